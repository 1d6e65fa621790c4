"""Arguments of the `kvbridge` subcommands that run tools (demo, eval, tune) and the argument types the
commands share, kept here so that building the parser (`kvbridge --help`) imports no tool: each tool is imported only
when its command runs."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..constants import EVAL_MODES, KV_MODES
from ..pocket import POCKET_MODELS

# `--data pocket` names the calibration split shipped with the pocket family
POCKET_DATA = "pocket"


def _ridge_lambda(value: str) -> str | float:
    """`--ridge-lambda`: `auto` or a number ≥ 0."""
    if value == "auto":
        return value
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not number >= 0:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a number ≥ 0, got {value!r}")
    return number


# the pocket models the demo offers: all of them (pocket-x has another KV layout, mapped like the others)
DEMO_MODELS = POCKET_MODELS


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive whole number (1 or more)")
    return number


def _top_k(value: str) -> int | None:
    if value == "all":
        return None
    try:
        return _positive_int(value)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{value!r}: pass a number of source layers ≥ 1, or 'all'") from None


def _number(value: str) -> float:
    """`value` as a float, or the argparse error every numeric option gives."""
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None


def _fraction(value: str) -> float:
    number = _number(value)
    if not 0.0 < number < 1.0:
        raise argparse.ArgumentTypeError(f"{value} is not a fraction between 0 and 1 (exclusive)")
    return number


def _calibration_data(value: str) -> str:
    """`pocket` → the shipped calibration split; a path that can only be local must exist."""
    if value == POCKET_DATA:
        from ..pocket import data_path

        return str(data_path("calibration"))
    from ..data import TEXT_SUFFIXES

    path = Path(value).expanduser()
    if not path.exists() and (value.endswith(TEXT_SUFFIXES) or value.startswith((".", "/", "~"))):
        raise argparse.ArgumentTypeError(
            f"calibration data {value} does not exist; pass a .txt/.jsonl(.gz) file or folder, "
            f"`--data {POCKET_DATA}` for the pocket family's shipped calibration split, or a dataset name"
        )
    return value


def _heldout_data(value: str) -> str:
    """`pocket` → the shipped held-out split (seen by no model and no calibration); else as `_calibration_data`."""
    if value == POCKET_DATA:
        from ..pocket import data_path

        return str(data_path("heldout"))
    return _calibration_data(value)


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--source", default="pocket-s", choices=DEMO_MODELS, help="pocket model that prefills")
    parser.add_argument("--target", default="pocket-l", choices=DEMO_MODELS, help="pocket model that decodes")
    parser.add_argument("--top-k", type=_top_k, default=6, help="source layers per target layer, or 'all'")
    parser.add_argument("--ridge-lambda", type=lambda v: v if v == "auto" else float(v), default="auto")
    parser.add_argument("--head-mode", choices=["all_heads", "same_head"], default="all_heads")
    parser.add_argument(
        "--num-sequences", type=_positive_int, help="calibration windows (default 128; 24 with --quick)"
    )
    parser.add_argument(
        "--seq-len", type=_positive_int, help="calibration window length (default 512; 256 with --quick)"
    )
    parser.add_argument(
        "--threads", type=_positive_int, help="torch threads (default: the physical cores, fewer when others are busy)"
    )
    parser.add_argument("--seed", type=int, default=0)


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("bridge", help="bridge checkpoint folder or Hub id")
    parser.add_argument("--tasks", required=True, help="comma-separated lm-eval tasks or groups")
    parser.add_argument("--include-path", help="extra lm-eval task folder, e.g. eval_tasks/pocket")
    parser.add_argument("--limit", type=float, help="documents per task (an int, or a fraction < 1)")
    parser.add_argument("--num-fewshot", type=int)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--device", help="default: cuda when available, else cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--revision", help="revision of the bridge repo on the Hub")
    parser.add_argument("--rolling-stride", type=int, help="chunk size of rolling log-likelihood (default 256)")
    parser.add_argument("--bootstrap-iters", type=int, default=100000, help="lm-eval's, for non-mean metrics")
    parser.add_argument("--modes", default=",".join(EVAL_MODES), help=f"subset of {','.join(EVAL_MODES)}")
    parser.add_argument("--output", help="write the results (table rows and each mode's lm-eval results) as JSON")
    parser.add_argument("--write-card", action="store_true", help="put the table into the checkpoint's README.md")


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


def _kv_mode(value: str) -> str:
    if value not in KV_MODES:
        raise argparse.ArgumentTypeError(f"{value!r} is not a kv mode; use {', '.join(KV_MODES)}")
    return value


def _share(value: str) -> float:
    """A number in [0, 1] (a recomputed share of the context)."""
    number = _number(value)
    if not 0.0 <= number <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} is not a share between 0 and 1")
    return number


def _positive_float(value: str) -> float:
    number = _number(value)
    if not number > 0:
        raise argparse.ArgumentTypeError(f"{value} is not a number > 0")
    return number


def _tune_top_k(value: str) -> int:
    """`all` → a number no model reaches (the tuner caps every top-k at the source's layers)."""
    return 1 << 20 if value == "all" else _positive_int(value)


def add_tune_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="source model (Hub id, local path, or pocket/<name>)")
    parser.add_argument("target", help="target model (Hub id, local path, or pocket/<name>)")
    parser.add_argument(
        "--min-retention",
        type=_positive_float,
        help="quality target: the cheapest configuration whose context-benefit retention on the tuning windows "
        "reaches it is chosen",
    )
    parser.add_argument(
        "--max-cost",
        type=_positive_float,
        help="cost budget, FLOPs per context token (mapping + recompute) as a share of the target's own prefill; "
        "alone: the best retention within it; with --min-retention: the cheapest meeting the target within it",
    )
    parser.add_argument("--out", required=True, help="output folder for the chosen bridge checkpoint")
    parser.add_argument("--overwrite", action="store_true", help="replace bridge files in a non-empty --out")
    parser.add_argument("--json", default="kvbridge-tune.json", help="where to write every measured point")
    parser.add_argument(
        "--data",
        type=_calibration_data,
        default="HuggingFaceFW/fineweb-edu",
        help=f"calibration data, as for kvbridge calibrate ('{POCKET_DATA}': the pocket family's calibration split)",
    )
    parser.add_argument(
        "--eval-data",
        type=_heldout_data,
        required=True,
        help=f"held-out text for the tuning and check windows (other documents each); '{POCKET_DATA}': the pocket "
        "family's held-out split",
    )
    grid = parser.add_argument_group("grid (comma-separated values)")
    grid.add_argument("--top-k", type=_comma_list(_tune_top_k, "top-k values"), default=[2, 4])
    grid.add_argument(
        "--ridge-lambdas", type=_comma_list(_ridge_lambda, "λ values ('auto' or ≥ 0)"), default=["auto", 1e-3, 1e-1]
    )
    grid.add_argument("--kv-modes", type=_comma_list(_kv_mode, "kv modes"), default=list(KV_MODES))
    grid.add_argument(
        "--ranks",
        type=_comma_list(_positive_int, "ranks", allow_empty=True),
        default=[16, 32],
        help="ranks of the low-rank mapper ('none': ridge only)",
    )
    grid.add_argument("--recompute-fractions", type=_comma_list(_share, "shares in [0, 1]"), default=[0.0, 0.05, 0.1])
    parser.add_argument("--num-sequences", type=_positive_int, default=64, help="calibration windows")
    parser.add_argument("--seq-len", type=_positive_int, default=256, help="calibration window length")
    parser.add_argument(
        "--heldout-fraction", type=_fraction, default=0.1, help="calibration windows held out for R²/λ"
    )
    parser.add_argument("--tune-windows", type=_positive_int, default=16)
    parser.add_argument("--check-windows", type=_positive_int, default=16)
    parser.add_argument("--context", type=_positive_int, default=192, help="context tokens of each window")
    parser.add_argument("--continuation", type=_positive_int, default=32, help="scored tokens after the context")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--text-field", default="text", help="JSON/dataset field holding the text")
    parser.add_argument("--dtype", help="model dtype, e.g. bfloat16")
