"""`KVBridgeForCausalLM`: the source prefills, the mapper turns its cache into the target's, the target decodes.

```
prompt ──source prefill──▶ source cache ──strip RoPE──▶ content rows ──mapper──▶ target rows
       ──apply target RoPE──▶ DynamicCache ──target (held-back tokens, then decoding)──▶ logits / tokens
```
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, Cache, DynamicCache, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .cache import append_layer, cache_layer_kv, check_cache_shape, new_target_cache, slice_cache
from .configuration import KVBridgeConfig
from .constants import (
    CONFIG_NAME,
    DEFAULT_MAX_SHARD_SIZE,
    FORMAT_VERSION,
    MAPPER_CHECKSUMS_KEY,
    MAPPER_WEIGHTS_NAME,
    MODEL_CARD_NAME,
    REVERSE_FOLDER,
)
from .layout import KVLayout, check_fingerprint, check_matched
from .mappers import LINEAR_MAPPER_TYPES, KVMapper, build_mapper
from .rope import Rotation, inverse_cos_sin, rotary_cos_sin

logger = logging.getLogger(__name__)


def execution_device(model: nn.Module) -> torch.device:
    """The device `model` computes on: `model.device`, or, when accelerate offloads its weights (`model.device` is
    `meta`), the execution device of its offloading hooks."""
    device = model.device
    if device.type != "meta":
        return device
    for module in model.modules():
        hook_device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
        if hook_device is not None:
            return torch.device(hook_device)
    return torch.device("cpu")


# kwargs that AutoModelForCausalLM.from_pretrained forwards and that have no meaning for the bridge itself
_AUTO_KWARGS = (
    "trust_remote_code",
    "adapter_kwargs",
    "code_revision",
    "_from_auto",
    "_commit_hash",
    "subfolder",
    "proxies",
    "user_agent",
    "_from_pipeline",
)


class MapperFileError(OSError):
    """A mapper weights file is missing, truncated, corrupt or does not fit the config."""


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-row positions of a (left-)padded batch, as `generate` computes them: `cumsum(mask) - 1`, pads at 0."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 0)


@torch.no_grad()
def probe_agreement(own: Cache, mapped: Cache, start: int, mask: torch.Tensor) -> float:
    """Mean cosine between the target's own K/V rows of tokens `[start, start + n)` in `own` and the mapped ones in
    `mapped` (which holds only those n tokens), over layers and real (unpadded) tokens."""
    scores = []
    weight = mask.float()  # (B, n)
    for own_layer, mapped_layer in zip(own.layers, mapped.layers):
        n = mapped_layer.keys.shape[2]
        a = torch.cat([own_layer.keys[:, :, start : start + n], own_layer.values[:, :, start : start + n]], -1)
        b = torch.cat([mapped_layer.keys, mapped_layer.values], -1)  # (B, H, n, 2d)
        cos = nn.functional.cosine_similarity(a.float(), b.float(), dim=-1).mean(1)  # (B, n)
        scores.append((cos * weight).sum() / weight.sum().clamp_min(1))
    return float(torch.stack(scores).mean())


def resolve_model_reference(name_or_path: str) -> str:
    """Turns a checkpoint's model reference into something `from_pretrained` loads.

    `pocket/<name>` names a model of the pocket family shipped inside this package (see `hf_kvbridge.pocket`);
    anything else (Hub id, local path) is returned unchanged.
    """
    if name_or_path.startswith("pocket/"):
        from .pocket import model_path

        return str(model_path(name_or_path.split("/", 1)[1]))
    return name_or_path


def model_reference(model: PreTrainedModel) -> str:
    """The id a checkpoint records for `model`: its Hub id, `pocket/<name>` for shipped pocket models, or a path."""
    name = model.config.name_or_path or ""
    if not name or not Path(name).is_dir():
        return name
    from .pocket import POCKET_MODELS, model_path

    for pocket_name in POCKET_MODELS:
        try:
            if Path(name).resolve() == model_path(pocket_name).resolve():
                return f"pocket/{pocket_name}"
        except FileNotFoundError:  # not installed in this build
            continue
    return name


class KVBridgeForCausalLM(nn.Module):
    r"""A source/target pair that behaves like the target, with the prompt prefilled by the source.

    With no cache, `forward` runs the source over the prompt except its last `hold_back` tokens, maps the
    source's KV cache into a target `DynamicCache`, and runs the target over the remaining tokens on that cache.
    With a cache, it is plain target decoding. `generate` behaves like the target's `generate`.

    Args:
        config ([`KVBridgeConfig`]): the pair, its fingerprints and the mapper settings.
        source ([`PreTrainedModel`]): the model that prefills.
        target ([`PreTrainedModel`]): the model that decodes.
        mapper ([`KVMapper`]): maps content-space source KV rows to target KV rows.

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

    def __init__(self, config: KVBridgeConfig, source: PreTrainedModel, target: PreTrainedModel, mapper: KVMapper):
        super().__init__()
        source_name = config.source_name_or_path or source.config.name_or_path
        target_name = config.target_name_or_path or target.config.name_or_path
        self.source_layout, self.target_layout = check_matched(source.config, target.config, source_name, target_name)
        if config.source_fingerprint is not None:
            check_fingerprint(config.source_fingerprint, self.source_layout, "source", source_name)
        if config.target_fingerprint is not None:
            check_fingerprint(config.target_fingerprint, self.target_layout, "target", target_name)
        if len(mapper.selected_layers) != self.target_layout.num_layers:
            raise ValueError(
                f"mapper has {len(mapper.selected_layers)} target layers but target {target_name!r} has "
                f"{self.target_layout.num_layers}"
            )
        used = {layer for layers in mapper.selected_layers for layer in layers}
        if used and max(used) >= self.source_layout.num_layers:
            raise ValueError(
                f"mapper reads source layer {max(used)} but source {source_name!r} has "
                f"{self.source_layout.num_layers} layers"
            )
        self.config = config
        self.source, self.target, self.mapper = source, target, mapper
        # the mapper lives in the target's dtype when that is a half type (matmuls accumulate in float32 anyway)
        half = self.target.dtype in (torch.bfloat16, torch.float16)
        self.mapper.to(device=execution_device(self.target), dtype=self.target.dtype if half else torch.float32)
        self.reverse: KVBridgeForCausalLM | None = None  # target→source bridge, for handoffs both ways
        self.last_transfer: dict | None = None  # what the last prefill did (mapped vs target tokens, gate score)
        self.transfer_counts: dict[str, int] = {}  # prefills that transferred / fell back to the target

    # -- properties that let tools treat the bridge like a model ------------------------------------------------
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
        target_cache: DynamicCache | None = None,
    ) -> DynamicCache:
        """Maps a source cache to the cache the target would have built for the same tokens.

        The mapping streams over the sequence in chunks of tokens (`KVMapper.chunk_tokens`). For each chunk every
        source layer is stripped of its rotation once, into a slot of one row buffer that it holds from the first
        step that reads it to the last (`KVMapper.row_slots`); each step of `KVMapper.mapping_plan` (target layers
        reading the same source layers, mapped by one wide matrix product) reads its source layers from there and
        writes its rotated keys and its values straight into the new cache's tensors. The chunk's
        buffers are a workspace kept between calls (per thread, at most `KVMapper.max_chunk_bytes`; see
        `free_workspace`), so mapping allocates nothing but the cache it returns.

        Args:
            source_cache (`Cache`): the source's cache, `L_s` layers of `(batch, kv_heads, seq, head_dim)`.
            position_ids (`torch.LongTensor` of shape `(batch, seq)`, *optional*): positions of the cached tokens
                (per row for left-padded batches); defaults to `0 … seq-1`.
            target_cache (`DynamicCache`, *optional*): a cache to append to (positions must continue it);
                a new one is made otherwise.

        Returns:
            `DynamicCache` with `L_t` layers in the target's dtype and device.
        """
        src = self.source_layout
        seq = check_cache_shape(source_cache, src.num_layers, src.num_kv_heads, src.head_dim, "source")
        first_keys, _ = cache_layer_kv(source_cache, 0)
        batch, device = first_keys.shape[0], self.device
        if position_ids is None:
            position_ids = torch.arange(seq, device=first_keys.device).unsqueeze(0).expand(batch, -1)
        if position_ids.shape[-1] != seq:
            raise ValueError(f"position_ids cover {position_ids.shape[-1]} tokens but the source cache holds {seq}")
        strip = Rotation(*inverse_cos_sin(*rotary_cos_sin(self.source, position_ids.to(device))))
        rotate = Rotation(*rotary_cos_sin(self.target, position_ids.to(device)))  # cos/sin (B, T, d) each
        mapper = self.mapper
        plan, last_use, slots, num_slots, widest, _, chunk = mapper.schedule(batch, seq)  # steps, row slots, chunk
        heads, dim = src.num_kv_heads, src.head_dim
        outputs = [  # the new cache's tensors, one (2, n, B, H, T, d) block per step: [0] keys, [1] values
            torch.empty((2, len(targets), batch, heads, seq, dim), dtype=self.target.dtype, device=device)
            for _, targets in plan
        ]
        dtype = mapper.layout_dtype()
        row_space = self._workspace("rows", batch * chunk * num_slots * heads * 2 * dim, dtype, device)
        out_space = self._workspace("mapped", batch * chunk * widest, dtype, device)
        for start in range(0, seq, chunk):
            end = min(start + chunk, seq)
            strip_c, rotate_c = strip.narrow(start, end), rotate.narrow(start, end)
            rows = mapper.new_rows(batch, end - start, num_slots, out=row_space)  # (B·c, slots·H·2d) or so
            loaded: set[int] = set()
            for step, (sources, targets) in enumerate(plan):
                for s in sources:
                    if s not in loaded:  # first step that reads source layer s: strip its rotation into its slot
                        keys, values = cache_layer_kv(source_cache, s)  # (B, H, T, d), keys post-RoPE
                        keys, values = keys[:, :, start:end].to(device), values[:, :, start:end].to(device)
                        mapper.write_rows(rows, slots[s], keys, values, write_keys=strip_c)
                        loaded.add(s)
                mapped = mapper.map_targets(sources, targets, rows, out=out_space, slots=slots)
                loaded -= {s for s in sources if last_use[s] == step}  # their slots go to later layers
                keys_c, values = mapper.split_rows(mapped, batch, end - start, layers=len(targets))  # (n,B,H,c,d)
                block = outputs[step][:, :, :, :, start:end]  # (2, n, B, H, c, d) view of the cache tensors
                rotate_c(keys_c, out=block[0])
                block[1].copy_(values)
        cache = target_cache if target_cache is not None else new_target_cache(self.target.config)
        for (_, targets), kv in zip(plan, outputs):
            for i, t in enumerate(targets):
                append_layer(cache, t, kv[0, i], kv[1, i])
        return cache

    def with_mapper(self, mapper: KVMapper, config: KVBridgeConfig) -> KVBridgeForCausalLM:
        """A bridge over the same two models with another mapper and its config (a refit of this one), keeping the
        calibration statistics, the single-layer R² matrix and the reverse bridge."""
        new = type(self)(config, self.source, self.target, mapper)
        for name in ("layer_r2", "calibration_statistics"):
            if hasattr(self, name):
                setattr(new, name, getattr(self, name))
        new.reverse = self.reverse
        return new

    def _workspace(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat buffer of at least `numel` elements kept for this thread between mappings (fresh memory on every
        call costs page faults on a CPU that can exceed the arithmetic of a small mapping). Buffers are per thread,
        so threads can map at once, and go with their thread."""
        per_thread = self.__dict__.setdefault("_workspaces", weakref.WeakKeyDictionary())
        spaces = per_thread.setdefault(threading.current_thread(), {})
        key = (name, dtype, torch.device(device))
        buffer = spaces.get(key)
        if buffer is None or buffer.numel() < numel:
            spaces.pop(key, None)  # drop the old one first: never two at once
            buffer = spaces[key] = torch.empty(numel, dtype=dtype, device=device)
        return buffer

    def free_workspace(self) -> None:
        """Frees the buffers `map_cache` keeps between calls, for every thread (they come back on the next mapping)."""
        self.__dict__.pop("_workspaces", None)

    def workspace_bytes(self) -> int:
        """Bytes held by `map_cache`'s workspace buffers (all threads)."""
        per_thread = self.__dict__.get("_workspaces", {})
        return sum(b.numel() * b.element_size() for spaces in list(per_thread.values()) for b in spaces.values())

    def _check_length(self, length: int) -> None:
        if length > self.max_positions:
            raise ValueError(
                f"input of {length} tokens is longer than the models' maximum of {self.max_positions} positions"
            )

    @torch.no_grad()
    def prefill(
        self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None, *, source_logits: bool = True
    ) -> tuple[DynamicCache, Any]:
        """Builds the target cache for every token of `input_ids` and returns `(target cache, source outputs)`.

        Call it on the prompt without its held-back tokens. The source prefills all of `input_ids`; its KV is mapped,
        except for the first `config.sink_tokens` real tokens of each row (attention sinks), which the target computes
        itself. With a quality gate (`config.gate_threshold`), the target also computes the last
        `config.gate_probe_tokens` tokens itself and compares its own K/V there with the mapped ones (cosine, mean
        over layers and tokens); below the threshold the mapped cache is dropped and the target prefills everything
        (fallback). The decision is in `self.last_transfer` and counted in `self.transfer_counts`.
        With `source_logits=False` the source computes logits for the last position only (generation needs none).
        """
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        length = input_ids.shape[1]
        self._check_length(length)
        positions = positions_from_mask(attention_mask)
        src_device, device = execution_device(self.source), self.device
        source_out = self.source(
            input_ids=input_ids.to(src_device),
            attention_mask=attention_mask.to(src_device),
            position_ids=positions.to(src_device),
            use_cache=True,
            logits_to_keep=0 if source_logits else 1,
        )
        ids, mask, pos = input_ids.to(device), attention_mask.to(device), positions.to(device)

        def target_run(start: int, end: int, cache: DynamicCache | None) -> DynamicCache:
            return self.target(
                input_ids=ids[:, start:end],
                attention_mask=mask[:, :end],
                position_ids=pos[:, start:end],
                cache=cache,
                use_cache=True,
            ).cache

        pads = (mask.cumsum(-1) == 0).sum(-1)  # (B,) left padding of each row
        sink_end = min(length, int((pads + self.config.sink_tokens).max())) if self.config.sink_tokens else 0
        gated = self.config.gate_threshold is not None
        probe = min(self.config.gate_probe_tokens, length - sink_end) if gated else 0
        map_end = length - probe
        cache = target_run(0, sink_end, None) if sink_end > 0 else None
        if map_end > sink_end:
            piece = slice_cache(source_out.cache, sink_end, map_end)
            cache = self.map_cache(piece, positions[:, sink_end:map_end], target_cache=cache)
        decision = {
            "transferred": True,
            "mapped_tokens": map_end - sink_end,
            "target_tokens": sink_end + probe,
            "score": None,
        }
        if probe > 0:
            cache = target_run(map_end, length, cache)  # the target's own K/V for the probe tokens
            mapped_probe = self.map_cache(slice_cache(source_out.cache, map_end, length), positions[:, map_end:])
            score = probe_agreement(cache, mapped_probe, map_end, mask[:, map_end:])
            decision.update(score=score, transferred=score >= self.config.gate_threshold)
            if not decision["transferred"]:
                logger.info(
                    "quality gate: probe K/V cosine %.4f < %.4f, the target prefills itself",
                    score,
                    self.config.gate_threshold,
                )
                cache = target_run(0, length, None)
                decision.update(mapped_tokens=0, target_tokens=length)
        self.last_transfer = decision
        key = "transferred" if decision["transferred"] else "fallback"
        self.transfer_counts[key] = self.transfer_counts.get(key, 0) + 1
        return cache, source_out

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
            return self.target(
                input_ids=input_ids,
                attention_mask=attention_mask,
                cache=cache,
                position_ids=position_ids,
                labels=labels,
                use_cache=use_cache,
                **kwargs,
            )
        seq = input_ids.shape[1]
        self._check_length(seq)
        prefill_length = seq if prefill_length is None else int(prefill_length)
        if not 1 <= prefill_length <= seq:
            raise ValueError(f"prefill_length must be in [1, {seq}], got {prefill_length}")
        split = prefill_length - self.config.hold_back
        if position_ids is None:
            position_ids = positions_from_mask(attention_mask)
        if split <= 0:  # nothing for the source to prefill: the target computes everything itself
            logger.info(
                "prompt too short to bridge (prefill_length=%d, hold_back=%d): target only",
                prefill_length,
                self.config.hold_back,
            )
            return self.target(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                labels=labels,
                use_cache=use_cache,
                **kwargs,
            )
        mapped, source_out = self.prefill(input_ids[:, :split], attention_mask[:, :split])
        device = self.device
        target_out = self.target(
            input_ids=input_ids[:, split:].to(device),
            attention_mask=attention_mask.to(device),
            position_ids=position_ids[:, split:].to(device),
            cache=mapped,
            use_cache=True,
            **kwargs,
        )
        logits = torch.cat([source_out.logits.to(device, target_out.logits.dtype), target_out.logits], dim=1)
        loss = None
        if labels is not None:
            shift_logits = logits[:, :-1].float()
            shift_labels = labels[:, 1:].to(device)
            loss = nn.functional.cross_entropy(
                shift_logits.reshape(-1, shift_logits.shape[-1]), shift_labels.reshape(-1), ignore_index=-100
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=target_out.cache if use_cache else None)

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
        if input_ids is None:
            input_ids = kwargs.pop("inputs", None)
        if input_ids is None:
            raise ValueError("generate needs input_ids")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        device = self.device
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        if "past_key_values" in kwargs:
            kwargs["cache"] = kwargs.pop("past_key_values")
        split = input_ids.shape[1] - self.config.hold_back
        if kwargs.get("cache") is None and split > 0:
            self._check_length(input_ids.shape[1])
            kwargs["cache"], _ = self.prefill(input_ids[:, :split], attention_mask[:, :split], source_logits=False)
        return self.target.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    # -- saving and loading --------------------------------------------------------------------------------------
    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        *,
        overwrite: bool = False,
        max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
        model_card_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """Writes `config.json`, the mapper weights and a `README.md` model card; never the models' weights.

        The mapper goes to `mapper.safetensors`, or, when larger than `max_shard_size` (e.g. `"2GB"`), to
        `mapper-0000i-of-0000N.safetensors` shards listed in `mapper.safetensors.index.json`. The sha256 of every
        weight file is recorded in `config.json` (`mapper_sha256`) and verified on load. `model_card_kwargs` go to
        `hub.render_model_card` (`repo_id`, `eval_table`, `attention_cosine`).

        Refuses a non-empty directory unless `overwrite=True` (then only the bridge's own files are replaced, and
        weight files of an earlier save that this one does not write are removed).
        """
        from .integrations.hub import remove_stale_weight_files, render_model_card, save_mapper_weights

        save_directory = Path(save_directory)
        if save_directory.is_file():
            raise FileExistsError(f"{save_directory} is a file")
        if save_directory.exists() and any(save_directory.iterdir()) and not overwrite:
            raise FileExistsError(
                f"{save_directory} is not empty; pass overwrite=True to replace the bridge files in it "
                f"({CONFIG_NAME}, {MAPPER_WEIGHTS_NAME}, {MODEL_CARD_NAME})"
            )
        save_directory.mkdir(parents=True, exist_ok=True)
        # write into a temporary folder first, so a failure leaves the old files intact
        with tempfile.TemporaryDirectory(dir=save_directory, prefix=".tmp-kvbridge-") as tmp:
            tmp = Path(tmp)
            checksums = save_mapper_weights(
                self.mapper.state_dict(),
                tmp,
                max_shard_size=max_shard_size,
                metadata={
                    "format": "pt",
                    "format_version": str(FORMAT_VERSION),
                    "mapper_type": self.config.mapper_type,
                },
            )
            self.config.save_pretrained(tmp)
            config_dict = json.loads((tmp / CONFIG_NAME).read_text(encoding="utf-8"))
            config_dict[MAPPER_CHECKSUMS_KEY] = checksums
            (tmp / CONFIG_NAME).write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n", encoding="utf-8")
            render_model_card(self.config, **(model_card_kwargs or {})).save(tmp / MODEL_CARD_NAME)
            if self.reverse is not None:  # the target→source mapper, in a folder of its own
                self.reverse.save_pretrained(tmp / REVERSE_FOLDER, max_shard_size=max_shard_size)
            written = {p.name for p in tmp.iterdir()}
            remove_stale_weight_files(save_directory, keep=written)
            if (save_directory / REVERSE_FOLDER).is_dir():  # a reverse mapper of an earlier save (overwrite=True)
                shutil.rmtree(save_directory / REVERSE_FOLDER)
            for name in sorted(written):
                os.replace(tmp / name, save_directory / name)

    def push_to_hub(
        self,
        repo_id: str,
        *,
        revision: str | None = None,
        private: bool | None = None,
        token: str | bool | None = None,
        commit_message: str | None = None,
        create_pr: bool = False,
        max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
        model_card_kwargs: dict[str, Any] | None = None,
    ):
        r"""Uploads exactly what `save_pretrained` writes (config, mapper weights, card) to `repo_id`, in one commit.

        Creates the repo if needed (`exist_ok=True`), saves into a temporary folder and uploads it with one
        `upload_folder` call; mapper weight files of an earlier push that are no longer part of the checkpoint
        (e.g. old shards) are deleted in the same commit. The source and target weights are never uploaded.

        Args:
            repo_id (`str`): `"org/name"` on the Hub.
            revision (`str`, *optional*): branch to commit to.
            private (`bool`, *optional*): visibility of a newly created repo.
            token (`str` or `bool`, *optional*): Hub token (defaults to the logged-in one).
            commit_message (`str`, *optional*), create_pr (`bool`, *optional*, defaults to `False`): as in
                `HfApi.upload_folder`.
            max_shard_size (`int` or `str`, *optional*, defaults to `"2GB"`): shard the mapper above this size.

        Returns:
            `CommitInfo` of the commit.

        Example:

        ```python
        >>> bridge.push_to_hub("me/qwen3-14b-to-32b")  # doctest: +SKIP
        >>> bridge = KVBridgeForCausalLM.from_pretrained("me/qwen3-14b-to-32b")  # doctest: +SKIP
        ```
        """
        from .integrations.hub import push_folder_to_hub

        card_kwargs = {"repo_id": repo_id, **(model_card_kwargs or {})}
        with tempfile.TemporaryDirectory(prefix="kvbridge-push-") as tmp:
            self.save_pretrained(tmp, max_shard_size=max_shard_size, model_card_kwargs=card_kwargs)
            return push_folder_to_hub(
                tmp,
                repo_id,
                revision=revision,
                private=private,
                token=token,
                commit_message=commit_message,
                create_pr=create_pr,
            )

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        source_model: PreTrainedModel | None = None,
        target_model: PreTrainedModel | None = None,
        *,
        config: KVBridgeConfig | None = None,
        revision: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        local_files_only: bool = False,
        token: str | bool | None = None,
        force_download: bool = False,
        lazy_mapper: bool = False,
        **load_kwargs: Any,
    ) -> KVBridgeForCausalLM:
        r"""Loads a bridge checkpoint and its two models.

        Args:
            pretrained_model_name_or_path (`str` or `os.PathLike`): a local folder or a Hub repo id.
            source_model, target_model ([`PreTrainedModel`], *optional*): already loaded models; otherwise they are
                loaded from the ids and revisions recorded in the config.
            revision (`str`, *optional*): revision of the bridge repo on the Hub.
            lazy_mapper (`bool`, *optional*, defaults to `False`): keep the mapper's weights on disk and load one
                target layer's weights at a time while mapping (for mappers too large to hold in memory).
            load_kwargs: passed to `AutoModelForCausalLM.from_pretrained` for the two models (`torch_dtype`,
                `dtype`, `device_map`, ...).

        Example:

        ```python
        >>> bridge = KVBridgeForCausalLM.from_pretrained("my-bridge", torch_dtype=torch.bfloat16)  # doctest: +SKIP
        ```
        """
        from .integrations.hub import read_config_dict, resolve_checkpoint

        for key in _AUTO_KWARGS:
            load_kwargs.pop(key, None)
        folder = resolve_checkpoint(
            pretrained_model_name_or_path,
            revision=revision,
            cache_dir=cache_dir,
            local_files_only=local_files_only,
            token=token,
            force_download=force_download,
        )
        config_dict = read_config_dict(folder)
        checksums = config_dict.pop(MAPPER_CHECKSUMS_KEY, None)  # not a config field: verified here, then dropped
        if config is None:
            config = KVBridgeConfig.from_dict(config_dict)
        if config.model_type != "kvbridge" or not config.selected_layers:
            raise ValueError(f"{pretrained_model_name_or_path} is not a kvbridge checkpoint")
        if source_model is None:
            source_model = load_model(config.source_name_or_path, config.source_revision, **load_kwargs)
        if target_model is None:
            target_model = load_model(config.target_name_or_path, config.target_revision, **load_kwargs)
        layout = KVLayout.from_config(target_model.config)
        if lazy_mapper:
            from .integrations.hub import verify_mapper_checksums
            from .mappers.lazy import LazyKVMapper

            if config.mapper_type not in LINEAR_MAPPER_TYPES:
                raise ValueError(f"lazy_mapper=True supports linear mappers, not {config.mapper_type!r}")
            files = [folder / name for name in verify_mapper_checksums(folder, checksums)]
            mapper = LazyKVMapper(
                config.selected_layers, layout.num_kv_heads, layout.head_dim, config.head_mode, files
            )
        else:
            mapper = build_mapper(config, layout)  # the class config.mapper_type names (ridge, mlp, ...)
            load_mapper_weights(mapper, folder, checksums)
        bridge = cls(config, source_model, target_model, mapper)
        bridge.config.name_or_path = str(pretrained_model_name_or_path)
        if (folder / REVERSE_FOLDER / CONFIG_NAME).is_file():
            bridge.reverse = cls.from_pretrained(
                folder / REVERSE_FOLDER, source_model=target_model, target_model=source_model
            )
        return bridge

    def start_session(self, tokenizer=None, **kwargs: Any):
        """A [`HandoffSession`]: one conversation whose turns can be answered by the source or the target.

        Example:

        ```python
        >>> session = bridge.start_session(tokenizer)  # doctest: +SKIP
        >>> session.add_user("Hi!")  # doctest: +SKIP
        >>> session.generate(model="source", max_new_tokens=20).text  # doctest: +SKIP
        ```
        """
        from .session import HandoffSession

        return HandoffSession(self, tokenizer, **kwargs)


def load_model(name_or_path: str, revision: str | None = None, **load_kwargs: Any) -> PreTrainedModel:
    """Loads a source/target model by its recorded reference (Hub id, local path or `pocket/<name>`)."""
    if not name_or_path:
        raise ValueError("the checkpoint does not record the model; pass source_model=/target_model=")
    model = AutoModelForCausalLM.from_pretrained(
        resolve_model_reference(name_or_path), revision=revision, **load_kwargs
    )
    return model.eval()


def load_mapper_weights(mapper: KVMapper, path: Path, checksums: dict[str, str] | None = None) -> None:
    """Loads a checkpoint folder's mapper weights (one file or shards) into `mapper`.

    `path` is the checkpoint folder (or its single weights file). Every weight file is checked against `checksums`
    (`{file name: sha256}`, from `config.json`) before it is read. Errors name the file for missing, corrupt,
    tampered or mismatched weights.
    """
    from .integrations.hub import read_mapper_state

    path = Path(path)
    folder = path if path.is_dir() else path.parent
    state = read_mapper_state(folder, checksums)
    expected = mapper.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise MapperFileError(
            f"mapper weights in {folder} do not fit the config: missing {missing[:4]}, unexpected {unexpected[:4]}"
        )
    for key, tensor in state.items():
        if tensor.shape != expected[key].shape:
            raise MapperFileError(
                f"mapper weights in {folder}: {key} has shape {tuple(tensor.shape)}, the config "
                f"implies {tuple(expected[key].shape)}"
            )
        if not torch.isfinite(tensor).all():
            raise MapperFileError(f"mapper weights in {folder}: {key} holds NaN/Inf")
    mapper.load_state_dict(state)
