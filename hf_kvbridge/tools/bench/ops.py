"""What one call dispatches and how long the device is busy with it: the op counter and device-busy time of
`kvbridge bench mapper`.

- `OpCounter` is a `TorchDispatchMode`: it sees every op the dispatcher hands to PyTorch's Python mode (ATen ops,
  views included, and the package's own `torch.ops.kvbridge` ops, each counted once however many kernels it
  launches), on any device, so a mapping counts the same on CPU and on CUDA. Ops that only make views or allocate
  (`aten.view`, `aten.slice`, `aten.empty`, ...) launch no kernel; `OpCounts.compute_ops` leaves them out.
- `device_busy_seconds` sums the time the GPU spends in kernels and copies during one call (`torch.profiler`'s device
  events): what the call costs the device, apart from the host's launch overhead. `None` on a CPU.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .report import fixed_width

# ops that allocate or only describe memory: no kernel runs for them (views are told apart by `OpOverload.is_view`)
_NO_KERNEL = {"empty", "empty_strided", "empty_like", "lift_fresh", "detach", "alias", "unbind", "split", "chunk"}


@dataclass
class OpCounts:
    """Ops dispatched during a counted call.

    Args:
        ops (`collections.Counter`): calls per op name (`"aten.addmm.default"`, `"kvbridge.rotate_kv.default"`).
        views (`int`): of them, ops that make views or allocate (no kernel).
    """

    ops: collections.Counter = field(default_factory=collections.Counter)
    views: int = 0

    @property
    def total(self) -> int:
        """Every op dispatched."""
        return sum(self.ops.values())

    @property
    def compute_ops(self) -> int:
        """Ops that run a kernel (or, for `torch.ops.kvbridge` ops, one kernel per layer they are given)."""
        return self.total - self.views

    def as_dict(self) -> dict:
        """Totals and the ten most frequent ops, for JSON."""
        return {"ops": self.total, "compute_ops": self.compute_ops, "top": dict(self.ops.most_common(10))}


class OpCounter(TorchDispatchMode):
    """Counts the ops dispatched inside its `with` block (`counts`), as the dispatcher sees them.

    Example:

    ```python
    >>> with OpCounter() as counter:
    ...     torch.ones(3).add_(1).view(3, 1)
    tensor([[2.],
            [2.],
            [2.]])
    >>> counter.counts.total, counter.counts.compute_ops
    (3, 2)
    ```
    """

    def __init__(self):
        super().__init__()
        self.counts = OpCounts()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        self.counts.ops[name] += 1
        if getattr(func, "is_view", False) or name.split(".")[1] in _NO_KERNEL:
            self.counts.views += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn: Callable[[], object]) -> OpCounts:
    """The ops `fn()` dispatches (`OpCounter`)."""
    with OpCounter() as counter:
        fn()
    return counter.counts


def device_busy_seconds(fn: Callable[[], object], device: torch.device) -> dict | None:
    """Time the GPU spends on `fn()`'s work: the sum of its kernels' and copies' durations (`torch.profiler` device
    events, so idle gaps between launches are not counted), and how many kernels ran. `None` on a CPU.

    Returns:
        `{"device_busy_s": seconds, "kernels": count}` or `None`.
    """
    if torch.device(device).type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    # kernels and copies are events of device type CUDA; one stream, so their durations do not overlap
    spans = [e.time_range.elapsed_us() for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return {"device_busy_s": sum(spans) / 1e6, "kernels": len(spans)}


def mapping_measures(
    bridge, map_fn: Callable[[], object], batch: int, tokens: int, seconds: float, ceilings: dict | None
) -> dict:
    """What `kvbridge bench mapper` adds to a row about one mapping `map_fn()` (timed at `seconds`): the ops it
    dispatches (in all and per target layer), the device's busy time and kernels (CUDA), and its FLOP and memory
    floors and the fraction of the floor reached (`hf_kvbridge.tools.bench.floors`, with the measured `ceilings`)."""
    from .floors import mapping_floor

    counts = count_ops(map_fn)
    layers = bridge.target_layout.num_layers
    row = {
        "ops_per_mapping": counts.total,
        "ops_per_target_layer": counts.total / layers,
        "compute_ops_per_mapping": counts.compute_ops,
        "compute_ops_per_target_layer": counts.compute_ops / layers,
        "top_ops": dict(counts.ops.most_common(8)),
    }
    busy = device_busy_seconds(map_fn, bridge.device)
    if busy is not None:
        row.update(busy)
    if ceilings is not None:
        row.update(mapping_floor(bridge, batch, tokens, ceilings, seconds))
    return row


def format_measures(rows: list[dict]) -> str:
    """The op counts, device time and floors of `kvbridge bench mapper`'s rows as a fixed-width table."""
    header = ("tokens", "ops", "ops/layer", "kernels", "busy ms", "FLOP fl. ms", "mem fl. ms", "of floor")
    cells = [
        (
            r["context_tokens"],
            r["ops_per_mapping"],
            f"{r['ops_per_target_layer']:.1f}",
            r.get("kernels", "n/a"),
            f"{r['device_busy_s'] * 1e3:.2f}" if "device_busy_s" in r else "n/a",
            f"{r['flop_floor_s'] * 1e3:.2f}" if "flop_floor_s" in r else "n/a",
            f"{r['memory_floor_s'] * 1e3:.2f}" if "memory_floor_s" in r else "n/a",
            f"{r['fraction_of_floor']:.2f}" if "fraction_of_floor" in r else "n/a",
        )
        for r in rows
    ]
    return fixed_width(header, cells)
