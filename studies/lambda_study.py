"""How much the ridge strength matters: the old fixed λ = 0.01, auto-λ (chosen per target layer by held-out R²) and
the best fixed λ in hindsight, on the pocket pairs in both directions.

Each pair is calibrated once; every λ setting is fitted from the same statistics (`fit_bridge`) and measured on
held-out text: context-benefit retention (NLL_no_context − NLL_bridge) / (NLL_no_context − NLL_target), R² of the
mapped K and V against the target's own (`mapped_r2`, mean of K and V) and the mean attention-output cosine. The
"best fixed λ in hindsight" is the grid value with the best retention on the evaluation windows themselves (an upper
bound no calibration-time rule can claim).

Run (quality figures only; no timings):

    python -m studies.lambda_study --out lambda_study.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from transformers import AutoTokenizer

from hf_kvbridge import pocket
from hf_kvbridge.fitting.attention import attention_output_cosine
from hf_kvbridge.fitting.calibration.calibrate import fit_bridge
from hf_kvbridge.tools.evaluation import heldout_windows, mean_nll
from studies.correlation_study import mapped_r2, refit_base

DEFAULT_PAIRS = (
    "pocket-s:pocket-m",
    "pocket-m:pocket-s",
    "pocket-s:pocket-l",
    "pocket-l:pocket-s",
    "pocket-m:pocket-l",
    "pocket-l:pocket-m",
)
FIXED_GRID = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)


def run_lambda_study(
    pairs=DEFAULT_PAIRS,
    *,
    num_sequences: int = 32,
    seq_len: int = 256,
    top_k: int = 3,
    windows: int = 16,
    context: int = 192,
    continuation: int = 32,
    fixed_grid=FIXED_GRID,
    seed: int = 0,
    progress=print,
    partial_path: str | Path | None = None,
) -> dict:
    """Measures the old default (λ = 0.01), auto-λ and every fixed λ of `fixed_grid` on each pair.

    Args:
        partial_path (`str` or `Path`, *optional*): rewrite the rows measured so far there after every pair.

    Returns:
        `dict` with `rows` (one per pair: retention, R² and attention cosine of `old_default`, `auto`,
        `best_fixed` (with its λ), the chosen λ range of auto) and `points` (every fixed λ), plus the settings.

    Example:

    ```python
    >>> from studies.lambda_study import run_lambda_study
    >>> result = run_lambda_study(["pocket-s:pocket-m"], num_sequences=8, seq_len=128)  # doctest: +SKIP
    ```
    """
    tokenizer = AutoTokenizer.from_pretrained(pocket.model_path(pairs[0].split(":")[1]))  # shared by the family
    held = heldout_windows(pocket.load_texts("heldout"), tokenizer, context + continuation, windows)
    models: dict = {}
    rows, points = [], []
    for pair in pairs:
        started = time.perf_counter()
        sizes = {"num_sequences": num_sequences, "seq_len": seq_len, "top_k": top_k, "seed": seed}
        base, train, heldout, reference, gain = refit_base(pair, tokenizer, models, held, context, **sizes)
        progress(f"{pair}: calibrated in {time.perf_counter() - started:.0f}s")

        def measure(bridge, label, lam, pair=pair, reference=reference, gain=gain):
            r2 = mapped_r2(bridge, held[:4])
            nll = mean_nll(bridge, held, context, "bridge")
            point = {
                "pair": pair,
                "setting": label,
                "ridge_lambda": lam,
                "retention": (reference["no_context"] - nll) / gain,
                "r2": (r2["k"] + r2["v"]) / 2,
                "attention_cosine": float(attention_output_cosine(bridge, held[:4]).mean()),
                "calibration_heldout_r2": sum(bridge.config.heldout_r2["k"] + bridge.config.heldout_r2["v"])
                / (2 * len(bridge.config.heldout_r2["k"])),
            }
            progress(
                f"  {label} λ={lam}: retention {point['retention']:.4f}  R² {point['r2']:.4f}  attn cos "
                f"{point['attention_cosine']:.4f}"
            )
            return point

        auto = measure(base, "auto", "auto")  # `calibrate` fits auto-λ by default
        chosen = [v for kv in ("k", "v") for layer in base.config.ridge_lambdas[kv] for v in layer]
        auto["chosen_min"], auto["chosen_max"] = min(chosen), max(chosen)
        fixed = []
        for lam in sorted(set(fixed_grid) | {0.01}):
            bridge = fit_bridge(base.source, base.target, train, heldout, top_k=top_k, ridge_lambda=lam)
            fixed.append(measure(bridge, "fixed", lam))
        points += [auto, *fixed]
        old = next(p for p in fixed if p["ridge_lambda"] == 0.01)
        best = max(fixed, key=lambda p: p["retention"])
        # NLL the target's own cache saves over no context: how much the target uses its context at all
        rows.append({"pair": pair, "old_default": old, "auto": auto, "best_fixed": best, "context_gain": gain})
        if partial_path is not None:
            Path(partial_path).write_text(json.dumps({"rows": rows, "points": points}, indent=2) + "\n")
    return {
        "rows": rows,
        "points": points,
        "settings": {
            "pairs": list(pairs),
            "num_sequences": num_sequences,
            "seq_len": seq_len,
            "top_k": top_k,
            "windows": windows,
            "context": context,
            "continuation": continuation,
            "fixed_grid": list(fixed_grid),
            "seed": seed,
        },
    }


def markdown_table(result: dict) -> str:
    """The README table: retention / R² / attention cosine of λ = 0.01, auto-λ and the best fixed λ per pair."""
    lines = [
        "| pair | retention λ=0.01 | retention auto | retention best fixed (λ) | R² 0.01 / auto "
        "| attn cos 0.01 / auto | auto λ range |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        old, auto, best = row["old_default"], row["auto"], row["best_fixed"]
        lines.append(
            f"| {row['pair'].replace(':', ' → ')} | {old['retention']:.3f} | {auto['retention']:.3f} | "
            f"{best['retention']:.3f} ({best['ridge_lambda']:g}) | {old['r2']:.3f} / {auto['r2']:.3f} | "
            f"{old['attention_cosine']:.4f} / {auto['attention_cosine']:.4f} | "
            f"{auto['chosen_min']:g} – {auto['chosen_max']:g} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", nargs="+", default=list(DEFAULT_PAIRS), help="source:target pocket names")
    parser.add_argument("--num-sequences", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--fixed-grid", type=float, nargs="+", default=list(FIXED_GRID), help="fixed λ to compare")
    parser.add_argument("--out", default="lambda_study.json")
    args = parser.parse_args(argv)
    result = run_lambda_study(
        args.pairs,
        num_sequences=args.num_sequences,
        seq_len=args.seq_len,
        top_k=args.top_k,
        windows=args.windows,
        fixed_grid=args.fixed_grid,
        partial_path=Path(args.out).with_suffix(".partial.json"),
    )
    Path(args.out).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    print(markdown_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
