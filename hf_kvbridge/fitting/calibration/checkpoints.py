"""Resumable calibration: the statistics of a pass saved every few batches and read back (atomically replaced;
refused when they belong to other data or settings)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from ...errors import ConfigurationError
from ..statistics.dense import KVStatistics

logger = logging.getLogger(__name__)


def windows_digest(windows: torch.Tensor, heldout: list[int], batch_size: int, reverse: bool) -> str:
    digest = hashlib.sha256(windows.numpy().tobytes())
    digest.update(json.dumps([sorted(heldout), batch_size, reverse, list(windows.shape)]).encode())
    return digest.hexdigest()


def save_checkpoint(folder: Path, stats: list[KVStatistics], done: int, digest: str) -> None:
    """Atomically replaces the checkpoint in `folder` (statistics files first, then the progress record)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, part in enumerate(stats):
        part.save(folder / f"statistics-{i}.safetensors.tmp")
        os.replace(folder / f"statistics-{i}.safetensors.tmp", folder / f"statistics-{i}.safetensors")
    record = folder / "progress.json.tmp"
    record.write_text(json.dumps({"batches_done": done, "digest": digest, "parts": len(stats)}))
    os.replace(record, folder / "progress.json")


def load_checkpoint(folder: Path, digest: str, device, part_class=KVStatistics) -> tuple[list, int] | None:
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
