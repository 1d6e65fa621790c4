"""Each mapper type's fit, the fitting side of `hf_kvbridge.mappers` (which holds only what a served bridge maps with).

| module | holds |
|---|---|
| `ridge` | `from_statistics`, `fit_targets`, `ridge_solutions`: the ridge fit, attached to `KVMapper` on import |
| `low_rank` | `fit_low_rank`, `reduce_rank`; `LowRankKVMapper.from_statistics` |
| `weighted` | `fit_attention_weighted`, `attention_mass` |
| `mlp` | `train_mlp_mapper` |

`FITS` names the fit of every shipped `mapper_type`; a registry entry of your own carries its fit itself
(`MapperType(fit=...)`), which `fit_of` prefers. `refit` runs a type's fit from a ridge bridge and hands the bridge
the new mapper (the bridge is handed in: nothing here imports the bridge class).

Example:

```python
>>> fit_of("low_rank").__name__
'fit_low_rank'
>>> fit_of("ridge") is None  # the ridge fit is calibrate's own
True
```
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from ...errors import ConfigurationError
from ...mappers import get_mapper_type
from ...utils.source_features import FEATURE_MAPPER_TYPES, SourceFeatures
from ..solve import effective_ridge_lambda
from ..statistics.dense import KVStatistics
from .low_rank import fit_low_rank
from .mlp import train_mlp_mapper
from .ridge import from_statistics, ridge_solutions
from .weighted import fit_attention_weighted

FITS: dict[str, Callable | None] = {
    "ridge": None,
    "ridge_attention_weighted": fit_attention_weighted,
    "mlp": train_mlp_mapper,
    "low_rank": fit_low_rank,
}


def fit_of(mapper_type: str) -> Callable | None:
    """The fit of `mapper_type` (`fit(ridge_mapper, *, source, target, windows, statistics, ridge_lambda, ...)`, see
    [`MapperType`]): the registry entry's own `fit` when it has one, else the shipped one; `None` for the ridge."""
    entry = get_mapper_type(mapper_type)  # a MapperError naming the known types for an unknown one
    return entry.fit if entry.fit is not None else FITS.get(mapper_type)


def refit(
    bridge,
    mapper_type: str,
    *,
    windows: torch.Tensor | None = None,
    statistics: tuple[KVStatistics, KVStatistics] | None = None,
    batch_size: int = 8,
    progress: bool = False,
    **mapper_kwargs: Any,
):
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
    features = SourceFeatures.from_config(bridge.config)
    if features is not None and entry.name not in FEATURE_MAPPER_TYPES:
        raise ConfigurationError(
            f"bridge maps from the source's hidden states (hidden_state_layers {list(features.hidden_states)}), but "
            f"mapper_type {entry.name!r} is fitted from K/V rows only; refit to one of {list(FEATURE_MAPPER_TYPES)}"
        )
    if statistics is None:
        statistics = getattr(bridge, "calibration_statistics", None)
    if features is not None:  # only the fits that read them take them (the MLP's takes no such argument)
        mapper_kwargs = {**mapper_kwargs, "features": features}
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
    if bridge.mapper.key_norm_gain is not None:  # keys put back on the target's key-norm sphere, as before the refit
        mapper.set_key_norm(bridge.mapper.key_norm_gain)
    config = copy.deepcopy(bridge.config)
    config.mapper_type = entry.name
    config.mapper_kwargs = dict(mapper.fit_summary or {})
    for key, value in (mapper.fit_config or {}).items():
        setattr(config, key, value)
    return bridge.with_mapper(mapper, config)


__all__ = ["FITS", "fit_of", "from_statistics", "refit", "ridge_solutions"]
