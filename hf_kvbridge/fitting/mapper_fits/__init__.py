"""Each mapper type's fit, the fitting side of `hf_kvbridge.mappers` (which holds only what a served bridge maps with).

| module | holds |
|---|---|
| `ridge` | `from_statistics`, `fit_targets`, `ridge_solutions`: the ridge fit, attached to `KVMapper` on import |
| `low_rank` | `fit_low_rank`, `reduce_rank`; `LowRankKVMapper.from_statistics` |
| `weighted` | `fit_attention_weighted`, `attention_mass` |
| `mlp` | `train_mlp_mapper` |

`FITS` names the fit of every shipped `mapper_type`; a registry entry of your own carries its fit itself
(`MapperType(fit=...)`), which `fit_of` prefers.

Example:

```python
>>> fit_of("low_rank").__name__
'fit_low_rank'
>>> fit_of("ridge") is None  # the ridge fit is calibrate's own
True
```
"""

from __future__ import annotations

from collections.abc import Callable

from ...mappers import get_mapper_type
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


__all__ = ["FITS", "fit_of", "from_statistics", "ridge_solutions"]
