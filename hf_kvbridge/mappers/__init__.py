"""Mappers: from the selected source layers' KV rows to one target layer's KV rows."""

from .low_rank import LowRankKVMapper
from .mlp import MLPKVMapper
from .ridge import KVMapper, solve_ridge

# mapper types stored as a plain linear `KVMapper` (same weights layout; they differ only in how W, b were fitted)
LINEAR_MAPPER_TYPES = ("ridge", "ridge_attention_weighted")
MAPPER_TYPES = (*LINEAR_MAPPER_TYPES, "mlp", "low_rank")


def build_mapper(config, layout) -> KVMapper:
    """An empty mapper of the kind `config.mapper_type` names, shaped for `config` and the target's `layout`.

    Used by `from_pretrained` before the weights are loaded into it.
    """
    args = (config.selected_layers, layout.num_kv_heads, layout.head_dim, config.head_mode)
    if config.mapper_type in LINEAR_MAPPER_TYPES:
        return KVMapper(*args)
    if config.mapper_type == "mlp":
        return MLPKVMapper(*args, hidden=(config.mapper_kwargs or {}).get("hidden", 256))
    if config.mapper_type == "low_rank":
        if "rank" not in (config.mapper_kwargs or {}):
            raise ValueError("a low_rank mapper's config lacks mapper_kwargs['rank']")
        return LowRankKVMapper(*args, rank=config.mapper_kwargs["rank"])
    raise ValueError(f"unknown mapper_type {config.mapper_type!r}; this hf_kvbridge knows {MAPPER_TYPES}")


__all__ = [
    "LINEAR_MAPPER_TYPES",
    "MAPPER_TYPES",
    "KVMapper",
    "LowRankKVMapper",
    "MLPKVMapper",
    "build_mapper",
    "solve_ridge",
]
