"""Mapped keys put back where the target's keys live: on its key norm's sphere.

Targets such as Qwen3 and Gemma 3 normalise every key head before the rotary embedding (`self_attn.k_norm`, an
RMSNorm over `head_dim`): each content-space key is `k = g ⊙ x / rms(x)` for the norm's gain `g`, so
`rms(k / g) = 1` for every token and head. A linear map does not keep that: ridge regresses towards the mean, and on
the pocket family the mapped keys' `rms(k / g)` is 0.86–0.97 on average and down to 0.73 at the 10th percentile,
which flattens the target's attention on the tokens the map is least sure of. `project_keys` rescales each mapped
key head to `rms(k / g) = 1` (its direction kept): no weights, one reduction and one product per key head, so the
bridge's runtime cost is unchanged. On the target's own keys it is the identity (up to the norm's `eps`), so a
bridge whose source is its target still reproduces the target.

`key_norm_gains(model)` reads the gains off a model once, at calibration (they are stored with the mapper: a served
bridge's target holds no weights). Measured in `docs/distillation.md`.
"""

from __future__ import annotations

import torch
from torch import nn

from ..constants import KEY_NORM_FORMAT_VERSION
from .devices import decoder_layers

# the input `key_norm_gains` feeds each norm: large, so that `rms(x)² + eps` is `rms(x)²` to float32's precision
_PROBE = 1e3
_SCRATCH_BYTES = 2**28  # `project_keys`' scratch per group of layers


def key_norm_gains(model: nn.Module) -> torch.Tensor | None:
    """The gain `g` of every decoder layer's per-head key norm, `(L, head_dim)` float32 on the CPU, or `None` when
    some layer has none (Llama, Mistral: no key norm; OLMo 2: one norm over all heads at once, not per head).

    Read by running each layer's `self_attn.k_norm` on a constant vector (`g = k_norm(c·1)` for an RMSNorm), so any
    RMSNorm variant works (Qwen3's `weight`, Gemma 3's `1 + weight`).

    Example:

    ```python
    >>> from hf_kvbridge import pocket
    >>> key_norm_gains(pocket.load_model("pocket-s")).shape
    torch.Size([3, 32])
    ```
    """
    gains = []
    for layer in decoder_layers(model):
        norm = getattr(getattr(layer, "self_attn", None), "k_norm", None)
        weight = getattr(norm, "weight", None)
        if norm is None or weight is None or weight.dim() != 1:
            return None
        head_dim = weight.shape[0]
        # on the CPU unless the weight is on a device: an offloaded layer's hook (accelerate) moves it where it runs
        device = weight.device if weight.device.type != "meta" else torch.device("cpu")
        probe = torch.full((1, head_dim), _PROBE, dtype=torch.float32, device=device)
        with torch.no_grad():
            gain = norm(probe).float().reshape(-1)  # (d,): g · c / sqrt(c² + eps) = g
        if gain.device.type == "meta":
            return None
        expected = getattr(layer.self_attn, "head_dim", head_dim)
        if gain.shape[0] != expected or not torch.isfinite(gain).all() or bool((gain == 0).any()):
            return None
        gains.append(gain.cpu())
    return torch.stack(gains) if gains else None  # (L, d)


def project_keys(keys: torch.Tensor, gains: torch.Tensor) -> torch.Tensor:
    """Rescales content-space keys in place so that every head's `rms(k / g)` is 1, and returns them.

    Layers are taken in groups whose scratch copy (`k / g` in the keys' dtype) stays under 256 MB: one group, so a
    handful of ops for all layers, for a CPU chunk or a short sequence; on a GPU's whole-layer span the groups grow
    in number only once all layers' keys pass 256 MB (Qwen3-32B's 64 layers: at about 2K tokens in bfloat16).

    Args:
        keys (`torch.Tensor` of shape `(n, B, H, T, d)`): mapped keys of `n` target layers, before the target's rotary
            embedding (any strides; the norms are accumulated in float32).
        gains (`torch.Tensor` of shape `(n, d)`): those layers' key-norm gains (`key_norm_gains`).
    """
    inverse = (1.0 / gains.float()).to(keys.device, keys.dtype)[:, None, None, None, :]  # (n, 1, 1, 1, d)
    dim = keys.shape[-1]
    step = max(1, _SCRATCH_BYTES // max(keys[0].numel() * keys.element_size(), 1))
    for start in range(0, keys.shape[0], step):
        part = keys[start : start + step]  # (g, B, H, T, d)
        norm = torch.linalg.vector_norm(
            part * inverse[start : start + step], dim=-1, keepdim=True, dtype=torch.float32
        )
        # rms = norm / sqrt(d); the scale stays float32 (a half one overflows for short keys: 0 · inf is NaN)
        part.mul_(norm.clamp_min_(1e-12).reciprocal_().mul_(dim**0.5))
    return keys


def normalized_keys(keys: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    """`project_keys` out of place for one target layer (autograd follows it: `distill` trains through it).

    Args:
        keys (`torch.Tensor` of shape `(B, H, T, d)`): mapped content-space keys of one target layer.
        gain (`torch.Tensor` of shape `(d,)`): its key-norm gain.
    """
    square = (keys / gain.to(keys.device, keys.dtype)).square().mean(-1, keepdim=True)  # (B, H, T, 1)
    return keys * square.clamp_min(1e-12).rsqrt()


def with_key_norm(bridge, gains: torch.Tensor | None):
    """`bridge` with its mapped keys put back on the target's key-norm sphere (`gains`, `key_norm_gains(target)`),
    recorded in its config (`key_norm`, and the format version that reads it); unchanged for `gains=None`. What
    `calibrate` does with `key_norm="auto"` on a target that has a key norm.

    Example:

    ```python
    >>> bridge = with_key_norm(bridge, key_norm_gains(bridge.target))  # doctest: +SKIP
    ```
    """
    if gains is not None:
        bridge.mapper.set_key_norm(gains)
        bridge.config.key_norm = True
        bridge.config.format_version = max(bridge.config.format_version, KEY_NORM_FORMAT_VERSION)
    return bridge
