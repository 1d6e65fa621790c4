"""`KVBridgeForCausalLM`: the source prefills, the mapper turns its cache into the target's, the target decodes.

```
prompt ──source prefill──▶ source cache ──strip RoPE──▶ content rows ──mapper──▶ target rows
       ──apply target RoPE──▶ DynamicCache ──target (held-back tokens, then decoding)──▶ logits / tokens
```
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, Cache, DynamicCache, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .bridge_parts import check_bridge_parts, converted_mapper
from .configuration import KVBridgeConfig
from .errors import ContextLengthError
from .generation import BridgedPrefill, bridged_forward, generation_inputs, target_forward
from .mappers.base import KVMapper
from .mappers.engine import Workspace, map_cache
from .mappers.lazy import LazyKVMapper
from .mappers.residual import ResidualMapper
from .persistence import BridgeHubMixin
from .transfer.layer_recompute import check_layer_recompute
from .transfer.plan import TransferPlan, plan_from_config
from .transfer.prefill import transfer_prefill
from .transfer.session import HandoffSession, TransferSide
from .transfer.steps import TransferDecision
from .transfer.warm_start import check_warm_plan, generate_from_source_cache
from .utils.cache import cache_kwargs
from .utils.devices import execution_device
from .utils.masks import left_padding
from .utils.precision import HALF_TYPES, resolve_mapper_dtype

logger = logging.getLogger(__name__)


class KVBridgeForCausalLM(BridgeHubMixin, nn.Module):
    r"""A source/target pair that behaves like the target, with the prompt prefilled by the source.

    With no cache, `forward` runs the source over the prompt except its last `hold_back` tokens, maps the
    source's KV cache into a target `DynamicCache`, and runs the target over the remaining tokens on that cache.
    With a cache, it is plain target decoding. `generate` behaves like the target's `generate`.

    Args:
        config ([`KVBridgeConfig`]): the pair, its fingerprints and the mapper settings.
        source ([`PreTrainedModel`]): the model that prefills.
        target ([`PreTrainedModel`]): the model that decodes.
        mapper ([`KVMapper`]): maps content-space source KV rows to target KV rows.
        residual_mapper ([`ResidualMapper`], *optional*): maps the source's hidden states to the residual stream
            entering the target's top layers, for layer recompute (`config.recompute_layers`,
            `hf_kvbridge.transfer.layer_recompute`).
        mapper_dtype (`torch.dtype` or `str`, *optional*): the dtype to keep the mapper in and map with (`float32`,
            `bfloat16`, `float16`). Defaults to `"auto"`: the target's dtype when that is a half type, else float32,
            mapping with a bfloat16 copy where `torch.set_float32_matmul_precision("medium")` allows it and the device
            has bfloat16 matrix units (`mapping_mapper`).

    Example:

    ```python
    >>> import hf_kvbridge
    >>> bridge = hf_kvbridge.calibrate(small, large, texts, num_sequences=64, seq_len=256)  # doctest: +SKIP
    >>> out = bridge.generate(**tokenizer("The KV cache", return_tensors="pt"), max_new_tokens=20)  # doctest: +SKIP
    >>> bridge.save_pretrained("my-bridge")  # doctest: +SKIP
    ```
    """

    config_class = KVBridgeConfig
    main_input_name = "input_ids"

    def __init__(
        self,
        config: KVBridgeConfig,
        source: PreTrainedModel,
        target: PreTrainedModel,
        mapper: KVMapper,
        residual_mapper: ResidualMapper | None = None,
        mapper_dtype: torch.dtype | str | None = None,
    ):
        super().__init__()
        # an explicit dtype is the mapper's own (converted below, saved as such); `None`/"auto" keeps the mapper in the
        # target's half type or float32 and may map with a bfloat16 copy (`mapping_mapper`)
        if mapper_dtype in (None, "auto"):
            storage_dtype = target.dtype if target.dtype in HALF_TYPES else torch.float32
        else:  # validated first
            storage_dtype = resolve_mapper_dtype(target.dtype, execution_device(target), mapper_dtype)
        self.source_layout, self.target_layout, features = check_bridge_parts(
            config, source, target, mapper, residual_mapper
        )
        self.config = config
        # the mapper lives in the target's dtype when that is a half type (matmuls accumulate in float32 anyway), else
        # in float32, or in the dtype asked for; a mapper in another dtype or on another device is converted into a
        # copy, never in the caller's hands
        mapper = converted_mapper(mapper, execution_device(target), storage_dtype)
        if residual_mapper is not None:
            residual_mapper = converted_mapper(residual_mapper, execution_device(target), storage_dtype)
        self.mapper_dtype = mapper_dtype
        self.source, self.target, self.mapper = source, target, mapper
        self.residual_mapper = residual_mapper
        self.source_features = features  # the hidden-state feature blocks the mapper reads, or None (K/V only)
        self.reverse: KVBridgeForCausalLM | None = None  # target→source bridge, for handoffs both ways
        self.last_transfer: dict | None = None  # what the last prefill or warm start did (mapped vs target, gate)
        self.transfer_counts: dict[str, int] = {}  # their rows that transferred / fell back to the target

    # -- what tools (pipelines, generation utilities, lm-eval) read on a model: the target's ----------------------
    def __getattr__(self, name: str) -> Any:
        """Attributes the bridge does not have come from the target (as peft's `PeftModel` forwards to its base
        model): `hf_device_map`, `vocab_size`, `prepare_inputs_for_generation`, ..."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in ("source", "target", "mapper") or name.startswith("__"):
                raise
            return getattr(super().__getattr__("target"), name)

    @classmethod
    def can_generate(cls) -> bool:
        """`True`: the bridge generates (with the target's `generate`), so pipelines may call `generate`."""
        return True

    def get_input_embeddings(self) -> nn.Module:
        """The target's input embeddings (the tokens the bridge decodes are the target's)."""
        return self.target.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module | None:
        """The target's output embeddings (`lm_head`)."""
        return self.target.get_output_embeddings()

    @property
    def device(self) -> torch.device:
        """Where the target computes (its embedding's device; accelerate's execution device when offloaded)."""
        return execution_device(self.target)

    @property
    def dtype(self) -> torch.dtype:
        return self.target.dtype

    @property
    def generation_config(self):
        return self.target.generation_config

    @property
    def name_or_path(self) -> str:
        return getattr(self.config, "name_or_path", "") or ""

    @property
    def max_positions(self) -> int:
        return min(self.source_layout.max_position_embeddings, self.target_layout.max_position_embeddings)

    # -- the mapping ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def map_cache(
        self,
        source_cache: Cache,
        position_ids: torch.Tensor | None = None,
        target_cache: Cache | None = None,
        hidden_states=None,
        schedule: str | None = None,
    ) -> Cache:
        """Maps a source cache to the cache the target would have built for the same tokens (the mapping engine,
        `hf_kvbridge.mappers.engine`: cache-sized chunks on a CPU, whole layers and fused kernels on a GPU; its
        buffers are a workspace kept between calls, see `free_workspace`).

        Args:
            source_cache (`Cache`): the source's cache, `L_s` layers of `(batch, kv_heads, seq, head_dim)`.
            position_ids (`torch.LongTensor` of shape `(batch, seq)`, *optional*): positions of the cached tokens
                (per row for left-padded batches); defaults to `0 … seq-1`.
            target_cache (`Cache`, *optional*): a cache to append to (positions must continue it); a new one is
                made otherwise. A `StaticCache` is written in place by the `"layers"` schedule.
            hidden_states (`tuple[torch.Tensor]`, *optional*): the source's `output_hidden_states` over the cached
                tokens (`L_s + 1` tensors of `(batch, seq, D_s)`); needed when the mapper reads them
                (`self.source_features`, `hf_kvbridge.utils.source_features`), ignored otherwise.
            schedule (`str`, *optional*): `"chunked"` or `"layers"` (`mappers.engine.SCHEDULES`); by default the
                one for the target's device (`engine.default_schedule`: whole layers on CUDA, chunks on CPU).

        Returns:
            `DynamicCache` with `L_t` layers in the target's dtype and device.
        """
        return map_cache(
            self.source,
            self.target,
            self.mapping_mapper(),
            self.source_layout,
            source_cache,
            position_ids=position_ids,
            target_cache=target_cache,
            workspace=self._mapping_workspace,
            target_layout=self.target_layout,
            source_features=self.source_features,
            hidden_states=hidden_states if self.source_features is not None else None,
            schedule=schedule,
        )

    def mapping_mapper(self) -> KVMapper:
        """The mapper `map_cache` computes with: `self.mapper`, or, when `mapper_dtype` is `None`/`"auto"`, the target
        is float32, PyTorch's float32 matmul precision allows bfloat16 (`torch.set_float32_matmul_precision(
        "medium")`) and the device has bfloat16 matrix units (`hf_kvbridge.utils.precision.resolve_mapper_dtype`), a
        bfloat16 copy of it. The copy is kept (half the float32 mapper's bytes) until a weight of `self.mapper`
        changes or moves; `self.mapper` itself, and so what `save_pretrained` writes, stays float32. A lazily loaded
        mapper is never copied.

        Example:

        ```python
        >>> torch.set_float32_matmul_precision("medium")  # doctest: +SKIP
        >>> bridge.mapping_mapper().layout_dtype()  # doctest: +SKIP
        torch.bfloat16
        ```
        """
        mapper = self.mapper
        if self.mapper_dtype not in (None, "auto") or isinstance(mapper, LazyKVMapper):
            return mapper
        if mapper.layout_dtype() != torch.float32:  # a half target's mapper, or one converted by hand
            return mapper
        dtype = resolve_mapper_dtype(self.target.dtype, execution_device(self.target), None)
        if dtype == torch.float32:
            return mapper
        # parameters made under `torch.inference_mode()` have no version counter: their storage is the key
        key = (
            dtype,
            tuple((p.data_ptr(), p.device, None if p.is_inference() else p._version) for p in mapper.parameters()),
        )
        kept = self.__dict__.get("_compute_mapper")  # kept out of nn.Module's attribute machinery (not a submodule)
        if kept is None or kept[0] != key:
            self.__dict__["_compute_mapper"] = None  # never two copies at once
            kept = self.__dict__["_compute_mapper"] = (
                key,
                converted_mapper(mapper, execution_device(self.target), dtype),
            )
        return kept[1]

    @torch.no_grad()
    def map_residual(self, source_hidden_states, recompute_layers: int) -> torch.Tensor:
        """The residual stream entering target layer `L_t − recompute_layers`, mapped from the source's hidden states
        (`output_hidden_states` of the source: `L_s + 1` tensors of `(batch, seq, D_s)`) by the residual map of
        layer recompute (`hf_kvbridge.transfer.layer_recompute`).

        Returns:
            `torch.Tensor` of shape `(batch, seq, D_t)` in the target's dtype, on its device.
        """
        check_layer_recompute(self.config, self.target_layout, self.residual_mapper, value=recompute_layers)
        return self.residual_mapper.map_hidden(source_hidden_states, recompute_layers).to(self.device, self.dtype)

    def bridged_prefill(self) -> BridgedPrefill:
        """What `hf_kvbridge.generation` needs of this bridge (target, device, `hold_back`, `check_length`, `prefill`),
        handed down instead of the bridge."""
        return BridgedPrefill(self.target, self.device, self.config.hold_back, self.check_length, self.prefill)

    def transfer_side(self) -> TransferSide:
        """What a [`HandoffSession`] needs of this bridge to map into its target (the config, the maps, the recompute
        check, the target), handed down instead of the bridge."""
        return TransferSide(
            config=self.config,
            map_fn=self.map_cache,
            residual_fn=self.map_residual,
            check_recompute_layers=self.check_recompute_layers,
            target=self.target,
            hidden_features=self.source_features is not None,
        )

    def check_recompute_layers(self) -> int:
        """`config.recompute_layers`, after checking that this bridge can run it (`layer_recompute.
        check_layer_recompute`: a calibrated value, full-attention top layers); raises otherwise."""
        return check_layer_recompute(self.config, self.target_layout, self.residual_mapper)

    def with_mapper(self, mapper: KVMapper, config: KVBridgeConfig) -> KVBridgeForCausalLM:
        """A bridge over the same two models with another mapper and its config (a refit of this one), keeping the
        residual map, the calibration statistics, the single-layer R² matrix and the reverse bridge."""
        return self._rebuilt(config, mapper, self.residual_mapper)

    def with_residual_mapper(self, residual_mapper: ResidualMapper | None, config: KVBridgeConfig):
        """A bridge over the same two models and mapper with another residual map of layer recompute and its config
        (whose `residual_map` records it), keeping the calibration statistics, the single-layer R² matrix and the
        reverse bridge."""
        return self._rebuilt(config, self.mapper, residual_mapper)

    def _rebuilt(self, config, mapper, residual_mapper) -> KVBridgeForCausalLM:
        new = type(self)(config, self.source, self.target, mapper, residual_mapper, mapper_dtype=self.mapper_dtype)
        for name in ("layer_r2", "calibration_statistics"):
            if hasattr(self, name):
                setattr(new, name, getattr(self, name))
        new.reverse = self.reverse
        return new

    @property
    def _mapping_workspace(self) -> Workspace:
        workspace = self.__dict__.get("_workspace")
        if workspace is None:  # kept out of nn.Module's attribute machinery: it holds no parameters
            workspace = self.__dict__["_workspace"] = Workspace()
        return workspace

    def free_workspace(self) -> None:
        """Frees the buffers `map_cache` keeps between calls, for every thread (they come back on the next mapping)."""
        self._mapping_workspace.free()

    def workspace_bytes(self) -> int:
        """Bytes held by `map_cache`'s workspace buffers (all threads)."""
        return self._mapping_workspace.nbytes()

    def check_length(self, length: int) -> None:
        """Refuses an input longer than both models' maximum positions (`ContextLengthError`)."""
        ContextLengthError.check("the input", length, self.max_positions, "shorten the prompt")

    @torch.no_grad()
    def prefill(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        *,
        position_ids: torch.LongTensor | None = None,
        source_logits: bool = True,
    ) -> tuple[DynamicCache, Any]:
        """Builds the target cache for every token of `input_ids` and returns `(target cache, source outputs)`.

        Call it on the prompt without its held-back tokens. The source prefills all of `input_ids`; its KV is mapped,
        except for attention sinks, recomputed tokens and the quality gate's probe tokens, which the target computes
        itself: the positions are `self.transfer_plan(...)`'s, the work is
        `hf_kvbridge.transfer.prefill.transfer_prefill`'s. The decision (a [`TransferDecision`] as a dict) is kept in
        `self.last_transfer` and its rows counted in `self.transfer_counts`. `position_ids` (`(batch, seq)`,
        *optional*) are the tokens' positions for both models (default: `cumsum(attention_mask) - 1`). With
        `source_logits=False` the source computes logits for the last position only.
        """
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        self.check_length(input_ids.shape[1])
        self.check_recompute_layers()  # the config may have changed since the bridge was built
        plan = self.transfer_plan(input_ids.shape[1], padding=int(left_padding(attention_mask).max()))
        result = transfer_prefill(
            self.source,
            self.target,
            self.map_cache,
            plan,
            input_ids,
            attention_mask,
            position_ids=position_ids,
            source_logits=source_logits,
            residual_fn=self.map_residual,
            hidden_features=self.source_features is not None,
        )
        self._record_transfer(result.decision)
        return result.cache, result.source_outputs

    def _record_transfer(self, decision: TransferDecision) -> None:
        """Keeps a transfer's decision (`prefill`'s, a warm start's) in `last_transfer` and counts its rows in
        `transfer_counts`."""
        self.last_transfer = decision.as_dict()
        for key, count in decision.counts().items():
            self.transfer_counts[key] = self.transfer_counts.get(key, 0) + count

    def transfer_plan(self, length: int, *, padding: int = 0) -> TransferPlan:
        """The [`TransferPlan`] `prefill` follows for `length` tokens (with `padding` tokens of left padding at most):
        `hf_kvbridge.transfer.plan.plan_from_config` with this bridge's config."""
        return plan_from_config(length, self.config, padding=padding)

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        prefill_length: int | None = None,
        *,
        cache: Cache | None = None,
        position_ids: torch.LongTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool = True,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        r"""Bridged forward pass.

        Args:
            input_ids (`torch.LongTensor` of shape `(batch, seq)`): the tokens (left padding allowed).
            attention_mask (`torch.Tensor` of shape `(batch, seq)`, *optional*): 1 for tokens, 0 for padding.
            past_key_values / cache (`Cache`, *optional*): a target cache; when given (and non-empty) this is plain
                target decoding.
            prefill_length (`int`, *optional*): length of the prompt inside `input_ids`; tokens
                `[0, prefill_length - hold_back)` are prefilled by the source. `None` means the whole input.
                When nothing is left for the source (e.g. a one-token prompt), the target runs alone.
            labels (`torch.LongTensor`, *optional*): for a causal LM loss over the returned logits.

        Returns:
            `CausalLMOutputWithPast`: `logits (batch, seq, vocab)` (source logits where the source ran, target
            logits from `prefill_length - hold_back` on) and the target cache in `past_key_values`.
        """
        cache = cache if cache is not None else past_key_values
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if cache is not None and cache.get_seq_length() > 0:
            return target_forward(
                self.bridged_prefill(),
                input_ids,
                attention_mask,
                position_ids,
                labels,
                use_cache,
                **cache_kwargs(cache),
                **kwargs,
            )
        parts = self.bridged_prefill()
        return bridged_forward(
            parts, input_ids, attention_mask, prefill_length, position_ids, labels, use_cache, **kwargs
        )

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ):
        """Generates like the target's `generate` (all its arguments), with the prompt prefilled by the source.

        The prompt's last `hold_back` tokens are run by the target on the mapped cache, so the first generated
        token comes from the target's own logits. Batched left-padded prompts are supported. Without an
        `attention_mask` every token is treated as real. A one-token prompt is generated by the target alone.

        Example:

        ```python
        >>> inputs = tokenizer(["Hello", "A longer prompt"], return_tensors="pt", padding=True)  # doctest: +SKIP
        >>> bridge.generate(**inputs, max_new_tokens=10, do_sample=False)  # doctest: +SKIP
        ```
        """
        input_ids, attention_mask = generation_inputs(self.bridged_prefill(), input_ids, attention_mask, kwargs)
        return self.target.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    @torch.no_grad()
    def generate_from_cache(self, source_cache: Cache, input_ids: torch.LongTensor | None = None, **kwargs: Any):
        r"""Generates like [`~KVBridgeForCausalLM.generate`] from a source cache the caller holds (a warm cascade):
        maps it in place into the target's cache, runs the target over the prompt's tokens it does not cover (at
        least the last `hold_back`), takes the first token as `generate` would and lets `generate` continue
        (`hf_kvbridge.transfer.warm_start`). Refuses configs that need the source's forward (sinks, gate, recompute).

        Args:
            source_cache (`Cache`): the source's cache of the prompt's first tokens (at `generate`'s positions).
            input_ids (`torch.LongTensor` of shape `(batch, seq)`): the whole prompt (left padding allowed).
            kwargs: `generate`'s arguments (`attention_mask`, `max_new_tokens`, `do_sample`, `streamer`, ...), and
                `cache_implementation="static"` (a `StaticCache` the bridge keeps), `cache=` (an empty cache to map
                into), `compile_hold_back` (the hold-back through the target's compiled step; by default where
                `generate` compiles its decoding: a static cache on a GPU).

        Example:

        ```python
        >>> source_cache = bridge.source(ids, use_cache=True).past_key_values  # doctest: +SKIP
        >>> bridge.generate_from_cache(source_cache, ids, max_new_tokens=5, do_sample=False)  # doctest: +SKIP
        ```
        """
        if input_ids is None:
            input_ids = kwargs.pop("inputs", None)
        length = 0 if input_ids is None else input_ids.shape[-1]
        self.check_length(length)
        check_warm_plan(self.transfer_plan(max(length - self.config.hold_back, 0)), self.source_features is not None)
        keep = self.__dict__.setdefault("_warm_start", {})  # the static cache reused between calls
        return generate_from_source_cache(self.target, self.map_cache, source_cache, input_ids,
                                          hold_back=self.config.hold_back, keep=keep, transfer_plan=self.transfer_plan,
                                          record=self._record_transfer, **kwargs)  # fmt: skip

    # -- a conversation (saving, loading, pushing: `BridgeHubMixin`) ---------------------------------------------
    def start_session(self, tokenizer=None, **kwargs: Any):
        """A [`HandoffSession`]: one conversation whose turns can be answered by the source or the target.

        Example:

        ```python
        >>> session = bridge.start_session(tokenizer)  # doctest: +SKIP
        >>> session.add_user("Hi!")  # doctest: +SKIP
        >>> session.generate(model="source", max_new_tokens=20).text  # doctest: +SKIP
        ```
        """
        return HandoffSession(self, tokenizer, **kwargs)


# the Auto classes load a saved bridge (`AutoModelForCausalLM.from_pretrained(folder)`); until this module is imported,
# `hf_kvbridge/__init__.py` registers a stand-in that imports it on first use
AutoModelForCausalLM.register(KVBridgeConfig, KVBridgeForCausalLM, exist_ok=True)
