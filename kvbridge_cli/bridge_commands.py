"""The subcommands that make, run and share a bridge: `calibrate`, `generate`, `chat`, `push`, `serve`, `store`."""

from __future__ import annotations

import argparse

from ._light import core
from .arguments import (
    POCKET_DATA,
    _calibration_data,
    _memory_size,
    _Parser,
    _port,
    _positive_float,
    _positive_int,
    add_model_loading,
)
from .settings_options import add_mapper_options, add_settings_options, library_only_fields

_constants = core("constants")
_settings = core("settings")


def add_data_and_out(parser, out_what: str) -> None:
    """`--data` (calibration text), `--out` and `--overwrite`: the options of the commands that write a bridge from
    calibration text (`calibrate`, `distill`)."""
    parser.add_argument(
        "--data",
        type=_calibration_data,
        default=_constants.DEFAULT_CALIBRATION_DATA,
        help=f"a .txt/.jsonl file or folder, '{POCKET_DATA}' (the pocket family's shipped calibration split), or a "
        f"dataset name (streamed; default {_constants.DEFAULT_CALIBRATION_DATA}, needs the Hub)",
    )
    parser.add_argument("--out", required=True, help=f"output folder for {out_what}")
    parser.add_argument("--overwrite", action="store_true", help="replace bridge files in a non-empty --out")


def add_calibrate(sub) -> None:
    cal = sub.add_parser(
        "calibrate",
        help="calibrate a source→target mapper and save it",
        epilog="library-only settings (no option): "
        + ", ".join(library_only_fields())
        + "; mapper_kwargs are the mapper options above, and progress bars are always on",
    )
    cal.add_argument("source", help="source model (Hub id, local path, or pocket/<name>)")
    cal.add_argument("target", help="target model (Hub id, local path, or pocket/<name>)")
    add_data_and_out(cal, "the bridge checkpoint")
    settings = cal.add_argument_group("calibration settings (hf_kvbridge.CalibrationSettings)")
    add_settings_options(settings)
    add_mapper_options(cal)
    models = cal.add_argument_group("models")
    models.add_argument("--source-revision")
    models.add_argument("--target-revision")
    add_model_loading(models)


def add_distill(sub) -> None:
    distill = sub.add_parser(
        "distill",
        help="train a calibrated bridge's map on the target's next-token KL and save it",
        description="Starts from the bridge's closed-form map and trains it on KL(target on its own cache || target "
        "on the mapped cache) over continuation windows of --data (calibration text, never evaluation text); "
        "held-out windows of it choose the stopping point and the pull towards the closed form. Resumable: the "
        "training state is checkpointed in OUT/distill-checkpoint (or --checkpoint-dir) and a rerun resumes it.",
    )
    distill.add_argument("bridge", help="calibrated bridge checkpoint folder or Hub id")
    add_data_and_out(distill, "the distilled bridge checkpoint")
    settings = distill.add_argument_group("distillation settings (hf_kvbridge.settings.DistillationSettings)")
    add_settings_options(settings, settings_class=_settings.DistillationSettings)
    add_model_loading(distill.add_argument_group("models (the bridge's source and target)"))


def add_generate_and_chat(sub) -> None:
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


def add_push(sub) -> None:
    push = sub.add_parser("push", help="upload a saved bridge checkpoint to the Hub in one commit")
    push.add_argument("bridge", help="bridge checkpoint folder")
    push.add_argument("repo_id", help="org/name on the Hub")
    push.add_argument("--revision", help="branch to commit to")
    push.add_argument("--private", action="store_true", default=None, help="create the repo private")
    push.add_argument("--token", help="Hub token (default: the logged-in one)")
    push.add_argument("--commit-message")
    push.add_argument("--create-pr", action="store_true")


def add_serve(sub) -> None:
    serve = sub.add_parser(
        "serve",
        help="serve the bridge's target with vLLM's OpenAI-compatible server and the KV bridge connector",
        description="kvbridge serve DIR [--bridge-revision REV] [--role target|source|both] [--store URL] "
        "[--no-source-weights] [--requests opt_in|all] [--lora-bridge NAME=BRIDGE[@REVISION] ...] [--print] "
        "[vllm serve args...]: every argument after "
        "DIR goes to "
        "hf_kvbridge.integrations.vllm.serve_main (see docs/serving.md).",
    )
    serve.add_argument("bridge", help="bridge checkpoint folder or Hub id")
    serve.add_argument(
        "vllm_args",
        nargs=argparse.REMAINDER,
        help="--bridge-revision, --role, --store, --requests, --lora-bridge, --print, and vllm serve options",
    )


def add_store(sub) -> None:
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
