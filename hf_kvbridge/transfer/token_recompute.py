"""Selective recompute: the target recomputes chosen context tokens over the mapped cache, in one forward pass.

The mapped cache holds a K/V row for every context token. The target then runs only the chosen tokens, at their own
positions, with a mask that lets chosen token `i` attend to

- the mapped K/V of every *unchosen* context token before it, and
- the recomputed K/V of every chosen token up to and including itself,

so each chosen token sees exactly the context it would see in a plain prefill, with mapped K/V standing in for the
tokens nobody recomputed. Its own K/V then replace the mapped ones. With every token chosen this *is* the target's
own prefill; with the last `m` tokens chosen it is `hold_back = m + 1`.

Which tokens to choose (`choose_tokens`): `"tail"` (the last ones), `"random"`, `"spread"` (evenly spaced),
`"probe"` (the largest expected damage at the target's first layer, `probe_scores`: mapped vs own layer-0 K/V,
weighted by the attention the last context tokens pay there; layer-0 projections only), or `"tail_probe"` (half
the budget on the last tokens, half by the probe score).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..constants import RECOMPUTE_POLICIES
from ..errors import ConfigurationError, InvalidInputError, KVLayoutError
from ..utils.cache import cache_kwargs, output_cache, replace_layer_kv
from ..utils.devices import decoder_layers
from ..utils.rope import apply_rotary, rotary_cos_sin


@torch.no_grad()
def probe_scores(
    target: nn.Module, mapped: DynamicCache, input_ids: torch.Tensor, positions: torch.Tensor, queries: int = 8
) -> torch.Tensor:
    """Per token, the expected damage of its mapped K/V at the target's first layer: `(B, T)`.

    The score is the relative squared error of the mapped layer-0 keys and values against the target's own, weighted
    by the attention the last `queries` context tokens pay to that token at layer 0 (what the continuation that
    follows is most likely to read). The target's layer-0 keys, values and queries depend on the token embeddings
    only: one normalisation and the `q/k/v` projections, no attention output, no MLP.
    """
    layer = decoder_layers(target)[0]
    attn = layer.self_attn
    hidden = layer.input_layernorm(target.get_input_embeddings()(input_ids))  # (B, T, D)
    batch, seq, _ = hidden.shape
    keys_mapped, values_mapped = mapped.layers[0].keys, mapped.layers[0].values  # (B, H, T, d)
    dim = keys_mapped.shape[-1]
    cos, sin = rotary_cos_sin(target, positions, dtype=hidden.dtype)  # (B, T, d)

    def project(proj, norm_name):
        states = proj(hidden).view(batch, seq, -1, dim)
        norm = getattr(attn, norm_name, None)
        return (norm(states) if norm is not None else states).transpose(1, 2)  # (B, heads, T, d)

    keys = apply_rotary(project(attn.k_proj, "k_norm"), cos, sin)
    values = project(attn.v_proj, "none")
    own = torch.cat([keys, values], -1).float()  # (B, H, T, 2d)
    approx = torch.cat([keys_mapped, values_mapped], -1).float()
    error = (own - approx).pow(2).sum((1, 3)) / own.pow(2).sum((1, 3)).clamp_min(1e-12)  # (B, T)
    last = min(queries, seq)
    q = apply_rotary(project(attn.q_proj, "q_norm"), cos, sin)[:, :, seq - last :].float()  # (B, H_q, last, d)
    k = keys.float().repeat_interleave(q.shape[1] // keys.shape[1], 1)  # (B, H_q, T, d)
    logits = (q @ k.transpose(-1, -2)) * attn.scaling  # (B, H_q, last, T)
    causal = torch.arange(seq, device=q.device)[None, :] <= torch.arange(seq - last, seq, device=q.device)[:, None]
    weight = logits.masked_fill(~causal, float("-inf")).softmax(-1).mean((1, 2))  # (B, T)
    return error * (weight + 1.0 / seq)


def choose_tokens(
    policy: str,
    count: int,
    attention_mask: torch.Tensor,
    *,
    score: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """A `(B, T)` boolean mask of the `count` real (unpadded) tokens of each row that `policy` recomputes.

    Args:
        policy (`str`): one of `RECOMPUTE_POLICIES`.
        count (`int`): tokens per row (capped at the row's real tokens).
        attention_mask (`torch.Tensor` of shape `(B, T)`): 1 for real tokens.
        score (`torch.Tensor` of shape `(B, T)`, *optional*): for `"probe"`, the per-token error estimate
            (`probe_scores`); the highest are chosen.
    """
    if policy not in RECOMPUTE_POLICIES:
        raise ConfigurationError(f"recompute_policy must be one of {RECOMPUTE_POLICIES}, got {policy!r}")
    real = attention_mask.bool()
    batch, seq = real.shape
    chosen = torch.zeros_like(real)
    if count <= 0:
        return chosen
    for b in range(batch):
        index = real[b].nonzero().squeeze(-1)  # real token columns, in order
        n = min(count, index.numel())
        if policy == "tail":
            pick = index[index.numel() - n :]
        elif policy == "spread":
            pick = index[torch.linspace(0, index.numel() - 1, n).round().long()]
        elif policy == "random":
            pick = index[torch.randperm(index.numel(), generator=generator)[:n]]
        else:
            if score is None:
                raise InvalidInputError(
                    f"the {policy!r} policy needs the per-token score: pass score= (`probe_scores`)"
                )
            tail = n // 2 if policy == "tail_probe" else 0  # the last tokens first, then the best scores of the rest
            rest = index[: index.numel() - tail]
            best = rest[torch.topk(score[b, rest].float(), n - tail).indices]
            pick = torch.cat([index[index.numel() - tail :], best])
        chosen[b, pick] = True
    return chosen


@torch.no_grad()
def recompute_tokens(
    target: nn.Module,
    cache: DynamicCache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    positions: torch.Tensor,
    chosen: torch.Tensor,
) -> DynamicCache:
    """Recomputes the `chosen` context tokens of `cache` with `target` in one forward pass (see the module docstring).

    Args:
        target ([`PreTrainedModel`]): the model whose cache `cache` stands in for.
        cache (`DynamicCache`): the mapped cache of the `T` context tokens (full-attention layers).
        input_ids, attention_mask, positions (`torch.Tensor` of shape `(B, T)`): the context, its padding mask and
            its positions.
        chosen (`torch.BoolTensor` of shape `(B, T)`): the tokens to recompute (rows may choose different numbers).

    Returns:
        `cache`, with the chosen tokens' K/V replaced by the target's own, still `T` tokens long.
    """
    if not chosen.any():
        return cache
    for layer in cache.layers:
        if type(layer) is not DynamicLayer:
            raise KVLayoutError(
                f"selective recompute needs full-attention cache layers, got {type(layer).__name__} (sliding-window "
                "targets recompute with hold_back instead)"
            )
    device = cache.layers[0].keys.device
    chosen, real = chosen.to(device), attention_mask.to(device).bool()
    batch, seq = chosen.shape
    n = int(chosen.sum(-1).max())
    columns = torch.zeros(batch, n, dtype=torch.long, device=device)  # context column of each recomputed slot
    used = torch.zeros(batch, n, dtype=torch.bool, device=device)  # padding slots for rows that choose fewer
    for b in range(batch):
        picked = chosen[b].nonzero().squeeze(-1)
        columns[b, : picked.numel()] = picked
        used[b, : picked.numel()] = True
    col = torch.arange(seq, device=device)
    query_col = columns.unsqueeze(-1)  # (B, n, 1)
    # mapped K/V of an unchosen real token before the query
    sees_mapped = (col < query_col) & ~chosen.unsqueeze(1) & real.unsqueeze(1)  # (B, n, T)
    # recomputed K/V of a chosen token up to and including the query (padding slots see only themselves)
    sees_new = (columns.unsqueeze(1) <= query_col) & used.unsqueeze(1) & used.unsqueeze(-1)  # (B, n, n)
    sees_new |= torch.eye(n, dtype=torch.bool, device=device).unsqueeze(0) & ~used.unsqueeze(-1)
    allowed = torch.cat([sees_mapped, sees_new], dim=-1).unsqueeze(1)  # (B, 1, n, T + n)
    dtype = cache.layers[0].keys.dtype
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    target_device = input_ids.device if target.device.type == "meta" else target.device
    ids = torch.gather(input_ids.to(device), 1, columns).to(target_device)
    pos = torch.gather(positions.to(device), 1, columns).to(target_device)
    out = target(
        input_ids=ids, position_ids=pos, attention_mask=mask, **cache_kwargs(cache), use_cache=True, logits_to_keep=1
    )
    for layer in output_cache(out).layers:
        written = []
        for tensor in (layer.keys, layer.values):  # (B, H, T + n, d)
            context, fresh = tensor[:, :, :seq].clone(), tensor[:, :, seq:]
            for b in range(batch):
                k = int(used[b].sum())
                context[b, :, columns[b, :k]] = fresh[b, :, :k]
            written.append(context)
        replace_layer_kv(layer, *written)
    return output_cache(out)


def recompute_mapped(
    target: nn.Module,
    cache: DynamicCache,
    ids: torch.Tensor,
    mask: torch.Tensor,
    pos: torch.Tensor,
    first_mapped: int,
    *,
    count: int,
    policy: str = "tail",
    seed: int = 0,
) -> int:
    """Selective recompute of `count` of the mapped columns `[first_mapped, T)` of `cache` (chosen by `policy`; `seed`
    for `"random"`) by `target`, in place; returns the most tokens a row recomputed.

    `ids`, `mask`, `pos` (`(batch, T)` each) are the tokens, mask and positions of the cached columns."""
    if count == 0:
        return 0
    mapped = mask.clone()
    mapped[:, :first_mapped] = 0  # sink tokens are the target's own already
    score = probe_scores(target, cache, ids, pos) if "probe" in policy else None
    generator = torch.Generator().manual_seed(seed)
    chosen = choose_tokens(policy, count, mapped, score=score, generator=generator)
    recompute_tokens(target, cache, ids, mask, pos, chosen)
    return int(chosen.sum(-1).max())
