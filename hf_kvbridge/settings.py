"""`CalibrationSettings`: every knob of `calibrate`, in one documented, validated object.

`calibrate(source, target, data, top_k=8)` keeps its simple call: keyword arguments that name a field override the
settings. Validation runs before any model is loaded or any text is read, so a bad value costs nothing.

The fields are also the options of `kvbridge calibrate`: each field's `metadata` holds its command-line help (and
choices), and the light command-line entry (`kvbridge_cli`) builds the options from them. That entry reads this file
without importing torch, so the module imports only the standard library and the stdlib-only `constants` and
`errors` (and `sizes`, `source_features`), and reads the mapper registry only when it is already loaded.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .constants import HEAD_MODES, KEY_NORM_MODES, KV_MODES, MAPPER_KWARGS, MAPPER_TYPE_NAMES, STATISTICS_DTYPES
from .errors import ConfigurationError, unknown_mapper_type
from .utils.sizes import parse_bytes
from .utils.source_features import check_feature_modes, check_hidden_state_layers_value

if TYPE_CHECKING:
    import torch

CLI_ONLY_IN_LIBRARY = "cli"
"""Metadata key: `False` marks a field the command line does not offer (it is listed as library-only)."""


def _option(default: Any = None, *, help: str, choices: tuple | None = None, cli: bool = True, **kwargs):
    """A settings field with its command-line help and choices (the one source of both)."""
    metadata = {"help": help, CLI_ONLY_IN_LIBRARY: cli}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    if "default_factory" in kwargs:
        return field(default_factory=kwargs["default_factory"], metadata=metadata)
    return field(default=default, metadata=metadata)


class _Settings:
    """What the settings dataclasses share: validated on creation and on `replace`, their field names and defaults
    (standard library only)."""

    def __post_init__(self):
        self.validate()

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def replace(self, **changes: Any):
        """A copy with `changes` applied (validated)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """The fields that have a default, with it."""
        return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}

    def values(self) -> dict[str, Any]:
        """Every field, with its value."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def validate(self) -> None:
        raise NotImplementedError


@dataclass
class CalibrationSettings(_Settings):
    r"""How `calibrate` fits a bridge.

    Args:
        num_sequences (`int`, *optional*, defaults to `500`), seq_len (`int`, *optional*, defaults to `1024`):
            calibration windows of `seq_len` tokens.
        top_k (`int`, *optional*, defaults to `6`): source layers per target layer (`None`: all).
        ridge_lambda (`float` or `"auto"`, *optional*, defaults to `"auto"`): relative to each input feature's
            variance (ridge on standardised inputs; see `hf_kvbridge.fitting.solve`). `"auto"` chooses it per target
            layer (and head, in `same_head` mode, and K/V) by held-out R² over `hf_kvbridge.fitting.solve.LAMBDA_GRID`.
        head_mode (`str`, *optional*, defaults to `"all_heads"`): or `"same_head"` (head h from head h only).
        kv_mode (`str`, *optional*, defaults to `"joint"`): `"separate"` maps keys from keys and values from values
            (half the mapper's weights and FLOPs; every mapper type).
        mapper_type (`str`, *optional*, defaults to `"ridge"`): a key of `hf_kvbridge.mappers.MAPPER_REGISTRY`
            (`"ridge"`, `"ridge_attention_weighted"`, `"mlp"`, `"low_rank"`).
        mapper_kwargs (`dict`, *optional*): options of that mapper type (e.g. `{"rank": 64}` for `"low_rank"`,
            `{"hidden": 256, "loss": "attention", "epochs": 2}` for `"mlp"`).
        batch_size (`int`, *optional*, defaults to `8`): windows per forward pass.
        heldout_fraction (`float`, *optional*, defaults to `0.1`): share of windows held out for R² and layer
            selection (split by sequence).
        hold_back (`int`, *optional*, defaults to `1`): prompt tokens the target computes itself.
        seed (`int`, *optional*, defaults to `0`): the held-out split (and the MLP's initialisation).
        text_field (`str`, *optional*, defaults to `"text"`): the text column of JSON Lines files and datasets.
        bidirectional (`bool`, *optional*, defaults to `False`): also fit a target→source mapper from the same
            forward passes (`bridge.reverse`).
        checkpoint_dir (`str`, *optional*): checkpoint the statistics there and resume after an interruption.
        statistics_device (*optional*): device of the statistics (defaults to the CPU).
        statistics_memory (`str` or `int`, *optional*): bytes the calibration statistics may take (`"16GB"`,
            `"512MiB"`); defaults to half the free memory of the statistics device, or to the cheapest plan's need
            (one target layer per fit pass) when that is more and still fits the free memory beside a batch's rows
            (`budget.default_budget`). Dense statistics (exact, one
            pass) are used when they fit, otherwise a selection pass and as many fit passes as the budget needs (see
            `hf_kvbridge.fitting.budget`); a budget too small for one target layer is refused before any work.
        statistics_dtype (`str`, *optional*, defaults to `"float32"`): of the budgeted statistics' Gram blocks
            (`"float32"` or `"float64"`; sums are centred, so float32 stays accurate).
        keep_statistics (`bool`, *optional*, defaults to `False`): leave the statistics on the returned bridge as
            `bridge.calibration_statistics` (for studies and diagnostics; they can take gigabytes).
        progress (`bool`, *optional*, defaults to `False`): progress bars.
        recompute_layers (`int` or `list[int]`, *optional*, defaults to `0`): also fit the residual map of layer
            recompute (`hf_kvbridge.transfer.layer_recompute`) for these numbers of top target layers, from the same
            forward passes: the bridge can then run `config.recompute_layers = n` for any of them (and for `0` and the
            target's layer count, which need no map). One number also turns it on in the saved config; a list leaves
            `config.recompute_layers` at `0` (pick one at run time). `0`: no residual map.
        hidden_state_layers (`list[int]`, `int` or `"all"`, *optional*): richer source features
            (`hf_kvbridge.utils.source_features`): these entries of the source's `output_hidden_states` (`0`: the
            embeddings, `i`: what source layer `i` receives, `L_s` or `-1`: the final normed output) become feature
            blocks of every target layer's map beside the source's K/V, ranked with the K/V blocks by held-out R²
            (`top_k` counts both). `None` (default): K/V only. Needs `head_mode="all_heads"`, `kv_mode="joint"` and
            the `"ridge"` or `"low_rank"` mapper; such a bridge cannot be served by vLLM or from a KV store.
        key_norm (`str`, *optional*, defaults to `"auto"`): put the mapped keys back on the target's key-norm sphere
            (`hf_kvbridge.utils.key_norm`: each key head rescaled to the length the target's per-head key norm gives
            its own keys; no weights, the same runtime cost): `"auto"` where the target has such a norm (Qwen3, Gemma
            3), `"on"` (refused before any work for a target without one), `"off"` (the plain linear map; `True` /
            `False` are read as `"on"` / `"off"`).

    Example:

    ```python
    >>> from hf_kvbridge.settings import CalibrationSettings
    >>> settings = CalibrationSettings(num_sequences=64, seq_len=256, top_k=4)
    >>> settings.replace(mapper_type="low_rank", mapper_kwargs={"rank": 32}).mapper_kwargs
    {'rank': 32}
    ```
    """

    num_sequences: int = _option(500, help="calibration windows")
    seq_len: int = _option(1024, help="calibration window length in tokens")
    top_k: int | None = _option(6, help="source layers per target layer, or 'all'")
    ridge_lambda: float | str = _option(
        "auto",
        help="'auto' (chosen per target layer by held-out R²) or a number ≥ 0, relative to each input feature's "
        "variance",
    )
    head_mode: str = _option("all_heads", choices=HEAD_MODES, help="same_head: head h from head h only")
    kv_mode: str = _option(
        "joint",
        choices=KV_MODES,
        help="separate: keys from keys and values from values (half the mapper's weights and FLOPs)",
    )
    mapper_type: str = _option(
        "ridge", choices=MAPPER_TYPE_NAMES, help="low_rank: each ridge map reduced to --rank (cheaper to apply)"
    )
    mapper_kwargs: dict[str, Any] = _option(
        help="options of the mapper type (the command line offers them as --rank and --mlp-*)",
        cli=False,
        default_factory=dict,
    )
    batch_size: int = _option(8, help="windows per forward pass")
    heldout_fraction: float = _option(0.1, help="share of windows held out for R² and layer selection")
    hold_back: int = _option(1, help="prompt tokens the target computes itself (≥ 1)")
    seed: int = _option(0, help="seed of the held-out split (and of the MLP's initialisation)")
    text_field: str = _option("text", help="JSON/dataset field holding the text")
    bidirectional: bool = _option(
        False, help="also fit a target→source mapper (bridge.reverse; chat's /switch needs it)"
    )
    checkpoint_dir: str | os.PathLike | None = _option(
        None, help="checkpoint the statistics in this folder and resume an interrupted calibration from it"
    )
    statistics_device: torch.device | str | None = _option(
        None, help="device of the calibration statistics, e.g. cuda:1 (default: the CPU)"
    )
    statistics_memory: int | str | None = _option(
        None,
        help="memory the calibration statistics may take, e.g. 16GB (default: half the free memory of the statistics "
        "device, more when one target layer needs it and it is free); refused up front when too small",
    )
    statistics_dtype: str = _option(
        "float32", choices=STATISTICS_DTYPES, help="of the budgeted statistics' Gram blocks"
    )
    keep_statistics: bool = _option(
        False, help="leave the statistics on the returned bridge (bridge.calibration_statistics)", cli=False
    )
    progress: bool = _option(False, help="progress bars (the command line always shows them)", cli=False)
    recompute_layers: int | list[int] = _option(
        0,
        help="fit the residual map of layer recompute for the top N target layers (a comma-separated list fits "
        "several; one number also turns it on in the saved bridge); 0: none",
    )
    hidden_state_layers: list[int] | int | str | None = _option(
        None,
        help="source hidden states (output_hidden_states entries, comma-separated, -1: the last; or 'all') that "
        "feed the K/V maps beside the source's K/V; none: K/V only (such a bridge cannot be served by vLLM)",
    )
    key_norm: bool | str = _option(
        "auto",
        choices=KEY_NORM_MODES,
        help="put mapped keys back on the target's key-norm sphere (same cost); auto: where the target normalises "
        "each key head (Qwen3)",
    )

    @classmethod
    def check_values(cls, values: dict[str, Any]) -> None:
        """Raises `ConfigurationError` for the first bad value among `values` (field name → value; the others take
        their defaults). Needs only the standard library: the command line calls it before importing torch."""
        _check_values({**cls.defaults(), **values})

    def validate(self) -> None:
        """Raises `ConfigurationError` naming the first bad setting and what is allowed.

        The mapper type's `mapper_kwargs` and `kv_mode` are checked against the mapper registry when it is loaded (it
        may hold types registered at run time: `hf_kvbridge.mappers.MAPPER_REGISTRY`), else against the built-in
        types' table (`constants.MAPPER_KWARGS`), so validating imports nothing beyond the standard library.
        """
        _check_values(self.values())
        if self.statistics_memory is not None:
            parse_bytes(self.statistics_memory)
        registry = sys.modules.get("hf_kvbridge.mappers")
        if registry is not None:
            entry = registry.get_mapper_type(self.mapper_type)
            accepted, kv_modes = entry.kwargs, entry.kv_modes
        elif self.mapper_type in MAPPER_KWARGS:  # every built-in type fits both kv modes
            accepted, kv_modes = MAPPER_KWARGS[self.mapper_type], KV_MODES
        else:
            raise unknown_mapper_type(self.mapper_type, MAPPER_TYPE_NAMES)
        unknown = sorted(set(self.mapper_kwargs or {}) - set(accepted))
        if unknown:
            raise ConfigurationError(
                f"mapper_type {self.mapper_type!r} takes mapper_kwargs {list(accepted) or 'none'}, not {unknown}"
            )
        if self.kv_mode not in kv_modes:
            raise ConfigurationError(
                f"mapper_type {self.mapper_type!r} supports kv_mode {list(kv_modes)}, not {self.kv_mode!r}"
            )
        if self.hidden_state_layers is not None:
            check_feature_modes(self.head_mode, self.kv_mode, self.mapper_type, self.bidirectional)


def _check_values(s: dict[str, Any]) -> None:
    """The per-value checks of `CalibrationSettings` (standard library only)."""
    for name in ("num_sequences", "seq_len", "batch_size"):
        value = s[name]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigurationError(f"{name} must be a positive integer, got {value!r}")
    top_k = s["top_k"]
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise ConfigurationError(f"top_k must be a positive integer or None (all source layers), got {top_k!r}")
    ridge_lambda = s["ridge_lambda"]
    number = isinstance(ridge_lambda, (int, float)) and not isinstance(ridge_lambda, bool)
    if ridge_lambda != "auto" and (not number or not ridge_lambda >= 0):
        raise ConfigurationError(f"ridge_lambda must be 'auto' or a number ≥ 0, got {ridge_lambda!r}")
    for name, allowed in (("head_mode", HEAD_MODES), ("kv_mode", KV_MODES), ("statistics_dtype", STATISTICS_DTYPES)):
        if s[name] not in allowed:
            raise ConfigurationError(f"{name} must be one of {allowed}, got {s[name]!r}")
    fraction = s["heldout_fraction"]
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        raise ConfigurationError(f"heldout_fraction must lie strictly between 0 and 1, got {fraction!r}")
    recompute_layer_values(s.get("recompute_layers", 0))
    check_hidden_state_layers_value(s.get("hidden_state_layers"))
    if s.get("key_norm", "auto") not in (*KEY_NORM_MODES, True, False):
        raise ConfigurationError(f"key_norm must be one of {KEY_NORM_MODES} (or True/False), got {s['key_norm']!r}")
    hold_back = s["hold_back"]
    if not isinstance(hold_back, int) or isinstance(hold_back, bool) or hold_back < 1:
        raise ConfigurationError(
            f"hold_back must be an integer ≥ 1 (the target runs the last prompt token), got {hold_back!r}"
        )


AUTOCAST_CHOICES = ("auto", "bfloat16", "off")
SELECT_BY_CHOICES = ("kl", "nll")


@dataclass
class DistillationSettings(_Settings):
    r"""How `distill` trains a calibrated bridge's map on the target's own next-token distribution.

    Each calibration window of `seq_len` tokens is split into a context (its first `seq_len - continuation_len`
    tokens, prefilled by the source and mapped) and a continuation the target scores on the mapped cache (student)
    and on its own cache (teacher); the loss is KL(teacher ‖ student) over the continuation's tokens, plus a pull
    towards the closed-form weights. Validated before any model runs or any text is read.

    Args:
        num_sequences (`int`, *optional*, defaults to `256`), seq_len (`int`, *optional*, defaults to `512`):
            windows of the calibration text.
        continuation_len (`int`, *optional*, defaults to `128`): tokens of each window the target scores (the rest
            is the context the source prefills); `< seq_len`.
        heldout_fraction (`float`, *optional*, defaults to `0.1`): share of the windows held out for early stopping
            and for choosing the pull's strength (never trained on).
        epochs (`int`, *optional*, defaults to `2`): passes over the training windows at most.
        batch_size (`int`, *optional*, defaults to `8`): windows per optimiser step.
        lr (`float`, *optional*, defaults to `1e-4`): AdamW learning rate of the weight changes in standardised
            units (`calibration.differentiable.PreconditionedMap`), cosine-annealed to 0. With the keys put back on
            the target's key-norm sphere (`CalibrationSettings.key_norm`) 3e-4 never improved on the closed form of
            either pocket pair and 1e-4 did; without it 3e-4 kept more (`docs/distillation.md`).
        pull (`float` or `list[float]`, *optional*, defaults to `[0.0, 1.0]`): strength of the L2 pull towards the
            closed-form weights, relative to their squared norm (`pull · ‖θ − θ₀‖² / ‖θ₀‖²` is added to the loss);
            several values are each trained and the one with the best held-out score (`select_by`) is kept.
        nll_weight (`float`, *optional*, defaults to `0.0`): weight of the student's NLL of the window's own next
            tokens (the hard labels of distillation; what retention scores), added to the KL per token. `0`: the KL
            alone. With it the map moves away from the target (its KL to the target rises) while its NLL of text
            like the calibration's falls (`docs/distillation.md`).
        select_by (`str`, *optional*, defaults to `"kl"`): the held-out score that stops a run and picks the map
            (and the pull's strength): `"kl"`, the KL to the target, or `"nll"`, the student's NLL of the text.
        evals_per_epoch (`int`, *optional*, defaults to `4`): held-out evaluations (and checkpoints) per epoch.
        patience (`int`, *optional*, defaults to `2`): evaluations without a better held-out score before a run
            stops.
        memory (`str` or `int`, *optional*): bytes one forward/backward pass may take (`"2GB"`); a batch that does
            not fit is split into micro-batches (gradients accumulated); a budget that cannot hold one window is
            refused before any work. `None`: the whole batch at once.
        autocast (`str`, *optional*, defaults to `"auto"`): `"bfloat16"` runs the models' forwards under
            `torch.autocast(bfloat16)` (the mapper's weights stay float32), `"off"` never; `"auto"`: on CUDA only.
        teacher_cache (`str` or `int`, *optional*, defaults to `"4GB"`): host memory for the teacher's last hidden
            states over each window's continuation (`continuation_len × hidden_size` numbers a window): a window's
            teacher runs the whole target the first time and the LM head alone after that, the same log-probabilities
            (checked on a window first; half of a step's time at Qwen3-0.6B → 1.7B is the teacher). Windows beyond
            the budget are recomputed; `0` or `None` turns it off.
        seed (`int`, *optional*, defaults to `0`): the held-out split and the window order.
        text_field (`str`, *optional*, defaults to `"text"`): the text column of JSON Lines files and datasets.
        checkpoint_dir (`str`, *optional*): checkpoint the optimiser and mapper state there at every evaluation and
            resume from it; a stopped run keeps its last checkpoint.
        progress (`bool`, *optional*, defaults to `False`): a progress bar.

    Example:

    ```python
    >>> from hf_kvbridge.settings import DistillationSettings
    >>> DistillationSettings(num_sequences=64, seq_len=256, continuation_len=64).pull
    [0.0, 1.0]
    ```
    """

    num_sequences: int = _option(256, help="calibration windows (training and held-out)")
    seq_len: int = _option(512, help="window length in tokens (context + continuation)")
    continuation_len: int = _option(128, help="tokens of each window the target scores (the rest is the context)")
    heldout_fraction: float = _option(0.1, help="share of windows held out for early stopping and the pull's strength")
    epochs: int = _option(2, help="passes over the training windows at most")
    batch_size: int = _option(8, help="windows per optimiser step")
    lr: float = _option(1e-4, help="AdamW learning rate of the standardised weight changes (cosine-annealed)")
    pull: float | list[float] = _option(
        help="strength of the L2 pull towards the closed-form weights (comma-separated: each is trained and the best "
        "on held-out windows kept)",
        default_factory=lambda: [0.0, 1.0],
    )
    nll_weight: float = _option(
        0.0, help="weight of the student's NLL of the text's own next tokens, added to the KL (0: the KL alone)"
    )
    select_by: str = _option(
        "kl", choices=SELECT_BY_CHOICES, help="the held-out score that stops a run and picks the map: kl or nll"
    )
    evals_per_epoch: int = _option(4, help="held-out evaluations (and checkpoints) per epoch")
    patience: int = _option(2, help="evaluations without a better held-out score before a run stops")
    memory: int | str | None = _option(
        None, help="memory one forward/backward may take, e.g. 2GB (batches are split to fit); default: no limit"
    )
    autocast: str = _option("auto", choices=AUTOCAST_CHOICES, help="bfloat16 autocast of the forwards (auto: CUDA)")
    teacher_cache: int | str | None = _option(
        "4GB",
        help="host memory for the teacher's last hidden states, so each window's teacher runs the whole target once "
        "(0: no cache)",
    )
    seed: int = _option(0, help="seed of the held-out split and the window order")
    text_field: str = _option("text", help="JSON/dataset field holding the text")
    checkpoint_dir: str | os.PathLike | None = _option(
        None, help="checkpoint the training state here and resume from it (kvbridge distill: OUT/distill-checkpoint)"
    )
    progress: bool = _option(False, help="a progress bar (the command line always shows it)", cli=False)

    def __post_init__(self):
        if isinstance(self.pull, (int, float)) and not isinstance(self.pull, bool):
            self.pull = [float(self.pull)]
        super().__post_init__()

    @classmethod
    def check_values(cls, values: dict[str, Any]) -> None:
        """Raises `ConfigurationError` for the first bad value among `values` (standard library only)."""
        _check_distillation_values({**cls.defaults(), "pull": [0.0, 1.0], **values})

    def validate(self) -> None:
        """Raises `ConfigurationError` naming the first bad setting and what is allowed."""
        _check_distillation_values(self.values())

    def teacher_cache_bytes(self) -> int:
        """`teacher_cache` in bytes; 0 when it is off (`0`, `"0"` or `None`)."""
        return _teacher_cache_bytes(self.teacher_cache)


def _teacher_cache_bytes(value: Any) -> int:
    return 0 if value in (None, 0, "0") else parse_bytes(value, "teacher_cache")


def _check_distillation_values(s: dict[str, Any]) -> None:
    """The per-value checks of `DistillationSettings` (standard library only)."""
    for name in ("num_sequences", "seq_len", "continuation_len", "epochs", "batch_size", "evals_per_epoch"):
        value = s[name]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigurationError(f"{name} must be a positive integer, got {value!r}")
    if s["continuation_len"] >= s["seq_len"]:
        raise ConfigurationError(
            f"continuation_len ({s['continuation_len']}) must be shorter than seq_len ({s['seq_len']}): the rest of "
            "each window is the context the source prefills"
        )
    patience = s["patience"]
    if not isinstance(patience, int) or isinstance(patience, bool) or patience < 0:
        raise ConfigurationError(f"patience must be an integer ≥ 0, got {patience!r}")
    fraction = s["heldout_fraction"]
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        raise ConfigurationError(f"heldout_fraction must lie strictly between 0 and 1, got {fraction!r}")
    lr = s["lr"]
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
        raise ConfigurationError(f"lr must be a number > 0, got {lr!r}")
    pulls = s["pull"] if isinstance(s["pull"], (list, tuple)) else [s["pull"]]
    if not pulls or any(isinstance(p, bool) or not isinstance(p, (int, float)) or not p >= 0 for p in pulls):
        raise ConfigurationError(f"pull must be a number ≥ 0 or a non-empty list of them, got {s['pull']!r}")
    if s["autocast"] not in AUTOCAST_CHOICES:
        raise ConfigurationError(f"autocast must be one of {AUTOCAST_CHOICES}, got {s['autocast']!r}")
    weight = s["nll_weight"]
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight >= 0:
        raise ConfigurationError(f"nll_weight must be a number ≥ 0, got {weight!r}")
    if s["select_by"] not in SELECT_BY_CHOICES:
        raise ConfigurationError(f"select_by must be one of {SELECT_BY_CHOICES}, got {s['select_by']!r}")
    if (weight > 0 or s["select_by"] == "nll") and s["continuation_len"] < 2:
        raise ConfigurationError(
            "continuation_len must be at least 2 with nll_weight > 0 or select_by='nll': the NLL scores each "
            "continuation token's next token within the window"
        )
    if s["memory"] is not None:
        parse_bytes(s["memory"], "memory")
    _teacher_cache_bytes(s["teacher_cache"])


def check_recompute_layers(n: Any, target_layers: int | None = None, calibrated: list[int] | None = None) -> int:
    """The one check of a `recompute_layers` value (the config, the bridge, a calibration's request, the residual
    map asked for): refuses one that is not an integer in `0 … target_layers` (when the target's layer count is
    known) or that lies between the two ends without a residual map calibrated for it (naming the calibrated ones;
    `calibrated=None`: no residual maps to hold it against, as when a calibration asks for them).

    Example:

    ```python
    >>> check_recompute_layers(2, 8, calibrated=[1, 2])
    2
    ```
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ConfigurationError(f"recompute_layers must be an integer ≥ 0 (top target layers), got {n!r}")
    if target_layers is None or n == 0:
        return n
    if n > target_layers:
        raise ConfigurationError(
            f"recompute_layers={n} exceeds the target's {target_layers} layers; use a value in 0…{target_layers}"
        )
    if calibrated is not None and n < target_layers and n not in calibrated:
        raise ConfigurationError(
            f"recompute_layers={n} needs a residual map calibrated for it; this bridge has "
            + (f"residual maps for recompute_layers {calibrated}" if calibrated else "none")
            + f": use one of {[0, *calibrated, target_layers]}, or calibrate with recompute_layers={n}"
        )
    return n


def recompute_layer_values(value: Any, target_layers: int | None = None) -> list[int]:
    """The residual maps a calibration fits for `recompute_layers` (one value or a list, each checked by
    `check_recompute_layers`): sorted, unique, without `0` (the plain bridge) and without `target_layers` (which
    starts from the target's own embeddings).

    Example:

    ```python
    >>> recompute_layer_values([2, 0, 1, 2, 8], target_layers=8)
    [1, 2]
    ```
    """
    values = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(values, (list, tuple)):
        raise ConfigurationError(
            f"recompute_layers must be an integer ≥ 0 or a list of them (top target layers), got {value!r}"
        )
    return sorted({n for n in values if check_recompute_layers(n, target_layers) > 0 and n != target_layers})
