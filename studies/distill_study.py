"""Retention of distilled bridges on the pocket family, in `kvbridge demo`'s own measurement (its 64 held-out windows
of 384 + 128 tokens, `tools.defaults.DEMO_SIZES`), with paired bootstrap 95% intervals; the closed-form calibration
and the distillation timed side by side on the same machine.

    python -m studies.distill_study --pairs pocket-s:pocket-l,pocket-l:pocket-s --out distill_results.json

Calibration: the demo's settings (128 windows × 512 tokens of the calibration split, top-k 6, λ auto, seed 0; add
`--head-mode same_head`, the source's hidden states as extra features with `--hidden-state-layers all`, or another
closed form with `--mapper-type`, e.g. `ridge_attention_weighted`).
Distillation: `hf_kvbridge.distill` on the whole calibration split (never the held-out
split the windows below come from). Evaluation: `tools.evaluation.window_nll` per window for target, no context,
closed form and distilled; retention and its interval by `tools.fidelity.paired_bootstrap`; next-token KL.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

import hf_kvbridge
from hf_kvbridge import pocket
from hf_kvbridge.fitting.data import iter_texts
from hf_kvbridge.tools.defaults import DEMO_SETTINGS, DEMO_SIZES
from hf_kvbridge.tools.evaluation import heldout_windows, window_nll
from hf_kvbridge.tools.fidelity import next_token_kl, paired_bootstrap, retention_of
from studies.recompute_study import hidden_state_layers


def measure_pair(
    source: str,
    target: str,
    head_mode: str,
    distill_kwargs: dict,
    hidden_states=None,
    mapper_type: str = "ridge",
    other_text: str | None = None,
    calibration_sequences: int | None = None,
) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(pocket.model_path(target))
    small, large = pocket.load_model(source), pocket.load_model(target)
    texts = pocket.load_texts("calibration")
    calibration_sequences = calibration_sequences or DEMO_SIZES["num_sequences"][0]
    started = time.perf_counter()
    bridge = hf_kvbridge.calibrate(
        small, large, texts, tokenizer=tokenizer, num_sequences=calibration_sequences,
        seq_len=DEMO_SIZES["seq_len"][0], top_k=DEMO_SETTINGS["top_k"], ridge_lambda=DEMO_SETTINGS["ridge_lambda"],
        head_mode=head_mode, seed=DEMO_SETTINGS["seed"], hidden_state_layers=hidden_states, mapper_type=mapper_type,
    )  # fmt: skip
    calibration_s = time.perf_counter() - started
    started = time.perf_counter()
    distilled = hf_kvbridge.distill(bridge, texts, tokenizer=tokenizer, progress=True, **distill_kwargs)
    distill_s = time.perf_counter() - started
    context, continuation = DEMO_SIZES["nll_context"][0], DEMO_SIZES["nll_continuation"][0]
    windows = heldout_windows(
        pocket.load_texts("heldout"), tokenizer, context + continuation, DEMO_SIZES["nll_windows"][0]
    )
    nll, kl = _scores(bridge, distilled, windows, context)
    other = {}
    if other_text:  # text of another kind than the calibration's: does what distillation learnt carry over?
        texts_other = [text for path in other_text.split(",") for text in iter_texts(path)]
        windows_other = heldout_windows(texts_other, tokenizer, context + continuation, DEMO_SIZES["nll_windows"][0])
        nll_other, kl_other = _scores(bridge, distilled, windows_other, context)
        other = {"other_text": {
            "data": other_text,
            "windows": int(len(windows_other)),
            "retention_closed_form": paired_bootstrap(nll_other, retention_of("bridge")),
            "retention_distilled": paired_bootstrap(nll_other, retention_of("distilled")),
            "retention_gain": paired_bootstrap(
                nll_other, lambda s: retention_of("distilled")(s) - retention_of("bridge")(s)
            ),
            "kl_closed_form": paired_bootstrap(kl_other, lambda s: float(s["closed_form"].mean())),
            "kl_distilled": paired_bootstrap(kl_other, lambda s: float(s["distilled"].mean())),
        }}  # fmt: skip
    return {
        "pair": f"{source} → {target}",
        "head_mode": head_mode,
        "mapper_type": mapper_type,
        "calibration_sequences": calibration_sequences,
        "hidden_state_layers": hidden_states,
        "retention_closed_form": paired_bootstrap(nll, retention_of("bridge")),
        "retention_distilled": paired_bootstrap(nll, retention_of("distilled")),
        "retention_gain": paired_bootstrap(nll, lambda s: retention_of("distilled")(s) - retention_of("bridge")(s)),
        "kl_closed_form": paired_bootstrap(kl, lambda s: float(s["closed_form"].mean())),
        "kl_distilled": paired_bootstrap(kl, lambda s: float(s["distilled"].mean())),
        "calibration_seconds": round(calibration_s, 1),
        "distillation_seconds": round(distill_s, 1),
        "time_ratio": round(distill_s / calibration_s, 2),
        "distillation": distilled.config.distillation,
        "per_window_nll": {mode: values.tolist() for mode, values in nll.items()},
        **other,
    }


def _scores(bridge, distilled, windows, context: int) -> tuple[dict, dict]:
    """Per-window NLL (target, no context, closed form, distilled) and next-token KL (closed form, distilled)."""
    nll = {mode: window_nll(bridge, windows, context, mode) for mode in ("target", "no_context", "bridge")}
    nll["distilled"] = window_nll(distilled, windows, context, "bridge")
    kl = {
        "closed_form": next_token_kl(bridge, windows, context),
        "distilled": next_token_kl(distilled, windows, context),
    }
    return nll, kl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", default="pocket-s:pocket-l,pocket-l:pocket-s")
    parser.add_argument("--head-mode", default="all_heads")
    parser.add_argument("--mapper-type", default="ridge", help="the closed form distilled from (calibrate's)")
    parser.add_argument("--out", default="distill_results.json")
    parser.add_argument("--num-sequences", type=int, default=304)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--pull", default="0,1")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--teacher-cache", default="4GB", help="DistillationSettings.teacher_cache (0: off)")
    parser.add_argument("--nll-weight", type=float, default=0.0, help="DistillationSettings.nll_weight")
    parser.add_argument("--select-by", default="kl", help="DistillationSettings.select_by (kl or nll)")
    parser.add_argument("--batch-size", type=int, default=8, help="DistillationSettings.batch_size")
    parser.add_argument(
        "--calibration-sequences", type=int, default=None,
        help="windows of the closed-form calibration (default: the demo's 128)",
    )  # fmt: skip
    parser.add_argument(
        "--other-text",
        help="also evaluate on text of another kind (comma-separated files of any name, or folders of .txt/.jsonl)",
    )
    parser.add_argument(
        "--hidden-state-layers",
        type=hidden_state_layers,
        help="the source's hidden states as extra features (comma-separated entries, or 'all')",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kwargs = {"num_sequences": args.num_sequences, "epochs": args.epochs, "lr": args.lr,
              "pull": [float(p) for p in args.pull.split(",")], "teacher_cache": args.teacher_cache,
              "nll_weight": args.nll_weight, "select_by": args.select_by,
              "batch_size": args.batch_size}  # fmt: skip
    results = []
    for pair in args.pairs.split(","):
        source, target = pair.split(":")
        results.append(
            measure_pair(
                source,
                target,
                args.head_mode,
                kwargs,
                args.hidden_state_layers,
                args.mapper_type,
                args.other_text,
                args.calibration_sequences,
            )
        )
        r = results[-1]
        print(
            f"{r['pair']} ({args.head_mode}): retention {r['retention_closed_form']['value']:.3f} → "
            f"{r['retention_distilled']['value']:.3f} [{r['retention_distilled']['low']:.3f}, "
            f"{r['retention_distilled']['high']:.3f}], time ratio {r['time_ratio']}",
            flush=True,
        )
        if "other_text" in r:
            o = r["other_text"]
            print(
                f"  on {o['data']} ({o['windows']} windows): retention {o['retention_closed_form']['value']:.3f} → "
                f"{o['retention_distilled']['value']:.3f}, gain {o['retention_gain']['value']:+.3f} "
                f"[{o['retention_gain']['low']:+.3f}, {o['retention_gain']['high']:+.3f}], next-token KL "
                f"{o['kl_closed_form']['value']:.4f} → {o['kl_distilled']['value']:.4f}",
                flush=True,
            )
        Path(args.out).write_text(json.dumps({"settings": kwargs, "results": results}, indent=2))


if __name__ == "__main__":
    main()
