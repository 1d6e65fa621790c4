"""Matched-head maps against same-head and all-heads on the pocket family (issue #47, item 2): each target head of
layer `t` read, from each selected source layer, from the one source head that predicts it best (not necessarily the
same index: two separately trained models number their heads arbitrarily), fitted with the target's attention mass
as token weights, as the weighted same-head map is. Paired on the same held-out windows as `head_local_study`: the
mean paired difference of context-benefit retention with its paired bootstrap 95% interval.

    python -m studies.matched_head_study --pairs pocket-s:pocket-l,pocket-l:pocket-s --windows 303 --out matched.json

`--rules same` embeds the weighted same-head map itself (a check of the embedding: it must equal
`same_head_weighted`). Two rules pick the heads, both on the weighted calibration statistics (no held-out text):
- `independent`: per selected source layer, the source head whose single-head ridge map explains most of the target
  head (the mean of its key R² and value R²); H_s choices per layer, so it scales to Qwen3's 8 heads.
- `exhaustive`: every combination of one head per selected layer (H_s^k), the best joint fit; only where H_s^k ≤ 4096.

A matched-head map has the same-head map's parameters (1/H of all-heads). Here it is evaluated embedded in an
all-heads mapper whose other rows are zero (the same outputs; the runtime of all-heads), which is enough to measure
its quality; the chosen heads and the fraction that differ from the same index are reported.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import time

import torch

import hf_kvbridge
from hf_kvbridge import pocket
from hf_kvbridge.fitting.data import token_windows
from hf_kvbridge.fitting.mapper_fits.weighted import weighted_statistics
from hf_kvbridge.fitting.solve import effective_ridge_lambda, map_group_lambda, solve_ridge
from hf_kvbridge.mappers.base import KVMapper
from hf_kvbridge.tools.evaluation import heldout_windows, window_nll
from hf_kvbridge.tools.fidelity import paired_bootstrap, retention_of
from studies.head_local_study import measurement_arguments, pair_setup, run_pairs


def explained(stats, x_idx: torch.Tensor, y_idx: torch.Tensor, lam, head_dim: int) -> float:
    """Mean of the key R² and the value R² of the ridge map `x[x_idx] → y[y_idx]` (one target head: key then value)."""
    weight, bias = solve_ridge(stats, x_idx, y_idx, lam)
    sse, sst = stats.residual_sums(x_idx, y_idx, weight, bias)
    key, value = slice(0, head_dim), slice(head_dim, 2 * head_dim)
    return float(0.5 * ((1 - sse[key].sum() / sst[key].sum()) + (1 - sse[value].sum() / sst[value].sum())))


def choose_heads(stats, k: int, head: int, lam, source_heads: int, head_dim: int, rule: str) -> list[int]:
    """One source head per selected source layer (`0 … k-1` in `stats`) for target head `head` (at layer `0`)."""
    y_idx = stats.target_index(0, head)
    if rule == "same":
        return [head] * k
    if rule == "independent":
        fit = lambda i, g: explained(stats, stats.source_index([i], g), y_idx, lam, head_dim)  # noqa: E731
        return [max(range(source_heads), key=lambda g, i=i: fit(i, g)) for i in range(k)]
    best, best_r2 = None, -float("inf")
    for combo in itertools.product(range(source_heads), repeat=k):
        x_idx = torch.cat([stats.source_index([i], g) for i, g in enumerate(combo)])
        r2 = explained(stats, x_idx, y_idx, lam, head_dim)
        if r2 > best_r2:
            best, best_r2 = list(combo), r2
    return best


def matched_bridge(bridge, stats: list, rule: str):
    """`bridge` (a weighted same-head bridge) with a matched-head map under `rule`, embedded in an all-heads mapper;
    returns `(bridge, heads)` with `heads[t][h]` the chosen source head of each selected layer."""
    base = bridge.mapper
    heads_s, d_s, heads_t, d_t = base.source_kv_heads, base.source_head_dim, base.target_kv_heads, base.target_head_dim
    lam_all = effective_ridge_lambda(bridge.config)
    mapper = KVMapper(base.selected_layers, heads_s, d_s, "all_heads", kv_mode="joint", **base.head_kwargs())
    chosen = []
    for t, layers in enumerate(base.selected_layers):
        k, weight = len(layers), torch.zeros_like(mapper.layers[t].weight.data[0])  # (k·H_s·2d_s, H_t·2d_t)
        bias = torch.zeros_like(mapper.layers[t].bias.data[0])
        chosen.append([])
        for h in range(heads_t):
            lam = map_group_lambda(lam_all, t, h, "same_head", "joint", heads_t, d_t)
            picks = choose_heads(stats[t], k, h, lam, heads_s, d_t, rule)
            chosen[-1].append(picks)
            x_idx = torch.cat([stats[t].source_index([i], g) for i, g in enumerate(picks)])
            y_idx = stats[t].target_index(0, h)
            w, b = solve_ridge(stats[t], x_idx, y_idx, lam)
            weight[x_idx.unsqueeze(1), y_idx.unsqueeze(0)] = w.to(weight.dtype)  # stats' order is the rows' order
            bias[y_idx] = b.to(bias.dtype)
        mapper.layers[t].weight.data[0] = weight
        mapper.layers[t].bias.data[0] = bias
    config = copy.deepcopy(bridge.config)
    config.head_mode = "all_heads"
    return bridge.with_mapper(mapper, config), chosen


def weighted_setup(source: str, target: str, args, *, all_heads_weighted: bool = False):
    """`(tokenizer, bridges, stats)`: the all-heads and the weighted same-head bridges (and, with
    `all_heads_weighted`, the all-heads map fitted with the same weights) of the demo's calibration, and the weighted
    statistics of the same-head bridge's selection on calibrate's own windows (so only the map built from them
    differs)."""
    tokenizer, models, texts, settings = pair_setup(source, target, args)
    started = time.perf_counter()
    weighted = {"mapper_type": "ridge_attention_weighted"}
    bridges = {"all_heads": hf_kvbridge.calibrate(*models, texts, tokenizer=tokenizer, **settings)}
    bridges["same_head_weighted"] = hf_kvbridge.calibrate(
        *models, texts, tokenizer=tokenizer, head_mode="same_head", **weighted, **settings
    )
    if all_heads_weighted:
        bridges["all_heads_weighted"] = hf_kvbridge.calibrate(
            *models, texts, tokenizer=tokenizer, **weighted, **settings
        )
    print(f"  {source} → {target}: calibrated in {time.perf_counter() - started:.0f} s", flush=True)
    windows = token_windows(texts, tokenizer, args.num_sequences, args.seq_len)
    mapper = bridges["same_head_weighted"].mapper
    return tokenizer, bridges, weighted_statistics(mapper, source=models[0], target=models[1], windows=windows)


def measure_pair(source: str, target: str, args) -> dict:
    tokenizer, bridges, stats = weighted_setup(source, target, args)
    weighted = bridges["same_head_weighted"]
    chosen, differ = {}, {}
    for rule in args.rules.split(","):
        started = time.perf_counter()
        bridges[f"matched_{rule}"], chosen[rule] = matched_bridge(weighted, stats, rule)
        picks = [g == h for layer in chosen[rule] for h, per in enumerate(layer) for g in per]
        differ[rule] = round(1 - sum(picks) / len(picks), 3)
        seconds = time.perf_counter() - started
        print(f"  {rule}: {differ[rule]:.0%} of picks differ from the same index ({seconds:.0f} s)", flush=True)
    return {
        "pair": f"{source} → {target}",
        **paired_against(bridges, tokenizer, args, "matched"),
        "differ_from_same_index": differ,
        "chosen_heads": chosen,
    }


def paired_against(bridges: dict, tokenizer, args, new: str) -> dict:
    """Every bridge's retention on `args.windows` held-out windows, and the paired difference of each bridge named
    `new…` against `all_heads` and `same_head_weighted` (and of the other weighted maps against `all_heads`)."""
    held = heldout_windows(pocket.load_texts("heldout"), tokenizer, args.context + args.continuation, args.windows)
    nll = {mode: window_nll(bridges["all_heads"], held, args.context, mode) for mode in ("target", "no_context")}
    for name, bridge in bridges.items():
        nll[name] = window_nll(bridge, held, args.context, "bridge")
    versus = {}
    for base in ("all_heads", "same_head_weighted"):
        for name in bridges:
            if name.startswith(new) or (base == "all_heads" and name.endswith("weighted")):
                versus[f"{name} vs {base}"] = paired_bootstrap(
                    nll, lambda s, n=name, b=base: retention_of(n)(s) - retention_of(b)(s)
                )
    return {
        "windows": int(len(held)),
        "retention": {name: paired_bootstrap(nll, retention_of(name)) for name in bridges},
        "difference": versus,
        "per_window_nll": {mode: values.tolist() for mode, values in nll.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rules", default="independent,exhaustive")
    measurement_arguments(parser, out="matched_head.json")
    args = parser.parse_args()
    run_pairs(args, measure_pair, report_lines)


def report_lines(r: dict):
    """One line a paired difference (with the two maps' parameter counts where `r` has them)."""
    for name, diff in r["difference"].items():
        new, _, base = name.partition(" vs ")
        counts = r.get("parameters")
        yield (
            f"{r['pair']}: {base} {r['retention'][base]['value']:.3f}, {new} {r['retention'][new]['value']:.3f}, "
            f"difference {diff['value']:+.3f} [{diff['low']:+.3f}, {diff['high']:+.3f}] on {r['windows']} windows"
            + (f"; parameters {counts[new]:,} vs {counts[base]:,}" if counts else "")
        )


if __name__ == "__main__":
    main()
