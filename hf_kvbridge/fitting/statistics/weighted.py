"""[`WeightedKVStatistics`]: [`KVStatistics`] whose tokens carry weights (the attention-weighted ridge,
`mappers.weighted`)."""

from __future__ import annotations

import torch

from ...errors import InvalidInputError
from .dense import KVStatistics


class WeightedKVStatistics(KVStatistics):
    """[`KVStatistics`] whose tokens carry weights: `count` is `Σw` (a float) and every sum is weighted.

    With all weights 1 it holds exactly what `KVStatistics` holds, so `solve_ridge` and `residual_sums` apply as
    they are.

    Example:

    ```python
    >>> stats = WeightedKVStatistics(source_layers=1, target_layers=1, num_kv_heads=1, head_dim=2)
    >>> stats.update(torch.randn(10, 4), torch.randn(10, 4), weight=torch.full((10,), 0.5))
    >>> stats.count
    5.0
    ```
    """

    @torch.no_grad()
    def update(self, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor | None = None) -> None:
        """Adds `x (N, F)` and `y (N, G)` with per-token `weight (N,)` (all 1 when `None`)."""
        if weight is None:
            weight = torch.ones(x.shape[0])
        if weight.numel() != x.shape[0]:
            raise InvalidInputError(f"{weight.numel()} weights for {x.shape[0]} tokens: pass one weight per token")
        x = x.to(self.xx.device, torch.float64)
        y = y.to(self.xx.device, torch.float64)
        w = weight.to(self.xx.device, torch.float64).reshape(-1, 1)  # (N, 1)
        total = float(w.sum())
        if total == 0:
            return
        mx, my = (w * x).sum(0) / total, (w * y).sum(0) / total  # weighted means
        xc, yc = x - mx, y - my
        wx = w * xc  # (N, F)
        self.count = float(self.count)
        # Σ w (x − x̄)(x − x̄)ᵀ, Σ w (x − x̄)(y − ȳ)ᵀ, Σ w (y − ȳ)², merged as in `KVStatistics`
        self._add_centred(total, mx, my, wx.T @ xc, wx.T @ yc, (w * yc * yc).sum(0))
