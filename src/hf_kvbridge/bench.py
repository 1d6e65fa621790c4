"""Latency of the mapper against the target's own prefill of the same context."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of `fn()` over `repeats` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.no_grad()
def mapper_vs_prefill(bridge, input_ids: torch.Tensor, repeats: int = 5, warmup: int = 1) -> dict:
    """Times, for the same context: the target's re-prefill (its transformer body, without the LM head, as the
    paper times it), the mapper (map + cache build, the source cache already existing), and the source prefill.

    Returns:
        `dict` with seconds for each and the warm (`prefill / map`) and cold (`prefill / (source + map)`) speedups.
    """
    device = bridge.target.device
    ids_t, ids_s = input_ids.to(device), input_ids.to(bridge.source.device)
    source_cache = bridge.source.model(input_ids=ids_s, use_cache=True).cache
    target_s = median_seconds(lambda: bridge.target.model(input_ids=ids_t, use_cache=True), device, repeats, warmup)
    map_s = median_seconds(lambda: bridge.map_cache(source_cache), device, repeats, warmup)
    source_s = median_seconds(lambda: bridge.source.model(input_ids=ids_s, use_cache=True), device, repeats, warmup)
    return {
        "context_tokens": int(input_ids.shape[1]),
        "batch": int(input_ids.shape[0]),
        "target_prefill_s": target_s,
        "mapper_s": map_s,
        "source_prefill_s": source_s,
        "warm_speedup": target_s / map_s,
        "cold_speedup": target_s / (source_s + map_s),
        "repeats": repeats,
    }
