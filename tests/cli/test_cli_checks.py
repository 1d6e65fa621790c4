"""The checks `kvbridge_cli.parser.check_arguments` runs on a parsed command line, before anything loads: each
refusal is one line with exit status 2 and the command never runs; what passes them reaches the command."""

import pytest

import hf_kvbridge.cli.main
from kvbridge_cli import main


@pytest.fixture
def commands(monkeypatch):
    """The command lines that reach `hf_kvbridge.cli.main.run` (stubbed: nothing is loaded or computed)."""
    reached = []
    monkeypatch.setattr(hf_kvbridge.cli.main, "run", lambda args, command: reached.append(args) or 0)
    return reached


def _refused(capsys, argv: list[str], *needles: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert exit_info.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_a_non_empty_out_needs_overwrite(tmp_path, capsys, commands):
    """`calibrate` and `tune` refuse a non-empty `--out` (or a file) without `--overwrite` before hours of work: one
    check for both (it was written twice in the command functions)."""
    out = tmp_path / "bridge"
    out.mkdir()
    (out / "config.json").write_text("{}")
    tune = ["tune", "a", "b", "--eval-data", "pocket", "--min-retention", "0.9"]
    for argv in (["calibrate", "a", "b", "--out", str(out)], [*tune, "--out", str(out)]):
        _refused(capsys, argv, f"--out {out} is not empty", "pass --overwrite")
        assert main([*argv, "--overwrite"]) == 0
    (tmp_path / "file").write_text("not a folder")
    _refused(capsys, ["calibrate", "a", "b", "--out", str(tmp_path / "file")], "is a file")
    assert main(["calibrate", "a", "b", "--out", str(tmp_path / "new")]) == 0
    assert [args.command for args in commands] == ["calibrate", "tune", "calibrate"]


def test_tune_needs_a_quality_target_or_a_budget(tmp_path, capsys, commands):
    """The parser runs the library's own check (`tools.tune.choice.check_objective`, which `run_tune` and `choose`
    run too), in the command line's words."""
    argv = ["tune", "a", "b", "--eval-data", "pocket", "--out", str(tmp_path / "new")]
    _refused(capsys, argv, "pass --min-retention (a quality target) or --max-cost (a cost budget), or both")
    assert main([*argv, "--max-cost", "0.5"]) == 0 and main([*argv, "--min-retention", "0.9"]) == 0
    assert len(commands) == 2


def test_mapper_options_belong_to_the_mapper_type(tmp_path, capsys, commands):
    argv = ["calibrate", "a", "b", "--out", str(tmp_path / "new")]
    _refused(capsys, [*argv, "--rank", "8"], "--rank applies to --mapper-type low_rank, not ridge")
    _refused(capsys, [*argv, "--mapper-type", "low_rank", "--mlp-epochs", "3"], "--mlp-epochs applies to")
    assert main([*argv, "--mapper-type", "mlp", "--mlp-epochs", "3", "--mlp-loss", "attention"]) == 0
    assert commands[-1].mapper_kwargs == {"epochs": 3, "loss": "attention"}


def test_demo_needs_two_models(capsys, commands):
    _refused(capsys, ["demo", "--source", "pocket-m", "--target", "pocket-m"], "--source and --target must differ")
    assert main(["demo", "--source", "pocket-m"]) == 0 and commands[0].target == "pocket-l"


def test_eval_modes_and_card_are_checked_before_loading(tmp_path, capsys, commands):
    _refused(capsys, ["eval", "b", "--tasks", "t", "--modes", "bridge,nope"], "unknown modes ['nope']", "no_context")
    _refused(capsys, ["eval", "org/bridge", "--tasks", "t", "--write-card"], "--write-card needs a local checkpoint")
    assert main(["eval", str(tmp_path), "--tasks", "t", "--write-card", "--modes", "target, bridge"]) == 0
    assert commands[0].modes == ("target", "bridge")
    assert main(["eval", "org/bridge", "--tasks", "t"]) == 0  # every mode by default
    assert commands[1].modes == ("source", "target", "bridge", "no_context", "zero_cache", "random_cache")
    _refused(capsys, ["eval", "b"], "pass --tasks (lm-eval tasks) or --heldout")
    _refused(capsys, ["eval", "b", "--tasks", "t", "--both-directions"], "pass --heldout")
    _refused(capsys, ["eval", "b", "--heldout", "pocket", "--probe-items", "-1"], "--probe-items must be 0")
    assert main(["eval", "b", "--heldout", "pocket", "--both-directions"]) == 0 and commands[2].tasks is None
    assert commands[2].windows == 64 and commands[2].context_len == 384 and commands[2].continuation_len == 128


def test_bench_option_pairs_that_contradict_each_other(capsys, commands):
    _refused(capsys, ["bench", "calibration", "--flop-model", "--layers", "2:2"], "--layers is for a measured run")
    _refused(capsys, ["bench", "mapper", "--shapes", "qwen3-0.6b:qwen3-1.7b", "--old-vs-new", "--interleave"],
             "drop --interleave")  # fmt: skip
    assert (
        main(["bench", "calibration", "--flop-model"]) == 0 and main(["bench", "calibration", "--layers", "2:2"]) == 0
    )
    assert len(commands) == 2
