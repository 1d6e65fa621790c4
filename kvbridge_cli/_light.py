"""Reads stdlib-only modules of `hf_kvbridge` (settings, constants, errors, pocket, the tools' defaults) without
importing the package.

Importing any `hf_kvbridge.x` runs `hf_kvbridge/__init__.py`, which imports torch and transformers. The command line
needs only the settings' field definitions, a few constants and defaults, and the pocket family's paths to build its
parser and check arguments, so it loads those same files under a private package name whose search path is the
installed `hf_kvbridge` folder: one source of truth, no copy, and no torch until a command runs. The packages on the
way to a module (`tools`, `tools.tune` for `tools.tune.grid`) are not run either: only their folders are searched.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types

_ALIAS = "kvbridge_cli._hf_kvbridge"


def _folder_package(name: str, folder: str) -> None:
    """A package `name` whose search path is `folder`, without running the `__init__.py` there."""
    if name not in sys.modules:
        package = types.ModuleType(name, "hf_kvbridge's stdlib-only modules, for the command line's parser")
        package.__path__ = [folder]
        sys.modules[name] = package


def core(name: str) -> types.ModuleType:
    """`hf_kvbridge.<name>` read from its file as `kvbridge_cli._hf_kvbridge.<name>` (its relative imports resolve
    to siblings loaded the same way). Only for modules that import nothing but the standard library at load time.

    Example:

    ```python
    >>> core("tools.tune.grid").DEFAULT_TOP_K  # the grid's defaults, without torch
    (2, 4)
    ```
    """
    if _ALIAS not in sys.modules:
        spec = importlib.util.find_spec("hf_kvbridge")  # finds the package folder; runs none of its code
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("hf_kvbridge is not installed")
        _folder_package(_ALIAS, list(spec.submodule_search_locations)[0])
    parts = name.split(".")
    for depth in range(1, len(parts)):  # the packages on the way: their folders, not their code
        parent = sys.modules[".".join([_ALIAS, *parts[: depth - 1]])]
        _folder_package(".".join([_ALIAS, *parts[:depth]]), os.path.join(parent.__path__[0], parts[depth - 1]))
    return importlib.import_module(f"{_ALIAS}.{name}")
