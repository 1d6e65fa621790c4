"""[`SelectionStatistics`]: per KV head and per K/V, each source layer's Gram block and its cross blocks with every
target layer, enough to rank source layers by held-out single-layer R²."""

from __future__ import annotations

import logging
import math

import torch

from ...errors import StatisticsError
from ..solve import ridge_from_moments
from .base import (
    CentredSums,
    LayerPairStatistics,
    StatisticsFile,
    centred_residual_sums,
    chan_merge,
    chunk_rows,
    has_rows,
)

logger = logging.getLogger(__name__)


class SelectionStatistics(CentredSums, StatisticsFile, LayerPairStatistics):
    """Small statistics for choosing layers: per KV head `h` and per K/V, source layer `s`'s `d × d` Gram block and
    its `d × d` cross blocks with every target layer's same head and same K/V (centred sums).

    They give the held-out R² of predicting target layer `t` from source layer `s` head by head and K from K, V from
    V (`single_layer_r2`), which ranks source layers like the all-heads single-layer R² (see the README's
    measurement) at `H·2·L_s·d·(d + L_t·d)` numbers instead of `L_s·row·(L_s + L_t)·row`.

    When the two layouts differ, "head" is a head *group*: `g = gcd(H_s, H_t)` groups, group `i` holding source heads
    `i·H_s/g …` and target heads `i·H_t/g …` (one head each for equal counts, all heads when the counts share no
    factor), so a block is `d_x = (H_s/g)·d_s` source by `d_y = (H_t/g)·d_t` target features.

    Args:
        the layout arguments: as [`LayerPairStatistics`] (`dtype`: of the Gram and cross blocks, means are float64).

    Example:

    ```python
    >>> stats = SelectionStatistics(2, 3, 1, 2)
    >>> stats.update(torch.randn(50, 2 * 4), torch.randn(50, 3 * 4))
    >>> stats.xy.shape  # (H·2, L_s·d, L_t·d)
    torch.Size([2, 4, 6])
    ```
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.groups = math.gcd(self.source_kv_heads, self.target_kv_heads)
        b, dx, dy = self.groups * 2, self.x_width, self.y_width
        ls, lt, kw = self.source_layers, self.target_layers, {"device": self.device}
        self.count = 0
        self.x_mean = torch.zeros(b, ls * dx, dtype=torch.float64, **kw)
        self.y_mean = torch.zeros(b, lt * dy, dtype=torch.float64, **kw)
        self.xx = torch.zeros(b, ls, dx, dx, dtype=self.dtype, **kw)  # diagonal Gram blocks only
        self.xy = torch.zeros(b, ls * dx, lt * dy, dtype=self.dtype, **kw)
        self.yy = torch.zeros(b, lt * dy, dtype=torch.float64, **kw)

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
        if not has_rows(x, y, self.x_mean.numel(), self.yy.numel(), "selection statistics"):
            return
        if x.shape[0] > (chunk := chunk_rows(x.shape[1] + y.shape[1])):
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
        f, share = chan_merge(self.count, n)
        self.xx.view(-1, d, d).baddbmm_(blocks.transpose(1, 2), blocks)  # (B·L_s, d_x, d_x), in place
        self.xy.baddbmm_(xc.transpose(1, 2), yc)  # (B, L_s·d_x, L_t·d_y), in place: no temporary of that size
        self.yy.add_((yc64 * yc64).sum(1))
        self._shift(f, share, n, mx, my)

    def single_layer_r2(self, heldout: SelectionStatistics, ridge_lambda: float = 0.01) -> torch.Tensor:
        """Held-out R² of predicting each target layer from each single source layer, head h from head h, K from K
        and V from V (centred ridge, λ relative to each feature's variance as in `hf_kvbridge.fitting.solve`).

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
            cxy = (self.xy[i].to(torch.float64) / n).view(ls, d, lt * e)  # (L_s, d, L_t·e)
            mx, my = self.x_mean[i].view(ls, d), self.y_mean[i].view(1, lt * e)
            weight, bias = ridge_from_moments(cxx, cxy, mx, my, ridge_lambda)  # (L_s, d, L_t·e), (L_s, L_t·e)
            del cxx, cxy
            # held-out residuals from held-out centred moments
            hxx = heldout.xx[i].to(torch.float64) / m  # (L_s, d, d)
            hxy = (heldout.xy[i].to(torch.float64) / m).view(ls, d, lt * e)
            hvy = (heldout.yy[i] / m).view(1, lt * e)
            hmx, hmy = heldout.x_mean[i].view(ls, d), heldout.y_mean[i].view(1, lt * e)
            block_sse, block_sst = centred_residual_sums(m, hmx, hmy, hxx, hxy, hvy, weight, bias)  # (L_s, L_t·e)
            sse[i] = block_sse.view(ls, lt, e).sum(-1)
            sst[i] = block_sst.view(1, lt, e).sum(-1)
        sse, sst = sse.view(self.groups, 2, ls, lt), sst.view(self.groups, 2, 1, lt)
        r2 = (1 - sse / sst.clamp_min(torch.finfo(torch.float64).tiny)).mean(0)  # (2, L_s, L_t): mean over heads
        return r2.permute(2, 1, 0).contiguous()  # (L_t, L_s, 2)
