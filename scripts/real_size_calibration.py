"""The paper's map at real size with default settings: `calibrate(random Qwen3-0.6B, random Qwen3-1.7B, texts,
top_k=6)` (all heads, K and V jointly, auto-λ, the default memory budget), 8 × 256 tokens of the pocket texts.

Random weights with the real layer shapes (`hf_kvbridge.tools.bench.shapes.random_model`: hidden 1024 / 2048,
28 / 28 layers, 16 query heads, 8 KV heads × 128, MLP 3072 / 6144, vocabulary 151,936, tied embeddings) give
meaningless maps but the real memory plan and costs. The text is tokenized by the pocket tokenizer (vocabulary 4,096,
so every id is one of the models'). Prints figures and writes JSON: peak RSS (`getrusage`, models included), the
default budget and the passes it plans, and the wall time split into forwards, statistics, selection scoring, λ
search and solves.

    python scripts/real_size_calibration.py --dry-run                  # the plan only: no model, no forward pass
    python scripts/real_size_calibration.py --selection-only           # real selection pass, then the planned passes
    python scripts/real_size_calibration.py --target-layers 2          # full calibration of a 2-layer target
    python scripts/real_size_calibration.py --json real_size.json      # the full 28 → 28 run (hours on 2 cores)

`--selection-only` runs what `calibrate` runs up to the layer choice (the selection pass over both models), plans the
fit passes from the layers it chose, and projects the full run's time: one forward pass of both models per fit pass,
plus the λ search and refit of each target layer's map (`--solve-seconds`, e.g. from
`python scripts/measure_solve_memory.py --p 12288 --threads 2`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a path from a checkout
    sys.path.insert(0, ROOT)

from hf_kvbridge.fitting import budget as plan  # noqa: E402
from hf_kvbridge.pocket import load_texts, model_path  # noqa: E402
from hf_kvbridge.tools.bench.shapes import CHECKPOINT_SHAPES, random_model  # noqa: E402

SOURCE, TARGET = "qwen3-0.6b", "qwen3-1.7b"


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _model_bytes(name: str, dtype: torch.dtype, layers: int | None = None) -> int:
    """Parameter bytes of a random model of `name`'s shapes (tied embeddings counted once)."""
    hidden, n, heads, kv_heads, head_dim, mlp, vocab, tied = CHECKPOINT_SHAPES[name]
    n = layers or n
    attention = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 2 * head_dim
    layer = attention + 3 * hidden * mlp + 2 * hidden
    params = n * layer + vocab * hidden * (1 if tied else 2) + hidden
    return params * torch.finfo(dtype).bits // 8


def nearest_selection(source_layers: int, target_layers: int, top_k: int) -> list[list[int]]:
    """A stand-in for the layer choice (dry run): each target layer's `top_k` source layers nearest in relative
    depth, in order of distance."""
    chosen = []
    for t in range(target_layers):
        depth = t * (source_layers - 1) / max(1, target_layers - 1)
        chosen.append(sorted(range(source_layers), key=lambda s: (abs(s - depth), s))[:top_k])
    return chosen


def plan_figures(args, free: int, selected: list[list[int]], source_layers: int, target_layers: int) -> dict:
    """The default budget `calibrate` computes for `free` bytes, and the passes it plans for `selected`."""
    heads, dim, dtype = 8, 128, torch.float32
    row = heads * 2 * dim
    shape = plan.FitShape(source_layers, target_layers, heads, dim, args.top_k, dtype, groups=1)
    smallest = plan.smallest_plan_bytes(shape)
    reserve = plan.rows_bytes(args.batch_size * args.seq_len, source_layers, target_layers, row)
    budget = plan.default_budget(free, smallest, reserve)
    mode = plan.check_budget(budget, shape)
    passes = plan.plan_passes(selected, row, budget, dtype) if mode == "blocks" else []
    return {
        "free_bytes": free,
        "half_free_bytes": free // 2,
        "smallest_plan_bytes": smallest,
        "batch_rows_reserve_bytes": reserve,
        "budget_bytes": budget,
        "budget_is_smallest_plan": budget == smallest and smallest > free // 2,
        "statistics": mode,
        "selection_bytes": plan.selection_bytes(source_layers, target_layers, heads, dim, dtype),
        "fit_pass_one_layer_bytes": plan.fit_bytes(args.top_k, 1, row, dtype),
        "solve_bytes": plan.solve_bytes(args.top_k, row),
        "fit_passes": len(passes),
        "target_layers_per_pass": [len(p) for p in passes],
    }


def windows_and_split(args, tokenizer):
    from hf_kvbridge.fitting.calibration.checks import split_heldout
    from hf_kvbridge.fitting.data import token_windows

    windows = token_windows(load_texts("calibration"), tokenizer, args.num_sequences, args.seq_len)
    _, heldout = split_heldout(len(windows), 0.1, 0)  # `CalibrationSettings`' defaults
    return windows, heldout


def selection_only(args, source, target, tokenizer, result: dict) -> None:
    """What `fit_bridge_in_passes` runs before its fit passes: the selection pass and the layer choice."""
    from hf_kvbridge.fitting.calibration.budgeted_fit import SELECTION_LAMBDA
    from hf_kvbridge.fitting.calibration.data_pass import collect_statistics
    from hf_kvbridge.fitting.layer_selection import select_layers
    from hf_kvbridge.fitting.statistics.selection import SelectionStatistics
    from hf_kvbridge.utils.layout import allowed_sources, check_matched

    src, tgt = check_matched(source.config, target.config, SOURCE, TARGET)
    windows, heldout = windows_and_split(args, tokenizer)
    timings: dict = {}
    started = time.perf_counter()
    train, held = collect_statistics(
        source,
        target,
        windows,
        heldout=heldout,
        batch_size=args.batch_size,
        make_parts=lambda: [
            SelectionStatistics(src.num_layers, tgt.num_layers, src.num_kv_heads, src.head_dim) for _ in range(2)
        ],
        timings=timings,
    )
    scoring = time.perf_counter()
    r2 = train.single_layer_r2(held, SELECTION_LAMBDA)  # (L_t, L_s, 2)
    del train, held
    selected = select_layers(r2, args.top_k, allowed_sources(src, tgt))
    timings["selection_seconds"] = time.perf_counter() - scoring
    result["selection_pass_seconds"] = round(time.perf_counter() - started, 1)
    result["tokens"] = int(windows.numel())
    # the budget `calibrate` computes: from the memory free once the models are built, before any pass
    free = result["free_after_models_bytes"]
    result["plan"] = plan_figures(args, free, selected, src.num_layers, tgt.num_layers)
    result["timings"] = {key: round(value, 1) for key, value in timings.items()}
    passes = result["plan"]["fit_passes"]
    projected = {
        "forwards_seconds": round(timings["forward_seconds"] * (1 + passes), 1),
        "statistics_seconds": round(timings["statistics_seconds"] * (1 + passes), 1),  # about: fit blocks are smaller
        "selection_seconds": round(timings["selection_seconds"], 1),
    }
    if args.solve_seconds is not None:
        projected["solves_seconds"] = round(args.solve_seconds * tgt.num_layers, 1)
    projected["total_seconds"] = round(sum(projected.values()), 1)
    result["projected_full_run"] = projected


def full(args, source, target, tokenizer, result: dict) -> None:
    import hf_kvbridge

    started = time.perf_counter()
    bridge = hf_kvbridge.calibrate(
        source,
        target,
        load_texts("calibration"),
        tokenizer=tokenizer,
        top_k=args.top_k,
        num_sequences=args.num_sequences,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
    )
    result["calibration_seconds"] = round(time.perf_counter() - started, 1)
    info = bridge.config.calibration
    keys = ("statistics", "statistics_memory", "fit_passes", "tokens", "forward_seconds", "statistics_seconds",
            "selection_seconds", "lambda_seconds", "solve_seconds")  # fmt: skip
    result["calibration"] = {key: info.get(key) for key in keys}
    result["solve_seconds_per_target_layer"] = round(
        (info.get("lambda_seconds", 0) + info.get("solve_seconds", 0)) / target.config.num_hidden_layers, 1
    )


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="the plan only, for the free memory the models leave")
    parser.add_argument("--selection-only", action="store_true", help="the selection pass, then the plan")
    parser.add_argument("--target-layers", type=int, default=None, help="fewer target layers (default: 28)")
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--num-sequences", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8, help="calibrate's default")
    parser.add_argument("--dtype", default="bfloat16", help="of the models (real Qwen3 checkpoints: bfloat16)")
    parser.add_argument("--solve-seconds", type=float, default=None, help="one target layer's λ search + refit")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    dtype = getattr(torch, args.dtype)
    source_layers = CHECKPOINT_SHAPES[SOURCE][1]
    target_layers = args.target_layers or CHECKPOINT_SHAPES[TARGET][1]
    result: dict = {
        "pair": f"{SOURCE} → {TARGET} (random weights)",
        "target_layers": target_layers,
        "top_k": args.top_k,
        "text": f"{args.num_sequences} × {args.seq_len} tokens",
        "model_dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "model_bytes": _model_bytes(SOURCE, dtype) + _model_bytes(TARGET, dtype, target_layers),
    }
    if args.dry_run:  # the models are not built: the free memory they would leave
        free = plan.free_bytes() - result["model_bytes"]
        selected = nearest_selection(source_layers, target_layers, args.top_k)
        result["plan"] = plan_figures(args, free, selected, source_layers, target_layers)
        result["plan"]["selection"] = "nearest layers by relative depth (dry run)"
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path("pocket-s"))
        started = time.perf_counter()
        source = random_model(SOURCE, dtype)
        target = random_model(TARGET, dtype)
        if args.target_layers:
            target.model.layers = target.model.layers[: args.target_layers]
            target.config.num_hidden_layers = args.target_layers
            target.config.layer_types = target.config.layer_types[: args.target_layers]
        result["build_seconds"] = round(time.perf_counter() - started, 1)
        result["rss_after_models_bytes"] = _peak_rss()
        result["free_after_models_bytes"] = plan.free_bytes()
        if args.selection_only:
            selection_only(args, source, target, tokenizer, result)
        else:
            full(args, source, target, tokenizer, result)
        result["peak_rss_bytes"] = _peak_rss()
    text = json.dumps(result, indent=1, ensure_ascii=False)
    print(text)
    summary = [f"{key}: {plan.format_bytes(value)}" for key, value in result.items() if key.endswith("_bytes")]
    print("; ".join(summary))
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return result


if __name__ == "__main__":
    main()
