"""Pocket-pair measurements for the budgeted calibration (issue 12), printed as JSON:

1. layer selection: the small per-head K→K / V→V statistic (`SelectionStatistics`) against the exact all-heads
   single-layer held-out R² (dense `KVStatistics`): overlap of the top-k sets, and the held-out R² of the mapper
   fitted with each selection;
2. kv_mode "joint" against "separate" (same selection, all heads, auto-λ): held-out R², parameters, FLOPs per token
   and context-benefit retention on 64 held-out pocket windows of 192 + 16 tokens;
3. float32 against float64 block statistics: largest difference of the fitted weights.

    python scripts/measure_statistics.py > statistics_measurements.json
"""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_kvbridge import pocket
from hf_kvbridge.fitting.calibration.calibrate import assemble_bridge
from hf_kvbridge.fitting.calibration.checks import split_heldout
from hf_kvbridge.fitting.calibration.data_pass import collect_statistics
from hf_kvbridge.fitting.data import token_windows
from hf_kvbridge.fitting.layer_selection import mapper_r2, select_layers, single_layer_r2
from hf_kvbridge.fitting.solve import LAMBDA_GRID, choose_ridge_lambdas
from hf_kvbridge.fitting.statistics.blocks import BlockStatistics
from hf_kvbridge.fitting.statistics.selection import SelectionStatistics
from hf_kvbridge.mappers import KVMapper
from hf_kvbridge.tools.evaluation import continuation_nll, heldout_windows

PAIRS = [
    ("pocket-l", "pocket-s"),
    ("pocket-m", "pocket-s"),
    ("pocket-s", "pocket-m"),
    ("pocket-m", "pocket-l"),
    ("pocket-s", "pocket-l"),
]


def _load(name):
    return AutoModelForCausalLM.from_pretrained(pocket.model_path(name), dtype=torch.float32).eval()


def measure(source_name: str, target_name: str, tokenizer, eval_windows) -> dict:
    source, target = _load(source_name), _load(target_name)
    windows = token_windows(pocket.load_texts("calibration"), tokenizer, 32, 256)
    _, heldout = split_heldout(len(windows), 0.1, 0)
    train, held = collect_statistics(source, target, windows, heldout=heldout)
    layers_s, layers_t = train.source_layers, train.target_layers
    k = 2 if layers_s <= 3 else 4
    exact = single_layer_r2(train, held, "all_heads")  # (L_t, L_s, 2)
    small = collect_statistics(
        source,
        target,
        windows,
        heldout=heldout,
        make_parts=lambda: [SelectionStatistics(*train.shape_key) for _ in range(2)],
    )
    cheap = small[0].single_layer_r2(small[1])
    exact_sel, cheap_sel = select_layers(exact, k), select_layers(cheap, k)
    overlap = sum(len(set(a) & set(b)) for a, b in zip(exact_sel, cheap_sel)) / (k * layers_t)
    r2_exact = mapper_r2(train, held, exact_sel).mean().item()
    r2_cheap = mapper_r2(train, held, cheap_sel).mean().item()
    out = {
        "pair": f"{source_name}→{target_name}",
        "top_k": k,
        "selection": {
            "same_layers_fraction": round(overlap, 3),
            "identical_sets": sum(set(a) == set(b) for a, b in zip(exact_sel, cheap_sel)),
            "target_layers": layers_t,
            "mapper_r2_exact_selection": round(r2_exact, 4),
            "mapper_r2_small_statistic_selection": round(r2_cheap, 4),
            "exact_selection": exact_sel,
            "small_statistic_selection": cheap_sel,
        },
        "kv_mode": {},
    }
    both = train + held
    heads, dim = train.num_kv_heads, train.head_dim
    for kv_mode in ("joint", "separate"):  # both at the default auto-λ, chosen for the maps as each mode fits them
        lam, r2 = choose_ridge_lambdas(train, held, exact_sel, "all_heads", heads, dim, LAMBDA_GRID, kv_mode=kv_mode)
        mapper = KVMapper.from_statistics(both, exact_sel, "all_heads", lam, kv_mode=kv_mode)
        bridge = assemble_bridge(source, target, mapper, exact, r2, (k, "auto", lam, "all_heads", 1))
        retention = continuation_nll(bridge, eval_windows, 192)["context_benefit_retention"]
        out["kv_mode"][kv_mode] = {
            "heldout_r2_k": round(r2[:, 0].mean().item(), 4),
            "heldout_r2_v": round(r2[:, 1].mean().item(), 4),
            "parameters": sum(layer.weight.numel() + layer.bias.numel() for layer in mapper.layers),
            "flops_per_token": mapper.flops_per_token(),
            "retention": round(retention, 4),
        }
    # float32 vs float64 block statistics (centred sums): the fitted weights
    weights, block_parts = {}, {}
    for dtype in (torch.float32, torch.float64):
        union = sorted({s for layers in exact_sel for s in layers})
        parts = collect_statistics(
            source,
            target,
            windows,
            heldout=heldout,
            make_parts=lambda dtype=dtype, union=union: [
                BlockStatistics(*train.shape_key, union, list(range(layers_t)), dtype) for _ in range(2)
            ],
        )
        block_parts[dtype] = parts
        weights[dtype] = KVMapper.from_statistics(parts[0] + parts[1], exact_sel, "all_heads", 0.01)
    diffs = [
        ((a.weight - b.weight).abs().max() / b.weight.abs().max()).item()
        for a, b in zip(weights[torch.float32].layers, weights[torch.float64].layers)
    ]
    out["float32_vs_float64_max_relative_weight_difference"] = float(f"{max(diffs):.2e}")
    r2_32 = mapper_r2(*block_parts[torch.float32], exact_sel).mean().item()
    out["heldout_r2_float64_dense_vs_float32_blocks"] = [round(r2_exact, 6), round(r2_32, 6)]
    return out


def main():
    tokenizer = AutoTokenizer.from_pretrained(pocket.model_path("pocket-s"))
    eval_windows = heldout_windows(pocket.load_texts("heldout"), tokenizer, 192 + 16, 64)
    results = [measure(s, t, tokenizer, eval_windows) for s, t in PAIRS]
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
