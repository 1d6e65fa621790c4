"""`stage_export`: an export's K/V handed from the engine's step to the store's writer thread without waiting.

The engine's step gathers the exported tokens' K/V out of its paged cache (one gather per layer, on the cache's device:
its blocks may be reused once the step ends) and hands them over. On a GPU the gathered K/V are copied into pinned host
buffers on the current stream without waiting (`non_blocking`), and an event marks the copy's end: the writer thread
waits for it (`StagedExport.wait`) before it encodes, so the step never waits for the device-to-host copy. The pinned
buffers come from PyTorch's caching host allocator (`pin_memory=True`), which reuses a freed block once the copies
recorded on it have finished: no pool of our own is needed there. On a CPU the gathered tensors are handed over as they
are (views: the writer thread gathers them into the chunks' bytes, `encode_chunk`), so the step makes one copy, the
gather, into a buffer of a `StagingPool`: buffers the writer has finished with are reused, so the step's copy lands in
memory the process already has (a fresh buffer's pages are faulted in on first write, which cost the export about as
much CPU time as the gather itself, so the connector `reserve`s a step's worth of them, faulted in, when the engine
registers its caches: the first export's step does not pay for them either).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from ...errors import InvalidInputError
from .writer import DEFAULT_MAX_PENDING_BYTES


class StagingPool:
    """Host buffers an export's step gathers into, given back by the writer and reused (thread-safe).

    Args:
        max_bytes (`int`, *optional*, defaults to 256 MiB): free buffers kept at most (as the writer's queue limit);
            a buffer given back past it is dropped, largest kept first.
        granule (`int`, *optional*, defaults to 4 MiB): sizes are rounded up to a multiple of it, so that steps of
            somewhat different sizes reuse each other's buffers.

    Example:

    ```python
    >>> pool = StagingPool()
    >>> lease = pool.lease(1000, users=2)  # one buffer for a step's two export tasks
    >>> lease.buffer.numel(), pool.free_bytes
    (1000, 0)
    >>> lease.release(); lease.release()  # each task's save calls it once it no longer reads the buffer
    >>> pool.free_bytes, pool.lease(5000, users=1).buffer.data_ptr() == lease.buffer.data_ptr(), pool.allocated
    (4194304, True, 1)
    ```
    """

    def __init__(self, max_bytes: int = DEFAULT_MAX_PENDING_BYTES, granule: int = 4 << 20):
        if not (max_bytes >= 0 and granule > 0):
            raise InvalidInputError(f"StagingPool wants max_bytes ≥ 0 and granule > 0, got {max_bytes}, {granule}")
        self.max_bytes, self.granule = int(max_bytes), int(granule)
        self._free: list[torch.Tensor] = []  # flat uint8 buffers, smallest first
        self._lock = threading.Lock()
        self.allocated = 0  # buffers made (not reused): how often a step's copy paid for fresh pages

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(buffer.numel() for buffer in self._free)

    def reserve(self, nbytes: int) -> int:
        """Makes one free buffer of `nbytes` (rounded up to the granule, capped at `max_bytes`) and writes every page
        of it, so that a later `lease` that fits it reuses memory already faulted in; returns its size in bytes (0
        when `nbytes` or `max_bytes` is 0). Called at start-up, off any engine step.

        Example:

        ```python
        >>> pool = StagingPool(max_bytes=8 << 20)
        >>> pool.reserve(5 << 20), pool.lease(6 << 20, users=1).buffer.numel(), pool.allocated
        (8388608, 6291456, 0)
        ```
        """
        size = min(self._rounded(max(int(nbytes), 0)), self.max_bytes)
        if size <= 0:
            return 0
        buffer = torch.zeros(size, dtype=torch.uint8)  # zeros: every page written (faulted in) now, not in a step
        self._give(buffer)
        return size

    def lease(self, nbytes: int, users: int) -> Lease:
        """A buffer of at least `nbytes` (the smallest free one that fits, else a new one), given back when
        `Lease.release` has been called `users` times."""
        with self._lock:
            found = next((i for i, buffer in enumerate(self._free) if buffer.numel() >= nbytes), None)
            buffer = None if found is None else self._free.pop(found)
            self.allocated += buffer is None
        if buffer is None:
            buffer = torch.empty(self._rounded(max(nbytes, 1)), dtype=torch.uint8)
        return Lease(self, buffer, nbytes, users)

    def _rounded(self, nbytes: int) -> int:
        """`nbytes` rounded up to a multiple of the granule."""
        return -(-nbytes // self.granule) * self.granule

    def _give(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buffer)
            self._free.sort(key=torch.Tensor.numel)
            while sum(b.numel() for b in self._free) > self.max_bytes:
                self._free.pop(0)  # keep the large ones: they fit any step


class Lease:
    """A `StagingPool` buffer lent to one step: `buffer` (flat `uint8`, `nbytes` long), back in the pool after
    `release` has been called once per user (the step's export tasks). Not released (a writer closed with the task
    queued): the buffer is simply freed when its last view goes."""

    def __init__(self, pool: StagingPool, whole: torch.Tensor, nbytes: int, users: int):
        self.buffer, self._pool, self._whole = whole[:nbytes], pool, whole
        self._users, self._lock = int(users), threading.Lock()

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            last = self._users == 0
        if last:
            self._pool._give(self._whole)


@dataclass
class StagedExport:
    """An export's K/V on their way to the writer thread.

    Attributes:
        keys, values (lists of `torch.Tensor`): per layer `(kv_heads, tokens, head_dim)` on the CPU (pinned buffers
            being filled, for a GPU source).
        event (`torch.cuda.Event`, *optional*): recorded after the copies; `None` on a CPU.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    event: object | None = None

    def wait(self) -> None:
        """Blocks (the writer thread) until the tensors hold the K/V."""
        if self.event is not None:
            self.event.synchronize()


def stage_export(keys: list[torch.Tensor], values: list[torch.Tensor]) -> StagedExport:
    """`keys`/`values` (per layer `(kv_heads, tokens, head_dim)`, gathered from the paged cache) staged for the writer
    thread: on a GPU, copied into pinned host buffers without waiting; on a CPU, as they are.

    Example:

    ```python
    >>> staged = stage_export([torch.ones(2, 4, 8)], [torch.zeros(2, 4, 8)])
    >>> staged.wait(); staged.keys[0].shape
    torch.Size([2, 4, 8])
    ```
    """
    if not any(t.is_cuda for t in (*keys, *values)):
        return StagedExport(list(keys), list(values))
    staged: list[list[torch.Tensor]] = [[], []]
    for out, tensors in zip(staged, (keys, values), strict=True):
        for tensor in tensors:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)  # (H, T, d), contiguous
            host.copy_(tensor, non_blocking=True)
            out.append(host)
    event = torch.cuda.Event()
    event.record()  # on the current stream, after the copies
    return StagedExport(staged[0], staged[1], event)
