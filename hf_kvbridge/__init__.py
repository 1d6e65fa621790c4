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
import sys

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
    "calibrate": "calibration.calibrate",
    "distill": "calibration.distill",
    "collect_statistics": "calibration.data_pass",
    "fit_bridge": "calibration.dense_fit",
    "KVBridgeForCausalLM": "modeling",
    "KVLayout": "layout",
    "KVMapper": "mappers",
    "KVStatistics": "statistics.dense",
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


AutoConfig.register("kvbridge", KVBridgeConfig, exist_ok=True)
if "hf_kvbridge.modeling" not in sys.modules:
    AutoModelForCausalLM.register(KVBridgeConfig, _BridgeClassOnFirstUse(), exist_ok=True)

__all__ = sorted(
    [*errors.__all__, "CalibrationSettings", "DistillationSettings", "KVBridgeConfig", "__version__", *_LAZY]
)
