"""The least time a mapping can take on a device, and how close a measured one comes: its FLOP floor (its matrix
products at the device's measured matrix rate) and its memory floor (each input read once, each output written once,
at the device's measured copy bandwidth); the larger is the floor.

Bytes of one mapping of `T` tokens (`B` rows): the source layers the mapper reads (keys and values, the cache's
dtype), the mapper's weights (its dtype) and the target cache it writes (the target's dtype). The engine moves more
(its row buffer is written once and read by each step; the all-heads map re-reads rows per target layer from cache),
which is what the fraction of the floor shows.

The ceilings are measured, not taken from a datasheet (`measure_ceilings`): a large matrix product in the dtype the
mapper runs in, and a large device-to-device copy (bytes read plus bytes written).

Example:

```python
>>> ceilings = measure_ceilings(torch.device("cpu"), torch.float32, size=256, copy_bytes=2**22)
>>> sorted(ceilings)
['copy_bytes_per_s', 'matmul_flops_per_s']
```
"""

from __future__ import annotations

import torch

from .flop_model import mapper_flops
from .timing import median_seconds


def measure_ceilings(
    device: torch.device, dtype: torch.dtype, size: int | None = None, copy_bytes: int | None = None
) -> dict[str, float]:
    """The device's matrix rate in `dtype` (a `size`³ product on random data: 8192 on a GPU, 1024 on a CPU) and its
    copy bandwidth (a `copy_bytes` device-to-device copy, read plus write: 4 GiB on a GPU, 256 MiB on a CPU), each
    the median of a few runs after warm-up."""
    gpu = device.type == "cuda"
    size = size or (8192 if gpu else 1024)
    copy_bytes = copy_bytes or (2**32 if gpu else 2**28)
    generator = torch.Generator(device=device).manual_seed(0)
    pair = [torch.randn(size, size, device=device, dtype=dtype, generator=generator) for _ in range(2)]
    matmul = median_seconds(lambda: pair[0] @ pair[1], device, repeats=5, warmup=2)
    pair.clear()
    source = torch.empty(copy_bytes // 2, dtype=torch.uint8, device=device).random_(generator=generator)
    target = torch.empty_like(source)
    copy = median_seconds(lambda: target.copy_(source), device, repeats=5, warmup=2)
    return {"matmul_flops_per_s": 2 * size**3 / matmul, "copy_bytes_per_s": copy_bytes / copy}


def mapping_bytes(bridge, batch: int, tokens: int) -> int:
    """Fewest bytes one mapping of `batch` rows of `tokens` tokens moves: the source layers its mapper reads, its
    weights and the target cache it writes, each once."""
    mapper = bridge.mapping_mapper()
    source, target = bridge.source_layout, bridge.target_layout
    read = len({s for layers in mapper.selected_layers for s in layers if s < source.num_layers})
    cache_element = torch.finfo(bridge.source.dtype).bits // 8
    target_element = torch.finfo(bridge.target.dtype).bits // 8
    weights = sum(p.numel() * p.element_size() for p in mapper.parameters())
    rows = batch * tokens
    return rows * (read * source.features_per_layer * cache_element + target.num_layers * target.features_per_layer
                   * target_element) + weights  # fmt: skip


def mapping_floor(bridge, batch: int, tokens: int, ceilings: dict[str, float], seconds: float | None = None) -> dict:
    """The FLOP floor, the memory floor and the floor (the larger) of one mapping, in seconds, and with `seconds`
    measured, the fraction of the floor reached (floor / measured: 1 is the device's limit)."""
    flops = mapper_flops(bridge.mapper, batch * tokens)
    moved = mapping_bytes(bridge, batch, tokens)
    flop_floor = flops / ceilings["matmul_flops_per_s"]
    memory_floor = moved / ceilings["copy_bytes_per_s"]
    floor = max(flop_floor, memory_floor)
    result = {
        "mapper_flops": flops,
        "mapping_bytes": moved,
        "flop_floor_s": flop_floor,
        "memory_floor_s": memory_floor,
        "floor_s": floor,
        "bound": "flops" if flop_floor >= memory_floor else "memory",
    }
    if seconds is not None:
        result["fraction_of_floor"] = floor / seconds
    return result
