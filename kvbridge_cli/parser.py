"""The `kvbridge` parser: every subcommand, built without importing torch or `hf_kvbridge` (its stdlib-only modules
are read by `_light`), and the checks that run on the parsed arguments before any model is loaded.

Where things are: `arguments` (the argument types), `settings_options` (the options generated from
`CalibrationSettings`, and the mapper options), `bridge_commands` (calibrate, generate, chat, push, serve, store) and
`tool_commands` (eval, inspect, bench, tune, demo). `check_arguments` runs the settings' own value checks.
"""

from __future__ import annotations

import argparse

from .arguments import _Parser
from .bridge_commands import add_calibrate, add_generate_and_chat, add_push, add_serve, add_store
from .settings_options import MAPPER_OPTIONS, CalibrationSettings, cli_fields
from .tool_commands import DEMO_SETTINGS, TUNE_SETTINGS, add_bench, add_demo, add_eval, add_inspect, add_tune

DEBUG_HELP = "on an error, show the full traceback instead of one line"


def _subcommand(parser: argparse.ArgumentParser, *names: str) -> argparse.ArgumentParser:
    """The subparser of `parser` that `names` lead to (`"bench", "mapper"`), for an error in its own words."""
    for name in names:
        parser = parser._subparsers._group_actions[0].choices[name]
    return parser


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The settings' own value checks (stdlib only) on the settings options `args.command` offers; a bad value
    exits with status 2 and one line, as a parse error does."""
    if args.command == "bench" and getattr(args, "bench", None) == "mapper" and args.old_vs_new and args.interleave:
        _subcommand(parser, "bench", "mapper").error(
            "--old-vs-new times the old and the new default mapping against each other (alternating rounds) and no "
            "prefills; drop --interleave, which orders the prefill runs"
        )
    offered = {"calibrate": None, "demo": DEMO_SETTINGS, "tune": TUNE_SETTINGS}
    if args.command not in offered:
        return
    names = [f.name for f in cli_fields()] if offered[args.command] is None else list(offered[args.command])
    values = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    command = _subcommand(parser, args.command)
    try:
        CalibrationSettings.check_values(values)
    except ValueError as err:  # the settings' ConfigurationError (loaded from the same file, under another name)
        command.error(str(err))
    if args.command == "calibrate":
        for mapper_type, _key, option, *_ in MAPPER_OPTIONS:
            if getattr(args, option[2:].replace("-", "_")) is not None and mapper_type != args.mapper_type:
                command.error(f"{option} applies to --mapper-type {mapper_type}, not {args.mapper_type}")


COMMANDS = ("calibrate", "generate", "chat", "eval", "push", "inspect", "bench", "tune", "serve", "demo", "store")
NESTED = ("bench", "store")  # commands whose subcommands take the options


def build_parser() -> argparse.ArgumentParser:
    """The `kvbridge` parser: every subcommand, with `-v`/`--debug` before or after the command."""
    parser = _Parser(prog="kvbridge", description="Cross-model KV cache transfer within an LLM family")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    add_calibrate(sub)
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
