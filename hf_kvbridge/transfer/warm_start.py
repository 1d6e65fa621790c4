"""The warm cascade: generating with the target from a source cache the caller already holds (a cascade that drafted
with the source, a router that switches models, a session handed over).

```
source cache (the prompt's first S tokens) ──map, in place──▶ target cache ──target: tokens [min(S, L - hold_back), L)
     (the hold-back forward; eager, or the target's compiled call on a StaticCache)──▶ first token ──generate──▶ rest
```

It costs the map and the target's forward over the tokens the source cache does not cover (at least the
`hold_back` last ones) and nothing more: no source prefill, no copy of the mapped cache (it is written where the
target reads it), one set of positions, one mask built by the target's own forward, and the first token chosen from
that forward's logits with `generate`'s own logits processors (greedy or sampled). With more than one new token,
`generate` continues from the cache with the first token as its input. The map is a transfer as `prefill` runs it:
planned by the plan function (`plan_transfer`, or the bridge's `transfer_plan`) over the `min(S, L - hold_back)`
tokens mapped, run by `TransferSteps` (a plan with nothing of the target inside the mapped span: `check_warm_plan`),
and its [`TransferDecision`] handed to `record`. Called with the models and a map function; keeps nothing (the bridge
keeps the static cache it reuses, and the decision).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import Cache, DynamicCache, StaticCache

from ..errors import ConfigurationError, InvalidInputError
from ..utils.cache import CACHE_KWARG, cache_kwargs, cache_layer_kv
from ..utils.devices import decoder_layers
from ..utils.masks import positions_from_mask
from .plan import TransferPlan, plan_transfer
from .steps import SourceKV, TransferDecision, TransferSteps

logger = logging.getLogger(__name__)


def check_warm_inputs(source_cache: Cache, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> int:
    """Checks a source cache against the prompt it continues and returns the tokens it covers.

    The cache must hold the first `S ≤ L` tokens of the `L`-token prompt, for the same rows; the prompt may be
    padded on the left only (the positions are the mask's, as `generate` makes them).
    """
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise InvalidInputError(
            f"input_ids must be (batch, seq) with an attention_mask of the same shape, got {tuple(input_ids.shape)} "
            f"and {tuple(attention_mask.shape)}"
        )
    mask = attention_mask.bool()
    if (mask[:, :-1] & ~mask[:, 1:]).any():  # a real token followed by padding
        raise InvalidInputError(
            "the prompt is padded on the right; pad it on the left (tokenizer.padding_side = 'left'), as generate "
            "expects of a decoder"
        )
    if not getattr(source_cache, "layers", None):
        raise InvalidInputError("source_cache is empty; pass the cache of a source forward pass over the prompt")
    keys, _ = cache_layer_kv(source_cache, 0)
    held = source_cache.get_seq_length()
    held = int(held) if not isinstance(held, int) else held
    if keys.shape[0] != input_ids.shape[0]:
        raise InvalidInputError(
            f"the source cache holds {keys.shape[0]} rows but input_ids has {input_ids.shape[0]}; pass the cache of "
            "these prompts"
        )
    if held > input_ids.shape[1]:
        raise InvalidInputError(
            f"the source cache holds {held} tokens but the prompt has {input_ids.shape[1]}; pass the whole prompt "
            "(the cached tokens, then any new ones)"
        )
    return held


def check_warm_plan(plan: TransferPlan, hidden_features: bool) -> None:
    """Refuses a warm start that the bridge's transfer plan (`plan_from_config` of the mapped length) cannot do from a
    source cache alone: attention sinks, the quality gate's probe, token or layer recompute, and hidden-state features
    need the source's own forward pass or the target's tokens inside the mapped span."""
    asked = [
        name
        for name, on in (
            ("sink_tokens", plan.map_start > 0),
            ("gate_threshold", plan.gate is not None),
            ("recompute_fraction", plan.recompute_tokens > 0),
            ("recompute_layers", plan.recompute_layers > 0),
            ("source_features", hidden_features),
        )
        if on
    ]
    if asked:
        raise ConfigurationError(
            f"generate_from_cache maps the source cache as it is, but this bridge's config asks for "
            f"{', '.join(asked)}, which need the source's own forward pass or the target's tokens inside the mapped "
            "span; use bridge.generate (or set them off in bridge.config)"
        )


def new_tokens_wanted(generation_config, prompt_length: int) -> int:
    """`max_new_tokens`, or what `max_length` leaves after the prompt (as `generate` reads them)."""
    if generation_config.max_new_tokens is not None:
        return int(generation_config.max_new_tokens)
    return max(0, int(generation_config.max_length) - prompt_length)


def static_cache_for(config, batch: int, length: int, dtype, device, kept: StaticCache | None) -> StaticCache:
    """`kept` reset, when it is a static cache of `batch` rows and at least `length` tokens in `dtype` on `device`;
    else a new one (as `generate` reuses its static cache between calls: its tensors keep their addresses, so a
    compiled step captured on them is replayed, not captured again)."""
    layer = kept.layers[0] if kept is not None and kept.layers else None
    if (
        layer is not None
        and layer.is_initialized
        and layer.keys.shape[0] == batch
        and layer.keys.shape[2] >= length
        and layer.keys.dtype == dtype
        and layer.keys.device == torch.device(device)
    ):
        kept.reset()
        return kept
    return StaticCache(config=config, max_cache_len=length)


@torch.no_grad()
def generate_from_source_cache(
    target: nn.Module,
    map_fn: Callable[..., Cache],
    source_cache: Cache,
    input_ids: torch.LongTensor | None,
    attention_mask: torch.Tensor | None = None,
    *,
    hold_back: int = 1,
    cache: Cache | None = None,
    cache_implementation: str | None = None,
    compile_hold_back: bool | None = None,
    keep: dict | None = None,
    transfer_plan: Callable[[int], TransferPlan] = plan_transfer,
    record: Callable[[TransferDecision], None] | None = None,
    **kwargs: Any,
):
    """Generates with `target` from `source_cache`, mapped by `map_fn` (see the module docstring).

    Args:
        target (`nn.Module`): the target model (a `GenerationMixin`).
        map_fn (`Callable`): `map_fn(source_cache, position_ids, target_cache=...)`, the bridge's `map_cache`.
        source_cache (`Cache`): the source's cache of the prompt's first tokens.
        input_ids (`torch.LongTensor` of shape `(batch, seq)`), attention_mask (*optional*): the whole prompt.
        hold_back (`int`, *optional*, defaults to `1`): prompt tokens the target computes itself at least.
        cache (`Cache`, *optional*): an empty target cache to map into (a `StaticCache` is written in place); a new
            `DynamicCache` otherwise (`past_key_values=` is the same).
        cache_implementation (`str`, *optional*): `"static"` maps into a `StaticCache` of the prompt and the new
            tokens (kept in `keep["static_cache"]` and reused while it fits), as `generate(cache_implementation=
            "static")` decodes; `None` or `"dynamic"`: a `DynamicCache`.
        compile_hold_back (`bool`, *optional*): run the hold-back forward through the target's compiled call
            (`get_compiled_call`, transformers' own compiled decoding step); `None` compiles where `generate` would
            compile its decoding steps (a static cache on a GPU).
        keep (`dict`, *optional*): where the static cache is kept between calls (the bridge's).
        transfer_plan (`Callable`, *optional*, defaults to `plan_transfer`): `transfer_plan(length)` → the
            [`TransferPlan`] of the `length` tokens mapped (the bridge's `transfer_plan`); refused by
            `check_warm_plan` where the target would compute tokens inside them.
        record (`Callable`, *optional*): called with the map's [`TransferDecision`] (the bridge keeps it in
            `last_transfer`, as `prefill` does); not called when nothing is mapped.
        kwargs: `generate`'s arguments (`max_new_tokens`, `do_sample`, `generation_config`, `streamer`,
            `return_dict_in_generate`, ...), greedy or sampled decoding.

    Returns:
        what `generate` returns: the sequences `(batch, seq + new)`, or a `GenerateDecoderOnlyOutput`.
    """
    if input_ids is None:
        raise InvalidInputError("generate_from_cache needs input_ids (or inputs): pass the whole prompt")
    for spelling in ("cache", "past_key_values"):  # either spelling of generate's cache argument
        cache = kwargs.pop(spelling) if cache is None and spelling in kwargs else cache
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    held = check_warm_inputs(source_cache, input_ids, attention_mask)
    device = target.device
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    batch, length = input_ids.shape
    # transformers' own preparation (the generation config with kwargs applied, special tokens, logits processors),
    # as `generate` does it, so that the first token is the one `generate` would choose
    config = kwargs.pop("generation_config", None)
    generation_config, model_kwargs = target._prepare_generation_config(config, **kwargs)
    if generation_config.num_beams != 1 or model_kwargs.get("assistant_model") is not None:
        raise InvalidInputError(
            "generate_from_cache decodes greedily or by sampling; for beam search or assisted decoding use "
            "bridge.generate"
        )
    streamer = model_kwargs.pop("streamer", None)
    logits_processor = model_kwargs.pop("logits_processor", None)
    wanted = new_tokens_wanted(generation_config, length)
    if wanted == 0:  # nothing to generate: nothing to map either
        return input_ids
    covered = min(held, length - hold_back)
    if cache_implementation not in (None, "dynamic", "static"):
        raise InvalidInputError(
            f"cache_implementation must be 'static' or 'dynamic' here, got {cache_implementation!r}"
        )
    if cache is not None and cache_implementation is not None:
        raise InvalidInputError("pass either a cache or cache_implementation, not both (as generate refuses)")
    if cache_implementation == "static":
        keep = {} if keep is None else keep
        cache = static_cache_for(target.config, batch, length + wanted, target.dtype, device, keep.get("static_cache"))
        keep["static_cache"] = cache
    elif cache is None:
        cache = DynamicCache(config=target.config)
    positions = positions_from_mask(attention_mask)  # (B, L), once for the map and the target
    if covered > 0:  # the map of tokens [0, covered), planned and run as every transfer is
        plan = transfer_plan(covered)
        check_warm_plan(plan, hidden_features=False)
        steps = TransferSteps(plan, map_fn, positions=positions[:, :covered], num_layers=len(decoder_layers(target)))
        cache = steps.before_target(SourceKV(source_cache), cache)
        if record is not None:
            record(steps.decision())
    forward = target.__call__
    if compile_hold_back is None:
        compile_hold_back = _compiles_decoding(target, cache, generation_config)
    if compile_hold_back:
        if not getattr(cache, "is_compileable", False):
            raise InvalidInputError(
                "compile_hold_back needs a static cache (cache_implementation='static'): a DynamicCache changes shape "
                "at every step"
            )
        forward = target.get_compiled_call(generation_config.compile_config)
    # the inputs as `generate` prepares them (a static cache gets its 4-D mask of the cache's full length, built here
    # once, outside the compiled step): a one-token hold-back is then the very step `generate` decodes with
    inputs = target.prepare_inputs_for_generation(
        input_ids,
        next_sequence_length=length - covered,
        attention_mask=attention_mask,
        position_ids=positions,
        use_cache=True,
        **cache_kwargs(cache),
    )
    outputs = forward(**inputs, logits_to_keep=1, return_dict=True)
    logits = outputs.logits[:, -1].to(copy=True, dtype=torch.float32)  # (B, V)
    target._prepare_special_tokens(generation_config, True, device=device, batch_size=batch)
    processors = target._get_logits_processor(
        generation_config=generation_config,
        input_ids_seq_length=length,
        encoder_input_ids=input_ids,
        prefix_allowed_tokens_fn=None,
        logits_processor=logits_processor,
        device=device,
        model_kwargs={"attention_mask": attention_mask},
    )
    scores = processors(input_ids, logits)
    if generation_config.do_sample:
        first = torch.multinomial(nn.functional.softmax(scores, dim=-1), num_samples=1).squeeze(1)
    else:
        first = scores.argmax(-1)  # (B,)
    sequences = torch.cat([input_ids, first[:, None]], dim=-1)
    if streamer is not None:
        streamer.put(input_ids.cpu())
        streamer.put(first.cpu())
    eos = generation_config._eos_token_tensor
    finished = torch.isin(first, eos) if eos is not None else torch.zeros_like(first, dtype=torch.bool)
    if wanted == 1 or bool(finished.all()):
        if streamer is not None:
            streamer.end()
        return _output(generation_config, sequences, (scores,), (logits,), cache)
    rest = target.generate(
        input_ids=sequences,
        attention_mask=torch.cat([attention_mask, attention_mask.new_ones(batch, 1)], dim=-1),
        generation_config=_continued(generation_config, wanted),
        logits_processor=logits_processor,
        streamer=None if streamer is None else _SkipPrompt(streamer),
        **cache_kwargs(cache),
        **model_kwargs,
    )
    if not generation_config.return_dict_in_generate:
        return _pad_finished(rest, finished, length + 1, generation_config)
    rest.sequences = _pad_finished(rest.sequences, finished, length + 1, generation_config)
    if rest.scores is not None:
        rest.scores = (scores, *rest.scores)
    if rest.logits is not None:
        rest.logits = (logits, *rest.logits)
    return rest


def _compiles_decoding(target: nn.Module, cache: Cache, generation_config) -> bool:
    """Whether `generate` would run `target`'s decoding steps through its compiled call with `cache`
    (transformers' own criteria: a compileable cache on an accelerator, compilation not disabled)."""
    check = getattr(target, "_valid_auto_compile_criteria", None)
    return bool(check is not None and check({CACHE_KWARG: cache}, generation_config))


def _continued(generation_config, wanted: int):
    """The generation config of the continuing `generate` call, which starts one token later."""
    continued = copy.deepcopy(generation_config)
    continued.max_new_tokens, continued.max_length = wanted - 1, None
    if continued.min_new_tokens:
        continued.min_new_tokens = max(0, continued.min_new_tokens - 1)
    return continued


def _pad_finished(sequences: torch.Tensor, finished: torch.Tensor, start: int, generation_config) -> torch.Tensor:
    """Rows whose first token ended them get padding after it, as `generate` pads a finished row."""
    if not finished.any():
        return sequences
    pad = generation_config._pad_token_tensor
    sequences[finished, start:] = pad if pad is not None else generation_config._eos_token_tensor.flatten()[0]
    return sequences


def _output(generation_config, sequences, scores, logits, cache):
    """`generate`'s return value for one new token."""
    if not generation_config.return_dict_in_generate:
        return sequences
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    return GenerateDecoderOnlyOutput(
        sequences=sequences,
        scores=scores if generation_config.output_scores else None,
        logits=logits if generation_config.output_logits else None,
        **{CACHE_KWARG: cache},
    )


class _SkipPrompt:
    """A streamer that passes on everything but the first `put` (the continuing `generate` call's prompt, which
    the caller's streamer has seen already, with the first token)."""

    def __init__(self, streamer):
        self.streamer, self.started = streamer, False

    def put(self, value):
        if self.started:
            self.streamer.put(value)
        self.started = True

    def end(self):
        self.streamer.end()
