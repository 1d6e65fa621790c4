"""`PrefixKVStore`: one model's per-token K/V in a store, by prefix: look up, save, load.

A sequence's K/V is stored as chunks of `chunk_size` tokens under chained keys (`keys.py`), each chunk a
self-describing payload (`format.py`). A lookup counts the leading chunks stored (one round trip); a save writes the
chunks it covers that are not stored yet (through an `AsyncWriter`, or at once); a load fetches a prefix's chunks
in one round trip and checks each before joining them.
"""

from __future__ import annotations

from typing import Any

import torch

from ...errors import InvalidInputError, StoreFormatError, StoreMissError
from .base import KVStore
from .format import decode_chunk, encode_chunk
from .keys import DEFAULT_CHUNK_SIZE, as_token_list, chunk_keys
from .writer import AsyncWriter


def _check_kv(keys: list[torch.Tensor], values: list[torch.Tensor], what: str) -> int:
    """The token count `T` of per-layer `(kv_heads, T, head_dim)` keys/values; raises on anything else."""
    if len(keys) != len(values) or not keys:
        raise InvalidInputError(f"{what}: keys and values for the same ≥ 1 layers, got {len(keys)} and {len(values)}")
    tokens = keys[0].shape[1] if keys[0].dim() == 3 else -1
    for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
        if k.dim() != 3 or k.shape != v.shape or k.shape[1] != tokens:
            raise InvalidInputError(
                f"{what}: layer {layer} keys {tuple(k.shape)} and values {tuple(v.shape)} must both be (kv_heads, "
                f"tokens, head_dim) with the {tokens} tokens of layer 0"
            )
    return tokens


class PrefixKVStore:
    """One model's K/V in a `KVStore`, found by the longest stored prefix of a token sequence.

    Args:
        store (`KVStore`): the store (`open_store(url)`).
        model_id (`str`): the identity of the model whose K/V this holds (`model_identity`).
        chunk_size (`int`, *optional*, defaults to `DEFAULT_CHUNK_SIZE`): tokens per chunk; writers and readers of
            one model must agree on it (it changes every key).
        writer (`AsyncWriter`, *optional*): writes saves in the background; without one, `save` writes at once.

    Example:

    ```python
    >>> prefix = PrefixKVStore(open_store(url), model_id=model_identity("pocket-s"), chunk_size=64)  # doctest: +SKIP
    >>> prefix.save(ids, keys, values, start=0)  # doctest: +SKIP
    2
    >>> n = prefix.stored_tokens(ids); k, v = prefix.load(ids, n)  # doctest: +SKIP
    ```
    """

    def __init__(
        self, store: KVStore, *, model_id: str, chunk_size: int = DEFAULT_CHUNK_SIZE, writer: AsyncWriter | None = None
    ):
        chunk_keys([], model_id=model_id, chunk_size=chunk_size)  # checks both
        if writer is not None and writer.store is not store:
            raise InvalidInputError("the AsyncWriter given to PrefixKVStore must write to the same store")
        self.store = store
        self.model_id = model_id
        self.chunk_size = chunk_size
        self.writer = writer

    @property
    def metrics(self):
        """The store's `StoreMetrics`."""
        return self.store.metrics

    def keys(self, token_ids: Any, salt: str | None = None) -> list[str]:
        """The keys of the full chunks of `token_ids` (see `chunk_keys`)."""
        return chunk_keys(token_ids, model_id=self.model_id, chunk_size=self.chunk_size, salt=salt)

    def stored_tokens(self, token_ids: Any, salt: str | None = None) -> int:
        """Tokens covered by the longest stored prefix of whole chunks (`chunk_size × ` leading chunks stored).

        One round trip; counted in `metrics` (`lookups`, `lookup_hit_chunks`, `lookup_miss`). Raises
        `StoreUnavailableError` when the store cannot be asked (the caller falls back to computing the tokens).
        """
        keys = self.keys(token_ids, salt)
        chunks = self.store.count_prefix(keys)
        self.metrics.add(lookups=1, lookup_hit_chunks=chunks, lookup_miss=int(chunks == 0))
        return chunks * self.chunk_size

    def save(
        self,
        token_ids: Any,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        *,
        start: int,
        salt: str | None = None,
        skip_stored: bool = True,
    ) -> int:
        """Writes every full chunk inside tokens `[start, start + T)` of `token_ids`.

        Args:
            token_ids (list of `int` or a 1-D tensor): the whole sequence from token 0 (the key chain needs it).
            keys (list of `torch.Tensor`): per layer, `(kv_heads, T, head_dim)` for tokens `[start, start + T)`,
                post-RoPE at those absolute positions.
            values (list of `torch.Tensor`): per layer, the same shape.
            start (`int`): absolute position of `keys[l][:, 0]`; a multiple of `chunk_size`.
            salt (`str`, *optional*): the tenant's cache salt.
            skip_stored (`bool`, *optional*, defaults to `True`): leave chunks the store already holds alone (one
                round trip to ask); `False` rewrites them (and restarts their TTL).

        Returns:
            `int`: chunks queued (with a writer; dropped ones not counted) or written. A trailing partial chunk is
            not written: it has no key until its sequence fills it.

        With a writer the chunks are encoded on its thread: the tensors must not change until it has written them.
        """
        tokens = as_token_list(token_ids)
        span = _check_kv(keys, values, "PrefixKVStore.save")
        if isinstance(start, bool) or not isinstance(start, int) or start < 0 or start % self.chunk_size:
            raise InvalidInputError(
                f"start must be a multiple of chunk_size={self.chunk_size} (a chunk boundary), got {start!r}"
            )
        if start + span > len(tokens):
            raise InvalidInputError(
                f"K/V for tokens [{start}, {start + span}) but token_ids has {len(tokens)} tokens; pass the whole "
                "sequence from token 0"
            )
        first, end = start // self.chunk_size, (start + span) // self.chunk_size
        if end <= first:
            return 0
        chunk_keys_ = self.keys(tokens[: end * self.chunk_size], salt)[first:end]
        stored = self.store.exists_many(chunk_keys_) if skip_stored else [False] * len(chunk_keys_)
        written, items = 0, {}
        for index, (key, present) in enumerate(zip(chunk_keys_, stored, strict=True)):
            if present:
                continue
            lo = (first + index) * self.chunk_size - start  # offset of the chunk inside the given K/V
            chunk_k = [k[:, lo : lo + self.chunk_size] for k in keys]  # per layer (H, C, d), views
            chunk_v = [v[:, lo : lo + self.chunk_size] for v in values]
            chunk_start = (first + index) * self.chunk_size
            if self.writer is None:
                items[key] = encode_chunk(chunk_k, chunk_v, model_id=self.model_id, start=chunk_start)
                written += 1
                continue

            def encode(chunk_k=chunk_k, chunk_v=chunk_v, chunk_start=chunk_start) -> bytes:
                return encode_chunk(chunk_k, chunk_v, model_id=self.model_id, start=chunk_start)

            nbytes = sum(t.numel() * t.element_size() for t in (*chunk_k, *chunk_v))
            written += self.writer.submit(key, encode, nbytes=nbytes)
        if items:
            self.store.put_many(items)
        return written

    def load(
        self, token_ids: Any, num_tokens: int, salt: str | None = None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The stored K/V of tokens `[0, num_tokens)` of `token_ids`, fetched in one round trip and checked.

        Args:
            token_ids (list of `int` or a 1-D tensor): the sequence (at least `num_tokens` tokens).
            num_tokens (`int`): a multiple of `chunk_size`, usually `stored_tokens(token_ids)`.
            salt (`str`, *optional*): the tenant's cache salt the chunks were saved under.

        Returns:
            `(keys, values)`: per layer, CPU tensors `(kv_heads, num_tokens, head_dim)` in the stored dtype.

        Raises:
            `StoreMissError`: a chunk is not in the store (evicted or expired since the lookup).
            `StoreFormatError`: a chunk is not a valid chunk of this model at its position.
        """
        tokens = as_token_list(token_ids)
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0 or (
            num_tokens % self.chunk_size
        ) or num_tokens > len(tokens):  # fmt: skip
            raise InvalidInputError(
                f"num_tokens must be a multiple of chunk_size={self.chunk_size} within the sequence's "
                f"{len(tokens)} tokens, got {num_tokens!r}"
            )
        keys = self.keys(tokens[:num_tokens], salt)
        payloads = self.store.get_many(keys)
        layer_keys: list[list[torch.Tensor]] = []
        layer_values: list[list[torch.Tensor]] = []
        for index, payload in enumerate(payloads):
            lo, hi = index * self.chunk_size, (index + 1) * self.chunk_size
            if payload is None:
                raise StoreMissError(
                    f"chunk {index} (tokens [{lo}, {hi})) of the stored prefix of model {self.model_id!r} is no "
                    "longer in the store (evicted or expired since the lookup); look up again or compute those tokens"
                )
            try:
                chunk_k, chunk_v = decode_chunk(payload, model_id=self.model_id, start=lo)
            except StoreFormatError as err:
                raise StoreFormatError(f"chunk {index} (tokens [{lo}, {hi})): {err}") from None
            if chunk_k[0].shape[1] != self.chunk_size:
                raise StoreFormatError(
                    f"chunk {index} holds {chunk_k[0].shape[1]} tokens, expected chunk_size={self.chunk_size}"
                )
            if index == 0:
                layer_keys = [[k] for k in chunk_k]
                layer_values = [[v] for v in chunk_v]
                continue
            if len(chunk_k) != len(layer_keys) or any(
                k.shape != ks[0].shape or k.dtype != ks[0].dtype for k, ks in zip(chunk_k, layer_keys, strict=False)
            ):
                raise StoreFormatError(
                    f"chunk {index} (tokens [{lo}, {hi})) has layers of other shapes or dtypes than chunk 0: the "
                    "chunks of one prefix were written by different layouts"
                )
            for ks, vs, k, v in zip(layer_keys, layer_values, chunk_k, chunk_v, strict=True):
                ks.append(k)
                vs.append(v)
        keys_out = [torch.cat(ks, dim=1) for ks in layer_keys]  # per layer (H, num_tokens, d)
        values_out = [torch.cat(vs, dim=1) for vs in layer_values]
        return keys_out, values_out
