"""`calibrate`: text → token windows → source/target KV → statistics → layer selection → ridge fit → bridge.

The one place of the fitting side that builds a [`KVBridgeForCausalLM`]: the fits below return [`BridgeFit`]s
(mapper, config, R²) and `build_bridge` turns one into a bridge; `fit_bridge`, `fit_bridge_in_passes` and
`assemble_bridge` are the fits with their bridge built.
"""

from __future__ import annotations

import datetime
import logging
import time
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from ...constants import DEFAULT_CALIBRATION_DATA
from ...errors import ConfigurationError, StatisticsMemoryError
from ...loading import load_model, model_reference
from ...mappers import get_mapper_type
from ...modeling import KVBridgeForCausalLM
from ...settings import CalibrationSettings, recompute_layer_values
from ...utils.heads import same_head_sources
from ...utils.key_norm import key_norm_gains, with_key_norm
from ...utils.layout import check_models, hidden_layout, hidden_size
from ...utils.sizes import format_bytes
from ...utils.source_features import SourceFeatures, source_blocks
from ...version import __version__
from ..budget import FitShape, statistics_budget
from ..data import describe_data, token_windows
from ..mapper_fits import fit_of, refit
from ..statistics.blocks import feature_groups
from ..statistics.dense import KVStatistics
from .budgeted_fit import fit_in_passes
from .checks import check_tokens, features_per_layer, shared_tokenizer, split_heldout
from .data_pass import collect_statistics
from .dense_fit import BridgeFit, bridge_fit, fit_dense
from .residual import fit_residual_map, residual_collection

logger = logging.getLogger(__name__)


def build_bridge(fit: BridgeFit, source: PreTrainedModel, target: PreTrainedModel) -> KVBridgeForCausalLM:
    """The bridge of `fit` over `source` and `target` (its single-layer R² matrix kept as `layer_r2`)."""
    return fit.build(KVBridgeForCausalLM, source, target)


def fit_bridge(
    source: PreTrainedModel, target: PreTrainedModel, train: KVStatistics, heldout: KVStatistics, **kwargs: Any
) -> KVBridgeForCausalLM:
    """The bridge of `dense_fit.fit_dense(source, target, train, heldout, **kwargs)`: layers selected on held-out
    statistics, λ chosen, the ridge mapper fitted on all of them.

    Example:

    ```python
    >>> bridge = fit_bridge(source, target, train, heldout, top_k=2)  # doctest: +SKIP
    ```
    """
    return build_bridge(fit_dense(source, target, train, heldout, **kwargs), source, target)


def fit_bridge_in_passes(
    source: PreTrainedModel, target: PreTrainedModel, windows: torch.Tensor, heldout: list[int], **kwargs: Any
) -> tuple[KVBridgeForCausalLM, tuple | None]:
    """`(bridge, statistics)` of `budgeted_fit.fit_in_passes(source, target, windows, heldout, **kwargs)`: the
    calibration on a memory budget, its bridge built."""
    fit, statistics = fit_in_passes(source, target, windows, heldout, **kwargs)
    return build_bridge(fit, source, target), statistics


def assemble_bridge(
    source, target, mapper, r2, fitted_r2, fit: tuple, config_kwargs=None, layouts=None, features=None
) -> KVBridgeForCausalLM:
    """The bridge of a fitted `mapper` (`dense_fit.bridge_fit`: its config records `r2`, `fitted_r2` and `fit`)."""
    fitted = bridge_fit(source, target, mapper, r2, fitted_r2, fit, config_kwargs, layouts, features)
    return build_bridge(fitted, source, target)


def _load(
    model: PreTrainedModel | str, revision: str | None, **load_kwargs: Any
) -> tuple[PreTrainedModel, str | None]:
    """`model` itself, or loaded from its reference (`loading.load_model`) and named by it, with its revision."""
    if not isinstance(model, PreTrainedModel):
        reference, model = model, load_model(model, revision, **load_kwargs)
        model.config.name_or_path = reference
    return model.eval(), revision or getattr(model.config, "_commit_hash", None)


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
    # the target's key-norm gains (and the source's, for a reverse map): "on" for a model without refused here
    gains = _gains(target, settings.key_norm, target.config.name_or_path)
    reverse_gains = _gains(source, settings.key_norm, source.config.name_or_path) if settings.bidirectional else None
    # the memory plan, before any text is read or any forward pass runs (`budget.statistics_budget`)
    dtype = getattr(torch, settings.statistics_dtype)
    # richer source features: hidden-state blocks after the K/V blocks, planned and selected like source layers
    features = SourceFeatures.for_models(src, hidden_size(source), settings.hidden_state_layers)
    blocks = source_blocks(features, src.num_layers)
    top_k = settings.top_k or blocks
    modes = (settings.head_mode, settings.kv_mode)
    recompute_layers = recompute_layer_values(settings.recompute_layers, tgt.num_layers)
    if recompute_layers:  # layer recompute lays hidden states out in two halves
        hidden_layout(hidden_size(source), "source")
        hidden_layout(hidden_size(target), "target")
    shape = FitShape(
        src.num_layers,
        tgt.num_layers,
        # one head layout for both sides, the larger one's (the plan never plans too little); the Gram blocks kept
        # per layer come from the two real layouts
        num_kv_heads=max(src.num_kv_heads, tgt.num_kv_heads),
        head_dim=max(src.head_dim, tgt.head_dim),
        top_k=top_k,
        dtype=dtype,
        groups=len(feature_groups(src.num_kv_heads, src.head_dim, *modes, tgt.num_kv_heads, tgt.head_dim)),
    )
    memory = statistics_budget(
        shape,
        statistics_memory=settings.statistics_memory,
        statistics_device=settings.statistics_device,
        batch_tokens=settings.batch_size * settings.seq_len,
        blocks=blocks,
        head_mode=settings.head_mode,
        kv_mode=settings.kv_mode,
        bidirectional=settings.bidirectional,
        residual=(
            (src.num_layers + 1, len(recompute_layers), max(hidden_size(source), hidden_size(target)))
            if recompute_layers
            else None
        ),
    )
    budget, mode, residual_mode, fit_budget = memory.budget, memory.mode, memory.residual_mode, memory.fit_budget
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
    # what every pass over the data takes, dense or on a budget
    pass_kwargs = {
        "heldout": heldout_ids,
        "batch_size": settings.batch_size,
        "statistics_device": settings.statistics_device,
        "progress": settings.progress,
        "timings": timings,
    }
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
            **pass_kwargs,
            reverse=settings.bidirectional,
            checkpoint_dir=settings.checkpoint_dir,
            residual=residual,
            features=features,
            layouts=(src, tgt),
        )
        statistics, reverse_statistics = stats[:2], stats[2:] or None
        fit = fit_dense(
            source,
            target,
            *statistics,
            **fit_kwargs,
            config_kwargs={**references, "calibration": provenance},
            features=features,
            layouts=(src, tgt),
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
            fit = fit.with_residual(fitted)
            del residual
        bridge = build_bridge(fit, source, target)
        if settings.bidirectional:
            reverse = fit_bridge(
                target,
                source,
                *reverse_statistics,
                **fit_kwargs,
                config_kwargs={**reverse_references, "calibration": dict(provenance)},
                layouts=(tgt, src),
            )
    else:
        passes = {"windows": windows, **pass_kwargs, **fit_kwargs}
        passes.update(statistics_memory=budget, statistics_dtype=dtype)
        want = settings.keep_statistics or fit_of(entry.name) is not None
        checkpoint = settings.checkpoint_dir
        fit, statistics = fit_in_passes(
            source,
            target,
            **{**passes, "statistics_memory": fit_budget},
            checkpoint_dir=checkpoint,
            keep_statistics=want,
            config_kwargs={**references, "calibration": provenance},
            residual=(recompute_layers, residual_mode) if recompute_layers else None,
            features=features,
            layouts=(src, tgt),
        )
        bridge = build_bridge(fit, source, target)
        if settings.bidirectional:
            reverse, reverse_statistics = fit_bridge_in_passes(
                target,
                source,
                **passes,
                checkpoint_dir=None if checkpoint is None else Path(checkpoint) / "reverse",
                keep_statistics=settings.keep_statistics,
                config_kwargs={**reverse_references, "calibration": dict(provenance)},
                layouts=(tgt, src),
            )
        if fit_of(entry.name) is not None and statistics is None:
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
    if (
        fit_of(entry.name) is not None
    ):  # mappers beyond ridge start from the ridge bridge (see `mappers.MAPPER_REGISTRY`)
        bridge = refit(
            bridge,
            settings.mapper_type,
            windows=windows,
            statistics=statistics,
            batch_size=settings.batch_size,
            progress=settings.progress,
            **settings.mapper_kwargs,
        )
    with_key_norm(bridge, gains)
    if settings.bidirectional:
        with_key_norm(reverse, reverse_gains)
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


def _gains(model, setting, name: str) -> torch.Tensor | None:
    """`model`'s key-norm gains when `setting` (`CalibrationSettings.key_norm`) asks for them, else `None`; `"on"`
    for a model without a per-head key norm is refused."""
    if setting in ("off", False):
        return None
    gains = key_norm_gains(model)
    if gains is None and setting in ("on", True):
        raise ConfigurationError(
            f"key_norm='on' puts mapped keys back on the target's per-head key norm, and {name} has none (its "
            "attention layers have no self_attn.k_norm over head_dim, as Qwen3's have); use key_norm='auto' or 'off'"
        )
    return gains
