"""Finding and loading the two models of a bridge: model references (Hub id, path, `pocket/<name>`) and devices."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from .errors import InvalidInputError
from .pocket import POCKET_MODELS, model_path


def execution_device(model: nn.Module) -> torch.device:
    """The device `model` computes on: `model.device`, or, when accelerate offloads its weights (`model.device` is
    `meta`), the execution device of its offloading hooks."""
    device = model.device
    if device.type != "meta":
        return device
    for module in model.modules():
        hook_device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
        if hook_device is not None:
            return torch.device(hook_device)
    return torch.device("cpu")


def layer_devices(model: nn.Module, num_layers: int) -> list[torch.device]:
    """The device each decoder layer of `model` computes on, for a model split over devices by a `device_map`.

    Read from `model.hf_device_map` as transformers and peft do (`map_cache_to_layer_device_map`): the longest
    entry that is a prefix of the layer's module name wins; layers offloaded to `"cpu"` or `"disk"` execute on the
    model's main device (the first accelerator in the map). Without a device map, every layer is on
    `execution_device(model)`.

    Example:

    ```python
    >>> model.hf_device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1}  # doctest: +SKIP
    >>> layer_devices(model, 2)  # doctest: +SKIP
    [device(type='cuda', index=0), device(type='cuda', index=1)]
    ```
    """
    device_map = getattr(model, "hf_device_map", None)
    if not device_map:
        return [execution_device(model)] * num_layers

    def as_device(device) -> torch.device:
        if isinstance(device, int):  # an accelerator index, as accelerate writes it
            accelerator = torch.accelerator.current_accelerator()
            return torch.device(accelerator.type if accelerator is not None else "cuda", device)
        return torch.device(device)

    accelerators = [d for d in device_map.values() if d not in ("cpu", "disk")]
    main = as_device(accelerators[0]) if accelerators else execution_device(model)

    def resolve(device) -> torch.device:
        return main if device in ("cpu", "disk") else as_device(device)

    devices = []
    for idx in range(num_layers):
        # the entry of the layer itself, or of its attention (where the cache is read), most specific first
        layer = re.compile(rf"(^|\.)layers\.{idx}(\.self_attn(\..*)?)?$")
        owners = [name for name in device_map if layer.search(name)]
        devices.append(resolve(device_map[max(owners, key=len)]) if owners else main)
    return devices


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
