"""Would a Hadamard rotation make the store's fp8 encoding cheaper (issue #48, item 4)? Each head's K/V rows are
multiplied by a normalised Hadamard matrix before the e4m3 encode and by its transpose after the decode (as QuaRot
does for weights), which spreads a head's outlier channels over all its dimensions. Measured as
`kvbridge bench store --retention` measures the encodings (`tools.bench.store_retention`): the source K/V encoded and
decoded chunk by chunk before the map, context-benefit retention on held-out windows, each encoding's cost
(retention lost) with its paired 95% interval, on the same windows.

    python -m studies.fp8_rotation_study --pair pocket-s:pocket-l --windows 256

Measured 2026-12-07 (results in docs/serving.md, "What fp8 costs a bridge"): the rotation made fp8 worse.
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
from hf_kvbridge.tools.bench.store_retention import EncodedSource, encoding_cost, roundtrip
from hf_kvbridge.tools.evaluation import gap_recovered, heldout_windows, window_nll


def hadamard(n: int) -> torch.Tensor:
    """The normalised `(n, n)` Hadamard matrix (Sylvester's construction; `n` a power of two): orthogonal."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power of two, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n**0.5


def rotated_roundtrip(tensor: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """`tensor` `(batch, kv_heads, seq, head_dim)` rotated, through the fp8 store round trip, rotated back."""
    h = hadamard(tensor.shape[-1])  # (d, d)
    return (roundtrip(tensor.float() @ h, "fp8_e4m3", chunk_size) @ h.T).to(tensor.dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="pocket-s:pocket-l")
    parser.add_argument("--windows", type=int, default=256)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="fp8_rotation.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    source, target = args.pair.split(":")
    tokenizer = AutoTokenizer.from_pretrained(pocket.model_path(target))
    started = time.perf_counter()
    bridge = hf_kvbridge.calibrate(f"pocket/{source}", f"pocket/{target}", pocket.load_texts("calibration"),
                                   tokenizer=tokenizer, num_sequences=16, seq_len=256)  # fmt: skip
    windows = heldout_windows(pocket.load_texts("heldout"), tokenizer, 256, args.windows)
    context = 192
    nll = {mode: window_nll(bridge, windows, context, mode) for mode in ("target", "no_context", "bridge")}
    transforms = {
        "fp8_e4m3": None,  # the store's own round trip
        "fp8_e4m3_hadamard": lambda t: rotated_roundtrip(t, args.chunk_size),
    }
    result = {"pair": args.pair, "windows": len(windows), "context_len": context, "chunk_size": args.chunk_size,
              "retention": gap_recovered(nll["no_context"], nll["bridge"], nll["target"]).value}  # fmt: skip
    for name, transform in transforms.items():
        with EncodedSource(bridge, "fp8_e4m3", args.chunk_size, transform=transform):
            encoded = window_nll(bridge, windows, context, "bridge")  # (N,)
        cost = encoding_cost(nll, encoded)
        result[name] = {"cost": cost.value, "cost_low": cost.low, "cost_high": cost.high}
        print(f"{name:<18} cost {cost.value:+.4f} [{cost.low:+.4f}, {cost.high:+.4f}]", flush=True)
    result["seconds"] = round(time.perf_counter() - started, 1)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
