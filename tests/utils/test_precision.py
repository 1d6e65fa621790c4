"""The mapper's dtype (`hf_kvbridge.utils.precision`, `KVBridgeForCausalLM.mapping_mapper`): float32 at PyTorch's
default
matmul precision, a bfloat16 copy where `torch.set_float32_matmul_precision("medium")` allows it on bfloat16 units,
and the dtype asked for with `mapper_dtype`."""

import pytest
import torch
from safetensors.torch import load_file

from hf_kvbridge.errors import InvalidInputError
from hf_kvbridge.fitting.calibration.calibrate import fit_bridge
from hf_kvbridge.fitting.calibration.data_pass import collect_statistics
from hf_kvbridge.modeling import KVBridgeForCausalLM
from hf_kvbridge.utils import precision
from hf_kvbridge.utils.precision import bf16_matmul_allowed, float32_matmul_precision, resolve_mapper_dtype
from tests.conftest import VOCAB, qwen3


@pytest.fixture
def bf16_units(monkeypatch):
    """bfloat16 matrix units as far as the bridge can tell, on any CPU (without them bfloat16 is emulated: slow, but
    exact to bfloat16 rounding, which is all these tiny shapes need)."""
    monkeypatch.setattr(precision, "bf16_matmul_units", lambda device: True)


@pytest.fixture(scope="module")
def pair_bridge(windows):
    source, target = qwen3(layers=2, seed=1), qwen3(layers=3, hidden=48, seed=2)
    train, heldout = collect_statistics(source, target, windows, heldout=[0, 1, 2, 3])
    # a firm λ keeps the weights small: at auto-λ this tiny random pair's map has weights up to 182 that cancel, and
    # bfloat16 rows then err by 7 % (0.2 % here); the rounding itself is what these tests look at
    return fit_bridge(source, target, train, heldout, top_k=2, ridge_lambda=1.0)


def _cache(bridge, seq=24, seed=0):
    ids = torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(seed))
    return bridge.source(ids, use_cache=True).past_key_values


def _relative(a, b):
    return max(
        ((x.keys - y.keys).norm() / y.keys.norm()).item() + ((x.values - y.values).norm() / y.values.norm()).item()
        for x, y in zip(a.layers, b.layers)
    )


def test_resolve_mapper_dtype(bf16_units):
    assert resolve_mapper_dtype(torch.bfloat16, "cpu") == torch.bfloat16  # a half target's own dtype
    assert resolve_mapper_dtype(torch.float16, "cpu", "auto") == torch.float16
    assert resolve_mapper_dtype(torch.float32, "cpu") == torch.float32  # PyTorch's default precision: "highest"
    with float32_matmul_precision("medium"):
        assert resolve_mapper_dtype(torch.float32, "cpu") == torch.bfloat16
        assert resolve_mapper_dtype(torch.float32, "cpu", torch.float32) == torch.float32  # asked for: kept
    with float32_matmul_precision("high"):  # TF32 is no licence for bfloat16
        assert resolve_mapper_dtype(torch.float32, "cpu") == torch.float32
    assert resolve_mapper_dtype(torch.float32, "cpu", "bfloat16") == torch.bfloat16
    assert resolve_mapper_dtype(torch.bfloat16, "cpu", "torch.float32") == torch.float32


def test_no_bf16_units_no_bf16(monkeypatch):
    monkeypatch.setattr(precision, "bf16_matmul_units", lambda device: False)
    with float32_matmul_precision("medium"):
        assert resolve_mapper_dtype(torch.float32, "cpu") == torch.float32


@pytest.mark.parametrize("bad", ["int8", "float64", "bf16x", torch.int8, torch.float64, 3])
def test_bad_mapper_dtype_is_named(bad):
    with pytest.raises(InvalidInputError, match="mapper_dtype must be") as raised:
        resolve_mapper_dtype(torch.float32, "cpu", bad)
    assert str(raised.value).endswith(f"got {bad!r}")  # what the caller passed, as passed


def test_backend_api_setting_is_read():
    """Set through the backend API (`torch.backends.mkldnn.matmul.fp32_precision`), where PyTorch's summary refuses to
    answer; restored afterwards."""
    matmul = torch.backends.mkldnn.matmul
    before = matmul.fp32_precision
    try:
        matmul.fp32_precision = "bf16"
        assert bf16_matmul_allowed("cpu")
        matmul.fp32_precision = "ieee"
        assert not bf16_matmul_allowed("cpu")
    finally:
        matmul.fp32_precision = before
        torch.set_float32_matmul_precision("highest")
    assert not bf16_matmul_allowed("cpu")


def test_float32_matmul_precision_restores():
    torch.set_float32_matmul_precision("highest")
    with float32_matmul_precision("medium"):
        assert torch.get_float32_matmul_precision() == "medium"
    assert torch.get_float32_matmul_precision() == "highest"


def test_medium_precision_maps_with_a_bf16_copy(pair_bridge, bf16_units, tmp_path):
    bridge = KVBridgeForCausalLM(pair_bridge.config, pair_bridge.source, pair_bridge.target, pair_bridge.mapper)
    cache = _cache(bridge)
    assert bridge.mapping_mapper() is bridge.mapper  # the default precision: the float32 mapper itself
    exact = bridge.map_cache(cache)
    with float32_matmul_precision("medium"):
        copy = bridge.mapping_mapper()
        assert copy is not bridge.mapper and copy.layout_dtype() == torch.bfloat16
        assert bridge.mapping_mapper() is copy  # kept between calls
        mapped = bridge.map_cache(cache)
        # the cache stays in the target's dtype; bfloat16 rounding (8 bits), not another map
        assert all(layer.keys.dtype == torch.float32 for layer in mapped.layers)
        assert 0 < _relative(mapped, exact) < 1e-2
        with torch.no_grad():
            bridge.mapper.layers[0].weight.mul_(2.0)  # an in-place edit: the copy is rebuilt from it
        assert bridge.mapping_mapper() is not copy
        edited = bridge.map_cache(cache)
        with torch.no_grad():
            bridge.mapper.layers[0].weight.mul_(0.5)
        assert _relative(edited, mapped) > 0.05
    assert bridge.mapper.layout_dtype() == torch.float32  # what is saved stays float32
    assert not any("compute" in name for name in bridge.state_dict())
    bridge.save_pretrained(tmp_path / "saved")
    weights = load_file(tmp_path / "saved" / "mapper.safetensors")
    assert {t.dtype for t in weights.values() if t.is_floating_point()} == {torch.float32}
    assert bridge.mapping_mapper() is bridge.mapper  # back at "highest"


def test_explicit_mapper_dtype_is_kept(pair_bridge, bf16_units):
    bridge = KVBridgeForCausalLM(
        pair_bridge.config, pair_bridge.source, pair_bridge.target, pair_bridge.mapper, mapper_dtype="bfloat16"
    )
    assert bridge.mapper.layout_dtype() == torch.bfloat16 and pair_bridge.mapper.layout_dtype() == torch.float32
    assert bridge.mapping_mapper() is bridge.mapper
    exact = pair_bridge.map_cache(_cache(bridge))
    assert 0 < _relative(bridge.map_cache(_cache(bridge)), exact) < 1e-2
    pinned = KVBridgeForCausalLM(
        pair_bridge.config, pair_bridge.source, pair_bridge.target, pair_bridge.mapper, mapper_dtype=torch.float32
    )
    with float32_matmul_precision("medium"):  # asked for float32: no copy, whatever the precision
        assert pinned.mapping_mapper() is pinned.mapper


def test_bf16_mapper_with_float32_caches_matches_the_float32_engine(pair_bridge):
    """The engine's scratch path (a mapper in another dtype than the caches: rotations in the caches' dtype, on
    copies) against the float32 engine with the same bfloat16 weights held in float32: they differ only by the
    rounding of the rows and of the products' outputs to bfloat16. A skipped or misplaced rotation is far off."""
    bf16 = KVBridgeForCausalLM(
        pair_bridge.config, pair_bridge.source, pair_bridge.target, pair_bridge.mapper, mapper_dtype=torch.bfloat16
    )
    rounded = KVBridgeForCausalLM(
        pair_bridge.config, pair_bridge.source, pair_bridge.target, bf16.mapper, mapper_dtype=torch.float32
    )  # the bfloat16 weights, exactly, in float32
    cache = _cache(pair_bridge, seq=40, seed=3)
    assert _relative(bf16.map_cache(cache), rounded.map_cache(cache)) < 1e-2


def test_from_pretrained_takes_mapper_dtype(pair_bridge, tmp_path, monkeypatch):
    pair_bridge.save_pretrained(tmp_path / "b")
    loaded = KVBridgeForCausalLM.from_pretrained(
        tmp_path / "b", pair_bridge.source, pair_bridge.target, mapper_dtype=torch.bfloat16
    )
    assert loaded.mapper.layout_dtype() == torch.bfloat16

    def no_loading(*args, **kwargs):
        raise AssertionError("a bad mapper_dtype must be refused before anything is read")

    from hf_kvbridge import persistence

    monkeypatch.setattr(persistence, "resolve_checkpoint", no_loading)
    with pytest.raises(InvalidInputError, match="mapper_dtype must be"):
        KVBridgeForCausalLM.from_pretrained(tmp_path / "b", mapper_dtype="int8")


def test_statistics_under_medium_precision_match_float64():
    """Under "medium", float32 statistics products run in bfloat16 with float32 accumulation on bfloat16 units (the
    lever for calibration's statistics on such hardware): the moments, the ridge map and its held-out R² stay close
    to float64 statistics of the same rows."""
    from hf_kvbridge.fitting.solve import solve_ridge
    from hf_kvbridge.fitting.statistics.blocks import BlockStatistics

    gen = torch.Generator().manual_seed(0)
    mix = torch.randn(24, 24, generator=gen, dtype=torch.float64)
    x = torch.randn(3000, 24, generator=gen, dtype=torch.float64) @ mix + 2.0  # 3 source layers × 2 heads × 2·2 dims
    w = torch.randn(24, 16, generator=gen, dtype=torch.float64)
    y = x @ w + 0.5 * torch.randn(3000, 16, generator=gen, dtype=torch.float64) - 1.0  # 2 target layers
    train, held = slice(0, 2500), slice(2500, None)

    def fit(dtype, precision):
        stats = [BlockStatistics(3, 2, 2, 2, sources=[0, 1, 2], targets=[0, 1], dtype=dtype) for _ in range(2)]
        with float32_matmul_precision(precision):
            stats[0].update(x[train].to(dtype), y[train].to(dtype))
            stats[1].update(x[held].to(dtype), y[held].to(dtype))
        x_idx, y_idx = stats[0].source_index([0, 1, 2]), stats[0].target_index(1)
        weight, bias = solve_ridge(stats[0], x_idx, y_idx, ridge_lambda=0.01)
        sse, sst = stats[1].residual_sums(x_idx, y_idx, weight, bias)
        return stats[0].moments(x_idx, y_idx), weight, (1 - sse / sst).mean().item()

    (_, _, cxx, cxy, _), weight, r2 = fit(torch.float64, "highest")
    (_, _, cxx_m, cxy_m, _), weight_m, r2_m = fit(torch.float32, "medium")
    errors = [((a - b).norm() / b.norm()).item() for a, b in ((cxx_m, cxx), (cxy_m, cxy), (weight_m, weight))]
    assert max(errors) < 2e-3, errors
    assert abs(r2_m - r2) < 1e-3 and r2 > 0.9
    if _medium_rounds_float32_products():  # PyTorch ran float32 products in bfloat16 here: so did the statistics
        assert errors[0] > 1e-6


def _medium_rounds_float32_products() -> bool:
    """Whether "medium" makes this machine's float32 `baddbmm` round its inputs to bfloat16. oneDNN does it on AMX
    (the Xeon of 2026-12-04); on an AMD EPYC with avx512_bf16 but no AMX it keeps float32 products, although
    `precision.bf16_matmul_units` is true there (explicit bfloat16 products do run on its bfloat16 units)."""
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(1, 64, 64, generator=gen), torch.randn(1, 64, 64, generator=gen)
    exact = (a.double() @ b.double()).float()
    with float32_matmul_precision("medium"):
        product = torch.baddbmm(torch.zeros(1, 64, 64), a, b)
    return ((product - exact).norm() / exact.norm()).item() > 1e-5


@pytest.mark.parametrize("head_mode", ["all_heads", "same_head"])
@pytest.mark.parametrize("kv_mode", ["joint", "separate"])
def test_bf16_mapper_every_layout(windows, head_mode, kv_mode):
    """The scratch path fits every mapper layout (its buffers are sized from the schedule): a bfloat16 mapper of each
    head and K/V mode maps a float32 pair to within bfloat16 rounding of its float32 mapper."""
    source, target = qwen3(layers=2, seed=1, kv_heads=2), qwen3(layers=3, hidden=48, seed=2, kv_heads=4)
    train, heldout = collect_statistics(source, target, windows, heldout=[0, 1, 2, 3])
    exact = fit_bridge(source, target, train, heldout, top_k=2, head_mode=head_mode, kv_mode=kv_mode, ridge_lambda=1.0)
    bf16 = KVBridgeForCausalLM(exact.config, source, target, exact.mapper, mapper_dtype=torch.bfloat16)
    cache = _cache(exact, seq=30, seed=4)
    assert 0 < _relative(bf16.map_cache(cache), exact.map_cache(cache)) < 1e-2
