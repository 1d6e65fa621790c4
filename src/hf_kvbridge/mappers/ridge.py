"""Centered ridge regression from sufficient statistics, and the linear `KVMapper` it produces.

For target layer `t` and head group `g` (all heads at once in `all_heads` mode, one head in `same_head` mode):

    W = (C_xx + λ·D)⁻¹ C_xy,   b = ȳ − x̄ W,   D = diag(C_xx)

`C` are covariances (centered sums divided by the token count), so λ is *relative to each input feature's own
variance* — the same as plain ridge on standardized (z-scored) inputs. It does not change with the number of
calibration tokens or with the scale of any feature (keys and values live at very different scales).
λ = 0.01 adds 1 % of each feature's variance to its diagonal entry.
"""

from __future__ import annotations

import torch
from torch import nn

from ..constants import HEAD_MODES
from ..statistics import KVStatistics, StatisticsError


def solve_ridge(
    stats: KVStatistics, x_idx: torch.Tensor, y_idx: torch.Tensor, ridge_lambda: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fits `y[y_idx] ≈ x[x_idx] W + b` by centered ridge in float64.

    Returns:
        `(weight (p, q), bias (q,))`, float64.

    Raises:
        `StatisticsError` if there are no more tokens than features, or the statistics are not finite.
    """
    p = x_idx.numel()
    if stats.count <= p:
        raise StatisticsError(
            f"fewer calibration tokens ({stats.count}) than mapper input features ({p}); use more or longer "
            "calibration sequences, a smaller top_k, or head_mode='same_head'"
        )
    mx, my, cxx, cxy, _ = stats.moments(x_idx, y_idx)
    if not (torch.isfinite(cxx).all() and torch.isfinite(cxy).all()):
        raise StatisticsError("NaN/Inf in calibration statistics; cannot fit the mapper")
    variance = torch.diagonal(cxx)
    # each feature's own variance (floored so a constant feature still gets a ridge): ridge on standardized inputs
    scale = variance.clamp_min(1e-6 * variance.mean().clamp_min(torch.finfo(torch.float64).tiny))
    system = cxx + torch.diag(ridge_lambda * scale)
    chol, info = torch.linalg.cholesky_ex(system)
    if info.item() == 0:
        weight = torch.cholesky_solve(cxy, chol)  # (p, q)
    else:  # λ = 0 on rank-deficient inputs: minimum-norm least squares
        weight = torch.linalg.lstsq(system, cxy, driver="gelsd").solution
    bias = my - mx @ weight
    return weight, bias


class LayerMap(nn.Module):
    """The affine map of one target layer: `weight (G, p_g, out_g)`, `bias (G, out_g)`, `G` head groups."""

    def __init__(self, groups: int, in_features: int, out_features: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(groups, in_features, out_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(groups, out_features, dtype=dtype), requires_grad=False)


class KVMapper(nn.Module):
    """Maps content-space source KV rows to content-space target KV rows, one target layer at a time.

    Args:
        selected_layers (`list[list[int]]`): for each target layer, the source layers whose rows are concatenated,
            in this order (the order is part of the artifact).
        num_kv_heads (`int`), head_dim (`int`): the shared KV layout.
        head_mode (`str`): `"all_heads"` (each target head sees all heads of the selected layers) or `"same_head"`
            (head h sees only head h).

    Example:

    ```python
    >>> mapper = KVMapper([[0], [1, 0]], num_kv_heads=2, head_dim=4, head_mode="same_head")
    >>> rows = [torch.randn(1, 5, 2 * 2 * 4)] * 2  # (B, T, H·2d) per selected source layer
    >>> mapper.map_layer(1, rows).shape
    torch.Size([1, 5, 16])
    ```
    """

    def __init__(self, selected_layers: list[list[int]], num_kv_heads: int, head_dim: int, head_mode: str):
        super().__init__()
        if head_mode not in HEAD_MODES:
            raise ValueError(f"head_mode must be one of {HEAD_MODES}, got {head_mode!r}")
        self.selected_layers = [list(map(int, layers)) for layers in selected_layers]
        self.num_kv_heads, self.head_dim, self.head_mode = num_kv_heads, head_dim, head_mode
        row = num_kv_heads * 2 * head_dim
        span = 2 * head_dim
        self.layers = nn.ModuleList(
            LayerMap(1, len(layers) * row, row)
            if head_mode == "all_heads"
            else LayerMap(num_kv_heads, len(layers) * span, span)
            for layers in self.selected_layers
        )

    @classmethod
    def from_statistics(
        cls,
        stats: KVStatistics,
        selected_layers: list[list[int]],
        head_mode: str,
        ridge_lambda: float,
    ) -> KVMapper:
        """Solves the ridge problems of every target layer (and head, in `same_head` mode)."""
        mapper = cls(selected_layers, stats.num_kv_heads, stats.head_dim, head_mode)
        for t, layers in enumerate(mapper.selected_layers):
            layer_map = mapper.layers[t]
            heads = [None] if head_mode == "all_heads" else range(stats.num_kv_heads)
            for g, head in enumerate(heads):
                weight, bias = solve_ridge(
                    stats, stats.source_index(layers, head), stats.target_index(t, head), ridge_lambda
                )
                layer_map.weight.data[g] = weight.to(layer_map.weight.dtype)
                layer_map.bias.data[g] = bias.to(layer_map.bias.dtype)
        return mapper

    def map_layer(self, target_layer: int, rows: list[torch.Tensor]) -> torch.Tensor:
        """Maps the selected source layers' rows to target layer `target_layer`'s rows.

        Args:
            rows (`list[torch.Tensor]`): one `(B, T, H·2d)` tensor per selected source layer, in the selected order,
                keys in content space (RoPE stripped).

        Returns:
            `torch.Tensor` of shape `(B, T, H·2d)`: target keys (content space) and values.
        """
        layer_map = self.layers[target_layer]
        weight, bias = layer_map.weight, layer_map.bias
        batch, seq, row = rows[0].shape
        if self.head_mode == "all_heads":
            x = torch.cat([r.to(weight.dtype) for r in rows], dim=-1)  # (B, T, k·H·2d)
            return torch.addmm(bias[0], x.view(batch * seq, -1), weight[0]).view(batch, seq, row)
        heads, span = self.num_kv_heads, 2 * self.head_dim
        x = torch.cat([r.to(weight.dtype).view(batch, seq, heads, span) for r in rows], dim=-1)  # (B, T, H, k·2d)
        x = x.permute(2, 0, 1, 3).reshape(heads, batch * seq, -1)  # (H, B·T, k·2d)
        y = torch.baddbmm(bias.unsqueeze(1), x, weight)  # (H, B·T, 2d)
        return y.view(heads, batch, seq, span).permute(1, 2, 0, 3).reshape(batch, seq, row)
