"""Control caches: K/V of the context's length that carry no information about it, the baselines every retention
figure is read against.

- `zero_cache`: every key and value zero. Each context position then gets attention logit 0 and adds nothing to the
  output, so the target decodes roughly as with no context (not exactly: the zero rows still take a share of the
  softmax's mass);
- `random_cache`: Gaussian keys and values scaled to the mapped cache's RMS per layer, row and KV head, so the
  target sees caches of the right size and spread that say nothing about the text.

A study of cross-model cache transfer found such caches reproducing most of the teacher-forced gain on some tasks: a
bridge whose retention a control comes within `CONTROL_MARGIN` of transfers little, and is flagged wherever retention
is reported (`kvbridge eval`, `kvbridge demo`, `continuation_nll(..., controls=True)`, lm-eval's `mode=`).
"""

from __future__ import annotations

import math

import torch
from transformers import Cache

from .constants import CONTROL_MODES
from .errors import InvalidInputError
from .utils.cache import replace_layer_kv

__all__ = ["CONTROL_MARGIN", "CONTROL_MODES", "control_cache", "controls_flag"]
# a control whose retention comes within this of the bridge's flags the bridge's figure
CONTROL_MARGIN = 0.1


@torch.no_grad()
def control_cache(cache: Cache, mode: str, attention_mask: torch.Tensor | None = None, seed: int = 0) -> Cache:
    """Replaces every layer's keys and values of `cache` by a control of the same shape, in place; returns `cache`.

    Args:
        cache (`Cache`): a mapped target cache (`(batch, kv_heads, seq, head_dim)` per layer).
        mode (`str`): `"zero_cache"` or `"random_cache"`.
        attention_mask (`torch.Tensor` of shape `(batch, seq)`, *optional*): 1 for real tokens. With it the random
            control matches the RMS of the real columns only and leaves padding columns zero.
        seed (`int`, *optional*, defaults to `0`): seed of the random control's noise.
    """
    if mode not in CONTROL_MODES:
        raise InvalidInputError(f"control mode must be one of {CONTROL_MODES}, got {mode!r}")
    generator = torch.Generator().manual_seed(seed)
    for layer in cache.layers:
        written = []
        for tensor in (layer.keys, layer.values):  # (B, H, T, d)
            if mode == "zero_cache":
                written.append(torch.zeros_like(tensor))
                continue
            noise = torch.randn(tensor.shape, generator=generator).to(tensor)
            if attention_mask is None:
                real = torch.ones(tensor.shape[0], 1, tensor.shape[2], 1, device=tensor.device)
            else:  # a sliding-window layer holds the last T columns
                real = attention_mask[:, -tensor.shape[2] :].to(tensor.device, torch.float32)[:, None, :, None]
            count = real.sum((2, 3), keepdim=True).clamp_min(1) * tensor.shape[-1]  # (B, 1, 1, 1)
            rms = (tensor.float().pow(2) * real).sum((2, 3), keepdim=True).div(count).sqrt()  # (B, H, 1, 1)
            noise_rms = (noise.float().pow(2) * real).sum((2, 3), keepdim=True).div(count).sqrt()
            written.append((noise * real * rms / noise_rms.clamp_min(1e-12)).to(tensor.dtype))
        replace_layer_kv(layer, *written)
    return cache


def controls_flag(retention: float | None, control_retention: dict[str, float | None]) -> bool | None:
    """Whether a control's retention comes within `CONTROL_MARGIN` of `retention` (the figure transfers little).

    `None` when `retention` or every control's is undefined (`None` or NaN).

    Example:

    ```python
    >>> controls_flag(0.8, {"zero_cache": 0.15, "random_cache": 0.2})
    False
    >>> controls_flag(0.3, {"zero_cache": 0.25, "random_cache": 0.1})
    True
    ```
    """
    values = [v for v in control_retention.values() if v is not None and not math.isnan(v)]
    if retention is None or math.isnan(retention) or not values:
        return None
    return max(values) >= retention - CONTROL_MARGIN
