"""The selective-recompute frontier: context-benefit retention against the share of the context the target recomputes.

For one pocket pair (by default pocket-l → pocket-s), one calibration, and the same held-out windows
for every point, each policy recomputes a fraction of the mapped context (`hf_kvbridge.transfer.token_recompute`);
`sinks` computes the first tokens instead (`config.sink_tokens`). Every point reports its cost: the share of the
context's tokens the target runs (its prefill FLOPs, to first order) and the wall time of the bridged prefill. The
zero- and random-cache controls are reported next to the bridge. The `random` policy is drawn once per `--seeds` seed
(its table cell is the mean); `compare_policies` puts a chosen policy against those draws window by window.

    python -m studies.recompute_study --source pocket-l --target pocket-s --out runs/recompute
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
from hf_kvbridge.mappers import MAPPER_TYPES
from hf_kvbridge.tools.bench.flop_model import cost, target_flops_per_token
from hf_kvbridge.tools.evaluation import continuation_nll, heldout_windows, retention, score_tokens

POLICIES = ("tail", "sinks", "random", "spread", "probe", "tail_probe")
FRACTIONS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--source", default="pocket-l", help="pocket model that prefills")
    parser.add_argument("--target", default="pocket-s", help="pocket model that decodes")
    parser.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated, of {POLICIES}")
    parser.add_argument("--fractions", default=",".join(map(str, FRACTIONS)), help="recomputed shares of the context")
    parser.add_argument(
        "--recompute-layers",
        default="0",
        help="comma-separated top-layer counts the target recomputes (layer recompute), each combined with every "
        "policy and fraction; the residual maps are fitted in the one calibration",
    )
    parser.add_argument("--num-sequences", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument(
        "--mapper-type", default="ridge", choices=MAPPER_TYPES, help="the mapper the recompute runs over"
    )
    parser.add_argument("--mlp-epochs", type=int, default=3, help="with --mapper-type mlp (attention-output loss)")
    parser.add_argument(
        "--hidden-state-layers",
        default=None,
        help="source hidden states that feed the K/V maps beside its K/V (comma-separated output_hidden_states "
        "entries, or 'all'; hf_kvbridge.utils.source_features); default: K/V only",
    )
    parser.add_argument("--windows", type=int, default=48, help="held-out windows")
    parser.add_argument("--context", type=int, default=192)
    parser.add_argument("--continuation", type=int, default=32)
    parser.add_argument("--seeds", default="0", help="comma-separated seeds of the random policy's draws")
    parser.add_argument("--out", default="runs/recompute", help="folder for recompute.json and recompute.png")
    parser.add_argument(
        "--combine",
        help="comma-separated recompute.json files of runs on one pair (e.g. ridge, mlp, hidden states): plot and "
        "tabulate them as one frontier (frontier.json, frontier.png in --out), no calibration",
    )


def hidden_state_layers(value: str | None):
    """`--hidden-state-layers` as `calibrate` takes it: `None`, `"all"` or a list of integers."""
    if value in (None, "", "none"):
        return None
    return "all" if value == "all" else [int(v) for v in value.split(",")]


def window_nll(bridge, windows: torch.Tensor, context: int, batch_size: int = 8) -> tuple[torch.Tensor, float]:
    """Mean continuation NLL of each window in bridge mode, `(N,)`, and the seconds spent in the bridged prefills."""
    nll, seconds = [], 0.0
    for start in range(0, len(windows), batch_size):
        started = time.perf_counter()
        nll.append(-score_tokens(bridge, windows[start : start + batch_size], context, "bridge").mean(-1))
        seconds += time.perf_counter() - started
    return torch.cat(nll), seconds


def recompute_variant(bridge, policy: str, fraction: float, seed: int = 0):
    """A copy of `bridge` that recomputes `fraction` of its mapped context chosen by `policy` (seeded by `seed`)."""
    variant = bridge.with_mapper(bridge.mapper, copy.deepcopy(bridge.config))
    if policy != "sinks":  # sinks: the caller sets `config.sink_tokens` from the context length
        variant.config.recompute_fraction, variant.config.recompute_policy = fraction, policy
        variant.config.recompute_seed = seed
    return variant


def paired_t(delta: torch.Tensor) -> float:
    """The paired t statistic of per-window differences `(N,)`: their mean over its standard error."""
    return float(delta.mean() / (delta.std() / len(delta) ** 0.5))


def compare_policies(
    bridge, windows: torch.Tensor, context: int, fraction: float, policy: str = "probe", seeds=(0, 1, 2, 3)
) -> dict:
    """`policy` against the `random` policy at the same recomputed `fraction`, on the same windows.

    Returns the context-benefit retention of `policy` and of each random draw, the per-window NLL of `policy`
    (`(N,)`), and its per-window NLL gain over the mean of the draws (`(N,)`, positive = `policy` better) with its mean
    and paired t statistic.
    """
    reference = {mode: -score_tokens(bridge, windows, context, mode).mean(-1) for mode in ("target", "no_context")}
    gain = float((reference["no_context"] - reference["target"]).mean())

    def kept(nll: torch.Tensor) -> float:
        return float((reference["no_context"] - nll).mean()) / gain

    chosen, _ = window_nll(recompute_variant(bridge, policy, fraction), windows, context)
    draws = torch.stack(
        [window_nll(recompute_variant(bridge, "random", fraction, s), windows, context)[0] for s in seeds]
    )
    delta = draws.mean(0) - chosen  # (N,)
    return {
        "policy": policy,
        "fraction": fraction,
        "retention": kept(chosen),
        "random_retention": [kept(d) for d in draws],
        "window_nll": chosen.tolist(),
        "window_gain": delta.tolist(),
        "mean_gain_nats": float(delta.mean()),
        "paired_t": paired_t(delta),
        "context_benefit_nats": gain,
    }


def run_frontier(args: argparse.Namespace) -> dict:
    """Calibrates the pair once and measures every (recomputed layers, policy, fraction) point on the same windows.

    Each point's `cost` is `kvbridge tune`'s: the FLOPs per context token the target spends (recomputed tokens and
    layers) plus the mapper's, as a share of the target's own prefill (`hf_kvbridge.tools.bench.flop_model.cost`)."""
    layer_counts = [int(n) for n in str(getattr(args, "recompute_layers", "0")).split(",")]
    tokenizer = AutoTokenizer.from_pretrained(pocket.model_path(args.target))
    source, target = pocket.load_model(args.source), pocket.load_model(args.target)
    bridge = calibrate(
        source,
        target,
        pocket.load_texts("calibration"),
        tokenizer=tokenizer,
        num_sequences=args.num_sequences,
        seq_len=args.seq_len,
        top_k=args.top_k,
        mapper_type=getattr(args, "mapper_type", "ridge"),
        hidden_state_layers=hidden_state_layers(getattr(args, "hidden_state_layers", None)),
        recompute_layers=[n for n in layer_counts if n > 0] or 0,
        **(
            {"mlp_kwargs": {"loss": "attention", "epochs": args.mlp_epochs}}
            if getattr(args, "mapper_type", "ridge") == "mlp"
            else {}
        ),
    )
    windows = heldout_windows(pocket.load_texts("heldout"), tokenizer, args.context + args.continuation, args.windows)
    reference = continuation_nll(bridge, windows, args.context, controls=True)
    nll = dict(reference["nll"])
    points = []
    mapped_context = args.context - bridge.config.hold_back  # the tokens the source prefills
    seeds = [int(s) for s in str(getattr(args, "seeds", "0")).split(",")]
    target_flops = target_flops_per_token(bridge.target.config, args.context)
    for layers in layer_counts:
        for policy in args.policies.split(","):
            for fraction in (float(f) for f in args.fractions.split(",")):
                for seed in seeds if policy == "random" else [0]:
                    variant = recompute_variant(bridge, policy, fraction, seed)
                    variant.config.recompute_layers = layers
                    if policy == "sinks":
                        variant.config.sink_tokens = round(fraction * mapped_context)
                    per_window, seconds = window_nll(variant, windows, args.context)
                    bridge_nll = float(per_window.mean())
                    computed = (variant.last_transfer or {}).get("target_tokens", 0) + variant.config.hold_back
                    points.append(
                        {
                            "policy": policy,
                            "fraction": fraction,
                            "recompute_layers": layers,
                            "seed": seed,
                            "retention": retention({**nll, "bridge": bridge_nll}),
                            "nll": bridge_nll,
                            "target_token_share": computed / args.context,
                            "cost": cost(variant, target_flops),
                            "prefill_seconds": seconds,
                            "window_nll": per_window.tolist(),  # for paired comparisons between runs
                        }
                    )
                    kept, spent = points[-1]["retention"], points[-1]["cost"]
                    print(
                        f"{_label(policy, layers):16s} {fraction:5.2f} seed {seed}  retention {kept:.4f}  "
                        f"cost {spent:.3f}  ({seconds:.1f}s)"
                    )
    return {
        "pair": {"source": args.source, "target": args.target},
        "settings": {k: v for k, v in vars(args).items() if k != "func"},
        "reference": {k: v for k, v in reference.items()},
        "points": points,
        "torch_threads": torch.get_num_threads(),
    }


def _label(policy: str, layers: int) -> str:
    """A frontier's name: the token policy, and the recomputed top layers when there are any."""
    return policy if not layers else f"{policy} + {layers} layer{'s' if layers > 1 else ''}"


def _curve(point: dict) -> str:
    curve = _label(point["policy"], point.get("recompute_layers", 0))
    return f"{point['variant']}: {curve}" if "variant" in point else curve


def variant_name(settings: dict) -> str:
    """A run's mapper, as `--combine` labels its curves: `ridge`, `mlp`, with `+ hidden states` when it had them."""
    name = settings.get("mapper_type") or "ridge"
    return name + (" + hidden states" if settings.get("hidden_state_layers") not in (None, "", "none") else "")


def combine(paths: list[str]) -> dict:
    """One frontier of several runs of this study on one pair (other mappers, hidden states): their points, each
    labelled with its run's `variant`, and the first run's reference (the same windows give the same controls)."""
    runs = [json.loads(Path(path).read_text()) for path in paths]
    if len({(r["pair"]["source"], r["pair"]["target"]) for r in runs}) > 1:
        raise SystemExit("--combine: the runs are of different pairs")
    points = [{**p, "variant": variant_name(r["settings"])} for r in runs for p in r["points"]]
    return {"pair": runs[0]["pair"], "reference": runs[0]["reference"], "points": points, "runs": list(paths)}


def format_table(result: dict) -> str:
    fractions = sorted({p["fraction"] for p in result["points"]})
    policies = list(dict.fromkeys(_curve(p) for p in result["points"]))
    by: dict[tuple[str, float], list[float]] = {}
    for p in result["points"]:  # the random policy's seeds: their mean
        by.setdefault((_curve(p), p["fraction"]), []).append(p["retention"])
    lines = ["| policy | " + " | ".join(f"{f:.0%}" for f in fractions) + " |", "|---" * (len(fractions) + 1) + "|"]
    for policy in policies:
        cells = [f"{sum(by[(policy, f)]) / len(by[(policy, f)]):.3f}" if (policy, f) in by else "–" for f in fractions]
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _plotted_seed(result: dict) -> int:
    """The seed whose random draws the plot shows (the first one)."""
    return min(p.get("seed", 0) for p in result["points"])


def plot_frontier(result: dict, path: Path) -> None:
    from hf_kvbridge.tools.diagnostics import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2), constrained_layout=True)
    for curve in dict.fromkeys(_curve(p) for p in result["points"]):
        pts = [p for p in result["points"] if _curve(p) == curve and p.get("seed", 0) == _plotted_seed(result)]
        pts.sort(key=lambda p: p.get("cost", p["target_token_share"]))
        x = [p.get("cost", p["target_token_share"]) for p in pts]  # runs saved before the cost axis: the share
        ax.plot(x, [p["retention"] for p in pts], marker="o", label=curve)
    for (mode, value), style in zip(result["reference"].get("control_retention", {}).items(), (":", "--")):
        ax.axhline(value, linestyle=style, color="grey", label=f"control: {mode.replace('_', ' ')}")
    pair = result["pair"]
    ax.set_title(f"Recompute frontier: {pair['source']} → {pair['target']}")
    ax.set_xlabel("cost: target + mapper FLOPs, share of the target's prefill")
    ax.set_ylabel("context-benefit retention")
    ax.legend(title="policy", fontsize=7, loc="lower right")
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    combined = bool(getattr(args, "combine", None))
    result = combine(args.combine.split(",")) if combined else run_frontier(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "frontier" if combined else "recompute"
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot_frontier(result, out / f"{name}.png")
    print(format_table(result))
    print(f"controls: {result['reference'].get('control_retention')}; written to {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
