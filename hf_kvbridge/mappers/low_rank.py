"""`mapper_type="low_rank"`: reduced-rank ridge, `W ≈ A B` with `A (p, r)`, `B (r, q)`, for cheaper mapping.

For target layer `t` and head group `g` the ridge solution `W (p, q)` is truncated to the rank-`r` map whose
predictions are closest to the full ridge's, in each output feature's own units (the fitted outputs are divided by
their standard deviations, so keys and values weigh alike):

    M = S⁻¹ Wᵀ C_xx W S⁻¹,  S = diag(σ_y);   U_r = top-r eigenvectors of M
    A = W S⁻¹ U_r,  B = U_rᵀ S,  b = ȳ − x̄ A B

This is reduced-rank regression on top of ridge: of all rank-r maps it loses the least of the ridge map's explained
variance, measured on the calibration inputs. Mapping a token costs `2 (p + q) r` FLOPs instead of `2 p q`, so
`r < p q / (p + q)` is cheaper; at `r ≥ min(p, q)` the map is the full ridge one.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import MapperError, moved_names
from .base import KVMapper, MapperType


class LowRankLayerMap(nn.Module):
    """The rank-`r` affine map of one target layer: `down (G, p, r)`, `up (G, r, q)`, `bias (G, q)`."""

    def __init__(self, groups: int, in_features: int, out_features: int, rank: int, dtype=torch.float32):
        super().__init__()
        self.down = nn.Parameter(torch.zeros(groups, in_features, rank, dtype=dtype), requires_grad=False)
        self.up = nn.Parameter(torch.zeros(groups, rank, out_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(groups, out_features, dtype=dtype), requires_grad=False)


class LowRankKVMapper(KVMapper):
    """`KVMapper` with each target layer's map factored as `x A B + b` (rank `rank`).

    Target layers that read the same source layers share one product with all their `A` stacked, then one small
    product each with their `B`.

    Args:
        selected_layers, num_kv_heads, head_dim, head_mode: as for [`KVMapper`].
        rank (`int`, keyword only): the rank of every target layer's (and, in `same_head` mode, every head's) map. With
            `kv_mode="separate"` that map is block-diagonal (keys from keys, values from values) and each block gets
            half of it, `⌈rank/2⌉`, so it costs half the joint map's weights and FLOPs, as the full maps do.
        kv_mode, target_kv_heads, target_head_dim (*optional*): as for [`KVMapper`].

    Example:

    ```python
    >>> mapper = LowRankKVMapper([[0], [1, 0]], num_kv_heads=2, head_dim=4, head_mode="all_heads", rank=3)
    >>> mapper.flops_per_token()  # 2·(16 + 16)·3 + 2·(32 + 16)·3, against 2·(16·16 + 32·16) = 1536 at full rank
    480
    >>> rows = [mapper.layout_rows(torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4))] * 2
    >>> mapper.map_layer(1, rows).shape  # (B·T, H·2d)
    torch.Size([5, 16])
    ```
    """

    def __init__(self, *layout, rank: int, **options):
        if rank < 1:
            raise MapperError(f"rank must be ≥ 1, got {rank}")
        self.rank = int(rank)
        super().__init__(*layout, **options)

    @classmethod
    def from_config(cls, config, layout) -> LowRankKVMapper:
        if "rank" not in (config.mapper_kwargs or {}):
            raise MapperError("a low_rank mapper's config lacks mapper_kwargs['rank']; save it with its rank")
        return super().from_config(config, layout, rank=config.mapper_kwargs["rank"])

    @property
    def group_rank(self) -> int:
        """Rank of one head group's map: `rank`, or `⌈rank/2⌉` per K and per V map with `kv_mode="separate"`."""
        return self.rank if self.kv_mode == "joint" else -(-self.rank // 2)

    def make_layer(self, groups: int, in_features: int, out_features: int) -> nn.Module:
        return LowRankLayerMap(groups, in_features, out_features, min(self.group_rank, in_features, out_features))

    def flops_per_token(self) -> int:
        return sum(2 * (layer.down.numel() + layer.up.numel()) for layer in self.layers)

    def layer_weight(self, target_layer: int) -> torch.Tensor:
        layer = self.layers[target_layer]
        return torch.bmm(layer.down, layer.up)  # (G, p, q)

    def _stack(self, sources: list[int], targets: list[int]):
        """`A` of `targets` side by side `(G, k·span, n·r)` (input rows in `sources` order), and their `B` `(G·n, r,
        q)` and bias `(G·n, 1, q)` stacked for one batched product (groups outer; `G = 1` for `all_heads` + `joint`).
        The targets of a step read the same source layers, so their maps have one shape and one rank."""
        layers = [self.layers[t] for t in targets]
        down = torch.cat([self._in_source_order(self.layers[t].down, t, sources) for t in targets], dim=2)
        up = torch.stack([layer.up for layer in layers], 1).flatten(0, 1)  # (G·n, r, q)
        bias = torch.stack([layer.bias for layer in layers], 1).flatten(0, 1).unsqueeze(1)  # (G·n, 1, q)
        return down, up, bias

    def map_layer(self, target_layer: int, rows: list[torch.Tensor]) -> torch.Tensor:
        """`(x A) B + b` for the selected source layers' rows (see [`KVMapper.map_layer`])."""
        layer = self.layers[target_layer]
        hidden = self.accumulated_product(rows, layer.down)  # (B·T, r) or (G, B·T, r)
        if not self.grouped:
            return torch.addmm(layer.bias[0], hidden, layer.up[0])  # (B·T, H·2d)
        return torch.baddbmm(layer.bias.unsqueeze(1), hidden, layer.up)  # (G, B·T, q)

    # `map_targets` writes layers first (one batched product per layer): `split_rows(..., layers=n)` reads this
    targets_orders = {
        ("separate", "all_heads"): "knbthd",
        ("separate", "same_head"): "khnbtd",
        ("joint", "all_heads"): "nbthkd",
        ("joint", "same_head"): "hnbtkd",
    }

    def map_targets(
        self,
        sources: list[int],
        targets: list[int],
        rows: torch.Tensor,
        out: torch.Tensor | None = None,
        slots: dict[int, int] | None = None,
    ) -> torch.Tensor:
        """One product of the inputs with every target's `A`, then one batched product with their `B`.

        Returns:
            the targets' rows in a groups-then-layers layout, `(G·n, B·T, q)`: `(n, B·T, H·2d)` for `all_heads` +
            `joint`, `(H·n, B·T, 2d)` (heads outer) for `same_head`, K then V outermost with `kv_mode="separate"`;
            `split_rows(..., layers=n)` reads it.
        """
        down, up, bias = self._stacked(sources, targets)
        hidden = self.step_product(sources, rows, down, slots=slots)  # (B·T, n·r) or (G, B·T, n·r)
        n, r, tokens = len(targets), up.shape[1], hidden.shape[-2]
        hidden = hidden.view(-1, tokens, n, r).transpose(1, 2).flatten(0, 1)  # (G·n, B·T, r)
        shape = (up.shape[0], tokens, up.shape[2])  # (G·n, B·T, q)
        result = None if out is None else out[: math.prod(shape)].view(shape)
        return torch.baddbmm(bias, hidden, up, out=result)


# fitted by hf_kvbridge.fitting.mapper_fits.low_rank.fit_low_rank; not linear (no lazy loading)
MAPPER = MapperType(
    "low_rank",
    LowRankKVMapper,
    description="each ridge map reduced to rank `rank` (two factors): fewer FLOPs and bytes",
)


__getattr__ = moved_names(__name__, ("reduce_rank", "fit_low_rank"), "hf_kvbridge.fitting.mapper_fits.low_rank")
