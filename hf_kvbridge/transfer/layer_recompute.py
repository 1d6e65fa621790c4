"""Layer recompute: the target computes its top `n` layers itself over the whole prompt, from a residual stream mapped
in closed form from the source, while its lower `L_t − n` layers get mapped K/V as usual.

```
prompt ──source prefill (hidden states)──▶ source K/V ──mapper──▶ target K/V of layers 0 … L_t − n − 1
                                       └──▶ hidden states of chosen source layers ──residual map──▶ hidden state
                                            entering target layer L_t − n ──target layers L_t − n … L_t − 1──▶
                                            their own K/V (attending to the sinks' own K/V and to each other)
```

Cost: `n / L_t` of the target's prefill, plus the two maps. `n = L_t` starts from the target's own embeddings (the
target prefills the mapped span itself, no residual map); `n = 0` is the plain bridge.

The residual map (`mappers.residual.ResidualMapper`) is fitted with the K/V maps
(`hf_kvbridge.fitting.calibration.residual`); this module holds what a transfer runs.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigurationError, KVLayoutError
from ..settings import check_recompute_layers
from ..utils.cache import CACHE_KWARG, crop_layer
from ..utils.devices import decoder_layers, layer_devices
from ..utils.rope import rotary_module


def check_layer_recompute(config, layout, residual_mapper=None, value: int | None = None) -> int:
    """The `config.recompute_layers` (or `value`: the residual map asked for) a bridge with target `layout` and
    `residual_mapper` can run, or a clear error.

    Refuses a value outside `0 … L_t` or one its residual map was not calibrated for (naming those it was:
    `settings.check_recompute_layers`), a residual map missing from a bridge that needs one, and sliding-window
    layers among the top `n` (their cache keeps only a window, which the top layers' own pass would have to
    reproduce; recompute them with `hold_back` instead). `layout` is the target's [`KVLayout`], `residual_mapper` the
    bridge's
    [`~mappers.residual.ResidualMapper`], or `None`.
    """
    n = (getattr(config, "recompute_layers", 0) or 0) if value is None else value
    n = check_recompute_layers(n, layout.num_layers, config.calibrated_recompute_layers)
    if n == 0 and value is None:
        return 0
    windowed = [t for t in range(layout.num_layers - n, layout.num_layers) if layout.window(t) is not None]
    if windowed:
        raise KVLayoutError(
            f"layer recompute runs the target's top {n} layers over the whole prompt, but layers {windowed} attend "
            "over a sliding window; use recompute_layers=0 (or a hold_back) with this target"
        )
    needs_map = n < layout.num_layers or value is not None  # a residual map asked for by value must exist
    if needs_map and (residual_mapper is None or n not in residual_mapper.recompute_layers):
        raise ConfigurationError(
            f"recompute_layers={n} needs the residual map of its checkpoint, and this bridge holds none for it; load "
            "the bridge with from_pretrained (which reads residual.safetensors) or calibrate with "
            f"recompute_layers={n}"
        )
    return n


@torch.no_grad()
def recompute_top_layers(
    target: nn.Module,
    cache,
    hidden: torch.Tensor,
    attention_mask: torch.Tensor,
    positions: torch.Tensor,
    first: int,
    start_layer: int,
) -> torch.Tensor:
    """Runs `target`'s layers `start_layer … L_t − 1` over tokens `[first, first + S)` from the residual `hidden`,
    writing their own K/V into `cache` in place, as the model's own forward calls its layers (its rotary embedding,
    one causal mask over the real tokens, the cache).

    Each of those layers' cache entries is cut back to the first `first` tokens (the attention sinks, or what a
    session had cached before, the target's own) and gets the new tokens' K/V; the layers below keep theirs (the
    mapped ones). The top layers then attend to exactly what a plain prefill would give them there.

    Args:
        target ([`PreTrainedModel`]): the target (full-attention top layers, see `check_layer_recompute`).
        cache (`DynamicCache`): the target cache of `first + S` tokens.
        hidden (`torch.Tensor` of shape `(B, S, D_t)`): the residual entering layer `start_layer`.
        attention_mask (`torch.Tensor` of shape `(B, first + S)`): 1 for real tokens.
        positions (`torch.LongTensor` of shape `(B, S)`): the new tokens' positions.
        first (`int`): tokens cached before the new ones.
        start_layer (`int`): `L_t − n`.

    Returns:
        the hidden state after the last layer, `(B, S, D_t)` (before the final norm).
    """
    layers = decoder_layers(target)
    places = layer_devices(target, len(layers))
    batch, seq, _ = hidden.shape
    end = first + seq
    for i in range(start_layer, len(layers)):  # the top layers keep only the tokens before the span (their own)
        crop_layer(cache.layers[i], first)  # a full-attention `DynamicLayer` (`check_layer_recompute`)
    device = places[start_layer]
    real = attention_mask[:, :end].to(device).bool()  # (B, first + S)
    columns = torch.arange(end, device=device)
    queries = torch.arange(first, end, device=device)
    allowed = (columns[None, :] <= queries[:, None])[None] & real[:, None, :]  # (B, S, first + S): causal, real keys
    dtype = hidden.dtype
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    mask = mask.unsqueeze(1)  # (B, 1, S, first + S), additive
    hidden, positions = hidden.to(device), positions.to(device)
    embeddings = rotary_module(target)(hidden, positions)  # (cos, sin), each (B, S, d)
    for i in range(start_layer, len(layers)):
        place = places[i]
        if hidden.device != place:
            hidden, mask, positions = hidden.to(place), mask.to(place), positions.to(place)
            embeddings = tuple(e.to(place) for e in embeddings)
        out = layers[i](
            hidden,
            attention_mask=mask,
            position_embeddings=embeddings,
            position_ids=positions,
            use_cache=True,
            **{CACHE_KWARG: cache},
        )
        hidden = out[0] if isinstance(out, tuple) else out  # (B, S, D_t)
    return hidden
