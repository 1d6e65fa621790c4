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

__version__ = "0.1.0"

from transformers import AutoConfig, AutoModelForCausalLM

from .calibration import calibrate, collect_statistics, fit_bridge
from .configuration import KVBridgeConfig
from .data import CalibrationDataError
from .layout import KVLayout, KVLayoutError
from .mappers import KVMapper
from .modeling import KVBridgeForCausalLM, MapperFileError
from .statistics import KVStatistics, StatisticsError

AutoConfig.register("kvbridge", KVBridgeConfig, exist_ok=True)
AutoModelForCausalLM.register(KVBridgeConfig, KVBridgeForCausalLM, exist_ok=True)

try:  # registers the "kvbridge" model with lm-eval, so simple_evaluate(model="kvbridge") works after import
    from .integrations import lm_eval  # noqa: F401
except ImportError:  # pragma: no cover - lm-eval is a dependency; never block the bridge on it
    pass

__all__ = [
    "CalibrationDataError",
    "KVBridgeConfig",
    "KVBridgeForCausalLM",
    "KVLayout",
    "KVLayoutError",
    "KVMapper",
    "KVStatistics",
    "MapperFileError",
    "StatisticsError",
    "calibrate",
    "collect_statistics",
    "fit_bridge",
]
