"""`RowStatistics` (the calibration rows, for fits from fewer tokens than map inputs): the λ search and the refit from
the `n × n` kernel equal those from the sums (`KVStatistics`, `BlockStatistics`) on the same rows, and calibration
takes that path only when it is cheaper."""

from __future__ import annotations

import pytest
import torch

from hf_kvbridge.errors import StatisticsError
from hf_kvbridge.fitting.solve import LAMBDA_GRID, choose_ridge_lambdas, heldout_r2_chunks, solve_ridge
from hf_kvbridge.fitting.statistics.dense import KVStatistics
from hf_kvbridge.fitting.statistics.rows import RowStatistics


def _rows(n, layers, row, seed, rank=6):
    gen = torch.Generator().manual_seed(seed)
    latent = torch.randn(n, rank, generator=gen)
    scale = torch.rand(layers * row, generator=gen).add_(0.1)
    x = latent @ torch.randn(rank, layers * row, generator=gen) + 0.3 * torch.randn(n, layers * row, generator=gen)
    y = latent @ torch.randn(rank, 2 * row, generator=gen) + 0.5 * torch.randn(n, 2 * row, generator=gen)
    return x * scale, y


def _both(n_train, n_held, layers=4, heads=2, dim=8):
    """`(sums, rows)` pairs of `(train, held-out)` statistics of the same rows: 4 source, 2 target layers."""
    row = heads * 2 * dim
    sums = [KVStatistics(layers, 2, heads, dim) for _ in range(2)]
    rows = [RowStatistics(layers, 2, heads, dim, sources=range(layers), targets=[0, 1]) for _ in range(2)]
    for i, n in enumerate((n_train, n_held)):
        x, y = _rows(n, layers, row, seed=i)
        for start in range(0, n, 7):  # several batches
            sums[i].update(x[start : start + 7], y[start : start + 7])
            rows[i].update(x[start : start + 7], y[start : start + 7])
    return sums, rows


@pytest.mark.parametrize("n_train", [40, 200])  # fewer tokens than the 128 inputs, and more
def test_the_row_form_equals_the_sums(n_train):
    (train, held), (rtrain, rheld) = _both(n_train, 24)
    x_idx, y_idx = train.source_index([0, 1, 3]), train.target_index(1)  # p = 96 inputs, q = 32 outputs
    path = heldout_r2_chunks(train, held, x_idx, y_idx, 8)
    row_path = heldout_r2_chunks(rtrain, rheld, x_idx, y_idx, 8)
    torch.testing.assert_close(row_path, path, atol=1e-9, rtol=1e-8)  # R² far below 0 at the smallest λ
    lambdas = torch.tensor([1e-3, 0.1]).repeat_interleave(8).repeat(2)  # per column: K, V of each head
    for lam in (0.01, lambdas):
        weight, bias = solve_ridge(train + held, x_idx, y_idx, lam)
        row_weight, row_bias = solve_ridge(rtrain + rheld, x_idx, y_idx, lam)
        torch.testing.assert_close(row_weight, weight, atol=1e-9 * weight.abs().max().item(), rtol=0)
        torch.testing.assert_close(row_bias, bias, atol=1e-9 * bias.abs().max().item(), rtol=0)
    # the moments too (any other reader of statistics), and λ = 0 takes them
    for got, want in zip(rtrain.moments(x_idx, y_idx), train.moments(x_idx, y_idx)):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    chosen, r2 = choose_ridge_lambdas(train, held, [[0, 1, 3], [2, 3]], "all_heads", 2, 8)
    row_chosen, row_r2 = choose_ridge_lambdas(rtrain, rheld, [[0, 1, 3], [2, 3]], "all_heads", 2, 8)
    assert row_chosen == chosen and min(min(v) for v in chosen["k"]) > LAMBDA_GRID[0]
    torch.testing.assert_close(row_r2, r2, atol=1e-9, rtol=0)


def test_row_statistics_refuse_layers_they_do_not_hold_and_keep_only_theirs():
    stats = RowStatistics(4, 2, 2, 8, sources=[1, 3], targets=[0])
    x, y = _rows(10, 4, 32, seed=0)
    stats.update(x, y)
    got, _ = stats.rows(stats.source_index([3]), stats.target_index(0))
    torch.testing.assert_close(got, x[:, 96:128].double())
    with pytest.raises(StatisticsError, match=r"hold source layers \[1, 3\], not \[2\]"):
        stats.rows(stats.source_index([2]), stats.target_index(0))
    with pytest.raises(StatisticsError, match="do not fit"):
        stats.update(x[:, :64], y)
    assert RowStatistics.nbytes(10, 2, 1, 32, 32) == 10 * 3 * 32 * 4


def test_calibration_from_the_rows_equals_calibration_from_the_sums(monkeypatch, caplog):
    """With fewer training tokens than map inputs `fit_bridge_in_passes` keeps the rows (one fit pass); the bridge
    it fits (layers, λ, held-out R², weights) is the one the sums give."""
    import copy

    import hf_kvbridge.fitting.calibration.budgeted_fit as calibration
    from tests.conftest import VOCAB, qwen3

    # source == target: each target layer is one source layer exactly, so the held-out λ are small (ill-conditioned
    # maps, where two paths part first) and not the grid's end; rows of 2 KV heads × 2 × 16 = 64 features
    source = qwen3(layers=3, seed=1)
    target = copy.deepcopy(source)
    windows = torch.randint(0, VOCAB, (8, 16), generator=torch.Generator().manual_seed(0))  # 96 train tokens
    options = {"statistics_memory": 10**9, "top_k": 3, "statistics_dtype": torch.float64, "batch_size": 2}

    def no_sums(*args, **kwargs):
        raise AssertionError("a p × p moment was formed from the rows")

    with monkeypatch.context() as patch, caplog.at_level("INFO", logger="hf_kvbridge.fitting.calibration"):
        patch.setattr(RowStatistics, "moments", no_sums)  # the λ search and refit use the n × n kernel only
        from_rows, _ = calibration.fit_in_passes(source, target, windows, [6, 7], **options)  # p = 192
    assert "from the rows themselves" in caplog.text
    monkeypatch.setattr(calibration, "rows_are_cheaper", lambda *args: False)
    from_sums, _ = calibration.fit_in_passes(source, target, windows, [6, 7], **options)
    assert from_rows.config.selected_layers == from_sums.config.selected_layers
    assert from_rows.config.ridge_lambdas == from_sums.config.ridge_lambdas
    assert max(max(row) for row in from_rows.config.ridge_lambdas["k"]) < 1e-2
    for kind in ("k", "v"):  # held-out R² at the chosen λ, rounded to 6 places in the config
        assert from_rows.config.heldout_r2[kind] == pytest.approx(from_sums.config.heldout_r2[kind], abs=2e-6)
    for key, value in from_sums.mapper.state_dict().items():
        got = from_rows.mapper.state_dict()[key]
        torch.testing.assert_close(got, value, atol=1e-6 * value.abs().max().item(), rtol=0)


def test_rows_are_kept_only_when_cheaper():
    from hf_kvbridge.fitting.calibration.budgeted_fit import rows_are_cheaper

    windows = torch.zeros(8, 256, dtype=torch.long)  # 1,792 train tokens with one window held out
    args = (windows, [7], 12288, 28, 28, 2048)
    assert rows_are_cheaper(*args, "auto", 10 * 10**9, torch.float32)  # the paper's map on 8 × 256 tokens
    assert not rows_are_cheaper(*args, 0.0, 10 * 10**9, torch.float32)  # λ = 0: no ridge, no row form
    assert not rows_are_cheaper(*args, "auto", 10**9, torch.float32)  # the rows do not fit the budget
    assert not rows_are_cheaper(windows, [7], 1792, 28, 28, 2048, "auto", 10 * 10**9, torch.float32)  # n ≥ p
