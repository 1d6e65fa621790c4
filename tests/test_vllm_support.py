"""What the vLLM connector serves right, as pure functions (no engine): the engine options refused at start-up
(`support.engine_refusal` over `EngineShape`, also read from vLLM's own config classes where vLLM is installed) and the
requests served unbridged with status `"unsupported"` (`support.request_refusal`, and the scheduler's status for them
on real vLLM `Request`s). The engine test (a refused option stops `LLM(...)` with its line) is in test_vllm.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hf_kvbridge.errors import ServingConfigError
from hf_kvbridge.integrations.vllm.support import EngineShape, check_engine, engine_refusal, request_refusal

REFUSED = [
    ({"tensor_parallel_size": 2}, "tensor_parallel_size=2"),
    ({"tensor_parallel_size": 8}, "tensor_parallel_size=8"),
    ({"pipeline_parallel_size": 2}, "pipeline_parallel_size=2"),
    ({"data_parallel_size": 2}, "data_parallel_size=2"),
    ({"prefill_context_parallel_size": 2}, "prefill_context_parallel_size=2"),
    ({"decode_context_parallel_size": 2}, "decode_context_parallel_size=2"),
    ({"cache_dtype": "fp8"}, "cache_dtype=fp8"),
    ({"cache_dtype": "fp8_e4m3"}, "cache_dtype=fp8_e4m3"),
    ({"cache_dtype": "fp8_e5m2"}, "cache_dtype=fp8_e5m2"),
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


@pytest.mark.parametrize("cache_dtype", ["auto", "bfloat16", "float16", "float32"])
def test_served_shapes(cache_dtype):
    assert engine_refusal(EngineShape(cache_dtype=cache_dtype)) is None
    check_engine(EngineShape(cache_dtype=cache_dtype), "my-bridge")


def test_tensor_parallel_refused_before_the_other_options():
    """Several refused options: the line names the first (the most harmful one: TP overwrites other requests)."""
    reason = engine_refusal(EngineShape(tensor_parallel_size=2, cache_dtype="fp8", pipeline_parallel_size=2))
    assert reason.startswith("tensor_parallel_size=2")


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
    )
    shape = EngineShape.from_vllm_config(config, SimpleNamespace(kv_cache_groups=[0, 1]))
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
