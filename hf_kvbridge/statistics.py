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
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .errors import StatisticsError
from .layout import HeadLayouts, same_head_sources, target_heads_of

logger = logging.getLogger(__name__)

_FIELDS = ("x_sum", "y_sum", "xx", "xy", "yy")


def centred_residual_sums(n, mx, my, cxx, cxy, vy, weight, bias) -> tuple[torch.Tensor, torch.Tensor]:
    """`(Σ(y − xW − b)², Σ(y − ȳ)²)` per output column from centred moments (covariances divided by `n`).

    With `r = (y − ȳ) − (x − x̄)W + e`, `e = ȳ − x̄W − b`, the cross terms of the centred parts with the constant `e`
    vanish, so `Σr² = n·(var_y − 2·diag(Wᵀ C_xy) + diag(Wᵀ C_xx W) + e²)`: no large raw sums cancel.

    Args:
        n (`int` or `float`): the token count. mx (`(p,)`), my (`(q,)`), cxx (`(p, p)`), cxy (`(p, q)`), vy (`(q,)`):
            float64 moments. weight (`(p, q)`), bias (`(q,)`).
    """
    w, b = weight.to(torch.float64), bias.to(torch.float64)
    offset = my - mx @ w - b  # (q,)
    explained = ((cxx @ w) * w).sum(0) - 2 * (cxy * w).sum(0)  # (q,)
    sse = n * (vy + explained + offset * offset)
    return sse, n * vy


def map_groups(stats, layers: list[int], target: int, head_mode: str, kv_mode: str = "joint"):
    """Feature indices `[(x_idx, y_idx)]` of each independent map ("group") of target layer `target` fitted from source
    `layers`, in the mapper's group order: one (`all_heads`, `joint`), one per target head (`same_head`: its source
    heads, see `layout.same_head_sources`), keys then values (`all_heads`, `separate`: K from K, V from V), or per K/V
    then per target head (`same_head`, `separate`).

    Args:
        stats: anything with `source_index`, `target_index` and the two head layouts ([`KVStatistics`],
            [`BlockStatistics`]).
    """
    if head_mode == "all_heads":
        heads = [(None, None)]
    else:
        heads = list(enumerate(same_head_sources(stats.source_kv_heads, stats.target_kv_heads)))
    ds, dt = stats.source_head_dim, stats.target_head_dim
    groups = []
    for kv in [None] if kv_mode == "joint" else [0, 1]:
        for head, sources in heads:
            x_idx, y_idx = stats.source_index(layers, sources), stats.target_index(target, head)
            if kv is not None:  # each (layer, head) chunk of 2d features is the key then the value
                x_idx, y_idx = x_idx.view(-1, 2, ds)[:, kv].reshape(-1), y_idx.view(-1, 2, dt)[:, kv].reshape(-1)
            groups.append((x_idx, y_idx))
    return groups


def _head_index(row: int, head_dim: int, layers: list[int], heads, device) -> torch.Tensor:
    """Feature indices of `layers` (in that order) in rows of `row` features per layer: all heads (`heads=None`),
    one head (an `int`) or several (a list, in that order) of `2·head_dim` features each."""
    span = 2 * head_dim
    if heads is None:
        parts = [torch.arange(layer * row, (layer + 1) * row) for layer in layers]
    else:
        heads = [heads] if isinstance(heads, int) else list(heads)
        parts = [torch.arange(layer * row + h * span, layer * row + (h + 1) * span) for layer in layers for h in heads]
    return torch.cat(parts).to(device)


class GlobalLayerIndex:
    """Feature indices with global layer numbers, and residual sums from `moments`, for statistics that hold layers
    of a `(source_layers, target_layers)` layout ([`KVStatistics`], [`BlockStatistics`], [`RowStatistics`]); the
    indices live on `_index_device`."""

    def source_index(self, layers: list[int], head: int | list[int] | None = None) -> torch.Tensor:
        """Global feature indices of source `layers` (in that order), all heads, only `head`, or a list of heads."""
        return _head_index(self.x_row, self.source_head_dim, layers, head, self._index_device)

    def target_index(self, layer: int, head: int | list[int] | None = None) -> torch.Tensor:
        """Global feature indices of target `layer`, all heads, only `head`, or a list of heads."""
        return _head_index(self.y_row, self.target_head_dim, [layer], head, self._index_device)

    def residual_sums(self, x_idx, y_idx, weight: torch.Tensor, bias: torch.Tensor):
        """Per output column, `(Σ(y − xW − b)², Σ(y − ȳ)²)` over these tokens (see `centred_residual_sums`)."""
        return centred_residual_sums(self.count, *self.moments(x_idx, y_idx), weight, bias)


CHUNK_BYTES = 2**28  # float64 bytes of the rows one statistics update works on at a time


def _chunk_rows(features: int) -> int:
    """Rows an update takes at a time: `CHUNK_BYTES` of float64 rows of `features` features (the update's copies of
    its rows, centred and regrouped, are a few times that; a batch of 8 × 256 tokens of Qwen3-0.6B → 1.7B rows is
    0.9 GB of them per side)."""
    return max(1, CHUNK_BYTES // (8 * max(features, 1)))


class KVStatistics(GlobalLayerIndex, HeadLayouts):
    """Sums over calibration tokens of source rows `x` and target rows `y` (see the module docstring).

    Args:
        source_layers (`int`), target_layers (`int`): number of cache layers of each model.
        num_kv_heads (`int`), head_dim (`int`): the source's KV layout (and the target's, unless given).
        device (`torch.device`, *optional*): where the sums live (defaults to CPU).
        target_kv_heads (`int`, *optional*), target_head_dim (`int`, *optional*): the target's KV layout when it
            differs from the source's.

    Example:

    ```python
    >>> stats = KVStatistics(source_layers=2, target_layers=3, num_kv_heads=1, head_dim=2)
    >>> stats.update(torch.randn(10, 2 * 4), torch.randn(10, 3 * 4))
    >>> stats.count
    10
    ```
    """

    def __init__(
        self,
        source_layers: int,
        target_layers: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str | None = None,
        *,
        target_kv_heads: int | None = None,
        target_head_dim: int | None = None,
    ):
        self.source_layers, self.target_layers = source_layers, target_layers
        self._set_head_layouts(num_kv_heads, head_dim, target_kv_heads, target_head_dim)
        f, g = source_layers * self.x_row, target_layers * self.y_row  # x_row, y_row: features of one layer
        kw = {"dtype": torch.float64, "device": device or "cpu"}
        self.count = 0
        self.x_sum = torch.zeros(f, **kw)
        self.y_sum = torch.zeros(g, **kw)
        self.xx = torch.zeros(f, f, **kw)
        self.xy = torch.zeros(f, g, **kw)
        self.yy = torch.zeros(g, **kw)

    @property
    def shape_key(self) -> tuple[int, ...]:
        """`(L_s, L_t, H, d)`, or `(L_s, L_t, H_s, d_s, H_t, d_t)` when the layouts differ."""
        return (self.source_layers, self.target_layers, *self._head_key())

    @torch.no_grad()
    def update(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Adds `x` `(N, F)` and `y` `(N, G)` (N tokens) to the sums."""
        if x.shape[0] != y.shape[0] or x.shape[1] != self.x_sum.numel() or y.shape[1] != self.y_sum.numel():
            raise StatisticsError(
                f"rows of shape {tuple(x.shape)} / {tuple(y.shape)} do not fit statistics with F={self.x_sum.numel()}"
                f", G={self.y_sum.numel()}"
            )
        if x.shape[0] == 0:
            return
        x = x.to(self.xx.device, torch.float64)
        y = y.to(self.xx.device, torch.float64)
        mx, my = x.mean(0), y.mean(0)
        xc, yc = x - mx, y - my  # centred on the batch's own means
        self._add_centred(x.shape[0], mx, my, xc.T @ xc, xc.T @ yc, (yc * yc).sum(0))  # (F, F), (F, G), (G,)

    def _add_centred(self, n_b, mx_b, my_b, xx_b, xy_b, yy_b) -> None:
        """Adds a part of `n_b` tokens (a count or a total weight) with means `mx_b`, `my_b` and centred sums:
        `M = M_a + M_b + (n_a·n_b / n)·δδᵀ` with `δ` the difference of the means (Chan et al.)."""
        n_a = self.count
        f, _ = _chan_merge(n_a, n_b)
        mx_a = self.x_sum / n_a if n_a else torch.zeros_like(self.x_sum)
        my_a = self.y_sum / n_a if n_a else torch.zeros_like(self.y_sum)
        dx, dy = mx_b - mx_a, my_b - my_a  # (F,), (G,)
        self.xx.add_(xx_b).addr_(dx, dx, alpha=f)
        self.xy.add_(xy_b).addr_(dx, dy, alpha=f)
        self.yy.add_(yy_b).add_(f * dy * dy)
        self.x_sum.add_(n_b * mx_b)
        self.y_sum.add_(n_b * my_b)
        self.count = n_a + n_b

    def merge_(self, other: KVStatistics) -> KVStatistics:
        """Adds `other` into `self` in place and returns `self` (statistics are additive)."""
        if other.shape_key != self.shape_key:
            raise StatisticsError(f"cannot merge statistics of layouts {self.shape_key} and {other.shape_key}")
        if other.count:
            dev = self.xx.device
            n = other.count
            self._add_centred(
                n,
                other.x_sum.to(dev) / n,
                other.y_sum.to(dev) / n,
                other.xx.to(dev),
                other.xy.to(dev),
                other.yy.to(dev),
            )
        return self

    def all_reduce_(self) -> KVStatistics:
        """Sums the statistics of every `torch.distributed` rank into each of them (in place): each rank re-centres
        its sums on the global mean (`Σ(x − c)(x − c)ᵀ = M + n(x̄ − c)(x̄ − c)ᵀ`), then they are all-reduced."""
        import torch.distributed as dist

        count = torch.tensor([float(self.count)], dtype=torch.float64, device=self.xx.device)
        dist.all_reduce(count)
        total = count.item()
        if total == 0:
            return self
        x_sum, y_sum = self.x_sum.clone(), self.y_sum.clone()
        dist.all_reduce(x_sum)
        dist.all_reduce(y_sum)
        n = self.count
        if n:
            dx, dy = self.x_sum / n - x_sum / total, self.y_sum / n - y_sum / total
            self.xx.addr_(dx, dx, alpha=n)
            self.xy.addr_(dx, dy, alpha=n)
            self.yy.add_(n * dy * dy)
        for tensor in (self.xx, self.xy, self.yy):
            dist.all_reduce(tensor)
        self.x_sum, self.y_sum = x_sum, y_sum
        self.count = int(total) if float(total).is_integer() else total
        return self

    def __add__(self, other: KVStatistics) -> KVStatistics:
        return self.copy().merge_(other)

    def copy(self) -> KVStatistics:
        key = self.shape_key
        new = KVStatistics(*key[:4], device=self.xx.device, **target_heads_of(key))
        new.merge_(self)
        return new

    def check_finite(self, what: str = "statistics") -> None:
        """Raises `StatisticsError` naming the field if any sum holds NaN or Inf (e.g. a model that overflowed)."""
        for name in _FIELDS:
            tensor = getattr(self, name)
            if not torch.isfinite(tensor).all():
                bad = (~torch.isfinite(tensor)).sum().item()
                raise StatisticsError(
                    f"{what}: {bad} non-finite (NaN/Inf) values in {name}; the source or target produced NaN/Inf "
                    "KV on the calibration data (try float32, or check the models)."
                )

    # -- indexing -------------------------------------------------------------------------------------------------
    @property
    def _index_device(self) -> torch.device:
        return self.xx.device

    # -- centered moments ----------------------------------------------------------------------------------------
    def moments(self, x_idx: torch.Tensor, y_idx: torch.Tensor):
        """Means and centered (co)variances over the selected features, divided by `count`.

        Returns:
            `(mean_x (p,), mean_y (q,), cov_xx (p, p), cov_xy (p, q), var_y (q,))`, float64.
        """
        if self.count == 0:
            raise StatisticsError("statistics hold no tokens")
        n = self.count
        mx, my = self.x_sum[x_idx] / n, self.y_sum[y_idx] / n
        return mx, my, self.xx[x_idx][:, x_idx] / n, self.xy[x_idx][:, y_idx] / n, self.yy[y_idx] / n

    def residual_sums(self, x_idx, y_idx, weight: torch.Tensor, bias: torch.Tensor):
        """Per output column, `Σ(y - xW - b)²` and `Σ(y - ȳ)²` over these tokens, from the sums alone.

        Args:
            weight (`torch.Tensor` of shape `(p, q)`), bias (`(q,)`): a fitted map from `x[x_idx]` to `y[y_idx]`.

        Returns:
            `(sse (q,), sst (q,))` float64, for R² = 1 - sse / sst. Computed from centred moments (not from the raw
            sums, where `Σy² − 2Σy·ŷ + Σŷ²` cancels catastrophically when the means are large).
        """
        mx, my, cxx, cxy, vy = self.moments(x_idx, y_idx)
        return centred_residual_sums(self.count, mx, my, cxx, cxy, vy, weight, bias)

    # -- persistence ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {name: getattr(self, name).contiguous() for name in _FIELDS}
        state["count"] = torch.tensor([self.count], dtype=torch.int64)
        state["shape_key"] = torch.tensor(self.shape_key, dtype=torch.int64)
        state["centred"] = torch.tensor([1], dtype=torch.int64)
        return state

    def save(self, path: str | Path) -> None:
        save_file({k: v.cpu() for k, v in self.state_dict().items()}, str(path))

    @classmethod
    def load(cls, path: str | Path, device: torch.device | str | None = None) -> KVStatistics:
        state = load_file(str(path))
        if "centred" not in state:
            raise StatisticsError(
                f"{path} holds raw (uncentred) statistics of an older hf_kvbridge; delete the checkpoint and "
                "calibrate again"
            )
        key = state["shape_key"].tolist()
        stats = cls(*key[:4], device=device, **target_heads_of(key))
        stats.count = state["count"].item()
        for name in _FIELDS:
            getattr(stats, name).copy_(state[name])
        return stats


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


def _chan_merge(n_a: int | float, n_b: int | float) -> tuple[float, float]:
    """Weights of the pairwise update: `(n_a·n_b / n, n_b / n)` (0, 0 when both are empty)."""
    n = n_a + n_b
    return (n_a * n_b / n, n_b / n) if n else (0.0, 0.0)


class _CentredSums:
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
        f, share = _chan_merge(self.count, other.count)
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


def feature_groups(
    num_kv_heads: int,
    head_dim: int,
    head_mode: str = "all_heads",
    kv_mode: str = "joint",
    target_kv_heads: int | None = None,
    target_head_dim: int | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The column offsets within one source layer's row and one target layer's row (`H·2d`: per head, key `d` then
    value `d`) that the maps of `head_mode` and `kv_mode` read together: one group per independent Gram block a fit
    needs.

    `all_heads`/`joint` → one group (the whole rows); `all_heads`/`separate` → the keys of every head, then the values;
    `same_head` → one group per head group (`g = gcd(H_s, H_t)` groups: one head each for equal counts; target head
    `h` reads the source heads of its group, see `layout.same_head_sources`), with its keys and values together
    (`joint`) or apart (`separate`). Statistics kept per group are `len(groups)` times smaller than one all-heads
    Gram block.

    Returns:
        `list[tuple[torch.LongTensor, torch.LongTensor]]`: per group, its source and its target offsets.

    Example:

    ```python
    >>> [(x.tolist(), y.tolist()) for x, y in feature_groups(2, 1, "same_head", "separate")]
    [([0], [0]), ([2], [2]), ([1], [1]), ([3], [3])]
    ```
    """
    heads_t = num_kv_heads if target_kv_heads is None else target_kv_heads
    dim_t = head_dim if target_head_dim is None else target_head_dim
    x = torch.arange(num_kv_heads * 2 * head_dim).view(num_kv_heads, 2, head_dim)  # (H_s, K/V, d_s)
    y = torch.arange(heads_t * 2 * dim_t).view(heads_t, 2, dim_t)  # (H_t, K/V, d_t)
    blocks = 1 if head_mode == "all_heads" else math.gcd(num_kv_heads, heads_t)
    hx, hy = num_kv_heads // blocks, heads_t // blocks  # heads per block on each side
    kinds = [slice(None)] if kv_mode == "joint" else [0, 1]
    return [
        (x[b * hx : (b + 1) * hx, kv].reshape(-1), y[b * hy : (b + 1) * hy, kv].reshape(-1))
        for kv in kinds
        for b in range(blocks)
    ]


class BlockStatistics(GlobalLayerIndex, _CentredSums, HeadLayouts):
    """Centred sums for `targets` (target layers) over the union `sources` of their selected source layers, kept per
    feature group (see `feature_groups`): the Gram and cross blocks that the maps of one head mode and kv mode read.

    Same interface as [`KVStatistics`] for the features it holds (`count`, `source_index`, `target_index`, `moments`,
    `residual_sums`, `merge_`, `all_reduce_`, `save`/`load`), with global layer numbers, so `solve_ridge` and the λ
    search run on it unchanged, as long as every query stays inside one group. Memory: `(U·row)²/G + K·row·T·row/G`
    numbers for `U` source and `T` target layers, `row = H·2d`, `G` groups (with `x_row = H_s·2d_s` and
    `y_row = H_t·2d_t` for the two sides of a mismatched pair), and `K = U` cross blocks per target layer, or with
    `target_sources` the most source layers one target layer reads.

    Two things keep accumulation at about half the products of the full sums, exactly: only the Gram's upper block
    triangle is summed (source layer `i` with layers `j ≥ i`; the lower blocks are mirrored from it before any read),
    and with `target_sources` each target layer's cross blocks are those of its own source layers only (`K·T`
    blocks instead of `U·T`): a fit pass's union is often much wider than what one of its target layers reads.

    Args:
        source_layers (`int`), target_layers (`int`), num_kv_heads (`int`), head_dim (`int`): the full layout (heads
            and head dim of the source, and of the target unless given).
        sources (`list[int]`): the source layers kept. targets (`list[int]`): the target layers kept.
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`): of the Gram and cross blocks (means are
            float64).
        device (*optional*): where the sums live.
        head_mode (`str`), kv_mode (`str`), *optional*, default to `"all_heads"`, `"joint"`: which blocks to keep.
        target_kv_heads (`int`, *optional*), target_head_dim (`int`, *optional*): the target's KV layout when it
            differs.
        target_sources (`dict[int, list[int]]`, *optional*): per target layer, the source layers its maps read (all
            in `sources`): only those cross blocks are kept. Default: every target layer with every source layer,
            which a re-fit with another selection needs.

    Example:

    ```python
    >>> stats = BlockStatistics(3, 2, 1, 2, sources=[0, 2], targets=[1])
    >>> stats.update(torch.randn(10, 3 * 4), torch.randn(10, 2 * 4))  # full rows: only the kept columns are summed
    >>> stats.xx.shape, stats.xy.shape  # (groups, U·row/G, U·row/G), (groups, K·row/G, T·row/G)
    (torch.Size([1, 8, 8]), torch.Size([1, 8, 4]))
    >>> own = BlockStatistics(3, 2, 1, 2, sources=[0, 2], targets=[0, 1], target_sources={0: [2], 1: [0, 2]})
    >>> own.xy.shape  # target 0 keeps its one block, target 1 its two
    torch.Size([1, 8, 8])
    ```
    """

    def __init__(
        self,
        source_layers: int,
        target_layers: int,
        num_kv_heads: int,
        head_dim: int,
        sources: list[int],
        targets: list[int],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        *,
        head_mode: str = "all_heads",
        kv_mode: str = "joint",
        target_kv_heads: int | None = None,
        target_head_dim: int | None = None,
        target_sources: dict[int, list[int]] | None = None,
    ):
        self.source_layers, self.target_layers = source_layers, target_layers
        self._set_head_layouts(num_kv_heads, head_dim, target_kv_heads, target_head_dim)
        self.head_mode, self.kv_mode = head_mode, kv_mode
        self.sources, self.targets = sorted(set(map(int, sources))), sorted(set(map(int, targets)))
        self.target_sources = self._check_target_sources(target_sources)
        self.dtype = dtype
        device = torch.device(device or "cpu")
        groups = feature_groups(
            self.source_kv_heads, self.source_head_dim, head_mode, kv_mode, self.target_kv_heads, self.target_head_dim
        )
        g = len(groups)
        self._x_width, self._y_width = groups[0][0].numel(), groups[0][1].numel()  # features per layer and group
        p, q = len(self.sources) * self._x_width, len(self.targets) * self._y_width
        reads = max((len(self.target_sources[t]) for t in self.targets), default=0)
        self.count = 0
        self.x_mean = torch.zeros(g, p, dtype=torch.float64, device=device)
        self.y_mean = torch.zeros(g, q, dtype=torch.float64, device=device)
        # per group Σ(x − x̄)(x − x̄)ᵀ: summed in its upper block triangle, the lower blocks mirrored before reads
        self.xx = torch.zeros(g, p, p, dtype=dtype, device=device)
        self._mirrored = True
        # per group Σ(x − x̄)(y − ȳ)ᵀ: target j's columns hold its own source layers' rows, in `sources` order
        self.xy = torch.zeros(g, reads * self._x_width, q, dtype=dtype, device=device)
        self.yy = torch.zeros(g, q, dtype=torch.float64, device=device)  # Σ(y − ȳ)²
        slot = {s: i for i, s in enumerate(self.sources)}
        # per target: union slots of its source layers (the rows of its cross block), and union slot → row, or -1
        self._reads = [[slot[s] for s in self.target_sources[t]] for t in self.targets]
        self._read_row = torch.full((len(self.targets), max(len(self.sources), 1)), -1, dtype=torch.long)
        for j, slots in enumerate(self._reads):
            self._read_row[j, slots] = torch.arange(len(slots))
        self._dense_cross = all(len(r) == len(self.sources) for r in self._reads)

        def columns(layers, row, side):  # (G, len(layers)·width): global feature numbers of each group, layer by layer
            if not layers:  # a rank without a pass holds empty statistics
                return torch.zeros(g, 0, dtype=torch.long)
            return torch.stack([torch.cat([layer * row + group[side] for layer in layers]) for group in groups])

        self._x_cols = columns(self.sources, self.x_row, 0).to(device)
        self._y_cols = columns(self.targets, self.y_row, 1).to(device)
        # global feature number → (group, position in the group); -1: not held
        self._x_group, self._x_pos = self._locate(self._x_cols, source_layers * self.x_row, device)
        self._y_group, self._y_pos = self._locate(self._y_cols, target_layers * self.y_row, device)

    def _check_target_sources(self, target_sources) -> dict[int, list[int]]:
        if target_sources is None:
            return {t: list(self.sources) for t in self.targets}
        given = {int(t): sorted(set(map(int, layers))) for t, layers in dict(target_sources).items()}
        if sorted(given) != self.targets:
            raise StatisticsError(f"target_sources names target layers {sorted(given)}, not {self.targets}")
        for t, layers in given.items():
            if not set(layers) <= set(self.sources):
                raise StatisticsError(
                    f"target layer {t} reads source layers {layers}, which are not all kept ({self.sources})"
                )
        return given

    def _target_columns(self, j: int) -> slice:
        return slice(j * self._y_width, (j + 1) * self._y_width)

    def _source_columns(self, slots: list[int]) -> torch.Tensor:
        """Positions in a group's `p` union features of the union `slots`, layer by layer."""
        w = self._x_width
        return (torch.tensor(slots, dtype=torch.long).unsqueeze(1) * w + torch.arange(w)).reshape(-1)

    def _mirror_(self) -> None:
        """Copies the Gram's upper block triangle onto the lower one (in place, a block at a time)."""
        if self._mirrored:
            return
        w = self._x_width
        for i in range(len(self.sources)):
            for j in range(i + 1, len(self.sources)):
                upper = self.xx[:, i * w : (i + 1) * w, j * w : (j + 1) * w]
                self.xx[:, j * w : (j + 1) * w, i * w : (i + 1) * w].copy_(upper.transpose(1, 2))
        self._mirrored = True

    @staticmethod
    def _locate(cols: torch.Tensor, size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        group = torch.full((size,), -1, dtype=torch.long, device=device)
        pos = torch.full((size,), -1, dtype=torch.long, device=device)
        g, n = cols.shape
        group[cols.reshape(-1)] = torch.arange(g, device=device).repeat_interleave(n)
        pos[cols.reshape(-1)] = torch.arange(n, device=device).repeat(g)
        return group, pos

    @staticmethod
    def nbytes(
        sources: int,
        targets: int,
        row: int,
        dtype: torch.dtype = torch.float32,
        groups: int = 1,
        target_row: int | None = None,
        reads: int | None = None,
    ) -> int:
        """Bytes of one `BlockStatistics` of `sources` source layers of `row` features and `targets` target layers of
        `target_row` features (defaults to `row`), kept in `groups` feature groups, whose target layers read at most
        `reads` source layers each (default: all of them)."""
        p, q = sources * row, targets * (row if target_row is None else target_row)
        cross = (sources if reads is None else min(reads, sources)) * row
        return (p * p + cross * q) // groups * torch.finfo(dtype).bits // 8 + (p + 2 * q) * 8

    @property
    def shape_key(self) -> tuple:
        return (self.source_layers, self.target_layers, *self._head_key())

    def _key(self) -> tuple:
        reads = tuple(tuple(self.target_sources[t]) for t in self.targets)
        return (*self.shape_key, tuple(self.sources), tuple(self.targets), self.head_mode, self.kv_mode, reads)

    # -- accumulation (in place: no temporary the size of a Gram block) ---------------------------------------------
    _merge_what = "block statistics of layers"

    def _merge_key(self) -> tuple:
        return self._key()

    def _outer_(self, dx: torch.Tensor, dy: torch.Tensor, alpha: float) -> None:
        dxs, dys = dx.to(self.dtype), dy.to(self.dtype)  # (G, p), (G, q)
        self._add_gram_(dxs.unsqueeze(1), alpha)  # += alpha·dx dxᵀ, per group
        self._add_cross_(dxs.unsqueeze(1), dys.unsqueeze(1), alpha)  # += alpha·dx dyᵀ

    def _add_gram_(self, xc: torch.Tensor, alpha: float = 1.0) -> None:
        """`xx += alpha·xcᵀ xc` (`xc` `(G, N, p)`) in the upper block triangle only: source layer `i` with layers
        `≥ i`, about half the products; the lower blocks are mirrored from it before the next read."""
        w = self._x_width
        for i in range(len(self.sources)):
            band = xc[:, :, i * w : (i + 1) * w].transpose(1, 2)  # (G, w, N)
            self.xx[:, i * w : (i + 1) * w, i * w :].baddbmm_(band, xc[:, :, i * w :], alpha=alpha)
        self._mirrored = False

    def _add_cross_(self, xc: torch.Tensor, yc: torch.Tensor, alpha: float = 1.0) -> None:
        """`xy += alpha·xcᵀ yc` in the cross blocks kept (`xc` `(G, N, p)`, `yc` `(G, N, q)`): one product when
        every target layer keeps every source layer, else one per target layer, of its own source layers' columns."""
        if self._dense_cross:
            self.xy.baddbmm_(xc.transpose(1, 2), yc, alpha=alpha)
            return
        for j, slots in enumerate(self._reads):
            rows = len(slots) * self._x_width
            x_own = xc.index_select(2, self._source_columns(slots).to(xc.device))  # (G, N, rows)
            cols = self._target_columns(j)
            self.xy[:, :rows, cols].baddbmm_(x_own.transpose(1, 2), yc[:, :, cols], alpha=alpha)

    @torch.no_grad()
    def update(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Adds full rows `x` `(N, F)` and `y` `(N, G)` (only the kept layers' columns are summed), in chunks of
        `_chunk_rows` rows (exact: Chan's merge)."""
        if x.shape[0] != y.shape[0] or x.shape[1] != self._x_group.numel() or y.shape[1] != self._y_group.numel():
            raise StatisticsError(
                f"rows of shape {tuple(x.shape)} / {tuple(y.shape)} do not fit statistics with "
                f"F={self._x_group.numel()}, G={self._y_group.numel()}"
            )
        if x.shape[0] == 0:
            return
        if x.shape[0] > (chunk := _chunk_rows(self._x_cols.numel() + self._y_cols.numel())):
            for start in range(0, x.shape[0], chunk):
                self.update(x[start : start + chunk], y[start : start + chunk])
            return
        device = self.xx.device
        x, y = x.to(device), y.to(device)
        xs = torch.stack([x[:, cols] for cols in self._x_cols]).to(torch.float64)  # (G, N, p)
        ys = torch.stack([y[:, cols] for cols in self._y_cols]).to(torch.float64)  # (G, N, q)
        mx, my = xs.mean(1), ys.mean(1)  # (G, p), (G, q)
        yc64 = ys - my.unsqueeze(1)
        xc, yc = (xs - mx.unsqueeze(1)).to(self.dtype), yc64.to(self.dtype)  # centred on the batch's own means
        del xs, ys
        f, share = _chan_merge(self.count, x.shape[0])
        self._add_gram_(xc)  # += Σ xc xcᵀ per group
        self._add_cross_(xc, yc)  # += Σ xc ycᵀ
        self.yy.add_((yc64 * yc64).sum(1))
        self._shift(f, share, x.shape[0], mx, my)

    def copy(self) -> BlockStatistics:
        key = self.shape_key
        new = BlockStatistics(
            *key[:4],
            **target_heads_of(key),
            sources=self.sources,
            targets=self.targets,
            dtype=self.dtype,
            device=self.xx.device,
            head_mode=self.head_mode,
            kv_mode=self.kv_mode,
            target_sources=self.target_sources,
        )
        return new.merge_(self)

    def __add__(self, other: BlockStatistics) -> BlockStatistics:
        return self.copy().merge_(other)

    # -- indexing (global layer numbers, as in `KVStatistics`) ------------------------------------------------------
    @property
    def _index_device(self) -> torch.device:
        return self.xx.device

    def _local(self, index: torch.Tensor, what: str) -> tuple[int, torch.Tensor]:
        """`(group, positions)` of global feature numbers `index`, which must all lie in one kept group."""
        group_of, pos_of = (self._x_group, self._x_pos) if what == "source" else (self._y_group, self._y_pos)
        index = index.to(group_of.device)
        groups, pos = group_of[index], pos_of[index]
        if (groups < 0).any():
            row = self.x_row if what == "source" else self.y_row
            missing = sorted({int(i) // row for i in index[groups < 0].cpu()})
            raise StatisticsError(
                f"these block statistics hold {what} layers {self.sources if what == 'source' else self.targets}, "
                f"not {missing}; accumulate statistics for the layers the fit needs"
            )
        if groups.numel() and (groups != groups[0]).any():
            raise StatisticsError(
                f"these block statistics keep {self.head_mode}/{self.kv_mode} blocks only; the fit asks for "
                f"{what} features across them (fit with the head_mode and kv_mode they were accumulated for)"
            )
        return (int(groups[0]) if groups.numel() else 0), pos

    def moments(self, x_idx: torch.Tensor, y_idx: torch.Tensor):
        """Means and centred (co)variances over the selected (global) features, divided by `count`.

        Returns:
            `(mean_x (p,), mean_y (q,), cov_xx (p, p), cov_xy (p, q), var_y (q,))`, float64.
        """
        if self.count == 0:
            raise StatisticsError("statistics hold no tokens")
        (gx, xl), (gy, yl) = self._local(x_idx, "source"), self._local(y_idx, "target")
        if gx != gy:
            raise StatisticsError(
                f"these block statistics keep {self.head_mode}/{self.kv_mode} blocks only; source group {gx} and "
                f"target group {gy} were not summed together"
            )
        self._mirror_()
        n = self.count
        cxx = self.xx[gx][xl.unsqueeze(1), xl.unsqueeze(0)].to(torch.float64) / n  # one gather, no (p, P) copy
        cxy = self.xy[gx][self._cross_rows(xl, yl).unsqueeze(1), yl.unsqueeze(0)].to(torch.float64) / n
        return self.x_mean[gx][xl], self.y_mean[gy][yl], cxx, cxy, self.yy[gy][yl] / n

    def _cross_rows(self, xl: torch.Tensor, yl: torch.Tensor) -> torch.Tensor:
        """Rows of `xy` holding union positions `xl` for the target columns `yl` (or `StatisticsError`)."""
        if self._dense_cross:
            return xl
        read_row = self._read_row.to(xl.device)
        owners = torch.unique(yl // self._y_width)
        if owners.numel() > 1:
            raise StatisticsError(
                "these block statistics keep each target layer's cross blocks with its own source layers only; "
                f"query one target layer at a time, not {[self.targets[int(j)] for j in owners]}"
            )
        j = int(owners[0]) if owners.numel() else 0
        slot_rows = read_row[j][xl // self._x_width]
        if (slot_rows < 0).any():
            missing = sorted({self.sources[int(i)] for i in (xl // self._x_width)[slot_rows < 0].cpu()})
            raise StatisticsError(
                f"these block statistics keep target layer {self.targets[j]}'s cross blocks with source layers "
                f"{self.target_sources[self.targets[j]]} only, not {missing}; accumulate them with "
                "target_sources that include the layers the fit reads"
            )
        return slot_rows * self._x_width + xl % self._x_width

    # -- persistence ------------------------------------------------------------------------------------------------
    _MODES = ({"all_heads": 0, "same_head": 1}, {"joint": 0, "separate": 1})

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {name: getattr(self, name).contiguous() for name in ("x_mean", "y_mean", "xx", "xy", "yy")}
        state["count"] = torch.tensor([self.count], dtype=torch.int64)
        state["shape_key"] = torch.tensor(self.shape_key, dtype=torch.int64)
        state["sources"] = torch.tensor(self.sources, dtype=torch.int64)
        state["targets"] = torch.tensor(self.targets, dtype=torch.int64)
        state["modes"] = torch.tensor([self._MODES[0][self.head_mode], self._MODES[1][self.kv_mode]])
        reads = max((len(r) for r in self._reads), default=0)
        state["target_sources"] = torch.tensor(
            [self.target_sources[t] + [-1] * (reads - len(self.target_sources[t])) for t in self.targets],
            dtype=torch.int64,
        ).reshape(len(self.targets), reads)  # (T, K), -1: padding
        return state

    def save(self, path: str | Path) -> None:
        save_file({k: v.cpu() for k, v in self.state_dict().items()}, str(path))

    @classmethod
    def load(cls, path: str | Path, device: torch.device | str | None = None) -> BlockStatistics:
        state = load_file(str(path))
        head_mode, kv_mode = (list(names)[int(i)] for names, i in zip(cls._MODES, state["modes"].tolist()))
        targets = state["targets"].tolist()
        reads = None
        if "target_sources" in state:  # absent in files written before cross blocks were kept per target layer
            reads = {t: [s for s in row if s >= 0] for t, row in zip(targets, state["target_sources"].tolist())}
        stats = cls(
            *state["shape_key"].tolist(),
            sources=state["sources"].tolist(),
            targets=targets,
            dtype=state["xx"].dtype,
            device=device,
            head_mode=head_mode,
            kv_mode=kv_mode,
            target_sources=reads,
        )
        stats.count = int(state["count"].item())
        for name in ("x_mean", "y_mean", "xx", "xy", "yy"):
            getattr(stats, name).copy_(state[name])
        stats._mirrored = False
        return stats


class SelectionStatistics(_CentredSums, HeadLayouts):
    """Small statistics for choosing layers: per KV head `h` and per K/V, source layer `s`'s `d × d` Gram block and
    its `d × d` cross blocks with every target layer's same head and same K/V (centred sums).

    They give the held-out R² of predicting target layer `t` from source layer `s` head by head and K from K, V from
    V (`single_layer_r2`), which ranks source layers like the all-heads single-layer R² (see the README's
    measurement) at `H·2·L_s·d·(d + L_t·d)` numbers instead of `L_s·row·(L_s + L_t)·row`.

    When the two layouts differ, "head" is a head *group*: `g = gcd(H_s, H_t)` groups, group `i` holding source heads
    `i·H_s/g …` and target heads `i·H_t/g …` (one head each for equal counts, all heads when the counts share no
    factor), so a block is `d_x = (H_s/g)·d_s` source by `d_y = (H_t/g)·d_t` target features.

    Args:
        source_layers (`int`), target_layers (`int`), num_kv_heads (`int`), head_dim (`int`): the layout (the
            source's, and the target's unless given).
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`), device (*optional*).
        target_kv_heads (`int`, *optional*), target_head_dim (`int`, *optional*): the target's layout when it differs.

    Example:

    ```python
    >>> stats = SelectionStatistics(2, 3, 1, 2)
    >>> stats.update(torch.randn(50, 2 * 4), torch.randn(50, 3 * 4))
    >>> stats.xy.shape  # (H·2, L_s·d, L_t·d)
    torch.Size([2, 4, 6])
    ```
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
        self.dtype = dtype
        self.groups = math.gcd(self.source_kv_heads, self.target_kv_heads)
        b, dx, dy = self.groups * 2, self.x_width, self.y_width
        kw = {"device": device or "cpu"}
        self.count = 0
        self.x_mean = torch.zeros(b, source_layers * dx, dtype=torch.float64, **kw)
        self.y_mean = torch.zeros(b, target_layers * dy, dtype=torch.float64, **kw)
        self.xx = torch.zeros(b, source_layers, dx, dx, dtype=dtype, **kw)  # diagonal Gram blocks only
        self.xy = torch.zeros(b, source_layers * dx, target_layers * dy, dtype=dtype, **kw)
        self.yy = torch.zeros(b, target_layers * dy, dtype=torch.float64, **kw)

    @property
    def x_width(self) -> int:
        """Source features of one layer in one block: `(H_s / g)·d_s`."""
        return self.source_kv_heads // self.groups * self.source_head_dim

    @property
    def y_width(self) -> int:
        """Target features of one layer in one block: `(H_t / g)·d_t`."""
        return self.target_kv_heads // self.groups * self.target_head_dim

    @staticmethod
    def nbytes(
        source_layers: int,
        target_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype=torch.float32,
        target_kv_heads: int | None = None,
        target_head_dim: int | None = None,
    ) -> int:
        """Bytes of one `SelectionStatistics`."""
        heads_t = num_kv_heads if target_kv_heads is None else target_kv_heads
        dim_t = head_dim if target_head_dim is None else target_head_dim
        g = math.gcd(num_kv_heads, heads_t)
        b, dx, dy = g * 2, num_kv_heads // g * head_dim, heads_t // g * dim_t
        numbers = b * source_layers * dx * (dx + target_layers * dy)
        return numbers * torch.finfo(dtype).bits // 8 + b * (source_layers * dx + 2 * target_layers * dy) * 8

    @property
    def shape_key(self) -> tuple[int, ...]:
        return (self.source_layers, self.target_layers, *self._head_key())

    def _split(self, rows: torch.Tensor, layers: int, heads: int, dim: int) -> torch.Tensor:
        """`(N, L·H·2d)` rows → `(g·2, N, L·(H/g)·d)`: per head group and K/V, the layers side by side."""
        n, g = rows.shape[0], self.groups
        return (
            rows.view(n, layers, g, heads // g, 2, dim)
            .permute(2, 4, 0, 1, 3, 5)
            .reshape(g * 2, n, layers * heads // g * dim)
        )

    _merge_what = "statistics of layouts"

    def _outer_(self, dx: torch.Tensor, dy: torch.Tensor, alpha: float) -> None:
        b, d, ls = self.groups * 2, self.x_width, self.source_layers
        dxb = dx.view(b * ls, d).to(self.dtype)  # dx (B, L_s·d_x): the diagonal d_x × d_x blocks only
        self.xx.view(b * ls, d, d).baddbmm_(dxb.unsqueeze(2), dxb.unsqueeze(1), alpha=alpha)
        self.xy.baddbmm_(
            dx.to(self.dtype).unsqueeze(2), dy.to(self.dtype).unsqueeze(1), alpha=alpha
        )  # dy (B, L_t·d_y)

    @torch.no_grad()
    def update(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Adds full rows `x` `(N, F)` and `y` `(N, G)`, in chunks of `_chunk_rows` rows (exact: Chan's merge)."""
        if x.shape[0] != y.shape[0] or x.shape[1] != self.x_mean.numel() or y.shape[1] != self.yy.numel():
            raise StatisticsError(
                f"rows of shape {tuple(x.shape)} / {tuple(y.shape)} do not fit selection statistics with "
                f"F={self.x_mean.numel()}, G={self.yy.numel()}"
            )
        if x.shape[0] == 0:
            return
        if x.shape[0] > (chunk := _chunk_rows(x.shape[1] + y.shape[1])):
            for start in range(0, x.shape[0], chunk):
                self.update(x[start : start + chunk], y[start : start + chunk])
            return
        device = self.xx.device
        xs = self._split(x.to(device, torch.float64), self.source_layers, self.source_kv_heads, self.source_head_dim)
        ys = self._split(y.to(device, torch.float64), self.target_layers, self.target_kv_heads, self.target_head_dim)
        mx, my = xs.mean(1), ys.mean(1)  # (B, L_s·d_x), (B, L_t·d_y)
        yc64 = ys - my.unsqueeze(1)
        xc, yc = (xs - mx.unsqueeze(1)).to(self.dtype), yc64.to(self.dtype)
        b, n, d = xc.shape[0], xc.shape[1], self.x_width
        del xs, ys
        blocks = xc.view(b, n, self.source_layers, d).permute(0, 2, 1, 3).reshape(b * self.source_layers, n, d)
        f, share = _chan_merge(self.count, n)
        self.xx.view(-1, d, d).baddbmm_(blocks.transpose(1, 2), blocks)  # (B·L_s, d_x, d_x), in place
        self.xy.baddbmm_(xc.transpose(1, 2), yc)  # (B, L_s·d_x, L_t·d_y), in place: no temporary of that size
        self.yy.add_((yc64 * yc64).sum(1))
        self._shift(f, share, n, mx, my)

    def single_layer_r2(self, heldout: SelectionStatistics, ridge_lambda: float = 0.01) -> torch.Tensor:
        """Held-out R² of predicting each target layer from each single source layer, head h from head h, K from K
        and V from V (centred ridge, λ relative to each feature's variance as in `hf_kvbridge.solve`).

        Returns:
            `torch.Tensor` of shape `(target_layers, source_layers, 2)`: R² of K and V, averaged over heads.
        """
        if self.count <= self.x_width or heldout.count == 0:
            raise StatisticsError(
                f"selection needs more than {self.x_width} train tokens and some held-out tokens, got {self.count} "
                f"and {heldout.count}; use more calibration sequences"
            )
        b, d, e = self.groups * 2, self.x_width, self.y_width  # e: target features of a block and layer
        ls, lt = self.source_layers, self.target_layers
        n, m = self.count, heldout.count
        sse = torch.zeros(b, ls, lt, dtype=torch.float64)
        sst = torch.zeros(b, 1, lt, dtype=torch.float64)
        for i in range(b):  # one (head, K/V) block at a time: float64 copies of 1/(2H) of the cross sums
            cxx = self.xx[i].to(torch.float64) / n  # (L_s, d, d)
            var = torch.diagonal(cxx, dim1=-2, dim2=-1)  # (L_s, d)
            floor = 1e-6 * var.mean(-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
            system = cxx + torch.diag_embed(ridge_lambda * torch.maximum(var, floor))
            cxy = (self.xy[i].to(torch.float64) / n).view(ls, d, lt * e)  # (L_s, d, L_t·e)
            weight = torch.linalg.lstsq(system, cxy).solution if ridge_lambda == 0 else torch.linalg.solve(system, cxy)
            del cxy
            mx, my = self.x_mean[i].view(ls, 1, d), self.y_mean[i].view(1, lt * e)
            bias = my - (mx @ weight).squeeze(-2)  # (L_s, L_t·e)
            # held-out residuals from held-out centred moments (see `centred_residual_sums`)
            hxx = heldout.xx[i].to(torch.float64) / m  # (L_s, d, d)
            hxy = (heldout.xy[i].to(torch.float64) / m).view(ls, d, lt * e)
            hvy = (heldout.yy[i] / m).view(1, lt * e)
            hmx, hmy = heldout.x_mean[i].view(ls, 1, d), heldout.y_mean[i].view(1, lt * e)
            offset = hmy - (hmx @ weight).squeeze(-2) - bias  # (L_s, L_t·e)
            explained = ((hxx @ weight) * weight).sum(-2) - 2 * (hxy * weight).sum(-2)  # (L_s, L_t·e)
            sse[i] = (hvy + explained + offset * offset).view(ls, lt, e).sum(-1)
            sst[i] = hvy.view(1, lt, e).sum(-1)
        sse, sst = sse.view(self.groups, 2, ls, lt), sst.view(self.groups, 2, 1, lt)
        r2 = (1 - sse / sst.clamp_min(torch.finfo(torch.float64).tiny)).mean(0)  # (2, L_s, L_t): mean over heads
        return r2.permute(2, 1, 0).contiguous()  # (L_t, L_s, 2)

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {name: getattr(self, name).contiguous() for name in ("x_mean", "y_mean", "xx", "xy", "yy")}
        state["count"] = torch.tensor([self.count], dtype=torch.int64)
        state["shape_key"] = torch.tensor(self.shape_key, dtype=torch.int64)
        return state

    def save(self, path: str | Path) -> None:
        save_file({k: v.cpu() for k, v in self.state_dict().items()}, str(path))

    @classmethod
    def load(cls, path: str | Path, device: torch.device | str | None = None) -> SelectionStatistics:
        state = load_file(str(path))
        key = state["shape_key"].tolist()
        stats = cls(*key[:4], dtype=state["xx"].dtype, device=device, **target_heads_of(key))
        stats.count = int(state["count"].item())
        for name in ("x_mean", "y_mean", "xx", "xy", "yy"):
            getattr(stats, name).copy_(state[name])
        return stats
