"""Ridge λ chosen by held-out fit: the λ path equals one ridge solve per λ, auto-λ tracks how much data there is,
and bridges keep their per-layer λ through save/load (old scalar-λ checkpoints still load)."""

import json

import pytest
import torch

from hf_kvbridge import KVBridgeForCausalLM
from hf_kvbridge.calibration import collect_statistics, fit_bridge
from hf_kvbridge.mappers import KVMapper
from hf_kvbridge.selection import mapped_heldout_r2, mapper_r2, single_layer_r2
from hf_kvbridge.solve import LAMBDA_GRID, choose_ridge_lambdas, heldout_r2_path, solve_ridge
from hf_kvbridge.statistics import KVStatistics
from tests.conftest import VOCAB, qwen3

# 4 source layers × 1 head × 2·4 dims = 32 features → 1 target layer of 8 outputs
LAYERS, HEADS, DIM = 4, 1, 4
FEATURES = LAYERS * HEADS * 2 * DIM


def _relation(seed=0):
    """A fixed linear map from correlated inputs (like concatenated, correlated source layers)."""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(FEATURES, FEATURES, generator=gen, dtype=torch.float64)
    mix = 0.3 * mix + torch.eye(FEATURES, dtype=torch.float64) * 0.2  # correlated features, all of them used
    weight = torch.randn(FEATURES, 2 * DIM, generator=gen, dtype=torch.float64) / FEATURES**0.5
    return mix, weight


RELATION = _relation()


def _stats(n, seed, noise=0.3):
    mix, weight = RELATION
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=gen, dtype=torch.float64) @ mix
    x = x * torch.linspace(0.1, 10, FEATURES, dtype=torch.float64)  # features at very different scales
    y = x @ (weight / torch.linspace(0.1, 10, FEATURES, dtype=torch.float64)[:, None])
    y = y + noise * y.std(0) * torch.randn(n, 2 * DIM, generator=gen, dtype=torch.float64) + 2.0
    stats = KVStatistics(LAYERS, 1, HEADS, DIM)
    stats.update(x, y)
    return stats


def test_lambda_path_equals_one_ridge_solve_per_lambda():
    """Every point of the eigendecomposition path is the held-out R² of `solve_ridge` at that λ (oracle: the
    Cholesky solve and `residual_sums`), per head and K/V."""
    train, held = _stats(200, 0), _stats(150, 1)
    x_idx, y_idx = train.source_index([2, 0, 3]), train.target_index(0)
    lambdas = [1e-5, 1e-2, 0.5]
    path = heldout_r2_path(train, held, x_idx, y_idx, DIM, lambdas)  # (3, 1, 2)
    for i, lam in enumerate(lambdas):
        weight, bias = solve_ridge(train, x_idx, y_idx, lam)
        sse, sst = held.residual_sums(x_idx, y_idx, weight, bias)
        r2 = 1 - sse.view(2, DIM).sum(-1) / sst.view(2, DIM).sum(-1)
        torch.testing.assert_close(path[i, 0], r2, atol=1e-9, rtol=1e-9)


def test_per_column_lambda_is_one_ridge_fit_per_column_group():
    stats = _stats(300, 2)
    x_idx, y_idx = stats.source_index([0, 1]), stats.target_index(0)
    per_column = torch.tensor([1e-4] * DIM + [0.3] * DIM, dtype=torch.float64)
    weight, bias = solve_ridge(stats, x_idx, y_idx, per_column)
    w_k, b_k = solve_ridge(stats, x_idx, y_idx, 1e-4)
    w_v, b_v = solve_ridge(stats, x_idx, y_idx, 0.3)
    torch.testing.assert_close(weight, torch.cat([w_k[:, :DIM], w_v[:, DIM:]], 1))
    torch.testing.assert_close(bias, torch.cat([b_k[:DIM], b_v[DIM:]]))


def _auto_vs_fixed(train, held, test):
    """λ auto-chosen on (train, held), and test-set R² of auto and of both grid ends, each refitted on train + held."""
    layers = [list(range(LAYERS))]
    lambdas, _ = choose_ridge_lambdas(train, held, layers, "all_heads", HEADS, DIM)
    everything = train + held
    r2 = {
        name: float(mapped_heldout_r2(KVMapper.from_statistics(everything, layers, "all_heads", lam), test).mean())
        for name, lam in (("auto", lambdas), ("smallest", LAMBDA_GRID[0]), ("largest", LAMBDA_GRID[-1]))
    }
    return lambdas, r2


def test_auto_lambda_is_small_with_plentiful_data_and_larger_with_scarce_data():
    test = _stats(4000, 99)
    plenty, plenty_r2 = _auto_vs_fixed(_stats(20_000, 10), _stats(5000, 11), test)
    scarce, scarce_r2 = _auto_vs_fixed(_stats(FEATURES - 4, 20), _stats(FEATURES - 4, 21), test)  # features ≥ tokens
    for kv in ("k", "v"):
        assert plenty[kv][0][0] <= 1e-3, plenty
        assert scarce[kv][0][0] >= 3e-2, scarce
        assert scarce[kv][0][0] >= 100 * plenty[kv][0][0]
    # on data neither fit saw: scarce, auto beats both ends of the grid; plentiful, it ties the weakest ridge (its
    # choice) and beats the strongest
    assert scarce_r2["auto"] > max(scarce_r2["smallest"], scarce_r2["largest"]) + 0.03, scarce_r2
    assert plenty_r2["auto"] >= plenty_r2["smallest"] - 1e-4 and plenty_r2["auto"] > plenty_r2["largest"] + 0.05


@pytest.fixture(scope="module")
def pair_statistics(windows):
    source, target = qwen3(layers=2, seed=1), qwen3(layers=3, hidden=48, seed=2)
    train, heldout = collect_statistics(source, target, windows, heldout=[0, 1, 2, 3])
    return source, target, train, heldout


@pytest.mark.parametrize("head_mode", ["all_heads", "same_head"])
def test_fit_bridge_records_lambda_per_layer_and_head(pair_statistics, head_mode):
    source, target, train, heldout = pair_statistics
    bridge = fit_bridge(source, target, train, heldout, top_k=2, head_mode=head_mode)  # auto is the default
    config = bridge.config
    groups = 1 if head_mode == "all_heads" else train.num_kv_heads
    assert config.ridge_lambda == "auto"
    assert set(config.ridge_lambdas) == {"k", "v"}
    assert [len(layer) for layer in config.ridge_lambdas["k"]] == [groups] * 3
    assert all(v in LAMBDA_GRID for kv in ("k", "v") for layer in config.ridge_lambdas[kv] for v in layer)
    # the recorded held-out R² is that of the chosen λ, and no fixed λ of the grid does better on any layer
    r2 = torch.tensor([config.heldout_r2["k"], config.heldout_r2["v"]]).T  # (L_t, 2)
    chosen = mapper_r2(train, heldout, config.selected_layers, head_mode, config.ridge_lambdas)
    torch.testing.assert_close(r2, chosen.float(), atol=1e-5, rtol=0)
    torch.testing.assert_close(mapper_r2(train, heldout, config.selected_layers, head_mode, "auto"), chosen)
    for lam in LAMBDA_GRID[::3]:
        fixed = mapper_r2(train, heldout, config.selected_layers, head_mode, lam)
        assert (chosen >= fixed - 1e-9).all()
    # auto layer selection scores each single layer at its best λ: never below a fixed λ's score
    best_single = single_layer_r2(train, heldout, head_mode, "auto")  # (L_t, L_s, 2)
    assert (best_single >= single_layer_r2(train, heldout, head_mode, 0.01) - 1e-9).all()


def test_save_load_keeps_per_layer_lambda_and_old_scalar_checkpoints_load(pair_statistics, tmp_path):
    source, target, train, heldout = pair_statistics
    auto = fit_bridge(source, target, train, heldout, top_k=2)
    auto.save_pretrained(tmp_path / "auto")
    saved = json.loads((tmp_path / "auto" / "config.json").read_text())
    expected, _ = choose_ridge_lambdas(train, heldout, auto.config.selected_layers, "all_heads", 2, train.head_dim)
    assert saved["ridge_lambda"] == "auto" and saved["ridge_lambdas"] == expected
    loaded = KVBridgeForCausalLM.from_pretrained(tmp_path / "auto", source_model=source, target_model=target)
    assert loaded.config.ridge_lambdas == auto.config.ridge_lambdas
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(loaded(ids).logits, auto(ids).logits)

    # a checkpoint written before auto-λ: one number, no `ridge_lambdas` key
    old = fit_bridge(source, target, train, heldout, top_k=2, ridge_lambda=0.01)
    old.save_pretrained(tmp_path / "old")
    path = tmp_path / "old" / "config.json"
    config = json.loads(path.read_text())
    config.pop("ridge_lambdas", None)
    path.write_text(json.dumps(config))
    loaded = KVBridgeForCausalLM.from_pretrained(tmp_path / "old", source_model=source, target_model=target)
    assert loaded.config.ridge_lambda == 0.01 and loaded.config.ridge_lambdas is None
    torch.testing.assert_close(loaded(ids).logits, old(ids).logits)


def test_identity_pair_picks_the_weakest_ridge(windows):
    """Source == target: K/V are predicted exactly, so the held-out fit prefers the smallest λ of the grid."""
    model = qwen3(layers=2, seed=3)
    train, heldout = collect_statistics(model, model, windows, heldout=[0, 1, 2, 3])
    bridge = fit_bridge(model, model, train, heldout, top_k=1)
    assert all(v == LAMBDA_GRID[0] for kv in ("k", "v") for layer in bridge.config.ridge_lambdas[kv] for v in layer)
    assert min(bridge.config.heldout_r2["k"] + bridge.config.heldout_r2["v"]) > 0.999


def test_bad_ridge_lambda_is_refused_before_any_work():
    from hf_kvbridge.settings import CalibrationSettings

    for bad in ("best", -1.0, True):
        with pytest.raises(ValueError, match="ridge_lambda must be 'auto' or a number"):
            CalibrationSettings(ridge_lambda=bad)
    assert CalibrationSettings().ridge_lambda == "auto"


def test_cli_ridge_lambda_accepts_auto_or_a_number(capsys):
    from hf_kvbridge.cli.main import main
    from kvbridge_cli.parser import _ridge_lambda

    assert _ridge_lambda("auto") == "auto" and _ridge_lambda("0.5") == 0.5
    with pytest.raises(SystemExit) as exit_info:
        main(["calibrate", "src", "tgt", "--out", "unused", "--ridge-lambda", "-1"])
    assert exit_info.value.code == 2 and "expected 'auto' or a number ≥ 0" in capsys.readouterr().err
