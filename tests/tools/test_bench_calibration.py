"""`kvbridge bench calibration` (`hf_kvbridge.tools.bench.calibration`): calibration at real layer shapes with
random weights charges each stage its own time, refuses what cannot run before building models, and scales a run on
the first layers to the whole pair."""

import json

import pytest
import torch

from hf_kvbridge.tools.bench import shapes
from hf_kvbridge.tools.bench.flop_model import prefill_flops
from kvbridge_cli import main
from tests.conftest import slowed

TINY_SHAPES = {"tiny-s": (32, 2, 2, 1, 16, 64, 128, True), "tiny-t": (48, 3, 2, 1, 16, 96, 128, False)}


def _with_tiny_shapes(monkeypatch):
    """`TINY_SHAPES` among the checkpoint shapes the calibration bench builds, for this test only."""
    for name, shape in TINY_SHAPES.items():
        monkeypatch.setitem(shapes.CHECKPOINT_SHAPES, name, shape)


def test_calibration_bench_splits_its_time(tmp_path, capsys, monkeypatch):
    """`kvbridge bench calibration` charges each stage its own time: the λ search and the solves, each slowed by a
    known delay, show it in their own fields; the projection adds the per-token stages scaled and the rest as is."""
    import hf_kvbridge.fitting.calibration.budgeted_fit as calibration
    from hf_kvbridge.mappers import KVMapper
    from hf_kvbridge.tools.bench import calibration as bench

    _with_tiny_shapes(monkeypatch)
    monkeypatch.setattr(calibration, "choose_ridge_lambdas", slowed(calibration.choose_ridge_lambdas, 0.3))
    monkeypatch.setattr(KVMapper, "fit_targets", slowed(KVMapper.fit_targets, 0.5))
    out = tmp_path / "cal.json"
    argv = ["bench", "calibration", "--pair", "tiny-s:tiny-t", "--num-sequences", "4", "--seq-len", "16",
            "--batch-size", "2", "--heldout-fraction", "0.25", "--top-k", "1", "--head-mode", "all_heads",
            "--dtype", "float32", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    passes = result["fit_passes"]
    assert 0.3 * passes <= result["lambda_seconds"] < 0.3 * passes + 0.5
    assert 0.5 * passes <= result["solve_seconds"] < 0.5 * passes + 0.5
    parts = sum(result[f"{k}_seconds"] for k in ("forward", "statistics", "selection", "lambda", "solve"))
    assert parts <= result["calibration_seconds"] + 0.3  # rounding of five fields
    assert result["tokens"] == 64 and result["threads"] == torch.get_num_threads()
    printed = capsys.readouterr().out
    assert "time split (s): forward" in printed and "projected to 512,000 tokens" in printed

    timings = {"forward_seconds": 2.0, "statistics_seconds": 1.0, "selection_seconds": 0.5, "lambda_seconds": 1.5,
               "solve_seconds": 4.0}  # fmt: skip
    projected = bench.project({"tokens": 100}, timings, 1000)
    assert projected == {"tokens": 1000, "seconds": 36.0, "forward_seconds": 20.0, "overhead_seconds": 16.0,
                         "overhead_over_forwards": 0.8}  # fmt: skip


def test_calibration_bench_runs_under_the_precision_asked_for(tmp_path, monkeypatch):
    """`--float32-matmul-precision medium` runs the calibration under it (seen from inside the fit), records it and
    the mean held-out R² in the JSON, and restores the precision afterwards."""
    import hf_kvbridge.fitting.calibration.budgeted_fit as calibration

    _with_tiny_shapes(monkeypatch)
    seen = []
    inner = calibration.choose_ridge_lambdas

    def spying(*args, **kwargs):
        seen.append(torch.get_float32_matmul_precision())
        return inner(*args, **kwargs)

    monkeypatch.setattr(calibration, "choose_ridge_lambdas", spying)
    out = tmp_path / "cal.json"
    argv = ["bench", "calibration", "--pair", "tiny-s:tiny-t", "--num-sequences", "4", "--seq-len", "16",
            "--batch-size", "2", "--heldout-fraction", "0.25", "--top-k", "1", "--head-mode", "all_heads",
            "--dtype", "float32", "--float32-matmul-precision", "medium", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert seen and set(seen) == {"medium"} and result["float32_matmul_precision"] == "medium"
    assert set(result["heldout_r2_mean"]) == {"k", "v"}
    assert torch.get_float32_matmul_precision() == "highest"


def test_calibration_bench_refuses_a_budget_too_small_before_building_the_models(capsys, monkeypatch):
    from hf_kvbridge.tools.bench import calibration

    def no_build(*args, **kwargs):
        raise AssertionError("the models were built before the budget was checked")

    monkeypatch.setattr(calibration, "random_model", no_build)
    argv = ["bench", "calibration", "--pair", "qwen3-0.6b:qwen3-1.7b", "--head-mode", "all_heads",
            "--statistics-memory", "1MB"]  # fmt: skip
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert "statistics need" in err and "statistics_memory allows 1.0 MB" in err and "were built" not in err


def test_calibration_bench_on_the_first_layers_scales_each_stage_to_the_whole_pair(tmp_path, monkeypatch):
    """`--layers S:T` builds only the first layers (a pair too large for the machine) and `full_depth` scales each
    measured stage by what its work grows with: the forwards by the prefill FLOPs, selection by source × target
    layers, the fit statistics, λ search and solves by the target layers."""
    from hf_kvbridge.tools.bench import calibration as bench

    _with_tiny_shapes(monkeypatch)
    built = []
    monkeypatch.setattr(bench, "random_model", _recorded(bench.random_model, built))
    out = tmp_path / "cal.json"
    argv = ["bench", "calibration", "--pair", "tiny-s:tiny-t", "--layers", "1:2", "--num-sequences", "4",
            "--seq-len", "16", "--batch-size", "2", "--heldout-fraction", "0.25", "--top-k", "1",
            "--dtype", "float32", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert [model.config.num_hidden_layers for model in built] == [1, 2]
    result = json.loads(out.read_text())
    assert (result["source_layers"], result["target_layers"]) == (1, 2) and result["row_statistics"] is False
    full = result["full_depth"]
    assert (full["source_layers"], full["target_layers"]) == (2, 3)
    a, b = (prefill_flops(shapes.shape_config(name, layers=1), 16) for name in ("tiny-s", "tiny-t"))  # one layer
    ratio = (2 * a + 3 * b) / (a + 2 * b)
    assert full["forward_seconds"] == pytest.approx(result["forward_seconds"] * ratio, abs=0.11)
    assert full["lambda_seconds"] == pytest.approx(result["lambda_seconds"] * 1.5, abs=0.11)
    assert full["selection_seconds"] == pytest.approx(result["selection_seconds"] * 3, abs=0.11)
    assert full["projection"]["tokens"] == bench.PAPER_TOKENS


def _recorded(fn, calls):
    def run(*args, **kwargs):
        calls.append(out := fn(*args, **kwargs))
        return out

    return run


@pytest.mark.parametrize(
    "layers, expected",
    [
        ("8", "--layers takes S:T"),
        ("0:2", "--layers takes S:T"),
        ("3:x", "--layers takes S:T"),
        ("3:2", "the source shape has 2 layers, not 3"),
        ("2:4", "the target shape has 3 layers, not 4"),
    ],  # fmt: skip
)
def test_calibration_bench_refuses_bad_layers_before_building(layers, expected, capsys, monkeypatch):
    from hf_kvbridge.tools.bench import calibration as bench

    def no_build(*args, **kwargs):
        raise AssertionError("a model was built for bad --layers")

    _with_tiny_shapes(monkeypatch)
    monkeypatch.setattr(bench, "random_model", no_build)
    assert main(["bench", "calibration", "--pair", "tiny-s:tiny-t", "--layers", layers]) != 0
    err = capsys.readouterr().err
    assert expected in err and "a model was built" not in err


def test_calibration_bench_does_not_project_the_rows_solves_to_more_tokens(tmp_path):
    """Fewer training tokens than map inputs keep the rows, whose λ search and solves (an `n × n` kernel) say nothing
    of the sums' at the paper's tokens: the projection leaves them out and says so."""
    out = tmp_path / "cal.json"
    with pytest.MonkeyPatch.context() as patch:
        _with_tiny_shapes(patch)
        argv = ["bench", "calibration", "--pair", "tiny-s:tiny-t", "--num-sequences", "4", "--seq-len", "16",
                "--batch-size", "2", "--heldout-fraction", "0.25", "--top-k", "2", "--head-mode", "all_heads",
                "--dtype", "float32", "--json", str(out)]  # fmt: skip
        assert main(argv) == 0  # 48 training tokens for 2 × 32 inputs
    result = json.loads(out.read_text())
    assert result["row_statistics"] is True and result["fit_passes"] == 1
    projected = result["projection"]
    assert projected["seconds"] is None and projected["overhead_over_forwards"] is None
    assert "kept the rows" in projected["not_projected"] and projected["forward_seconds"] > 0
