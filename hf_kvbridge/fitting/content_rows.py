"""A model's cache as content-space rows: one row per token, per layer and head the key (RoPE stripped) then the
value, the form the statistics and the mappers' fits read (`hf_kvbridge.fitting.statistics`)."""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache

from ..utils.cache import cache_kwargs, cache_layer_kv, kv_to_rows, output_cache
from ..utils.rope import rotary_cos_sin, strip_rotary


@torch.no_grad()
def cache_rows(model: nn.Module, input_ids: torch.Tensor, device: torch.device | str | None = None):
    """Runs `model` on unpadded windows and returns its cache as content-space rows.

    Works with models sharded over devices (`device_map`), also with offloaded weights (`"disk"` in a `device_map`,
    `accelerate.cpu_offload`): each layer's rows are moved to `device` (defaults to the device of the first layer)
    before they are joined.

    Returns:
        `torch.Tensor` of shape `(batch·seq, layers·H·2d)`, float32: per layer and head, key (RoPE stripped), value.
    """
    return forward_rows(model, input_ids, device)[0]


@torch.no_grad()
def forward_rows(
    model: nn.Module, input_ids: torch.Tensor, device: torch.device | str | None = None, hidden: bool = False
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """`cache_rows` and, with `hidden=True`, the model's `output_hidden_states` of the same forward pass (`L + 1`
    tensors of `(batch, seq, hidden_size)`: entry `i` is what layer `i` receives, the last one the final output).

    Returns:
        `(rows, hidden_states)`: `rows` as `cache_rows` returns them, `hidden_states` `None` unless `hidden`.
    """
    if model.device.type != "meta":  # meta: weights offloaded by accelerate, whose hooks move the inputs
        input_ids = input_ids.to(model.device)
    # a plain DynamicCache keeps every token of every layer, sliding-window layers included (the model still masks
    # them to their window): each source layer's rows must exist for every token
    out = model(
        input_ids=input_ids,
        use_cache=True,
        **cache_kwargs(DynamicCache()),
        logits_to_keep=1,
        output_hidden_states=hidden,
    )
    batch, seq = input_ids.shape
    positions = torch.arange(seq, device=input_ids.device).unsqueeze(0).expand(batch, -1)
    cos, sin = rotary_cos_sin(model, positions)  # (B, T, d)
    rows = []
    for layer in range(len(output_cache(out).layers)):
        keys, values = cache_layer_kv(output_cache(out), layer)  # (B, H, T, d)
        device = device if device is not None else keys.device
        content = strip_rotary(keys.float(), cos.to(keys.device), sin.to(keys.device))
        rows.append(kv_to_rows(content, values.float()).to(device))
    return torch.cat(rows, dim=-1).view(batch * seq, -1), (out.hidden_states if hidden else None)  # (B·T, L·H·2d)
