"""The parts of a bridge: checked against each other when it is built (models, config, mapper, residual map), and the
mapper converted to where and in what dtype it computes."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from .errors import KVLayoutError, MapperError
from .mappers.base import KVMapper
from .mappers.lazy import LazyKVMapper
from .transfer.layer_recompute import check_layer_recompute
from .utils.layout import KVLayout, check_fingerprint, check_models, hidden_size
from .utils.source_features import SourceFeatures, check_source_features, source_blocks


def converted_mapper(mapper: KVMapper, device: torch.device, dtype: torch.dtype) -> KVMapper:
    """`mapper` itself when its weights are already on `device` in `dtype`, else a converted copy.

    The copy is made tensor by tensor (the original's weights are never duplicated in their own dtype); weights on
    the meta device (a lazily loaded mapper) stay there and the copy records where they will be loaded.
    """
    tensors = [*mapper.parameters(), *mapper.buffers()]
    floating = [t for t in tensors if t.is_floating_point() and t.device.type != "meta"]
    if all(t.device == device and t.dtype == dtype for t in floating) and not isinstance(mapper, LazyKVMapper):
        return mapper
    memo: dict[int, Any] = {}
    if "_stacked_cache" in mapper.__dict__:  # weights derived from the originals: rebuilt on demand
        memo[id(mapper.__dict__["_stacked_cache"])] = {}
    for tensor in tensors:
        if tensor.device.type == "meta":
            continue
        new = tensor.detach().to(device, dtype if tensor.is_floating_point() else tensor.dtype, copy=True)
        memo[id(tensor)] = (
            nn.Parameter(new, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else new
        )
    return copy.deepcopy(mapper, memo).to(device=device, dtype=dtype)


def check_residual_mapper(residual_mapper, config, source, target, source_name: str, target_name: str) -> None:
    """Refuses a residual map that does not fit the two models (hidden sizes, source hidden states) or the config."""
    sizes = (residual_mapper.source_hidden, residual_mapper.target_hidden)
    if sizes != (hidden_size(source), hidden_size(target)):
        raise MapperError(
            f"the residual map maps hidden size {sizes[0]} to {sizes[1]}, but source {source_name!r} has "
            f"{hidden_size(source)} and target {target_name!r} has {hidden_size(target)}; use the models it was "
            "calibrated for"
        )
    states = {s for layers in residual_mapper.selected_layers for s in layers}
    layers = source.config.get_text_config(decoder=True).num_hidden_layers
    if states and max(states) > layers:
        raise MapperError(
            f"the residual map reads source hidden state {max(states)} but source {source_name!r} has {layers + 1}; "
            "use the source it was calibrated for"
        )
    if config.calibrated_recompute_layers != residual_mapper.recompute_layers:
        raise MapperError(
            f"the residual map holds recompute_layers {residual_mapper.recompute_layers} but config.residual_map "
            f"records {config.calibrated_recompute_layers}; pass the config it was saved with"
        )


def check_bridge_parts(
    config, source, target, mapper, residual_mapper=None
) -> tuple[KVLayout, KVLayout, SourceFeatures | None]:
    """Checks the parts of a bridge against each other before it is built: the two models against the config's
    fingerprints, the mapper's layers, heads and source blocks against the models, the residual map of layer recompute
    against the models and the config, and `config.recompute_layers` against what the bridge can run.

    Returns:
        `(source_layout, target_layout, source_features)`: the models' [`KVLayout`]s and the hidden-state feature
        blocks the mapper reads (`None`: K/V only).
    """
    source_name = config.source_name_or_path or source.config.name_or_path
    target_name = config.target_name_or_path or target.config.name_or_path
    source_layout, target_layout = check_models(source, target, source_name, target_name)
    if config.source_fingerprint is not None:
        check_fingerprint(config.source_fingerprint, source_layout, "source", source_name)
    if config.target_fingerprint is not None:
        check_fingerprint(config.target_fingerprint, target_layout, "target", target_name)
    if len(mapper.selected_layers) != target_layout.num_layers:
        raise MapperError(
            f"mapper has {len(mapper.selected_layers)} target layers but target {target_name!r} has "
            f"{target_layout.num_layers}; calibrate a bridge for this target"
        )
    src, tgt = source_layout, target_layout
    shapes = (mapper.source_kv_heads, mapper.source_head_dim, mapper.target_kv_heads, mapper.target_head_dim)
    if shapes != (src.num_kv_heads, src.head_dim, tgt.num_kv_heads, tgt.head_dim):
        raise KVLayoutError(
            f"mapper maps {shapes[0]} KV heads × {shapes[1]} to {shapes[2]} × {shapes[3]}, but source "
            f"{source_name!r} has {src.num_kv_heads} × {src.head_dim} and target {target_name!r} has "
            f"{tgt.num_kv_heads} × {tgt.head_dim}; use the models the mapper was calibrated for"
        )
    features = SourceFeatures.from_config(config)
    if features is not None:
        check_source_features(features, source_layout, hidden_size(source), source_name)
    blocks = source_blocks(features, source_layout.num_layers)
    used = {layer for layers in mapper.selected_layers for layer in layers}
    if used and max(used) >= blocks:
        raise MapperError(
            f"mapper reads source layer {max(used)} but source {source_name!r} has "
            f"{source_layout.num_layers} layers"
            + (f" and {blocks - source_layout.num_layers} hidden-state feature blocks" if features else "")
            + "; use the source the mapper was calibrated for (and its config's source_features)"
        )
    if residual_mapper is not None:
        check_residual_mapper(residual_mapper, config, source, target, source_name, target_name)
    check_layer_recompute(config, target_layout, residual_mapper)  # refused here, before any prompt
    return source_layout, target_layout, features
