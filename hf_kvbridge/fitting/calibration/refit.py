"""Old path of `refit`, which moved to `hf_kvbridge.fitting.mapper_fits` (beside `fit_of`) for one release."""

import warnings

from .. import mapper_fits


def __getattr__(name: str):
    if name != "refit":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    new = "hf_kvbridge.fitting.mapper_fits.refit"
    warnings.warn(f"{__name__}.refit moved to {new}: import it from there", DeprecationWarning, stacklevel=2)
    return mapper_fits.refit
