"""Mappers: from the selected source layers' KV rows to one target layer's KV rows.

`MAPPER_REGISTRY` maps each `mapper_type` to its [`MapperType`] (class, fit, whether it is linear). Adding a mapper
type is one new file defining `MAPPER = MapperType(...)` and one line below.
"""

from ..errors import MapperError
from . import low_rank, mlp, ridge, weighted
from .base import KVMapper, MapperType
from .low_rank import LowRankKVMapper
from .mlp import MLPKVMapper

MAPPER_REGISTRY: dict[str, MapperType] = {
    entry.name: entry
    for entry in (
        ridge.MAPPER,
        weighted.MAPPER,
        mlp.MAPPER,
        low_rank.MAPPER,
    )
}
MAPPER_TYPES = tuple(MAPPER_REGISTRY)
LINEAR_MAPPER_TYPES = tuple(name for name, entry in MAPPER_REGISTRY.items() if entry.linear)


def get_mapper_type(name: str) -> MapperType:
    """The registry entry of `mapper_type` `name`; a `MapperError` naming the known types otherwise."""
    if name not in MAPPER_REGISTRY:
        raise MapperError(
            f"unknown mapper_type {name!r}; this hf_kvbridge knows {', '.join(MAPPER_TYPES)}: use one of them, or "
            "upgrade hf_kvbridge for a checkpoint saved by a newer version"
        )
    return MAPPER_REGISTRY[name]


def build_mapper(config, layout) -> KVMapper:
    """An empty mapper of the kind `config.mapper_type` names, shaped for `config` and the target's `layout`.

    Used by `from_pretrained` before the weights are loaded into it.
    """
    return get_mapper_type(config.mapper_type).mapper_class.from_config(config, layout)


__all__ = [
    "LINEAR_MAPPER_TYPES",
    "MAPPER_REGISTRY",
    "MAPPER_TYPES",
    "KVMapper",
    "LowRankKVMapper",
    "MLPKVMapper",
    "MapperType",
    "build_mapper",
    "get_mapper_type",
]
