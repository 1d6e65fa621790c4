"""The data pass: both models over the calibration windows, their rows summed into statistics (one pass of
`collect_statistics`, under `torch.distributed` too)."""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from ...errors import ConfigurationError
from ...utils.source_features import SourceFeatures, source_blocks
from ..content_rows import cache_rows, forward_rows
from ..statistics.dense import KVStatistics
from .checkpoints import load_checkpoint, save_checkpoint, windows_digest
from .checks import pair_heads, pair_layouts
from .residual import ResidualCollection

logger = logging.getLogger(__name__)


def clock() -> float:
    """`time.perf_counter()` once the GPU's queued work is done, so the timing split (forwards, statistics, selection,
    λ search, solves) charges each stage its own kernels, not the previous stage's (a no-op on CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


def distributed_rank() -> tuple[int, int]:
    """`(rank, world_size)` of an initialised `torch.distributed` process group, else `(0, 1)`."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


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
    layouts: tuple | None = None,
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
            (`hf_kvbridge.transfer.layer_recompute`) from the same forward passes: the two models' hidden states into
            `residual.parts` (`[train, held-out]`, filled in place; each rank adds its own batches and they are
            all-reduced at the end, also when `gather_rows`).
        features ([`SourceFeatures`], *optional*): the source's hidden-state feature blocks
            (`hf_kvbridge.utils.source_features`): the same forward passes return the source's hidden states, whose
            blocks are appended to its K/V rows (the statistics then hold `features.num_blocks` source "layers").
        layouts (`tuple[KVLayout, KVLayout]`, *optional*): the two models' layouts, checked already
            (`checks.pair_layouts`); checked here otherwise.

    Returns:
        `(train, heldout)` [`KVStatistics`], followed by `(reverse_train, reverse_heldout)` when `reverse`.
    """
    src, tgt = layouts or pair_layouts(source, target)
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
                *pair_heads(a, b)[:2],
                statistics_device,
                **pair_heads(a, b)[2],
            )
            for i, (a, b) in enumerate(pairs)
            for _ in range(2)
        ]
    else:
        parts = list(make_parts())
    train_ids = [i for i in range(len(windows)) if i not in set(heldout_list)]
    batches = [(0, train_ids[i : i + batch_size]) for i in range(0, len(train_ids), batch_size)]
    batches += [(1, heldout_list[i : i + batch_size]) for i in range(0, len(heldout_list), batch_size)]
    rank, world = distributed_rank()
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
        digest = windows_digest(windows, heldout_list, batch_size, reverse)
        if checkpoint_tag is not None:  # the pass's layers are part of what it sums
            layers = [part._key() if hasattr(part, "_key") else part.shape_key for part in parts]
            digest = hashlib.sha256(f"{digest}{checkpoint_tag}{layers}".encode()).hexdigest()
        if residual is not None:  # and so are the residual statistics
            kept = [residual.source_states, residual.target_states, [type(p).__name__ for p in extra]]
            digest = hashlib.sha256(f"{digest}residual{kept}".encode()).hexdigest()
        if features is not None:  # and the hidden-state feature blocks
            digest = hashlib.sha256(f"{digest}features{features.as_dict()}".encode()).hexdigest()
        classes = [type(part) for part in parts + extra]
        resumed = load_checkpoint(folder, digest, statistics_device, classes)
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
            started = clock()
            if gather:
                rows, hidden = _gathered_rows(
                    source, target, windows, step, rank, statistics_device, residual, features
                )
            else:
                group, ids = step
                x, y, hidden = _batch_rows(source, target, windows[ids], group, statistics_device, residual, features)
                rows = [(group, x, y)]
            forward_s += clock() - started
            started = clock()
            for group, x, y in rows:
                parts[group].update(x, y)
                if reverse:
                    parts[2 + group].update(y, x)
            if hidden is not None:  # this rank's own batch only (all-reduced below)
                residual.parts[hidden[0]].update(hidden[1], hidden[2])
            stats_s += clock() - started
            bar.update(1)
            if folder is not None and ((index + 1) % checkpoint_every == 0 or index + 1 == len(mine)):
                save_checkpoint(folder, parts + (residual.parts if residual is not None else []), index + 1, digest)
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


def _batch_rows(source, target, batch, group: int, device, residual=None, features=None):
    """Both models over one batch of windows: `(x, y, hidden)`, the source's and the target's statistics rows
    (`(B·T, ·)` each; the source's with its hidden-state feature blocks when `features`) and, for `residual`,
    `(group, source hidden rows, target hidden rows)` from the same forward passes (`None` without it)."""
    if residual is None and features is None:
        return cache_rows(source, batch, device), cache_rows(target, batch, device), None
    x, source_hidden = _source_rows(source, batch, device, features)  # the same passes give the hidden states
    y, target_hidden = forward_rows(target, batch, device, hidden=residual is not None)
    hidden = None if residual is None else (group, *residual.rows(source_hidden, target_hidden))
    return x, y, hidden


def _source_rows(source, batch, device, features: SourceFeatures | None):
    """The source's statistics rows of `batch` (`content_rows.forward_rows`, K/V blocks) followed by its hidden-state
    feature blocks when `features` (`(B·T, features.num_blocks·W)`), and its `output_hidden_states`."""
    x, hidden = forward_rows(source, batch, device, hidden=True)
    if features is not None:
        x = torch.cat([x, features.rows(hidden, x.device)], -1)  # (B·T, (L_s + c·|states|)·W)
    return x, hidden


def _gathered_rows(source, target, windows, step, rank, device, residual=None, features=None):
    """Runs this rank's batch of a round (`step`: one `(group, ids)` per rank) and all-gathers every rank's rows:
    `([(group, x, y)] in rank order, the same on every rank, hidden)`; `hidden` is this rank's own
    `(group, source hidden rows, target hidden rows)` for `residual` (`None` without it or without a batch)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    x = y = hidden = None
    if rank < len(step):
        group, ids = step[rank]
        x, y, hidden = _batch_rows(source, target, windows[ids], group, device, residual, features)
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
