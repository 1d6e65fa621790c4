"""The mapping engine: a source cache in, the cache the target would have built out.

```
source cache ──strip source RoPE──▶ content rows ──mapper──▶ target content rows ──apply target RoPE──▶ DynamicCache
```

The engine owns the schedule; a `KVMapper` owns the weights, the row layout and the product of one step over one
chunk (`KVMapper.write_rows`, `map_targets`, `split_rows`). Two schedules give the same numbers (`SCHEDULES`; the
`schedule` argument of `map_cache`, by default chosen by the device: `default_schedule`):

- **`"chunked"`** (CPUs): the engine streams over the sequence in chunks of tokens sized for a CPU's caches
  (`chunk_tokens`, `KVMapper.max_chunk_bytes`). For each chunk every source layer is stripped of its rotation once,
  into a slot of one row buffer that it holds from the first step that reads it to the last (`row_slots`); each step
  of `steps.mapping_steps` (target layers reading the same source layers, mapped by one wide matrix product) reads its
  source layers from there and writes its rotated keys and its values straight into the new cache's tensors.
- **`"layers"`** (GPUs; `hf_kvbridge.mappers.layer_schedule`): whole-layer steps. All tokens at once (in as few
  chunks as the device's free memory allows); every source layer the mapper reads is stripped once per mapping into
  its own slot of one row buffer, in layer order (so the layers a step reads side by side are one strided view and
  one product), by one fused op for all of them (`rope.rotate_kv`); each step is one product (a batched one, heads in
  the batch dimension, for the same-head map) into its columns of one buffer, and one fused rotation then writes every
  target layer's keys and values into the cache. The ops dispatched do not grow with the length
  (`hf_kvbridge.tools.bench.ops` counts them). With a `StaticCache` as `target_cache`, the keys and values are written
  in place into its tensors.

The chunk's buffers are a `Workspace` kept between calls (per thread), so mapping allocates nothing but the cache it
returns; the workspace also keeps the two rotations (the source's inverse, the target's) of the last positions
mapped, so mapping again at the same positions runs neither model's rotary embedding (`Workspace.rotations`).
"""

from __future__ import annotations

import threading
import weakref
from typing import NamedTuple

import torch
from torch import nn
from transformers import Cache, DynamicCache

from ..constants import SCHEDULES
from ..errors import InvalidInputError, renamed_name
from ..utils.cache import append_layer, cache_layer_kv, check_cache_shape, new_target_cache
from ..utils.devices import execution_device, layer_devices
from ..utils.layout import KVLayout
from ..utils.rope import Rotation, inverse_cos_sin, rotary_cos_sin, rotary_module
from ..utils.source_features import SourceFeatures
from .base import KVMapper
from .engine_steps import SpanJob, held_offsets, mapping_steps, row_slots
from .layer_schedule import map_span_layers, static_destinations


class Workspace:
    """Flat buffers kept per thread between mappings, and the rotations of the last positions mapped.

    Fresh memory on every call costs page faults on a CPU that can exceed the arithmetic of a small mapping. Buffers
    are per thread, so threads can map at once, and go with their thread.

    Args:
        reuse_rotations (`bool`, *optional*, defaults to `True`): keep the source's inverse and the target's rotation
            of the last positions mapped (per thread) and reuse them while the positions, the rotary modules and
            their buffers are the same (`rotations`); `False` computes them on every call (the engine before this
            cache, kept for `scripts/mapper_time_split.py` and the tests that check the cache against it).
    """

    def __init__(self, reuse_rotations: bool = True):
        self._per_thread: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.reuse_rotations = reuse_rotations

    def rotations(self, source: nn.Module, target: nn.Module, positions: torch.Tensor) -> tuple[Rotation, Rotation]:
        """`(strip, rotate)`: the inverse of `source`'s rotation and `target`'s rotation at `positions` `(B, T)`.

        Exact: the same tensors a fresh computation gives, kept per thread for the last positions mapped and reused
        while the positions are equal and both rotary modules are the same objects with unchanged buffers (version
        counters). Rotary types whose frequencies depend on the call history (`dynamic`, `longrope`: transformers
        updates them inside the forward) and buffers made under `torch.inference_mode()` (no version counter) are
        computed on every call.
        """
        rotaries = (rotary_module(source), rotary_module(target))
        state = _rotary_state(rotaries)
        if not self.reuse_rotations or state is None:
            return _rotations(source, target, positions)
        spaces = self._per_thread.setdefault(threading.current_thread(), {})
        key = ("rotations", positions.device)
        kept = spaces.get(key)
        if (
            kept is not None
            and all(ref() is rotary for ref, rotary in zip(kept[0], rotaries))
            and kept[1] == state
            and kept[2].shape == positions.shape
            and torch.equal(kept[2], positions)
        ):
            return kept[3]
        result = _rotations(source, target, positions)
        spaces[key] = (tuple(weakref.ref(r) for r in rotaries), state, positions.clone(), result)
        return result

    def buffer(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat buffer of at least `numel` elements for this thread."""
        spaces = self._per_thread.setdefault(threading.current_thread(), {})
        key = (name, dtype, torch.device(device))
        buffer = spaces.get(key)
        if buffer is None or buffer.numel() < numel:
            spaces.pop(key, None)  # drop the old one first: never two at once
            buffer = spaces[key] = torch.empty(numel, dtype=dtype, device=device)
        return buffer

    def free(self) -> None:
        """Frees every thread's buffers (they come back on the next mapping)."""
        self._per_thread = weakref.WeakKeyDictionary()

    def nbytes(self) -> int:
        """Bytes held by all threads' buffers (the kept rotations not included: `(B, T, d)` cos/sin, a few of them)."""
        spaces = list(self._per_thread.values())
        return sum(
            b.numel() * b.element_size()
            for per_thread in spaces
            for b in per_thread.values()
            if isinstance(b, torch.Tensor)
        )


def _rotations(source: nn.Module, target: nn.Module, positions: torch.Tensor) -> tuple[Rotation, Rotation]:
    strip = Rotation(*inverse_cos_sin(*rotary_cos_sin(source, positions)))
    return strip, Rotation(*rotary_cos_sin(target, positions))  # cos/sin (B, T, d) each


def _rotary_state(rotaries) -> tuple | None:
    """What a rotary module's output depends on besides the positions (its buffers' identities and versions), or
    `None` when it cannot be told (frequencies updated inside the forward, buffers without a version counter)."""
    state = []
    for rotary in rotaries:
        rope_type = str(getattr(rotary, "rope_type", "default"))
        if "dynamic" in rope_type or rope_type == "longrope":
            return None
        for buffer in rotary.buffers():
            if buffer.is_inference():
                return None
            state.append((buffer.data_ptr(), buffer._version, buffer.dtype, buffer.device))
    return tuple(state)


class MappingSchedule(NamedTuple):
    """How `map_cache` maps one batch (`schedule`)."""

    plan: list[tuple[list[int], list[int]]]  # steps of (source layers, target layers mapped together)
    last_use: dict[int, int]  # source layer → the last step that reads it
    slots: dict[int, int]  # source layer → its slot in the chunk's row buffer
    num_slots: int
    widest: int  # output features per token of the widest step
    bytes_per_token: int  # working set per token: the slots' rows and the widest output
    chunk: int  # tokens per chunk


def schedule(mapper: KVMapper, batch: int, seq: int, targets: set[int] | None = None) -> MappingSchedule:
    """How `map_cache` maps `batch` sequences of `seq` tokens with `mapper`: the plan, where each source layer's rows
    live, and the tokens per chunk, worked out once per mapping. `targets` restricts the plan to those target layers
    (the engine maps sliding-window layers over their window only).

    A chunk's working set (the live source rows and the widest step's output) is about `mapper.max_chunk_bytes`, but
    its products have at least `mapper.min_chunk_rows` rows (batch × chunk tokens: each chunk reads every weight once
    more, and short products run below peak); `max_chunk_bytes=None` maps the whole sequence at once."""
    plan = mapping_steps(mapper, targets)
    last_use = {s: step for step, (sources, _) in enumerate(plan) for s in sources}
    slots, num_slots = row_slots(plan, last_use)
    widest = max(len(step_targets) for _, step_targets in plan) * mapper.y_row  # output features per token
    bytes_per_token = (num_slots * mapper.slot_features + widest) * torch.finfo(mapper.layout_dtype()).bits // 8
    if mapper.max_chunk_bytes is None:
        chunk = seq
    else:
        fits = mapper.max_chunk_bytes // (batch * bytes_per_token)
        chunk = max(1, min(seq, max(-(-mapper.min_chunk_rows // batch), fits)))
    return MappingSchedule(plan, last_use, slots, num_slots, widest, bytes_per_token, chunk)


def chunk_tokens(mapper: KVMapper, batch: int, seq: int) -> int:
    """Tokens per chunk when `map_cache` maps `batch` sequences of `seq` tokens with `mapper`."""
    return schedule(mapper, batch, seq).chunk


def chunk_bytes_per_token(mapper: KVMapper) -> int:
    """Bytes of `map_cache`'s working set per token with `mapper`: the live source rows and the widest step's
    output."""
    return schedule(mapper, 1, 1).bytes_per_token


def default_schedule(device: torch.device | str) -> str:
    """The schedule `map_cache` uses on `device` when none is asked for: `"layers"` on CUDA (few, large kernels: a
    GPU is bound by launches and memory traffic, not by a cache's size), `"chunked"` elsewhere (on a CPU it keeps a
    64 MB workspace and was as fast from 1K tokens on; the whole-layer one won 5-10 % at 256-512 tokens and lost 5-7 %
    at 1-2K, docs/benchmarks.md)."""
    return "layers" if torch.device(device).type == "cuda" else "chunked"


def resolve_schedule(schedule: str | None, device: torch.device | str) -> str:
    """`schedule` checked against `SCHEDULES`, with `None`/`"auto"` resolved by `default_schedule(device)`."""
    if schedule in (None, "auto"):
        return default_schedule(device)
    if schedule not in SCHEDULES:
        raise InvalidInputError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    return schedule


@torch.no_grad()
def map_cache(
    source: nn.Module,
    target: nn.Module,
    mapper: KVMapper,
    source_layout: KVLayout,
    source_cache: Cache,
    position_ids: torch.Tensor | None = None,
    target_cache: DynamicCache | None = None,
    workspace: Workspace | None = None,
    target_layout: KVLayout | None = None,
    *,
    source_features: SourceFeatures | None = None,
    hidden_states=None,
    schedule: str | None = None,
) -> Cache:
    """Maps `source_cache` (of `source`) to the cache `target` would have built for the same tokens.

    Target layers that attend to all tokens are mapped over every token; a sliding-window target layer only over the
    last tokens its cache keeps, and it is stored in the target's own sliding-window cache layer. A sliding-window
    source layer supplies the tokens it holds (its last ones); selection (`layout.allowed_sources`) makes sure the
    layers a target layer reads hold what it needs.

    Args:
        source, target (`nn.Module`): the two models; only their rotary modules, the target's dtype, device and
            config are read.
        mapper ([`KVMapper`]): the fitted mapper.
        source_layout ([`KVLayout`]): the source's KV layout (checked against the cache).
        source_cache (`Cache`): `L_s` layers of `(batch, kv_heads, seq, head_dim)` (sliding layers may hold only
            their last tokens), keys post-RoPE.
        position_ids (`torch.LongTensor` of shape `(batch, seq)`, *optional*): positions of the cached tokens (per
            row for left-padded batches); defaults to `0 … seq-1`.
        target_cache (`Cache`, *optional*): a cache to append to (positions must continue it): a `DynamicCache`, or
            a `StaticCache` (of full-attention layers) that the `"layers"` schedule writes into in place.
        workspace ([`Workspace`], *optional*): buffers to reuse; fresh ones otherwise.
        target_layout ([`KVLayout`], *optional*): the target's layout (read from its config otherwise).
        source_features ([`SourceFeatures`], *optional*), hidden_states (*optional*): when the mapper reads the
            source's hidden states beside its K/V (`hf_kvbridge.utils.source_features`: selected blocks `≥ L_s`), the
            feature layout and the source's `output_hidden_states` of the cached tokens (`L_s + 1` tensors of
            `(batch, seq, D_s)`); their blocks are written into the row slots as they are (no rotation).
        schedule (`str`, *optional*): `"chunked"` or `"layers"` (see the module docstring); `None`/`"auto"` picks by
            the target's device (`default_schedule`). Both compute the same map.

    Returns:
        `target_cache`, or a new `DynamicCache`, with `L_t` layers in the target's dtype, each on the device of its
        target layer (`devices.layer_devices`: one device, or the layers' devices of a target split by a
        `device_map`).
    """
    src = source_layout
    tgt = target_layout if target_layout is not None else KVLayout.from_config(target.config)
    seq_hint = None if position_ids is None else position_ids.shape[-1]
    seq = check_cache_shape(
        source_cache, src.num_layers, src.num_kv_heads, src.head_dim, "source", src.layer_windows, seq_hint
    )
    first_keys, _ = cache_layer_kv(source_cache, 0)
    if position_ids is None:
        position_ids = torch.arange(seq, device=first_keys.device).unsqueeze(0).expand(first_keys.shape[0], -1)
    features = _check_features(mapper, src, source_features, hidden_states, first_keys.shape[0], seq)
    workspace = workspace if workspace is not None else Workspace()
    schedule = resolve_schedule(schedule, execution_device(target))
    # target layers by the tokens they keep: all of them (full attention) or the last `window - 1` (sliding)
    by_span: dict[int, set[int]] = {}
    for t in range(tgt.num_layers):
        by_span.setdefault(tgt.kept_tokens(t, seq), set()).add(t)
    cache = target_cache if target_cache is not None else new_target_cache(target.config)
    places = layer_devices(target, tgt.num_layers)
    into = None  # {target layer: (keys, values)} views of a static cache to write into, in place
    if schedule == "layers" and list(by_span) == [seq] and all(p == execution_device(target) for p in places):
        into = static_destinations(cache, mapper, first_keys.shape[0], seq, places, target.dtype)
    mapped: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    map_span = map_span_layers if schedule == "layers" else _map_span
    for span, layers in sorted(by_span.items(), reverse=True):
        job = SpanJob(source, target, mapper, src, source_cache, position_ids, seq - span, layers, workspace, features)
        mapped.update(map_span(job, into=into) if into is not None else map_span(job))
    if into is not None:  # written in place: the layers now hold `seq` more tokens
        for layer in cache.layers:
            layer.cumulative_length.add_(seq)
        return cache
    # a target split over devices reads each layer's cache on that layer's device (peft's
    # `map_cache_to_layer_device_map`); `.to` is free where it is the device the mapping ran on
    for t in range(tgt.num_layers):
        keys, values = mapped[t]
        if keys.device != places[t]:
            keys, values = keys.to(places[t]), values.to(places[t])
        append_layer(cache, t, keys, values)
        layer = cache.layers[t]
        if keys.shape[2] < seq and hasattr(layer, "cumulative_length"):  # a sliding layer got only its window
            layer.cumulative_length += seq - keys.shape[2]
    return cache


def _map_span(job: SpanJob) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Maps tokens `[first, seq)` of the target layers `targets`: `{target layer: (keys, values)}`, each
    `(B, H, seq - first, d)` views into one block per step. `features`: `(SourceFeatures, hidden states)` when the
    mapper reads hidden-state blocks (`_check_features`)."""
    source, target, mapper, src, source_cache, position_ids, first, targets, workspace, features = job
    seq = position_ids.shape[-1]
    first_keys, _ = cache_layer_kv(source_cache, 0)
    batch, device = first_keys.shape[0], execution_device(target)
    positions = position_ids[:, first:].to(device)
    strip, rotate = workspace.rotations(source, target, positions)  # the source's inverse, the target's: (B, T, d)
    span = seq - first
    plan, last_use, slots, num_slots, widest, _, chunk = schedule(mapper, batch, span, targets)  # steps, slots, chunk
    heads, dim = mapper.target_kv_heads, mapper.target_head_dim  # of the new cache
    offsets = held_offsets(source_cache, src, plan, seq, first)  # source layer → tokens it has dropped
    outputs = [  # the new cache's tensors, one (2, n, B, H, T, d) block per step: [0] keys, [1] values
        torch.empty((2, len(step_targets), batch, heads, span, dim), dtype=target.dtype, device=device)
        for _, step_targets in plan
    ]
    dtype = mapper.layout_dtype()
    row_space = workspace.buffer("rows", batch * chunk * num_slots * mapper.slot_features, dtype, device)
    out_space = workspace.buffer("mapped", batch * chunk * widest, dtype, device)
    # a mapper in another dtype than the caches (a bfloat16 copy of a float32 mapper): the rotations run in the caches'
    # dtype on scratch copies, since elementwise ops of mixed dtypes take about twice as long
    strip_scratch = rotate_scratch = None
    if dtype != first_keys.dtype:
        strip_scratch = workspace.buffer(
            "strip", batch * chunk * src.num_kv_heads * src.head_dim, first_keys.dtype, device
        )
    if dtype != target.dtype:
        rotate_scratch = workspace.buffer("rotate", batch * chunk * widest // 2, target.dtype, device)
    for start in range(0, span, chunk):
        end = min(start + chunk, span)
        strip_c, rotate_c = strip.narrow(start, end), rotate.narrow(start, end)
        rows = mapper.new_rows(batch, end - start, num_slots, out=row_space)  # (B·c, slots·H_s·2d_s) or so
        loaded: set[int] = set()
        for step, (sources, step_targets) in enumerate(plan):
            for s in sources:
                if s not in loaded and s >= src.num_layers:  # a hidden-state block, as it is (no rotation)
                    part = features[0].piece(features[1], s)[:, first + start : first + end]  # (B, c, W)
                    features[0].write_block(mapper, rows, slots[s], part.to(device))
                    loaded.add(s)
                elif s not in loaded:  # first step that reads source layer s: strip its rotation into its slot
                    keys, values = cache_layer_kv(source_cache, s)  # (B, H, T_held, d), keys post-RoPE
                    lo, hi = first + start - offsets[s], first + end - offsets[s]
                    keys, values = keys[:, :, lo:hi].to(device), values[:, :, lo:hi].to(device)
                    write_keys = strip_c
                    if strip_scratch is not None:  # stripped in the cache's dtype, then copied into the rows

                        def write_keys(k, out, rotation=strip_c):
                            out.copy_(rotation(k, out=strip_scratch[: k.numel()].view(k.shape)))

                    mapper.write_rows(rows, slots[s], keys, values, write_keys=write_keys)
                    loaded.add(s)
            mapped = mapper.map_targets(sources, step_targets, rows, out=out_space, slots=slots)
            loaded -= {s for s in sources if last_use[s] == step}  # their slots go to later layers
            keys_c, values = mapper.split_rows(mapped, batch, end - start, layers=len(step_targets))  # (n,B,H,c,d)
            mapper.project_mapped_keys(keys_c, step_targets)  # onto the target's key-norm sphere, if it has one
            block = outputs[step][:, :, :, :, start:end]  # (2, n, B, H, c, d) view of the cache tensors
            if rotate_scratch is not None:  # rotated in the cache's dtype from a copy of the keys in it
                keys_c = rotate_scratch[: keys_c.numel()].view(keys_c.shape).copy_(keys_c)
            rotate_c(keys_c, out=block[0])
            block[1].copy_(values)
    return {
        t: (kv[0, i], kv[1, i]) for (_, step_targets), kv in zip(plan, outputs) for i, t in enumerate(step_targets)
    }


def _check_features(mapper: KVMapper, src: KVLayout, source_features, hidden_states, batch: int, seq: int):
    """`(source_features, hidden_states)` when `mapper` reads hidden-state blocks (selected source "layers" `≥ L_s`),
    after checking that they are given and cover the cached tokens; `None` for a K/V-only mapper."""
    if max((s for layers in mapper.selected_layers for s in layers), default=-1) < src.num_layers:
        return None
    if source_features is None or hidden_states is None:
        raise InvalidInputError(
            "this mapper reads the source's hidden states beside its K/V (source_features); pass source_features "
            "and hidden_states (the source's output_hidden_states over the cached tokens) to map_cache"
        )
    shape = tuple(hidden_states[0].shape[:2])
    if len(hidden_states) != src.num_layers + 1 or shape != (batch, seq):
        raise InvalidInputError(
            f"hidden_states must be the source's {src.num_layers + 1} output_hidden_states over the {seq} cached "
            f"tokens of {batch} rows, got {len(hidden_states)} of shape {shape}; run the source with "
            "output_hidden_states=True over the same tokens"
        )
    return source_features, hidden_states


def __getattr__(name: str):  # the old names, for one release (CHANGELOG.md)
    return renamed_name(__name__, name, {"mapping_plan": mapping_steps})
