"""`calibrate`: text → token windows → source/target KV → statistics → layer selection → ridge fit → bridge."""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from .cache import cache_rows
from .configuration import KVBridgeConfig
from .constants import DEFAULT_CALIBRATION_DATA, HEAD_MODES
from .data import describe_data, token_windows
from .errors import StatisticsError
from .layout import allowed_sources, check_matched, check_models
from .loading import model_reference, resolve_model_reference
from .mappers import KVMapper, get_mapper_type
from .modeling import KVBridgeForCausalLM
from .selection import mapper_r2, select_layers, single_layer_r2
from .settings import CalibrationSettings
from .solve import LAMBDA_GRID, choose_ridge_lambdas
from .statistics import KVStatistics
from .tokenization import check_same_tokenizer
from .version import __version__

logger = logging.getLogger(__name__)


def _load(
    model: PreTrainedModel | str, revision: str | None, **load_kwargs: Any
) -> tuple[PreTrainedModel, str | None]:
    if isinstance(model, PreTrainedModel):
        return model.eval(), revision or getattr(model.config, "_commit_hash", None)
    loaded = AutoModelForCausalLM.from_pretrained(resolve_model_reference(model), revision=revision, **load_kwargs)
    loaded.config.name_or_path = model
    return loaded.eval(), revision or getattr(loaded.config, "_commit_hash", None)


def _shared_tokenizer(source: PreTrainedModel, target: PreTrainedModel):
    """The tokenizer of the source, after checking that the target's (when it has one) is the same."""
    source_name = source.config.name_or_path
    try:
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_reference(source_name))
    except Exception as err:
        raise ValueError(f"could not load a tokenizer for source {source_name!r}; pass tokenizer=") from err
    try:
        target_tokenizer = AutoTokenizer.from_pretrained(resolve_model_reference(target.config.name_or_path))
    except Exception:  # a target without tokenizer files: the vocab-size check is all we can do
        logger.warning("no tokenizer found for target %r; assuming it shares the source's", target.config.name_or_path)
        return tokenizer
    check_same_tokenizer(tokenizer, target_tokenizer, f"source {source_name}", f"target {target.config.name_or_path}")
    return tokenizer


def split_heldout(num_sequences: int, heldout_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Splits window indices into train and held-out *by sequence* (seeded)."""
    if num_sequences < 2:
        raise ValueError(f"need at least 2 calibration sequences (one held out for R²), got {num_sequences}")
    if not 0 < heldout_fraction < 1:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    num_heldout = min(num_sequences - 1, max(1, round(num_sequences * heldout_fraction)))
    order = torch.randperm(num_sequences, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(order[num_heldout:]), sorted(order[:num_heldout])


def _distributed() -> tuple[int, int]:
    """`(rank, world_size)` of an initialised `torch.distributed` process group, else `(0, 1)`."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _windows_digest(windows: torch.Tensor, heldout: list[int], batch_size: int, reverse: bool) -> str:
    digest = hashlib.sha256(windows.numpy().tobytes())
    digest.update(json.dumps([sorted(heldout), batch_size, reverse, list(windows.shape)]).encode())
    return digest.hexdigest()


def _save_checkpoint(folder: Path, stats: list[KVStatistics], done: int, digest: str) -> None:
    """Atomically replaces the checkpoint in `folder` (statistics files first, then the progress record)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, part in enumerate(stats):
        part.save(folder / f"statistics-{i}.safetensors.tmp")
        os.replace(folder / f"statistics-{i}.safetensors.tmp", folder / f"statistics-{i}.safetensors")
    record = folder / "progress.json.tmp"
    record.write_text(json.dumps({"batches_done": done, "digest": digest, "parts": len(stats)}))
    os.replace(record, folder / "progress.json")


def _load_checkpoint(folder: Path, digest: str, device) -> tuple[list[KVStatistics], int] | None:
    record = folder / "progress.json"
    if not record.is_file():
        return None
    progress = json.loads(record.read_text())
    if progress["digest"] != digest:
        raise ValueError(
            f"checkpoint in {folder} belongs to other calibration data or settings; use another checkpoint_dir "
            "or delete it"
        )
    stats = [KVStatistics.load(folder / f"statistics-{i}.safetensors", device) for i in range(progress["parts"])]
    return stats, int(progress["batches_done"])


def collect_statistics(
    source: PreTrainedModel,
    target: PreTrainedModel,
    windows: torch.Tensor,
    *,
    heldout: list[int] | None = None,
    batch_size: int = 8,
    statistics_device: torch.device | str | None = None,
    progress: bool = False,
    reverse: bool = False,
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint_every: int = 10,
    timings: dict | None = None,
) -> tuple[KVStatistics, ...]:
    """One pass of both models over `windows`, accumulating train and held-out statistics.

    Under `torch.distributed` (launched with `torchrun` or `accelerate launch`), each rank runs every
    `world_size`-th batch and the statistics are all-reduced, so every rank returns the statistics of all windows.

    Args:
        windows (`torch.LongTensor` of shape `(num_sequences, seq_len)`).
        heldout (`list[int]`, *optional*): indices of the held-out windows.
        reverse (`bool`, *optional*, defaults to `False`): also accumulate the target→source statistics from the
            same forward passes (for a bidirectional bridge).
        checkpoint_dir (`str` or `os.PathLike`, *optional*): save the statistics there every `checkpoint_every`
            batches (per rank), and resume from what is there: an interrupted run restarts where it stopped and
            ends with the same statistics.
        timings (`dict`, *optional*): filled with `forward_seconds` (both models) and `statistics_seconds`.

    Returns:
        `(train, heldout)` [`KVStatistics`], followed by `(reverse_train, reverse_heldout)` when `reverse`.
    """
    src, tgt = check_matched(source.config, target.config, source.config.name_or_path, target.config.name_or_path)
    heldout_list = sorted(set(heldout or []))
    forward_shape = (src.num_layers, tgt.num_layers, src.num_kv_heads, src.head_dim)
    reverse_shape = (tgt.num_layers, src.num_layers, src.num_kv_heads, src.head_dim)
    shapes = [forward_shape, reverse_shape] if reverse else [forward_shape]
    # parts: [train, held] forward, then [train, held] reverse
    parts = [KVStatistics(*shape, device=statistics_device) for shape in shapes for _ in range(2)]
    train_ids = [i for i in range(len(windows)) if i not in set(heldout_list)]
    batches = [(0, train_ids[i : i + batch_size]) for i in range(0, len(train_ids), batch_size)]
    batches += [(1, heldout_list[i : i + batch_size]) for i in range(0, len(heldout_list), batch_size)]
    rank, world = _distributed()
    mine = [b for i, b in enumerate(batches) if i % world == rank]
    done = 0
    folder = digest = None
    if checkpoint_dir is not None:
        folder = Path(checkpoint_dir) / (f"rank{rank}-of-{world}" if world > 1 else "")
        digest = _windows_digest(windows, heldout_list, batch_size, reverse)
        resumed = _load_checkpoint(folder, digest, statistics_device)
        if resumed is not None:
            parts, done = resumed
            logger.info("resuming calibration from %s after %d batches", folder, done)
    forward_s = stats_s = 0.0
    with tqdm(total=len(mine), initial=done, desc="calibrating", unit="batch", disable=not progress) as bar:
        for index, (group, ids) in enumerate(mine):
            if index < done:
                continue
            started = time.perf_counter()
            batch = windows[ids]
            x = cache_rows(source, batch, statistics_device)
            y = cache_rows(target, batch, statistics_device)
            forward_s += time.perf_counter() - started
            started = time.perf_counter()
            parts[group].update(x, y)
            if reverse:
                parts[2 + group].update(y, x)
            stats_s += time.perf_counter() - started
            bar.update(1)
            if folder is not None and ((index + 1) % checkpoint_every == 0 or index + 1 == len(mine)):
                _save_checkpoint(folder, parts, index + 1, digest)
    if world > 1:
        for part in parts:
            part.all_reduce_()
    if timings is not None:
        timings.update({"forward_seconds": forward_s, "statistics_seconds": stats_s})
    for i, part in enumerate(parts):
        part.check_finite(("reverse " if i >= 2 else "") + ("held-out" if i % 2 else "train") + " statistics")
    return tuple(parts)


def fit_bridge(
    source: PreTrainedModel,
    target: PreTrainedModel,
    train: KVStatistics,
    heldout: KVStatistics,
    *,
    top_k: int | None = 6,
    ridge_lambda: float | str = "auto",
    head_mode: str = "all_heads",
    hold_back: int = 1,
    selected_layers: list[list[int]] | None = None,
    config_kwargs: dict | None = None,
) -> KVBridgeForCausalLM:
    """Selects layers (held-out single-layer R²), fits the ridge mapper on all statistics and builds the bridge.

    Args:
        ridge_lambda (`float` or `"auto"`, *optional*, defaults to `"auto"`): relative ridge strength; `"auto"`
            chooses it per target layer, head group and K/V by held-out R² over `hf_kvbridge.solve.LAMBDA_GRID`
            (fit on `train`, scored on `heldout`, refitted on both; stored in `config.ridge_lambdas`).
        selected_layers (`list[list[int]]`, *optional*): force these source layers (per target layer, in order)
            instead of selecting them.
        config_kwargs (`dict`, *optional*): extra [`KVBridgeConfig`] fields (references, provenance).
    """
    if head_mode not in HEAD_MODES:
        raise ValueError(f"head_mode must be one of {HEAD_MODES}, got {head_mode!r}")
    src, tgt = check_matched(source.config, target.config, source.config.name_or_path, target.config.name_or_path)
    k = max(map(len, selected_layers)) if selected_layers else min(top_k or src.num_layers, src.num_layers)
    features = k * (src.features_per_layer if head_mode == "all_heads" else 2 * src.head_dim)
    if train.count <= features:
        raise StatisticsError(
            f"fewer calibration tokens ({train.count}) than mapper input features ({features}); use more or longer "
            "calibration sequences, a smaller top_k, or head_mode='same_head'"
        )
    r2 = single_layer_r2(train, heldout, head_mode, ridge_lambda)  # (L_t, L_s, 2)
    if selected_layers is None:
        selected_layers = select_layers(r2, top_k, allowed_sources(src, tgt))
    elif len(selected_layers) != tgt.num_layers:
        raise ValueError(f"selected_layers has {len(selected_layers)} entries, target has {tgt.num_layers} layers")
    ridge_lambdas = None
    if ridge_lambda == "auto":
        ridge_lambdas, fitted_r2 = choose_ridge_lambdas(
            train, heldout, selected_layers, head_mode, src.num_kv_heads, src.head_dim, LAMBDA_GRID
        )  # fitted_r2: (L_t, 2)
    else:
        fitted_r2 = mapper_r2(train, heldout, selected_layers, head_mode, ridge_lambda)  # (L_t, 2)
    mapper = KVMapper.from_statistics(train + heldout, selected_layers, head_mode, ridge_lambdas or ridge_lambda)
    config = KVBridgeConfig(
        source_fingerprint=src.fingerprint(),
        target_fingerprint=tgt.fingerprint(),
        top_k=top_k,
        ridge_lambda=ridge_lambda,
        ridge_lambdas=ridge_lambdas,
        head_mode=head_mode,
        selected_layers=selected_layers,
        selected_layer_r2=[
            [round(float(r2[t, s].mean()), 6) for s in layers] for t, layers in enumerate(selected_layers)
        ],
        heldout_r2={
            "k": [round(float(v), 6) for v in fitted_r2[:, 0]],
            "v": [round(float(v), 6) for v in fitted_r2[:, 1]],
        },
        hold_back=hold_back,
        **(config_kwargs or {}),
    )
    bridge = KVBridgeForCausalLM(config, source, target, mapper)
    bridge.layer_r2 = r2  # the full single-layer R² matrix, for diagnostics and plots
    return bridge


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
    check_models(source, target, source.config.name_or_path, target.config.name_or_path)  # before any work
    if tokenizer is None:
        tokenizer = _shared_tokenizer(source, target)
    windows = token_windows(data, tokenizer, settings.num_sequences, settings.seq_len, text_field=settings.text_field)
    train_ids, heldout_ids = split_heldout(len(windows), settings.heldout_fraction, settings.seed)
    timings: dict = {}
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
    )
    train, heldout = stats[:2]
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
        "forward_seconds": round(timings["forward_seconds"], 2),
        "statistics_seconds": round(timings["statistics_seconds"], 2),
    }
    import transformers

    provenance["transformers_version"] = transformers.__version__
    bridge = fit_bridge(
        source,
        target,
        train,
        heldout,
        top_k=settings.top_k,
        ridge_lambda=settings.ridge_lambda,
        head_mode=settings.head_mode,
        hold_back=settings.hold_back,
        config_kwargs={
            "source_name_or_path": model_reference(source),
            "source_revision": source_revision,
            "target_name_or_path": model_reference(target),
            "target_revision": target_revision,
            "calibration": provenance,
        },
    )
    entry = get_mapper_type(settings.mapper_type)
    if entry.fit is not None:  # mappers beyond ridge start from the ridge bridge (see `mappers.MAPPER_REGISTRY`)
        bridge = entry.fit(
            bridge,
            windows=windows,
            statistics=(train, heldout),
            batch_size=settings.batch_size,
            progress=settings.progress,
            **settings.mapper_kwargs,
        )
    if settings.bidirectional:
        reverse = fit_bridge(
            target,
            source,
            *stats[2:],
            top_k=settings.top_k,
            ridge_lambda=settings.ridge_lambda,
            head_mode=settings.head_mode,
            hold_back=settings.hold_back,
            config_kwargs={
                "source_name_or_path": bridge.config.target_name_or_path,
                "source_revision": target_revision,
                "target_name_or_path": bridge.config.source_name_or_path,
                "target_revision": source_revision,
                "calibration": dict(provenance),
            },
        )
        reverse.calibration_statistics = tuple(stats[2:])
        bridge.reverse = reverse
    bridge.config.calibration["seconds"] = round(time.perf_counter() - started, 2)
    bridge.calibration_statistics = (train, heldout)
    bridge.config.calibration["bidirectional"] = settings.bidirectional
    logger.info(
        "calibrated %s → %s in %.1fs",
        bridge.config.source_name_or_path,
        bridge.config.target_name_or_path,
        bridge.config.calibration["seconds"],
    )
    return bridge
