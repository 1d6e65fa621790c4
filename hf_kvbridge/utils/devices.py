"""Where a model computes: its execution device (accelerate's offloading hooks included), its decoder layers and each
decoder layer's device under a `device_map`."""

from __future__ import annotations

import re

import torch
from torch import nn


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


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a causal LM (`model.model.layers`)."""
    base = getattr(model, "model", model)
    return base.layers
