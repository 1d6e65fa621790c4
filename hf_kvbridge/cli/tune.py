"""`kvbridge tune`: the arguments handed to `hf_kvbridge.tools.tune.search.run_tune`, and the choice printed.

The parser has checked the arguments (a quality target or a cost budget, a `--out` it may write to); the windows are
checked against the models' maximum positions here, before the calibration pass.
"""

from __future__ import annotations

import argparse

from . import keywords, model_load_kwargs
from .bridge import check_fits_the_models

TUNE_OPTIONS = (
    "num_sequences",
    "seq_len",
    "heldout_fraction",
    "seed",
    "tune_windows",
    "check_windows",
    "context",
    "continuation",
    "text_field",
    "out",
    "overwrite",
)
"""Options `kvbridge tune` hands to `hf_kvbridge.tools.tune.tune` under their own names."""


def tune(args: argparse.Namespace) -> int:
    """`kvbridge tune`: searches the grid the options describe, saves the choice to `--out`, prints it."""
    check_fits_the_models(
        (args.source, args.target),
        [
            ("--seq-len", args.seq_len, "pass a smaller --seq-len"),
            ("--context plus --continuation", args.context + args.continuation, "shorten them"),
        ],
    )
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
    result = run_tune(
        args.source,
        args.target,
        args.data,
        args.eval_data,
        min_retention=args.min_retention,
        max_cost=args.max_cost,
        grid=grid,
        **keywords(args, *TUNE_OPTIONS),
        json_path=args.json,
        **model_load_kwargs(args),
    )
    choice = result["choice"]
    print(
        f"chose {format_settings(choice['settings'])}: retention {choice['retention']:.3f} on the tuning windows, "
        f"{choice['check_retention']:.3f} on {result['settings']['check_windows']} check windows (gap recovered "
        f"{format_gap(choice['check_gap_recovered'], choice['check_gap_recovered_ci'])}), cost "
        f"{choice['cost']:.3f}; saved to {args.out}" + (f", all points in {args.json}" if args.json else "")
    )
    return 0
