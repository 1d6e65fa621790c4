"""Arguments of the `kvbridge` subcommands that run tools (demo, eval, mappers), kept here so that building the
parser (`kvbridge --help`) imports no tool: each tool is imported only when its command runs."""

from __future__ import annotations

import argparse

from ..constants import EVAL_MODES, MAPPER_STUDY_MAPPERS, MAPPER_STUDY_PAIRS
from ..pocket import POCKET_MODELS

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


def add_mappers_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pairs", default=MAPPER_STUDY_PAIRS, help="candidate SOURCE:TARGET pairs; the hardest is studied"
    )
    parser.add_argument("--pair", help="study this SOURCE:TARGET pair directly (skips the search for the hardest)")
    parser.add_argument(
        "--mappers",
        default=",".join(MAPPER_STUDY_MAPPERS),
        help="comma-separated mapper names: ridge, ridge_same_head, low_rank_<rank> (e.g. low_rank_32), mlp_mse, "
        "mlp_attention, ridge_attention_weighted; a linear one with _bf16 appended keeps its weights in bfloat16 "
        f"(default: {','.join(MAPPER_STUDY_MAPPERS)})",
    )
    parser.add_argument("--num-sequences", type=int, default=128, help="calibration windows")
    parser.add_argument("--seq-len", type=int, default=256, help="calibration window length")
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--ridge-lambda", type=float, default=0.01)
    parser.add_argument("--head-mode", choices=["all_heads", "same_head"], default="all_heads")
    parser.add_argument("--nll-windows", type=int, default=64)
    parser.add_argument("--nll-context", type=int, default=256)
    parser.add_argument("--nll-continuation", type=int, default=64)
    parser.add_argument("--cloze-items", type=int, default=100, help="cloze items per mapper (0: skip the cloze)")
    parser.add_argument("--mlp-hidden", type=int, default=128)
    parser.add_argument("--mlp-epochs", type=int, default=3)
    parser.add_argument("--mlp-lr", type=float, default=3e-3)
    parser.add_argument("--mlp-steps-per-batch", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--timing-context", type=int, default=1024)
    parser.add_argument("--timing-repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="kvbridge-mappers.json", help="where to write the results")
