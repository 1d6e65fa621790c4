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

    Knows two layouts: the CPU backend's with its portable kernels (`isa` "vec"/"vec16"): a cache of
    `(blocks, kv_heads, block_size, 2 * head_dim)` whose `(block, head)` page holds the keys transposed,
    `(head_dim, block_size)`, then the values, `(block_size, head_dim)` (found by writing through
    `cpu_attn_reshape_and_cache`), and the `(2, blocks, block_size, kv_heads, head_dim)` of FlashAttention-style
    backends (not run here: no GPU). Anything else raises `NotImplementedError`. `map_and_write` checks that it
    reads back what the backend's own cache-update op wrote before the gate trusts it (`reads_back`).
    """
    kv_cache = layer.kv_cache
    slots = slots.to(kv_cache.device)
    if layer.impl.__class__.__name__.startswith("CPUAttention") and getattr(layer, "isa", None) in ("vec", "vec16"):
        num_blocks, heads, block_size, width = kv_cache.shape
        head_dim = width // 2
        pages = kv_cache.view(num_blocks, heads, 2, block_size * head_dim)  # per block and head: keys, values
        blocks, offsets = slots // block_size, slots % block_size
        keys = pages[:, :, 0].unflatten(-1, (head_dim, block_size))[blocks, :, :, offsets]  # (T, H, d)
        values = pages[:, :, 1].unflatten(-1, (block_size, head_dim))[blocks, :, offsets]  # (T, H, d)
        return keys, values
    if kv_cache.dim() == 5 and kv_cache.shape[0] == 2:
        block_size = kv_cache.shape[2]
        keys, values = (part[slots // block_size, slots % block_size] for part in kv_cache.unbind(0))  # (T, H, d)
        return keys, values
    raise NotImplementedError(f"unknown KV cache layout {tuple(kv_cache.shape)} of {layer.impl.__class__.__name__}")


def reads_back(layer: nn.Module, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether `read_slots` returns the `keys`/`values` just written at `slots` (exactly, in the cache's dtype)."""
    try:
        got_keys, got_values = read_slots(layer, slots)
    except NotImplementedError:
        return False
    dtype = got_keys.dtype
    return torch.equal(got_keys, keys.to(dtype)) and torch.equal(got_values, values.to(dtype))
