"""Finding and loading the two models of a bridge and its checkpoint: model references (Hub id, path,
`pocket/<name>`), a checkpoint folder (local or a Hub snapshot) and its raw config; where the models compute is
`hf_kvbridge.utils.devices`. Reading a checkpoint's config needs no mapper code (the vLLM scheduler and the lm-eval
model read it before any torch module), which is why it lives here rather than in `persistence`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from huggingface_hub import snapshot_download
from transformers import AutoModelForCausalLM, PreTrainedModel

from .constants import CONFIG_NAME, HUB_FILE_PATTERNS
from .errors import CheckpointFileError, CheckpointNotFoundError, InvalidInputError
from .pocket import POCKET_MODELS, model_path


def resolve_model_reference(name_or_path: str) -> str:
    """Turns a checkpoint's model reference into something `from_pretrained` loads.

    Precedence, first match wins:

    1. an existing local path is returned unchanged, so a local folder `pocket/pocket-s` is loaded, not the shipped
       model of that name;
    2. `pocket/<name>` with `<name>` one of `hf_kvbridge.pocket.POCKET_MODELS` is the shipped pocket model's folder;
    3. anything else is returned unchanged: a Hub id (`pocket/<other name>` included: a Hub organisation called
       `pocket` stays reachable) or a path for `from_pretrained` to report.

    Example:

    ```python
    >>> resolve_model_reference("pocket/pocket-s")  # doctest: +SKIP
    '/.../hf_kvbridge/pocket/models/pocket-s'
    >>> resolve_model_reference("pocket/some-hub-model")
    'pocket/some-hub-model'
    ```
    """
    if Path(name_or_path).exists():
        return name_or_path
    prefix, _, name = name_or_path.partition("/")
    if prefix == "pocket" and name in POCKET_MODELS:
        return str(model_path(name))
    return name_or_path


def model_reference(model: PreTrainedModel) -> str:
    """The id a checkpoint records for `model`: its Hub id, `pocket/<name>` for shipped pocket models, or a path.

    A local folder whose relative path reads like a shipped model (`pocket/pocket-s` in the working directory) is
    recorded as its absolute path, so that loading the checkpoint elsewhere does not pick the shipped model.
    """
    name = model.config.name_or_path or ""
    if not name or not Path(name).is_dir():
        return name
    for pocket_name in POCKET_MODELS:
        try:
            if Path(name).resolve() == model_path(pocket_name).resolve():
                return f"pocket/{pocket_name}"
        except FileNotFoundError:  # not installed in this build
            continue
    prefix, _, rest = name.partition("/")
    if prefix == "pocket" and rest in POCKET_MODELS:
        return str(Path(name).resolve())
    return name


def load_model(name_or_path: str, revision: str | None = None, **load_kwargs: Any) -> PreTrainedModel:
    """Loads a source/target model by its recorded reference (Hub id, local path or `pocket/<name>`)."""
    if not name_or_path:
        raise InvalidInputError(
            "the checkpoint does not record this model (source_name_or_path/target_name_or_path is empty); pass "
            "the model itself as source_model= or target_model="
        )
    model = AutoModelForCausalLM.from_pretrained(
        resolve_model_reference(name_or_path), revision=revision, **load_kwargs
    )
    return model.eval()


# -- bridge checkpoints ----------------------------------------------------------------------------------------------
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

    Raises:
        [`CheckpointNotFoundError`]: the folder does not exist (for a path that can only be local: absolute, `./`,
            `~`, or more than one `/`), is not a checkpoint, or the Hub repo is neither cached nor reachable.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / CONFIG_NAME).is_file():
            raise CheckpointNotFoundError(
                f"{path} has no {CONFIG_NAME}; it is not a kvbridge checkpoint (make one with `kvbridge calibrate "
                f"... --out {path}` or `bridge.save_pretrained`)"
            )
        return path
    text = str(name_or_path)
    if path.exists():
        raise CheckpointNotFoundError(f"{text} is a file; a bridge checkpoint is a folder holding {CONFIG_NAME}")
    if text.startswith((".", "/", "~")) or "\\" in text or text.count("/") > 1:  # cannot be a Hub repo id
        raise CheckpointNotFoundError(
            f"bridge checkpoint folder {text} does not exist; check the path, or make it with `kvbridge calibrate "
            f"SOURCE TARGET --out {text}`"
        )
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        snapshot = snapshot_download(
            text,
            revision=revision,
            cache_dir=cache_dir,
            local_files_only=local_files_only,
            token=token,
            force_download=force_download,
            allow_patterns=HUB_FILE_PATTERNS,
        )
    except (HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError) as err:
        offline = " (offline: not in the local Hub cache)" if isinstance(err, LocalEntryNotFoundError) else ""
        raise CheckpointNotFoundError(
            f"bridge checkpoint {text} not found: no folder {text} here, and no Hub repository {text}{offline}; "
            f"check the name, or make it with `kvbridge calibrate SOURCE TARGET --out {text}`"
        ) from err
    return Path(snapshot)


def read_config_dict(folder: str | os.PathLike) -> dict[str, Any]:
    """The raw `config.json` of a checkpoint folder (with `mapper_sha256`, which `KVBridgeConfig` does not keep)."""
    path = Path(folder) / CONFIG_NAME
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointFileError(
            f"cannot read the bridge config {path}: {err}; the checkpoint is damaged or incomplete (download or "
            "save it again)"
        ) from err
