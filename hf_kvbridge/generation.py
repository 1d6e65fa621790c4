"""What `KVBridgeForCausalLM.forward` and `generate` do beyond calling the target: the bridged forward pass of a prompt
and the mapped cache handed to the target's `generate`. The bridge hands these functions what they need of it (a
[`BridgedPrefill`]: the target, its device, `hold_back` and two functions), never itself."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from .errors import InvalidInputError
from .utils.cache import CACHE_KWARG, cache_kwargs, output_cache
from .utils.masks import positions_from_mask

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BridgedPrefill:
    """What the bridged forward pass and `generate` need of a bridge (`KVBridgeForCausalLM.bridged_prefill()`).

    Args:
        target (`nn.Module`): the target model.
        device (`torch.device`): where the target computes.
        hold_back (`int`): prompt tokens the target runs itself on the mapped cache (`config.hold_back`).
        check_length (`Callable[[int], None]`): refuses a prompt longer than the target's context.
        prefill (`Callable`): `prefill(input_ids, attention_mask, *, position_ids=None, source_logits=True)` →
            `(target cache, source outputs)`, the bridge's own `prefill`.
    """

    target: nn.Module
    device: torch.device
    hold_back: int
    check_length: Callable[[int], None]
    prefill: Callable[..., tuple]


def target_forward(
    bridge: BridgedPrefill, input_ids, attention_mask, position_ids, labels, use_cache, /, **kwargs: Any
):
    """The target alone over `input_ids`: `bridge.forward` decoding on a cache (its cache keyword in `kwargs`), or a
    prompt too short to bridge."""
    return bridge.target(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        labels=labels,
        use_cache=use_cache,
        **kwargs,
    )


def bridged_forward(
    bridge, input_ids, attention_mask, prefill_length, position_ids, labels, use_cache, **kwargs: Any
) -> CausalLMOutputWithPast:
    """`bridge.forward` without a cache (`bridge`: a [`BridgedPrefill`]): the source prefills
    `[0, prefill_length - hold_back)`, the mapper carries its KV over (`bridge.prefill`), the target runs the rest on
    the mapped cache; the logits are the source's where it ran and the target's after. A prompt too short to bridge is
    the target's alone."""
    seq = input_ids.shape[1]
    bridge.check_length(seq)
    prefill_length = seq if prefill_length is None else int(prefill_length)
    if not 1 <= prefill_length <= seq:
        raise InvalidInputError(
            f"prefill_length must be in [1, {seq}] (the prompt's length inside input_ids), got {prefill_length}"
        )
    split = prefill_length - bridge.hold_back
    if position_ids is None:
        position_ids = positions_from_mask(attention_mask)
    position_ids = position_ids.expand(input_ids.shape[0], -1)
    if split <= 0:  # nothing for the source to prefill: the target computes everything itself
        logger.info(
            "prompt too short to bridge (prefill_length=%d, hold_back=%d): target only",
            prefill_length,
            bridge.hold_back,
        )
        return target_forward(bridge, input_ids, attention_mask, position_ids, labels, use_cache, **kwargs)
    mapped, source_out = bridge.prefill(
        input_ids[:, :split], attention_mask[:, :split], position_ids=position_ids[:, :split]
    )
    device = bridge.device
    target_out = bridge.target(
        input_ids=input_ids[:, split:].to(device),
        attention_mask=attention_mask.to(device),
        position_ids=position_ids[:, split:].to(device),
        **cache_kwargs(mapped),
        use_cache=True,
        **kwargs,
    )
    logits = torch.cat([source_out.logits.to(device, target_out.logits.dtype), target_out.logits], dim=1)
    loss = None
    if labels is not None:
        shift_logits = logits[:, :-1].float()
        shift_labels = labels[:, 1:].to(device)
        loss = nn.functional.cross_entropy(
            shift_logits.reshape(-1, shift_logits.shape[-1]), shift_labels.reshape(-1), ignore_index=-100
        )
    return CausalLMOutputWithPast(
        loss=loss, logits=logits, **cache_kwargs(output_cache(target_out) if use_cache else None)
    )


def generation_inputs(bridge: BridgedPrefill, input_ids, attention_mask, kwargs: dict[str, Any]):
    """What `bridge.generate` hands the target's `generate`: the prompt and its mask on the target's device, and in
    `kwargs` (updated in place) the mapped cache of all but the prompt's last `hold_back` tokens, under the cache
    keyword of this transformers version (`cache=` or `past_key_values=`; either spelling is taken).

    Returns:
        `(input_ids, attention_mask)`.
    """
    if input_ids is None:
        input_ids = kwargs.pop("inputs", None)
    if input_ids is None:
        raise InvalidInputError("generate needs input_ids (or inputs): pass the tokenized prompt")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    device = bridge.device
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    for spelling in ("cache", "past_key_values"):  # either spelling, passed on as this transformers names it
        if spelling in kwargs and spelling != CACHE_KWARG:
            kwargs[CACHE_KWARG] = kwargs.pop(spelling)
    split = input_ids.shape[1] - bridge.hold_back
    if kwargs.get(CACHE_KWARG) is None and split > 0:
        bridge.check_length(input_ids.shape[1])
        kwargs[CACHE_KWARG], _ = bridge.prefill(input_ids[:, :split], attention_mask[:, :split], source_logits=False)
    return input_ids, attention_mask
