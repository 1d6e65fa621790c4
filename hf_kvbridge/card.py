"""The README model card of a bridge checkpoint, rendered from the Jinja template in `model_cards/`."""

from __future__ import annotations

import re
from importlib import resources

from huggingface_hub import ModelCard, ModelCardData

from .configuration import KVBridgeConfig
from .constants import LIBRARY_NAME

CARD_TEMPLATE = "kvbridge.md"
CARD_TAGS = ["kv-cache", "kvbridge", "prefill-reuse"]
# the retention table sits between these markers in the card, so it survives re-rendering (`kvbridge push`)
EVAL_TABLE_START, EVAL_TABLE_END = "<!-- kvbridge-eval-table -->", "<!-- /kvbridge-eval-table -->"


def _describe_lambda(config) -> str:
    """`0.01`, or for an auto-λ bridge the range of the λ chosen per layer."""
    chosen = getattr(config, "ridge_lambdas", None)
    if not chosen:
        return str(config.ridge_lambda)
    values = [v for kv in ("k", "v") for layer in chosen[kv] for v in layer]
    return f"auto (held-out R² per target layer, K and V): {min(values):g} – {max(values):g}"


def _mean(values: list[float] | None) -> float | None:
    return sum(values) / len(values) if values else None


def read_eval_table(card_text: str) -> str | None:
    """The retention table `kvbridge eval` wrote into a card, if any (so re-rendering the card keeps it)."""
    match = re.search(re.escape(EVAL_TABLE_START) + r"\n(.*?)\n" + re.escape(EVAL_TABLE_END), card_text, re.S)
    return match.group(1).strip() if match else None


def render_model_card(
    config: KVBridgeConfig,
    repo_id: str | None = None,
    eval_table: str | None = None,
    attention_cosine: list[float] | None = None,
) -> ModelCard:
    r"""The README model card of a bridge checkpoint, from the Jinja template in `model_cards/`.

    Args:
        config ([`KVBridgeConfig`]): the bridge's config (pair, mapper settings, provenance, held-out R²).
        repo_id (`str`, *optional*): the Hub repo the card describes (used in the usage snippet).
        eval_table (`str`, *optional*): a Markdown retention table, as `kvbridge eval` prints it.
        attention_cosine (`list[float]`, *optional*): attention-output cosine per target layer
            (`hf_kvbridge.fitting.attention.attention_output_cosine`).

    Example:

    ```python
    >>> card = render_model_card(bridge.config, repo_id="me/qwen3-14b-to-32b")  # doctest: +SKIP
    >>> card.data.library_name  # doctest: +SKIP
    'hf-kvbridge'
    ```
    """
    base_models = [m for m in (config.source_name_or_path, config.target_name_or_path) if m]
    card_data = ModelCardData(
        library_name=LIBRARY_NAME,
        base_model=base_models or None,
        tags=list(CARD_TAGS),
        pipeline_tag="text-generation",
    )
    r2 = config.heldout_r2 or {}
    r2_summary = None
    if r2.get("k") and r2.get("v"):
        r2_summary = {
            "k": f"{_mean(r2['k']):.3f}",
            "v": f"{_mean(r2['v']):.3f}",
            "k_min": f"{min(r2['k']):.3f}",
            "v_min": f"{min(r2['v']):.3f}",
        }
    cosine_summary = None
    if attention_cosine:
        cosine_summary = {"mean": f"{_mean(attention_cosine):.4f}", "min": f"{min(attention_cosine):.4f}"}
    source_fp, target_fp = config.source_fingerprint or {}, config.target_fingerprint or {}
    template = resources.files("hf_kvbridge.model_cards").joinpath(CARD_TEMPLATE).read_text(encoding="utf-8")
    return ModelCard.from_template(
        card_data,
        template_str=template,
        source=config.source_name_or_path,
        target=config.target_name_or_path,
        source_revision=config.source_revision or "(default)",
        target_revision=config.target_revision or "(default)",
        source_layers=source_fp.get("num_layers", "?"),
        target_layers=target_fp.get("num_layers", "?"),
        source_kv_heads=source_fp.get("num_kv_heads", "?"),
        source_head_dim=source_fp.get("head_dim", "?"),
        kv_heads=target_fp.get("num_kv_heads", "?"),
        head_dim=target_fp.get("head_dim", "?"),
        repo_id=repo_id or "path/to/this-bridge",
        mapper_type=config.mapper_type,
        head_mode=config.head_mode,
        top_k=config.top_k,
        ridge_lambda=_describe_lambda(config),
        hold_back=config.hold_back,
        key_norm="yes" if getattr(config, "key_norm", False) else "no",
        calibration=config.calibration or {},
        r2_summary=r2_summary,
        cosine_summary=cosine_summary,
        eval_table=eval_table,
        eval_table_start=EVAL_TABLE_START,
        eval_table_end=EVAL_TABLE_END,
    )
