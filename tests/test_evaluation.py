"""Retention figures of the evaluation tools: chance-normalised retention is undefined at or below chance."""

import math

from hf_kvbridge.tools.eval_cli import format_table, retention_rows
from hf_kvbridge.tools.evaluation import chance_normalised_retention


def test_chance_normalised_retention_above_chance():
    assert math.isclose(chance_normalised_retention(0.40, 0.50, 0.25), 0.6)
    assert math.isclose(chance_normalised_retention(0.25, 0.50, 0.25), 0.0)


def test_chance_normalised_retention_undefined_at_or_below_chance():
    for bridge, target in ((0.25, 0.25), (0.20, 0.20), (0.30, 0.20), (0.10, 0.24)):
        assert chance_normalised_retention(bridge, target, 0.25) is None
    assert chance_normalised_retention(0.3, 0.5, None) is None


def _results(values):
    return {"results": {"cloze": {"acc,none": values, "acc_stderr,none": 0.01}}, "higher_is_better": {}}


def test_eval_table_reports_undefined_not_one_below_chance():
    by_mode = {mode: _results(0.20) for mode in ("source", "target", "bridge")}  # all below chance 0.25
    (row,) = retention_rows(by_mode, {"cloze": 0.25})
    assert row["chance_normalised_retention"] is None
    assert row["retention"] == 1.0
    table = format_table([row])
    assert "undefined" in table and "| 1.0000 | 0.2500 | undefined" in table
    by_mode["target"] = _results(0.50)
    by_mode["bridge"] = _results(0.40)
    (row,) = retention_rows(by_mode, {"cloze": 0.25})
    assert math.isclose(row["chance_normalised_retention"], 0.6)
