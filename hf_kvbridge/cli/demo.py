"""`kvbridge demo`: the threads, the output folder and the report around `hf_kvbridge.tools.demo.measure`."""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

from . import keywords


def demo(args: argparse.Namespace) -> int:
    """`kvbridge demo`: calibrates and measures a pocket bridge, prints the report and writes it into a new folder
    (the parser has refused a pair of one model)."""
    import torch

    from ..tools.demo import (
        BUSY_WARNING_SHARE,
        busy_share,
        choose_threads,
        describe_threads,
        measure,
        report,
        write_outputs,
    )

    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) / f"{args.source}-to-{args.target}-{stamp}"  # a new folder: earlier runs are kept
    busy = busy_share()
    threads, why = choose_threads(getattr(args, "threads", None), busy)
    torch.set_num_threads(threads)
    print(f"using {describe_threads(threads)} ({why})")
    machine_busy = busy is not None and busy >= BUSY_WARNING_SHARE
    if machine_busy:
        print(
            f"warning: other processes keep {busy:.0%} of the CPUs busy; timings will be slower and noisier than on "
            "a quiet machine (quality figures are not affected)",
            file=sys.stderr,
        )
    results = measure(
        args.source,
        args.target,
        **keywords(args, "quick", "top_k", "ridge_lambda", "head_mode", "num_sequences", "seq_len", "seed"),
    )
    results["machine_busy"] = machine_busy
    results["cpu_busy_share_before"] = busy
    print()
    print(report(results))
    write_outputs(results, out)
    print(f"\nwrote {out}/results.json, r2_vs_k.png, attention_cosine.png, r2_heatmap.png")
    return 0
