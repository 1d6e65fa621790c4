"""The calibration rows themselves, for fits from fewer tokens than map inputs.

With `n` tokens and maps of `p > n` inputs, the sums of [`BlockStatistics`] (`p × p` per map) are larger than the
rows they sum (`n × p`), and a ridge map of every λ lies in the row space of the training rows, so the λ search and
the refit need only `n × n` kernels (`hf_kvbridge.fitting.solve`, "Fewer tokens than inputs"). [`RowStatistics`] keeps
the rows of `sources` and `targets` and answers what the solve asks of statistics (`count`, `source_index`,
`target_index`, `moments`, `residual_sums`, `rows`), with global layer numbers as in [`KVStatistics`].
"""

from __future__ import annotations

import torch

from ...errors import StatisticsError
from .base import GlobalLayerIndex, KeptLayerStatistics, has_rows, head_index


class RowStatistics(GlobalLayerIndex, KeptLayerStatistics):
    """The rows of source layers `sources` and target layers `targets` over calibration tokens.

    Args:
        the kept layers and the layout arguments: as [`KeptLayerStatistics`] (`dtype`: of the kept rows, `device`:
            where they live).

    Memory: `n · (U·x_row + T·y_row)` numbers for `n` tokens, `U` source and `T` target layers (`nbytes`).

    Example:

    ```python
    >>> stats = RowStatistics(3, 2, 1, 2, sources=[0, 2], targets=[1])
    >>> stats.update(torch.randn(10, 3 * 4), torch.randn(10, 2 * 4))  # full rows: the kept layers' columns are kept
    >>> x, y = stats.rows(stats.source_index([2]), stats.target_index(1))
    >>> stats.count, x.shape, y.shape
    (10, torch.Size([10, 4]), torch.Size([10, 4]))
    ```
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._x_cols = head_index(self.x_row, self.source_head_dim, self.sources, None, self.device)  # (U·x_row,)
        self._y_cols = head_index(self.y_row, self.target_head_dim, self.targets, None, self.device)  # (T·y_row,)
        # global feature number → position in the kept rows; -1: not kept
        self._x_pos = self._positions(self._x_cols, self.source_layers * self.x_row)
        self._y_pos = self._positions(self._y_cols, self.target_layers * self.y_row)
        self._x: list[torch.Tensor] = []  # (n_b, U·x_row) per batch
        self._y: list[torch.Tensor] = []  # (n_b, T·y_row)
        self.count = 0

    def _positions(self, cols: torch.Tensor, size: int) -> torch.Tensor:
        pos = torch.full((size,), -1, dtype=torch.long, device=self.device)
        pos[cols] = torch.arange(cols.numel(), device=self.device)
        return pos

    @staticmethod
    def nbytes(tokens: int, sources: int, targets: int, x_row: int, y_row: int, dtype=torch.float32) -> int:
        """Bytes of the rows of `tokens` tokens over `sources` source and `targets` target layers."""
        return tokens * (sources * x_row + targets * y_row) * torch.finfo(dtype).bits // 8

    @torch.no_grad()
    def update(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Keeps the kept layers' columns of full rows `x` `(N, F)` and `y` `(N, G)`."""
        if not has_rows(x, y, self._x_pos.numel(), self._y_pos.numel()):
            return
        self._x.append(x.to(self.device)[:, self._x_cols].to(self.dtype))
        self._y.append(y.to(self.device)[:, self._y_cols].to(self.dtype))
        self.count += x.shape[0]

    def merge_(self, other: RowStatistics) -> RowStatistics:
        """Adds `other`'s rows (the same layers) to these, in place."""
        if (other.sources, other.targets, other._x_pos.numel()) != (self.sources, self.targets, self._x_pos.numel()):
            raise StatisticsError("row statistics of different layers cannot be merged")
        self._x += other._x
        self._y += other._y
        self.count += other.count
        return self

    def __add__(self, other: RowStatistics) -> RowStatistics:
        new = RowStatistics.__new__(RowStatistics)
        new.__dict__.update(self.__dict__)
        new._x, new._y = list(self._x), list(self._y)
        return new.merge_(other)

    def check_finite(self, what: str = "statistics") -> None:
        """Raises `StatisticsError` if any kept row holds NaN or Inf."""
        for name, rows in (("source rows", self._x), ("target rows", self._y)):
            if not all(torch.isfinite(r).all() for r in rows):
                raise StatisticsError(
                    f"{what}: non-finite (NaN/Inf) values in the {name}; the source or target produced NaN/Inf KV on "
                    "the calibration data (try float32, or check the models)."
                )

    def all_reduce_(self):
        raise StatisticsError("row statistics are not all-reduced; under torch.distributed calibrate from sums")

    @property
    def _index_device(self) -> torch.device:
        return self.device

    def _local(self, index: torch.Tensor, pos_of: torch.Tensor, what: str) -> torch.Tensor:
        pos = pos_of[index.to(self.device)]
        if (pos < 0).any():
            row = self.x_row if what == "source" else self.y_row
            missing = sorted({int(i) // row for i in index[pos.cpu() < 0]})
            kept = self.sources if what == "source" else self.targets
            raise StatisticsError(f"these row statistics hold {what} layers {kept}, not {missing}")
        return pos

    def rows(self, x_idx: torch.Tensor, y_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept rows of global features `x_idx` and `y_idx`: `(x (n, p), y (n, q))`, float64."""
        if self.count == 0:
            raise StatisticsError("statistics hold no tokens")
        xl, yl = self._local(x_idx, self._x_pos, "source"), self._local(y_idx, self._y_pos, "target")
        x = torch.cat([r[:, xl] for r in self._x]).to(torch.float64)  # (n, p)
        y = torch.cat([r[:, yl] for r in self._y]).to(torch.float64)  # (n, q)
        return x, y

    def moments(self, x_idx: torch.Tensor, y_idx: torch.Tensor):
        """Means and centred (co)variances over the selected (global) features, divided by `count`, as
        [`KVStatistics.moments`] returns them: `(mean_x (p,), mean_y (q,), cov_xx (p, p), cov_xy (p, q), var_y (q,))`,
        float64."""
        x, y = self.rows(x_idx, y_idx)
        mx, my = x.mean(0), y.mean(0)
        xc, yc = x - mx, y - my
        n = self.count
        return mx, my, xc.T @ xc / n, xc.T @ yc / n, (yc * yc).sum(0) / n
