"""A tensor-parallel target engine: which of the target's KV heads a rank holds, the mapped cache sliced to them, and
the quality gate's score averaged over the ranks.

vLLM shards the KV heads of each attention layer across the tensor-parallel ranks (`QKVParallelLinear`): with
`kv_heads >= tp_size` rank `r` holds the `kv_heads / tp_size` heads from `r · kv_heads / tp_size`; with fewer heads
than ranks each head is replicated on `tp_size / kv_heads` consecutive ranks and rank `r` holds head
`r // (tp_size / kv_heads)`. The connector's worker on rank `r` writes exactly those heads of the mapped cache.

Rank 0 alone holds the source and the mapper: it maps every head and scatters each rank its heads (`scatter.py`), a
status a load, so one rank's failure cannot block the others (a load rank 0 cannot map is a zero status, every rank
reports its blocks as failed loads, and vLLM, which unions the ranks' failed blocks, has the target recompute the
prompt on every rank). The gate's collective: each rank scores its own heads, and the scores are averaged over the
ranks (`tensor_model_parallel_all_reduce`), which equals the score over all heads (every rank holds as many heads,
replicas counted alike); every rank takes part for every gated load, a rank that could not score contributing NaN,
so all ranks decide the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ...errors import ServingConfigError
from ...utils.cache import append_layer


@dataclass(frozen=True)
class HeadShard:
    """The KV heads `[start, stop)` of `total` that tensor-parallel rank `rank` of `size` holds.

    Example:

    ```python
    >>> HeadShard.of(8, rank=1, size=4).heads, HeadShard.of(1, rank=1, size=2).heads
    (slice(2, 4, None), slice(0, 1, None))
    ```
    """

    total: int
    rank: int = 0
    size: int = 1

    @classmethod
    def of(cls, total: int, rank: int = 0, size: int = 1) -> HeadShard:
        if size < 1 or not 0 <= rank < size:
            raise ServingConfigError(f"tensor-parallel rank {rank} of {size} is not a rank")
        if total % size and size % total:
            raise ServingConfigError(
                f"the target has {total} KV heads and tensor_parallel_size is {size}: vLLM shards KV heads evenly "
                "(one must divide the other)"
            )
        return cls(total, rank, size)

    @property
    def heads(self) -> slice:
        """This rank's KV heads, as a slice of the model's heads."""
        if self.total >= self.size:
            per_rank = self.total // self.size
            return slice(self.rank * per_rank, (self.rank + 1) * per_rank)
        head = self.rank // (self.size // self.total)  # replicated: tp_size / total consecutive ranks per head
        return slice(head, head + 1)

    @property
    def sharded(self) -> bool:
        """Whether this rank holds fewer heads than the model (tensor parallelism)."""
        return self.size > 1

    def num_heads(self) -> int:
        return self.heads.stop - self.heads.start


def slice_heads(cache, heads: slice) -> DynamicCache:
    """A cache holding only the KV heads `heads` of every layer of `cache` (views, `(B, h, T, d)` per layer)."""
    out = DynamicCache()
    for index, layer in enumerate(cache.layers):
        append_layer(out, index, layer.keys[:, heads], layer.values[:, heads])
    return out


def mean_over_ranks(scores: torch.Tensor, shard: HeadShard) -> torch.Tensor:
    """The mean of each rank's `scores` (float32, one per gated load of this step, NaN where a rank could not score)
    over the tensor-parallel group: every rank must call it with as many scores, in the same order."""
    if not shard.sharded:
        return scores
    from vllm.distributed import tensor_model_parallel_all_reduce

    return tensor_model_parallel_all_reduce(scores.clone()) / shard.size
