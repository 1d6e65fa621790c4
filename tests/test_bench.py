"""The benchmark measures what it says: FLOP counts, timings and memory on tiny random-weight bridges."""

import json
import time

import pytest
import torch

from hf_kvbridge.cli.main import main
from hf_kvbridge.tools.bench import shapes
from hf_kvbridge.tools.bench.flop_model import mapper_flops, prefill_flops
from hf_kvbridge.tools.bench.mapper import benchmark
from hf_kvbridge.tools.bench.shapes import random_bridge
from hf_kvbridge.tools.bench.timing import peak_extra_bytes
from tests.conftest import qwen3


def test_flop_counts_match_the_weights():
    model = qwen3(layers=2, hidden=32)
    body = sum(p.numel() for n, p in model.model.layers.named_parameters() if p.dim() == 2)
    tokens, q = 10, 4 * 16
    assert prefill_flops(model.config, tokens) == 2 * tokens * body + 2 * 2 * 2 * tokens * tokens * q / 2
    bridge = random_bridge(qwen3(layers=2).config, qwen3(layers=3, hidden=48).config, top_k=2)
    assert mapper_flops(bridge.mapper, tokens) == 2 * tokens * 3 * (2 * 2 * 2 * 16) * (2 * 2 * 16)


def _slowed(fn, seconds):
    """`fn`, each call delayed by `seconds`."""

    def run(*args, **kwargs):
        time.sleep(seconds)
        return fn(*args, **kwargs)

    return run


def test_benchmark_times_what_it_names(monkeypatch):
    """Each timing is of its own function: slowed down by a known delay, the right field grows by it."""
    bridge = random_bridge(qwen3(layers=2).config, qwen3(layers=3, hidden=48).config, top_k=2)

    monkeypatch.setattr(bridge, "map_cache", _slowed(bridge.map_cache, 0.12))
    monkeypatch.setattr(bridge.target.model, "forward", _slowed(bridge.target.model.forward, 0.04))
    (row,) = benchmark(bridge, [32], repeats=2)
    assert row["context_tokens"] == 32
    assert row["mapper_s"] >= 0.12 and row["target_prefill_s"] >= 0.04 and row["source_prefill_s"] > 0
    assert row["warm_speedup"] == pytest.approx(row["target_prefill_s"] / row["mapper_s"])
    assert row["mapper_flops"] == mapper_flops(bridge.mapper, 32)
    # the peak of one mapping includes the cache it returns
    assert row["mapping_peak_extra_bytes"] is None or row["mapping_peak_extra_bytes"] >= row["mapped_cache_bytes"]
    assert row["mapped_cache_bytes"] == 3 * 2 * 2 * 32 * 16 * 4  # layers × (K, V) × heads × tokens × dim × fp32


def test_peak_memory_sees_a_large_temporary():
    def allocate():
        big = torch.ones(4_000_000)  # 16 MB, freed before returning
        return float(big.sum())

    peak = peak_extra_bytes(allocate, torch.device("cpu"))
    assert peak is None or peak >= 15_000_000


def test_bench_cli_with_random_shapes(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(shapes.QWEN3_SHAPES, "tiny-a", (2, 32, 4, 2, 16, 64))
    monkeypatch.setitem(shapes.QWEN3_SHAPES, "tiny-b", (3, 48, 4, 2, 16, 96))
    out = tmp_path / "bench.json"
    assert (
        main(
            [
                "bench",
                "mapper",
                "--shapes",
                "tiny-a:tiny-b",
                "--lengths",
                "16,32",
                "--repeats",
                "1",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())["rows"]
    assert [r["context_tokens"] for r in rows] == [16, 32]
    assert "warm ×" in capsys.readouterr().out


def test_bench_cli_low_rank_bf16_interleaved(tmp_path, monkeypatch):
    """`--rank`, `--mapper-dtype` and `--interleave` reach the benchmark: a low-rank bfloat16 mapper's row says so
    and counts the low-rank FLOPs."""
    monkeypatch.setitem(shapes.QWEN3_SHAPES, "tiny-a", (2, 32, 4, 2, 16, 64))
    monkeypatch.setitem(shapes.QWEN3_SHAPES, "tiny-b", (3, 48, 4, 2, 16, 96))
    out, full = tmp_path / "low.json", tmp_path / "full.json"
    common = ["bench", "mapper", "--shapes", "tiny-a:tiny-b", "--top-k", "2", "--lengths", "16", "--repeats", "1"]
    assert main([*common, "--rank", "4", "--mapper-dtype", "bfloat16", "--interleave", "--json", str(out)]) == 0
    assert main([*common, "--json", str(full)]) == 0
    (low,), (ref,) = json.loads(out.read_text())["rows"], json.loads(full.read_text())["rows"]
    assert low["interleaved"] and not ref["interleaved"]
    assert low["mapper_dtype"] == "torch.bfloat16" and ref["mapper_dtype"] == "torch.float32"
    # all heads, 3 target layers reading 2 source layers: p = 2·64, q = 64; rank 4 against the full p·q
    assert low["mapper_flops"] == 16 * 3 * 2 * (128 + 64) * 4
    assert ref["mapper_flops"] == 16 * 3 * 2 * 128 * 64


def test_cpu_memory_records_print_no_profiler_noise(capfd):
    from hf_kvbridge.tools.bench.timing import cpu_peak_bytes

    assert cpu_peak_bytes(lambda: torch.ones(1000) * 2) >= 4000
    captured = capfd.readouterr()
    assert "USDT" not in captured.out + captured.err and "profiler_start" not in captured.out + captured.err


def test_vllm_bench_random_shapes_bridge_builds(tmp_path, monkeypatch):
    """`kvbridge bench vllm --shapes` builds its bridge from the mapper bench's helpers (it once imported a module
    that did not exist); without vLLM, at a tiny shape: the saved bridge loads back."""
    from hf_kvbridge import KVBridgeForCausalLM
    from hf_kvbridge.tools.bench.vllm import random_shapes_bridge

    monkeypatch.setitem(shapes.QWEN3_SHAPES, "tiny-a", (2, 32, 4, 2, 16, 64))
    monkeypatch.setitem(shapes.QWEN3_SHAPES, "tiny-b", (3, 48, 4, 2, 16, 96))
    bridge_dir = random_shapes_bridge(tmp_path, "tiny-a:tiny-b", top_k=2, max_positions=128)
    bridge = KVBridgeForCausalLM.from_pretrained(bridge_dir)
    assert bridge.source.config.num_hidden_layers == 2 and bridge.target.config.num_hidden_layers == 3


@pytest.mark.parametrize("units", [True, False])
def test_bench_cli_old_vs_new_writes_both_defaults(tmp_path, capsys, monkeypatch, units):
    """`--old-vs-new` times the old default mapping (the float32 mapper) and the new one (a bfloat16 copy under
    matmul precision "medium", where the device has bfloat16 units) of one bridge in one run and writes both, side by
    side, with their ratio and the differences of their outputs: bfloat16 rounding with units, 0 without."""
    from hf_kvbridge import precision
    from hf_kvbridge.tools.bench import mapper as bench

    real_units = precision.bf16_matmul_units("cpu")  # where oneDNN has them, "medium" uses them in float32 products
    monkeypatch.setattr(precision, "bf16_matmul_units", lambda device: units)

    monkeypatch.setitem(shapes.QWEN3_SHAPES, "tiny-a", (2, 32, 4, 2, 16, 64))
    monkeypatch.setitem(shapes.QWEN3_SHAPES, "tiny-b", (3, 48, 4, 2, 16, 96))
    out = tmp_path / "old_new.json"
    common = ["bench", "mapper", "--shapes", "tiny-a:tiny-b", "--top-k", "2", "--lengths", "16,24", "--repeats", "2"]
    assert main([*common, "--old-vs-new", "--json", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["old_default"] == bench.OLD_DEFAULT and payload["new_default"] == bench.NEW_DEFAULT
    assert payload["cpu_bf16_units"] is units and payload["cpu_capability"]
    rows = payload["old_vs_new"]
    assert [r["context_tokens"] for r in rows] == [16, 24]
    for row in rows:
        assert row["old_default_s"] > 0 and row["new_default_s"] > 0
        assert row["new_over_old"] == pytest.approx(row["new_default_s"] / row["old_default_s"])
        assert row["mapper_dtype"] == "torch.float32"
        if units:
            assert row["new_mapper_dtype"] == "torch.bfloat16" and 0 < row["relative_difference"] < 0.05
        else:  # the float32 mapper: the same products, in bfloat16 inside oneDNN where the CPU has the units
            assert row["new_mapper_dtype"] == "torch.float32" and row["relative_difference"] < 0.05
            assert real_units or row["max_abs_difference"] == 0.0
        assert row["mapper_flops"] == row["context_tokens"] * 3 * 2 * 128 * 64
    assert "new / old" in capsys.readouterr().out


def test_bench_old_vs_new_times_each_path(monkeypatch):
    """Each column is its own path's time: the old path slowed by 0.05 s and the new one by 0.4 s, each column grows
    by its own delay (the old one stays below the new one)."""
    from hf_kvbridge.mappers import engine as mapping
    from hf_kvbridge.tools.bench.mapper import old_vs_new

    bridge = random_bridge(qwen3(layers=2).config, qwen3(layers=3, hidden=48).config, top_k=2)

    monkeypatch.setattr(mapping, "map_cache", _slowed(mapping.map_cache, 0.05))  # the old path calls this one
    monkeypatch.setattr(bridge, "map_cache", _slowed(bridge.map_cache, 0.4))  # the new path is the bridge's own
    (row,) = old_vs_new(bridge, [16], repeats=2, warmup=0)
    assert 0.05 <= row["old_default_s"] < row["new_default_s"] and row["new_default_s"] >= 0.4


def test_bench_old_vs_new_refuses_interleave(capsys, monkeypatch):
    """`--old-vs-new --interleave` is refused by the argument checks, before any model is built, naming both."""
    from hf_kvbridge.tools.bench import mapper as bench

    built = []
    monkeypatch.setattr(bench, "random_bridge", lambda *a, **k: built.append(1))
    args = ["bench", "mapper", "--shapes", "qwen3-0.6b:qwen3-1.7b", "--old-vs-new", "--interleave"]
    with pytest.raises(SystemExit) as err:
        main(args)
    assert err.value.code == 2 and not built
    message = capsys.readouterr().err
    assert "--old-vs-new" in message and "drop --interleave" in message


TINY_SHAPES = {"tiny-s": (32, 2, 2, 1, 16, 64, 128, True), "tiny-t": (48, 3, 2, 1, 16, 96, 128, False)}


def _with_tiny_shapes(monkeypatch):
    """`TINY_SHAPES` among the checkpoint shapes the calibration bench builds, for this test only."""
    for name, shape in TINY_SHAPES.items():
        monkeypatch.setitem(shapes.CHECKPOINT_SHAPES, name, shape)


def test_calibration_bench_splits_its_time(tmp_path, capsys, monkeypatch):
    """`kvbridge bench calibration` charges each stage its own time: the λ search and the solves, each slowed by a
    known delay, show it in their own fields; the projection adds the per-token stages scaled and the rest as is."""
    import hf_kvbridge.calibration.budgeted_fit as calibration
    from hf_kvbridge.mappers import KVMapper
    from hf_kvbridge.tools.bench import calibration as bench

    _with_tiny_shapes(monkeypatch)
    monkeypatch.setattr(calibration, "choose_ridge_lambdas", _slowed(calibration.choose_ridge_lambdas, 0.3))
    monkeypatch.setattr(KVMapper, "fit_targets", _slowed(KVMapper.fit_targets, 0.5))
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
    import hf_kvbridge.calibration.budgeted_fit as calibration

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


def test_gpu_script_runs_every_step_at_tiny_shapes_without_the_optional_packages(tmp_path):
    """`scripts/bench_gpu.sh` (run for real on a lent GPU) in its smoke mode: one process runs every step at tiny
    shapes on the CPU, with `datasets`, `lm_eval` and `vllm` made unimportable (the GPU machine has none of them),
    and the one JSON holds each step's status and result: the schedules' maps and op counts, time to first token
    eager and compiled, the calibration, the λ searches agreeing, the vLLM helpers equal."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    blocker = tmp_path / "site"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import sys\n"
        "class _Absent:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('datasets', 'lm_eval', 'vllm'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r} (absent on the GPU machine)')\n"
        "sys.meta_path.insert(0, _Absent())\n"
    )
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out), "SMOKE": "1", "PYTHONPATH": str(blocker)}
    done = subprocess.run(["bash", str(root / "scripts" / "bench_gpu.sh")], env=env, cwd=tmp_path, text=True,
                          capture_output=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "bench-gpu.json").read_text())
    steps = result["steps"]
    assert result["smoke"] and {name: step["status"] for name, step in steps.items()} == dict.fromkeys(steps, "ok")
    names = {"device", "lambda_search", "vllm_helpers", "exactness", "calibration", "build_large", "table_32",
             "table_64", "ttft_same_head_64", "ttft_all_heads_32", "small_pair"}  # fmt: skip
    assert names <= set(steps), sorted(steps)
    row = steps["table_64"]["result"]["same_head"]
    assert row["layers_ops_per_target_layer"] <= 12 < row["chunked_ops_per_target_layer"]
    assert row["floor_s"] > 0 and row["fraction_of_floor"] > 0
    ttft = steps["ttft_all_heads_32"]["result"]
    assert ttft["compiled"]["compiled_hold_back"] and ttft["eager"]["warm_ttft_s"] > 0
    search = steps["lambda_search"]["result"]
    assert search["cholesky_max_r2_difference"] < 1e-9 and search["eigh32_max_r2_difference"] < 1e-4
    helpers = steps["vllm_helpers"]["result"]
    assert helpers["read_slots_equal"] and helpers["reads_back"] and helpers["rotary_max_abs_difference"] == 0
    assert steps["calibration"]["result"]["lambda_seconds"] >= 0
    exact = steps["exactness"]["result"]
    assert exact["all_heads_float32_default"] < 1e-6 and exact["same_head_bfloat16_default"] < 1e-2


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["bench", "mapper", "--shapes", "qwen3-0.6b", "--lengths", "16"], "--shapes takes SOURCE:TARGET"),
        (["bench", "mapper", "--shapes", "qwen3-0.6b:qwen3-9b", "--lengths", "16"], "unknown shape 'qwen3-9b'"),
        (["bench", "calibration", "--pair", "qwen3-0.6b", "--flop-model"], "--pair takes SOURCE:TARGET"),
        (["bench", "calibration", "--pair", "foo:qwen3-1.7b", "--flop-model"], "unknown shape 'foo'"),
        (["bench", "calibration", "--pair", "qwen3-0.6b:a:b"], "--pair takes SOURCE:TARGET"),
        (["bench", "calibration", "--pair", "small-3l-2x64:small-8l-2x64"], "unknown shape 'small-3l-2x64'"),
    ],
)
def test_bench_names_a_bad_pair_of_shapes_and_the_known_ones(argv, expected, capsys, monkeypatch):
    """A malformed or unknown `--shapes` / `--pair` is refused with the known names, before any model is built."""
    from hf_kvbridge.tools.bench import calibration, mapper

    def no_build(*args, **kwargs):
        raise AssertionError("a model was built for a bad pair")

    monkeypatch.setattr(calibration, "random_model", no_build)
    monkeypatch.setattr(mapper, "random_bridge", no_build)
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert expected in err and "known: qwen3-0.6b, qwen3-1.7b" in err and "a model was built" not in err


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
