"""The budgeted fit: a selection pass, then fit passes of the selected source layers only, as many target layers
a pass as the memory budget allows (`hf_kvbridge.fitting.budget`)."""

from __future__ import annotations

import logging
import os

import torch
from transformers import PreTrainedModel

from ...errors import moved_names
from ...mappers import KVMapper
from ...utils.layout import hidden_size
from ...utils.source_features import SourceFeatures, source_blocks
from ..budget import (
    plan_passes,
)
from ..layer_selection import mapper_r2, select_layers
from ..solve import LAMBDA_GRID, choose_ridge_lambdas
from ..statistics.blocks import BlockStatistics, feature_groups
from ..statistics.dense import KVStatistics
from ..statistics.rows import RowStatistics
from ..statistics.selection import SelectionStatistics
from .checks import allowed_blocks, check_tokens, features_per_layer, pair_heads, pair_layouts
from .data_pass import clock, collect_statistics, distributed_rank
from .dense_fit import BridgeFit, bridge_fit
from .residual import fit_residual_map, residual_collection

logger = logging.getLogger(__name__)


# λ at which the budgeted path's selection statistic scores single source layers when the fit λ is "auto"
SELECTION_LAMBDA = 1e-3


def rows_are_cheaper(
    windows: torch.Tensor,
    heldout: list[int],
    inputs: int,
    sources: int,
    targets: int,
    row: int,
    ridge_lambda: float | str,
    statistics_memory: int,
    dtype: torch.dtype,
) -> bool:
    """Whether a fit pass keeps the rows (`RowStatistics`) instead of their sums: a ridge fit (auto-λ or λ > 0) with
    fewer training tokens than the widest map's `inputs`, whose rows (`sources` source and `targets` target layers
    of `row` features, every token) and one map's float64 kernel solve fit in `statistics_memory`. Then the λ search
    and refit of a map cost `O(n²p)` instead of `O(p³)`, and the rows are smaller than the `p × p` sums."""
    train = (len(windows) - len(set(heldout))) * windows.shape[1]
    if train >= inputs or (ridge_lambda != "auto" and float(ridge_lambda) <= 0):
        return False
    tokens = int(windows.numel())
    kept = RowStatistics.nbytes(tokens, sources, targets, row, row, dtype)
    solve = 8 * (3 * tokens * inputs + 2 * tokens * tokens + 3 * tokens * row)  # float64 rows, kernel, outputs
    return kept + solve <= statistics_memory


def fit_in_passes(
    source: PreTrainedModel,
    target: PreTrainedModel,
    windows: torch.Tensor,
    heldout: list[int],
    *,
    statistics_memory: int,
    top_k: int | None = 6,
    ridge_lambda: float | str = "auto",
    head_mode: str = "all_heads",
    hold_back: int = 1,
    statistics_dtype: torch.dtype = torch.float32,
    batch_size: int = 8,
    statistics_device: torch.device | str | None = None,
    progress: bool = False,
    checkpoint_dir: str | os.PathLike | None = None,
    timings: dict | None = None,
    config_kwargs: dict | None = None,
    keep_statistics: bool = False,
    kv_mode: str = "joint",
    residual: tuple[list[int], str] | None = None,
    features: SourceFeatures | None = None,
    layouts: tuple | None = None,
) -> tuple[BridgeFit, tuple | None]:
    """Calibration on a memory budget (see `hf_kvbridge.fitting.budget`): a selection pass over `windows` picks the
    top-k source layers of each target layer from [`SelectionStatistics`], then fit passes accumulate
    [`BlockStatistics`] of the selected source layers only, for as many target layers per pass as
    `statistics_memory` allows, and solve them. A ridge fit from fewer training tokens than map inputs keeps the rows
    themselves instead ([`RowStatistics`], one fit pass, when they fit the budget; `rows_are_cheaper`): the same maps
    from `n × n` kernels instead of `p × p` sums.

    Args:
        timings (`dict`, *optional*): besides `collect_statistics`' `forward_seconds` and `statistics_seconds`,
            `selection_statistics_seconds` (the selection pass's share of `statistics_seconds`),
            `selection_seconds` (scoring the source layers), `lambda_seconds` (the held-out λ search, or the
            held-out R² at a fixed λ), `solve_seconds` (the final fits), `fit_passes` and `row_statistics` (whether
            the fit pass kept the rows) are added to it.
        keep_statistics (`bool`, *optional*, defaults to `False`): return the `(train, held-out)` statistics when one
            pass held every target layer (a copy more while fitting). Kept statistics hold every target layer's
            cross blocks with the pass's whole union of source layers, for re-fits with another selection; else each
            target layer's with its own selected source layers only (fewer bytes and multiply-adds a pass).
        residual (`tuple[list[int], str]`, *optional*): `(recompute_layers, mode)`: also fit the residual maps of
            layer recompute for those values (`hf_kvbridge.transfer.layer_recompute`), from the same passes: dense
            statistics in the selection pass (`mode="dense"`), or selection statistics there and the block statistics
            of the selected source hidden states in the first fit pass (`"blocks"`; `budget.plan_residual` plans both).
            The returned fit holds them (`residual_mapper`, `config.residual_map`).
        features ([`SourceFeatures`], *optional*): hidden-state feature blocks beside the K/V blocks (see
            `fit_bridge`), accumulated in every pass like any source layer.
        layouts (`tuple[KVLayout, KVLayout]`, *optional*): the two models' layouts, checked already
            (`checks.pair_layouts`); checked here otherwise.

    Returns:
        `(fit, statistics)`: the [`BridgeFit`] (`calibrate.fit_bridge_in_passes` builds its bridge), and
        `statistics`, `(train, held-out)` [`BlockStatistics`] or `None`.
    """
    src, tgt = layouts or pair_layouts(source, target)
    heads, dim, target_heads = pair_heads(src, tgt)
    blocks = source_blocks(features, src.num_layers)
    shape = (blocks, tgt.num_layers, heads, dim)
    # the memory plan counts one row size for both sides: the larger one, so it never plans too little
    row = max(src.features_per_layer, tgt.features_per_layer)
    timings = {} if timings is None else timings
    common = {
        "heldout": heldout,
        "batch_size": batch_size,
        "statistics_device": statistics_device,
        "progress": progress,
        "checkpoint_dir": checkpoint_dir,
        "timings": timings,
        "features": features,
        "layouts": (src, tgt),
    }
    # the token count against the widest map, before any forward pass
    widest = min(top_k or blocks, blocks) * features_per_layer(src, tgt, head_mode, kv_mode)
    check_tokens((len(windows) - len(heldout)) * windows.shape[1], widest, ridge_lambda)
    residual_layers, residual_mode = residual if residual else ([], None)
    residual_kind = KVStatistics if residual_mode == "dense" else SelectionStatistics
    collection = (
        residual_collection(residual_kind, source, target, residual_layers, statistics_device, statistics_dtype)
        if residual_layers
        else None
    )
    before = timings.get("statistics_seconds", 0.0)
    train, held = collect_statistics(
        source,
        target,
        windows,
        make_parts=lambda: [
            SelectionStatistics(*shape, statistics_dtype, statistics_device, **target_heads) for _ in range(2)
        ],
        checkpoint_tag="selection",
        residual=collection,
        **common,
    )
    timings["selection_statistics_seconds"] = (
        timings.get("selection_statistics_seconds", 0.0) + timings.get("statistics_seconds", 0.0) - before
    )
    # selection scores each source layer at one λ (the smallest of the auto grid's typical choices for "auto")
    selection_lambda = SELECTION_LAMBDA if ridge_lambda == "auto" else ridge_lambda
    started = clock()
    r2 = train.single_layer_r2(held, selection_lambda)  # (L_t, L_s, 2)
    timings["selection_seconds"] = timings.get("selection_seconds", 0.0) + clock() - started
    del train, held
    residual_fit = residual_fit_parts = None
    residual_shape = (residual_layers, hidden_size(source), hidden_size(target))
    if collection is not None and residual_mode == "dense":  # fitted from the selection pass's dense statistics
        residual_fit = fit_residual_map(*collection.parts, *residual_shape, top_k=top_k, ridge_lambda=ridge_lambda)
    elif collection is not None:  # selected now, fitted from block statistics that ride on the first fit pass
        residual_r2 = collection.parts[0].single_layer_r2(collection.parts[1], selection_lambda)  # (N, L_s + 1, 2)
        residual_selected = select_layers(residual_r2, top_k)
        residual_fit_parts = residual_collection(
            BlockStatistics,
            source,
            target,
            residual_layers,
            statistics_device,
            statistics_dtype,
            sources=sorted(set().union(*residual_selected)),
        )
    del collection
    selected = select_layers(r2, top_k, allowed_blocks(src, tgt, features))
    groups = len(feature_groups(src.num_kv_heads, src.head_dim, head_mode, kv_mode, tgt.num_kv_heads, tgt.head_dim))
    # each target layer's cross blocks with its own source layers only, unless the statistics are kept for re-fits
    own_cross = not keep_statistics
    inputs = max(map(len, selected)) * features_per_layer(src, tgt, head_mode, kv_mode)
    rank, world = distributed_rank()
    simple = not (keep_statistics or residual_layers or features is not None or checkpoint_dir is not None)
    use_rows = simple and world == 1 and rows_are_cheaper(
        windows, heldout, inputs, len(set().union(*selected)), tgt.num_layers, row, ridge_lambda, statistics_memory,
        statistics_dtype,
    )  # fmt: skip
    if use_rows:  # fewer training tokens than map inputs: one pass keeps the rows (`RowStatistics`)
        passes = [list(range(tgt.num_layers))]
    else:
        passes = plan_passes(selected, row, statistics_memory, statistics_dtype, groups, own_cross)
    timings["fit_passes"] = timings.get("fit_passes", 0) + len(passes)
    timings["row_statistics"] = use_rows
    logger.info(
        "fitting %d target layers in %d pass(es) over the data%s",
        tgt.num_layers,
        len(passes),
        " from the rows themselves (fewer training tokens than map inputs)" if use_rows else "",
    )
    mapper = KVMapper(selected, heads, dim, head_mode, kv_mode=kv_mode, **target_heads)
    fitted_r2 = torch.zeros(tgt.num_layers, 2, dtype=torch.float64)
    chosen_lambdas = {"k": [[] for _ in selected], "v": [[] for _ in selected]}
    statistics = None
    # under torch.distributed each rank accumulates (and solves) its own pass of a round of `world` passes, from the
    # rows of every rank's batches: the fit statistics are split by target layer, the forward passes by data
    owner = {}
    for start in range(0, len(passes), world):
        mine = start + rank
        targets = passes[mine] if mine < len(passes) else []
        union = sorted(set().union(*(selected[t] for t in targets))) if targets else []

        def make_parts(union=union, targets=targets):
            if use_rows:
                return [
                    RowStatistics(*shape, union, targets, statistics_dtype, statistics_device, **target_heads)
                    for _ in range(2)
                ]
            return [
                BlockStatistics(
                    *shape,
                    union,
                    targets,
                    statistics_dtype,
                    statistics_device,
                    head_mode=head_mode,
                    kv_mode=kv_mode,
                    **target_heads,
                    target_sources={t: selected[t] for t in targets} if own_cross else None,
                )
                for _ in range(2)
            ]

        train, held = collect_statistics(
            source,
            target,
            windows,
            make_parts=make_parts,
            checkpoint_tag=f"fit-{start // world}",
            gather_rows=True,
            residual=residual_fit_parts if start == 0 else None,
            **common,
        )
        if start == 0 and residual_fit_parts is not None:  # every rank holds them (all-reduced): fit them now
            residual_fit = fit_residual_map(
                *residual_fit_parts.parts,
                *residual_shape,
                top_k=top_k,
                ridge_lambda=ridge_lambda,
                selected_layers=residual_selected,
                layer_r2=residual_r2,
            )
            residual_fit_parts = None
        for i in range(start, min(start + world, len(passes))):
            owner.update(dict.fromkeys(passes[i], i - start))
        if not targets:
            continue
        check_tokens(train.count, inputs, ridge_lambda, warn=False)  # warned before the selection pass
        lam = ridge_lambda
        started = clock()
        if ridge_lambda == "auto":  # λ per layer, head group and K/V of this pass's target layers
            lam, pass_r2 = choose_ridge_lambdas(
                train,
                held,
                selected,
                head_mode,
                tgt.num_kv_heads,
                tgt.head_dim,
                LAMBDA_GRID,
                targets=targets,
                kv_mode=kv_mode,
            )  # pass_r2: held-out R² at the chosen λ, 0 outside this pass
            for kind in ("k", "v"):
                for t in targets:
                    chosen_lambdas[kind][t] = lam[kind][t]
        else:
            pass_r2 = mapper_r2(train, held, selected, head_mode, lam, targets, kv_mode)
        fitted_r2 += pass_r2
        timings["lambda_seconds"] = timings.get("lambda_seconds", 0.0) + clock() - started
        started = clock()
        if keep_statistics and len(passes) == 1:
            statistics = (train, held)
            mapper.fit_targets(train + held, targets, lam)  # the final fit sees every token
        else:
            mapper.fit_targets(train.merge_(held), targets, lam)  # merged in place: no third copy
        timings["solve_seconds"] = timings.get("solve_seconds", 0.0) + clock() - started
        del train, held
    if world > 1:  # every rank ends with every target layer's weights
        import torch.distributed as dist

        for t, layer_map in enumerate(mapper.layers):
            for tensor in (layer_map.weight.data, layer_map.bias.data, fitted_r2[t]):
                dist.broadcast(tensor, src=owner[t])
    if ridge_lambda == "auto" and world > 1:  # every rank ends with every target layer's λ
        import torch.distributed as dist

        gathered = [None] * world
        dist.all_gather_object(gathered, chosen_lambdas)
        for kind in ("k", "v"):
            for t in range(tgt.num_layers):
                chosen_lambdas[kind][t] = gathered[owner[t]][kind][t]
    ridge_lambdas = chosen_lambdas if ridge_lambda == "auto" else None
    fit = (top_k, ridge_lambda, ridge_lambdas, head_mode, hold_back)
    fitted = bridge_fit(source, target, mapper, r2, fitted_r2, fit, config_kwargs, (src, tgt), features)
    if residual_fit is not None:
        fitted = fitted.with_residual(residual_fit)
    return fitted, statistics


# `fit_bridge_in_passes` (the bridge built from `fit_in_passes`) moved up to `calibrate`
__getattr__ = moved_names(__name__, ("fit_bridge_in_passes",), "hf_kvbridge.fitting.calibration.calibrate")
