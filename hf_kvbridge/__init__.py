"""hf_kvbridge: share a prompt's prefill between two models of one LLM family.

A *source* model prefills the context; a closed-form mapper turns its KV cache into the cache the *target* would
have built; the target decodes from it without its own prefill.

Example:

```python
>>> import hf_kvbridge
>>> bridge = hf_kvbridge.calibrate("Qwen/Qwen3-14B", "Qwen/Qwen3-32B", texts)  # doctest: +SKIP
>>> bridge.generate(**inputs, max_new_tokens=32)  # doctest: +SKIP
```
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

from transformers import AutoConfig, AutoModelForCausalLM

from . import errors
from .configuration import KVBridgeConfig
from .errors import *  # noqa: F403  every public error, named once in `errors.__all__`
from .settings import CalibrationSettings as CalibrationSettings
from .settings import DistillationSettings as DistillationSettings
from .version import __version__ as __version__

# Names imported on first use (PEP 562 `__getattr__`), as transformers' own top level does: the bridge class and the
# calibration code need transformers' modeling stack (`PreTrainedModel`, and with it scipy and accelerate), which
# `import hf_kvbridge` for a config, a setting or an error does not. Integrations and tools are never imported here:
# lm-eval finds the model "kvbridge" after `import hf_kvbridge.integrations.lm_eval`.
_LAZY = {
    "calibrate": "fitting.calibration.calibrate",
    "distill": "fitting.calibration.distill",
    "collect_statistics": "fitting.calibration.data_pass",
    "fit_bridge": "fitting.calibration.calibrate",
    "KVBridgeForCausalLM": "modeling",
    "KVLayout": "utils.layout",
    "KVMapper": "mappers",
    "KVStatistics": "fitting.statistics.dense",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


class _BridgeClassOnFirstUse:
    """`KVBridgeForCausalLM` in `AutoModelForCausalLM`'s table until `hf_kvbridge.modeling` is imported (which
    registers the class itself): any attribute read (`from_pretrained`, `from_config`, ...) imports it and reads it
    there, so the Auto classes find the bridge after `import hf_kvbridge` without loading the modeling stack first."""

    __name__ = __qualname__ = "KVBridgeForCausalLM"
    config_class = KVBridgeConfig

    def __getattr__(self, name: str):
        return getattr(importlib.import_module("hf_kvbridge.modeling").KVBridgeForCausalLM, name)


# Modules that moved (CHANGELOG.md): the old import path imports the new module itself, one module object under both
# names (so `isinstance`, `monkeypatch` and private names behave as before), with a DeprecationWarning naming it.
MOVED_MODULES = {
    # the fitting side
    "hf_kvbridge.attention": "hf_kvbridge.fitting.attention",
    "hf_kvbridge.budget": "hf_kvbridge.fitting.budget",
    "hf_kvbridge.calibration": "hf_kvbridge.fitting.calibration",
    "hf_kvbridge.content_rows": "hf_kvbridge.fitting.content_rows",
    "hf_kvbridge.data": "hf_kvbridge.fitting.data",
    "hf_kvbridge.ridge_path": "hf_kvbridge.fitting.ridge_path",
    "hf_kvbridge.selection": "hf_kvbridge.fitting.layer_selection",
    "hf_kvbridge.solve": "hf_kvbridge.fitting.solve",
    "hf_kvbridge.statistics": "hf_kvbridge.fitting.statistics",
    # the runtime helpers
    "hf_kvbridge.cache": "hf_kvbridge.utils.cache",
    "hf_kvbridge.devices": "hf_kvbridge.utils.devices",
    "hf_kvbridge.heads": "hf_kvbridge.utils.heads",
    "hf_kvbridge.layout": "hf_kvbridge.utils.layout",
    "hf_kvbridge.masks": "hf_kvbridge.utils.masks",
    "hf_kvbridge.precision": "hf_kvbridge.utils.precision",
    "hf_kvbridge.rope": "hf_kvbridge.utils.rope",
    "hf_kvbridge.rope_triton": "hf_kvbridge.utils.rope_triton",
    "hf_kvbridge.sizes": "hf_kvbridge.utils.sizes",
    "hf_kvbridge.source_features": "hf_kvbridge.utils.source_features",
    "hf_kvbridge.tokenization": "hf_kvbridge.utils.tokenization",
    # one name per concept: the mapping engine's steps beside the transfer's
    "hf_kvbridge.mappers.steps": "hf_kvbridge.mappers.engine_steps",
}


def moved_module(name: str) -> str | None:
    """The new name of module `name` if it (or a package above it) moved, else `None`.

    Example:

    ```python
    >>> moved_module("hf_kvbridge.calibration.refit")
    'hf_kvbridge.fitting.calibration.refit'
    ```
    """
    for old, new in MOVED_MODULES.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old) :]
    return None


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old import paths of `MOVED_MODULES` and loads them as their new module (the import system keeps the
    module an `exec_module` leaves in `sys.modules`)."""

    def find_spec(self, name, path=None, target=None):
        if not name.startswith("hf_kvbridge."):  # first on sys.meta_path: every other import passes here
            return None
        return importlib.util.spec_from_loader(name, self) if moved_module(name) else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        new = moved_module(module.__name__)
        warnings.warn(f"{module.__name__} moved to {new}", DeprecationWarning, stacklevel=2)
        sys.modules[module.__name__] = importlib.import_module(new)


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())

AutoConfig.register("kvbridge", KVBridgeConfig, exist_ok=True)
if "hf_kvbridge.modeling" not in sys.modules:
    AutoModelForCausalLM.register(KVBridgeConfig, _BridgeClassOnFirstUse(), exist_ok=True)

__all__ = sorted(
    [*errors.__all__, "CalibrationSettings", "DistillationSettings", "KVBridgeConfig", "__version__", *_LAZY]
)
