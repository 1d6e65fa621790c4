"""The memory plan of calibration: how many bytes the statistics need, and which target layers each pass holds.

Dense statistics (`KVStatistics`: every source layer against every target layer) are exact and need one pass over the
data, but grow with `L_s·L_t·(H·2d)²`. When they do not fit `statistics_memory`, calibration runs

1. one *selection pass* accumulating [`SelectionStatistics`] (per head and K/V blocks, train + held-out), which picks
   the top-k source layers of every target layer, then
2. one or more *fit passes*, each accumulating [`BlockStatistics`] (train + held-out) for a group of consecutive
   target layers that fits the budget: the Gram matrix of the union of their selected source layers, shared by the
   group, and their cross blocks.

Memory model (numbers, times 4 bytes in float32; `row = H·2d`, `U` source layers in a group of `T` target layers):

    dense        2 · (F² + F·G)                         F = L_s·row, G = L_t·row   (float64: times 8 bytes)
    selection    2 · H·2·L_s·d·(d + L_t·d)  (+ the same again in float64 while scoring)
    fit pass     2 · ((U·row)² + U·row·T·row) / G       at least U = k, T = 1; G feature groups (1 all heads and
                                                        joint, H same_head, 2 separate, 2H same_head + separate)
                 + 8 · (max(3p² + p·w, 2p² + 4p·w) + 512·p) bytes  solving one map of p = k·w inputs, w = row/G
                                                        (float64; see `solve_bytes`)

Every figure is per rank: under `torch.distributed` each rank holds the statistics of the pass it accumulates.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..errors import StatisticsMemoryError, renamed_name
from ..utils.sizes import format_bytes, parse_bytes
from .statistics.blocks import BlockStatistics, feature_groups
from .statistics.selection import SelectionStatistics

logger = logging.getLogger(__name__)


def free_bytes(device: torch.device | str | None = None) -> int:
    """Memory free on the statistics device now: the CPU's available RAM (`MemAvailable`), or a GPU's free memory."""
    device = torch.device(device or "cpu")
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_bytes(device: torch.device | str | None = None) -> int:
    """Memory the statistics may take by default: half of what is free on the statistics device (the CPU's available
    RAM, or a GPU's free memory), leaving room for the models, their activations and the rows of a batch."""
    return free_bytes(device) // 2


def rows_bytes(tokens: int, source_layers: int, target_layers: int, row: int) -> int:
    """Bytes of one batch's cache rows of both models in float32 (`cache_rows`: `tokens × layers·row` each), counted
    twice: the per-layer pieces and the joined rows are alive together while a batch is read."""
    return 2 * tokens * (source_layers + target_layers) * row * 4


class FitShape(NamedTuple):
    """The sizes a calibration's memory plan reads (`check_budget`, `plan_residual`, `statistics_budget`).

    Args:
        source_layers (`int`), target_layers (`int`): the layers (source: and hidden-state blocks) mapped from and to.
        num_kv_heads (`int`), head_dim (`int`): one head layout for both sides (the larger one's, so the plan never
            plans too little).
        top_k (`int`): the fit's source layers per target layer.
        dtype (`torch.dtype`): the statistics' dtype.
        groups (`int`, *optional*): Gram blocks kept per layer (`feature_groups` of the real layouts); `None`: those
            of the head and kv modes `check_budget` is given (1 for all heads, joint).

    Example:

    ```python
    >>> shape = FitShape(28, 28, num_kv_heads=8, head_dim=128, top_k=6, dtype=torch.float32)
    >>> check_budget(16 * 10**9, shape)
    'blocks'
    ```
    """

    source_layers: int
    target_layers: int
    num_kv_heads: int
    head_dim: int
    top_k: int
    dtype: torch.dtype
    groups: int | None = None

    @property
    def row(self) -> int:
        """Features of one layer's K/V row, `H·2d`."""
        return self.num_kv_heads * 2 * self.head_dim

    def reversed(self) -> FitShape:
        """The same shape mapping target layers to source layers (a bidirectional calibration's reverse map)."""
        return self._replace(source_layers=self.target_layers, target_layers=self.source_layers)

    def selection_bytes(self) -> int:
        """`selection_bytes` of this shape."""
        return selection_bytes(self.source_layers, self.target_layers, self.num_kv_heads, self.head_dim, self.dtype)

    def smallest_fit_bytes(self) -> int:
        """`fit_bytes` of one pass holding a single target layer and its `top_k` source layers."""
        return fit_bytes(min(self.top_k, self.source_layers), 1, self.row, self.dtype, self.groups or 1)


def smallest_plan_bytes(shape: FitShape) -> int:
    """Bytes the cheapest plan needs at its peak: the selection pass's statistics, or one fit pass holding a single
    target layer's statistics and the solve of one map, whichever is larger (more passes cannot lower it)."""
    return max(shape.selection_bytes(), shape.smallest_fit_bytes())


def default_budget(free: int, smallest: int, reserve: int) -> int:
    """The statistics budget when `statistics_memory` is not given: half of the `free` bytes (`available_bytes`), or,
    when the cheapest plan needs more than that but still fits beside `reserve` (the rows of a batch,
    `rows_bytes`), exactly the cheapest plan's `smallest` bytes, so calibration takes more passes over the data
    instead of refusing. When not even that fits, half of `free` (`check_budget` then refuses, naming the bytes).

    Example:

    ```python
    >>> default_budget(free=16 * 10**9, smallest=5 * 10**9, reserve=10**9)  # half of the free memory is enough
    8000000000
    >>> default_budget(free=8 * 10**9, smallest=5 * 10**9, reserve=10**9)  # more passes rather than an error
    5000000000
    ```
    """
    half = free // 2
    if smallest <= half or smallest + reserve > free:
        return half
    return smallest


def dense_bytes(source_layers: int, target_layers: int, row: int) -> int:
    """Bytes of dense calibration: train + held-out `KVStatistics` in float64 and the merged copy the fit makes."""
    f, g = source_layers * row, target_layers * row
    return 3 * (f * f + f * g + 2 * f + 2 * g) * 8


def selection_bytes(source_layers: int, target_layers: int, num_kv_heads: int, head_dim: int, dtype) -> int:
    """Bytes of the selection pass: train + held-out [`SelectionStatistics`] and the float64 weights of scoring."""
    one = SelectionStatistics.nbytes(source_layers, target_layers, num_kv_heads, head_dim, dtype)
    scoring = 5 * source_layers * head_dim * target_layers * head_dim * 8  # float64 of one (head, K/V) block at a time
    return 2 * one + scoring


def solve_bytes(top_k: int, width: int) -> int:
    """Peak bytes of solving one map of `top_k` source layers' `width` features each (`row` / groups) for one
    target layer, `p = top_k·width` inputs and `width` outputs, in float64 (`hf_kvbridge.fitting.solve`):

    - the λ search's eigendecomposition: the eigenvectors (written over the standardized Gram block) and LAPACK's
      `2·p²` workspace, beside one `p × width` cross block: `3p² + p·w` numbers (reading the held-out moments after
      it, with the eigenvectors alive, takes as much: their float64 copy and its scaled copy);
    - the refit on train + held-out: the Gram block, its Cholesky factor and four `p × width` blocks (cross block,
      weights, the triangular solves' right-hand side and result): `2p² + 4p·w` (the λ path in between,
      `p² + 4p·w`, is never above it);
    - `512·p` for the linear algebra's blocked workspaces besides (measured: about `p × 150…400`).

    Measured by `scripts/measure_solve_memory.py` (peak resident memory above the statistics) and checked in
    `tests/fitting/test_budget.py`.
    """
    p = top_k * width
    return 8 * (max(3 * p * p + p * width, 2 * p * p + 4 * p * width) + 512 * p)


def fit_bytes(
    sources: int,
    targets: int,
    row: int,
    dtype,
    groups: int = 1,
    top_k: int | None = None,
    reads: int | None = None,
) -> int:
    """Bytes of one fit pass over `sources` (union) and `targets` layers: train + held-out [`BlockStatistics`] kept
    in `groups` feature groups, with the cross blocks of `reads` source layers per target layer (default: all
    `sources`; calibration keeps each target layer's own `top_k`), plus the transient of solving one map of `top_k`
    (default: `sources`) layers."""
    width = row // groups
    statistics = BlockStatistics.nbytes(sources, targets, row, dtype, groups, reads=reads)
    return 2 * statistics + solve_bytes(top_k or sources, width)


def check_budget(budget: int, shape: FitShape, head_mode: str = "all_heads", kv_mode: str = "joint") -> str:
    """Which calibration of `shape` fits `budget` bytes: `"dense"` or `"blocks"`; raises `StatisticsMemoryError`
    (naming bytes needed, bytes available and what to change) when not even the smallest block plan fits. Runs
    before any work. `head_mode`, `kv_mode`: the maps fitted (the Gram blocks kept per layer when `shape.groups` is
    `None`, see `hf_kvbridge.fitting.statistics.blocks.feature_groups`; they name what to change in a refusal)."""
    source_layers, target_layers, num_kv_heads, head_dim, top_k, dtype, groups = shape
    row = shape.row
    if groups is None:
        shape = shape._replace(groups=len(feature_groups(num_kv_heads, head_dim, head_mode, kv_mode)))
        groups = shape.groups
    if dense_bytes(source_layers, target_layers, row) <= budget:
        return "dense"
    selection = shape.selection_bytes()
    k = min(top_k, source_layers)
    smallest = shape.smallest_fit_bytes()
    dtype_name = str(dtype).replace("torch.", "")
    if selection > budget:
        raise StatisticsMemoryError(
            f"layer selection statistics need {format_bytes(selection)} ({source_layers} source × {target_layers} "
            f"target layers, {num_kv_heads} KV heads × {head_dim}, train + held-out, {dtype_name}) but "
            f"statistics_memory allows {format_bytes(budget)}; raise statistics_memory"
            + (" or use statistics_dtype='float32'" if dtype == torch.float64 else "")
        )
    if smallest > budget:
        fits = [j for j in range(1, k) if fit_bytes(j, 1, row, dtype, groups) <= budget]
        hint = f", or use top_k ≤ {fits[-1]}" if fits else ""
        if groups < num_kv_heads * 2:
            hint += ", or head_mode='same_head' / kv_mode='separate' (smaller Gram blocks)"
        if dtype == torch.float64:
            hint += ", or statistics_dtype='float32'"
        solve = solve_bytes(k, row // groups)
        raise StatisticsMemoryError(
            f"fitting one target layer from top_k={k} source layers needs {format_bytes(smallest)}: statistics "
            f"{format_bytes(smallest - solve)} (train + held-out, {dtype_name}) and {format_bytes(solve)} to solve a "
            f"map of {k}·{row // groups} input features (float64), but statistics_memory allows "
            f"{format_bytes(budget)}; raise statistics_memory{hint}"
        )
    return "blocks"


def plan_passes(
    selected_layers: list[list[int]], row: int, budget: int, dtype, groups: int = 1, own_cross: bool = True
) -> list[list[int]]:
    """Groups target layers into fit passes: consecutive target layers (which select similar source layers, so their
    union stays small) join a pass while its train + held-out [`BlockStatistics`] (kept in `groups` feature groups,
    see `hf_kvbridge.fitting.statistics.blocks.feature_groups`) and the solve of one map fit `budget` bytes.

    `own_cross` (the default) plans each target layer's cross blocks with its own selected source layers only
    (`BlockStatistics(..., target_sources=...)`); `False` plans them with the pass's whole union, which statistics
    kept for re-fits with another selection need.

    Returns:
        `list[list[int]]`: the target layers of each pass.
    """
    top_k = max(map(len, selected_layers))

    def need(sources, targets):
        return fit_bytes(sources, targets, row, dtype, groups, top_k, top_k if own_cross else None)

    passes: list[list[int]] = []
    union: set[int] = set()
    for t, layers in enumerate(selected_layers):
        grown = union | set(layers)
        if passes and need(len(grown), len(passes[-1]) + 1) <= budget:
            passes[-1].append(t)
            union = grown
        else:
            if need(len(layers), 1) > budget:
                raise StatisticsMemoryError(
                    f"target layer {t} needs {format_bytes(need(len(layers), 1))} (train + held-out statistics of "
                    f"its {len(layers)} source layers and the float64 solve of one map) but statistics_memory allows "
                    f"{format_bytes(budget)}; raise statistics_memory or lower top_k"
                )
            passes.append([t])
            union = set(layers)
    return passes


def plan_residual(
    budget: int, kv_plan: str, shape: FitShape, source_states: int, residual_targets: int, hidden: int
) -> tuple[str, str, int]:
    """The memory plan of K/V statistics of `shape` with the residual statistics of layer recompute
    (`hf_kvbridge.transfer.layer_recompute`) beside them: `(kv_mode, residual_mode, kv_fit_budget)`.

    The residual block is `source_states` source hidden states against `residual_targets` target hidden states of
    `hidden` features (the larger hidden size), planned like a K/V block of one head of `hidden / 2`:

    - both dense in one pass when the K/V statistics are dense (`kv_plan`) and both fit the budget together;
    - otherwise the K/V statistics go by blocks, and the residual statistics are dense in the selection pass when
      they fit beside the K/V selection statistics; else they go by blocks too: a [`SelectionStatistics`] beside the
      K/V one, then the [`BlockStatistics`] of their selected source states in the first fit pass, whose bytes are
      taken from the K/V fit passes' budget (`kv_fit_budget`).

    Raises `StatisticsMemoryError` (bytes needed, bytes allowed, what to change) when no plan fits.
    """
    top_k, dtype = shape.top_k, shape.dtype
    residual_dense = dense_bytes(source_states, residual_targets, hidden)
    kv_dense = dense_bytes(shape.source_layers, shape.target_layers, shape.row)
    if kv_plan == "dense" and kv_dense + residual_dense <= budget:
        return "dense", "dense", budget
    kv_selection = shape.selection_bytes()
    kv_smallest = shape.smallest_fit_bytes()
    if kv_selection + residual_dense <= budget and kv_smallest <= budget:
        return "blocks", "dense", budget
    residual_selection = selection_bytes(source_states, residual_targets, 1, hidden // 2, dtype)
    residual_fit = fit_bytes(min(top_k, source_states), residual_targets, hidden, dtype, 1)
    needed = max(kv_selection + residual_selection, kv_smallest + residual_fit)
    if needed > budget:
        raise StatisticsMemoryError(
            f"layer recompute's residual statistics ({source_states} source hidden states × {residual_targets} "
            f"target ones of {hidden} features) need {format_bytes(max(residual_selection, residual_fit))} beside "
            f"the K/V statistics: {format_bytes(needed)} in all, but statistics_memory allows {format_bytes(budget)}; "
            "raise statistics_memory, lower top_k, or calibrate fewer recompute_layers values"
        )
    return "blocks", "blocks", budget - residual_fit


@dataclass(frozen=True)
class StatisticsBudget:
    """How a calibration keeps its statistics (`statistics_budget`).

    Args:
        budget (`int`): bytes the statistics may take.
        mode (`str`): `"dense"` (one pass, dense statistics) or `"blocks"` (a selection pass, then fit passes).
        residual_mode (`str`, *optional*): how the residual maps of layer recompute ride along (`plan_residual`);
            `None` without layer recompute.
        fit_budget (`int`): bytes the K/V fit passes may take (the budget less the residual fit's share).
    """

    budget: int
    mode: str
    residual_mode: str | None
    fit_budget: int


def statistics_budget(
    shape: FitShape,
    *,
    statistics_memory: int | str | None,
    statistics_device,
    batch_tokens: int,
    blocks: int,
    head_mode: str = "all_heads",
    kv_mode: str = "joint",
    bidirectional: bool = False,
    residual: tuple[int, int, int] | None = None,
) -> StatisticsBudget:
    """The memory plan of a calibration, before any text is read or any forward pass runs.

    The budget is `statistics_memory`, or half the free memory of `statistics_device` (the cheapest plan's bytes
    when that is more and still fits, `default_budget`); the statistics go dense when every direction fits it
    (`check_budget`), else by blocks; layer recompute's residual statistics ride along (`plan_residual`).

    Args:
        shape ([`FitShape`]): the two depths (`source_layers` of the models, without hidden-state blocks: the
            reverse direction of a `bidirectional` calibration maps target layers to source layers), the head
            layout, `top_k`, the statistics' dtype and `groups` (set: the Gram blocks of the real layouts).
        statistics_memory (`int` or `str`, *optional*): the budget asked for (`"16GB"`).
        statistics_device: where the statistics live (its free memory sets the default budget).
        batch_tokens (`int`): tokens of one batch (the rows held while it is summed).
        blocks (`int`): source blocks (source layers, and hidden-state feature blocks) of the forward map.
        head_mode (`str`), kv_mode (`str`): the maps fitted (they name what to change in a refusal).
        residual (`tuple[int, int, int]`, *optional*): `(source hidden states, recompute_layers values, hidden
            features)` of layer recompute's residual maps.

    Raises `StatisticsMemoryError` (what is needed, what is allowed, what to change) when no plan fits.
    """
    forward = shape._replace(source_layers=blocks)
    directions = [forward] + [shape.reversed()] * bidirectional
    if statistics_memory is not None:
        budget = parse_bytes(statistics_memory)
    else:  # half the free memory, or the cheapest plan (more passes) when that is more and still fits
        smallest = max(smallest_plan_bytes(direction) for direction in directions)
        reserve = rows_bytes(batch_tokens, blocks, shape.target_layers, shape.row)
        budget = default_budget(free_bytes(statistics_device), smallest, reserve)
    plan = [check_budget(budget, direction, head_mode, kv_mode) for direction in directions]
    mode = "dense" if set(plan) == {"dense"} else "blocks"
    if residual is None:
        return StatisticsBudget(budget, mode, None, budget)
    mode, residual_mode, fit_budget = plan_residual(budget, mode, forward, *residual)
    return StatisticsBudget(budget, mode, residual_mode, fit_budget)


def __getattr__(name: str):  # the old names, for one release (CHANGELOG.md)
    return renamed_name(__name__, name, {"CalibrationPlan": StatisticsBudget, "plan_calibration": statistics_budget})
