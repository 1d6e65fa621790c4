"""The transfer plan: which positions of a prompt the target computes itself and which it gets mapped, worked out
once from lengths and the config's knobs. Pure index arithmetic (no models, no tensors), shared by
`KVBridgeForCausalLM.prefill` (`transfer.transfer_prefill`), the vLLM connector's scheduler side and a handoff
session's sync (`session.HandoffSession.sync`), so all of them treat the same prompt the same way.

```
 0 ──sinks──▶ map_start ──mapped (recompute: `recompute_tokens` of them)──▶ map_end ──probe──▶ length ──hold-back──▶
 target's own            source prefill + mapper                                     target's own, mapped too (gate)
```
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigurationError

SOURCE_PREFILL = "source_prefill"


def recompute_count(fraction: float, length: int) -> int:
    """How many of `length` context tokens a `fraction` recomputes (rounded up, so any fraction > 0 recomputes one)."""
    if not 0.0 <= fraction <= 1.0:
        raise ConfigurationError(f"recompute_fraction must lie in [0, 1], got {fraction}")
    return min(length, math.ceil(fraction * length))


@dataclass(frozen=True)
class TransferPlan:
    """The positions of one transfer, for the `length` tokens prefilled (the prompt without its held-back tokens).

    Segments, in order: `[0, map_start)` attention sinks (the target computes them) or tokens cached already (a
    continuation, `plan_transfer(start=...)`), `[map_start, map_end)` mapped
    from the source's cache (of which the target recomputes `recompute_tokens`, chosen by `recompute_policy`; with
    `"tail"` they are `[recompute_start, map_end)`), `[map_end, length)` the quality gate's probe (the target computes
    them and compares its own K/V there with the mapped ones). Nothing is mapped when `map_start == map_end`.

    Args:
        length (`int`): tokens the transfer covers (left padding included).
        map_start (`int`), map_end (`int`): the mapped span.
        recompute_tokens (`int`): how many of the mapped tokens the target recomputes (`recompute_fraction`).
        gate (`str`, *optional*): `None` (no quality gate), `"checked"` or `"skipped"` (sinks and probe would cover the
            whole prompt: nothing is mapped, nothing checked).
        gate_threshold (`float`, *optional*), recompute_policy (`str`), recompute_seed (`int`): the knobs the
            transfer applies to these positions.
        kind (`str`, *optional*, defaults to `"source_prefill"`): where the mapped K/V come from.
        recompute_layers (`int`, *optional*, defaults to `0`): the target's top layers that compute the whole mapped
            span themselves, from a mapped residual stream (`hf_kvbridge.transfer.layer_recompute`); the mapped K/V
            then fill only the layers below them. Equal to the target's layer count, the target prefills the span
            itself.
        gate_probe_start (`int`, *optional*): where the probe starts when not at `map_end` (see `probe_start`).

    Later kinds of transfer extend the plan rather than fork it: a cache fetched from a KV store is
    `kind="kv_store"` with the fetched prefix as its mapped span (`map_start` where the fetch begins); a recompute of
    the top n layers is the field `recompute_layers` next to `recompute_tokens`. Every consumer reads only the
    fields it knows, and `plan_transfer` stays the one place where positions are decided.

    Example:

    ```python
    >>> plan = plan_transfer(12, sink_tokens=2, gate_threshold=0.9, gate_probe_tokens=4)
    >>> plan.map_start, plan.map_end, plan.probe_tokens, plan.gate
    (2, 8, 4, 'checked')
    ```
    """

    length: int
    map_start: int
    map_end: int
    recompute_tokens: int = 0
    gate: str | None = None
    gate_threshold: float | None = None
    recompute_policy: str = "tail"
    recompute_seed: int = 0
    kind: str = SOURCE_PREFILL
    recompute_layers: int = 0
    gate_probe_start: int | None = None

    @property
    def mapped_tokens(self) -> int:
        """Tokens in the mapped span (recomputed ones included)."""
        return self.map_end - self.map_start

    @property
    def probe_start(self) -> int:
        """Where the gate's probe starts: `map_end`, unless `gate_probe_start` says later (a prefix-loading engine
        leaves the recomputed tail `[map_end, probe_start)` to the target, outside the probe)."""
        return self.map_end if self.gate_probe_start is None else self.gate_probe_start

    @property
    def probe_tokens(self) -> int:
        """Tokens of the gate's probe, `[probe_start, length)`."""
        return self.length - self.probe_start

    @property
    def recompute_start(self) -> int:
        """Where a `"tail"` recompute starts: the end of the K/V that stay mapped (`map_end` without recompute)."""
        return self.map_end - self.recompute_tokens

    @property
    def target_tokens(self) -> int:
        """Tokens the target computes itself: sinks, probe and recomputed ones."""
        return self.length - self.mapped_tokens + self.recompute_tokens


def plan_transfer(
    length: int,
    *,
    start: int = 0,
    padding: int = 0,
    sink_tokens: int = 0,
    gate_threshold: float | None = None,
    gate_probe_tokens: int = 0,
    recompute_fraction: float = 0.0,
    recompute_policy: str = "tail",
    recompute_seed: int = 0,
    recompute_layers: int = 0,
    tail_tokens: int = 0,
) -> TransferPlan:
    """The [`TransferPlan`] of `length` prefilled tokens.

    Args:
        length (`int`): tokens prefilled (the prompt without its held-back tokens); `0` or less plans nothing.
        start (`int`, *optional*, defaults to `0`): tokens `[0, start)` are cached already (a continuation: a later
            turn of a handoff session); the mapped span starts there at the earliest, and the probe and the recompute
            share are taken of what is left.
        padding (`int`, *optional*, defaults to `0`): the batch's longest left padding; the sinks are the first
            `sink_tokens` real tokens of every row, so they end at `padding + sink_tokens`.
        sink_tokens (`int`): attention sinks the target computes itself.
        gate_threshold (`float`, *optional*), gate_probe_tokens (`int`): the quality gate (`None`: no gate); the
            probe is the last `gate_probe_tokens` tokens.
        recompute_fraction (`float`), recompute_policy (`str`), recompute_seed (`int`): selective recompute of
            `ceil(recompute_fraction · mapped)` of the mapped tokens.
        recompute_layers (`int`): layer recompute of the target's top layers over the mapped span.
        tail_tokens (`int`, *optional*, defaults to `0`): tokens right before the probe that the target computes
            itself, outside the mapped span and the probe (a prefix-loading engine's recomputed tail: vLLM computes
            it after the loaded prefix; the plan's `gate_probe_start` then says where the probe starts).
    """
    length = max(0, int(length))
    sink_end = min(length, padding + sink_tokens) if sink_tokens else 0
    sink_end = max(sink_end, min(length, start))
    gated = gate_threshold is not None
    probe = min(gate_probe_tokens, length - sink_end) if gated else 0
    map_end = max(sink_end, length - probe - max(0, int(tail_tokens)))
    probe_start = length - probe if map_end < length - probe else None
    gate = "checked" if gated else None
    if gated and map_end <= sink_end:  # sinks and probe cover the prompt: the target computes all of it itself
        sink_end = map_end = length
        gate, probe_start = "skipped", None
    recompute = recompute_count(recompute_fraction, map_end - sink_end) if map_end > sink_end else 0
    return TransferPlan(
        length=length,
        map_start=sink_end,
        map_end=map_end,
        recompute_tokens=recompute,
        gate=gate,
        gate_threshold=gate_threshold,
        recompute_policy=recompute_policy,
        recompute_seed=recompute_seed,
        recompute_layers=int(recompute_layers) if map_end > sink_end else 0,
        gate_probe_start=probe_start,
    )


def plan_load(start: int, end: int, probe_start: int, probe_end: int, gate_threshold: float | None) -> TransferPlan:
    """The plan of one load of a prefix-loading engine (the vLLM worker): tokens `[0, start)` cached already, the
    mapped span `[start, end)`, the tail `[end, probe_start)` and, with a gate (`probe_end > probe_start`), the probe
    `[probe_start, probe_end)` that the engine computes itself. `plan_transfer` decides the positions.

    Example:

    ```python
    >>> plan = plan_load(16, 40, 44, 48, gate_threshold=0.9)
    >>> plan.map_start, plan.map_end, plan.probe_start, plan.probe_tokens, plan.gate
    (16, 40, 44, 4, 'checked')
    ```
    """
    gated = probe_end > probe_start
    return plan_transfer(
        probe_end if gated else end,
        start=start,
        gate_threshold=gate_threshold if gated else None,
        gate_probe_tokens=probe_end - probe_start if gated else 0,
        tail_tokens=probe_start - end if gated else 0,
    )


def plan_from_config(length: int, config, *, start: int = 0, padding: int = 0) -> TransferPlan:
    """`plan_transfer` with the knobs of `config` (a `KVBridgeConfig`)."""
    return plan_transfer(
        length,
        start=start,
        padding=padding,
        sink_tokens=int(config.sink_tokens or 0),
        gate_threshold=config.gate_threshold,
        gate_probe_tokens=int(config.gate_probe_tokens),
        recompute_fraction=float(config.recompute_fraction or 0.0),
        recompute_policy=config.recompute_policy,
        recompute_seed=int(config.recompute_seed),
        recompute_layers=int(getattr(config, "recompute_layers", 0) or 0),
    )


def plan_prompt(num_prompt_tokens: int, config, *, hold_back: int | None = None) -> TransferPlan:
    """The plan of a whole prompt of `num_prompt_tokens`: its last `hold_back` tokens (default `config.hold_back`)
    are left to the target, the rest is planned by `plan_from_config`. What the vLLM connector's scheduler claims."""
    hold_back = config.hold_back if hold_back is None else hold_back
    return plan_from_config(num_prompt_tokens - hold_back, config)
