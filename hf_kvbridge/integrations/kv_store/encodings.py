"""How a stored chunk holds its K/V: in the source's dtype, in bfloat16, or in fp8 (e4m3) with per-head scales.

An encoding is chosen per store (`PrefixKVStore(..., encoding=...)`, the vLLM connector's `kv_store_encoding`, a
store URL's `?encoding=` parameter), recorded in every entry it writes and checked when the entry is read: a reader
decodes any encoding it knows, whatever its own store writes, and refuses an entry of an encoding it does not know
(`StoreFormatError`: the caller counts it as a miss and computes the tokens), never reading it as another.

- `source`: the K/V as the source engine holds them (bfloat16 for most engines): exact.
- `bfloat16`: exact for a bfloat16 source; halves a float32 source's bytes.
- `fp8_e4m3`: one byte per value, `float8_e4m3fn` codes with one float32 scale per KV head of each layer and chunk
  (the head's largest magnitude over the chunk's tokens maps to e4m3's largest, 448): half of bfloat16's bytes; a
  reader gets the K/V back in the source's dtype (the dequantization is its one copy).

Example:

```python
>>> import torch
>>> k = torch.randn(2, 16, 8)
>>> parts = encode_tensor(k, "fp8_e4m3")
>>> sorted(parts), parts[""].dtype, parts["_scale"].shape
(['', '_scale'], torch.float8_e4m3fn, torch.Size([2]))
>>> (decode_tensor(parts[""], parts["_scale"], "fp8_e4m3", torch.float32) - k).abs().max() < 0.2
tensor(True)
```
"""

from __future__ import annotations

import torch

from ...constants import STORE_ENCODINGS
from ...errors import InvalidInputError, StoreFormatError

ENCODINGS = STORE_ENCODINGS
"""The encodings a stored chunk may have: `"source"`, `"bfloat16"`, `"fp8_e4m3"`."""

DEFAULT_ENCODING = "source"
"""The encoding a store writes unless told otherwise (and that of every chunk written before encodings existed)."""

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
_FP8_VALUES = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).to(torch.float32)  # (256,) code → value
SCALE_SUFFIX = "_scale"
"""A scaled encoding's per-head scales are the tensor `<name>_scale` beside `<name>`."""


def check_encoding(encoding: str) -> str:
    """`encoding` if it is one of `ENCODINGS`; else an `InvalidInputError` that lists them."""
    if encoding not in ENCODINGS:
        raise InvalidInputError(f"unknown store encoding {encoding!r}; choose one of {', '.join(ENCODINGS)}")
    return encoding


def encode_tensor(tensor: torch.Tensor, encoding: str) -> dict[str, torch.Tensor]:
    """The stored tensors of one layer's keys or values `(kv_heads, tokens, head_dim)` in `encoding`: `{"": codes}`,
    and `{"_scale": (kv_heads,) float32}` for fp8. Views of `tensor` where the encoding keeps it as it is."""
    if encoding == "source":
        return {"": tensor}
    if encoding == "bfloat16":
        return {"": tensor.to(torch.bfloat16)}
    # fp8: per KV head, the largest magnitude over the chunk maps to e4m3's largest (448). The largest magnitude is
    # taken in the source's dtype (exact), and the scaled values computed in one float32 copy, in place: the same
    # codes as dividing a float32 copy, at about half the time (one float32 temporary instead of four).
    amax = tensor.abs().amax(dim=(1, 2)).float()  # (H,)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # (H,)
    wide = tensor.to(torch.float32, copy=True).div_(scale[:, None, None]).clamp_(-FP8_MAX, FP8_MAX)  # (H, T, d)
    return {"": wide.to(FP8_DTYPE), SCALE_SUFFIX: scale.contiguous()}


def decode_tensor(codes: torch.Tensor, scale: torch.Tensor | None, encoding: str, dtype: torch.dtype) -> torch.Tensor:
    """One layer's keys or values `(kv_heads, tokens, head_dim)` from their stored `codes` (and `scale`): the codes
    themselves (no copy) for `source` and `bfloat16`, the dequantized values in `dtype` for fp8."""
    if encoding != "fp8_e4m3":
        return codes
    # the 256 codes' values looked up (several times faster on CPU than torch's element-wise fp8 cast)
    values = _FP8_VALUES.index_select(0, codes.reshape(-1).view(torch.uint8).int()).view(codes.shape)  # (H, T, d)
    return (values.mul_(scale[:, None, None])).to(dtype)


def dequantize_codes(codes: torch.Tensor, scale: float) -> torch.Tensor:
    """float32 values `code * scale` of an fp8 KV cache's `codes` (a `float8_e4m3fn` or `float8_e5m2` tensor, any
    shape and strides): what the engine's attention reads (vLLM's `kv_cache_dtype` fp8, `code = fp8(x / scale)`)."""
    if codes.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise InvalidInputError(f"fp8 codes must be float8_e4m3fn or float8_e5m2, got {codes.dtype}")
    return codes.to(torch.float32) * scale


def check_stored(name: str, codes: torch.Tensor, scale: torch.Tensor | None, encoding: str) -> None:
    """Raises `StoreFormatError` unless the stored tensors of `name` are what `encoding` writes."""
    if encoding == "bfloat16" and codes.dtype != torch.bfloat16:
        raise StoreFormatError(f"the stored chunk says encoding bfloat16 but {name} is {codes.dtype}")
    if encoding == "fp8_e4m3":
        if codes.dtype != FP8_DTYPE:
            raise StoreFormatError(f"the stored chunk says encoding fp8_e4m3 but {name} is {codes.dtype}")
        if scale is None or scale.dtype != torch.float32 or tuple(scale.shape) != (codes.shape[0],):
            got = "none" if scale is None else f"{tuple(scale.shape)} {scale.dtype}"
            raise StoreFormatError(
                f"the stored chunk's fp8 {name} needs one float32 scale per KV head ({codes.shape[0]}), got {got}"
            )


def bytes_per_value(encoding: str, dtype: torch.dtype) -> int:
    """Bytes one K/V value takes in `encoding` from a source of `dtype` (fp8's scales aside: 4 bytes per head and
    chunk)."""
    check_encoding(encoding)
    return {"source": torch.empty((), dtype=dtype).element_size(), "bfloat16": 2, "fp8_e4m3": 1}[encoding]
