"""`kvbridge bench mapper` (`hf_kvbridge.tools.bench.mapper`) measures what it says: timings, FLOPs and memory on
tiny random-weight bridges; and the GPU script's commands parse."""

import json

import pytest

from hf_kvbridge.tools.bench import shapes
from hf_kvbridge.tools.bench.flop_model import mapper_flops
from hf_kvbridge.tools.bench.mapper import benchmark
from hf_kvbridge.tools.bench.shapes import random_bridge
from kvbridge_cli import main
from tests.conftest import qwen3, slowed


def test_benchmark_times_what_it_names(monkeypatch):
    """Each timing is of its own function: slowed down by a known delay, the right field grows by it."""
    bridge = random_bridge(qwen3(layers=2).config, qwen3(layers=3, hidden=48).config, top_k=2)

    monkeypatch.setattr(bridge, "map_cache", slowed(bridge.map_cache, 0.12))
    monkeypatch.setattr(bridge.target.model, "forward", slowed(bridge.target.model.forward, 0.04))
    (row,) = benchmark(bridge, [32], repeats=2)
    assert row["context_tokens"] == 32
    assert row["mapper_s"] >= 0.12 and row["target_prefill_s"] >= 0.04 and row["source_prefill_s"] > 0
    assert row["warm_speedup"] == pytest.approx(row["target_prefill_s"] / row["mapper_s"])
    assert row["mapper_flops"] == mapper_flops(bridge.mapper, 32)
    # the peak of one mapping includes the cache it returns
    assert row["mapping_peak_extra_bytes"] is None or row["mapping_peak_extra_bytes"] >= row["mapped_cache_bytes"]
    assert row["mapped_cache_bytes"] == 3 * 2 * 2 * 32 * 16 * 4  # layers × (K, V) × heads × tokens × dim × fp32


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


@pytest.mark.parametrize("units", [True, False])
def test_bench_cli_old_vs_new_writes_both_defaults(tmp_path, capsys, monkeypatch, units):
    """`--old-vs-new` times the old default mapping (the float32 mapper) and the new one (a bfloat16 copy under
    matmul precision "medium", where the device has bfloat16 units) of one bridge in one run and writes both, side by
    side, with their ratio and the differences of their outputs: bfloat16 rounding with units, 0 without."""
    from hf_kvbridge.tools.bench import mapper as bench
    from hf_kvbridge.utils import precision

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

    monkeypatch.setattr(mapping, "map_cache", slowed(mapping.map_cache, 0.05))  # the old path calls this one
    monkeypatch.setattr(bridge, "map_cache", slowed(bridge.map_cache, 0.4))  # the new path is the bridge's own
    (row,) = old_vs_new(bridge, [16], repeats=2, warmup=0)
    assert 0.05 <= row["old_default_s"] < row["new_default_s"] and row["new_default_s"] >= 0.4


def test_bench_old_vs_new_refuses_interleave(capsys, monkeypatch):
    """`--old-vs-new --interleave` is refused by the argument checks, before any model is built, naming both."""
    built = []
    monkeypatch.setattr(shapes, "random_bridge", lambda *a, **k: built.append(1))
    args = ["bench", "mapper", "--shapes", "qwen3-0.6b:qwen3-1.7b", "--old-vs-new", "--interleave"]
    with pytest.raises(SystemExit) as err:
        main(args)
    assert err.value.code == 2 and not built
    message = capsys.readouterr().err
    assert "--old-vs-new" in message and "drop --interleave" in message
