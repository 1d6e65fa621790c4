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
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch import nn

from ..cache import cache_kwargs
from ..controls import CONTROL_MODES, control_cache, controls_flag
from ..errors import InvalidInputError

MODES = ("target", "source", "bridge", "no_context")


def heldout_windows(texts: list[str], tokenizer, length: int, max_windows: int) -> torch.Tensor:
    """Non-overlapping `length`-token windows cut from the documents, shuffled (seeded), at most `max_windows`."""
    windows = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        for start in range(0, len(ids) - length + 1, length):
            windows.append(ids[start : start + length])
    if not windows:
        raise InvalidInputError(f"no held-out document has {length} tokens")
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
        return _token_logprobs(_control_logits(bridge, ids, context_len, mode), ids, first)
    elif mode == "no_context":
        tail = ids[:, context_len:]
        return _token_logprobs(
            bridge.target(input_ids=tail.to(bridge.target.device)).logits, tail, max(1, first - context_len)
        )
    else:
        raise InvalidInputError(f"mode must be one of {MODES + CONTROL_MODES}, got {mode!r}")
    return _token_logprobs(logits, ids, first)


def mean_nll(bridge, windows: torch.Tensor, context: int, mode: str, batch_size: int = 8) -> float:
    """Mean continuation NLL (nats/token) of `windows` `(N, T)` in `mode`, scored after `context` tokens
    (`score_tokens`, `batch_size` windows at a time)."""
    total, count = 0.0, 0
    for start in range(0, len(windows), batch_size):
        logprobs = score_tokens(bridge, windows[start : start + batch_size], context, mode)
        total -= logprobs.sum().item()
        count += logprobs.numel()
    return total / count


@torch.no_grad()
def _control_logits(bridge, ids: torch.Tensor, context_len: int, mode: str) -> torch.Tensor:
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


def continuation_nll(
    bridge, windows: torch.Tensor, context_len: int, batch_size: int = 8, controls: bool = False
) -> dict:
    """Mean continuation NLL (nats/token) and perplexity of every mode, and the context-benefit retention.

    Args:
        windows (`torch.LongTensor` of shape `(N, context_len + continuation_len)`): held-out text.
        controls (`bool`, *optional*, defaults to `False`): also score the zero- and random-cache controls, report
            their retention, and flag the bridge's when a control comes within `hf_kvbridge.controls.CONTROL_MARGIN`
            of it (`None` when the retention is undefined).
    """
    modes = MODES + (CONTROL_MODES if controls else ())
    totals = dict.fromkeys(modes, 0.0)
    count = 0
    for start in range(0, len(windows), batch_size):
        batch = windows[start : start + batch_size]
        for mode in modes:
            totals[mode] -= score_tokens(bridge, batch, context_len, mode).sum().item()
        count += batch.shape[0] * (batch.shape[1] - context_len - 1)
    nll = {mode: totals[mode] / count for mode in modes}
    result = {
        "nll": nll,
        "perplexity": {mode: float(torch.tensor(v).exp()) for mode, v in nll.items()},
        "context_benefit_retention": retention(nll),
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
    """Accuracy of each mode at picking the true continuation (sum of log-probabilities over its tokens)."""
    correct = dict.fromkeys(MODES, 0)
    for item in items:
        context_len = len(item.context)
        ids = torch.tensor([item.context + choice for choice in item.choices])  # (choices, C + M)
        for mode in MODES:
            # every continuation token (no_context has no prediction for the first one and scores the rest)
            scores = score_tokens(bridge, ids, context_len, mode, first=context_len).sum(-1)
            correct[mode] += int(scores.argmax().item() == item.label)
    chance = 1.0 / len(items[0].choices)
    acc = {mode: correct[mode] / len(items) for mode in MODES}
    return {
        "accuracy": acc,
        "chance": chance,
        "items": len(items),
        "retention": acc["bridge"] / acc["target"] if acc["target"] > 0 else float("nan"),
        "chance_normalised_retention": chance_normalised_retention(acc["bridge"], acc["target"], chance),
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
