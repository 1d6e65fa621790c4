"""The `kvbridge` command: `calibrate`, `generate`, `demo`."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence


def _top_k(value: str) -> int | None:
    return None if value == "all" else int(value)


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from pathlib import Path

    import hf_kvbridge

    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.overwrite:  # refuse before hours of calibration, not after
        print(f"error: {out} is not empty; pass --overwrite to replace the bridge files in it", file=sys.stderr)
        return 2
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
        batch_size=args.batch_size,
        heldout_fraction=args.heldout_fraction,
        seed=args.seed,
        source_revision=args.source_revision,
        target_revision=args.target_revision,
        text_field=args.text_field,
        progress=True,
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
    from hf_kvbridge.modeling import resolve_model_reference

    bridge = KVBridgeForCausalLM.from_pretrained(args.bridge)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_reference(bridge.config.target_name_or_path))
    inputs = tokenizer(args.prompt, return_tensors="pt")
    torch.manual_seed(args.seed)
    output = bridge.generate(
        **inputs,
        max_new_tokens=args.max_new_tokens,
        do_sample=args.do_sample,
        pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
    )
    print(tokenizer.decode(output[0], skip_special_tokens=True))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from hf_kvbridge.demo import run_demo

    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvbridge", description="Cross-model KV cache transfer within an LLM family")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    cal = sub.add_parser("calibrate", help="calibrate a source→target mapper and save it")
    cal.add_argument("source", help="source model (Hub id, local path, or pocket/<name>)")
    cal.add_argument("target", help="target model (Hub id, local path, or pocket/<name>)")
    cal.add_argument(
        "--data",
        default="HuggingFaceFW/fineweb-edu",
        help="a .txt/.jsonl file or folder, or a dataset name (streamed)",
    )
    cal.add_argument("--out", required=True, help="output folder for the bridge checkpoint")
    cal.add_argument("--top-k", type=_top_k, default=6, help="source layers per target layer, or 'all'")
    cal.add_argument("--ridge-lambda", type=float, default=0.01, help="relative to each input feature's variance")
    cal.add_argument("--num-sequences", type=int, default=500)
    cal.add_argument("--seq-len", type=int, default=1024)
    cal.add_argument("--head-mode", choices=["all_heads", "same_head"], default="all_heads")
    cal.add_argument("--batch-size", type=int, default=8)
    cal.add_argument("--heldout-fraction", type=float, default=0.1)
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
    gen.add_argument("--max-new-tokens", type=int, default=40)
    gen.add_argument("--do-sample", action="store_true")
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(func=_cmd_generate)

    demo = sub.add_parser("demo", help="calibrate and measure a bridge of the shipped pocket family (offline)")
    demo.add_argument("--out", default="kvbridge-demo", help="parent folder; each run writes a new folder in it")
    demo.add_argument("--quick", action="store_true", help="smaller calibration and evaluation (for tests)")
    from hf_kvbridge.demo import add_arguments

    add_arguments(demo)
    demo.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
