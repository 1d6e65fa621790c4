"""The choice of `kvbridge tune` (`hf_kvbridge.tools.tune.choice`) on hand-made points: the Pareto front, the
cheapest configuration meeting a target, the best within a budget, and the refusals."""

import pytest

from hf_kvbridge.errors import TuningError
from hf_kvbridge.tools.tune.choice import Point, choose, pareto_front


def _point(name: str, retention: float, cost: float) -> Point:
    settings = {"mapper_type": "ridge", "top_k": 2, "ridge_lambda": "auto", "kv_mode": "joint", "name": name}
    settings["recompute_fraction"] = 0.0
    return Point(settings, retention, cost, mapper_flops_per_token=0, mapper_parameters=0)


POINTS = [
    _point("cheap-bad", 0.70, 0.01),
    _point("mid", 0.91, 0.10),
    _point("mid-dominated", 0.90, 0.12),
    _point("good", 0.96, 0.20),
    _point("good-same-cost", 0.97, 0.20),
    _point("best", 0.99, 0.50),
    _point("undefined", float("nan"), 0.0),
]


def _names(points):
    return [p.settings["name"] for p in points]


def test_pareto_front_keeps_what_nothing_beats_on_both_cheapest_first():
    assert _names(pareto_front(POINTS)) == ["cheap-bad", "mid", "good-same-cost", "best"]


def test_choose_the_cheapest_meeting_the_target():
    assert choose(POINTS, min_retention=0.9).settings["name"] == "mid"
    # at equal cost the better retention wins
    assert choose(POINTS, min_retention=0.95).settings["name"] == "good-same-cost"
    assert choose(POINTS, min_retention=0.99).settings["name"] == "best"


def test_choose_the_best_within_a_budget():
    assert choose(POINTS, max_cost=0.15).settings["name"] == "mid"
    assert choose(POINTS, max_cost=1.0).settings["name"] == "best"
    # both: the cheapest meeting the target, among those within the budget
    assert choose(POINTS, min_retention=0.9, max_cost=0.3).settings["name"] == "mid"


def test_choose_refuses_when_nothing_qualifies():
    with pytest.raises(TuningError, match=r"no configuration reaches retention 0\.995 .*best: retention 0\.990"):
        choose(POINTS, min_retention=0.995)
    with pytest.raises(TuningError, match=r"within cost 0\.15 .*raise --max-cost"):
        choose(POINTS, min_retention=0.95, max_cost=0.15)
    with pytest.raises(TuningError, match=r"no configuration costs at most 0\.001"):
        choose(POINTS[:-1], max_cost=0.001)
    with pytest.raises(TuningError, match="no configuration has a defined retention"):
        choose(POINTS[-1:], min_retention=0.5)
    with pytest.raises(ValueError, match="min_retention .* or max_cost"):
        choose(POINTS)


def test_the_objective_stays_retention_not_gap_recovered():
    closes_more = _point("closes-more-gap", 0.80, 0.05)
    closes_more.gap_recovered = 5.0  # reported beside retention, never what the front or the choice go by
    points = [*POINTS, closes_more]
    assert choose(points, min_retention=0.9).settings["name"] == "mid"
    assert choose(points, max_cost=0.06).settings["name"] == "closes-more-gap"  # the best retention within 0.06
    assert _names(pareto_front(points)) == ["cheap-bad", "closes-more-gap", "mid", "good-same-cost", "best"]
