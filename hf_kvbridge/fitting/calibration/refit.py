"""Mappers beyond ridge, fitted from a ridge bridge (`fitting.mapper_fits.fit_of(mapper_type)`)."""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch

from ...errors import ConfigurationError
from ...mappers import get_mapper_type
from ...modeling import KVBridgeForCausalLM
from ..mapper_fits import fit_of
from ..solve import effective_ridge_lambda
from ..statistics.dense import KVStatistics

logger = logging.getLogger(__name__)


def refit(
    bridge: KVBridgeForCausalLM,
    mapper_type: str,
    *,
    windows: torch.Tensor | None = None,
    statistics: tuple[KVStatistics, KVStatistics] | None = None,
    batch_size: int = 8,
    progress: bool = False,
    **mapper_kwargs: Any,
) -> KVBridgeForCausalLM:
    """A bridge over `bridge`'s models with a mapper of type `mapper_type` fitted from `bridge`'s (ridge) mapper.

    Calls the type's fit (`fitting.mapper_fits.fit_of(mapper_type)`) with the mapper, the two models, `windows`,
    `statistics` (default: the `calibration_statistics` that `calibrate(keep_statistics=True)` leaves on the bridge),
    the λ the mapper was fitted with, and `mapper_kwargs`; the fit returns the new mapper, and the new bridge's config
    records `mapper_type`, the fit's `fit_summary` as `mapper_kwargs` and its `fit_config` fields. `bridge` itself is
    left unchanged.

    Example:

    ```python
    >>> cheap = refit(bridge, "low_rank", rank=32)  # doctest: +SKIP
    >>> mlp = refit(bridge, "mlp", windows=windows, hidden=128, epochs=1)  # doctest: +SKIP
    ```
    """
    entry, fit = get_mapper_type(mapper_type), fit_of(mapper_type)
    if fit is None:
        raise ConfigurationError(f"mapper_type {mapper_type!r} is the ridge fit itself: use fit_bridge or calibrate")
    if statistics is None:
        statistics = getattr(bridge, "calibration_statistics", None)
    mapper = fit(
        bridge.mapper,
        source=bridge.source,
        target=bridge.target,
        windows=windows,
        statistics=statistics,
        ridge_lambda=effective_ridge_lambda(bridge.config),
        batch_size=batch_size,
        progress=progress,
        **mapper_kwargs,
    )
    config = copy.deepcopy(bridge.config)
    config.mapper_type = entry.name
    config.mapper_kwargs = dict(mapper.fit_summary or {})
    for key, value in (mapper.fit_config or {}).items():
        setattr(config, key, value)
    return bridge.with_mapper(mapper, config)
