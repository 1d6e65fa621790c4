"""A bridge checkpoint on disk and on the Hub: resolving it, its (sharded, checksummed) mapper files, its model card,
and pushing it in one commit.

A checkpoint folder holds exactly:

- `config.json`: the [`KVBridgeConfig`], plus `mapper_sha256`: `{weight file name: sha256 hex digest}` for every
  mapper weight file, verified before the weights are read;
- the mapper weights: `mapper.safetensors`, or, above `max_shard_size`, `mapper-00001-of-0000N.safetensors` shards
  and `mapper.safetensors.index.json` (`{"metadata": {"total_size": ...}, "weight_map": {tensor: shard}}`, the
  layout transformers uses for `model.safetensors.index.json`);
- `README.md`: the model card rendered from `model_cards/kvbridge.md`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import HfApi, ModelCard, ModelCardData, snapshot_download, split_torch_state_dict_into_shards
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..configuration import KVBridgeConfig
from ..constants import (
    CONFIG_NAME,
    DEFAULT_MAX_SHARD_SIZE,
    LIBRARY_NAME,
    MAPPER_CHECKSUMS_KEY,
    MAPPER_SHARD_PATTERN,
    MAPPER_WEIGHTS_INDEX_NAME,
    MAPPER_WEIGHTS_NAME,
    MODEL_CARD_NAME,
    REVERSE_FOLDER,
)

logger = logging.getLogger(__name__)

CARD_TEMPLATE = "kvbridge.md"
CARD_TAGS = ["kv-cache", "kvbridge", "prefill-reuse"]
SHARD_GLOB = "mapper-*-of-*.safetensors"
# every file a checkpoint may hold; pushes upload these and nothing else
WEIGHT_FILE_PATTERNS = [MAPPER_WEIGHTS_NAME, MAPPER_WEIGHTS_INDEX_NAME, SHARD_GLOB]
CHECKPOINT_FILE_PATTERNS = [CONFIG_NAME, MODEL_CARD_NAME, *WEIGHT_FILE_PATTERNS]
# what travels to and from the Hub: the checkpoint, and the reverse mapper of a bidirectional one
HUB_FILE_PATTERNS = [*CHECKPOINT_FILE_PATTERNS, f"{REVERSE_FOLDER}/*"]
# the retention table sits between these markers in the card, so it survives re-rendering (`kvbridge push`)
EVAL_TABLE_START, EVAL_TABLE_END = "<!-- kvbridge-eval-table -->", "<!-- /kvbridge-eval-table -->"


def _mapper_file_error(message: str) -> OSError:
    from ..modeling import MapperFileError  # modeling imports this module lazily; keep the cycle one-way at import

    return MapperFileError(message)


# -- resolving -------------------------------------------------------------------------------------------------------
def resolve_checkpoint(
    name_or_path: str | os.PathLike,
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    local_files_only: bool = False,
    token: str | bool | None = None,
    force_download: bool = False,
) -> Path:
    """A local folder holding the checkpoint: `name_or_path` itself, or a snapshot from the Hub cache.

    Honours `HF_HUB_OFFLINE` (through huggingface_hub): offline, only what is already cached resolves.
    """
    path = Path(name_or_path)
    if path.is_dir():
        if not (path / CONFIG_NAME).is_file():
            raise FileNotFoundError(f"{path} has no {CONFIG_NAME}; it is not a kvbridge checkpoint")
        return path
    snapshot = snapshot_download(
        str(name_or_path),
        revision=revision,
        cache_dir=cache_dir,
        local_files_only=local_files_only,
        token=token,
        force_download=force_download,
        allow_patterns=HUB_FILE_PATTERNS,
    )
    return Path(snapshot)


def read_config_dict(folder: str | os.PathLike) -> dict[str, Any]:
    """The raw `config.json` of a checkpoint folder (with `mapper_sha256`, which `KVBridgeConfig` does not keep)."""
    path = Path(folder) / CONFIG_NAME
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise OSError(f"cannot read the bridge config {path}: {err}") from err


# -- mapper weight files ----------------------------------------------------------------------------------------------
def sha256_file(path: str | os.PathLike, chunk_size: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_size):
            digest.update(block)
    return digest.hexdigest()


def save_mapper_weights(
    state_dict: dict[str, torch.Tensor],
    folder: str | os.PathLike,
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    metadata: dict[str, str] | None = None,
) -> dict[str, str]:
    """Writes the mapper weights into `folder` (one file, or shards + index above `max_shard_size`).

    Returns:
        `dict[str, str]`: `{weight file name: sha256}` of every safetensors file written (the index is plain JSON
        and is checked against the shards' own headers on load instead).
    """
    folder = Path(folder)
    state = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
    split = split_torch_state_dict_into_shards(
        state, filename_pattern=MAPPER_SHARD_PATTERN, max_shard_size=max_shard_size
    )
    checksums = {}
    for filename, keys in split.filename_to_tensors.items():
        save_file({k: state[k] for k in sorted(keys)}, folder / filename, metadata=metadata)  # deterministic bytes
        checksums[filename] = sha256_file(folder / filename)
    if split.is_sharded:
        index = {"metadata": {**split.metadata, **(metadata or {})}, "weight_map": split.tensor_to_filename}
        (folder / MAPPER_WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return checksums


def mapper_weight_files(folder: str | os.PathLike) -> list[str]:
    """Names of the mapper's safetensors files in a checkpoint folder: the shards listed in the index, or the single
    file. Raises `MapperFileError` for an unreadable index or a missing file."""
    folder = Path(folder)
    index_path = folder / MAPPER_WEIGHTS_INDEX_NAME
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as err:
            raise _mapper_file_error(f"mapper index {index_path} is unreadable: {err}") from err
        names = sorted(set(weight_map.values()))
    else:
        names = [MAPPER_WEIGHTS_NAME]
    for name in names:
        if not (folder / name).is_file():
            raise _mapper_file_error(f"mapper weights {folder / name} not found")
    return names


def verify_mapper_checksums(folder: str | os.PathLike, checksums: dict[str, str] | None) -> list[str]:
    """Checks every mapper weight file against the sha256 recorded in `config.json`; returns the file names.

    A checkpoint without recorded checksums (saved before they existed) is accepted with a log message.
    """
    folder = Path(folder)
    names = mapper_weight_files(folder)
    if not checksums:
        logger.info("%s records no mapper checksums; weight files are not verified", folder / CONFIG_NAME)
        return names
    unlisted = [name for name in names if name not in checksums]
    if unlisted:
        raise _mapper_file_error(f"mapper weights {folder / unlisted[0]} have no sha256 in {CONFIG_NAME}")
    for name in names:
        actual = sha256_file(folder / name)
        if actual != checksums[name]:
            raise _mapper_file_error(
                f"mapper weights {folder / name} fail their checksum: sha256 {actual}, {CONFIG_NAME} records "
                f"{checksums[name]} (a damaged or partial download, or a file replaced after saving)"
            )
    return names


def read_mapper_state(folder: str | os.PathLike, checksums: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """The mapper's tensors from a checkpoint folder (one file or shards), after verifying their checksums."""
    folder = Path(folder)
    state: dict[str, torch.Tensor] = {}
    for name in verify_mapper_checksums(folder, checksums):
        path = folder / name
        try:
            part = load_file(str(path))
        except (SafetensorError, OSError, ValueError) as err:
            raise _mapper_file_error(f"mapper weights {path} are corrupt or truncated: {err}") from err
        overlap = sorted(set(part) & set(state))
        if overlap:
            raise _mapper_file_error(f"mapper weights {path} repeat tensors of another shard: {overlap[:4]}")
        state.update(part)
    return state


def remove_stale_weight_files(folder: str | os.PathLike, keep: set[str]) -> None:
    """Deletes mapper weight files of an earlier save (e.g. shards after a save into one file) not in `keep`."""
    folder = Path(folder)
    for pattern in WEIGHT_FILE_PATTERNS:
        for path in folder.glob(pattern):
            if path.name not in keep and path.is_file():
                path.unlink()


def checkpoint_files(folder: str | os.PathLike) -> list[str]:
    """The names of a checkpoint's own files present in `folder` (what a push uploads)."""
    folder = Path(folder)
    names = {p.name for pattern in CHECKPOINT_FILE_PATTERNS for p in folder.glob(pattern) if p.is_file()}
    return sorted(names)


# -- the Hub ---------------------------------------------------------------------------------------------------------
def push_folder_to_hub(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    revision: str | None = None,
    private: bool | None = None,
    token: str | bool | None = None,
    commit_message: str | None = None,
    create_pr: bool = False,
):
    """Uploads a checkpoint folder's own files to `repo_id` in one commit (as `ModelHubMixin.push_to_hub` does).

    The repo is created if needed (`exist_ok=True`). Mapper weight files of an earlier push that this checkpoint does
    not hold (e.g. old shards) are deleted in the same commit. The folder's checksums are verified first.

    Returns:
        `CommitInfo` of the commit (or of the pull request with `create_pr=True`).
    """
    folder = Path(folder)
    verify_mapper_checksums(folder, read_config_dict(folder).get(MAPPER_CHECKSUMS_KEY))
    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True, token=token).repo_id
    return api.upload_folder(
        repo_id=repo_id,
        folder_path=folder,
        commit_message=commit_message or "Upload kvbridge mapper",
        revision=revision,
        create_pr=create_pr,
        token=token,
        allow_patterns=HUB_FILE_PATTERNS,
        delete_patterns=WEIGHT_FILE_PATTERNS,
    )


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


# -- the model card --------------------------------------------------------------------------------------------------
def _mean(values: list[float] | None) -> float | None:
    return sum(values) / len(values) if values else None


def read_eval_table(card_text: str) -> str | None:
    """The retention table `kvbridge eval` wrote into a card, if any (so re-rendering the card keeps it)."""
    match = re.search(re.escape(EVAL_TABLE_START) + r"\n(.*?)\n" + re.escape(EVAL_TABLE_END), card_text, re.S)
    return match.group(1).strip() if match else None


def render_model_card(
    config: KVBridgeConfig,
    repo_id: str | None = None,
    eval_table: str | None = None,
    attention_cosine: list[float] | None = None,
) -> ModelCard:
    r"""The README model card of a bridge checkpoint, from the Jinja template in `model_cards/`.

    Args:
        config ([`KVBridgeConfig`]): the bridge's config (pair, mapper settings, provenance, held-out R²).
        repo_id (`str`, *optional*): the Hub repo the card describes (used in the usage snippet).
        eval_table (`str`, *optional*): a Markdown retention table, as `kvbridge eval` prints it.
        attention_cosine (`list[float]`, *optional*): attention-output cosine per target layer
            (`hf_kvbridge.tools.diagnostics.attention_output_cosine`).

    Example:

    ```python
    >>> card = render_model_card(bridge.config, repo_id="me/qwen3-14b-to-32b")  # doctest: +SKIP
    >>> card.data.library_name  # doctest: +SKIP
    'hf-kvbridge'
    ```
    """
    base_models = [m for m in (config.source_name_or_path, config.target_name_or_path) if m]
    card_data = ModelCardData(
        library_name=LIBRARY_NAME,
        base_model=base_models or None,
        tags=list(CARD_TAGS),
        pipeline_tag="text-generation",
    )
    r2 = config.heldout_r2 or {}
    r2_summary = None
    if r2.get("k") and r2.get("v"):
        r2_summary = {
            "k": f"{_mean(r2['k']):.3f}",
            "v": f"{_mean(r2['v']):.3f}",
            "k_min": f"{min(r2['k']):.3f}",
            "v_min": f"{min(r2['v']):.3f}",
        }
    cosine_summary = None
    if attention_cosine:
        cosine_summary = {"mean": f"{_mean(attention_cosine):.4f}", "min": f"{min(attention_cosine):.4f}"}
    source_fp, target_fp = config.source_fingerprint or {}, config.target_fingerprint or {}
    template = resources.files("hf_kvbridge.model_cards").joinpath(CARD_TEMPLATE).read_text(encoding="utf-8")
    return ModelCard.from_template(
        card_data,
        template_str=template,
        source=config.source_name_or_path,
        target=config.target_name_or_path,
        source_revision=config.source_revision or "(default)",
        target_revision=config.target_revision or "(default)",
        source_layers=source_fp.get("num_layers", "?"),
        target_layers=target_fp.get("num_layers", "?"),
        kv_heads=target_fp.get("num_kv_heads", "?"),
        head_dim=target_fp.get("head_dim", "?"),
        repo_id=repo_id or "path/to/this-bridge",
        mapper_type=config.mapper_type,
        head_mode=config.head_mode,
        top_k=config.top_k,
        ridge_lambda=config.ridge_lambda,
        hold_back=config.hold_back,
        calibration=config.calibration or {},
        r2_summary=r2_summary,
        cosine_summary=cosine_summary,
        eval_table=eval_table,
        eval_table_start=EVAL_TABLE_START,
        eval_table_end=EVAL_TABLE_END,
    )
