"""The grid `kvbridge tune` searches (`hf_kvbridge.tools.tune.grid.TuneGrid`): which fits and recompute values it
crosses, capped at the models' layers, and what it refuses."""

import pytest

from hf_kvbridge.errors import ConfigurationError, InvalidInputError
from hf_kvbridge.tools.tune.grid import TuneGrid


def test_grid_caps_top_k_and_crosses_mappers_with_kv_modes():
    fits = TuneGrid(top_k=(2, 9), ridge_lambdas=("auto",), ranks=(8,)).fits(source_layers=3)
    assert sorted({f["top_k"] for f in fits}) == [2, 3]
    assert {(f["mapper_type"], f["kv_mode"]) for f in fits} == {
        ("ridge", "joint"),
        ("ridge", "separate"),
        ("low_rank", "joint"),
        ("low_rank", "separate"),
        ("mlp", "joint"),  # the default grid has the MLP: one per top-k, on the first λ and kv mode
    }
    # and maps that also read the source's hidden states: ridge and low rank, joint K/V only (no MLP)
    assert {(f["mapper_type"], f["kv_mode"]) for f in fits if f["hidden_states"]} == {
        ("ridge", "joint"),
        ("low_rank", "joint"),
    }
    # their top-k is capped at the blocks they choose from (3 K/V layers + 4 hidden states), not at the K/V layers
    both = TuneGrid(top_k=(2, 9), ridge_lambdas=("auto",), ranks=(8,)).fits(source_layers=3, feature_blocks=7)
    assert sorted({f["top_k"] for f in both if f["hidden_states"]}) == [2, 7]
    assert sorted({f["top_k"] for f in both if not f["hidden_states"]}) == [2, 3]
    mlp = [f for f in fits if f["mapper_type"] == "mlp"]
    assert [(f["top_k"], f["hidden"], f["loss"], f["epochs"]) for f in mlp] == [
        (2, 256, "attention", 2),
        (3, 256, "attention", 2),
    ]
    grid = TuneGrid(top_k=(2,), ridge_lambdas=("auto",), ranks=(8,), recompute_layers=(0,))
    assert grid.size(3, 6) == (4 + 2 + 1) * 3 and grid.uses_hidden_states
    kv_only = {"top_k": (2,), "ridge_lambdas": ("auto",), "ranks": (8,), "mlp_hidden": (), "recompute_layers": (0,)}
    assert TuneGrid(**kv_only, hidden_states=(False,)).size(3, 6) == 4 * 3
    # no hidden-state maps without hidden states to read, or without a joint kv mode to read them in
    for grid in (TuneGrid(**kv_only, hidden_state_layers=None), TuneGrid(**kv_only, kv_modes=("separate",))):
        assert not grid.uses_hidden_states and not any(f["hidden_states"] for f in grid.fits(3))


@pytest.mark.parametrize(
    "bad, needle",
    [
        ({"hidden_states": (True,), "kv_modes": ("separate",)}, "'joint' kv mode"),
        ({"hidden_states": (True,), "hidden_state_layers": None}, "needs hidden_state_layers"),
        ({"hidden_states": ()}, "non-empty"),
        ({"hidden_states": ("yes",)}, "True/False"),
        ({"hidden_state_layers": "last"}, "hidden_state_layers must be"),
    ],
)
def test_grid_refuses_hidden_state_maps_it_cannot_fit(bad, needle):
    with pytest.raises((InvalidInputError, ConfigurationError), match=needle):
        TuneGrid(**bad)


@pytest.mark.parametrize("bad", [{"mlp_loss": "l1"}, {"mlp_hidden": (0,)}, {"mlp_epochs": 0}])
def test_grid_refuses_bad_mlp_settings(bad):
    with pytest.raises(InvalidInputError, match="mlp_"):
        TuneGrid(**bad)


def test_grid_crosses_token_with_layer_recompute_and_caps_the_layers():
    grid = TuneGrid(recompute_fractions=(0.0, 0.1), recompute_layers=(0, 2, 9))
    assert grid.layers(target_layers=6) == [0, 2, 6]
    # n = L_t (the target's own prefill of the span) leaves nothing to recompute token by token: fraction 0 only
    assert grid.recompute(target_layers=6) == [(0.0, 0), (0.0, 2), (0.1, 0), (0.1, 2), (0.0, 6)]
    assert grid.size(3, 6) == len(grid.fits(3)) * 5
