"""The `kvbridge` command functions: each runs one parsed command (the parser is `kvbridge_cli.parser`)."""

from .main import main, run

__all__ = ["main", "run"]
