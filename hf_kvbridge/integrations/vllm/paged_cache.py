"""vLLM's paged KV cache, read and written: slots of a request's positions, one layer's write through the attention
backend's own cache-update op, and reading slots back (the quality gate), with the layout detected at run time."""

from __future__ import annotations

import torch
from torch import nn


def slots_of(block_ids: list[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """Slots in vLLM's paged cache of prompt positions `[start, end)` of a request holding blocks `block_ids`."""
    offsets = torch.arange(start, end)
    blocks = torch.tensor(block_ids, dtype=torch.long)[offsets // block_size]
    return blocks * block_size + offsets % block_size


def write_layer(layer: nn.Module, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
    """Writes `keys`, `values` (`(T, kv_heads, head_dim)` each, keys post-RoPE) at `slots` of `layer`'s paged cache
    through the backend's `do_kv_cache_update`, so the layout is the backend's business."""
    kv_cache = layer.kv_cache
    layer.impl.do_kv_cache_update(layer, keys, values, kv_cache, slots.to(kv_cache.device))


def read_slots(layer: nn.Module, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values `(len(slots), kv_heads, head_dim)` stored at `slots` of `layer`'s paged KV cache.

    Two kinds of layout:

    - the CPU backend's `(blocks, kv_heads, block_size, 2 * head_dim)` cache, whose kernels (`layer.isa`: "vec" and
      "vec16", the portable ones; "amx", which vLLM picks for bfloat16 on CPUs with AMX tiles; "neon", ...) each
      order a block's keys and values their own way. The order is not assumed: it is *probed*, once per kernel,
      dtype and shape, by writing coordinates through the backend's own `do_kv_cache_update` into a scratch block
      (`probe_block_layout`), so every kernel vLLM picks is read as it wrote;
    - the `(2, blocks, block_size, kv_heads, head_dim)` of FlashAttention-style backends (not run here: no GPU).

    A quantized (fp8) cache holds codes with the engine's scales, not numbers: it raises `NotImplementedError` (the
    connector refuses fp8 caches at start-up, `support.engine_refusal`), and so does any other layout.
    `map_and_write` checks that it reads back what the backend's own op wrote before the gate trusts it
    (`reads_back`).
    """
    kv_cache = layer.kv_cache
    slots = slots.to(kv_cache.device)
    if not (kv_cache.dtype.is_floating_point and kv_cache.dtype.itemsize >= 2):
        raise NotImplementedError(f"a {kv_cache.dtype} KV cache holds quantized codes, not keys and values")
    cpu_backend = any(cls.__name__.startswith("CPUAttention") for cls in type(layer.impl).__mro__)
    if cpu_backend and kv_cache.dim() == 4:
        num_blocks, heads, block_size, width = kv_cache.shape
        key_index, value_index = probe_block_layout(layer)  # (block_size, H, d) each, into a flattened block
        blocks, offsets = slots // block_size, slots % block_size
        pages = kv_cache.view(num_blocks, -1)[blocks]  # (T, H * block_size * 2d)
        shape = (len(slots), heads, width // 2)
        keys = pages.gather(1, key_index[offsets].flatten(1).to(kv_cache.device)).view(shape)  # (T, H, d)
        values = pages.gather(1, value_index[offsets].flatten(1).to(kv_cache.device)).view(shape)  # (T, H, d)
        return keys, values
    if kv_cache.dim() == 5 and kv_cache.shape[0] == 2:
        block_size = kv_cache.shape[2]
        keys, values = (part[slots // block_size, slots % block_size] for part in kv_cache.unbind(0))  # (T, H, d)
        return keys, values
    raise NotImplementedError(f"unknown KV cache layout {tuple(kv_cache.shape)} of {layer.impl.__class__.__name__}")


_PROBED: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_DIGIT = 128  # coordinates are written in base-128 digits (+1): integers up to 129 are exact in bfloat16 and float16


def probe_block_layout(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the backend's cache-update op puts each key and value of one block: `(key_index, value_index)`, each
    `(block_size, kv_heads, head_dim)` of positions in the block's flattened page (`kv_cache[block].flatten()`).

    Found by writing a scratch one-block cache of `layer`'s dtype and shape through `layer.impl.do_kv_cache_update`
    (the op vLLM and the connector write with, with the layer's kernel and scales), once per coordinate digit: the
    token offset, the head and the dimension, each as base-128 digits plus one (exact in every float cache dtype), and
    whether it is a key or a value. Every `(key/value, offset, head, dim)` must land in exactly one place, or the
    layout is not one this can read (`NotImplementedError`). Cached per kernel (`layer.isa`), dtype and shape.
    """
    kv_cache = layer.kv_cache
    _, heads, block_size, width = kv_cache.shape
    key = (layer.impl.__class__.__name__, getattr(layer, "isa", None), kv_cache.dtype, heads, block_size, width)
    if key not in _PROBED:
        try:
            _PROBED[key] = _probe(layer)
        except RuntimeError as error:  # the kernel cannot write this shape or dtype: nothing to read either
            raise NotImplementedError(f"probing the KV cache layout failed: {error}") from error
    return _PROBED[key]


def _probe(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    kv_cache = layer.kv_cache
    _, heads, block_size, width = kv_cache.shape
    head_dim = width // 2
    scratch = torch.zeros((1, heads, block_size, width), dtype=kv_cache.dtype, device=kv_cache.device)
    slots = torch.arange(block_size, device=kv_cache.device)
    grid = torch.stack(
        torch.meshgrid(torch.arange(block_size), torch.arange(heads), torch.arange(head_dim), indexing="ij")
    ).to(kv_cache.device)  # (3, block_size, H, d): offset, head, dim
    found = torch.zeros(heads * block_size * width, dtype=torch.long, device=kv_cache.device)
    for axis, stride in enumerate((heads * head_dim, head_dim, 1)):  # into the flat (offset, head, dim) index
        power = 1
        while power == 1 or power <= int(grid[axis].max()):  # one base-128 digit per write
            digit = (grid[axis] // power % _DIGIT + 1).to(kv_cache.dtype)  # (block_size, H, d), in 1..128
            scratch.zero_()
            layer.impl.do_kv_cache_update(layer, digit, digit, scratch, slots)
            found += (scratch.flatten().long() - 1).clamp(min=0) * power * stride
            power *= _DIGIT
    ones = torch.ones((block_size, heads, head_dim), dtype=kv_cache.dtype, device=kv_cache.device)
    scratch.zero_()
    layer.impl.do_kv_cache_update(layer, ones, ones * 2, scratch, slots)
    side = scratch.flatten().long()  # 1: a key, 2: a value, 0: nothing (padding)
    index = torch.full((2, block_size * heads * head_dim), -1, dtype=torch.long, device=kv_cache.device)
    for side_value in (1, 2):
        positions = (side == side_value).nonzero().flatten()
        index[side_value - 1, found[positions]] = positions
    counts = torch.stack([torch.bincount(found[side == v], minlength=index.shape[1]) for v in (1, 2)])
    if (index < 0).any() or (counts != 1).any() or int((side > 0).sum()) != 2 * index.shape[1]:
        raise NotImplementedError(
            f"the KV cache layout of {layer.impl.__class__.__name__} (isa {getattr(layer, 'isa', None)}, "
            f"{kv_cache.dtype}) is not a permutation of one block's keys and values"
        )
    shape = (block_size, heads, head_dim)
    return index[0].view(shape), index[1].view(shape)


def reads_back(layer: nn.Module, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether `read_slots` returns the `keys`/`values` just written at `slots` (exactly, in the cache's dtype)."""
    try:
        got_keys, got_values = read_slots(layer, slots)
    except NotImplementedError:
        return False
    dtype = got_keys.dtype
    return torch.equal(got_keys, keys.to(dtype)) and torch.equal(got_values, values.to(dtype))
