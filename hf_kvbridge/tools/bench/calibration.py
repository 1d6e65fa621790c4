"""Calibration at real layer shapes with random weights: tokens/s, statistics memory, peak RSS, and the overhead over
the two models' forward passes.

    kvbridge bench calibration --pair qwen3-0.6b:qwen3-1.7b --statistics-memory 8GB

Random weights give meaningless maps but real shapes, so the memory plan, the statistics' cost and the passes over the
data are those of the real pair. Timing figures need a quiet machine.
"""

from __future__ import annotations

import contextlib
import resource
import time
from dataclasses import asdict, dataclass

import torch
from transformers import Qwen3Config

from ...errors import InvalidInputError
from ...fitting.budget import FitShape, check_budget, fit_bytes, plan_passes, selection_bytes
from ...fitting.calibration.budgeted_fit import fit_in_passes
from ...fitting.calibration.checks import split_heldout
from ...fitting.statistics.blocks import feature_groups
from ...fitting.statistics.rows import RowStatistics
from ...utils.precision import bf16_matmul_units, float32_matmul_precision
from ...utils.sizes import format_bytes, parse_bytes
from .flop_model import H100_SXM, CalibrationShape, calibration_flops, prefill_flops, probe_rates, project_seconds
from .shapes import CHECKPOINT_SHAPES, random_model, shape_config, shape_pair

# (layers, KV heads, head dim) of the pairs in the README's memory model
LAYOUTS = {
    "Qwen3-0.6B → 1.7B": ((28, 8, 128), (28, 8, 128)),
    "Qwen3-4B → 8B": ((36, 8, 128), (36, 8, 128)),
    "Qwen3-14B → 32B": ((40, 8, 128), (64, 8, 128)),
    "Llama-3.1-8B → 70B": ((32, 8, 128), (80, 8, 128)),
}


def targets_per_pass(ls: int, lt: int, row: int, dtype, groups: int, k: int, budget: int, shared: bool = False) -> int:
    """Target layers a fit pass holds within `budget` when no two of them share a source layer (`U = min(T·k, L_s)`:
    sharing only lowers the need), or with `shared` when all read the same `k` (`U = k`); 0 when not even one
    fits."""
    fits = [
        t
        for t in range(1, lt + 1)
        if fit_bytes(k if shared else min(t * k, ls), t, row, dtype, groups, k, k) <= budget
    ]
    return max(fits, default=0)


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
                per_pass = targets_per_pass(ls, lt, row, dtype, groups, k, budget)
                passes = "–" if per_pass == 0 else f"{1 + -(-lt // per_pass)} / {1 + -(-lt // (ranks * per_pass))}"
                params = lt * (k * row // groups) * (row // groups) * groups + lt * row  # weights + biases
                selection = format_bytes(selection_bytes(ls, lt, heads, dim, dtype))
                lines.append(
                    f"| {pair} | {k} | {head_mode} / {kv_mode} | {selection} | {format_bytes(one)} "
                    f"| {format_bytes(every)} | {passes} | {params / 1e6:,.0f} M |"
                )
    return "\n".join(lines)


def layer_counts(text: str, source: Qwen3Config, target: Qwen3Config) -> tuple[int, int]:
    """`--layers S:T`: the first `S` source and `T` target layers, at most the shapes' depths.

    Example:

    ```python
    >>> layer_counts("8:4", shape_config("qwen3-4b"), shape_config("qwen3-8b"))
    (8, 4)
    ```
    """
    parts = text.split(":")
    if len(parts) != 2 or not all(part.isdigit() and int(part) > 0 for part in parts):
        raise InvalidInputError(f"--layers takes S:T, two positive layer counts joined by ':'; got {text!r}")
    counts = int(parts[0]), int(parts[1])
    for side, count, config in zip(("source", "target"), counts, (source, target)):
        if count > config.num_hidden_layers:
            raise InvalidInputError(
                f"--layers {text}: the {side} shape has {config.num_hidden_layers} layers, not {count}"
            )
    return counts


def scale_to_depth(timings: dict, measured: tuple, full: tuple, seq_len: int) -> dict:
    """The stages' seconds of a run on the first layers of a pair (`measured`: the `(source, target)` configs it
    ran) scaled to the whole pair (`full`), per what each stage's work grows with:
    - forwards: with the two prefills' FLOPs (`prefill_flops`; every layer of a model has the same shape);
    - the selection pass's statistics and scoring: with source × target layers (every pair is scored);
    - the fit passes' statistics, the λ search and the solves: with the target layers (one map each, from as many
      source layers as the run's: a deeper source may spread a pass's union wider, which the FLOP model brackets).

    Example:

    ```python
    >>> small = (shape_config("qwen3-4b", layers=4), shape_config("qwen3-8b", layers=2))
    >>> full = (shape_config("qwen3-4b"), shape_config("qwen3-8b"))
    >>> timings = {"forward_seconds": 1.0, "statistics_seconds": 3.0, "selection_statistics_seconds": 1.0,
    ...            "selection_seconds": 1.0, "lambda_seconds": 1.0, "solve_seconds": 1.0}
    >>> scaled = scale_to_depth(timings, small, full, 256)
    >>> scaled["selection_seconds"], scaled["lambda_seconds"], round(scaled["statistics_seconds"], 1)
    (162.0, 18.0, 198.0)
    ```
    """
    (ms, mt), (fs, ft) = measured, full
    forward = (prefill_flops(fs, seq_len) + prefill_flops(ft, seq_len)) / (
        prefill_flops(ms, seq_len) + prefill_flops(mt, seq_len)
    )
    pairs = fs.num_hidden_layers * ft.num_hidden_layers / (ms.num_hidden_layers * mt.num_hidden_layers)
    targets = ft.num_hidden_layers / mt.num_hidden_layers
    selection_statistics = timings.get("selection_statistics_seconds", 0.0)
    fit_statistics = timings["statistics_seconds"] - selection_statistics
    return {
        "forward_seconds": timings["forward_seconds"] * forward,
        "statistics_seconds": selection_statistics * pairs + fit_statistics * targets,
        "selection_statistics_seconds": selection_statistics * pairs,
        "selection_seconds": timings.get("selection_seconds", 0.0) * pairs,
        "lambda_seconds": timings.get("lambda_seconds", 0.0) * targets,
        "solve_seconds": timings.get("solve_seconds", 0.0) * targets,
    }


@dataclass(frozen=True)
class CalibrationWorkload:
    """What a benchmarked calibration computes on: random-weight models of the checkpoint shapes `pair`
    (`"SOURCE:TARGET"`, keys of `shapes.CHECKPOINT_SHAPES`) in `dtype` on `device`, `num_sequences` random windows of
    `seq_len` tokens, a map of `top_k` source layers per target layer in `head_mode` / `kv_mode`, and statistics in
    `statistics_dtype` within `statistics_memory` (`"8GB"`). `dtype` and `statistics_dtype` are torch dtype names;
    `vocab` overrides the shapes' vocabulary. `kvbridge bench calibration` builds it from its options (and their
    defaults); `run` measures it, `flop_model_report` counts it."""

    pair: str
    num_sequences: int
    seq_len: int
    top_k: int
    head_mode: str
    kv_mode: str
    statistics_memory: str
    statistics_dtype: str
    dtype: str
    device: str
    vocab: int | None = None

    def shapes(self, layers: tuple[int | None, int | None] = (None, None)) -> tuple[Qwen3Config, Qwen3Config]:
        """The source's and the target's configs (their first `layers` layers only, where given)."""
        names = shape_pair(self.pair, "--pair", CHECKPOINT_SHAPES)
        return tuple(shape_config(name, self.vocab, count) for name, count in zip(names, layers))


def run(
    workload: CalibrationWorkload,
    *,
    batch_size: int,
    heldout_fraction: float,
    statistics_device: str | None = None,
    matmul_precision: str | None = None,
    layers: str | None = None,
    progress: bool = False,
) -> dict:
    """Calibrates `workload` on random token windows and returns what it measured: the time of each stage, tokens per
    second, statistics bytes, peak RSS, the projection to the paper's calibration set (`project`), and with `layers`
    (`"S:T"`, the first layers only) each stage scaled to the whole pair (`scale_to_depth`). `matmul_precision`
    (`"highest"`, `"high"`, `"medium"`: the float32 matmul precision) is set for the run.

    Example:

    ```python
    >>> workload = CalibrationWorkload("qwen3-0.6b:qwen3-1.7b", num_sequences=8, seq_len=256, top_k=6,
    ...                                head_mode="same_head", kv_mode="joint", statistics_memory="8GB",
    ...                                statistics_dtype="float32", dtype="bfloat16", device="cpu")
    >>> result = run(workload, batch_size=2, heldout_fraction=0.125, layers="2:2")  # doctest: +SKIP
    >>> result["tokens_per_second"]  # doctest: +SKIP
    ```
    """
    w = workload
    source_name, target_name = shape_pair(w.pair, "--pair", CHECKPOINT_SHAPES)
    dtype, statistics_dtype = getattr(torch, w.dtype), getattr(torch, w.statistics_dtype)
    budget = parse_bytes(w.statistics_memory)
    full = w.shapes()
    counts = layer_counts(layers, *full) if layers else (None, None)
    source_config, target_config = w.shapes(counts)
    ls, lt = source_config.num_hidden_layers, target_config.num_hidden_layers
    heads, dim = source_config.num_key_value_heads, source_config.head_dim
    row = heads * 2 * dim
    modes = (w.head_mode, w.kv_mode)
    # refuses before any work, the models' build included
    mode = check_budget(budget, FitShape(ls, lt, heads, dim, w.top_k, statistics_dtype), *modes)
    started = time.perf_counter()
    source = random_model(source_name, dtype, w.device, w.vocab, counts[0])
    target = random_model(target_name, dtype, w.device, w.vocab, counts[1])
    build_s = time.perf_counter() - started
    groups = len(feature_groups(heads, dim, *modes))  # the shapes here are matched pairs
    windows = torch.randint(0, source.config.vocab_size, (w.num_sequences, w.seq_len),
                            generator=torch.Generator().manual_seed(0))  # fmt: skip
    _, heldout = split_heldout(len(windows), heldout_fraction, 0)
    timings: dict = {}
    precision = matmul_precision
    started = time.perf_counter()
    with torch.no_grad(), float32_matmul_precision(precision) if precision else contextlib.nullcontext():
        fitted, _ = fit_in_passes(
            source,
            target,
            windows,
            heldout,
            statistics_memory=budget,
            top_k=w.top_k,
            head_mode=w.head_mode,
            kv_mode=w.kv_mode,
            statistics_dtype=statistics_dtype,
            batch_size=batch_size,
            statistics_device=statistics_device,
            progress=progress,
            timings=timings,
        )
    wall = time.perf_counter() - started
    selected = fitted.config.selected_layers
    if timings["row_statistics"]:  # one pass kept every target layer's rows (fewer training tokens than inputs)
        passes = [list(range(len(selected)))]
        union = len(set().union(*selected))
        pass_bytes = [RowStatistics.nbytes(int(windows.numel()), union, len(selected), row, row, statistics_dtype)]
    else:
        passes = plan_passes(selected, row, budget, statistics_dtype, groups)
        pass_bytes = [
            fit_bytes(len(set().union(*(selected[t] for t in group))), len(group), row, statistics_dtype, groups,
                      w.top_k, w.top_k)
            for group in passes
        ]  # fmt: skip
    one_pass_forward = timings["forward_seconds"] / (1 + len(passes))
    tokens = int(windows.numel())
    cores = 1 if w.device == "cuda" else torch.get_num_threads()  # per CPU core on CPU; the whole GPU on CUDA
    result = {
        "pair": w.pair,
        "mode_if_calibrate": mode,
        "tokens": tokens,
        "head_mode": w.head_mode,
        "kv_mode": w.kv_mode,
        "top_k": w.top_k,
        "statistics_memory": budget,
        "statistics_dtype": w.statistics_dtype,
        "float32_matmul_precision": precision or torch.get_float32_matmul_precision(),
        "cpu_bf16_units": bf16_matmul_units("cpu"),
        "heldout_r2_mean": _mean_r2(fitted.config.heldout_r2),
        "source_layers": ls,
        "target_layers": lt,
        "fit_passes": len(passes),
        "row_statistics": timings["row_statistics"],
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
    if w.device == "cuda":
        result["peak_cuda_bytes"] = torch.cuda.max_memory_allocated()
    result["projection"] = project(result, timings, PAPER_TOKENS)
    if layers:  # the whole pair's stages, scaled from this run's first layers
        scaled = scale_to_depth(timings, (source_config, target_config), full, w.seq_len)
        scaled["row_statistics"] = timings["row_statistics"]
        result["full_depth"] = {
            "source_layers": full[0].num_hidden_layers,
            "target_layers": full[1].num_hidden_layers,
            **{key: round(value, 1) for key, value in scaled.items() if key.endswith("_seconds")},
            "projection": project(result, scaled, PAPER_TOKENS),
        }
    return result


def _mean_r2(heldout_r2: dict | None) -> dict:
    """`{"k": mean, "v": mean}` of a config's per-layer held-out R² (layers without one left out)."""
    means = {}
    for kv, values in (heldout_r2 or {}).items():
        known = [float(v) for v in values if v is not None]
        if known:
            means[kv] = round(sum(known) / len(known), 4)
    return means


PAPER_TOKENS = 500 * 1024  # the paper's calibration set: 500 sequences of 1,024 tokens


def project(result: dict, timings: dict, tokens: int) -> dict:
    """The run's time at `tokens` calibration tokens, from what it measured: forwards and statistics grow with the
    tokens (the same passes: the statistics' size, hence the plan, does not depend on them), selection scoring, λ
    search and solves work on the summed statistics and do not. Also the share the non-forward work takes of it,
    which the paper's cost claim needs to be small."""
    forwards = timings["forward_seconds"] / result["tokens"] * tokens
    if timings.get("row_statistics"):  # fewer tokens than inputs: the rows' λ search and solves do not scale
        return {
            "tokens": tokens,
            "seconds": None,
            "forward_seconds": round(forwards, 1),
            "overhead_seconds": None,
            "overhead_over_forwards": None,
            "not_projected": "the fit kept the rows (fewer training tokens than map inputs); at these tokens it "
            "takes the sums, whose λ search and solves this run did not measure (scripts/measure_row_solve.py "
            "times both)",
        }
    per_token = (timings["forward_seconds"] + timings["statistics_seconds"]) / result["tokens"]
    fixed = sum(timings.get(k, 0.0) for k in ("selection_seconds", "lambda_seconds", "solve_seconds"))
    total = per_token * tokens + fixed
    return {
        "tokens": tokens,
        "seconds": round(total, 1),
        "forward_seconds": round(forwards, 1),
        "overhead_seconds": round(total - forwards, 1),
        "overhead_over_forwards": round((total - forwards) / forwards, 3) if forwards else None,
    }


def flop_model_report(workload: CalibrationWorkload, *, fit_passes: int | None = None) -> dict:
    """`kvbridge bench calibration --flop-model`: the FLOPs of each stage of calibrating `workload`
    (`tools.bench.flop_model`) and their time at the rates probed on its device (products in its dtype) and at the
    H100 SXM's (datasheet peaks × assumed efficiencies). The fit passes are `fit_passes` (target layers split evenly),
    or planned within the statistics' memory with the target layers of a pass sharing their `k` source layers, as
    neighbouring layers mostly do (the fewest passes; the statistics' FLOPs are counted at both ends of the union all
    the same)."""
    w = workload
    source, target = w.shapes()
    heads, dim = source.num_key_value_heads, source.head_dim
    if (target.num_key_value_heads, target.head_dim) != (heads, dim):
        raise InvalidInputError(f"--flop-model needs a pair with one KV layout; {w.pair} has two")
    ls, lt, row = source.num_hidden_layers, target.num_hidden_layers, heads * 2 * dim
    groups = len(feature_groups(heads, dim, w.head_mode, w.kv_mode))
    budget = parse_bytes(w.statistics_memory)
    statistics_dtype = getattr(torch, w.statistics_dtype)
    if fit_passes:
        if fit_passes > lt:
            raise InvalidInputError(f"--fit-passes {fit_passes} is more than the target's {lt} layers")
        per_pass = -(-lt // fit_passes)
    elif not (per_pass := targets_per_pass(ls, lt, row, statistics_dtype, groups, w.top_k, budget, shared=True)):
        need = fit_bytes(w.top_k, 1, row, statistics_dtype, groups, w.top_k, w.top_k)
        raise InvalidInputError(
            f"one target layer needs {format_bytes(need)} but --statistics-memory is {format_bytes(budget)}"
        )
    sizes = tuple(min(per_pass, lt - start) for start in range(0, lt, per_pass))
    shape = CalibrationShape(ls, lt, heads, dim, w.top_k, groups, w.num_sequences, w.seq_len, sizes)
    flops = calibration_flops(shape, source, target)
    devices = []
    for rates in (probe_rates(w.device, getattr(torch, w.dtype)), H100_SXM):
        seconds = project_seconds(flops, rates)
        devices.append({"rates": asdict(rates), "seconds": seconds,
                        "tokens_per_second": shape.tokens / seconds["total_high"]})  # fmt: skip
    cores = torch.get_num_threads() if torch.device(w.device).type == "cpu" else None
    if cores:
        devices[0]["tokens_per_second_per_core"] = devices[0]["tokens_per_second"] / cores
    return {
        "pair": w.pair,
        "top_k": w.top_k,
        "head_mode": w.head_mode,
        "kv_mode": w.kv_mode,
        "tokens": shape.tokens,
        "fit_passes": list(sizes),
        "statistics_memory": budget,
        "flops": flops,
        "devices": devices,
    }


def format_flop_table(result: dict) -> str:
    names = [d["rates"]["name"] for d in result["devices"]]
    lines = ["| stage | FLOPs | " + " | ".join(f"seconds: {n}" for n in names) + " |",
             "|---|---|" + "---|" * len(names)]  # fmt: skip
    for stage in ("forwards", "selection_statistics", "selection_scoring", "fit_statistics_low",
                  "fit_statistics_high", "lambda_search", "refit"):  # fmt: skip
        cells = " | ".join(f"{d['seconds'][stage]:,.1f}" for d in result["devices"])
        lines.append(f"| {stage} | {result['flops'][stage]:.3g} | {cells} |")
    for end in ("low", "high"):
        cells = " | ".join(f"{d['seconds'][f'total_{end}']:,.1f} "
                           f"(the rest {d['seconds'][f'overhead_over_forwards_{end}']:.2f}× the forwards)"
                           for d in result["devices"])  # fmt: skip
        lines.append(f"| total, fit statistics {end} | | {cells} |")
    return "\n".join(lines)
