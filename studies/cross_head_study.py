"""Same-head plus a low-rank cross-head term on the pocket family (issue #47, item 2): is the information a head-local
map misses (the −0.02 of `matched_head_study`: other heads', not a numbering) low-rank? Each target layer's map is
the weighted same-head map `W_s` plus `B_r`, a rank-`r` map from every selected source head to every target head
fitted in closed form to what `W_s` leaves:

    R = C_xy − C_xx W_s                 (the residual's cross-covariance, from the same weighted statistics)
    B = (C_xx + λ·D)⁻¹ R                (ridge, the all-heads map's λ per column)
    B_r = B S⁻¹ U_r U_rᵀ S              (reduced-rank regression: U_r the top-r eigenvectors of S⁻¹ Bᵀ C_xx B S⁻¹,
                                          S each output column's residual standard deviation, so keys and values
                                          count alike)

Paired on the same held-out windows as `head_local_study`: the mean paired difference of context-benefit retention
with its paired bootstrap 95% interval against all-heads and against the weighted same-head map, and each map's
parameter count (same-head's plus `r·(p + q)` a target layer, `p` the selected source features and `q` the target
layer's; at most all-heads' count, which a full-rank term makes it), with the all-heads map fitted with the same
token weights beside them (what a full-rank term approaches). Evaluated embedded in an all-heads mapper (the same
outputs; the runtime of all-heads).

    python -m studies.cross_head_study --pairs pocket-s:pocket-l,pocket-l:pocket-s --ranks 1,4,16 --windows 303

`--ranks 0` embeds the weighted same-head map alone (a check: it must equal `same_head_weighted`).
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from hf_kvbridge.fitting.solve import effective_ridge_lambda, map_group_lambda, ridge_from_moments
from studies.head_local_study import measurement_arguments, parameters, run_pairs
from studies.matched_head_study import matched_bridge, paired_against, report_lines, weighted_setup


def cross_head_term(stats, same: torch.Tensor, lam: torch.Tensor, rank: int) -> torch.Tensor:
    """`B_r` `(p, q)` (float64) for one target layer: the rank-`rank` ridge map of what `same` `(p, q)` leaves,
    `lam` `(q,)` the relative λ of each output column."""
    x_idx = stats.source_index(list(range(stats.source_layers)))  # every selected source layer, every head
    y_idx = stats.target_index(0)
    mx, my, cxx, cxy, vy = stats.moments(x_idx, y_idx)
    residual = cxy - cxx @ same  # (p, q): C_x,(y − x W_s)
    full = torch.empty_like(residual)
    for value in lam.unique().tolist():
        columns = (lam == value).nonzero().squeeze(1)
        full[:, columns] = ridge_from_moments(cxx, residual[:, columns], mx, my[columns], value)[0]
    if rank >= full.shape[1]:
        return full
    left = vy - 2 * (same * cxy).sum(0) + (same * (cxx @ same)).sum(0)  # (q,): each column's residual variance
    scale = left.clamp_min(1e-12 * float(left.mean())).sqrt()
    fitted = full.T @ cxx @ full / scale.unsqueeze(0) / scale.unsqueeze(1)  # (q, q), in standardized columns
    _, vectors = torch.linalg.eigh(fitted)
    top = vectors[:, -rank:]  # (q, r)
    projection = (top / scale.unsqueeze(1)) @ (top * scale.unsqueeze(1)).T  # S⁻¹ U Uᵀ S
    return full @ projection


def cross_head_bridge(embedded, stats: list, lam_all, rank: int):
    """`embedded` (the weighted same-head map inside an all-heads mapper, `matched_bridge(..., "same")`) plus a
    rank-`rank` cross-head term in every target layer."""
    mapper = copy.deepcopy(embedded.mapper)
    heads_t, d_t = mapper.target_kv_heads, mapper.target_head_dim
    for t, layer in enumerate(mapper.layers):
        weight = layer.weight.data[0]  # (p, q): rows and columns in the statistics' order
        same = weight.to(torch.float64)
        lam = map_group_lambda(lam_all, t, 0, "all_heads", "joint", heads_t, d_t)
        lam = lam if isinstance(lam, torch.Tensor) else torch.full((same.shape[1],), float(lam))
        total = same + cross_head_term(stats[t], same, lam.to(torch.float64), rank) if rank else same
        x_idx = stats[t].source_index(list(range(stats[t].source_layers)))
        mx, my = stats[t].moments(x_idx, stats[t].target_index(0))[:2]
        layer.weight.data[0] = total.to(weight.dtype)
        layer.bias.data[0] = (my - mx @ total).to(weight.dtype)
    return embedded.with_mapper(mapper, copy.deepcopy(embedded.config))


def measure_pair(source: str, target: str, args) -> dict:
    tokenizer, bridges, stats = weighted_setup(source, target, args, all_heads_weighted=True)
    weighted = bridges["same_head_weighted"]
    embedded, _ = matched_bridge(weighted, stats, "same")
    lam_all = effective_ridge_lambda(bridges["all_heads"].config)
    counts = {name: parameters(bridge) for name, bridge in bridges.items()}
    sizes = [(s.source_index(list(range(s.source_layers))).numel(), s.target_index(0).numel()) for s in stats]
    for rank in (int(r) for r in args.ranks.split(",")):
        started = time.perf_counter()
        name = f"cross_rank_{rank}"
        bridges[name] = cross_head_bridge(embedded, stats, lam_all, rank)
        low_rank = counts["same_head_weighted"] + sum(rank * (p + q) for p, q in sizes)
        counts[name] = min(low_rank, counts["all_heads"])  # past it, W_s + B_r is a full map: all-heads' count
        seconds = time.perf_counter() - started
        print(f"  rank {rank}: fitted in {seconds:.1f} s, {counts[name]:,} parameters", flush=True)
    return {"pair": f"{source} → {target}", **paired_against(bridges, tokenizer, args, "cross"), "parameters": counts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="1,4,16")
    measurement_arguments(parser, out="cross_head.json")
    args = parser.parse_args()
    run_pairs(args, measure_pair, report_lines)  # matched_head_study's lines, with the parameter counts


if __name__ == "__main__":
    main()
