"""Accumulation time of a fit pass's `BlockStatistics` at the paper's map's real shapes (issue 25, item 3).

Side by side in one process, per case (`U` source layers in the pass's union, `T` target layers, each reading `k` of
them; all heads, K and V jointly, float32, `w` = 2,048 features a layer as for Qwen3-0.6B → 1.7B's 8 KV heads × 128):

- `full`: the accumulation as it was before the two exact levers: the same `update`, with `xx += xcᵀ xc` and
  `xy += xcᵀ yc` over the whole union;
- `upper`: `BlockStatistics.update` with every target layer keeping every source layer's cross block (what
  `keep_statistics=True` accumulates): the Gram summed in its upper block triangle only;
- `own`: `BlockStatistics.update` with `target_sources` (what calibration accumulates): the upper triangle and each
  target layer's own `k` cross blocks.

Prints one line a measurement and writes JSON (seconds per update, ms per token, multiply-adds per token, the rate,
and the peak of CPU allocations during one update above the statistics themselves, from the profiler). Random rows:
the cost does not depend on the values. Run it on a quiet machine.

    python scripts/measure_statistics_rate.py --threads 2 --out statistics_rate.json
"""

from __future__ import annotations

import argparse
import time

import torch

from hf_kvbridge.fitting.statistics.blocks import BlockStatistics
from hf_kvbridge.tools.bench.report import write_measurement
from hf_kvbridge.tools.bench.timing import cpu_peak_bytes

HEADS, DIM = 8, 128  # Qwen3-0.6B and -1.7B: row = 8 · 2 · 128 = 2,048
CASES = [(6, 4, 6), (12, 4, 6), (20, 8, 6)]  # (U, T, k)


class _FullProducts(BlockStatistics):
    """The accumulation before the levers: the same `update` (gather, centring, Chan's shift), with the whole
    `xx += xcᵀ xc` and `xy += xcᵀ yc` products over the union."""

    def _add_gram_(self, xc: torch.Tensor, alpha: float = 1.0) -> None:  # xc (G, N, p)
        self.xx.baddbmm_(xc.transpose(1, 2), xc, alpha=alpha)

    def _add_cross_(self, xc: torch.Tensor, yc: torch.Tensor, alpha: float = 1.0) -> None:  # yc (G, N, q)
        self.xy.baddbmm_(xc.transpose(1, 2), yc, alpha=alpha)


def _statistics(variant: str, union: int, targets: int, k: int, heads: int, dim: int) -> BlockStatistics:
    sources = list(range(union))
    reads = {t: sources[(t * k // 2) % (union - k + 1) :][:k] for t in range(targets)} if variant == "own" else None
    kind = _FullProducts if variant == "full" else BlockStatistics
    return kind(union, targets, heads, dim, sources=sources, targets=list(range(targets)), target_sources=reads)


def _time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def measure(
    union: int, targets: int, k: int, tokens: int, repeats: int, heads: int = HEADS, dim: int = DIM
) -> list[dict]:
    """One case's records, one per variant (`own` only where a target reads fewer layers than the union)."""
    w = 2 * heads * dim
    gen = torch.Generator().manual_seed(union * 100 + targets)
    x = torch.randn(tokens, union * w, generator=gen)  # (N, U·w): the union's rows, all source layers given
    y = torch.randn(tokens, targets * w, generator=gen)  # (N, T·w)
    records = []
    for variant in ("full", "upper", "own"):
        if variant == "own" and union == k:
            continue  # every target reads the whole union: the same as "upper"
        stats = _statistics(variant, union, targets, k, heads, dim)
        step = lambda s=stats: s.update(x, y)  # noqa: E731
        peak = cpu_peak_bytes(step)  # also the warm-up: the first touch of the statistics' pages
        seconds = _time(step, repeats)
        gram = union * union if variant == "full" else union * (union + 1) // 2
        cross = (k if variant == "own" else union) * targets
        madds = (gram + cross) * w * w  # multiply-adds per token
        record = {
            "variant": variant,
            "union": union,
            "targets": targets,
            "reads": k if variant == "own" else union,
            "tokens": tokens,
            "seconds_per_update": float(f"{seconds:.4g}"),
            "ms_per_token": float(f"{1e3 * seconds / tokens:.4g}"),
            "multiply_adds_per_token": madds,
            "rate_gmadds_per_s": round(madds * tokens / seconds / 1e9, 1),
            "statistics_bytes": sum(t.numel() * t.element_size() for t in (stats.xx, stats.xy)),
            "update_peak_bytes": peak,
        }
        records.append(record)
        print(
            f"U={union:2d} T={targets:2d} {variant:5s}: {seconds:7.2f} s / {tokens} tokens = "
            f"{record['ms_per_token']:6.2f} ms a token, {madds / 1e9:.2f} G multiply-adds a token, "
            f"{record['rate_gmadds_per_s']:.1f} G/s, peak {peak / 1e6:.0f} MB during the update",
            flush=True,
        )
        del stats
    full = next(r for r in records if r["variant"] == "full")
    for record in records:
        record["time_vs_full"] = round(record["seconds_per_update"] / full["seconds_per_update"], 3)
    return records


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2048, help="rows per update (a batch of windows × tokens)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="statistics_rate.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cases = [r for case in CASES for r in measure(*case, args.tokens, args.repeats)]
    write_measurement(args.out, threads=args.threads, cases=cases)


if __name__ == "__main__":
    main()
