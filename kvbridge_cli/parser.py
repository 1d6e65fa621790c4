"""Every `kvbridge` subcommand's arguments, in one module that imports neither torch nor `hf_kvbridge`.

`kvbridge calibrate`'s calibration options are generated from the fields of `hf_kvbridge.settings.CalibrationSettings`
(name, default, choices and help come from the field, as transformers' `HfArgumentParser` does with dataclasses), so a
field added there is an option here without an edit. `demo` and `tune` offer some of the same fields with their own
defaults, declared once each in `DEMO_SETTINGS` and `TUNE_SETTINGS`. Argument types check their value when it is
parsed; `check_arguments` runs the settings' own value checks before any model is loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

from ._light import core

_constants = core("constants")
_settings = core("settings")
_pocket = core("pocket")
CalibrationSettings = _settings.CalibrationSettings

# `--data pocket` names the calibration split shipped with the pocket family
POCKET_DATA = "pocket"
# the pocket models the demo offers: all of them (pocket-x has another KV layout, mapped like the others)
DEMO_MODELS = _pocket.POCKET_MODELS
DEFAULT_BENCH_LENGTHS = (256, 1024, 4096)
BENCH_DTYPES = ("float32", "bfloat16", "float16")
DEBUG_HELP = "on an error, show the full traceback instead of one line"

# The settings fields `demo` and `tune` offer, with the defaults those commands deliberately use instead of the
# library's (None: the command picks the value, as its --help says). Every other command-line option of theirs is
# their own.
DEMO_SETTINGS = {"top_k": 6, "ridge_lambda": "auto", "head_mode": "all_heads", "num_sequences": None, "seq_len": None,
                 "seed": 0}  # fmt: skip
DEMO_SIZES_HELP = {"num_sequences": "default 128; 24 with --quick", "seq_len": "default 512; 256 with --quick"}
TUNE_SETTINGS = {"num_sequences": 64, "seq_len": 256, "heldout_fraction": 0.1, "seed": 0, "text_field": "text",
                 "hidden_state_layers": "all"}  # fmt: skip

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


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument gets one line (what is wrong, where to look) instead of the whole usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# ---- argument types: each names what is wrong with a bad value


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
    `hf_kvbridge.data.resolve_data_reference`); a path that can only be local must exist."""
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


# ---- options generated from CalibrationSettings


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


def _subcommand(parser: argparse.ArgumentParser, *names: str) -> argparse.ArgumentParser:
    """The subparser of `parser` that `names` lead to (`"bench", "mapper"`), for an error in its own words."""
    for name in names:
        parser = parser._subparsers._group_actions[0].choices[name]
    return parser


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The settings' own value checks (stdlib only) on the settings options `args.command` offers; a bad value
    exits with status 2 and one line, as a parse error does."""
    if args.command == "bench" and getattr(args, "bench", None) == "mapper" and args.old_vs_new and args.interleave:
        _subcommand(parser, "bench", "mapper").error(
            "--old-vs-new times the old and the new default mapping against each other (alternating rounds) and no "
            "prefills; drop --interleave, which orders the prefill runs"
        )
    offered = {"calibrate": None, "demo": DEMO_SETTINGS, "tune": TUNE_SETTINGS}
    if args.command not in offered:
        return
    names = [f.name for f in cli_fields()] if offered[args.command] is None else list(offered[args.command])
    values = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    command = _subcommand(parser, args.command)
    try:
        CalibrationSettings.check_values(values)
    except ValueError as err:  # the settings' ConfigurationError (loaded from the same file, under another name)
        command.error(str(err))
    if args.command == "calibrate":
        for mapper_type, _key, option, *_ in MAPPER_OPTIONS:
            if getattr(args, option[2:].replace("-", "_")) is not None and mapper_type != args.mapper_type:
                command.error(f"{option} applies to --mapper-type {mapper_type}, not {args.mapper_type}")


# ---- the subcommands


def _add_calibrate(sub) -> None:
    cal = sub.add_parser(
        "calibrate",
        help="calibrate a source→target mapper and save it",
        epilog="library-only settings (no option): "
        + ", ".join(library_only_fields())
        + "; mapper_kwargs are the mapper options above, and progress bars are always on",
    )
    cal.add_argument("source", help="source model (Hub id, local path, or pocket/<name>)")
    cal.add_argument("target", help="target model (Hub id, local path, or pocket/<name>)")
    cal.add_argument(
        "--data",
        type=_calibration_data,
        default=_constants.DEFAULT_CALIBRATION_DATA,
        help=f"a .txt/.jsonl file or folder, '{POCKET_DATA}' (the pocket family's shipped calibration split), or a "
        f"dataset name (streamed; default {_constants.DEFAULT_CALIBRATION_DATA}, needs the Hub)",
    )
    cal.add_argument("--out", required=True, help="output folder for the bridge checkpoint")
    cal.add_argument("--overwrite", action="store_true", help="replace bridge files in a non-empty --out")
    settings = cal.add_argument_group("calibration settings (hf_kvbridge.CalibrationSettings)")
    add_settings_options(settings)
    add_mapper_options(cal)
    models = cal.add_argument_group("models")
    models.add_argument("--source-revision")
    models.add_argument("--target-revision")
    models.add_argument("--dtype", help="model dtype, e.g. bfloat16")
    models.add_argument("--device-map", help="e.g. auto")


def _add_generate_and_chat(sub) -> None:
    gen = sub.add_parser("generate", help="generate with a saved bridge")
    gen.add_argument("bridge", help="bridge checkpoint folder or Hub id")
    gen.add_argument("prompt")
    gen.add_argument("--max-new-tokens", type=_positive_int, default=40)
    gen.add_argument("--do-sample", action="store_true")
    gen.add_argument("--seed", type=int, default=0)

    chat = sub.add_parser("chat", help="chat in the terminal, switching models mid-conversation")
    chat.add_argument("bridge", help="bridge checkpoint folder or Hub id")
    chat.add_argument("--start", choices=["source", "target"], default="source", help="model of the first answer")
    chat.add_argument("--remap", choices=["incremental", "full"], default="incremental")
    chat.add_argument("--system", help="system prompt")
    chat.add_argument("--max-new-tokens", type=_positive_int, default=64)
    chat.add_argument("--do-sample", action="store_true")


def _add_eval(sub) -> None:
    ev = sub.add_parser("eval", help="source, target and bridge through lm-eval: one retention table")
    ev.add_argument("bridge", help="bridge checkpoint folder or Hub id")
    ev.add_argument("--tasks", required=True, help="comma-separated lm-eval tasks or groups")
    ev.add_argument("--include-path", help="extra lm-eval task folder, e.g. eval_tasks/pocket")
    ev.add_argument("--limit", type=float, help="documents per task (an int, or a fraction < 1)")
    ev.add_argument("--num-fewshot", type=int)
    ev.add_argument("--batch-size", type=int, default=1)
    ev.add_argument("--device", help="default: cuda when available, else cpu")
    ev.add_argument("--dtype", default="auto")
    ev.add_argument("--revision", help="revision of the bridge repo on the Hub")
    ev.add_argument("--rolling-stride", type=int, help="chunk size of rolling log-likelihood (default 256)")
    ev.add_argument("--bootstrap-iters", type=int, default=100000, help="lm-eval's, for non-mean metrics")
    modes = _constants.EVAL_MODES
    ev.add_argument("--modes", default=",".join(modes), help=f"subset of {','.join(modes)}")
    ev.add_argument("--output", help="write the results (table rows and each mode's lm-eval results) as JSON")
    ev.add_argument("--write-card", action="store_true", help="put the table into the checkpoint's README.md")


def _add_push(sub) -> None:
    push = sub.add_parser("push", help="upload a saved bridge checkpoint to the Hub in one commit")
    push.add_argument("bridge", help="bridge checkpoint folder")
    push.add_argument("repo_id", help="org/name on the Hub")
    push.add_argument("--revision", help="branch to commit to")
    push.add_argument("--private", action="store_true", default=None, help="create the repo private")
    push.add_argument("--token", help="Hub token (default: the logged-in one)")
    push.add_argument("--commit-message")
    push.add_argument("--create-pr", action="store_true")


def _add_inspect(sub) -> None:
    inspect = sub.add_parser("inspect", help="diagnostics report of a saved bridge on held-out text (JSON + PNG)")
    inspect.add_argument("bridge", help="bridge checkpoint folder or Hub id")
    inspect.add_argument(
        "--data",
        required=True,
        type=_heldout_data,
        help=f"held-out text: a .txt/.jsonl file or folder, '{POCKET_DATA}' (the pocket family's held-out split), "
        "or a dataset",
    )
    inspect.add_argument("--num-sequences", type=_positive_int, default=16)
    inspect.add_argument("--seq-len", type=_positive_int, default=256)
    inspect.add_argument("--batch-size", type=_positive_int, default=4)
    inspect.add_argument("--out", default="kvbridge-inspect", help="folder for report.json and the plots")


def _add_bench(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks: mapper vs re-prefill, calibration at real shapes, vLLM")
    kinds = bench.add_subparsers(dest="bench", required=True, parser_class=_Parser)

    mapper = kinds.add_parser("mapper", help="mapper time vs the target's re-prefill, per context length")
    mapper.add_argument("bridge", nargs="?", help="bridge checkpoint (or use --shapes for random weights)")
    mapper.add_argument("--shapes", help="random-weight Qwen3 shapes, e.g. qwen3-0.6b:qwen3-4b")
    mapper.add_argument("--top-k", type=_positive_int, default=6, help="with --shapes")
    mapper.add_argument("--head-mode", choices=_constants.HEAD_MODES, default="all_heads", help="with --shapes")
    mapper.add_argument("--rank", type=_positive_int, help="with --shapes: a low-rank mapper of this rank")
    mapper.add_argument("--mapper-dtype", choices=BENCH_DTYPES, help="defaults to --dtype")
    mapper.add_argument(
        "--interleave", action="store_true", help="alternate source, mapper and target runs (in cascade order)"
    )
    mapper.add_argument(
        "--old-vs-new",
        action="store_true",
        help="time the old default mapping against the new one in alternating rounds (no prefills); JSON key "
        "old_vs_new",
    )
    mapper.add_argument(
        "--lengths",
        type=_lengths,
        help="context lengths in tokens (default "
        + ",".join(map(str, DEFAULT_BENCH_LENGTHS))
        + ", cut to the models' maximum positions)",
    )
    mapper.add_argument(
        "--schedule",
        choices=_constants.SCHEDULES,
        default=None,
        help="the mapping engine's schedule (default: by device, whole layers on CUDA, chunks on CPU)",
    )
    mapper.add_argument(
        "--end-to-end",
        action="store_true",
        help="also time to first token through bridge.generate_from_cache, warm and cold (JSON key ttft)",
    )
    mapper.add_argument(
        "--compile-hold-back",
        action="store_true",
        help="with --end-to-end: also a static cache with the hold-back through the target's compiled call",
    )
    mapper.add_argument("--batch", type=_positive_int, default=1)
    mapper.add_argument("--repeats", type=_positive_int, default=5)
    mapper.add_argument("--warmup", type=int, default=1)
    mapper.add_argument("--dtype", default="float32", choices=BENCH_DTYPES)
    mapper.add_argument("--device", default="cpu")
    mapper.add_argument("--threads", type=_positive_int, help="torch threads on CPU")
    mapper.add_argument("--json", help="write the rows as JSON here")

    cal = kinds.add_parser(
        "calibration",
        help="calibration at real layer shapes with random weights: tokens/s, statistics memory, peak RSS",
    )
    cal.add_argument("--pair", default="qwen3-0.6b:qwen3-1.7b", help="source:target Qwen3 shapes")
    cal.add_argument("--num-sequences", type=_positive_int, default=8)
    cal.add_argument("--seq-len", type=_positive_int, default=256)
    cal.add_argument("--batch-size", type=_positive_int, default=2)
    cal.add_argument("--heldout-fraction", type=float, default=0.125)
    cal.add_argument("--top-k", type=_positive_int, default=6)
    cal.add_argument("--head-mode", default="same_head", choices=_constants.HEAD_MODES)
    cal.add_argument("--kv-mode", default="joint", choices=_constants.KV_MODES)
    cal.add_argument("--statistics-memory", default="8GB")
    cal.add_argument("--statistics-dtype", default="float32", choices=_constants.STATISTICS_DTYPES)
    cal.add_argument("--statistics-device", default=None)
    cal.add_argument(
        "--float32-matmul-precision",
        default=None,
        choices=("highest", "high", "medium"),
        help="torch.set_float32_matmul_precision for the run: 'medium' lets float32 products (the statistics, and "
        "float32 models' forwards) run in bfloat16 with float32 accumulation on bfloat16 units",
    )
    cal.add_argument("--dtype", default="bfloat16")
    cal.add_argument("--device", default="cpu")
    cal.add_argument("--vocab", type=_positive_int, default=None, help="override the vocabulary size")
    cal.add_argument(
        "--layers",
        default=None,
        metavar="S:T",
        help="build only the first S source and T target layers (real layer shapes: a pair too large for this "
        "machine); the JSON's full_depth scales each stage to the whole pair",
    )
    cal.add_argument("--progress", action="store_true")
    cal.add_argument("--json", default=None, help="also write the result here")
    cal.add_argument("--memory-model", action="store_true", help="print the README's memory model table and exit")
    cal.add_argument(
        "--flop-model",
        action="store_true",
        help="print the FLOPs of each calibration stage and their time at rates probed on --device and on an H100 "
        "(datasheet peaks x assumed efficiencies), then exit; no models are built",
    )
    cal.add_argument(
        "--fit-passes",
        type=_positive_int,
        default=None,
        help="with --flop-model: this many fit passes instead of the plan within --statistics-memory",
    )

    vllm = kinds.add_parser(
        "vllm", help="time to first token and throughput in vLLM, with and without the bridge (needs vLLM)"
    )
    vllm.add_argument("--bridge", help="a bridge checkpoint (default: calibrate the pocket pair here)")
    vllm.add_argument(
        "--pair", default="pocket-s:pocket-l", help="pocket pair to calibrate when --bridge is not given"
    )
    vllm.add_argument("--shapes", help="random Qwen3-shaped models instead, e.g. qwen3-0.6b:qwen3-8b (GPU)")
    vllm.add_argument("--lengths", type=_lengths, default=[512, 1024, 2000], help="prompt lengths in tokens")
    vllm.add_argument(
        "--store",
        help="a KV store URL (or 'local': start a redis-server here) to time the warm path too: prompts whose "
        "source KV are in the store, mapped with no source prefill",
    )
    vllm.add_argument("--repeats", type=_positive_int, default=5, help="TTFT samples per length and mode")
    vllm.add_argument("--requests", type=_positive_int, default=8, help="requests per throughput batch")
    vllm.add_argument("--max-tokens", type=_positive_int, default=32, help="output tokens per throughput request")
    vllm.add_argument("--dtype", default="bfloat16")
    vllm.add_argument("--block-size", type=_positive_int, help="vLLM block size (CPU attention: multiple of 32)")
    vllm.add_argument("--kv-cache-gb", type=_positive_float, default=1.0)
    vllm.add_argument("--max-model-len", type=_positive_int, default=None)
    vllm.add_argument("--num-sequences", type=_positive_int, default=64)
    vllm.add_argument("--seq-len", type=_positive_int, default=512)
    vllm.add_argument("--top-k", type=_positive_int, default=6)
    vllm.add_argument("--json", help="write the results here")


def _add_tune(sub) -> None:
    tune = sub.add_parser(
        "tune",
        help="search top-k, λ, kv mode, mapper, rank, recompute share and recomputed layers from one calibration; "
        "save the choice",
    )
    tune.add_argument("source", help="source model (Hub id, local path, or pocket/<name>)")
    tune.add_argument("target", help="target model (Hub id, local path, or pocket/<name>)")
    tune.add_argument(
        "--min-retention",
        type=_positive_float,
        help="quality target: the cheapest configuration whose context-benefit retention on the tuning windows "
        "reaches it is chosen",
    )
    tune.add_argument(
        "--max-cost",
        type=_positive_float,
        help="cost budget, FLOPs per context token (maps + recomputed tokens and layers) as a share of the target's "
        "own prefill; alone: the best retention within it; with --min-retention: the cheapest meeting the target "
        "within it",
    )
    tune.add_argument("--out", required=True, help="output folder for the chosen bridge checkpoint")
    tune.add_argument("--overwrite", action="store_true", help="replace bridge files in a non-empty --out")
    tune.add_argument("--json", default="kvbridge-tune.json", help="where to write every measured point")
    tune.add_argument(
        "--data",
        type=_calibration_data,
        default=_constants.DEFAULT_CALIBRATION_DATA,
        help=f"calibration data, as for kvbridge calibrate ('{POCKET_DATA}': the pocket family's calibration split)",
    )
    tune.add_argument(
        "--eval-data",
        type=_heldout_data,
        required=True,
        help=f"held-out text for the tuning and check windows (other documents each); '{POCKET_DATA}': the pocket "
        "family's held-out split",
    )
    grid = tune.add_argument_group("grid (comma-separated values)")
    grid.add_argument("--top-k", type=_comma_list(_tune_top_k, "top-k values"), default=[2, 4])
    grid.add_argument(
        "--ridge-lambdas", type=_comma_list(_ridge_lambda, "λ values ('auto' or ≥ 0)"), default=["auto", 1e-3, 1e-1]
    )
    grid.add_argument("--kv-modes", type=_comma_list(_kv_mode, "kv modes"), default=list(_constants.KV_MODES))
    grid.add_argument(
        "--ranks",
        type=_comma_list(_positive_int, "ranks", allow_empty=True),
        default=[16, 32],
        help="ranks of the low-rank mapper ('none': ridge only)",
    )
    grid.add_argument("--recompute-fractions", type=_comma_list(_share, "shares in [0, 1]"), default=[0.0, 0.05, 0.1])
    grid.add_argument(
        "--recompute-layers",
        type=_comma_list(_layer_count, "layer counts"),
        default=[0, 1, 2],
        help="top target layers the target recomputes over the whole context (layer recompute; their residual maps "
        "are fitted in the calibration pass); 0: the plain bridge",
    )
    grid.add_argument(
        "--mlp-hidden",
        type=_comma_list(_positive_int, "hidden widths", allow_empty=True),
        default=[256],
        help="hidden widths of MLP mappers, trained from each top-k's ridge fit at the first λ and kv mode ('none': "
        "no MLP)",
    )
    grid.add_argument("--mlp-loss", choices=("attention", "mse"), default="attention", help="the MLPs' training loss")
    grid.add_argument(
        "--mlp-epochs", type=_positive_int, default=2, help="the MLPs' passes over the calibration windows"
    )
    grid.add_argument(
        "--hidden-states",
        type=_comma_list(_yes_no, "yes/no values"),
        default=[False, True],
        help="no: maps of the source's K/V only; yes: ridge and low-rank joint maps that also read the source's "
        "hidden states (--hidden-state-layers, collected in the same calibration pass) (default: no,yes)",
    )
    settings = tune.add_argument_group("calibration settings (tune's defaults)")
    add_settings_options(settings, TUNE_SETTINGS)
    tune.add_argument("--tune-windows", type=_positive_int, default=16)
    tune.add_argument("--check-windows", type=_positive_int, default=16)
    tune.add_argument("--context", type=_positive_int, default=192, help="context tokens of each window")
    tune.add_argument("--continuation", type=_positive_int, default=32, help="scored tokens after the context")
    tune.add_argument("--dtype", help="model dtype, e.g. bfloat16")


def _add_serve(sub) -> None:
    serve = sub.add_parser(
        "serve",
        help="serve the bridge's target with vLLM's OpenAI-compatible server and the KV bridge connector",
        description="kvbridge serve DIR [--role target|source|both] [--store URL] [--no-source-weights] "
        "[--requests opt_in|all] [--print] [vllm serve args...]: every argument after DIR goes to "
        "hf_kvbridge.integrations.vllm.serve_main (see docs/serving.md).",
    )
    serve.add_argument("bridge", help="bridge checkpoint folder or Hub id")
    serve.add_argument(
        "vllm_args", nargs=argparse.REMAINDER, help="--role, --store, --requests, --print, and vllm serve options"
    )


def _add_demo(sub) -> None:
    demo = sub.add_parser(
        "demo",
        help="calibrate and measure a bridge of the shipped pocket family (offline)",
        description="Calibrates a pocket bridge and measures it (retention, cloze, speed); 128 × 512-token "
        "calibration windows by default, 24 × 256 with --quick.",
    )
    demo.add_argument("--out", default="kvbridge-demo", help="parent folder; each run writes a new folder in it")
    demo.add_argument("--quick", action="store_true", help="smaller calibration and evaluation (for tests)")
    demo.add_argument("--source", default="pocket-s", choices=DEMO_MODELS, help="pocket model that prefills")
    demo.add_argument("--target", default="pocket-l", choices=DEMO_MODELS, help="pocket model that decodes")
    settings = demo.add_argument_group("calibration settings (the demo's defaults)")
    add_settings_options(settings, DEMO_SETTINGS, DEMO_SIZES_HELP)
    demo.add_argument(
        "--threads", type=_positive_int, help="torch threads (default: the physical cores, fewer when others are busy)"
    )


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


def _add_store(sub) -> None:
    store = sub.add_parser(
        "store",
        help="the KV store of warm-path serving (Redis/Valkey): run a local server, show what it holds",
    )
    actions = store.add_subparsers(dest="store", required=True, parser_class=_Parser)
    serve = actions.add_parser(
        "serve",
        help="run a local redis-server/valkey-server on 127.0.0.1 in the foreground until Ctrl-C; prints its URL",
        description="Starts redis-server (or valkey-server) on 127.0.0.1 with no persistence and maxmemory + "
        "allkeys-lru eviction, prints its URL, and runs until Ctrl-C.",
    )
    serve.add_argument("--port", type=_port, help="TCP port on 127.0.0.1 (default: a free one)")
    serve.add_argument(
        "--maxmemory", type=_memory_size, default="4gb", help="memory limit; past it the least recently used chunks "
        "are evicted (default 4gb)"
    )  # fmt: skip
    serve.add_argument("--password", help="require this password (it appears in the printed URL)")
    serve.add_argument("--binary", help="the server program (default: redis-server, else valkey-server, on PATH)")
    stats = actions.add_parser(
        "stats", help="what a store holds of hf_kvbridge chunks: keys and memory, per model, as JSON"
    )
    stats.add_argument("url", help="the store, e.g. redis://127.0.0.1:6379/0 (rediss:// for TLS, valkey://)")
    stats.add_argument("--socket-timeout", type=_positive_float, default=5.0, help="seconds (default 5)")


COMMANDS = ("calibrate", "generate", "chat", "eval", "push", "inspect", "bench", "tune", "serve", "demo", "store")
NESTED = ("bench", "store")  # commands whose subcommands take the options


def build_parser() -> argparse.ArgumentParser:
    """The `kvbridge` parser: every subcommand, with `-v`/`--debug` before or after the command."""
    parser = _Parser(prog="kvbridge", description="Cross-model KV cache transfer within an LLM family")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_calibrate(sub)
    _add_generate_and_chat(sub)
    _add_eval(sub)
    _add_push(sub)
    _add_inspect(sub)
    _add_bench(sub)
    _add_tune(sub)
    _add_serve(sub)
    _add_demo(sub)
    _add_store(sub)
    for name, subparser in sub.choices.items():  # `--debug` after the command, too
        if name not in NESTED:
            subparser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    for name in NESTED:
        for subparser in sub.choices[name]._subparsers._group_actions[0].choices.values():
            subparser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    return parser
