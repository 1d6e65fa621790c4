"""What an fp8 target KV cache costs a bridge, library side: context-benefit retention with the mapped cache passed
through an fp8 cache as vLLM's CPU backend stores it (`code = fp8(x / scale)`, saturated, rounded to nearest;
dequantized `code * scale`, `paged_cache.quantize`; scale 1.0, vLLM's default without checkpoint scales), beside the
float one, paired over the same held-out windows (the cost's 95 % interval by the delta method of
`evaluation.gap_recovered`, as `kvbridge bench store --retention` reports the store's encodings).

The target's own continuation K/V stays float here (in the engine it is fp8 too, for the bridged and the plain
request alike): this is the mapped prefix's share of the cost.

    PYTHONPATH=$PWD HF_HUB_OFFLINE=1 .venv/bin/python scripts/fp8_target_retention.py pocket-m:pocket-l --windows 32
"""

from __future__ import annotations

import argparse
import json


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pair", nargs="?", default="pocket-m:pocket-l")
    parser.add_argument("--windows", type=int, default=32)
    parser.add_argument("--context-len", type=int, default=192)
    parser.add_argument("--scale", type=float, default=1.0, help="the engine's k_scale and v_scale")
    parser.add_argument("--json")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    import hf_kvbridge
    from hf_kvbridge import pocket
    from hf_kvbridge.integrations.vllm.paged_cache import FP8_FORMATS, quantize
    from hf_kvbridge.tools.evaluation import gap_recovered, heldout_windows, window_nll

    source, target = args.pair.split(":")
    tokenizer = AutoTokenizer.from_pretrained(pocket.model_path(target))
    bridge = hf_kvbridge.calibrate(f"pocket/{source}", f"pocket/{target}", pocket.load_texts("calibration"),
                                   tokenizer=tokenizer, num_sequences=16, seq_len=256)  # fmt: skip
    windows = heldout_windows(pocket.load_texts("heldout"), tokenizer, 256, args.windows)
    nll = {mode: window_nll(bridge, windows, args.context_len, mode, 8) for mode in ("target", "no_context", "bridge")}
    exact = gap_recovered(nll["no_context"], nll["bridge"], nll["target"])
    rows = {"float": {"retention": exact.value, "low": exact.low, "high": exact.high}}
    original = bridge.map_cache
    for name in ("fp8_e4m3", "fp8_e5m2"):
        fp8 = FP8_FORMATS[name]

        def map_cache(*a, fp8=fp8, **k):  # the mapped cache as the engine's fp8 cache holds it
            cache = original(*a, **k)
            for layer in cache.layers:
                layer.keys.copy_(quantize(layer.keys, fp8, args.scale))
                layer.values.copy_(quantize(layer.values, fp8, args.scale))
            return cache

        bridge.map_cache = map_cache
        quantized = window_nll(bridge, windows, args.context_len, "bridge", 8)
        del bridge.map_cache
        kept = gap_recovered(nll["no_context"], quantized, nll["target"])
        cost = gap_recovered(nll["no_context"], nll["no_context"] - (quantized - nll["bridge"]), nll["target"])
        rows[name] = {"retention": kept.value, "cost": cost.value, "cost_low": cost.low, "cost_high": cost.high,
                      "cost_reason": cost.reason, "nll_change": float((quantized - nll["bridge"]).mean())}  # fmt: skip
    print(f"{args.pair}: {args.windows} held-out windows, {args.context_len} context tokens, fp8 scale {args.scale}")
    for name, row in rows.items():
        print(name, json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in row.items()}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"pair": args.pair, "windows": args.windows, "scale": args.scale, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
