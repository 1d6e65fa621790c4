"""`distill`: a calibrated bridge's map trained on the target's own next-token distribution.

The closed-form fit minimises the K/V reconstruction error; what a bridge is scored on is the target's continuation
loss. `distill` starts from the closed-form weights and trains them by gradient descent on

    KL(target on its own cache ‖ target on the mapped cache)  +  nll_weight · NLL(student, the text's next tokens)
                                                               +  pull · ‖θ − θ₀‖² / ‖θ₀‖²

over the continuation tokens of calibration windows (teacher-forced; both models frozen, the teacher under
`no_grad`), with AdamW and a cosine schedule. Held-out calibration windows choose when to stop (the best held-out
score, KL or the student's NLL by `select_by`, is kept, and a run stops after `patience` evaluations without a better
one) and which pull strength wins; the
closed-form map itself is the first candidate, so the result is never worse than it on those windows. The map keeps
its shape (same weights, same runtime cost); the result is a normal bridge checkpoint whose config (and card) records
the distillation (`config.distillation`).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...constants import DEFAULT_CALIBRATION_DATA
from ...errors import CalibrationDataError, CheckpointFileError, ConfigurationError, InvalidInputError
from ...settings import DistillationSettings
from ...utils.cache import cache_kwargs
from ...utils.sizes import format_bytes, parse_bytes
from ..data import describe_data, token_windows
from .checks import shared_tokenizer, split_heldout
from .differentiable import PreconditionedMap, check_linear, differentiable_map_cache, source_rows

logger = logging.getLogger(__name__)

STATE_NAME = "distill_state.pt"


def check_models_loaded(bridge) -> None:
    """Refuses a bridge whose source or target holds no weights (parameters on the `meta` device)."""
    for role in ("source", "target"):
        model = getattr(bridge, role, None)
        if model is None or any(p.device.type == "meta" for p in model.parameters()):
            raise InvalidInputError(
                f"the bridge's {role} model is not loaded (no weights, or weights on the meta device); load the "
                "bridge with from_pretrained (which loads both models) before distilling it"
            )


MAP_STATE_COPIES = 4  # on the map's device: Δ, Δ's gradient, AdamW's two moments (θ₀ is the bridge's own mapper)


def map_state_bytes(mapper) -> int:
    """Bytes of the map's training state on the map's device, beside the models and the bridge's own mapper (which
    is θ₀, read and never copied): `MAP_STATE_COPIES` float32 copies of the mapper's parameters.

    Example:

    ```python
    >>> from hf_kvbridge.mappers import KVMapper
    >>> mapper = KVMapper([[0, 1]], num_kv_heads=2, head_dim=4, head_mode="all_heads")  # 32 inputs, 16 outputs
    >>> map_state_bytes(mapper)  # 4 × 4 bytes × (32·16 + 16)
    8448
    ```
    """
    return MAP_STATE_COPIES * 4 * sum(p.numel() for p in mapper.parameters())


def best_state_bytes(mapper, pull_candidates: int = 1) -> int:
    """Bytes of the weights kept in host (CPU) memory while training: the best Δ so far, and the best earlier run's
    with several pull strengths; one float32 copy of the map each. On a GPU they leave its memory to the training."""
    return (2 if pull_candidates > 1 else 1) * 4 * sum(p.numel() for p in mapper.parameters())


def window_bytes(bridge, seq_len: int, continuation_len: int) -> int:
    """An estimate of the bytes one window takes through a training step (float32): the source's rows, the mapped
    cache with its gradient, the target's activations over the continuation and the two vocabularies of logits
    (`window_bytes_of` on the bridge's mapper and target config)."""
    return window_bytes_of(bridge.mapper, bridge.target.config, seq_len, continuation_len)


def window_bytes_of(mapper, config, seq_len: int, continuation_len: int) -> int:
    """`window_bytes` from a mapper (its layout and selection; it may live on the `meta` device) and the target's
    config, without loading either model."""
    context = seq_len - continuation_len
    rows = context * len({s for layers in mapper.selected_layers for s in layers}) * mapper.x_row
    layers = len(mapper.selected_layers)
    cache = 4 * context * layers * mapper.y_row  # mapped rows, rotated keys, cast copy, gradient
    hidden = getattr(config, "hidden_size", 0) + getattr(config, "intermediate_size", 0)
    heads = getattr(config, "num_attention_heads", 1)
    activations = layers * continuation_len * (6 * hidden + 2 * heads * seq_len)
    logits = 6 * continuation_len * config.vocab_size  # teacher and student logits, log-probs, gradient
    return 4 * (2 * rows + cache + activations + logits)


def _micro_batch(bridge, settings: DistillationSettings) -> int:
    """Windows per forward/backward under `settings.memory` (the whole batch when unset); refuses a budget that cannot
    hold one window."""
    if settings.memory is None:
        return settings.batch_size
    budget = parse_bytes(settings.memory, "memory")
    need = window_bytes(bridge, settings.seq_len, settings.continuation_len)
    if budget < need:
        raise ConfigurationError(
            f"memory={format_bytes(budget)} cannot hold one window of {settings.seq_len} tokens (about "
            f"{format_bytes(need)}); raise memory or lower seq_len / continuation_len"
        )
    return max(1, min(settings.batch_size, budget // need))


def _autocast(settings: DistillationSettings, device: torch.device):
    on = settings.autocast == "bfloat16" or (settings.autocast == "auto" and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=on)


@contextlib.contextmanager
def _timed(timings: dict | None, key: str, device: torch.device):
    """Adds the block's wall time to `timings[key]` (a GPU synchronised at both ends); nothing without `timings`."""
    if timings is None:
        yield
        return
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    timings[key] = timings.get(key, 0.0) + time.perf_counter() - start


class TeacherCache:
    """The teacher's last hidden states over each window's continuation, kept in host memory up to `budget` bytes,
    so that a window's teacher costs a full forward of the target once and its LM head alone afterwards (every epoch
    and pull strength trains on the same windows, and every evaluation scores the same held-out ones). The teacher is
    frozen, so what it gives is the same either way; `check` compares the two ways on a window before the cache is
    used (a model whose logits are more than its LM head of the last hidden state, a final soft-capping say, is left
    uncached)."""

    def __init__(self, budget: int):
        self.budget, self.used, self.states, self.enabled = budget, 0, {}, budget > 0

    def check(self, target, ids: torch.Tensor, continuation_len: int, autocast) -> bool:
        """Whether the target's logits over the continuation of `ids` are its LM head of the cached states; turns
        the cache off otherwise."""
        if self.enabled:
            with torch.no_grad(), autocast:
                whole = target(input_ids=ids, logits_to_keep=continuation_len).logits.float()
                head = _head(target, _last_states(target, ids, continuation_len)).float()
            self.enabled = torch.allclose(whole, head, rtol=1e-4, atol=1e-4 * float(whole.abs().max()))
            if not self.enabled:
                logger.info("the target's logits are not its LM head of its last hidden states: no teacher cache")
        return self.enabled

    def log_probs(self, target, ids: torch.Tensor, keys: list | None, continuation_len: int, autocast):
        """The teacher's log-probabilities `(B, C, V)` over the continuation of `ids` `(B, T)`, windows named by
        `keys` (`None`: not cached)."""
        with torch.no_grad():
            if not self.enabled or keys is None:
                with autocast:
                    logits = target(input_ids=ids, logits_to_keep=continuation_len).logits  # (B, C, V)
                return nn.functional.log_softmax(logits.float(), dim=-1)
            if all(key in self.states for key in keys):
                states = torch.stack([self.states[key] for key in keys]).to(ids.device)  # (B, C, hidden)
            else:
                with autocast:
                    states = _last_states(target, ids, continuation_len)
                for key, row in zip(keys, states):
                    if key not in self.states and self.used + row.nbytes <= self.budget:
                        self.states[key] = row.to("cpu", copy=True)
                        self.used += row.nbytes
            with autocast:
                logits = _head(target, states)
            return nn.functional.log_softmax(logits.float(), dim=-1)


def _last_states(target, ids: torch.Tensor, continuation_len: int) -> torch.Tensor:
    """The target's last hidden states (after its final norm) over the last `continuation_len` tokens of `ids`."""
    return target.base_model(input_ids=ids, use_cache=False).last_hidden_state[:, -continuation_len:]


def _head(target, states: torch.Tensor) -> torch.Tensor:
    return target.get_output_embeddings()(states)


def window_losses(
    bridge,
    maps: PreconditionedMap,
    ids: torch.Tensor,
    continuation_len: int,
    autocast,
    timings: dict | None = None,
    teacher: TeacherCache | None = None,
    keys: list | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(KL, NLL)`, each summed over the windows `ids` `(B, T)`: KL(teacher ‖ student) over the `C` continuation
    tokens, where the teacher is the target on its own cache (no gradient) and the student the target on `maps`' map
    of the source's prefill of the context; and the student's NLL of the text's own next tokens over the `C − 1`
    continuation tokens that have one in the window (what retention scores). One student forward gives both.
    `timings` (a benchmark's) gets the seconds of the parts: `teacher`, `source`, `map` and `student` (forwards);
    `teacher` with `keys` (one per window) reads and fills a `TeacherCache`."""
    target = bridge.target
    device = target.device
    ids = ids.to(device)
    context, continuation = ids[:, :-continuation_len], ids[:, -continuation_len:]
    with torch.no_grad():
        with _timed(timings, "teacher", device):
            teacher = (teacher or TeacherCache(0)).log_probs(target, ids, keys, continuation_len, autocast)
        with _timed(timings, "source", device):
            rows = source_rows(bridge, maps.mapper, context.to(bridge.source.device))
    with autocast:
        with _timed(timings, "map", device):
            cache = differentiable_map_cache(bridge, maps, context, rows)
        with _timed(timings, "student", device):
            student = target(input_ids=continuation, **cache_kwargs(cache)).logits  # (B, C, V)
    student = nn.functional.log_softmax(student.float(), dim=-1)  # (B, C, V)
    kl = nn.functional.kl_div(student, teacher, log_target=True, reduction="sum")
    nll = nn.functional.nll_loss(student[:, :-1].flatten(0, 1), continuation[:, 1:].flatten(), reduction="sum")
    return kl, nll


def heldout_scores(
    bridge,
    maps,
    windows: torch.Tensor,
    continuation_len: int,
    micro: int,
    autocast,
    teacher: TeacherCache | None = None,
) -> dict[str, float]:
    """`{"kl": mean KL per continuation token, "nll": the student's mean NLL per scored token}` over `windows`
    `(N, T)` (no gradient; `window_losses`); `teacher` caches the teacher's states under the keys `("heldout", i)`."""
    kl = nll = 0.0
    with torch.no_grad():
        for start in range(0, len(windows), micro):
            keys = [("heldout", i) for i in range(start, min(start + micro, len(windows)))]
            part = windows[start : start + micro]
            losses = window_losses(bridge, maps, part, continuation_len, autocast, None, teacher, keys)
            kl, nll = kl + float(losses[0]), nll + float(losses[1])
    scored = max(1, len(windows) * (continuation_len - 1))  # none with one continuation token: the NLL is 0
    return {"kl": kl / (len(windows) * continuation_len), "nll": nll / scored}


def _fingerprint(settings: DistillationSettings, windows: torch.Tensor, params: list[torch.Tensor]) -> str:
    """What a checkpoint must match to be resumed: the settings that shape training, the windows, the start map."""
    digest = hashlib.sha256()
    ignored = ("progress", "checkpoint_dir", "memory", "teacher_cache")  # change the memory or speed, not the result
    shaping = {k: v for k, v in vars(settings).items() if k not in ignored}
    digest.update(repr(sorted(shaping.items())).encode())
    digest.update(windows.numpy().tobytes())
    for p in params:  # hashed through the buffer protocol: no bytes copy of a map of several GB
        digest.update(p.detach().float().cpu().contiguous().numpy())
    return digest.hexdigest()


def _save_state(folder: Path | None, state: dict) -> None:
    if folder is None:
        return
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / (STATE_NAME + ".partial")
    torch.save(state, partial)
    os.replace(partial, folder / STATE_NAME)  # a stop mid-write keeps the previous checkpoint


def _load_state(folder: Path | None, fingerprint: str) -> dict | None:
    path = None if folder is None else folder / STATE_NAME
    if path is None or not path.is_file():
        return None
    state = torch.load(path, weights_only=False)
    if state.get("fingerprint") != fingerprint:
        raise CheckpointFileError(
            f"{path} is the checkpoint of another distillation (other settings, text or bridge); remove it or pass "
            "another checkpoint_dir"
        )
    logger.info("resuming the distillation from %s (pull %d, step %d)", path, state["candidate"], state["step"])
    return state


def _settings_from(settings: DistillationSettings | None, kwargs: dict) -> DistillationSettings:
    overrides = {key: kwargs.pop(key) for key in list(kwargs) if key in DistillationSettings.field_names()}
    if kwargs:
        raise ConfigurationError(
            f"distill takes the fields of DistillationSettings as keywords, not {sorted(kwargs)}; the fields: "
            f"{sorted(DistillationSettings.field_names())}"
        )
    return (settings or DistillationSettings()).replace(**overrides)


def distill(bridge, data: Any = DEFAULT_CALIBRATION_DATA, settings: DistillationSettings | None = None, *,
            tokenizer=None, **kwargs: Any):  # fmt: skip
    r"""Trains the map of a calibrated `bridge` on the target's next-token KL and returns the refined bridge.

    Args:
        bridge ([`KVBridgeForCausalLM`] or `str`): a calibrated bridge with both models loaded (ridge, same-head,
            attention-weighted or low-rank map, with or without hidden-state features), or a checkpoint to load.
        data (*optional*, defaults to `"HuggingFaceFW/fineweb-edu"`): calibration text, as `calibrate` takes it (a
            list of strings, a `.txt`/`.jsonl` file or folder, a `datasets.Dataset`, a dataset name); never the text
            you evaluate on.
        settings ([`DistillationSettings`], *optional*): every knob; defaults to `DistillationSettings()`.
        tokenizer (*optional*): the shared tokenizer; by default the source's, checked against the target's.
        kwargs: fields of [`DistillationSettings`] (they override `settings`: `distill(bridge, texts, epochs=1)`).

    Returns:
        A new [`KVBridgeForCausalLM`] over the same models with the trained map (same shape and cost; `bridge` is left
        unchanged); `config.distillation` records the settings, the held-out KL and NLL before and after, and the
        time.

    Example:

    ```python
    >>> import hf_kvbridge
    >>> bridge = hf_kvbridge.calibrate("pocket/pocket-s", "pocket/pocket-l", "pocket")  # doctest: +SKIP
    >>> distilled = hf_kvbridge.distill(bridge, "pocket", num_sequences=128)  # doctest: +SKIP
    >>> distilled.save_pretrained("pocket-s-to-l-distilled")  # doctest: +SKIP
    ```
    """
    settings = _settings_from(settings, kwargs)
    if isinstance(bridge, (str, os.PathLike)):
        from ...modeling import KVBridgeForCausalLM

        bridge = KVBridgeForCausalLM.from_pretrained(bridge)
    check_models_loaded(bridge)
    # θ₀ is the bridge's own mapper, read (in float32, a layer at a time) and never written: no copy of the map is
    # held for training; the result is a float32 copy with Δ folded in, made once the optimiser's state is gone
    mapper = bridge.mapper
    check_linear(mapper)
    bridge.check_length(settings.seq_len)
    micro = _micro_batch(bridge, settings)  # refuses a budget that cannot hold one window, before any text is read
    if tokenizer is None:
        tokenizer = shared_tokenizer(bridge.source, bridge.target)
    windows = token_windows(data, tokenizer, settings.num_sequences, settings.seq_len, text_field=settings.text_field)
    train_ids, heldout_ids = split_heldout(len(windows), settings.heldout_fraction, settings.seed)
    if not train_ids:
        raise CalibrationDataError("no calibration window is left for training; give more text")
    train, heldout = windows[train_ids], windows[heldout_ids]
    started = time.perf_counter()
    folder = None if settings.checkpoint_dir is None else Path(settings.checkpoint_dir)
    fingerprint = _fingerprint(settings, windows, list(mapper.parameters()))
    state = _load_state(folder, fingerprint)
    autocast = _autocast(settings, bridge.target.device)
    frozen = [(p, p.requires_grad) for model in (bridge.source, bridge.target) for p in model.parameters()]
    for p, _ in frozen:
        p.requires_grad_(False)
    # Δ in standardised units, its scales from the first training windows' rows
    first = train[: settings.batch_size, : settings.seq_len - settings.continuation_len]
    maps = PreconditionedMap(mapper, source_rows(bridge, mapper, first.to(bridge.source.device)))
    params = list(maps.deltas)  # Δ = 0: the closed form (no copy of it is kept: a run starts from zeros)
    teacher = TeacherCache(settings.teacher_cache_bytes())
    teacher.check(bridge.target, train[:1].to(bridge.target.device), settings.continuation_len, autocast)
    try:
        if state is None:
            baseline = heldout_scores(bridge, maps, heldout, settings.continuation_len, micro, autocast, teacher)
            state = {"fingerprint": fingerprint, "baseline": baseline, "candidate": 0, "step": 0, "runs": [],
                     "seconds": 0.0}  # fmt: skip
            _save_state(folder, state)
        data_parts = (train, heldout, settings, micro, autocast, teacher)
        state = _train(bridge, maps, params, *data_parts, state, folder, started)
    finally:
        for p, flag in frozen:
            p.requires_grad_(flag)
        for p in params:
            p.requires_grad_(False)
    by = settings.select_by
    best = min(state["runs"], key=lambda run: run["best"][by])
    chosen = best if best["best"][by] < state["baseline"][by] else None
    scores = chosen["best"] if chosen else state["baseline"]
    with torch.no_grad():
        for i, p in enumerate(params):
            if chosen:
                p.copy_(chosen["params"][i])
            else:  # the closed form
                p.zero_()
    mapper = maps.fold(into=copy.deepcopy(bridge.mapper).float())
    seconds = state["seconds"] + time.perf_counter() - started
    config = copy.deepcopy(bridge.config)
    objective = "KL(target on its own cache || target on the mapped cache), continuation tokens"
    if settings.nll_weight > 0:
        objective += f" + {settings.nll_weight:g} x the student's NLL of the text's next tokens"
    config.distillation = {
        "objective": objective,
        "data": describe_data(data),
        "windows": len(train_ids),
        "heldout_windows": len(heldout_ids),
        "seq_len": settings.seq_len,
        "continuation_len": settings.continuation_len,
        "epochs": settings.epochs,
        "batch_size": settings.batch_size,
        "lr": settings.lr,
        "pull_candidates": list(settings.pull),
        "nll_weight": settings.nll_weight,
        "select_by": by,
        "pull": chosen["pull"] if chosen else None,
        "best_step": chosen["best_step"] if chosen else 0,
        "heldout_kl_closed_form": round(state["baseline"]["kl"], 6),
        "heldout_kl": round(scores["kl"], 6),
        "heldout_nll_closed_form": round(state["baseline"]["nll"], 6),
        "heldout_nll": round(scores["nll"], 6),
        "heldout_kl_by_pull": {str(run["pull"]): round(run["best"]["kl"], 6) for run in state["runs"]},
        "heldout_nll_by_pull": {str(run["pull"]): round(run["best"]["nll"], 6) for run in state["runs"]},
        "autocast": settings.autocast,
        "seconds": round(seconds, 2),
        "seed": settings.seed,
    }
    summary = config.distillation
    nll_part = f" + {settings.nll_weight:g} × the text's NLL" if settings.nll_weight > 0 else ""
    # one line in the card's calibration table (the card renders `config.calibration`); the details: `distillation`
    config.calibration = {
        **(config.calibration or {}),
        "distillation": (
            f"map trained on the target's next-token KL{nll_part} over {summary['windows']} windows of "
            f"{settings.seq_len} tokens ({settings.continuation_len} scored), AdamW lr {settings.lr}, pull "
            f"{summary['pull']} chosen from {summary['pull_candidates']} by the held-out {by.upper()} on "
            f"{summary['heldout_windows']} held-out windows; held-out KL per token "
            f"{summary['heldout_kl_closed_form']:.4f} (closed form) → {summary['heldout_kl']:.4f}, NLL "
            f"{summary['heldout_nll_closed_form']:.4f} → {summary['heldout_nll']:.4f}, {summary['seconds']:.0f}s; "
            "details: config.json `distillation`"
        ),
    }
    logger.info(
        "distilled %s → %s in %.1fs: held-out KL %.4f → %.4f, NLL %.4f → %.4f",
        config.source_name_or_path, config.target_name_or_path, seconds, state["baseline"]["kl"], scores["kl"],
        state["baseline"]["nll"], scores["nll"],
    )  # fmt: skip
    return bridge.with_mapper(mapper, config)


def _train(bridge, maps, params, train, heldout, settings, micro, autocast, teacher, state, folder, started) -> dict:
    """Trains one run per pull strength (from θ₀ each), resuming `state`; returns the state with every run's best
    held-out scores and the weights of the best run only.

    The map's training state on its device is `Δ`, its gradient and AdamW's two moments (`map_state_bytes`); the best
    `Δ` so far (and the best earlier run's) is kept in host memory (`best_state_bytes`); `θ₀` is the bridge's own
    mapper. No other copy is held (a checkpoint is written from the live tensors)."""
    from tqdm.auto import tqdm

    steps_per_epoch = math.ceil(len(train) / settings.batch_size)
    total = settings.epochs * steps_per_epoch
    eval_every = max(1, math.ceil(steps_per_epoch / settings.evals_per_epoch))
    by = settings.select_by  # the held-out score that stops a run and keeps the best
    norm = maps.squared_norms()[1]
    bar = tqdm(total=total * len(settings.pull), desc="distilling", unit="step", disable=not settings.progress)
    bar.update(state["candidate"] * total + state["step"])
    for candidate in range(state["candidate"], len(settings.pull)):
        pull = float(settings.pull[candidate])
        optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total)
        if state["step"] == 0:  # a fresh run: from the closed form (Δ = 0), best so far the closed form
            with torch.no_grad():
                for p in params:
                    p.zero_()
            state.update(best=state["baseline"], best_params=None, best_step=0, bad=0)
        else:  # resumed mid-run
            with torch.no_grad():
                for p, value in zip(params, state["params"]):
                    p.copy_(value)
            optimizer.load_state_dict(state["optimizer"])
            schedule.load_state_dict(state["schedule"])
        for p in params:
            p.requires_grad_(True)
        stopped = False
        while state["step"] < total and not stopped:
            step = state["step"]
            epoch, offset = divmod(step, steps_per_epoch)
            order = torch.randperm(len(train), generator=torch.Generator().manual_seed(settings.seed + 1 + epoch))
            picked = order[offset * settings.batch_size : (offset + 1) * settings.batch_size]
            batch = train[picked]
            optimizer.zero_grad(set_to_none=True)
            tokens = len(batch) * settings.continuation_len  # KL's; the NLL's: one fewer a window
            scored = len(batch) * (settings.continuation_len - 1)
            for first in range(0, len(batch), micro):  # streamed micro-batches, gradients accumulated
                keys = [("train", int(i)) for i in picked[first : first + micro]]
                kl, nll = window_losses(bridge, maps, batch[first : first + micro], settings.continuation_len,
                                        autocast, None, teacher, keys)  # fmt: skip
                loss = kl / tokens
                if settings.nll_weight > 0:
                    loss = loss + settings.nll_weight * nll / max(1, scored)
                loss.backward()
            if pull > 0:
                (pull * maps.squared_norms()[0] / norm).backward()
            optimizer.step()
            schedule.step()
            state["step"] = step + 1
            bar.update(1)
            if state["step"] % eval_every == 0 or state["step"] == total:
                scores = heldout_scores(bridge, maps, heldout, settings.continuation_len, micro, autocast, teacher)
                if scores[by] < state["best"][by]:
                    if state["best_params"] is None:  # in host memory: a GPU keeps its memory for the training
                        state["best_params"] = [p.detach().to("cpu", copy=True) for p in params]
                    else:  # into the same buffers: never two best copies at once
                        for best, p in zip(state["best_params"], params):
                            best.copy_(p.detach())
                    state.update(best=scores, best_step=state["step"], bad=0)
                else:
                    state["bad"] += 1
                    stopped = settings.patience > 0 and state["bad"] >= settings.patience
                best_score = state["best"][by]
                bar.set_postfix({"pull": pull, f"heldout_{by}": f"{scores[by]:.4f}", "best": f"{best_score:.4f}"})
                if folder is not None:  # the live tensors: torch.save writes their values now, resuming reads the file
                    state.update(params=[p.detach() for p in params], optimizer=optimizer.state_dict(),
                                 schedule=schedule.state_dict())  # fmt: skip
                    _save_state(folder, {**state, "seconds": state["seconds"] + time.perf_counter() - started})
        if state["best_params"] is not None and all(state["best"][by] < run["best"][by] for run in state["runs"]):
            for run in state["runs"]:  # only the best run's weights are kept
                run["params"] = None
        else:  # the closed form, or a run no better than an earlier one: its weights are not needed
            state["best_params"] = None
        state["runs"].append(
            {"pull": pull, "best": state["best"], "best_step": state["best_step"], "params": state["best_params"]}
        )  # fmt: skip
        logger.info("pull %g: best held-out %s %.4f at step %d", pull, by, state["best"][by], state["best_step"])
        state.update(candidate=candidate + 1, step=0)
        for key in ("params", "optimizer", "schedule"):
            state.pop(key, None)
        _save_state(folder, {**state, "seconds": state["seconds"] + time.perf_counter() - started})
        for p in params:
            p.requires_grad_(False)
    bar.close()
    return state
