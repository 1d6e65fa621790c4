"""Streamed sufficient statistics of source and target KV rows (additive, so they merge and all-reduce).

For every calibration token we see one source row `x` (all source layers, `F = L_s · H · 2d` features: per layer,
per head, content-space key then value) and one target row `y` (`G = L_t · H · 2d`). We keep

    count = n,   x_sum = Σx (F),   y_sum = Σy (G),   xx = Σxxᵀ (F, F),   xy = Σxyᵀ (F, G),   yy = Σy² (G)

in float64. Any subset of source layers, any head mode and any `top_k` is then a slice of these, so one pass over
the models is enough for layer selection and every fit. Memory is independent of the number of tokens.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .errors import StatisticsError

logger = logging.getLogger(__name__)

_FIELDS = ("x_sum", "y_sum", "xx", "xy", "yy")


class KVStatistics:
    """Sums over calibration tokens of source rows `x` and target rows `y` (see the module docstring).

    Args:
        source_layers (`int`), target_layers (`int`): number of cache layers of each model.
        num_kv_heads (`int`), head_dim (`int`): the shared KV layout.
        device (`torch.device`, *optional*): where the sums live (defaults to CPU).

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
    ):
        self.source_layers, self.target_layers = source_layers, target_layers
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.row = num_kv_heads * 2 * head_dim  # features of one layer
        f, g = source_layers * self.row, target_layers * self.row
        kw = {"dtype": torch.float64, "device": device or "cpu"}
        self.count = 0
        self.x_sum = torch.zeros(f, **kw)
        self.y_sum = torch.zeros(g, **kw)
        self.xx = torch.zeros(f, f, **kw)
        self.xy = torch.zeros(f, g, **kw)
        self.yy = torch.zeros(g, **kw)

    @property
    def shape_key(self) -> tuple[int, int, int, int]:
        return (self.source_layers, self.target_layers, self.num_kv_heads, self.head_dim)

    @torch.no_grad()
    def update(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Adds `x` `(N, F)` and `y` `(N, G)` (N tokens) to the sums."""
        if x.shape[0] != y.shape[0] or x.shape[1] != self.x_sum.numel() or y.shape[1] != self.y_sum.numel():
            raise StatisticsError(
                f"rows of shape {tuple(x.shape)} / {tuple(y.shape)} do not fit statistics with F={self.x_sum.numel()}"
                f", G={self.y_sum.numel()}"
            )
        x = x.to(self.xx.device, torch.float64)
        y = y.to(self.xx.device, torch.float64)
        self.count += x.shape[0]
        self.x_sum += x.sum(0)
        self.y_sum += y.sum(0)
        self.xx.addmm_(x.T, x)  # (F, N) @ (N, F)
        self.xy.addmm_(x.T, y)  # (F, N) @ (N, G)
        self.yy += (y * y).sum(0)

    def merge_(self, other: KVStatistics) -> KVStatistics:
        """Adds `other` into `self` in place and returns `self` (statistics are additive)."""
        if other.shape_key != self.shape_key:
            raise StatisticsError(f"cannot merge statistics of layouts {self.shape_key} and {other.shape_key}")
        self.count += other.count
        for name in _FIELDS:
            getattr(self, name).add_(getattr(other, name).to(self.xx.device))
        return self

    def all_reduce_(self) -> KVStatistics:
        """Sums the statistics of every `torch.distributed` rank into each of them (in place)."""
        import torch.distributed as dist

        count = torch.tensor([float(self.count)], dtype=torch.float64, device=self.xx.device)
        dist.all_reduce(count)
        self.count = int(count.item())
        for name in _FIELDS:
            dist.all_reduce(getattr(self, name))
        return self

    def __add__(self, other: KVStatistics) -> KVStatistics:
        return self.copy().merge_(other)

    def copy(self) -> KVStatistics:
        new = KVStatistics(*self.shape_key, device=self.xx.device)
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
    def _index(self, layers: list[int], head: int | None) -> torch.Tensor:
        if head is None:
            parts = [torch.arange(layer * self.row, (layer + 1) * self.row) for layer in layers]
        else:
            span = 2 * self.head_dim
            parts = [
                torch.arange(layer * self.row + head * span, layer * self.row + (head + 1) * span) for layer in layers
            ]
        return torch.cat(parts).to(self.xx.device)

    def source_index(self, layers: list[int], head: int | None = None) -> torch.Tensor:
        """Feature indices of `layers` (in that order), all heads or only `head`."""
        return self._index(layers, head)

    def target_index(self, layer: int, head: int | None = None) -> torch.Tensor:
        return self._index([layer], head)

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
        cxx = self.xx[x_idx][:, x_idx] / n - torch.outer(mx, mx)
        cxy = self.xy[x_idx][:, y_idx] / n - torch.outer(mx, my)
        vy = self.yy[y_idx] / n - my * my
        return mx, my, cxx, cxy, vy

    def residual_sums(self, x_idx, y_idx, weight: torch.Tensor, bias: torch.Tensor):
        """Per output column, `Σ(y - xW - b)²` and `Σ(y - ȳ)²` over these tokens, from the sums alone.

        Args:
            weight (`torch.Tensor` of shape `(p, q)`), bias (`(q,)`): a fitted map from `x[x_idx]` to `y[y_idx]`.

        Returns:
            `(sse (q,), sst (q,))` float64, for R² = 1 - sse / sst.
        """
        n = self.count
        w, b = weight.to(torch.float64), bias.to(torch.float64)
        xx = self.xx[x_idx][:, x_idx]
        xy = self.xy[x_idx][:, y_idx]
        sx, sy, yy = self.x_sum[x_idx], self.y_sum[y_idx], self.yy[y_idx]
        pred_sq = ((xx @ w) * w).sum(0) + 2 * b * (sx @ w) + n * b * b  # Σ (xW + b)²
        cross = (xy * w).sum(0) + b * sy  # Σ y (xW + b)
        sse = (yy - 2 * cross + pred_sq).clamp_min(0)
        sst = (yy - sy * sy / n).clamp_min(0)
        return sse, sst

    # -- persistence ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {name: getattr(self, name).contiguous() for name in _FIELDS}
        state["count"] = torch.tensor([self.count], dtype=torch.int64)
        state["shape_key"] = torch.tensor(self.shape_key, dtype=torch.int64)
        return state

    def save(self, path: str | Path) -> None:
        save_file({k: v.cpu() for k, v in self.state_dict().items()}, str(path))

    @classmethod
    def load(cls, path: str | Path, device: torch.device | str | None = None) -> KVStatistics:
        state = load_file(str(path))
        stats = cls(*state["shape_key"].tolist(), device=device)
        stats.count = int(state["count"].item())
        for name in _FIELDS:
            getattr(stats, name).copy_(state[name])
        return stats
