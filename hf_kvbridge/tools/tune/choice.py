"""The measured configurations of a search (`Point`), the Pareto front of retention against cost, the choice, and
the Pareto table."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from ...errors import InvalidInputError, TuningError


@dataclass
class Point:
    """One measured configuration: its settings, tuning retention and cost (`hf_kvbridge.tools.tune`; the K/V
    mapper's and the residual map's FLOPs per token are kept apart), and its gap recovered (reported beside retention,
    never optimised; `None` when undefined)."""

    settings: dict
    retention: float
    cost: float
    mapper_flops_per_token: int
    mapper_parameters: int
    residual_flops_per_token: int = 0
    check_retention: float | None = None
    gap_recovered: float | None = None
    gap_recovered_ci: list[float] | None = None
    check_gap_recovered: float | None = None
    check_gap_recovered_ci: list[float] | None = None
    extra: dict = field(default_factory=dict)


# -- the choice ----------------------------------------------------------------------------------------------------
def _valid(point: Point) -> bool:
    return not math.isnan(point.retention)


def pareto_front(points: Sequence[Point]) -> list[Point]:
    """The points no other point beats on both retention and cost (higher retention, lower cost), cheapest first.

    Example:

    ```python
    >>> pts = [Point({"n": i}, r, c, 0, 0) for i, (r, c) in enumerate([(0.9, 0.2), (0.8, 0.3), (0.95, 0.4)])]
    >>> [p.settings["n"] for p in pareto_front(pts)]
    [0, 2]
    ```
    """
    front: list[Point] = []
    for point in sorted(filter(_valid, points), key=lambda p: (p.cost, -p.retention)):
        if not front or point.retention > front[-1].retention:
            front.append(point)
    return front


def _describe(point: Point) -> str:
    return f"retention {point.retention:.3f} at cost {point.cost:.3f} ({format_settings(point.settings)})"


def check_objective(
    min_retention: float | None, max_cost: float | None, names: tuple[str, str] = ("min_retention", "max_cost")
) -> None:
    """Refuses a search with neither a quality target nor a cost budget (`names`: how the caller spells the two, the
    command line's `--min-retention` and `--max-cost`). Standard library only: the command line runs it on the parsed
    arguments before anything loads.

    Example:

    ```python
    >>> check_objective(None, 0.2)  # a budget alone is enough
    >>> check_objective(None, None)
    Traceback (most recent call last):
    ...
    hf_kvbridge.errors.InvalidInputError: pass min_retention (a quality target) or max_cost (a cost budget), or both
    ```
    """
    if min_retention is None and max_cost is None:
        raise InvalidInputError(f"pass {names[0]} (a quality target) or {names[1]} (a cost budget), or both")


def choose(points: Sequence[Point], *, min_retention: float | None = None, max_cost: float | None = None) -> Point:
    """The configuration to keep.

    - `min_retention`: the cheapest point whose retention reaches it (ties: the better retention), among those
      within `max_cost` when that is given too;
    - `max_cost` alone: the best retention within that cost (ties: the cheaper).

    Raises:
        `TuningError`: no point qualifies (the message names the best one there is), or neither bound is given.
    """
    check_objective(min_retention, max_cost)
    valid = [p for p in points if _valid(p)]
    if not valid:
        raise TuningError(
            "no configuration has a defined retention (the target's own context does not lower its NLL on the "
            "tuning windows); use longer or more tuning windows"
        )
    affordable = [p for p in valid if max_cost is None or p.cost <= max_cost]
    if max_cost is not None and not affordable:
        cheapest = min(valid, key=lambda p: p.cost)
        raise TuningError(
            f"no configuration costs at most {max_cost:g} (the cheapest: {_describe(cheapest)}); raise --max-cost"
        )
    if min_retention is None:
        return max(affordable, key=lambda p: (p.retention, -p.cost))
    meeting = [p for p in affordable if p.retention >= min_retention]
    if not meeting:
        best = max(affordable, key=lambda p: (p.retention, -p.cost))
        within = f" within cost {max_cost:g}" if max_cost is not None else ""
        raise TuningError(
            f"no configuration reaches retention {min_retention:g}{within} on the tuning windows (the best: "
            f"{_describe(best)}); lower --min-retention, "
            + ("raise --max-cost, " if max_cost is not None else "")
            + "widen the grid (more top-k, recompute fractions) or calibrate on more data"
        )
    return min(meeting, key=lambda p: (p.cost, -p.retention))


def _mapper_name(settings: dict) -> str:
    """The mapper of `settings` as the Pareto table names it: type, rank, and whether it reads hidden states."""
    name = settings["mapper_type"] + (f" r{settings['rank']}" if settings.get("rank") else "")
    return name + (" + hidden states" if settings.get("hidden_states") else "")


def format_settings(settings: dict) -> str:
    mapper = _mapper_name(settings)
    mapper += f" h{settings['hidden']} {settings['loss']}" if settings.get("hidden") else ""
    return (
        f"{mapper}, k={settings['top_k']}, λ={settings['ridge_lambda']}, {settings['kv_mode']}, "
        f"recompute {settings['recompute_fraction']:g}, top layers {settings.get('recompute_layers', 0)}"
    )


def format_gap(value: float | None, ci: list[float] | None) -> str:
    return "n/a" if value is None else f"{value:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"


def format_table(result: dict) -> str:
    """The Pareto table (markdown): every configuration no other beats on both retention and cost, cheapest first,
    with its gap recovered [95% CI] beside (reported, not part of the front: "n/a" where undefined). "recompute" is the
    share of the context the target recomputes, "top layers" the layers it recomputes over all of it, "map FLOPs /
    token" the K/V mapper's plus the residual map's."""
    lines = [
        "| mapper | top-k | λ | kv mode | recompute | top layers | map FLOPs / token | cost | retention (tune) "
        "| retention (check) | gap recovered (tune) | gap recovered (check) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    chosen = result.get("choice")
    for point in result["pareto_front"]:
        s = point["settings"]
        mapper = _mapper_name(s)
        check = "–" if point.get("check_retention") is None else f"{point['check_retention']:.3f}"
        mark = " **chosen**" if chosen is not None and point["settings"] == chosen["settings"] else ""
        gap = format_gap(point.get("gap_recovered"), point.get("gap_recovered_ci"))
        check_gap = (
            "–"
            if point.get("check_retention") is None
            else format_gap(point.get("check_gap_recovered"), point.get("check_gap_recovered_ci"))
        )
        flops = point["mapper_flops_per_token"] + point.get("residual_flops_per_token", 0)
        lines.append(
            f"| {mapper}{mark} | {s['top_k']} | {s['ridge_lambda']} | {s['kv_mode']} | {s['recompute_fraction']:.0%} "
            f"| {s.get('recompute_layers', 0)} | {flops:,} | {point['cost']:.3f} | {point['retention']:.3f} | {check} "
            f"| {gap} | {check_gap} |"
        )
    return "\n".join(lines)
