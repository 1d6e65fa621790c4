"""The `kvbridge` command functions: each runs one command line that `kvbridge_cli` parsed and checked, handing plain
arguments to the tools and the core; `run(args)` dispatches them (`cli/main.py`)."""

from .main import run

__all__ = ["run"]
