"""Running a transfer: the source prefills, the mapper carries its KV over where the plan says
(`hf_kvbridge.transfer.plan` decides which tokens the target computes itself: attention sinks, the quality gate's
probe, recomputed tokens), and the gate decides whether a row's transfer is trusted at all. Called with the models, a
map function and the plan; returns the cache and its decision, and leaves no state anywhere.

```
prompt ──source prefill──▶ source cache ──map (all but sinks and probe)──▶ target cache
       (layer recompute: source hidden states ──residual map──▶ the target's top n layers over the mapped span)
       ──target runs the sinks and the probe──▶ gate: own vs mapped K/V of the probe ──▶ keep, or re-prefill
```
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from transformers import Cache, DynamicCache

from ..attention import decoder_layers
from ..cache import cache_kwargs, output_cache, slice_cache
from ..errors import InvalidInputError
from ..loading import execution_device
from .layer_recompute import recompute_top_layers
from .plan import TransferPlan
from .token_recompute import choose_tokens, probe_scores, recompute_tokens

logger = logging.getLogger(__name__)


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-row positions of a (left-)padded batch, as `generate` computes them: `cumsum(mask) - 1`, pads at 0."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 0)


@torch.no_grad()
def probe_agreement(own: Cache, mapped: Cache, start: int, mask: torch.Tensor) -> torch.Tensor:
    """Per-row mean cosine between the target's own K/V rows of tokens `[start, start + n)` in `own` and the mapped
    ones in `mapped` (which holds only those n tokens), over layers and real (unpadded) tokens.

    Returns:
        `torch.Tensor` of shape `(batch,)`, float32, on the device of `mask`.
    """
    scores = []
    weight = mask.float()  # (B, n)
    for own_layer, mapped_layer in zip(own.layers, mapped.layers):
        n = mapped_layer.keys.shape[2]
        a = torch.cat([own_layer.keys[:, :, start : start + n], own_layer.values[:, :, start : start + n]], -1)
        b = torch.cat([mapped_layer.keys, mapped_layer.values], -1).to(a.device)  # (B, H, n, 2d)
        cos = nn.functional.cosine_similarity(a.float(), b.float(), dim=-1).mean(1).to(weight.device)  # (B, n)
        scores.append((cos * weight).sum(-1) / weight.sum(-1).clamp_min(1))  # (B,)
    return torch.stack(scores).mean(0)  # (B,)


def _replace_rows(cache: Cache, own: Cache, rows: torch.Tensor) -> None:
    """Writes rows `rows` (a `(B,)` bool mask) of every layer of `own` into `cache`, in place."""
    for layer, own_layer in zip(cache.layers, own.layers):
        index = rows.to(layer.keys.device)
        layer.keys[index] = own_layer.keys.to(layer.keys.device)
        layer.values[index] = own_layer.values.to(layer.values.device)


@dataclass(frozen=True)
class TransferDecision:
    """What one transfer did, row by row.

    Args:
        transferred (`bool`): every row kept its mapped cache.
        rows_transferred (`list[bool]`): per row.
        mapped_tokens (`int`), target_tokens (`int`), recomputed_tokens (`int`): of the rows that transferred
            (`0`, `length` and `0` when none did). `mapped_tokens` counts the tokens whose lower layers hold mapped
            K/V (none when the target computed all of its layers itself).
        score (`float`, *optional*): the lowest per-row gate score; scores (`list[float]`, *optional*): all of them.
        gate (`str`, *optional*): `None` without a gate, `"checked"` or `"skipped"` (see [`TransferPlan`]).
        recomputed_layers (`int`, *optional*, defaults to `0`): the target's top layers that computed the mapped
            span themselves (layer recompute; `0` when no row transferred).
    """

    transferred: bool
    rows_transferred: list[bool]
    mapped_tokens: int
    target_tokens: int
    recomputed_tokens: int
    score: float | None
    scores: list[float] | None
    gate: str | None
    recomputed_layers: int = 0

    def as_dict(self) -> dict[str, Any]:
        """The decision as a plain dict (what `KVBridgeForCausalLM.last_transfer` holds)."""
        return asdict(self)

    def counts(self) -> dict[str, int]:
        """Rows that transferred and rows that fell back, zeros left out: `{"transferred": n, "fallback": m}`."""
        kept = sum(self.rows_transferred)
        counts = {"transferred": kept, "fallback": len(self.rows_transferred) - kept}
        return {key: count for key, count in counts.items() if count}


@dataclass(frozen=True)
class TransferResult:
    """What `transfer_prefill` returns: the target `cache`, the source's outputs and the [`TransferDecision`]."""

    cache: DynamicCache
    source_outputs: Any
    decision: TransferDecision


MapFunction = Callable[..., DynamicCache]
"""`map_fn(source_cache, position_ids, target_cache=None) -> DynamicCache`, e.g. `KVBridgeForCausalLM.map_cache`."""

ResidualFunction = Callable[..., torch.Tensor]
"""`residual_fn(source_hidden_states, recompute_layers) -> (B, T, D_t)`: the hidden state entering target layer
`L_t − recompute_layers`, mapped from the source's hidden states of the same `T` tokens (`L_s + 1` tensors of
`(B, T, D_s)`), e.g. `KVBridgeForCausalLM.map_residual`."""


def left_padding(attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-row left padding of a `(batch, seq)` mask: `(batch,)`."""
    return (attention_mask.cumsum(-1) == 0).sum(-1)


@torch.no_grad()
def transfer_prefill(
    source: nn.Module,
    target: nn.Module,
    map_fn: MapFunction,
    plan: TransferPlan,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None = None,
    *,
    position_ids: torch.LongTensor | None = None,
    source_logits: bool = True,
    residual_fn: ResidualFunction | None = None,
    hidden_features: bool = False,
) -> TransferResult:
    """Builds `target`'s cache for every token of `input_ids` as `plan` says, and returns it with its decision.

    Call it on the prompt without its held-back tokens, with the plan of its length (`plan.plan_from_config`). The
    source prefills all of `input_ids`; its KV is mapped by `map_fn` over `[plan.map_start, plan.map_end)`; the
    target computes the attention sinks `[0, plan.map_start)` itself (the first real tokens of each row: the plan's
    `padding` is the batch's longest left padding). With a quality gate (`plan.gate == "checked"`), the target also
    computes the probe `[plan.map_end, length)` itself and compares its own K/V there with the mapped ones (cosine,
    mean over layers and tokens), row by row: a row below `plan.gate_threshold` drops its mapped K/V and gets the
    target's own prefill (fallback), the other rows keep theirs. `plan.recompute_tokens` of the mapped tokens are
    recomputed by the target (`hf_kvbridge.transfer.token_recompute`). With `plan.recompute_layers = n` (layer
    recompute, `hf_kvbridge.transfer.layer_recompute`), the target's top `n` layers then compute the mapped span
    themselves from the residual `residual_fn` maps from the source's hidden states (the mapped K/V stay in the layers
    below), before the token recompute; with `n` the target's layer count, the target prefills the span itself.

    Nothing here reads or writes a bridge: the caller records the decision (`KVBridgeForCausalLM.prefill` keeps it in
    `last_transfer` and `transfer_counts`).

    Args:
        source, target (`nn.Module`): the two models.
        map_fn (`Callable`): `map_fn(source_cache, position_ids, target_cache=None)`, the mapping engine bound to a
            mapper (`KVBridgeForCausalLM.map_cache`).
        plan ([`TransferPlan`]): the positions, for `input_ids.shape[1]` tokens.
        input_ids (`torch.LongTensor` of shape `(batch, seq)`), attention_mask (*optional*): the tokens.
        position_ids (`torch.LongTensor` of shape `(batch, seq)`, *optional*): the tokens' positions for both models
            (default: `cumsum(mask) - 1`).
        source_logits (`bool`, *optional*, defaults to `True`): `False` computes the source's logits for the last
            position only (generation needs none).
        residual_fn (`Callable`, *optional*): `residual_fn(source_hidden_states, n)` (see `ResidualFunction`),
            needed when `0 < plan.recompute_layers <` the target's layer count.
        hidden_features (`bool`, *optional*, defaults to `False`): `map_fn` reads the source's hidden states beside
            its K/V (`hf_kvbridge.source_features`): the source prefill returns them (`output_hidden_states`) and
            `map_fn` gets those of the tokens it maps as `hidden_states=`.

    Returns:
        [`TransferResult`]: the target cache, the source outputs and the [`TransferDecision`].
    """
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    batch, length = input_ids.shape
    if plan.length != length:
        raise InvalidInputError(
            f"the transfer plan covers {plan.length} tokens but input_ids hold {length}; plan the prompt's own length"
        )
    if position_ids is None:
        positions = positions_from_mask(attention_mask)
    else:
        if tuple(position_ids.shape[-1:]) != (length,):
            raise InvalidInputError(
                f"position_ids cover {position_ids.shape[-1]} tokens but input_ids hold {length}; pass one position "
                "per token"
            )
        positions = position_ids.expand(batch, -1)
    num_layers = len(decoder_layers(target))
    top = plan.recompute_layers
    residual = 0 < top < num_layers  # the top layers start from a mapped residual (at num_layers: the embeddings)
    if residual and residual_fn is None:
        raise InvalidInputError(
            f"the plan recomputes the target's top {top} layers, which start from a mapped residual stream; pass "
            "residual_fn (the bridge's map_residual)"
        )
    src_device, device = execution_device(source), execution_device(target)
    source_out = source(
        input_ids=input_ids.to(src_device),
        attention_mask=attention_mask.to(src_device),
        position_ids=positions.to(src_device),
        use_cache=True,
        logits_to_keep=0 if source_logits else 1,
        output_hidden_states=residual or hidden_features,
    )

    def states(start: int, end: int) -> list[torch.Tensor]:  # the source's hidden states of tokens [start, end)
        return [h[:, start:end] for h in source_out.hidden_states]  # L_s + 1 × (B, end - start, D_s)

    def hidden(start: int, end: int) -> dict:  # map_fn's hidden states when it reads them
        return {"hidden_states": states(start, end)} if hidden_features else {}

    ids, mask, pos = input_ids.to(device), attention_mask.to(device), positions.to(device)

    def target_run(start: int, end: int, cache: DynamicCache | None, rows: torch.Tensor | None = None):
        pick = slice(None) if rows is None else rows
        return output_cache(
            target(
                input_ids=ids[pick, start:end],
                attention_mask=mask[pick, :end],
                position_ids=pos[pick, start:end],
                **cache_kwargs(cache),
                use_cache=True,
            )
        )

    sink_end, map_end, probe = plan.map_start, plan.map_end, plan.probe_tokens
    if plan.gate == "skipped":
        logger.info("quality gate skipped: sink and probe tokens cover the %d-token prompt, nothing is mapped", length)
    cache = target_run(0, sink_end, None) if sink_end > 0 else None
    if map_end > sink_end and top >= num_layers:  # every layer recomputed: the target prefills the span itself
        cache = target_run(sink_end, map_end, cache)
    elif map_end > sink_end:
        piece = slice_cache(output_cache(source_out), sink_end, map_end)
        cache = map_fn(piece, pos[:, sink_end:map_end], target_cache=cache, **hidden(sink_end, map_end))
        if residual:  # the top layers compute the span themselves, from the residual mapped at each token
            stream = residual_fn(states(sink_end, map_end), top)  # (B, span, D_t)
            recompute_top_layers(
                target, cache, stream, mask[:, :map_end], pos[:, sink_end:map_end], sink_end, num_layers - top
            )
    recomputed = 0
    if plan.recompute_tokens and cache is not None and top < num_layers:
        recomputed = recompute_mapped(
            target,
            cache,
            ids[:, :map_end],
            mask[:, :map_end],
            pos[:, :map_end],
            sink_end,
            count=plan.recompute_tokens,
            policy=plan.recompute_policy,
            seed=plan.recompute_seed,
        )
    ok = torch.ones(batch, dtype=torch.bool)
    scores = None
    if probe > 0:
        cache = target_run(map_end, length, cache)  # the target's own K/V for the probe tokens
        mapped_probe = map_fn(
            slice_cache(output_cache(source_out), map_end, length), pos[:, map_end:], **hidden(map_end, length)
        )
        row_scores = probe_agreement(cache, mapped_probe, map_end, mask[:, map_end:]).cpu()  # (B,)
        ok = row_scores >= plan.gate_threshold
        scores = [float(x) for x in row_scores]
        if not ok.all():
            logger.info(
                "quality gate: probe K/V cosine %s below %.4f in rows %s, the target prefills those rows itself",
                [round(x, 4) for x in scores],
                plan.gate_threshold,
                (~ok).nonzero().flatten().tolist(),
            )
            if not ok.any():
                cache = target_run(0, length, None)
            else:
                _replace_rows(cache, target_run(0, length, None, rows=(~ok).to(device)), ~ok)
    own_span = top >= num_layers  # no mapped K/V left anywhere
    decision = TransferDecision(
        transferred=bool(ok.all()),
        rows_transferred=ok.tolist(),
        mapped_tokens=map_end - sink_end - recomputed if ok.any() and not own_span else 0,
        target_tokens=sink_end + probe + recomputed if ok.any() and not own_span else length,
        recomputed_tokens=recomputed if ok.any() else 0,
        score=min(scores) if scores else None,
        scores=scores,
        gate=plan.gate,
        recomputed_layers=top if ok.any() else 0,
    )
    return TransferResult(cache, source_out, decision)


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
