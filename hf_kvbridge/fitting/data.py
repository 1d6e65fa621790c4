"""Calibration text → fixed-length token windows.

`data` may be a list of strings, a path to a `.txt`/`.jsonl`(`.gz`) file or a folder of them, a `datasets.Dataset`
(or `IterableDataset`), or a dataset name on the Hub (streamed). Documents are tokenised with the shared tokenizer,
joined with the EOS token and cut into `num_sequences × seq_len` windows.
"""

from __future__ import annotations

import gzip
import itertools
import json
import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..constants import TEXT_SUFFIXES
from ..errors import CalibrationDataError, InvalidInputError
from ..pocket import data_path

logger = logging.getLogger(__name__)


def _open_text(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def _iter_file(path: Path, text_field: str) -> Iterator[str]:
    is_jsonl = path.name.endswith((".jsonl", ".jsonl.gz"))
    with _open_text(path) as handle:
        if not is_jsonl:
            yield handle.read()
            return
        for line_no, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise CalibrationDataError(f"{path}:{line_no}: not valid JSON ({err.msg})") from None
            if text_field not in record:
                raise CalibrationDataError(f"{path}:{line_no}: no {text_field!r} field")
            yield record[text_field]


def _iter_dataset(dataset: Iterable[Any], text_field: str) -> Iterator[str]:
    for record in dataset:
        if text_field not in record:
            raise CalibrationDataError(f"dataset records have no {text_field!r} column (got {sorted(record)})")
        yield record[text_field]


def iter_texts(data: Any, text_field: str = "text") -> Iterator[str]:
    """Yields documents from any supported `data` form (see the module docstring)."""
    if isinstance(data, (list, tuple)):
        for item in data:
            if not isinstance(item, str):
                raise CalibrationDataError(f"calibration data lists must hold strings, got {type(item).__name__}")
            yield item
        return
    if isinstance(data, (str, os.PathLike)):
        path = Path(data)
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(TEXT_SUFFIXES))
            if not files:
                raise CalibrationDataError(f"no {'/'.join(TEXT_SUFFIXES)} files in folder {path}")
            for file in files:
                yield from _iter_file(file, text_field)
            return
        if path.is_file():
            yield from _iter_file(path, text_field)
            return
        if isinstance(data, str) and not data.endswith(TEXT_SUFFIXES):
            yield from _iter_hub_dataset(data, text_field)
            return
        raise CalibrationDataError(f"calibration data {str(data)!r} is not a file, folder or dataset name")
    if hasattr(data, "__iter__"):  # datasets.Dataset / IterableDataset / any iterable of records
        yield from _iter_dataset(data, text_field)
        return
    raise CalibrationDataError(f"unsupported calibration data of type {type(data).__name__}")


def resolve_data_reference(data: str, split: str = "calibration") -> str:
    """`pocket` → the path of the pocket family's shipped `split` (`hf_kvbridge.pocket.SPLITS`); anything else as is.

    A local file or folder called `pocket` wins over the shipped split, as a local model folder wins over
    `pocket/<name>` (`hf_kvbridge.loading.resolve_model_reference`). The command line's `--data pocket` means this.

    Example:

    ```python
    >>> resolve_data_reference("pocket", "heldout")  # doctest: +SKIP
    '/.../hf_kvbridge/pocket/data/heldout.jsonl.gz'
    >>> resolve_data_reference("org/dataset:config")
    'org/dataset:config'
    ```
    """
    if data != "pocket" or Path(data).exists():
        return data
    return str(data_path(split))


def _iter_hub_dataset(name: str, text_field: str) -> Iterator[str]:
    import datasets

    config = None
    if ":" in name:  # "org/dataset:config"
        name, config = name.split(":", 1)
    logger.info("streaming calibration data from dataset %s (config %s)", name, config)
    try:
        stream = datasets.load_dataset(name, config, split="train", streaming=True)
    except Exception as err:  # offline, unknown name, ...: say what to do instead
        raise CalibrationDataError(
            f"could not stream dataset {name!r} ({type(err).__name__}: {err}). Offline, pass local data: a list "
            "of strings, a .txt/.jsonl file or folder, or a datasets.Dataset."
        ) from err
    yield from _iter_dataset(stream, text_field)


def token_windows(
    data: Any,
    tokenizer,
    num_sequences: int,
    seq_len: int,
    *,
    text_field: str = "text",
) -> torch.Tensor:
    """Tokenises documents into up to `num_sequences` windows of exactly `seq_len` tokens.

    Documents are joined with the tokenizer's EOS token so no window is padded. Fewer windows than asked for is
    allowed (logged); none at all raises `CalibrationDataError`.

    Returns:
        `torch.LongTensor` of shape `(num_windows, seq_len)`.

    Example:

    ```python
    >>> windows = token_windows(["some text " * 200], tokenizer, num_sequences=4, seq_len=64)  # doctest: +SKIP
    >>> windows.shape  # doctest: +SKIP
    torch.Size([4, 64])
    ```
    """
    if num_sequences < 1 or seq_len < 2:
        raise InvalidInputError(
            f"num_sequences must be ≥ 1 and seq_len ≥ 2, got num_sequences={num_sequences} and seq_len={seq_len}"
        )
    eos = tokenizer.eos_token_id
    needed = num_sequences * seq_len
    buffer: list[int] = []
    saw_text = False
    for text in iter_texts(data, text_field):
        if not text or not text.strip():
            continue
        saw_text = True
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        buffer.extend(ids)
        if eos is not None:
            buffer.append(eos)
        if len(buffer) >= needed:
            break
    if not saw_text:
        raise CalibrationDataError("calibration data is empty: no non-blank documents")
    num_windows = min(num_sequences, len(buffer) // seq_len)
    if num_windows == 0:
        raise CalibrationDataError(
            f"calibration data has {len(buffer)} tokens, fewer than one window of seq_len={seq_len}"
        )
    if num_windows < num_sequences:
        logger.warning(
            "calibration data gave %d windows of %d tokens (asked for %d)", num_windows, seq_len, num_sequences
        )
    return torch.tensor(list(itertools.islice(buffer, num_windows * seq_len)), dtype=torch.long).view(
        num_windows, seq_len
    )


def describe_data(data: Any) -> str:
    """A short provenance string for the config (`"list[str] (12 documents)"`, a path, or a dataset name)."""
    if isinstance(data, (list, tuple)):
        return f"list[str] ({len(data)} documents)"
    if isinstance(data, (str, os.PathLike)):
        return str(data)
    info = getattr(data, "info", None)
    name = getattr(info, "dataset_name", None) or getattr(data, "builder_name", None)
    return f"datasets:{name}" if name else type(data).__name__
