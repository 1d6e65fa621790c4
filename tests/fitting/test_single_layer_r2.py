"""One single-layer held-out R²: the selection statistics' batched R² (`SelectionStatistics.single_layer_r2`, the
budgeted calibration's layer choice) and the dense statistics' (`selection.single_layer_r2`) solve and score with the
same routines (`solve.ridge_from_moments`, `statistics.base.centred_residual_sums`), which the solves of every map use
too. `tests/data/single_layer_r2_reference.pt` holds what the two routines computed before they were merged (written
from commit 9a20c65 with `KVBRIDGE_WRITE_R2_REFERENCE=1`): the merged code gives the same R² (≤ 1e-6 relative) and so
the same selected layers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hf_kvbridge.fitting.layer_selection import select_layers, single_layer_r2
from hf_kvbridge.fitting.statistics.dense import KVStatistics
from hf_kvbridge.fitting.statistics.selection import SelectionStatistics

REFERENCE = Path(__file__).parents[1] / "data" / "single_layer_r2_reference.pt"
WRITE = os.environ.get("KVBRIDGE_WRITE_R2_REFERENCE") == "1"
# (source layers, target layers, source heads, source dim, target heads, target dim)
LAYOUTS = {"matched": (3, 4, 2, 4, 2, 4), "wider_target": (3, 2, 2, 4, 4, 8), "one_head": (2, 3, 1, 4, 1, 4)}
LAMBDAS = (0.0, 1e-3, 0.01, 1.0)


def _rows(layout, n: int, seed: int):
    ls, lt, hs, ds, ht, dt = layout
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, ls * hs * 2 * ds, generator=gen, dtype=torch.float64) * 2 + 1
    mix = torch.randn(x.shape[1], lt * ht * 2 * dt, generator=gen, dtype=torch.float64) / x.shape[1] ** 0.5
    y = x @ mix + 0.5 * torch.randn(n, mix.shape[1], generator=gen, dtype=torch.float64) - 3
    return x, y


def _compute() -> dict:
    out = {}
    for name, layout in LAYOUTS.items():
        ls, lt, hs, ds, ht, dt = layout
        x, y = _rows(layout, 400, seed=len(name))
        heads = {"target_kv_heads": ht, "target_head_dim": dt}
        for dtype in (torch.float64, torch.float32):
            train, held = (SelectionStatistics(ls, lt, hs, ds, dtype, **heads) for _ in range(2))
            train.update(x[:300], y[:300])
            held.update(x[300:], y[300:])
            for lam in LAMBDAS:
                out[f"selection/{name}/{dtype}/{lam}"] = train.single_layer_r2(held, lam)
        train, held = (KVStatistics(ls, lt, hs, ds, **heads) for _ in range(2))
        train.update(x[:300], y[:300])
        held.update(x[300:], y[300:])
        for mode in ("all_heads", "same_head"):
            for lam in (*LAMBDAS[1:], "auto"):
                out[f"dense/{name}/{mode}/{lam}"] = single_layer_r2(train, held, mode, lam)
    return out


@pytest.fixture(scope="module")
def computed() -> dict:
    return _compute()


def test_write_reference(computed):
    """Writes the reference (only with `KVBRIDGE_WRITE_R2_REFERENCE=1`, from the code before the merge)."""
    if not WRITE:
        pytest.skip("the reference is written once, from the code before the merge")
    REFERENCE.parent.mkdir(exist_ok=True)
    torch.save(computed, REFERENCE)


def test_the_merged_r2_gives_what_each_routine_gave(computed):
    reference = torch.load(REFERENCE, weights_only=True)
    assert sorted(computed) == sorted(reference)
    for key, expected in reference.items():
        got = computed[key]
        scale = float(expected.abs().max())
        assert float((got - expected).abs().max()) <= 1e-6 * scale, key
        assert select_layers(got, 2) == select_layers(expected, 2), key
