"""Loads the pocket tasks' local JSONL files relative to this folder, so the tasks run from any working directory."""

from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def load_local_json(data_files: dict[str, str], **kwargs) -> datasets.DatasetDict:
    """`datasets.load_dataset("json", ...)` with `data_files` relative to `eval_tasks/pocket/`."""
    files = {split: str(HERE / path) for split, path in data_files.items()}
    return datasets.load_dataset("json", data_files=files)
