"""`PrefixKVStore`: one model's per-token K/V in a store, by prefix: look up, save, load.

A sequence's K/V is stored as chunks of `chunk_size` tokens under chained keys, and its trailing partial chunk as
sub-chunks and a remainder chained on from the last whole chunk (`keys.py`); each entry is a self-describing payload
(`format.py`). A lookup finds the leading whole chunks stored, then the sub-chunks and the longest remainder after
them (one round trip in the common cases); a save writes the entries it covers that are not stored yet; a load
fetches a prefix's entries in one round trip and checks each before joining them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import InvalidInputError, StoreFormatError, StoreMissError, StoreUnavailableError
from .base import KVStore, at_once, spread, spread_parts
from .encodings import DEFAULT_ENCODING, check_encoding
from .format import ChunkEncoder, copy_into, decode_chunk
from .keys import DEFAULT_CHUNK_SIZE, SequenceKeys, as_token_list, sequence_keys
from .writer import AsyncWriter

logger = logging.getLogger(__name__)

DEFAULT_PARTIAL_TTL_S = 3600.0
"""Seconds a partial chunk's sub-chunks and remainder live in the store by default."""


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
class FetchedRun:
    """A run of a stored prefix, fetched and checked (`PrefixKVStore.iter_load`): the K/V of tokens `[start, end)`,
    per layer CPU tensors `(kv_heads, end − start, head_dim)` in the stored dtype, and the seconds its fetch and checks
    took (on the fetching thread)."""

    start: int
    end: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    seconds: float


@dataclass(frozen=True)
class StoredPrefix:
    """What the store holds of a sequence (`PrefixKVStore.lookup`): the K/V of its tokens `[0, tokens)`.

    Attributes:
        tokens (`int`): tokens covered, from token 0.
        chunks (`int`): leading whole chunks stored.
        tail_tokens (`int`): tokens covered after them, by sub-chunks and a remainder of a partial chunk.
        pieces (`tuple`): `(key, first token, end, stored bytes)` of each stored entry of the prefix, in order: the
            whole chunks, then the partial chunk's sub-chunks and remainder (what a fetch reads).
        round_trips (`int`): store calls the lookup made.
    """

    tokens: int = 0
    chunks: int = 0
    tail_tokens: int = 0
    pieces: tuple[tuple[str, int, int, int], ...] = ()
    round_trips: int = 0


def fetch_runs(pieces: list[tuple[str, int, int, int]], parts: int) -> list[list[tuple[str, int, int, int]]]:
    """`pieces` (key, start, end, bytes; in token order) cut into at most `parts` runs of about equal bytes, each run
    of consecutive pieces: a whole chunk weighs 16 of a partial chunk's sub-chunks, so runs of equal counts would put
    most of the bytes in the first run and leave nothing to overlap.

    Example:

    ```python
    >>> pieces = [("a", 0, 256, 100), ("b", 256, 512, 100), ("c", 512, 528, 6), ("d", 528, 544, 6)]
    >>> [[key for key, *_ in run] for run in fetch_runs(pieces, 2)]
    [['a'], ['b', 'c', 'd']]
    ```
    """
    parts = max(1, min(parts, len(pieces)))
    total = sum(max(size, 1) for *_, size in pieces)
    runs: list[list[tuple[str, int, int, int]]] = [[]]
    done = 0
    for piece in pieces:
        size = max(piece[3], 1)
        if runs[-1] and len(runs) < parts and done + size / 2 >= total * len(runs) / parts:  # past the cut: a new run
            runs.append([])
        runs[-1].append(piece)
        done += size
    return runs if runs[0] else []


class PrefixKVStore:
    """One model's K/V in a `KVStore`, found by the longest stored prefix of a token sequence.

    Args:
        store (`KVStore`): the store (`open_store(url)`).
        model_id (`str`): the identity of the model whose K/V this holds (`model_identity`).
        chunk_size (`int`, *optional*, defaults to `DEFAULT_CHUNK_SIZE`): tokens per chunk; writers and readers of
            one model must agree on it (it changes every key).
        writer (`AsyncWriter`, *optional*): writes saves in the background; without one, `save` writes at once.
        partial_ttl_s (`float`, *optional*, defaults to `3600`): seconds a partial chunk's entries live (`None`: the
            store's TTL): a conversation that goes on leaves its earlier partial chunks behind, read by nothing else.
        encoding (`str`, *optional*): how saved chunks hold their K/V (`"source"`, `"bfloat16"`, `"fp8_e4m3"`;
            `encodings.py`); default: the store's `encoding` (a store option, or the URL's `?encoding=`), else
            `"source"`. Reads take every encoding, whatever this one is.

    Example:

    ```python
    >>> prefix = PrefixKVStore(open_store(url), model_id=model_identity("pocket-s"), chunk_size=64)  # doctest: +SKIP
    >>> prefix.save(ids, keys, values, start=0)  # doctest: +SKIP
    2
    >>> found = prefix.lookup(ids); k, v = prefix.load(ids, found.tokens, stored=found)  # doctest: +SKIP
    ```
    """

    def __init__(
        self,
        store: KVStore,
        *,
        model_id: str,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        writer: AsyncWriter | None = None,
        partial_ttl_s: float | None = DEFAULT_PARTIAL_TTL_S,
        encoding: str | None = None,
    ):
        sequence_keys([], model_id=model_id, chunk_size=chunk_size)  # checks both
        self.encoding = check_encoding(encoding or getattr(store, "encoding", DEFAULT_ENCODING))
        if writer is not None and writer.store is not store:
            raise InvalidInputError("the AsyncWriter given to PrefixKVStore must write to the same store")
        if partial_ttl_s is not None and not partial_ttl_s > 0:
            raise InvalidInputError(f"partial_ttl_s must be a number of seconds > 0 or None, got {partial_ttl_s!r}")
        self.store = store
        self.model_id = model_id
        self.chunk_size = chunk_size
        self.writer = writer
        self.partial_ttl_s = partial_ttl_s

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
        """The longest stored prefix of `token_ids`: the leading whole chunks the store holds, then the sub-chunks of
        a partial chunk after them, then the longest remainder (every stored entry is content-addressed: only this
        sequence's own tokens can match, a branch's never).

        One round trip (`probe`: sizes of the whole chunks' keys, the sub-chunks' and every remainder length's after
        them), two when the sub-chunks stop early (the remainders after the last one found are probed then), three
        when the whole chunks stop before the sequence's last one (the sub-chunks after the last found, then the
        remainders). Counted in `metrics` (`lookups`, `lookup_hit_chunks`, `lookup_tail_tokens`, `lookup_miss`).
        Raises `StoreUnavailableError` when the store cannot be asked within its deadline (the caller computes the
        tokens instead).
        """
        tokens = as_token_list(token_ids)
        seq = self.sequence(tokens, salt)
        size, whole = self.chunk_size, len(seq.chunks)
        tail = seq.tail(whole, tokens[whole * size :])
        subs, step = len(tail.subs), tail.sub_size
        remainders = tail.remainders(subs, tokens[whole * size + subs * step :])
        sizes, _ = self.store.probe([*seq.chunks, *tail.subs, *remainders], [])
        trips, chunks = 1, _leading(sizes[:whole])
        pieces = [(key, i * size, (i + 1) * size, sizes[i]) for i, key in enumerate(seq.chunks[:chunks])]
        if chunks == whole:
            found = _leading(sizes[whole : whole + subs])
            sub_sizes, rem_sizes = sizes[whole : whole + found], sizes[whole + subs :] if found == subs else None
        else:  # the whole chunks stop early: the tail after the last one found, from this sequence's next tokens
            tail = seq.tail(chunks, tokens[chunks * size : (chunks + 1) * size])
            sub_sizes = self._probe_or_nothing(tail.subs)
            found, rem_sizes, trips = _leading(sub_sizes), None, trips + 1
            sub_sizes = sub_sizes[:found]
        start = chunks * size
        pieces += [(tail.subs[j], start + j * step, start + (j + 1) * step, n) for j, n in enumerate(sub_sizes)]
        after = start + found * step  # the remainder's first token
        rest = tokens[after : min(len(tokens), start + size - 1, after + step - 1)]
        remainders = tail.remainders(found, rest)
        if rem_sizes is None:
            rem_sizes, trips = self._probe_or_nothing(remainders), trips + 1
        longest = max((n for n in range(1, len(rem_sizes) + 1) if rem_sizes[n - 1] > 0), default=0)
        if longest:
            pieces.append((remainders[longest - 1], after, after + longest, rem_sizes[longest - 1]))
        covered = pieces[-1][2] if pieces else 0
        stored = StoredPrefix(covered, chunks, covered - chunks * size, tuple(pieces), trips)
        self.metrics.add(lookups=1, lookup_hit_chunks=chunks, lookup_tail_tokens=stored.tail_tokens,
                         lookup_miss=int(covered == 0))  # fmt: skip
        return stored

    def _probe_or_nothing(self, keys: list[str]) -> list[int]:
        """The sizes of `keys` (a lookup's later round trip); all `0` if the store does not answer: what the lookup
        found so far stands."""
        if not keys:
            return []
        try:
            return self.store.probe(keys, [])[0]
        except StoreUnavailableError as err:
            logger.debug("%s", err)
            return [0] * len(keys)

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
        ready: Callable[[], None] | None = None,
        scales: Sequence[tuple[float, float]] | None = None,
        done: Callable[[], None] | None = None,
    ) -> int:
        """Writes every whole chunk inside tokens `[start, start + T)` of `token_ids`, and (with `tail`) the partial
        chunk after the last of them: its sub-chunks and its remainder, which expire after `partial_ttl_s`.

        Args:
            token_ids (list of `int` or a 1-D tensor): the whole sequence from token 0 (the key chain needs it).
            keys (list of `torch.Tensor`): per layer, `(kv_heads, T, head_dim)` for tokens `[start, start + T)`,
                post-RoPE at those absolute positions.
            values (list of `torch.Tensor`): per layer, the same shape.
            start (`int`): absolute position of `keys[l][:, 0]`; a multiple of `chunk_size`.
            salt (`str`, *optional*): the tenant's cache salt.
            skip_stored (`bool`, *optional*, defaults to `True`): leave entries the store already holds alone (one
                round trip to ask); `False` rewrites them (and restarts their TTL).
            tail (`bool`, *optional*, defaults to `True`): also store the trailing partial chunk (`start + T` not a
                multiple of `chunk_size`).
            ready (callable, *optional*): called (on the writer thread, with a writer) before the tensors are read:
                the wait of a staged device-to-host copy (`staging.StagedExport.wait`).
            scales (list of `(k_scale, v_scale)`, *optional*): per layer, the scales of an fp8 KV cache whose codes
                `keys`/`values` are (`float8_e4m3fn` or `float8_e5m2` tensors, `x = code * scale`). In the encoding
                `fp8_e4m3`, e4m3 codes are stored as they are with the layer's scale as each head's (not quantized
                twice); otherwise they are dequantized to float32 (`encodings.dequantize_codes`) on the writer
                thread, not on the caller's (`ChunkEncoder`).
            done (callable, *optional*): called once when `keys`/`values` are no longer read: after the writes (on
                the writer thread, whatever they did), at once when the writer drops the save, or when the save is
                refused (raises); what gives a `staging.StagingPool` lease back.

        Returns:
            `int`: whole chunks written (stored ones skipped), or with a writer queued (all those in the range; the
            writer skips the stored ones; dropped ones not counted).

        With a writer, everything (the question of what is stored, the encoding, the writes) runs on its thread: the
        tensors must not change until it has written them.
        """
        try:
            job, nbytes, chunks = self._save_job(
                token_ids, keys, values, start, salt, skip_stored, tail, ready, scales
            )
        except BaseException:
            if done is not None:
                done()
            raise
        if done is not None:
            job = _then(job, done)
        if self.writer is None:
            return job()
        if self.writer.submit_job(job, nbytes=nbytes):
            return chunks
        if done is not None:
            done()
        return 0

    def _save_job(self, token_ids, keys, values, start, salt, skip_stored, tail, ready, scales):
        """`save`'s checks, then `(job, nbytes, chunks)`: the callable that writes, its bytes for the writer's queue
        limit, and the whole chunks in the range."""
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
        entries = [(seq.chunks[i], i * size, (i + 1) * size, False) for i in range(first, last)]
        if tail and end % size:
            pieces = seq.tail(last, tokens[last * size : end])
            lo, step = last * size, pieces.sub_size
            entries += [(key, lo + j * step, lo + (j + 1) * step, True) for j, key in enumerate(pieces.subs)]
            after = lo + len(pieces.subs) * step
            if after < end:  # the remainder
                entries.append((pieces.remainders(len(pieces.subs), tokens[after:end])[-1], after, end, True))

        as_codes = self.encoding == "fp8_e4m3"  # an fp8 cache's e4m3 codes are sent as they are, others as float32
        width = [t.element_size() if scales is None or (as_codes and t.dtype == torch.float8_e4m3fn) else 4
                 for t in (*keys, *values)]  # fmt: skip
        token_bytes = sum(t.shape[0] * t.shape[2] * w for t, w in zip((*keys, *values), width))  # a token's K/V

        if scales is not None and len(scales) != len(keys):
            raise InvalidInputError(f"PrefixKVStore.save: {len(scales)} scale pairs for {len(keys)} layers")

        def job() -> int:
            if ready is not None:
                ready()
            wanted = entries
            if skip_stored and wanted:
                stored = self.store.probe([e[0] for e in wanted], [], timeout=self._writer_deadline())[0]
                wanted = [entry for entry, n in zip(wanted, stored, strict=True) if not n]

            # an fp8 cache's codes: kept as they are in fp8_e4m3 (e4m3 codes), else dequantized here, on this thread
            encoder = ChunkEncoder(keys, values, model_id=self.model_id, encoding=self.encoding, scales=scales)

            def write(group: list, ttl_s: float | None) -> None:  # one of the writers: encodes its entries, writes
                with self.metrics.writer_cpu():  # once: the writer's thread counts a write it runs inline
                    items = {key: encoder.encode(lo - start, hi - start, start=lo, token_ids=tokens[lo:hi])
                             for key, lo, hi, _ in group}  # views into keys/values, sent as they are  # fmt: skip
                    self.store.put_many(items, ttl_s=ttl_s)

            calls = []  # large saves spread over the store's connections: one encodes while another sends
            for is_tail in (False, True):
                group, ttl_s = [e for e in wanted if e[3] == is_tail], self.partial_ttl_s if is_tail else None
                parts = spread_parts(sum(hi - lo for _, lo, hi, _ in group) * token_bytes, self._connections())
                calls += [lambda part=part, ttl_s=ttl_s: write(part, ttl_s)
                          for part in spread(group, parts) if part]  # fmt: skip
            at_once(calls)
            return sum(not partial for *_, partial in wanted)

        return job, sum(t.numel() * t.element_size() for t in (*keys, *values)), last - first

    def _writer_deadline(self) -> float | None:
        """The deadline of a save's question of what is stored: the store's bulk one (a save runs on the writer
        thread, or for a caller that can wait), not the lookup deadline vLLM's scheduler needs."""
        return getattr(self.store, "bulk_timeout", None)

    # -- load --------------------------------------------------------------------------------------------------------
    def load(
        self, token_ids: Any, num_tokens: int, salt: str | None = None, *, stored: StoredPrefix | None = None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The stored K/V of tokens `[0, num_tokens)` of `token_ids`, fetched (in runs spread over the store's
        connections) and checked.

        Args:
            token_ids (list of `int` or a 1-D tensor): the sequence (at least `num_tokens` tokens).
            num_tokens (`int`): at most what `lookup` found (`stored.tokens`).
            salt (`str`, *optional*): the tenant's cache salt the chunks were saved under.
            stored (`StoredPrefix`, *optional*): the lookup of `token_ids` (which entries hold the prefix, and their
                sizes); without one, a `num_tokens` that ends inside a chunk is looked up first (one more round trip).

        Returns:
            `(keys, values)`: per layer, CPU tensors `(kv_heads, num_tokens, head_dim)` in the stored dtype.

        Raises:
            `StoreMissError`: an entry is not in the store (evicted or expired since the lookup), or the store holds
                fewer tokens than `num_tokens`.
            `StoreFormatError`: an entry is not a valid chunk of this model at its position, or holds other tokens.
        """
        runs = list(self.iter_load(token_ids, num_tokens, salt, stored=stored, parts=self._connections()))
        if len(runs) == 1:
            return runs[0].keys, runs[0].values
        keys = [torch.cat([run.keys[layer] for run in runs], dim=1) for layer in range(len(runs[0].keys))]
        values = [torch.cat([run.values[layer] for run in runs], dim=1) for layer in range(len(runs[0].values))]
        return keys, values  # per layer (H, num_tokens, d)

    def _connections(self) -> int:
        """The store's connections a fetch is spread over (1 for a store that has no such setting)."""
        return max(1, int(getattr(self.store, "connections", 1)))

    def _stored(
        self, tokens: list[int], num_tokens: int, salt: str | None, stored: StoredPrefix | None
    ) -> StoredPrefix:
        """`stored`, or what the store holds of `tokens` (asked only when `num_tokens` ends inside a chunk)."""
        size = self.chunk_size
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or not 0 < num_tokens <= len(tokens):
            raise InvalidInputError(
                f"num_tokens must be a number of tokens in [1, {len(tokens)}] (the sequence's length), got "
                f"{num_tokens!r}"
            )
        if stored is None and num_tokens % size == 0:  # whole chunks: their keys say it all
            chunks = self.sequence(tokens[:num_tokens], salt).chunks
            stored = StoredPrefix(num_tokens, len(chunks), 0, tuple((k, i * size, (i + 1) * size, 0)
                                                                    for i, k in enumerate(chunks)))  # fmt: skip
        elif stored is None:
            stored = self.lookup(tokens, salt)
        if num_tokens > stored.tokens:
            raise StoreMissError(
                f"the store holds {stored.tokens} tokens of this sequence of model {self.model_id!r}, not the "
                f"{num_tokens} asked for; compute the rest"
            )
        return stored

    def iter_load(
        self,
        token_ids: Any,
        num_tokens: int,
        salt: str | None = None,
        *,
        stored: StoredPrefix | None = None,
        start: int = 0,
        parts: int = 4,
    ) -> Iterator[FetchedRun]:
        """The stored K/V of tokens `[start, num_tokens)`, in `parts` runs of entries fetched on threads of their own,
        as many at once as the store has `connections`: each run is yielded in token order (a `FetchedRun`) as soon as
        it has arrived and been checked, while the next ones are being fetched, so the caller maps one run while the
        next arrive. Raises what `load` raises, at the run it concerns.

        Example:

        ```python
        >>> for run in prefix.iter_load(ids, n, stored=found, parts=4):  # doctest: +SKIP
        ...     mapped = map_tokens(run.start, run.end, run.keys, run.values)
        ```
        """
        tokens = as_token_list(token_ids)
        stored = self._stored(tokens, num_tokens, salt, stored)
        if not 0 <= start < num_tokens:
            raise InvalidInputError(f"start must be in [0, {num_tokens}), got {start!r}")
        pieces = [p for p in stored.pieces if p[1] < num_tokens and p[2] > start]
        runs = fetch_runs(pieces, parts)
        results: list[queue.Queue] = [queue.Queue(maxsize=1) for _ in runs]
        todo: queue.Queue = queue.Queue()
        for index, run in enumerate(runs):
            todo.put((index, run))

        def fetch() -> None:  # one fetching thread: takes the next run in token order, fetches and checks it
            while True:
                try:
                    index, run = todo.get_nowait()
                except queue.Empty:
                    return
                began = time.perf_counter()
                try:
                    lo, hi, keys, values = self._fetch(tokens, run, max(start, run[0][1]), min(num_tokens, run[-1][2]),
                                                       share=fetchers)  # fmt: skip
                except BaseException as err:  # handed to the caller, at this run
                    results[index].put(err)
                    continue
                results[index].put(FetchedRun(lo, hi, keys, values, time.perf_counter() - began))

        fetchers = min(len(runs), self._connections())
        for _ in range(fetchers):  # several runs in flight at once, on their connections
            threading.Thread(target=fetch, name="kvbridge-store-fetch", daemon=True).start()
        for result in results:  # in token order, each as soon as it has arrived
            item = result.get()
            if isinstance(item, BaseException):
                raise item
            yield item

    def _fetch(
        self, tokens: list[int], pieces: list[tuple[str, int, int, int]], start: int, end: int, share: int = 1
    ) -> tuple[int, int, list[torch.Tensor], list[torch.Tensor]]:
        """`(start, end, keys, values)`: the stored K/V of tokens `[start, end)`, from `pieces` (which cover them), in
        one round trip, each entry checked. `share`: fetches in flight at once, which share the bandwidth (the
        deadline allows for their bytes too)."""
        sizes = [piece[3] for piece in pieces]
        payloads = self.store.get_many(
            [piece[0] for piece in pieces], expected_bytes=sum(sizes) * share if all(sizes) else None
        )
        layer_keys: list[list[torch.Tensor]] = []
        layer_values: list[list[torch.Tensor]] = []
        for (_, lo, hi, _), payload in zip(pieces, payloads, strict=True):
            hi = min(hi, end)
            if payload is None:
                raise StoreMissError(
                    f"the chunk of tokens [{lo}, {hi}) of the stored prefix of model {self.model_id!r} is no longer "
                    "in the store (evicted or expired since the lookup); look up again or compute them"
                )
            try:
                chunk_k, chunk_v = decode_chunk(payload, model_id=self.model_id, start=lo, token_ids=tokens[lo:hi])
            except StoreFormatError as err:
                raise StoreFormatError(f"chunk of tokens [{lo}, {hi}): {err}") from None
            first = max(start, lo) - lo
            chunk_k = [k[:, first : hi - lo] for k in chunk_k]  # (H, hi - max(start, lo), d): the part needed
            chunk_v = [v[:, first : hi - lo] for v in chunk_v]
            if not layer_keys:
                layer_keys = [[k] for k in chunk_k]
                layer_values = [[v] for v in chunk_v]
                continue
            if len(chunk_k) != len(layer_keys) or any(
                k.shape[::2] != ks[0].shape[::2] for k, ks in zip(chunk_k, layer_keys, strict=False)
            ):
                raise StoreFormatError(
                    f"the chunk of tokens [{lo}, {hi}) has layers of other shapes than the first: the chunks of one "
                    "prefix were written by different layouts"
                )
            for ks, vs, k, v in zip(layer_keys, layer_values, chunk_k, chunk_v, strict=True):
                ks.append(k)  # chunks written in other encodings (dtypes) join in the wider dtype (torch.cat)
                vs.append(v)
        return start, end, [_join(ks) for ks in layer_keys], [_join(vs) for vs in layer_values]


def _join(parts: list[torch.Tensor]) -> torch.Tensor:
    """One layer's chunks `(H, t_i, d)` joined along the tokens: `(H, Σ t_i, d)`, one copy (by numpy, see
    `copy_into`), in the widest dtype among them."""
    dtype = parts[0].dtype
    for part in parts[1:]:
        dtype = torch.promote_types(dtype, part.dtype)
    out = torch.empty(parts[0].shape[0], sum(p.shape[1] for p in parts), parts[0].shape[2], dtype=dtype)
    at = 0
    for part in parts:
        copy_into(out[:, at : at + part.shape[1]], part.to(dtype))
        at += part.shape[1]
    return out


def _leading(sizes: list[int]) -> int:
    """How many of the leading `sizes` are stored (`> 0`)."""
    count = 0
    while count < len(sizes) and sizes[count] > 0:
        count += 1
    return count


def _then(job: Callable[[], int], done: Callable[[], None]) -> Callable[[], int]:
    """`job`, then `done` whatever `job` did."""

    def run() -> int:
        try:
            return job()
        finally:
            done()

    return run
