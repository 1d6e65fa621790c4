"""`CalibrationSettings`: every knob of `calibrate`, in one documented, validated object.

`calibrate(source, target, data, top_k=8)` keeps its simple call: keyword arguments that name a field override the
settings. Validation runs before any model is loaded or any text is read, so a bad value costs nothing.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from .budget import parse_bytes
from .constants import HEAD_MODES, KV_MODES
from .mappers import get_mapper_type


@dataclass
class CalibrationSettings:
    r"""How `calibrate` fits a bridge.

    Args:
        num_sequences (`int`, *optional*, defaults to `500`), seq_len (`int`, *optional*, defaults to `1024`):
            calibration windows of `seq_len` tokens.
        top_k (`int`, *optional*, defaults to `6`): source layers per target layer (`None`: all).
        ridge_lambda (`float` or `"auto"`, *optional*, defaults to `"auto"`): relative to each input feature's
            variance (ridge on standardised inputs; see `hf_kvbridge.solve`). `"auto"` chooses it per target layer
            (and head, in `same_head` mode, and K/V) by held-out R² over `hf_kvbridge.solve.LAMBDA_GRID`.
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
            `"512MiB"`); defaults to half the free memory of the statistics device. Dense statistics (exact, one
            pass) are used when they fit, otherwise a selection pass and as many fit passes as the budget needs (see
            `hf_kvbridge.budget`); a budget too small for one target layer is refused before any work.
        statistics_dtype (`str`, *optional*, defaults to `"float32"`): of the budgeted statistics' Gram blocks
            (`"float32"` or `"float64"`; sums are centred, so float32 stays accurate).
        keep_statistics (`bool`, *optional*, defaults to `False`): leave the statistics on the returned bridge as
            `bridge.calibration_statistics` (for studies and diagnostics; they can take gigabytes).
        progress (`bool`, *optional*, defaults to `False`): progress bars.

    Example:

    ```python
    >>> from hf_kvbridge.settings import CalibrationSettings
    >>> settings = CalibrationSettings(num_sequences=64, seq_len=256, top_k=4)
    >>> settings.replace(mapper_type="low_rank", mapper_kwargs={"rank": 32}).mapper_kwargs
    {'rank': 32}
    ```
    """

    num_sequences: int = 500
    seq_len: int = 1024
    top_k: int | None = 6
    ridge_lambda: float | str = "auto"
    head_mode: str = "all_heads"
    kv_mode: str = "joint"
    mapper_type: str = "ridge"
    mapper_kwargs: dict[str, Any] = field(default_factory=dict)
    batch_size: int = 8
    heldout_fraction: float = 0.1
    hold_back: int = 1
    seed: int = 0
    text_field: str = "text"
    bidirectional: bool = False
    checkpoint_dir: str | os.PathLike | None = None
    statistics_device: torch.device | str | None = None
    statistics_memory: int | str | None = None
    statistics_dtype: str = "float32"
    keep_statistics: bool = False
    progress: bool = False

    def __post_init__(self):
        self.validate()

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def replace(self, **changes: Any) -> CalibrationSettings:
        """A copy with `changes` applied (validated)."""
        return dataclasses.replace(self, **changes)

    def validate(self) -> None:
        """Raises `ValueError` naming the first bad setting and what is allowed."""
        for name in ("num_sequences", "seq_len", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"top_k must be a positive integer or None (all source layers), got {self.top_k!r}")
        number = isinstance(self.ridge_lambda, (int, float)) and not isinstance(self.ridge_lambda, bool)
        if self.ridge_lambda != "auto" and (not number or self.ridge_lambda < 0):
            raise ValueError(f"ridge_lambda must be 'auto' or a number ≥ 0, got {self.ridge_lambda!r}")
        if self.head_mode not in HEAD_MODES:
            raise ValueError(f"head_mode must be one of {HEAD_MODES}, got {self.head_mode!r}")
        if not 0 < self.heldout_fraction < 1:
            raise ValueError(f"heldout_fraction must lie strictly between 0 and 1, got {self.heldout_fraction!r}")
        if not isinstance(self.hold_back, int) or self.hold_back < 1:
            raise ValueError(
                f"hold_back must be an integer ≥ 1 (the target runs the last prompt token), got {self.hold_back!r}"
            )
        if self.kv_mode not in KV_MODES:
            raise ValueError(f"kv_mode must be one of {KV_MODES}, got {self.kv_mode!r}")
        if self.statistics_memory is not None:
            parse_bytes(self.statistics_memory)
        if self.statistics_dtype not in ("float32", "float64"):
            raise ValueError(f"statistics_dtype must be 'float32' or 'float64', got {self.statistics_dtype!r}")
        entry = get_mapper_type(self.mapper_type)
        unknown = sorted(set(self.mapper_kwargs or {}) - set(entry.kwargs))
        if unknown:
            raise ValueError(
                f"mapper_type {self.mapper_type!r} takes mapper_kwargs {list(entry.kwargs) or 'none'}, not {unknown}"
            )
        if self.kv_mode not in entry.kv_modes:
            raise ValueError(
                f"mapper_type {self.mapper_type!r} supports kv_mode {list(entry.kv_modes)}, not {self.kv_mode!r}"
            )
