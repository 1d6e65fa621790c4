"""`calibrate`: text → token windows → source/target KV → statistics → layer selection → ridge fit → bridge."""

from __future__ import annotations

import datetime
import logging
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from ..budget import (
    check_budget,
    default_budget,
    format_bytes,
    free_bytes,
    parse_bytes,
    plan_residual,
    rows_bytes,
    smallest_plan_bytes,
)
from ..constants import DEFAULT_CALIBRATION_DATA
from ..data import describe_data, token_windows
from ..errors import StatisticsMemoryError
from ..layout import check_models, hidden_layout, hidden_size, same_head_sources
from ..loading import model_reference, resolve_model_reference
from ..mappers import get_mapper_type
from ..modeling import KVBridgeForCausalLM
from ..settings import CalibrationSettings
from ..source_features import SourceFeatures, source_blocks
from ..statistics.blocks import feature_groups
from ..statistics.dense import KVStatistics
from ..version import __version__
from .budgeted_fit import fit_bridge_in_passes
from .checks import check_tokens, features_per_layer, shared_tokenizer, split_heldout
from .data_pass import collect_statistics
from .dense_fit import fit_bridge
from .refit import refit
from .residual import fit_residual_map, normalize_recompute_layers, residual_collection, with_residual_map

logger = logging.getLogger(__name__)


def _load(
    model: PreTrainedModel | str, revision: str | None, **load_kwargs: Any
) -> tuple[PreTrainedModel, str | None]:
    if isinstance(model, PreTrainedModel):
        return model.eval(), revision or getattr(model.config, "_commit_hash", None)
    loaded = AutoModelForCausalLM.from_pretrained(resolve_model_reference(model), revision=revision, **load_kwargs)
    loaded.config.name_or_path = model
    return loaded.eval(), revision or getattr(loaded.config, "_commit_hash", None)


def calibrate(
    source: PreTrainedModel | str,
    target: PreTrainedModel | str,
    data: Any = DEFAULT_CALIBRATION_DATA,
    settings: CalibrationSettings | None = None,
    *,
    tokenizer=None,
    source_revision: str | None = None,
    target_revision: str | None = None,
    **kwargs: Any,
) -> KVBridgeForCausalLM:
    r"""Calibrates a KV bridge from `source` to `target` on `data` and returns it.

    Args:
        source, target ([`PreTrainedModel`] or `str`): loaded models, or Hub ids / local paths to load.
        data (*optional*, defaults to `"HuggingFaceFW/fineweb-edu"`): a list of strings, a `.txt`/`.jsonl` file or
            folder, a `datasets.Dataset`, or a dataset name (streamed; `"name:config"` picks a config).
        settings ([`CalibrationSettings`], *optional*): every calibration knob (windows, top-k, λ, head mode,
            mapper type, …); defaults to `CalibrationSettings()`.
        tokenizer (*optional*): the shared tokenizer; by default the source's, checked against the target's.
        source_revision, target_revision (`str`, *optional*): revisions of models given by name.
        kwargs: fields of [`CalibrationSettings`] (they override `settings`: `calibrate(s, t, texts, top_k=8)`),
            and otherwise keyword arguments of `from_pretrained` for models given by name (`dtype`, `device_map`).
            `rank=` and `mlp_kwargs=` are accepted as shorthands for `mapper_kwargs`.

    Example:

    ```python
    >>> import hf_kvbridge
    >>> bridge = hf_kvbridge.calibrate("Qwen/Qwen3-14B", "Qwen/Qwen3-32B")  # doctest: +SKIP
    >>> bridge.save_pretrained("qwen3-14b-to-32b")  # doctest: +SKIP
    ```
    """
    overrides = {key: kwargs.pop(key) for key in list(kwargs) if key in CalibrationSettings.field_names()}
    mapper_kwargs = dict(overrides.pop("mapper_kwargs", None) or (settings.mapper_kwargs if settings else {}))
    mapper_kwargs.update(kwargs.pop("mlp_kwargs", None) or {})
    if "rank" in kwargs:
        mapper_kwargs["rank"] = kwargs.pop("rank")
    settings = (settings or CalibrationSettings()).replace(**overrides, mapper_kwargs=mapper_kwargs)  # validates
    load_kwargs = kwargs
    started = time.perf_counter()
    source, source_revision = _load(source, source_revision, **load_kwargs)
    target, target_revision = _load(target, target_revision, **load_kwargs)
    src, tgt = check_models(source, target, source.config.name_or_path, target.config.name_or_path)
    if settings.head_mode == "same_head":  # refuse head counts same_head cannot pair before any work
        names = (source.config.name_or_path, target.config.name_or_path)
        same_head_sources(src.num_kv_heads, tgt.num_kv_heads, *names)
        if settings.bidirectional:
            same_head_sources(tgt.num_kv_heads, src.num_kv_heads, *reversed(names))
    # the memory plan, before any text is read or any forward pass runs
    dtype = getattr(torch, settings.statistics_dtype)
    # richer source features: hidden-state blocks after the K/V blocks, planned and selected like source layers
    features = SourceFeatures.for_models(src, hidden_size(source), settings.hidden_state_layers)
    blocks = source_blocks(features, src.num_layers)
    top_k = settings.top_k or blocks
    # the budget counts one head layout for both sides: the larger one's, so it never plans too little; the Gram
    # blocks kept per layer come from the two real layouts
    heads, dim = max(src.num_kv_heads, tgt.num_kv_heads), max(src.head_dim, tgt.head_dim)
    modes = (settings.head_mode, settings.kv_mode)
    groups = len(feature_groups(src.num_kv_heads, src.head_dim, *modes, tgt.num_kv_heads, tgt.head_dim))
    if settings.statistics_memory is not None:
        budget = parse_bytes(settings.statistics_memory)
    else:  # half the free memory, or the cheapest plan (more passes) when that is more and still fits
        directions = [(blocks, tgt.num_layers)] + [(tgt.num_layers, src.num_layers)] * settings.bidirectional
        smallest = max(smallest_plan_bytes(a, b, heads, dim, top_k, dtype, groups) for a, b in directions)
        reserve = rows_bytes(settings.batch_size * settings.seq_len, blocks, tgt.num_layers, heads * 2 * dim)
        budget = default_budget(free_bytes(settings.statistics_device), smallest, reserve)
    plan = [check_budget(budget, blocks, tgt.num_layers, heads, dim, top_k, dtype, *modes, groups=groups)]
    if settings.bidirectional:
        plan.append(
            check_budget(budget, tgt.num_layers, src.num_layers, heads, dim, top_k, dtype, *modes, groups=groups)
        )
    mode = "dense" if set(plan) == {"dense"} else "blocks"
    # layer recompute: the residual maps' statistics ride along the same passes (`budget.plan_residual`)
    recompute_layers = normalize_recompute_layers(settings.recompute_layers, tgt.num_layers)
    residual_mode, fit_budget = None, budget
    if recompute_layers:
        hidden_layout(hidden_size(source), "source")
        hidden_layout(hidden_size(target), "target")
        mode, residual_mode, fit_budget = plan_residual(
            budget,
            mode,
            blocks,
            tgt.num_layers,
            heads,
            dim,
            top_k,
            dtype,
            groups,
            src.num_layers + 1,
            len(recompute_layers),
            max(hidden_size(source), hidden_size(target)),
        )
    turn_on = settings.recompute_layers if isinstance(settings.recompute_layers, int) else 0
    logger.info(
        "calibration statistics: %s%s (budget %s)",
        mode,
        f", residual maps for recompute_layers {recompute_layers}: {residual_mode}" if recompute_layers else "",
        format_bytes(budget),
    )
    if tokenizer is None:
        tokenizer = shared_tokenizer(source, target)
    windows = token_windows(data, tokenizer, settings.num_sequences, settings.seq_len, text_field=settings.text_field)
    train_ids, heldout_ids = split_heldout(len(windows), settings.heldout_fraction, settings.seed)
    # an unregularised fit from too few tokens is refused here, before any forward pass (the fit warns of a ridge fit
    # from fewer tokens than inputs)
    train_tokens = len(train_ids) * windows.shape[1]
    inputs = min(top_k, blocks) * features_per_layer(src, tgt, *modes)
    check_tokens(train_tokens, inputs, settings.ridge_lambda, warn=False)
    if settings.bidirectional:
        reverse_inputs = min(top_k, tgt.num_layers) * features_per_layer(tgt, src, *modes)
        check_tokens(train_tokens, reverse_inputs, settings.ridge_lambda, warn=False)
    timings: dict = {}
    entry = get_mapper_type(settings.mapper_type)
    references = {
        "source_name_or_path": model_reference(source),
        "source_revision": source_revision,
        "target_name_or_path": model_reference(target),
        "target_revision": target_revision,
    }
    reverse_references = {
        "source_name_or_path": references["target_name_or_path"],
        "source_revision": target_revision,
        "target_name_or_path": references["source_name_or_path"],
        "target_revision": source_revision,
    }
    fit_kwargs = {
        "top_k": settings.top_k,
        "ridge_lambda": settings.ridge_lambda,
        "head_mode": settings.head_mode,
        "hold_back": settings.hold_back,
        "kv_mode": settings.kv_mode,
    }
    provenance = {
        "data": describe_data(data),
        "num_sequences": len(windows),
        "seq_len": settings.seq_len,
        "heldout_sequences": len(heldout_ids),
        "tokens": int(windows.numel()),
        "seed": settings.seed,
        "hf_kvbridge_version": __version__,
        "torch_version": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "statistics": mode,
        "statistics_memory": budget,
    }
    if features is not None:
        provenance["source_features"] = "kv+hidden"
    import transformers

    provenance["transformers_version"] = transformers.__version__
    if mode == "dense":
        residual = (
            residual_collection(KVStatistics, source, target, recompute_layers, settings.statistics_device)
            if recompute_layers
            else None
        )
        stats = collect_statistics(
            source,
            target,
            windows,
            heldout=heldout_ids,
            batch_size=settings.batch_size,
            statistics_device=settings.statistics_device,
            progress=settings.progress,
            reverse=settings.bidirectional,
            checkpoint_dir=settings.checkpoint_dir,
            timings=timings,
            residual=residual,
            features=features,
        )
        statistics, reverse_statistics = stats[:2], stats[2:] or None
        bridge = fit_bridge(
            source,
            target,
            *statistics,
            **fit_kwargs,
            config_kwargs={**references, "calibration": provenance},
            features=features,
        )
        if residual is not None:
            fitted = fit_residual_map(
                *residual.parts,
                recompute_layers,
                hidden_size(source),
                hidden_size(target),
                top_k=settings.top_k,
                ridge_lambda=settings.ridge_lambda,
            )
            bridge = with_residual_map(bridge, fitted)
            del residual
        if settings.bidirectional:
            reverse = fit_bridge(
                target,
                source,
                *reverse_statistics,
                **fit_kwargs,
                config_kwargs={**reverse_references, "calibration": dict(provenance)},
            )
    else:
        passes = {
            "windows": windows,
            "heldout": heldout_ids,
            "statistics_memory": budget,
            "statistics_dtype": dtype,
            "batch_size": settings.batch_size,
            "statistics_device": settings.statistics_device,
            "progress": settings.progress,
            "timings": timings,
            **fit_kwargs,
        }
        want = settings.keep_statistics or entry.fit is not None
        checkpoint = settings.checkpoint_dir
        bridge, statistics = fit_bridge_in_passes(
            source,
            target,
            **{**passes, "statistics_memory": fit_budget},
            checkpoint_dir=checkpoint,
            keep_statistics=want,
            config_kwargs={**references, "calibration": provenance},
            residual=(recompute_layers, residual_mode) if recompute_layers else None,
            features=features,
        )
        if settings.bidirectional:
            reverse, reverse_statistics = fit_bridge_in_passes(
                target,
                source,
                **passes,
                checkpoint_dir=None if checkpoint is None else Path(checkpoint) / "reverse",
                keep_statistics=settings.keep_statistics,
                config_kwargs={**reverse_references, "calibration": dict(provenance)},
            )
        if entry.fit is not None and statistics is None:
            raise StatisticsMemoryError(
                f"mapper_type {settings.mapper_type!r} starts from the statistics of every target layer at once, but "
                f"statistics_memory={format_bytes(budget)} needed several passes over the data; raise "
                "statistics_memory or use mapper_type='ridge'"
            )
    bridge.config.recompute_layers = turn_on  # one calibrated value is turned on; a list leaves the choice to run time
    for part in [bridge] + ([reverse] if settings.bidirectional else []):
        part.config.calibration["forward_seconds"] = round(timings["forward_seconds"], 2)
        part.config.calibration["statistics_seconds"] = round(timings["statistics_seconds"], 2)
        for key in ("selection_seconds", "lambda_seconds", "solve_seconds"):  # budgeted calibration's split
            if key in timings:
                part.config.calibration[key] = round(timings[key], 2)
        if "fit_passes" in timings:
            part.config.calibration["fit_passes"] = timings["fit_passes"]
    if entry.fit is not None:  # mappers beyond ridge start from the ridge bridge (see `mappers.MAPPER_REGISTRY`)
        bridge = refit(
            bridge,
            settings.mapper_type,
            windows=windows,
            statistics=statistics,
            batch_size=settings.batch_size,
            progress=settings.progress,
            **settings.mapper_kwargs,
        )
    if settings.bidirectional:
        if settings.keep_statistics:
            reverse.calibration_statistics = reverse_statistics
        bridge.reverse = reverse
    bridge.config.calibration["seconds"] = round(time.perf_counter() - started, 2)
    if settings.keep_statistics:
        bridge.calibration_statistics = statistics
    bridge.config.calibration["bidirectional"] = settings.bidirectional
    logger.info(
        "calibrated %s → %s in %.1fs",
        bridge.config.source_name_or_path,
        bridge.config.target_name_or_path,
        bridge.config.calibration["seconds"],
    )
    return bridge
