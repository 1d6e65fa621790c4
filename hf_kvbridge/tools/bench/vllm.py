"""Time to first token and throughput in vLLM, with and without the bridge.

```bash
# CPU, pocket-s → pocket-l (calibrated here, 64 × 512 tokens), bfloat16, prompts of 512 / 1,024 / 2,000 tokens
HF_HUB_OFFLINE=1 kvbridge bench vllm --lengths 512,1024,2000 --json vllm-bench.json
# an existing bridge
kvbridge bench vllm --bridge DIR --lengths 1024 --json out.json
# GPU, Qwen3-shaped random weights (0.6B → 8B shapes, vocabulary of the pocket tokenizer), needs a CUDA vLLM
kvbridge bench vllm --shapes qwen3-0.6b:qwen3-8b --lengths 1024,4096,16384 --json gpu.json
```

One engine serves the target with the connector; requests that do not opt in are the target alone, requests that
opt in are bridged, so both modes share every setting. With `--store` (a KV store URL, or `local` to start a
redis-server here) the engine's connector also looks the prompts up in the store: the `bridge` rows are misses
(the cold path: the worker's source prefill), the `warm` rows are prompts whose source KV were written to the store
beforehand (`save_cache` of the source's own prefill, what a source engine exports), mapped with no source forward
pass; their rows carry the time of each stage (lookup, fetch, map, write; from the connector's counters). Prefix
caching is off (each timed request has a prompt of its own anyway). Per length and mode:

- **TTFT**: one request at a time with `max_tokens=1`, wall time of `llm.generate` (median of `--repeats`);
- **throughput**: `--requests` requests of that length submitted together, `--max-tokens` each: requests/s,
  output tokens/s and prompt + output tokens/s.

Bridged rows also record how many requests were mapped (`kv_transfer_params["kvbridge"]`) — a benchmark whose
mappings fell back would time the target twice.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


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
    from hf_kvbridge.layout import KVLayout
    from hf_kvbridge.tools.bench.shapes import (
        QWEN3_SHAPES,
        SMALL_SHAPES,
        qwen3_shape_config,
        random_bridge,
        shape_pair,
    )

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


def run(
    bridge_dir: str,
    lengths: list[int],
    *,
    repeats: int,
    requests: int,
    max_tokens: int,
    dtype: str,
    block_size: int | None,
    kv_cache_gb: float,
    max_model_len: int,
    store: str | None = None,
    log=print,
) -> dict[str, Any]:
    import os

    if store is not None:  # the stage times are the connector's counters: engine core and worker in this process
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from hf_kvbridge.integrations import vllm as kvb

    target = kvb.target_model(bridge_dir)
    chunk_size = 256
    store_options = {} if store is None else {"store": store, "chunk_size": chunk_size}
    engine_args: dict[str, Any] = {
        "model": target,
        "kv_transfer_config": kvb.kv_transfer_config(bridge_dir, **store_options),
        "dtype": dtype,
        "max_model_len": max_model_len,
        "enable_prefix_caching": False,
        "kv_cache_memory_bytes": int(kv_cache_gb * (1 << 30)),
        "max_num_seqs": max(requests, 1),
        "seed": 0,
    }
    if block_size is not None:
        engine_args["block_size"] = block_size
    llm = LLM(**engine_args)
    tokenizer = AutoTokenizer.from_pretrained(target)
    pool = prompt_pool(tokenizer, len(tokenizer), lengths, repeats + requests + 2)
    warm_pool = {}
    if store is not None:  # other prompts of each length, their source KV in the store (as a source engine writes)
        warm_pool = prompt_pool(tokenizer, len(tokenizer), lengths, repeats + requests + 2, seed=1)
        export_to_store(bridge_dir, store, chunk_size, [p for prompts in warm_pool.values() for p in prompts], dtype)
    counters = kvb.KVBridgeConnector.counters  # filled in this process only when the engine runs in it (store)

    def generate(prompts, bridged: bool, tokens: int):
        params = SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0, extra_args=kvb.bridged(bridged))
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        mapped = sum(
            ((o.kv_transfer_params or {}).get(kvb.PARAM_KEY) or {}).get("status") == "mapped" for o in outputs
        )
        return seconds, outputs, mapped

    for bridged in (False, True):  # warm-up: both paths, the shortest length
        generate(pool[lengths[0]][-1:], bridged, 2)
    if warm_pool:
        generate(warm_pool[lengths[0]][-1:], True, 2)
    stages = ("lookup_seconds", "fetch_seconds", "prefill_seconds", "map_seconds", "write_seconds")
    rows = []
    modes = ("target", "bridge", "warm") if warm_pool else ("target", "bridge")
    for length in lengths:
        for mode in modes:
            bridged = mode != "target"
            prompts = (warm_pool if mode == "warm" else pool)[length]
            ttft, mapped = [], 0
            before = {k: counters.get(k, 0.0) for k in stages}
            for i in range(repeats):
                seconds, _, m = generate([prompts[i]], bridged, 1)
                ttft.append(seconds)
                mapped += m
            stage_ms = {
                k.replace("_seconds", "_ms"): 1000 * (counters.get(k, 0.0) - before[k]) / repeats for k in stages
            }
            seconds, outputs, m = generate(prompts[repeats : repeats + requests], bridged, max_tokens)
            out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            row = {
                "length": length,
                "mode": mode,
                "ttft_ms": 1000 * statistics.median(ttft),
                "ttft_ms_all": [1000 * t for t in ttft],
                "requests": requests,
                "max_tokens": max_tokens,
                "batch_seconds": seconds,
                "requests_per_s": requests / seconds,
                "output_tokens_per_s": out_tokens / seconds,
                "total_tokens_per_s": (out_tokens + requests * length) / seconds,
                "mapped_requests": mapped + m if bridged else 0,
                **({"stages_ms": stage_ms} if bridged else {}),
            }
            rows.append(row)
            log(
                f"{length:>6} tokens  {mode:<6}  TTFT {row['ttft_ms']:9.1f} ms   {row['requests_per_s']:7.2f} req/s   "
                f"{row['output_tokens_per_s']:8.1f} out tok/s   mapped {row['mapped_requests']}"
            )
    for length in lengths:
        t = next(r for r in rows if r["length"] == length and r["mode"] == "target")
        for b in (r for r in rows if r["length"] == length and r["mode"] != "target"):
            b["ttft_speedup"] = t["ttft_ms"] / b["ttft_ms"]
            b["throughput_ratio"] = b["requests_per_s"] / t["requests_per_s"]
        if warm_pool:
            cold, warm = (
                next(r for r in rows if r["length"] == length and r["mode"] == m) for m in ("bridge", "warm")
            )
            warm["ttft_speedup_over_cold"] = cold["ttft_ms"] / warm["ttft_ms"]
            log(f"{length:>6} tokens  warm TTFT {warm['ttft_speedup_over_cold']:.2f}x better than cold")
    engine = {k: v for k, v in engine_args.items() if k != "kv_transfer_config"}
    engine["in_process"] = store is not None
    return {"rows": rows, "engine": engine}


def export_to_store(bridge_dir: str, store: str, chunk_size: int, prompts: list[list[int]], dtype: str) -> None:
    """Writes the source's own KV of `prompts` to the store, keyed as a source engine's connector keys them."""
    import torch

    from hf_kvbridge.integrations.kv_store import PrefixKVStore, open_store, save_cache
    from hf_kvbridge.integrations.vllm import read_bridge_config, store_identity
    from hf_kvbridge.loading import load_model

    _, config, _ = read_bridge_config(bridge_dir)
    source = load_model(config.source_name_or_path, config.source_revision, dtype=getattr(torch, dtype))
    prefix = PrefixKVStore(open_store(store), model_id=store_identity(config, "source"), chunk_size=chunk_size)
    with torch.inference_mode():
        for ids in prompts:
            cache = source(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1).past_key_values
            save_cache(prefix, ids, cache)


def run_cli(args: argparse.Namespace) -> int:
    """`kvbridge bench vllm`: vLLM is imported here, when the benchmark runs."""
    lengths = list(args.lengths)
    with tempfile.TemporaryDirectory(prefix="kvbridge-vllm-bench-") as tmp:
        if args.bridge:
            bridge_dir, what = args.bridge, args.bridge
        elif args.shapes:
            bridge_dir = str(random_shapes_bridge(Path(tmp), args.shapes, args.top_k, max(40960, max(lengths) + 64)))
            what = f"random weights, shapes {args.shapes}"
        else:
            source, target = args.pair.split(":")
            bridge_dir = str(
                calibrated_pocket_bridge(
                    Path(tmp) / "bridge", source, target, args.num_sequences, args.seq_len, args.top_k
                )
            )
            what = f"{args.pair}, calibrated on {args.num_sequences} x {args.seq_len} tokens, top-k {args.top_k}"
        max_model_len = args.max_model_len or max(lengths) + max(args.max_tokens, 1) + 8
        import torch

        on_cpu = not torch.cuda.is_available()
        block_size = args.block_size or (32 if on_cpu else None)
        server = None
        store = getattr(args, "store", None)
        if store == "local":
            from hf_kvbridge.integrations.kv_store import start_local_server

            server = start_local_server(maxmemory="8gb")
            store = server.url
        try:
            result = run(
                bridge_dir,
                lengths,
                repeats=args.repeats,
                requests=args.requests,
                max_tokens=args.max_tokens,
                dtype=args.dtype,
                block_size=block_size,
                kv_cache_gb=args.kv_cache_gb,
                max_model_len=max_model_len,
                store=store,
            )
        finally:
            if server is not None:
                server.stop()
    import vllm

    result.update(
        bridge=what,
        settings=vars(args),
        machine={"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
                 "vllm": vllm.__version__, "device": torch.cuda.get_device_name() if not on_cpu else "cpu"},
    )  # fmt: skip
    text = json.dumps(result, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    else:
        print(text)
    return 0
