"""`kvbridge bench mapper`, `calibration`, `vllm` and `store`: their arguments handed to `hf_kvbridge.tools.bench`, the
figures printed and written."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from . import keywords


def bench(args: argparse.Namespace) -> int:
    """`kvbridge bench mapper|calibration|vllm|store`."""
    commands = {"mapper": bench_mapper, "calibration": bench_calibration, "distill": bench_distill, "vllm": bench_vllm,
                "store": bench_store}  # fmt: skip
    return commands[args.bench](args)


def bench_mapper(args: argparse.Namespace) -> int:
    """`kvbridge bench mapper`: a saved bridge (or random weights of public Qwen3 shapes) timed per context length."""
    import torch

    from ..errors import ContextLengthError, InvalidInputError
    from ..tools.bench.floors import measure_ceilings
    from ..tools.bench.mapper import (
        NEW_DEFAULT,
        OLD_DEFAULT,
        benchmark,
        format_old_vs_new,
        format_table,
        old_vs_new,
    )
    from ..tools.bench.ops import format_measures
    from ..tools.bench.shapes import QWEN3_SHAPES, SMALL_SHAPES, qwen3_shape_config, random_bridge, shape_pair
    from ..tools.bench.ttft import end_to_end, format_ttft
    from ..tools.defaults import BENCH_LENGTHS
    from ..utils import precision

    dtype = getattr(torch, args.dtype)
    mapper_dtype = getattr(torch, args.mapper_dtype or args.dtype)
    if args.shapes:
        source_name, target_name = shape_pair(args.shapes, "--shapes", {**QWEN3_SHAPES, **SMALL_SHAPES})
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
        from ..modeling import KVBridgeForCausalLM

        bridge = KVBridgeForCausalLM.from_pretrained(args.bridge, dtype=dtype, device_map=args.device)
        bridge.mapper.to(dtype=mapper_dtype)
        what = f"{bridge.config.source_name_or_path} → {bridge.config.target_name_or_path} ({args.bridge})"
    else:
        raise InvalidInputError("pass a bridge folder or --shapes SOURCE:TARGET")
    old_new = getattr(args, "old_vs_new", False)  # with --interleave refused by the parser's checks
    if (
        mapper_dtype == torch.bfloat16
        and torch.device(args.device).type == "cpu"
        and not precision.bf16_matmul_units("cpu")
    ):
        print(
            f"note: this CPU ({torch.backends.cpu.get_cpu_capability()}) has no bfloat16 matrix units; bfloat16 "
            "products are emulated and far slower than float32 here",
            file=sys.stderr,
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    limit = bridge.max_positions
    if args.lengths is None:  # the defaults, cut to what the models take
        lengths = [n for n in BENCH_LENGTHS if n <= limit] or [limit]
    else:
        lengths = args.lengths
        ContextLengthError.check("a --lengths entry", max(lengths), limit, f"pass lengths up to {limit:,}")
    if old_new:
        rows = old_vs_new(bridge, lengths, batch=args.batch, repeats=args.repeats, warmup=args.warmup)
        print(
            f"{what}; {args.dtype} models, {mapper_dtype} mapper on {args.device}, {torch.get_num_threads()} threads, "
            f"old and new default mapping in alternating rounds, median of {args.repeats}\n"
            f"old: {OLD_DEFAULT}\nnew: {NEW_DEFAULT}"
        )
        print(format_old_vs_new(rows))
        if args.json:
            with open(args.json, "w") as handle:
                payload = {
                    "bridge": what,
                    "old_default": OLD_DEFAULT,
                    "new_default": NEW_DEFAULT,
                    "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                    "cpu_bf16_units": precision.bf16_matmul_units("cpu"),
                    "old_vs_new": rows,
                }
                json.dump(payload, handle, indent=2)
            print(f"wrote {args.json}")
        return 0
    ceilings = measure_ceilings(torch.device(args.device), mapper_dtype)  # the FLOP and memory floors' rates
    rows = benchmark(bridge, lengths, batch=args.batch, repeats=args.repeats, warmup=args.warmup,
                     interleave=args.interleave, schedule=args.schedule, ceilings=ceilings)  # fmt: skip
    order = "interleaved rounds" if args.interleave else "each in a row"
    print(
        f"{what}; {args.dtype} models, {mapper_dtype} mapper on {args.device}, {torch.get_num_threads()} threads, "
        f"median of {args.repeats} ({order}), {rows[0]['schedule']} schedule"
    )
    print(format_table(rows))
    print(format_measures(rows))
    ttft = None
    if args.end_to_end:
        ttft = end_to_end(bridge, lengths, batch=args.batch, repeats=args.repeats, warmup=args.warmup,
                          compile_hold_back=args.compile_hold_back)  # fmt: skip
        print(format_ttft(ttft))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"bridge": what, "ceilings": ceilings, "rows": rows, "ttft": ttft}, handle, indent=2)
        print(f"wrote {args.json}")
    return 0


def bench_calibration(args: argparse.Namespace) -> int:
    """`kvbridge bench calibration`: prints the result (and writes it with `--json`)."""
    from ..tools.bench.calibration import CalibrationWorkload, flop_model_report, format_flop_table, memory_table, run
    from ..utils.sizes import format_bytes

    if args.memory_model:
        print(memory_table())
        return 0
    workload = CalibrationWorkload(
        **keywords(args, *(field.name for field in dataclasses.fields(CalibrationWorkload)))
    )
    if args.flop_model:
        result = flop_model_report(workload, fit_passes=args.fit_passes)
        print(
            f"{args.pair}, top-k {args.top_k}, {args.head_mode} / {args.kv_mode}, {result['tokens']:,} tokens, "
            f"fit passes of {result['fit_passes']} target layers, {result['flops']['maps']} maps"
        )
        print(format_flop_table(result))
        for device in result["devices"]:
            per_core = device.get("tokens_per_second_per_core")
            core = f" ({per_core:,.1f} per core)" if per_core else ""
            print(f"{device['rates']['name']}: {device['tokens_per_second']:,.1f} tokens/s{core}; "
                  f"rates from {device['rates']['source']}")  # fmt: skip
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
        return 0
    result = run(
        workload,
        **keywords(args, "batch_size", "heldout_fraction", "statistics_device"),
        matmul_precision=args.float32_matmul_precision,
        layers=args.layers,
        progress=args.progress,
    )
    text = json.dumps(result, indent=2)
    print(text)
    seconds = {k: result[f"{k}_seconds"] for k in ("forward", "statistics", "selection", "lambda", "solve")}
    print("time split (s): " + ", ".join(f"{k} {v}" for k, v in seconds.items()))
    for label, part in (("", result), (" (the whole pair, scaled from its first layers)", result.get("full_depth"))):
        if part is None:
            continue
        projected = part["projection"]
        if projected["seconds"] is None:
            print(f"projected to {projected['tokens']:,} tokens{label}: forwards {projected['forward_seconds']:,} s; "
                  f"the rest not projected: {projected['not_projected']}")  # fmt: skip
        else:
            print(
                f"projected to {projected['tokens']:,} tokens{label}: {projected['seconds']:,} s, of which forwards "
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


def bench_distill(args: argparse.Namespace) -> int:
    """`kvbridge bench distill`: a measured training step at real shapes, or with `--flop-model` the plan on paper."""
    import torch

    from ..tools.bench.distill import DistillWorkload, flop_model_report, format_report, run

    workload = DistillWorkload(
        **keywords(args, "pair", "seq_len", "continuation_len", "top_k", "head_mode", "dtype", "device", "windows",
                   "epochs", "pull_candidates", "fit_passes")
    )  # fmt: skip
    workload.configs()  # an unknown shape is refused before any model is built
    if args.continuation_len >= args.seq_len:
        from ..errors import InvalidInputError

        raise InvalidInputError(
            f"--continuation-len {args.continuation_len} must be below --seq-len {args.seq_len} (the rest is the "
            "context the source prefills)"
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    result = flop_model_report(workload) if args.flop_model else run(workload, steps=args.steps)
    print(format_report(result))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2, default=str)
        print(f"wrote {args.json}")
    return 0


def bench_vllm(args: argparse.Namespace) -> int:
    """`kvbridge bench vllm`: vLLM is imported here (in each engine's process), when the benchmark runs."""
    from pathlib import Path

    from ..tools.bench.vllm import run_benchmark

    names = ("lengths", "bridge", "shapes", "pair", "num_sequences", "seq_len", "top_k", "repeats", "requests",
             "max_tokens", "dtype", "block_size", "kv_cache_gb", "max_model_len", "store", "chunk_sizes",
             "fetch_parts", "source_throughput", "source_rounds")  # fmt: skip
    result = run_benchmark(**{name: getattr(args, name) for name in names if getattr(args, name, None) is not None})
    result["settings"] = vars(args)
    text = json.dumps(result, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    else:
        print(text)
    return 0


def bench_store(args: argparse.Namespace) -> int:
    """`kvbridge bench store`: the store's put and fetch beside raw SET/GET; prints the table (and writes the JSON)."""
    from pathlib import Path

    from ..tools.bench.store import format_store_table, run_store_benchmark

    if args.retention:
        from ..tools.bench.store_retention import format_retention, pocket_encoding_retention

        result = pocket_encoding_retention(args.retention, windows=args.windows)
        print(format_retention(result))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
            print(f"wrote {args.json}")
        return 0
    result = run_store_benchmark(
        args.store, args.shapes, args.tokens, chunk_size=args.chunk_size, repeats=args.repeats, dtype=args.dtype,
        encoding=args.encoding, connections=args.connections,
    )  # fmt: skip
    print(
        f"{result['shapes']} source K/V ({result['dtype']}, encoding {result['encoding']}), store {result['store']}, "
        f"{result['connections']} connection(s), chunks of {result['chunk_size']} tokens, median of "
        f"{result['repeats']} alternating rounds; GB/s"
    )
    print(format_store_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
