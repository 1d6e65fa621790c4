"""`mapper_type="mlp"`: a small residual MLP per (target layer, head group) on top of the ridge map.

For target layer `t` and head group `g` (all heads at once in `all_heads` mode, one head in `same_head` mode; with
`kv_mode="separate"` the keys and the values of each are two groups, so the key residual reads source keys only and
the value residual source values only, like the ridge maps under them):

    ŷ = x W + b  +  (gelu(z W₁ + b₁) W₂ + b₂) · σ_y,     z = (x − μ_x) / σ_x

`W, b` are the ridge solution and stay fixed; only `W₁, b₁, W₂, b₂` are trained. `W₂` and `b₂` start at zero, so an
untrained MLP mapper maps exactly as its ridge base. `μ_x, σ_x` (per input feature) and `σ_y` (per output feature)
are fixed preconditioners taken from the first training batch: source keys and values live at very different
scales, and so do the target's.

Training streams the calibration windows: every batch re-runs the source (and the target) and is dropped after
its step, so memory does not grow with the number of windows. Two losses:

- `"mse"`: squared error of the content-space K/V, each feature divided by its `σ_y` (keys and values count alike);
- `"attention"`: the target's own queries attend (causally) over the mapped and over the true K/V of the layer,
  and the squared error of the two attention outputs after `o_proj`, relative to the true output's energy, is
  minimised: error in directions the target's attention ignores costs nothing.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from ..constants import MLP_LOSSES
from ..errors import moved_names
from .base import KVMapper, MapperType

logger = logging.getLogger(__name__)

LOSSES = MLP_LOSSES  # named in `constants`, where the command line reads them


class ResidualMLP(nn.Module):
    """`G` independent two-layer MLPs `(G, N, p) → (G, N, q)`, batched; the last layer starts at zero."""

    def __init__(self, groups: int, in_features: int, out_features: int, hidden: int):
        super().__init__()
        self.register_buffer("in_mean", torch.zeros(groups, in_features))
        self.register_buffer("in_scale", torch.ones(groups, in_features))
        self.register_buffer("out_scale", torch.ones(groups, out_features))
        # trainable only inside `train_mlp_mapper`; a loaded mapper is inference-only like the ridge one
        self.w1 = nn.Parameter(torch.zeros(groups, in_features, hidden), requires_grad=False)
        self.b1 = nn.Parameter(torch.zeros(groups, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.zeros(groups, hidden, out_features), requires_grad=False)
        self.b2 = nn.Parameter(torch.zeros(groups, out_features), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = (x - self.in_mean.unsqueeze(1)) / self.in_scale.unsqueeze(1)  # (G, N, p)
        h = nn.functional.gelu(torch.baddbmm(self.b1.unsqueeze(1), z, self.w1))  # (G, N, hidden)
        return torch.baddbmm(self.b2.unsqueeze(1), h, self.w2) * self.out_scale.unsqueeze(1)  # (G, N, q)


class MLPKVMapper(KVMapper):
    """A [`KVMapper`] plus a residual MLP per target layer and head group (see the module docstring).

    Same interface as the ridge mapper (`layout_rows`, `map_layer`, `split_rows`), so `map_cache` uses it unchanged.

    Args:
        selected_layers, num_kv_heads, head_dim, head_mode: as for [`KVMapper`].
        hidden (`int`, *optional*, defaults to `256`; keyword only): hidden width of each target layer's (head's,
            in `same_head` mode) MLP; with `kv_mode="separate"` the keys' and the values' MLPs get `⌈hidden/2⌉`
            each, so the residual costs half the joint one's weights and FLOPs, as the ridge part does.
        kv_mode, target_kv_heads, target_head_dim (*optional*): as for [`KVMapper`].

    Example:

    ```python
    >>> ridge = KVMapper([[0], [1, 0]], num_kv_heads=2, head_dim=4, head_mode="all_heads")
    >>> mlp = MLPKVMapper.from_linear(ridge, hidden=8)
    >>> rows = [mlp.layout_rows(torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4))] * 2
    >>> torch.equal(mlp.map_layer(1, rows), ridge.map_layer(1, rows))  # zero-initialised residual
    True
    ```
    """

    groupable = False  # map_layer adds a nonlinear residual per layer

    def __init__(self, *layout, hidden: int = 256, **options):
        super().__init__(*layout, **options)
        self.hidden = int(hidden)
        group_hidden = self.hidden if self.kv_mode == "joint" else -(-self.hidden // 2)
        self.residuals = nn.ModuleList(
            ResidualMLP(*layer_map.weight.shape, group_hidden)
            for layer_map in self.layers  # (G, p, q)
        )

    @classmethod
    def from_config(cls, config, layout) -> MLPKVMapper:
        return super().from_config(config, layout, hidden=(config.mapper_kwargs or {}).get("hidden", 256))

    @classmethod
    def from_linear(cls, linear: KVMapper, hidden: int = 256, seed: int = 0) -> MLPKVMapper:
        """An MLP mapper whose linear part is a copy of `linear` and whose residual is zero (so it maps the same).

        The first MLP layer is drawn with a seeded generator (`N(0, 1/p)`), so the result is reproducible.
        """
        mapper = cls(
            linear.selected_layers,
            linear.source_kv_heads,
            linear.source_head_dim,
            linear.head_mode,
            hidden=hidden,
            kv_mode=linear.kv_mode,
            **linear.head_kwargs(),
        )
        mapper.layers.load_state_dict(linear.layers.state_dict())
        generator = torch.Generator().manual_seed(seed)
        for residual in mapper.residuals:
            fan_in = residual.w1.shape[1]
            residual.w1.data.copy_(torch.randn(residual.w1.shape, generator=generator) / math.sqrt(fan_in))
        return mapper.to(linear.layers[0].weight.device)

    def flops_per_token(self) -> int:
        """The ridge part's FLOPs plus the residual MLPs' two products."""
        mlp = sum(2 * (r.w1.numel() + r.w2.numel()) for r in self.residuals)
        return super().flops_per_token() + mlp

    def residual(self, target_layer: int, rows: list[torch.Tensor]) -> torch.Tensor:
        """The MLP's correction for `target_layer`, in the mapper's layout (same shape as `map_layer`'s output)."""
        x = torch.cat(rows, dim=-1)  # (B·T, k·H_s·2d_s) all_heads + joint, else (G, B·T, p)
        if not self.grouped:
            return self.residuals[target_layer](x.unsqueeze(0)).squeeze(0)  # (B·T, H·2d)
        return self.residuals[target_layer](x)  # (G, B·T, q)

    def map_layer(self, target_layer: int, rows: list[torch.Tensor]) -> torch.Tensor:
        """The ridge map of the selected source layers' rows plus the MLP's correction (see [`KVMapper.map_layer`])."""
        return super().map_layer(target_layer, rows) + self.residual(target_layer, rows)

    @torch.no_grad()
    def set_normalisation(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Sets `μ_x, σ_x, σ_y` of every target layer from one batch of rows.

        Args:
            x (`torch.Tensor` of shape `(N, L_s·H_s·2d_s)`), y (`(N, L_t·H_t·2d_t)`): content-space rows
                (`cache_rows`).
        """
        xw, yw = self.x_row, self.y_row
        for t, layers in enumerate(self.selected_layers):
            inputs = torch.cat([source_rows_in_layout(self, x[:, s * xw : (s + 1) * xw]) for s in layers], dim=-1)
            outputs = rows_in_layout(self, y[:, t * yw : (t + 1) * yw])
            if not self.grouped:  # one head group
                inputs, outputs = inputs.unsqueeze(0), outputs.unsqueeze(0)
            residual = self.residuals[t]
            in_std, out_std = inputs.std(1), outputs.std(1)  # (G, p), (G, q)
            residual.in_mean.copy_(inputs.mean(1))
            # a constant feature must not divide by ~0
            residual.in_scale.copy_(in_std.clamp_min(1e-6 * float(in_std.mean()) + 1e-12))
            residual.out_scale.copy_(out_std.clamp_min(1e-6 * float(out_std.mean()) + 1e-12))


def rows_in_layout(mapper: KVMapper, rows: torch.Tensor) -> torch.Tensor:
    """One target layer's `(N, H_t·2d_t)` content-space rows (a slice of `cache_rows`) in `mapper`'s output layout.

    `(N, H_t·2d_t)` for `all_heads` (unchanged), `(H_t, N, 2d_t)` for `same_head` (a view); with
    `kv_mode="separate"` the keys then the values: `(2, N, H_t·d_t)` and `(2·H_t, N, d_t)` (copies).
    """
    n, heads, dim = rows.shape[0], mapper.target_kv_heads, mapper.target_head_dim
    if mapper.kv_mode == "joint":
        return rows if mapper.head_mode == "all_heads" else rows.view(n, heads, 2 * dim).transpose(0, 1)
    kv = rows.view(n, heads, 2, dim)
    if mapper.head_mode == "all_heads":
        return kv.permute(2, 0, 1, 3).reshape(2, n, heads * dim)  # (2, N, H·d)
    return kv.permute(2, 1, 0, 3).reshape(2 * heads, n, dim)  # (2·H, N, d): K of every head, then V


def source_rows_in_layout(mapper: KVMapper, rows: torch.Tensor) -> torch.Tensor:
    """One source layer's `(N, H_s·2d_s)` content-space rows in `mapper`'s input layout: `rows` itself for
    `all_heads` + `joint`, else a `(G, N, p)` copy in the mapper's dtype (`KVMapper.layout_rows`), each group's
    source heads (a copy for each target head that shares one), keys and values interleaved or apart as `kv_mode`
    says."""
    if not mapper.grouped:
        return rows
    heads = rows.view(rows.shape[0], mapper.source_kv_heads, 2, mapper.source_head_dim).transpose(0, 1)  # (H, N, 2, d)
    return mapper.layout_rows(heads[:, :, 0].unsqueeze(0), heads[:, :, 1].unsqueeze(0))  # keys, values (1, H, N, d)


def rows_from_layout(mapper: KVMapper, mapped: torch.Tensor) -> torch.Tensor:
    """Inverse of `rows_in_layout`: a layer's mapped rows back to `(N, H_t·2d_t)`."""
    n, heads, dim = mapped.shape[-2], mapper.target_kv_heads, mapper.target_head_dim
    if mapper.kv_mode == "joint":
        return mapped if mapper.head_mode == "all_heads" else mapped.transpose(0, 1).reshape(n, -1)  # (N, H·2d)
    if mapper.head_mode == "all_heads":
        kv = mapped.view(2, n, heads, dim).permute(1, 2, 0, 3)  # (N, H, 2, d)
    else:
        kv = mapped.view(2, heads, n, dim).permute(2, 1, 0, 3)  # (N, H, 2, d)
    return kv.reshape(n, -1)  # (N, H·2d)


# fitted by hf_kvbridge.fitting.mapper_fits.mlp.train_mlp_mapper; not linear (no lazy loading)
MAPPER = MapperType(
    "mlp",
    MLPKVMapper,
    description="a residual MLP per target layer on top of the ridge map, trained on the calibration windows",
)


__getattr__ = moved_names(__name__, ("train_mlp_mapper",), "hf_kvbridge.fitting.mapper_fits.mlp")
