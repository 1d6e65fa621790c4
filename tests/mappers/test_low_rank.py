"""Reduced-rank ridge mappers: full rank is the ridge map, lower ranks are the best truncation, and they save,
load, stack and calibrate like any mapper."""

import pytest
import torch

import hf_kvbridge
from hf_kvbridge import KVBridgeForCausalLM
from hf_kvbridge.fitting.calibration.calibrate import fit_bridge
from hf_kvbridge.fitting.calibration.data_pass import collect_statistics
from hf_kvbridge.fitting.layer_selection import mapped_heldout_r2
from hf_kvbridge.fitting.mapper_fits import refit
from hf_kvbridge.fitting.solve import effective_ridge_lambda
from hf_kvbridge.mappers import engine as mapping
from hf_kvbridge.mappers.low_rank import LowRankKVMapper, fit_low_rank, reduce_rank
from tests.conftest import CORPUS, VOCAB, qwen3


@pytest.fixture(scope="module")
def ridge_pair(windows):
    bridge, statistics = _ridge(windows, "all_heads")
    bridge.calibration_statistics = statistics
    return bridge


def _ridge(windows, head_mode):
    """A ridge bridge of a 2-layer → 3-layer Qwen3 pair, top-2, and its (train, held-out) statistics."""
    source, target = qwen3(layers=2, seed=1), qwen3(layers=3, hidden=48, seed=2)
    train, heldout = collect_statistics(source, target, windows, heldout=[0, 1, 2, 3])
    return fit_bridge(source, target, train, heldout, top_k=2, head_mode=head_mode), (train, heldout)


def _caches_close(a, b, **tol):
    for la, lb in zip(a.layers, b.layers):
        torch.testing.assert_close(la.keys, lb.keys, **tol)
        torch.testing.assert_close(la.values, lb.values, **tol)


@pytest.mark.parametrize("head_mode", ["all_heads", "same_head"])
def test_full_rank_is_the_ridge_map(windows, head_mode):
    """At rank ≥ min(p, q) the factors multiply back to the ridge weights: the same cache, both head modes."""
    ridge, statistics = _ridge(windows, head_mode)
    full = refit(ridge, "low_rank", rank=10_000, statistics=statistics)
    for t in range(3):
        torch.testing.assert_close(full.mapper.layer_weight(t), ridge.mapper.layer_weight(t), atol=1e-4, rtol=1e-4)
    ids = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(3))
    _caches_close(full.prefill(ids)[0], ridge.prefill(ids)[0], atol=1e-4, rtol=1e-4)
    assert full.config.heldout_r2["k"] == pytest.approx(ridge.config.heldout_r2["k"], abs=1e-5)


def test_truncation_is_the_best_of_its_rank():
    """`reduce_rank` keeps the rank-r map with the smallest standardised prediction error: it beats the plain SVD
    truncation of W and random rank-r projections of the predictions."""
    generator = torch.Generator().manual_seed(0)
    p, q, rank = 12, 8, 3
    mix = torch.randn(p, p, generator=generator, dtype=torch.float64)
    cxx = mix @ mix.T / p + torch.diag(torch.linspace(0.01, 3, p, dtype=torch.float64))
    weight = torch.randn(p, q, generator=generator, dtype=torch.float64)
    std = torch.linspace(0.5, 4, q, dtype=torch.float64)

    def error(approx):  # E‖(x W − x W_r) S⁻¹‖²
        diff = (weight - approx) / std
        return float(torch.trace(diff.T @ cxx @ diff))

    down, up = reduce_rank(weight, cxx, std, rank)
    best = error(down @ up)
    u, s, vh = torch.linalg.svd(weight, full_matrices=False)
    assert best < error(u[:, :rank] @ torch.diag(s[:rank]) @ vh[:rank])
    for _ in range(20):  # W S⁻¹ B Bᵀ S: W's predictions projected on a random rank-r subspace, in standardised units
        basis, _ = torch.linalg.qr(torch.randn(q, rank, generator=generator, dtype=torch.float64))
        assert best <= error((weight / std) @ basis @ (basis.T * std)) + 1e-9
    down, up = reduce_rank(weight, cxx, std, q)
    assert error(down @ up) < 1e-9  # full rank: W itself


def test_lower_rank_costs_less_and_explains_less(ridge_pair):
    ranks = [1, 4, 16, 64]
    bridges = [refit(ridge_pair, "low_rank", rank=r) for r in ranks]
    flops = [b.mapper.flops_per_token() for b in bridges]
    r2 = [sum(b.config.heldout_r2["k"]) + sum(b.config.heldout_r2["v"]) for b in bridges]
    assert flops == sorted(flops) and flops[0] < flops[-1]
    assert r2 == sorted(r2) and r2[0] < r2[-1] - 0.05
    assert flops[1] < ridge_pair.mapper.flops_per_token()
    train, heldout = ridge_pair.calibration_statistics
    config = ridge_pair.config  # the low-rank fit reuses the ridge's layers and its per-layer (auto) λ
    rank_4 = LowRankKVMapper.from_statistics(train, config.selected_layers, "all_heads", config.ridge_lambdas, 4)
    measured = mapped_heldout_r2(rank_4, heldout)
    assert float(measured[:, 0].sum()) == pytest.approx(sum(bridges[1].config.heldout_r2["k"]), abs=1e-5)


@pytest.mark.parametrize("head_mode", ["all_heads", "same_head"])
def test_stacked_low_rank_equals_layer_by_layer(windows, head_mode):
    ridge, statistics = _ridge(windows, head_mode)
    bridge = refit(ridge, "low_rank", rank=5, statistics=statistics)
    assert mapping.mapping_steps(bridge.mapper) == [([0, 1], [0, 1, 2])]
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(4))
    stacked = bridge.prefill(ids)[0]
    bridge.mapper.groupable = False
    _caches_close(stacked, bridge.prefill(ids)[0])


def test_save_load_and_calibrate(saved_pair, tmp_path):
    bridge = hf_kvbridge.calibrate(
        saved_pair["small"],
        saved_pair["large"],
        CORPUS,
        num_sequences=16,
        seq_len=32,
        top_k=2,
        batch_size=4,
        mapper_type="low_rank",
        rank=6,
    )
    assert bridge.config.mapper_type == "low_rank" and bridge.config.mapper_kwargs == {"rank": 6}
    assert isinstance(bridge.mapper, LowRankKVMapper)
    bridge.save_pretrained(tmp_path / "b")
    loaded = KVBridgeForCausalLM.from_pretrained(tmp_path / "b")
    assert isinstance(loaded.mapper, LowRankKVMapper) and loaded.mapper.rank == 6
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(2))
    _caches_close(bridge.prefill(ids)[0], loaded.prefill(ids)[0])
    with pytest.raises(ValueError, match="lazy_mapper"):
        KVBridgeForCausalLM.from_pretrained(tmp_path / "b", lazy_mapper=True)


def test_the_fit_returns_a_mapper_and_refit_builds_the_bridge(ridge_pair):
    """`fit_low_rank` is handed a mapper and statistics, returns a mapper; `refit` alone builds the bridge."""
    statistics = ridge_pair.calibration_statistics
    lam = effective_ridge_lambda(ridge_pair.config)
    mapper = fit_low_rank(ridge_pair.mapper, statistics=statistics, ridge_lambda=lam, rank=5)
    assert isinstance(mapper, LowRankKVMapper) and mapper.rank == 5 and mapper.fit_summary == {"rank": 5}
    bridge = refit(ridge_pair, "low_rank", rank=5)
    assert bridge.config.mapper_type == "low_rank" and bridge.config.mapper_kwargs == {"rank": 5}
    assert bridge.config.heldout_r2 == mapper.fit_config["heldout_r2"] and ridge_pair.config.mapper_type == "ridge"
    for got, want in zip(bridge.mapper.parameters(), mapper.parameters()):
        torch.testing.assert_close(got, want)
