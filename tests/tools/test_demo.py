"""The demo's words: its plain summary, undefined chance-normalised retention, its thread choice, its stage lines."""

import io

from hf_kvbridge.tools.demo import Stages, choose_threads, physical_cores, report


def _results(target_acc=0.5, no_context_nll=5.3, busy=False, controls=None, gap=(0.412, [0.301, 0.523])):
    """Demo results as `measure` returns them; `controls` = the controls' retention (flagged when one is within 0.1
    of the bridge's 0.9); `gap` = the gap recovered on NLL and its CI (`None`: n/a)."""
    controls = controls or {"zero_cache": 0.15, "random_cache": 0.1}
    no_gap = {"gap_recovered": None, "gap_recovered_ci": None, "gap_recovered_reason": "an identity pair?"}
    nll_gap = no_gap if gap is None else {"gap_recovered": gap[0], "gap_recovered_ci": gap[1]}
    return {
        "pair": {"source": "pocket-s", "target": "pocket-l"},
        "settings": {"num_sequences": 24, "seq_len": 256},
        "calibration_seconds": 1.0,
        "r2_by_k": {"1": {"k": 0.8, "v": 0.8}},
        "attention_output_cosine": [0.9, 0.8],
        "continuation": {
            "windows": 12,
            "context_len": 128,
            "tokens_scored": 372,
            "nll": {"target": 5.1, "source": 4.1, "bridge": 5.12, "no_context": no_context_nll},
            "perplexity": {"target": 164.0, "source": 60.0, "bridge": 167.0, "no_context": 200.0},
            "context_benefit_retention": 0.9,
            "control_retention": controls,
            "controls_flag": max(controls.values()) >= 0.9 - 0.1,
            **nll_gap,
        },
        "cloze": {
            "items": 16,
            "chance": 0.25,
            "accuracy": {"target": target_acc, "source": 0.4, "bridge": 0.2, "no_context": 0.2},
            "retention": 0.2 / target_acc,
            "chance_normalised_retention": None if target_acc <= 0.25 else (0.2 - 0.25) / (target_acc - 0.25),
            **no_gap,
        },
        "timing": {
            "context_tokens": 1024,
            "repeats": 5,
            "target_prefill_s": 0.1,
            "mapper_s": 0.005,
            "source_prefill_s": 0.02,
            "warm_speedup": 20.0,
            "cold_speedup": 4.0,
        },
        "generation": {"prompt": "a", "target": "b", "bridge": "b", "same_tokens": 1, "new_tokens": 1},
        "torch_threads": 2,
        "machine_busy": busy,
    }


def test_summary_says_what_was_kept_and_how_much_faster():
    text = " ".join(report(_results()).split())  # the summary is wrapped
    assert "In short: pocket-s read each 128-token context" in text
    assert "20.0× faster" in text and "4.0× counting pocket-s's prefill" in text
    assert "90% of what pocket-l's own context is worth" in text
    assert "Careful" not in text and "busy" not in text


def test_undefined_chance_normalised_retention_and_cautions():
    text = " ".join(report(_results(target_acc=0.25, no_context_nll=5.15, busy=True)).split())
    assert "chance-normalised retention undefined (target at or below chance)" in text
    assert "the cloze test says nothing here" in text
    assert "Careful: pocket-l gains only 0.050 nats" in text
    assert "measured on a busy machine" in text and "rerun on a quiet machine" in text


def test_thread_choice():
    assert choose_threads(3, 0.9) == (3, "--threads")
    threads, why = choose_threads(None, 0.0)
    assert threads == physical_cores() and "physical cores" in why
    busy_threads, _ = choose_threads(None, 1.0)
    assert busy_threads == 1  # every CPU busy elsewhere: one thread, not an oversubscribed pool


def test_stage_lines_have_elapsed_and_eta():
    stream = io.StringIO()
    stages = Stages({"a": 1.0, "b": 3.0}, stream=stream)
    assert stages.run("a", "first", lambda: 7) == 7
    stages.run("b", "second", lambda: None)
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("[1/2] first (elapsed") and "ETA after the first stage" in lines[0]
    assert lines[2].startswith("[2/2] second (elapsed") and "ETA" in lines[2]
    assert lines[1].strip().startswith("done in")


def test_controls_are_reported_and_a_close_control_is_flagged():
    text = " ".join(report(_results()).split())
    assert (
        "controls (caches with no information about the context), retention: zero cache 0.150, random cache 0.100"
        in text
    )
    assert "warning" not in text.lower()
    flagged = " ".join(report(_results(controls={"zero_cache": 0.85, "random_cache": 0.1})).split())
    assert "warning: a control comes within 0.1 of the bridge's retention" in flagged
    assert "Warning: a cache that carries no information about the context" in flagged and "keeps 85%" in flagged


def test_gap_recovered_is_reported_with_its_interval_or_why_not():
    text = report(_results())
    assert "gap recovered (source → target, NLL; paired 95% CI over windows): 0.412 [0.301, 0.523]" in text
    assert "gap recovered (accuracy; paired 95% CI over items): n/a (an identity pair?)" in text
    assert "closed 41% (95% CI 30% to 52%) of the continuation-NLL gap between pocket-s and pocket-l" in " ".join(
        text.split()
    )
    undefined = report(_results(gap=None))
    assert "gap recovered (source → target, NLL; paired 95% CI over windows): n/a (an identity pair?)" in undefined
    assert "of the continuation-NLL gap" not in " ".join(undefined.split())
