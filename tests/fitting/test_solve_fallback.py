"""The ridge solve's fallback: λ = 0 on rank-deficient inputs gives the minimum-norm least-squares fit."""

import torch

from hf_kvbridge.fitting.solve import solve_ridge
from hf_kvbridge.fitting.statistics.dense import KVStatistics


def test_rank_deficient_inputs_with_zero_lambda_give_the_minimum_norm_fit():
    # source: 2 layers of 1 head × 2 dims → 8 features; layer 1 repeats layer 0 exactly (rank 4 of 8)
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(200, 4, generator=gen, dtype=torch.float64)
    x = torch.cat([base, base], dim=1)  # (N, 8), Cxx singular
    y = base @ torch.randn(4, 4, generator=gen, dtype=torch.float64) + 0.5  # (N, 4): exactly linear in x
    stats = KVStatistics(source_layers=2, target_layers=1, num_kv_heads=1, head_dim=2)
    stats.update(x, y)
    x_idx, y_idx = stats.source_index([0, 1]), stats.target_index(0)
    weight, bias = solve_ridge(stats, x_idx, y_idx, ridge_lambda=0.0)
    assert torch.isfinite(weight).all() and torch.isfinite(bias).all()
    # the oracle: pseudo-inverse of the centred system (the minimum-norm solution)
    xc, yc = x - x.mean(0), y - y.mean(0)
    want = torch.linalg.pinv(xc.T @ xc) @ (xc.T @ yc)
    torch.testing.assert_close(weight, want, atol=1e-8, rtol=1e-6)
    torch.testing.assert_close(x @ weight + bias, y, atol=1e-8, rtol=1e-8)  # exact fit
    # minimum norm: the duplicated features share the weight equally
    torch.testing.assert_close(weight[:4], weight[4:], atol=1e-8, rtol=1e-6)
