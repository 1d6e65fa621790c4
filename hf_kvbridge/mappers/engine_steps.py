"""The steps of a mapping, shared by the engine's schedules (`hf_kvbridge.mappers.engine`): which target layers map
together (`mapping_steps`), where the chunked schedule keeps each source layer's rows (`row_slots`), and how many
tokens each source layer the plan reads has dropped (`held_offsets`); and what a schedule maps (`SpanJob`)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn
from transformers import Cache

from ..errors import KVLayoutError, renamed_name
from ..utils.cache import cache_layer_kv
from ..utils.layout import KVLayout
from .base import KVMapper


class SpanJob(NamedTuple):
    """What a schedule maps (`map_cache` makes one per span of kept tokens): tokens `[first, seq)` of the target
    layers `targets` (full-attention layers keep every token, sliding ones their window)."""

    source: nn.Module
    target: nn.Module
    mapper: KVMapper
    src: KVLayout  # the source cache's layout
    source_cache: Cache
    position_ids: torch.Tensor  # (B, seq)
    first: int
    targets: set[int]
    workspace: Any  # the engine's `Workspace`: rotation tables and reused buffers
    features: tuple | None = None  # (SourceFeatures, hidden states) when the mapper reads hidden-state blocks


def mapping_steps(
    mapper: KVMapper, targets: set[int] | None = None, ascending: bool = False
) -> list[tuple[list[int], list[int]]]:
    """`(source layers in input order, target layers)` steps covering every target layer (of `targets`) once.

    Target layers that read the same set of source layers are one step (`mapper.map_targets` maps them with one wide
    product of their stacked weights) when the mapper is `groupable` and their weights are at most
    `mapper.max_group_bytes`; otherwise each is a step of its own, in its selected order, or with `ascending=True`
    (the `"layers"` schedule, whose row slots are in layer order) in ascending order, so that layers side by side in
    the rows are one product (the mapper keeps a copy of such a layer's weights with their rows reordered)."""
    chosen = [(t, layers) for t, layers in enumerate(mapper.selected_layers) if targets is None or t in targets]
    if not mapper.groupable:
        return [(list(layers), [t]) for t, layers in chosen]
    groups: dict[tuple[int, ...], list[int]] = {}
    for t, layers in chosen:
        groups.setdefault(tuple(sorted(layers)), []).append(t)
    plan = []
    for sources, group in groups.items():
        size = sum(p.numel() * p.element_size() for t in group for p in mapper.layers[t].parameters())
        if len(group) > 1 and size <= mapper.max_group_bytes:
            plan.append((list(sources), group))
        else:
            plan.extend((list(sources) if ascending else list(mapper.selected_layers[t]), [t]) for t in group)
    return sorted(plan, key=lambda step: step[1][0])


def row_slots(
    plan: list[tuple[list[int], list[int]]], last_use: dict[int, int] | None = None
) -> tuple[dict[int, int], int]:
    """Where `map_cache` keeps each source layer's rows within a chunk: `(slot of each source layer, slots)`.

    A source layer takes the lowest free slot when the first step that reads it comes, and frees it after the
    last one, so the buffer holds the layers that are live at once (about `top_k + 1` when each target layer
    reads the source layers of about its own relative depth), not all of them. A step's layers are placed in
    ascending order, so consecutive layers read together sit side by side (read as a view, not gathered)."""
    if last_use is None:
        last_use = {s: step for step, (sources, _) in enumerate(plan) for s in sources}
    slot_of: dict[int, int] = {}
    free: list[int] = []
    slots = 0
    for step, (sources, _) in enumerate(plan):
        for s in sorted(sources):
            if s not in slot_of:
                if free:
                    slot_of[s] = free.pop(0)
                else:
                    slot_of[s], slots = slots, slots + 1
        free = sorted(free + [slot_of[s] for s in sources if last_use[s] == step])
    return slot_of, slots


def held_offsets(source_cache: Cache, src: KVLayout, plan, seq: int, first: int) -> dict[int, int]:
    """Tokens each source layer the plan reads has dropped (a sliding layer holds only its last ones), checked
    against the first token mapped."""
    offsets = {}
    for sources, _ in plan:
        for s in sources:
            if s >= src.num_layers:  # a hidden-state block: the source's hidden states cover every token
                offsets[s] = 0
                continue
            held = cache_layer_kv(source_cache, s)[0].shape[2]
            offsets[s] = seq - held
            if offsets[s] > first:
                raise KVLayoutError(
                    f"source layer {s} holds only its last {held} of {seq} tokens, but the mapper reads it for "
                    f"tokens from {first} on (a sliding-window layer chosen for a layer that needs more tokens); "
                    "recalibrate so that selection keeps such layers for sliding-window target layers only"
                )
    return offsets


def __getattr__(name: str):  # the old names, for one release (CHANGELOG.md)
    return renamed_name(__name__, name, {"mapping_plan": mapping_steps})
