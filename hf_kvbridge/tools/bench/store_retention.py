"""What a compact store encoding costs a bridge: context-benefit retention with the source's K/V passed through the
store's encoding (encode, then decode, chunk by chunk as the store holds them) before the map, against the exact K/V,
paired over held-out windows.

The cost is `retention(exact) − retention(encoded) = mean(NLL_encoded − NLL_exact) / mean(NLL_no_context −
NLL_target)` over the windows, with its paired 95 % interval (the delta method of `evaluation.gap_recovered`). The
`source` encoding is exact, so its cost is 0 on every window (the measurement's own check).

```bash
kvbridge bench store --retention pocket-m:pocket-l --windows 32
```
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...errors import InvalidInputError


def roundtrip(tensor: torch.Tensor, encoding: str, chunk_size: int) -> torch.Tensor:
    """`tensor` `(batch, kv_heads, seq, head_dim)` as a reader of the store gets it back: each row's chunks of
    `chunk_size` tokens encoded and decoded (fp8's scales are per head and chunk, as stored), in `tensor`'s dtype."""
    from ...integrations.kv_store.encodings import decode_tensor, encode_tensor

    out = torch.empty_like(tensor)
    for row in range(tensor.shape[0]):
        for lo in range(0, tensor.shape[2], chunk_size):
            part = encode_tensor(tensor[row, :, lo : lo + chunk_size], encoding)  # (H, t, d) codes (and scales)
            decoded = decode_tensor(part[""], part.get("_scale"), encoding, tensor.dtype)
            out[row, :, lo : lo + chunk_size] = decoded.to(tensor.dtype)
    return out


class EncodedSource:
    """A context manager that makes `bridge` map its source K/V as the store's `encoding` hands them back (the
    bridge's `map_cache` wrapped; restored on exit), or as `transform` returns them (a round trip of another
    encoding: `(batch, kv_heads, seq, head_dim)` in, the same shape and dtype out)."""

    def __init__(self, bridge, encoding: str, chunk_size: int, transform: Callable | None = None):
        self.bridge = bridge
        self.transform = transform or (lambda tensor: roundtrip(tensor, encoding, chunk_size))

    def __enter__(self):
        original = self.bridge.map_cache

        def map_cache(source_cache, *args, **kwargs):
            for layer in source_cache.layers:  # the source's cache is read by the map only: replaced in place
                layer.keys.copy_(self.transform(layer.keys))
                layer.values.copy_(self.transform(layer.values))
            return original(source_cache, *args, **kwargs)

        self.bridge.map_cache = map_cache
        return self.bridge

    def __exit__(self, *exc) -> None:
        del self.bridge.map_cache  # the method again


def encoding_cost(nll: dict[str, torch.Tensor], encoded: torch.Tensor):
    """The retention an encoding loses, with its paired 95 % interval (`evaluation.gap_recovered`'s result): the
    per-window NLL it adds, `NLL_encoded − NLL_exact`, over the context's benefit `NLL_no_context − NLL_target`.
    `nll` holds the window NLLs `(N,)` of modes `target`, `no_context` and `bridge` (exact K/V); `encoded` the
    bridge's with the encoded K/V."""
    from ..evaluation import gap_recovered

    return gap_recovered(nll["no_context"], nll["no_context"] - (encoded - nll["bridge"]), nll["target"])


def encoding_retention(
    bridge,
    windows: torch.Tensor,
    context_len: int,
    encodings: Sequence[str] = ("source", "bfloat16", "fp8_e4m3"),
    *,
    chunk_size: int = 256,
    batch_size: int = 8,
) -> dict[str, Any]:
    """Retention of `bridge` on `windows` with exact source K/V and with each store encoding, and each encoding's cost
    with its paired 95 % interval.

    Args:
        bridge (`KVBridgeForCausalLM`): a calibrated bridge.
        windows (`torch.LongTensor` of shape `(N, T)`): held-out windows (`evaluation.heldout_windows`).
        context_len (`int`): the tokens of each window the source prefills.
        encodings (list of `str`): the store encodings to measure.
        chunk_size (`int`, *optional*, defaults to 256): tokens per stored chunk (fp8's scales are per chunk).

    Returns:
        `dict`: `retention` (exact), `windows`, and per encoding `retention`, `cost`, `cost_low`, `cost_high` (`None`
        with `cost_reason` where the target's gain from the context is not resolved by the windows), and the paired
        mean NLL change `nll_change` (nats/token, always defined) with its 95 % interval.

    Example:

    ```python
    >>> result = encoding_retention(bridge, windows, context_len=192)  # doctest: +SKIP
    >>> result["encodings"]["fp8_e4m3"]["cost"] < 0.003  # doctest: +SKIP
    True
    ```
    """
    from ...integrations.kv_store.encodings import check_encoding
    from ..evaluation import gap_recovered, student_t_quantile, window_nll

    for encoding in encodings:
        check_encoding(encoding)
    if len(windows) < 2:
        raise InvalidInputError(f"the retention's paired interval needs ≥ 2 windows, got {len(windows)}")
    nll = {mode: window_nll(bridge, windows, context_len, mode, batch_size) for mode in ("target", "no_context",
                                                                                        "bridge")}  # fmt: skip
    exact = gap_recovered(nll["no_context"], nll["bridge"], nll["target"])  # (nc − bridge) / (nc − target)
    result: dict[str, Any] = {"retention": exact.value, "windows": len(windows), "context_len": context_len,
                              "chunk_size": chunk_size, "encodings": {}}  # fmt: skip
    for encoding in encodings:
        with EncodedSource(bridge, encoding, chunk_size):
            encoded = window_nll(bridge, windows, context_len, "bridge", batch_size)  # (N,)
        cost = encoding_cost(nll, encoded)
        change = encoded - nll["bridge"]  # (N,) nats/token the encoding adds to each window's NLL
        half = student_t_quantile(0.975, len(change) - 1) * float(change.std()) / len(change) ** 0.5
        result["encodings"][encoding] = {
            "nll_change": float(change.mean()),
            "nll_change_low": float(change.mean()) - half,
            "nll_change_high": float(change.mean()) + half,
            "retention": gap_recovered(nll["no_context"], encoded, nll["target"]).value,
            "cost_reason": cost.reason,
            "cost": cost.value,
            "cost_low": cost.low,
            "cost_high": cost.high,
            "max_window_nll_change": float((encoded - nll["bridge"]).abs().max()),
        }
    return result


def pocket_encoding_retention(
    pair: str, *, windows: int = 32, window_len: int = 256, context_len: int = 192, num_sequences: int = 16,
    seq_len: int = 256, chunk_size: int = 64,
) -> dict[str, Any]:  # fmt: skip
    """`encoding_retention` of the pocket pair `pair` (`"pocket-m:pocket-l"`), calibrated here on the calibration
    split (`num_sequences` × `seq_len`), on `windows` held-out windows of `window_len` tokens."""
    from transformers import AutoTokenizer

    import hf_kvbridge
    from hf_kvbridge import pocket

    from ..evaluation import heldout_windows

    names = pair.split(":")
    if len(names) != 2 or any(name not in pocket.POCKET_MODELS for name in names):
        raise InvalidInputError(f"--retention takes SOURCE:TARGET pocket models ({', '.join(pocket.POCKET_MODELS)}), "
                                f"got {pair!r}")  # fmt: skip
    source, target = names
    tokenizer = AutoTokenizer.from_pretrained(pocket.model_path(target))
    bridge = hf_kvbridge.calibrate(f"pocket/{source}", f"pocket/{target}", pocket.load_texts("calibration"),
                                   tokenizer=tokenizer, num_sequences=num_sequences, seq_len=seq_len)  # fmt: skip
    held = heldout_windows(pocket.load_texts("heldout"), tokenizer, window_len, windows)
    return {"pair": pair, **encoding_retention(bridge, held, context_len, chunk_size=chunk_size)}


def format_retention(result: dict[str, Any]) -> str:
    """`encoding_retention`'s result as a text table."""
    lines = [
        f"{result.get('pair', 'bridge')}: retention {result['retention']:.4f} with exact source K/V, "
        f"{result['windows']} held-out windows, {result['context_len']} context tokens, chunks of "
        f"{result['chunk_size']}; cost = retention lost, paired 95% CI",
        f"{'encoding':<10} {'retention':>9} {'cost':>8} {'95% CI':>20}",
    ]
    for name, row in result["encodings"].items():
        if row["cost"] is None:
            lines.append(f"{name:<10} {'n/a':>9} {'n/a':>8} {'':>20}  NLL change {row['nll_change']:+.5f} nats/token "
                         f"({row['cost_reason']})")  # fmt: skip
            continue
        ci = f"[{row['cost_low']:+.4f}, {row['cost_high']:+.4f}]"
        change = f"[{row['nll_change_low']:+.5f}, {row['nll_change_high']:+.5f}]"
        lines.append(f"{name:<10} {row['retention']:>9.4f} {row['cost']:>+8.4f} {ci:>20}  NLL change "
                     f"{row['nll_change']:+.5f} {change}")  # fmt: skip
    return "\n".join(lines)
