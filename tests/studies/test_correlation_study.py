"""The correlation study, its knob sweep, and the λ study, small, on the shipped pocket family."""

import json

import pytest


@pytest.mark.slow
def test_study_and_knob_sweep_run():
    from studies.correlation_study import SETTINGS, run_knobs, run_study

    result = run_study(["pocket-s:pocket-m"], num_sequences=8, seq_len=256, windows=3, progress=lambda *_: None)
    points = len(SETTINGS["top_k"]) * len(SETTINGS["ridge_lambda"]) * len(SETTINGS["head_mode"]) + 1  # + MLP
    assert result["correlations"]["attention_cosine"]["points"] == points == len(result["points"])
    assert [p["mapper"] for p in result["points"]].count("mlp") == 1
    knobs = run_knobs(
        "pocket-m",
        "pocket-s",
        sinks=(0, 4),
        hold_backs=(1,),
        num_sequences=8,
        seq_len=256,
        windows=3,
        progress=lambda *_: None,
    )
    assert [(r["sink_tokens"], r["hold_back"]) for r in knobs["rows"]] == [(0, 1), (4, 1)]
    assert all(r["retention"] == r["retention"] for r in knobs["rows"])  # not NaN


def test_lambda_study_runs_on_a_pocket_pair(tmp_path):
    """The README's `lambda_study` command end to end, small: one pair, every λ setting, the table it prints."""
    from studies.lambda_study import main

    out = tmp_path / "lambda.json"
    assert (
        main(
            [
                "--pairs",
                "pocket-s:pocket-m",
                "--num-sequences",
                "8",
                "--seq-len",
                "96",
                "--windows",
                "2",
                "--fixed-grid",
                "1e-4",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    # the best fixed λ is one of the grid's or the old default 0.01, which every study measures too
    assert row["pair"] == "pocket-s:pocket-m" and row["best_fixed"]["ridge_lambda"] in (1e-4, 1.0, 0.01)
    assert {p["setting"] for p in result["points"]} >= {"auto", "fixed"}
    assert all(abs(p["retention"]) < 10 and -1 < p["attention_cosine"] <= 1 for p in result["points"])
