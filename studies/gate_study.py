"""Calibrating the quality gate: which probe score predicts that a transfer keeps less than a target retention.

For each pocket pair, one calibration; then on held-out windows (context + continuation) the bridge runs with the
gate switched on but never refusing (`gate_threshold = -1`), so that every window records its gate score (mean cosine
between the target's own K/V and the mapped K/V on the probe tokens, `hf_kvbridge.transfer.steps.probe_agreement`)
next to its continuation NLL in three modes: the target's own prefill, the gated bridge (the probe tokens are the
target's own, as under a real gate) and no context (`hf_kvbridge.tools.evaluation`). The same windows are also scored
by a
*broken* copy of each bridge (every target layer's source layers in reversed order), whose gate scores show what a
threshold must catch (`broken_scores`; not part of the threshold table).

For every candidate threshold `t` (each observed score), windows with score ≥ t pass (the bridge's cache is used), the
others fall back to the target's own prefill. Reported per threshold, pooled over all pairs' windows:

- `passed`: the share of windows that transfer;
- `retention_passed`: the context-benefit retention of the passed windows, pooled:
  Σ(NLL_no_context − NLL_bridge) / Σ(NLL_no_context − NLL_target) over them;
- `retention_system`: the same over all windows, the failed ones scored as the target (what a gated bridge delivers);
- `precision` / `recall` of passing as a test for a *good* window, one whose bridge NLL exceeds the target's by at
  most (1 − target retention) × the mean context benefit of all windows (a loss budget in nats per token; a
  per-window retention ratio would divide by a per-window benefit that is often near zero).

The chosen threshold is the lowest `t` (the most transfers) whose passed windows meet the target retention (a
threshold counts only when at least `min_passed` windows pass). When that is the lowest score seen, every window
passes: at that target the gate is not needed on these pairs.

    python -m studies.gate_study --pairs pocket-l:pocket-s pocket-m:pocket-s pocket-s:pocket-l \\
        --windows 32 --out runs/gate_study.json
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from hf_kvbridge import pocket
from hf_kvbridge.fitting.calibration.calibrate import calibrate
from hf_kvbridge.tools.evaluation import heldout_windows, score_tokens

PAIRS = ("pocket-l:pocket-s", "pocket-m:pocket-s", "pocket-s:pocket-l", "pocket-s:pocket-m", "pocket-m:pocket-l")
TARGET_RETENTION = 0.9
MODES = ("target", "bridge", "no_context")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pairs", nargs="+", default=list(PAIRS), help="SOURCE:TARGET pocket pairs")
    parser.add_argument("--num-sequences", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--windows", type=int, default=32, help="held-out windows per pair")
    parser.add_argument("--context", type=int, default=192)
    parser.add_argument("--continuation", type=int, default=32)
    parser.add_argument("--probe-tokens", type=int, default=8, help="the gate's probe (config.gate_probe_tokens)")
    parser.add_argument("--target-retention", type=float, default=TARGET_RETENTION)
    parser.add_argument("--min-passed", type=int, default=16, help="windows a threshold must pass to count")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/gate_study.json")


@torch.no_grad()
def measure_pair(source: str, target: str, args: argparse.Namespace) -> list[dict]:
    """One record per held-out window: its gate score and mean continuation NLL per mode."""
    tokenizer = AutoTokenizer.from_pretrained(pocket.model_path(target))
    bridge = calibrate(
        pocket.load_model(source),
        pocket.load_model(target),
        pocket.load_texts("calibration"),
        tokenizer=tokenizer,
        num_sequences=args.num_sequences,
        seq_len=args.seq_len,
        top_k=args.top_k,
        seed=args.seed,
        progress=False,
    )
    gated = bridge.with_mapper(bridge.mapper, copy.deepcopy(bridge.config))
    gated.config.gate_threshold, gated.config.gate_probe_tokens = -1.0, args.probe_tokens  # score, never refuse
    windows = heldout_windows(pocket.load_texts("heldout"), tokenizer, args.context + args.continuation, args.windows)
    broken = gated.with_mapper(copy.deepcopy(gated.mapper), copy.deepcopy(gated.config))
    broken.mapper.selected_layers = [list(reversed(layers)) for layers in broken.mapper.selected_layers]
    records, broken_scores = [], []
    for start in range(0, len(windows), 8):
        batch = windows[start : start + 8]
        nll = {mode: -score_tokens(gated, batch, args.context, mode).mean(-1) for mode in MODES}  # (B,) each
        scores = gated.last_transfer["scores"]  # from the bridge mode's prefill of this batch
        for row in range(batch.shape[0]):
            records.append(
                {"pair": f"{source}:{target}", "score": scores[row], **{m: float(nll[m][row]) for m in MODES}}
            )
        broken.prefill(batch[:, : args.context - broken.config.hold_back], source_logits=False)
        broken_scores += broken.last_transfer["scores"]
    return records, broken_scores


def _pooled(records: list[dict]) -> float | None:
    gain = sum(r["no_context"] - r["target"] for r in records)
    return sum(r["no_context"] - r["bridge"] for r in records) / gain if records and gain > 0 else None


def threshold_table(records: list[dict], target_retention: float, min_passed: int) -> dict:
    """Every candidate threshold's passed share, retentions, precision and recall, and the chosen threshold."""
    benefit = sum(r["no_context"] - r["target"] for r in records) / len(records)
    budget = (1.0 - target_retention) * benefit  # nats per token a good window may lose against the target
    good = [r["bridge"] - r["target"] <= budget for r in records]
    total_gain = sum(r["no_context"] - r["target"] for r in records)
    rows = []
    for t in sorted({r["score"] for r in records}, reverse=True):
        passed = [r["score"] >= t for r in records]
        kept = [r for r, p in zip(records, passed) if p]
        true_pos = sum(p and g for p, g in zip(passed, good))
        system = sum((r["no_context"] - (r["bridge"] if p else r["target"])) for r, p in zip(records, passed))
        rows.append(
            {
                "threshold": t,
                "passed": len(kept) / len(records),
                "passed_windows": len(kept),
                "retention_passed": _pooled(kept),
                "retention_system": system / total_gain if total_gain > 0 else None,
                "precision": true_pos / len(kept),
                "recall": true_pos / max(sum(good), 1),
            }
        )
    # the lowest threshold (the most transfers) whose passed windows meet the target retention
    meets = [
        row
        for row in rows
        if row["passed_windows"] >= min_passed
        and row["retention_passed"] is not None
        and row["retention_passed"] >= target_retention
    ]
    chosen = meets[-1] if meets else None
    return {
        "target_retention": target_retention,
        "loss_budget_nats": budget,
        "good_windows": sum(good),
        "rows": rows,
        "chosen": chosen,
    }


def pair_summary(records: list[dict]) -> list[dict]:
    out = []
    for pair in dict.fromkeys(r["pair"] for r in records):
        mine = [r for r in records if r["pair"] == pair]
        scores = sorted(r["score"] for r in mine)
        out.append(
            {
                "pair": pair,
                "windows": len(mine),
                "score_mean": sum(scores) / len(scores),
                "score_min": scores[0],
                "score_max": scores[-1],
                "retention": _pooled(mine),
            }
        )
    return out


def _spearman(x: list[float], y: list[float]) -> float:
    rank = lambda v: torch.tensor(v).argsort().argsort().double()  # noqa: E731 (no ties among float scores)
    a, b = rank(x), rank(y)
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


def run_study(args: argparse.Namespace) -> dict:
    started = time.perf_counter()
    records, broken = [], {}
    for pair in args.pairs:
        source, target = pair.split(":")
        pair_records, broken[pair] = measure_pair(source, target, args)
        records += pair_records
        print(f"{pair}: {len(records)} windows so far ({time.perf_counter() - started:.0f}s)", flush=True)
    table = threshold_table(records, args.target_retention, args.min_passed)
    return {
        "settings": {k: v for k, v in vars(args).items() if k != "func"},
        "pairs": pair_summary(records),
        "spearman_score_vs_loss": _spearman(
            [r["score"] for r in records], [r["bridge"] - r["target"] for r in records]
        ),
        "thresholds": table,
        "broken_scores": broken,
        "broken_score_max": max(max(scores) for scores in broken.values()),
        "records": records,
        "torch_threads": torch.get_num_threads(),
        "seconds": time.perf_counter() - started,
    }


def format_tables(result: dict, every: int = 0) -> str:
    """The per-pair table and the threshold table (every `every`-th threshold plus the chosen one; all if 0)."""

    def fmt(value):
        return "–" if value is None else f"{value:.3f}"

    lines = ["| pair | windows | gate score mean (min – max) | retention (gated bridge) |", "|---|---|---|---|"]
    for p in result["pairs"]:
        lines.append(
            f"| {p['pair'].replace(':', ' → ')} | {p['windows']} | {p['score_mean']:.4f} ({p['score_min']:.4f} – "
            f"{p['score_max']:.4f}) | {fmt(p['retention'])} |"
        )
    table = result["thresholds"]
    chosen = table["chosen"]
    lines += ["", "| threshold | passed | retention of passed | retention with fallback | precision | recall |"]
    lines.append("|---|---|---|---|---|---|")
    for i, row in enumerate(table["rows"]):
        if every and i % every and row is not chosen and i != len(table["rows"]) - 1:
            continue
        mark = " **chosen**" if row is chosen else ""
        lines.append(
            f"| {row['threshold']:.4f}{mark} | {row['passed']:.0%} | {fmt(row['retention_passed'])} | "
            f"{fmt(row['retention_system'])} | {row['precision']:.2f} | {row['recall']:.2f} |"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    result = run_study(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(format_tables(result, every=max(1, len(result["thresholds"]["rows"]) // 12)))
    chosen = result["thresholds"]["chosen"]
    if chosen is None:
        print(f"no threshold keeps retention ≥ {args.target_retention} on the passed windows")
    elif chosen is result["thresholds"]["rows"][-1]:
        print(f"every window passes at retention ≥ {args.target_retention}: no gate is needed on these pairs")
    else:
        print(
            f"chosen gate_threshold {chosen['threshold']:.4f}: {chosen['passed']:.0%} of windows transfer, retention "
            f"{chosen['retention_passed']:.3f} on them, precision {chosen['precision']:.2f}, recall "
            f"{chosen['recall']:.2f}"
        )
    print(
        f"Spearman(score, bridge − target NLL) = {result['spearman_score_vs_loss']:.3f}; broken bridges score at most "
        f"{result['broken_score_max']:.3f}; wrote {out}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
