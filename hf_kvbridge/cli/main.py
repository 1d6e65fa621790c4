"""How a `kvbridge` command runs: `run(args, command)` runs the command function of a command line that `kvbridge_cli`
(the console script's light entry) has parsed and checked, with the command line's logging and errors.

Arguments are validated when they are parsed, before any model is loaded, and this package never imports
`kvbridge_cli`. Any error a command meets is printed as one line (what is wrong, what to do) with exit status 1
(`--debug` shows the traceback instead); Ctrl-C exits with status 130 and one line. The command functions: `bridge`
(calibrate, generate, chat, push, serve, store), `evaluate` (eval, inspect), `bench`, `tune`, `demo`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable


def _one_line(err: BaseException) -> str:
    """An error as one line: its message (lines joined), prefixed with its type when that is not ours."""
    from ..errors import KVBridgeError

    message = " ".join(line.strip() for line in str(err).splitlines() if line.strip()) or repr(err)
    if isinstance(err, KVBridgeError | FileNotFoundError | FileExistsError | ValueError):
        return message
    return f"{type(err).__name__}: {message}"


def run(args: argparse.Namespace, command: Callable[[argparse.Namespace], int]) -> int:
    """Runs `command(args)`, the function of the command `args` (parsed and checked by `kvbridge_cli`) names; returns
    its exit status."""
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    if not args.verbose:  # transformers' "Loading weights" bar on every model load says nothing to a user
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    try:
        return command(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print(f"\ninterrupted: kvbridge {args.command} stopped (nothing more was written)", file=sys.stderr)
        return 130
    except Exception as err:
        if args.debug:
            raise
        print(f"error: {_one_line(err)} (--debug shows the traceback)", file=sys.stderr)
        return 1
