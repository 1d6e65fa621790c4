"""`kvbridge demo`: calibrate a bridge of the shipped pocket family and measure it, offline, on held-out text.

Prints and writes (JSON + PNG) into a new folder: calibration time; held-out R² of K and V against the number of
source layers; attention-output cosine per target layer; continuation NLL of target / source / bridge / no context
and the context-benefit retention; cloze accuracy and retention; mapper time against the target's re-prefill; a
greedy generation of target and bridge side by side.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from .. import pocket
from ..attention import attention_output_cosine
from ..calibration import calibrate
from ..selection import mapper_r2, select_layers
from .bench import mapper_vs_prefill
from .diagnostics import plot_layer_bars, plot_r2_heatmap, plot_r2_vs_k
from .evaluation import build_cloze, cloze_accuracy, continuation_nll, heldout_windows

# (full, quick) sizes; quick is for tests and smoke runs
SIZES = {
    "num_sequences": (128, 24),
    "seq_len": (512, 256),
    "nll_windows": (64, 12),
    "nll_context": (384, 128),
    "nll_continuation": (128, 32),
    "cloze_items": (120, 16),
    "cloze_context": (256, 96),
    "cloze_continuation": (24, 16),
    "timing_context": (1024, 256),
    "timing_repeats": (5, 2),
    "cosine_windows": (8, 4),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--source", default="pocket-s", choices=pocket.POCKET_MODELS, help="pocket model that prefills"
    )
    parser.add_argument("--target", default="pocket-l", choices=pocket.POCKET_MODELS, help="pocket model that decodes")
    parser.add_argument("--top-k", type=lambda v: None if v == "all" else int(v), default=6)
    parser.add_argument("--ridge-lambda", type=float, default=0.01)
    parser.add_argument("--head-mode", choices=["all_heads", "same_head"], default="all_heads")
    parser.add_argument("--num-sequences", type=int, help="calibration windows (default 128; 24 with --quick)")
    parser.add_argument("--seq-len", type=int, help="calibration window length (default 512; 256 with --quick)")
    parser.add_argument("--seed", type=int, default=0)


def _fmt_row(cells, widths) -> str:
    return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths))


def measure(args: argparse.Namespace) -> dict:
    """Runs every measurement of the demo and returns the results (also used by the tests)."""
    size = {key: value[1] if args.quick else value[0] for key, value in SIZES.items()}
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(pocket.model_path(args.target))
    source, target = pocket.load_model(args.source), pocket.load_model(args.target)
    num_sequences = args.num_sequences or size["num_sequences"]
    seq_len = args.seq_len or size["seq_len"]

    started = time.perf_counter()
    bridge = calibrate(
        source,
        target,
        pocket.load_texts("calibration"),
        tokenizer=tokenizer,
        num_sequences=num_sequences,
        seq_len=seq_len,
        top_k=args.top_k,
        ridge_lambda=args.ridge_lambda,
        head_mode=args.head_mode,
        seed=args.seed,
        progress=not args.quick,
        keep_statistics=True,  # the top-k sweep below re-fits from them
    )
    calibration_s = time.perf_counter() - started
    train, heldout = bridge.calibration_statistics
    num_source = bridge.source_layout.num_layers

    r2_by_k = {}
    for k in (1, 2, 4, 6, None):
        if k is not None and k >= num_source:
            continue
        fitted = mapper_r2(train, heldout, select_layers(bridge.layer_r2, k), args.head_mode, args.ridge_lambda)
        r2_by_k["all" if k is None else str(k)] = {"k": float(fitted[:, 0].mean()), "v": float(fitted[:, 1].mean())}

    heldout_texts = pocket.load_texts("heldout")
    nll_windows = heldout_windows(
        heldout_texts, tokenizer, size["nll_context"] + size["nll_continuation"], size["nll_windows"]
    )
    cosine = attention_output_cosine(bridge, nll_windows[: size["cosine_windows"]])
    nll = continuation_nll(bridge, nll_windows, size["nll_context"])
    cloze_windows = heldout_windows(
        heldout_texts, tokenizer, size["cloze_context"] + size["cloze_continuation"], size["cloze_items"]
    )
    cloze = cloze_accuracy(bridge, build_cloze(cloze_windows, size["cloze_context"], seed=args.seed))
    timing_ids = heldout_windows(heldout_texts, tokenizer, size["timing_context"], 1)
    timing = mapper_vs_prefill(bridge, timing_ids, repeats=size["timing_repeats"])

    prompt = heldout_windows(heldout_texts, tokenizer, 48, 1)
    gen_kw = {"max_new_tokens": 32, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}
    target_tokens = target.generate(prompt, attention_mask=torch.ones_like(prompt), **gen_kw)[0, 48:]
    bridge_tokens = bridge.generate(prompt, **gen_kw)[0, 48:]
    generation = {
        "prompt": tokenizer.decode(prompt[0]),
        "target": tokenizer.decode(target_tokens),
        "bridge": tokenizer.decode(bridge_tokens),
        "same_tokens": int((target_tokens == bridge_tokens).sum()),
        "new_tokens": int(target_tokens.numel()),
    }
    return {
        "pair": {"source": args.source, "target": args.target},
        "settings": {
            "top_k": args.top_k,
            "ridge_lambda": args.ridge_lambda,
            "head_mode": args.head_mode,
            "num_sequences": num_sequences,
            "seq_len": seq_len,
            "seed": args.seed,
            "quick": args.quick,
        },
        "calibration_seconds": calibration_s,
        "selected_layers": bridge.config.selected_layers,
        "single_layer_r2": bridge.layer_r2.mean(-1).tolist(),
        "r2_by_k": r2_by_k,
        "attention_output_cosine": cosine.tolist(),
        "continuation": nll,
        "cloze": cloze,
        "timing": timing,
        "generation": generation,
        "torch_threads": torch.get_num_threads(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "_bridge": bridge,
    }


def report(results: dict) -> str:
    """The human-readable summary the demo prints."""
    pair = results["pair"]
    lines = [f"== bridge {pair['source']} → {pair['target']} (pocket family, held-out split) ==", ""]
    lines.append(
        f"calibration: {results['calibration_seconds']:.1f}s "
        f"({results['settings']['num_sequences']} × {results['settings']['seq_len']} tokens)"
    )
    lines += ["", "held-out R² of the mapper vs source layers per target layer (mean over target layers):"]
    widths = (8, 8, 8)
    lines.append(_fmt_row(("top-k", "R² K", "R² V"), widths))
    for k, r2 in results["r2_by_k"].items():
        lines.append(_fmt_row((k, f"{r2['k']:.4f}", f"{r2['v']:.4f}"), widths))
    cos = results["attention_output_cosine"]
    lines += [
        "",
        "attention-output cosine per target layer: "
        + " ".join(f"{c:.3f}" for c in cos)
        + f"  (mean {sum(cos) / len(cos):.3f})",
    ]
    cont = results["continuation"]
    lines += [
        "",
        f"continuation NLL on held-out text ({cont['windows']} windows, context {cont['context_len']} "
        f"tokens, {cont['tokens_scored']} tokens scored):",
    ]
    widths = (12, 10, 10)
    lines.append(_fmt_row(("mode", "NLL", "ppl"), widths))
    for mode, value in cont["nll"].items():
        lines.append(_fmt_row((mode, f"{value:.4f}", f"{cont['perplexity'][mode]:.2f}"), widths))
    lines.append(f"context-benefit retention: {cont['context_benefit_retention']:.3f}")
    cloze = results["cloze"]
    lines += [
        "",
        f"cloze ({cloze['items']} items, {round(1 / cloze['chance'])} choices, chance {cloze['chance']:.2f}):",
    ]
    lines.append("  ".join(f"{mode} {acc:.3f}" for mode, acc in cloze["accuracy"].items()))
    lines.append(
        f"retention {cloze['retention']:.3f}   chance-normalised retention {cloze['chance_normalised_retention']:.3f}"
    )
    timing = results["timing"]
    lines += [
        "",
        f"latency at {timing['context_tokens']} context tokens (median of {timing['repeats']}): target "
        f"re-prefill {timing['target_prefill_s'] * 1e3:.1f} ms, mapper {timing['mapper_s'] * 1e3:.1f} ms, "
        f"source prefill {timing['source_prefill_s'] * 1e3:.1f} ms → warm speedup "
        f"{timing['warm_speedup']:.2f}×, cold {timing['cold_speedup']:.2f}×",
    ]
    gen = results["generation"]
    lines += [
        "",
        "greedy generation (32 tokens) after a held-out prompt:",
        f"  prompt: {gen['prompt']!r}",
        f"  target: {gen['target']!r}",
        f"  bridge: {gen['bridge']!r}",
        f"  same token at {gen['same_tokens']}/{gen['new_tokens']} positions",
    ]
    return "\n".join(lines)


def write_outputs(results: dict, out: Path) -> None:
    """JSON and the three plots."""
    out.mkdir(parents=True, exist_ok=False)
    public = {k: v for k, v in results.items() if not k.startswith("_")}
    (out / "results.json").write_text(json.dumps(public, indent=2, sort_keys=True))
    pair = f"{results['pair']['source']} → {results['pair']['target']}"
    plot_r2_vs_k(results["r2_by_k"], out / "r2_vs_k.png")
    plot_layer_bars(
        results["attention_output_cosine"],
        out / "attention_cosine.png",
        "attention-output cosine",
        f"mapped vs true KV, {pair}",
    )
    plot_r2_heatmap(results["_bridge"].layer_r2, out / "r2_heatmap.png", f"held-out single-layer R², {pair}")


def run_demo(args: argparse.Namespace) -> int:
    if args.source == args.target:
        print("error: --source and --target must differ")
        return 2
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) / f"{args.source}-to-{args.target}-{stamp}"  # a new folder: earlier runs are kept
    results = measure(args)
    print(report(results))
    write_outputs(results, out)
    print(f"\nwrote {out}/results.json, r2_vs_k.png, attention_cosine.png, r2_heatmap.png")
    return 0
