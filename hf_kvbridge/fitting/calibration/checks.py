"""What calibration checks before any work: the shared tokenizer, the train / held-out split by sequence, the token
count against the map's inputs, and which source blocks a target layer may read."""

from __future__ import annotations

import logging

import torch
from transformers import AutoTokenizer, PreTrainedModel

from ...errors import CalibrationDataError, ConfigurationError, StatisticsError
from ...loading import resolve_model_reference
from ...utils.layout import allowed_sources, check_matched
from ...utils.source_features import SourceFeatures
from ...utils.tokenization import check_same_tokenizer

logger = logging.getLogger(__name__)


def shared_tokenizer(source: PreTrainedModel, target: PreTrainedModel):
    """The tokenizer of the source, after checking that the target's (when it has one) is the same."""
    source_name = source.config.name_or_path
    try:
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_reference(source_name))
    except Exception as err:
        raise CalibrationDataError(f"could not load a tokenizer for source {source_name!r}; pass tokenizer=") from err
    try:
        target_tokenizer = AutoTokenizer.from_pretrained(resolve_model_reference(target.config.name_or_path))
    except Exception:  # a target without tokenizer files: the vocab-size check is all we can do
        logger.warning("no tokenizer found for target %r; assuming it shares the source's", target.config.name_or_path)
        return tokenizer
    check_same_tokenizer(tokenizer, target_tokenizer, f"source {source_name}", f"target {target.config.name_or_path}")
    return tokenizer


def split_heldout(num_sequences: int, heldout_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Splits window indices into train and held-out *by sequence* (seeded)."""
    if num_sequences < 2:
        raise CalibrationDataError(
            f"need at least 2 calibration sequences (one held out for R²), got {num_sequences}; give more text"
        )
    if not 0 < heldout_fraction < 1:
        raise ConfigurationError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    num_heldout = min(num_sequences - 1, max(1, round(num_sequences * heldout_fraction)))
    order = torch.randperm(num_sequences, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(order[num_heldout:]), sorted(order[:num_heldout])


def pair_heads(src, tgt) -> tuple[int, int, dict]:
    """`(num_kv_heads, head_dim, target keywords)` of statistics and mappers from layout `src` to layout `tgt`."""
    target = {"target_kv_heads": tgt.num_kv_heads, "target_head_dim": tgt.head_dim}
    return src.num_kv_heads, src.head_dim, target


def features_per_layer(src, tgt, head_mode: str, kv_mode: str) -> int:
    """Input features one source layer gives each independent map (see [`KVMapper`]'s table of groups)."""
    heads = src.num_kv_heads if head_mode == "all_heads" else max(1, src.num_kv_heads // tgt.num_kv_heads)
    return heads * (2 if kv_mode == "joint" else 1) * src.head_dim


def check_tokens(train_tokens: int, inputs: int, ridge_lambda: float | str, warn: bool = True) -> None:
    """Refuses an unregularised fit (`ridge_lambda` 0) from no more training tokens than map inputs, where least
    squares has no unique answer; with auto-λ or any λ > 0 the ridge is well posed at any token count, so fewer tokens
    than inputs (the paper's map, `p` = 12,288 at top-6, calibrated on a few thousand tokens) is allowed with a
    warning (`warn`) that the λ chosen on the held-out data then carries the fit.

    Raises:
        `StatisticsError` if `ridge_lambda` is 0 and `train_tokens <= inputs`.
    """
    if train_tokens > inputs:
        return
    if ridge_lambda != "auto" and float(ridge_lambda) <= 0:
        raise StatisticsError(
            f"fewer calibration tokens ({train_tokens}) than mapper input features ({inputs}) for an unregularised "
            "fit (ridge_lambda=0); use ridge_lambda='auto' or a λ > 0, more or longer calibration sequences, a "
            "smaller top_k, or head_mode='same_head'"
        )
    if warn:
        logger.warning(
            "%d training tokens for maps of %d input features: the ridge (λ %s) carries the fit; more calibration "
            "tokens than input features give a better-determined map",
            train_tokens,
            inputs,
            "chosen on the held-out data" if ridge_lambda == "auto" else f"= {ridge_lambda}",
        )


def allowed_blocks(src, tgt, features: SourceFeatures | None, held: int | None = None) -> list[list[bool]]:
    """`layout.allowed_sources`, extended with the hidden-state blocks of `features` (which cover every token: always
    allowed) and with the other blocks of statistics holding `held` in all (never allowed: hidden-state blocks a
    K/V-only fit leaves out, so its map is the one K/V-only statistics give)."""
    allowed = allowed_sources(src, tgt)
    extra = 0 if features is None else features.num_blocks - src.num_layers
    spare = 0 if held is None else held - src.num_layers - extra
    return [row + [True] * extra + [False] * spare for row in allowed]


def pair_layouts(source, target):
    """The two models' [`KVLayout`]s, after checking that they can be bridged (`layout.check_matched`); the fits take
    them as `layouts=` from a caller that has checked them already."""
    return check_matched(source.config, target.config, source.config.name_or_path, target.config.name_or_path)
