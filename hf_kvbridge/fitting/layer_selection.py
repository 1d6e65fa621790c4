"""Which source layers predict each target layer: held-out single-layer R², top-k selection, mapper R².

R² is measured on held-out calibration *sequences* (statistics of sequences the fit never saw): in-sample R² is
biased upward by about p/n even on noise. It is averaged over heads and over K and V.

Every function reads statistics through what all of them share (`statistics.base.LayerPairStatistics`: dense, block
and row statistics alike), so selection imports no statistics class.
"""

from __future__ import annotations

import torch

from ..errors import InvalidInputError
from ..utils.heads import map_groups, same_head_sources
from .solve import LAMBDA_GRID, choose_ridge_lambdas, heldout_r2_chunks, map_group_lambda, solve_ridge
from .statistics.base import LayerPairStatistics


def _r2_by_head(sse: torch.Tensor, sst: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Column sums `(H·2d,)` → R² per head and K/V `(H, 2)`."""
    sse = sse.view(heads, 2, head_dim).sum(-1)
    sst = sst.view(heads, 2, head_dim).sum(-1).clamp_min(torch.finfo(torch.float64).tiny)
    return 1 - sse / sst


def single_layer_r2(
    train: LayerPairStatistics,
    heldout: LayerPairStatistics,
    head_mode: str = "all_heads",
    ridge_lambda: float | str = 0.01,
) -> torch.Tensor:
    """Held-out R² of predicting each target layer from each single source layer.

    With `ridge_lambda="auto"` each (target layer, source layer, K/V) scores at its best λ of `LAMBDA_GRID`
    (one eigendecomposition per source layer and head group; see `hf_kvbridge.fitting.solve`).

    Returns:
        `torch.Tensor` of shape `(target_layers, source_layers, 2)`: R² for K (`[..., 0]`) and V (`[..., 1]`),
        averaged over heads.
    """
    heads, dim = train.target_kv_heads, train.target_head_dim
    out = torch.zeros(train.target_layers, train.source_layers, 2, dtype=torch.float64)
    all_targets = torch.arange(train.target_layers)
    # per target head, the source heads it reads (`layout.same_head_sources`)
    reads = None if head_mode == "all_heads" else same_head_sources(train.source_kv_heads, heads)
    for s in range(train.source_layers):
        head_list = [None] if head_mode == "all_heads" else list(range(heads))
        per_head = torch.zeros(train.target_layers, heads, 2, dtype=torch.float64)
        for head in head_list:
            x_idx = train.source_index([s], None if head is None else reads[head])
            # every target layer at once: same inputs, more output columns
            y_idx = torch.cat([train.target_index(int(t), head) for t in all_targets])
            if ridge_lambda == "auto":
                path = heldout_r2_chunks(train, heldout, x_idx, y_idx, dim, LAMBDA_GRID)  # (Λ, L_t·heads·2)
                blocks = train.target_layers if head is not None else train.target_layers * heads
                path = path.view(len(LAMBDA_GRID), train.target_layers, blocks // train.target_layers, 2)
                best = path.mean(2).argmax(0)  # (L_t, 2): best λ per target layer and K/V
                chosen = path.gather(0, best.view(1, -1, 1, 2).expand(1, -1, path.shape[2], 2))[0]  # (L_t, h, 2)
                if head is None:
                    per_head = chosen
                else:
                    per_head[:, head] = chosen[:, 0]
                continue
            weight, bias = solve_ridge(train, x_idx, y_idx, ridge_lambda)
            sse, sst = heldout.residual_sums(x_idx, y_idx, weight, bias)
            if head is None:
                per_head = _r2_by_head(sse, sst, heads * train.target_layers, dim).view(train.target_layers, heads, 2)
            else:
                per_head[:, head] = _r2_by_head(sse, sst, train.target_layers, dim)
        out[:, s] = per_head.mean(1)
    return out


def select_layers(r2: torch.Tensor, top_k: int | None, allowed: list[list[bool]] | None = None) -> list[list[int]]:
    """The `top_k` source layers of each target layer, best first (mean of K and V R²); `None` keeps all.

    `allowed[t][s]` (`layout.allowed_sources`) restricts target layer `t` to the source layers that keep the tokens
    it needs (sliding-window layers); a target layer then gets at most as many layers as it is allowed.
    """
    score = r2.mean(-1)  # (L_t, L_s)
    k = score.shape[1] if top_k is None else min(int(top_k), score.shape[1])
    if k < 1:
        raise InvalidInputError(f"top_k must be ≥ 1 (source layers per target layer), got {top_k}")
    ranked = [torch.argsort(row, descending=True, stable=True).tolist() for row in score]
    if allowed is None:
        return [order[:k] for order in ranked]
    return [[s for s in order if allowed[t][s]][:k] for t, order in enumerate(ranked)]


def mapper_r2(
    train: LayerPairStatistics,
    heldout: LayerPairStatistics,
    selected_layers: list[list[int]],
    head_mode: str = "all_heads",
    ridge_lambda: float | dict | str = 0.01,
    targets: list[int] | None = None,
    kv_mode: str = "joint",
) -> torch.Tensor:
    """Held-out R² of a mapper fitted on `train` with `selected_layers`.

    `ridge_lambda` is one number, per-layer choices (see `hf_kvbridge.fitting.solve.group_lambda`), or `"auto"`: each
    layer, head group and K/V at its best λ of `LAMBDA_GRID` (`hf_kvbridge.fitting.solve.choose_ridge_lambdas`).

    Args:
        targets (`list[int]`, *optional*): only these target layers (the rows of the others stay 0), e.g. the target
            layers of one fit pass's `BlockStatistics`.
        kv_mode (`str`, *optional*, defaults to `"joint"`): `"separate"` fits keys from keys and values from values.

    Returns:
        `torch.Tensor` of shape `(target_layers, 2)`: R² of K and V per target layer, averaged over heads.
    """

    heads, dim = train.target_kv_heads, train.target_head_dim
    if ridge_lambda == "auto":
        _, r2 = choose_ridge_lambdas(
            train, heldout, selected_layers, head_mode, heads, dim, LAMBDA_GRID, targets=targets, kv_mode=kv_mode
        )
        return r2  # the held-out R² of each map at its chosen λ, as kv_mode fits it

    def fit(t, g, x_idx, y_idx):
        return solve_ridge(train, x_idx, y_idx, map_group_lambda(ridge_lambda, t, g, head_mode, kv_mode, heads, dim))

    return _heldout_r2(heldout, selected_layers, head_mode, fit, targets, kv_mode)


def mapped_heldout_r2(mapper, heldout: LayerPairStatistics) -> torch.Tensor:
    """Held-out R² of an affine mapper's own weights (`mapper.layer_weight`, `bias`) on held-out statistics.

    Returns:
        `torch.Tensor` of shape `(target_layers, 2)`: R² of K and V per target layer, averaged over heads.
    """

    def weights(t, g, x_idx, y_idx):
        return mapper.layer_weight(t)[g].double(), mapper.layers[t].bias[g].double()  # (p, q), (q,)

    kv_mode = getattr(mapper, "kv_mode", "joint")
    return _heldout_r2(heldout, mapper.selected_layers, mapper.head_mode, weights, kv_mode=kv_mode)


def _heldout_r2(heldout, selected_layers, head_mode: str, weights, targets=None, kv_mode="joint") -> torch.Tensor:
    """R² on `heldout` per target layer (K, V; mean over heads) of the maps `weights(t, group, x_idx, y_idx)`
    returns as `(weight (p, q), bias (q,))`."""
    heads, dim = heldout.target_kv_heads, heldout.target_head_dim
    out = torch.zeros(heldout.target_layers, 2, dtype=torch.float64)
    for t in range(len(selected_layers)) if targets is None else targets:
        layers = selected_layers[t]
        # each group's output columns put back at their place in the target layer's row (H, 2, d)
        sse_all = torch.zeros(heads * 2 * dim, dtype=torch.float64)
        sst_all = torch.zeros(heads * 2 * dim, dtype=torch.float64)
        offset = int(heldout.target_index(t)[0])
        for g, (x_idx, y_idx) in enumerate(map_groups(heldout, layers, t, head_mode, kv_mode)):
            sse, sst = heldout.residual_sums(x_idx, y_idx, *weights(t, g, x_idx, y_idx))
            sse_all[y_idx.cpu() - offset] = sse.cpu()
            sst_all[y_idx.cpu() - offset] = sst.cpu()
        out[t] = _r2_by_head(sse_all, sst_all, heads, dim).mean(0)
    return out
