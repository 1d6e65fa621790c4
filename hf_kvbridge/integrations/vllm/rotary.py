"""The target's rotary embedding without its weights: what the worker needs of the target to rotate mapped keys."""

from __future__ import annotations

import importlib

import torch
from torch import nn

from ...errors import KVLayoutError


class RotaryOnlyTarget(nn.Module):
    """Stands in for the target model in the worker: its config, its own rotary embedding module (what the mapper
    needs to rotate mapped keys), its dtype and device, and no weights. `KVBridgeForCausalLM.map_cache` reads only
    these of the target."""

    def __init__(self, config, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.config = config
        self.model = nn.Module()
        self.model.rotary_emb = rotary_embedding_class(config)(config=config).to(device)
        self._dtype, self._device = dtype, torch.device(device)
        self.generation_config = None

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    @classmethod
    def from_reference(cls, name_or_path: str, revision: str | None, dtype: torch.dtype, device) -> RotaryOnlyTarget:
        from transformers import AutoConfig

        from ...loading import resolve_model_reference

        config = AutoConfig.from_pretrained(resolve_model_reference(name_or_path), revision=revision)
        return cls(config, dtype, device)


def rotary_embedding_class(config) -> type:
    """The transformers rotary-embedding class of `config.model_type` (e.g. `Qwen3RotaryEmbedding`)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.model_type
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    prefix = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, "").removesuffix("ForCausalLM")
    found = getattr(module, f"{prefix}RotaryEmbedding", None)
    if found is None:
        candidates = [v for k, v in vars(module).items() if k.endswith("RotaryEmbedding") and isinstance(v, type)]
        if len(candidates) != 1:
            raise KVLayoutError(
                f"cannot find the rotary embedding class of model type {model_type!r} in transformers; the connector "
                "serves targets whose modeling module defines one `*RotaryEmbedding`"
            )
        found = candidates[0]
    return found
