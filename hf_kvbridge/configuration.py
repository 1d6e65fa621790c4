"""`KVBridgeConfig`: which pair a mapper belongs to, how it was fitted, and how the bridge uses it."""

from __future__ import annotations

import logging
from typing import Any

from transformers import PretrainedConfig

from .constants import (
    FORMAT_VERSION,
    HEAD_MODES,
    HIDDEN_FEATURES_FORMAT_VERSION,
    KEY_NORM_FORMAT_VERSION,
    KV_FORMAT_VERSION,
    KV_MODES,
    RECOMPUTE_POLICIES,
)
from .errors import ConfigurationError
from .settings import check_recompute_layers  # noqa: F401  also read here by its old path

logger = logging.getLogger(__name__)


class KVBridgeConfig(PretrainedConfig):
    r"""Configuration of a [`KVBridgeForCausalLM`]: a source/target pair and the mapper between their KV caches.

    The checkpoint refers to both models by id and revision (it never contains their weights) and records a
    fingerprint of each model's config, checked when the models are loaded.

    Args:
        source_name_or_path (`str`): Hub id or local path of the source model (the one that prefills).
        source_revision (`str`, *optional*): revision of the source model.
        target_name_or_path (`str`): Hub id or local path of the target model (the one that decodes).
        target_revision (`str`, *optional*): revision of the target model.
        source_fingerprint (`dict`), target_fingerprint (`dict`): layers, KV heads, head dim, vocab size, rotary
            parameters and maximum positions of each model (see [`KVLayout`]).
        top_k (`int`, *optional*, defaults to `6`): number of source layers feeding each target layer.
        ridge_lambda (`float` or `str`, *optional*, defaults to `"auto"`): ridge strength, relative to each input
            feature's variance (ridge on standardized inputs), or `"auto"`: chosen per target layer by held-out R²
            (then `ridge_lambdas` holds the choices). Checkpoints from before auto-λ hold one number here.
        ridge_lambdas (`dict`, *optional*): the λ chosen per target layer, head group (one in `all_heads` mode, one
            per KV head in `same_head` mode) and K/V: `{"k": [[λ per group] per target layer], "v": [...]}`.
        head_mode (`str`, *optional*, defaults to `"all_heads"`): `"all_heads"` or `"same_head"`.
        kv_mode (`str`, *optional*, defaults to `"joint"`): `"joint"` (keys and values → keys and values) or
            `"separate"` (keys from keys, values from values). Checkpoints saved without it are `"joint"`.
        mapper_type (`str`, *optional*, defaults to `"ridge"`): kind of mapper stored in the weights file:
            `"ridge"`, `"ridge_attention_weighted"` (same linear layout, see `mappers.weighted`), `"mlp"` (a residual
            MLP on top of the ridge map, see `mappers.mlp`) or `"low_rank"` (reduced-rank ridge, see
            `mappers.low_rank`).
        mapper_kwargs (`dict`, *optional*): hyper-parameters of a non-ridge mapper (for `"mlp"`: `hidden`, `loss`,
            `epochs`, `lr`, ...; for `"low_rank"`: `rank`) and how it was fitted; `heldout_r2` is that of the ridge
            base, except for `"low_rank"`, whose own maps it measures.
        selected_layers (`list[list[int]]`): per target layer, the source layers used, best first.
        selected_layer_r2 (`list[list[float]]`, *optional*): held-out single-layer R² of those layers.
        heldout_r2 (`dict`, *optional*): held-out R² of the fitted mapper per target layer, `{"k": [...], "v": [...]}`.
        hold_back (`int`, *optional*, defaults to `1`): prompt tokens at the end of the prefix that the target
            computes itself on the mapped cache (so its first logits are its own).
        sink_tokens (`int`, *optional*, defaults to `0`): the first tokens of the prompt (where attention sinks live)
            that the target computes itself instead of receiving mapped K/V.
        gate_threshold (`float`, *optional*): enables the quality gate: when the cosine between the target's own K/V
            and the mapped K/V on the last `gate_probe_tokens` tokens of the prefix is below this, the target
            prefills the prompt itself (fallback). `None` (default): always transfer. On the pocket pairs
            (`python -m studies.gate_study`) working transfers scored ≥ 0.85 and broken mappings ≤ 0.17, while the
            score did not predict a working transfer's quality: `0.5` is a safety net against a broken mapper.
        gate_probe_tokens (`int`, *optional*, defaults to `8`): probe size of the quality gate.
        recompute_fraction (`float`, *optional*, defaults to `0.0`): share of the mapped context tokens the target
            recomputes itself over the mapped cache (`hf_kvbridge.transfer.token_recompute`).
        recompute_policy (`str`, *optional*, defaults to `"tail"`): which tokens it recomputes (`RECOMPUTE_POLICIES`).
        recompute_seed (`int`, *optional*, defaults to `0`): seed of the `"random"` policy's choice (each prefill
            draws from a generator seeded with it, so the same prompt gets the same tokens).
        recompute_layers (`int`, *optional*, defaults to `0`): layer recompute
            (`hf_kvbridge.transfer.layer_recompute`): the target computes its top `n` layers itself over the mapped
            span, from a residual stream mapped from the source's hidden states, and gets mapped K/V for its lower
            layers only (cost: `n / L_t` of its prefill). `0`: the plain bridge; the target's layer count: the target
            prefills the span itself; any other value must be one the residual map was calibrated for
            (`residual_map["recompute_layers"]`).
        residual_map (`dict`, *optional*): what the residual map (`residual.safetensors`) was calibrated for:
            `recompute_layers` (the `n` values), `selected_layers` (per `n`, the source hidden states read), their
            `selected_layer_r2`, the maps' `heldout_r2`, `ridge_lambda` / `ridge_lambdas` and both hidden sizes.
        source_features (`dict`, *optional*): the mapper's inputs beyond the source's K/V
            (`hf_kvbridge.utils.source_features`): `hidden_state_layers` (entries of the source's
            `output_hidden_states`),
            `hidden_size`, `block_width`, `pieces` (feature blocks per hidden state) and `kv_layers`; selected
            "layers" `≥ kv_layers` are hidden-state blocks. `None`: K/V only. A config with it has
            `format_version` 2, which readers of the K/V-only format 1 refuse.
        key_norm (`bool`, *optional*, defaults to `False`): mapped keys are put back on the target's key-norm sphere
            (`hf_kvbridge.utils.key_norm`; targets that normalise each key head, such as Qwen3): the mapper's weights
            file holds the target's key-norm gains (`key_norm_gain`). A config with it has `format_version` 3.
            Checkpoints saved without it are `False`.
        calibration (`dict`, *optional*): provenance: data, number of sequences, sequence length, held-out
            sequences, seed, library versions, time.
        distillation (`dict`, *optional*): how `hf_kvbridge.distill` trained the map after calibration (objective,
            windows, settings, the pull chosen, held-out KL before and after, time); `None` for a closed-form map.
        format_version (`int`): version of the checkpoint format: the oldest that reads this checkpoint (`1` for a
            K/V-only bridge, `2` with `source_features`); loading refuses a version newer than this library's.
        mapper_sha256 (`dict`, *optional*): sha256 of every mapper weight file (`{file name: hex digest}`), written
            by `save_pretrained` and verified on load.

    Example:

    ```python
    >>> config = KVBridgeConfig(source_name_or_path="Qwen/Qwen3-14B", target_name_or_path="Qwen/Qwen3-32B")
    >>> config.model_type, config.hold_back
    ('kvbridge', 1)
    ```
    """

    model_type = "kvbridge"

    source_name_or_path: str | None = None
    source_revision: str | None = None
    target_name_or_path: str | None = None
    target_revision: str | None = None
    source_fingerprint: dict | None = None
    target_fingerprint: dict | None = None
    top_k: int | None = 6
    ridge_lambda: float | str = "auto"
    ridge_lambdas: dict | None = None
    head_mode: str = "all_heads"
    kv_mode: str = "joint"
    mapper_type: str = "ridge"
    mapper_kwargs: dict | None = None
    selected_layers: list | None = None
    selected_layer_r2: list | None = None
    heldout_r2: dict | None = None
    hold_back: int = 1
    sink_tokens: int = 0
    gate_threshold: float | None = None
    gate_probe_tokens: int = 8
    recompute_fraction: float = 0.0
    recompute_policy: str = "tail"
    recompute_seed: int = 0
    recompute_layers: int = 0
    residual_map: dict | None = None
    source_features: dict | None = None
    key_norm: bool = False
    calibration: dict | None = None
    distillation: dict | None = None
    format_version: int = KV_FORMAT_VERSION
    mapper_sha256: dict | None = None

    def __post_init__(self, **kwargs: Any):
        known = {
            "torch_dtype",
            "dtype",
            "transformers_version",
            "architectures",
            "auto_map",
            "_name_or_path",
            "name_or_path",
            "model_type",
            "_commit_hash",
            "_attn_implementation_autoset",
            "return_dict",
        }
        unknown = sorted(set(kwargs) - known)
        if unknown:  # a newer version's keys: dropped with a warning, not a crash (as peft does)
            logger.warning("KVBridgeConfig: ignoring unknown keys %s (saved by a newer hf_kvbridge?)", unknown)
            for key in unknown:
                kwargs.pop(key)
        super().__post_init__(**kwargs)
        if self.head_mode not in HEAD_MODES:
            raise ConfigurationError(f"head_mode must be one of {HEAD_MODES}, got {self.head_mode!r}")
        if self.kv_mode not in KV_MODES:
            raise ConfigurationError(f"kv_mode must be one of {KV_MODES}, got {self.kv_mode!r}")
        if self.sink_tokens < 0 or self.gate_probe_tokens < 1:
            raise ConfigurationError(
                f"sink_tokens must be ≥ 0 and gate_probe_tokens ≥ 1, got sink_tokens={self.sink_tokens} and "
                f"gate_probe_tokens={self.gate_probe_tokens}"
            )
        if self.hold_back < 1:
            raise ConfigurationError(
                f"hold_back must be ≥ 1 (the target computes at least the last prompt token), got {self.hold_back}"
            )
        if not 0.0 <= self.recompute_fraction <= 1.0:
            raise ConfigurationError(f"recompute_fraction must lie in [0, 1], got {self.recompute_fraction}")
        if self.recompute_policy not in RECOMPUTE_POLICIES:
            raise ConfigurationError(
                f"recompute_policy must be one of {RECOMPUTE_POLICIES}, got {self.recompute_policy!r}"
            )
        self._check_recompute_layers()
        if self.ridge_lambda != "auto" and (
            isinstance(self.ridge_lambda, bool) or not isinstance(self.ridge_lambda, (int, float))
        ):
            raise ConfigurationError(f"ridge_lambda must be a number ≥ 0 or 'auto', got {self.ridge_lambda!r}")
        if self.ridge_lambdas is not None and set(self.ridge_lambdas) != {"k", "v"}:
            raise ConfigurationError(
                f"ridge_lambdas must be {{'k': [[...]], 'v': [[...]]}} (λ per target layer and head group), got keys "
                f"{sorted(self.ridge_lambdas)}"
            )
        if self.format_version > FORMAT_VERSION:
            raise ConfigurationError(
                f"this checkpoint has format version {self.format_version}, newer than this hf_kvbridge supports "
                f"({FORMAT_VERSION}); upgrade hf_kvbridge"
            )
        if self.source_features:  # a mapper that reads hidden states: a format K/V-only readers refuse
            missing = sorted(
                {"kv_layers", "hidden_state_layers", "hidden_size", "block_width"} - set(self.source_features)
            )
            if missing:
                raise ConfigurationError(
                    f"source_features lacks {missing}; it records kv_layers, hidden_state_layers, hidden_size and "
                    "block_width (save the bridge again with this hf_kvbridge)"
                )
            self.format_version = max(self.format_version, HIDDEN_FEATURES_FORMAT_VERSION)
        if not isinstance(self.key_norm, bool):
            raise ConfigurationError(f"key_norm must be true or false, got {self.key_norm!r}")
        if self.key_norm:  # readers of versions 1-2 would map without it
            self.format_version = max(self.format_version, KEY_NORM_FORMAT_VERSION)

    @property
    def calibrated_recompute_layers(self) -> list[int]:
        """The `recompute_layers` values the residual map was calibrated for (`residual_map`; none without one)."""
        return [int(n) for n in (self.residual_map or {}).get("recompute_layers", [])]

    def _check_recompute_layers(self) -> None:
        layers = (self.target_fingerprint or {}).get("num_layers")
        check_recompute_layers(self.recompute_layers, layers, self.calibrated_recompute_layers)
