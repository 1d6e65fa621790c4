"""`calibrate`: text → token windows → source/target KV → statistics → layer selection → ridge fit → bridge."""

from __future__ import annotations

import datetime
import logging
import time
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from . import __version__
from .cache import cache_layer_kv, kv_to_rows
from .configuration import KVBridgeConfig
from .constants import DEFAULT_CALIBRATION_DATA, HEAD_MODES
from .data import describe_data, token_windows
from .layout import KVLayoutError, check_matched
from .mappers import KVMapper
from .modeling import KVBridgeForCausalLM, model_reference, resolve_model_reference
from .rope import rotary_cos_sin, strip_rotary
from .selection import mapper_r2, select_layers, single_layer_r2
from .statistics import KVStatistics, StatisticsError

logger = logging.getLogger(__name__)


def _load(
    model: PreTrainedModel | str, revision: str | None, **load_kwargs: Any
) -> tuple[PreTrainedModel, str | None]:
    if isinstance(model, PreTrainedModel):
        return model.eval(), revision or getattr(model.config, "_commit_hash", None)
    loaded = AutoModelForCausalLM.from_pretrained(resolve_model_reference(model), revision=revision, **load_kwargs)
    loaded.config.name_or_path = model
    return loaded.eval(), revision or getattr(loaded.config, "_commit_hash", None)


def _shared_tokenizer(source: PreTrainedModel, target: PreTrainedModel):
    """The tokenizer of the source, after checking that the target's (when it has one) is the same."""
    source_name = source.config.name_or_path
    try:
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_reference(source_name))
    except Exception as err:
        raise ValueError(f"could not load a tokenizer for source {source_name!r}; pass tokenizer=") from err
    try:
        target_tokenizer = AutoTokenizer.from_pretrained(resolve_model_reference(target.config.name_or_path))
    except Exception:  # a target without tokenizer files: the vocab-size check is all we can do
        logger.warning("no tokenizer found for target %r; assuming it shares the source's", target.config.name_or_path)
        return tokenizer
    if tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise KVLayoutError(
            f"source {source_name!r} and target {target.config.name_or_path!r} use different tokenizers; the bridge "
            "needs one shared tokenizer"
        )
    return tokenizer


@torch.no_grad()
def cache_rows(model: PreTrainedModel, input_ids: torch.Tensor) -> torch.Tensor:
    """Runs `model` on unpadded windows and returns its cache as content-space rows.

    Returns:
        `torch.Tensor` of shape `(batch·seq, layers·H·2d)`, float32: per layer and head, key (RoPE stripped), value.
    """
    input_ids = input_ids.to(model.device)
    out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1)
    batch, seq = input_ids.shape
    positions = torch.arange(seq, device=input_ids.device).unsqueeze(0).expand(batch, -1)
    cos, sin = rotary_cos_sin(model, positions)  # (B, T, d)
    rows = []
    for layer in range(len(out.cache.layers)):
        keys, values = cache_layer_kv(out.cache, layer)  # (B, H, T, d)
        rows.append(kv_to_rows(strip_rotary(keys.float(), cos.to(keys.device), sin.to(keys.device)), values.float()))
    return torch.cat(rows, dim=-1).view(batch * seq, -1)  # (B·T, L·H·2d)


def split_heldout(num_sequences: int, heldout_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Splits window indices into train and held-out *by sequence* (seeded)."""
    if num_sequences < 2:
        raise ValueError(f"need at least 2 calibration sequences (one held out for R²), got {num_sequences}")
    if not 0 < heldout_fraction < 1:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    num_heldout = min(num_sequences - 1, max(1, round(num_sequences * heldout_fraction)))
    order = torch.randperm(num_sequences, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(order[num_heldout:]), sorted(order[:num_heldout])


def collect_statistics(
    source: PreTrainedModel,
    target: PreTrainedModel,
    windows: torch.Tensor,
    *,
    heldout: list[int] | None = None,
    batch_size: int = 8,
    statistics_device: torch.device | str | None = None,
    progress: bool = False,
) -> tuple[KVStatistics, KVStatistics]:
    """One pass of both models over `windows`, accumulating train and held-out statistics.

    Args:
        windows (`torch.LongTensor` of shape `(num_sequences, seq_len)`).
        heldout (`list[int]`, *optional*): indices of the held-out windows.

    Returns:
        `(train, heldout)` [`KVStatistics`].
    """
    src, tgt = check_matched(source.config, target.config, source.config.name_or_path, target.config.name_or_path)
    heldout_set = set(heldout or [])
    shape = (src.num_layers, tgt.num_layers, src.num_kv_heads, src.head_dim)
    train_stats, heldout_stats = (
        KVStatistics(*shape, device=statistics_device),
        KVStatistics(*shape, device=statistics_device),
    )
    groups = [
        (train_stats, [i for i in range(len(windows)) if i not in heldout_set]),
        (heldout_stats, sorted(heldout_set)),
    ]
    total = sum((len(ids) + batch_size - 1) // batch_size for _, ids in groups)
    with tqdm(total=total, desc="calibrating", unit="batch", disable=not progress) as bar:
        for stats, ids in groups:
            for start in range(0, len(ids), batch_size):
                batch = windows[ids[start : start + batch_size]]
                stats.update(cache_rows(source, batch), cache_rows(target, batch))
                bar.update(1)
    train_stats.check_finite("train statistics")
    heldout_stats.check_finite("held-out statistics")
    return train_stats, heldout_stats


def fit_bridge(
    source: PreTrainedModel,
    target: PreTrainedModel,
    train: KVStatistics,
    heldout: KVStatistics,
    *,
    top_k: int | None = 6,
    ridge_lambda: float = 0.01,
    head_mode: str = "all_heads",
    hold_back: int = 1,
    selected_layers: list[list[int]] | None = None,
    config_kwargs: dict | None = None,
) -> KVBridgeForCausalLM:
    """Selects layers (held-out single-layer R²), fits the ridge mapper on all statistics and builds the bridge.

    Args:
        selected_layers (`list[list[int]]`, *optional*): force these source layers (per target layer, in order)
            instead of selecting them.
        config_kwargs (`dict`, *optional*): extra [`KVBridgeConfig`] fields (references, provenance).
    """
    if head_mode not in HEAD_MODES:
        raise ValueError(f"head_mode must be one of {HEAD_MODES}, got {head_mode!r}")
    src, tgt = check_matched(source.config, target.config, source.config.name_or_path, target.config.name_or_path)
    k = max(map(len, selected_layers)) if selected_layers else min(top_k or src.num_layers, src.num_layers)
    features = k * (src.features_per_layer if head_mode == "all_heads" else 2 * src.head_dim)
    if train.count <= features:
        raise StatisticsError(
            f"fewer calibration tokens ({train.count}) than mapper input features ({features}); use more or longer "
            "calibration sequences, a smaller top_k, or head_mode='same_head'"
        )
    r2 = single_layer_r2(train, heldout, head_mode, ridge_lambda)  # (L_t, L_s, 2)
    if selected_layers is None:
        selected_layers = select_layers(r2, top_k)
    elif len(selected_layers) != tgt.num_layers:
        raise ValueError(f"selected_layers has {len(selected_layers)} entries, target has {tgt.num_layers} layers")
    fitted_r2 = mapper_r2(train, heldout, selected_layers, head_mode, ridge_lambda)  # (L_t, 2)
    mapper = KVMapper.from_statistics(train + heldout, selected_layers, head_mode, ridge_lambda)
    config = KVBridgeConfig(
        source_fingerprint=src.fingerprint(),
        target_fingerprint=tgt.fingerprint(),
        top_k=top_k,
        ridge_lambda=ridge_lambda,
        head_mode=head_mode,
        selected_layers=selected_layers,
        selected_layer_r2=[
            [round(float(r2[t, s].mean()), 6) for s in layers] for t, layers in enumerate(selected_layers)
        ],
        heldout_r2={
            "k": [round(float(v), 6) for v in fitted_r2[:, 0]],
            "v": [round(float(v), 6) for v in fitted_r2[:, 1]],
        },
        hold_back=hold_back,
        **(config_kwargs or {}),
    )
    bridge = KVBridgeForCausalLM(config, source, target, mapper)
    bridge.layer_r2 = r2  # the full single-layer R² matrix, for diagnostics and plots
    return bridge


def calibrate(
    source: PreTrainedModel | str,
    target: PreTrainedModel | str,
    data: Any = DEFAULT_CALIBRATION_DATA,
    *,
    tokenizer=None,
    num_sequences: int = 500,
    seq_len: int = 1024,
    top_k: int | None = 6,
    ridge_lambda: float = 0.01,
    head_mode: str = "all_heads",
    batch_size: int = 8,
    heldout_fraction: float = 0.1,
    hold_back: int = 1,
    seed: int = 0,
    text_field: str = "text",
    source_revision: str | None = None,
    target_revision: str | None = None,
    statistics_device: torch.device | str | None = None,
    progress: bool = False,
    **load_kwargs: Any,
) -> KVBridgeForCausalLM:
    r"""Calibrates a KV bridge from `source` to `target` on `data` and returns it.

    Args:
        source, target ([`PreTrainedModel`] or `str`): loaded models, or Hub ids / local paths to load.
        data (*optional*, defaults to `"HuggingFaceFW/fineweb-edu"`): a list of strings, a `.txt`/`.jsonl` file or
            folder, a `datasets.Dataset`, or a dataset name (streamed; `"name:config"` picks a config).
        tokenizer (*optional*): the shared tokenizer; by default the source's, checked against the target's.
        num_sequences (`int`, *optional*, defaults to `500`), seq_len (`int`, *optional*, defaults to `1024`):
            calibration windows.
        top_k (`int`, *optional*, defaults to `6`): source layers per target layer (`None`: all).
        ridge_lambda (`float`, *optional*, defaults to `0.01`): relative to each input feature's variance.
        head_mode (`str`, *optional*, defaults to `"all_heads"`): or `"same_head"` (head h from head h only).
        batch_size (`int`, *optional*, defaults to `8`): windows per forward pass.
        heldout_fraction (`float`, *optional*, defaults to `0.1`): share of windows held out for R² and layer
            selection (split by sequence).
        hold_back (`int`, *optional*, defaults to `1`): prompt tokens the target computes itself.
        load_kwargs: passed to `from_pretrained` when `source`/`target` are names (`torch_dtype`, `device_map`).

    Example:

    ```python
    >>> import hf_kvbridge
    >>> bridge = hf_kvbridge.calibrate("Qwen/Qwen3-14B", "Qwen/Qwen3-32B")  # doctest: +SKIP
    >>> bridge.save_pretrained("qwen3-14b-to-32b")  # doctest: +SKIP
    ```
    """
    started = time.perf_counter()
    source, source_revision = _load(source, source_revision, **load_kwargs)
    target, target_revision = _load(target, target_revision, **load_kwargs)
    check_matched(source.config, target.config, source.config.name_or_path, target.config.name_or_path)
    if tokenizer is None:
        tokenizer = _shared_tokenizer(source, target)
    windows = token_windows(data, tokenizer, num_sequences, seq_len, text_field=text_field)
    train_ids, heldout_ids = split_heldout(len(windows), heldout_fraction, seed)
    train, heldout = collect_statistics(
        source,
        target,
        windows,
        heldout=heldout_ids,
        batch_size=batch_size,
        statistics_device=statistics_device,
        progress=progress,
    )
    provenance = {
        "data": describe_data(data),
        "num_sequences": len(windows),
        "seq_len": seq_len,
        "heldout_sequences": len(heldout_ids),
        "tokens": int(windows.numel()),
        "seed": seed,
        "hf_kvbridge_version": __version__,
        "torch_version": torch.__version__,
        "date": datetime.date.today().isoformat(),
    }
    import transformers

    provenance["transformers_version"] = transformers.__version__
    bridge = fit_bridge(
        source,
        target,
        train,
        heldout,
        top_k=top_k,
        ridge_lambda=ridge_lambda,
        head_mode=head_mode,
        hold_back=hold_back,
        config_kwargs={
            "source_name_or_path": model_reference(source),
            "source_revision": source_revision,
            "target_name_or_path": model_reference(target),
            "target_revision": target_revision,
            "calibration": provenance,
        },
    )
    bridge.config.calibration["seconds"] = round(time.perf_counter() - started, 2)
    bridge.calibration_statistics = (train, heldout)
    logger.info(
        "calibrated %s → %s in %.1fs",
        bridge.config.source_name_or_path,
        bridge.config.target_name_or_path,
        bridge.config.calibration["seconds"],
    )
    return bridge
