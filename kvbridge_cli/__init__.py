"""The `kvbridge` command's light entry: parses and checks the arguments, then imports `hf_kvbridge` to run them.

`kvbridge --help`, `kvbridge CMD --help` and argument mistakes are answered without importing torch or transformers
(the parser is built from the settings' field definitions and the tools' defaults, read by `_light`); the command
functions live in `hf_kvbridge.cli`, imported only when a command runs. The dependency goes one way: `hf_kvbridge`
never imports this package.
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

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
