"""Fidelity of a bridge to its target beyond mean NLL: next-token KL, paired bootstrap intervals, a retrieval probe;
what `kvbridge eval BRIDGE --heldout DATA` prints.

- `next_token_kl`: per window, the mean KL(target ‖ bridge) over the continuation tokens: the target's full
  next-token distribution on its own cache against the one on the mapped cache (0 = the same distribution), the
  quantity `hf_kvbridge.distill` trains on, measured on held-out text.
- `paired_bootstrap`: a statistic of paired per-window scores (retention, a mean KL, a difference of two bridges'
  retentions) with its percentile bootstrap interval, resampling windows (every mode keeps its pairing).
- `retrieval_probe`: a fact (a made-up name and a number) placed early in a long context of held-out text and asked
  for at the end; the log-probability and exact match of the answer for the target, the bridge and the target with
  no context (which cannot know it).
- `heldout_fidelity`: all of it on one set of windows, one direction of a pair: per mode the continuation NLL, the
  context-benefit retention and KL(target ‖ mode) with paired bootstrap intervals, the gap recovered (delta method,
  `evaluation.gap_recovered`), the zero/random-cache controls, the probe; `format_fidelity` prints it.
- `greedy_agreement`: whether two greedy runs of one prompt (a served engine and the library, a batch and the prompt
  alone) serve the same tokens, and where they first differ, how close to a tie each run was there: two runs whose
  sums are taken in another order (batched kernels, tensor-parallel ranks, bfloat16) may swap two tokens that score
  within their round-off of each other, and nothing wider.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..controls import CONTROL_MODES, controls_flag
from ..errors import InvalidInputError
from .evaluation import control_logits, gap_recovered, score_tokens


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


# the modes whose next-token distribution is the target model's (on some cache): KL(target ‖ mode) is defined
KL_MODES = ("bridge", "no_context", *CONTROL_MODES)


@torch.no_grad()
def continuation_logits(bridge, ids: torch.Tensor, context_len: int, mode: str) -> torch.Tensor:
    """The target model's logits `(B, T - context_len - 1, V)` (float32) predicting `ids[:, context_len + 1:]`, in
    `mode`: `target` (its own prefill), `bridge` (the mapped cache of `ids[:, :context_len]`, the bridge's own
    forward), `no_context` (the continuation alone) or a control cache (`hf_kvbridge.controls`)."""
    if mode == "target":
        logits = bridge.target(input_ids=ids.to(bridge.target.device)).logits[:, context_len:-1]
    elif mode == "bridge":
        logits = bridge(ids, prefill_length=context_len).logits[:, context_len:-1]
    elif mode == "no_context":
        logits = bridge.target(input_ids=ids[:, context_len:].to(bridge.target.device)).logits[:, :-1]
    elif mode in CONTROL_MODES:
        logits = control_logits(bridge, ids, context_len, mode)[:, context_len:-1]
    else:
        raise InvalidInputError(f"mode must be one of {('target', *KL_MODES)}, got {mode!r}")
    return logits.float()


def window_fidelity(
    bridge, windows: torch.Tensor, context_len: int, modes: Sequence[str] = ("bridge",), batch_size: int = 8
) -> dict[str, dict[str, torch.Tensor]]:
    """Per window of `windows` `(N, T)`, scored after `context_len` tokens: the continuation NLL (nats/token) of the
    target and of every mode in `modes` (`source` too: its NLL only), and KL(target ‖ mode) in nats/token for the
    modes of `KL_MODES`, both from the same forward passes. Returns `{"nll": {mode: (N,)}, "kl": {mode: (N,)}}`
    (float64, window order kept).

    Example:

    ```python
    >>> scores = window_fidelity(bridge, windows, 384, ("bridge", "no_context"))  # doctest: +SKIP
    >>> scores["kl"]["bridge"].mean()  # 0 for a bridge that reproduces the target  # doctest: +SKIP
    ```
    """
    if not 0 < context_len < windows.shape[1] - 1:
        raise InvalidInputError(
            f"context_len must leave at least 2 continuation tokens of the {windows.shape[1]}-token windows, got "
            f"{context_len}"
        )
    nll: dict[str, list] = {mode: [] for mode in ("target", *modes)}
    kl: dict[str, list] = {mode: [] for mode in modes if mode in KL_MODES}
    for start in range(0, len(windows), batch_size):
        ids = windows[start : start + batch_size]
        gold = ids[:, context_len + 1 :, None]  # (B, C - 1, 1)
        teacher = nn.functional.log_softmax(continuation_logits(bridge, ids, context_len, "target"), -1)
        nll["target"].append(-teacher.gather(-1, gold.to(teacher.device)).squeeze(-1).double().mean(-1).cpu())
        for mode in modes:
            if mode == "source":  # another model's vocabulary head: its NLL, no KL
                nll[mode].append(-score_tokens(bridge, ids, context_len, mode).double().mean(-1).cpu())
                continue
            student = nn.functional.log_softmax(continuation_logits(bridge, ids, context_len, mode), -1)
            student = student.to(teacher.device)  # (B, C - 1, V)
            nll[mode].append(-student.gather(-1, gold.to(student.device)).squeeze(-1).double().mean(-1).cpu())
            divergence = (teacher.exp() * (teacher - student)).sum(-1)  # (B, C - 1)
            kl[mode].append(divergence.double().mean(-1).cpu())
    return {"nll": {m: torch.cat(v) for m, v in nll.items()}, "kl": {m: torch.cat(v) for m, v in kl.items()}}


def next_token_kl(bridge, windows: torch.Tensor, context_len: int, batch_size: int = 8) -> torch.Tensor:
    """Per window `(N,)`, the mean KL(target ‖ bridge) in nats over the continuation tokens of `windows` `(N, T)`
    after `context_len` tokens: the target on its own cache against the target on the mapped cache of the context
    (the bridge's own forward, hold-back included)."""
    return window_fidelity(bridge, windows, context_len, ("bridge",), batch_size)["kl"]["bridge"]


@dataclass(frozen=True)
class RetrievalItem:
    """One probe: `context` `(C,)` ends with the question, `answer` `(A,)` is the number's tokens, and the last
    `question_len` tokens of the context are the question alone (what the target with no context sees)."""

    context: torch.Tensor
    answer: torch.Tensor
    question_len: int


def build_retrieval_items(
    tokenizer, filler: torch.Tensor, context_len: int = 512, count: int = 32, seed: int = 0, fact_position: int = 16
) -> list[RetrievalItem]:
    """Retrieval items: `"The code of <name> is <number>."` after the first `fact_position` tokens of a
    `context_len`-token window of held-out `filler` text `(N, ≥ context_len)`, and at its end `"The code of <name>
    is"`; the answer is the number's tokens. One item per filler row, at most `count`."""
    rng = random.Random(seed)
    names = ["Arvel", "Brisk", "Corwen", "Dalmor", "Elsin", "Farrow", "Gilden", "Harlan", "Istra", "Jorvik"]
    items = []
    for i in range(min(count, len(filler))):
        name, number = rng.choice(names) + rng.choice(["ia", "on", "ar", "el"]), str(rng.randint(1000, 9999))
        fact = tokenizer(f"\nThe code of {name} is {number}.\n", add_special_tokens=False)["input_ids"]
        question = tokenizer(f"\nThe code of {name} is", add_special_tokens=False)["input_ids"]
        answer = tokenizer(f" {number}", add_special_tokens=False)["input_ids"]
        body = context_len - len(fact) - len(question) - fact_position
        if body < 1 or filler.shape[1] < context_len:
            raise InvalidInputError(
                f"a retrieval item needs a context of more than {len(fact) + len(question) + fact_position} tokens "
                f"and filler windows of at least context_len={context_len} tokens (got {filler.shape[1]})"
            )
        text = filler[i].tolist()
        context = text[:fact_position] + fact + text[fact_position : fact_position + body] + question
        items.append(RetrievalItem(torch.tensor(context), torch.tensor(answer), len(question)))
    return items


PROBE_MODES = ("target", "bridge", "no_context")


@torch.no_grad()
def retrieval_probe(bridge, items: Sequence[RetrievalItem], iterations: int = 2000, seed: int = 0) -> dict:
    """Per mode of `PROBE_MODES`, the answer's log-probability (summed over its tokens; mean over items with its
    bootstrap interval, `logprob`) and the exact-match rate (every answer token the argmax, `exact`); `gain`: the
    mean paired log-probability gain of target and bridge over no context, with intervals. The probe tells something
    about the bridge only where the target itself recalls the fact (`target_recalls`: its gain's interval lies above
    0). `per_item` keeps the log-probabilities.

    Example:

    ```python
    >>> items = build_retrieval_items(tokenizer, filler, context_len=512, count=32)  # doctest: +SKIP
    >>> retrieval_probe(bridge, items)["exact"]  # {"target": ..., "bridge": ..., "no_context": ...}  # doctest: +SKIP
    ```
    """
    if not items:
        raise InvalidInputError("the retrieval probe needs at least one item")
    logprob: dict[str, list[float]] = {mode: [] for mode in PROBE_MODES}
    exact: dict[str, list[float]] = {mode: [] for mode in PROBE_MODES}
    for item in items:
        ids = torch.cat([item.context, item.answer]).unsqueeze(0)  # (1, C + A)
        start = len(item.context)
        for mode in PROBE_MODES:
            if mode == "target":
                logits = bridge.target(input_ids=ids.to(bridge.target.device)).logits
            elif mode == "bridge":
                logits = bridge(ids, prefill_length=start).logits
            else:  # the question and the answer alone: no fact in sight
                logits = bridge.target(input_ids=ids[:, start - item.question_len :].to(bridge.target.device)).logits
            predicted = logits[0, -len(item.answer) - 1 : -1].float().log_softmax(-1)  # (A, V)
            gold = item.answer.to(predicted.device)
            logprob[mode].append(float(predicted.gather(-1, gold[:, None]).sum()))
            exact[mode].append(float(bool((predicted.argmax(-1) == gold).all())))
    mean = {mode: paired_bootstrap(logprob, _mean_of(mode), iterations=iterations, seed=seed) for mode in logprob}
    gain = {
        mode: paired_bootstrap(logprob, _difference(mode, "no_context"), iterations=iterations, seed=seed)
        for mode in ("target", "bridge")
    }
    return {
        "items": len(items),
        "context_len": len(items[0].context),
        "logprob": mean,
        "exact": {mode: sum(values) / len(values) for mode, values in exact.items()},
        "gain": gain,
        "target_recalls": gain["target"]["low"] is not None and gain["target"]["low"] > 0,
        "per_item": logprob,
    }


def _mean_of(mode: str) -> Callable[[dict[str, torch.Tensor]], float]:
    return lambda s: float(s[mode].mean())


def _difference(mode: str, other: str) -> Callable[[dict[str, torch.Tensor]], float]:
    return lambda s: float((s[mode] - s[other]).mean())


def heldout_fidelity(
    bridge,
    windows: torch.Tensor,
    context_len: int,
    *,
    controls: bool = True,
    probe_items: Sequence[RetrievalItem] | None = None,
    batch_size: int = 8,
    iterations: int = 2000,
    seed: int = 0,
) -> dict:
    """One direction of a pair on held-out `windows` `(N, T)`, scored after `context_len` tokens: what `kvbridge
    eval --heldout` reports.

    Returns a JSON-ready dict: `direction`, `windows`, `context_len`, `continuation_len`; `nll` (mean per mode);
    `retention` (context-benefit retention of the bridge and of each control: `{"value", "low", "high", ...}`, paired
    percentile bootstrap over windows, retention of means); `kl` (KL(target ‖ mode) per mode of `KL_MODES`, mean over
    windows with its bootstrap interval; `bridge` 0 = the target's own distribution); the gap recovered fields of
    `GapRecovered.fields` (delta method); `controls_flag`; `probe` (`retrieval_probe`, when `probe_items`);
    `per_window` (`nll` and `kl` lists, to pair other runs against).

    Example:

    ```python
    >>> report = heldout_fidelity(bridge, windows, 384, probe_items=items)  # doctest: +SKIP
    >>> print(format_fidelity(report))  # doctest: +SKIP
    ```
    """
    modes = ("source", "bridge", "no_context", *(CONTROL_MODES if controls else ()))
    scores = window_fidelity(bridge, windows, context_len, modes, batch_size)
    nll, kl = scores["nll"], scores["kl"]
    boot = {"iterations": iterations, "seed": seed}
    retention = {
        mode: paired_bootstrap(nll, retention_of(mode), **boot) for mode in ("bridge", *CONTROL_MODES) if mode in nll
    }
    gap = gap_recovered(nll["source"], nll["bridge"], nll["target"])
    config = bridge.config
    report = {
        "direction": f"{config.source_name_or_path} → {config.target_name_or_path}",
        "windows": int(len(windows)),
        "context_len": context_len,
        "continuation_len": int(windows.shape[1] - context_len),
        "nll": {mode: float(values.mean()) for mode, values in nll.items()},
        "retention": retention,
        "kl": {mode: paired_bootstrap(kl, _mean_of(mode), **boot) for mode in kl},
        **gap.fields(),
        "per_window": {"nll": {m: v.tolist() for m, v in nll.items()}, "kl": {m: v.tolist() for m, v in kl.items()}},
    }
    if controls:
        values = {mode: retention[mode]["value"] for mode in CONTROL_MODES}
        report["controls_flag"] = controls_flag(retention["bridge"]["value"], values)
    if probe_items is not None:
        report["probe"] = retrieval_probe(bridge, probe_items, **boot)
    return report


@dataclass(frozen=True)
class GreedyAgreement:
    """How two greedy runs of one prompt compare (`greedy_agreement`): `first_difference`, the first generated
    position where their tokens differ (`None`: the same tokens throughout), and `gaps`, at that position, how many
    nats the other run's token scored below each run's own choice (`inf` where it was not among the leading tokens
    the run reported)."""

    first_difference: int | None
    gaps: tuple[float, float] = (0.0, 0.0)

    @property
    def same(self) -> bool:
        return self.first_difference is None

    def within(self, tolerance: float) -> bool:
        """The same tokens, or a first difference at a near-tie: in each run the other's token scored less than
        `tolerance` nats below the run's choice."""
        return self.same or max(self.gaps) < tolerance

    def __str__(self) -> str:
        if self.same:
            return "equal"
        return (
            f"first difference at token {self.first_difference}, the other's token {self.gaps[0]:.3g} / "
            f"{self.gaps[1]:.3g} nats below the choice"
        )


def greedy_agreement(
    got: Sequence[int],
    want: Sequence[int],
    got_top: Sequence[Mapping[int, float] | Sequence[Sequence[float]]] | None = None,
    want_top: Sequence[Mapping[int, float] | Sequence[Sequence[float]]] | None = None,
) -> GreedyAgreement:
    """Compares two greedy runs' tokens `got` and `want`; `got_top` and `want_top` (a step each: the leading tokens'
    logprobs, `{token: logprob}` or `[[token, logprob], ...]`, as vLLM's `logprobs=k` reports them) say how close
    to a tie each run was where they first differ. One run ending before the other (a stop token) is a difference at
    its end with no tie.

    Example:

    ```python
    >>> from hf_kvbridge.tools.fidelity import greedy_agreement
    >>> greedy_agreement([5, 7, 9], [5, 7, 9]).same
    True
    >>> got_top, want_top = [{5: -0.1}, {7: -0.690, 8: -0.6905}], [{5: -0.1}, {8: -0.690, 7: -0.6903}]
    >>> tie = greedy_agreement([5, 7], [5, 8], got_top, want_top)
    >>> tie.first_difference, tie.within(1e-3), tie.within(1e-4)
    (1, True, False)
    ```
    """
    got, want = list(got), list(want)
    first = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if first is None:
        if len(got) == len(want):
            return GreedyAgreement(None)
        return GreedyAgreement(min(len(got), len(want)), (math.inf, math.inf))
    gaps = []
    for top, own, other in ((got_top, got, want), (want_top, want, got)):
        scores = {} if top is None else {int(t): float(lp) for t, lp in dict(top[first]).items()}
        if other[first] in scores and own[first] in scores:
            gaps.append(scores[own[first]] - scores[other[first]])
        else:
            gaps.append(math.inf)
    return GreedyAgreement(first, (gaps[0], gaps[1]))


def _interval(result: dict | None, digits: int = 3) -> str:
    if result is None or result.get("value") is None:
        return "—"
    value, low, high = result["value"], result["low"], result["high"]
    if low is None or value != value:  # undefined (NaN) retention
        return "n/a"
    return f"{value:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def format_fidelity(report: dict) -> str:
    """A `heldout_fidelity` report as Markdown: one row per mode (NLL, retention and KL(target ‖ mode) with their
    95% intervals), the gap recovered, the controls' verdict and the probe's table."""
    lines = [
        f"**{report['direction']}**: {report['windows']} held-out windows of {report['context_len']} context + "
        f"{report['continuation_len']} continuation tokens; paired bootstrap 95% intervals over the windows",
        "",
        "| mode | NLL (nats/token) | context-benefit retention [95% CI] | KL(target ‖ mode) [95% CI] |",
        "|---|---|---|---|",
    ]
    for mode, value in report["nll"].items():
        retention = {"target": "1", "no_context": "0"}.get(mode) or _interval(report["retention"].get(mode))
        kl = "0" if mode == "target" else _interval(report["kl"].get(mode), 4)
        lines.append(f"| {mode} | {value:.4f} | {retention} | {kl} |")
    if report["gap_recovered"] is None:
        lines += ["", f"gap recovered: n/a ({report['gap_recovered_reason']})"]
    else:
        low, high = report["gap_recovered_ci"]
        lines += ["", f"gap recovered: {report['gap_recovered']:.3f} [{low:.3f}, {high:.3f}] (delta method)"]
    if "controls_flag" in report:
        flag = report["controls_flag"]
        verdict = {None: "undefined", True: "⚠ a control comes close to the bridge", False: "ok"}[flag]
        lines.append(f"controls (zero / random cache): {verdict}")
    probe = report.get("probe")
    if probe:
        lines += [
            "",
            f"retrieval probe: {probe['items']} facts placed near the start of {probe['context_len']}-token contexts, "
            "asked at the end",
            "",
            "| mode | answer log-prob [95% CI] | gain over no context [95% CI] | exact match |",
            "|---|---|---|---|",
        ]
        for mode in PROBE_MODES:
            gain = _interval(probe["gain"].get(mode), 2) if mode != "no_context" else "0"
            lines.append(f"| {mode} | {_interval(probe['logprob'][mode], 2)} | {gain} | {probe['exact'][mode]:.3f} |")
        if not probe["target_recalls"]:
            lines.append(
                "\nthe target itself does not recall the fact here (its gain over no context is not above 0): the "
                "probe cannot show what the bridge keeps of it"
            )
    return "\n".join(lines)


def evaluate_heldout(
    bridges: Sequence,
    data,
    *,
    windows: int = 64,
    context_len: int = 384,
    continuation_len: int = 128,
    probe_items: int = 32,
    probe_context: int = 512,
    tokenizer=None,
    controls: bool = True,
    iterations: int = 2000,
) -> list[dict]:
    """`heldout_fidelity` of each bridge of `bridges` (e.g. a pair's two directions) on the same held-out windows of
    `data` (text as `calibrate` takes it; use text no map was fitted on) and the same probe items, one report each.

    Example:

    ```python
    >>> reports = evaluate_heldout([bridge, bridge.reverse], pocket.data_path("heldout"))  # doctest: +SKIP
    ```
    """
    from transformers import AutoTokenizer

    from ..errors import ContextLengthError
    from ..fitting.data import iter_texts
    from ..loading import resolve_model_reference
    from .evaluation import heldout_windows

    first = bridges[0]
    for bridge in bridges:
        ContextLengthError.check(
            "a held-out window", context_len + continuation_len, bridge.max_positions, "pass a smaller --context-len"
        )
        if probe_items:
            ContextLengthError.check(
                "a probe item", probe_context + 8, bridge.max_positions, "pass a smaller --probe-context"
            )
    if tokenizer is None:
        name = first.config.target_name_or_path or first.target.config.name_or_path
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_reference(name))
    texts = list(iter_texts(data))
    scored = heldout_windows(texts, tokenizer, context_len + continuation_len, windows)
    items = None
    if probe_items:
        items = build_retrieval_items(tokenizer, heldout_windows(texts, tokenizer, probe_context, probe_items),
                                      probe_context, probe_items)  # fmt: skip
    return [
        heldout_fidelity(bridge, scored, context_len, controls=controls, probe_items=items, iterations=iterations)
        for bridge in bridges
    ]
