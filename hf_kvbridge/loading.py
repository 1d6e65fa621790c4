"""Finding and loading the two models of a bridge: model references (Hub id, path, `pocket/<name>`); where they
compute is `hf_kvbridge.utils.devices`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoModelForCausalLM, PreTrainedModel

from .errors import InvalidInputError
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
