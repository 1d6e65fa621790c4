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
DistillationSettings = _settings.DistillationSettings

_constants = core("constants")

# The command-line spelling of each `mapper_kwargs` keyword (`constants.MAPPER_KWARGS` says which mapper type takes
# it): keyword → (option, type, help). They are passed only when given, so each mapper keeps its own defaults; a
# keyword without an option here (the MLP's `seed`) is library-only.
MAPPER_OPTIONS = {
    "rank": ("--rank", int, "rank of a low_rank mapper (default 64)"),
    "hidden": ("--mlp-hidden", int, "hidden width of the MLP mapper (default 256)"),
    "loss": ("--mlp-loss", _constants.MLP_LOSSES, "MLP training loss (default mse)"),
    "epochs": ("--mlp-epochs", int, "MLP training epochs (default 2)"),
    "lr": ("--mlp-lr", float, "MLP learning rate (default 3e-3)"),
    "steps_per_batch": ("--mlp-steps-per-batch", int, "MLP optimiser steps per batch (default 8)"),
    "weight_decay": ("--mlp-weight-decay", float, "MLP weight decay (default 0)"),
    "weighting": (
        "--weighting",
        _constants.WEIGHTINGS,
        "token weights of ridge_attention_weighted (default attention)",
    ),
}
# the mapper type each keyword belongs to
MAPPER_OF_KEYWORD = {key: name for name, keys in _constants.MAPPER_KWARGS.items() for key in keys}


def cli_fields(settings_class=None) -> list[dataclasses.Field]:
    """The fields of `settings_class` (default `CalibrationSettings`; `kvbridge distill` offers
    `DistillationSettings`') the command line offers (the others are library-only, listed in `--help`)."""
    fields = dataclasses.fields(settings_class or CalibrationSettings)
    return [f for f in fields if f.metadata.get(_settings.CLI_ONLY_IN_LIBRARY, True)]


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
        if "list[float]" in types and "," in value:
            return _comma_list(_number, "numbers")(value)
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


def add_settings_options(
    parser: argparse.ArgumentParser, defaults: dict | None = None, help_overrides=None, settings_class=None
) -> None:
    """One option per command-line settings field of `settings_class` (default `CalibrationSettings`; all of them, or
    those named in `defaults`, with those defaults); name, choices and help come from the field."""
    help_overrides = help_overrides or {}
    for f in cli_fields(settings_class):
        if defaults is not None and f.name not in defaults:
            continue
        default = f.default if defaults is None else defaults[f.name]
        if default is dataclasses.MISSING:  # a default_factory field (a list)
            default = f.default_factory()
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


class _MapperKeyword(argparse.Action):
    """Stores a mapper option's value under its keyword in `args.mapper_kwargs` (a new dict each time: the default
    is shared between parses)."""

    def __init__(self, *args, keyword: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.keyword = keyword

    def __call__(self, parser, namespace, values, option_string=None):
        namespace.mapper_kwargs = {**(namespace.mapper_kwargs or {}), self.keyword: values}


def add_mapper_options(parser: argparse.ArgumentParser) -> None:
    """One option per `mapper_kwargs` keyword of `MAPPER_OPTIONS`; what is given lands in `args.mapper_kwargs`
    (`{}` when none is), which `check_arguments` checks against `--mapper-type`."""
    group = parser.add_argument_group("mapper options (mapper_kwargs; each only with its --mapper-type)")
    parser.set_defaults(mapper_kwargs={})
    for keyword, (option, kind, help_text) in MAPPER_OPTIONS.items():
        choices = kind if isinstance(kind, tuple) else None
        kind = None if choices else {int: _positive_int, float: _number}.get(kind, kind)
        metavar = None if choices else option[2:].upper().replace("-", "_")  # as argparse names it from the option
        group.add_argument(
            option, type=kind, choices=choices, help=help_text, action=_MapperKeyword, keyword=keyword,
            dest=f"mapper_option_{keyword}", default=argparse.SUPPRESS, metavar=metavar,
        )  # fmt: skip


def check_mapper_kwargs(args: argparse.Namespace) -> str | None:
    """What is wrong with the mapper options given for `args.mapper_type` (one line), or `None`."""
    for keyword in args.mapper_kwargs:
        if MAPPER_OF_KEYWORD[keyword] != args.mapper_type:
            option = MAPPER_OPTIONS[keyword][0]
            return f"{option} applies to --mapper-type {MAPPER_OF_KEYWORD[keyword]}, not {args.mapper_type}"
    return None
