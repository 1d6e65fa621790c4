"""The dense fit: layer selection, λ and the ridge mapper from statistics of every layer pair, and the config that
records them ([`BridgeFit`]). The fitting side below `calibrate` returns fits, never bridges: `calibrate` (and
`fit_bridge` beside it) builds the [`KVBridgeForCausalLM`] from one, so nothing here imports the bridge class."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, replace

import torch
from transformers import PreTrainedModel

from ...configuration import KVBridgeConfig
from ...constants import HEAD_MODES
from ...errors import ConfigurationError, moved_names
from ...mappers import KVMapper
from ...mappers.residual import ResidualMapper
from ...utils.source_features import SourceFeatures, check_feature_modes, source_blocks
from ..layer_selection import mapper_r2, select_layers, single_layer_r2
from ..solve import LAMBDA_GRID, choose_ridge_lambdas
from ..statistics.dense import KVStatistics
from .checks import allowed_blocks, check_tokens, features_per_layer, pair_layouts

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BridgeFit:
    """What a fit returns: the bridge's parts before the bridge is built (`build`, which `calibrate` calls with the
    bridge class).

    Args:
        mapper ([`KVMapper`]): the fitted mapper.
        config ([`KVBridgeConfig`]): the config recording the fit (selection, λ, held-out R², references).
        layer_r2 (`torch.Tensor` of shape `(L_t, L_s, 2)`): the full single-layer R² matrix, for diagnostics.
        residual_mapper ([`ResidualMapper`], *optional*): the residual maps of layer recompute (`config.residual_map`
            records them).

    Example:

    ```python
    >>> fit = fit_dense(source, target, train, heldout, top_k=2)  # doctest: +SKIP
    >>> fit.config.selected_layers  # doctest: +SKIP
    ```
    """

    mapper: KVMapper
    config: KVBridgeConfig
    layer_r2: torch.Tensor
    residual_mapper: ResidualMapper | None = None

    def build(self, bridge_class: type, source: PreTrainedModel, target: PreTrainedModel, residual_mapper=None):
        """The bridge of this fit over `source` and `target`: `bridge_class` (`KVBridgeForCausalLM`, handed in by
        the caller above) with this fit's single-layer R² matrix kept as `layer_r2`; `residual_mapper` replaces the
        fit's own residual maps (a tuning candidate takes its base bridge's)."""
        residual_mapper = residual_mapper if residual_mapper is not None else self.residual_mapper
        bridge = bridge_class(self.config, source, target, self.mapper, residual_mapper)
        bridge.layer_r2 = self.layer_r2  # the full single-layer R² matrix, for diagnostics and plots
        return bridge

    def with_residual(self, fitted: tuple) -> BridgeFit:
        """This fit with the residual map `fitted` (`fit_residual_map`'s `(mapper, summary)`), recorded in its config
        (`residual_map`)."""
        mapper, summary = fitted
        config = copy.deepcopy(self.config)
        config.residual_map = summary
        logger.info(
            "residual maps for recompute_layers %s: held-out R² %s", summary["recompute_layers"], summary["heldout_r2"]
        )
        return replace(self, config=config, residual_mapper=mapper)


def fit_dense(
    source: PreTrainedModel,
    target: PreTrainedModel,
    train: KVStatistics,
    heldout: KVStatistics,
    *,
    top_k: int | None = 6,
    ridge_lambda: float | str = "auto",
    head_mode: str = "all_heads",
    hold_back: int = 1,
    selected_layers: list[list[int]] | None = None,
    config_kwargs: dict | None = None,
    kv_mode: str = "joint",
    features: SourceFeatures | None = None,
    layouts: tuple | None = None,
) -> BridgeFit:
    """Selects layers (held-out single-layer R²), fits the ridge mapper on all statistics and records the fit
    (`calibrate.fit_bridge` builds the bridge of it).

    Args:
        ridge_lambda (`float` or `"auto"`, *optional*, defaults to `"auto"`): relative ridge strength; `"auto"`
            chooses it per target layer, head group and K/V by held-out R² over `hf_kvbridge.fitting.solve.LAMBDA_GRID`
            (fit on `train`, scored on `heldout`, refitted on both; stored in `config.ridge_lambdas`).
        selected_layers (`list[list[int]]`, *optional*): force these source layers (per target layer, in order)
            instead of selecting them.
        config_kwargs (`dict`, *optional*): extra [`KVBridgeConfig`] fields (references, provenance).
        kv_mode (`str`, *optional*, defaults to `"joint"`): or `"separate"` (keys from keys, values from values).
        features ([`SourceFeatures`], *optional*): the hidden-state feature blocks the statistics hold after the K/V
            blocks (`collect_statistics(features=...)`); selection ranks them with the K/V blocks. Without it, a
            map of statistics that hold such blocks reads the K/V blocks only.
        layouts (`tuple[KVLayout, KVLayout]`, *optional*): the two models' layouts, checked already
            (`checks.pair_layouts`); checked here otherwise.
    """
    if head_mode not in HEAD_MODES:
        raise ConfigurationError(f"head_mode must be one of {HEAD_MODES}, got {head_mode!r}")
    src, tgt = layouts or pair_layouts(source, target)
    if features is not None:
        check_feature_modes(head_mode, kv_mode)
    blocks = source_blocks(features, src.num_layers)
    k = max(map(len, selected_layers)) if selected_layers else min(top_k or blocks, blocks)
    inputs = k * features_per_layer(src, tgt, head_mode, kv_mode)
    check_tokens(train.count, inputs, ridge_lambda)
    r2 = single_layer_r2(train, heldout, head_mode, ridge_lambda)  # (L_t, blocks held, 2)
    if selected_layers is None:
        # without `features`, hidden-state blocks the statistics hold are never selected (`kvbridge tune`'s K/V-only
        # configurations)
        selected_layers = select_layers(r2, top_k, allowed_blocks(src, tgt, features, held=r2.shape[1]))
    elif len(selected_layers) != tgt.num_layers:
        raise ConfigurationError(
            f"selected_layers has {len(selected_layers)} entries, target has {tgt.num_layers} layers; give one list "
            "of source layers per target layer"
        )
    ridge_lambdas = None
    if ridge_lambda == "auto":
        ridge_lambdas, fitted_r2 = choose_ridge_lambdas(
            train, heldout, selected_layers, head_mode, tgt.num_kv_heads, tgt.head_dim, LAMBDA_GRID, kv_mode=kv_mode
        )  # fitted_r2: (L_t, 2), the held-out R² of the maps as kv_mode fits them
    else:
        fitted_r2 = mapper_r2(train, heldout, selected_layers, head_mode, ridge_lambda, kv_mode=kv_mode)  # (L_t, 2)
    mapper = KVMapper.from_statistics(
        train + heldout, selected_layers, head_mode, ridge_lambdas or ridge_lambda, kv_mode=kv_mode
    )
    fit = (top_k, ridge_lambda, ridge_lambdas, head_mode, hold_back)
    return bridge_fit(source, target, mapper, r2, fitted_r2, fit, config_kwargs, (src, tgt), features)


def bridge_fit(
    source, target, mapper, r2, fitted_r2, fit: tuple, config_kwargs=None, layouts=None, features=None
) -> BridgeFit:
    """The [`BridgeFit`] of a fitted `mapper`, with its selection R² `r2` `(L_t, L_s, 2)` and held-out R² `fitted_r2`
    `(L_t, 2)` recorded in the config.

    Args:
        fit (`tuple`): `(top_k, ridge_lambda, ridge_lambdas, head_mode, hold_back)` of the fit.
        config_kwargs (`dict`, *optional*): more [`KVBridgeConfig`] fields (references, provenance).
        layouts (`tuple[KVLayout, KVLayout]`, *optional*): the two models' layouts, checked already.
        features ([`SourceFeatures`], *optional*): the hidden-state feature blocks the mapper reads (recorded).
    """
    top_k, ridge_lambda, ridge_lambdas, head_mode, hold_back = fit
    if features is not None:
        config_kwargs = {**(config_kwargs or {}), "source_features": features.as_dict()}
    src, tgt = layouts or pair_layouts(source, target)
    selected_layers = mapper.selected_layers
    config = KVBridgeConfig(
        source_fingerprint=src.fingerprint(),
        target_fingerprint=tgt.fingerprint(),
        top_k=top_k,
        ridge_lambda=ridge_lambda,
        ridge_lambdas=ridge_lambdas,
        head_mode=head_mode,
        kv_mode=mapper.kv_mode,
        selected_layers=selected_layers,
        selected_layer_r2=[
            [round(float(r2[t, s].mean()), 6) for s in layers] for t, layers in enumerate(selected_layers)
        ],
        heldout_r2={
            "k": [round(float(v), 6) for v in fitted_r2[:, 0]],
            "v": [round(float(v), 6) for v in fitted_r2[:, 1]],
        },
        hold_back=hold_back,
        **(config_kwargs or {}),
    )
    return BridgeFit(mapper, config, r2)


# the functions that build a bridge moved up to `calibrate` (the fitting side below it returns fits)
__getattr__ = moved_names(__name__, ("fit_bridge", "assemble_bridge"), "hf_kvbridge.fitting.calibration.calibrate")
