"""The cross-head study's closed form on known statistics: a rank-r term recovers a rank-r cross-head map that the
same-head map leaves, and full rank is the residual's ridge map."""

import torch

from hf_kvbridge.fitting.statistics.dense import KVStatistics
from studies.cross_head_study import cross_head_term


def _statistics(n=4000, seed=0):
    """x: one source layer of 2 heads (8 features); y = x W_s (block diagonal: same head) + x u vᵀ (rank 1) + noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g, dtype=torch.float64)
    same = torch.zeros(8, 8, dtype=torch.float64)
    same[:4, :4], same[4:, 4:] = torch.randn(4, 4, generator=g), torch.randn(4, 4, generator=g)
    cross = torch.randn(8, 1, generator=g, dtype=torch.float64) @ torch.randn(1, 8, generator=g, dtype=torch.float64)
    y = x @ (same + cross) + 0.01 * torch.randn(n, 8, generator=g, dtype=torch.float64)
    stats = KVStatistics(source_layers=1, target_layers=1, num_kv_heads=2, head_dim=2)
    stats.update(x, y)
    return stats, same, cross


def test_a_rank_one_term_recovers_the_rank_one_cross_head_map_the_same_head_map_leaves():
    stats, same, cross = _statistics()
    lam = torch.full((8,), 1e-6, dtype=torch.float64)
    term = cross_head_term(stats, same, lam, rank=1)
    assert torch.linalg.matrix_rank(term, rtol=1e-8) == 1
    assert torch.allclose(term, cross, atol=5e-3), (term - cross).abs().max()
    assert cross_head_term(stats, same, lam, rank=2).sub(cross).abs().max() < 5e-3  # nothing more to find


def test_full_rank_is_the_ridge_map_of_the_residual_and_a_lower_rank_fits_worse():
    stats, same, cross = _statistics()
    lam = torch.full((8,), 1e-6, dtype=torch.float64)
    full = cross_head_term(stats, same, lam, rank=8)
    assert torch.allclose(full, cross, atol=5e-3)
    wrong = same + torch.randn(8, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)  # a poor W_s
    one, two, whole = (cross_head_term(stats, wrong, lam, rank=r) for r in (1, 2, 8))
    residual = stats.moments(torch.arange(8), torch.arange(8))
    assert torch.linalg.matrix_rank(two, rtol=1e-8) == 2

    def sse(term):  # the residual sum of squares of wrong + term, from the statistics
        mx, my, cxx, cxy, vy = residual
        w = wrong + term
        return float((vy - 2 * (w * cxy).sum(0) + (w * (cxx @ w)).sum(0)).sum())

    assert sse(whole) < sse(two) < sse(one) < sse(torch.zeros_like(whole))
    assert torch.allclose(wrong + whole, same + cross, atol=5e-3)  # full rank: the residual's whole ridge map
