"""The gate study's threshold choice on known records, and the command end to end on a small pocket run."""

import json

import pytest

from studies.gate_study import main, threshold_table


def _record(score, bridge, target=4.0, no_context=5.0):
    return {"pair": "a:b", "score": score, "target": target, "bridge": bridge, "no_context": no_context}


def test_threshold_is_the_lowest_score_whose_passed_windows_meet_the_target():
    # high scores transfer well (lose 0.02 of 1 nat of benefit), low scores badly (lose 0.6)
    records = [_record(0.9 + i / 100, 4.02) for i in range(6)] + [_record(0.5 + i / 100, 4.6) for i in range(4)]
    table = threshold_table(records, target_retention=0.9, min_passed=2)
    chosen = table["chosen"]
    # passing a bad window drops the pooled retention of the passed ones to (6 × 0.98 + 0.4) / 7 = 0.897 < 0.9
    assert chosen["threshold"] == pytest.approx(0.9) and chosen["passed_windows"] == 6
    assert chosen["retention_passed"] == pytest.approx(0.98)
    assert chosen["precision"] == 1.0 and chosen["recall"] == 1.0  # good = loses at most 0.1 × mean benefit
    assert chosen["retention_system"] == pytest.approx((6 * 0.98 + 4 * 1.0) / 10)  # the failed fall back
    everyone = table["rows"][-1]
    assert everyone["passed"] == 1.0 and everyone["retention_passed"] == pytest.approx((6 * 0.98 + 4 * 0.4) / 10)
    # a target no threshold meets, and min_passed ignoring the few top windows
    assert threshold_table(records, target_retention=0.99, min_passed=2)["chosen"] is None
    assert threshold_table(records, target_retention=0.99, min_passed=1)["chosen"] is None
    assert threshold_table(records, target_retention=0.9, min_passed=7)["chosen"] is None


def test_gate_study_command_runs(tmp_path):
    out = tmp_path / "gate.json"
    args = ["--pairs", "pocket-m:pocket-s", "--num-sequences", "4", "--seq-len", "128", "--top-k", "2"]
    assert (
        main(
            [
                *args,
                "--windows",
                "4",
                "--context",
                "64",
                "--continuation",
                "16",
                "--min-passed",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert len(result["records"]) == 4 and {"score", "target", "bridge", "no_context"} <= set(result["records"][0])
    assert all(-1 <= r["score"] <= 1 for r in result["records"])
    assert result["pairs"][0]["pair"] == "pocket-m:pocket-s" and len(result["thresholds"]["rows"]) >= 1
    assert len(result["broken_scores"]["pocket-m:pocket-s"]) == 4
    assert result["broken_score_max"] < min(r["score"] for r in result["records"])  # what the gate must catch
