"""`stage_export`: an export's K/V handed from the engine's step to the store's writer thread without waiting.

The engine's step gathers the exported tokens' K/V out of its paged cache (one gather per layer, on the cache's
device: its blocks may be reused once the step ends) and hands them over. On a GPU the gathered K/V are copied into
pinned host buffers on the current stream without waiting (`non_blocking`), and an event marks the copy's end: the
writer thread waits for it (`StagedExport.wait`) before it encodes, so the step never waits for the device-to-host
copy. On a CPU the gathered tensors are handed over as they are (views: the writer thread gathers them into the
chunks' bytes, `encode_chunk`), so the step makes one copy, the gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
