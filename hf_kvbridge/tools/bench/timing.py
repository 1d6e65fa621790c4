"""Wall time and peak memory of a function, as the benchmarks and measurement scripts take them, and the random
prompts the benchmarks time on (`random_prompts`).

Medians of repeated runs after warm-up (`median_seconds`), or of rounds that run several functions in turn
(`interleaved_medians`), synchronising a GPU before each clock read; the peak memory a call allocates on top of what
is already there (`peak_extra_bytes`: CUDA allocator statistics on a GPU, PyTorch's own allocation records on CPU).

Example:

```python
>>> import torch
>>> from hf_kvbridge.tools.bench.timing import median_seconds, peak_extra_bytes
>>> a = torch.randn(256, 256)
>>> median_seconds(lambda: a @ a, torch.device("cpu"), repeats=3) > 0
True
>>> peak_extra_bytes(lambda: torch.ones(1 << 20), torch.device("cpu")) >= 4 << 20
True
```
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch


def synchronize(device: torch.device) -> None:
    """Waits for the work queued on `device` (a CUDA device; nothing to wait for on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of `fn()` over `repeats` runs after `warmup` runs."""
    return interleaved_medians({"fn": fn}, device, repeats, warmup)["fn"]


def interleaved_medians(
    fns: dict[str, Callable[[], object]], device: torch.device, repeats: int = 5, warmup: int = 1
) -> dict[str, float]:
    """Median wall time of each of `fns` over `repeats` rounds after `warmup` rounds; each round runs every function
    once, in turn, so a slow patch of a shared machine slows all of them alike instead of one."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    synchronize(device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


@contextlib.contextmanager
def native_output_silenced():
    """Sends what native code writes to stdout/stderr to /dev/null: the profiler's tracing backend prints
    `USDT ... profiler_start` lines there, which say nothing to a user."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, devnull):
            os.close(fd)


def cpu_peak_bytes(fn: Callable[[], object]) -> int:
    """Peak of PyTorch's CPU allocations during `fn()` above where they started, from the allocator's own records
    (every allocation and free, in order, as `torch.profiler` logs them with `profile_memory=True`)."""
    from torch.profiler import ProfilerActivity, profile

    with native_output_silenced(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    current = peak = 0
    for event in events:  # nbytes > 0 for an allocation, < 0 for a free
        current += event.nbytes()
        peak = max(peak, current)
    del result
    return peak


def peak_extra_bytes(fn: Callable[[], object], device: torch.device) -> int | None:
    """Peak memory `fn()` allocates on top of what is already allocated (what it returns included): CUDA allocator
    statistics on a GPU; on CPU PyTorch's own allocation records (`torch.profiler` memory events)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    if device.type != "cpu":
        return None
    return cpu_peak_bytes(fn)


def random_prompts(vocab_size: int, lengths: list[int], batch: int = 1, seed: int = 0) -> list[torch.Tensor]:
    """Random token ids `(batch, length)` for each of `lengths`, drawn in turn from one generator seeded `seed` (a
    length's prompt depends on the lengths before it, as in a benchmark's rows)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (batch, length), generator=generator) for length in lengths]
