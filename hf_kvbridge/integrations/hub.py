"""Pushing a saved bridge checkpoint to the Hub without loading its two models (`kvbridge push`).

Saving, loading and pushing a loaded bridge live in the core (`hf_kvbridge.persistence`); this module adds what
only the command line needs: re-rendering the card of a checkpoint on disk for its new repo.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from ..card import read_eval_table, render_model_card
from ..configuration import KVBridgeConfig
from ..constants import MAPPER_CHECKSUMS_KEY, MODEL_CARD_NAME, REVERSE_FOLDER
from ..persistence import BridgeHubMixin, checkpoint_files, read_config_dict


class SavedCheckpoint(BridgeHubMixin):
    """A bridge checkpoint on disk, pushed without loading its two models (`kvbridge push DIR REPO_ID`): the bridge's
    own `push_to_hub`, with `save_pretrained` staging the checkpoint's files as saved and its card re-rendered for the
    new repo (keeping a retention table that `kvbridge eval --write-card` put in it); config and weights are
    uploaded as saved, in one commit, after their checksums are verified.

    Args:
        folder (`str` or `os.PathLike`): the checkpoint (as `save_pretrained` wrote it).

    Example:

    ```python
    >>> SavedCheckpoint("my-bridge").push_to_hub("me/qwen3-14b-to-32b", private=True)  # doctest: +SKIP
    ```
    """

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        config_dict = read_config_dict(self.folder)
        config_dict.pop(MAPPER_CHECKSUMS_KEY, None)
        self.config = KVBridgeConfig.from_dict(config_dict)
        card_path = self.folder / MODEL_CARD_NAME
        self.eval_table = read_eval_table(card_path.read_text(encoding="utf-8")) if card_path.is_file() else None

    def save_pretrained(self, save_directory: str | os.PathLike, *, model_card_kwargs=None, **kwargs: Any) -> None:
        """Stages the checkpoint in `save_directory` (a push's temporary folder): its files as saved (linked, weights
        can be large; `max_shard_size` does not apply), and its card rendered with `model_card_kwargs` (the new
        `repo_id`), keeping the retention table that `kvbridge eval --write-card` put in it."""
        folder, tmp = self.folder, Path(save_directory)
        for name in checkpoint_files(folder):
            if name == MODEL_CARD_NAME:
                continue
            try:  # weights can be large: link rather than copy
                os.symlink((folder / name).resolve(), tmp / name)
            except OSError:
                shutil.copy2(folder / name, tmp / name)
        if (folder / REVERSE_FOLDER).is_dir():  # a bidirectional checkpoint's target→source mapper goes along
            try:
                shutil.copytree((folder / REVERSE_FOLDER).resolve(), tmp / REVERSE_FOLDER, copy_function=os.symlink)
            except OSError:
                shutil.copytree(folder / REVERSE_FOLDER, tmp / REVERSE_FOLDER, dirs_exist_ok=True)
        card_kwargs = {"eval_table": self.eval_table, **(model_card_kwargs or {})}
        render_model_card(self.config, **card_kwargs).save(tmp / MODEL_CARD_NAME)
