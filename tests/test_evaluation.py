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


# A zero cache cannot score exactly as no context: its keys give every context position attention logit 0 and its
# values add nothing, but those positions still take a share of each softmax's mass, and the continuation no longer
# starts at position 0, where these models park attention (an attention sink). Measured with this setup on the
# retrained family (pocket-s, 24 held-out windows of 192 + 32 tokens): no context 4.009, zero cache 4.037, target 3.706
# nats/token, i.e. the zero cache sits 0.09 of the context's benefit from no context (on the worse side; the random
# cache 0.11). The bound, 0.35 of the benefit, still fails a "control" that carries the context: this (cheaply
# calibrated) bridge's mapped cache is 0.69 of it away.
ZERO_CACHE_TOLERANCE = 0.35


def test_zero_cache_control_scores_like_no_context():
    from transformers import AutoTokenizer

    import hf_kvbridge
    from hf_kvbridge import pocket
    from hf_kvbridge.tools.evaluation import continuation_nll, heldout_windows

    bridge = hf_kvbridge.calibrate(
        "pocket/pocket-m", "pocket/pocket-s", pocket.load_texts("calibration"), num_sequences=8, seq_len=128, top_k=2
    )
    windows = heldout_windows(
        pocket.load_texts("heldout"), AutoTokenizer.from_pretrained(pocket.model_path("pocket-s")), 192 + 32, 24
    )
    nll = continuation_nll(bridge, windows, 192, controls=True)["nll"]
    benefit = nll["no_context"] - nll["target"]
    assert benefit > 0.2  # pocket-s uses its context: the comparison means something
    for control in ("zero_cache", "random_cache"):
        assert abs(nll[control] - nll["no_context"]) < ZERO_CACHE_TOLERANCE * benefit, nll
    assert abs(nll["bridge"] - nll["no_context"]) > ZERO_CACHE_TOLERANCE * benefit  # what the bound tells apart
