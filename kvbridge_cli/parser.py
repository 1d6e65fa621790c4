"""The `kvbridge` parser: every subcommand, built without importing torch or `hf_kvbridge` (its stdlib-only modules
are read by `_light`), and the checks that run on the parsed arguments before any model is loaded.

Where things are: `arguments` (the argument types), `settings_options` (the options generated from
`CalibrationSettings`, and the mapper options), `bridge_commands` (calibrate, generate, chat, push, serve, store) and
`tool_commands` (eval, inspect, bench, tune, demo). `check_arguments` runs the settings' own value checks.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from . import settings_options
from ._light import core
from .arguments import _Parser
from .bridge_commands import add_calibrate, add_distill, add_generate_and_chat, add_push, add_serve, add_store
from .settings_options import cli_fields
from .tool_commands import DEMO_SETTINGS, TUNE_SETTINGS, add_bench, add_demo, add_eval, add_inspect, add_tune

_choice = core("tools.tune.choice")

DEBUG_HELP = "on an error, show the full traceback instead of one line"
# the settings fields each command offers besides `calibrate` (which offers them all)
OFFERED_SETTINGS = {"demo": DEMO_SETTINGS, "tune": TUNE_SETTINGS}


def _subcommand(parser: argparse.ArgumentParser, *names: str) -> argparse.ArgumentParser:
    """The subparser of `parser` that `names` lead to (`"bench", "mapper"`), for an error in its own words."""
    for name in names:
        parser = parser._subparsers._group_actions[0].choices[name]
    return parser


def _settings_values(args: argparse.Namespace) -> str | None:
    """The settings' own value checks (stdlib only) on the settings options the command offers."""
    names = [f.name for f in cli_fields()] if args.command == "calibrate" else list(OFFERED_SETTINGS[args.command])
    values = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    try:
        settings_options.CalibrationSettings.check_values(values)
    except ValueError as err:  # the settings' ConfigurationError (loaded from the same file, under another name)
        return str(err)
    return None


def _distill_values(args: argparse.Namespace) -> str | None:
    """`DistillationSettings`' own value checks on `kvbridge distill`'s options."""
    settings = settings_options.DistillationSettings
    names = [f.name for f in cli_fields(settings)]
    try:
        settings.check_values({name: getattr(args, name) for name in names})
    except ValueError as err:
        return str(err)
    return None


def _distill_out(args: argparse.Namespace) -> str | None:
    """`--out` of `kvbridge distill` may hold the checkpoint of a stopped run (it resumes) and nothing else unless
    `--overwrite` is given."""
    out = Path(args.out)
    if out.is_file():
        return f"--out {out} is a file; pass a folder (new or empty)"
    others = [p.name for p in out.iterdir() if p.name != "distill-checkpoint"] if out.is_dir() else []
    if others and not args.overwrite:
        return f"--out {out} is not empty; pass --overwrite to replace the bridge files in it"
    return None


def _out_folder(args: argparse.Namespace) -> str | None:
    """`--out` must be a folder that is new or empty, or `--overwrite` given: refused before hours of calibration or
    search, not after."""
    out = Path(args.out)
    if out.is_file():
        return f"--out {out} is a file; pass a folder (new or empty)"
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        return f"--out {out} is not empty; pass --overwrite to replace the bridge files in it"
    return None


def _objective(args: argparse.Namespace) -> str | None:
    """A search needs a quality target or a cost budget (the library's own check, `tools.tune.choice`)."""
    try:
        _choice.check_objective(args.min_retention, args.max_cost, ("--min-retention", "--max-cost"))
    except ValueError as err:
        return str(err)
    return None


def _two_models(args: argparse.Namespace) -> str | None:
    return "--source and --target must differ; pick two pocket models" if args.source == args.target else None


def _card_folder(args: argparse.Namespace) -> str | None:
    if args.write_card and not Path(args.bridge).is_dir():
        return "--write-card needs a local checkpoint folder"
    return None


def _eval_what(args: argparse.Namespace) -> str | None:
    """`kvbridge eval` needs lm-eval tasks or held-out text; the held-out options need `--heldout`."""
    if not args.tasks and not args.heldout:
        return "pass --tasks (lm-eval tasks) or --heldout (held-out text, e.g. pocket), or both"
    if not args.heldout and (args.both_directions or args.reverse):
        return "--both-directions and --reverse evaluate on held-out text; pass --heldout"
    if args.probe_items < 0:
        return f"--probe-items must be 0 (no probe) or more, got {args.probe_items}"
    return None


def _old_vs_new_alone(args: argparse.Namespace) -> str | None:
    if args.old_vs_new and args.interleave:
        return (
            "--old-vs-new times the old and the new default mapping against each other (alternating rounds) and no "
            "prefills; drop --interleave, which orders the prefill runs"
        )
    return None


def _flop_model_alone(args: argparse.Namespace) -> str | None:
    if args.flop_model and args.layers:
        return "--layers is for a measured run; --flop-model counts the whole pair"
    return None


# the checks of each command (and bench kind), in order: the first problem is the one reported
CHECKS = {
    "calibrate": (_settings_values, settings_options.check_mapper_kwargs, _out_folder),
    "distill": (_distill_values, _distill_out),
    "tune": (_objective, _settings_values, _out_folder),
    "demo": (_two_models, _settings_values),
    "eval": (_eval_what, _card_folder),
    "bench mapper": (_old_vs_new_alone,),
    "bench calibration": (_flop_model_alone,),
}


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What argument types cannot check alone (options together, the settings' own value checks, a folder on disk),
    standard library only: the first problem exits with status 2 and one line, as a parse error does, before anything
    is loaded."""
    names = [args.command, *([args.bench] if args.command == "bench" else [])]
    for check in CHECKS.get(" ".join(names), ()):
        problem = check(args)
        if problem:
            _subcommand(parser, *names).error(problem)


NESTED = ("bench", "store")  # commands whose subcommands take the options


def build_parser() -> argparse.ArgumentParser:
    """The `kvbridge` parser: every subcommand, with `-v`/`--debug` before or after the command."""
    parser = _Parser(prog="kvbridge", description="Cross-model KV cache transfer within an LLM family")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    add_calibrate(sub)
    add_distill(sub)
    add_generate_and_chat(sub)
    add_eval(sub)
    add_push(sub)
    add_inspect(sub)
    add_bench(sub)
    add_tune(sub)
    add_serve(sub)
    add_demo(sub)
    add_store(sub)
    for name, subparser in sub.choices.items():  # `--debug` after the command, too
        if name not in NESTED:
            subparser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    for name in NESTED:
        for subparser in sub.choices[name]._subparsers._group_actions[0].choices.values():
            subparser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    return parser
