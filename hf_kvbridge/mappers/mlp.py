"""`mapper_type="mlp"`: a small residual MLP per (target layer, head group) on top of the ridge map.

For target layer `t` and head group `g` (all heads at once in `all_heads` mode, one head in `same_head` mode; with
`kv_mode="separate"` the keys and the values of each are two groups, so the key residual reads source keys only and
the value residual source values only, like the ridge maps under them):

    ŷ = x W + b  +  (gelu(z W₁ + b₁) W₂ + b₂) · σ_y,     z = (x − μ_x) / σ_x

`W, b` are the ridge solution and stay fixed; only `W₁, b₁, W₂, b₂` are trained. `W₂` and `b₂` start at zero, so an
untrained MLP mapper maps exactly as its ridge base. `μ_x, σ_x` (per input feature) and `σ_y` (per output feature)
are fixed preconditioners taken from the first training batch: source keys and values live at very different
scales, and so do the target's.

Training streams the calibration windows: every batch re-runs the source (and the target) and is dropped after
its step, so memory does not grow with the number of windows. Two losses:

- `"mse"`: squared error of the content-space K/V, each feature divided by its `σ_y` (keys and values count alike);
- `"attention"`: the target's own queries attend (causally) over the mapped and over the true K/V of the layer,
  and the squared error of the two attention outputs after `o_proj`, relative to the true output's energy, is
  minimised: error in directions the target's attention ignores costs nothing.
"""

from __future__ import annotations

import logging
import math
import time

import torch
from torch import nn

from ..attention import attend, target_queries
from ..constants import MLP_LOSSES
from ..content_rows import cache_rows
from ..devices import decoder_layers
from ..errors import MapperError
from ..rope import rotary_cos_sin, rotate_half
from .base import KVMapper, MapperType

logger = logging.getLogger(__name__)

LOSSES = MLP_LOSSES  # named in `constants`, where the command line reads them


class ResidualMLP(nn.Module):
    """`G` independent two-layer MLPs `(G, N, p) → (G, N, q)`, batched; the last layer starts at zero."""

    def __init__(self, groups: int, in_features: int, out_features: int, hidden: int):
        super().__init__()
        self.register_buffer("in_mean", torch.zeros(groups, in_features))
        self.register_buffer("in_scale", torch.ones(groups, in_features))
        self.register_buffer("out_scale", torch.ones(groups, out_features))
        # trainable only inside `train_mlp_mapper`; a loaded mapper is inference-only like the ridge one
        self.w1 = nn.Parameter(torch.zeros(groups, in_features, hidden), requires_grad=False)
        self.b1 = nn.Parameter(torch.zeros(groups, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.zeros(groups, hidden, out_features), requires_grad=False)
        self.b2 = nn.Parameter(torch.zeros(groups, out_features), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = (x - self.in_mean.unsqueeze(1)) / self.in_scale.unsqueeze(1)  # (G, N, p)
        h = nn.functional.gelu(torch.baddbmm(self.b1.unsqueeze(1), z, self.w1))  # (G, N, hidden)
        return torch.baddbmm(self.b2.unsqueeze(1), h, self.w2) * self.out_scale.unsqueeze(1)  # (G, N, q)


class MLPKVMapper(KVMapper):
    """A [`KVMapper`] plus a residual MLP per target layer and head group (see the module docstring).

    Same interface as the ridge mapper (`layout_rows`, `map_layer`, `split_rows`), so `map_cache` uses it unchanged.

    Args:
        selected_layers, num_kv_heads, head_dim, head_mode: as for [`KVMapper`].
        hidden (`int`, *optional*, defaults to `256`): hidden width of each target layer's (head's, in `same_head`
            mode) MLP; with `kv_mode="separate"` the keys' and the values' MLPs get `⌈hidden/2⌉` each, so the
            residual costs half the joint one's weights and FLOPs, as the ridge part does.
        kv_mode, target_kv_heads, target_head_dim (*optional*): as for [`KVMapper`].

    Example:

    ```python
    >>> ridge = KVMapper([[0], [1, 0]], num_kv_heads=2, head_dim=4, head_mode="all_heads")
    >>> mlp = MLPKVMapper.from_linear(ridge, hidden=8)
    >>> rows = [mlp.layout_rows(torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4))] * 2
    >>> torch.equal(mlp.map_layer(1, rows), ridge.map_layer(1, rows))  # zero-initialised residual
    True
    ```
    """

    groupable = False  # map_layer adds a nonlinear residual per layer

    def __init__(
        self,
        selected_layers: list[list[int]],
        num_kv_heads: int,
        head_dim: int,
        head_mode: str,
        hidden: int = 256,
        kv_mode: str = "joint",
        **target_heads,
    ):
        super().__init__(selected_layers, num_kv_heads, head_dim, head_mode, kv_mode=kv_mode, **target_heads)
        self.hidden = int(hidden)
        group_hidden = self.hidden if self.kv_mode == "joint" else -(-self.hidden // 2)
        self.residuals = nn.ModuleList(
            ResidualMLP(*layer_map.weight.shape, group_hidden)
            for layer_map in self.layers  # (G, p, q)
        )

    @classmethod
    def from_config(cls, config, layout) -> MLPKVMapper:
        return super().from_config(config, layout, hidden=(config.mapper_kwargs or {}).get("hidden", 256))

    @classmethod
    def from_linear(cls, linear: KVMapper, hidden: int = 256, seed: int = 0) -> MLPKVMapper:
        """An MLP mapper whose linear part is a copy of `linear` and whose residual is zero (so it maps the same).

        The first MLP layer is drawn with a seeded generator (`N(0, 1/p)`), so the result is reproducible.
        """
        mapper = cls(
            linear.selected_layers,
            linear.source_kv_heads,
            linear.source_head_dim,
            linear.head_mode,
            hidden,
            kv_mode=linear.kv_mode,
            **linear.head_kwargs(),
        )
        mapper.layers.load_state_dict(linear.layers.state_dict())
        generator = torch.Generator().manual_seed(seed)
        for residual in mapper.residuals:
            fan_in = residual.w1.shape[1]
            residual.w1.data.copy_(torch.randn(residual.w1.shape, generator=generator) / math.sqrt(fan_in))
        return mapper.to(linear.layers[0].weight.device)

    def flops_per_token(self) -> int:
        """The ridge part's FLOPs plus the residual MLPs' two products."""
        mlp = sum(2 * (r.w1.numel() + r.w2.numel()) for r in self.residuals)
        return super().flops_per_token() + mlp

    def residual(self, target_layer: int, rows: list[torch.Tensor]) -> torch.Tensor:
        """The MLP's correction for `target_layer`, in the mapper's layout (same shape as `map_layer`'s output)."""
        x = torch.cat(rows, dim=-1)  # (B·T, k·H_s·2d_s) all_heads + joint, else (G, B·T, p)
        if not self.grouped:
            return self.residuals[target_layer](x.unsqueeze(0)).squeeze(0)  # (B·T, H·2d)
        return self.residuals[target_layer](x)  # (G, B·T, q)

    def map_layer(self, target_layer: int, rows: list[torch.Tensor]) -> torch.Tensor:
        """The ridge map of the selected source layers' rows plus the MLP's correction (see [`KVMapper.map_layer`])."""
        return super().map_layer(target_layer, rows) + self.residual(target_layer, rows)

    @torch.no_grad()
    def set_normalisation(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Sets `μ_x, σ_x, σ_y` of every target layer from one batch of rows.

        Args:
            x (`torch.Tensor` of shape `(N, L_s·H_s·2d_s)`), y (`(N, L_t·H_t·2d_t)`): content-space rows
                (`cache_rows`).
        """
        xw, yw = self.x_row, self.y_row
        for t, layers in enumerate(self.selected_layers):
            inputs = torch.cat([source_rows_in_layout(self, x[:, s * xw : (s + 1) * xw]) for s in layers], dim=-1)
            outputs = rows_in_layout(self, y[:, t * yw : (t + 1) * yw])
            if not self.grouped:  # one head group
                inputs, outputs = inputs.unsqueeze(0), outputs.unsqueeze(0)
            residual = self.residuals[t]
            in_std, out_std = inputs.std(1), outputs.std(1)  # (G, p), (G, q)
            residual.in_mean.copy_(inputs.mean(1))
            # a constant feature must not divide by ~0
            residual.in_scale.copy_(in_std.clamp_min(1e-6 * float(in_std.mean()) + 1e-12))
            residual.out_scale.copy_(out_std.clamp_min(1e-6 * float(out_std.mean()) + 1e-12))


def rows_in_layout(mapper: KVMapper, rows: torch.Tensor) -> torch.Tensor:
    """One target layer's `(N, H_t·2d_t)` content-space rows (a slice of `cache_rows`) in `mapper`'s output layout.

    `(N, H_t·2d_t)` for `all_heads` (unchanged), `(H_t, N, 2d_t)` for `same_head` (a view); with
    `kv_mode="separate"` the keys then the values: `(2, N, H_t·d_t)` and `(2·H_t, N, d_t)` (copies).
    """
    n, heads, dim = rows.shape[0], mapper.target_kv_heads, mapper.target_head_dim
    if mapper.kv_mode == "joint":
        return rows if mapper.head_mode == "all_heads" else rows.view(n, heads, 2 * dim).transpose(0, 1)
    kv = rows.view(n, heads, 2, dim)
    if mapper.head_mode == "all_heads":
        return kv.permute(2, 0, 1, 3).reshape(2, n, heads * dim)  # (2, N, H·d)
    return kv.permute(2, 1, 0, 3).reshape(2 * heads, n, dim)  # (2·H, N, d): K of every head, then V


def source_rows_in_layout(mapper: KVMapper, rows: torch.Tensor) -> torch.Tensor:
    """One source layer's `(N, H_s·2d_s)` content-space rows in `mapper`'s input layout: `rows` itself for
    `all_heads` + `joint`, else a `(G, N, p)` copy in the mapper's dtype (`KVMapper.layout_rows`), each group's
    source heads (a copy for each target head that shares one), keys and values interleaved or apart as `kv_mode`
    says."""
    if not mapper.grouped:
        return rows
    heads = rows.view(rows.shape[0], mapper.source_kv_heads, 2, mapper.source_head_dim).transpose(0, 1)  # (H, N, 2, d)
    return mapper.layout_rows(heads[:, :, 0].unsqueeze(0), heads[:, :, 1].unsqueeze(0))  # keys, values (1, H, N, d)


def rows_from_layout(mapper: KVMapper, mapped: torch.Tensor) -> torch.Tensor:
    """Inverse of `rows_in_layout`: a layer's mapped rows back to `(N, H_t·2d_t)`."""
    n, heads, dim = mapped.shape[-2], mapper.target_kv_heads, mapper.target_head_dim
    if mapper.kv_mode == "joint":
        return mapped if mapper.head_mode == "all_heads" else mapped.transpose(0, 1).reshape(n, -1)  # (N, H·2d)
    if mapper.head_mode == "all_heads":
        kv = mapped.view(2, n, heads, dim).permute(1, 2, 0, 3)  # (N, H, 2, d)
    else:
        kv = mapped.view(2, heads, n, dim).permute(2, 1, 0, 3)  # (N, H, 2, d)
    return kv.reshape(n, -1)  # (N, H·2d)


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
    `hf_kvbridge.calibration.refit` records as the new bridge's `config.mapper_kwargs` (`mapper_type="mlp"`), so
    `save_pretrained` / `from_pretrained` round-trip it.

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
    >>> from hf_kvbridge.calibration.refit import refit
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


MAPPER = MapperType(
    "mlp",
    MLPKVMapper,
    fit=train_mlp_mapper,
    linear=False,
    description="a residual MLP per target layer on top of the ridge map, trained on the calibration windows",
)
