"""The mapping with gradients: a bridge's map of a source cache into the target's cache, written so that autograd
reaches the mapper's weights (`distill` trains them through the frozen target).

The mapping engine (`mappers.engine.map_cache`) runs under `torch.no_grad()` and writes its products into reused
buffers (`out=`, in-place accumulation), which autograd cannot follow. This module computes the same map with plain
out-of-place operations: the source's content-space rows (`content_rows.forward_rows`, RoPE stripped; hidden-state
blocks after them, `SourceFeatures.rows`), each target layer's affine map `cat(rows) @ W + b` with `W = W₀ + ΔW`
(`PreconditionedMap`: the trainable `Δ` in standardised units; the low-rank mapper's two factors each get theirs),
the target's rotary embedding applied out of place. `tests/fitting/test_distill.py` checks it against the engine's
output.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache

from ...errors import MapperError
from ...mappers.base import KVMapper
from ...utils.cache import append_layer, new_target_cache
from ...utils.key_norm import normalized_keys
from ...utils.rope import rotary_cos_sin, rotate_half
from ..content_rows import forward_rows


@torch.no_grad()
def source_rows(bridge, mapper: KVMapper, input_ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """The source's rows of `input_ids` `(B, T)` for every block `mapper` (of `bridge`'s layouts) reads, in its input
    layout (`(B·T, w)`, or `(G, B·T, w)` for grouped maps), float32, on the target's device; no gradient (the source
    is frozen)."""
    from ...mappers.mlp import source_rows_in_layout

    device = bridge.target.device
    features = bridge.source_features
    rows, hidden = forward_rows(bridge.source, input_ids, device, hidden=features is not None)  # (B·T, L_s·H·2d)
    if features is not None:
        rows = torch.cat([rows, features.rows(hidden, device)], dim=-1)  # (B·T, blocks·H·2d)
    width = mapper.x_row
    used = sorted({s for layers in mapper.selected_layers for s in layers})
    return {s: source_rows_in_layout(mapper, rows[:, s * width : (s + 1) * width]).float() for s in used}


def check_linear(mapper: KVMapper) -> bool:
    """Refuses a mapper that is not one affine map per target layer (the MLP mapper, a lazily loaded one); `True` for
    the low-rank mapper (two factors per map)."""
    from ...mappers.lazy import LazyKVMapper
    from ...mappers.low_rank import LowRankKVMapper

    if isinstance(mapper, LazyKVMapper) or type(mapper) not in (KVMapper, LowRankKVMapper):
        raise MapperError(
            f"distill trains linear maps (ridge, ridge_attention_weighted, low_rank), not {type(mapper).__name__}; "
            "load the bridge without lazy_mapper"
        )
    return isinstance(mapper, LowRankKVMapper)


def _affine(mapper: KVMapper, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """`x @ weight + bias` out of place: `x (B·T, p)` with `(1, p, q)`/`(1, q)`, or `(G, B·T, p)` with `(G, ·)`."""
    if mapper.grouped:
        return torch.baddbmm(bias.unsqueeze(1), x, weight)  # (G, B·T, q)
    return torch.addmm(bias[0], x, weight[0])  # (B·T, q)


def _inputs(mapper: KVMapper, target_layer: int, rows: dict[int, torch.Tensor]) -> torch.Tensor:
    return torch.cat([rows[s] for s in mapper.selected_layers[target_layer]], dim=-1)  # (B·T, p) or (G, B·T, p)


class PreconditionedMap(nn.Module):
    """A linear mapper's maps as `θ₀ + Δ`, with `Δ` (the trainable parameters, zero at first) in standardised units:
    `W = W₀ + diag(1/σ_x) ΔW diag(σ_y)`, `b = b₀ + Δb · σ_y` (the low-rank mapper: `A = A₀ + diag(1/σ_x) ΔA`,
    `B = B₀ + ΔB diag(σ_y)`), `σ_x` per input feature and `σ_y` per output feature of the closed-form map on a
    batch of rows. Source keys, values and hidden states live at very different scales; in these units one
    optimiser step moves every weight by about as much of the output.

    Args:
        mapper ([`KVMapper`] or [`LowRankKVMapper`]): its maps `θ₀`, in any dtype (read in float32, a layer at a
            time, never written: `distill` passes the bridge's own mapper); `fold(into)` writes `θ₀ + Δ` into a copy.
        rows (`dict[int, torch.Tensor]`): a batch of source rows (`source_rows`) for the scales.
    """

    def __init__(self, mapper: KVMapper, rows: dict[int, torch.Tensor]):
        super().__init__()
        self.mapper, self.low_rank = mapper, check_linear(mapper)
        self.deltas = nn.ParameterList()
        self.in_scales, self.out_scales = [], []
        with torch.no_grad():
            for t, layer in enumerate(mapper.layers):
                x = _inputs(mapper, t, rows)
                y = self.map_rows(t, rows, closed_form=True)
                groups = mapper.groups if mapper.grouped else 1
                in_scale = x.reshape(groups, -1, x.shape[-1]).std(1)  # (G, p)
                out_scale = y.reshape(groups, -1, y.shape[-1]).std(1)  # (G, q)
                self.in_scales.append(in_scale.clamp_min(1e-6 * float(in_scale.mean()) + 1e-12))
                self.out_scales.append(out_scale.clamp_min(1e-6 * float(out_scale.mean()) + 1e-12))
                shapes = [layer.down.shape, layer.up.shape] if self.low_rank else [layer.weight.shape]
                for shape in [*shapes, layer.bias.shape]:
                    self.deltas.append(nn.Parameter(torch.zeros(shape, device=layer.bias.device)))

    def layer_deltas(self, target_layer: int) -> list[nn.Parameter]:
        per = 3 if self.low_rank else 2
        return list(self.deltas[per * target_layer : per * (target_layer + 1)])

    def weights(self, target_layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(W (G, p, q), b (G, q))` of one target layer: `θ₀ + Δ` (differentiable in `Δ`)."""
        layer = self.mapper.layers[target_layer]
        in_scale, out_scale = self.in_scales[target_layer], self.out_scales[target_layer]
        *factors, bias = self.layer_deltas(target_layer)
        bias = layer.bias.float() + bias * out_scale
        if self.low_rank:
            down = layer.down.float() + factors[0] / in_scale.unsqueeze(-1)  # (G, p, r)
            up = layer.up.float() + factors[1] * out_scale.unsqueeze(1)  # (G, r, q)
            return torch.bmm(down, up), bias
        return layer.weight.float() + factors[0] / in_scale.unsqueeze(-1) * out_scale.unsqueeze(1), bias

    def map_rows(self, target_layer: int, rows: dict[int, torch.Tensor], closed_form: bool = False) -> torch.Tensor:
        """One target layer's mapped rows `(B·T, q)` or `(G, B·T, q)`, out of place (`closed_form`: with `θ₀`)."""
        if closed_form:
            layer = self.mapper.layers[target_layer]
            weight, bias = self.mapper.layer_weight(target_layer).float(), layer.bias.float()
        else:
            weight, bias = self.weights(target_layer)
        return _affine(self.mapper, _inputs(self.mapper, target_layer, rows), weight, bias)

    def squared_norms(self) -> tuple[torch.Tensor, float]:
        """`(‖Δ‖², ‖θ₀‖²)`, the latter in the same standardised units (the pull's ratio)."""
        delta = sum(d.pow(2).sum() for d in self.deltas)
        start = 0.0
        for t, layer in enumerate(self.mapper.layers):
            in_scale, out_scale = self.in_scales[t], self.out_scales[t]
            weight = self.mapper.layer_weight(t).float() * in_scale.unsqueeze(-1) / out_scale.unsqueeze(1)
            start += float(weight.pow(2).sum() + (layer.bias.float() / out_scale).pow(2).sum())
        return delta, start or 1.0

    @torch.no_grad()
    def fold(self, into: KVMapper | None = None) -> KVMapper:
        """Writes `θ₀ + Δ` into the weights of `into` (a copy of the mapper that holds `θ₀`; by default the mapper
        itself) and returns it (a plain mapper of the same shape); `Δ` is zero afterwards."""
        mapper = self.mapper if into is None else into
        for t, layer in enumerate(mapper.layers):
            *factors, bias = self.layer_deltas(t)
            in_scale, out_scale = self.in_scales[t], self.out_scales[t]
            if self.low_rank:
                layer.down.add_(factors[0] / in_scale.unsqueeze(-1))
                layer.up.add_(factors[1] * out_scale.unsqueeze(1))
            else:
                layer.weight.add_(factors[0] / in_scale.unsqueeze(-1) * out_scale.unsqueeze(1))
            layer.bias.add_(bias * out_scale)
            for d in self.layer_deltas(t):
                d.zero_()
        return mapper


def differentiable_map_cache(
    bridge, maps: PreconditionedMap, input_ids: torch.Tensor, rows: dict[int, torch.Tensor] | None = None
) -> DynamicCache:
    """The target cache `bridge.map_cache` builds for the source's prefill of `input_ids` `(B, T)`, computed with
    `maps` (a float32 copy of `bridge.mapper` being trained) with gradients to its `Δ`: every token is mapped (the
    prefill's attention sinks and recomputed tokens are not modelled). `rows` (`source_rows`) skips the source's
    forward.

    Returns:
        `DynamicCache` of `L_t` layers `(B, H_t, T, d_t)` in the target's dtype (autocast decides the matmuls').
    """
    target, mapper = bridge.target, maps.mapper
    batch, seq = input_ids.shape
    rows = source_rows(bridge, mapper, input_ids) if rows is None else rows
    positions = torch.arange(seq, device=target.device).unsqueeze(0).expand(batch, -1)
    cos, sin = rotary_cos_sin(target, positions)  # (B, T, d)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, d)
    cache = new_target_cache(target.config)
    for t in range(len(mapper.selected_layers)):
        keys_c, values = mapper.split_rows(maps.map_rows(t, rows), batch, seq)  # (B, H, T, d) content space
        if mapper.key_norm_gain is not None:  # onto the target's key-norm sphere, as the engine does
            keys_c = normalized_keys(keys_c, mapper.key_norm_gain[t])
        keys = keys_c * cos + rotate_half(keys_c) * sin  # the target's RoPE, out of place
        append_layer(cache, t, keys.to(target.dtype), values.to(target.dtype))
    return cache
