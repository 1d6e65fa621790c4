"""A tensor-parallel target's loads, the source computed once: rank 0 alone holds the source model and the mapper,
gets each load's source K/V (its prefill, the KV store, or both), maps every target KV head, writes its own heads,
and one scatter a step over vLLM's tensor-parallel group sends each other rank its heads of the mapped K/V, which it
writes into its paged cache. The other ranks load no source weights and no mapper, and run no source prefill.

Each rank gets one flat buffer a step, in the format of the export's gather (`export.pack`): a status a load (1:
mapped, 0: rank 0 could not map it), then each load's `(layers, 2, tokens, heads of the rank, head_dim)` (zeros where
it failed): the tokens `[start, end)` the rank writes, then, for a gated load, the mapped K/V of its probe tokens
`[probe_start, probe_end)` (not written: the quality gate's, each rank scoring its heads as before). Every rank knows
every size from the step's metadata and its layers, so every rank takes part in the one scatter whatever failed, and
no rank waits for another: a load rank 0 could not map reaches the others as a zero status, and every rank reports
its blocks as failed loads (status `fallback`), which vLLM recomputes on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from ...utils.cache import append_layer
from .export import ShardGeometry, pack
from .metadata import BridgeLoad
from .tensor_parallel import HeadShard


def sent_tokens(load: BridgeLoad) -> int:
    """The tokens of `load` a rank gets: the mapped `[start, end)`, then the probe `[probe_start, probe_end)`.

    Example:

    ```python
    >>> sent_tokens(BridgeLoad("r", list(range(50)), start=0, end=40, block_ids=[0, 1], probe_start=42, probe_end=50))
    48
    ```
    """
    return (load.end - load.start) + (load.probe_end - load.probe_start)


def stack_kv(cache) -> torch.Tensor:
    """A cache's K/V as one tensor: `(layers, 2, T, H, d)` from `(1, H, T, d)` keys and values per layer (a copy)."""
    return torch.stack([torch.stack((layer.keys[0], layer.values[0])).transpose(1, 2) for layer in cache.layers])


def cache_of(kv: torch.Tensor) -> DynamicCache:
    """The inverse of `stack_kv`: a cache of `(1, h, T, d)` views per layer of `kv` `(layers, 2, T, h, d)`."""
    out = DynamicCache()
    for index, layer in enumerate(kv):  # (2, T, h, d)
        append_layer(out, index, layer[0].transpose(0, 1)[None], layer[1].transpose(0, 1)[None])
    return out


def rank_buffers(
    kvs: Sequence[torch.Tensor | None], lengths: Sequence[int], geometry: ShardGeometry, total: int, size: int,
    device=None,
) -> list[torch.Tensor]:  # fmt: skip
    """Rank 0's buffers of a step, one a rank of `size` (in rank order): each `export.pack` of the loads' `kvs`
    (`(layers, 2, T, total, d)` each, every head; `None` where rank 0 could not map the load) sliced to the rank's
    KV heads (`HeadShard`: a head replicated on `size / total` ranks when there are fewer heads than ranks)."""
    buffers = []
    for rank in range(size):
        heads = HeadShard.of(total, rank, size).heads
        buffers.append(pack([None if kv is None else kv[:, :, :, heads] for kv in kvs], lengths, geometry, device))
    return buffers


def scatter_from_first_rank(
    buffers: Sequence[torch.Tensor] | None, numel: int, dtype: torch.dtype, device
) -> torch.Tensor:
    """Rank `r`'s buffer of `buffers` (given on rank 0 of vLLM's tensor-parallel group, `None` elsewhere; `numel`
    elements of `dtype` each), on every rank. Sent as bytes, so any dtype goes through any backend. Every rank must
    call it, with the same `numel`."""
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    out = torch.empty(numel * dtype.itemsize, dtype=torch.uint8, device=device)  # (numel · itemsize,)
    sent = None if buffers is None else [buffer.contiguous().view(torch.uint8) for buffer in buffers]
    torch.distributed.scatter(out, sent, src=group.ranks[0], group=group.device_group)
    return out.view(dtype)
