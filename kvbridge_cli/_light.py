"""Reads stdlib-only modules of `hf_kvbridge` (settings, constants, errors, pocket) without importing the package.

Importing any `hf_kvbridge.x` runs `hf_kvbridge/__init__.py`, which imports torch and transformers. The command line
needs only the settings' field definitions, a few constants and the pocket family's paths to build its parser and
check arguments, so it loads those same files under a private package name whose search path is the installed
`hf_kvbridge` folder: one source of truth, no copy, and no torch until a command runs.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

_ALIAS = "kvbridge_cli._hf_kvbridge"


def core(name: str) -> types.ModuleType:
    """`hf_kvbridge.<name>` read from its file as `kvbridge_cli._hf_kvbridge.<name>` (its relative imports resolve
    to siblings loaded the same way). Only for modules that import nothing but the standard library at load time."""
    if _ALIAS not in sys.modules:
        spec = importlib.util.find_spec("hf_kvbridge")  # finds the package folder; runs none of its code
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("hf_kvbridge is not installed")
        alias = types.ModuleType(_ALIAS, "hf_kvbridge's stdlib-only modules, for the command line's parser")
        alias.__path__ = list(spec.submodule_search_locations)
        sys.modules[_ALIAS] = alias
    return importlib.import_module(f"{_ALIAS}.{name}")
