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
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from ..errors import InvalidInputError
from ..utils.cache import cache_kwargs, copy_batch_rows, output_cache
from ..utils.devices import decoder_layers, execution_device
from ..utils.masks import positions_from_mask
from .plan import TransferPlan
from .steps import MapFunction, ResidualFunction, SourceKV, TargetSide, TransferDecision, TransferSteps

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TransferResult:
    """What `transfer_prefill` returns: the target `cache`, the source's outputs and the [`TransferDecision`]."""

    cache: DynamicCache
    source_outputs: Any
    decision: TransferDecision


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
            its K/V (`hf_kvbridge.utils.source_features`): the source prefill returns them (`output_hidden_states`) and
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
    residual = 0 < plan.recompute_layers < num_layers  # the top layers start from a mapped residual
    src_device, device = execution_device(source), execution_device(target)
    ids, mask, pos = input_ids.to(device), attention_mask.to(device), positions.to(device)
    steps = TransferSteps(
        plan,
        map_fn,
        positions=pos,
        num_layers=num_layers,
        input_ids=ids,
        attention_mask=mask,
        residual_fn=residual_fn,
        hidden_features=hidden_features,
    )
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

    if plan.gate == "skipped":
        logger.info("quality gate skipped: sink and probe tokens cover the %d-token prompt, nothing is mapped", length)
    source_kv = SourceKV(output_cache(source_out), states if source_out.hidden_states is not None else None)
    cache = steps.before_target(source_kv, None, TargetSide(target, target_run))
    if steps.gated:
        cache = target_run(plan.probe_start, length, cache)  # the target's own K/V for the probe tokens
        ok = steps.gate(cache, plan.probe_start)
        if not ok.all():
            logger.info(
                "quality gate: probe K/V cosine %s below %.4f in rows %s, the target prefills those rows itself",
                [round(x, 4) for x in steps.scores],
                plan.gate_threshold,
                (~ok).nonzero().flatten().tolist(),
            )
            if not ok.any():
                cache = target_run(0, length, None)
            else:
                copy_batch_rows(cache, target_run(0, length, None, rows=(~ok).to(device)), ~ok)
    return TransferResult(cache, source_out, steps.decision())
