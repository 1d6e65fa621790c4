"""The store interface the prefix store and the vLLM connector use, and its metrics.

`KVStore` is what any backend provides: the sizes of many keys in one round trip (`probe`, for the longest-prefix
lookup), batched writes and batched reads of opaque payloads, and deletes. `RedisKVStore` (one Redis-protocol server:
Redis or Valkey) and `RedisClusterKVStore` (a Redis/Valkey cluster) implement it; an LMCache backend for GPU
deployments can be added beside them by implementing these methods.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

T = TypeVar("T")


def spread(items: list[T], parts: int) -> list[list[T]]:
    """`items` in at most `parts` runs of consecutive items, as even as counts allow (none empty).

    Example:

    ```python
    >>> spread([1, 2, 3, 4, 5], 2)
    [[1, 2, 3], [4, 5]]
    ```
    """
    parts = max(1, min(parts, len(items)))
    size, extra = divmod(len(items), parts)
    runs, at = [], 0
    for i in range(parts):
        runs.append(items[at : at + size + (i < extra)])
        at += size + (i < extra)
    return runs


SPREAD_BYTES = 2 << 20
"""A write is spread over several connections (threads) only in parts of at least this many bytes: a smaller one is
sent on the calling thread, where handing it to another thread costs more CPU time than it saves wall time."""


def spread_parts(nbytes: int, connections: int) -> int:
    """Parts to spread a write of `nbytes` over: one per `SPREAD_BYTES`, at most `connections`, at least one.

    Example:

    ```python
    >>> spread_parts(1 << 20, 4), spread_parts(5 << 20, 4), spread_parts(100 << 20, 4)
    (1, 2, 4)
    ```
    """
    return max(1, min(connections, nbytes // SPREAD_BYTES))


def at_once(calls: list[Callable[[], Any]]) -> list[Any]:
    """Runs `calls` on threads of their own (one alone: here), waits for all and returns their results in order;
    raises the first error."""
    if len(calls) == 1:
        return [calls[0]()]
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as err:  # raised to the caller below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


@dataclass
class StoreMetrics:
    """Thread-safe counters of one store client (the writer thread and the caller's thread add to them).

    Args:
        lookups (`int`): prefix lookups (`PrefixKVStore.lookup`).
        lookup_hit_chunks (`int`): whole chunks those lookups found stored (the leading run).
        lookup_tail_tokens (`int`): tokens those lookups found after the whole chunks (a partial chunk's entries).
        lookup_miss (`int`): lookups that found nothing.
        round_trips (`int`): store calls the caller waited for (a pipeline, or a cluster's requests to its nodes
            sent together, is one).
        timeouts (`int`): calls that missed their deadline (a hung server or node).
        skipped_down (`int`): calls answered at once, without asking, because the server (or the node) failed
            within the last `cooldown_s` seconds.
        chunks_written (`int`), bytes_written (`int`): payloads the store accepted.
        chunks_read (`int`), bytes_read (`int`): payloads fetched (found ones only).
        write_errors (`int`): chunks lost to a failed write (store down, an encoding error on the writer thread).
        read_errors (`int`): store calls of a lookup or fetch that failed.
        writes_dropped (`int`): chunks the asynchronous writer dropped because its queue was full.
        fetch_seconds (`float`): time spent in fetches (`get_many`), summed.
        put_seconds (`float`): time spent in writes (`put_many`), summed.
        writer_cpu_seconds (`float`): CPU time of the asynchronous writer's thread, of the threads a save encodes
            on (views, checksums, sends) and of the store's I/O threads' sends (`SetPipeline.cpu_seconds`): what an
            export costs its engine's host past the step's gather.

    Example:

    ```python
    >>> metrics = StoreMetrics()
    >>> metrics.add(chunks_written=2, bytes_written=1024)
    >>> metrics.as_dict()["bytes_written"]
    1024
    ```
    """

    lookups: int = 0
    lookup_hit_chunks: int = 0
    lookup_tail_tokens: int = 0
    lookup_miss: int = 0
    round_trips: int = 0
    timeouts: int = 0
    skipped_down: int = 0
    chunks_written: int = 0
    bytes_written: int = 0
    chunks_read: int = 0
    bytes_read: int = 0
    write_errors: int = 0
    read_errors: int = 0
    writes_dropped: int = 0
    fetch_seconds: float = 0.0
    put_seconds: float = 0.0
    writer_cpu_seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    _counting: threading.local = field(default_factory=threading.local, repr=False, compare=False)

    def add(self, **increments: float) -> None:
        """Adds to the named counters atomically."""
        with self._lock:
            for name, amount in increments.items():
                setattr(self, name, getattr(self, name) + amount)

    def as_dict(self) -> dict[str, float]:
        """A consistent snapshot of every counter."""
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}

    @contextmanager
    def writer_cpu(self) -> Iterator[None]:
        """Adds this thread's CPU time over the block to `writer_cpu_seconds`, even when it raises; a block inside
        another one on the same thread adds nothing, since the outer one counts that time (a save's write run inline
        by the asynchronous writer's thread is counted once, not twice)."""
        if getattr(self._counting, "active", False):
            yield
            return
        self._counting.active = True
        began = time.thread_time()
        try:
            yield
        finally:
            self._counting.active = False
            self.add(writer_cpu_seconds=time.thread_time() - began)

    @contextmanager
    def timed(self, counter: str) -> Iterator[None]:
        """Adds the time the block takes to `counter` (`fetch_seconds` or `put_seconds`), even when it raises."""
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.add(**{counter: time.perf_counter() - begin})


class KVStore(ABC):
    """A key → bytes store for K/V chunks, shared by engines (abstract base).

    Implementations: `RedisKVStore` (a Redis or Valkey server), `RedisClusterKVStore` (a cluster of them). An LMCache
    backend (for GPU deployments, where LMCache's vLLM integration runs) can be added as another subclass: the prefix
    store and the connector only use the methods below. Every implementation raises `StoreUnavailableError` for a
    failed call (naming the store, without its password, and what to check), counts its own failures and traffic in
    `metrics`, is safe to call from several threads, and bounds every call by its deadline (`timeout`): a dead or
    hung server is a `StoreUnavailableError` within it, never a wait.

    Example:

    ```python
    >>> store = open_store("redis://127.0.0.1:6379/0")  # doctest: +SKIP
    >>> store.put_many({"k1": b"a"}); store.count_prefix(["k1", "k2"])  # doctest: +SKIP
    1
    ```
    """

    metrics: StoreMetrics
    timeout: float

    @abstractmethod
    def exists_many(self, keys: list[str]) -> list[bool]:
        """For each key, whether the store holds it (one round trip)."""

    def probe(
        self, exists: list[str], get: list[str], *, timeout: float | None = None
    ) -> tuple[list[int], list[bytes | None]]:
        """For each of `exists` the stored payload's size in bytes (`0`: not stored), and the (small) payloads of
        `get`, in one round trip, within the deadline (`timeout` seconds; default: the store's lookup deadline, what
        vLLM's scheduler can wait; the writer thread passes a longer one): what a prefix lookup asks. A backend that
        keys some of them on a server it cannot reach may answer those as missing instead of failing the whole call.
        This default asks `exists_many` (a size of 1 stands for "stored, size unknown")."""
        return [int(present) for present in self.exists_many(exists)], self.get_many(get)

    def warm_up(self) -> None:
        """Connects now (an engine calls it at start-up, so that its first lookups do not pay for the connections
        within their deadline); raises `StoreUnavailableError` when the store cannot be reached. This default asks
        whether one key exists."""
        self.exists_many(["kvbridge:warm-up"])

    def count_prefix(self, keys: list[str]) -> int:
        """How many of the LEADING `keys` the store holds (one round trip): the length of the stored prefix."""
        count = 0
        for present in self.exists_many(keys) if keys else []:
            if not present:
                break
            count += 1
        return count

    @abstractmethod
    def put_many(self, items: dict[str, bytes], *, ttl_s: float | None = None) -> None:
        """Stores every `key → payload` (one round trip; `ttl_s`, or else the store's TTL, applies)."""

    @abstractmethod
    def get_many(self, keys: list[str]) -> list[bytes | None]:
        """The payloads of `keys`, `None` for a key the store does not hold (one round trip)."""

    @abstractmethod
    def delete_many(self, keys: list[str]) -> int:
        """Deletes `keys`; returns how many existed."""

    @abstractmethod
    def close(self) -> None:
        """Releases the client's connections (the stored data stays)."""

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
