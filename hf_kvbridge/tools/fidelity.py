"""Fidelity of a bridge to its target beyond mean NLL: next-token KL, paired bootstrap intervals, a retrieval probe.

- `next_token_kl`: per window, the mean KL(target ‖ bridge) over the continuation tokens: the target's full
  next-token distribution on its own cache against the one on the mapped cache (0 = the same distribution), the
  quantity `hf_kvbridge.distill` trains on, measured on held-out text.
- `paired_bootstrap`: a statistic of paired per-window scores (retention, a mean KL, a difference of two bridges'
  retentions) with its percentile bootstrap interval, resampling windows (every mode keeps its pairing).
- `retrieval_probe`: a fact (a made-up name and a number) placed early in a long context of held-out text and asked
  for at the end; the log-probability and exact match of the answer for the target, the bridge and the target with
  no context (which cannot know it).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping

import torch
from torch import nn

from ..errors import InvalidInputError


def paired_bootstrap(
    scores: Mapping[str, torch.Tensor | list[float]],
    statistic: Callable[[dict[str, torch.Tensor]], float],
    *,
    iterations: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict:
    """`statistic` of paired per-window `scores` and its percentile bootstrap interval (windows resampled together).

    Args:
        scores (`dict[str, torch.Tensor]`): per-window scores `(N,)` of each mode, in the same window order.
        statistic (`Callable`): maps a `{mode: (N,) scores}` dict to a number (e.g. a retention of means).

    Returns:
        `{"value", "low", "high", "windows", "iterations", "confidence"}`.

    Example:

    ```python
    >>> scores = {"a": [1.0, 2.0, 3.0, 4.0], "b": [1.5, 2.5, 3.0, 4.5]}
    >>> result = paired_bootstrap(scores, lambda s: float((s["b"] - s["a"]).mean()), iterations=200)
    >>> result["value"], result["low"] <= result["value"] <= result["high"]
    (0.375, True)
    ```
    """
    table = {mode: torch.as_tensor(values, dtype=torch.float64).reshape(-1) for mode, values in scores.items()}
    sizes = {len(v) for v in table.values()}
    if len(sizes) != 1 or 0 in sizes:
        raise InvalidInputError(f"paired scores need the same, non-zero number of windows per mode, got {sizes}")
    (n,) = sizes
    generator = torch.Generator().manual_seed(seed)
    draws = []
    for _ in range(iterations):
        index = torch.randint(0, n, (n,), generator=generator)
        draws.append(statistic({mode: values[index] for mode, values in table.items()}))
    draws = torch.tensor(draws, dtype=torch.float64)
    draws = draws[torch.isfinite(draws)]
    tail = (1 - confidence) / 2
    low, high = (float(torch.quantile(draws, q)) for q in (tail, 1 - tail)) if len(draws) else (None, None)
    return {"value": statistic(table), "low": low, "high": high, "windows": n, "iterations": iterations,
            "confidence": confidence}  # fmt: skip


def retention_of(mode: str = "bridge") -> Callable[[dict[str, torch.Tensor]], float]:
    """The context-benefit retention of `mode` from per-window NLLs: `(mean no_context − mean mode) / (mean
    no_context − mean target)` (as `evaluation.retention`, on means over windows)."""

    def statistic(s: dict[str, torch.Tensor]) -> float:
        gain = float(s["no_context"].mean() - s["target"].mean())
        return float(s["no_context"].mean() - s[mode].mean()) / gain if gain > 0 else float("nan")

    return statistic


@torch.no_grad()
def next_token_kl(bridge, windows: torch.Tensor, context_len: int, batch_size: int = 8) -> torch.Tensor:
    """Per window `(N,)`, the mean KL(target ‖ bridge) in nats over the continuation tokens of `windows` `(N, T)`
    after `context_len` tokens: the target on its own cache against the target on the mapped cache of the context
    (the bridge's own forward, hold-back included)."""
    per_window = []
    for start in range(0, len(windows), batch_size):
        ids = windows[start : start + batch_size]
        first = context_len  # the prediction of token context_len + 1 on: every mode has it
        target = bridge.target(input_ids=ids.to(bridge.target.device)).logits[:, first:-1].float()
        bridged = bridge(ids, prefill_length=context_len).logits[:, first:-1].float()
        teacher = nn.functional.log_softmax(target, -1)  # (B, C - 1, V)
        student = nn.functional.log_softmax(bridged.to(teacher.device), -1)
        kl = (teacher.exp() * (teacher - student)).sum(-1)  # (B, C - 1)
        per_window.append(kl.double().mean(-1).cpu())
    return torch.cat(per_window)


def build_retrieval_items(tokenizer, filler: torch.Tensor, context_len: int = 512, count: int = 32, seed: int = 0):
    """Retrieval items: `"The code of <name> is <number>."` right after the start of a `context_len`-token window
    of held-out `filler` text `(N, ≥ context_len)`, and at its end `"The code of <name> is"`; the answer is the
    number's tokens. Returns a list of `(context ids (context_len,), answer ids)`."""
    rng = random.Random(seed)
    names = ["Arvel", "Brisk", "Corwen", "Dalmor", "Elsin", "Farrow", "Gilden", "Harlan", "Istra", "Jorvik"]
    items = []
    for i in range(min(count, len(filler))):
        name, number = rng.choice(names) + rng.choice(["ia", "on", "ar", "el"]), str(rng.randint(1000, 9999))
        fact = tokenizer(f"\nThe code of {name} is {number}.\n", add_special_tokens=False)["input_ids"]
        question = tokenizer(f"\nThe code of {name} is", add_special_tokens=False)["input_ids"]
        answer = tokenizer(f" {number}", add_special_tokens=False)["input_ids"]
        body = context_len - len(fact) - len(question) - 16
        if body < 1:
            raise InvalidInputError(f"context_len={context_len} is too short for a retrieval item")
        text = filler[i].tolist()
        context = text[:16] + fact + text[16 : 16 + body] + question
        items.append((torch.tensor(context), torch.tensor(answer)))
    return items


@torch.no_grad()
def retrieval_probe(bridge, items) -> dict:
    """Mean log-probability of the answer and exact match (every answer token the argmax) for the target with its
    context, the bridge (context prefilled by the source and mapped) and the target with no context (the question
    alone)."""
    scores = {mode: {"logprob": [], "exact": []} for mode in ("target", "bridge", "no_context")}
    for context, answer in items:
        ids = torch.cat([context, answer]).unsqueeze(0)  # (1, C + A)
        start = len(context)
        question = ids[:, start - 6 :]  # the question's last tokens and the answer: no fact in sight
        for mode in scores:
            if mode == "target":
                logits = bridge.target(input_ids=ids.to(bridge.target.device)).logits
            elif mode == "bridge":
                logits = bridge(ids, prefill_length=start).logits
            else:
                logits = bridge.target(input_ids=question.to(bridge.target.device)).logits
            offset = ids.shape[1] - logits.shape[1]
            predicted = logits[0, start - 1 - offset : -1].float().log_softmax(-1)  # (A, V)
            gold = answer.to(predicted.device)
            scores[mode]["logprob"].append(float(predicted.gather(-1, gold[:, None]).sum()))
            scores[mode]["exact"].append(float(bool((predicted.argmax(-1) == gold).all())))
    return {
        mode: {key: sum(values) / len(values) for key, values in result.items()} for mode, result in scores.items()
    } | {"items": len(items)}
