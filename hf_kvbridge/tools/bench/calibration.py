"""Calibration at real layer shapes with random weights: tokens/s, statistics memory, peak RSS, and the overhead over
the two models' forward passes.

    kvbridge bench calibration --pair qwen3-0.6b:qwen3-1.7b --statistics-memory 8GB

Random weights give meaningless maps but real shapes, so the memory plan, the statistics' cost and the passes over the
data are those of the real pair. Timing figures need a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from ...budget import check_budget, fit_bytes, format_bytes, parse_bytes, plan_passes, selection_bytes
from ...calibration import fit_bridge_in_passes, split_heldout
from ...statistics import feature_groups

# layer shapes of real checkpoints (hidden, layers, attention heads, KV heads, head dim, MLP width, vocabulary, tied)
SHAPES = {
    "qwen3-0.6b": (1024, 28, 16, 8, 128, 3072, 151936, True),
    "qwen3-1.7b": (2048, 28, 16, 8, 128, 6144, 151936, True),
    "qwen3-4b": (2560, 36, 32, 8, 128, 9728, 151936, True),
    "qwen3-8b": (4096, 36, 32, 8, 128, 12288, 151936, False),
    "qwen3-14b": (5120, 40, 40, 8, 128, 17408, 151936, False),
    "qwen3-32b": (5120, 64, 64, 8, 128, 25600, 151936, False),
}
# (layers, KV heads, head dim) of the pairs in the README's memory model
LAYOUTS = {
    "Qwen3-0.6B → 1.7B": ((28, 8, 128), (28, 8, 128)),
    "Qwen3-4B → 8B": ((36, 8, 128), (36, 8, 128)),
    "Qwen3-14B → 32B": ((40, 8, 128), (64, 8, 128)),
    "Llama-3.1-8B → 70B": ((32, 8, 128), (80, 8, 128)),
}


def memory_table(budget: int = 16 * 10**9, ranks: int = 8, dtype=torch.float32) -> str:
    """The README's memory model: selection and fit statistics, passes and mapper parameters per pair, k and mode.

    A fit pass of `T` target layers is counted without sharing of source layers between them (`U = min(T·k, L_s)`):
    sharing only lowers it. "passes" counts the selection pass.
    """
    lines = [
        "| pair | k | head / kv mode | selection | fit pass, 1 target layer | 1 pass, all target layers "
        "| passes at 16 GB: 1 device / 8 ranks | mapper parameters |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for pair, ((ls, heads, dim), (lt, _, _)) in LAYOUTS.items():
        row = heads * 2 * dim
        for k in (6, 8):
            for head_mode, kv_mode in (("all_heads", "joint"), ("all_heads", "separate"), ("same_head", "separate")):
                groups = len(feature_groups(heads, dim, head_mode, kv_mode))
                one = fit_bytes(k, 1, row, dtype, groups, k, k)
                every = fit_bytes(ls, lt, row, dtype, groups, k, k)  # each target's own k cross blocks
                per_pass = max(
                    [t for t in range(1, lt + 1) if fit_bytes(min(t * k, ls), t, row, dtype, groups, k, k) <= budget],
                    default=0,
                )
                passes = "–" if per_pass == 0 else f"{1 + -(-lt // per_pass)} / {1 + -(-lt // (ranks * per_pass))}"
                params = lt * (k * row // groups) * (row // groups) * groups + lt * row  # weights + biases
                selection = format_bytes(selection_bytes(ls, lt, heads, dim, dtype))
                lines.append(
                    f"| {pair} | {k} | {head_mode} / {kv_mode} | {selection} | {format_bytes(one)} "
                    f"| {format_bytes(every)} | {passes} | {params / 1e6:,.0f} M |"
                )
    return "\n".join(lines)


def random_model(name: str, dtype: torch.dtype, device: str = "cpu", vocab: int | None = None) -> Qwen3ForCausalLM:
    """A Qwen3 with the layer shapes of `name` (a key of `SHAPES`) and random weights, built directly in `dtype`."""
    hidden, layers, heads, kv_heads, head_dim, mlp, vocab_size, tied = SHAPES[name]
    config = Qwen3Config(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=mlp,
        vocab_size=vocab or vocab_size,
        tie_word_embeddings=tied,
        max_position_embeddings=4096,
    )
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # no float32 copy of the weights on the way
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    model.config.name_or_path = name
    return model


def run(args: argparse.Namespace) -> dict:
    source_name, target_name = args.pair.split(":")
    dtype = getattr(torch, args.dtype)
    statistics_dtype = getattr(torch, args.statistics_dtype)
    budget = parse_bytes(args.statistics_memory)
    started = time.perf_counter()
    source = random_model(source_name, dtype, args.device, args.vocab)
    target = random_model(target_name, dtype, args.device, args.vocab)
    build_s = time.perf_counter() - started
    ls, lt = source.config.num_hidden_layers, target.config.num_hidden_layers
    heads, dim = source.config.num_key_value_heads, source.config.head_dim
    row = heads * 2 * dim
    modes = (args.head_mode, args.kv_mode)
    mode = check_budget(budget, ls, lt, heads, dim, args.top_k, statistics_dtype, *modes)  # refuses before any work
    groups = len(feature_groups(heads, dim, *modes))  # the shapes here are matched pairs
    windows = torch.randint(0, source.config.vocab_size, (args.num_sequences, args.seq_len),
                            generator=torch.Generator().manual_seed(0))  # fmt: skip
    _, heldout = split_heldout(len(windows), args.heldout_fraction, 0)
    timings: dict = {}
    started = time.perf_counter()
    with torch.no_grad():
        bridge, _ = fit_bridge_in_passes(
            source,
            target,
            windows,
            heldout,
            statistics_memory=budget,
            top_k=args.top_k,
            head_mode=args.head_mode,
            kv_mode=args.kv_mode,
            statistics_dtype=statistics_dtype,
            batch_size=args.batch_size,
            statistics_device=args.statistics_device,
            progress=args.progress,
            timings=timings,
        )
    wall = time.perf_counter() - started
    passes = plan_passes(bridge.config.selected_layers, row, budget, statistics_dtype, groups)
    pass_bytes = [
        fit_bytes(len(set().union(*(bridge.config.selected_layers[t] for t in group))), len(group), row,
                  statistics_dtype, groups, args.top_k, args.top_k)
        for group in passes
    ]  # fmt: skip
    one_pass_forward = timings["forward_seconds"] / (1 + len(passes))
    tokens = int(windows.numel())
    cores = 1 if args.device == "cuda" else torch.get_num_threads()  # per CPU core on CPU; the whole GPU on CUDA
    result = {
        "pair": args.pair,
        "mode_if_calibrate": mode,
        "tokens": tokens,
        "head_mode": args.head_mode,
        "kv_mode": args.kv_mode,
        "top_k": args.top_k,
        "statistics_memory": budget,
        "statistics_dtype": args.statistics_dtype,
        "fit_passes": len(passes),
        "selection_statistics_bytes": selection_bytes(ls, lt, heads, dim, statistics_dtype),
        "feature_groups": groups,
        "largest_fit_pass_bytes": max(pass_bytes),
        "model_bytes": sum(p.numel() * p.element_size() for m in (source, target) for p in m.parameters()),
        "build_seconds": round(build_s, 1),
        "calibration_seconds": round(wall, 1),
        "forward_seconds": round(timings["forward_seconds"], 1),
        "statistics_seconds": round(timings["statistics_seconds"], 1),
        "selection_seconds": round(timings.get("selection_seconds", 0.0), 1),
        "lambda_seconds": round(timings.get("lambda_seconds", 0.0), 1),
        "solve_seconds": round(timings.get("solve_seconds", 0.0), 1),
        "threads": torch.get_num_threads(),
        "tokens_per_second": round(tokens / wall, 1),
        "tokens_per_second_per_core": round(tokens / wall / cores, 1),
        "overhead_over_two_forward_passes": round(wall / one_pass_forward, 2),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    if args.device == "cuda":
        result["peak_cuda_bytes"] = torch.cuda.max_memory_allocated()
    result["projection"] = project(result, timings, PAPER_TOKENS)
    return result


PAPER_TOKENS = 500 * 1024  # the paper's calibration set: 500 sequences of 1,024 tokens


def project(result: dict, timings: dict, tokens: int) -> dict:
    """The run's time at `tokens` calibration tokens, from what it measured: forwards and statistics grow with the
    tokens (the same passes: the statistics' size, hence the plan, does not depend on them), selection scoring, λ
    search and solves work on the summed statistics and do not. Also the share the non-forward work takes of it,
    which the paper's cost claim needs to be small."""
    per_token = (timings["forward_seconds"] + timings["statistics_seconds"]) / result["tokens"]
    fixed = sum(timings.get(k, 0.0) for k in ("selection_seconds", "lambda_seconds", "solve_seconds"))
    forwards = timings["forward_seconds"] / result["tokens"] * tokens
    total = per_token * tokens + fixed
    return {
        "tokens": tokens,
        "seconds": round(total, 1),
        "forward_seconds": round(forwards, 1),
        "overhead_seconds": round(total - forwards, 1),
        "overhead_over_forwards": round((total - forwards) / forwards, 3) if forwards else None,
    }


def run_cli(args: argparse.Namespace) -> int:
    """`kvbridge bench calibration`: prints the result (and writes it with `--json`)."""
    if args.memory_model:
        print(memory_table())
        return 0
    result = run(args)
    text = json.dumps(result, indent=2)
    print(text)
    seconds = {k: result[f"{k}_seconds"] for k in ("forward", "statistics", "selection", "lambda", "solve")}
    print("time split (s): " + ", ".join(f"{k} {v}" for k, v in seconds.items()))
    projected = result["projection"]
    print(
        f"projected to {projected['tokens']:,} tokens: {projected['seconds']:,} s, of which forwards "
        f"{projected['forward_seconds']:,} s (statistics + selection + λ + solves: "
        f"{projected['overhead_over_forwards']}× the forwards)"
    )
    print(
        f"{result['tokens_per_second']} tokens/s ({result['tokens_per_second_per_core']} per core, "
        f"{result['threads']} threads); statistics: selection "
        f"{format_bytes(result['selection_statistics_bytes'])}"
        f", largest fit pass {format_bytes(result['largest_fit_pass_bytes'])} in {result['fit_passes']} pass(es); "
        f"peak RSS {format_bytes(result['peak_rss_bytes'])}"
    )
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0
