"""The residual MLP mapper, the attention-weighted closed form and the mapper study (`hf_kvbridge.mappers.mlp`,
`.weighted`, `studies.mapper_study`)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_kvbridge
from hf_kvbridge import KVBridgeForCausalLM, KVStatistics
from hf_kvbridge.errors import MapperError
from hf_kvbridge.fitting.calibration.calibrate import fit_bridge
from hf_kvbridge.fitting.calibration.data_pass import collect_statistics
from hf_kvbridge.fitting.content_rows import cache_rows
from hf_kvbridge.fitting.mapper_fits import refit
from hf_kvbridge.fitting.solve import effective_ridge_lambda
from hf_kvbridge.fitting.statistics.weighted import WeightedKVStatistics
from hf_kvbridge.mappers import KVMapper, MLPKVMapper, build_mapper
from hf_kvbridge.mappers.mlp import rows_from_layout, rows_in_layout, train_mlp_mapper
from hf_kvbridge.mappers.weighted import attention_mass, fit_attention_weighted
from tests.conftest import CORPUS, VOCAB, qwen3


@pytest.fixture(scope="module")
def pair():
    return qwen3(layers=2, seed=1), qwen3(layers=3, hidden=48, seed=2)


@pytest.fixture(scope="module")
def few(windows):
    return windows[:12]  # 576 tokens: enough for 2 source layers × 64 features, and fast


@pytest.fixture(scope="module")
def ridge_bridge(pair, few):
    source, target = pair
    train, heldout = collect_statistics(source, target, few, heldout=[0, 1])
    return fit_bridge(source, target, train, heldout, top_k=2)


def _mapped(bridge, ids):
    return bridge.map_cache(bridge.source(ids, use_cache=True).cache)


def _normalised_error(bridge, windows) -> float:
    """Σ over target layers of the K/V squared error, each feature divided by its variance (mean over features)."""
    mapper, width = bridge.mapper, bridge.target_layout.features_per_layer
    x, y = cache_rows(bridge.source, windows), cache_rows(bridge.target, windows)
    total = 0.0
    with torch.no_grad():
        for t, layers in enumerate(mapper.selected_layers):
            rows = [rows_in_layout(mapper, x[:, s * width : (s + 1) * width]) for s in layers]
            pred = rows_from_layout(mapper, mapper.map_layer(t, rows))  # (N, H·2d)
            truth = y[:, t * width : (t + 1) * width]
            total += float(((pred - truth) ** 2).mean(0).div(truth.var(0)).mean())
    return total


def test_mlp_starts_exactly_as_ridge(ridge_bridge, pair):
    mlp = MLPKVMapper.from_linear(ridge_bridge.mapper, hidden=16)
    assert any(residual.w1.abs().sum() > 0 for residual in mlp.residuals)  # random first layer, zero last layer
    bridge = KVBridgeForCausalLM(ridge_bridge.config, *pair, mlp)
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(7))
    ridge_bridge.mapper.groupable = False  # layer by layer, as the MLP maps: the same sums in the same order
    try:
        want, got = _mapped(ridge_bridge, ids), _mapped(bridge, ids)
    finally:
        del ridge_bridge.mapper.groupable
    for layer in range(3):
        assert torch.equal(got.layers[layer].keys, want.layers[layer].keys)
        assert torch.equal(got.layers[layer].values, want.layers[layer].values)


@pytest.mark.parametrize("head_mode", ["all_heads", "same_head"])
def test_mlp_training_lowers_heldout_error(pair, windows, head_mode):
    source, target = pair
    train, heldout = collect_statistics(source, target, windows, heldout=[0, 1, 2, 3])
    ridge = fit_bridge(source, target, train, heldout, top_k=2, head_mode=head_mode)
    mlp = refit(ridge, "mlp", windows=windows, hidden=64, epochs=3, lr=3e-3, batch_size=8)
    assert mlp.config.mapper_type == "mlp" and ridge.config.mapper_type == "ridge"  # the input bridge is untouched
    assert mlp.config.mapper_kwargs["hidden"] == 64 and mlp.config.mapper_kwargs["loss"] == "mse"
    assert not any(p.requires_grad for p in mlp.mapper.parameters())
    fresh = torch.randint(0, VOCAB, (8, 48), generator=torch.Generator().manual_seed(11))  # never trained on
    # strictly lower: the residual starts at zero, so an untrained MLP equals the ridge map exactly (`<=` would hold)
    assert _normalised_error(mlp, fresh) < _normalised_error(ridge, fresh)


def test_mlp_attention_loss_trains(ridge_bridge, few):
    mlp = refit(ridge_bridge, "mlp", windows=few, hidden=32, loss="attention", epochs=2, lr=3e-3, batch_size=6)
    losses = mlp.config.mapper_kwargs["epoch_losses"]
    assert mlp.config.mapper_kwargs["loss"] == "attention"
    assert losses[-1] < losses[0]
    with pytest.raises(ValueError, match="loss must be one of"):
        refit(ridge_bridge, "mlp", windows=few, loss="l1")


def test_mlp_save_load_round_trip(saved_pair, tmp_path, few):
    source = AutoModelForCausalLM.from_pretrained(saved_pair["small"]).eval()
    target = AutoModelForCausalLM.from_pretrained(saved_pair["large"]).eval()
    train, heldout = collect_statistics(source, target, few, heldout=[0, 1])
    ridge = fit_bridge(
        source,
        target,
        train,
        heldout,
        top_k=2,
        config_kwargs={"source_name_or_path": saved_pair["small"], "target_name_or_path": saved_pair["large"]},
    )
    mlp = refit(ridge, "mlp", windows=few, hidden=16, epochs=1, batch_size=12)
    mlp.save_pretrained(tmp_path / "mlp")
    assert {p.name for p in (tmp_path / "mlp").iterdir()} == {
        "config.json",
        "mapper.safetensors",
        "README.md",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "mlp")
    assert isinstance(loaded, KVBridgeForCausalLM) and isinstance(loaded.mapper, MLPKVMapper)
    assert loaded.config.mapper_type == "mlp"
    assert loaded.config.mapper_kwargs == mlp.config.mapper_kwargs
    ids = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(3))
    want, got = _mapped(mlp, ids), _mapped(loaded, ids)
    for layer in range(3):
        assert torch.equal(got.layers[layer].keys, want.layers[layer].keys)
        assert torch.equal(got.layers[layer].values, want.layers[layer].values)
    assert loaded.generate(ids, max_new_tokens=3, do_sample=False).shape == (2, 20)


def test_build_mapper_refuses_unknown_type(ridge_bridge):
    config = ridge_bridge.config.__class__.from_dict({**ridge_bridge.config.to_dict(), "mapper_type": "transformer"})
    with pytest.raises(ValueError, match="unknown mapper_type 'transformer'"):
        build_mapper(config, ridge_bridge.target_layout)


def test_calibrate_with_mlp(saved_pair):
    bridge = hf_kvbridge.calibrate(
        saved_pair["small"],
        saved_pair["large"],
        CORPUS,
        num_sequences=10,
        seq_len=32,
        top_k=1,
        mapper_type="mlp",
        mlp_kwargs={"hidden": 8, "epochs": 1},
    )
    assert bridge.config.mapper_type == "mlp" and isinstance(bridge.mapper, MLPKVMapper)
    assert bridge.config.mapper_kwargs["windows"] == 10
    with pytest.raises(ValueError, match="unknown mapper_type .svm.; this hf_kvbridge knows ridge"):
        hf_kvbridge.calibrate(saved_pair["small"], saved_pair["large"], CORPUS, mapper_type="svm")


# -- attention-weighted closed form ----------------------------------------------------------------------------------
def test_weighted_statistics_equal_repeated_tokens():
    """Oracle: weight 2 on a token is the same as that token twice."""
    x, y = torch.randn(6, 8), torch.randn(6, 8)
    weighted = WeightedKVStatistics(2, 2, 1, 2)
    weighted.update(x, y, torch.tensor([1.0, 2, 1, 1, 2, 1]))
    plain = KVStatistics(2, 2, 1, 2)
    plain.update(torch.cat([x, x[[1, 4]]]), torch.cat([y, y[[1, 4]]]))
    assert weighted.count == plain.count == 8
    for name in ("x_sum", "y_sum", "xx", "xy", "yy"):
        torch.testing.assert_close(getattr(weighted, name), getattr(plain, name))


def test_attention_mass_of_uniform_attention():
    """Zero queries attend uniformly over the causal prefix: token j receives Σ_{i ≥ j} 1/(i+1)."""
    seq = 6
    mass = attention_mass(torch.zeros(1, 4, seq, 8), torch.randn(1, 2, seq, 8), scaling=0.5)
    expected = torch.tensor([sum(1 / (i + 1) for i in range(j, seq)) for j in range(seq)])
    torch.testing.assert_close(mass[0], expected / expected.mean())
    assert abs(float(mass.mean()) - 1) < 1e-6


@pytest.mark.parametrize("head_mode", ["all_heads", "same_head"])
def test_uniform_weights_equal_plain_ridge(pair, few, head_mode):
    source, target = pair
    train, heldout = collect_statistics(source, target, few, heldout=[0, 1])
    ridge = fit_bridge(source, target, train, heldout, top_k=2, head_mode=head_mode)
    uniform = refit(ridge, "ridge_attention_weighted", windows=few, weighting="uniform", batch_size=12)
    for got, want in zip(uniform.mapper.layers, ridge.mapper.layers):
        torch.testing.assert_close(got.weight, want.weight, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(got.bias, want.bias, atol=1e-5, rtol=1e-4)


def test_attention_weights_change_the_fit(ridge_bridge, few, tmp_path):
    weighted = refit(ridge_bridge, "ridge_attention_weighted", windows=few, batch_size=12)
    assert weighted.config.mapper_type == "ridge_attention_weighted"
    assert type(weighted.mapper) is KVMapper
    change = max(
        float((a.weight - b.weight).abs().max() / b.weight.abs().max())
        for a, b in zip(weighted.mapper.layers, ridge_bridge.mapper.layers)
    )
    assert change > 1e-3
    weighted.save_pretrained(tmp_path / "weighted")
    loaded = KVBridgeForCausalLM.from_pretrained(
        tmp_path / "weighted", source_model=ridge_bridge.source, target_model=ridge_bridge.target
    )
    assert loaded.config.mapper_type == "ridge_attention_weighted"
    for a, b in zip(loaded.mapper.layers, weighted.mapper.layers):
        assert torch.equal(a.weight, b.weight)


def test_fits_return_mappers(ridge_bridge, few):
    """The MLP and attention-weighted fits take a mapper and the models, and return a mapper, not a bridge."""
    models = {"source": ridge_bridge.source, "target": ridge_bridge.target, "windows": few}
    mlp = train_mlp_mapper(ridge_bridge.mapper, **models, hidden=8, epochs=1, batch_size=12)
    assert type(mlp) is MLPKVMapper and mlp.fit_summary["hidden"] == 8 and mlp.fit_summary["windows"] == 12
    lam = effective_ridge_lambda(ridge_bridge.config)
    weighted = fit_attention_weighted(ridge_bridge.mapper, **models, ridge_lambda=lam, weighting="uniform")
    assert type(weighted) is KVMapper and weighted.fit_summary["weighting"] == "uniform"
    assert ridge_bridge.mapper.fit_summary is None  # the base mapper is left as it was
    with pytest.raises(MapperError, match="linear"):
        train_mlp_mapper(mlp, **models)
