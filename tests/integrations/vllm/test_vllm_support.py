"""What the vLLM connector serves right, as pure functions (no engine): the engine options refused at start-up
(`support.engine_refusal` over `EngineShape`, also read from vLLM's own config classes where vLLM is installed) and the
requests served unbridged with status `"unsupported"` (`support.request_refusal`, and the scheduler's status for them
on real vLLM `Request`s). The engine test (a refused option stops `LLM(...)` with its line) is in test_vllm.py."""

from __future__ import annotations

import os
import re
from dataclasses import replace
from types import SimpleNamespace

import pytest

from hf_kvbridge.errors import ServingConfigError
from hf_kvbridge.integrations.vllm.support import EngineShape, check_engine, engine_refusal, request_refusal
from hf_kvbridge.integrations.vllm.tensor_parallel import HeadShard

REFUSED = [
    ({"pipeline_parallel_size": 2}, "pipeline_parallel_size=2"),
    ({"data_parallel_size": 2}, "data_parallel_size=2"),
    ({"prefill_context_parallel_size": 2}, "prefill_context_parallel_size=2"),
    ({"decode_context_parallel_size": 2}, "decode_context_parallel_size=2"),
    ({"cache_dtype": "fp8", "device_type": "cuda"}, "cache_dtype=fp8 on cuda"),
    ({"cache_dtype": "fp8_e5m2", "device_type": "cuda"}, "cache_dtype=fp8_e5m2 on cuda"),
    ({"cache_dtype": "fp8_inc"}, "cache_dtype=fp8_inc"),
    ({"cache_dtype": "turboquant_k8v4"}, "cache_dtype=turboquant_k8v4"),
    ({"speculative": "ngram"}, "speculative decoding (ngram)"),
    ({"speculative": "eagle"}, "speculative decoding (eagle)"),
    ({"multimodal": True}, "multi-modal model"),
    ({"use_mla": True}, "latent attention"),
    ({"hybrid": True}, "hybrid"),
    ({"sliding_window": 4096}, "sliding_window=4096"),
    ({"kv_cache_groups": 2}, "2 KV cache groups"),
]


@pytest.mark.parametrize(("options", "named"), REFUSED, ids=[name for _, name in REFUSED])
def test_engine_options_refused_with_one_line_naming_them(options, named):
    reason = engine_refusal(EngineShape(**options))
    assert reason is not None and named in reason.split(":")[0] and "\n" not in reason
    with pytest.raises(ServingConfigError, match="my-bridge") as error:
        check_engine(EngineShape(**options), "my-bridge")
    assert named in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("cache_dtype", ["auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2"])
def test_served_shapes(cache_dtype):
    assert engine_refusal(EngineShape(cache_dtype=cache_dtype)) is None  # fp8: on the CPU backend
    assert engine_refusal(EngineShape(cache_dtype=cache_dtype), exports=True) is None  # exported dequantized
    check_engine(EngineShape(cache_dtype=cache_dtype), "my-bridge")


@pytest.mark.parametrize("size", [2, 4, 8])
def test_tensor_parallel_served_on_mapping_and_exporting_engines(size):
    """A target's ranks write their own KV heads (`HeadShard`); an exporting engine's ranks read theirs, gathered to
    rank 0 (`export.export_sharded`). What else such an engine is refused for still is."""
    for exports in (False, True):
        assert engine_refusal(EngineShape(tensor_parallel_size=size), exports=exports) is None
        check_engine(EngineShape(tensor_parallel_size=size), "b", exports=exports)
    reason = engine_refusal(EngineShape(tensor_parallel_size=size, pipeline_parallel_size=2), exports=True)
    assert reason.startswith("pipeline_parallel_size=2")


def test_several_refused_options_name_the_first():
    reason = engine_refusal(EngineShape(tensor_parallel_size=2, cache_dtype="int8", pipeline_parallel_size=2))
    assert reason.startswith("pipeline_parallel_size=2")


@pytest.mark.parametrize(
    ("total", "size", "per_rank"),
    [
        (8, 1, [(0, 8)]),
        (8, 2, [(0, 4), (4, 8)]),
        (8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)]),
        (2, 2, [(0, 1), (1, 2)]),
        (1, 2, [(0, 1), (0, 1)]),  # fewer heads than ranks: replicated
        (2, 4, [(0, 1), (0, 1), (1, 2), (1, 2)]),  # each head on two consecutive ranks, as QKVParallelLinear
    ],
)
def test_head_shard_is_vllms(total, size, per_rank):
    got = [HeadShard.of(total, rank, size).heads for rank in range(size)]
    assert [(s.start, s.stop) for s in got] == per_rank


def test_head_shard_refuses_uneven_heads():
    with pytest.raises(ServingConfigError, match="3 KV heads and tensor_parallel_size is 2"):
        HeadShard.of(3, 0, 2)
    with pytest.raises(ServingConfigError, match="rank 2 of 2"):
        HeadShard.of(2, 2, 2)


def request(**fields):
    base = {"lora_request": None, "prompt_token_ids": [1, 2, 3], "prompt_embeds": None, "prompt_is_token_ids": None}
    return SimpleNamespace(**{**base, **fields})


def test_request_refusals():
    assert request_refusal(request()) is None
    assert request_refusal(request(mm_features=[])) is None
    assert "LoRA adapter 'sql'" in request_refusal(request(lora_request=SimpleNamespace(lora_name="sql")))
    assert "prompt embeddings" in request_refusal(request(prompt_token_ids=None))
    assert "prompt embeddings" in request_refusal(request(prompt_is_token_ids=[True, False, True]))
    assert "multi-modal" in request_refusal(request(mm_features=[object()]))


# -- with vLLM's own classes ------------------------------------------------------------------------------------------
def test_shape_read_from_vllm_config():
    pytest.importorskip("vllm")
    from vllm.config import CacheConfig, ParallelConfig

    model = SimpleNamespace(
        is_hybrid=False, is_attention_free=False, is_encoder_decoder=False, is_multimodal_model=False,
        get_sliding_window=lambda: None, use_mla=False,
    )  # fmt: skip
    config = SimpleNamespace(
        parallel_config=ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=3),
        cache_config=CacheConfig(cache_dtype="fp8_e5m2"),
        model_config=model,
        speculative_config=None,
        device_config=SimpleNamespace(device_type="cuda"),
    )
    shape = EngineShape.from_vllm_config(config, SimpleNamespace(kv_cache_groups=[0, 1]))
    assert shape.device_type == "cuda"
    alone = replace(shape, tensor_parallel_size=1, pipeline_parallel_size=1, kv_cache_groups=1)
    assert engine_refusal(alone).startswith("cache_dtype=fp8_e5m2 on cuda")
    assert (shape.tensor_parallel_size, shape.pipeline_parallel_size, shape.cache_dtype) == (2, 3, "fp8_e5m2")
    assert shape.kv_cache_groups == 2 and shape.speculative is None and not shape.hybrid


def test_vllm_requests_with_lora_or_embeds_are_unsupported_not_mapped():
    """The scheduler's status of a bridged request with a LoRA adapter or prompt embeddings, on real vLLM `Request`s:
    `unsupported` with its reason, never claimed (no tokens offered), never exported, counted."""
    pytest.importorskip("vllm")
    import torch
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.v1.request import Request

    from hf_kvbridge import KVBridgeConfig
    from hf_kvbridge.integrations.vllm import BridgeScheduler, bridged

    counts = {}

    def count(**amounts):
        for key, value in amounts.items():
            counts[key] = counts.get(key, 0) + value

    scheduler = BridgeScheduler(KVBridgeConfig(), hold_back=1, requests_mode="opt_in", salt_tag="t", count=count)
    params = SamplingParams(max_tokens=4, extra_args=bridged())
    kinds = {
        "lora": Request("lora", list(range(100)), params, None, lora_request=LoRARequest("sql", 1, "/nowhere")),
        "embeds": Request("embeds", None, params, None, prompt_embeds=torch.zeros(100, 8)),
        "plain": Request("plain", list(range(100)), params, None),
    }
    for req in kinds.values():
        req.kv_transfer_params = params.extra_args["kv_transfer_params"]
        scheduler.on_new_request(req)
    assert scheduler.get_num_new_matched_tokens(kinds["lora"], 0) == (0, False)
    assert scheduler.get_num_new_matched_tokens(kinds["embeds"], 0) == (0, False)
    assert scheduler.get_num_new_matched_tokens(kinds["plain"], 0)[0] > 0  # the oracle: a plain one is claimed
    statuses = {name: scheduler.request_finished(kinds[name], [])[1]["kvbridge"] for name in ("lora", "embeds")}
    assert {status["status"] for status in statuses.values()} == {"unsupported"}
    assert "LoRA adapter 'sql'" in statuses["lora"]["reason"] and "embeddings" in statuses["embeds"]["reason"]
    assert counts["requests_unsupported"] == 2

    # a source engine (exports only) does not export them: the adapter's K/V are not the base model's
    exporter = BridgeScheduler(
        KVBridgeConfig(), hold_back=1, requests_mode="all", salt_tag="t", count=count, imports=False,
        exports=SimpleNamespace(chunk_size=16),
    )  # fmt: skip
    for req in kinds.values():
        exporter.on_new_request(req)
    assert set(exporter._exporting) == {"plain"}
    assert exporter.request_finished(kinds["lora"], [])[1]["kvbridge"]["status"] == "unsupported"


# -- identity: the served model is the bridge's ---------------------------------------------------------------------
def _copy_model(source, folder):
    import shutil

    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(source / name, folder / name)
    return folder


def test_identity_accepts_a_copy_and_refuses_another_config_or_tokenizer(tmp_path):
    import json

    from hf_kvbridge import KVBridgeConfig, pocket
    from hf_kvbridge.integrations.vllm.identity import check_identity

    config = KVBridgeConfig(source_name_or_path="pocket/pocket-s", target_name_or_path="pocket/pocket-l")
    original = pocket.model_path("pocket-l")

    def served(folder):
        return SimpleNamespace(model=str(folder), revision=None, tokenizer=str(folder), tokenizer_revision=None)

    check_identity(served(original), config, "target", "b")  # the bridge's own target
    copy = _copy_model(original, tmp_path / "copy")  # re-saved by another transformers: still the same model
    fields = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**fields, "transformers_version": "9.9.9"}, indent=1))
    check_identity(served(copy), config, "target", "b")

    other = _copy_model(original, tmp_path / "other-tokenizer")  # the same shape, another tokenizer
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    tokenizer["added_tokens"] = [*tokenizer.get("added_tokens", []), {**tokenizer["added_tokens"][0], "id": 4095}]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    refused = r"not the bridge b's target pocket/pocket-l \(they differ in {}\)"
    with pytest.raises(ServingConfigError, match=refused.format("tokenizer.json")) as e:
        check_identity(served(other), config, "target", "b")
    assert "\n" not in str(e.value)
    with pytest.raises(ServingConfigError, match="pocket-m, " + refused.format("config.json")):
        check_identity(served(pocket.model_path("pocket-m")), config, "target", "b")  # another model
    check_identity(served(pocket.model_path("pocket-s")), config, "source", "b")  # a source engine: the source


def test_unsupported_status_reaches_the_router_header():
    """`kvbridge serve` answers a request the connector served unbridged (LoRA, prompt embeds) with
    `x-vsr-kv-transfer-status: unsupported`, never `applied`."""
    pytest.importorskip("vllm")
    from hf_kvbridge.integrations.vllm.middleware import transfer_status_header

    assert transfer_status_header("unsupported") == "unsupported"
    assert transfer_status_header("mapped") == "applied"


@pytest.mark.parametrize(
    "vllm_args, named",
    [
        (["--role", "source", "-tp", "2", "-pp", "2"], "pipeline_parallel_size=2"),
        (["--role", "both", "--serves", "source", "--tensor_parallel_size=2", "--kv_cache_dtype=fp8_inc"], "=fp8_inc"),
        (["--pipeline-parallel-size", "2"], "pipeline_parallel_size=2"),
        (["--kv-cache-dtype", "int8", "--max-model-len", "512"], "cache_dtype=int8"),
        (["-sc", '{"method": "ngram", "num_speculative_tokens": 3}'], "speculative decoding (ngram)"),
        (["-dp", "2"], "data_parallel_size=2"),
    ],
)
def test_kvbridge_serve_refuses_engine_options_before_starting_vllm(vllm_args, named, capsys):
    """`kvbridge serve` reads the engine options of its command line (vLLM's names, short forms and underscore
    spellings) and refuses one it cannot serve before vLLM starts (and before the bridge is read): the CLI's one
    line, where each rank's worker would otherwise fail with its traceback."""
    from hf_kvbridge.integrations.vllm.serve import serve_main

    with pytest.raises(ServingConfigError, match=re.escape(named)):
        serve_main(["no-such-bridge", *vllm_args, "--print"])
    assert capsys.readouterr().out == ""  # nothing printed, nothing started


def test_kvbridge_serve_passes_a_target_at_tensor_parallel_2():
    from hf_kvbridge.integrations.vllm.serve import command_line_shape

    shape = command_line_shape(["--tensor-parallel-size", "2", "--kv-cache-dtype=bfloat16", "--port", "8000"])
    assert (shape.tensor_parallel_size, shape.cache_dtype) == (2, "bfloat16")
    assert engine_refusal(shape) is None and engine_refusal(shape, exports=True) is None  # a TP source is served too
    assert command_line_shape(["--role", "source", "--tensor_parallel_size=2"]).tensor_parallel_size == 2
    assert command_line_shape(["--kv-cache-dtype-skip-layers", "0"]).cache_dtype == "auto"


def test_kvbridge_serve_command_line_refusal_is_one_line(tmp_path):
    """Through the command line: one line naming the option, status 1, no traceback."""
    pytest.importorskip("vllm")
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "kvbridge_cli", "serve", str(tmp_path), "--role", "source", "-tp", "2", "-pp", "2"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "pipeline_parallel_size=2" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_source_memory_left_room_for():
    """vLLM sizes its KV cache before the connector loads the source: the operator's arithmetic, and the start-up
    line that says so (what to set on a GPU, what the host must hold on CPU)."""
    from hf_kvbridge.integrations.vllm.support import source_memory_note, utilization_with_source

    assert utilization_with_source(0.9, 20, 100) == pytest.approx(0.7)
    with pytest.raises(ServingConfigError, match="store-only target"):
        utilization_with_source(0.5, 60, 100)
    gpu = SimpleNamespace(gpu_memory_utilization=0.85, kv_cache_memory_bytes=None)
    cuda = source_memory_note(3 * 2**30, gpu, "cuda")
    assert "(3.00 GiB)" in cuda and "gpu_memory_utilization=0.85" in cuda and "\n" not in cuda
    assert "kv_cache_memory_bytes=1024" in source_memory_note(1, SimpleNamespace(kv_cache_memory_bytes=1024), "cuda")
    assert "VLLM_CPU_KVCACHE_SPACE" in source_memory_note(2**30, SimpleNamespace())
