"""`kvbridge demo`: calibrate a bridge of the shipped pocket family and measure it, offline, on held-out text.

Prints and writes (JSON + PNG) into a new folder: calibration time; held-out R² of K and V against the number of
source layers; attention-output cosine per target layer; continuation NLL of target / source / bridge / no context
and of the zero- and random-cache controls (`hf_kvbridge.controls`), the context-benefit retention of the bridge and
of the controls, flagged when a control comes within `CONTROL_MARGIN` of the bridge, and the share of the source →
target gap the bridge closes (`gap_recovered`, paired 95% CI over windows; n/a where the target does not beat the
source by a margin the windows resolve); cloze accuracy, retention and gap recovered on accuracy; mapper time
against the target's re-prefill; a greedy generation of target and bridge side by side.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from .. import pocket
from ..controls import CONTROL_MARGIN
from ..errors import ContextLengthError
from ..fitting.attention import attention_output_cosine
from ..fitting.calibration.calibrate import calibrate
from ..fitting.layer_selection import mapper_r2, select_layers
from .bench.mapper import mapper_vs_prefill
from .defaults import DEMO_SETTINGS, DEMO_SIZES, DEMO_SOURCE, DEMO_TARGET
from .diagnostics import plot_layer_bars, plot_r2_heatmap, plot_r2_vs_k
from .evaluation import build_cloze, cloze_accuracy, continuation_nll, heldout_windows

# a machine whose other processes keep more than this share of the CPUs busy gives timings that do not compare
BUSY_WARNING_SHARE = 0.25


def physical_cores() -> int:
    """Physical CPU cores this process may use (logical CPUs / hyper-threads per core; Linux `/proc/cpuinfo`)."""
    logical = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        info = Path("/proc/cpuinfo").read_text()
        siblings = int(info.split("siblings")[1].split(":")[1].split()[0])
        cores = int(info.split("cpu cores")[1].split(":")[1].split()[0])
        return max(1, logical * cores // siblings)
    except (OSError, IndexError, ValueError, ZeroDivisionError):
        return logical


def busy_share(seconds: float = 0.5) -> float | None:
    """Share of all CPUs kept busy by other processes over `seconds` (this one sleeps meanwhile): from
    `/proc/stat`, else the 1-minute load average over the CPU count; `None` when neither is available."""

    def read() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields[:8]) - idle, sum(fields[:8])

    try:
        busy0, total0 = read()
        time.sleep(seconds)
        busy1, total1 = read()
        return (busy1 - busy0) / max(total1 - total0, 1)
    except (OSError, IndexError, ValueError):
        pass
    try:
        return min(os.getloadavg()[0] / (os.cpu_count() or 1), 1.0)
    except (OSError, AttributeError):
        return None


def choose_threads(requested: int | None, busy: float | None) -> tuple[int, str]:
    """The torch thread count for the demo and why: `requested`, else the physical cores less those others keep
    busy (oversubscribed threads made a pocket-l forward 10× slower under load than one thread)."""
    if requested:
        return requested, "--threads"
    cores = physical_cores()
    if busy is None or busy < BUSY_WARNING_SHARE:
        return cores, f"the {cores} physical cores"
    logical = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    free = max(1, cores - math.ceil(busy * logical))
    return free, f"{cores} physical cores, {cores - free} kept busy by other processes"


class Stages:
    """Prints one line as each stage of the demo starts (elapsed time, ETA of the rest) and one as it ends.

    The ETA comes from a cost per stage in "token forwards" (tokens × model passes) and the rate the stages done so
    far ran at; before any is done it is not shown.
    """

    def __init__(self, costs: dict[str, float], stream=None):
        self.costs, self.stream = costs, stream or sys.stdout
        self.started = time.perf_counter()
        self.done_cost = 0.0
        self.names = list(costs)

    def _eta(self, remaining: float) -> str:
        elapsed = time.perf_counter() - self.started
        if self.done_cost <= 0:
            return "ETA after the first stage"
        return f"ETA {_duration(remaining * elapsed / self.done_cost)}"

    def run(self, name: str, label: str, fn):
        index = self.names.index(name) + 1
        remaining = sum(self.costs[n] for n in self.names[index - 1 :])
        elapsed = time.perf_counter() - self.started
        print(
            f"[{index}/{len(self.names)}] {label} (elapsed {_duration(elapsed)}, {self._eta(remaining)})",
            file=self.stream,
            flush=True,
        )
        stage_started = time.perf_counter()
        result = fn()
        self.done_cost += self.costs[name]
        print(f"      done in {_duration(time.perf_counter() - stage_started)}", file=self.stream, flush=True)
        return result


def describe_threads(count: int) -> str:
    return f"{count} torch thread" + ("" if count == 1 else "s")


def _duration(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    if seconds < 60:
        return f"{seconds:.0f}s" if seconds >= 10 else f"{seconds:.1f}s"
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


def _fmt_row(cells, widths) -> str:
    return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths))


def stage_costs(size: dict, num_sequences: int, seq_len: int) -> dict[str, float]:
    """Rough cost of each stage in token forwards (tokens × model passes), for the ETA."""
    nll_tokens = size["nll_windows"] * (size["nll_context"] + size["nll_continuation"])
    cloze_tokens = size["cloze_items"] * 4 * (size["cloze_context"] + size["cloze_continuation"])
    return {
        "calibration": 2.0 * num_sequences * seq_len,  # source + target forward
        "r2_by_k": 0.05 * num_sequences * seq_len,  # closed-form fits from the statistics
        "cosine": 3.0 * size["cosine_windows"] * (size["nll_context"] + size["nll_continuation"]),
        "nll": 6.0 * nll_tokens,  # target, source, bridge, no context, zero cache, random cache
        "cloze": 4.0 * cloze_tokens,
        "timing": 3.0 * (size["timing_repeats"] + 2) * size["timing_context"],
        "generation": 2.0 * 32 * 48,
    }


def measure(
    source: str = DEMO_SOURCE,
    target: str = DEMO_TARGET,
    *,
    quick: bool = False,
    top_k: int | None = DEMO_SETTINGS["top_k"],
    ridge_lambda: float | str = DEMO_SETTINGS["ridge_lambda"],
    head_mode: str = DEMO_SETTINGS["head_mode"],
    num_sequences: int | None = None,
    seq_len: int | None = None,
    seed: int = DEMO_SETTINGS["seed"],
    stages: Stages | None = None,
) -> dict:
    """Calibrates a bridge of two pocket models and runs every measurement of the demo; returns the results.

    Args:
        source, target (`str`): pocket model names (`hf_kvbridge.pocket.POCKET_MODELS`).
        quick (`bool`): the small sizes of `tools.defaults.DEMO_SIZES` (tests and smoke runs).
        top_k, ridge_lambda, head_mode, seed: calibration settings (`hf_kvbridge.CalibrationSettings`).
        num_sequences (`int`, *optional*), seq_len (`int`, *optional*): calibration windows (default: the sizes').
        stages ([`Stages`], *optional*): prints progress with an ETA; by default one that prints to stdout.

    Example:

    ```python
    >>> results = measure("pocket-s", "pocket-l", quick=True)  # doctest: +SKIP
    >>> print(report(results))  # doctest: +SKIP
    ```
    """
    size = {key: value[1] if quick else value[0] for key, value in DEMO_SIZES.items()}
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(pocket.model_path(target))
    source_model, target_model = pocket.load_model(source), pocket.load_model(target)
    num_sequences = num_sequences or size["num_sequences"]
    seq_len = seq_len or size["seq_len"]
    limit = min(source_model.config.max_position_embeddings, target_model.config.max_position_embeddings)
    for what, length in (("--seq-len", seq_len), ("the timing context", size["timing_context"])):
        ContextLengthError.check(what, length, limit, f"pass a smaller --seq-len ({source}/{target})")
    stages = stages or Stages(stage_costs(size, num_sequences, seq_len))

    started = time.perf_counter()
    bridge = stages.run(
        "calibration",
        f"calibrating {source} → {target} on {num_sequences} × {seq_len} tokens",
        lambda: calibrate(
            source_model,
            target_model,
            pocket.load_texts("calibration"),
            tokenizer=tokenizer,
            num_sequences=num_sequences,
            seq_len=seq_len,
            top_k=top_k,
            ridge_lambda=ridge_lambda,
            head_mode=head_mode,
            seed=seed,
            progress=not quick,
            keep_statistics=True,  # the top-k sweep below re-fits from them
        ),
    )
    calibration_s = time.perf_counter() - started
    train, heldout = bridge.calibration_statistics
    num_source = bridge.source_layout.num_layers

    def fit_by_k() -> dict:
        r2_by_k = {}
        for k in (1, 2, 4, 6, None):
            if k is not None and k >= num_source:
                continue
            fitted = mapper_r2(train, heldout, select_layers(bridge.layer_r2, k), head_mode, ridge_lambda)
            r2_by_k["all" if k is None else str(k)] = {
                "k": float(fitted[:, 0].mean()),
                "v": float(fitted[:, 1].mean()),
            }
        return r2_by_k

    r2_by_k = stages.run("r2_by_k", "held-out R² against the number of source layers", fit_by_k)

    heldout_texts = pocket.load_texts("heldout")
    nll_windows = heldout_windows(
        heldout_texts, tokenizer, size["nll_context"] + size["nll_continuation"], size["nll_windows"]
    )
    cosine = stages.run(
        "cosine",
        f"attention-output cosine on {size['cosine_windows']} held-out windows",
        lambda: attention_output_cosine(bridge, nll_windows[: size["cosine_windows"]]),
    )
    nll = stages.run(
        "nll",
        f"continuation NLL of target, source, bridge, no context and the zero- and random-cache controls on "
        f"{size['nll_windows']} held-out windows",
        lambda: continuation_nll(bridge, nll_windows, size["nll_context"], controls=True),
    )
    cloze_windows = heldout_windows(
        heldout_texts, tokenizer, size["cloze_context"] + size["cloze_continuation"], size["cloze_items"]
    )
    cloze = stages.run(
        "cloze",
        f"cloze accuracy on {size['cloze_items']} held-out items × 4 choices",
        lambda: cloze_accuracy(bridge, build_cloze(cloze_windows, size["cloze_context"], seed=seed)),
    )
    timing_ids = heldout_windows(heldout_texts, tokenizer, size["timing_context"], 1)
    timing = stages.run(
        "timing",
        f"timing mapper vs target re-prefill at {size['timing_context']} tokens "
        f"({describe_threads(torch.get_num_threads())})",
        lambda: mapper_vs_prefill(bridge, timing_ids, repeats=size["timing_repeats"]),
    )

    prompt = heldout_windows(heldout_texts, tokenizer, 48, 1)
    gen_kw = {"max_new_tokens": 32, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}
    target_tokens, bridge_tokens = stages.run(
        "generation",
        "greedy generation, target and bridge",
        lambda: (
            target_model.generate(prompt, attention_mask=torch.ones_like(prompt), **gen_kw)[0, 48:],
            bridge.generate(prompt, **gen_kw)[0, 48:],
        ),
    )
    generation = {
        "prompt": tokenizer.decode(prompt[0]),
        "target": tokenizer.decode(target_tokens),
        "bridge": tokenizer.decode(bridge_tokens),
        "same_tokens": int((target_tokens == bridge_tokens).sum()),
        "new_tokens": int(target_tokens.numel()),
    }
    return {
        "pair": {"source": source, "target": target},
        "settings": {
            "top_k": top_k,
            "ridge_lambda": ridge_lambda,
            "head_mode": head_mode,
            "num_sequences": num_sequences,
            "seq_len": seq_len,
            "seed": seed,
            "quick": quick,
        },
        "calibration_seconds": calibration_s,
        "selected_layers": bridge.config.selected_layers,
        "single_layer_r2": bridge.layer_r2.mean(-1).tolist(),
        "r2_by_k": r2_by_k,
        "attention_output_cosine": cosine.tolist(),
        "continuation": nll,
        "cloze": cloze,
        "timing": timing,
        "generation": generation,
        "torch_threads": torch.get_num_threads(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "_bridge": bridge,
    }


def report(results: dict) -> str:
    """The human-readable summary the demo prints."""
    pair = results["pair"]
    lines = [f"== bridge {pair['source']} → {pair['target']} (pocket family, held-out split) ==", ""]
    lines.append(
        f"calibration: {results['calibration_seconds']:.1f}s "
        f"({results['settings']['num_sequences']} × {results['settings']['seq_len']} tokens)"
    )
    lines += ["", "held-out R² of the mapper vs source layers per target layer (mean over target layers):"]
    widths = (8, 8, 8)
    lines.append(_fmt_row(("top-k", "R² K", "R² V"), widths))
    for k, r2 in results["r2_by_k"].items():
        lines.append(_fmt_row((k, f"{r2['k']:.4f}", f"{r2['v']:.4f}"), widths))
    cos = results["attention_output_cosine"]
    lines += [
        "",
        "attention-output cosine per target layer: "
        + " ".join(f"{c:.3f}" for c in cos)
        + f"  (mean {sum(cos) / len(cos):.3f})",
    ]
    cont = results["continuation"]
    lines += [
        "",
        f"continuation NLL on held-out text ({cont['windows']} windows, context {cont['context_len']} "
        f"tokens, {cont['tokens_scored']} tokens scored):",
    ]
    widths = (12, 10, 10)
    lines.append(_fmt_row(("mode", "NLL", "ppl"), widths))
    for mode, value in cont["nll"].items():
        lines.append(_fmt_row((mode, f"{value:.4f}", f"{cont['perplexity'][mode]:.2f}"), widths))
    lines.append(f"context-benefit retention: {cont['context_benefit_retention']:.3f}")
    lines.append(f"gap recovered (source → target, NLL; paired 95% CI over windows): {_gap(cont)}")
    if "control_retention" in cont:
        controls = ", ".join(f"{m.replace('_', ' ')} {v:.3f}" for m, v in cont["control_retention"].items())
        lines.append(f"controls (caches with no information about the context), retention: {controls}")
        if cont.get("controls_flag"):
            lines.append(f"warning: a control comes within {CONTROL_MARGIN} of the bridge's retention")
    cloze = results["cloze"]
    lines += [
        "",
        f"cloze ({cloze['items']} items, {round(1 / cloze['chance'])} choices, chance {cloze['chance']:.2f}):",
    ]
    lines.append("  ".join(f"{mode} {acc:.3f}" for mode, acc in cloze["accuracy"].items()))
    normalised = cloze["chance_normalised_retention"]
    normalised = "undefined (target at or below chance)" if normalised is None else f"{normalised:.3f}"
    lines.append(f"retention {cloze['retention']:.3f}   chance-normalised retention {normalised}")
    lines.append(f"gap recovered (accuracy; paired 95% CI over items): {_gap(cloze)}")
    timing = results["timing"]
    lines += [
        "",
        f"latency at {timing['context_tokens']} context tokens (median of {timing['repeats']}): target "
        f"re-prefill {timing['target_prefill_s'] * 1e3:.1f} ms, mapper {timing['mapper_s'] * 1e3:.1f} ms, "
        f"source prefill {timing['source_prefill_s'] * 1e3:.1f} ms → warm speedup "
        f"{timing['warm_speedup']:.2f}×, cold {timing['cold_speedup']:.2f}× "
        f"({describe_threads(results['torch_threads'])}"
        + (", measured on a busy machine" if results.get("machine_busy") else "")
        + ")",
    ]
    gen = results["generation"]
    lines += [
        "",
        "greedy generation (32 tokens) after a held-out prompt:",
        f"  prompt: {gen['prompt']!r}",
        f"  target: {gen['target']!r}",
        f"  bridge: {gen['bridge']!r}",
        f"  same token at {gen['same_tokens']}/{gen['new_tokens']} positions",
    ]
    lines += ["", summary(results)]
    return "\n".join(lines)


def _gap(measured: dict) -> str:
    """`0.412 [0.301, 0.523] (target with no context: 0.210)`, or `n/a (the reason)`, from a result's
    `gap_recovered` fields."""
    if measured.get("gap_recovered") is None:
        return f"n/a ({measured.get('gap_recovered_reason') or 'not measured'})"
    low, high = measured["gap_recovered_ci"]
    floor = measured.get("gap_recovered_no_context")
    floor = "" if floor is None else f" (target with no context: {floor:.3f})"
    return f"{measured['gap_recovered']:.3f} [{low:.3f}, {high:.3f}]{floor}"


# below this many nats of benefit from its context, a target's context-benefit retention is mostly noise
SMALL_CONTEXT_BENEFIT = 0.1


def summary(results: dict) -> str:
    """A few sentences in plain words: what was bridged, how much of the target's quality it kept, how much faster."""
    pair, cont, cloze, timing = results["pair"], results["continuation"], results["cloze"], results["timing"]
    source, target = pair["source"], pair["target"]
    nll = cont["nll"]
    benefit = nll["no_context"] - nll["target"]
    kept = cont["context_benefit_retention"]
    normalised = cloze["chance_normalised_retention"]
    text = [
        f"In short: {source} read each {cont['context_len']}-token context and the mapper turned its KV cache into "
        f"the one {target} would have built; {target} then continued from that cache.",
        f"It kept {kept:.0%} of what {target}'s own context is worth to it (continuation NLL)"
        + (
            f" and {normalised:.0%} of its above-chance cloze accuracy."
            if normalised is not None
            else f"; the cloze test says nothing here ({target} is at or below chance on it)."
        ),
    ]
    if cont.get("gap_recovered") is not None:
        low, high = cont["gap_recovered_ci"]
        text.append(
            f"Against {source} alone it closed {cont['gap_recovered']:.0%} (95% CI {low:.0%} to {high:.0%}) of the "
            f"continuation-NLL gap between {source} and {target}."
        )
    if cont.get("controls_flag"):
        best = max(cont["control_retention"].values())
        text.append(
            f"Warning: a cache that carries no information about the context (all zeros, or random with the mapped "
            f"cache's norms) keeps {best:.0%}, within {CONTROL_MARGIN} of the bridge: the mapped cache transfers "
            "little here."
        )
    if benefit < SMALL_CONTEXT_BENEFIT:
        text.append(
            f"Careful: {target} gains only {benefit:.3f} nats per token from its context here, so that share rests on "
            "a small difference and says little."
        )
    text.append(
        f"Mapping a {timing['context_tokens']:,}-token context took {timing['mapper_s'] * 1e3:.1f} ms instead of "
        f"{target}'s own prefill of {timing['target_prefill_s'] * 1e3:.1f} ms: {timing['warm_speedup']:.1f}× faster "
        f"when {source}'s cache is already there, {timing['cold_speedup']:.1f}× counting {source}'s prefill too."
    )
    if results.get("machine_busy"):
        text.append("The timings were taken while other processes kept the machine busy; rerun on a quiet machine.")
    return "\n".join(_wrap(line) for line in text)


def _wrap(line: str, width: int = 100) -> str:
    import textwrap

    return textwrap.fill(line, width)


def write_outputs(results: dict, out: Path) -> None:
    """JSON and the three plots."""
    out.mkdir(parents=True, exist_ok=False)
    public = {k: v for k, v in results.items() if not k.startswith("_")}
    (out / "results.json").write_text(json.dumps(public, indent=2, sort_keys=True))
    pair = f"{results['pair']['source']} → {results['pair']['target']}"
    plot_r2_vs_k(results["r2_by_k"], out / "r2_vs_k.png", f"{pair}: held-out R² of the mapper vs source layers used")
    plot_layer_bars(
        results["attention_output_cosine"],
        out / "attention_cosine.png",
        "attention-output cosine (1 = same)",
        f"{pair}: target attention output over mapped vs its own K/V",
    )
    plot_r2_heatmap(
        results["_bridge"].layer_r2,
        out / "r2_heatmap.png",
        f"{pair}: R² of each target layer's K/V from one source layer alone (held-out calibration windows)",
    )
