"""The `kvbridge` command's light entry: parses and checks the arguments, then imports `hf_kvbridge` to run them.

`kvbridge --help`, `kvbridge CMD --help` and argument mistakes are answered without importing torch or transformers
(the parser is built from the settings' field definitions and the tools' defaults, read by `_light`); the command
functions live in `hf_kvbridge.cli` (`command_function` names each one), imported only when a command runs, and
`hf_kvbridge.cli.main.run` runs them. The dependency goes one way: `hf_kvbridge` never imports this package.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from .parser import build_parser, check_arguments

__all__ = ["build_parser", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one `kvbridge` command; returns its exit status (0 ok, 1 error, 2 bad arguments, 130 interrupted)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_arguments(parser, args)  # exits with status 2 and one line on a bad value, before anything loads
    from hf_kvbridge.cli.main import run

    return run(args, command_function(args.command))


# command → (the module of `hf_kvbridge.cli` that runs it, its function there)
COMMANDS = {
    "calibrate": ("bridge", "calibrate"),
    "distill": ("bridge", "distill"),
    "generate": ("bridge", "generate"),
    "chat": ("bridge", "chat"),
    "push": ("bridge", "push"),
    "serve": ("bridge", "serve"),
    "store": ("bridge", "store"),
    "eval": ("evaluate", "evaluate"),
    "inspect": ("evaluate", "inspect"),
    "bench": ("bench", "bench"),
    "tune": ("tune", "tune"),
    "demo": ("demo", "demo"),
}


def command_function(name: str):
    """The function of `hf_kvbridge.cli` that runs the command `name`, its module imported now (torch with it) and no
    other: `kvbridge calibrate` loads neither the benchmarks' nor lm-eval's nor vLLM's code."""
    module, function = COMMANDS[name]
    if module == "bridge":
        from hf_kvbridge.cli import bridge as commands
    elif module == "evaluate":
        from hf_kvbridge.cli import evaluate as commands
    elif module == "bench":
        from hf_kvbridge.cli import bench as commands
    elif module == "tune":
        from hf_kvbridge.cli import tune as commands
    else:
        from hf_kvbridge.cli import demo as commands
    return getattr(commands, function)


if __name__ == "__main__":
    sys.exit(main())
