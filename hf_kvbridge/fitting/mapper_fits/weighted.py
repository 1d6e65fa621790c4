"""Attention-aware closed form: ridge with a per-token weight, the attention mass the token receives in the target.

For target layer `t`, token `j` of a window gets the weight

    w_tj = (1 / H_q) Σ_h Σ_{i ≥ j} softmax_j(q_hi · k_hj · scaling)

(the target's own queries and keys, causal, summed over query positions and averaged over heads), which has mean
exactly 1 over a window's tokens; it is renormalised to mean 1 anyway. The ridge problem of layer `t` is then solved
on weighted statistics (`Σw, Σw·x, Σw·xxᵀ, Σw·xyᵀ, ...` over the layer's *selected* source features only), with the
same centered solve and the same relative λ as the plain ridge (`solve_ridge` works on them unchanged: the token
count becomes `Σw`). Tokens the target attends to a lot (early tokens, attention sinks) count more.

Not built here: a *query-covariance-weighted key fit*, `min E[(k̂ − k)ᵀ Σ_q (k̂ − k)]` with one metric `Σ_q` (the
target's query second moment) shared by all tokens. For an unconstrained linear map `k̂ = xW + b` (and a ridge
penalty in the same metric) its minimiser is the unweighted one: substituting `W' = W Σ_q^{1/2}` gives the
unweighted problem for `W'`, whose solution is `W_ridge Σ_q^{1/2}`. It would only differ with per-token metrics or a
constrained (e.g. low-rank) map.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from ...constants import WEIGHTINGS
from ...errors import MapperError
from ...mappers.base import KVMapper
from ...utils.devices import decoder_layers
from ..attention import target_queries
from ..content_rows import cache_rows, forward_rows
from ..statistics.weighted import WeightedKVStatistics

logger = logging.getLogger(__name__)


def attention_mass(queries: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention mass each token receives, summed over (causal) query positions, averaged over query heads.

    Args:
        queries (`torch.Tensor` of shape `(B, H_q, T, d)`), keys (`(B, H_kv, T, d)`): post-RoPE, as the layer uses.
        scaling (`float`): the layer's softmax scale.

    Returns:
        `torch.Tensor` of shape `(B, T)`, float32, mean 1 over each window.
    """
    seq = queries.shape[2]
    rep = queries.shape[1] // keys.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=queries.device).triu(1)  # key after query
    mass = []
    for b in range(queries.shape[0]):  # one window at a time: H_q·T² scores, not B·H_q·T²
        scores = queries[b].float() @ keys[b].float().repeat_interleave(rep, 0).transpose(-1, -2) * scaling
        probs = scores.masked_fill(causal, float("-inf")).softmax(-1)  # (H_q, T_query, T_key)
        mass.append(probs.sum(1).mean(0))  # (T,)
    mass = torch.stack(mass)  # (B, T)
    return mass / mass.mean(-1, keepdim=True)


def fit_attention_weighted(
    base: KVMapper,
    *,
    source: nn.Module,
    target: nn.Module,
    windows: torch.Tensor,
    ridge_lambda: float | dict,
    statistics=None,
    batch_size: int = 8,
    weighting: str = "attention",
    features=None,
    progress: bool = False,
) -> KVMapper:
    r"""Refits the ridge mapper `base` with per-token attention-mass weights; returns the new mapper.

    Keeps `base`'s layer selection, head mode and kv mode, and the λ it was fitted with (`ridge_lambda`: the
    per-layer choices of an auto-λ bridge, `solve.effective_ridge_lambda(config)`); one streamed pass of both models
    over `windows` accumulates, per target layer, weighted statistics of its selected source features only. The result
    is a plain linear [`KVMapper`] (same weights layout as ridge); `hf_kvbridge.fitting.mapper_fits.refit` records it
    with `config.mapper_type == "ridge_attention_weighted"` and its `fit_summary` as `config.mapper_kwargs`.

    Args:
        base ([`KVMapper`]): a fitted mapper of `source` → `target` (its selection is reused).
        source, target (`nn.Module`): the two models.
        windows (`torch.LongTensor` of shape `(num_sequences, seq_len)`): calibration windows.
        ridge_lambda (`float` or `dict`): the λ of the maps.
        statistics: not used (the registry passes every fit the same arguments).
        batch_size (`int`, *optional*, defaults to `8`): windows per forward pass.
        weighting (`str`, *optional*, defaults to `"attention"`): `"attention"`, or `"uniform"` (every weight 1:
            the plain ridge fit on `windows`, an oracle for tests).
        features ([`~utils.source_features.SourceFeatures`], *optional*): the source's hidden-state blocks `base`
            reads beside its K/V (`config.source_features`; `refit` passes them): each pass appends them to the
            source's rows, so `base`'s selection may name them.

    Returns:
        [`KVMapper`].

    Example:

    ```python
    >>> from hf_kvbridge.fitting.mapper_fits import refit
    >>> weighted = refit(bridge, "ridge_attention_weighted", windows=windows)  # doctest: +SKIP
    >>> weighted.config.mapper_type  # doctest: +SKIP
    'ridge_attention_weighted'
    ```
    """
    started = time.perf_counter()
    stats = weighted_statistics(
        base, source=source, target=target, windows=windows, batch_size=batch_size, weighting=weighting,
        features=features, progress=progress,
    )  # fmt: skip
    layouts = (base.source_kv_heads, base.source_head_dim)
    mapper = KVMapper(base.selected_layers, *layouts, base.head_mode, kv_mode=base.kv_mode, **base.head_kwargs())
    for t, layers in enumerate(base.selected_layers):
        # stats[t] holds only layer t's selection: its source layers at 0 … k-1 and the target layer at 0
        for g, _, _, weight, bias in mapper.ridge_solutions(stats[t], t, ridge_lambda, range(len(layers)), 0):
            mapper.layers[t].weight.data[g] = weight.to(mapper.layers[t].weight.dtype)
            mapper.layers[t].bias.data[g] = bias.to(mapper.layers[t].bias.dtype)
    mapper.fit_summary = {
        "weighting": weighting,
        "windows": int(len(windows)),
        "seq_len": int(windows.shape[1]),
        "fit_seconds": round(time.perf_counter() - started, 2),
    }
    return mapper


def weighted_statistics(
    base: KVMapper,
    *,
    source: nn.Module,
    target: nn.Module,
    windows: torch.Tensor,
    batch_size: int = 8,
    weighting: str = "attention",
    features=None,
    progress: bool = False,
) -> list[WeightedKVStatistics]:
    """Per target layer `t`, the attention-mass-weighted statistics of its selected source layers (all heads, in
    `base.selected_layers[t]`'s order, at `0 … k-1`) → target layer `t` (at `0`): one streamed pass of both models
    over `windows`. `fit_attention_weighted` solves its maps from them; studies solve other maps from the same sums.

    Args:
        base ([`KVMapper`]): gives the selection and the head layouts (its head mode does not matter: every head is
            summed).
        weighting (`str`, *optional*, defaults to `"attention"`): `"attention"` or `"uniform"`.
        features ([`~utils.source_features.SourceFeatures`], *optional*): hidden-state blocks appended to the
            source's rows (block `s ≥ L_s` of a selection is one of them).

    Returns:
        `list[WeightedKVStatistics]`, one per target layer.
    """
    if weighting not in WEIGHTINGS:
        raise MapperError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    heads, dim = base.target_kv_heads, base.target_head_dim
    xw, yw = base.x_row, base.y_row  # features of one source / target layer
    attn_layers = [layer.self_attn for layer in decoder_layers(target)]
    layouts = (base.source_kv_heads, base.source_head_dim)
    stats = [
        WeightedKVStatistics(len(layers), 1, *layouts, target_kv_heads=heads, target_head_dim=dim)
        for layers in base.selected_layers
    ]
    kv_blocks = len(decoder_layers(source))  # the source's K/V blocks; hidden-state blocks come after them
    needed = sorted({s for layers in base.selected_layers for s in layers if s >= kv_blocks})
    if needed and features is None:
        raise MapperError(
            f"the mapper's selection reads source blocks {needed} past the source's {kv_blocks} K/V layers "
            "(hidden-state features): pass the bridge's `features` (`SourceFeatures.from_config(bridge.config)`; "
            "`refit` does)"
        )
    from tqdm.auto import tqdm

    for start in tqdm(range(0, len(windows), batch_size), desc="weighted ridge", disable=not progress):
        ids = windows[start : start + batch_size]
        x, hidden = forward_rows(source, ids, "cpu", hidden=features is not None)  # (B·T, L_s·H·2d)
        # the hidden-state blocks some selection reads, each (B·T, W): not every state's (163 blocks for Qwen3-14B
        # with all 41 states: 5.5 GB of rows for 8 × 512 tokens, against the ≤ 64·k blocks the maps read)
        extra = {s: features.piece(hidden, s).float().reshape(len(x), xw) for s in needed} if needed else {}
        del hidden
        y = cache_rows(target, ids, "cpu")  # (B·T, L_t·H·2d)
        queries = true_cache = None
        if weighting == "attention":
            queries, true_cache = target_queries(target, ids)
        for t, layers in enumerate(base.selected_layers):
            blocks = [extra[s] if s in extra else x[:, s * xw : (s + 1) * xw] for s in layers]
            x_t = torch.cat(blocks, dim=-1)  # (B·T, k·H_s·2d_s)
            y_t = y[:, t * yw : (t + 1) * yw]  # (B·T, H_t·2d_t)
            weight = None
            if weighting == "attention":
                weight = attention_mass(queries[t], true_cache.layers[t].keys, attn_layers[t].scaling).reshape(-1)
            stats[t].update(x_t, y_t, weight)
    return stats
