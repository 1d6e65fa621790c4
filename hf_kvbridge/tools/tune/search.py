"""The whole search (`run_tune`): one calibration pass, every configuration of the grid measured on tuning windows,
the choice measured again on check windows and saved."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ...errors import InvalidInputError, TuningError
from ...fitting.calibration.calibrate import calibrate
from ...fitting.data import iter_texts, token_windows
from ...fitting.statistics.dense import KVStatistics
from ..bench.flop_model import COST_UNIT
from ..evaluation import heldout_windows
from .choice import Point, check_objective, choose, format_table, pareto_front
from .grid import (
    DEFAULT_CHECK_WINDOWS,
    DEFAULT_CONTEXT,
    DEFAULT_CONTINUATION,
    DEFAULT_HELDOUT_FRACTION,
    DEFAULT_NUM_SEQUENCES,
    DEFAULT_SEED,
    DEFAULT_SEQ_LEN,
    DEFAULT_TEXT_FIELD,
    DEFAULT_TUNE_WINDOWS,
    TuneGrid,
)
from .measure import (
    feature_blocks,
    fit_candidate,
    mean_scores,
    measure_bridge,
    measure_grid,
    reference_scores,
    source_target_gap,
)

# documents read from the evaluation text (alternately into tuning and check windows)
MAX_EVAL_DOCUMENTS = 2000


def split_windows(
    texts: Sequence[str], tokenizer, length: int, tune_windows: int, check_windows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tuning windows from the even-numbered documents, check windows from the odd-numbered ones: the check windows
    share no document with the windows the configuration was chosen on."""
    if len(texts) < 2:
        raise InvalidInputError(
            f"the evaluation text has {len(texts)} document(s); tuning needs at least 2 (tune and check)"
        )
    return (
        heldout_windows(list(texts[0::2]), tokenizer, length, tune_windows),
        heldout_windows(list(texts[1::2]), tokenizer, length, check_windows),
    )


def _point_json(point: Point) -> dict:
    return {key: value for key, value in asdict(point).items() if key != "extra"} | point.extra


def run_tune(
    source,
    target,
    data,
    eval_data,
    *,
    min_retention: float | None = None,
    max_cost: float | None = None,
    grid: TuneGrid | None = None,
    num_sequences: int = DEFAULT_NUM_SEQUENCES,
    seq_len: int = DEFAULT_SEQ_LEN,
    heldout_fraction: float = DEFAULT_HELDOUT_FRACTION,
    batch_size: int = 8,
    seed: int = DEFAULT_SEED,
    tune_windows: int = DEFAULT_TUNE_WINDOWS,
    check_windows: int = DEFAULT_CHECK_WINDOWS,
    context: int = DEFAULT_CONTEXT,
    continuation: int = DEFAULT_CONTINUATION,
    text_field: str = DEFAULT_TEXT_FIELD,
    tokenizer=None,
    out: str | Path | None = None,
    overwrite: bool = False,
    json_path: str | Path | None = None,
    progress: Callable[[str], Any] = print,
    **load_kwargs: Any,
) -> dict:
    """Calibrates once, measures every configuration of `grid`, picks one (`choose`) and saves it to `out`.

    Args:
        source, target ([`PreTrainedModel`] or `str`): as for `calibrate`.
        data: calibration data, as for `calibrate` (one pass; its statistics are kept and every fit reuses them).
        eval_data: held-out text (anything `hf_kvbridge.fitting.data.iter_texts` reads; never the calibration data):
        even
            documents give `tune_windows` tuning windows, odd ones `check_windows` check windows, each of `context`
            + `continuation` tokens.
        min_retention (`float`, *optional*): the quality target (context-benefit retention on the tuning windows).
        max_cost (`float`, *optional*): the cost budget (share of the target's prefill FLOPs; see the module doc).
        grid ([`TuneGrid`], *optional*): the configurations; defaults to `TuneGrid()`.
        out (`str` or `Path`, *optional*): save the chosen bridge there (`save_pretrained`).
        json_path (`str` or `Path`, *optional*): write the result there, also when no configuration qualifies.
        progress (`Callable`, *optional*, defaults to `print`): receives one line per measured configuration and the
            Pareto table.
        load_kwargs: `from_pretrained` keywords for models given by name (`dtype`, `device_map`).

    Returns:
        `dict` with `points` (every configuration: `settings` with its `recompute_fraction` and `recompute_layers`,
        `retention`, `cost`, `mapper_flops_per_token`, `residual_flops_per_token`, `mapper_parameters`,
        `gap_recovered`, `gap_recovered_ci`), `pareto_front` (with `check_retention`,
        `check_gap_recovered`, `check_gap_recovered_ci`), `choice`, the reference NLLs of both window sets (target,
        no context, source), `source_target_gap` of both (the gap and whether the windows resolve it, else the
        reason the gap recovered is n/a) and the settings; and `bridge`, the chosen bridge (not in the JSON).

    Raises:
        `TuningError`: no configuration meets `min_retention` / `max_cost` (after the JSON is written).

    Example:

    ```python
    >>> from hf_kvbridge import pocket
    >>> from hf_kvbridge.tools.tune import run_tune
    >>> result = run_tune("pocket/pocket-l", "pocket/pocket-s", pocket.load_texts("calibration"),
    ...                   pocket.load_texts("heldout"), min_retention=0.9, out="tuned")  # doctest: +SKIP
    >>> result["choice"]["settings"]  # doctest: +SKIP
    ```
    """
    check_objective(min_retention, max_cost)  # before any work
    grid = grid or TuneGrid()
    started = time.perf_counter()
    # the residual maps of the grid's layer-recompute values, fitted in the same calibration pass (`n = 0` and
    # `n = L_t` need none)
    target_layers = _num_layers(target)
    residual = [n for n in grid.layers(target_layers) if 0 < n < target_layers]
    base = calibrate(
        source,
        target,
        data,
        tokenizer=tokenizer,
        num_sequences=num_sequences,
        seq_len=seq_len,
        top_k=max(grid.top_k),
        heldout_fraction=heldout_fraction,
        batch_size=batch_size,
        seed=seed,
        text_field=text_field,
        keep_statistics=True,
        recompute_layers=residual or 0,
        # the hidden-state blocks of the grid's hidden-state maps, collected in the same pass
        hidden_state_layers=grid.hidden_state_layers if grid.uses_hidden_states else None,
        **load_kwargs,
    )
    statistics = base.calibration_statistics
    if statistics is None or not isinstance(statistics[0], KVStatistics):
        raise TuningError(
            "tuning refits every configuration from the dense calibration statistics, but this calibration needed "
            "budgeted passes; tune on fewer or smaller models, or on a machine with more memory"
        )
    if tokenizer is None:
        from transformers import AutoTokenizer

        from ...loading import resolve_model_reference

        tokenizer = AutoTokenizer.from_pretrained(resolve_model_reference(base.config.source_name_or_path))
    texts = list(itertools.islice(iter_texts(eval_data, text_field), MAX_EVAL_DOCUMENTS))
    tune_ids, check_ids = split_windows(texts, tokenizer, context + continuation, tune_windows, check_windows)
    source_layers = base.config.source_fingerprint["num_layers"]
    maps = f" (residual maps for top layers {residual})" if residual else ""
    size = grid.size(source_layers, target_layers, feature_blocks(base))
    progress(
        f"calibrated {base.config.source_name_or_path} → {base.config.target_name_or_path}{maps} in "
        f"{time.perf_counter() - started:.0f}s; measuring {size} configurations on "
        f"{len(tune_ids)} tuning windows of {context} + {continuation} tokens"
    )
    trained: dict = {}  # the MLP bridges, trained once each: measured, then checked (and saved) as they are
    calibration_windows = None
    if grid.has_mlp(source_layers):
        calibration_windows = token_windows(data, tokenizer, num_sequences, seq_len, text_field=text_field)
    tune_reference = reference_scores(base, tune_ids, context)
    points = measure_grid(
        base, statistics, tune_ids, context, grid, reference=tune_reference, progress=progress,
        calibration_windows=calibration_windows, trained=trained,
    )  # fmt: skip
    front = pareto_front(points)
    result = {
        "source": base.config.source_name_or_path,
        "target": base.config.target_name_or_path,
        "min_retention": min_retention,
        "max_cost": max_cost,
        "cost_unit": COST_UNIT,
        "grid": {key: list(value) if isinstance(value, tuple) else value for key, value in asdict(grid).items()},
        "points": [_point_json(p) for p in points],
        "pareto_front": [_point_json(p) for p in front],
        "reference_nll": {"tune": mean_scores(tune_reference)},
        "source_target_gap": {"tune": source_target_gap(tune_reference)},
        "settings": {
            "num_sequences": num_sequences,
            "seq_len": seq_len,
            "heldout_fraction": heldout_fraction,
            "seed": seed,
            "tune_windows": len(tune_ids),
            "check_windows": len(check_ids),
            "context": context,
            "continuation": continuation,
            "torch_threads": torch.get_num_threads(),
        },
        "choice": None,
    }
    try:
        choice = choose(points, min_retention=min_retention, max_cost=max_cost)
    except TuningError as err:
        result["error"] = str(err)
        _write_json(result, json_path)
        progress(format_table(result))
        raise
    # the front again on the check windows (how far each tuning figure carries); the choice is on the front (nothing
    # cheaper retains as much), and its refit, deterministic from the same statistics, is the bridge to save
    check_reference = reference_scores(base, check_ids, context)
    result["reference_nll"]["check"] = mean_scores(check_reference)
    result["source_target_gap"]["check"] = source_target_gap(check_reference)
    bridge = None
    for point in front:
        fitted = _check(base, statistics, point, check_ids, context, check_reference, calibration_windows, trained)
        if point is choice:
            bridge = fitted
    if bridge is None:  # not on the front: cannot happen with `choose` as it is, but never save an unchecked choice
        bridge = _check(base, statistics, choice, check_ids, context, check_reference, calibration_windows, trained)
    result["pareto_front"] = [_point_json(p) for p in front]
    result["choice"] = _point_json(choice)
    result["seconds"] = round(time.perf_counter() - started, 1)
    bridge.config.calibration = dict(bridge.config.calibration or {})
    bridge.config.calibration["tuning"] = {
        "min_retention": min_retention,
        "max_cost": max_cost,
        "cost_unit": COST_UNIT,
        "chosen": choice.settings,
        "tuned_retention": round(choice.retention, 6),
        "cost": round(choice.cost, 6),
        "check_retention": round(choice.check_retention, 6),
        "tuned_gap_recovered": _round(choice.gap_recovered),
        "check_gap_recovered": _round(choice.check_gap_recovered),
        "tune_windows": len(tune_ids),
        "check_windows": len(check_ids),
        "context": context,
        "continuation": continuation,
        "configurations": len(points),
    }
    if out is not None:
        bridge.save_pretrained(out, overwrite=overwrite)
        result["out"] = str(out)
    _write_json(result, json_path)
    progress(format_table(result))
    result["bridge"] = bridge
    return result


def _num_layers(model) -> int:
    """The decoder layers of `model` (a loaded model, or a reference `calibrate` loads: its config alone is read)."""
    if isinstance(model, str | Path):
        from transformers import AutoConfig

        from ...loading import resolve_model_reference

        config = AutoConfig.from_pretrained(resolve_model_reference(str(model)))
    else:
        config = model.config
    return int(config.get_text_config(decoder=True).num_hidden_layers)


def _check(base, statistics, point: Point, windows: torch.Tensor, context: int, reference: dict,
           calibration_windows=None, trained=None):  # fmt: skip
    """The bridge of `point`'s settings, refitted from `statistics` (an MLP: the one trained for the grid); records
    its retention and gap recovered on `windows` (`reference`: their `reference_scores`) on `point`."""
    bridge = fit_candidate(base, statistics, point.settings, windows=calibration_windows, trained=trained)
    point.check_retention, gap = measure_bridge(bridge, windows, context, reference)
    point.check_gap_recovered, point.check_gap_recovered_ci = gap.value, gap.fields()["gap_recovered_ci"]
    return bridge


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def _write_json(result: dict, path: str | Path | None) -> None:
    if path is not None:
        Path(path).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n", encoding="utf-8")
