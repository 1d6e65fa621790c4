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
    >>> keys = values = torch.randn(1, 2, 5, 4)  # (B, H, T, d) of one source layer
    >>> rows = [mapper.layout_rows(keys, values)] * 2  # one per selected source layer
    >>> mapped = mapper.map_layer(1, rows)  # (H, B·T, 2d)
    >>> [t.shape for t in mapper.split_rows(mapped, batch=1, seq=5)]
    [torch.Size([1, 2, 5, 4]), torch.Size([1, 2, 5, 4])]
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

    def layout_dtype(self) -> torch.dtype:
        """dtype of the mapper's inputs (its weights' dtype)."""
        return self.layers[0].weight.dtype

    def materialize(self, target_layer: int) -> None:
        """Makes target layer `target_layer`'s weights available; a no-op here (see `LazyKVMapper`)."""

    def release(self, target_layer: int) -> None:
        """Lets go of target layer `target_layer`'s weights after mapping; a no-op here (see `LazyKVMapper`)."""

    def layout_rows(self, keys: torch.Tensor, values: torch.Tensor, write_keys=None) -> torch.Tensor:
        """One source layer's keys and values, `(B, H, T, d)` each, in the mapper's input layout: `(B·T, H·2d)` for
        `all_heads`, `(H, B·T, 2d)` for `same_head`; per head the key then the value.

        Args:
            write_keys (`Callable`, *optional*): `write_keys(keys, out)` writes the keys into `out` (a `(B, H, T, d)`
                view of the buffer); used to strip RoPE straight into the buffer. Defaults to a copy.
        """
        batch, heads, seq, dim = values.shape
        dtype = self.layout_dtype()
        if self.head_mode == "all_heads":
            rows = torch.empty(batch, seq, heads, 2, dim, dtype=dtype, device=values.device)
            key_view, value_view = rows[:, :, :, 0].transpose(1, 2), rows[:, :, :, 1].transpose(1, 2)
        else:
            rows = torch.empty(heads, batch, seq, 2, dim, dtype=dtype, device=values.device)
            key_view, value_view = rows[:, :, :, 0].transpose(0, 1), rows[:, :, :, 1].transpose(0, 1)
        if write_keys is None:
            key_view.copy_(keys)
        else:
            write_keys(keys, key_view)
        value_view.copy_(values)
        if self.head_mode == "all_heads":
            return rows.view(batch * seq, heads * 2 * dim)
        return rows.view(heads, batch * seq, 2 * dim)

    def split_rows(self, mapped: torch.Tensor, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse of `layout_rows` for the output: content-space keys and values `(B, H, T, d)` (views)."""
        heads, dim = self.num_kv_heads, self.head_dim
        if self.head_mode == "all_heads":
            kv = mapped.view(batch, seq, heads, 2, dim).permute(3, 0, 2, 1, 4)  # (2, B, H, T, d)
        else:
            kv = mapped.view(heads, batch, seq, 2, dim).permute(3, 1, 0, 2, 4)  # (2, B, H, T, d)
        return kv[0], kv[1]

    def map_layer(self, target_layer: int, rows: list[torch.Tensor]) -> torch.Tensor:
        """Maps the selected source layers' rows to target layer `target_layer`'s rows.

        One matrix product per selected source layer, accumulated in place (no concatenated copy of the inputs).

        Args:
            rows (`list[torch.Tensor]`): one tensor per selected source layer, in the selected order, from
                `layout_rows`.

        Returns:
            `torch.Tensor` in the same layout: the target layer's content-space keys and values.
        """
        layer_map = self.layers[target_layer]
        weight, bias = layer_map.weight, layer_map.bias
        if self.head_mode == "all_heads":
            width = rows[0].shape[-1]  # H·2d
            out = torch.addmm(bias[0], rows[0], weight[0, :width])  # (B·T, H·2d)
            for i, x in enumerate(rows[1:], 1):
                out.addmm_(x, weight[0, i * width : (i + 1) * width])
            return out
        span = rows[0].shape[-1]  # 2d
        out = torch.baddbmm(bias.unsqueeze(1), rows[0], weight[:, :span])  # (H, B·T, 2d)
        for i, x in enumerate(rows[1:], 1):
            out.baddbmm_(x, weight[:, i * span : (i + 1) * span])
        return out

    # -- mapping several target layers at once -------------------------------------------------------------------
    # Target layers that read the same set of source layers are mapped with one wide matrix product (their weights'
    # row blocks put in one order and stacked along the output). One product per layer is narrow (output H·2d) and
    # runs far below a CPU's or GPU's peak; the stacked product runs near it. Exact: same weights, same sums.
    groupable = True  # False where `map_layer` is not one affine map per layer (MLP) or weights load lazily
    max_group_bytes = 2**28  # stacked weights are a copy: don't stack more than this per group

    def mapping_plan(self) -> list[tuple[list[int], list[int]]]:
        """`(source layers in input order, target layers)` steps covering every target layer once."""
        if not self.groupable:
            return [(list(layers), [t]) for t, layers in enumerate(self.selected_layers)]
        groups: dict[tuple[int, ...], list[int]] = {}
        for t, layers in enumerate(self.selected_layers):
            groups.setdefault(tuple(sorted(layers)), []).append(t)
        plan = []
        for sources, targets in groups.items():
            size = sum(self.layers[t].weight.numel() * self.layers[t].weight.element_size() for t in targets)
            if len(targets) > 1 and size <= self.max_group_bytes:
                plan.append((list(sources), targets))
            else:
                plan.extend((list(self.selected_layers[t]), [t]) for t in targets)
        return sorted(plan, key=lambda step: step[1][0])

    def _stacked(self, sources: list[int], targets: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Weights `(G, k·span, n·out)` and bias `(G, n·out)` of `targets`, inputs in `sources` order (cached until
        any of their weights or their layer order change)."""
        versions = tuple(
            (
                self.layers[t].weight._version,
                self.layers[t].bias._version,
                self.layers[t].weight.data_ptr(),
                tuple(self.selected_layers[t]),
            )
            for t in targets
        )
        key = (tuple(sources), tuple(targets))
        cache = self.__dict__.setdefault("_stacked_cache", {})
        if key in cache and cache[key][0] == versions:
            return cache[key][1]
        blocks = []
        for t in targets:
            weight, order = self.layers[t].weight, self.selected_layers[t]  # (G, k·span, out)
            span = weight.shape[1] // len(order)
            index = [order.index(s) for s in sources]
            blocks.append(torch.cat([weight[:, i * span : (i + 1) * span] for i in index], dim=1))
        stacked = torch.cat(blocks, dim=2), torch.cat([self.layers[t].bias for t in targets], dim=1)
        cache[key] = (versions, stacked)
        return stacked

    def map_targets(self, sources: list[int], targets: list[int], rows: list[torch.Tensor]) -> list[torch.Tensor]:
        """Maps one step of `mapping_plan`: `rows` holds the source layers' rows in `sources` order; returns one
        output per target layer, in `map_layer`'s layout."""
        if len(targets) == 1 and sources == self.selected_layers[targets[0]]:
            self.materialize(targets[0])
            out = self.map_layer(targets[0], rows)
            self.release(targets[0])
            return [out]
        weight, bias = self._stacked(sources, targets)
        x = torch.cat(rows, dim=-1)  # (B·T, k·H·2d) or (H, B·T, k·2d)
        if self.head_mode == "all_heads":
            out = torch.addmm(bias[0], x, weight[0])  # (B·T, n·H·2d)
        else:
            out = torch.baddbmm(bias.unsqueeze(1), x, weight)  # (H, B·T, n·2d)
        return list(out.split(out.shape[-1] // len(targets), dim=-1))
