"""Calibration on a memory budget: small selection statistics, block fit statistics, the planner's refusals."""

import importlib.util
import os
from pathlib import Path

import pytest
import torch

import hf_kvbridge
import hf_kvbridge.fitting.budget as budget_module
import hf_kvbridge.fitting.calibration.data_pass as data_pass
from hf_kvbridge import StatisticsMemoryError
from hf_kvbridge.fitting.budget import (
    FitShape,
    check_budget,
    default_budget,
    dense_bytes,
    fit_bytes,
    plan_passes,
    rows_bytes,
    selection_bytes,
    smallest_plan_bytes,
    solve_bytes,
)
from hf_kvbridge.fitting.calibration.calibrate import fit_bridge, fit_bridge_in_passes
from hf_kvbridge.fitting.calibration.checks import split_heldout
from hf_kvbridge.fitting.calibration.data_pass import collect_statistics
from hf_kvbridge.fitting.data import token_windows
from hf_kvbridge.fitting.layer_selection import select_layers
from hf_kvbridge.fitting.solve import solve_ridge
from hf_kvbridge.fitting.statistics.blocks import BlockStatistics
from hf_kvbridge.fitting.statistics.dense import KVStatistics
from hf_kvbridge.fitting.statistics.selection import SelectionStatistics
from hf_kvbridge.mappers import KVMapper
from hf_kvbridge.tools.bench.timing import cpu_peak_bytes
from hf_kvbridge.utils.heads import map_groups
from hf_kvbridge.utils.sizes import parse_bytes
from tests.conftest import CORPUS, make_tokenizer, qwen3

LS, LT, H, D = 3, 4, 2, 3
ROW = H * 2 * D


def _rows(n, seed, mean=0.0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, LS * ROW, generator=gen, dtype=torch.float64) * 3 + mean
    w = torch.randn(LS * ROW, LT * ROW, generator=gen, dtype=torch.float64) * 0.2
    y = x @ w + torch.randn(n, LT * ROW, generator=gen, dtype=torch.float64) + 7
    return x, y


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_block_statistics_fit_like_dense(dtype, tmp_path):
    x, y = _rows(600, 0, mean=40.0)  # large means: raw float32 sums would cancel
    dense = KVStatistics(LS, LT, H, D)
    dense.update(x, y)
    parts = [BlockStatistics(LS, LT, H, D, sources=[2, 0], targets=[1, 3], dtype=dtype) for _ in range(2)]
    for i in range(0, 300, 64):
        parts[0].update(x[i : min(i + 64, 300)], y[i : min(i + 64, 300)])
    parts[1].update(x[300:], y[300:])
    parts[1].save(tmp_path / "b.safetensors")
    block = parts[0] + BlockStatistics.load(tmp_path / "b.safetensors")
    assert block.count == 600
    tol = {"atol": 1e-9, "rtol": 1e-7} if dtype == torch.float64 else {"atol": 2e-4, "rtol": 2e-4}
    for head in (None, 1):
        x_idx, y_idx = dense.source_index([2, 0], head), dense.target_index(3, head)
        want = solve_ridge(dense, x_idx, y_idx, 0.01)
        got = solve_ridge(block, x_idx, y_idx, 0.01)
        torch.testing.assert_close(got[0], want[0], **tol)
        torch.testing.assert_close(got[1], want[1], **tol)
        sse_want, sst_want = dense.residual_sums(x_idx, y_idx, *want)
        sse_got, sst_got = block.residual_sums(x_idx, y_idx, *want)
        torch.testing.assert_close(sse_got, sse_want, **tol)
        torch.testing.assert_close(sst_got, sst_want, **tol)
    with pytest.raises(hf_kvbridge.StatisticsError, match=r"hold source layers \[0, 2\], not \[1\]"):
        block.moments(dense.source_index([1]), dense.target_index(1))


def _tensor_bytes(stats) -> int:
    return sum(t.numel() * t.element_size() for t in (stats.xx, stats.xy, stats.x_mean, stats.y_mean, stats.yy))


def test_block_statistics_with_own_cross_blocks_fit_like_dense_and_refuse_the_rest(tmp_path):
    """With `target_sources`, each target layer keeps the cross blocks of its own source layers only (a pass's union is
    wider than what one target reads): the same fit as the dense sums for what it reads, fewer bytes, exactly as
    `nbytes(..., reads=)` plans, through batches, save/load and merging with a Gram mirrored before the merge."""
    x, y = _rows(600, 2, mean=30.0)
    dense = KVStatistics(LS, LT, H, D)
    dense.update(x, y)
    reads = {1: [2], 3: [0, 1]}

    def block():
        return BlockStatistics(LS, LT, H, D, sources=[0, 1, 2], targets=[1, 3], target_sources=reads)

    parts = [block(), block()]
    for i in range(0, 300, 64):
        parts[0].update(x[i : min(i + 64, 300)], y[i : min(i + 64, 300)])
    parts[0].moments(dense.source_index([1, 0]), dense.target_index(3))  # mirrors part 0's Gram before the merge
    parts[1].update(x[300:], y[300:])
    parts[1].save(tmp_path / "b.safetensors")
    loaded = BlockStatistics.load(tmp_path / "b.safetensors")
    assert loaded.target_sources == reads
    merged = parts[0] + loaded
    assert merged.count == 600
    full = BlockStatistics(LS, LT, H, D, sources=[0, 1, 2], targets=[1, 3])
    assert merged.xy.shape[1] * 3 == full.xy.shape[1] * 2  # two of the union's three layers per target
    assert _tensor_bytes(merged) == BlockStatistics.nbytes(3, 2, ROW, torch.float32, reads=2)
    assert _tensor_bytes(full) == BlockStatistics.nbytes(3, 2, ROW, torch.float32) > _tensor_bytes(merged)
    for t, layers in ((1, [2]), (3, [1, 0]), (3, [0, 1])):
        for head in (None, 1):
            x_idx, y_idx = dense.source_index(layers, head), dense.target_index(t, head)
            want = solve_ridge(dense, x_idx, y_idx, 0.01)
            got = solve_ridge(merged, x_idx, y_idx, 0.01)
            torch.testing.assert_close(got[0], want[0], atol=2e-4, rtol=2e-4)
            torch.testing.assert_close(got[1], want[1], atol=2e-4, rtol=2e-4)
            sse_want, sst_want = dense.residual_sums(x_idx, y_idx, *want)
            sse_got, sst_got = merged.residual_sums(x_idx, y_idx, *want)
            torch.testing.assert_close(sse_got, sse_want, atol=2e-4, rtol=2e-4)
            torch.testing.assert_close(sst_got, sst_want, atol=2e-4, rtol=2e-4)
    with pytest.raises(hf_kvbridge.StatisticsError, match=r"target layer 1's cross blocks with source layers \[2\] "):
        merged.moments(dense.source_index([2, 0]), dense.target_index(1))
    both = torch.cat([dense.target_index(1), dense.target_index(3)])
    with pytest.raises(hf_kvbridge.StatisticsError, match=r"one target layer at a time, not \[1, 3\]"):
        merged.moments(dense.source_index([2]), both)
    with pytest.raises(hf_kvbridge.StatisticsError, match="cannot merge"):
        merged.merge_(full)  # cross blocks of other source layers
    with pytest.raises(hf_kvbridge.StatisticsError, match=r"names target layers \[1\], not \[1, 3\]"):
        BlockStatistics(LS, LT, H, D, sources=[0, 1, 2], targets=[1, 3], target_sources={1: [2]})
    with pytest.raises(hf_kvbridge.StatisticsError, match=r"target layer 3 reads source layers \[0, 1\], which are"):
        BlockStatistics(LS, LT, H, D, sources=[0, 2], targets=[1, 3], target_sources=reads)


def test_the_gram_is_summed_in_its_upper_triangle_and_mirrored_before_reads():
    """The lower blocks are not summed (about half the products), yet every read sees the whole symmetric Gram."""
    x, y = _rows(200, 3)
    layout = KVStatistics(LS, LT, H, D)
    stats = BlockStatistics(LS, LT, H, D, sources=[0, 1, 2], targets=[0], dtype=torch.float64)
    stats.update(x, y)
    assert stats.xx[0, ROW:, :ROW].abs().max() == 0  # the lower blocks: not summed
    stats.moments(layout.source_index([2, 0]), layout.target_index(0))
    xc = x - x.mean(0)
    torch.testing.assert_close(stats.xx[0], xc.T @ xc)


@pytest.mark.parametrize(
    "head_mode, kv_mode, groups",
    [("same_head", "joint", H), ("all_heads", "separate", 2), ("same_head", "separate", 2 * H)],
)
def test_grouped_block_statistics_fit_like_dense_and_are_smaller(head_mode, kv_mode, groups, tmp_path):
    """Kept per head and/or per K/V, the blocks give the dense sums' fit for every map of that mode, take 1/groups
    of the Gram and cross memory, survive save/load and merging, and refuse a fit that needs blocks they dropped."""
    x, y = _rows(600, 1, mean=25.0)
    dense = KVStatistics(LS, LT, H, D)
    dense.update(x, y)
    parts = [
        BlockStatistics(LS, LT, H, D, sources=[2, 0], targets=[1, 3], head_mode=head_mode, kv_mode=kv_mode)
        for _ in range(2)
    ]
    parts[0].update(x[:250], y[:250])
    parts[1].update(x[250:], y[250:])
    parts[1].save(tmp_path / "b.safetensors")
    block = parts[0].merge_(BlockStatistics.load(tmp_path / "b.safetensors"))
    full = BlockStatistics(LS, LT, H, D, sources=[2, 0], targets=[1, 3])
    assert block.xx.numel() * groups == full.xx.numel() and block.xy.numel() * groups == full.xy.numel()
    assert BlockStatistics.nbytes(2, 2, ROW, torch.float32, groups) < BlockStatistics.nbytes(2, 2, ROW, torch.float32)
    maps = map_groups(dense, [2, 0], 3, head_mode, kv_mode)
    assert len(maps) == groups
    for x_idx, y_idx in maps:
        want = solve_ridge(dense, x_idx, y_idx, 0.01)
        got = solve_ridge(block, x_idx, y_idx, 0.01)
        torch.testing.assert_close(got[0], want[0], atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(got[1], want[1], atol=2e-4, rtol=2e-4)
    with pytest.raises(hf_kvbridge.StatisticsError, match=f"keep {head_mode}/{kv_mode} blocks only"):
        block.moments(dense.source_index([2, 0]), dense.target_index(3))  # all heads, keys and values together


def test_residual_sums_are_centred():
    """R² from raw sums loses everything to cancellation when the means dwarf the spread; centred sums do not."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(500, LS * ROW, generator=gen, dtype=torch.float64)
    y = torch.randn(500, LT * ROW, generator=gen, dtype=torch.float64) * 1e-3 + 1e5  # tiny spread, huge mean
    stats = KVStatistics(LS, LT, H, D)
    stats.update(x, y)
    x_idx, y_idx = stats.source_index([0]), stats.target_index(0)
    weight, bias = solve_ridge(stats, x_idx, y_idx, 0.01)
    sse, sst = stats.residual_sums(x_idx, y_idx, weight, bias)
    resid = y[:, y_idx] - x[:, x_idx] @ weight - bias
    torch.testing.assert_close(sse, (resid**2).sum(0), rtol=1e-3, atol=0)


def _direct_same_head_r2(x, y, train, held, ridge_lambda):
    """Reference selection score from raw rows: per head and K/V, ridge on the train rows, R² on held-out rows."""
    xv, yv = x.view(len(x), LS, H, 2, D), y.view(len(y), LT, H, 2, D)
    out = torch.zeros(LT, LS, 2, dtype=torch.float64)
    for t in range(LT):
        for s in range(LS):
            for kv in range(2):
                for h in range(H):
                    a, b = xv[train, s, h, kv], yv[train, t, h, kv]
                    ac, bc = a - a.mean(0), b - b.mean(0)
                    cxx = ac.T @ ac / len(a)
                    weight = torch.linalg.solve(cxx + ridge_lambda * torch.diag(torch.diag(cxx)), ac.T @ bc / len(a))
                    bias = b.mean(0) - a.mean(0) @ weight
                    ha, hb = xv[held, s, h, kv], yv[held, t, h, kv]
                    sse = ((hb - ha @ weight - bias) ** 2).sum()
                    out[t, s, kv] += (1 - sse / ((hb - hb.mean(0)) ** 2).sum()) / H
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_selection_statistics_score_like_direct_fits(dtype):
    x, y = _rows(500, 1, mean=20.0)
    train, held = SelectionStatistics(LS, LT, H, D, dtype), SelectionStatistics(LS, LT, H, D, dtype)
    for i in range(0, 400, 48):
        train.update(x[i : min(i + 48, 400)], y[i : min(i + 48, 400)])
    held.update(x[400:], y[400:])
    want = _direct_same_head_r2(x, y, slice(0, 400), slice(400, None), 0.01)
    tol = 1e-8 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(train.single_layer_r2(held, 0.01), want, atol=tol, rtol=0)


def test_parse_bytes_and_bad_sizes():
    assert parse_bytes("16GB") == 16 * 10**9 and parse_bytes("2GiB") == 2 * 2**30 and parse_bytes(4096) == 4096
    with pytest.raises(ValueError, match="statistics_memory must be a size"):
        parse_bytes("lots")
    with pytest.raises(ValueError, match="statistics_memory must be a size"):
        hf_kvbridge.CalibrationSettings(statistics_memory="-3GB")


def test_planner_names_the_numbers():
    # Qwen3-0.6B → 1.7B shapes: 28 → 28 layers, 8 KV heads × 128
    assert check_budget(parse_bytes("16GB"), FitShape(28, 28, 8, 128, 6, torch.float32)) == "blocks"
    # all heads, joint: a 32,768-feature Gram block per map, and its float64 eigendecomposition
    message = r"top_k=16 .* needs 35\.6 GB: statistics 9\.1 GB .* 26\.4 GB to solve .*allows 8\.0 GB.*top_k ≤ 7"
    with pytest.raises(StatisticsMemoryError, match=message):
        check_budget(parse_bytes("8GB"), FitShape(28, 28, 8, 128, 16, torch.float32))
    # per head and K/V (16 groups of 128 features per layer): the same k fits beside the 2.2 GB selection pass
    per_head = check_budget(parse_bytes("3GB"), FitShape(28, 28, 8, 128, 16, torch.float32), "same_head", "separate")
    assert per_head == "blocks"
    with pytest.raises(StatisticsMemoryError, match=r"selection statistics need 2\.2 GB .*allows 1\.0 GB"):
        check_budget(parse_bytes("1GB"), FitShape(28, 28, 8, 128, 6, torch.float32))
    assert selection_bytes(28, 28, 8, 128, torch.float32) < parse_bytes("2.5GB")
    # consecutive target layers share a pass while the union of their source layers fits
    selected = [[0, 1], [1, 2], [5, 6], [6, 7]]
    budget = fit_bytes(3, 2, ROW, torch.float32, top_k=2)
    assert plan_passes(selected, ROW, budget, torch.float32) == [[0, 1], [2, 3]]


def _pair():
    return qwen3(layers=4, seed=1), qwen3(layers=5, hidden=48, seed=2)


def test_calibrate_refuses_an_impossible_budget_before_any_forward(monkeypatch):
    def no_forward(*args, **kwargs):
        raise AssertionError("a forward pass ran before the budget was checked")

    monkeypatch.setattr(data_pass, "cache_rows", no_forward)
    source, target = _pair()
    message = r"need 415\.7 kB \(4 source × 5 target layers.* but statistics_memory allows 2\.0 kB"
    with pytest.raises(StatisticsMemoryError, match=message):
        hf_kvbridge.calibrate(
            source, target, CORPUS, tokenizer=make_tokenizer(), num_sequences=8, seq_len=16, statistics_memory="2kB"
        )


@pytest.mark.parametrize(
    "head_mode, kv_mode", [("all_heads", "joint"), ("same_head", "joint"), ("same_head", "separate")]
)
def test_passes_select_and_fit_like_a_dense_reference(windows, head_mode, kv_mode):
    source, target = _pair()
    _, heldout = split_heldout(len(windows), 0.25, 0)
    row = 2 * 2 * 16
    groups = (1 if head_mode == "all_heads" else 2) * (1 if kv_mode == "joint" else 2)  # Gram blocks kept per pass
    budget = fit_bytes(3, 2, row, torch.float64, groups, top_k=2)  # forces several fit passes
    bridge, _ = fit_bridge_in_passes(
        source, target, windows, heldout, statistics_memory=budget, top_k=2, head_mode=head_mode, ridge_lambda=0.01,
        statistics_dtype=torch.float64, batch_size=6, kv_mode=kv_mode,
    )  # fmt: skip
    assert len(plan_passes(bridge.config.selected_layers, row, budget, torch.float64, groups)) > 1
    # the dense reference: all sums of every layer, the selection score and the fit computed from them here
    train, held = collect_statistics(source, target, windows, heldout=heldout, batch_size=6)
    score = torch.zeros(5, 4, 2, dtype=torch.float64)
    for t in range(5):
        for s in range(4):
            for kv in range(2):
                for h in range(2):
                    x_idx = train.source_index([s], h)[kv * 16 : (kv + 1) * 16]
                    y_idx = train.target_index(t, h)[kv * 16 : (kv + 1) * 16]
                    sse, sst = held.residual_sums(x_idx, y_idx, *solve_ridge(train, x_idx, y_idx, 0.01))
                    score[t, s, kv] += (1 - sse.sum() / sst.sum()) / 2
    torch.testing.assert_close(bridge.layer_r2, score, atol=1e-8, rtol=0)
    assert bridge.config.selected_layers == select_layers(score, 2)
    want = KVMapper.from_statistics(train + held, bridge.config.selected_layers, head_mode, 0.01, kv_mode=kv_mode)
    for key, value in want.state_dict().items():
        torch.testing.assert_close(bridge.mapper.state_dict()[key], value, atol=1e-5, rtol=1e-5)


def test_fit_statistics_memory_does_not_grow_with_layer_counts():
    """At fixed top_k, a fit pass's statistics hold k source layers, however many layers the models have; the selection
    statistics hold per-head d×d blocks, 1/(2H) of the dense cross blocks."""
    peaks = {}
    for layers in (2, 12):
        gen = torch.Generator().manual_seed(layers)
        x, y = torch.randn(256, layers * ROW, generator=gen), torch.randn(256, layers * ROW, generator=gen)
        selected = [[(t + 1) % layers, t % layers] for t in range(layers)]

        def fit(layers=layers, x=x, y=y, selected=selected):
            for t in range(layers):  # one target layer per pass: train + held-out
                parts = [BlockStatistics(layers, layers, H, D, selected[t], [t]) for _ in range(2)]
                for part in parts:
                    part.update(x, y)
                del parts

        peaks[layers] = cpu_peak_bytes(fit)
    assert 0 < peaks[12] <= 1.05 * peaks[2], peaks
    dense_cross = 12 * 12 * ROW * ROW  # numbers of `KVStatistics.xy` for 12 → 12 layers
    assert SelectionStatistics(12, 12, H, D).xy.numel() * 2 * H == dense_cross


def test_default_paper_map_fits_a_24gb_machine_and_too_small_a_budget_is_refused():
    """Qwen3-0.6B → 1.7B shapes, the paper's map (all heads, K and V jointly, top-k 6, float32 statistics): one target
    layer needs 1.4 GB of statistics and 3.9 GB to solve its 12,288-feature map, so half of a 24 GB machine's memory
    holds it (the plan of eight p × p matrices asked 12.7 GB); less than one layer's need is refused, naming bytes."""
    shape = FitShape(28, 28, 8, 128, 6, torch.float32)
    assert check_budget(parse_bytes("12GB"), shape) == "blocks"
    assert solve_bytes(6, 2048) < 4e9 and fit_bytes(6, 1, 2048, torch.float32) < 5.4e9
    message = r"top_k=6 .* needs 5\.3 GB: statistics 1\.4 GB .*float32.* 3\.9 GB to solve .* 6·2048 .*allows 5\.0 GB"
    with pytest.raises(StatisticsMemoryError, match=message):
        check_budget(parse_bytes("5GB"), shape)
    # between one layer's need and the dense plan: more passes, never a refusal
    selected = [sorted({max(0, min(27, t + d)) for d in (-3, -2, -1, 0, 1, 2)} | {0}) for t in range(28)]
    selected = [layers[-6:] for layers in selected]
    for budget in ("5.5GB", "8GB", "12GB", "24GB"):
        passes = plan_passes(selected, 2048, parse_bytes(budget), torch.float32)
        assert sorted(t for group in passes for t in group) == list(range(28))
        for group in passes:
            union = set().union(*(selected[t] for t in group))
            assert fit_bytes(len(union), len(group), 2048, torch.float32, top_k=6, reads=6) <= parse_bytes(budget)
    counts = [len(plan_passes(selected, 2048, parse_bytes(b), torch.float32)) for b in ("5.5GB", "8GB", "24GB")]
    assert counts[0] > counts[1] > counts[2] >= 1, counts
    # each target layer's own six cross blocks, not the pass union's: more target layers a pass
    whole_union = plan_passes(selected, 2048, parse_bytes("12GB"), torch.float32, own_cross=False)
    assert len(plan_passes(selected, 2048, parse_bytes("12GB"), torch.float32)) < len(whole_union)


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's resettable peak RSS")
@pytest.mark.parametrize("k", [6, 1])
def test_solve_memory_plan_matches_the_measured_peak(k):
    """One map's auto-λ search and refit in a fresh interpreter (`scripts/measure_solve_memory.py`: real
    `BlockStatistics`, peak resident memory above the statistics): `solve_bytes` is within 10 % of what it takes."""
    path = Path(__file__).parents[2] / "scripts" / "measure_solve_memory.py"
    spec = importlib.util.spec_from_file_location("measure_solve_memory", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    record = script.measure(1536, k=k, threads=1)
    assert record["k"] == k and record["weight_finite"]
    assert abs(record["plan_bytes"] - record["peak_bytes"]) <= 0.1 * record["peak_bytes"], record


def test_plan_passes_refuses_only_a_layer_that_fits_no_pass():
    selected = [[0, 1], [1, 2], [5, 6], [6, 7]]
    one_layer = fit_bytes(2, 1, ROW, torch.float32, top_k=2)
    assert plan_passes(selected, ROW, one_layer, torch.float32) == [[0], [1], [2], [3]]  # a pass per layer
    with pytest.raises(StatisticsMemoryError, match=r"target layer 0 needs .* \(train \+ held-out statistics of its"):
        plan_passes(selected, ROW, one_layer - 1, torch.float32)


def _calibrate_small(source, target, **kwargs):
    return hf_kvbridge.calibrate(
        source, target, CORPUS, tokenizer=make_tokenizer(), num_sequences=12, seq_len=24, top_k=2, batch_size=4,
        statistics_dtype="float64", **kwargs,
    )  # fmt: skip


def test_default_budget_takes_more_passes_when_half_the_free_memory_is_too_small(monkeypatch):
    """Nothing set and half the free memory below one target layer's need, but the need itself free beside a batch's
    rows: calibration runs a fit pass per target layer (the cheapest plan) and ends with the unbudgeted mapper; with
    less free memory than that it is refused before any forward pass."""
    source, target = _pair()
    heads, dim = source.config.num_key_value_heads, source.config.head_dim
    smallest = smallest_plan_bytes(FitShape(4, 5, heads, dim, 2, torch.float64, 1))
    reserve = rows_bytes(4 * 24, 4, 5, heads * 2 * dim)
    assert reserve < smallest < dense_bytes(4, 5, heads * 2 * dim)  # half of `smallest + reserve` is too small
    free = smallest + reserve
    monkeypatch.setattr(budget_module, "free_bytes", lambda device=None: free)
    bridge = _calibrate_small(source, target)
    provenance = bridge.config.calibration
    assert (provenance["statistics"], provenance["statistics_memory"]) == ("blocks", smallest), provenance
    assert provenance["fit_passes"] == target.config.num_hidden_layers  # one target layer per pass
    assert all(provenance[key] >= 0 for key in ("selection_seconds", "lambda_seconds", "solve_seconds"))
    # the unbudgeted mapper: dense statistics of the same windows, the same source layers, λ chosen from them
    windows = token_windows(CORPUS, make_tokenizer(), 12, 24)
    _, heldout = split_heldout(len(windows), 0.1, 0)
    dense = collect_statistics(source, target, windows, heldout=heldout, batch_size=4)
    unbudgeted = fit_bridge(source, target, *dense, selected_layers=bridge.config.selected_layers)
    assert bridge.config.ridge_lambdas == unbudgeted.config.ridge_lambdas
    for key, value in unbudgeted.mapper.state_dict().items():
        torch.testing.assert_close(bridge.mapper.state_dict()[key], value, atol=1e-6, rtol=1e-6)

    def no_forward(*args, **kwargs):
        raise AssertionError("a forward pass ran before the budget was checked")

    monkeypatch.setattr(data_pass, "cache_rows", no_forward)
    monkeypatch.setattr(budget_module, "free_bytes", lambda device=None: free - 1)
    with pytest.raises(StatisticsMemoryError, match=r"needs .* but statistics_memory allows"):
        _calibrate_small(source, target)


def test_default_budget_is_half_the_free_memory_or_the_cheapest_plan_when_that_fits():
    assert default_budget(free=100, smallest=40, reserve=10) == 50  # half is enough: half
    assert default_budget(free=100, smallest=60, reserve=40) == 60  # more than half, fits beside the rows: the need
    assert default_budget(free=100, smallest=61, reserve=40) == 50  # does not fit: half (then refused by the plan)


def test_statistics_rate_benchmark_runs_its_three_variants():
    """`scripts/measure_statistics_rate.py` at a tiny width: one record per variant, the multiply-adds it counts."""
    path = Path(__file__).parents[2] / "scripts" / "measure_statistics_rate.py"
    spec = importlib.util.spec_from_file_location("measure_statistics_rate", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    records = script.measure(4, 2, 2, tokens=32, repeats=1, heads=1, dim=2)
    assert [r["variant"] for r in records] == ["full", "upper", "own"]
    assert [r["multiply_adds_per_token"] for r in records] == [(16 + 8) * 16, (10 + 8) * 16, (10 + 4) * 16]
    assert records[2]["statistics_bytes"] < records[1]["statistics_bytes"] == records[0]["statistics_bytes"]
    assert records[0]["time_vs_full"] == 1.0 and all(r["seconds_per_update"] > 0 for r in records)
