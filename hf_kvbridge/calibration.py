"""`calibrate`: text → token windows → source/target KV → statistics → layer selection → ridge fit → bridge."""

from __future__ import annotations

import copy
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

from .budget import (
    check_budget,
    default_budget,
    format_bytes,
    free_bytes,
    parse_bytes,
    plan_passes,
    plan_residual,
    rows_bytes,
    smallest_plan_bytes,
)
from .cache import cache_rows, forward_rows
from .configuration import KVBridgeConfig
from .constants import DEFAULT_CALIBRATION_DATA, HEAD_MODES
from .data import describe_data, token_windows
from .errors import CalibrationDataError, ConfigurationError, StatisticsError, StatisticsMemoryError
from .layer_recompute import (
    ResidualCollection,
    fit_residual_map,
    hidden_layout,
    hidden_size,
    normalize_recompute_layers,
    residual_statistics,
)
from .layout import allowed_sources, check_matched, check_models, same_head_sources
from .loading import model_reference, resolve_model_reference
from .mappers import KVMapper, get_mapper_type
from .modeling import KVBridgeForCausalLM
from .row_statistics import RowStatistics
from .selection import mapper_r2, select_layers, single_layer_r2
from .settings import CalibrationSettings
from .solve import LAMBDA_GRID, choose_ridge_lambdas, effective_ridge_lambda
from .source_features import SourceFeatures, check_feature_modes, source_blocks
from .statistics import BlockStatistics, KVStatistics, SelectionStatistics, feature_groups
from .tokenization import check_same_tokenizer
from .version import __version__

logger = logging.getLogger(__name__)


def _clock() -> float:
    """`time.perf_counter()` once the GPU's queued work is done, so the timing split (forwards, statistics, selection,
    λ search, solves) charges each stage its own kernels, not the previous stage's (a no-op on CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


# λ at which the budgeted path's selection statistic scores single source layers when the fit λ is "auto"
SELECTION_LAMBDA = 1e-3


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
        raise CalibrationDataError(f"could not load a tokenizer for source {source_name!r}; pass tokenizer=") from err
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
        raise CalibrationDataError(
            f"need at least 2 calibration sequences (one held out for R²), got {num_sequences}; give more text"
        )
    if not 0 < heldout_fraction < 1:
        raise ConfigurationError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
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


def _load_checkpoint(folder: Path, digest: str, device, part_class=KVStatistics) -> tuple[list, int] | None:
    """The statistics and the batches done of a checkpoint in `folder` (`None` if there is none); `part_class` is
    the class of every part, or a list with the class of each."""
    record = folder / "progress.json"
    if not record.is_file():
        return None
    progress = json.loads(record.read_text())
    if progress["digest"] != digest:
        raise ConfigurationError(
            f"checkpoint in {folder} belongs to other calibration data or settings; use another checkpoint_dir "
            "or delete it"
        )
    classes = part_class if isinstance(part_class, list) else [part_class] * progress["parts"]
    if len(classes) != progress["parts"]:
        raise ConfigurationError(
            f"checkpoint in {folder} holds {progress['parts']} statistics, this calibration keeps {len(classes)}; use "
            "another checkpoint_dir or delete it"
        )
    stats = [cls.load(folder / f"statistics-{i}.safetensors", device) for i, cls in enumerate(classes)]
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
    make_parts=None,
    checkpoint_tag: str | None = None,
    gather_rows: bool = False,
    residual: ResidualCollection | None = None,
    features: SourceFeatures | None = None,
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
        timings (`dict`, *optional*): `forward_seconds` (both models) and `statistics_seconds` are added to it.
        make_parts (`Callable`, *optional*): returns the empty statistics to fill, `[train, held-out]` (then the
            reverse pair when `reverse`), e.g. [`SelectionStatistics`] or [`BlockStatistics`]; defaults to dense
            [`KVStatistics`]. Anything with `update`, `all_reduce_`, `check_finite`, `save` and `load` works.
        checkpoint_tag (`str`, *optional*): sub-folder of `checkpoint_dir` for this pass (one per pass of a
            budgeted calibration).
        gather_rows (`bool`, *optional*, defaults to `False`): under `torch.distributed`, every rank still runs its
            share of the batches, but the rows of each round of batches are all-gathered and every rank adds *all*
            of them to its own statistics (which may differ per rank: each holds the target layers it fits); no
            all-reduce at the end.
        residual ([`ResidualCollection`], *optional*): also accumulate the residual statistics of layer recompute
            (`hf_kvbridge.layer_recompute`) from the same forward passes: the two models' hidden states into
            `residual.parts` (`[train, held-out]`, filled in place; each rank adds its own batches and they are
            all-reduced at the end, also when `gather_rows`).
        features ([`SourceFeatures`], *optional*): the source's hidden-state feature blocks
            (`hf_kvbridge.source_features`): the same forward passes return the source's hidden states, whose blocks
            are appended to its K/V rows (the statistics then hold `features.num_blocks` source "layers").

    Returns:
        `(train, heldout)` [`KVStatistics`], followed by `(reverse_train, reverse_heldout)` when `reverse`.
    """
    src, tgt = check_matched(source.config, target.config, source.config.name_or_path, target.config.name_or_path)
    heldout_list = sorted(set(heldout or []))
    if features is not None and reverse:
        raise ConfigurationError("hidden-state features fit the source → target map only; use reverse=False")
    pairs = [(src, tgt), (tgt, src)] if reverse else [(src, tgt)]
    # parts: [train, held] forward, then [train, held] reverse
    if make_parts is None:
        parts = [
            KVStatistics(  # the forward pair's source "layers" include the hidden-state blocks
                source_blocks(features if i == 0 else None, a.num_layers),
                b.num_layers,
                *_heads(a, b)[:2],
                statistics_device,
                **_heads(a, b)[2],
            )
            for i, (a, b) in enumerate(pairs)
            for _ in range(2)
        ]
    else:
        parts = list(make_parts())
    train_ids = [i for i in range(len(windows)) if i not in set(heldout_list)]
    batches = [(0, train_ids[i : i + batch_size]) for i in range(0, len(train_ids), batch_size)]
    batches += [(1, heldout_list[i : i + batch_size]) for i in range(0, len(heldout_list), batch_size)]
    rank, world = _distributed()
    gather = gather_rows and world > 1
    if gather:  # one step per round of `world` batches, one batch per rank (the last round may be short)
        mine = [batches[i : i + world] for i in range(0, len(batches), world)]
    else:
        mine = [b for i, b in enumerate(batches) if i % world == rank]
    done = 0
    folder = digest = None
    extra = list(residual.parts) if residual is not None else []  # checkpointed with the K/V statistics
    if checkpoint_dir is not None:
        folder = Path(checkpoint_dir) / (checkpoint_tag or "") / (f"rank{rank}-of-{world}" if world > 1 else "")
        digest = _windows_digest(windows, heldout_list, batch_size, reverse)
        if checkpoint_tag is not None:  # the pass's layers are part of what it sums
            layers = [part._key() if hasattr(part, "_key") else part.shape_key for part in parts]
            digest = hashlib.sha256(f"{digest}{checkpoint_tag}{layers}".encode()).hexdigest()
        if residual is not None:  # and so are the residual statistics
            kept = [residual.source_states, residual.target_states, [type(p).__name__ for p in extra]]
            digest = hashlib.sha256(f"{digest}residual{kept}".encode()).hexdigest()
        if features is not None:  # and the hidden-state feature blocks
            digest = hashlib.sha256(f"{digest}features{features.as_dict()}".encode()).hexdigest()
        classes = [type(part) for part in parts + extra]
        resumed = _load_checkpoint(folder, digest, statistics_device, classes)
        if resumed is not None:
            loaded, done = resumed
            parts, extra = loaded[: len(parts)], loaded[len(parts) :]
            if residual is not None:
                residual.parts[:] = extra
            logger.info("resuming calibration from %s after %d batches", folder, done)
    forward_s = stats_s = 0.0
    with tqdm(total=len(mine), initial=done, desc="calibrating", unit="batch", disable=not progress) as bar:
        for index, step in enumerate(mine):
            if index < done:
                continue
            started = _clock()
            if gather:
                rows, hidden = _gathered_rows(
                    source, target, windows, step, rank, statistics_device, residual, features
                )
            else:
                group, ids = step
                batch = windows[ids]
                hidden = None
                if residual is None and features is None:
                    x, y = cache_rows(source, batch, statistics_device), cache_rows(target, batch, statistics_device)
                else:  # the same forward passes give the hidden states
                    x, source_hidden = _source_rows(source, batch, statistics_device, features)
                    y, target_hidden = forward_rows(target, batch, statistics_device, hidden=residual is not None)
                    if residual is not None:
                        hidden = (group, *residual.rows(source_hidden, target_hidden))
                    del source_hidden, target_hidden
                rows = [(group, x, y)]
            forward_s += _clock() - started
            started = _clock()
            for group, x, y in rows:
                parts[group].update(x, y)
                if reverse:
                    parts[2 + group].update(y, x)
            if hidden is not None:  # this rank's own batch only (all-reduced below)
                residual.parts[hidden[0]].update(hidden[1], hidden[2])
            stats_s += _clock() - started
            bar.update(1)
            if folder is not None and ((index + 1) % checkpoint_every == 0 or index + 1 == len(mine)):
                _save_checkpoint(folder, parts + (residual.parts if residual is not None else []), index + 1, digest)
    if world > 1 and not gather:
        for part in parts:
            part.all_reduce_()
    if world > 1 and residual is not None:
        for part in residual.parts:
            part.all_reduce_()
    if timings is not None:
        timings["forward_seconds"] = timings.get("forward_seconds", 0.0) + forward_s
        timings["statistics_seconds"] = timings.get("statistics_seconds", 0.0) + stats_s
    for i, part in enumerate(parts):
        part.check_finite(("reverse " if i >= 2 else "") + ("held-out" if i % 2 else "train") + " statistics")
    for i, part in enumerate(residual.parts if residual is not None else []):
        part.check_finite(("held-out" if i % 2 else "train") + " residual statistics")
    return tuple(parts)


def _heads(src, tgt) -> tuple[int, int, dict]:
    """`(num_kv_heads, head_dim, target keywords)` of statistics and mappers from layout `src` to layout `tgt`."""
    target = {"target_kv_heads": tgt.num_kv_heads, "target_head_dim": tgt.head_dim}
    return src.num_kv_heads, src.head_dim, target


def _features_per_layer(src, tgt, head_mode: str, kv_mode: str) -> int:
    """Input features one source layer gives each independent map (see [`KVMapper`]'s table of groups)."""
    heads = src.num_kv_heads if head_mode == "all_heads" else max(1, src.num_kv_heads // tgt.num_kv_heads)
    return heads * (2 if kv_mode == "joint" else 1) * src.head_dim


def check_tokens(train_tokens: int, inputs: int, ridge_lambda: float | str, warn: bool = True) -> None:
    """Refuses an unregularised fit (`ridge_lambda` 0) from no more training tokens than map inputs, where least
    squares has no unique answer; with auto-λ or any λ > 0 the ridge is well posed at any token count, so fewer tokens
    than inputs (the paper's map, `p` = 12,288 at top-6, calibrated on a few thousand tokens) is allowed with a
    warning (`warn`) that the λ chosen on the held-out data then carries the fit.

    Raises:
        `StatisticsError` if `ridge_lambda` is 0 and `train_tokens <= inputs`.
    """
    if train_tokens > inputs:
        return
    if ridge_lambda != "auto" and float(ridge_lambda) <= 0:
        raise StatisticsError(
            f"fewer calibration tokens ({train_tokens}) than mapper input features ({inputs}) for an unregularised "
            "fit (ridge_lambda=0); use ridge_lambda='auto' or a λ > 0, more or longer calibration sequences, a "
            "smaller top_k, or head_mode='same_head'"
        )
    if warn:
        logger.warning(
            "%d training tokens for maps of %d input features: the ridge (λ %s) carries the fit; more calibration "
            "tokens than input features give a better-determined map",
            train_tokens,
            inputs,
            "chosen on the held-out data" if ridge_lambda == "auto" else f"= {ridge_lambda}",
        )


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


def _source_rows(source, batch, device, features: SourceFeatures | None):
    """The source's statistics rows of `batch` (`cache.forward_rows`, K/V blocks) followed by its hidden-state
    feature blocks when `features` (`(B·T, features.num_blocks·W)`), and its `output_hidden_states`."""
    x, hidden = forward_rows(source, batch, device, hidden=True)
    if features is not None:
        x = torch.cat([x, features.rows(hidden, x.device)], -1)  # (B·T, (L_s + c·|states|)·W)
    return x, hidden


def _allowed(src, tgt, features: SourceFeatures | None, held: int | None = None) -> list[list[bool]]:
    """`layout.allowed_sources`, extended with the hidden-state blocks of `features` (which cover every token: always
    allowed) and with the other blocks of statistics holding `held` in all (never allowed: hidden-state blocks a
    K/V-only fit leaves out, so its map is the one K/V-only statistics give)."""
    allowed = allowed_sources(src, tgt)
    extra = 0 if features is None else features.num_blocks - src.num_layers
    spare = 0 if held is None else held - src.num_layers - extra
    return [row + [True] * extra + [False] * spare for row in allowed]


def _gathered_rows(source, target, windows, step, rank, device, residual=None, features=None):
    """Runs this rank's batch of a round (`step`: one `(group, ids)` per rank) and all-gathers every rank's rows:
    `([(group, x, y)] in rank order, the same on every rank, hidden)`; `hidden` is this rank's own
    `(group, source hidden rows, target hidden rows)` for `residual` (`None` without it or without a batch)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    hidden = None
    if rank < len(step):
        batch = windows[step[rank][1]]
        if residual is None and features is None:
            x, y = cache_rows(source, batch, device), cache_rows(target, batch, device)
        else:
            x, source_hidden = _source_rows(source, batch, device, features)
            y, target_hidden = forward_rows(target, batch, device, hidden=residual is not None)
            if residual is not None:
                hidden = (step[rank][0], *residual.rows(source_hidden, target_hidden))
    else:
        x = y = None
    widths = torch.tensor([-1, -1] if x is None else [x.shape[1], y.shape[1]], dtype=torch.long)
    all_widths = [torch.zeros_like(widths) for _ in range(world)]
    dist.all_gather(all_widths, widths)
    f, g = max(int(w[0]) for w in all_widths), max(int(w[1]) for w in all_widths)
    lengths = [len(step[r][1]) * windows.shape[1] if r < len(step) else 0 for r in range(world)]
    longest = max(lengths)
    out = []
    for width, local in ((f, x), (g, y)):
        padded = torch.zeros(longest, width, dtype=torch.float32, device=device or "cpu")
        if local is not None:
            padded[: local.shape[0]] = local
        gathered = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(gathered, padded)
        out.append(gathered)
    return [(step[r][0], out[0][r][: lengths[r]], out[1][r][: lengths[r]]) for r in range(len(step))], hidden


def residual_collection(
    kind, source, target, recompute_layers: list[int], device=None, dtype=torch.float32, sources=None
) -> ResidualCollection:
    """The residual statistics of layer recompute for `recompute_layers` to fill in a pass of `collect_statistics`
    (`kind`: `KVStatistics`, `SelectionStatistics`, or `BlockStatistics` of the `sources` kept), with the hidden
    states they read: every source hidden state, and the target's entering layer `L_t − n` for each `n`.

    Example:

    ```python
    >>> residual = residual_collection(KVStatistics, source, target, [1, 2])  # doctest: +SKIP
    >>> train, held = collect_statistics(source, target, windows, heldout=[0], residual=residual)  # doctest: +SKIP
    >>> mapper, summary = fit_residual_map(*residual.parts, [1, 2], 32, 48, top_k=2)  # doctest: +SKIP
    ```
    """
    source_states = source.config.get_text_config(decoder=True).num_hidden_layers + 1
    target_layers = target.config.get_text_config(decoder=True).num_hidden_layers
    shape = (hidden_size(source), hidden_size(target), source_states, len(recompute_layers))
    return ResidualCollection(
        list(range(source_states)),
        [target_layers - n for n in recompute_layers],
        [residual_statistics(kind, *shape, device=device, dtype=dtype, sources=sources) for _ in range(2)],
    )


def _with_residual(bridge: KVBridgeForCausalLM, fitted: tuple) -> KVBridgeForCausalLM:
    """`bridge` with the residual map `fitted` (`fit_residual_map`'s `(mapper, summary)`), recorded in its config
    (`residual_map`)."""
    mapper, summary = fitted
    config = copy.deepcopy(bridge.config)
    config.residual_map = summary
    logger.info(
        "residual maps for recompute_layers %s: held-out R² %s", summary["recompute_layers"], summary["heldout_r2"]
    )
    return bridge.with_residual_mapper(mapper, config)


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
    kv_mode: str = "joint",
    features: SourceFeatures | None = None,
) -> KVBridgeForCausalLM:
    """Selects layers (held-out single-layer R²), fits the ridge mapper on all statistics and builds the bridge.

    Args:
        ridge_lambda (`float` or `"auto"`, *optional*, defaults to `"auto"`): relative ridge strength; `"auto"`
            chooses it per target layer, head group and K/V by held-out R² over `hf_kvbridge.solve.LAMBDA_GRID`
            (fit on `train`, scored on `heldout`, refitted on both; stored in `config.ridge_lambdas`).
        selected_layers (`list[list[int]]`, *optional*): force these source layers (per target layer, in order)
            instead of selecting them.
        config_kwargs (`dict`, *optional*): extra [`KVBridgeConfig`] fields (references, provenance).
        kv_mode (`str`, *optional*, defaults to `"joint"`): or `"separate"` (keys from keys, values from values).
        features ([`SourceFeatures`], *optional*): the hidden-state feature blocks the statistics hold after the K/V
            blocks (`collect_statistics(features=...)`); selection ranks them with the K/V blocks. Without it, a
            map of statistics that hold such blocks reads the K/V blocks only.
    """
    if head_mode not in HEAD_MODES:
        raise ConfigurationError(f"head_mode must be one of {HEAD_MODES}, got {head_mode!r}")
    src, tgt = check_matched(source.config, target.config, source.config.name_or_path, target.config.name_or_path)
    if features is not None:
        check_feature_modes(head_mode, kv_mode)
    blocks = source_blocks(features, src.num_layers)
    k = max(map(len, selected_layers)) if selected_layers else min(top_k or blocks, blocks)
    inputs = k * _features_per_layer(src, tgt, head_mode, kv_mode)
    check_tokens(train.count, inputs, ridge_lambda)
    r2 = single_layer_r2(train, heldout, head_mode, ridge_lambda)  # (L_t, blocks held, 2)
    if selected_layers is None:
        # without `features`, hidden-state blocks the statistics hold are never selected (`kvbridge tune`'s K/V-only
        # configurations)
        selected_layers = select_layers(r2, top_k, _allowed(src, tgt, features, held=r2.shape[1]))
    elif len(selected_layers) != tgt.num_layers:
        raise ConfigurationError(
            f"selected_layers has {len(selected_layers)} entries, target has {tgt.num_layers} layers; give one list "
            "of source layers per target layer"
        )
    ridge_lambdas = None
    if ridge_lambda == "auto":
        ridge_lambdas, fitted_r2 = choose_ridge_lambdas(
            train, heldout, selected_layers, head_mode, tgt.num_kv_heads, tgt.head_dim, LAMBDA_GRID, kv_mode=kv_mode
        )  # fitted_r2: (L_t, 2), the held-out R² of the maps as kv_mode fits them
    else:
        fitted_r2 = mapper_r2(train, heldout, selected_layers, head_mode, ridge_lambda, kv_mode=kv_mode)  # (L_t, 2)
    mapper = KVMapper.from_statistics(
        train + heldout, selected_layers, head_mode, ridge_lambdas or ridge_lambda, kv_mode=kv_mode
    )
    if features is not None:
        config_kwargs = {**(config_kwargs or {}), "source_features": features.as_dict()}
    return assemble_bridge(
        source, target, mapper, r2, fitted_r2, top_k, ridge_lambda, ridge_lambdas, head_mode, hold_back, config_kwargs
    )


def assemble_bridge(
    source, target, mapper, r2, fitted_r2, top_k, ridge_lambda, ridge_lambdas, head_mode, hold_back, config_kwargs
) -> KVBridgeForCausalLM:
    """The bridge of a fitted `mapper`, with its selection R² `r2` `(L_t, L_s, 2)` and held-out R² `fitted_r2`
    `(L_t, 2)` recorded in the config."""
    src, tgt = check_matched(source.config, target.config, source.config.name_or_path, target.config.name_or_path)
    selected_layers = mapper.selected_layers
    config = KVBridgeConfig(
        source_fingerprint=src.fingerprint(),
        target_fingerprint=tgt.fingerprint(),
        top_k=top_k,
        ridge_lambda=ridge_lambda,
        ridge_lambdas=ridge_lambdas,
        head_mode=head_mode,
        kv_mode=mapper.kv_mode,
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


def fit_bridge_in_passes(
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
) -> tuple[KVBridgeForCausalLM, tuple | None]:
    """Calibration on a memory budget (see `hf_kvbridge.budget`): a selection pass over `windows` picks the top-k
    source layers of each target layer from [`SelectionStatistics`], then fit passes accumulate
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
            layer recompute for those values (`hf_kvbridge.layer_recompute`), from the same passes: dense statistics
            in the selection pass (`mode="dense"`), or selection statistics there and the block statistics of the
            selected source hidden states in the first fit pass (`"blocks"`; `budget.plan_residual` plans both).
            The returned bridge holds them (`residual_mapper`, `config.residual_map`).
        features ([`SourceFeatures`], *optional*): hidden-state feature blocks beside the K/V blocks (see
            `fit_bridge`), accumulated in every pass like any source layer.

    Returns:
        `(bridge, statistics)`: `statistics` is `(train, held-out)` [`BlockStatistics`] or `None`.
    """
    src, tgt = check_matched(source.config, target.config, source.config.name_or_path, target.config.name_or_path)
    heads, dim, target_heads = _heads(src, tgt)
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
    }
    # the token count against the widest map, before any forward pass
    widest = min(top_k or blocks, blocks) * _features_per_layer(src, tgt, head_mode, kv_mode)
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
    started = _clock()
    r2 = train.single_layer_r2(held, selection_lambda)  # (L_t, L_s, 2)
    timings["selection_seconds"] = timings.get("selection_seconds", 0.0) + _clock() - started
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
    selected = select_layers(r2, top_k, _allowed(src, tgt, features))
    groups = len(feature_groups(src.num_kv_heads, src.head_dim, head_mode, kv_mode, tgt.num_kv_heads, tgt.head_dim))
    # each target layer's cross blocks with its own source layers only, unless the statistics are kept for re-fits
    own_cross = not keep_statistics
    inputs = max(map(len, selected)) * _features_per_layer(src, tgt, head_mode, kv_mode)
    rank, world = _distributed()
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
        started = _clock()
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
        timings["lambda_seconds"] = timings.get("lambda_seconds", 0.0) + _clock() - started
        started = _clock()
        if keep_statistics and len(passes) == 1:
            statistics = (train, held)
            mapper.fit_targets(train + held, targets, lam)  # the final fit sees every token
        else:
            mapper.fit_targets(train.merge_(held), targets, lam)  # merged in place: no third copy
        timings["solve_seconds"] = timings.get("solve_seconds", 0.0) + _clock() - started
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
    if features is not None:
        config_kwargs = {**(config_kwargs or {}), "source_features": features.as_dict()}
    bridge = assemble_bridge(
        source, target, mapper, r2, fitted_r2, top_k, ridge_lambda, ridge_lambdas, head_mode, hold_back, config_kwargs
    )
    if residual_fit is not None:
        bridge = _with_residual(bridge, residual_fit)
    return bridge, statistics


def refit(
    bridge: KVBridgeForCausalLM,
    mapper_type: str,
    *,
    windows: torch.Tensor | None = None,
    statistics: tuple[KVStatistics, KVStatistics] | None = None,
    batch_size: int = 8,
    progress: bool = False,
    **mapper_kwargs: Any,
) -> KVBridgeForCausalLM:
    """A bridge over `bridge`'s models with a mapper of type `mapper_type` fitted from `bridge`'s (ridge) mapper.

    Calls the registry's fit (`mappers.MAPPER_REGISTRY[mapper_type].fit`) with the mapper, the two models, `windows`,
    `statistics` (default: the `calibration_statistics` that `calibrate(keep_statistics=True)` leaves on the bridge),
    the λ the mapper was fitted with, and `mapper_kwargs`; the fit returns the new mapper, and the new bridge's config
    records `mapper_type`, the fit's `fit_summary` as `mapper_kwargs` and its `fit_config` fields. `bridge` itself is
    left unchanged.

    Example:

    ```python
    >>> cheap = refit(bridge, "low_rank", rank=32)  # doctest: +SKIP
    >>> mlp = refit(bridge, "mlp", windows=windows, hidden=128, epochs=1)  # doctest: +SKIP
    ```
    """
    entry = get_mapper_type(mapper_type)
    if entry.fit is None:
        raise ConfigurationError(f"mapper_type {mapper_type!r} is the ridge fit itself: use fit_bridge or calibrate")
    if statistics is None:
        statistics = getattr(bridge, "calibration_statistics", None)
    mapper = entry.fit(
        bridge.mapper,
        source=bridge.source,
        target=bridge.target,
        windows=windows,
        statistics=statistics,
        ridge_lambda=effective_ridge_lambda(bridge.config),
        batch_size=batch_size,
        progress=progress,
        **mapper_kwargs,
    )
    config = copy.deepcopy(bridge.config)
    config.mapper_type = entry.name
    config.mapper_kwargs = dict(mapper.fit_summary or {})
    for key, value in (mapper.fit_config or {}).items():
        setattr(config, key, value)
    return bridge.with_mapper(mapper, config)


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
        tokenizer = _shared_tokenizer(source, target)
    windows = token_windows(data, tokenizer, settings.num_sequences, settings.seq_len, text_field=settings.text_field)
    train_ids, heldout_ids = split_heldout(len(windows), settings.heldout_fraction, settings.seed)
    # an unregularised fit from too few tokens is refused here, before any forward pass (the fit warns of a ridge fit
    # from fewer tokens than inputs)
    train_tokens = len(train_ids) * windows.shape[1]
    inputs = min(top_k, blocks) * _features_per_layer(src, tgt, *modes)
    check_tokens(train_tokens, inputs, settings.ridge_lambda, warn=False)
    if settings.bidirectional:
        reverse_inputs = min(top_k, tgt.num_layers) * _features_per_layer(tgt, src, *modes)
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
            bridge = _with_residual(bridge, fitted)
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
