"""The `kvbridge` parser's argument types, each naming what is wrong with a bad value, and the parser class that
answers a bad argument in one line. Standard library only (and `hf_kvbridge`'s stdlib-only modules, read by `_light`).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from ._light import core

_constants = core("constants")
_pocket = core("pocket")

# `--data pocket` names the calibration split shipped with the pocket family
POCKET_DATA = "pocket"

# `--dtype` of the commands that load a bridge's two models (`auto`: the checkpoint's own, as transformers loads)
MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")


def add_model_loading(group) -> None:
    """`--dtype` and `--device-map` of the commands that load the two models to fit a map (`calibrate`, `distill`),
    passed to `from_pretrained`."""
    group.add_argument(
        "--dtype",
        choices=MODEL_DTYPES,
        help="the models' dtype (default: the checkpoint's, as transformers loads it; float16 runs several times "
        "slower than float32 on a CPU)",
    )
    group.add_argument("--device-map", help="e.g. auto")


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument gets one line (what is wrong, where to look) instead of the whole usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _number(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None


def _whole_number(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None


def _positive_int(value: str) -> int:
    number = _whole_number(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive whole number (1 or more)")
    return number


def _positive_float(value: str) -> float:
    number = _number(value)
    if not number > 0:
        raise argparse.ArgumentTypeError(f"{value} is not a number > 0")
    return number


def _share(value: str) -> float:
    """A number in [0, 1] (a recomputed share of the context)."""
    number = _number(value)
    if not 0.0 <= number <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} is not a share between 0 and 1")
    return number


def _layer_count(value: str) -> int:
    """A whole number ≥ 0 (top target layers recomputed)."""
    number = _whole_number(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"{value} is not a whole number ≥ 0 (top target layers)")
    return number


def _ridge_lambda(value: str) -> str | float:
    """`auto` or a number ≥ 0."""
    if value == "auto":
        return value
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not number >= 0:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a number ≥ 0, got {value!r}")
    return number


def _top_k(value: str) -> int | None:
    if value == "all":
        return None
    try:
        return _positive_int(value)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{value!r}: pass a number of source layers ≥ 1, or 'all'") from None


def _tune_top_k(value: str) -> int:
    """`all` → a number no model reaches (the tuner caps every top-k at the source's layers)."""
    return 1 << 20 if value == "all" else _positive_int(value)


def _kv_mode(value: str) -> str:
    if value not in _constants.KV_MODES:
        raise argparse.ArgumentTypeError(f"{value!r} is not a kv mode; use {', '.join(_constants.KV_MODES)}")
    return value


def _comma_list(item_type, what: str, allow_empty: bool = False):
    """An argparse type: a comma-separated list whose items `item_type` parses (its messages name the bad item)."""

    def parse(value: str) -> list:
        items = [v.strip() for v in value.split(",") if v.strip()]
        if allow_empty and value.strip().lower() == "none":
            return []
        if not items:
            raise argparse.ArgumentTypeError(f"{value!r}: expected comma-separated {what}")
        return [item_type(v) for v in items]

    return parse


def _eval_modes(value: str) -> tuple[str, ...]:
    """Comma-separated modes of `kvbridge eval`, each one of `constants.EVAL_MODES`."""
    modes = tuple(m.strip() for m in value.split(",") if m.strip())
    unknown = sorted(set(modes) - set(_constants.EVAL_MODES))
    if unknown or not modes:
        raise argparse.ArgumentTypeError(
            f"unknown modes {unknown or [value]}; choose from {', '.join(_constants.EVAL_MODES)}"
        )
    return modes


def _yes_no(value: str) -> bool:
    if value.lower() in ("yes", "no"):
        return value.lower() == "yes"
    raise argparse.ArgumentTypeError(f"{value!r}: expected yes or no")


def _lengths(value: str) -> list[int]:
    try:
        return [_positive_int(n.strip()) for n in value.split(",") if n.strip()] or _positive_int("")
    except argparse.ArgumentTypeError as err:
        raise argparse.ArgumentTypeError(
            f"{value!r}: comma-separated positive token counts, e.g. 256,1024 ({err})"
        ) from None


def _calibration_data(value: str) -> str:
    """`pocket` → the shipped calibration split (a local file or folder called `pocket` wins, as in
    `hf_kvbridge.fitting.data.resolve_data_reference`); a path that can only be local must exist."""
    if value == POCKET_DATA and not Path(value).exists():
        return str(_pocket.data_path("calibration"))
    path = Path(value).expanduser()
    if not path.exists() and (value.endswith(_constants.TEXT_SUFFIXES) or value.startswith((".", "/", "~"))):
        raise argparse.ArgumentTypeError(
            f"calibration data {value} does not exist; pass a .txt/.jsonl(.gz) file or folder, "
            f"`--data {POCKET_DATA}` for the pocket family's shipped calibration split, or a dataset name"
        )
    return value


def _heldout_data(value: str) -> str:
    """`pocket` → the shipped held-out split (seen by no model and no calibration); else as `_calibration_data`."""
    if value == POCKET_DATA and not Path(value).exists():
        return str(_pocket.data_path("heldout"))
    return _calibration_data(value)


def _memory_size(value: str) -> str:
    """A server memory size: a number of bytes, or with kb/mb/gb (as redis-server reads it)."""
    if not re.fullmatch(r"\d+(?:[kmg]b?|b)?", value.strip(), re.IGNORECASE):
        raise argparse.ArgumentTypeError(f"{value!r} is not a size such as 512mb, 4gb or a number of bytes")
    return value.strip().lower()


def _port(value: str) -> int:
    number = _whole_number(value)
    if not 0 < number < 65536:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port (1 to 65535)")
    return number
