"""The fused rotation's CUDA kernel (`hf_kvbridge.utils.rope.rotate_kv`), in Triton: one launch per layer reads its
keys and values once, rotates the keys in float32 and writes both, in any strides and dtypes.

```
keys (B, H, T, d) ──[k1·c − k2·s, k2·c + k1·s] (float32)──▶ key_out (B, H, T, d)
values (B, H, T, d) ──────────────────────────────────────▶ value_out
```

Per token and head it moves `2·d` elements in and `2·d` out (plus `d` cos/sin values, shared by the heads of a
token), against the eager rotation's 5 passes (4 elementwise kernels over the key halves and a copy). Layers of one
layout (the engine's source cache layers into its row slots, its mapped rows into a static cache's layers) go in one
launch: the kernel reads each layer's addresses from a table. Imported only where Triton is installed; it runs on CPU
tensors under `TRITON_INTERPRET=1` (the tests check it there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_TOKENS = 32  # tokens per program: a (32, d/2) tile of each key half, two of the value


@triton.jit
def _rotate_kv_kernel(
    k_ptr, v_ptr, cos_ptr, sin_ptr, ko_ptr, vo_ptr,
    batch, heads, tokens,
    sk_a, sk_b, sk_h, sk_t, sk_d, sv_a, sv_b, sv_h, sv_t, sv_d,
    sko_a, sko_b, sko_h, sko_t, sko_d, svo_a, svo_b, svo_h, svo_t, svo_d,
    sc_b, sc_t, sc_d,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_T: tl.constexpr, HAS_VALUES: tl.constexpr,
):  # fmt: skip
    # one program: layer a, batch row b, head h, tokens [t0, t0 + BLOCK_T); offsets in int64 (a row buffer's strides
    # are large)
    abh = tl.program_id(0)
    a = (abh // (batch * heads)).to(tl.int64)
    b = (abh // heads % batch).to(tl.int64)
    h = (abh % heads).to(tl.int64)
    t = (tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # (BLOCK_T,)
    _rotate_tile(
        k_ptr + a * sk_a + b * sk_b + h * sk_h + t[:, None] * sk_t,
        v_ptr + a * sv_a + b * sv_b + h * sv_h + t[:, None] * sv_t,
        ko_ptr + a * sko_a + b * sko_b + h * sko_h + t[:, None] * sko_t,
        vo_ptr + a * svo_a + b * svo_b + h * svo_h + t[:, None] * svo_t,
        cos_ptr, sin_ptr, b * sc_b + t[:, None] * sc_t, sc_d, t, tokens, sk_d, sv_d, sko_d, svo_d,
        ko_ptr.dtype.element_ty, vo_ptr.dtype.element_ty, HALF, BLOCK_HALF, HAS_VALUES,
    )  # fmt: skip


@triton.jit
def _rotate_tile(
    k, v, ko, vo, cos_ptr, sin_ptr, table, sc_d, t, tokens, sk_d, sv_d, sko_d, svo_d,
    KO_TYPE: tl.constexpr, VO_TYPE: tl.constexpr,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, HAS_VALUES: tl.constexpr,
):  # fmt: skip
    """One program's tile: tokens `t` `(BLOCK_T,)` of one layer, batch row and head, whose rows start at `k`, `v`,
    `ko`, `vo` `(BLOCK_T, 1)` and whose cos/sin rows start at `table` (offsets); the keys rotated in float32 into
    `ko`, the values copied into `vo` (with `HAS_VALUES`)."""
    j = tl.arange(0, BLOCK_HALF).to(tl.int64)  # (BLOCK_HALF,) dims of the first half
    mask = (t[:, None] < tokens) & (j[None, :] < HALF)  # (BLOCK_T, BLOCK_HALF)
    c = tl.load(cos_ptr + table + j[None, :] * sc_d, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + table + j[None, :] * sc_d, mask=mask, other=0.0).to(tl.float32)
    k1 = tl.load(k + j[None, :] * sk_d, mask=mask, other=0.0).to(tl.float32)
    k2 = tl.load(k + (j[None, :] + HALF) * sk_d, mask=mask, other=0.0).to(tl.float32)
    tl.store(ko + j[None, :] * sko_d, _cast(k1 * c - k2 * s, KO_TYPE), mask=mask)
    tl.store(ko + (j[None, :] + HALF) * sko_d, _cast(k2 * c + k1 * s, KO_TYPE), mask=mask)
    if HAS_VALUES:
        for half in tl.static_range(2):
            part = tl.load(v + (j[None, :] + half * HALF) * sv_d, mask=mask)
            tl.store(vo + (j[None, :] + half * HALF) * svo_d, _cast(part, VO_TYPE), mask=mask)


@triton.jit
def _cast(x, dtype: tl.constexpr):
    """`x` in `dtype`; float32 to bfloat16 rounded to nearest even by hand (the bits of `x` plus `0x7fff` plus the
    last kept bit, then the high half), as PyTorch and a GPU's conversion round, and as Triton's interpreter, whose
    cast truncates, would not: the CPU test then checks the same numbers a GPU computes. (NaN is not kept NaN: the
    inputs are finite.)"""
    if dtype == tl.bfloat16 and x.dtype == tl.float32:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


@triton.jit
def _rotate_kv_layers_kernel(
    table_ptr, cos_ptr, sin_ptr,
    layers, batch, heads, tokens,
    sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d,
    sko_b, sko_h, sko_t, sko_d, svo_b, svo_h, svo_t, svo_d,
    sc_b, sc_t, sc_d,
    K_TYPE: tl.constexpr, V_TYPE: tl.constexpr, KO_TYPE: tl.constexpr, VO_TYPE: tl.constexpr,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_T: tl.constexpr, HAS_VALUES: tl.constexpr,
):  # fmt: skip
    # `_rotate_kv_kernel` over many layers in one launch: layer a's four tensors are at addresses
    # table[a], table[L + a], table[2L + a], table[3L + a] (keys, values, key_out, value_out), of equal strides
    abh = tl.program_id(0)
    a = abh // (batch * heads)
    k_ptr = tl.load(table_ptr + a).to(tl.pointer_type(K_TYPE))
    v_ptr = tl.load(table_ptr + layers + a).to(tl.pointer_type(V_TYPE))
    ko_ptr = tl.load(table_ptr + 2 * layers + a).to(tl.pointer_type(KO_TYPE))
    vo_ptr = tl.load(table_ptr + 3 * layers + a).to(tl.pointer_type(VO_TYPE))
    b = (abh // heads % batch).to(tl.int64)
    h = (abh % heads).to(tl.int64)
    t = (tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # (BLOCK_T,)
    _rotate_tile(
        k_ptr + b * sk_b + h * sk_h + t[:, None] * sk_t,
        v_ptr + b * sv_b + h * sv_h + t[:, None] * sv_t,
        ko_ptr + b * sko_b + h * sko_h + t[:, None] * sko_t,
        vo_ptr + b * svo_b + h * svo_h + t[:, None] * svo_t,
        cos_ptr, sin_ptr, b * sc_b + t[:, None] * sc_t, sc_d, t, tokens, sk_d, sv_d, sko_d, svo_d,
        KO_TYPE, VO_TYPE, HALF, BLOCK_HALF, HAS_VALUES,
    )  # fmt: skip


_TRITON_TYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _uniform(tensors: list[torch.Tensor]) -> bool:
    """Whether `tensors` share one shape, strides and dtype (so one launch can address them all)."""
    first = tensors[0]
    return first.dim() == 4 and all(
        t.shape == first.shape and t.stride() == first.stride() and t.dtype == first.dtype for t in tensors
    )


def rotate_kv(
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_out: list[torch.Tensor],
    value_out: list[torch.Tensor],
) -> None:
    """`hf_kvbridge.utils.rope.rotate_kv` in Triton: one launch for all entries when they share one layout (shape,
    strides and dtype per list: a cache's layers), else one launch per entry (keys and, where given, its values).

    Args:
        keys, values (`list[torch.Tensor]`): `(B, H, T, d)` or `(n, B, H, T, d)` (n layers) each, any strides;
            `values` empty or one per key (`hf_kvbridge.utils.rope.rotate_kv` runs other pairings eagerly).
        cos, sin (`torch.Tensor` of shape `(B, T, d/2)`): the half-size tables, float32.
        key_out, value_out (`list[torch.Tensor]`): outputs of the inputs' shapes.
    """
    lists = [keys, values, key_out, value_out] if values else [keys, keys, key_out, key_out]
    if len(keys) > 1 and all(_uniform(x) for x in lists) and all(x[0].dtype in _TRITON_TYPES for x in lists):
        _rotate_layers(lists, cos, sin, bool(values))  # many layers of one layout (the engine's): one launch
        return
    for i, k in enumerate(keys):
        *outer, batch, heads, tokens, dim = k.shape
        layers = outer[0] if outer else 1
        if tokens == 0 or layers * batch * heads == 0:
            continue
        half = dim // 2
        has_values = bool(values)
        v, v_out = (values[i], value_out[i]) if has_values else (k, key_out[i])  # unread without values
        grid = (layers * batch * heads, triton.cdiv(tokens, BLOCK_TOKENS))
        _rotate_kv_kernel[grid](
            k, v, cos, sin, key_out[i], v_out,
            batch, heads, tokens,
            *_strides5(k), *_strides5(v), *_strides5(key_out[i]), *_strides5(v_out),
            cos.stride(0), cos.stride(1), cos.stride(2),
            HALF=half, BLOCK_HALF=triton.next_power_of_2(half), BLOCK_T=BLOCK_TOKENS, HAS_VALUES=has_values,
        )  # fmt: skip


def _rotate_layers(lists: list[list[torch.Tensor]], cos: torch.Tensor, sin: torch.Tensor, has_values: bool) -> None:
    """One launch of `_rotate_kv_layers_kernel` over the layers of `lists` (keys, values, key_out, value_out)."""
    keys = lists[0]
    layers, (batch, heads, tokens, dim) = len(keys), keys[0].shape
    if tokens == 0 or batch * heads == 0:
        return
    addresses = [x.data_ptr() for part in lists for x in part]  # (4L,): one copy to the device for all of them
    table = torch.tensor(addresses, dtype=torch.int64).to(keys[0].device)
    half = dim // 2
    grid = (layers * batch * heads, triton.cdiv(tokens, BLOCK_TOKENS))
    _rotate_kv_layers_kernel[grid](
        table, cos, sin,
        layers, batch, heads, tokens,
        *lists[0][0].stride(), *lists[1][0].stride(), *lists[2][0].stride(), *lists[3][0].stride(),
        cos.stride(0), cos.stride(1), cos.stride(2),
        K_TYPE=_TRITON_TYPES[lists[0][0].dtype], V_TYPE=_TRITON_TYPES[lists[1][0].dtype],
        KO_TYPE=_TRITON_TYPES[lists[2][0].dtype], VO_TYPE=_TRITON_TYPES[lists[3][0].dtype],
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half), BLOCK_T=BLOCK_TOKENS, HAS_VALUES=has_values,
    )  # fmt: skip


def _strides5(x: torch.Tensor) -> tuple[int, ...]:
    """Strides of `x` as an `(n, B, H, T, d)` tensor (a `(B, H, T, d)` one has one layer, stride 0)."""
    return tuple(x.stride()) if x.dim() == 5 else (0, *x.stride())
