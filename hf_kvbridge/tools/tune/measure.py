"""Measuring the configurations of a grid: each refitted from the calibration statistics and scored on held-out
windows (context-benefit retention and gap recovered, `tools/evaluation.py`) beside its cost (`bench.flop_model`)."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import torch

from ...errors import TuningError
from ...fitting.calibration.dense_fit import fit_dense
from ...fitting.mapper_fits import refit
from ...utils.key_norm import with_key_norm
from ..bench.flop_model import cost, map_flops_per_token, target_flops_per_token
from ..evaluation import GapRecovered, gap_recovered, retention, window_nll
from .choice import Point, format_gap, format_settings
from .grid import TuneGrid

REFERENCE_MODES = ("target", "no_context", "source")


def reference_scores(bridge, windows: torch.Tensor, context: int) -> dict[str, torch.Tensor]:
    """Per-window NLL `(N,)` of the target with its own prefill and with no context (the two ends retention is
    measured between) and of the source alone (the other end of the gap recovered), as `tools/evaluation.window_nll`
    scores them."""
    return {mode: window_nll(bridge, windows, context, mode) for mode in REFERENCE_MODES}


def mean_scores(scores: dict[str, torch.Tensor]) -> dict[str, float]:
    return {mode: float(values.mean()) for mode, values in scores.items()}


def reference_nll(bridge, windows: torch.Tensor, context: int) -> dict[str, float]:
    """Mean NLL of the target with its own prefill, with no context, and of the source (`reference_scores`)."""
    return mean_scores(reference_scores(bridge, windows, context))


def measure_bridge(bridge, windows: torch.Tensor, context: int, reference: dict[str, torch.Tensor]):
    """`(retention, GapRecovered)` of `bridge` on `windows`, against the per-window `reference_scores`."""
    scores = window_nll(bridge, windows, context, "bridge")  # (N,)
    kept = retention({**mean_scores(reference), "bridge": float(scores.mean())})
    return kept, gap_recovered(reference["source"], scores, reference["target"])


def source_target_gap(reference: dict[str, torch.Tensor]) -> dict:
    """The source → target gap of a window set (what the gap recovered is a share of) and whether it is resolved."""
    gap: GapRecovered = gap_recovered(reference["source"], reference["target"], reference["target"])
    ci = None if gap.gap_low is None else [gap.gap_low, gap.gap_high]
    return {"gap": gap.gap, "ci": ci, "defined": gap.defined, "reason": gap.reason, "windows": gap.windows}


def fit_candidate(base, statistics, settings: dict, *, windows: torch.Tensor | None = None, trained=None):
    """The bridge of `settings` (mapper part, recompute fraction and recompute layers), refitted from `statistics`
    (train, held-out), with `base`'s residual maps (fitted once, in the calibration pass).

    The fits select layers and choose λ on the held-out statistics and solve on train + held-out (`fit_dense`):
    every candidate, and so the chosen one, is fitted on all the statistics. An MLP (`mapper_type="mlp"`) is then
    trained from that ridge fit on `windows` (the calibration windows; seeded, so a refit is the same mapper); pass
    a dict as `trained` to keep each trained MLP bridge there and reuse it for the same mapper settings.
    """
    if settings["mapper_type"] == "mlp":
        key = json.dumps({k: v for k, v in settings.items() if not k.startswith("recompute_")}, sort_keys=True)
        if trained is not None and key in trained:
            bridge = trained[key]
        else:
            if windows is None:
                raise TuningError("an MLP configuration is trained on the calibration windows: pass windows=")
            ridge = fit_candidate(base, statistics, {**settings, "mapper_type": "ridge", "recompute_fraction": 0.0,
                                                     "recompute_layers": 0})  # fmt: skip
            bridge = refit(
                ridge, "mlp", windows=windows, hidden=settings["hidden"], loss=settings["loss"],
                epochs=settings["epochs"], seed=0,
            )  # fmt: skip
            if base.residual_mapper is not None:
                bridge = bridge.with_residual_mapper(base.residual_mapper, bridge.config)
            if trained is not None:
                trained[key] = bridge
        return with_recompute(bridge, settings.get("recompute_fraction", 0.0), settings.get("recompute_layers", 0))
    if settings.get("hidden_states") and base.source_features is None:
        raise TuningError("a hidden-state configuration needs statistics collected with hidden_state_layers")
    train, heldout = statistics
    fit = fit_dense(
        base.source,
        base.target,
        train,
        heldout,
        top_k=settings["top_k"],
        ridge_lambda=settings["ridge_lambda"],
        kv_mode=settings["kv_mode"],
        head_mode=base.config.head_mode,
        hold_back=base.config.hold_back,
        config_kwargs=_references(base.config),
        # the statistics' hidden-state blocks, read by the configurations that ask for them (the others are the
        # K/V-only maps those statistics also hold)
        features=base.source_features if settings.get("hidden_states") else None,
    )
    # the bridge class is the base bridge's; the same residual maps for every candidate (`config.residual_map`)
    bridge = fit.build(type(base), base.source, base.target, base.residual_mapper)
    bridge = with_key_norm(bridge, base.mapper.key_norm_gain)  # as the calibrated bridge maps its keys
    if settings["mapper_type"] == "low_rank":
        bridge = refit(bridge, "low_rank", rank=settings["rank"], statistics=statistics)
    return with_recompute(bridge, settings.get("recompute_fraction", 0.0), settings.get("recompute_layers", 0))


def with_recompute(bridge, fraction: float, layers: int = 0):
    """A copy of `bridge` (same mappers) that recomputes `fraction` of its mapped context (the default `tail`) and
    its target's top `layers` layers over all of it (a value its residual map was calibrated for, `0` or `L_t`)."""
    config = copy.deepcopy(bridge.config)
    config.recompute_fraction = float(fraction)
    config.recompute_layers = int(layers)
    return bridge.with_mapper(bridge.mapper, config)


def _references(config) -> dict:
    keys = (
        "source_name_or_path",
        "source_revision",
        "target_name_or_path",
        "target_revision",
        "calibration",
        "residual_map",
    )
    return {key: copy.deepcopy(getattr(config, key)) for key in keys}


def feature_blocks(base) -> int | None:
    """The blocks a hidden-state map of `base`'s statistics chooses from (K/V layers + hidden-state blocks)."""
    return None if base.source_features is None else base.source_features.num_blocks


def measure_grid(
    base,
    statistics,
    windows: torch.Tensor,
    context: int,
    grid: TuneGrid,
    *,
    reference: dict[str, float] | None = None,
    progress: Callable[[str], Any] = print,
    calibration_windows: torch.Tensor | None = None,
    trained: dict | None = None,
) -> list[Point]:
    """Every configuration of `grid`, fitted from `statistics` and measured on `windows` (`context` tokens of each
    are the context, the rest the continuation scored); `reference` is `reference_scores` of those windows. MLP
    configurations are trained on `calibration_windows` (kept in `trained`, see `fit_candidate`)."""
    reference = reference or reference_scores(base, windows, context)
    target_flops = target_flops_per_token(base.target.config, context)
    source_layers = base.config.source_fingerprint["num_layers"]
    target_layers = base.config.target_fingerprint["num_layers"]
    points = []
    for fit in grid.fits(source_layers, feature_blocks(base)):
        mapped = fit_candidate(base, statistics, fit, windows=calibration_windows, trained=trained)
        parameters = sum(p.numel() for p in mapped.mapper.parameters())
        for fraction, layers in grid.recompute(target_layers):
            settings = {**fit, "recompute_fraction": fraction, "recompute_layers": layers}
            bridge = with_recompute(mapped, fraction, layers)
            kept, gap = measure_bridge(bridge, windows, context, reference)
            kv_flops, residual_flops = map_flops_per_token(bridge)
            point = Point(
                settings=settings,
                retention=kept,
                cost=cost(bridge, target_flops),
                mapper_flops_per_token=kv_flops,
                mapper_parameters=parameters,
                residual_flops_per_token=residual_flops,
                gap_recovered=gap.value,
                gap_recovered_ci=gap.fields()["gap_recovered_ci"],
            )
            points.append(point)
            progress(
                f"  {format_settings(settings):70s} retention {point.retention:.3f}  cost {point.cost:.3f}  gap "
                f"recovered {format_gap(point.gap_recovered, point.gap_recovered_ci)}"
            )
    return points
