"""Head-local maps against all-heads on the pocket family (issue #47, item 2): same-head fitted with the target's
attention mass as token weights (`mapper_type="ridge_attention_weighted"`, `head_mode="same_head"`; each target
head read from its own source head), optionally distilled, against the all-heads ridge map, paired on the same
held-out windows: the mean paired difference of context-benefit retention with its paired bootstrap 95% interval,
and each map's parameter count.

    python -m studies.head_local_study --pairs pocket-s:pocket-l,pocket-l:pocket-s --out head_local.json

Defaults are `kvbridge demo`'s measurement (calibration 128 × 512 tokens of the calibration split, top-k 6, λ auto,
seed 0; 64 windows of 384 + 128 tokens of the held-out split); `--windows` asks for more (the held-out split holds
303 windows of 512 tokens) to narrow the interval. `--distill-epochs N` also distills the weighted same-head map
and the all-heads map alike (`hf_kvbridge.distill`, pull 0) on the calibration split, and pairs the
distilled same-head map with the distilled all-heads map too.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

import hf_kvbridge
from hf_kvbridge import pocket
from hf_kvbridge.tools.defaults import DEMO_SETTINGS, DEMO_SIZES
from hf_kvbridge.tools.evaluation import heldout_windows, window_nll
from hf_kvbridge.tools.fidelity import paired_bootstrap, retention_of

MAPS = {  # name: calibrate keywords
    "all_heads": {"head_mode": "all_heads"},
    "same_head": {"head_mode": "same_head"},
    "same_head_weighted": {"head_mode": "same_head", "mapper_type": "ridge_attention_weighted"},
}


def parameters(bridge) -> int:
    return sum(p.numel() for p in bridge.mapper.parameters())


def pair_setup(source: str, target: str, args):
    """`(tokenizer, (source, target) models, calibration texts, calibrate keywords)`: the demo's calibration."""
    tokenizer = AutoTokenizer.from_pretrained(pocket.model_path(target))
    models = pocket.load_model(source), pocket.load_model(target)
    settings = {"num_sequences": args.num_sequences, "seq_len": args.seq_len, "top_k": DEMO_SETTINGS["top_k"],
                "ridge_lambda": DEMO_SETTINGS["ridge_lambda"], "seed": DEMO_SETTINGS["seed"]}  # fmt: skip
    return tokenizer, models, pocket.load_texts("calibration"), settings


def measurement_arguments(parser: argparse.ArgumentParser, out: str) -> None:
    """`--pairs`, the calibration and held-out window sizes (the demo's by default), `--threads` and `--out`."""
    parser.add_argument("--pairs", default="pocket-s:pocket-l,pocket-l:pocket-s")
    parser.add_argument("--out", default=out)
    parser.add_argument("--num-sequences", type=int, default=DEMO_SIZES["num_sequences"][0])
    parser.add_argument("--seq-len", type=int, default=DEMO_SIZES["seq_len"][0])
    parser.add_argument("--windows", type=int, default=DEMO_SIZES["nll_windows"][0])
    parser.add_argument("--context", type=int, default=DEMO_SIZES["nll_context"][0])
    parser.add_argument("--continuation", type=int, default=DEMO_SIZES["nll_continuation"][0])
    parser.add_argument("--threads", type=int, default=None)


def measure_pair(source: str, target: str, args) -> dict:
    tokenizer, models, texts, settings = pair_setup(source, target, args)
    bridges, seconds = {}, {}
    for name, kwargs in MAPS.items():
        started = time.perf_counter()
        bridges[name] = hf_kvbridge.calibrate(*models, texts, tokenizer=tokenizer, **settings, **kwargs)
        seconds[name] = round(time.perf_counter() - started, 1)
        print(f"  {source} → {target} {name}: calibrated in {seconds[name]} s", flush=True)
    for name in ("all_heads", "same_head_weighted") if args.distill_epochs else ():
        started = time.perf_counter()  # each map distilled alike, so distilled can be paired with distilled
        bridges[f"{name}_distilled"] = hf_kvbridge.distill(
            bridges[name],
            texts,
            tokenizer=tokenizer,
            num_sequences=304,
            epochs=args.distill_epochs,
            pull=[0.0],
            lr=args.distill_lr,
            nll_weight=args.nll_weight,
            select_by=args.select_by,
            batch_size=args.distill_batch_size,
        )
        seconds[f"{name}_distilled"] = round(time.perf_counter() - started, 1)
        print(f"  {source} → {target} {name}: distilled in {seconds[f'{name}_distilled']} s", flush=True)
    windows = heldout_windows(pocket.load_texts("heldout"), tokenizer, args.context + args.continuation, args.windows)
    first = bridges["all_heads"]
    nll = {mode: window_nll(first, windows, args.context, mode) for mode in ("target", "no_context")}
    for name, bridge in bridges.items():
        nll[name] = window_nll(bridge, windows, args.context, "bridge")
    results = {name: paired_bootstrap(nll, retention_of(name)) for name in bridges}
    versus = {
        name: paired_bootstrap(nll, lambda s, n=name: retention_of(n)(s) - retention_of("all_heads")(s))
        for name in bridges
        if name != "all_heads"
    }
    if "all_heads_distilled" in bridges:  # the head-local map distilled against the all-heads map distilled
        versus["same_head_weighted_distilled vs all_heads_distilled"] = paired_bootstrap(
            nll, lambda s: retention_of("same_head_weighted_distilled")(s) - retention_of("all_heads_distilled")(s)
        )
    return {
        "pair": f"{source} → {target}",
        "windows": int(len(windows)),
        "context": args.context,
        "continuation": args.continuation,
        "retention": results,
        "difference_vs_all_heads": versus,
        "parameters": {name: parameters(bridge) for name, bridge in bridges.items()},
        "seconds": seconds,
        "per_window_nll": {mode: values.tolist() for mode, values in nll.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    measurement_arguments(parser, out="head_local.json")
    parser.add_argument("--distill-epochs", type=int, default=0)
    parser.add_argument("--distill-lr", type=float, default=1e-4, help="DistillationSettings.lr")
    parser.add_argument("--distill-batch-size", type=int, default=8, help="DistillationSettings.batch_size")
    parser.add_argument("--nll-weight", type=float, default=0.0, help="DistillationSettings.nll_weight")
    parser.add_argument("--select-by", default="kl", help="DistillationSettings.select_by (kl or nll)")
    args = parser.parse_args()
    run_pairs(args, measure_pair, _lines)


def _lines(r: dict):
    for name, diff in r["difference_vs_all_heads"].items():
        name, _, base = name.partition(" vs ")
        base = base or "all_heads"
        yield (
            f"{r['pair']}: {base} {r['retention'][base]['value']:.3f}, {name} "
            f"{r['retention'][name]['value']:.3f}, difference {diff['value']:+.3f} [{diff['low']:+.3f}, "
            f"{diff['high']:+.3f}] on {r['windows']} windows; parameters {r['parameters'][name]:,} vs "
            f"{r['parameters'][base]:,}"
        )


def run_pairs(args, measure, lines) -> None:
    """`measure(source, target, args)` for each of `args.pairs`, printing `lines(result)` and writing every result so
    far to `args.out` after each pair (with `args.threads` torch threads)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    results = []
    for pair in args.pairs.split(","):
        results.append(measure(*pair.split(":"), args))
        for line in lines(results[-1]):
            print(line, flush=True)
        Path(args.out).write_text(json.dumps({"settings": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
