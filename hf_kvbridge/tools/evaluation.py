"""Measured fidelity of a bridge on held-out text: continuation NLL, a multiple-choice cloze, and retention.

Every mode scores the same tokens:

- `target`: the target with its own prefill of the context;
- `source`: the source alone;
- `bridge`: the source prefills the context, the mapped cache is scored by the target;
- `no_context`: the target sees only the continuation;
- controls (`CONTROL_MODES`, `hf_kvbridge.controls`): the target scores the continuation on a cache of the context's
  length that carries no information: `zero_cache` (all keys and values zero) and `random_cache` (Gaussian keys and
  values with the mapped cache's norm per layer and head). A bridge whose retention a control comes close to
  transfers little: a study of cross-model transfer found such caches reproducing most of the teacher-forced gain on
  some tasks.

Context-benefit retention = (NLL_no_context − NLL_bridge) / (NLL_no_context − NLL_target): 1 means the bridge keeps all
that the context is worth to the target, 0 means the mapped cache is worth nothing.

Gap recovered (`gap_recovered`) = (NLL_source − NLL_bridge) / (NLL_source − NLL_target) (on accuracy: (acc_bridge −
acc_source) / (acc_target − acc_source)): the share of the source → target gap the bridge closes, 1 = as good as the
target, 0 = as good as the source alone. For a cascade it says whether escalating to the target was worth it. It is
defined only where the target beats the source by a margin the windows resolve, and comes with a paired confidence
interval over windows.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

import torch
from torch import nn

from ..controls import CONTROL_MODES, control_cache, controls_flag
from ..errors import EvaluationError, InvalidInputError
from ..utils.cache import cache_kwargs

MODES = ("target", "source", "bridge", "no_context")


def heldout_windows(texts: list[str], tokenizer, length: int, max_windows: int) -> torch.Tensor:
    """Non-overlapping `length`-token windows cut from the documents, shuffled (seeded), at most `max_windows`."""
    windows = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        for start in range(0, len(ids) - length + 1, length):
            windows.append(ids[start : start + length])
    if not windows:
        raise EvaluationError(
            f"no held-out document has {length} tokens; use shorter windows, or held-out text with longer documents"
        )
    rng = random.Random(0)
    rng.shuffle(windows)
    return torch.tensor(windows[:max_windows], dtype=torch.long)


def _token_logprobs(logits: torch.Tensor, ids: torch.Tensor, start: int) -> torch.Tensor:
    """Log-probabilities of `ids[:, start:]`, each predicted from the logits one position earlier: `(B, T - start)`."""
    logprobs = nn.functional.log_softmax(logits[:, start - 1 : -1].float(), dim=-1)
    return logprobs.gather(-1, ids[:, start:, None].to(logits.device)).squeeze(-1)


@torch.no_grad()
def score_tokens(bridge, ids: torch.Tensor, context_len: int, mode: str, first: int | None = None) -> torch.Tensor:
    """Log-probabilities of `ids[:, first:]` given everything before, in `mode`; shape `(B, T - first)`.

    `ids[:, :context_len]` is the context (the part the bridge prefills with the source). `first` defaults to
    `context_len + 1`: the first continuation token is left out, since `no_context` has no prediction for it.
    """
    first = context_len + 1 if first is None else first
    if mode == "target":
        logits = bridge.target(input_ids=ids.to(bridge.target.device)).logits
    elif mode == "source":
        logits = bridge.source(input_ids=ids.to(bridge.source.device)).logits
    elif mode == "bridge":
        logits = bridge(ids, prefill_length=context_len).logits
    elif mode in CONTROL_MODES:
        return _token_logprobs(control_logits(bridge, ids, context_len, mode), ids, first)
    elif mode == "no_context":
        tail = ids[:, context_len:]
        return _token_logprobs(
            bridge.target(input_ids=tail.to(bridge.target.device)).logits, tail, max(1, first - context_len)
        )
    else:
        raise InvalidInputError(f"mode must be one of {MODES + CONTROL_MODES}, got {mode!r}")
    return _token_logprobs(logits, ids, first)


def window_nll(bridge, windows: torch.Tensor, context: int, mode: str, batch_size: int = 8) -> torch.Tensor:
    """Continuation NLL (nats/token) of each window of `windows` `(N, T)` in `mode`, scored after `context` tokens
    (`score_tokens`, `batch_size` windows at a time): shape `(N,)`, float64. Every window scores as many tokens, so
    their mean is the mean over all tokens (`mean_nll`)."""
    per_window = [
        -score_tokens(bridge, windows[start : start + batch_size], context, mode).double().mean(-1)  # (B,)
        for start in range(0, len(windows), batch_size)
    ]
    return torch.cat(per_window)


def mean_nll(bridge, windows: torch.Tensor, context: int, mode: str, batch_size: int = 8) -> float:
    """Mean continuation NLL (nats/token) of `windows` `(N, T)` in `mode`, scored after `context` tokens
    (`score_tokens`, `batch_size` windows at a time)."""
    return float(window_nll(bridge, windows, context, mode, batch_size).mean())


@torch.no_grad()
def control_logits(bridge, ids: torch.Tensor, context_len: int, mode: str) -> torch.Tensor:
    """Target logits over `ids` whose context K/V are replaced by a control cache of the same shape."""
    target, device = bridge.target, bridge.device
    mapped = control_cache(bridge.prefill(ids[:, :context_len], source_logits=False)[0], mode)
    rest = target(input_ids=ids[:, context_len:].to(device), **cache_kwargs(mapped)).logits
    # positions before the context's end are never scored (first > context_len); pad them to keep the indexing
    return torch.cat([rest.new_zeros(rest.shape[0], context_len, rest.shape[-1]), rest], dim=1)


def retention(nll: dict[str, float], mode: str = "bridge") -> float:
    """Context-benefit retention of `mode`: `(NLL_no_context − NLL_mode) / (NLL_no_context − NLL_target)`."""
    gain = nll["no_context"] - nll["target"]
    return (nll["no_context"] - nll[mode]) / gain if gain > 0 else float("nan")


def student_t_quantile(p: float, df: int) -> float:
    """The `p` quantile of Student's t with `df` degrees of freedom (exact for 1 and 2; for 3 and more the
    Cornish–Fisher expansion of Abramowitz & Stegun 26.7.5, within 0.12 % at 3 and 2e-6 at 11 for p = 0.975).

    Example:

    ```python
    >>> round(student_t_quantile(0.975, 11), 3)
    2.201
    ```
    """
    if not 0.0 < p < 1.0 or df < 1:
        raise InvalidInputError(f"need 0 < p < 1 and df ≥ 1, got p={p}, df={df}")
    if df == 1:
        return math.tan(math.pi * (p - 0.5))
    if df == 2:
        return (2 * p - 1) / math.sqrt(2 * p * (1 - p))
    z = NormalDist().inv_cdf(p)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / df + g2 / df**2 + g3 / df**3 + g4 / df**4


@dataclass(frozen=True)
class GapRecovered:
    """The share of the source → target gap a bridge closes, with its paired confidence interval (`gap_recovered`).

    Args:
        value (`float` or `None`): the share, unclipped (below 0: worse than the source alone; above 1: better than
            the target); `None` when undefined.
        low, high (`float` or `None`): the confidence interval of `value`.
        defined (`bool`): whether the target beats the source by a margin the windows resolve.
        reason (`str` or `None`): why it is undefined (`None` when defined).
        gap, gap_low, gap_high (`float` or `None`): the target's mean advantage over the source per window, in the
            score's units and oriented so that positive is "the target is better", and its confidence interval.
        windows (`int`): the paired windows (or documents) it was measured on.
        confidence (`float`): the level of both intervals.
    """

    value: float | None
    low: float | None
    high: float | None
    defined: bool
    reason: str | None = None
    gap: float | None = None
    gap_low: float | None = None
    gap_high: float | None = None
    windows: int = 0
    confidence: float = 0.95

    def fields(self, prefix: str = "gap_recovered") -> dict:
        """The JSON fields of this figure: `{prefix}` (`None` when undefined), `{prefix}_ci` (`[low, high]` or
        `None`), `{prefix}_reason` and the source → target gap it is a share of (`source_target_gap`, `..._ci`)."""
        ci = [self.low, self.high] if self.defined else None
        gap_ci = None if self.gap_low is None else [self.gap_low, self.gap_high]
        return {
            prefix: self.value,
            f"{prefix}_ci": ci,
            f"{prefix}_reason": self.reason,
            "source_target_gap": self.gap,
            "source_target_gap_ci": gap_ci,
        }

    def describe(self, digits: int = 3) -> str:
        """`0.412 [0.301, 0.523]`, or `n/a (the reason)`."""
        if not self.defined:
            return f"n/a ({self.reason})"
        return f"{self.value:.{digits}f} [{self.low:.{digits}f}, {self.high:.{digits}f}]"


def _as_scores(values, name: str) -> torch.Tensor:
    scores = torch.as_tensor(values, dtype=torch.float64).reshape(-1)  # (N,)
    if not torch.isfinite(scores).all():
        raise InvalidInputError(f"the {name} scores hold NaN or infinite values; score every window first")
    return scores


def gap_recovered(
    source: Sequence[float] | torch.Tensor,
    bridge: Sequence[float] | torch.Tensor,
    target: Sequence[float] | torch.Tensor,
    *,
    higher_is_better: bool = False,
    confidence: float = 0.95,
    unit: str = "windows",
) -> GapRecovered:
    """The share of the source → target gap the bridge closes, from paired per-window (or per-document) scores.

    With `d_i` the target's advantage over the source on window `i` (`source_i − target_i` for a lower-is-better
    score such as NLL, `target_i − source_i` for accuracy) and `a_i` the bridge's (`source_i − bridge_i`, resp.
    `bridge_i − source_i`), the figure is the ratio of means `mean(a) / mean(d)`: 1 = as good as the target, 0 = as
    good as the source alone, unclipped. On NLL that is `(NLL_source − NLL_bridge) / (NLL_source − NLL_target)`.

    It is defined only where the target is better than the source by a margin the windows resolve: the paired
    `confidence` interval of `mean(d)` (Student's t over the windows) must lie above 0. Identity pairs (`d_i = 0`)
    and downward pairs (a weaker target) are undefined, with the reason.

    The interval of the ratio is the delta method's, paired over windows: `R ± t · sd(a_i − R d_i) / (√N mean(d))`
    with `t` the Student quantile for `N − 1` degrees of freedom (no resampling: deterministic).

    Args:
        source, bridge, target (sequences of `float`, or `torch.Tensor` of shape `(N,)`): each window's score in
            the three modes, in the same window order.
        higher_is_better (`bool`, *optional*, defaults to `False`): `False` for NLL, `True` for accuracy.
        confidence (`float`, *optional*, defaults to `0.95`): the level of both intervals.
        unit (`str`, *optional*, defaults to `"windows"`): what one score is of, for the reason (`"items"`, ...).

    Returns:
        [`GapRecovered`].

    Example:

    ```python
    >>> result = gap_recovered([4.0, 4.2, 3.9], [3.7, 3.9, 3.5], [3.5, 3.6, 3.3])
    >>> round(result.value, 3), result.defined
    (0.588, True)
    >>> gap_recovered([4.0, 4.2], [3.9, 4.1], [4.0, 4.2]).reason
    'the source and the target score the same on every window (an identity pair?)'
    ```
    """
    s, b, t = (_as_scores(x, name) for x, name in ((source, "source"), (bridge, "bridge"), (target, "target")))
    if not len(s) == len(b) == len(t):
        raise InvalidInputError(
            f"gap recovered pairs windows: got {len(s)} source, {len(b)} bridge and {len(t)} target scores; score "
            "the same windows in every mode"
        )
    n = len(s)
    sign = 1.0 if higher_is_better else -1.0
    d, a = sign * (t - s), sign * (b - s)  # (N,): the target's and the bridge's advantage over the source
    if n < 2:
        return GapRecovered(None, None, None, False, f"needs at least 2 paired {unit}, got {n}", windows=n)
    quantile = student_t_quantile(0.5 + confidence / 2, n - 1)
    gap = float(d.mean())
    half = quantile * float(d.std()) / math.sqrt(n)
    common = {"gap": gap, "gap_low": gap - half, "gap_high": gap + half, "windows": n, "confidence": confidence}
    if bool((d == 0).all()):
        reason = "the source and the target score the same on every window (an identity pair?)"
        return GapRecovered(None, None, None, False, reason, **common)
    if gap - half <= 0:
        level = f"{confidence:.0%}"
        if gap <= 0:
            reason = f"the target is not better than the source here (gap {gap:.4g}, paired {level} CI"
        else:
            reason = f"the target's advantage over the source is not resolved by {n} {unit} (gap {gap:.4g}, {level} CI"
        reason += f" [{gap - half:.4g}, {gap + half:.4g}])"
        return GapRecovered(None, None, None, False, reason, **common)
    ratio = float(a.mean()) / gap
    spread = quantile * float((a - ratio * d).std()) / (math.sqrt(n) * gap)
    return GapRecovered(ratio, ratio - spread, ratio + spread, True, None, **common)


def continuation_nll(
    bridge, windows: torch.Tensor, context_len: int, batch_size: int = 8, controls: bool = False
) -> dict:
    """Mean continuation NLL (nats/token) and perplexity of every mode, the context-benefit retention and the gap
    recovered (`gap_recovered`, `gap_recovered_ci`, `gap_recovered_reason`: the share of the source → target NLL gap
    the bridge closes, paired over the windows; see [`gap_recovered`]).

    Args:
        windows (`torch.LongTensor` of shape `(N, context_len + continuation_len)`): held-out text.
        controls (`bool`, *optional*, defaults to `False`): also score the zero- and random-cache controls, report
            their retention, and flag the bridge's when a control comes within `hf_kvbridge.controls.CONTROL_MARGIN`
            of it (`None` when the retention is undefined).
    """
    modes = MODES + (CONTROL_MODES if controls else ())
    totals = dict.fromkeys(modes, 0.0)
    per_window: dict[str, list[torch.Tensor]] = {mode: [] for mode in modes}
    count = 0
    for start in range(0, len(windows), batch_size):
        batch = windows[start : start + batch_size]
        for mode in modes:
            logprobs = score_tokens(bridge, batch, context_len, mode)  # (B, T - context_len - 1)
            totals[mode] -= logprobs.sum().item()
            per_window[mode].append(-logprobs.double().mean(-1))  # (B,)
        count += batch.shape[0] * (batch.shape[1] - context_len - 1)
    nll = {mode: totals[mode] / count for mode in modes}
    windows_nll = {mode: torch.cat(values) for mode, values in per_window.items()}  # (N,) per mode
    gap = gap_recovered(windows_nll["source"], windows_nll["bridge"], windows_nll["target"])
    floor = gap_recovered(windows_nll["source"], windows_nll["no_context"], windows_nll["target"])
    result = {
        "nll": nll,
        "perplexity": {mode: float(torch.tensor(v).exp()) for mode, v in nll.items()},
        "context_benefit_retention": retention(nll),
        **gap.fields(),
        # the same figure for the target with no context at all: what decoding with the target alone already closes
        "gap_recovered_no_context": floor.value,
        "tokens_scored": count,
        "windows": int(len(windows)),
        "context_len": context_len,
    }
    if controls:
        control_retention = {mode: retention(nll, mode) for mode in CONTROL_MODES}
        result["control_retention"] = control_retention
        result["controls_flag"] = controls_flag(result["context_benefit_retention"], control_retention)
    return result


@dataclass
class ClozeItem:
    """A context and `choices` continuations of equal length; `label` is the index of the true one."""

    context: list[int]
    choices: list[list[int]]
    label: int


def build_cloze(windows: torch.Tensor, context_len: int, num_choices: int = 4, seed: int = 0) -> list[ClozeItem]:
    """Cloze items from held-out windows: the true continuation vs continuations taken from other windows."""
    rng = random.Random(seed)
    items = []
    for i, window in enumerate(windows.tolist()):
        others = rng.sample([j for j in range(len(windows)) if j != i], num_choices - 1)
        choices = [window[context_len:]] + [windows[j, context_len:].tolist() for j in others]
        order = list(range(num_choices))
        rng.shuffle(order)
        items.append(ClozeItem(window[:context_len], [choices[k] for k in order], order.index(0)))
    return items


@torch.no_grad()
def cloze_accuracy(bridge, items: list[ClozeItem]) -> dict:
    """Accuracy of each mode at picking the true continuation (sum of log-probabilities over its tokens), its
    retention, and the gap recovered on accuracy (`gap_recovered`, `gap_recovered_ci`, `gap_recovered_reason`: the
    share of the source → target accuracy gap the bridge closes, paired over the items; see [`gap_recovered`])."""
    correct: dict[str, list[float]] = {mode: [] for mode in MODES}
    for item in items:
        context_len = len(item.context)
        ids = torch.tensor([item.context + choice for choice in item.choices])  # (choices, C + M)
        for mode in MODES:
            # every continuation token (no_context has no prediction for the first one and scores the rest)
            scores = score_tokens(bridge, ids, context_len, mode, first=context_len).sum(-1)
            correct[mode].append(float(scores.argmax().item() == item.label))
    chance = 1.0 / len(items[0].choices)
    acc = {mode: sum(correct[mode]) / len(items) for mode in MODES}
    gap = gap_recovered(correct["source"], correct["bridge"], correct["target"], higher_is_better=True, unit="items")
    floor = gap_recovered(
        correct["source"], correct["no_context"], correct["target"], higher_is_better=True, unit="items"
    )
    return {
        "accuracy": acc,
        "chance": chance,
        "items": len(items),
        "retention": acc["bridge"] / acc["target"] if acc["target"] > 0 else float("nan"),
        "chance_normalised_retention": chance_normalised_retention(acc["bridge"], acc["target"], chance),
        **gap.fields(),
        "gap_recovered_no_context": floor.value,  # the target with no context: the floor to read the figure against
    }


def chance_normalised_retention(bridge: float | None, target: float | None, chance: float | None) -> float | None:
    """(bridge − chance) / (target − chance), or `None` (undefined) when the target is at or below chance.

    At or below chance the target shows no ability for the bridge to retain, and the ratio would be meaningless (a
    bridge exactly as bad as the target would read 1.0).

    Example:

    ```python
    >>> chance_normalised_retention(0.40, 0.50, 0.25)
    0.6
    >>> chance_normalised_retention(0.20, 0.20, 0.25) is None
    True
    ```
    """
    if bridge is None or target is None or chance is None or not target > chance:
        return None
    return (bridge - chance) / (target - chance)
