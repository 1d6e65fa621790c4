"""[`KVStatistics`]: the dense sums of every source layer against every target layer (see `statistics.base`)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ...errors import StatisticsError
from ...utils.heads import target_heads_of
from .base import GlobalLayerIndex, LayerPairStatistics, StatisticsFile, centred_residual_sums, chan_merge, has_rows

logger = logging.getLogger(__name__)

_FIELDS = ("x_sum", "y_sum", "xx", "xy", "yy")


class KVStatistics(GlobalLayerIndex, StatisticsFile, LayerPairStatistics):
    """Sums over calibration tokens of source rows `x` and target rows `y` (see the module docstring).

    Args:
        source_layers (`int`), target_layers (`int`), num_kv_heads (`int`), head_dim (`int`), device (*optional*),
            target_kv_heads (`int`, *optional*), target_head_dim (`int`, *optional*): the layout arguments, as
            [`LayerPairStatistics`] takes them, without `dtype`: the sums are float64 (so `device` comes fifth).

    Example:

    ```python
    >>> stats = KVStatistics(source_layers=2, target_layers=3, num_kv_heads=1, head_dim=2)
    >>> stats.update(torch.randn(10, 2 * 4), torch.randn(10, 3 * 4))
    >>> stats.count
    10
    ```
    """

    def __init__(self, *layout, device: torch.device | str | None = None, **named):
        if len(layout) == 5:  # `device` given fifth
            layout, device = layout[:4], layout[4]
        super().__init__(*layout, dtype=torch.float64, device=device, **named)  # the layout is declared there
        f, g = self.source_layers * self.x_row, self.target_layers * self.y_row  # x_row, y_row: features per layer
        kw = {"dtype": self.dtype, "device": self.device}
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
        if not has_rows(x, y, self.x_sum.numel(), self.y_sum.numel()):
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
        f, _ = chan_merge(n_a, n_b)
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
    _fields = _FIELDS

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {**super().state_dict(), "centred": torch.tensor([1], dtype=torch.int64)}

    @classmethod
    def _from_state(cls, state: dict[str, torch.Tensor], path: str | Path, device) -> KVStatistics:
        if "centred" not in state:
            raise StatisticsError(
                f"{path} holds raw (uncentred) statistics of an older hf_kvbridge; delete the checkpoint and "
                "calibrate again"
            )
        key = state["shape_key"].tolist()
        return cls(*key[:4], device=device, **target_heads_of(key))
