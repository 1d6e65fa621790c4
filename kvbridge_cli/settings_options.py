"""Command-line options generated from the fields of `hf_kvbridge.settings.CalibrationSettings` (name, default,
choices and help come from the field, as transformers' `HfArgumentParser` does with dataclasses), so a field added
there is an option here without an edit; and the options of `mapper_kwargs`, one per mapper keyword.
"""

from __future__ import annotations

import argparse
import dataclasses

from ._light import core
from .arguments import _comma_list, _number, _positive_int, _ridge_lambda, _top_k

_settings = core("settings")
CalibrationSettings = _settings.CalibrationSettings

# Options of `mapper_kwargs`, offered one by one: (mapper type, keyword, option, type, choices, help). They are passed
# only when given, so each mapper keeps its own defaults.
MAPPER_OPTIONS = (
    ("low_rank", "rank", "--rank", int, None, "rank of a low_rank mapper (default 64)"),
    ("mlp", "hidden", "--mlp-hidden", int, None, "hidden width of the MLP mapper (default 256)"),
    ("mlp", "loss", "--mlp-loss", str, ("mse", "attention"), "MLP training loss (default mse)"),
    ("mlp", "epochs", "--mlp-epochs", int, None, "MLP training epochs (default 2)"),
    ("mlp", "lr", "--mlp-lr", float, None, "MLP learning rate (default 3e-3)"),
    ("mlp", "steps_per_batch", "--mlp-steps-per-batch", int, None, "MLP optimiser steps per batch (default 8)"),
    ("mlp", "weight_decay", "--mlp-weight-decay", float, None, "MLP weight decay (default 0)"),
    ("ridge_attention_weighted", "weighting", "--weighting", str, ("attention", "uniform"),
     "token weights of ridge_attention_weighted (default attention)"),
)  # fmt: skip


def cli_fields() -> list[dataclasses.Field]:
    """The settings fields the command line offers (the others are library-only, listed in `--help`)."""
    return [f for f in dataclasses.fields(CalibrationSettings) if f.metadata.get(_settings.CLI_ONLY_IN_LIBRARY, True)]


def library_only_fields() -> list[str]:
    return [f.name for f in dataclasses.fields(CalibrationSettings) if f not in cli_fields()]


def option_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _annotation_types(annotation: str) -> list[str]:
    """`"int | str | None"` → `["int", "str", "None"]` (the settings module's annotations are strings)."""
    if isinstance(annotation, type):
        return [annotation.__name__]
    return [part.strip() for part in str(annotation).split("|")]


def _field_type(f: dataclasses.Field):
    """The argparse type of a settings field, from its annotation: numbers parsed as numbers where the annotation
    allows, `all`/`none` for `None` where it does, text otherwise. Ranges are checked by the settings themselves
    (`check_arguments`)."""
    if f.name == "top_k":
        return _top_k
    if f.name == "ridge_lambda":
        return _ridge_lambda
    types = _annotation_types(f.type)

    def parse(value: str):
        if "None" in types and value.lower() == "none":
            return None
        if "list[int]" in types and "," in value:  # a comma-separated list where the annotation takes one
            return _comma_list(int, "integers")(value)
        for name, convert in (("int", int), ("float", float)):
            if name in types:
                try:
                    return convert(value)
                except ValueError:
                    continue
        if "str" in types:
            return value
        expected = " or ".join(t for t in types if t != "None")
        raise argparse.ArgumentTypeError(f"{value!r} is not a {expected}")

    return parse


def add_settings_options(parser: argparse.ArgumentParser, defaults: dict | None = None, help_overrides=None) -> None:
    """One option per command-line settings field (all of them, or those named in `defaults`, with those
    defaults); name, choices and help come from the field."""
    help_overrides = help_overrides or {}
    for f in cli_fields():
        if defaults is not None and f.name not in defaults:
            continue
        default = f.default if defaults is None else defaults[f.name]
        help_text = f.metadata.get("help", "")
        shown = help_overrides.get(f.name) or ("default: off" if default is False else f"default: {default}")
        if default is None and f.name not in help_overrides:  # the field's help says what None means
            shown = None
        kwargs = {"default": default, "help": f"{help_text} ({shown})" if shown else help_text, "dest": f.name}
        if _annotation_types(f.type) == ["bool"]:
            parser.add_argument(option_name(f.name), action="store_true", **kwargs)
            continue
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        else:
            kwargs["type"] = _field_type(f)
        parser.add_argument(option_name(f.name), **kwargs)


def add_mapper_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("mapper options (mapper_kwargs; each only with its --mapper-type)")
    for _mapper_type, _key, option, kind, choices, help_text in MAPPER_OPTIONS:
        kind = {int: _positive_int, float: _number}.get(kind, kind)
        group.add_argument(option, type=None if choices else kind, choices=choices, default=None, help=help_text)


def mapper_kwargs(args: argparse.Namespace) -> dict:
    """The `mapper_kwargs` the mapper options given on the command line make (checked by `check_arguments`)."""
    return {
        key: getattr(args, option[2:].replace("-", "_"))
        for mapper_type, key, option, *_ in MAPPER_OPTIONS
        if mapper_type == args.mapper_type and getattr(args, option[2:].replace("-", "_")) is not None
    }
