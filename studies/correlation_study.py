"""Which diagnostic predicts transfer quality? Pearson r of held-out R² and of attention-output cosine with the
measured context-benefit retention, across pairs and mapper settings of the pocket family
(`python -m studies.correlation_study`).

Each pair is calibrated once (statistics are reused for every setting); each setting (top-k, ridge λ, head mode) is
fitted from the statistics, plus one MLP mapper (attention loss) per pair, and measured on held-out text: R² of the
mapped K and V against the target's own (`mapped_r2`), mean attention-output cosine, and retention =
(NLL_no_context − NLL_bridge) / (NLL_no_context − NLL_target).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import time
from pathlib import Path

import torch
from scipy import stats as scipy_stats
from transformers import AutoTokenizer

from hf_kvbridge import pocket
from hf_kvbridge.fitting.attention import attention_output_cosine
from hf_kvbridge.fitting.calibration.calibrate import calibrate, fit_bridge
from hf_kvbridge.fitting.data import token_windows
from hf_kvbridge.fitting.mapper_fits import refit
from hf_kvbridge.tools.diagnostics import pyplot
from hf_kvbridge.tools.evaluation import heldout_windows
from hf_kvbridge.tools.evaluation import mean_nll as _nll
from hf_kvbridge.utils.cache import output_cache
from hf_kvbridge.utils.rope import rotary_cos_sin, strip_rotary

DEFAULT_PAIRS = ("pocket-s:pocket-l", "pocket-m:pocket-l", "pocket-l:pocket-s", "pocket-s:pocket-m")
SETTINGS = {"top_k": (1, 2, None), "ridge_lambda": (0.01, 3.0), "head_mode": ("all_heads", "same_head")}


@torch.no_grad()
def mapped_r2(bridge, input_ids: torch.Tensor) -> dict:
    """R² of the mapped K (content space) and V against the target's own, pooled over layers, heads and tokens of
    `input_ids`. Measured on the mapper's outputs, so it applies to any mapper type (ridge or MLP) alike."""
    source_cache = output_cache(bridge.source(input_ids=input_ids, use_cache=True, logits_to_keep=1))
    mapped = bridge.map_cache(source_cache)
    true = output_cache(bridge.target(input_ids=input_ids, use_cache=True, logits_to_keep=1))
    positions = torch.arange(input_ids.shape[1]).unsqueeze(0).expand(input_ids.shape[0], -1)
    cos, sin = rotary_cos_sin(bridge.target, positions)
    sums = {"k": [0.0, 0.0], "v": [0.0, 0.0]}  # [Σ residual², Σ deviation²]
    for got, want in zip(mapped.layers, true.layers):
        pairs = {
            "k": (strip_rotary(got.keys.float(), cos, sin), strip_rotary(want.keys.float(), cos, sin)),
            "v": (got.values.float(), want.values.float()),
        }
        for name, (a, b) in pairs.items():  # (B, H, T, d)
            sums[name][0] += float(((a - b) ** 2).sum())
            sums[name][1] += float(((b - b.mean(dim=(0, 2), keepdim=True)) ** 2).sum())
    return {name: 1 - sse / sst for name, (sse, sst) in sums.items()}


def _load_pocket(name: str, models: dict):
    if name not in models:
        models[name] = pocket.load_model(name)
    return models[name]


def _calibrated(source_name: str, target_name: str, tokenizer, models: dict, **calibrate_kwargs):
    """A ridge bridge of two pocket models calibrated on the calibration split (models loaded once per name)."""
    return calibrate(
        _load_pocket(source_name, models),
        _load_pocket(target_name, models),
        pocket.load_texts("calibration"),
        tokenizer=tokenizer,
        **calibrate_kwargs,
    )


def _reference_nll(bridge, held, context: int) -> dict:
    return {mode: _nll(bridge, held, context, mode) for mode in ("target", "no_context")}


def refit_base(pair: str, tokenizer, models: dict, held, context: int, **calibrate_kwargs):
    """What a study that re-fits many settings from one calibration starts from: the calibrated bridge of `pair`
    (`"source:target"`), its `(train, held-out)` statistics, and the target's NLL with and without context on `held`.

    Returns:
        `(base, train, heldout, reference, gain)`: `gain` is the context's benefit, no-context NLL − target NLL.
    """
    source_name, target_name = pair.split(":")
    base = _calibrated(source_name, target_name, tokenizer, models, keep_statistics=True, **calibrate_kwargs)
    train, heldout = base.calibration_statistics
    reference = _reference_nll(base, held, context)
    return base, train, heldout, reference, reference["no_context"] - reference["target"]


def run_study(
    pairs=DEFAULT_PAIRS,
    *,
    num_sequences=64,
    seq_len=512,
    windows=12,
    context=256,
    continuation=64,
    seed=0,
    mlp=True,
    progress=print,
) -> dict:
    """Measures every (pair, setting) point and the correlations; returns the points and the Pearson r values."""
    tokenizer = AutoTokenizer.from_pretrained(pocket.model_path(pairs[0].split(":")[1]))  # shared by the family
    held = heldout_windows(pocket.load_texts("heldout"), tokenizer, context + continuation, windows)
    models: dict = {}
    points = []
    for pair in pairs:
        started = time.perf_counter()
        base, train, heldout, reference, gain = refit_base(
            pair, tokenizer, models, held, context, num_sequences=num_sequences, seq_len=seq_len, seed=seed
        )
        progress(
            f"{pair}: calibrated in {time.perf_counter() - started:.0f}s; NLL target {reference['target']:.3f}, "
            f"no context {reference['no_context']:.3f}"
        )
        candidates = [(dict(zip(SETTINGS, values)), None) for values in itertools.product(*SETTINGS.values())]
        if mlp:  # the MLP residual (attention loss) on top of the default ridge map: ridge vs MLP in one r
            candidates.append(({"top_k": 6, "ridge_lambda": 0.01, "head_mode": "all_heads"}, "mlp"))
        for setting, mapper_type in candidates:
            top_k, lam, head_mode = setting["top_k"], setting["ridge_lambda"], setting["head_mode"]
            bridge = fit_bridge(
                base.source, base.target, train, heldout, top_k=top_k, ridge_lambda=lam, head_mode=head_mode
            )
            if mapper_type == "mlp":
                windows_ = token_windows(pocket.load_texts("calibration"), tokenizer, num_sequences, seq_len)
                bridge = refit(bridge, "mlp", windows=windows_, hidden=128, loss="attention", epochs=1, seed=seed)
            r2 = mapped_r2(bridge, held[:4])
            nll = _nll(bridge, held, context, "bridge")
            point = {
                "pair": pair,
                "top_k": "all" if top_k is None else top_k,
                "ridge_lambda": lam,
                "head_mode": head_mode,
                "mapper": mapper_type or "ridge",
                "r2": (r2["k"] + r2["v"]) / 2,
                "attention_cosine": float(attention_output_cosine(bridge, held[:4]).mean()),
                "nll_bridge": nll,
                "retention": (reference["no_context"] - nll) / gain,
            }
            points.append(point)
            progress(
                f"  {point['mapper']} k={point['top_k']} λ={lam} {head_mode}: R² {point['r2']:.3f}  attn cos "
                f"{point['attention_cosine']:.4f}  retention {point['retention']:.3f}"
            )
    retention = [p["retention"] for p in points]
    correlations = {}
    for key in ("r2", "attention_cosine"):
        result = scipy_stats.pearsonr([p[key] for p in points], retention)
        correlations[key] = {
            "pearson_r": float(result.statistic),
            "p_value": float(result.pvalue),
            "points": len(points),
        }
    return {
        "points": points,
        "correlations": correlations,
        "settings": {
            "pairs": list(pairs),
            "num_sequences": num_sequences,
            "seq_len": seq_len,
            "windows": windows,
            "context": context,
            "continuation": continuation,
            "seed": seed,
        },
    }


def plot_study(result: dict, path) -> None:
    """Scatter of retention against R² and against attention cosine, one colour per pair."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 5.2), sharey=True, layout="constrained")
    pairs = sorted({p["pair"] for p in result["points"]})
    for ax, key, label in zip(
        axes, ("r2", "attention_cosine"), ("held-out R² (mean K, V)", "attention-output cosine")
    ):
        for pair in pairs:
            for mapper, marker in (("ridge", "o"), ("mlp", "*")):
                pts = [p for p in result["points"] if p["pair"] == pair and p.get("mapper", "ridge") == mapper]
                if pts:
                    ax.scatter(
                        [p[key] for p in pts],
                        [p["retention"] for p in pts],
                        s=18 if mapper == "ridge" else 80,
                        marker=marker,
                        label=pair if mapper == "ridge" else f"{pair} (MLP)",
                    )
        r = result["correlations"][key]
        ax.set_title(f"Pearson r = {r['pearson_r']:+.2f} (n = {r['points']})", fontsize=9)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("context-benefit retention")
    fig.legend(*axes[1].get_legend_handles_labels(), loc="outside lower center", ncol=4, fontsize=7)
    fig.suptitle(f"Does fit quality predict retention? Pocket pairs (source:target) {', '.join(pairs)}", fontsize=10)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_study_cli(args) -> int:
    if args.knobs:
        source_name, target_name = args.knobs.split(":")
        result = run_knobs(source_name, target_name, seed=args.seed)
        out = Path(args.out) / f"knobs-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"
        out.mkdir(parents=True)
        (out / "knobs.json").write_text(json.dumps(result, indent=2))
        print(f"wrote {out}/knobs.json")
        return 0
    result = run_study(
        args.pairs.split(","),
        num_sequences=args.num_sequences,
        seq_len=args.seq_len,
        windows=args.windows,
        seed=args.seed,
    )
    for key, r in result["correlations"].items():
        print(f"Pearson r({key}, retention) = {r['pearson_r']:+.3f} (p = {r['p_value']:.3g}, n = {r['points']})")
    out = Path(args.out) / f"study-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True)
    (out / "study.json").write_text(json.dumps(result, indent=2))
    plot_study(result, out / "study.png")
    print(f"wrote {out}/study.json, study.png")
    return 0


def run_knobs(
    source_name="pocket-l",
    target_name="pocket-s",
    *,
    sinks=(0, 4, 16),
    hold_backs=(1, 4, 16),
    num_sequences=64,
    seq_len=512,
    windows=24,
    context=256,
    continuation=32,
    seed=0,
    progress=print,
):
    """Retention against added cost for the partial-recompute knobs: the target computes the first `sink_tokens`
    and the last `hold_back` tokens of the context itself. Cost: context tokens the target computes, and time."""
    tokenizer = AutoTokenizer.from_pretrained(pocket.model_path(target_name))
    held = heldout_windows(pocket.load_texts("heldout"), tokenizer, context + continuation, windows)

    bridge = _calibrated(
        source_name, target_name, tokenizer, {}, num_sequences=num_sequences, seq_len=seq_len, seed=seed
    )
    reference = _reference_nll(bridge, held, context)
    gain = reference["no_context"] - reference["target"]
    rows = []
    for sink, hold in itertools.product(sinks, hold_backs):
        bridge.config.sink_tokens, bridge.config.hold_back = sink, hold
        started = time.perf_counter()
        nll = _nll(bridge, held, context, "bridge")
        rows.append(
            {
                "sink_tokens": sink,
                "hold_back": hold,
                "target_context_tokens": sink + hold,
                "retention": (reference["no_context"] - nll) / gain,
                "nll_bridge": nll,
                "seconds": time.perf_counter() - started,
            }
        )
        progress(
            f"sink {sink:3d} hold_back {hold:3d}: target computes {sink + hold:3d}/{context} context tokens, "
            f"retention {rows[-1]['retention']:.3f}, {rows[-1]['seconds']:.1f}s"
        )
    return {
        "pair": f"{source_name}:{target_name}",
        "reference": reference,
        "rows": rows,
        "settings": {
            "windows": windows,
            "context": context,
            "continuation": continuation,
            "num_sequences": num_sequences,
            "seq_len": seq_len,
            "seed": seed,
        },
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pairs", default="pocket-s:pocket-l,pocket-m:pocket-l,pocket-l:pocket-s,pocket-s:pocket-m")
    parser.add_argument("--num-sequences", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--windows", type=int, default=12, help="held-out windows for retention")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--knobs", metavar="SOURCE:TARGET", help="instead: retention vs cost of sink_tokens and hold_back on this pair"
    )
    parser.add_argument("--out", default="kvbridge-demo")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m studies.correlation_study", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_study_cli(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
