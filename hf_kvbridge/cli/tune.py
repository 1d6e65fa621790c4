"""`kvbridge tune`: the pre-flight checks, and the arguments handed to `hf_kvbridge.tools.tune.search.run_tune`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import ContextLengthError
from .bridge import max_positions


def tune(args: argparse.Namespace) -> int:
    if args.min_retention is None and args.max_cost is None:
        print("error: pass --min-retention (a quality target), --max-cost (a cost budget), or both", file=sys.stderr)
        return 2
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.overwrite:  # refuse before the search, not after
        print(f"error: {out} is not empty; pass --overwrite to replace the bridge files in it", file=sys.stderr)
        return 2
    limits = [n for n in (max_positions(args.source), max_positions(args.target)) if n]
    if limits:
        ContextLengthError.check("--seq-len", args.seq_len, min(limits), "pass a smaller --seq-len")
        ContextLengthError.check(
            "--context plus --continuation", args.context + args.continuation, min(limits), "shorten them"
        )
    return run_tune_cli(args)


def run_tune_cli(args: argparse.Namespace) -> int:
    """`kvbridge tune`: the arguments are parsed and checked by the CLI (`kvbridge_cli/parser.py`)."""
    from ..tools.tune.choice import format_gap, format_settings
    from ..tools.tune.grid import TuneGrid
    from ..tools.tune.search import run_tune

    grid = TuneGrid(
        top_k=tuple(args.top_k),
        ridge_lambdas=tuple(args.ridge_lambdas),
        kv_modes=tuple(args.kv_modes),
        ranks=tuple(args.ranks),
        recompute_fractions=tuple(args.recompute_fractions),
        recompute_layers=tuple(args.recompute_layers),
        mlp_hidden=tuple(args.mlp_hidden),
        mlp_loss=args.mlp_loss,
        mlp_epochs=args.mlp_epochs,
        hidden_states=tuple(args.hidden_states),
        hidden_state_layers=args.hidden_state_layers,
    )
    load_kwargs = {"dtype": args.dtype} if args.dtype else {}
    result = run_tune(
        args.source,
        args.target,
        args.data,
        args.eval_data,
        min_retention=args.min_retention,
        max_cost=args.max_cost,
        grid=grid,
        num_sequences=args.num_sequences,
        seq_len=args.seq_len,
        heldout_fraction=args.heldout_fraction,
        seed=args.seed,
        tune_windows=args.tune_windows,
        check_windows=args.check_windows,
        context=args.context,
        continuation=args.continuation,
        text_field=args.text_field,
        out=args.out,
        overwrite=args.overwrite,
        json_path=args.json,
        **load_kwargs,
    )
    choice = result["choice"]
    print(
        f"chose {format_settings(choice['settings'])}: retention {choice['retention']:.3f} on the tuning windows, "
        f"{choice['check_retention']:.3f} on {result['settings']['check_windows']} check windows (gap recovered "
        f"{format_gap(choice['check_gap_recovered'], choice['check_gap_recovered_ci'])}), cost "
        f"{choice['cost']:.3f}; saved to {args.out}" + (f", all points in {args.json}" if args.json else "")
    )
    return 0
