"""Resolving a bridge checkpoint (local folder or Hub repo) and rendering its model card."""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData, snapshot_download

from .configuration import KVBridgeConfig
from .constants import CONFIG_NAME, MAPPER_WEIGHTS_INDEX_NAME, MAPPER_WEIGHTS_NAME, MODEL_CARD_NAME

CARD_TEMPLATE = "kvbridge.md"


def resolve_checkpoint(
    name_or_path: str | os.PathLike,
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    local_files_only: bool = False,
    token: str | bool | None = None,
    force_download: bool = False,
) -> Path:
    """A local folder holding the checkpoint: `name_or_path` itself, or a snapshot from the Hub cache.

    Honours `HF_HUB_OFFLINE` (through huggingface_hub): offline, only what is already cached resolves.
    """
    path = Path(name_or_path)
    if path.is_dir():
        if not (path / CONFIG_NAME).is_file():
            raise FileNotFoundError(f"{path} has no {CONFIG_NAME}; it is not a kvbridge checkpoint")
        return path
    snapshot = snapshot_download(
        str(name_or_path),
        revision=revision,
        cache_dir=cache_dir,
        local_files_only=local_files_only,
        token=token,
        force_download=force_download,
        allow_patterns=[
            CONFIG_NAME,
            MAPPER_WEIGHTS_NAME,
            MAPPER_WEIGHTS_INDEX_NAME,
            "mapper-*.safetensors",
            MODEL_CARD_NAME,
        ],
    )
    return Path(snapshot)


def render_model_card(config: KVBridgeConfig, repo_id: str | None = None, eval_table: str | None = None) -> ModelCard:
    """The README model card of a bridge checkpoint, from the Jinja template in `model_cards/`."""
    base_models = [m for m in (config.source_name_or_path, config.target_name_or_path) if m]
    card_data = ModelCardData(
        library_name="hf-kvbridge",
        base_model=base_models or None,
        tags=["kv-cache", "kvbridge", "prefill-reuse"],
        pipeline_tag="text-generation",
    )
    r2_summary = None
    if config.heldout_r2:
        k, v = config.heldout_r2.get("k", []), config.heldout_r2.get("v", [])
        if k and v:
            r2_summary = {"k": f"{sum(k) / len(k):.3f}", "v": f"{sum(v) / len(v):.3f}"}
    template = resources.files("hf_kvbridge").joinpath("model_cards", CARD_TEMPLATE).read_text(encoding="utf-8")
    return ModelCard.from_template(
        card_data,
        template_str=template,
        source=config.source_name_or_path,
        target=config.target_name_or_path,
        source_revision=config.source_revision or "(default)",
        target_revision=config.target_revision or "(default)",
        repo_id=repo_id or "path/to/this-bridge",
        mapper_type=config.mapper_type,
        head_mode=config.head_mode,
        top_k=config.top_k,
        ridge_lambda=config.ridge_lambda,
        hold_back=config.hold_back,
        calibration=config.calibration or {},
        r2_summary=r2_summary,
        eval_table=eval_table,
    )
