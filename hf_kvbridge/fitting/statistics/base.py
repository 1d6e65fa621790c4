"""Streamed sufficient statistics of source and target KV rows (additive, so they merge and all-reduce).

For every calibration token we see one source row `x` (all source layers, `F = L_s · H_s · 2d_s` features: per
layer, per head, content-space key then value) and one target row `y` (`G = L_t · H_t · 2d_t`; the target's KV heads
and head dim may differ from the source's). We keep

    count = n,   x_sum = Σx (F),   y_sum = Σy (G),
    xx = Σ(x − x̄)(x − x̄)ᵀ (F, F),   xy = Σ(x − x̄)(y − ȳ)ᵀ (F, G),   yy = Σ(y − ȳ)² (G)

in float64: *centred* sums, merged with Chan et al.'s pairwise update, so no large raw sums cancel when means,
variances and residuals are taken from them. Any subset of source layers, any head mode and any `top_k` is then a
slice of these, so one pass over the models is enough for layer selection and every fit. Memory is independent of the
number of tokens, but grows as `L_s·L_t·(H·2d)²`: see `BlockStatistics` below for real model pairs.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ...errors import StatisticsError
from ...utils.heads import HeadLayouts, map_groups, target_heads_of

logger = logging.getLogger(__name__)


def centred_residual_sums(n, mx, my, cxx, cxy, vy, weight, bias) -> tuple[torch.Tensor, torch.Tensor]:
    """`(Σ(y − xW − b)², Σ(y − ȳ)²)` per output column from centred moments (covariances divided by `n`).

    With `r = (y − ȳ) − (x − x̄)W + e`, `e = ȳ − x̄W − b`, the cross terms of the centred parts with the constant `e`
    vanish, so `Σr² = n·(var_y − 2·diag(Wᵀ C_xy) + diag(Wᵀ C_xx W) + e²)`: no large raw sums cancel.

    Args:
        n (`int` or `float`): the token count. mx (`(p,)`), my (`(q,)`), cxx (`(p, p)`), cxy (`(p, q)`), vy (`(q,)`):
            float64 moments. weight (`(p, q)`), bias (`(q,)`). Any leading batch dimensions broadcast (a batch of
            maps).
    """
    w, b = weight.to(torch.float64), bias.to(torch.float64)
    offset = my - (mx.unsqueeze(-2) @ w).squeeze(-2) - b  # (..., q)
    explained = ((cxx @ w) * w).sum(-2) - 2 * (cxy * w).sum(-2)  # (..., q)
    sse = n * (vy + explained + offset * offset)
    return sse, n * vy


def has_rows(x: torch.Tensor, y: torch.Tensor, features: int, targets: int, what: str = "statistics") -> bool:
    """Whether `x` `(N, F)` and `y` `(N, G)` hold any rows, after checking that they fit statistics of `features`
    source and `targets` target features (a `StatisticsError` naming both shapes otherwise)."""
    if x.shape[0] != y.shape[0] or x.shape[1] != features or y.shape[1] != targets:
        raise StatisticsError(
            f"rows of shape {tuple(x.shape)} / {tuple(y.shape)} do not fit {what} with F={features}, G={targets}"
        )
    return x.shape[0] > 0


def head_index(row: int, head_dim: int, layers: list[int], heads, device) -> torch.Tensor:
    """Feature indices of `layers` (in that order) in rows of `row` features per layer: all heads (`heads=None`),
    one head (an `int`) or several (a list, in that order) of `2·head_dim` features each."""
    span = 2 * head_dim
    if heads is None:
        parts = [torch.arange(layer * row, (layer + 1) * row) for layer in layers]
    else:
        heads = [heads] if isinstance(heads, int) else list(heads)
        parts = [torch.arange(layer * row + h * span, layer * row + (h + 1) * span) for layer in layers for h in heads]
    return torch.cat(parts).to(device)


class LayerPairStatistics(HeadLayouts):
    """The layout every statistics class is built on: `source_layers` source and `target_layers` target cache
    layers, the KV head layouts of the two sides ([`HeadLayouts`]), and the `dtype` and `device` of what it keeps.
    Subclasses take their own arguments and hand these on (`*args, **kwargs`), so the layout is declared here only.

    Args:
        source_layers (`int`), target_layers (`int`): number of cache layers of each model.
        num_kv_heads (`int`), head_dim (`int`): the source's KV layout (and the target's, unless given).
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`): of the sums or rows a subclass keeps.
        device (`torch.device` or `str`, *optional*): where they live (defaults to CPU).
        target_kv_heads (`int`, *optional*), target_head_dim (`int`, *optional*): the target's KV layout when it
            differs from the source's.
    """

    def __init__(
        self,
        source_layers: int,
        target_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        *,
        target_kv_heads: int | None = None,
        target_head_dim: int | None = None,
    ):
        self.source_layers, self.target_layers = source_layers, target_layers
        self._set_head_layouts(num_kv_heads, head_dim, target_kv_heads, target_head_dim)
        self.dtype, self.device = dtype, torch.device(device or "cpu")


class StatisticsFile:
    """`state_dict`, `save` and `load` (one safetensors file, what resumable calibration checkpoints hold) of
    statistics whose sums are the tensors `_fields`, with `count` and `shape_key` beside them. A subclass adds its own
    entries (`state_dict`) and builds itself from a file's (`_from_state`)."""

    _fields: tuple[str, ...] = ("x_mean", "y_mean", "xx", "xy", "yy")

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {name: getattr(self, name).contiguous() for name in self._fields}
        state["count"] = torch.tensor([self.count], dtype=torch.int64)
        state["shape_key"] = torch.tensor(self.shape_key, dtype=torch.int64)
        return state

    def save(self, path: str | Path) -> None:
        save_file({k: v.cpu() for k, v in self.state_dict().items()}, str(path))

    @classmethod
    def load(cls, path: str | Path, device: torch.device | str | None = None):
        state = load_file(str(path))
        stats = cls._from_state(state, path, device)
        stats.count = int(state["count"].item())
        for name in cls._fields:
            getattr(stats, name).copy_(state[name])
        return stats

    @classmethod
    def _from_state(cls, state: dict[str, torch.Tensor], path: str | Path, device):
        """Empty statistics of the layout (and dtype) a file's `state` was saved with."""
        key = state["shape_key"].tolist()
        return cls(*key[:4], dtype=state["xx"].dtype, device=device, **target_heads_of(key))


def kept_layers(sources: list[int], targets: list[int]) -> tuple[list[int], list[int]]:
    """`sources` and `targets` sorted, each layer once; called with what a [`KeptLayerStatistics`] was given, so
    Python itself raises on one given twice or not at all."""
    return sorted(set(map(int, sources))), sorted(set(map(int, targets)))


class KeptLayerStatistics(LayerPairStatistics):
    """[`LayerPairStatistics`] that keep some layers only: source layers `sources` and target layers `targets`
    (sorted, each once), as [`BlockStatistics`] and [`RowStatistics`] do.

    Args:
        sources (`list[int]`), targets (`list[int]`): the layers kept. By keyword, or positionally after the four
            layout numbers: these classes have always been called as `(L_s, L_t, H, d, sources, targets, dtype,
            device)`.
        the layout arguments: as [`LayerPairStatistics`].
    """

    def __init__(self, *args, **kwargs):
        given = {name: kwargs.pop(name) for name in ("sources", "targets") if name in kwargs}
        kept = kept_layers(*args[4:6], **given)  # args[4:6]: sources, then targets, when they come positionally
        super().__init__(*args[:4], *args[6:], **kwargs)
        self.sources, self.targets = kept


class GlobalLayerIndex:
    """Feature indices with global layer numbers, and residual sums from `moments`, for statistics that hold layers
    of a `(source_layers, target_layers)` layout ([`KVStatistics`], [`BlockStatistics`], [`RowStatistics`]); the
    indices live on `_index_device`."""

    def source_index(self, layers: list[int], head: int | list[int] | None = None) -> torch.Tensor:
        """Global feature indices of source `layers` (in that order), all heads, only `head`, or a list of heads."""
        return head_index(self.x_row, self.source_head_dim, layers, head, self._index_device)

    def target_index(self, layer: int, head: int | list[int] | None = None) -> torch.Tensor:
        """Global feature indices of target `layer`, all heads, only `head`, or a list of heads."""
        return head_index(self.y_row, self.target_head_dim, [layer], head, self._index_device)

    def residual_sums(self, x_idx, y_idx, weight: torch.Tensor, bias: torch.Tensor):
        """Per output column, `(Σ(y − xW − b)², Σ(y − ȳ)²)` over these tokens (see `centred_residual_sums`)."""
        return centred_residual_sums(self.count, *self.moments(x_idx, y_idx), weight, bias)

    def map_groups(self, layers: list[int], target: int, head_mode: str, kv_mode: str = "joint"):
        """`heads.map_groups` of these statistics: the feature indices of each independent map of target layer
        `target` fitted from source `layers`, in the mapper's group order."""
        return map_groups(self, layers, target, head_mode, kv_mode)


CHUNK_BYTES = 2**28  # float64 bytes of the rows one statistics update works on at a time


def chunk_rows(features: int) -> int:
    """Rows an update takes at a time: `CHUNK_BYTES` of float64 rows of `features` features (the update's copies of
    its rows, centred and regrouped, are a few times that; a batch of 8 × 256 tokens of Qwen3-0.6B → 1.7B rows is
    0.9 GB of them per side)."""
    return max(1, CHUNK_BYTES // (8 * max(features, 1)))


# -- statistics on a memory budget ------------------------------------------------------------------------------------
# `KVStatistics` holds every source layer against every target layer: F² + F·G numbers (52.6 GB in float64 for
# Qwen3-0.6B → 1.7B). Calibration of real pairs instead runs two kinds of smaller statistics:
#   1. `SelectionStatistics`: per KV head and per K/V, each source layer's d×d Gram block and its d×d cross blocks
#      with every target layer (H·2·L_s·d·(d + L_t·d) numbers), enough for a single-layer held-out R² of every
#      (target layer, source layer) pair, hence the top-k choice;
#   2. `BlockStatistics`: for a group of target layers, the Gram matrix of the union of their selected source layers
#      (shared by all target layers of the group) and the cross blocks of each target layer with its own selected
#      source layers only.
# Both keep *centred* sums (means plus Σ(x − x̄)(x − x̄)ᵀ, merged with Chan et al.'s pairwise update), so float32
# Gram blocks lose no precision to the cancellation of large raw sums.


def chan_merge(n_a: int | float, n_b: int | float) -> tuple[float, float]:
    """Weights of the pairwise update: `(n_a·n_b / n, n_b / n)` (0, 0 when both are empty)."""
    n = n_a + n_b
    return (n_a * n_b / n, n_b / n) if n else (0.0, 0.0)


class CentredSums:
    """What [`BlockStatistics`] and [`SelectionStatistics`] share: float64 means `x_mean`, `y_mean`, centred Gram and
    cross sums `xx`, `xy` (in `dtype`, laid out as each class keeps its blocks), `yy` and `count`, merged with Chan's
    pairwise update and all-reduced in place. A subclass says how an outer product lands in its blocks (`_outer_`)
    and what must match to merge (`_merge_key`)."""

    _merge_what = "statistics"

    def _outer_(self, dx: torch.Tensor, dy: torch.Tensor, alpha: float) -> None:
        """`xx += alpha·dx dxᵀ`, `xy += alpha·dx dyᵀ` in the blocks this class keeps (`dx`, `dy`: as the means)."""
        raise NotImplementedError

    def _merge_key(self) -> tuple:
        return self.shape_key

    def _shift(self, f: float, share: float, n_b: int, mx_b, my_b) -> None:
        """Chan's correction for adding `n_b` tokens of means `mx_b`, `my_b`, in place; then the new means."""
        dx, dy = mx_b - self.x_mean, my_b - self.y_mean  # float64, shaped as the means
        self._outer_(dx, dy, f)
        self.yy.add_(f * dy * dy)
        self.x_mean.add_(share * dx)
        self.y_mean.add_(share * dy)
        self.count += n_b

    def merge_(self, other):
        """Adds `other` (same layers and blocks) into `self` in place and returns `self`."""
        if other._merge_key() != self._merge_key():
            raise StatisticsError(f"cannot merge {self._merge_what} {self._merge_key()} and {other._merge_key()}")
        dev = self.xx.device
        f, share = chan_merge(self.count, other.count)
        self.xx.add_(other.xx.to(dev, self.dtype))
        self.xy.add_(other.xy.to(dev, self.dtype))
        self.yy.add_(other.yy.to(dev))
        self._shift(f, share, other.count, other.x_mean.to(dev), other.y_mean.to(dev))
        return self

    def all_reduce_(self):
        """Sums the statistics of every `torch.distributed` rank into each of them (in place): every rank re-centres
        its sums on the global mean, then the sums are all-reduced."""
        import torch.distributed as dist

        dev = self.xx.device
        count = torch.tensor([float(self.count)], dtype=torch.float64, device=dev)
        dist.all_reduce(count)
        total = count.item()
        if total == 0:
            return self
        mx, my = self.x_mean * self.count, self.y_mean * self.count
        dist.all_reduce(mx)
        dist.all_reduce(my)
        mx, my = mx / total, my / total
        dx, dy = self.x_mean - mx, self.y_mean - my  # Σ(x − c)(x − c)ᵀ = M + n (x̄ − c)(x̄ − c)ᵀ
        self._outer_(dx, dy, self.count)
        self.yy.add_(self.count * dy * dy)
        for tensor in (self.xx, self.xy, self.yy):
            dist.all_reduce(tensor)
        self.x_mean, self.y_mean, self.count = mx, my, int(total)
        return self

    def check_finite(self, what: str = "statistics") -> None:
        """Raises `StatisticsError` naming the field if any sum holds NaN or Inf."""
        for name in ("x_mean", "y_mean", "xx", "xy", "yy"):
            if not torch.isfinite(getattr(self, name)).all():
                raise StatisticsError(
                    f"{what}: non-finite (NaN/Inf) values in {name}; the source or target produced NaN/Inf KV on the "
                    "calibration data (try float32, or check the models)."
                )
