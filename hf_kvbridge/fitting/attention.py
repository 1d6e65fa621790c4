"""The target's attention, seen from outside: its own queries, attention over any K/V, and the attention-output
cosine (the paper's predictor of downstream quality). One routine each, used by diagnostics, tools and the mappers
that fit against attention.

Attention-output cosine: the target's *own* queries attend over the mapped K/V and over the true K/V of the same
tokens, through the target's attention and `o_proj`; the cosine of the two outputs is averaged over tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from ..utils.cache import output_cache
from ..utils.devices import decoder_layers
from ..utils.rope import apply_rotary


@torch.no_grad()
def target_queries(target: nn.Module, input_ids: torch.Tensor):
    """The target's own post-RoPE queries at every layer, and its cache, from one forward pass over `input_ids`.

    Queries are rebuilt from the hidden states each `self_attn` receives (captured with forward pre-hooks, removed
    afterwards), as the layer itself builds them: `q_proj`, `q_norm` when the model has one, the layer's rotary.

    Args:
        target ([`PreTrainedModel`]): a decoder of the supported families.
        input_ids (`torch.LongTensor` of shape `(batch, seq)`): unpadded text.

    Returns:
        `(queries, cache)`: `queries[t]` of shape `(batch, q_heads, seq, head_dim)`, float32, and the target's cache
        (keys post-RoPE) for the same tokens.

    Example:

    ```python
    >>> queries, cache = target_queries(model, ids)  # doctest: +SKIP
    >>> queries[0].shape  # (B, H_q, T, d)  # doctest: +SKIP
    ```
    """
    layers = decoder_layers(target)
    captured: dict[int, tuple] = {}

    def capture(idx):
        def hook(module, args, kwargs):
            captured[idx] = (kwargs.get("hidden_states", args[0] if args else None), kwargs["position_embeddings"])

        return hook

    handles = [
        layer.self_attn.register_forward_pre_hook(capture(i), with_kwargs=True) for i, layer in enumerate(layers)
    ]
    try:
        cache = output_cache(target(input_ids=input_ids.to(target.device), use_cache=True, logits_to_keep=1))
    finally:
        for handle in handles:
            handle.remove()
    queries = []
    for t, layer in enumerate(layers):
        attn = layer.self_attn
        hidden, (cos, sin) = captured[t]  # (B, T, hidden), (B, T, d) each
        batch, seq, _ = hidden.shape
        head_dim = cache.layers[t].keys.shape[-1]
        query = attn.q_proj(hidden).view(batch, seq, -1, head_dim)
        if getattr(attn, "q_norm", None) is not None:
            query = attn.q_norm(query)
        queries.append(apply_rotary(query.transpose(1, 2).float(), cos.float(), sin.float()))  # (B, H_q, T, d)
    return queries, cache


def attend(attn: nn.Module, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Causal attention of `queries (B, H_q, T, d)` over `keys, values (B, H_kv, T, d)`, after `o_proj`: `(B, T, D)`.

    `o_proj`'s weights are detached: gradients flow to the mapped K/V only, never into the target.
    """
    batch, _, seq, _ = queries.shape
    rep = queries.shape[1] // keys.shape[1]
    attended = nn.functional.scaled_dot_product_attention(
        queries, keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1), is_causal=True, scale=attn.scaling
    )  # (B, H_q, T, d)
    bias = attn.o_proj.bias.detach() if attn.o_proj.bias is not None else None
    flat = attended.transpose(1, 2).reshape(batch, seq, -1)  # (B, T, H_q·d)
    return nn.functional.linear(flat, attn.o_proj.weight.detach().to(flat.dtype), bias)


@torch.no_grad()
def attention_output_cosine(bridge, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean cosine, per target layer, between attention outputs over mapped and over true K/V.

    Args:
        bridge ([`KVBridgeForCausalLM`]): the bridge to diagnose.
        input_ids (`torch.LongTensor` of shape `(batch, seq)`): unpadded held-out text.

    Returns:
        `torch.Tensor` of shape `(target_layers,)`, float64.

    Example:

    ```python
    >>> cos = attention_output_cosine(bridge, heldout_ids)  # doctest: +SKIP
    >>> cos.mean()  # doctest: +SKIP
    ```
    """

    target = bridge.target
    attn_layers = [layer.self_attn for layer in decoder_layers(target)]
    queries, true_cache = target_queries(target, input_ids)  # (B, H_q, T, d) per layer, float32
    source = bridge.source
    hidden = getattr(bridge, "source_features", None) is not None  # the mapper reads hidden states too
    source_out = source(
        input_ids=input_ids.to(source.device), use_cache=True, logits_to_keep=1, output_hidden_states=hidden
    )
    mapped = bridge.map_cache(output_cache(source_out), hidden_states=source_out.hidden_states if hidden else None)
    out = torch.zeros(len(attn_layers), dtype=torch.float64)
    for t, attn in enumerate(attn_layers):
        true, approx = (
            attend(attn, queries[t], cache.layers[t].keys.float(), cache.layers[t].values.float()).double()
            for cache in (true_cache, mapped)
        )  # (B, T, D) each
        out[t] = nn.functional.cosine_similarity(true, approx, dim=-1).mean()
    return out
