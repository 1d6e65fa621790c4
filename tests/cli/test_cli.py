"""The `kvbridge` command line, run in-process on local folders."""

import argparse
import dataclasses
import json

import pytest
from transformers import AutoTokenizer

from hf_kvbridge import CalibrationSettings, KVBridgeForCausalLM
from hf_kvbridge.cli.bridge import settings_from_args
from hf_kvbridge.constants import MAPPER_TYPE_NAMES
from hf_kvbridge.mappers import MAPPER_REGISTRY
from kvbridge_cli import build_parser, main
from kvbridge_cli import settings_options as cli_options
from kvbridge_cli import tool_commands as cli_commands
from tests.conftest import CORPUS


def test_calibrate_then_generate(saved_pair, tmp_path, capsys):
    data = tmp_path / "calib.txt"
    data.write_text(" ".join(CORPUS))
    out = tmp_path / "bridge"
    code = main(
        [
            "calibrate",
            saved_pair["small"],
            saved_pair["large"],
            "--data",
            str(data),
            "--out",
            str(out),
            "--top-k",
            "2",
            "--num-sequences",
            "12",
            "--seq-len",
            "32",
            "--head-mode",
            "same_head",
            "--kv-mode",
            "separate",
        ]
    )
    assert code == 0
    assert "held-out R²" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert (config["head_mode"], config["kv_mode"]) == ("same_head", "separate")
    tokenizer_files = {"tokenizer.json", "tokenizer_config.json"}  # the shared tokenizer travels with the bridge
    assert {p.name for p in out.iterdir()} == {"config.json", "mapper.safetensors", "README.md", *tokenizer_files}
    assert main(["generate", str(out), "The quick brown", "--max-new-tokens", "5"]) == 0
    # the command prints what the library generates greedily from the same prompt
    bridge = KVBridgeForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    inputs = tokenizer("The quick brown", return_tensors="pt")
    expected = bridge.generate(**inputs, max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert expected.shape[1] > inputs["input_ids"].shape[1]
    assert capsys.readouterr().out.strip() == tokenizer.decode(expected[0], skip_special_tokens=True).strip()
    # a second calibrate into the same folder refuses before doing any work (the parser's check: exit status 2)
    with pytest.raises(SystemExit) as exit_info:
        main(["calibrate", saved_pair["small"], saved_pair["large"], "--data", str(data), "--out", str(out)])
    assert exit_info.value.code == 2


def test_help_imports_no_tool():
    """Building the parser (`kvbridge --help`) imports none of the studies, demo, bench or evaluation tools."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom kvbridge_cli import build_parser\nbuild_parser().format_help()\n"
        "print(sorted(m for m in sys.modules if m.startswith('hf_kvbridge.tools')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


# a command-line value for every CLI-able settings field, and the value it must reach CalibrationSettings as
SAMPLES = {
    "num_sequences": ("7", 7),
    "seq_len": ("33", 33),
    "top_k": ("all", None),
    "ridge_lambda": ("0.5", 0.5),
    "head_mode": ("same_head", "same_head"),
    "kv_mode": ("separate", "separate"),
    "mapper_type": ("low_rank", "low_rank"),
    "batch_size": ("3", 3),
    "heldout_fraction": ("0.25", 0.25),
    "hold_back": ("4", 4),
    "seed": ("5", 5),
    "text_field": ("body", "body"),
    "bidirectional": (None, True),
    "checkpoint_dir": ("/tmp/kvbridge-checkpoint", "/tmp/kvbridge-checkpoint"),
    "statistics_device": ("cpu", "cpu"),
    "statistics_memory": ("16GB", "16GB"),
    "statistics_dtype": ("float64", "float64"),
    "recompute_layers": ("1,2", [1, 2]),
    "hidden_state_layers": ("0,-1", [0, -1]),
    "key_norm": ("off", "off"),
}
CALIBRATE = ["calibrate", "src", "tgt", "--out", "o"]


def _settings(*options: str) -> CalibrationSettings:
    return settings_from_args(build_parser().parse_args([*CALIBRATE, *options]))


def test_every_cli_field_has_an_option_and_a_sample():
    fields = {f.name for f in cli_options.cli_fields()}
    assert fields == set(SAMPLES)
    library_only = {f.name for f in dataclasses.fields(CalibrationSettings)} - fields
    assert library_only == {"mapper_kwargs", "keep_statistics", "progress"}
    help_text = build_parser()._subparsers._group_actions[0].choices["calibrate"].format_help()
    assert all(cli_options.option_name(name) in help_text for name in fields)
    assert all(name in help_text for name in library_only)  # named in the epilog


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_each_settings_option_reaches_the_settings_unchanged(name):
    text, expected = SAMPLES[name]
    option = cli_options.option_name(name)
    settings = _settings(option) if text is None else _settings(option, text)
    assert getattr(settings, name) == expected
    assert expected != getattr(CalibrationSettings(), name)  # the sample is not the default


def test_hidden_state_layers_take_one_entry_a_list_or_all():
    assert _settings("--hidden-state-layers", "-1").hidden_state_layers == -1
    assert _settings("--hidden-state-layers", "all").hidden_state_layers == "all"
    assert _settings("--hidden-state-layers", "none").hidden_state_layers is None


def test_calibrate_defaults_are_the_settings_defaults():
    assert _settings() == CalibrationSettings(progress=True)


def test_mapper_options_become_mapper_kwargs():
    assert _settings("--mapper-type", "low_rank", "--rank", "8").mapper_kwargs == {"rank": 8}
    mlp = _settings("--mapper-type", "mlp", "--mlp-hidden", "16", "--mlp-loss", "attention", "--mlp-lr", "0.01")
    assert mlp.mapper_kwargs == {"hidden": 16, "loss": "attention", "lr": 0.01}
    assert _settings().mapper_kwargs == {}


def test_a_new_settings_field_becomes_an_option_without_cli_edits(monkeypatch):
    settings_module = cli_options._settings

    @dataclasses.dataclass
    class Extended(cli_options.CalibrationSettings):
        new_knob: int = settings_module._option(3, help="a knob added to the settings")

    monkeypatch.setattr(cli_options, "CalibrationSettings", Extended)
    args = build_parser().parse_args([*CALIBRATE, "--new-knob", "9"])
    assert args.new_knob == 9
    assert (
        "a knob added to the settings"
        in build_parser()._subparsers._group_actions[0].choices["calibrate"].format_help()
    )


def test_mapper_type_names_match_the_registry():
    assert set(MAPPER_TYPE_NAMES) == set(MAPPER_REGISTRY)


def test_demo_and_tune_declare_their_defaults_once():
    demo = build_parser().parse_args(["demo"])
    assert {name: getattr(demo, name) for name in cli_commands.DEMO_SETTINGS} == cli_commands.DEMO_SETTINGS
    tune = build_parser().parse_args(["tune", "s", "t", "--out", "o", "--eval-data", "pocket"])
    assert {name: getattr(tune, name) for name in cli_commands.TUNE_SETTINGS} == cli_commands.TUNE_SETTINGS
    assert isinstance(tune, argparse.Namespace)


def test_the_command_line_defaults_are_the_tools_own():
    """`kvbridge tune` and `demo` read their defaults from the tools' standard-library modules (`tools/tune/grid.py`,
    `tools/defaults.py`): a command line with no options asks for exactly what the library does by default."""
    import inspect

    from hf_kvbridge.tools.demo import measure
    from hf_kvbridge.tools.tune.grid import TuneGrid
    from hf_kvbridge.tools.tune.search import run_tune

    tune = build_parser().parse_args(["tune", "s", "t", "--out", "o", "--eval-data", "pocket"])
    grid = {name: getattr(tune, name) for name in dataclasses.asdict(TuneGrid())}
    grid = {name: tuple(value) if isinstance(value, list) else value for name, value in grid.items()}
    assert TuneGrid(**grid) == TuneGrid()
    library = {name: p.default for name, p in inspect.signature(run_tune).parameters.items()}
    sizes = ("num_sequences", "seq_len", "heldout_fraction", "seed", "text_field", "tune_windows", "check_windows")
    for name in (*sizes, "context", "continuation"):
        assert getattr(tune, name) == library[name], name
    demo = build_parser().parse_args(["demo"])
    library = {name: p.default for name, p in inspect.signature(measure).parameters.items()}
    for name in (
        "source",
        "target",
        "quick",
        "top_k",
        "ridge_lambda",
        "head_mode",
        "num_sequences",
        "seq_len",
        "seed",
    ):
        assert getattr(demo, name) == library[name], name


def test_mapper_options_are_keywords_of_their_mapper_type():
    """Each mapper option of `kvbridge calibrate` is a `mapper_kwargs` keyword its registry entry accepts, and every
    registry entry takes the keywords `constants.MAPPER_KWARGS` names (one table, read by the settings and the CLI)."""
    from hf_kvbridge.constants import MAPPER_KWARGS

    assert {name: entry.kwargs for name, entry in MAPPER_REGISTRY.items()} == MAPPER_KWARGS
    for keyword in cli_options.MAPPER_OPTIONS:
        assert keyword in MAPPER_REGISTRY[cli_options.MAPPER_OF_KEYWORD[keyword]].kwargs


def test_every_command_of_the_parser_has_its_function():
    """The parser's subcommands and `kvbridge_cli.COMMANDS` (a command's module and function in `hf_kvbridge.cli`)
    name the same commands."""
    from kvbridge_cli import COMMANDS

    assert set(build_parser()._subparsers._group_actions[0].choices) == set(COMMANDS)
