"""The transfer policy: which prompt tokens the source prefills and the mapper carries over, which the target
computes itself (attention sinks, the quality gate's probe), and whether a transfer is trusted at all.

```
prompt ──source prefill──▶ source cache ──map (all but sinks and probe)──▶ target cache
       ──target runs the sinks and the probe──▶ gate: own vs mapped K/V of the probe ──▶ keep, or re-prefill
```
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from transformers import Cache, DynamicCache

from .cache import cache_kwargs, output_cache, slice_cache
from .loading import execution_device
from .recompute import choose_tokens, probe_scores, recompute_count, recompute_tokens

logger = logging.getLogger(__name__)


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-row positions of a (left-)padded batch, as `generate` computes them: `cumsum(mask) - 1`, pads at 0."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 0)


@torch.no_grad()
def probe_agreement(own: Cache, mapped: Cache, start: int, mask: torch.Tensor) -> torch.Tensor:
    """Per-row mean cosine between the target's own K/V rows of tokens `[start, start + n)` in `own` and the mapped
    ones in `mapped` (which holds only those n tokens), over layers and real (unpadded) tokens.

    Returns:
        `torch.Tensor` of shape `(batch,)`, float32, on the device of `mask`.
    """
    scores = []
    weight = mask.float()  # (B, n)
    for own_layer, mapped_layer in zip(own.layers, mapped.layers):
        n = mapped_layer.keys.shape[2]
        a = torch.cat([own_layer.keys[:, :, start : start + n], own_layer.values[:, :, start : start + n]], -1)
        b = torch.cat([mapped_layer.keys, mapped_layer.values], -1).to(a.device)  # (B, H, n, 2d)
        cos = nn.functional.cosine_similarity(a.float(), b.float(), dim=-1).mean(1).to(weight.device)  # (B, n)
        scores.append((cos * weight).sum(-1) / weight.sum(-1).clamp_min(1))  # (B,)
    return torch.stack(scores).mean(0)  # (B,)


def _replace_rows(cache: Cache, own: Cache, rows: torch.Tensor) -> None:
    """Writes rows `rows` (a `(B,)` bool mask) of every layer of `own` into `cache`, in place."""
    for layer, own_layer in zip(cache.layers, own.layers):
        index = rows.to(layer.keys.device)
        layer.keys[index] = own_layer.keys.to(layer.keys.device)
        layer.values[index] = own_layer.values.to(layer.values.device)


@torch.no_grad()
def transfer_prefill(
    bridge,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None = None,
    *,
    position_ids: torch.LongTensor | None = None,
    source_logits: bool = True,
) -> tuple[DynamicCache, Any]:
    """Builds `bridge`'s target cache for every token of `input_ids` and returns `(target cache, source outputs)`.

    Call it on the prompt without its held-back tokens. The source prefills all of `input_ids`; its KV is mapped,
    except for the first `config.sink_tokens` real tokens of each row (attention sinks), which the target computes
    itself. With a quality gate (`config.gate_threshold`), the target also computes the last
    `config.gate_probe_tokens` tokens itself and compares its own K/V there with the mapped ones (cosine, mean
    over layers and tokens), row by row: a row below the threshold drops its mapped K/V and gets the target's own
    prefill (fallback), the other rows keep theirs. When sinks and probe cover the whole prompt nothing is mapped and
    the gate has nothing to check: the decision records `gate="skipped"`.

    `position_ids` (`(batch, seq)`) are the tokens' positions for both models (default: `cumsum(mask) - 1`). With
    `source_logits=False` the source computes logits for the last position only (generation needs none).

    The decision is in `bridge.last_transfer`: `transferred` (every row kept its mapped cache), `rows_transferred`
    (per row), `scores` (per-row gate scores, or `None`), `score` (the lowest of them), `gate` (`None` without a
    gate, `"checked"` or `"skipped"`), `mapped_tokens` and `target_tokens` (per row, of the rows that transferred).
    `bridge.transfer_counts` counts rows: `{"transferred": n, "fallback": m}`.
    """
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    batch, length = input_ids.shape
    bridge.check_length(length)
    if position_ids is None:
        positions = positions_from_mask(attention_mask)
    else:
        if tuple(position_ids.shape[-1:]) != (length,):
            raise ValueError(f"position_ids cover {position_ids.shape[-1]} tokens but input_ids hold {length}")
        positions = position_ids.expand(batch, -1)
    src_device, device = execution_device(bridge.source), bridge.device
    source_out = bridge.source(
        input_ids=input_ids.to(src_device),
        attention_mask=attention_mask.to(src_device),
        position_ids=positions.to(src_device),
        use_cache=True,
        logits_to_keep=0 if source_logits else 1,
    )
    ids, mask, pos = input_ids.to(device), attention_mask.to(device), positions.to(device)

    def target_run(start: int, end: int, cache: DynamicCache | None, rows: torch.Tensor | None = None):
        pick = slice(None) if rows is None else rows
        return output_cache(
            bridge.target(
                input_ids=ids[pick, start:end],
                attention_mask=mask[pick, :end],
                position_ids=pos[pick, start:end],
                **cache_kwargs(cache),
                use_cache=True,
            )
        )

    pads = (mask.cumsum(-1) == 0).sum(-1)  # (B,) left padding of each row
    sink_end = min(length, int((pads + bridge.config.sink_tokens).max())) if bridge.config.sink_tokens else 0
    gated = bridge.config.gate_threshold is not None
    probe = min(bridge.config.gate_probe_tokens, length - sink_end) if gated else 0
    map_end = length - probe
    gate = "checked" if gated else None
    if gated and map_end <= sink_end:  # sinks and probe cover the prompt: the target computes all of it itself
        logger.info("quality gate skipped: sink and probe tokens cover the %d-token prompt, nothing is mapped", length)
        probe, map_end, gate = 0, length, "skipped"
        sink_end = length
    cache = target_run(0, sink_end, None) if sink_end > 0 else None
    if map_end > sink_end:
        piece = slice_cache(output_cache(source_out), sink_end, map_end)
        cache = bridge.map_cache(piece, pos[:, sink_end:map_end], target_cache=cache)
    recomputed = recompute_mapped(bridge, cache, ids[:, :map_end], mask[:, :map_end], pos[:, :map_end], sink_end)
    ok = torch.ones(batch, dtype=torch.bool)
    scores = None
    if probe > 0:
        cache = target_run(map_end, length, cache)  # the target's own K/V for the probe tokens
        mapped_probe = bridge.map_cache(slice_cache(output_cache(source_out), map_end, length), pos[:, map_end:])
        row_scores = probe_agreement(cache, mapped_probe, map_end, mask[:, map_end:]).cpu()  # (B,)
        ok = row_scores >= bridge.config.gate_threshold
        scores = [float(x) for x in row_scores]
        if not ok.all():
            logger.info(
                "quality gate: probe K/V cosine %s below %.4f in rows %s, the target prefills those rows itself",
                [round(x, 4) for x in scores],
                bridge.config.gate_threshold,
                (~ok).nonzero().flatten().tolist(),
            )
            if not ok.any():
                cache = target_run(0, length, None)
            else:
                _replace_rows(cache, target_run(0, length, None, rows=(~ok).to(device)), ~ok)
    transferred = bool(ok.all())
    decision = {
        "transferred": transferred,
        "rows_transferred": ok.tolist(),
        "mapped_tokens": map_end - sink_end - recomputed if ok.any() else 0,
        "target_tokens": sink_end + probe + recomputed if ok.any() else length,
        "recomputed_tokens": recomputed if ok.any() else 0,
        "score": min(scores) if scores else None,
        "scores": scores,
        "gate": gate,
    }
    bridge.last_transfer = decision
    for key, count in (("transferred", int(ok.sum())), ("fallback", int((~ok).sum()))):
        if count:
            bridge.transfer_counts[key] = bridge.transfer_counts.get(key, 0) + count
    return cache, source_out


def recompute_mapped(bridge, cache: DynamicCache | None, ids, mask, pos, first_mapped: int) -> int:
    """Selective recompute (`config.recompute_fraction` of the mapped tokens, chosen by `config.recompute_policy`)
    of the mapped columns `[first_mapped, T)` of `cache`, in place; returns the most tokens a row recomputed."""
    config = bridge.config
    count = recompute_count(config.recompute_fraction, ids.shape[1] - first_mapped)
    if count == 0 or cache is None:
        return 0
    mapped = mask.clone()
    mapped[:, :first_mapped] = 0  # sink tokens are the target's own already
    score = probe_scores(bridge.target, cache, ids, pos) if "probe" in config.recompute_policy else None
    generator = torch.Generator().manual_seed(config.recompute_seed)
    chosen = choose_tokens(config.recompute_policy, count, mapped, score=score, generator=generator)
    recompute_tokens(bridge.target, cache, ids, mask, pos, chosen)
    return int(chosen.sum(-1).max())
