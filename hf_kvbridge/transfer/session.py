"""Multi-turn handoff: one conversation, a cache per model, and cheap switches between the two models.

On a switch, only the tokens the other model added since the last sync are mapped (incrementally, positions
continuing through RoPE) and appended to the receiving model's cache; the receiving model then computes the rest of
the prompt itself and generates. `remap="full"` instead re-maps the other model's whole cache at every switch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from ..errors import InvalidInputError
from ..utils.cache import cache_kwargs, crop_cache, output_cache, slice_cache
from ..utils.devices import decoder_layers, execution_device
from .plan import plan_from_config
from .steps import MapFunction, ResidualFunction, SourceKV, TargetSide, TransferDecision, TransferSteps

logger = logging.getLogger(__name__)

MODELS = ("source", "target")


@dataclass
class HandoffTurn:
    """What one turn did: which model answered, the reply, and how the model's cache was brought up to date."""

    model: str
    text: str
    token_ids: list[int]
    mapped_tokens: int
    prefilled_tokens: int
    cache_tokens: int
    gate_score: float | None = None  # the quality gate's probe cosine of this turn's mapping (`None`: no gate ran)
    fell_back: bool = False  # the gate refused the mapping and the model computed those tokens itself
    recomputed_tokens: int = 0  # mapped tokens this model then recomputed itself (`config.recompute_fraction`)
    recomputed_layers: int = 0  # top layers this model computed over the mapped tokens (`config.recompute_layers`)


@dataclass
class _ModelState:
    cache: DynamicCache | None = None
    tokens: list[int] = field(default_factory=list)  # the conversation tokens this model's cache holds


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _new_cache(config) -> DynamicCache:
    """An empty cache for a session: sliding-window layers keep their past until cropped (`_recording`)."""
    return _recording(DynamicCache(config=config))


def _recording(cache: DynamicCache) -> DynamicCache:
    """Lets a session crop `cache` after its sliding-window layers are full (a reply re-tokenised, the last prompt
    token recomputed): those layers keep their past states until the next `crop` instead of dropping them at once."""
    if hasattr(cache, "activate_past_recording"):
        cache.activate_past_recording()
    return cache


def _sync_record(decision: TransferDecision | None) -> dict[str, Any]:
    """`HandoffSession.last_sync`: the fields of the last sync's [`TransferDecision`] a turn reports (zeros and no
    score before a sync has mapped anything)."""
    if decision is None:
        return {"mapped_tokens": 0, "recomputed_tokens": 0, "recomputed_layers": 0, "score": None, "fell_back": False}
    return {
        "mapped_tokens": decision.mapped_tokens,
        "recomputed_tokens": decision.recomputed_tokens,
        "recomputed_layers": decision.recomputed_layers,
        "score": decision.score,
        "fell_back": not decision.transferred,
    }


@dataclass(frozen=True)
class TransferSide:
    """What a session needs of one direction's bridge to map into its receiving model
    (`KVBridgeForCausalLM.transfer_side()`), handed down instead of the bridge.

    Args:
        config ([`KVBridgeConfig`]): the transfer policy (`sink_tokens`, recompute, gate); read at every sync.
        map_fn (`MapFunction`): the bridge's `map_cache`.
        residual_fn (`ResidualFunction`): the bridge's `map_residual` (layer recompute).
        check_recompute_layers (`Callable[[], int]`): checks `config.recompute_layers` against the bridge.
        target (`nn.Module`): the receiving model.
        hidden_features (`bool`): the map reads the source's hidden states beside its K/V.
    """

    config: Any
    map_fn: MapFunction
    residual_fn: ResidualFunction
    check_recompute_layers: Callable[[], int]
    target: nn.Module
    hidden_features: bool = False


class HandoffSession:
    r"""A conversation that can switch between the bridge's source and target model at every turn.

    Args:
        bridge ([`KVBridgeForCausalLM`]): source→target bridge; `bridge.reverse` (from
            `calibrate(..., bidirectional=True)`) is used for target→source switches, which otherwise re-prefill.
        tokenizer: the shared tokenizer; its chat template renders the conversation.
        system_prompt (`str`, *optional*): a system message at the start.
        remap (`str`, *optional*, defaults to `"incremental"`): `"incremental"` maps only the tokens added since the
            last sync; `"full"` re-maps the other model's whole cache at every switch.

    Example:

    ```python
    >>> session = bridge.start_session(tokenizer)  # doctest: +SKIP
    >>> session.add_user("What is a KV cache?")  # doctest: +SKIP
    >>> session.generate(model="source", max_new_tokens=40).text  # doctest: +SKIP
    >>> session.add_user("And why map it?")  # doctest: +SKIP
    >>> turn = session.generate(model="target", max_new_tokens=40)  # doctest: +SKIP
    >>> turn.mapped_tokens, turn.prefilled_tokens  # doctest: +SKIP
    ```
    """

    def __init__(self, bridge, tokenizer=None, *, system_prompt: str | None = None, remap: str = "incremental"):
        if remap not in ("incremental", "full"):
            raise InvalidInputError(f"remap must be 'incremental' or 'full', got {remap!r}")
        self.bridge, self.tokenizer, self.remap = bridge, tokenizer, remap
        self.models = {"source": bridge.source, "target": bridge.target}
        reverse = getattr(bridge, "reverse", None)
        # what each receiving model's map needs (`TransferSide`), handed down once: the session never calls the bridge
        self.mappers = {"target": bridge.transfer_side(), "source": reverse.transfer_side() if reverse else None}
        self.messages: list[dict[str, str]] = []
        if system_prompt:
            self.messages.append({"role": "system", "content": system_prompt})
        self.tokens: list[int] = []  # the whole conversation so far, as the models computed it
        self.states = {name: _ModelState() for name in MODELS}
        self.turns: list[HandoffTurn] = []
        # the decision record of the last sync, the one `transfer_prefill` and the warm start return (`None`: the
        # last sync had nothing to bring over)
        self.last_decision: TransferDecision | None = None

    @property
    def last_sync(self) -> dict[str, Any]:
        """The last sync's decision (`last_decision`) as the fields a turn reports: `mapped_tokens`,
        `recomputed_tokens`, `recomputed_layers`, `score`, `fell_back`."""
        return _sync_record(self.last_decision)

    # -- conversation ----------------------------------------------------------------------------------------------
    def add_user(self, text: str) -> None:
        """Adds a user message; the next `generate` answers it."""
        self.messages.append({"role": "user", "content": text})

    def prompt_tokens(self) -> list[int]:
        """The conversation rendered with the chat template and a generation prompt, as token ids."""
        if self.tokenizer is None:
            raise InvalidInputError(
                "a tokenizer is needed to render the conversation: pass tokenizer= to start_session"
            )
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(self.messages, tokenize=False, add_generation_prompt=True)
        else:  # no template: plain "role: content" lines
            text = "".join(f"{m['role']}: {m['content']}\n" for m in self.messages) + "assistant:"
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    # -- cache bookkeeping -------------------------------------------------------------------------------------------
    def _crop_to(self, name: str, tokens: list[int]) -> None:
        """Drops the part of `name`'s cache that no longer matches `tokens` (e.g. a re-tokenised reply)."""
        state = self.states[name]
        keep = _common_prefix(state.tokens, tokens)
        if keep < len(state.tokens):
            if keep == 0:
                state.cache, state.tokens = None, []
            else:
                crop_cache(state.cache, keep)
                state.tokens = state.tokens[:keep]

    @torch.no_grad()
    def sync(self, name: str, tokens: list[int], upto: int) -> int:
        """Brings `name`'s cache up to `tokens[:upto]` with what the other model has computed; returns how many
        tokens were mapped. Tokens neither model has computed are left for `name` to compute itself.

        The mapping follows the bridge's transfer policy (`hf_kvbridge.transfer`), planned by `plan_from_config` and
        run by `TransferSteps` as `prefill` runs it: the first `sink_tokens` of the conversation are computed by
        `name` itself (the plan's `[0, map_start)`); `recompute_fraction` of the tokens mapped in this sync are
        recomputed by `name` over the mapped cache (chosen by `recompute_policy`, as in `prefill`); and with a quality
        gate (`gate_threshold`) `name` computes the
        last `gate_probe_tokens` of the span itself and compares its own K/V there with the mapped ones; below the
        threshold the mapped span is dropped and left for `name` to compute (`self.last_decision` records it).
        """
        other = "target" if name == "source" else "source"
        for model in MODELS:
            self._crop_to(model, tokens)
        mine, theirs = self.states[name], self.states[other]
        mapper: TransferSide | None = self.mappers[name]
        end = min(len(theirs.tokens), upto)
        self.last_decision = None
        if mapper is None or end <= len(mine.tokens):
            return 0  # nothing the other model has that this one lacks (or no mapper this way: prefill instead)
        if self.remap == "full":  # re-map the other model's whole cache, dropping this model's own
            mine.cache, mine.tokens = None, []
        cached = len(mine.tokens)
        # the span this model lacks, as prefill plans it: the attention sinks (this model's own K/V, never mapped
        # ones) are `[cached, plan.map_start)`, which the steps run
        plan = plan_from_config(end, mapper.config, start=cached)
        if plan.mapped_tokens:
            mapper.check_recompute_layers()  # the config may have changed since the bridge was built
        start, device = plan.map_start, execution_device(mapper.target)
        steps = TransferSteps(
            plan,
            mapper.map_fn,
            positions=torch.arange(end, device=device).unsqueeze(0),  # (1, end)
            num_layers=len(decoder_layers(mapper.target)),
            input_ids=torch.tensor([tokens[:end]], device=device),  # (1, end)
            residual_fn=mapper.residual_fn,
            hidden_features=mapper.hidden_features,
        )

        def run(first: int, last: int, cache):  # this model over tokens [first, last) of its cache
            self._run(name, tokens[:last])
            return mine.cache

        source = SourceKV(theirs.cache, lambda a, b: self._hidden_states(other, a, b))
        cache = steps.before_target(
            source, mine.cache, TargetSide(mapper.target, run), cached=cached, after_map=_recording
        )
        mine.cache, mine.tokens = cache, tokens[: plan.map_end]
        if plan.mapped_tokens == 0:  # the sinks and the probe cover the span: this model computed it itself
            self.last_decision = steps.decision()
            return 0
        if steps.gated:
            self._run(name, tokens[:end])  # this model's own K/V for the probe tokens
            steps.gate(mine.cache, plan.probe_start)
        decision = steps.decision()
        self.last_decision = decision
        if not decision.transferred:
            logger.info(
                "quality gate: probe K/V cosine %.4f < %.4f, the %s computes tokens %d-%d itself",
                decision.score,
                plan.gate_threshold,
                name,
                start,
                end,
            )
            crop_cache(mine.cache, start)
            if start == 0:
                mine.cache = None
            mine.tokens = tokens[:start]
        return decision.mapped_tokens

    @torch.no_grad()
    def _hidden_states(self, name: str, start: int, end: int) -> tuple[torch.Tensor, ...]:
        """`name`'s hidden states (`output_hidden_states`) of the conversation tokens `[start, end)` its cache holds,
        recomputed over its cache of the tokens before them (a view: its cache is left as it is)."""
        state, net = self.states[name], self.models[name]
        past = slice_cache(state.cache, 0, start) if start > 0 else None
        ids = torch.tensor([state.tokens[start:end]], device=net.device)
        positions = torch.arange(start, end, device=net.device).unsqueeze(0)
        out = net(
            input_ids=ids,
            position_ids=positions,
            **cache_kwargs(past),
            use_cache=past is not None,
            logits_to_keep=1,
            output_hidden_states=True,
        )
        return out.hidden_states

    def _run(self, name: str, tokens: list[int]) -> None:
        """Runs `name` over the tokens of `tokens` its cache lacks, appending to its cache."""
        state, net = self.states[name], self.models[name]
        new = tokens[len(state.tokens) :]
        if not new:
            return
        if state.cache is None:
            state.cache = _new_cache(net.config)
        ids = torch.tensor([new], device=net.device)
        positions = torch.arange(len(state.tokens), len(tokens), device=net.device).unsqueeze(0)
        out = net(input_ids=ids, position_ids=positions, **cache_kwargs(state.cache), use_cache=True, logits_to_keep=1)
        state.cache, state.tokens = output_cache(out), list(tokens)

    @torch.no_grad()
    def feed(self, token_ids: list[int], model: str = "target") -> torch.Tensor:
        """Appends `token_ids` to the conversation, run by `model` (after syncing its cache); returns its logits
        `(len(token_ids), vocab)` for them. The low-level step of `generate`, also used by the drift harness."""
        self._check_model(model)
        tokens = self.tokens + list(token_ids)
        self.sync(model, tokens, upto=len(self.tokens))
        state = self.states[model]
        net = self.models[model]
        new = tokens[len(state.tokens) :]
        if state.cache is None:
            state.cache = _new_cache(net.config)
        ids = torch.tensor([new], device=net.device)
        positions = torch.arange(len(state.tokens), len(tokens), device=net.device).unsqueeze(0)
        out = net(input_ids=ids, position_ids=positions, **cache_kwargs(state.cache), use_cache=True)
        state.cache, state.tokens, self.tokens = output_cache(out), tokens, tokens
        return out.logits[0, -len(token_ids) :]

    @torch.no_grad()
    def generate(self, model: str = "target", **generate_kwargs: Any) -> HandoffTurn:
        """Answers the conversation with `model` (`"source"` or `"target"`), like that model's `generate`.

        Returns:
            [`HandoffTurn`] with the reply text and tokens, and how many prompt tokens were mapped from the other
            model's cache vs computed by this model.
        """
        self._check_model(model)
        prompt = self.prompt_tokens()
        mapped = self.sync(model, prompt, upto=len(prompt) - 1)  # the model computes at least the last token
        state, net = self.states[model], self.models[model]
        if len(state.tokens) >= len(prompt):  # generate needs at least one uncached token
            crop_cache(state.cache, len(prompt) - 1)
            state.tokens = state.tokens[: len(prompt) - 1]
        cached = len(state.tokens)
        ids = torch.tensor([prompt], device=net.device)
        generate_kwargs.setdefault(
            "pad_token_id",
            getattr(self.tokenizer, "pad_token_id", None) or getattr(self.tokenizer, "eos_token_id", None),
        )
        if state.cache is None:
            state.cache = _new_cache(net.config)
        output = net.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            **cache_kwargs(state.cache),
            return_dict_in_generate=True,
            **generate_kwargs,
        )
        sequence = output.sequences[0].tolist()
        reply = sequence[len(prompt) :]
        state.cache = output_cache(output)
        state.tokens = sequence[: state.cache.get_seq_length()]
        self.tokens = sequence
        text = self.tokenizer.decode(reply, skip_special_tokens=True) if self.tokenizer is not None else ""
        self.messages.append({"role": "assistant", "content": text})
        turn = HandoffTurn(
            model,
            text,
            reply,
            mapped,
            len(prompt) - cached,
            len(state.tokens),
            gate_score=self.last_sync["score"],
            fell_back=self.last_sync["fell_back"],
            recomputed_tokens=self.last_sync["recomputed_tokens"],
            recomputed_layers=self.last_sync["recomputed_layers"],
        )
        self.turns.append(turn)
        return turn

    def _check_model(self, model: str) -> None:
        if model not in MODELS:
            raise InvalidInputError(f"model must be 'source' or 'target', got {model!r}")

    def cache_bytes(self) -> dict[str, int]:
        """Bytes held by each model's cache (the session keeps nothing else of size)."""
        out = {}
        for name, state in self.states.items():
            total = 0
            if state.cache is not None:
                for layer in state.cache.layers:
                    if getattr(layer, "keys", None) is not None:
                        total += layer.keys.numel() * layer.keys.element_size()
                        total += layer.values.numel() * layer.values.element_size()
            out[name] = total
        return out
