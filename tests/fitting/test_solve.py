"""Ridge λ chosen by held-out fit: the λ path equals one ridge solve per λ, auto-λ tracks how much data there is,
and bridges keep their per-layer λ through save/load (old scalar-λ checkpoints still load)."""

import json

import pytest
import torch

from hf_kvbridge import KVBridgeForCausalLM
from hf_kvbridge.errors import InvalidInputError
from hf_kvbridge.fitting.calibration.calibrate import fit_bridge
from hf_kvbridge.fitting.calibration.data_pass import collect_statistics
from hf_kvbridge.fitting.layer_selection import mapped_heldout_r2, mapper_r2, single_layer_r2
from hf_kvbridge.fitting.solve import (
    LAMBDA_GRID,
    choose_ridge_lambdas,
    group_lambda,
    heldout_r2_chunks,
    solve_ridge,
)
from hf_kvbridge.fitting.statistics.dense import KVStatistics
from hf_kvbridge.mappers import KVMapper
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
    path = heldout_r2_chunks(train, held, x_idx, y_idx, DIM, lambdas).view(3, 1, 2)  # λ, head, K/V
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
    from kvbridge_cli import main
    from kvbridge_cli.arguments import _ridge_lambda

    assert _ridge_lambda("auto") == "auto" and _ridge_lambda("0.5") == 0.5
    with pytest.raises(SystemExit) as exit_info:
        main(["calibrate", "src", "tgt", "--out", "unused", "--ridge-lambda", "-1"])
    assert exit_info.value.code == 2 and "expected 'auto' or a number ≥ 0" in capsys.readouterr().err


# -- the memory-lean solve gives the numbers of the straightforward one -----------------------------------------------
# The oracle: the solve as it was before issue 25 (every intermediate a new tensor: eight p × p matrices at its peak).


def _oracle_ridge_weight(cxx, cxy, scale, ridge_lambda):
    system = cxx + torch.diag(ridge_lambda * scale)
    chol, info = torch.linalg.cholesky_ex(system)
    if info.item() == 0:
        return torch.cholesky_solve(cxy, chol)
    return torch.linalg.lstsq(system, cxy, driver="gelsd").solution


def _oracle_solve_ridge(stats, x_idx, y_idx, ridge_lambda):
    mx, my, cxx, cxy, _ = stats.moments(x_idx, y_idx)
    variance = torch.diagonal(cxx)
    scale = variance.clamp_min(1e-6 * variance.mean().clamp_min(torch.finfo(torch.float64).tiny))
    if isinstance(ridge_lambda, torch.Tensor):
        weight = torch.empty_like(cxy)
        for value in ridge_lambda.unique().tolist():
            columns = (ridge_lambda == value).nonzero().squeeze(1)
            weight[:, columns] = _oracle_ridge_weight(cxx, cxy[:, columns], scale, value)
    else:
        weight = _oracle_ridge_weight(cxx, cxy, scale, float(ridge_lambda))
    return weight, my - mx @ weight


def _oracle_r2_chunks(train, heldout, x_idx, y_idx, head_dim, lambdas):
    mx, my, cxx, cxy, _ = train.moments(x_idx, y_idx)
    hmx, hmy, hcxx, hcxy, hvy = heldout.moments(x_idx, y_idx)
    variance = torch.diagonal(cxx)
    root = variance.clamp_min(1e-6 * variance.mean().clamp_min(torch.finfo(torch.float64).tiny)).sqrt()
    z = cxx / root[:, None] / root[None, :]
    evals, evecs = torch.linalg.eigh((z + z.T) / 2)
    evals = evals.clamp_min(0)
    a = evecs.T @ (cxy / root[:, None])
    m = evecs.T @ (hcxx / root[:, None] / root[None, :]) @ evecs
    c = evecs.T @ (hcxy / root[:, None])
    shift = evecs.T @ ((hmx - mx) / root)
    chunks = y_idx.numel() // head_dim
    sst = hvy.view(chunks, head_dim).sum(-1).clamp_min(torch.finfo(torch.float64).tiny)
    out = torch.empty(len(lambdas), chunks, dtype=torch.float64)
    for i, lam in enumerate(lambdas):
        w = a / (evals + lam)[:, None]
        mse = hvy - 2 * (c * w).sum(0) + ((m @ w) * w).sum(0) + (hmy - my - shift @ w) ** 2
        out[i] = 1 - mse.clamp_min(0).view(chunks, head_dim).sum(-1) / sst
    return out


def test_lean_solve_matches_the_oracle_lambda_path_choice_and_refit():
    train, held = _stats(200, 0), _stats(150, 1)
    x_idx, y_idx = train.source_index([2, 0, 3]), train.target_index(0)
    path = heldout_r2_chunks(train, held, x_idx, y_idx, DIM, LAMBDA_GRID)  # (Λ, 2): K, V
    want = _oracle_r2_chunks(train, held, x_idx, y_idx, DIM, LAMBDA_GRID)
    torch.testing.assert_close(path, want, rtol=1e-9, atol=1e-12)
    assert torch.equal(path.argmax(0), want.argmax(0))  # the same λ per column group
    # the statistics are read, never written, by the in-place solve
    before = train.moments(x_idx, y_idx)
    lambdas, r2 = choose_ridge_lambdas(train, held, [[2, 0, 3]], "all_heads", HEADS, DIM)
    for got, kept in zip(train.moments(x_idx, y_idx), before):
        assert torch.equal(got, kept)
    assert [lambdas["k"][0][0], lambdas["v"][0][0]] == [LAMBDA_GRID[int(i)] for i in want.argmax(0)]
    torch.testing.assert_close(r2[0], want.max(0).values, rtol=1e-9, atol=1e-12)
    merged = train + held
    per_column = group_lambda(lambdas, 0, 0, HEADS, DIM)  # K columns and V columns at their own λ
    for lam in (per_column, 1e-3, LAMBDA_GRID[0]):
        got, want_fit = solve_ridge(merged, x_idx, y_idx, lam), _oracle_solve_ridge(merged, x_idx, y_idx, lam)
        torch.testing.assert_close(got[0], want_fit[0], rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(got[1], want_fit[1], rtol=1e-9, atol=1e-12)


def test_lean_solve_matches_the_oracle_on_rank_deficient_inputs():
    """λ = 0 with a repeated source layer: both fall back to the same minimum-norm least squares; a per-column λ with
    one zero column group mixes the fallback and the Cholesky solve on one Gram block (its diagonal rewritten)."""
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(300, 2 * DIM, generator=gen, dtype=torch.float64)
    x = torch.cat([base] * LAYERS, dim=1)  # rank 2·DIM of FEATURES
    y = base @ torch.randn(2 * DIM, 2 * DIM, generator=gen, dtype=torch.float64) + 0.1 * torch.randn(
        300, 2 * DIM, generator=gen, dtype=torch.float64
    )
    stats = KVStatistics(LAYERS, 1, HEADS, DIM)
    stats.update(x, y)
    x_idx, y_idx = stats.source_index(list(range(LAYERS))), stats.target_index(0)
    mixed = torch.tensor([0.0] * DIM + [0.01] * DIM, dtype=torch.float64)
    for lam in (0.0, mixed):
        got, want = solve_ridge(stats, x_idx, y_idx, lam), _oracle_solve_ridge(stats, x_idx, y_idx, lam)
        assert torch.isfinite(got[0]).all()
        torch.testing.assert_close(got[0], want[0], rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(got[1], want[1], rtol=1e-9, atol=1e-12)


def test_chosen_lambda_regression():
    """A fixed seeded problem's choice, pinned: a change of the λ search's numbers shows here."""
    pinned = {  # (train, held-out tokens): (λ of K, λ of V), held-out R² (K, V), as the pre-issue-25 solve chose
        (200, 150): ((0.0316, 0.01), (0.796921718309799, 0.8194047067352358)),
        (FEATURES - 4, FEATURES - 4): ((0.0316, 0.1), (0.6142208923024963, 0.6049420508314511)),
        (2000, 500): ((0.01, 0.00316), (0.8062103765601982, 0.8261987847600268)),
    }
    for (n_train, n_held), (want_lambdas, want_r2) in pinned.items():
        train, held = _stats(n_train, 0), _stats(n_held, 1)
        lambdas, r2 = choose_ridge_lambdas(train, held, [[2, 0, 3]], "all_heads", HEADS, DIM)
        assert (lambdas["k"][0][0], lambdas["v"][0][0]) == want_lambdas, (n_train, lambdas)
        torch.testing.assert_close(r2[0], torch.tensor(want_r2, dtype=torch.float64), rtol=1e-9, atol=1e-12)


def test_solve_paths_benchmark_compares_equal_results():
    """`scripts/measure_solve_paths.py` at a tiny size: both λ-search paths time their steps and give the same
    held-out errors (the Cholesky path is the measured alternative to the `eigh` the solve uses)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[2] / "scripts" / "measure_solve_paths.py"
    spec = importlib.util.spec_from_file_location("measure_solve_paths", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    record = script.measure(96, 24)
    assert set(record["eigh_steps"]) == {"eigh", "rotation", "lambda_loop"}
    assert set(record["cholesky_steps"]) == {"cholesky", "triangular_solves", "heldout_product"}
    assert record["max_relative_mse_difference"] < 1e-8 and record["lambdas"] == 13
    assert record["cholesky_seconds"] > 0 and record["eigh_seconds"] > 0


def test_row_solve_measurement_matches_the_library_solve():
    """`scripts/measure_row_solve.py` at a tiny size with fewer training tokens than map inputs: from the rows
    (`RowStatistics`) the held-out R² over the λ grid, chosen λ and refitted weights equal those from the sums
    (`KVStatistics`), so its timings compare equal results."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[2] / "scripts" / "measure_row_solve.py"
    spec = importlib.util.spec_from_file_location("measure_row_solve", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    record = script.measure(512, 256, 160, 48)
    assert record["max_abs_r2_difference"] < 1e-10
    assert record["max_relative_weight_difference"] < 1e-10 and record["max_relative_bias_difference"] < 1e-10
    assert record["row_lambda_kv"] == record["library_lambda_kv"]
    assert all(1e-6 < lam < 1.0 for lam in record["row_lambda_kv"])  # an interior best: the grid's ends are not it
    assert record["row_search_seconds"] > 0 and record["library_search_seconds"] > 0


def test_a_per_column_lambda_of_the_wrong_length_is_refused_for_sums_and_rows():
    from hf_kvbridge.errors import InvalidInputError
    from hf_kvbridge.fitting.statistics.rows import RowStatistics

    sums = KVStatistics(1, 1, 1, 2)
    rows = RowStatistics(1, 1, 1, 2, sources=[0], targets=[0])
    x = torch.randn(20, 4, dtype=torch.float64)
    for stats in (sums, rows):
        stats.update(x, x + 0.1)
        with pytest.raises(InvalidInputError, match=r"got 3 ridge λ for 4 output columns"):
            solve_ridge(stats, torch.arange(4), torch.arange(4), torch.full((3,), 0.01))


# -- the three λ searches -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pocket_statistics():
    """pocket-s → pocket-l statistics of 24 calibration windows of 96 tokens (4 held out): a real pair."""
    from transformers import AutoTokenizer

    from hf_kvbridge import pocket
    from hf_kvbridge.fitting.data import token_windows

    tokenizer = AutoTokenizer.from_pretrained(pocket.model_path("pocket-s"))
    windows = token_windows(pocket.load_texts("calibration"), tokenizer, 24, 96)
    source, target = pocket.load_model("pocket-s"), pocket.load_model("pocket-l")
    return collect_statistics(source, target, windows, heldout=[0, 1, 2, 3])


MODES = [("all_heads", "joint"), ("same_head", "joint"), ("all_heads", "separate"), ("same_head", "separate")]


@pytest.mark.parametrize("head_mode, kv_mode", MODES)
def test_lambda_searches_choose_the_same_lambda(pocket_statistics, pair_statistics, head_mode, kv_mode):
    """On a real pair (pocket-s → pocket-l) and a random one: the float32 search (checked in float64) and the
    batched float64 Cholesky search choose the float64 eigendecomposition's λ at every target layer, head group and
    K/V, with held-out R² within 1e-4 (float32) and 1e-9 (Cholesky)."""
    for train, heldout in (pocket_statistics, pair_statistics[-2:]):
        layers = train.source_layers
        selected = [[(t + i) % layers for i in range(2)] for t in range(train.target_layers)]
        args = (train, heldout, selected, head_mode, train.target_kv_heads, train.target_head_dim)
        reference, r2 = choose_ridge_lambdas(*args, kv_mode=kv_mode, search="eigh")
        for search, tolerance in (("eigh32", 1e-4), ("cholesky", 1e-9)):
            chosen, got = choose_ridge_lambdas(*args, kv_mode=kv_mode, search=search)
            assert chosen == reference, search
            assert (got - r2).abs().max() <= tolerance, (search, (got - r2).abs().max())


def test_float32_search_falls_back_to_float64_where_it_is_off(pocket_statistics, monkeypatch, caplog):
    """Where the float32 R² at the chosen λ is off by more than the tolerance (here: any difference at all), the map
    is searched again in float64: the result is the float64 search's, bit for bit, and the fallback is logged."""
    import logging

    import hf_kvbridge.fitting.solve as solve

    train, heldout = pocket_statistics
    selected = [[t % train.source_layers, (t + 1) % train.source_layers] for t in range(train.target_layers)]
    args = (train, heldout, selected, "same_head", train.target_kv_heads, train.target_head_dim)
    reference = choose_ridge_lambdas(*args, search="eigh")
    monkeypatch.setattr(solve, "EIGH32_TOLERANCE", -1.0)
    with caplog.at_level(logging.INFO, logger="hf_kvbridge.fitting.solve"):
        chosen, r2 = choose_ridge_lambdas(*args, search="eigh32")
    assert chosen == reference[0] and torch.equal(r2, reference[1])
    assert "searched again" in caplog.text


def test_lambda_search_default_follows_the_device():
    from hf_kvbridge.fitting.solve import default_lambda_search

    assert default_lambda_search("cpu") == "eigh" and default_lambda_search("cuda:0") == "cholesky"
    train, held = _stats(64, 0), _stats(64, 1)
    with pytest.raises(InvalidInputError, match="λ search must be one of"):
        heldout_r2_chunks(train, held, torch.arange(4), torch.arange(4), 2, search="eigh16")
