"""`PrefixKVStore`: one model's per-token K/V in a store, by prefix: look up, save, load.

A sequence's K/V is stored as chunks of `chunk_size` tokens under chained keys, and its trailing partial chunk under
the slot of the node it follows (`keys.py`); each chunk is a self-describing payload (`format.py`). A lookup finds the
leading whole chunks stored and what the slot after them holds of the sequence's next tokens (one round trip; two when
the whole chunks stop before the sequence's last node); a save writes the chunks it covers that are not stored yet and
its partial tail; a load fetches a prefix's chunks in one round trip and checks each before joining them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import InvalidInputError, StoreFormatError, StoreMissError, StoreUnavailableError
from .base import KVStore
from .format import decode_chunk, decode_slot, encode_chunk, encode_slot
from .keys import DEFAULT_CHUNK_SIZE, SequenceKeys, as_token_list, parse_key, sequence_keys, shared_tokens
from .writer import AsyncWriter

logger = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class StoredPrefix:
    """What the store holds of a sequence (`PrefixKVStore.lookup`): the K/V of its tokens `[0, tokens)`.

    Attributes:
        tokens (`int`): tokens covered, from token 0: `chunks × chunk_size + tail_tokens`.
        chunks (`int`): leading whole chunks stored.
        chunk_bytes (`tuple[int, ...]`): the stored size of each of them.
        tail_key (`str` or `None`): the key whose chunk holds the `tail_tokens` tokens after them (a partial chunk,
            or a whole chunk of a longer sequence), from the slot of node `chunks`.
        tail_tokens (`int`): how many of that chunk's tokens are this sequence's next tokens.
        tail_bytes (`int`): the stored size of the tail's chunk.
        round_trips (`int`): store calls the lookup made.
    """

    tokens: int = 0
    chunks: int = 0
    chunk_bytes: tuple[int, ...] = ()
    tail_key: str | None = None
    tail_tokens: int = 0
    tail_bytes: int = 0
    round_trips: int = 0


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
    >>> found = prefix.lookup(ids); k, v = prefix.load(ids, found.tokens, stored=found)  # doctest: +SKIP
    ```
    """

    def __init__(
        self, store: KVStore, *, model_id: str, chunk_size: int = DEFAULT_CHUNK_SIZE, writer: AsyncWriter | None = None
    ):
        sequence_keys([], model_id=model_id, chunk_size=chunk_size)  # checks both
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

    def sequence(self, token_ids: Any, salt: str | None = None) -> SequenceKeys:
        """The chain of `token_ids` (see `sequence_keys`)."""
        return sequence_keys(token_ids, model_id=self.model_id, chunk_size=self.chunk_size, salt=salt)

    def keys(self, token_ids: Any, salt: str | None = None) -> list[str]:
        """The keys of the full chunks of `token_ids` (see `chunk_keys`)."""
        return self.sequence(token_ids, salt).chunks

    # -- lookup ------------------------------------------------------------------------------------------------------
    def lookup(self, token_ids: Any, salt: str | None = None) -> StoredPrefix:
        """The longest stored prefix of `token_ids`: the leading whole chunks the store holds, then what the slot of
        the node after them holds of the sequence's next tokens (a partial chunk, or part of a longer sequence's
        chunk; only tokens this sequence shares with it count).

        One round trip (`probe`: the whole chunks' sizes and the last node's slot), two when the whole chunks stop
        before the sequence's last node (that node's slot is then read). Counted in `metrics` (`lookups`,
        `lookup_hit_chunks`, `lookup_tail_tokens`, `lookup_miss`). Raises `StoreUnavailableError` when the store
        cannot be asked within its deadline (the caller computes the tokens instead).
        """
        tokens = as_token_list(token_ids)
        seq = self.sequence(tokens, salt)
        whole = len(seq.chunks)
        sizes, (slot,) = self.store.probe(seq.chunks, [seq.slot(whole)])
        chunks, trips = 0, 1
        while chunks < whole and sizes[chunks] > 0:
            chunks += 1
        if chunks < whole:  # the run of whole chunks broke early: the slot after it may hold part of the next chunk
            trips += 1
            try:
                _, (slot,) = self.store.probe([], [seq.slot(chunks)])
            except StoreUnavailableError as err:  # what was found stands; the slot's server did not answer
                logger.debug("%s", err)
                slot = None
        found = StoredPrefix(chunks * self.chunk_size, chunks, tuple(sizes[:chunks]), round_trips=trips)
        tail = self._tail(slot, seq, chunks, tokens)
        if tail is not None:
            key, shared, nbytes = tail
            found = StoredPrefix(found.tokens + shared, chunks, found.chunk_bytes, key, shared, nbytes, trips)
        self.metrics.add(lookups=1, lookup_hit_chunks=chunks, lookup_tail_tokens=found.tail_tokens,
                         lookup_miss=int(found.tokens == 0))  # fmt: skip
        return found

    def _tail(
        self, slot: bytes | None, seq: SequenceKeys, node: int, tokens: list[int]
    ) -> tuple[str, int, int] | None:
        """`(key, shared tokens, bytes)` of what slot `node` holds of `tokens`' next tokens, or `None`."""
        if slot is None:
            return None
        try:
            start, stored, key, nbytes = decode_slot(slot)
            parse_key(key)
        except (StoreFormatError, InvalidInputError) as err:
            logger.warning("KV store: slot of node %d of model %s is not usable: %s", node, self.model_id, err)
            return None
        if start != node * self.chunk_size:
            return None
        if node < len(seq.chunks) and key == seq.chunks[node]:  # this very chunk, which the lookup found missing
            return None
        shared = min(shared_tokens(stored, tokens[start:]), self.chunk_size)
        return (key, shared, nbytes) if shared > 0 else None

    def stored_tokens(self, token_ids: Any, salt: str | None = None) -> int:
        """Tokens covered by the longest stored prefix (`lookup(...).tokens`)."""
        return self.lookup(token_ids, salt).tokens

    # -- save --------------------------------------------------------------------------------------------------------
    def save(
        self,
        token_ids: Any,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        *,
        start: int,
        salt: str | None = None,
        skip_stored: bool = True,
        tail: bool = True,
        relink: Iterable[int] = (),
    ) -> int:
        """Writes every whole chunk inside tokens `[start, start + T)` of `token_ids`, and (with `tail`) the partial
        chunk after the last of them, under its node's slot (replacing what the slot held).

        Args:
            token_ids (list of `int` or a 1-D tensor): the whole sequence from token 0 (the key chain needs it).
            keys (list of `torch.Tensor`): per layer, `(kv_heads, T, head_dim)` for tokens `[start, start + T)`,
                post-RoPE at those absolute positions.
            values (list of `torch.Tensor`): per layer, the same shape.
            start (`int`): absolute position of `keys[l][:, 0]`; a multiple of `chunk_size`.
            salt (`str`, *optional*): the tenant's cache salt.
            skip_stored (`bool`, *optional*, defaults to `True`): leave whole chunks the store already holds alone (one
                round trip to ask); `False` rewrites them (and restarts their TTL).
            tail (`bool`, *optional*, defaults to `True`): also store the trailing partial chunk (`start + T` not a
                multiple of `chunk_size`); a longer sequence's save later replaces it in its slot.
            relink (iterable of `int`, *optional*): nodes whose slot held this sequence's partial chunk and whose
                chunk this save completes: their slot then names the whole chunk instead (the partial is deleted),
                so a reader of the shorter sequence still finds it.

        Returns:
            `int`: whole chunks written (stored ones skipped), or with a writer queued (all those in the range; the
            writer skips the stored ones; dropped ones not counted).

        With a writer, everything (the question of what is stored, the encoding, the writes) runs on its thread: the
        tensors must not change until it has written them.
        """
        tokens = as_token_list(token_ids)
        span = _check_kv(keys, values, "PrefixKVStore.save")
        size = self.chunk_size
        if isinstance(start, bool) or not isinstance(start, int) or start < 0 or start % size:
            raise InvalidInputError(f"start must be a multiple of chunk_size={size} (a chunk boundary), got {start!r}")
        end = start + span
        if end > len(tokens):
            raise InvalidInputError(
                f"K/V for tokens [{start}, {end}) but token_ids has {len(tokens)} tokens; pass the whole "
                "sequence from token 0"
            )
        seq = self.sequence(tokens[:end], salt)
        first, last = start // size, end // size  # whole chunks [first, last)
        relink = sorted({int(node) for node in relink if first <= int(node) < last})
        has_tail = tail and end % size > 0

        def piece(lo: int, hi: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:  # views of tokens [lo, hi)
            return [k[:, lo - start : hi - start] for k in keys], [v[:, lo - start : hi - start] for v in values]

        def job() -> int:
            wanted, sizes = list(range(first, last)), {}
            if skip_stored and wanted:
                stored_sizes = self.store.probe(seq.chunks[first:last], [], timeout=self._writer_deadline())[0]
                sizes = {i: n for i, n in zip(wanted, stored_sizes, strict=True) if n > 0}
                wanted = [i for i in wanted if i not in sizes]
            items = {}
            for i in wanted:
                ids = tokens[i * size : (i + 1) * size]
                items[seq.chunks[i]] = encode_chunk(*piece(i * size, (i + 1) * size), model_id=self.model_id,
                                                    start=i * size, token_ids=ids)  # fmt: skip
            partial = None
            if has_tail:
                ids = tokens[last * size : end]
                partial = seq.partial(last, ids), ids
                items[partial[0]] = encode_chunk(*piece(last * size, end), model_id=self.model_id, start=last * size,
                                                 token_ids=ids)  # fmt: skip
            self.store.put_many(items)
            for node in relink:  # the slot names the whole chunk now (its size: what put_many wrote, or stored)
                ids = tokens[node * size : (node + 1) * size]
                nbytes = len(items[seq.chunks[node]]) if seq.chunks[node] in items else sizes.get(node, 0)
                self._replace_slot(seq.slot(node), encode_slot(node * size, ids, seq.chunks[node], nbytes))
            if partial is not None:
                key, ids = partial
                self._replace_slot(seq.slot(last), encode_slot(last * size, ids, key, len(items[key])))
            return len(wanted)

        if self.writer is None:
            return job()
        count = last - first
        nbytes = sum(t.numel() * t.element_size() for t in (*keys, *values))
        return count if self.writer.submit_job(job, nbytes=nbytes) else 0

    def _writer_deadline(self) -> float | None:
        """The deadline of a save's question of what is stored: the store's bulk one (a save runs on the writer
        thread, or for a caller that can wait), not the lookup deadline vLLM's scheduler needs."""
        return getattr(self.store, "bulk_timeout", None)

    def _replace_slot(self, slot: str, record: bytes) -> None:
        """Points `slot` at a new chunk and deletes the partial chunk it named before (if another one)."""
        old = self.store.swap(slot, record)
        if old is None:
            return
        try:
            old_key = decode_slot(old)[2]
        except StoreFormatError:
            return
        if old_key != decode_slot(record)[2] and parse_key(old_key)["kind"] == "partial":
            self.store.delete_many([old_key])

    # -- load --------------------------------------------------------------------------------------------------------
    def load(
        self, token_ids: Any, num_tokens: int, salt: str | None = None, *, stored: StoredPrefix | None = None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The stored K/V of tokens `[0, num_tokens)` of `token_ids`, fetched in one round trip and checked.

        Args:
            token_ids (list of `int` or a 1-D tensor): the sequence (at least `num_tokens` tokens).
            num_tokens (`int`): at most what `lookup` found (`stored.tokens`).
            salt (`str`, *optional*): the tenant's cache salt the chunks were saved under.
            stored (`StoredPrefix`, *optional*): the lookup of `token_ids` (where its tail is, and its size); without
                one, a `num_tokens` that ends inside a chunk is looked up first (one more round trip).

        Returns:
            `(keys, values)`: per layer, CPU tensors `(kv_heads, num_tokens, head_dim)` in the stored dtype.

        Raises:
            `StoreMissError`: a chunk is not in the store (evicted or expired since the lookup), or the store holds
                fewer tokens than `num_tokens`.
            `StoreFormatError`: a chunk is not a valid chunk of this model at its position, or holds other tokens.
        """
        tokens = as_token_list(token_ids)
        size = self.chunk_size
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or not 0 < num_tokens <= len(tokens):
            raise InvalidInputError(
                f"num_tokens must be a number of tokens in [1, {len(tokens)}] (the sequence's length), got "
                f"{num_tokens!r}"
            )
        if stored is None:
            stored = StoredPrefix(num_tokens, num_tokens // size) if num_tokens % size == 0 else self.lookup(
                tokens, salt
            )  # fmt: skip
        if num_tokens > stored.tokens:
            raise StoreMissError(
                f"the store holds {stored.tokens} tokens of this sequence of model {self.model_id!r}, not the "
                f"{num_tokens} asked for; compute the rest"
            )
        whole = stored.chunks * size  # ≤ len(tokens): the lookup computed those chunks' keys from them
        chunks = self.sequence(tokens[:whole], salt).chunks
        # (first token, end, key) of each chunk to read: whole chunks (the last one maybe in part), then the tail
        parts = [
            (i * size, min((i + 1) * size, num_tokens), chunks[i]) for i in range(-(-min(num_tokens, whole) // size))
        ]
        if num_tokens > whole:
            parts.append((whole, num_tokens, stored.tail_key))
        expected = None
        if stored.chunk_bytes or stored.tail_bytes:
            expected = sum(stored.chunk_bytes[: len(parts)]) + (stored.tail_bytes if num_tokens > whole else 0)
        payloads = self.store.get_many([key for _, _, key in parts], expected_bytes=expected)
        layer_keys: list[list[torch.Tensor]] = []
        layer_values: list[list[torch.Tensor]] = []
        for (lo, hi, _), payload in zip(parts, payloads, strict=True):
            if payload is None:
                raise StoreMissError(
                    f"the chunk of tokens [{lo}, {hi}) of the stored prefix of model {self.model_id!r} is no longer "
                    "in the store (evicted, expired or replaced since the lookup); look up again or compute them"
                )
            try:
                chunk_k, chunk_v = decode_chunk(payload, model_id=self.model_id, start=lo, token_ids=tokens[lo:hi])
            except StoreFormatError as err:
                raise StoreFormatError(f"chunk of tokens [{lo}, {hi}): {err}") from None
            chunk_k = [k[:, : hi - lo] for k in chunk_k]  # (H, hi - lo, d): the part this sequence shares
            chunk_v = [v[:, : hi - lo] for v in chunk_v]
            if not layer_keys:
                layer_keys = [[k] for k in chunk_k]
                layer_values = [[v] for v in chunk_v]
                continue
            if len(chunk_k) != len(layer_keys) or any(
                k.shape[::2] != ks[0].shape[::2] or k.dtype != ks[0].dtype
                for k, ks in zip(chunk_k, layer_keys, strict=False)
            ):
                raise StoreFormatError(
                    f"the chunk of tokens [{lo}, {hi}) has layers of other shapes or dtypes than the first: the "
                    "chunks of one prefix were written by different layouts"
                )
            for ks, vs, k, v in zip(layer_keys, layer_values, chunk_k, chunk_v, strict=True):
                ks.append(k)
                vs.append(v)
        keys_out = [torch.cat(ks, dim=1) for ks in layer_keys]  # per layer (H, num_tokens, d)
        values_out = [torch.cat(vs, dim=1) for vs in layer_values]
        return keys_out, values_out
