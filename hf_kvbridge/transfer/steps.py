"""The steps of a transfer, written once: what `transfer_prefill`, a handoff session's sync and the vLLM worker run.

A transfer is a unit in two phases around the target's own forward pass over the tokens it computes itself:

```
before the target's forward                                       after it
 sinks ──▶ map the span ──▶ layer recompute ──▶ token recompute    probe gate: own vs mapped K/V of the probe
 (target)  (source K/V)     (top n layers)      (chosen tokens)    ──▶ decision (per row: keep, or fall back)
           └──▶ map the probe (kept for the gate)
```

The plan (`transfer.plan.TransferPlan`) says which steps run. In vLLM the target's forward (and so its own K/V of the
probe) happens inside the engine's step, between the two phases; the worker runs no target model, and its plan has
nothing that needs one (no sinks, no layer or token recompute: vLLM computes a recomputed tail itself, after the
loaded prefix). What each caller does with a refusal stays its own: `transfer_prefill` re-prefills the refused rows,
a session crops its cache, the vLLM worker reports the load's blocks as failed.

Example:

```python
>>> plan = plan_transfer(12, gate_threshold=0.9, gate_probe_tokens=4)
>>> steps = TransferSteps(plan, bridge.map_cache, positions=torch.arange(12)[None], num_layers=3)  # doctest: +SKIP
>>> cache = steps.before_target(SourceKV(source_cache))  # doctest: +SKIP
>>> cache = target(ids[:, 8:], past_key_values=cache).past_key_values  # the target's own probe  # doctest: +SKIP
>>> steps.gate(cache, at=8), steps.decision()  # doctest: +SKIP
```
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from transformers import Cache

from ..errors import InvalidInputError
from ..utils.cache import slice_cache
from .layer_recompute import recompute_top_layers
from .plan import TransferPlan, plan_transfer  # noqa: F401  plan_transfer: the examples
from .token_recompute import recompute_mapped

MapFunction = Callable[..., Cache]
"""`map_fn(source_cache, position_ids, target_cache=None, hidden_states=None) -> Cache`, e.g.
`KVBridgeForCausalLM.map_cache`."""

ResidualFunction = Callable[..., torch.Tensor]
"""`residual_fn(source_hidden_states, recompute_layers) -> (B, T, D_t)`: the hidden state entering target layer
`L_t − recompute_layers`, mapped from the source's hidden states of the same `T` tokens (`L_s + 1` tensors of
`(B, T, D_s)`), e.g. `KVBridgeForCausalLM.map_residual`."""


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


@dataclass
class SourceKV:
    """The source's side of a transfer: its cache of the prompt's tokens from position `0`, and (when a map or the
    residual map reads them) its hidden states of any span.

    Args:
        cache (`Cache`): the source's K/V, `(batch, kv_heads, seq, head_dim)` a layer.
        hidden_states (`Callable`, *optional*): `hidden_states(start, end)` → the source's `output_hidden_states` of
            tokens `[start, end)` (`L_s + 1` tensors of `(batch, end − start, D_s)`).
    """

    cache: Cache
    hidden_states: Callable[[int, int], Sequence[torch.Tensor]] | None = None

    def kv(self, start: int, end: int) -> Cache:
        """The source's K/V of tokens `[start, end)` (the cache itself when that is all of it)."""
        if start == 0 and end == self.cache.get_seq_length():
            return self.cache
        return slice_cache(self.cache, start, end)


@dataclass
class TargetSide:
    """The target, for the steps it runs itself before its forward (sinks, a span it computes whole, layer and token
    recompute).

    Args:
        model (`nn.Module`): the target model.
        run (`Callable`): `run(start, end, cache)` → the cache with the target's own K/V of tokens `[start, end)`
            appended (a forward pass over them on `cache`).
    """

    model: nn.Module
    run: Callable[[int, int, Cache | None], Cache]


class TransferSteps:
    """One transfer, run as `plan` says, in two phases (see the module docstring).

    Args:
        plan ([`TransferPlan`]): the positions.
        map_fn (`Callable`): the mapping engine bound to a mapper (see `MapFunction`).
        positions (`torch.LongTensor` of shape `(batch, plan.length)`): the tokens' positions.
        num_layers (`int`): the target's decoder layers.
        input_ids (`torch.LongTensor` of shape `(batch, plan.length)`, *optional*): the tokens (token recompute runs
            the target over chosen ones).
        attention_mask (`torch.Tensor` of shape `(batch, plan.length)`, *optional*): 1 for real tokens (default: all).
        residual_fn (`Callable`, *optional*): the residual map (see `ResidualFunction`), when
            `0 < plan.recompute_layers < num_layers`.
        hidden_features (`bool`, *optional*, defaults to `False`): `map_fn` reads the source's hidden states beside
            its K/V (`hf_kvbridge.utils.source_features`): it gets those of the tokens it maps as `hidden_states=`.
    """

    def __init__(
        self,
        plan: TransferPlan,
        map_fn: MapFunction,
        *,
        positions: torch.Tensor,
        num_layers: int,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        residual_fn: ResidualFunction | None = None,
        hidden_features: bool = False,
    ):
        self.plan, self.map_fn, self.num_layers = plan, map_fn, num_layers
        self.positions, self.input_ids = positions, input_ids  # (B, length) each
        if attention_mask is None:
            attention_mask = torch.ones(positions.shape, dtype=torch.long, device=positions.device)
        self.mask = attention_mask  # (B, length)
        self.residual_fn, self.hidden_features = residual_fn, hidden_features
        top = plan.recompute_layers
        if 0 < top < num_layers and residual_fn is None:
            raise InvalidInputError(
                f"the plan recomputes the target's top {top} layers, which start from a mapped residual stream; pass "
                "residual_fn (the bridge's map_residual)"
            )
        self.recomputed = 0  # the most tokens a row recomputed (token recompute)
        self.mapped_probe: Cache | None = None  # the mapped K/V of the probe tokens, for the gate
        self.scores: list[float] | None = None
        self.ok: torch.Tensor | None = None  # (B,) bool: rows whose mapped cache the gate kept

    @property
    def gated(self) -> bool:
        """Whether the gate checks probe tokens (after the target's forward computed its own K/V of them)."""
        return self.plan.probe_tokens > 0

    def _features(self, source: SourceKV, start: int, end: int) -> dict:
        return {"hidden_states": source.hidden_states(start, end)} if self.hidden_features else {}

    @torch.no_grad()
    def before_target(
        self,
        source: SourceKV,
        cache: Cache | None = None,
        target: TargetSide | None = None,
        *,
        cached: int = 0,
        after_map: Callable[[Cache], Cache] | None = None,
    ) -> Cache | None:
        """Phase one: the attention sinks (the target's own), the mapped span (or the target's own span, when it
        recomputes every layer), layer recompute and token recompute over it, and the mapped K/V of the probe (kept
        for `gate`). Returns the target cache of tokens `[0, plan.map_end)`.

        Args:
            source ([`SourceKV`]): the source's K/V (and hidden states) of the tokens.
            cache (`Cache`, *optional*): the target's cache of tokens `[0, cached)` to append to.
            target ([`TargetSide`], *optional*): the target, for the steps it runs; `None` where the plan needs none
                (the vLLM worker).
            cached (`int`, *optional*, defaults to `0`): tokens `cache` holds already.
            after_map (`Callable`, *optional*): called on the cache right after the map (a session's recording).
        """
        plan, layers = self.plan, self.num_layers
        sink_end, map_end, top = plan.map_start, plan.map_end, plan.recompute_layers
        mapping = map_end > sink_end
        needs_target = sink_end > cached or (mapping and top > 0) or (mapping and plan.recompute_tokens > 0)
        if needs_target and target is None:
            raise InvalidInputError(
                f"the transfer plan has the target compute tokens itself (sinks to {sink_end}, recompute_layers="
                f"{top}, recompute_tokens={plan.recompute_tokens}) and no target was given to run them"
            )
        positions, mask = self.positions, self.mask
        if sink_end > cached:  # the attention sinks: the target's own K/V, never mapped ones
            cache = target.run(cached, sink_end, cache)
        if mapping and top >= layers:  # every layer recomputed: the target computes the span itself
            cache = target.run(sink_end, map_end, cache)
        elif mapping:
            span = positions[:, sink_end:map_end]  # (B, span)
            features = self._features(source, sink_end, map_end)
            cache = self.map_fn(source.kv(sink_end, map_end), span, target_cache=cache, **features)
            if after_map is not None:
                cache = after_map(cache)
            if top > 0:  # the top layers compute the span themselves, from the residual mapped at each token
                stream = self.residual_fn(source.hidden_states(sink_end, map_end), top)  # (B, span, D_t)
                recompute_top_layers(target.model, cache, stream, mask[:, :map_end], span, sink_end, layers - top)
            if plan.recompute_tokens:  # the target recomputes a share of the tokens just mapped
                self.recomputed = recompute_mapped(
                    target.model,
                    cache,
                    self.input_ids[:, :map_end],
                    mask[:, :map_end],
                    positions[:, :map_end],
                    sink_end,
                    count=plan.recompute_tokens,
                    policy=plan.recompute_policy,
                    seed=plan.recompute_seed,
                )
        if self.gated:  # the mapped K/V of the probe, which the target computes itself in its forward
            start, end = plan.probe_start, plan.length
            self.mapped_probe = self.map_fn(
                source.kv(start, end), positions[:, start:end], **self._features(source, start, end)
            )
        return cache

    @torch.no_grad()
    def score(self, own: Cache, at: int) -> torch.Tensor:
        """The gate's scores, decided nothing yet: the mapped probe against the target's own K/V of the probe tokens,
        which `own` holds from index `at` (`probe_agreement`), row by row.

        Returns:
            `torch.Tensor` of shape `(batch,)`, float32, on the CPU.
        """
        plan = self.plan
        probe_mask = self.mask[:, plan.probe_start : plan.length]  # (B, probe)
        return probe_agreement(own, self.mapped_probe, at, probe_mask).cpu()  # (B,)

    def judge(self, scores: torch.Tensor) -> torch.Tensor:
        """The gate's decision on `scores` `(batch,)` (this transfer's own, or aggregated elsewhere: the vLLM worker
        averages them over its tensor-parallel ranks): a row below `plan.gate_threshold` falls back, and so does a row
        whose score is NaN (it could not be scored). The one place where a score meets the threshold.

        Returns:
            `torch.Tensor` of shape `(batch,)`, bool: the rows that keep their mapped cache (also in `self.ok`; the
            scores in `self.scores`, `None` for a row that could not be scored).
        """
        scores = scores.float().cpu()
        self.scores = [None if x != x else float(x) for x in scores.tolist()]
        self.ok = scores >= self.plan.gate_threshold  # NaN compares False: a row that could not be scored falls back
        return self.ok

    @torch.no_grad()
    def gate(self, own: Cache, at: int) -> torch.Tensor:
        """Phase two: `judge(score(own, at))`, the gate of this transfer's own scores.

        Returns:
            `torch.Tensor` of shape `(batch,)`, bool: the rows that keep their mapped cache.
        """
        return self.judge(self.score(own, at))

    def fail(self) -> TransferDecision:
        """The decision when the transfer could not run (its mapping failed): every row falls back."""
        self.ok = torch.zeros(self.positions.shape[0], dtype=torch.bool)
        return self.decision()

    def decision(self) -> TransferDecision:
        """What the transfer did (after `gate` or `judge`, when the plan has a probe)."""
        return decide(self.plan, self.num_layers, self.ok, self.scores, self.recomputed, self.positions.shape[0])


def decide(
    plan: TransferPlan,
    num_layers: int | None = None,
    ok: torch.Tensor | None = None,
    scores: list[float | None] | None = None,
    recomputed: int = 0,
    batch: int = 1,
) -> TransferDecision:
    """The [`TransferDecision`] of a transfer run as `plan` says: `ok` `(batch,)` the rows that kept their mapped
    cache (default: all), `scores` the gate's per row, `recomputed` the most tokens a row recomputed; `num_layers`
    (the target's) tells whether layer recompute covered every layer (needed only with `plan.recompute_layers`)."""
    ok = ok if ok is not None else torch.ones(batch, dtype=torch.bool)
    # own span: every layer recomputed, no mapped K/V left
    own_span = bool(plan.recompute_layers) and num_layers is not None and plan.recompute_layers >= num_layers
    kept = bool(ok.any())
    sink_end = plan.map_start
    return TransferDecision(
        transferred=bool(ok.all()),
        rows_transferred=ok.tolist(),
        mapped_tokens=plan.map_end - sink_end - recomputed if kept and not own_span else 0,
        target_tokens=sink_end + plan.probe_tokens + recomputed if kept and not own_span else plan.length,
        recomputed_tokens=recomputed if kept else 0,
        score=None if not scores or None in scores else min(scores),
        scores=scores,
        gate=plan.gate,
        recomputed_layers=plan.recompute_layers if kept else 0,
    )


def served_outcome(decision: TransferDecision, plan: TransferPlan, *, reason: str | None = None) -> dict[str, Any]:
    """A served request's record of `decision` (one row; what the vLLM connector reports as its status): `"mapped"`
    (its mapped cache kept; with the gate's `score` and `probe_tokens` when it checked), `"gated"` (the gate checked
    and refused: `score`, `threshold`, `probe_tokens`) or `"fallback"` (the transfer could not run); `reason` says why
    where something failed.

    Example:

    ```python
    >>> plan = plan_transfer(8, gate_threshold=0.9, gate_probe_tokens=2)
    >>> served_outcome(decide(plan, ok=torch.tensor([False]), scores=[0.5]), plan)
    {'status': 'gated', 'mapped_tokens': 0, 'score': 0.5, 'threshold': 0.9, 'probe_tokens': 2}
    ```
    """
    checked = decision.gate == "checked" and decision.scores is not None
    if decision.transferred:
        gate = {"score": decision.score, "probe_tokens": plan.probe_tokens} if checked else {}
        return {"status": "mapped", "mapped_tokens": decision.mapped_tokens, **gate}
    because = {"reason": reason} if reason else {}
    if not checked:
        return {"status": "fallback", "mapped_tokens": 0, **because}
    gate = {"score": decision.score, "threshold": plan.gate_threshold, "probe_tokens": plan.probe_tokens}
    return {"status": "gated", "mapped_tokens": 0, **gate, **because}
