"""The fit of `mapper_type="mlp"`: a residual MLP per (target layer, head group) trained on top of the ridge map (see
`hf_kvbridge.mappers.mlp` for the map itself). Training streams the calibration windows: every batch re-runs the source
(and the target) and is dropped after its step. Two losses, `"mse"` and `"attention"` (`hf_kvbridge.mappers.mlp`)."""

from __future__ import annotations

import logging
import math
import time

import torch
from torch import nn

from ...errors import MapperError
from ...mappers.base import KVMapper
from ...mappers.mlp import LOSSES, MLPKVMapper, rows_in_layout, source_rows_in_layout
from ...utils.devices import decoder_layers
from ...utils.rope import rotary_cos_sin, rotate_half
from ..attention import attend, target_queries
from ..content_rows import cache_rows

logger = logging.getLogger(__name__)


def _rotate(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Differentiable rotate-half RoPE, `(B, H, T, d)` with `(B, T, d)` cos/sin (`rope.apply_rotary` writes with
    `out=`, which autograd does not support)."""
    return keys * cos.unsqueeze(1) + rotate_half(keys) * sin.unsqueeze(1)


def train_mlp_mapper(
    base: KVMapper,
    *,
    source: nn.Module,
    target: nn.Module,
    windows: torch.Tensor,
    statistics=None,
    ridge_lambda=None,
    hidden: int = 256,
    loss: str = "mse",
    epochs: int = 2,
    lr: float = 3e-3,
    batch_size: int = 8,
    steps_per_batch: int = 8,
    weight_decay: float = 0.0,
    seed: int = 0,
    progress: bool = False,
) -> MLPKVMapper:
    r"""Trains a residual MLP mapper on top of the ridge mapper `base` and returns it (`base` is left unchanged).

    The returned mapper's `fit_summary` holds the hyper-parameters (plus training time and final loss): what
    `hf_kvbridge.fitting.mapper_fits.refit` records as the new bridge's `config.mapper_kwargs` (`mapper_type="mlp"`),
    so `save_pretrained` / `from_pretrained` round-trip it.

    Args:
        base ([`KVMapper`]): a linear (ridge) mapper of `source` → `target`.
        source, target (`nn.Module`): the two models; every batch runs both (their caches are the training rows).
        windows (`torch.LongTensor` of shape `(num_sequences, seq_len)`): calibration windows (never held-out text).
        statistics, ridge_lambda: not used (the registry passes every fit the same arguments).
        hidden (`int`, *optional*, defaults to `256`): hidden width of each per-(layer, head group) MLP.
        loss (`str`, *optional*, defaults to `"mse"`): `"mse"` (normalised K/V error) or `"attention"`
            (attention-output error under the target's own queries, after `o_proj`).
        epochs (`int`, *optional*, defaults to `2`): passes over `windows` (each re-runs the models).
        lr (`float`, *optional*, defaults to `3e-3`): Adam learning rate, cosine-annealed to 0 over training.
        batch_size (`int`, *optional*, defaults to `8`): windows per streamed batch.
        steps_per_batch (`int`, *optional*, defaults to `8`): optimiser steps on each batch before the next is
            extracted (the models' forward passes cost far more than a step).
        weight_decay (`float`, *optional*, defaults to `0.0`): Adam weight decay.
        seed (`int`, *optional*, defaults to `0`): initialisation and window order.

    Returns:
        [`MLPKVMapper`].

    Example:

    ```python
    >>> from hf_kvbridge.fitting.mapper_fits import refit
    >>> mlp_bridge = refit(bridge, "mlp", windows=windows, hidden=128, loss="attention", epochs=2)  # doctest: +SKIP
    >>> mlp_bridge.config.mapper_type  # doctest: +SKIP
    'mlp'
    ```
    """

    if loss not in LOSSES:
        raise MapperError(f"loss must be one of {LOSSES}, got {loss!r}")
    if min(epochs, batch_size, hidden, steps_per_batch) < 1:
        raise MapperError(
            f"epochs, batch_size, hidden and steps_per_batch must be ≥ 1, got {epochs}, {batch_size}, {hidden}, "
            f"{steps_per_batch}"
        )
    if type(base) is not KVMapper:
        raise MapperError(
            f"train_mlp_mapper starts from a linear (ridge) mapper, got {type(base).__name__}; refit a ridge bridge"
        )
    started = time.perf_counter()
    device = target.device
    mapper = MLPKVMapper.from_linear(base, hidden=hidden, seed=seed).to(device=device, dtype=torch.float32)
    xw, yw = mapper.x_row, mapper.y_row  # features of one source / target layer
    attn_layers = [layer.self_attn for layer in decoder_layers(target)]
    params = [p for residual in mapper.residuals for p in residual.parameters()]
    for param in params:
        param.requires_grad_(True)
    steps = epochs * math.ceil(len(windows) / batch_size) * steps_per_batch
    optimizer = torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    generator = torch.Generator().manual_seed(seed)
    epoch_losses: list[float] = []
    try:
        from tqdm.auto import tqdm

        bar = tqdm(
            total=steps // steps_per_batch, desc=f"training MLP mapper ({loss})", unit="batch", disable=not progress
        )
        for epoch in range(epochs):
            order = torch.randperm(len(windows), generator=generator)
            total, batches = 0.0, 0
            for start in range(0, len(windows), batch_size):
                ids = windows[order[start : start + batch_size]]
                batch, seq = ids.shape
                with torch.no_grad():
                    x = cache_rows(source, ids, device)  # (B·T, L_s·H·2d)
                    y = cache_rows(target, ids, device) if loss == "mse" or epoch == start == 0 else None
                    if epoch == start == 0:
                        mapper.set_normalisation(x, y)
                    if loss == "attention":
                        queries, true_cache = target_queries(target, ids)  # (B, H_q, T, d) per layer
                        positions = torch.arange(seq, device=device).unsqueeze(0).expand(batch, -1)
                        cos, sin = rotary_cos_sin(target, positions)  # (B, T, d)
                        true_out = [
                            attend(attn_layers[t], queries[t], layer.keys.float(), layer.values.float())
                            for t, layer in enumerate(true_cache.layers)
                        ]  # (B, T, D) per layer
                    used = {s for layers in mapper.selected_layers for s in layers}
                    source_rows = {s: source_rows_in_layout(mapper, x[:, s * xw : (s + 1) * xw]) for s in used}
                # several optimiser steps on each streamed batch: the forward passes cost far more than a step
                for _ in range(steps_per_batch):
                    optimizer.zero_grad(set_to_none=True)
                    step_loss = 0.0
                    for t, layers in enumerate(mapper.selected_layers):
                        rows = [source_rows[s] for s in layers]
                        mapped = mapper.map_layer(t, rows)  # mapper layout
                        if loss == "mse":
                            true = rows_in_layout(mapper, y[:, t * yw : (t + 1) * yw])
                            scale = mapper.residuals[t].out_scale
                            scale = scale.unsqueeze(1) if mapper.grouped else scale  # (G, 1, q) or (1, q)
                            layer_loss = ((mapped - true) / scale).pow(2).mean()
                        else:
                            keys_c, values = mapper.split_rows(mapped, batch, seq)  # (B, H, T, d)
                            out = attend(attn_layers[t], queries[t], _rotate(keys_c, cos, sin), values)
                            energy = true_out[t].pow(2).sum(-1).mean()
                            layer_loss = (out - true_out[t]).pow(2).sum(-1).mean() / energy
                        # backward per layer: only one target layer's graph is alive at a time
                        (layer_loss / len(mapper.selected_layers)).backward()
                        step_loss += float(layer_loss.detach()) / len(mapper.selected_layers)
                    optimizer.step()
                    schedule.step()
                total += step_loss
                batches += 1
                bar.update(1)
            epoch_losses.append(total / batches)
            logger.info("MLP mapper epoch %d: mean %s loss %.5f", epoch, loss, epoch_losses[-1])
        bar.close()
    finally:
        for param in params:
            param.requires_grad_(False)
    mapper.fit_summary = {
        "hidden": int(hidden),
        "loss": loss,
        "epochs": int(epochs),
        "lr": float(lr),
        "batch_size": int(batch_size),
        "steps_per_batch": int(steps_per_batch),
        "weight_decay": float(weight_decay),
        "seed": int(seed),
        "windows": int(len(windows)),
        "seq_len": int(windows.shape[1]),
        "epoch_losses": [round(v, 6) for v in epoch_losses],
        "train_seconds": round(time.perf_counter() - started, 2),
    }
    return mapper
