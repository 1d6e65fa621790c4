"""The FLOP model (`hf_kvbridge.tools.bench.flop_model`) counts what the code computes: the calibration's counts are
checked against the matrix products the statistics and the λ search really dispatch, `kvbridge bench calibration
--flop-model` prints and writes them with times at probed and datasheet rates, and a transfer's cost (`kvbridge
tune`'s axis) agrees with the mapper bench's FLOP counts."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_kvbridge.fitting.solve import LAMBDA_GRID, heldout_r2_chunks
from hf_kvbridge.fitting.statistics.blocks import BlockStatistics
from hf_kvbridge.fitting.statistics.selection import SelectionStatistics
from hf_kvbridge.tools.bench.flop_model import (
    EIGH_FLOPS,
    H100_SXM,
    CalibrationShape,
    DeviceRates,
    calibration_flops,
    cost,
    map_flops_per_token,
    mapper_flops,
    prefill_flops,
    project_seconds,
    target_flops_per_token,
)
from hf_kvbridge.tools.bench.mapper import benchmark
from hf_kvbridge.tools.bench.shapes import CHECKPOINT_SHAPES, random_bridge, shape_config
from hf_kvbridge.utils.heads import map_groups
from kvbridge_cli import main
from tests.conftest import qwen3

TINY_SHAPES = {"tiny-s": (32, 4, 2, 1, 4, 64, 128, True), "tiny-t": (48, 3, 2, 1, 4, 96, 128, False)}


class MatmulFlops(TorchDispatchMode):
    """Counts the FLOPs (2 per multiply-add) of every matrix product dispatched, in place or not."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("baddbmm", "baddbmm_", "addmm", "addmm_"):
            a, b = args[1], args[2]
        elif name in ("bmm", "mm", "mv"):
            a, b = args[0], args[1]
        else:
            a = b = None
        if a is not None:
            self.flops += 2 * a.numel() * (b.shape[-1] if b.dim() > 1 else 1)
        return func(*args, **(kwargs or {}))


def _counted(fn) -> int:
    with MatmulFlops() as counter:
        fn()
    return counter.flops


def _shape(sequences: int, seq_len: int, passes=(3,), top_k=2, groups=1) -> CalibrationShape:
    return CalibrationShape(4, 3, 1, 4, top_k=top_k, groups=groups, sequences=sequences, seq_len=seq_len,
                            passes=passes)  # fmt: skip


def test_fit_statistics_count_is_what_an_update_dispatches():
    """Per token, a fit pass's `BlockStatistics.update` with each target's own `k` cross blocks dispatches the
    model's count at both ends of the union: every target reading the same `k` source layers, and none sharing."""
    config = shape_config("qwen3-0.6b")  # only the forwards read it; they are not compared here
    heads, dim, k, targets = 1, 4, 2, 2
    row = heads * 2 * dim
    for union, reads in ((2, {0: [0, 1], 1: [0, 1]}), (4, {0: [0, 1], 1: [2, 3]})):
        stats = BlockStatistics(union, targets, heads, dim, sources=list(range(union)), targets=[0, 1],
                                target_sources=reads)  # fmt: skip
        counts = [
            _counted(lambda n=n, s=stats, u=union: s.update(torch.randn(n, u * row), torch.randn(n, targets * row)))
            for n in (32, 96)
        ]
        per_token = (counts[1] - counts[0]) / 64  # the per-update rank-one shift cancels
        shape = CalibrationShape(4, targets, heads, dim, top_k=k, groups=1, sequences=1, seq_len=1, passes=(targets,))
        flops = calibration_flops(shape, config, config)
        end = "low" if union == k else "high"
        assert per_token == pytest.approx(flops[f"fit_statistics_{end}"])


def test_selection_statistics_count_is_what_an_update_dispatches():
    config = shape_config("qwen3-0.6b")
    stats = SelectionStatistics(4, 3, 2, 4)

    def update(tokens):
        return lambda: stats.update(torch.randn(tokens, 4 * 16), torch.randn(tokens, 3 * 16))

    per_token = (_counted(update(80)) - _counted(update(16))) / 64
    shape = CalibrationShape(4, 3, 2, 4, top_k=2, groups=1, sequences=1, seq_len=1, passes=(3,))
    assert per_token == pytest.approx(calibration_flops(shape, config, config)["selection_statistics"])


def test_lambda_search_count_is_what_the_search_dispatches_besides_its_eigh():
    """`heldout_r2_chunks` of one all-heads joint map: its products are the model's λ-search count without the
    eigendecomposition (to the λ path's `shift @ w` vectors, `2pq` a λ, which the model leaves out)."""
    config = shape_config("qwen3-0.6b")
    heads, dim, k = 1, 4, 2
    train, held = (BlockStatistics(3, 1, heads, dim, sources=[0, 1, 2], targets=[0]) for _ in range(2))
    for stats in (train, held):
        stats.update(torch.randn(200, 3 * 8), torch.randn(200, 8))
    ((x_idx, y_idx),) = map_groups(train, [0, 2], 0, "all_heads")
    counted = _counted(lambda: heldout_r2_chunks(train, held, x_idx, y_idx, dim))
    shape = CalibrationShape(3, 1, heads, dim, top_k=k, groups=1, sequences=1, seq_len=1, passes=(1,))
    flops = calibration_flops(shape, config, config)
    p, q = x_idx.numel(), y_idx.numel()
    vectors = len(LAMBDA_GRID) * 2 * p * q + 2 * p * p  # shift @ w per λ, and Vᵀ·shift once
    assert counted - vectors == pytest.approx(flops["lambda_search"] - flops["eigh"])
    assert flops["eigh"] == pytest.approx(EIGH_FLOPS * p**3)


def test_forwards_count_both_models_once_per_pass():
    source, target = shape_config("qwen3-0.6b"), shape_config("qwen3-1.7b")
    one = calibration_flops(_shape(2, 64, passes=(3,)), source, target)
    three = calibration_flops(_shape(2, 64, passes=(1, 1, 1)), source, target)
    assert three["forwards"] == pytest.approx(2 * one["forwards"])  # 1 + 3 passes against 1 + 1
    assert three["selection_statistics"] == one["selection_statistics"]


def test_projection_divides_each_stage_by_its_rate():
    config = shape_config("qwen3-0.6b")
    flops = calibration_flops(_shape(4, 32), config, config)
    rates = DeviceRates("unit", forward=1.0, float32=2.0, float64=4.0, eigh=8.0, source="test")
    seconds = project_seconds(flops, rates)
    assert seconds["forwards"] == flops["forwards"]
    assert seconds["fit_statistics_high"] == flops["fit_statistics_high"] / 2
    assert seconds["lambda_search"] == pytest.approx(flops["eigh"] / 8 + (flops["lambda_search"] - flops["eigh"]) / 4)
    rest = sum(seconds[s] for s in ("selection_statistics", "selection_scoring", "lambda_search", "refit"))
    assert seconds["total_low"] == pytest.approx(seconds["forwards"] + rest + seconds["fit_statistics_low"])
    assert seconds["overhead_over_forwards_high"] == pytest.approx((seconds["total_high"] / seconds["forwards"]) - 1)


def test_flop_model_cli_prints_and_writes_both_devices(tmp_path, capsys, monkeypatch):
    for name, shape in TINY_SHAPES.items():
        monkeypatch.setitem(CHECKPOINT_SHAPES, name, shape)
    out = tmp_path / "flops.json"
    argv = ["bench", "calibration", "--flop-model", "--pair", "tiny-s:tiny-t", "--head-mode", "all_heads",
            "--top-k", "2", "--num-sequences", "10", "--seq-len", "64", "--dtype", "float32",
            "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["tokens"] == 640 and sum(result["fit_passes"]) == 3 and result["flops"]["maps"] == 3
    probed, h100 = result["devices"]
    assert probed["rates"]["name"].startswith("this CPU") and probed["tokens_per_second_per_core"] > 0
    assert h100["rates"]["float64"] == H100_SXM.float64
    assert all(d["seconds"]["total_high"] >= d["seconds"]["total_low"] > d["seconds"]["forwards"] > 0
               for d in result["devices"])  # fmt: skip
    printed = capsys.readouterr().out
    assert "| lambda_search |" in printed and "tokens/s" in printed and "per core" in printed

    assert main([*argv, "--fit-passes", "3"]) == 0  # one target layer a pass: 1 + 3 passes of forwards
    three = json.loads(out.read_text())
    assert three["fit_passes"] == [1, 1, 1]
    assert three["flops"]["forwards"] == pytest.approx(
        result["flops"]["forwards"] * 4 / (1 + len(result["fit_passes"]))
    )
    assert main([*argv, "--fit-passes", "4"]) != 0 and "more than the target's 3 layers" in capsys.readouterr().err


def test_flop_model_cli_refuses_a_budget_that_holds_no_target_layer(capsys):
    argv = ["bench", "calibration", "--flop-model", "--head-mode", "all_heads", "--statistics-memory", "1MB"]
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert "one target layer needs" in err and "--statistics-memory" in err and "Traceback" not in err


@pytest.mark.parametrize("rank", [None, 4])
def test_tune_cost_and_the_mapper_bench_count_with_one_model(rank):
    """Tune's cost axis and the mapper bench's FLOP figures come from the one FLOP model and agree: a bridge that maps
    every layer and recomputes nothing costs the inverse of the bench's FLOP bound (≤ 1e-6); token and layer recompute
    add `(f + n / L_t)` of the target's prefill; recomputing every target layer maps nothing and costs exactly 1."""
    bridge = random_bridge(qwen3(layers=2).config, qwen3(layers=3, hidden=48).config, top_k=2, rank=rank)
    context = 32
    (row,) = benchmark(bridge, [context], repeats=1, warmup=0)
    per_token = target_flops_per_token(bridge.target.config, context)
    assert per_token == pytest.approx(prefill_flops(bridge.target.config, context) / context, rel=1e-12)
    assert per_token == pytest.approx(row["target_prefill_flops"] / context, rel=1e-6)
    assert cost(bridge, per_token) == pytest.approx(1 / row["flop_ratio_bound"], rel=1e-6)
    maps = row["mapper_flops"] / context / per_token
    for fraction, layers in ((0.1, 0), (0.0, 1), (0.2, 2)):
        bridge.config.recompute_fraction, bridge.config.recompute_layers = fraction, layers
        assert cost(bridge, per_token) == pytest.approx(maps + fraction + layers / 3, rel=1e-6)
    bridge.config.recompute_fraction, bridge.config.recompute_layers = 0.0, 3
    assert cost(bridge, per_token) == 1.0 and map_flops_per_token(bridge) == (0, 0)


def test_calibration_forwards_are_the_prefill_model_once_per_pass():
    """The calibration's forwards are the same prefill FLOPs the transfer's cost divides by: both models' prefills of
    every sequence, once for the selection pass and once per fit pass."""
    source, target = shape_config("qwen3-0.6b"), shape_config("qwen3-1.7b")
    shape = CalibrationShape(28, 28, 8, 128, top_k=6, groups=1, sequences=5, seq_len=512, passes=(10, 10, 8))
    flops = calibration_flops(shape, source, target)
    one = prefill_flops(source, 512) + prefill_flops(target, 512)
    assert flops["forwards"] == pytest.approx(4 * 5 * one, rel=1e-12)
    assert target_flops_per_token(target, 512) * 512 == pytest.approx(prefill_flops(target, 512), rel=1e-12)


def test_flop_counts_match_the_weights():
    model = qwen3(layers=2, hidden=32)
    body = sum(p.numel() for n, p in model.model.layers.named_parameters() if p.dim() == 2)
    tokens, q = 10, 4 * 16
    assert prefill_flops(model.config, tokens) == 2 * tokens * body + 2 * 2 * 2 * tokens * tokens * q / 2
    bridge = random_bridge(qwen3(layers=2).config, qwen3(layers=3, hidden=48).config, top_k=2)
    assert mapper_flops(bridge.mapper, tokens) == 2 * tokens * 3 * (2 * 2 * 2 * 16) * (2 * 2 * 16)
