"""How many bytes a model's K/V takes in the store, per token and per chunk (for `maxmemory` and network sizing)."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from ...errors import InvalidInputError
from ...utils.layout import KVLayout

HEADER_BYTES_PER_LAYER = 192
"""Upper bound of the safetensors header bytes a stored chunk adds per layer (two tensor entries, offsets < 10 GB)."""

HEADER_BYTES_FIXED = 512
"""Upper bound of the header bytes a stored chunk adds once (metadata), for a model identity of ≤ 128 characters."""

TOKEN_ID_BYTES = 8
"""Bytes a stored chunk adds per token: its token ids (int64), which a reader checks against its own."""


def _itemsize(dtype: torch.dtype | str) -> int:
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(resolved, torch.dtype):
            raise InvalidInputError(f"{dtype!r} is not a torch dtype; use e.g. 'bfloat16' or torch.float32")
        dtype = resolved
    return torch.empty((), dtype=dtype).element_size()


def chunk_bytes(layout_or_config: KVLayout | PretrainedConfig, chunk_size: int, dtype: torch.dtype | str) -> int:
    """Bytes of the K/V tensors of one stored chunk: layers × 2 (K, V) × kv_heads × head_dim × tokens × itemsize.

    The payload adds a header of at most `HEADER_BYTES_FIXED + HEADER_BYTES_PER_LAYER × layers` bytes and the token
    ids (`TOKEN_ID_BYTES` a token); the server adds its own per-key overhead (tens of bytes). `chunk_bytes(layout,
    1, dtype)` is the cost of one token.

    Args:
        layout_or_config (`KVLayout` or `PretrainedConfig`): the model's KV layout (or its config).
        chunk_size (`int`): tokens per chunk.
        dtype (`torch.dtype` or `str`): the dtype the K/V are stored in (the engine's KV dtype).

    Example:

    ```python
    >>> from transformers import Qwen3Config
    >>> qwen3_06b = Qwen3Config(num_hidden_layers=28, num_key_value_heads=8, head_dim=128)
    >>> chunk_bytes(qwen3_06b, 1, "bfloat16"), chunk_bytes(qwen3_06b, 256, "bfloat16")
    (114688, 29360128)
    ```
    """
    layout = layout_or_config if isinstance(layout_or_config, KVLayout) else KVLayout.from_config(layout_or_config)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise InvalidInputError(f"chunk_size must be a whole number of tokens ≥ 1, got {chunk_size!r}")
    return layout.num_layers * 2 * layout.num_kv_heads * layout.head_dim * chunk_size * _itemsize(dtype)
