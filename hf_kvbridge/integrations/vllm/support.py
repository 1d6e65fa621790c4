"""What the connector serves right, decided before any request: the engine options it refuses at start-up
(`engine_refusal`, a pure function of vLLM's config values, `EngineShape`) and the requests it serves unbridged with
status `"unsupported"` (`request_refusal`: a LoRA adapter without a mapper of its own, prompt embeddings, multi-modal
inputs), and the mapper a request gets (`request_mapper`: its LoRA adapter's, or the base bridge's). Needs no vLLM
import of its own: `EngineShape.from_vllm_config` reads the attributes of a `VllmConfig`.

The rule: nothing may report `"mapped"` with a cache the target could not use. An option the worker does not handle
(a pipeline stage holds only its layers; a draft model adds attention layers of its own; a quantized cache other
than fp8 holds codes nothing here reads) is refused with one line naming it, and the engine does not start.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from ...errors import ServingConfigError

SERVED_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float")
"""`cache_dtype` values whose cache holds the model's numbers (written through the backend's own op, read back as
they are)."""

SERVED_FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")
"""fp8 `cache_dtype` values served on the CPU backend: written through the backend's own op (quantized the engine's
way), read back (the gate, the exports) as codes dequantized with the engine's scales (`paged_cache.read_slots`).
On another device the read-back is not implemented: refused there, as every other quantized cache is."""


# vLLM's parallel sizes, by its own names (`ParallelConfig` attributes, `vllm serve` option destinations)
PARALLEL_SIZES = (
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
    "prefill_context_parallel_size",
    "decode_context_parallel_size",
)


@dataclass(frozen=True)
class EngineShape:
    """The vLLM engine options that decide whether the connector can serve right: read from a `VllmConfig`
    (`from_vllm_config`) or given directly (tests, `kvbridge serve` before it starts vLLM).

    Example:

    ```python
    >>> engine_refusal(EngineShape(pipeline_parallel_size=2)).split(":")[0]
    'pipeline_parallel_size=2'
    >>> engine_refusal(EngineShape(tensor_parallel_size=2), exports=True) is None
    True
    ```
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    cache_dtype: str = "auto"
    speculative: str | None = None  # the speculative method ("ngram", "eagle", "draft_model", ...), None: off
    multimodal: bool = False
    sliding_window: int | None = None
    use_mla: bool = False
    hybrid: bool = False  # attention-free or hybrid (Mamba) layers, or an encoder-decoder model
    kv_cache_groups: int = 1  # vLLM's KV cache groups (more than one: layers with different block tables)
    device_type: str = "cpu"  # vLLM's device_config.device_type: "cpu", "cuda", ...

    @classmethod
    def from_vllm_config(cls, vllm_config: Any, kv_cache_config: Any = None) -> EngineShape:
        """The shape of the engine `vllm_config` (a `vllm.config.VllmConfig`) describes; `kv_cache_config` (the
        connector's, when vLLM gives one) adds its number of KV cache groups."""
        parallel, cache, model = vllm_config.parallel_config, vllm_config.cache_config, vllm_config.model_config
        speculative = vllm_config.speculative_config
        kinds = ("is_hybrid", "is_attention_free", "is_encoder_decoder")
        hybrid = any(bool(_attribute(model, name)) for name in kinds)
        groups = getattr(kv_cache_config, "kv_cache_groups", None)
        return cls(
            **{name: int(getattr(parallel, name, 1) or 1) for name in PARALLEL_SIZES},  # context ones: newer vLLM
            cache_dtype=str(cache.cache_dtype),
            speculative=None if speculative is None else str(getattr(speculative, "method", None) or "on"),
            multimodal=bool(_attribute(model, "is_multimodal_model")),
            sliding_window=_attribute(model, "get_sliding_window"),
            use_mla=bool(_attribute(model, "use_mla")),
            hybrid=hybrid,
            kv_cache_groups=len(groups) if groups else 1,
            device_type=str(getattr(getattr(vllm_config, "device_config", None), "device_type", None) or "cpu"),
        )


def _attribute(model_config: Any, name: str) -> Any:
    """A property or no-argument method of vLLM's `ModelConfig`; `None` when it has none (or it cannot answer)."""
    try:
        value = getattr(model_config, name, None)
        return value() if callable(value) else value
    except Exception:  # a property that needs what this config lacks: treated as absent
        return None


def engine_refusal(shape: EngineShape, *, exports: bool = False) -> str | None:
    """Why the connector refuses to serve an engine of `shape` (one line naming the first option it cannot serve
    right), or `None` when it serves it. Pure: no vLLM, no engine.

    Served: tensor parallelism, on a mapping engine (each rank writes its own KV heads, `tensor_parallel.HeadShard`)
    and on an exporting one (each rank reads its own heads, gathered to rank 0, which writes the entries of all heads:
    `export.export_sharded`); a cache of the model's numbers (`cache_dtype` auto, float32, float16 or bfloat16), an
    fp8 cache on the CPU backend (`SERVED_FP8_CACHE_DTYPES`; exported dequantized with the engine's scales), chunked
    prefill, prefix caching, any block size, LoRA-enabled engines (a request with an adapter is mapped with that
    adapter's mapper, `lora_bridges`, and served unbridged without one: `request_refusal`). `exports`: whether this
    engine exports its KV to a store (roles source and both), which refuses nothing more today (kept so that callers
    say which engine they check).

    Example:

    ```python
    >>> engine_refusal(EngineShape(cache_dtype="fp8_e4m3")) is None
    True
    >>> engine_refusal(EngineShape(cache_dtype="fp8_e4m3", device_type="cuda"))[:30]
    'cache_dtype=fp8_e4m3 on cuda: '
    ```
    """
    if shape.pipeline_parallel_size > 1:
        return (
            f"pipeline_parallel_size={shape.pipeline_parallel_size}: each stage holds only its own layers and the "
            "connector maps all of them; serve with pipeline_parallel_size=1"
        )
    for name in ("prefill_context_parallel_size", "decode_context_parallel_size"):
        size = getattr(shape, name)
        if size > 1:
            return f"{name}={size}: the KV cache is split by token across ranks, which the connector does not do"
    if shape.data_parallel_size > 1:
        return (
            f"data_parallel_size={shape.data_parallel_size}: not verified with the connector; run one engine per "
            "replica (each with its own connector) behind a router"
        )
    if shape.cache_dtype in SERVED_FP8_CACHE_DTYPES and shape.device_type != "cpu":
        return (
            f"cache_dtype={shape.cache_dtype} on {shape.device_type}: the quality gate and the exports read fp8 codes "
            "back on the CPU backend only; serve with kv_cache_dtype auto, bfloat16 or float16"
        )
    if shape.cache_dtype not in SERVED_CACHE_DTYPES + SERVED_FP8_CACHE_DTYPES:
        return (
            f"cache_dtype={shape.cache_dtype}: the cache holds quantized codes the quality gate and the exports "
            "cannot read back (fp8, fp8_e4m3 and fp8_e5m2 are read); serve with kv_cache_dtype auto, bfloat16, "
            "float16 or fp8"
        )
    if shape.speculative is not None:
        return (
            f"speculative decoding ({shape.speculative}): a draft model's layers and rejected drafts are not handled "
            "by the connector; serve without speculative_config"
        )
    if shape.multimodal:
        return "a multi-modal model: the source sees no image, audio or video inputs; serve a text-only target"
    if shape.use_mla:
        return "multi-head latent attention (MLA): the cache holds a latent, not the per-head keys and values mapped"
    if shape.hybrid:
        return "an attention-free, hybrid (Mamba) or encoder-decoder model: the connector maps attention K/V only"
    if shape.sliding_window is not None:
        return (
            f"sliding-window attention (sliding_window={shape.sliding_window}): vLLM keeps only the window's blocks "
            "and the connector writes the whole prompt"
        )
    if shape.kv_cache_groups > 1:
        return (
            f"{shape.kv_cache_groups} KV cache groups (layers with different block tables): the connector writes "
            "every layer through the first group's blocks"
        )
    return None


def check_engine(shape: EngineShape, bridge: str, *, exports: bool = False) -> None:
    """Raises `ServingConfigError` (one line: the bridge and the option) when `engine_refusal` refuses `shape`."""
    reason = engine_refusal(shape, exports=exports)
    if reason is not None:
        raise ServingConfigError(f"KVBridgeConnector (bridge {bridge}) does not serve {reason}")


def lora_name(request: Any) -> str | None:
    """The name of a vLLM `Request`'s LoRA adapter (`LoRARequest.lora_name`), or `None` without one."""
    lora = getattr(request, "lora_request", None)
    if lora is None:
        return None
    return str(getattr(lora, "lora_name", None) or getattr(lora, "name", None) or "?")


def request_mapper(request: Any, mappers: Collection[str] = ()) -> str | None:
    """The mapper `request` is mapped with: its LoRA adapter's name when `mappers` (the adapter names with a mapper of
    their own, `lora_bridges`) has it, `None` for the base bridge's (a request without an adapter, or one that
    `request_refusal` refuses).

    Example:

    ```python
    >>> from types import SimpleNamespace
    >>> request_mapper(SimpleNamespace(lora_request=SimpleNamespace(lora_name="sql")), {"sql"})
    'sql'
    ```
    """
    name = lora_name(request)
    return name if name is not None and name in mappers else None


def request_refusal(request: Any, mappers: Collection[str] = ()) -> str | None:
    """Why a vLLM `Request` cannot be bridged (mapped into) nor exported, or `None`: a LoRA adapter that `mappers`
    (the adapter names with a mapper of their own, `lora_bridges`; none on a source engine) does not name (the base
    bridge maps the base model's K/V; an adapter's differ), prompt embeddings (no token ids for the source) and
    multi-modal inputs (the source sees the placeholders only). Such a request is served unbridged with status
    `"unsupported"`.

    Example:

    ```python
    >>> from types import SimpleNamespace
    >>> request_refusal(SimpleNamespace(lora_request=None, prompt_token_ids=[1, 2], prompt_embeds=None)) is None
    True
    ```
    """
    name = lora_name(request)
    if name is not None and name not in mappers:
        known = f"lora_bridges maps {', '.join(map(repr, sorted(mappers)))} only" if mappers else "no lora_bridges"
        return f"LoRA adapter {name!r}: the bridge maps the base model's K/V, not the adapter's ({known})"
    if (
        getattr(request, "prompt_token_ids", None) is None
        or getattr(request, "prompt_embeds", None) is not None
        or getattr(request, "prompt_is_token_ids", None) is not None
    ):
        return "prompt embeddings: the source needs the prompt's token ids"
    if getattr(request, "mm_features", None):
        return "multi-modal inputs: the source sees only their placeholder tokens"
    return None


def utilization_with_source(gpu_memory_utilization: float, source_bytes: int, total_bytes: int) -> float:
    """The `gpu_memory_utilization` to give vLLM so that the source model's weights (`source_bytes`, loaded by the
    connector, on tensor-parallel rank 0 only) fit beside what vLLM sized with `gpu_memory_utilization` of a device
    of `total_bytes`.

    vLLM 0.32 builds the worker's connector in `Worker.initialize_from_config`, after `determine_available_memory`
    sized the KV cache (`gpu_memory_utilization × total − weights − activations`): the source is never counted
    there, and nothing the connector can set changes that sizing afterwards. So the operator leaves the room, by this
    arithmetic (or serves a store-only target, which loads no source weights). Raises `ServingConfigError` when the
    source alone takes all of the budget.

    Example (a Qwen3-14B source, 29.5 GB in bfloat16, beside a Qwen3-32B target at TP 2 on 80 GB GPUs):

    ```python
    >>> round(utilization_with_source(0.9, 29_500_000_000, 80_000_000_000), 3)
    0.531
    ```
    """
    left = gpu_memory_utilization - source_bytes / total_bytes
    if left <= 0:
        raise ServingConfigError(
            f"the source's weights ({source_bytes / 2**30:.1f} GiB) take more than gpu_memory_utilization="
            f"{gpu_memory_utilization} of the device ({total_bytes / 2**30:.1f} GiB); serve a store-only target "
            "(source_weights false) or a larger device"
        )
    return left


def source_memory_note(source_bytes: int, cache_config: Any, device_type: str = "cpu") -> str:
    """The start-up line saying that the source's `source_bytes` were loaded after vLLM sized its KV cache, and what
    to set (`cache_config`: vLLM's `CacheConfig`, its `gpu_memory_utilization` and `kv_cache_memory_bytes`)."""
    size = f"{source_bytes / 2**30:.2f} GiB" if source_bytes >= 2**30 else f"{source_bytes / 2**20:.1f} MiB"
    if device_type == "cpu":
        return (
            f"the source's weights ({size}) are loaded after vLLM sized its KV cache and are not in it: the host's "
            "memory must hold them beside the target's weights and VLLM_CPU_KVCACHE_SPACE / kv_cache_memory_bytes"
        )
    explicit = getattr(cache_config, "kv_cache_memory_bytes", None)
    if explicit:
        return (
            f"the source's weights ({size}) are loaded after vLLM sized its KV cache and are not in "
            f"kv_cache_memory_bytes={explicit}: leave them room on the device"
        )
    utilization = float(getattr(cache_config, "gpu_memory_utilization", 0.9))
    return (
        f"the source's weights ({size}) are loaded after vLLM sized its KV cache with gpu_memory_utilization="
        f"{utilization}: set it to {utilization} - {size} / the device's memory "
        "(support.utilization_with_source), or serve a store-only target"
    )
