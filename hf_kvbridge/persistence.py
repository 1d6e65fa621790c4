"""A bridge checkpoint on disk and on the Hub: saving and loading it, its (sharded, checksummed) mapper files.

Kept apart from the model class, as peft keeps `utils/save_and_load.py` apart from `PeftModel`; the class inherits
`save_pretrained`, `from_pretrained` and `push_to_hub` from `BridgeHubMixin` here. A checkpoint folder holds exactly:

- `config.json`: the [`KVBridgeConfig`], plus `mapper_sha256`: `{weight file name: sha256 hex digest}` for every
  mapper weight file, verified before the weights are read;
- the mapper weights: `mapper.safetensors`, or, above `max_shard_size`, `mapper-00001-of-0000N.safetensors` shards
  and `mapper.safetensors.index.json` (`{"metadata": {"total_size": ...}, "weight_map": {tensor: shard}}`, the
  layout transformers uses for `model.safetensors.index.json`);
- `residual.safetensors`: the residual map of layer recompute (`hf_kvbridge.transfer.layer_recompute`), when the bridge
  was calibrated with `recompute_layers` (its sha256 is in `mapper_sha256` too);
- `README.md`: the model card (`card.render_model_card`);
- the shared tokenizer's files (`tokenizer.json`, `tokenizer_config.json`, ...), when the bridge knows its tokenizer,
  so `AutoTokenizer.from_pretrained(bridge_dir)` works;
- `reverse/`: the target→source mapper of a bidirectional bridge, a checkpoint of its own.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, TypeVar

import torch
from huggingface_hub import HfApi, split_torch_state_dict_into_shards
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from .card import render_model_card
from .configuration import KVBridgeConfig
from .constants import (  # noqa: F401  the file patterns, read here by their old path too
    AUTO_LOAD_KWARGS,
    CHECKPOINT_FILE_PATTERNS,
    CONFIG_NAME,
    DEFAULT_MAX_SHARD_SIZE,
    HUB_FILE_PATTERNS,
    MAPPER_CHECKSUMS_KEY,
    MAPPER_SHARD_PATTERN,
    MAPPER_WEIGHTS_INDEX_NAME,
    MAPPER_WEIGHTS_NAME,
    MODEL_CARD_NAME,
    RESIDUAL_WEIGHTS_NAME,
    REVERSE_FOLDER,
    SHARD_GLOB,
    TOKENIZER_FILE_NAMES,
    WEIGHT_FILE_PATTERNS,
)
from .errors import (
    CheckpointExistsError,
    ConfigurationError,
    InvalidInputError,
    MapperFileError,
)
from .loading import (  # noqa: F401  checkpoint references live in `loading`; read here by their old path too
    load_model,
    read_config_dict,
    resolve_checkpoint,
    resolve_model_reference,
)
from .mappers import KVMapper, build_mapper, get_mapper_type
from .mappers.lazy import LazyKVMapper
from .mappers.residual import ResidualMapper
from .utils.layout import KVLayout, check_fingerprint
from .utils.precision import resolve_mapper_dtype
from .utils.source_features import required_format_version

logger = logging.getLogger(__name__)

T = TypeVar("T", bound="BridgeHubMixin")


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
            raise MapperFileError(f"mapper index {index_path} is unreadable: {err}") from err
        names = sorted(set(weight_map.values()))
    else:
        names = [MAPPER_WEIGHTS_NAME]
    for name in names:
        if not (folder / name).is_file():
            raise MapperFileError(f"mapper weights {folder / name} not found")
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
        raise MapperFileError(f"mapper weights {folder / unlisted[0]} have no sha256 in {CONFIG_NAME}")
    for name in names:
        actual = sha256_file(folder / name)
        if actual != checksums[name]:
            raise MapperFileError(
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
            raise MapperFileError(f"mapper weights {path} are corrupt or truncated: {err}") from err
        overlap = sorted(set(part) & set(state))
        if overlap:
            raise MapperFileError(f"mapper weights {path} repeat tensors of another shard: {overlap[:4]}")
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


# -- a bridge's parts: tokenizer, config, mapper files ----------------------------------------------------------------
def bridge_tokenizer(bridge):
    """The tokenizer a checkpoint carries: `bridge.tokenizer` when set, else the target's own when it loads from
    local files (a local folder, a `pocket/` model, or the Hub cache); `None` when there is none at hand."""
    tokenizer = getattr(bridge, "tokenizer", None)
    if tokenizer is not None:
        return tokenizer
    reference = bridge.config.target_name_or_path
    if not reference:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(
            resolve_model_reference(reference), revision=bridge.config.target_revision, local_files_only=True
        )
    except Exception as err:  # a target without tokenizer files, or not cached: the checkpoint is still valid
        logger.info("no tokenizer saved with the bridge (target %r: %s)", reference, err)
        return None


def read_checkpoint_config(folder: Path, config: KVBridgeConfig | None = None) -> tuple[KVBridgeConfig, dict | None]:
    """The checkpoint's config (or `config`, when given) and the mapper checksums its `config.json` records."""
    config_dict = read_config_dict(folder)
    checksums = config_dict.pop(MAPPER_CHECKSUMS_KEY, None)  # not a config field: verified on load, then dropped
    if config is None:
        config = KVBridgeConfig.from_dict(config_dict)
    if config.model_type != "kvbridge" or not config.selected_layers:
        raise ConfigurationError(
            f"{folder} is not a kvbridge checkpoint (its {CONFIG_NAME} has no kvbridge mapper); pass the folder "
            "`save_pretrained` or `kvbridge calibrate --out` wrote"
        )
    return config, checksums


def load_mapper(
    config: KVBridgeConfig, layout: KVLayout, folder: Path, checksums: dict | None, lazy: bool = False
) -> KVMapper:
    """The mapper a checkpoint folder holds, shaped by `config` and the target's `layout`.

    With `lazy=True` the weights stay on disk and one target layer's weights are read at a time while mapping
    (linear mappers only).
    """
    if lazy:
        if not get_mapper_type(config.mapper_type).linear:
            raise InvalidInputError(
                f"lazy_mapper=True reads linear mappers only, and this checkpoint holds a {config.mapper_type!r} "
                "mapper; load it with lazy_mapper=False"
            )
        files = [folder / name for name in verify_mapper_checksums(folder, checksums)]
        mapper = LazyKVMapper(
            config.selected_layers,
            head_mode=config.head_mode,
            files=files,
            kv_mode=config.kv_mode,
            **KVMapper.layout_kwargs(config, layout),
        )
        if getattr(config, "key_norm", False) and mapper.key_norm_gain is None:
            raise MapperFileError(f"mapper weights in {folder} lack key_norm_gain, which config.key_norm needs")
        return mapper
    mapper = build_mapper(config, layout)  # the class config.mapper_type names (ridge, mlp, ...)
    load_mapper_weights(mapper, folder, checksums)
    return mapper


def load_mapper_weights(mapper: KVMapper, path: Path, checksums: dict[str, str] | None = None) -> None:
    """Loads a checkpoint folder's mapper weights (one file or shards) into `mapper`.

    `path` is the checkpoint folder (or its single weights file). Every weight file is checked against `checksums`
    (`{file name: sha256}`, from `config.json`) before it is read. Errors name the file for missing, corrupt,
    tampered or mismatched weights.
    """
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    _load_checked(mapper, read_mapper_state(folder, checksums), f"mapper weights in {folder}")


def _load_checked(mapper: torch.nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    """Loads `state` into `mapper` after checking names, shapes and finiteness (errors name `what`)."""
    expected = mapper.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise MapperFileError(f"{what} do not fit the config: missing {missing[:4]}, unexpected {unexpected[:4]}")
    for key, tensor in state.items():
        if tensor.shape != expected[key].shape:
            raise MapperFileError(
                f"{what}: {key} has shape {tuple(tensor.shape)}, the config implies {tuple(expected[key].shape)}"
            )
        if not torch.isfinite(tensor).all():
            raise MapperFileError(f"{what}: {key} holds NaN/Inf")
        if key == "key_norm_gain" and bool((tensor == 0).any()):  # keys would be divided by it
            raise MapperFileError(f"{what}: {key} holds zeros; a key norm's gains are nonzero")
    mapper.load_state_dict(state)


def load_residual_mapper(config: KVBridgeConfig, folder: Path, checksums: dict | None) -> ResidualMapper | None:
    """The residual map of layer recompute a checkpoint folder holds (`residual.safetensors`, shaped by
    `config.residual_map`), after verifying its sha256; `None` when the checkpoint was calibrated without one."""
    if not getattr(config, "residual_map", None):
        return None
    path = Path(folder) / RESIDUAL_WEIGHTS_NAME
    if not path.is_file():
        raise MapperFileError(
            f"{path} not found, but {CONFIG_NAME} records a residual map (residual_map); download or save the "
            "checkpoint again"
        )
    if checksums:
        if RESIDUAL_WEIGHTS_NAME not in checksums:
            raise MapperFileError(f"residual map {path} has no sha256 in {CONFIG_NAME}")
        actual = sha256_file(path)
        if actual != checksums[RESIDUAL_WEIGHTS_NAME]:
            raise MapperFileError(
                f"residual map {path} fails its checksum: sha256 {actual}, {CONFIG_NAME} records "
                f"{checksums[RESIDUAL_WEIGHTS_NAME]} (a damaged or partial download, or a file replaced after saving)"
            )
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise MapperFileError(f"residual map {path} is corrupt or truncated: {err}") from err
    mapper = ResidualMapper.from_config(config)
    _load_checked(mapper, state, f"residual map {path}")
    return mapper


# -- a bridge: save, load, push ---------------------------------------------------------------------------------------
class BridgeHubMixin:
    """`save_pretrained`, `push_to_hub` and `from_pretrained` of a bridge, as transformers' `PushToHubMixin` and
    huggingface_hub's `ModelHubMixin` give them to a model: `KVBridgeForCausalLM` inherits them. `push_to_hub` stages
    what `save_pretrained` writes in a temporary folder and uploads it, so a class that stages a checkpoint otherwise
    (`hf_kvbridge.integrations.hub.SavedCheckpoint`, a saved one pushed without its models) overrides
    `save_pretrained` only. `save_pretrained` reads `config`, `mapper`, `reverse`, and `residual_mapper` and
    `tokenizer` where set; `from_pretrained` builds `cls(config, source, target, mapper, residual_mapper, ...)`.
    """

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        *,
        overwrite: bool = False,
        max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
        model_card_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """Writes `config.json`, the mapper weights and a `README.md` model card; never the models' weights.

        The mapper goes to `mapper.safetensors`, or, when larger than `max_shard_size` (e.g. `"2GB"`), to
        `mapper-0000i-of-0000N.safetensors` shards listed in `mapper.safetensors.index.json`. The sha256 of every
        weight file is recorded in `config.json` (`mapper_sha256`) and verified on load. `model_card_kwargs` go to
        `card.render_model_card` (`repo_id`, `eval_table`, `attention_cosine`).

        Refuses a non-empty directory unless `overwrite=True` (then only the bridge's own files are replaced, and
        weight files of an earlier save that this one does not write are removed).
        """
        save_directory = Path(save_directory)
        if save_directory.is_file():
            raise CheckpointExistsError(f"{save_directory} is a file; save the bridge into a folder (new or empty)")
        if save_directory.exists() and any(save_directory.iterdir()) and not overwrite:
            raise CheckpointExistsError(
                f"{save_directory} is not empty; pass overwrite=True to replace the bridge files in it "
                f"({CONFIG_NAME}, {MAPPER_WEIGHTS_NAME}, {MODEL_CARD_NAME})"
            )
        save_directory.mkdir(parents=True, exist_ok=True)
        # written into a temporary folder inside `save_directory` first, so a failure leaves the old files intact
        with tempfile.TemporaryDirectory(dir=save_directory, prefix=".tmp-kvbridge-") as tmp:
            tmp = Path(tmp)
            mapper = self.mapper  # a lazily loaded mapper holds meta tensors: its weights come from its files
            # the oldest format that reads this checkpoint: K/V-only bridges stay readable by every reader, one that
            # reads hidden states needs a reader that knows them (older ones refuse it: `configuration`)
            version = required_format_version(self.config)
            state = mapper.stored_state_dict() if isinstance(mapper, LazyKVMapper) else mapper.state_dict()
            checksums = save_mapper_weights(
                state,
                tmp,
                max_shard_size=max_shard_size,
                metadata={
                    "format": "pt",
                    "format_version": str(version),
                    "mapper_type": self.config.mapper_type,
                },
            )
            residual = getattr(self, "residual_mapper", None)
            if residual is not None:  # the residual map of layer recompute, one small file beside the mapper
                save_file(
                    {k: v.detach().to("cpu").contiguous() for k, v in sorted(residual.state_dict().items())},
                    tmp / RESIDUAL_WEIGHTS_NAME,
                    metadata={"format": "pt", "format_version": str(version)},
                )
                checksums[RESIDUAL_WEIGHTS_NAME] = sha256_file(tmp / RESIDUAL_WEIGHTS_NAME)
            self.config.save_pretrained(tmp)
            config_dict = json.loads((tmp / CONFIG_NAME).read_text(encoding="utf-8"))
            config_dict[MAPPER_CHECKSUMS_KEY] = checksums
            config_dict["format_version"] = version
            (tmp / CONFIG_NAME).write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n", encoding="utf-8")
            render_model_card(self.config, **(model_card_kwargs or {})).save(tmp / MODEL_CARD_NAME)
            # safetensors writes its files 0600; give them the mode the umask gives every other file here (0644)
            for name in checksums:
                (tmp / name).chmod((tmp / CONFIG_NAME).stat().st_mode & 0o777)
            tokenizer = bridge_tokenizer(self)
            if tokenizer is not None:
                for name in tokenizer.save_pretrained(tmp):
                    if Path(name).name not in TOKENIZER_FILE_NAMES:  # only the tokenizer's own files travel
                        Path(name).unlink(missing_ok=True)
            if self.reverse is not None:  # the target→source mapper, in a folder of its own
                self.reverse.save_pretrained(tmp / REVERSE_FOLDER, max_shard_size=max_shard_size)
            written = {p.name for p in tmp.iterdir()}
            remove_stale_weight_files(save_directory, keep=written)
            if (save_directory / REVERSE_FOLDER).is_dir():  # a reverse mapper of an earlier save (overwrite=True)
                shutil.rmtree(save_directory / REVERSE_FOLDER)
            for name in sorted(written):
                os.replace(tmp / name, save_directory / name)

    def push_to_hub(
        self,
        repo_id: str,
        *,
        revision: str | None = None,
        private: bool | None = None,
        token: str | bool | None = None,
        commit_message: str | None = None,
        create_pr: bool = False,
        max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
        model_card_kwargs: dict[str, Any] | None = None,
    ):
        r"""Uploads exactly what `save_pretrained` writes (config, mapper weights, card) to `repo_id`, in one commit.

        Creates the repo if needed (`exist_ok=True`), saves into a temporary folder and uploads it with one
        `upload_folder` call; mapper weight files of an earlier push that are no longer part of the checkpoint
        (e.g. old shards) are deleted in the same commit. The source and target weights are never uploaded.

        Args:
            repo_id (`str`): `"org/name"` on the Hub.
            revision (`str`, *optional*): branch to commit to.
            private (`bool`, *optional*): visibility of a newly created repo.
            token (`str` or `bool`, *optional*): Hub token (defaults to the logged-in one).
            commit_message (`str`, *optional*), create_pr (`bool`, *optional*, defaults to `False`): as in
                `HfApi.upload_folder`.
            max_shard_size (`int` or `str`, *optional*, defaults to `"2GB"`): shard the mapper above this size.

        Returns:
            `CommitInfo` of the commit.

        Example:

        ```python
        >>> bridge.push_to_hub("me/qwen3-14b-to-32b")  # doctest: +SKIP
        >>> bridge = KVBridgeForCausalLM.from_pretrained("me/qwen3-14b-to-32b")  # doctest: +SKIP
        ```
        """
        card_kwargs = {"repo_id": repo_id, **(model_card_kwargs or {})}
        with tempfile.TemporaryDirectory(prefix="kvbridge-push-") as tmp:
            self.save_pretrained(tmp, max_shard_size=max_shard_size, model_card_kwargs=card_kwargs)
            folder = Path(tmp)  # its checksums are verified before anything reaches the Hub
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
                # old weight files, and a `reverse/` of an earlier bidirectional push that this checkpoint does not
                # replace (`from_pretrained` would attach it): files uploaded in this commit are kept
                delete_patterns=[*WEIGHT_FILE_PATTERNS, f"{REVERSE_FOLDER}/*"],
            )

    @classmethod
    def from_pretrained(
        cls: type[T],
        pretrained_model_name_or_path: str | os.PathLike,
        source_model: PreTrainedModel | None = None,
        target_model: PreTrainedModel | None = None,
        *,
        config: KVBridgeConfig | None = None,
        revision: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        local_files_only: bool = False,
        token: str | bool | None = None,
        force_download: bool = False,
        lazy_mapper: bool = False,
        mapper_dtype: torch.dtype | str | None = None,
        **load_kwargs: Any,
    ) -> T:
        r"""Loads a bridge checkpoint and its two models.

        Args:
            pretrained_model_name_or_path (`str` or `os.PathLike`): a local folder or a Hub repo id.
            source_model, target_model ([`PreTrainedModel`], *optional*): already loaded models; otherwise they are
                loaded from the ids and revisions recorded in the config.
            revision (`str`, *optional*): revision of the bridge repo on the Hub.
            lazy_mapper (`bool`, *optional*, defaults to `False`): keep the mapper's weights on disk and load one
                target layer's weights at a time while mapping (for mappers too large to hold in memory).
            mapper_dtype (`torch.dtype` or `str`, *optional*): as in the constructor; `"auto"` by default.
            load_kwargs: passed to `AutoModelForCausalLM.from_pretrained` for the two models (`torch_dtype`,
                `dtype`, `device_map`, ...).

        Example:

        ```python
        >>> bridge = KVBridgeForCausalLM.from_pretrained("my-bridge", torch_dtype=torch.bfloat16)  # doctest: +SKIP
        ```
        """
        for key in AUTO_LOAD_KWARGS:
            load_kwargs.pop(key, None)
        resolve_mapper_dtype(torch.float32, "cpu", mapper_dtype)  # a bad mapper_dtype is named before any loading
        folder = resolve_checkpoint(
            pretrained_model_name_or_path,
            revision=revision,
            cache_dir=cache_dir,
            local_files_only=local_files_only,
            token=token,
            force_download=force_download,
        )
        config, checksums = read_checkpoint_config(folder, config)
        if source_model is None:
            source_model = load_model(config.source_name_or_path, config.source_revision, **load_kwargs)
        if target_model is None:
            target_model = load_model(config.target_name_or_path, config.target_revision, **load_kwargs)
        layout = KVLayout.from_config(target_model.config)
        # the models are checked against the checkpoint before its mapper, shaped by their layouts, is read
        for role, model, fingerprint in (
            ("source", source_model, config.source_fingerprint),
            ("target", target_model, config.target_fingerprint),
        ):
            if fingerprint is not None:
                name = getattr(config, f"{role}_name_or_path") or model.config.name_or_path
                check_fingerprint(fingerprint, KVLayout.from_config(model.config), role, name)
        mapper = load_mapper(config, layout, folder, checksums, lazy=lazy_mapper)
        residual_mapper = load_residual_mapper(config, folder, checksums)  # None without layer recompute
        bridge = cls(config, source_model, target_model, mapper, residual_mapper, mapper_dtype=mapper_dtype)
        bridge.config.name_or_path = str(pretrained_model_name_or_path)
        if (folder / REVERSE_FOLDER / CONFIG_NAME).is_file():
            bridge.reverse = cls.from_pretrained(
                folder / REVERSE_FOLDER, source_model=target_model, target_model=source_model
            )
        return bridge
