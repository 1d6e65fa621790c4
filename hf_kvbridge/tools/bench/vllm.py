"""Time to first token and throughput in vLLM, with and without the bridge; with a KV store, the warm path per
store chunk size and the source engine's cost of exporting.

```bash
# CPU, pocket-s → pocket-l (calibrated here, 64 × 512 tokens), bfloat16, prompts of 512 / 1,024 / 2,000 tokens
HF_HUB_OFFLINE=1 kvbridge bench vllm --lengths 512,1024,2000 --json vllm-bench.json
# the warm path at three chunk sizes, and the source engine with export on and off
HF_HUB_OFFLINE=1 kvbridge bench vllm --store local --chunk-sizes 16,64,256 --source-throughput --json warm.json
# an existing bridge
kvbridge bench vllm --bridge DIR --lengths 1024 --json out.json
# GPU, Qwen3-shaped random weights (0.6B → 8B shapes, vocabulary of the pocket tokenizer), needs a CUDA vLLM
kvbridge bench vllm --shapes qwen3-0.6b:qwen3-8b --lengths 1024,4096,16384 --json gpu.json
```

One engine serves the target with the connector; requests that do not opt in are the target alone, requests that
opt in are bridged, so both modes share every setting. With `--store` (a KV store URL, `local` to start a
redis-server here, or `local-cluster` for a 3-master cluster) the engine's connector also looks the prompts up in the
store: the `bridge` rows are misses (the cold path: the worker's source prefill), the `warm` rows are prompts whose
source KV were written to the store beforehand (`save_cache` of the source's own prefill, what a source engine
exports: whole chunks and the trailing partial one), mapped with no source forward pass, and the `warm_whole` rows are
prompts of which only the whole chunks were written (what the store held before partial chunks). Store rows carry
the time of each stage (lookup, fetch, map, write; from the connector's counters), the store keys written per prompt,
the store round trips per request (lookup and fetch) and the fetch bandwidth (bytes fetched / fetch time). Each chunk
size of `--chunk-sizes` is its own engine. Prefix caching is off (each timed request has a prompt of its own
anyway). Per length and mode:

- **TTFT**: one request at a time with `max_tokens=1`, wall time of `llm.generate` (median of `--repeats`);
- **throughput**: `--requests` requests of that length submitted together, `--max-tokens` each: requests/s,
  output tokens/s and prompt + output tokens/s.

`--source-throughput` adds the source engine (the bridge's source model): alone (no connector) and as a cascade's
source (`role="source"` on the store), with requests that do not opt in and with requests that do (their prompt and
reply K/V exported): throughput as above, and for the exported ones the chunks written and the write bandwidth
(bytes / time in the store's writes, on the writer thread).

Each engine runs in a process of its own (vLLM's connector is a per-process singleton), with its engine core in it
so that the connector's counters and the store's metrics can be read. Bridged rows also record how many requests
were mapped (`kv_transfer_params["kvbridge"]`) — a benchmark whose mappings fell back would time the target twice.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from hf_kvbridge.errors import BenchmarkError


def calibrated_pocket_bridge(
    out: Path, source: str, target: str, num_sequences: int, seq_len: int, top_k: int
) -> Path:
    """Calibrates `pocket/<source>` → `pocket/<target>` on the shipped calibration split and saves it to `out`."""
    from transformers import AutoTokenizer

    import hf_kvbridge
    from hf_kvbridge import pocket

    tokenizer = AutoTokenizer.from_pretrained(pocket.model_path(target))
    bridge = hf_kvbridge.calibrate(
        f"pocket/{source}",
        f"pocket/{target}",
        pocket.load_texts("calibration"),
        tokenizer=tokenizer,
        num_sequences=num_sequences,
        seq_len=seq_len,
        top_k=top_k,
    )
    bridge.save_pretrained(out)
    return out


def random_shapes_bridge(out: Path, shapes: str, top_k: int, max_positions: int) -> Path:
    """Random-weight models of public Qwen3 shapes (`"qwen3-0.6b:qwen3-8b"`) with the pocket tokenizer, saved in
    bfloat16 under `out`, and a random mapper between them (timings only: random weights time like real ones)."""
    import torch
    from transformers import AutoTokenizer

    from hf_kvbridge import pocket
    from hf_kvbridge.tools.bench.shapes import (
        QWEN3_SHAPES,
        SMALL_SHAPES,
        qwen3_shape_config,
        random_bridge,
        shape_pair,
    )
    from hf_kvbridge.utils.layout import KVLayout

    source_name, target_name = shape_pair(shapes, "--shapes", {**QWEN3_SHAPES, **SMALL_SHAPES})
    tokenizer = AutoTokenizer.from_pretrained(pocket.model_path("pocket-l"))
    configs = [
        qwen3_shape_config(n, vocab_size=len(tokenizer), max_positions=max_positions)
        for n in (source_name, target_name)
    ]
    bridge = random_bridge(*configs, top_k=top_k, dtype=torch.bfloat16)
    for name, model in ((source_name, bridge.source), (target_name, bridge.target)):
        model.save_pretrained(out / name)
        tokenizer.save_pretrained(out / name)
    bridge.config.source_name_or_path, bridge.config.target_name_or_path = (
        str(out / source_name),
        str(out / target_name),
    )
    bridge.config.source_fingerprint = KVLayout.from_config(configs[0]).fingerprint()
    bridge.config.target_fingerprint = KVLayout.from_config(configs[1]).fingerprint()
    bridge.save_pretrained(out / "bridge")
    return out / "bridge"


def prompt_pool(
    tokenizer, vocab_size: int, lengths: list[int], count: int, seed: int = 0
) -> dict[int, list[list[int]]]:
    """`count` distinct prompts per length, cut from the pocket family's held-out text (random ids past its end)."""
    import random

    from hf_kvbridge import pocket

    ids = tokenizer("\n".join(pocket.load_texts("heldout")))["input_ids"]
    rng = random.Random(seed)
    pool = {}
    for length in lengths:
        prompts = []
        for _ in range(count):
            if len(ids) > length:
                start = rng.randrange(0, len(ids) - length)
                prompts.append(ids[start : start + length])
            else:
                prompts.append([rng.randrange(2, vocab_size) for _ in range(length)])
        pool[length] = prompts
    return pool


STAGES = (
    "lookup_seconds",
    "fetch_seconds",
    "fetch_wait_seconds",
    "prefill_seconds",
    "map_seconds",
    "write_seconds",
    "load_seconds",
)


@dataclass(frozen=True)
class BenchEngines:
    """What every engine of the benchmark shares (`run_benchmark` makes one; each engine's process gets it as JSON):
    the bridge, the prompt lengths, the throughput batch and the engine settings."""

    bridge_dir: str
    lengths: list[int]
    requests: int  # per throughput batch (and the engine's max_num_seqs)
    max_tokens: int  # per request of a throughput batch
    dtype: str
    block_size: int | None
    kv_cache_gb: float
    max_model_len: int
    store: str | None = None  # the KV store's URL

    def workload(self) -> tuple[str, list[int], int, int, str | None]:
        """`(bridge_dir, lengths, requests, max_tokens, store)`: what each engine's run reads besides the settings."""
        return self.bridge_dir, self.lengths, self.requests, self.max_tokens, self.store

    def engine(self, model: str, kv_transfer_config):
        """A vLLM `LLM` of `model` in this process (engine core included), prefix caching off, and its settings."""
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the connector's counters and stores live in this process
        from vllm import LLM

        engine_args: dict[str, Any] = {
            "model": model,
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "enable_prefix_caching": False,
            "kv_cache_memory_bytes": int(self.kv_cache_gb * (1 << 30)),
            "max_num_seqs": max(self.requests, 1),
            "seed": 0,
        }
        if kv_transfer_config is not None:
            engine_args["kv_transfer_config"] = kv_transfer_config
        if self.block_size is not None:
            engine_args["block_size"] = self.block_size
        llm = LLM(**engine_args)
        return llm, {k: v for k, v in engine_args.items() if k != "kv_transfer_config"}


def _generate(llm, prompts, bridged: bool | None, tokens: int):
    """`(seconds, outputs, statuses)` of one `llm.generate` of token-id `prompts` (`bridged=None`: no flag)."""
    from vllm import SamplingParams

    from hf_kvbridge.integrations import vllm as kvb

    extra = None if bridged is None else kvb.bridged(bridged)
    params = SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0, extra_args=extra)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    statuses = [((o.kv_transfer_params or {}).get(kvb.PARAM_KEY) or {}) for o in outputs]
    return seconds, outputs, statuses


def _throughput(seconds: float, outputs, requests: int, length: int) -> dict[str, float]:
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "batch_seconds": seconds,
        "requests_per_s": requests / seconds,
        "output_tokens_per_s": out_tokens / seconds,
        "total_tokens_per_s": (out_tokens + requests * length) / seconds,
    }


def run(
    bench: BenchEngines,
    *,
    repeats: int,
    chunk_size: int | None = None,
    fetch_parts: int | None = None,
    log=print,
) -> dict[str, Any]:
    """The target engine's rows: `target` and `bridge` per length, and with a store `warm` and `warm_whole`."""
    from transformers import AutoTokenizer
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from hf_kvbridge.integrations import vllm as kvb
    from hf_kvbridge.integrations.kv_store import DEFAULT_CHUNK_SIZE

    bridge_dir, lengths, requests, max_tokens, store = bench.workload()
    target = kvb.target_model(bridge_dir)
    chunk_size = chunk_size or DEFAULT_CHUNK_SIZE
    store_options = {} if store is None else {"store": store, "chunk_size": chunk_size, "store_timeout_ms": 1000,
                                              "store_fetch_parts": fetch_parts}  # fmt: skip
    llm, engine = bench.engine(target, kvb.kv_transfer_config(bridge_dir, **store_options))
    tokenizer = AutoTokenizer.from_pretrained(target)
    count = repeats + requests + 2
    pools = {"target": prompt_pool(tokenizer, len(tokenizer), lengths, count)}
    pools["bridge"] = pools["target"]
    keys_per_prompt: dict[str, dict[int, float]] = {}
    if store is not None:  # other prompts of each length, their source KV in the store (as a source engine writes)
        for mode, seed, tail in (("warm", 1, True), ("warm_whole", 2, False)):
            pools[mode] = prompt_pool(tokenizer, len(tokenizer), lengths, count, seed=seed)
            keys_per_prompt[mode] = export_to_store(bridge_dir, store, chunk_size, pools[mode], bench.dtype, tail=tail)
    counters = kvb.KVBridgeConnector.counters  # filled in this process (the engine core runs in it)
    worker_store = get_kv_transfer_group().worker.store  # the worker's fetches (None without a store)

    for mode in pools:  # warm-up: every path, the shortest length
        _generate(llm, pools[mode][lengths[0]][-1:], mode != "target", 2)
    rows = []
    for length in lengths:
        for mode, pool in pools.items():
            bridged = mode != "target"
            prompts = pool[length]
            before = {k: counters.get(k, 0.0) for k in (*STAGES, "store_round_trips")}
            fetched = worker_store.metrics.as_dict() if worker_store is not None else {}
            ttft, statuses = [], []
            for i in range(repeats):
                seconds, _, status = _generate(llm, [prompts[i]], bridged, 1)
                ttft.append(seconds)
                statuses += status
            delta = {k: counters.get(k, 0.0) - before[k] for k in before}
            row: dict[str, Any] = {
                "length": length,
                "mode": mode,
                "ttft_ms": 1000 * statistics.median(ttft),
                "ttft_ms_all": [1000 * t for t in ttft],
                "requests": requests,
                "max_tokens": max_tokens,
            }
            if bridged:
                row["stages_ms"] = {k.replace("_seconds", "_ms"): 1000 * delta[k] / repeats for k in STAGES}
                row["mapped_tokens"] = statistics.mean(s.get("mapped_tokens", 0) for s in statuses)
            if store is not None and bridged:
                now = worker_store.metrics.as_dict()
                read, spent = (
                    now["bytes_read"] - fetched["bytes_read"],
                    now["fetch_seconds"] - fetched["fetch_seconds"],
                )
                row.update(
                    chunk_size=chunk_size,
                    fetch_parts=fetch_parts,
                    store_tokens=statistics.mean(s.get("store_tokens", 0) for s in statuses),
                    keys_per_prompt=keys_per_prompt.get(mode, {}).get(length, 0.0),
                    round_trips_per_request=(delta["store_round_trips"] + now["round_trips"] - fetched["round_trips"])
                    / repeats,
                    fetch_bytes_per_request=read / repeats,
                    fetch_gbps=read / spent / 1e9 if spent > 0 else None,
                )
            seconds, outputs, status = _generate(llm, prompts[repeats : repeats + requests], bridged, max_tokens)
            row.update(_throughput(seconds, outputs, requests, length))
            row["mapped_requests"] = sum(s.get("status") == "mapped" for s in statuses + status) if bridged else 0
            rows.append(row)
            extra = ""
            if "mapped_tokens" in row:
                extra = f"   mapped {row['mapped_tokens']:7.1f} tokens ({row['mapped_requests']} requests)"
            if row.get("keys_per_prompt") is not None and "round_trips_per_request" in row:
                extra += f"   {row['keys_per_prompt']:.1f} keys/prompt, {row['round_trips_per_request']:.1f} trips"
            log(
                f"{length:>6} tokens  {mode:<10}  TTFT {row['ttft_ms']:9.1f} ms   {row['requests_per_s']:7.2f} req/s"
                f"   {row['output_tokens_per_s']:8.1f} out tok/s{extra}"
            )
    for length in lengths:
        by_mode = {r["mode"]: r for r in rows if r["length"] == length}
        for mode, row in by_mode.items():
            if mode != "target":
                row["ttft_speedup"] = by_mode["target"]["ttft_ms"] / row["ttft_ms"]
                row["throughput_ratio"] = row["requests_per_s"] / by_mode["target"]["requests_per_s"]
        if "warm" in by_mode:
            by_mode["warm"]["ttft_speedup_over_cold"] = by_mode["bridge"]["ttft_ms"] / by_mode["warm"]["ttft_ms"]
            log(f"{length:>6} tokens  warm TTFT {by_mode['warm']['ttft_speedup_over_cold']:.2f}x better than cold")
    engine["in_process"] = True
    return {"rows": rows, "engine": engine, "chunk_size": chunk_size if store else None}


def run_source(
    bench: BenchEngines,
    *,
    chunk_size: int | None = None,
    rounds: int = 1,
    store_pids: list[int] | None = None,
    log=print,
) -> dict[str, Any]:
    """The source engine's throughput in `rounds` rounds (`source_export.source_rounds`): without a connector
    (`bench.store=None`: mode `no_connector`), or as a cascade's source on `store` with requests that do not opt in
    (`not_opted_in`) and that do (`opted_in`: exported), interleaved in each round. An opted-in row carries what its
    export wrote (chunks, bytes, the store's time in writes: the write bandwidth), how long the writer took to drain
    after the batch, and the export's CPU time (the writer threads' and the engine step's gather); with `store_pids`
    (a store server this benchmark started) that server's CPU time too."""
    from transformers import AutoTokenizer
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from hf_kvbridge.integrations import vllm as kvb

    from .source_export import ExportStepTimer, source_rounds

    bridge_dir, lengths, requests, max_tokens, store = bench.workload()
    model = kvb.served_model(bridge_dir, "source")
    config = None
    if store is not None:
        config = kvb.kv_transfer_config(bridge_dir, role="source", store=store, chunk_size=chunk_size,
                                        store_timeout_ms=1000)  # fmt: skip
    llm, engine = bench.engine(model, config)
    tokenizer = AutoTokenizer.from_pretrained(model)
    modes = {"no_connector": None} if store is None else {"not_opted_in": False, "opted_in": True}
    worker = None if store is None else get_kv_transfer_group().worker
    exports = None if worker is None else worker.exports
    timer = None if worker is None else ExportStepTimer(worker)
    names = list(modes)

    def pools(index: int, mode: str) -> dict[int, list[list[int]]]:  # fresh prompts per round and mode: no store hits
        return prompt_pool(tokenizer, len(tokenizer), lengths, requests, seed=1000 * (index + 1) + names.index(mode))

    def generate(prompts, flag):
        seconds, outputs, _ = _generate(llm, prompts, flag, max_tokens)
        return seconds, {"requests": requests, "max_tokens": max_tokens,
                         **_throughput(seconds, outputs, requests, len(prompts[0]))}  # fmt: skip

    for flag in modes.values():  # warm-up
        _generate(llm, prompt_pool(tokenizer, len(tokenizer), lengths[:1], 1, seed=7)[lengths[0]], flag, 2)
    if exports is not None:
        exports.writer.flush(timeout=300)
    rows = source_rounds(generate, pools, lengths, modes, rounds, exports=exports, timer=timer,
                         store_pids=store_pids, log=log)  # fmt: skip
    return {"rows": rows, "engine": engine}


def export_to_store(
    bridge_dir: str, store: str, chunk_size: int, pool: dict[int, list[list[int]]], dtype: str, *, tail: bool = True
) -> dict[int, float]:
    """Writes the source's own KV of the prompts of `pool` (length → prompts) to the store, keyed as a source engine's
    connector keys them (`tail=False`: whole chunks only); returns the store keys written per prompt, per length."""
    import torch

    from hf_kvbridge.integrations.kv_store import PrefixKVStore, open_store, save_cache
    from hf_kvbridge.integrations.vllm import read_bridge_config, store_identity
    from hf_kvbridge.loading import load_model

    _, config, _ = read_bridge_config(bridge_dir)
    source = load_model(config.source_name_or_path, config.source_revision, dtype=getattr(torch, dtype))
    model_id = store_identity(config, "source")
    keys = {}
    with open_store(store, timeout=5.0) as opened:
        prefix = PrefixKVStore(opened, model_id=model_id, chunk_size=chunk_size)
        with torch.inference_mode():
            for length, prompts in pool.items():
                before = opened.stats(model_id)["keys"]
                for ids in prompts:
                    cache = source(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1).past_key_values
                    save_cache(prefix, ids, cache, tail=tail)
                keys[length] = (opened.stats(model_id)["keys"] - before) / len(prompts)
    return keys


def _child(spec_path: str, out_path: str) -> None:
    """One engine of the benchmark, in this process: `spec["kind"]` is `"target"` (`run`) or `"source"`
    (`run_source`), `spec["engines"]` the `BenchEngines` fields, the rest its keywords."""
    spec = json.loads(Path(spec_path).read_text())
    kind, bench = spec.pop("kind"), BenchEngines(**spec.pop("engines"))
    result = (run if kind == "target" else run_source)(bench, **spec, log=lambda line: print(line, flush=True))
    Path(out_path).write_text(json.dumps(result))


def _server_pids(server) -> list[int] | None:
    """The processes of a store this benchmark started (a `LocalServer`, or each master of a `LocalCluster`)."""
    if server is None:
        return None
    return [master.pid for master in getattr(server, "masters", [server])]


def _spawn(spec: dict[str, Any], folder: Path, name: str) -> dict[str, Any]:
    """Runs one engine (`_child`) in a new process and returns its result."""
    spec_path, out_path = folder / f"{name}.json", folder / f"{name}-out.json"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, "-m", "hf_kvbridge.tools.bench.vllm", str(spec_path), str(out_path)])
    if proc.returncode != 0:
        raise BenchmarkError(
            f"the benchmark's {name} engine failed (exit status {proc.returncode}); see its output above"
        )
    return json.loads(out_path.read_text())


def run_benchmark(
    *,
    lengths: list[int],
    bridge: str | None = None,
    shapes: str | None = None,
    pair: str = "pocket-s:pocket-l",
    num_sequences: int = 64,
    seq_len: int = 512,
    top_k: int = 6,
    repeats: int = 5,
    requests: int = 8,
    max_tokens: int = 32,
    dtype: str = "bfloat16",
    block_size: int | None = None,
    kv_cache_gb: float = 1.0,
    max_model_len: int | None = None,
    store: str | None = None,
    chunk_sizes: list[int] | None = None,
    fetch_parts: list[int] | None = None,
    source_throughput: bool = False,
    source_rounds: int | None = None,
) -> dict[str, Any]:
    """The whole benchmark (what `kvbridge bench vllm` runs): the bridge (`bridge`, or random `shapes`, or the pocket
    `pair` calibrated here), a local store if `store` is `"local"` / `"local-cluster"`, one target engine per chunk
    size (and per number of fetch runs, `fetch_parts`), and with `source_throughput` the source engine alone and
    exporting, in `source_rounds` interleaved rounds (default: `repeats`); each engine in a process of its own.
    Returns the rows, the engines' settings and the machine."""
    from hf_kvbridge.errors import InvalidInputError

    chunk_sizes = list(chunk_sizes or [None])
    source_rounds = source_rounds or repeats
    if source_throughput and store is None:
        raise InvalidInputError("--source-throughput measures exports to a KV store: give --store (e.g. local)")
    with tempfile.TemporaryDirectory(prefix="kvbridge-vllm-bench-") as tmp:
        if bridge:
            bridge_dir, what = bridge, bridge
        elif shapes:
            bridge_dir = str(random_shapes_bridge(Path(tmp), shapes, top_k, max(40960, max(lengths) + 64)))
            what = f"random weights, shapes {shapes}"
        else:
            source, target = pair.split(":")
            bridge_dir = str(calibrated_pocket_bridge(Path(tmp) / "bridge", source, target, num_sequences, seq_len,
                                                      top_k))  # fmt: skip
            what = f"{pair}, calibrated on {num_sequences} x {seq_len} tokens, top-k {top_k}"
        max_model_len = max_model_len or max(lengths) + max(max_tokens, 1) + 8
        import torch

        on_cpu = not torch.cuda.is_available()
        block_size = block_size or (32 if on_cpu else None)
        server = None
        if store in ("local", "local-cluster"):
            from hf_kvbridge.integrations.kv_store import start_local_cluster, start_local_server

            server = (
                start_local_server(maxmemory="8gb") if store == "local" else start_local_cluster(3, maxmemory="3gb")
            )
            store = server.url
        common = BenchEngines(bridge_dir, lengths, requests, max_tokens, dtype, block_size, kv_cache_gb, max_model_len,
                              store)  # fmt: skip
        try:
            runs = []
            for chunk_size in chunk_sizes if store else [None]:
                for parts in fetch_parts or [None]:
                    spec = {"kind": "target", "engines": asdict(common), "repeats": repeats, "chunk_size": chunk_size,
                            "fetch_parts": parts}  # fmt: skip
                    runs.append(_spawn(spec, Path(tmp), f"target-chunk-{chunk_size or 'default'}-parts-{parts}"))
            result: dict[str, Any] = {"rows": [row for r in runs for row in r["rows"]], "engine": runs[0]["engine"]}
            if len(runs) > 1:
                result["runs"] = runs
            if source_throughput:
                from .source_export import format_summary, summarize

                result["source_rows"] = []
                for name, url in (("source-alone", None), ("source-exporting", store)):
                    engines = asdict(replace(common, store=url))
                    spec = {"kind": "source", "engines": engines, "chunk_size": None,  # the default chunk size
                            "rounds": source_rounds, "store_pids": _server_pids(server)}  # fmt: skip
                    result["source_rows"] += _spawn(spec, Path(tmp), name)["rows"]
                alone = [row for row in result["source_rows"] if row["mode"] == "no_connector"]
                result["source_summary"] = summarize([r for r in result["source_rows"] if r not in alone], alone)
                print(format_summary(result["source_summary"]), flush=True)
        finally:
            if server is not None:
                server.stop()
    import vllm

    result.update(
        bridge=what,
        machine={"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
                 "vllm": vllm.__version__, "device": torch.cuda.get_device_name() if not on_cpu else "cpu",
                 "load_average": os.getloadavg()},
    )  # fmt: skip
    return result


if __name__ == "__main__":  # one engine of the benchmark (see _spawn)
    _child(*sys.argv[1:3])
