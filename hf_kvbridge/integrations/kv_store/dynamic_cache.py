"""A transformers `DynamicCache` into and out of a `PrefixKVStore` (the library side of the warm path).

`save_cache` exports a prefill's cache (batch 1) as the store's chunks; `load_cache` builds a `DynamicCache` of a
stored prefix that a model continues from at position `num_tokens`, as if it had prefilled those tokens itself.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import Cache, DynamicCache

from ...errors import InvalidInputError
from ...utils.cache import append_layer, cache_layer_kv, cache_num_layers
from .keys import as_token_list
from .prefix import PrefixKVStore, StoredPrefix


def save_cache(
    prefix_store: PrefixKVStore, token_ids: Any, cache: Cache, *, salt: str | None = None, tail: bool = True
) -> int:
    """Exports a prefill's cache of `token_ids` (batch 1) to the store: its whole chunks, and (with `tail`) its
    trailing partial chunk.

    Args:
        prefix_store (`PrefixKVStore`): the model's prefix store.
        token_ids (list of `int`, or a `(seq,)` / `(1, seq)` tensor): the tokens the cache holds, from token 0.
        cache (`Cache`): the model's cache after its forward pass over `token_ids` (every layer holding every
            token: a plain `DynamicCache()`, not one built from a sliding-window config).
        salt (`str`, *optional*): the tenant's cache salt.
        tail (`bool`, *optional*, defaults to `True`): store the trailing partial chunk too.

    Returns:
        `int`: whole chunks queued or written (stored chunks are skipped).

    Example:

    ```python
    >>> out = model(ids, use_cache=True, past_key_values=DynamicCache())  # doctest: +SKIP
    >>> save_cache(prefix, ids, out.past_key_values)  # doctest: +SKIP
    2
    ```
    """
    tokens = as_token_list(token_ids)
    keys, values = [], []
    for layer in range(cache_num_layers(cache)):
        k, v = cache_layer_kv(cache, layer)  # (1, H, T, d)
        if k.shape[0] != 1:
            raise InvalidInputError(f"save_cache takes a cache of batch 1, got batch {k.shape[0]}; save each row")
        if k.shape[2] != len(tokens):
            raise InvalidInputError(
                f"cache layer {layer} holds {k.shape[2]} tokens but token_ids has {len(tokens)}; pass the tokens of "
                "the prefill, and prefill with a plain DynamicCache() (a sliding-window layer keeps only its window)"
            )
        keys.append(k[0])  # (H, T, d)
        values.append(v[0])
    return prefix_store.save(tokens, keys, values, start=0, salt=salt, tail=tail)


def load_cache(
    prefix_store: PrefixKVStore,
    token_ids: Any,
    num_tokens: int,
    *,
    salt: str | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    stored: StoredPrefix | None = None,
) -> DynamicCache:
    """A `DynamicCache` (batch 1, layers `(1, H, num_tokens, d)`) of the stored K/V of tokens `[0, num_tokens)`.

    Args:
        prefix_store (`PrefixKVStore`): the model's prefix store.
        token_ids (list of `int`, or a tensor): the sequence (at least `num_tokens` tokens).
        num_tokens (`int`): at most what the store holds, usually `prefix_store.lookup(token_ids).tokens`.
        salt (`str`, *optional*): the tenant's cache salt.
        dtype (`torch.dtype`, *optional*): cast to this dtype (default: the stored one).
        device (`torch.device` or `str`, *optional*): move to this device (default: CPU).
        stored (`StoredPrefix`, *optional*): the lookup of `token_ids` (spares a second one, see
            `PrefixKVStore.load`).

    Raises `StoreMissError` if a chunk vanished since the lookup, `StoreFormatError` for a corrupt one.

    Example:

    ```python
    >>> found = prefix.lookup(ids)  # doctest: +SKIP
    >>> n = found.tokens; cache = load_cache(prefix, ids, n, dtype=model.dtype, stored=found)  # doctest: +SKIP
    >>> model(ids[:, n:], past_key_values=cache)  # continues at position n  # doctest: +SKIP
    ```
    """
    keys, values = prefix_store.load(token_ids, num_tokens, salt=salt, stored=stored)
    cache = DynamicCache()
    for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
        k = k.to(device=device, dtype=dtype).unsqueeze(0)  # (1, H, n, d)
        v = v.to(device=device, dtype=dtype).unsqueeze(0)
        append_layer(cache, layer, k, v)
    return cache
