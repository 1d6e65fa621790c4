"""Mappers: from the selected source layers' KV rows to one target layer's KV rows.

`MAPPER_REGISTRY` maps each `mapper_type` to its [`MapperType`] (class, whether it is linear; the fits are the
fitting side's, `hf_kvbridge.fitting.mapper_fits`). Adding a mapper
type is one new file defining `MAPPER = MapperType(...)` and one line in `_TYPE_MODULES` below. A type's module is
imported when its entry is first read (as lm-eval's model table and transformers' auto classes load theirs), so
loading a ridge bridge does not import the MLP's module.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, MutableMapping

from ..errors import unknown_mapper_type
from .base import KVMapper, MapperType

# mapper_type → the module of this package that defines its `MAPPER`
_TYPE_MODULES = {
    "ridge": "ridge",
    "ridge_attention_weighted": "weighted",
    "mlp": "mlp",
    "low_rank": "low_rank",
}


class MapperRegistry(MutableMapping):
    """`{mapper_type: MapperType}`, each entry read from its module on first use; an entry set here (a mapper type of
    your own, or a test's stand-in) replaces it.

    Example:

    ```python
    >>> MAPPER_REGISTRY["low_rank"].mapper_class.__name__
    'LowRankKVMapper'
    ```
    """

    def __init__(self, modules: dict[str, str]):
        self._modules: dict[str, str | None] = dict(modules)
        self._entries: dict[str, MapperType] = {}

    def __getitem__(self, name: str) -> MapperType:
        if name not in self._entries:
            module = self._modules[name]  # KeyError for an unknown type
            self._entries[name] = importlib.import_module(f"{__name__}.{module}").MAPPER
        return self._entries[name]

    def __setitem__(self, name: str, entry: MapperType) -> None:
        self._modules.setdefault(name, None)
        self._entries[name] = entry

    def __delitem__(self, name: str) -> None:
        del self._modules[name]
        self._entries.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        return iter(self._modules)

    def __len__(self) -> int:
        return len(self._modules)


MAPPER_REGISTRY = MapperRegistry(_TYPE_MODULES)
MAPPER_TYPES = tuple(_TYPE_MODULES)


def get_mapper_type(name: str) -> MapperType:
    """The registry entry of `mapper_type` `name`; a `MapperError` naming the known types otherwise."""
    if name not in MAPPER_REGISTRY:
        raise unknown_mapper_type(name, MAPPER_REGISTRY)
    return MAPPER_REGISTRY[name]


def build_mapper(config, layout) -> KVMapper:
    """An empty mapper of the kind `config.mapper_type` names, shaped for `config` and the target's `layout`.

    Used by `from_pretrained` before the weights are loaded into it.
    """
    return get_mapper_type(config.mapper_type).mapper_class.from_config(config, layout)


_CLASSES = {"LowRankKVMapper": "low_rank", "MLPKVMapper": "mlp"}


def __getattr__(name: str):
    """The mapper classes of the registry's modules and `LINEAR_MAPPER_TYPES`, read on first use."""
    if name in _CLASSES:
        return MAPPER_REGISTRY[_CLASSES[name]].mapper_class
    if name == "LINEAR_MAPPER_TYPES":
        return tuple(kind for kind, entry in MAPPER_REGISTRY.items() if entry.linear)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "LINEAR_MAPPER_TYPES",
    "MAPPER_REGISTRY",
    "MAPPER_TYPES",
    "KVMapper",
    "LowRankKVMapper",
    "MLPKVMapper",
    "MapperRegistry",
    "MapperType",
    "build_mapper",
    "get_mapper_type",
]
