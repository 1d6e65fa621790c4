"""Centered ridge regression from sufficient statistics: the closed form every linear mapper is fitted with.

For target layer `t` and head group `g` (all heads at once in `all_heads` mode, one head in `same_head` mode):

    W = (C_xx + λ·D)⁻¹ C_xy,   b = ȳ − x̄ W,   D = diag(C_xx)

`C` are covariances (centered sums divided by the token count), so λ is *relative to each input feature's own
variance* — the same as plain ridge on standardized (z-scored) inputs. It does not change with the number of
calibration tokens or with the scale of any feature (keys and values live at very different scales).
λ = 0.01 adds 1 % of each feature's variance to its diagonal entry.
"""

from __future__ import annotations

import torch

from .errors import StatisticsError
from .statistics import KVStatistics


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
