"""[`BlockStatistics`]: centred sums of the selected source layers of a group of target layers, per feature group
(`feature_groups`), for calibration on a memory budget."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

from ...errors import StatisticsError
from ...utils.heads import target_heads_of
from .base import CentredSums, GlobalLayerIndex, KeptLayerStatistics, StatisticsFile, chan_merge, chunk_rows, has_rows

logger = logging.getLogger(__name__)


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


class BlockStatistics(GlobalLayerIndex, CentredSums, StatisticsFile, KeptLayerStatistics):
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
        head_mode (`str`), kv_mode (`str`), *optional*, default to `"all_heads"`, `"joint"`: which blocks to keep.
        target_sources (`dict[int, list[int]]`, *optional*): per target layer, the source layers its maps read (all
            in `sources`): only those cross blocks are kept. Default: every target layer with every source layer,
            which a re-fit with another selection needs.
        the kept layers and the layout arguments: as [`KeptLayerStatistics`] (`sources`: the source layers kept,
            `targets`: the target layers kept, `dtype`: of the Gram and cross blocks (means are float64), `device`:
            where the sums live).

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
        *args,
        head_mode: str = "all_heads",
        kv_mode: str = "joint",
        target_sources: dict[int, list[int]] | None = None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.head_mode, self.kv_mode = head_mode, kv_mode
        self.target_sources = self._check_target_sources(target_sources)
        dtype, device = self.dtype, self.device
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
        self._x_group, self._x_pos = self._locate(self._x_cols, self.source_layers * self.x_row, device)
        self._y_group, self._y_pos = self._locate(self._y_cols, self.target_layers * self.y_row, device)

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
        if not has_rows(x, y, self._x_group.numel(), self._y_group.numel()):
            return
        if x.shape[0] > (chunk := chunk_rows(self._x_cols.numel() + self._y_cols.numel())):
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
        f, share = chan_merge(self.count, x.shape[0])
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
        state = super().state_dict()
        state["sources"] = torch.tensor(self.sources, dtype=torch.int64)
        state["targets"] = torch.tensor(self.targets, dtype=torch.int64)
        state["modes"] = torch.tensor([self._MODES[0][self.head_mode], self._MODES[1][self.kv_mode]])
        reads = max((len(r) for r in self._reads), default=0)
        state["target_sources"] = torch.tensor(
            [self.target_sources[t] + [-1] * (reads - len(self.target_sources[t])) for t in self.targets],
            dtype=torch.int64,
        ).reshape(len(self.targets), reads)  # (T, K), -1: padding
        return state

    @classmethod
    def load(cls, path: str | Path, device: torch.device | str | None = None) -> BlockStatistics:
        stats = super().load(path, device)
        stats._mirrored = False  # mirrored again before it is read: only the upper block triangle is kept up to date
        return stats

    @classmethod
    def _from_state(cls, state: dict[str, torch.Tensor], path: str | Path, device) -> BlockStatistics:
        head_mode, kv_mode = (list(names)[int(i)] for names, i in zip(cls._MODES, state["modes"].tolist()))
        targets = state["targets"].tolist()
        reads = None
        if "target_sources" in state:  # absent in files written before cross blocks were kept per target layer
            reads = {t: [s for s in row if s >= 0] for t, row in zip(targets, state["target_sources"].tolist())}
        key = state["shape_key"].tolist()
        return cls(
            *key[:4],
            **target_heads_of(key),
            sources=state["sources"].tolist(),
            targets=targets,
            dtype=state["xx"].dtype,
            device=device,
            head_mode=head_mode,
            kv_mode=kv_mode,
            target_sources=reads,
        )
