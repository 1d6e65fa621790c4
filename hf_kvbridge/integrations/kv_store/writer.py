"""`AsyncWriter`: writes chunks to a store on a thread of its own, so the caller (an engine's step) never waits.

The caller hands over `(key, payload)` pairs, where the payload may be a callable that encodes it (the encoding then
runs on the writer thread too), or a *job*: a callable that makes its own store calls (`PrefixKVStore.save` queues one
per export: it asks what is stored, encodes and writes the rest, and replaces a slot), run after the chunks queued
before it. `submit` never blocks and never raises for the store: past `max_pending_bytes` queued
it drops the chunk (counted in `writes_dropped`), and a failed write is counted (`write_errors`) and logged at
WARNING once per run of failures, since an export is an optimisation the caller can live without.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

from ...errors import InvalidInputError, StoreUnavailableError
from .base import KVStore

logger = logging.getLogger(__name__)

Payload = bytes | Callable[[], bytes]
Job = Callable[[], None]
_JOB = object()  # the queue's key for a job

MAX_BATCH_CHUNKS = 32
"""Chunks sent in one round trip at most."""

DEFAULT_MAX_PENDING_BYTES = 256 << 20
"""The queue's limit unless told (the vLLM connector's `export_buffer_mb`); the staging pool's too."""

MAX_BATCH_BYTES = 64 << 20
"""Bytes sent in one round trip at most (one larger chunk still goes alone)."""


class AsyncWriter:
    """A daemon thread draining a queue of chunk writes into `store`.

    Args:
        store (`KVStore`): where the chunks go; its `metrics` count the writer's drops and errors too.
        max_pending_bytes (`int`, *optional*, defaults to 256 MiB): queued bytes past which `submit` drops.

    Example:

    ```python
    >>> writer = AsyncWriter(store)  # doctest: +SKIP
    >>> writer.submit("kvbridge:v1:...", lambda: encode_chunk(k, v, model_id=mid, start=0), nbytes=2 << 20)
    True
    >>> writer.flush(timeout=10)  # doctest: +SKIP
    True
    ```
    """

    def __init__(self, store: KVStore, *, max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES):
        if not max_pending_bytes > 0:
            raise InvalidInputError(f"max_pending_bytes must be > 0, got {max_pending_bytes!r}")
        self.store = store
        self.metrics = store.metrics
        self.max_pending_bytes = int(max_pending_bytes)
        self._queue: collections.deque[tuple[str, Payload, int]] = collections.deque()
        self._pending_bytes = 0
        self._busy = False  # a batch is being encoded or written
        self._closed = False
        self._failing = False  # inside a run of failed writes (logged once)
        self._dropping = False  # inside a run of drops (logged once)
        self._condition = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="kvbridge-store-writer", daemon=True)
        self._thread.start()

    def submit_job(self, job: Job, nbytes: int = 0) -> bool:
        """Queues `job` (a callable that makes its own store calls; what it raises is counted in `write_errors` and
        logged like a failed write) after what is queued; returns `False` when it was dropped. `nbytes` counts
        against the queue limit."""
        return self.submit(_JOB, job, nbytes)  # type: ignore[arg-type]

    @property
    def pending_bytes(self) -> int:
        """Bytes queued and not yet written (callables count as their `nbytes`)."""
        with self._condition:
            return self._pending_bytes

    def submit(self, key: str, payload: Payload, nbytes: int | None = None) -> bool:
        """Queues one chunk; returns `False` when it was dropped (queue full, or the writer closed).

        Args:
            key (`str`): the store key.
            payload (`bytes` or a callable returning `bytes`): the chunk, or what encodes it on the writer thread
                (it must not read tensors the caller changes afterwards: hand it copies of a paged cache).
            nbytes (`int`, *optional*): the payload's size for the queue limit; defaults to `len(payload)` for bytes,
                and should be given for a callable (else it counts as 0 bytes).
        """
        size = len(payload) if isinstance(payload, bytes | bytearray) else int(nbytes or 0)
        with self._condition:
            if self._closed:
                self.metrics.add(writes_dropped=1)
                return False
            if self._pending_bytes + size > self.max_pending_bytes and (self._queue or self._busy):
                self.metrics.add(writes_dropped=1)
                if not self._dropping:
                    self._dropping = True
                    logger.warning(
                        "KV store writer: queue full (%d bytes pending, limit %d); dropping chunks until it drains",
                        self._pending_bytes, self.max_pending_bytes,
                    )  # fmt: skip
                return False
            self._queue.append((key, payload, size))
            self._pending_bytes += size
            self._condition.notify_all()
            return True

    def _next_batch(self) -> list[tuple[str, Payload, int]] | None:
        """Waits for queued chunks; `None` once closed and drained."""
        with self._condition:
            while not self._queue and not self._closed:
                self._condition.wait()
            if not self._queue:
                return None
            batch, total = [], 0
            while self._queue and len(batch) < MAX_BATCH_CHUNKS and (not batch or total < MAX_BATCH_BYTES):
                item = self._queue.popleft()
                batch.append(item)
                total += item[2]
            self._busy = True
            return batch

    def _write(self, batch: list[tuple[str, Payload, int]]) -> None:
        items, failures, error = {}, 0, None

        def put() -> None:
            nonlocal failures, error
            try:
                self.store.put_many(items)  # counts its own write errors
            except Exception as err:
                failures, error = failures + len(items), err
            items.clear()

        for key, payload, _ in batch:
            if key is _JOB:  # the chunks queued before it first
                put()
                try:
                    payload()
                except Exception as err:  # a job counts its store errors itself; anything else is counted here
                    failures, error = failures + 1, err
                    if not isinstance(err, StoreUnavailableError):
                        self.metrics.add(write_errors=1)
                continue
            try:
                items[key] = payload() if callable(payload) else bytes(payload)
            except Exception as err:  # an encoding error loses that chunk only
                failures, error = failures + 1, err
                self.metrics.add(write_errors=1)
        put()
        if failures:
            if not self._failing:
                self._failing = True
                logger.warning("KV store writer: %d chunk(s) not written: %s (further failures logged at DEBUG "
                               "until a write succeeds)", failures, error)  # fmt: skip
            else:
                logger.debug("KV store writer: %d chunk(s) not written: %s", failures, error)
        elif self._failing:
            self._failing = False
            logger.info("KV store writer: writes succeed again")

    def _run(self) -> None:
        while (batch := self._next_batch()) is not None:
            try:
                with self.metrics.writer_cpu():
                    self._write(batch)
            finally:
                with self._condition:
                    self._pending_bytes -= sum(item[2] for item in batch)
                    self._busy = False
                    if not self._queue:
                        self._dropping = False
                    self._condition.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until every queued chunk is written (or failed); `False` if `timeout` seconds pass first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._condition:
            while self._queue or self._busy:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._condition.wait(remaining)
            return True

    def close(self, timeout: float | None = 30.0) -> bool:
        """Stops taking chunks, writes what is queued (up to `timeout` seconds) and ends the thread.

        Returns whether everything queued was written (or failed) in time; a daemon thread never holds up exit.
        """
        with self._condition:
            self._closed = True
            self._condition.notify_all()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def __enter__(self) -> AsyncWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
