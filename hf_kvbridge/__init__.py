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

import importlib.util

from transformers import AutoConfig, AutoModelForCausalLM

from .calibration import calibrate, collect_statistics, fit_bridge
from .configuration import KVBridgeConfig
from .errors import (
    CalibrationDataError,
    CheckpointExistsError,
    CheckpointFileError,
    CheckpointNotFoundError,
    ConfigurationError,
    ContextLengthError,
    EvaluationError,
    InvalidInputError,
    KVBridgeError,
    KVLayoutError,
    MapperError,
    MapperFileError,
    MissingDependencyError,
    ServingConfigError,
    StatisticsError,
    StatisticsMemoryError,
    StoreFormatError,
    StoreMissError,
    StoreUnavailableError,
    TuningError,
)
from .layout import KVLayout
from .mappers import KVMapper
from .modeling import KVBridgeForCausalLM
from .settings import CalibrationSettings
from .statistics import KVStatistics
from .version import __version__

AutoConfig.register("kvbridge", KVBridgeConfig, exist_ok=True)
AutoModelForCausalLM.register(KVBridgeConfig, KVBridgeForCausalLM, exist_ok=True)

# lm-eval finds "kvbridge" through its lazy registry: a "module:object" entry, imported only when an
# evaluation asks for it, so `simple_evaluate(model="kvbridge")` works after this import without loading the adapter.
# lm-eval's own table (`lm_eval.models`: placeholders only, ~0.1 s, no torch) goes in first: `get_model` fills it only
# while the registry is empty, so an entry of ours alone would hide "hf" and the rest.
if importlib.util.find_spec("lm_eval") is not None:
    import lm_eval.models  # noqa: F401
    from lm_eval.api.registry import model_registry

    if "kvbridge" not in model_registry.keys():
        model_registry.register("kvbridge", target="hf_kvbridge.integrations.lm_eval:KVBridgeLM")

__all__ = [
    "CalibrationDataError",
    "CalibrationSettings",
    "CheckpointExistsError",
    "CheckpointFileError",
    "CheckpointNotFoundError",
    "ConfigurationError",
    "ContextLengthError",
    "EvaluationError",
    "InvalidInputError",
    "KVBridgeConfig",
    "KVBridgeError",
    "KVBridgeForCausalLM",
    "KVLayout",
    "KVLayoutError",
    "KVMapper",
    "KVStatistics",
    "MapperError",
    "MapperFileError",
    "MissingDependencyError",
    "ServingConfigError",
    "StatisticsError",
    "StatisticsMemoryError",
    "StoreFormatError",
    "StoreMissError",
    "StoreUnavailableError",
    "TuningError",
    "__version__",
    "calibrate",
    "collect_statistics",
    "fit_bridge",
]
