"""The `kvbridge` command line: a thin layer that parses, validates, calls the library and prints."""

from .main import build_parser, main

__all__ = ["build_parser", "main"]
