"""`mapper_type="ridge_attention_weighted"`: a plain linear [`KVMapper`] (the ridge's weights layout), fitted with a
per-token weight, the attention mass the token receives in the target. Serving maps it exactly as a ridge mapper;
the weighted fit is `hf_kvbridge.fitting.mapper_fits.weighted.fit_attention_weighted` (the fitting side)."""

from __future__ import annotations

from ..errors import moved_names
from .base import KVMapper, MapperType

MAPPER = MapperType(
    "ridge_attention_weighted",
    KVMapper,
    fit=None,  # hf_kvbridge.fitting.mapper_fits.weighted.fit_attention_weighted
    linear=True,
    description="ridge refitted with the target's attention mass as token weights",
)


__getattr__ = moved_names(
    __name__, ("attention_mass", "fit_attention_weighted"), "hf_kvbridge.fitting.mapper_fits.weighted"
)
