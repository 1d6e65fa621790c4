"""Pushing a saved bridge checkpoint to the Hub without loading its two models (`kvbridge push`).

Saving, loading and pushing a loaded bridge live in the core (`hf_kvbridge.persistence`); this module adds what
only the command line needs: re-rendering the card of a checkpoint on disk for its new repo.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from ..card import read_eval_table, render_model_card
from ..configuration import KVBridgeConfig
from ..constants import MAPPER_CHECKSUMS_KEY, MODEL_CARD_NAME, REVERSE_FOLDER
from ..persistence import checkpoint_files, push_folder_to_hub, read_config_dict


def push_checkpoint(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    revision: str | None = None,
    private: bool | None = None,
    token: str | bool | None = None,
    commit_message: str | None = None,
    create_pr: bool = False,
):
    """`kvbridge push DIR REPO_ID`: pushes a saved checkpoint without loading the two models.

    The card is re-rendered for `repo_id` (keeping a retention table that `kvbridge eval --write-card` put in it);
    config and weights are uploaded as saved, in one commit, after their checksums are verified.
    """
    folder = Path(folder)
    config_dict = read_config_dict(folder)
    config_dict.pop(MAPPER_CHECKSUMS_KEY, None)
    config = KVBridgeConfig.from_dict(config_dict)
    card_path = folder / MODEL_CARD_NAME
    eval_table = read_eval_table(card_path.read_text(encoding="utf-8")) if card_path.is_file() else None
    with tempfile.TemporaryDirectory(prefix="kvbridge-push-") as tmp:
        tmp = Path(tmp)
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
        render_model_card(config, repo_id=repo_id, eval_table=eval_table).save(tmp / MODEL_CARD_NAME)
        return push_folder_to_hub(
            tmp,
            repo_id,
            revision=revision,
            private=private,
            token=token,
            commit_message=commit_message,
            create_pr=create_pr,
        )
