"""The GPU run of the mapping engine, the warm cascade and the calibration (issue 40), in one process of at most five
minutes: `scripts/bench_gpu.sh` runs it (`python -m hf_kvbridge.tools.bench.gpu --out DIR`), from a checkout, on a
machine with a CUDA PyTorch and transformers (no lm-eval, datasets or vLLM needed).

Steps, each under a time limit (a step that fails or runs out of time is recorded and the next one runs) and within
the run's total budget (`BUDGET_S`, 290 s); `bench-gpu.json` is rewritten after every step:

1. `device`: the GPU, versions, and its measured ceilings (a bfloat16 matrix product, a device copy).
2. `lambda_search`: one map of the paper's calibration of 0.6B → 1.7B (p = 12,288 inputs) searched by each method
   (`solve.LAMBDA_SEARCHES`): seconds, and whether they choose alike.
3. `vllm_helpers`: the vLLM connector's paged-cache read and its rotary-only target on CUDA tensors against their CPU
   results (without vLLM); `exactness`: the map on the GPU (whole layers, the Triton rotation; and the chunked
   schedule) against the CPU's float32 map of the same bridge and cache, in float32 and bfloat16.
4. `calibration`: the paper's map (all heads, joint, top-6, auto-λ) of 0.6B → 1.7B on 16 × 1,024 tokens, stages timed
   and projected to the paper's 500 × 1,024 tokens.
5. `build_large`: random-weight Qwen3-14B and Qwen3-32B shapes in bfloat16, built once on the GPU.
6. `table_<tokens>`: per length (`LENGTHS`, 1K-32K), the 32B's re-prefill and the 14B's prefill, then for the
   all-heads top-6 map, the same-head top-6 map and a rank-512 map: the map with the whole-layer schedule and with the
   chunked one (interleaved medians), warm and cold speed-ups, ops per mapping and per target layer (both schedules),
   the GPU's busy time and kernels, the FLOP and memory floors and the fraction of the floor reached.
7. `ttft_<kind>_<tokens>`: time to first token through `generate_from_cache` at 8K and 1K, warm and cold, eager on a
   dynamic cache and compiled on a static one (the first call, with compilation, timed apart).
8. `small_pair`: Qwen3-0.6B → 1.7B shapes, the table and eager time to first token at 1K and 8K.

`--smoke` runs every step at tiny shapes on the CPU (the test suite runs it).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import platform
import signal
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from .timing import synchronize

LARGE = ("qwen3-14b", "qwen3-32b")
SMALL = ("qwen3-0.6b", "qwen3-1.7b")
SMOKE_LARGE = ("small-3l-2x64", "small-8l-2x64")
KINDS = {"all_heads": {"head_mode": "all_heads"}, "same_head": {"head_mode": "same_head"},
         "low_rank": {"head_mode": "all_heads", "rank": 512}}  # fmt: skip


class StepTimeout(Exception):
    """A step ran past its time limit."""


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raises `StepTimeout` in the main thread after `seconds` (between Python operations: a GPU kernel already
    running finishes first)."""

    def expire(signum, frame):
        raise StepTimeout(f"ran past its {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Run:
    """The steps' results, written to `path` after each step, and the run's total time budget."""

    def __init__(self, path: Path, budget: float):
        self.path, self.budget, self.started = path, budget, time.perf_counter()
        self.results: dict = {"steps": {}}

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.started)

    def step(self, name: str, limit: float, fn: Callable[[], dict]) -> dict | None:
        """Runs `fn()` under `min(limit, time left)`; records its result, or why it has none."""
        allowed = min(limit, self.left())
        record: dict = {"limit_s": round(allowed, 1)}
        started = time.perf_counter()
        if allowed <= 1:
            record["status"] = "skipped: the run's time budget is spent"
        else:
            print(f"== {name} (at most {allowed:.0f} s)", flush=True)
            try:
                with time_limit(allowed):
                    record["result"] = fn()
                record["status"] = "ok"
            except StepTimeout as err:
                record["status"] = f"timeout: {err}"
            except Exception as err:  # a failing step must not stop the others: recorded with its traceback
                record["status"] = f"error: {type(err).__name__}: {err}"[:500]
                record["traceback"] = traceback.format_exc()[-3000:]
            finally:
                _release()
        record["seconds"] = round(time.perf_counter() - started, 2)
        self.results["steps"][name] = record
        self.write()
        print(f"   {name}: {record['status']} ({record['seconds']} s)", flush=True)
        return record.get("result")

    def write(self) -> None:
        self.results["elapsed_s"] = round(time.perf_counter() - self.started, 1)
        partial = self.path.with_suffix(".partial")
        partial.write_text(json.dumps(self.results, indent=2, default=str))
        partial.replace(self.path)


def _release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- steps ----------------------------------------------------------------------------------------------------------
def device_step(device: torch.device, dtype: torch.dtype) -> dict:
    import transformers

    from .floors import measure_ceilings

    info = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpu_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    info["ceilings"] = measure_ceilings(device, dtype)
    return info


def build_pair(names, device, dtype, state: dict) -> dict:
    """Both models of `names` with random weights, built once (kept in `state`)."""
    from transformers import AutoModelForCausalLM

    from .shapes import qwen3_shape_config

    started = time.perf_counter()
    models = []
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made in the dtype directly: no float32 copy of 92 GB
    try:
        for name in names:
            with torch.device(device):
                models.append(AutoModelForCausalLM.from_config(qwen3_shape_config(name), dtype=dtype).eval())
    finally:
        torch.set_default_dtype(default)
    synchronize(device)
    state["models"] = models
    return {
        "pair": list(names),
        "build_s": time.perf_counter() - started,
        "model_bytes": sum(p.numel() * p.element_size() for m in models for p in m.parameters()),
    }


@torch.no_grad()
def table_step(state: dict, length: int, kinds: dict, settings: dict) -> dict:
    """The re-prefill and prefill at `length`, then each mapper kind's map on both schedules (module docstring)."""
    from ...utils.cache import output_cache
    from .floors import mapping_floor
    from .flop_model import prefill_flops
    from .ops import count_ops, device_busy_seconds
    from .shapes import random_mapper_bridge
    from .timing import interleaved_medians, median_seconds

    source, target = state["models"]
    device = target.device
    ids = torch.randint(0, target.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
    ids = ids.to(device)
    repeats = settings["prefill_repeats"] if length <= 8192 else max(1, settings["prefill_repeats"] - 1)
    prefill = {
        "target_prefill_s": median_seconds(lambda: target.model(input_ids=ids, use_cache=True), device, repeats, 1),
        "source_prefill_s": median_seconds(lambda: source.model(input_ids=ids, use_cache=True), device, repeats, 1),
    }
    prefill["target_prefill_flops"] = prefill_flops(target.config, length)
    source_cache = output_cache(source.model(input_ids=ids, use_cache=True))
    rows = {"context_tokens": length, **prefill}
    for kind, options in kinds.items():
        bridge = random_mapper_bridge(source, target, top_k=settings["top_k"], **options)
        fns = {schedule: _mapping(bridge, source_cache, schedule) for schedule in ("layers", "chunked")}
        seconds = interleaved_medians(fns, device, settings["map_repeats"], 1)
        layers = bridge.target_layout.num_layers
        row = {f"{s}_map_s": value for s, value in seconds.items()}
        for schedule, fn in fns.items():
            counts = count_ops(fn)
            row[f"{schedule}_ops"] = counts.total
            row[f"{schedule}_ops_per_target_layer"] = counts.total / layers
            row[f"{schedule}_compute_ops_per_target_layer"] = counts.compute_ops / layers
            busy = device_busy_seconds(fn, device)
            if busy is not None:
                row[f"{schedule}_device_busy_s"] = busy["device_busy_s"]
                row[f"{schedule}_kernels"] = busy["kernels"]
        row.update(mapping_floor(bridge, 1, length, state["ceilings"], seconds["layers"]))
        row["warm_speedup"] = prefill["target_prefill_s"] / seconds["layers"]
        row["cold_speedup"] = prefill["target_prefill_s"] / (prefill["source_prefill_s"] + seconds["layers"])
        row["chunked_warm_speedup"] = prefill["target_prefill_s"] / seconds["chunked"]
        row["mapper_flops_per_s"] = row["mapper_flops"] / seconds["layers"]
        rows[kind] = row
        bridge.free_workspace()
        del bridge, fns
        _release()
    return rows


def _mapping(bridge, source_cache, schedule: str) -> Callable[[], object]:
    return lambda: bridge.map_cache(source_cache, schedule=schedule)


def ttft_step(state: dict, kind: str, length: int, settings: dict) -> dict:
    """Time to first token at `length` through `generate_from_cache`, eager (dynamic cache) and compiled (static)."""
    from .shapes import random_mapper_bridge
    from .ttft import time_to_first_token

    source, target = state["models"]
    bridge = state.get(("bridge", kind))
    if bridge is None:  # one bridge per kind, kept, all sharing one static cache: the target's compiled step
        # (kept on the target) then sees the same tensors at every call and is compiled once for the run
        bridge = state[("bridge", kind)] = random_mapper_bridge(source, target, top_k=settings["top_k"],
                                                                **KINDS[kind])  # fmt: skip
        bridge.__dict__["_warm_start"] = state.setdefault("warm_start", {})
    ids = torch.randint(0, target.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(7))
    rows = {"eager": time_to_first_token(bridge, ids, repeats=settings["ttft_repeats"])}
    if settings["compile"]:
        rows["compiled"] = time_to_first_token(
            bridge,
            ids,
            repeats=settings["ttft_repeats"],
            static=True,
            compile_hold_back=True,
            compile_config=settings["compile_config"],
        )
    bridge.free_workspace()
    return rows


def calibration_step(settings: dict) -> dict:
    """The paper's calibration of the small pair (`kvbridge bench calibration`), its stages and projection."""
    from ...fitting.solve import default_lambda_search
    from .calibration import CalibrationWorkload, run

    c = settings["calibration"]
    workload = CalibrationWorkload(**{f.name: c[f.name] for f in dataclasses.fields(CalibrationWorkload)})
    result = run(workload, batch_size=c["batch_size"], heldout_fraction=c["heldout_fraction"],
                 statistics_device=c["statistics_device"], matmul_precision=c["float32_matmul_precision"],
                 layers=c["layers"], progress=c["progress"])  # fmt: skip
    return {**result, "lambda_search": default_lambda_search(c["statistics_device"])}


@torch.no_grad()
def lambda_search_step(device: torch.device, settings: dict) -> dict:
    """One map of the paper's calibration shape (p = top_k · H · 2d inputs, q = H · 2d outputs) searched by each
    λ search on `device`: seconds per map, and whether the searches choose the same λ."""
    from ...fitting.solve import LAMBDA_GRID, LAMBDA_SEARCHES, heldout_r2_chunks
    from ...fitting.statistics.dense import KVStatistics

    heads, dim, layers, tokens = settings["lambda_shape"]
    features = heads * 2 * dim
    generator = torch.Generator(device=device).manual_seed(0)
    mix = torch.randn(layers * features, layers * features, device=device, generator=generator) / features**0.5
    stats = []
    for _ in range(2):  # train, held out: correlated features (a mixed Gaussian) and a noisy linear target
        part = KVStatistics(layers, 1, heads, dim, device=device)
        x = torch.randn(tokens, layers * features, device=device, generator=generator) @ mix
        y = x[:, :features] * 0.5 + x[:, -features:] * 0.25 + torch.randn(tokens, features, device=device,
                                                                         generator=generator)  # fmt: skip
        part.update(x, y)
        stats.append(part)
    x_idx, y_idx = torch.arange(layers * features, device=device), torch.arange(features, device=device)
    result = {"p": layers * features, "q": features, "tokens": tokens}
    choices = {}
    for search in LAMBDA_SEARCHES:
        heldout_r2_chunks(*stats, x_idx[:64], y_idx[: 2 * dim], dim, (1e-2,), search=search)  # warm-up: handles
        synchronize(device)
        started = time.perf_counter()
        path = heldout_r2_chunks(*stats, x_idx, y_idx, dim, LAMBDA_GRID, search=search)
        synchronize(device)
        result[f"{search}_s"] = time.perf_counter() - started
        choices[search] = path.view(len(LAMBDA_GRID), -1, 2).mean(1)
        result[f"{search}_best_lambda"] = [LAMBDA_GRID[int(i)] for i in choices[search].argmax(0)]
    reference = choices["eigh"]
    for search in LAMBDA_SEARCHES:
        result[f"{search}_max_r2_difference"] = float((choices[search] - reference).abs().max())
    return result


@torch.no_grad()
def exactness_step(device: torch.device) -> dict:
    """The map on `device` (its default schedule: whole layers and the Triton rotation on CUDA; and the chunked one)
    against the CPU's chunked float32 map of the same bridge and cache, in float32 and bfloat16: the largest
    relative difference over the layers' keys and values."""
    import copy

    from transformers import DynamicCache

    from ...mappers.engine import default_schedule
    from ...utils.cache import append_layer, output_cache
    from ...utils.rope import triton_rotate_kv
    from .shapes import qwen3_shape_config, random_bridge

    def moved(cache, dtype):
        out = DynamicCache()
        for i, layer in enumerate(cache.layers):
            append_layer(out, i, layer.keys.to(device, dtype), layer.values.to(device, dtype))
        return out

    def difference(got, want) -> float:
        worst = 0.0
        for a, b in zip(got.layers, want.layers):
            for x, y in ((a.keys, b.keys), (a.values, b.values)):
                worst = max(worst, float((x.float().cpu() - y).norm() / y.norm()))
        return worst

    result = {
        "device": str(device),
        "default_schedule": default_schedule(device),
        "triton": triton_rotate_kv() is not None,
    }
    for head_mode in ("all_heads", "same_head"):
        bridge = random_bridge(qwen3_shape_config("small-3l-2x64"), qwen3_shape_config("small-8l-2x64"), top_k=3,
                               head_mode=head_mode)  # fmt: skip
        ids = torch.randint(0, 1024, (2, 300), generator=torch.Generator().manual_seed(3))
        cache = output_cache(bridge.source.model(input_ids=ids, use_cache=True))
        reference = bridge.map_cache(cache, schedule="chunked")
        for dtype in (torch.float32, torch.bfloat16):
            there = copy.deepcopy(bridge).to(device=device, dtype=dtype)
            for model, original in ((there.source, bridge.source), (there.target, bridge.target)):
                # the rotary frequencies stay float32, as a model loaded in bfloat16 keeps them
                model.model.rotary_emb.inv_freq = original.model.rotary_emb.inv_freq.to(device)
            for schedule in (None, "chunked"):
                got = there.map_cache(moved(cache, dtype), schedule=schedule)
                name = f"{head_mode}_{str(dtype).removeprefix('torch.')}_{schedule or 'default'}"
                result[name] = difference(got, reference)
    return result


@torch.no_grad()
def vllm_helpers_step(device: torch.device) -> dict:
    """The vLLM connector's paged-cache read and its rotary-only target, on `device` against the CPU."""
    from types import SimpleNamespace

    from ...integrations.vllm.paged_cache import read_slots, reads_back, slots_of
    from ...integrations.vllm.rotary import RotaryOnlyTarget
    from ...utils.rope import rotary_cos_sin
    from .shapes import qwen3_shape_config

    generator = torch.Generator().manual_seed(0)
    blocks, block_size, heads, dim = 12, 16, 8, 128
    cache = torch.randn(2, blocks, block_size, heads, dim, generator=generator).to(torch.bfloat16)
    slots = slots_of([3, 7, 1, 10], block_size, 5, 57)

    def layer(on):
        return SimpleNamespace(kv_cache=cache.to(on), impl=SimpleNamespace())  # a FlashAttention-style layout

    keys_cpu, values_cpu = read_slots(layer("cpu"), slots)
    keys_dev, values_dev = read_slots(layer(device), slots)
    config = qwen3_shape_config("qwen3-1.7b")
    positions = torch.arange(4000, 4100).unsqueeze(0)
    cos_cpu, sin_cpu = rotary_cos_sin(RotaryOnlyTarget(config, torch.bfloat16, "cpu"), positions)
    cos_dev, sin_dev = rotary_cos_sin(RotaryOnlyTarget(config, torch.bfloat16, device), positions.to(device))
    return {
        "read_slots_equal": bool(torch.equal(keys_dev.cpu(), keys_cpu) and torch.equal(values_dev.cpu(), values_cpu)),
        "reads_back": bool(reads_back(layer(device), slots, keys_cpu.to(device), values_cpu.to(device))),
        "rotary_max_abs_difference": float(
            max((cos_dev.cpu() - cos_cpu).abs().max(), (sin_dev.cpu() - sin_cpu).abs().max())
        ),
        "device": str(device),
    }


# -- the run --------------------------------------------------------------------------------------------------------
def settings_for(smoke: bool, device: torch.device) -> dict:
    """What the run measures: the GPU run, or tiny shapes on the CPU for the test suite (`--smoke`)."""
    lengths = [int(n) for n in os.environ.get("LENGTHS", "1024,4096,8192,16384,32768").split(",")]
    if not smoke:
        return {
            "large": LARGE, "small": SMALL, "dtype": torch.bfloat16, "lengths": lengths, "ttft_lengths": [8192, 1024],
            "small_lengths": [1024, 8192], "top_k": 6, "prefill_repeats": 3, "map_repeats": 5, "ttft_repeats": 3,
            "compile": True, "compile_config": None, "budget": float(os.environ.get("BUDGET_S", 290)),
            "lambda_shape": (8, 128, 6, 16384),
            "calibration": _calibration_args("qwen3-0.6b:qwen3-1.7b", 16, 1024, "cuda", "40GB", "all_heads", 6,
                                             vocab=None),
            "limits": {"table": 75, "ttft": 150, "small_pair": 60, "calibration": 120, "lambda_search": 40},
        }  # fmt: skip
    from transformers import CompileConfig

    return {
        "large": SMOKE_LARGE, "small": SMOKE_LARGE, "dtype": torch.float32, "lengths": [32, 64],
        "ttft_lengths": [64, 32], "small_lengths": [32], "top_k": 3, "prefill_repeats": 1, "map_repeats": 1,
        "ttft_repeats": 1, "compile": True, "compile_config": CompileConfig(backend="eager", mode=None),
        "budget": 240.0, "lambda_shape": (2, 16, 2, 512),
        "calibration": _calibration_args("qwen3-0.6b:qwen3-1.7b", 6, 32, "cpu", "2GB", "same_head", 2, "2:2"),
        "limits": {"table": 60, "ttft": 90, "small_pair": 60, "calibration": 90, "lambda_search": 30},
    }  # fmt: skip


def _calibration_args(pair, sequences, seq_len, device, memory, head_mode, top_k, layers=None, vocab=4096) -> dict:
    return {
        "pair": pair, "num_sequences": sequences, "seq_len": seq_len, "batch_size": 4, "heldout_fraction": 0.125,
        "top_k": top_k, "head_mode": head_mode, "kv_mode": "joint", "statistics_memory": memory,
        "statistics_dtype": "float32", "statistics_device": device, "float32_matmul_precision": None,
        "dtype": "bfloat16" if device == "cuda" else "float32", "device": device, "vocab": vocab, "layers": layers,
        "progress": False,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=".", help="folder for bench-gpu.json")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (what the test suite runs)")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU, or pass --smoke for the CPU check")
    device = torch.device("cpu" if args.smoke else "cuda")
    settings = settings_for(args.smoke, device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run = Run(out / "bench-gpu.json", settings["budget"])
    run.results["smoke"] = args.smoke
    limits = settings["limits"]
    info = run.step("device", 30, lambda: device_step(device, settings["dtype"]))
    ceilings = (info or {}).get("ceilings") or {"matmul_flops_per_s": 1.0, "copy_bytes_per_s": 1.0}
    # first what needs no large model (short, and the GPU's memory free), then the large pair, the compiled hold-back
    # (whose compilation takes longest) last of it, then the small pair
    run.step("lambda_search", limits["lambda_search"], lambda: lambda_search_step(device, settings))
    run.step("vllm_helpers", 30, lambda: vllm_helpers_step(device))
    run.step("exactness", 60, lambda: exactness_step(device))
    run.step("calibration", limits["calibration"], lambda: calibration_step(settings))
    state: dict = {"ceilings": ceilings}
    if run.step("build_large", 60, lambda: build_pair(settings["large"], device, settings["dtype"], state)):
        for length in settings["lengths"]:
            run.step(f"table_{length}", limits["table"], lambda n=length: table_step(state, n, KINDS, settings))
        for kind in ("same_head", "all_heads"):
            for length in settings["ttft_lengths"]:
                step = lambda k=kind, n=length: ttft_step(state, k, n, settings)  # noqa: E731
                run.step(f"ttft_{kind}_{length}", limits["ttft"], step)
    state = {"ceilings": ceilings}
    _release()

    def small_pair() -> dict:
        built = build_pair(settings["small"], device, settings["dtype"], state)
        lengths, kinds = settings["small_lengths"], {"all_heads": KINDS["all_heads"]}
        rows = {n: table_step(state, n, kinds, settings) for n in lengths}
        ttft = {n: ttft_step(state, "all_heads", n, {**settings, "compile": False}) for n in lengths}
        return {"build": built, "table": rows, "ttft": ttft}

    run.step("small_pair", limits["small_pair"], small_pair)
    statuses = {name: record["status"] for name, record in run.results["steps"].items()}
    print(json.dumps(statuses, indent=1))
    print(f"wrote {run.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
