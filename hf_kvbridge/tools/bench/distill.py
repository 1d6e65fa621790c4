"""Distillation (`hf_kvbridge.distill`) at real layer shapes: a training step's time by part and its memory against
the plan, with random weights, and the same on paper (FLOPs and bytes) for pairs that do not fit this machine.

    kvbridge bench distill --pair qwen3-0.6b:qwen3-1.7b --head-mode same_head --steps 3
    kvbridge bench distill --pair qwen3-14b:qwen3-32b --flop-model

Random weights give meaningless maps but real shapes, so a step's FLOPs, time and bytes are those of the real pair.
A step is what `distill` runs per window: the teacher (the target over the whole window, no gradient), the source's
prefill of the context (no gradient), the map with gradients (`differentiable_map_cache`), the student (the target
over the continuation on the mapped cache), the backward into the map's weights, and AdamW's update.

**FLOPs of one window's step** (`step_flops`; matmul work, 2 per multiply-add; `C` continuation and `X` context
tokens of a window of `T = X + C`; `lm_head(n) = 2 · n · hidden · vocab`):

- teacher: `prefill(target, T) + lm_head(C)`; source: `prefill(source, X)` (plus one token's LM head);
- map: `X · mapper.flops_per_token()` forward, as much again backward (the weights' gradient; the source rows
  need none);
- student: the target's `C` tokens over `X` cached ones, `decode(target, C, X) + lm_head(C)` (`decode_flops`);
- backward through the student: every product of the frozen target once (its input's gradient, never its weights'),
  and the attention's products twice (queries and the mapped keys, scores and the mapped values all need theirs),
  except what the first layer's embedding inputs need no gradient for (its Q/K/V projections and its queries); and
  the map's weight gradient.

**Memory** (`memory_plan`), on the models' device: the two models' weights, the bridge's own mapper (which is the
map's θ₀, never copied), the map's training state (`distill.map_state_bytes`: Δ, its gradient and AdamW's two
moments, four float32 copies of the map) and one window's activations (`distill.window_bytes_of`, the estimate
`memory=` splits batches by); in host memory the best Δ so far, and the best earlier run's with several pull strengths
(`distill.best_state_bytes`). On a CPU both are one memory. The measured mode checks the state and the window against
the live tensors and the allocator's peak.

**The whole distillation** is projected from a step: `epochs` passes over the training windows for each pull
strength, `evals_per_epoch` held-out evaluations each (teacher, source, map and student forwards), and the baseline
evaluation once; with the teacher cache a window's teacher is a whole forward of the target the first time and its
LM head afterwards; beside it the closed-form calibration's forwards on the same windows (both models over every
window once for the selection and once per fit pass), the least a calibration costs: the ratio is the issue's
"distillation ≤ 10× the closed-form calibration" at real size, an upper bound.
"""

from __future__ import annotations

import resource
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from ...fitting.calibration.checks import split_heldout
from ...fitting.calibration.differentiable import PreconditionedMap, source_rows
from ...fitting.calibration.distill import (
    MAP_STATE_COPIES,
    best_state_bytes,
    map_state_bytes,
    window_bytes_of,
    window_losses,
)
from ...mappers import KVMapper
from ...utils.key_norm import key_norm_gains, with_key_norm
from ...utils.sizes import format_bytes
from .flop_model import H100_SXM, prefill_flops
from .shapes import CHECKPOINT_SHAPES, depth_selection, random_mapper_bridge, random_model, shape_config, shape_pair
from .timing import peak_extra_bytes, synchronize

PARTS = ("teacher", "source", "map", "student", "backward", "optimizer")


@dataclass(frozen=True)
class DistillWorkload:
    """A distillation at real layer shapes: the pair (`"SOURCE:TARGET"`, keys of `shapes.CHECKPOINT_SHAPES`), the
    map (`top_k`, `head_mode`; the keys on the target's key-norm sphere, as `calibrate` does for Qwen3 targets), the
    windows (`seq_len` tokens, the last `continuation_len` scored) and the run it is projected to (`windows` of which
    `heldout_fraction` are held out, `epochs`, `evals_per_epoch`, `pull_candidates`: `DistillationSettings`'
    defaults, `teacher_cache` bytes of it), beside a calibration of `fit_passes` fit passes; models in `dtype` on
    `device`."""

    pair: str = "qwen3-0.6b:qwen3-1.7b"
    seq_len: int = 512
    continuation_len: int = 128
    top_k: int = 6
    head_mode: str = "all_heads"
    dtype: str = "float32"
    device: str = "cpu"
    windows: int = 256
    heldout_fraction: float = 0.1
    epochs: int = 2
    evals_per_epoch: int = 4
    pull_candidates: int = 2
    fit_passes: int = 1
    teacher_cache: int = 4 * 10**9

    def configs(self):
        """The source's and the target's `Qwen3Config`."""
        return tuple(shape_config(name) for name in shape_pair(self.pair, "--pair", CHECKPOINT_SHAPES))


def decode_flops(config, tokens: int, past: int) -> float:
    """Matmul FLOPs of `tokens` new tokens through a decoder body over `past` cached ones (no LM head): 2 × tokens ×
    body weights, plus QKᵀ and AV over `past` keys and, causally, half the new ones. `decode_flops(c, T, 0)` is
    `prefill_flops(c, T)`.

    Example:

    ```python
    >>> config = shape_config("qwen3-0.6b")
    >>> decode_flops(config, 512, 0) == prefill_flops(config, 512)
    True
    ```
    """
    c = config.get_text_config(decoder=True)
    q = c.num_attention_heads * c.head_dim
    attention_past = c.num_hidden_layers * 4 * tokens * past * q
    return prefill_flops(config, tokens) + attention_past


def _attention_flops(config, tokens: int, past: int) -> float:
    c = config.get_text_config(decoder=True)
    q = c.num_attention_heads * c.head_dim
    return c.num_hidden_layers * 4 * tokens * (past + tokens / 2) * q


def lm_head_flops(config, tokens: int) -> float:
    """`2 · tokens · hidden · vocab`: the LM head's logits for `tokens` tokens."""
    return 2.0 * tokens * config.hidden_size * config.vocab_size


def step_flops(source_config, target_config, map_flops_per_token: int, seq_len: int, continuation_len: int) -> dict:
    """FLOPs of one window's training step, by part (the module docstring).

    Example:

    ```python
    >>> s, t = shape_config("qwen3-0.6b"), shape_config("qwen3-1.7b")
    >>> flops = step_flops(s, t, 10**6, 512, 128)
    >>> flops["map"] == 384 * 10**6 and flops["total"] == sum(flops[p] for p in ("teacher", "source", "map",
    ...                                                                         "student", "backward"))
    True
    ```
    """
    context = seq_len - continuation_len
    student = decode_flops(target_config, continuation_len, context) + lm_head_flops(target_config, continuation_len)
    map_forward = float(context * map_flops_per_token)
    attention = _attention_flops(target_config, continuation_len, context)
    c = target_config.get_text_config(decoder=True)
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    # the first layer's queries, keys and values come from the embeddings, which need no gradient: no input gradient
    # of its three projections, nor of its queries in QKᵀ (its keys' gradient is the mapped cache's)
    first_layer = 2 * continuation_len * c.hidden_size * (q + 2 * kv) + attention / c.num_hidden_layers / 2
    parts = {
        "teacher": prefill_flops(target_config, seq_len) + lm_head_flops(target_config, continuation_len),
        "source": prefill_flops(source_config, context) + lm_head_flops(source_config, 1),
        "map": map_forward,
        "student": student,
        # the frozen target's input gradients (each product once), the attention's twice, the map's weight gradient
        "backward": student + attention - first_layer + map_forward,
    }
    parts["total"] = sum(parts.values())
    parts["evaluation"] = parts["teacher"] + parts["source"] + parts["map"] + parts["student"]
    return parts


def _counts(w: DistillWorkload) -> dict:
    """Training steps (windows) and evaluations (windows) of the run `w` projects to."""
    train_ids, heldout_ids = split_heldout(w.windows, w.heldout_fraction, 0)
    train, heldout = len(train_ids), len(heldout_ids)
    return {
        "train_windows": train,
        "heldout_windows": heldout,
        "step_windows": w.pull_candidates * w.epochs * train,
        "evaluation_windows": heldout * (1 + w.pull_candidates * w.epochs * w.evals_per_epoch),
        "calibration_windows": w.windows * (1 + w.fit_passes),  # both models over each window, each pass
    }


def project(w: DistillWorkload, flops: dict, rates: dict[str, float]) -> dict:
    """The whole distillation's seconds from one window's `flops` by part at `rates` (FLOP/s by part; `"forward"`
    is the models' forward rate, which the calibration's forwards run at), and the calibration's forwards beside it.
    """
    counts = _counts(w)
    step = sum(flops[p] / rates[p] for p in ("teacher", "source", "map", "student", "backward"))
    evaluation = sum(flops[p] / rates[p] for p in ("teacher", "source", "map", "student"))
    source_config, target_config = w.configs()
    calibration_flops = prefill_flops(source_config, w.seq_len) + prefill_flops(target_config, w.seq_len)
    calibration = counts["calibration_windows"] * calibration_flops / rates["forward"]
    uncached = counts["step_windows"] * step + counts["evaluation_windows"] * evaluation
    # the teacher cache (`DistillationSettings.teacher_cache`): a cached window's teacher runs the whole target once,
    # then its LM head alone; windows beyond the budget run the whole target every time
    whole = flops["teacher"] / rates["teacher"]
    head = lm_head_flops(target_config, w.continuation_len) / rates["teacher"]
    per_window = 4 * w.continuation_len * target_config.hidden_size
    cached = min(w.windows, w.teacher_cache // per_window) / w.windows
    uses = counts["step_windows"] + counts["evaluation_windows"]
    saved = cached * (uses - counts["train_windows"] - counts["heldout_windows"]) * (whole - head)
    distillation = uncached - saved
    return {
        **counts,
        "step_seconds": step,
        "teacher_cache_share": cached,
        "distillation_seconds": distillation,
        "distillation_seconds_uncached": uncached,
        "calibration_forward_seconds": calibration,
        "ratio_to_calibration_forwards": distillation / calibration,
        "ratio_uncached": uncached / calibration,
    }


def _meta_parts(w: DistillWorkload):
    """The mapper of `w`'s map and both models' parameter counts, built on the `meta` device (no memory)."""
    from transformers import Qwen3ForCausalLM

    from ...utils.layout import check_matched

    source_config, target_config = w.configs()
    with torch.device("meta"):
        counts = [sum(p.numel() for p in Qwen3ForCausalLM(c).parameters()) for c in (source_config, target_config)]
    src, tgt = check_matched(source_config, target_config, "source", "target")
    selected = depth_selection(src.num_layers, tgt.num_layers, min(w.top_k, src.num_layers))
    with torch.device("meta"):  # the selection random_mapper_bridge makes, so the plan is the measured map's
        mapper = KVMapper(selected, src.num_kv_heads, src.head_dim, w.head_mode)
    return mapper, counts


def memory_plan(w: DistillWorkload, mapper=None, model_parameters=None) -> dict:
    """Bytes of a distillation of `w` by part (the module docstring), from the shapes alone: models in `w.dtype`,
    the bridge's mapper in `w.dtype`, the map's training state, one window."""
    if mapper is None or model_parameters is None:
        mapper, model_parameters = _meta_parts(w)
    size = torch.empty((), dtype=getattr(torch, w.dtype)).element_size()
    map_parameters = sum(p.numel() for p in mapper.parameters())
    plan = {
        "models": size * sum(model_parameters),
        "bridge_mapper": size * map_parameters,
        "map_state": map_state_bytes(mapper),
        "host_best": best_state_bytes(mapper, w.pull_candidates),
        "window": window_bytes_of(mapper, w.configs()[1], w.seq_len, w.continuation_len),
        "map_parameters": map_parameters,
        "model_parameters": list(model_parameters),
    }
    plan["device_total"] = plan["models"] + plan["bridge_mapper"] + plan["map_state"] + plan["window"]
    plan["total"] = plan["device_total"] + plan["host_best"]
    return plan


def flop_model_report(w: DistillWorkload, rates=H100_SXM) -> dict:
    """`w` on paper: one window's FLOPs, the memory plan, and the whole distillation's time at `rates` (a
    `flop_model.DeviceRates`; every part at its forward rate, as under bfloat16 autocast)."""
    mapper, counts = _meta_parts(w)
    source_config, target_config = w.configs()
    flops = step_flops(source_config, target_config, mapper.flops_per_token(), w.seq_len, w.continuation_len)
    part_rates = dict.fromkeys((*PARTS, "forward"), rates.forward)
    return {
        "workload": asdict(w),
        "flops": flops,
        "memory": memory_plan(w, mapper, counts),
        "rates": asdict(rates),
        "projection": project(w, flops, part_rates),
    }


def _rss() -> int:
    """This process's resident set now (bytes; Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def run(w: DistillWorkload, steps: int = 3, seed: int = 0) -> dict:
    """Builds random-weight models of `w.pair` and a random map, runs `steps` training steps of one window each as
    `distill` runs them (the first is a warm-up that also allocates AdamW's moments), and returns the median seconds
    of each part, the FLOP rates, the memory measured against `memory_plan`, and the projection of the whole run.

    Example:

    ```python
    >>> result = run(DistillWorkload("qwen3-0.6b:qwen3-1.7b", head_mode="same_head"), steps=2)  # doctest: +SKIP
    >>> result["projection"]["ratio_to_calibration_forwards"]  # doctest: +SKIP
    ```
    """
    device = torch.device(w.device)
    dtype = getattr(torch, w.dtype)
    names = shape_pair(w.pair, "--pair", CHECKPOINT_SHAPES)
    started = time.perf_counter()
    source = random_model(names[0], dtype, w.device)
    target = random_model(names[1], dtype, w.device)
    bridge = random_mapper_bridge(source, target, top_k=w.top_k, head_mode=w.head_mode)
    bridge.mapper.to(dtype=dtype)
    with_key_norm(bridge, key_norm_gains(target))  # as calibrate does for a Qwen3 target
    build_seconds = time.perf_counter() - started
    for model in (source, target):
        model.requires_grad_(False)
    context = w.seq_len - w.continuation_len
    windows = torch.randint(0, target.config.vocab_size, (steps + 1, w.seq_len),
                            generator=torch.Generator().manual_seed(seed))  # fmt: skip
    mapper = bridge.mapper  # θ₀, as distill reads it
    maps = PreconditionedMap(mapper, source_rows(bridge, mapper, windows[:1, :context].to(device)))
    params = list(maps.deltas)
    best = [p.detach().to("cpu", copy=True) for p in params]  # distill keeps the best Δ so far, in host memory
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    for p in params:
        p.requires_grad_(True)
    rss_before = _rss()
    per_step: list[dict] = []
    for i in range(steps):
        timings: dict = {}
        kl = window_losses(bridge, maps, windows[i : i + 1], w.continuation_len, autocast, timings)[0]
        start = time.perf_counter()
        (kl / w.continuation_len).backward()
        synchronize(device)
        timings["backward"] = time.perf_counter() - start
        start = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        timings["optimizer"] = time.perf_counter() - start
        per_step.append(timings)
    timed = per_step[1:] or per_step  # the first step warms up and allocates AdamW's moments
    seconds = {p: statistics.median(t[p] for t in timed) for p in PARTS}

    def one_window():  # a window's forward and backward, the gradient it allocates included
        kl = window_losses(bridge, maps, windows[-1:], w.continuation_len, autocast)[0]
        (kl / w.continuation_len).backward()
        optimizer.zero_grad(set_to_none=True)

    window_peak = peak_extra_bytes(one_window, device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss * 1024  # fmt: skip
    flops = step_flops(source.config, target.config, bridge.mapper.flops_per_token(), w.seq_len, w.continuation_len)
    rates = {p: flops[p] / seconds[p] for p in PARTS if p != "optimizer"}
    rates["forward"] = rates["teacher"]  # the target over whole windows: what a calibration's forwards run
    # the map's training state as held now, counted from the live tensors: Δ and AdamW's moments on the device, the
    # best Δ in host memory (θ₀ is the bridge's own mapper)
    moments = sum(t.numel() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim())
    held = 4 * (sum(p.numel() for p in params) + moments)
    held_host = 4 * sum(b.numel() for b in best if b.device.type == "cpu")
    plan = memory_plan(w, bridge.mapper, [sum(p.numel() for p in m.parameters()) for m in (source, target)])
    map_bytes = 4 * plan["map_parameters"]
    projection = project(w, flops, {**rates, "optimizer": 1.0})
    projection["step_seconds_measured"] = sum(seconds.values())
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    return {
        "workload": asdict(w),
        "steps": steps,
        "threads": torch.get_num_threads(),
        "device": where,
        "build_seconds": round(build_seconds, 1),
        "seconds": seconds,
        "flops": flops,
        "rates": rates,
        "memory": {
            "plan": plan,
            "map_state_held": held,  # the map state less the gradient (counted in the window's peak)
            "map_state_planned_without_gradient": map_state_bytes(bridge.mapper) - map_bytes,
            "host_best_held": held_host,
            "host_best_planned": best_state_bytes(bridge.mapper, 1),
            "window_peak_measured": window_peak,  # a window's forward and backward, its gradient included
            "window_planned_with_gradient": plan["window"] + map_bytes,
            "gradient": map_bytes,
            "rss_before_steps": rss_before,
            "peak": peak,
        },
        "projection": projection,
    }


def format_report(result: dict) -> str:
    """The figures of `run` or `flop_model_report` as lines of text."""
    w, flops, memory = result["workload"], result["flops"], result["memory"]
    plan = memory.get("plan", memory)
    lines = [
        f"{w['pair']}: {w['head_mode']} top-{w['top_k']} map of {plan['map_parameters'] / 1e6:,.1f} M parameters, "
        f"windows of {w['seq_len']} tokens ({w['continuation_len']} scored), models in {w['dtype']}",
        "one window's step, TFLOP: " + ", ".join(
            f"{p} {flops[p] / 1e12:.3f}" for p in ("teacher", "source", "map", "student", "backward", "total")),
    ]  # fmt: skip
    if "seconds" in result:
        lines.append(
            f"measured ({result['device']}, median of {max(1, result['steps'] - 1)} steps after a warm-up), s: "
            + ", ".join(f"{p} {result['seconds'][p]:.2f}" for p in PARTS)
            + "; GFLOP/s: " + ", ".join(f"{p} {r / 1e9:.0f}" for p, r in result["rates"].items() if p != "forward")
        )  # fmt: skip
        lines.append(
            f"memory: models {format_bytes(plan['models'])}, the bridge's mapper {format_bytes(plan['bridge_mapper'])}"
            f"; map training state held {format_bytes(memory['map_state_held'])} (planned, less the gradient: "
            f"{format_bytes(memory['map_state_planned_without_gradient'])}) and the best Δ in host memory "
            f"{format_bytes(memory['host_best_held'])} (planned {format_bytes(memory['host_best_planned'])}); one "
            "window's step "
            f"{format_bytes(memory['window_peak_measured'] or 0)} measured against "
            f"{format_bytes(memory['window_planned_with_gradient'])} planned (gradient included); peak "
            f"{'allocated' if 'cuda' in result['device'].lower() else 'RSS'} {format_bytes(memory['peak'])} against "
            f"a plan of {format_bytes(plan['total'])}"
        )
    else:
        rates = result["rates"]
        lines.append(
            f"memory plan: models {format_bytes(plan['models'])}, the bridge's mapper "
            f"{format_bytes(plan['bridge_mapper'])}, map training state ({MAP_STATE_COPIES} float32 copies) "
            f"{format_bytes(plan['map_state'])}, one window {format_bytes(plan['window'])}: "
            f"{format_bytes(plan['device_total'])} on the device; the best Δ in host memory "
            f"{format_bytes(plan['host_best'])}"
        )
        lines.append(f"rates: {rates['name']} ({rates['source']})")
    p = result["projection"]
    lines.append(
        f"projected: {w['windows']} windows ({p['train_windows']} trained, {p['heldout_windows']} held out), "
        f"{w['epochs']} epochs x {w['pull_candidates']} pull strengths, {w['evals_per_epoch']} evaluations an "
        f"epoch: {p['distillation_seconds']:,.0f} s with the teacher cache ({p['teacher_cache_share']:.0%} of the "
        f"windows), {p['distillation_seconds_uncached']:,.0f} s without; the calibration's forwards on the same "
        f"windows ({1 + w['fit_passes']} passes) {p['calibration_forward_seconds']:,.0f} s; ratio "
        f"{p['ratio_to_calibration_forwards']:.1f}x ({p['ratio_uncached']:.1f}x without the cache; an upper bound of "
        "distillation / calibration)"
    )
    return "\n".join(lines)
