"""Sufficient statistics are additive and give the same fits and R² as the raw rows."""

import pytest
import torch

from hf_kvbridge.fitting.solve import solve_ridge
from hf_kvbridge.fitting.statistics.dense import KVStatistics


def _rows(n, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2 * 8, generator=gen, dtype=torch.float64)  # 2 source layers, 2 heads × 2·2 dims
    w = torch.randn(16, 3 * 8, generator=gen, dtype=torch.float64)
    y = x @ w + 0.1 * torch.randn(n, 24, generator=gen, dtype=torch.float64) + 3.0
    return x, y


def test_streamed_merge_equals_one_pass(tmp_path):
    x, y = _rows(300, 0)
    whole = KVStatistics(2, 3, 2, 2)
    whole.update(x, y)
    parts = [KVStatistics(2, 3, 2, 2) for _ in range(3)]
    for i, part in enumerate(parts):
        part.update(x[i * 100 : (i + 1) * 100], y[i * 100 : (i + 1) * 100])
    merged = parts[0] + parts[1] + parts[2]
    for name in ("x_sum", "y_sum", "xx", "xy", "yy"):
        torch.testing.assert_close(getattr(merged, name), getattr(whole, name))
    whole.save(tmp_path / "s.safetensors")
    loaded = KVStatistics.load(tmp_path / "s.safetensors")
    assert loaded.count == 300 and torch.equal(loaded.xx, whole.xx)


def test_ridge_and_residuals_match_direct_computation():
    x, y = _rows(400, 1)
    stats = KVStatistics(2, 3, 2, 2)
    stats.update(x, y)
    x_idx, y_idx = stats.source_index([1, 0]), stats.target_index(2)
    weight, bias = solve_ridge(stats, x_idx, y_idx, ridge_lambda=0.0)
    xs, ys = x[:, x_idx], y[:, y_idx]
    design = torch.cat([xs, torch.ones(len(xs), 1, dtype=xs.dtype)], 1)
    direct = torch.linalg.lstsq(design, ys).solution
    torch.testing.assert_close(weight, direct[:-1], atol=1e-8, rtol=1e-6)
    torch.testing.assert_close(bias, direct[-1], atol=1e-8, rtol=1e-6)
    heldout_x, heldout_y = _rows(200, 2)
    held = KVStatistics(2, 3, 2, 2)
    held.update(heldout_x, heldout_y)
    sse, sst = held.residual_sums(x_idx, y_idx, weight, bias)
    resid = heldout_y[:, y_idx] - heldout_x[:, x_idx] @ weight - bias
    torch.testing.assert_close(sse, (resid**2).sum(0))
    torch.testing.assert_close(sst, ((heldout_y[:, y_idx] - heldout_y[:, y_idx].mean(0)) ** 2).sum(0))


def test_lambda_is_relative_to_feature_scale():
    x, y = _rows(300, 3)
    a, b = KVStatistics(2, 3, 2, 2), KVStatistics(2, 3, 2, 2)
    a.update(x, y)
    b.update(x * 1000, y)  # same problem, inputs in other units
    idx, out = a.source_index([0, 1]), a.target_index(0)
    wa, _ = solve_ridge(a, idx, out, 0.5)
    wb, _ = solve_ridge(b, idx, out, 0.5)
    torch.testing.assert_close(wa, wb * 1000)


def test_same_head_index_picks_one_head():
    stats = KVStatistics(2, 1, 2, 3)  # row = 2 heads × 2 × 3 = 12
    assert stats.source_index([1], head=1).tolist() == list(range(12 + 6, 24))
    assert stats.source_index([0, 1], head=0).tolist() == list(range(0, 6)) + list(range(12, 18))


@pytest.mark.parametrize("kind", ["selection", "blocks"])
def test_updates_in_chunks_equal_one_update(kind, monkeypatch):
    """A batch larger than `CHUNK_BYTES` of rows is summed a chunk at a time (less transient memory: the selection
    pass of Qwen3-0.6B → 1.7B copies its 0.9 GB of rows per side several times); the sums are those of one update."""
    from hf_kvbridge.fitting.statistics import base as statistics
    from hf_kvbridge.fitting.statistics.blocks import BlockStatistics
    from hf_kvbridge.fitting.statistics.selection import SelectionStatistics

    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(50, 3 * 8, generator=gen) * 3 + 1, torch.randn(50, 2 * 8, generator=gen) - 2

    def make():
        if kind == "selection":
            return SelectionStatistics(3, 2, 2, 2, torch.float64)
        return BlockStatistics(3, 2, 2, 2, sources=[0, 2], targets=[0, 1], dtype=torch.float64)

    whole = make()
    whole.update(x, y)
    monkeypatch.setattr(statistics, "CHUNK_BYTES", 8 * 40 * 7)  # 7 rows of 40 features a chunk
    chunked = make()
    chunked.update(x, y)
    assert chunked.count == whole.count == 50
    for name in ("x_mean", "y_mean", "xx", "xy", "yy"):
        torch.testing.assert_close(getattr(chunked, name), getattr(whole, name), atol=1e-10, rtol=1e-12)


@pytest.mark.parametrize("kind", ["dense", "selection", "blocks"])
def test_a_saved_file_loads_back_with_the_target_head_layout(kind, tmp_path):
    """`save` then `load` gives the same statistics for each class that writes a file (what resumable calibration
    keeps), also when the target's KV heads and head dim differ from the source's (2 × 4 against 3 × 2 here)."""
    from hf_kvbridge.fitting.statistics.blocks import BlockStatistics
    from hf_kvbridge.fitting.statistics.selection import SelectionStatistics

    heads = {"target_kv_heads": 3, "target_head_dim": 2}
    make = {
        "dense": lambda: KVStatistics(2, 3, 2, 4, **heads),
        "selection": lambda: SelectionStatistics(2, 3, 2, 4, torch.float64, **heads),
        "blocks": lambda: BlockStatistics(
            2,
            3,
            2,
            4,
            sources=[0, 1],
            targets=[1, 2],
            dtype=torch.float64,
            target_sources={1: [1], 2: [0, 1]},
            **heads,
        ),  # fmt: skip
    }[kind]
    stats = make()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(40, 2 * 2 * 2 * 4, generator=generator, dtype=torch.float64)  # (N, L_s·H·2d)
    y = x @ torch.randn(32, 36, generator=generator, dtype=torch.float64)  # (N, L_t·H_t·2d_t)
    stats.update(x, y + torch.randn(40, 36, generator=generator, dtype=torch.float64))
    stats.save(tmp_path / "s.safetensors")
    loaded = type(stats).load(tmp_path / "s.safetensors")
    assert loaded.shape_key == stats.shape_key and loaded.count == stats.count == 40
    for name, tensor in stats.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0)
