"""Export from a tensor-parallel engine (roles source and both): each rank reads its own KV heads of a step's export
tasks from its paged cache, the ranks' shares are gathered to rank 0 (one gather a step, vLLM's tensor-parallel
group), and rank 0 writes the entries of all heads in the store's one format (the keys and chunks a TP 1 engine
writes), so that any target, at any tensor-parallel size, reads them.

Each rank sends one flat buffer a step: a status a task (1: read, 0: this rank could not read it), then each task's
`(layers, 2, tokens, heads of the rank, head_dim)` (zeros where it failed). Every rank knows every size from the
step's metadata and its layers, so a rank whose read fails still takes part in the gather with its marker: no rank
waits for another, and rank 0 writes nothing of a task some rank could not read (counted as `export_errors`, with
a WARNING naming the ranks). With fewer KV heads than ranks each head is replicated on `tp / kv_heads` ranks: the
first rank of each head's replicas gives it (`head_owners`), so every head is stored once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from vllm.logger import init_logger

from ...errors import KVLayoutError
from .paged_cache import dequantize, engine_scales, fp8_format, read_layers, read_nbytes, slots_of
from .tensor_parallel import HeadShard

logger = init_logger("vllm.hf_kvbridge")


@dataclass(frozen=True)
class ShardGeometry:
    """What one rank's read of a task holds, known on every rank before it reads: `layers` attention layers,
    `heads` KV heads (this rank's share), `head_dim`, in `dtype` (a float cache's own dtype; float32 otherwise).

    Example:

    ```python
    >>> ShardGeometry(layers=3, heads=1, head_dim=32, dtype=torch.float32).numel(tokens=10)
    1920
    ```
    """

    layers: int
    heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, layers: Sequence[nn.Module]) -> ShardGeometry:
        """The geometry of vLLM's attention `layers` (their `num_kv_heads` and `head_size`: this rank's share)."""
        first = layers[0]
        cache_dtype = first.kv_cache.dtype
        dtype = cache_dtype if cache_dtype.is_floating_point and cache_dtype.itemsize >= 2 else torch.float32
        return cls(len(layers), int(first.num_kv_heads), int(first.head_size), dtype)

    def shape(self, tokens: int) -> tuple[int, ...]:
        return (self.layers, 2, tokens, self.heads, self.head_dim)

    def numel(self, tokens: int) -> int:
        return self.layers * 2 * tokens * self.heads * self.head_dim


def read_task(layers: Sequence[nn.Module], slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The keys and values at `slots` of every layer of `layers` (in order), `(layers, 2, T, heads, head_dim)`."""
    return read_tasks(layers, [slots], dtype)[0]


def read_tasks(layers: Sequence[nn.Module], slots: Sequence[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """Each task's keys and values at its `slots` (`(T_i,)` each) of every layer of `layers`, `(layers, 2, T_i,
    heads, head_dim)` in `dtype` (an fp8 cache's codes dequantized with the engine's scales): all the tasks read at
    once, one `index_select` a layer (`read_layers`)."""
    kv = torch.stack(read_layers(layers, torch.cat(list(slots))))  # (L, 2, h, T_all, d), the cache's dtype
    codes = fp8_format(layers[0])
    if codes is not None:  # dequantized as read_slots does, with each layer's scales
        kv = torch.stack([
            torch.stack([dequantize(side, codes, scale) for side, scale in zip(layer_kv, engine_scales(layer))])
            for layer_kv, layer in zip(kv, layers, strict=True)
        ])  # fmt: skip
    out, offset = [], 0
    for task_slots in slots:
        out.append(kv[:, :, :, offset : offset + len(task_slots)].transpose(2, 3).to(dtype))  # (L, 2, T_i, h, d)
        offset += len(task_slots)
    return out


def task_views(
    kv: Sequence[torch.Tensor], begin: int, end: int, codes: torch.dtype | None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One task's keys and values out of a step's read (`read_layers`: per layer `(2, H, T_all, d)`): tokens
    `[begin, end)` of it, per layer `(H, end - begin, d)` views (each head's tokens contiguous), as `codes` (an fp8
    cache's format, for `PrefixKVStore.save(scales=...)`) where the cache holds fp8 codes."""
    keys = [layer[0, :, begin:end] for layer in kv]  # (H, T, d) views
    values = [layer[1, :, begin:end] for layer in kv]
    if codes is not None:
        keys, values = [k.view(codes) for k in keys], [v.view(codes) for v in values]
    return keys, values


def pack(
    reads: Sequence[torch.Tensor | None], lengths: Sequence[int], geometry: ShardGeometry, device=None
) -> torch.Tensor:
    """One rank's flat buffer of a step's tasks: a status a task (1.0 read, 0.0 not), then each task's read
    (`geometry.shape(length)`, zeros for a task this rank could not read). Its size depends on `lengths` and
    `geometry` only, so it is the same on every rank."""
    parts = [torch.tensor([float(r is not None) for r in reads], dtype=geometry.dtype, device=device)]
    for read, length in zip(reads, lengths, strict=True):
        if read is None:
            parts.append(torch.zeros(geometry.numel(length), dtype=geometry.dtype, device=device))
        else:
            if tuple(read.shape) != geometry.shape(length):
                raise KVLayoutError(f"a read of shape {tuple(read.shape)} where {geometry.shape(length)} was expected")
            parts.append(read.to(device=device, dtype=geometry.dtype).flatten())
    return torch.cat(parts)


def unpack(flat: torch.Tensor, lengths: Sequence[int], geometry: ShardGeometry) -> list[torch.Tensor | None]:
    """The inverse of `pack` for one rank's buffer: each task's read (views), or `None` where the rank failed."""
    status, offset, out = flat[: len(lengths)], len(lengths), []
    for ok, length in zip(status.tolist(), lengths, strict=True):
        n = geometry.numel(length)
        out.append(flat[offset : offset + n].view(geometry.shape(length)) if ok == 1.0 else None)
        offset += n
    return out


def head_owners(total: int, size: int) -> list[int]:
    """The ranks whose shares, concatenated in order, hold each of `total` KV heads once: every rank when the heads
    are sharded, the first rank of each head's replicas when there are fewer heads than ranks.

    Example:

    ```python
    >>> head_owners(8, 4), head_owners(2, 4), head_owners(1, 2)
    ([0, 1, 2, 3], [0, 2], [0])
    ```
    """
    HeadShard.of(total, 0, size)  # refuses a size the heads do not divide, nor it them
    if total >= size:
        return list(range(size))
    return [head * (size // total) for head in range(total)]


def assemble(shares: Sequence[torch.Tensor], total: int) -> torch.Tensor:
    """All `total` KV heads from every rank's share of a task (`(layers, 2, T, h, d)` each, in rank order):
    `(layers, 2, T, total, d)`, each head taken once."""
    return torch.cat([shares[rank] for rank in head_owners(total, len(shares))], dim=3)


def gather_to_first_rank(flat: torch.Tensor, size: int) -> list[torch.Tensor] | None:
    """Every rank's `flat` (the same size on each), on rank 0 of vLLM's tensor-parallel group (in rank order);
    `None` on the other ranks. Every rank must call it, with as many elements."""
    from vllm.distributed import get_tp_group

    gathered = get_tp_group().gather(flat, dst=0, dim=0)  # (size · n,) on rank 0
    return None if gathered is None else list(gathered.chunk(size))


def export_sharded(
    tasks: Sequence[Any],
    layers: Sequence[nn.Module],
    *,
    block_size: int,
    exports,
    shard: HeadShard,
    count: Callable[..., None],
    gather: Callable[[torch.Tensor, int], list[torch.Tensor] | None] = gather_to_first_rank,
) -> None:
    """A step's export `tasks` (`metadata.ExportTask`, the same on every rank) on tensor-parallel rank `shard.rank`:
    its heads read from `layers` (vLLM's attention layers, in layer order), gathered to rank 0, which writes every
    task all ranks could read to `exports` (a `PrefixKVStore` with a writer) and counts the others as
    `export_errors`. Every rank calls it once a step with exports, whatever fails."""
    from ..kv_store.staging import stage_export

    geometry = ShardGeometry.of(layers)
    device = layers[0].kv_cache.device
    lengths = [task.end - task.start for task in tasks]
    reads: list[torch.Tensor | None] = [None] * len(tasks)  # None: this rank's marker, rank 0 writes nothing of it

    def failed(task, error: Exception) -> None:
        logger.warning(
            "KVBridgeConnector: tensor-parallel rank %d could not read request %s tokens %d..%d to export: %s: %s",
            shard.rank, task.req_id, task.start, task.end, type(error).__name__, error,
        )  # fmt: skip

    slots: dict[int, torch.Tensor] = {}
    for index, task in enumerate(tasks):
        try:
            slots[index] = slots_of(task.block_ids, block_size, task.start, task.end)  # (T,)
        except Exception as error:
            failed(task, error)
    try:
        if slots:  # every task at once: one index_select a layer
            for index, read in zip(slots, read_tasks(layers, list(slots.values()), geometry.dtype), strict=True):
                reads[index] = read  # (L, 2, T, h, d)
    except Exception as error:
        for index in slots:
            failed(tasks[index], error)
    gathered = gather(pack(reads, lengths, geometry, device), shard.size)
    if gathered is None:  # not rank 0: rank 0 writes
        return
    per_rank = [unpack(flat, lengths, geometry) for flat in gathered]
    for index, task in enumerate(tasks):
        shares = [rank_reads[index] for rank_reads in per_rank]
        failed = [rank for rank, share in enumerate(shares) if share is None]
        try:
            if failed:
                raise KVLayoutError(f"tensor-parallel rank(s) {failed} could not read their KV heads")
            kv = assemble(shares, shard.total)  # (L, 2, T, H, d)
            keys, values = [layer[0].transpose(0, 1) for layer in kv], [layer[1].transpose(0, 1) for layer in kv]
            staged = stage_export(keys, values)  # per layer (H, T, d) views
            chunks = exports.save(task.token_ids, staged.keys, staged.values, start=task.start, salt=task.salt,
                                  tail=task.tail, ready=staged.wait)  # fmt: skip
            count(chunks_exported=chunks, partials_exported=int(task.tail), tokens_exported=lengths[index])
        except Exception as error:  # an export never fails the request: the store just lacks these chunks
            export_failed(count, task, error)


def export_failed(count: Callable[..., None], task, error: Exception) -> None:
    """An export `task` that failed: counted (`export_errors`) and logged, never raised."""
    count(export_errors=1)
    logger.warning(
        "KVBridgeConnector: export of request %s tokens %d..%d failed: %s: %s",
        task.req_id, task.start, task.end, type(error).__name__, error,
    )  # fmt: skip


def export_local(
    tasks: Sequence[Any], layers: Sequence[nn.Module], *, block_size: int, exports, count: Callable[..., None], pool
) -> None:
    """A step's export `tasks` (`metadata.ExportTask`) on a TP 1 engine: every task's slots read at once
    (`read_layers`: one `index_select` a layer of exactly the exported tokens' K/V, into `(2, H, T_all, d)`; the
    step's one copy, made before the step returns since vLLM may give the blocks to another request in the next
    step; on a CPU into a buffer of `pool`, a `staging.StagingPool`, which each task's save gives back once written,
    dropped or refused), each task handed to `exports` (a `PrefixKVStore`, its writer thread) as views of it (an fp8
    cache's codes, dequantized there: `save(scales=...)`). What fails is counted (`export_errors`) and logged, never
    raised: an export never fails the request."""
    from ..kv_store.staging import stage_export

    def failed(task, error: Exception) -> None:
        export_failed(count, task, error)

    slots, ready = [], []
    for task in tasks:
        try:
            slots.append(slots_of(task.block_ids, block_size, task.start, task.end))  # (T,)
            ready.append(task)
        except Exception as error:
            failed(task, error)
    if not ready:
        return
    lease = None
    try:
        if layers[0].kv_cache.device.type == "cpu":  # a GPU's read is staged to pinned buffers (`stage_export`)
            lease = pool.lease(read_nbytes(layers, sum(map(len, slots))), users=len(ready))
        kv = read_layers(layers, torch.cat(slots), None if lease is None else lease.buffer)  # (2, H, T_all, d) each
        codes = fp8_format(layers[0])
        scales = None if codes is None else [engine_scales(layer) for layer in layers]
    except Exception as error:
        for task in ready:
            if lease is not None:
                lease.release()
            failed(task, error)
        return
    offset = 0
    for task, task_slots in zip(ready, slots, strict=True):
        tokens, begin, done = len(task_slots), offset, None if lease is None else lease.release
        offset += tokens
        try:
            keys, values = task_views(kv, begin, offset, codes)  # (H, T, d) views, each head's tokens contiguous
            staged = stage_export(keys, values)  # a GPU's: to pinned host buffers, not waited for here
            handed, done = done, None  # from here the save calls it (written, dropped or refused)
            chunks = exports.save(
                task.token_ids, staged.keys, staged.values, start=task.start, salt=task.salt, tail=task.tail,
                ready=staged.wait, scales=scales, done=handed,
            )  # fmt: skip
            count(chunks_exported=chunks, partials_exported=int(task.tail), tokens_exported=tokens)
        except Exception as error:
            if done is not None:
                done()
            failed(task, error)
