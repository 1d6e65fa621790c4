"""`kvbridge eval` (source, target, bridge and the controls through lm-eval: one retention table) and `kvbridge
inspect` (the diagnostics report of a saved bridge)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from ..errors import ContextLengthError
from . import keywords, model_load_kwargs

logger = logging.getLogger(__name__)


def evaluate(args: argparse.Namespace) -> int:
    """`kvbridge eval`: prints the table, optionally writes JSON and the model card (the parser has checked the
    modes, and that `--write-card` has a local checkpoint folder to write into)."""
    import torch

    from ..controls import CONTROL_MARGIN
    from ..integrations.hub import read_eval_table, render_model_card
    from ..modeling import KVBridgeForCausalLM
    from ..tools.task_retention import evaluate_modes

    modes = tuple(args.modes)
    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    bridge = KVBridgeForCausalLM.from_pretrained(args.bridge, revision=args.revision, **model_load_kwargs(args))
    bridge.to(args.device or ("cuda" if torch.cuda.is_available() else "cpu")).eval()
    tasks = [t.strip() for t in (args.tasks or "").split(",") if t.strip()]
    heldout = _heldout(args, bridge) if args.heldout else None
    out = {"rows": [], "table": "", "warnings": [], "results": {}}
    if tasks:
        out = evaluate_modes(
            bridge,
            tasks,
            modes=modes,
            include_path=args.include_path,
            limit=limit,
            **keywords(args, "num_fewshot", "batch_size", "bootstrap_iters", "rolling_stride"),
        )
        print(out["table"])
    for line in out["warnings"]:
        print(line, file=sys.stderr)
    if heldout is not None:
        print(heldout["table"])
    if args.output:
        from ..version import __version__

        payload = {
            "bridge": str(args.bridge),
            "source": bridge.config.source_name_or_path,
            "target": bridge.config.target_name_or_path,
            "tasks": tasks,
            "limit": limit,
            "num_fewshot": args.num_fewshot,
            "modes": list(modes),
            "rows": out["rows"],
            "table": out["table"],
            "controls_flagged": [f"{r['task']} {r['metric']}" for r in out["rows"] if r.get("controls_flag")],
            "control_margin": CONTROL_MARGIN,
            "hf_kvbridge_version": __version__,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            # lm-eval's own results per mode (configs, sample counts, versions), JSON-safe
            "lm_eval_results": json.loads(json.dumps(out["results"], default=str)),
        }
        if tasks:
            import lm_eval

            payload["lm_eval_version"] = lm_eval.__version__
        if heldout is not None:  # one report per direction (`tools.fidelity.heldout_fidelity`)
            payload["heldout"] = heldout["reports"]
            payload["heldout_data"] = str(args.heldout)
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        print(f"wrote {args.output}")
    if args.write_card:
        card_path = Path(args.bridge) / "README.md"
        previous = card_path.read_text(encoding="utf-8") if card_path.is_file() else ""
        if read_eval_table(previous):
            logger.info("replacing the retention table in %s", card_path)
        table = out["table"]
        if heldout is not None:
            table = "\n\n".join(part for part in (table, heldout["table"]) if part)
        if limit is not None and tasks:  # a subset is not the task: say so next to the numbers
            docs = f"the first {limit}" if isinstance(limit, int) else f"the first {limit:.0%} of the"
            table += f"\n\nEvaluated on {docs} documents of each task (`--limit {args.limit:g}`), not the full tasks."
        flagged = [f"{row['task']} {row['metric']}" for row in out["rows"] if row.get("controls_flag")]
        if flagged:
            table += (
                f"\n\nFlagged by the controls (a zero or random cache comes within {CONTROL_MARGIN} of the bridge's "
                f"retention): {', '.join(flagged)}."
            )
        render_model_card(bridge.config, eval_table=table).save(card_path)
        print(f"wrote the table into {card_path}")
    return 0


def _heldout(args: argparse.Namespace, bridge) -> dict:
    """`--heldout`: the bridge (and with `--both-directions` / `--reverse` the other direction) on the same held-out
    windows and probe items; `{"reports": [...], "table": markdown}`."""
    from ..errors import ConfigurationError
    from ..modeling import KVBridgeForCausalLM
    from ..tools.fidelity import evaluate_heldout, format_fidelity

    bridges = [bridge]
    if args.reverse:  # the other direction's checkpoint, on the models already loaded (its fingerprints checked)
        bridges.append(
            KVBridgeForCausalLM.from_pretrained(args.reverse, source_model=bridge.target, target_model=bridge.source)
        )
    elif args.both_directions:
        if bridge.reverse is None:
            raise ConfigurationError(
                f"{args.bridge} has no reverse mapper for --both-directions; calibrate it with --bidirectional, or "
                "pass the other direction's bridge with --reverse"
            )
        bridges.append(bridge.reverse)
    reports = evaluate_heldout(
        bridges,
        args.heldout,
        windows=args.windows,
        context_len=args.context_len,
        continuation_len=args.continuation_len,
        probe_items=args.probe_items,
        probe_context=args.probe_context,
        controls=any(mode in args.modes for mode in ("zero_cache", "random_cache")),
        iterations=args.bootstrap,
    )
    return {"reports": reports, "table": "\n\n".join(format_fidelity(report) for report in reports)}


def inspect(args: argparse.Namespace) -> int:
    from hf_kvbridge import KVBridgeForCausalLM
    from hf_kvbridge.tools.diagnostics import inspect_bridge, write_inspect_outputs

    bridge = KVBridgeForCausalLM.from_pretrained(args.bridge)
    ContextLengthError.check("--seq-len", args.seq_len, bridge.max_positions, "pass a smaller --seq-len")
    report = inspect_bridge(
        bridge, args.data, num_sequences=args.num_sequences, seq_len=args.seq_len, batch_size=args.batch_size
    )
    files = write_inspect_outputs(report, args.out)
    summary = report["summary"]
    print(
        f"{report['source']} → {report['target']} ({report['mapper_type']}), {report['windows']} windows × "
        f"{report['seq_len']} tokens"
    )
    print(f"ridge λ: {report['ridge_lambda']} (relative to each input feature's variance)")
    print(f"{'layer':<6}{'R² K':>8}{'R² V':>8}{'attn cos':>10}{'key err':>9}{'λ K':>10}{'λ V':>10}")
    lam = report["ridge_lambda_layer"]
    for t, cos in enumerate(report["attention_cosine"]):
        r2 = report["mapper_r2_layer"]
        print(
            f"{t:<6}{r2['k'][t]:>8.4f}{r2['v'][t]:>8.4f}{cos:>10.4f}{report['key_error_layer'][t]:>9.4f}"
            f"{lam['k'][t]:>10.3g}{lam['v'][t]:>10.3g}"
        )
    print(
        f"mean  R² K {summary['mapper_r2_k']:.4f}  R² V {summary['mapper_r2_v']:.4f}  attention cosine "
        f"{summary['attention_cosine']:.4f}  key error {summary['key_error']:.4f}"
    )
    print(f"wrote {', '.join(files)} to {args.out}")
    return 0
