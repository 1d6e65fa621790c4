"""Centered ridge regression from sufficient statistics: the closed form every linear mapper is fitted with.

For target layer `t` and head group `g` (all heads at once in `all_heads` mode, one head in `same_head` mode):

    W = (C_xx + λ·D)⁻¹ C_xy,   b = ȳ − x̄ W,   D = diag(C_xx)

`C` are covariances (centered sums divided by the token count), so λ is *relative to each input feature's own
variance* — the same as plain ridge on standardized (z-scored) inputs. It does not change with the number of
calibration tokens or with the scale of any feature (keys and values live at very different scales).
λ = 0.01 adds 1 % of each feature's variance to its diagonal entry. With several correlated source layers
concatenated, that shrinks the map much more than "1 %" suggests, and the best λ differs between pairs and layers.

**Choosing λ** (`ridge_lambda="auto"`, the default): for each target layer and head group, one eigendecomposition
of the standardized training Gram block, `Z = D^-½ C_xx D^-½ = V Λ Vᵀ`, gives the ridge map for every λ of a grid
at the cost of one matrix product each,

    W(λ) = D^-½ V diag(1 / (Λ + λ)) Vᵀ D^-½ C_xy,

and the held-out statistics' moments give each W(λ)'s held-out residual sum of squares without another pass over
the data. Ridge decouples over output columns, so the K columns and the V columns each get the λ with the best
held-out R² (mean over heads) — exactly what two separate K and V maps would get. The map is then refitted on
train + held-out statistics with the chosen λ per column (`solve_ridge` with a per-column λ).

**Three ways to search** (`LAMBDA_SEARCHES`): `"eigh"` (the above, float64; the CPU's default), `"eigh32"` (the
same in float32, each map's chosen λ then checked in float64 by Cholesky and the map searched again in float64 where
its R² was off by more than `EIGH32_TOLERANCE`) and `"cholesky"` (float64, one factorisation and solve per λ, batched:
`hf_kvbridge.fitting.ridge_path`; as many FLOPs as `"eigh"` for `q = p/6`, all of it matrix-matrix work; CUDA's
default).

**Memory** (`p` inputs, `w` outputs, float64; `hf_kvbridge.fitting.budget.solve_bytes` plans it): the search keeps at
most three `p × p` matrices, at the eigendecomposition (its eigenvectors written over the standardized Gram block, plus
LAPACK's `2p²` workspace); the held-out Gram block is read only after it and rotated in place, `M = Vᵀ Z' V`, so each
λ costs products and diagonal scalings of `p × w` blocks. The refit keeps the Gram block (the ridge added on its
diagonal) and one Cholesky factor. The moments `stats.moments` returns are worked on in place.
"""

from __future__ import annotations

import logging

import torch

from ..errors import ConfigurationError, InvalidInputError, StatisticsError
from .ridge_path import heldout_r2_by_cholesky

logger = logging.getLogger(__name__)

# 1e-6 … 1 in half decades: the search grid of `ridge_lambda="auto"` (relative λ, see the module docstring)
LAMBDA_GRID: tuple[float, ...] = tuple(float(f"{10 ** (e / 2):.3g}") for e in range(-12, 1))

LAMBDA_SEARCHES = ("eigh", "eigh32", "cholesky")  # `choose_ridge_lambdas(search=...)`, see the module docstring
EIGH32_TOLERANCE = 1e-4  # R² a float32 search may be off by at its chosen λ before the map is redone in float64
CHOLESKY_BATCH_BYTES = 2**33  # float64 systems factorised at once by the "cholesky" search (8 GiB)


def default_lambda_search(device: torch.device | str) -> str:
    """The λ search for statistics on `device`: `"cholesky"` on CUDA (its float64 matrix work), else `"eigh"`."""
    return "cholesky" if torch.device(device).type == "cuda" else "eigh"


def _check_count(stats, p: int) -> None:
    """An unregularised (λ = 0) fit needs more tokens than features; any λ > 0 makes the problem well posed."""
    if stats.count <= p:
        raise StatisticsError(
            f"fewer calibration tokens ({stats.count}) than mapper input features ({p}); use more or longer "
            "calibration sequences, a smaller top_k, or head_mode='same_head'"
        )


def _floored(variance: torch.Tensor) -> torch.Tensor:
    """Each feature's variance `(..., p)`, floored (per map) so a constant feature still gets a ridge."""
    return variance.clamp_min(1e-6 * variance.mean(-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny))


def _feature_scale(cxx: torch.Tensor) -> torch.Tensor:
    """Each feature's own variance `(p,)` from the Gram block's diagonal, floored (`_floored`)."""
    return _floored(torch.diagonal(cxx))


def _moments(stats, x_idx: torch.Tensor, y_idx: torch.Tensor):
    mx, my, cxx, cxy, vy = stats.moments(x_idx, y_idx)
    # NaN/Inf reach the sums (`isfinite(cxx)` would allocate more than `cxx` itself: its |·| and two masks); only
    # entries near the float64 maximum could make finite moments sum to Inf
    if not (torch.isfinite(cxx.sum()) and torch.isfinite(cxy.sum())):
        raise StatisticsError("NaN/Inf in calibration statistics; cannot fit the mapper")
    return mx, my, cxx, cxy, vy


def solve_ridge(
    stats, x_idx: torch.Tensor, y_idx: torch.Tensor, ridge_lambda: float | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fits `y[y_idx] ≈ x[x_idx] W + b` by centered ridge in float64.

    Args:
        stats ([`KVStatistics`]): anything with `count` and `moments(x_idx, y_idx)` (returning new tensors: the
            solve works on them in place).
        x_idx (`torch.Tensor` of shape `(p,)`), y_idx (`(q,)`): input and output feature indices.
        ridge_lambda (`float` or `torch.Tensor` of shape `(q,)`): relative ridge strength, one for all output
            columns or one per column (ridge decouples over columns, so this is one ridge fit per distinct value).

    Returns:
        `(weight (p, q), bias (q,))`, float64.

    Raises:
        `StatisticsError` if λ = 0 and there are no more tokens than features, or the statistics are not finite.

    Example:

    ```python
    >>> from hf_kvbridge.fitting.statistics.dense import KVStatistics
    >>> stats = KVStatistics(source_layers=1, target_layers=1, num_kv_heads=1, head_dim=2)
    >>> stats.update(torch.randn(50, 4), torch.randn(50, 4))
    >>> weight, bias = solve_ridge(stats, torch.arange(4), torch.arange(4), 0.01)
    >>> weight.shape, bias.shape
    (torch.Size([4, 4]), torch.Size([4]))
    ```
    """
    p = x_idx.numel()
    if isinstance(ridge_lambda, torch.Tensor) and ridge_lambda.numel() != y_idx.numel():
        raise InvalidInputError(
            f"got {ridge_lambda.numel()} ridge λ for {y_idx.numel()} output columns; pass one λ, or one per column"
        )
    smallest = float(ridge_lambda.min()) if isinstance(ridge_lambda, torch.Tensor) else float(ridge_lambda)
    if smallest <= 0:
        _check_count(stats, p)
    elif hasattr(stats, "rows"):  # `RowStatistics`: the same map from the n × n kernel
        return _solve_ridge_rows(stats, x_idx, y_idx, ridge_lambda)
    mx, my, cxx, cxy, _ = _moments(stats, x_idx, y_idx)
    scale = _feature_scale(cxx)  # ridge on standardized inputs (a copy: the diagonal is rewritten below)
    # the system `C_xx + λ·D` is built in place on `cxx`'s diagonal (from a copy of the diagonal, so every λ adds to
    # the same numbers): the Gram block and one Cholesky factor are the only `p × p` matrices alive
    diagonal = cxx.diagonal()
    variance = diagonal.clone()
    if isinstance(ridge_lambda, torch.Tensor):
        lambdas = ridge_lambda.to(torch.float64).reshape(-1)
        weight = torch.empty_like(cxy)  # (p, q)
        for value in lambdas.unique().tolist():
            columns = (lambdas == value).nonzero().squeeze(1)
            diagonal.copy_(variance + value * scale)
            weight[:, columns] = _ridge_weight(cxx, cxy[:, columns])
    else:
        diagonal.copy_(variance + float(ridge_lambda) * scale)
        weight = _ridge_weight(cxx, cxy)
    del cxx, diagonal
    bias = my - mx @ weight
    return weight, bias


def ridge_from_moments(
    cxx: torch.Tensor, cxy: torch.Tensor, mx: torch.Tensor, my: torch.Tensor, ridge_lambda: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The centered ridge map from centred moments (covariances divided by the token count), for a batch of maps:
    `W = (C_xx + λ·D)⁻¹ C_xy`, `b = ȳ − x̄ W`, with `D` each input's own variance (floored, `_floored`).

    `solve_ridge` builds the same system in place for one map of statistics; this takes the moments themselves, with
    any leading batch dimensions (the selection statistics' every source layer at once).

    Args:
        cxx (`torch.Tensor` of shape `(..., p, p)`), cxy (`(..., p, q)`), mx (`(..., p)`), my (`(..., q)`): float64.
        ridge_lambda (`float`): the relative ridge strength (`0`: least squares).

    Returns:
        `(weight (..., p, q), bias (..., q))`.

    Example:

    ```python
    >>> x = torch.randn(100, 3, dtype=torch.float64)
    >>> y = x @ torch.tensor([[1.0], [2.0], [-1.0]], dtype=torch.float64) + 5
    >>> xc, yc = x - x.mean(0), y - y.mean(0)
    >>> w, b = ridge_from_moments(xc.T @ xc / 100, xc.T @ yc / 100, x.mean(0), y.mean(0), 0.0)
    >>> [round(v, 6) for v in w.flatten().tolist()], round(float(b), 6)
    ([1.0, 2.0, -1.0], 5.0)
    ```
    """
    system = cxx + torch.diag_embed(ridge_lambda * _floored(torch.diagonal(cxx, dim1=-2, dim2=-1)))
    weight = _ridge_weight(system, cxy)
    return weight, my - (mx.unsqueeze(-2) @ weight).squeeze(-2)


def _ridge_weight(system: torch.Tensor, cxy: torch.Tensor) -> torch.Tensor:
    """`system⁻¹ cxy` for the ridge system `C_xx + λ·D` `(..., p, p)`; `system` is read, never written."""
    chol, info = torch.linalg.cholesky_ex(system)
    if not info.any():  # two triangular solves, as `cholesky_solve` does, without the copy of the factor it makes
        half = torch.linalg.solve_triangular(chol, cxy, upper=False)
        return torch.linalg.solve_triangular(chol.mT, half, upper=True)  # (p, q)
    del chol  # λ = 0 on rank-deficient inputs: minimum-norm least squares (`lstsq` copies `system` once)
    return torch.linalg.lstsq(system, cxy, driver="gelsd").solution


def _symmetrize_(z: torch.Tensor, block: int) -> torch.Tensor:
    """`z ← (z + zᵀ) / 2` in place, one strip of `block` rows (and the matching columns) at a time."""
    p = z.shape[0]
    for i in range(0, p, block):
        j = min(i + block, p)
        strip = (z[i:j, i:] + z[i:, i:j].T) / 2  # (b, p − i): rows i:j right of the diagonal, and their mirror
        z[i:j, i:] = strip
        z[i:, i:j] = strip.T
    return z


def rotate_(m: torch.Tensor, evecs: torch.Tensor, block: int) -> torch.Tensor:
    """`m ← Vᵀ m V` in place: column strips of `Vᵀ m` (each needs only that strip of `m`), then row strips of
    `(Vᵀ m) V`; only `(p, block)` strips besides `m` and `V`."""
    p = m.shape[0]
    for i in range(0, p, block):
        m[:, i : i + block] = evecs.T @ m[:, i : i + block]
    for i in range(0, p, block):
        m[i : i + block] = m[i : i + block] @ evecs
    return m


def strip_rows(p: int) -> int:
    """Rows per strip of the in-place steps: a strip is at most 1/16 of a `p × p` matrix."""
    return max(1, min(p, max(64, p // 16)))


def heldout_r2_chunks(
    train,
    heldout,
    x_idx: torch.Tensor,
    y_idx: torch.Tensor,
    head_dim: int,
    lambdas: tuple[float, ...] | list[float] = LAMBDA_GRID,
    search: str = "eigh",
) -> torch.Tensor:
    """Held-out R² of the ridge map fitted on `train` for every λ of `lambdas`, from one eigendecomposition.

    The output columns `y_idx` are whole `head_dim` chunks (keys only, values only, or both); laid out as the
    statistics lay out a head (key `d` columns, then value `d` columns), the result viewed as
    `(len(lambdas), q // (2d), 2)` is the R² per λ, head and K/V.

    Args:
        train, heldout ([`KVStatistics`]): statistics with `count` and `moments` (or `RowStatistics`); the fit uses
            `train`, the R² is measured on `heldout`.
        x_idx, y_idx (`torch.Tensor`): the input and output columns (`source_index`, `target_index`).
        head_dim (`int`): `d`.
        lambdas (`tuple[float]`, *optional*, defaults to `LAMBDA_GRID`): relative ridge strengths (> 0).
        search (`str`, *optional*, defaults to `"eigh"`): `"eigh"` (float64), `"eigh32"` (float32
            eigendecomposition and path; `choose_ridge_lambdas` checks its choice) or `"cholesky"` (float64, one
            factorisation per λ), see the module docstring.

    Returns:
        `torch.Tensor` of shape `(len(lambdas), q // d)`, float64: held-out R² per λ and chunk (pooled over its `d`
        columns).

    Example:

    ```python
    >>> from hf_kvbridge.fitting.statistics.dense import KVStatistics
    >>> train, held = (KVStatistics(1, 1, num_kv_heads=1, head_dim=2) for _ in range(2))
    >>> for stats in (train, held):
    ...     x = torch.randn(200, 4)
    ...     stats.update(x, x + 0.1 * torch.randn(200, 4))
    >>> heldout_r2_chunks(train, held, torch.arange(4), torch.arange(4), head_dim=2, lambdas=[1e-4, 1.0]).shape
    torch.Size([2, 2])
    ```
    """
    if not lambdas or min(lambdas) <= 0:
        raise InvalidInputError(f"the λ grid must be non-empty and every λ > 0, got {list(lambdas)}")
    q = y_idx.numel()
    if q % head_dim:
        raise InvalidInputError(f"{q} output columns are not whole chunks of {head_dim}; pass whole head_dim chunks")
    if search not in LAMBDA_SEARCHES:
        raise InvalidInputError(f"the λ search must be one of {LAMBDA_SEARCHES}, got {search!r}")
    if hasattr(train, "rows"):  # `RowStatistics`: the same path from the n × n kernel
        return _heldout_r2_rows(train, heldout, x_idx, y_idx, head_dim, lambdas)
    if search == "cholesky":
        return heldout_r2_cholesky(train, heldout, [(x_idx, y_idx)], head_dim, lambdas)[0]
    # Peak memory: three `p × p` float64 matrices (the eigendecomposition: eigenvectors written over the standardized
    # Gram block, plus LAPACK's `2·p²` workspace), with the held-out moments read only after it, rotated in place
    # (see `hf_kvbridge.fitting.budget.solve_bytes`)
    block = strip_rows(x_idx.numel())
    mx, my, z, a, _ = _moments(train, x_idx, y_idx)
    root = _feature_scale(z).sqrt()  # (p,) D^½
    z.div_(root[:, None]).div_(root[None, :])  # (p, p) standardized Gram block Z = D^-½ C_xx D^-½, in place
    _symmetrize_(z, block)
    work = torch.float32 if search == "eigh32" else torch.float64  # the eigendecomposition's and the path's dtype
    if work != z.dtype:
        z = z.to(work)
    evals = torch.empty(z.shape[0], dtype=work, device=z.device)
    # Z = V Λ Vᵀ; the eigenvectors overwrite Z (`z.mT` is Z itself, Z being symmetric, and column-major as LAPACK
    # wants its output), so no copy of Z is made
    torch.linalg.eigh(z.mT, out=(evals, z.mT))
    evecs = z.mT  # (p, p) V
    del z
    evals.clamp_min_(0)
    a = evecs.T @ a.div_(root[:, None]).to(work)  # (p, q): Vᵀ D^-½ C_xy, so W(λ) = D^-½ V diag(1/(Λ+λ)) a
    # the held-out moments in the same rotated, standardized coordinates
    hmx, hmy, m, c, hvy = _moments(heldout, x_idx, y_idx)
    m = m.div_(root[:, None]).div_(root[None, :]).to(work)
    rotate_(m, evecs, block)  # (p, p) M = Vᵀ D^-½ C_xx' D^-½ V, over the held-out Gram block
    c = evecs.T @ c.div_(root[:, None]).to(work)  # (p, q)
    shift = evecs.T @ ((hmx - mx) / root).to(work)  # (p,): held-out minus train input mean
    del evecs
    offset = (hmy - my).to(work)  # (q,)
    hvy = hvy.to(work)
    chunks = q // head_dim
    sst = hvy.view(chunks, head_dim).sum(-1).clamp_min(torch.finfo(torch.float64).tiny)  # (chunks,)
    out = torch.empty(len(lambdas), chunks, dtype=torch.float64)
    w, scratch = torch.empty_like(a), torch.empty_like(a)  # (p, q)
    for i, lam in enumerate(lambdas):
        torch.div(a, (evals + lam)[:, None], out=w)  # (p, q) rotated map
        # per column, mean squared held-out residual: var_y − 2 wᵀc + wᵀ M w + (mean residual)²
        quadratic = torch.matmul(m, w, out=scratch).mul_(w).sum(0)  # (q,) wᵀ M w
        linear = torch.mul(c, w, out=scratch).sum(0)  # (q,) wᵀ c
        mse = hvy - 2 * linear + quadratic + (offset - shift @ w) ** 2  # (q,)
        sse = mse.clamp_min(0).view(chunks, head_dim).sum(-1)  # (chunks,)
        out[i] = 1 - sse.double().cpu() / sst.cpu()
    return out


def heldout_r2_cholesky(
    train,
    heldout,
    maps: list[tuple[torch.Tensor, torch.Tensor]],
    head_dim: int,
    lambdas: tuple[float, ...] | list[float] = LAMBDA_GRID,
) -> list[torch.Tensor]:
    """`heldout_r2_chunks` of several maps by the `"cholesky"` search: for each λ, `W(λ) = (Z + λI)⁻¹ a` by one
    Cholesky factorisation and two triangular solves, float64, and its held-out residual from the held-out moments
    (`wᵀ Z' w − 2 wᵀ c' + …`, as the eigendecomposition's path computes it). Maps of one shape (`p`, `q`) are
    factorised together, `(maps × λ, p, p)` at a time within `CHOLESKY_BATCH_BYTES`.

    Args:
        maps (`list[tuple[torch.Tensor, torch.Tensor]]`): `(x_idx, y_idx)` of each map, as `heldout_r2_chunks` takes
            one.

    Returns:
        `list[torch.Tensor]`, one `(len(lambdas), q // d)` float64 tensor per map, on the CPU.
    """
    results: list[torch.Tensor | None] = [None] * len(maps)
    shapes: dict[tuple[int, int], list[int]] = {}
    for i, (x_idx, y_idx) in enumerate(maps):
        shapes.setdefault((x_idx.numel(), y_idx.numel()), []).append(i)
    grid = torch.tensor([float(v) for v in lambdas], dtype=torch.float64)
    for (p, _), members in shapes.items():
        systems = max(1, CHOLESKY_BATCH_BYTES // (2 * p * p * 8))  # (map, λ) systems at once: each and its factor
        per_batch = max(1, systems // len(lambdas))  # maps at once, all λ...
        lam_batch = min(len(lambdas), systems)  # ...or one map's λ in parts where one map's do not fit
        for start in range(0, len(members), per_batch):
            group = members[start : start + per_batch]
            paths = _cholesky_path(train, heldout, [maps[j] for j in group], head_dim, grid, lam_batch)
            for i, r2 in zip(group, paths):
                results[i] = r2
    return results


def _cholesky_path(train, heldout, maps, head_dim: int, grid: torch.Tensor, lam_batch: int) -> torch.Tensor:
    """Held-out R² `(maps, Λ, q // d)` of maps of one shape, `lam_batch` λ of `grid` factorised in one batch."""
    zs, as_, ms, cs, shifts, offsets, hvys = [], [], [], [], [], [], []
    for x_idx, y_idx in maps:
        mx, my, z, a, _ = _moments(train, x_idx, y_idx)
        root = _feature_scale(z).sqrt()  # (p,) D^½
        z.div_(root[:, None]).div_(root[None, :])
        zs.append(_symmetrize_(z, strip_rows(z.shape[0])))  # (p, p) Z
        as_.append(a.div_(root[:, None]))  # (p, q) D^-½ C_xy
        hmx, hmy, m, c, hvy = _moments(heldout, x_idx, y_idx)
        ms.append(m.div_(root[:, None]).div_(root[None, :]))  # (p, p) Z'
        cs.append(c.div_(root[:, None]))  # (p, q)
        shifts.append((hmx - mx) / root)  # (p,)
        offsets.append(hmy - my)  # (q,)
        hvys.append(hvy)  # (q,)
    z, a, m, c = (torch.stack(x) for x in (zs, as_, ms, cs))  # (n, p, p), (n, p, q)
    shift, offset, hvy = torch.stack(shifts), torch.stack(offsets), torch.stack(hvys)  # (n, p), (n, q), (n, q)
    del zs, as_, ms, cs
    return heldout_r2_by_cholesky(z, a, m, c, shift, offset, hvy, grid.to(z.device), head_dim, lam_batch).cpu()


# -- fewer tokens than inputs: the same maps from the rows (`RowStatistics`) ------------------------------------------
def _standardized_rows(x: torch.Tensor, y: torch.Tensor):
    """`(mean_x (p,), mean_y (q,), root (p,), xs (n, p), ys (n, q))` of rows `x`, `y`: `xs` centred, each feature
    divided by its floored standard deviation (`_floored`) and all by `√n`, so `xsᵀxs` is the standardized Gram
    block `Z` and `xsᵀys` its standardized cross block."""
    n = x.shape[0]
    mx, my = x.mean(0), y.mean(0)
    xc = x - mx  # (n, p)
    variance = (xc * xc).mean(0)
    root = _floored(variance).sqrt()
    return mx, my, root, xc.div_(root).div_(n**0.5), (y - my) / n**0.5


def _solve_ridge_rows(stats, x_idx, y_idx, ridge_lambda) -> tuple[torch.Tensor, torch.Tensor]:
    """`solve_ridge` from the rows, λ > 0: `W = D^-½ xsᵀ (xs xsᵀ + λI)⁻¹ ys`, one `n × n` Cholesky per λ."""
    x, y = stats.rows(x_idx, y_idx)
    mx, my, root, xs, ys = _standardized_rows(x, y)
    del x, y
    kernel = xs @ xs.T  # (n, n)
    if isinstance(ridge_lambda, torch.Tensor):
        lambdas = ridge_lambda.to(torch.float64).reshape(-1)  # (q,), counted by `solve_ridge`
    else:
        lambdas = torch.full((ys.shape[1],), float(ridge_lambda), dtype=torch.float64)
    dual = torch.empty_like(ys)  # (n, q)
    for value in lambdas.unique().tolist():
        columns = (lambdas == value).nonzero().squeeze(1)
        system = kernel.clone()
        system.diagonal().add_(value)
        dual[:, columns] = torch.cholesky_solve(ys[:, columns], torch.linalg.cholesky(system))
    weight = (xs.T @ dual).div_(root[:, None])  # (p, q)
    return weight, my - mx @ weight


def _heldout_r2_rows(train, heldout, x_idx, y_idx, head_dim: int, lambdas) -> torch.Tensor:
    """`heldout_r2_chunks` from the rows: one eigendecomposition of the `n × n` kernel `xs xsᵀ = U S² Uᵀ` gives the
    training Gram block's nonzero eigenpairs (`V_r = xsᵀ U S⁻¹`), in which the held-out moments are `r × r` and
    `r × q` blocks; every ridge map lies in that row space, so the path equals the `p × p` one."""
    x, y = train.rows(x_idx, y_idx)
    n = x.shape[0]
    mx, my, root, xs, ys = _standardized_rows(x, y)
    del x, y
    s2, u = torch.linalg.eigh(xs @ xs.T)  # (n,), (n, n)
    keep = s2 > s2.max().clamp_min(torch.finfo(torch.float64).tiny) * n * torch.finfo(torch.float64).eps
    s2, u = s2[keep], u[:, keep]  # (r,), (n, r): the centering drops one
    s = s2.sqrt()
    a = s[:, None] * (u.T @ ys)  # (r, q) V_rᵀ D^-½ C_xy = S Uᵀ ys
    hx, hy = heldout.rows(x_idx, y_idx)
    nh = hx.shape[0]
    hmx, hmy = hx.mean(0), hy.mean(0)
    hxs = (hx - hmx).div_(root).div_(nh**0.5)  # (n', p) held-out, in the training scale
    hys = (hy - hmy) / nh**0.5  # (n', q)
    del hx, hy
    proj = (hxs @ xs.T) @ u / s  # (n', r) hxs V_r
    m = proj.T @ proj  # (r, r) V_rᵀ Z' V_r
    c = proj.T @ hys  # (r, q)
    shift = (u.T @ (xs @ ((hmx - mx) / root))) / s  # (r,): held-out minus train input mean
    hvy = (hys * hys).sum(0)  # (q,)
    offset = hmy - my
    chunks = y_idx.numel() // head_dim
    sst = hvy.view(chunks, head_dim).sum(-1).clamp_min(torch.finfo(torch.float64).tiny)
    out = torch.empty(len(lambdas), chunks, dtype=torch.float64)
    for i, lam in enumerate(lambdas):
        w = a / (s2 + lam)[:, None]  # (r, q)
        mse = hvy - 2 * (c * w).sum(0) + (m @ w).mul_(w).sum(0) + (offset - shift @ w) ** 2
        out[i] = 1 - mse.clamp_min(0).view(chunks, head_dim).sum(-1) / sst
    return out


def group_lambda(ridge_lambda, target_layer: int, group: int, heads: int, head_dim: int) -> float | torch.Tensor:
    """The λ of target layer `target_layer`, head group `group` for `solve_ridge`.

    Args:
        ridge_lambda (`float` or `dict`): one number for every map, or per-layer choices
            `{"k": [[λ per head group] per target layer], "v": [...]}` (as `choose_ridge_lambdas` returns and
            `KVBridgeConfig.ridge_lambdas` stores).
        heads (`int`): heads in the group (all KV heads in `all_heads` mode, 1 in `same_head` mode).

    Returns:
        a float, or a per-column `torch.Tensor` of shape `(heads · 2d,)` (K columns then V columns, per head).
    """
    if not isinstance(ridge_lambda, dict):
        return float(ridge_lambda)
    lam_k = float(ridge_lambda["k"][target_layer][group])
    lam_v = float(ridge_lambda["v"][target_layer][group])
    per_head = torch.tensor([lam_k, lam_v], dtype=torch.float64).repeat_interleave(head_dim)  # (2d,)
    return per_head.repeat(heads)  # (heads·2d,)


def choose_ridge_lambdas(
    train,
    heldout,
    selected_layers: list[list[int]],
    head_mode: str,
    num_kv_heads: int,
    head_dim: int,
    lambdas: tuple[float, ...] | list[float] = LAMBDA_GRID,
    targets: list[int] | None = None,
    kv_mode: str = "joint",
    search: str | None = None,
) -> tuple[dict[str, list[list[float]]], torch.Tensor]:
    r"""Chooses λ per target layer, head group and K/V by held-out R² (fit on `train`, scored on `heldout`).

    Args:
        train, heldout ([`KVStatistics`]): the calibration statistics, split by sequence.
        selected_layers (`list[list[int]]`): per target layer, its source layers in order.
        head_mode (`str`): `"all_heads"` (one group per layer) or `"same_head"` (one group per target head).
        num_kv_heads (`int`), head_dim (`int`): the target's KV heads and head dim.
        lambdas (`tuple[float]`, *optional*, defaults to `LAMBDA_GRID`): the grid searched.
        targets (`list[int]`, *optional*): only these target layers (e.g. one fit pass's); the others get empty
            lists and R² 0.

        kv_mode (`str`, *optional*, defaults to `"joint"`): `"joint"` scores each λ with the keys and values of the
            selected layers as inputs; `"separate"` scores the key map (keys from keys) and the value map (values
            from values) as the mapper fits them.

    Returns:
        `(ridge_lambdas, r2)`: `{"k": [[λ per group] per layer], "v": [...]}` and the held-out R² at the chosen λ,
        `torch.Tensor` of shape `(target_layers, 2)` (K, V; mean over heads). On ties the smaller λ wins.

    Example:

    ```python
    >>> lambdas, r2 = choose_ridge_lambdas(train, held, [[0, 1]], "all_heads", 2, 8)  # doctest: +SKIP
    >>> lambdas["k"][0]  # doctest: +SKIP
    [0.0001]
    ```
    """
    grid = [float(v) for v in lambdas]
    chosen: dict[str, list[list[float]]] = {"k": [], "v": []}
    r2 = torch.zeros(len(selected_layers), 2, dtype=torch.float64)
    if (num_kv_heads, head_dim) != (train.target_kv_heads, train.target_head_dim):
        raise StatisticsError(
            f"the target layout ({num_kv_heads} KV heads × {head_dim}) is not the statistics' "
            f"({train.target_kv_heads} × {train.target_head_dim}); choose λ with the statistics of this model pair"
        )
    for t, layers in enumerate(selected_layers):
        if targets is not None and t not in targets:
            chosen["k"].append([])
            chosen["v"].append([])
            continue
        maps = train.map_groups(layers, t, head_mode, kv_mode)
        if search is None:
            search = default_lambda_search(maps[0][0].device)  # the index tensors live with the statistics
        paths = _group_paths(train, heldout, maps, kv_mode, head_dim, grid, search)  # per group (Λ, 2): K, V
        per_group = []
        for g, path in enumerate(paths):
            best = path.argmax(0)  # (2,) first maximum: the smaller λ on ties
            if search == "eigh32":  # the float64 R² at the chosen λ; off by more than the tolerance: float64 again
                exact = _group_r2_at(train, heldout, maps, kv_mode, head_dim, g, [grid[int(i)] for i in best])
                if (exact - path[best, torch.arange(2)]).abs().max() > EIGH32_TOLERANCE:
                    logger.info("target layer %d, group %d: float32 λ search off in float64; searched again", t, g)
                    path = _group_paths(train, heldout, maps, kv_mode, head_dim, grid, "eigh", only=g)[0]
                    best = path.argmax(0)
            per_group.append((best, path[best, torch.arange(2)]))
        chosen["k"].append([grid[int(best[0])] for best, _ in per_group])
        chosen["v"].append([grid[int(best[1])] for best, _ in per_group])
        r2[t] = torch.stack([score for _, score in per_group]).mean(0)
    return chosen, r2


def _group_paths(train, heldout, maps, kv_mode: str, head_dim: int, grid, search: str, only: int | None = None):
    """Held-out R² `(Λ, 2)` (K, V: mean over heads) of each head group of one target layer's `maps` (the statistics'
    `map_groups` order: one joint map per group, or every group's key map, then the value maps), or of group `only`."""
    groups = len(maps) if kv_mode == "joint" else len(maps) // 2
    members = range(groups) if only is None else [only]
    if kv_mode == "joint":
        wanted = [maps[g] for g in members]
    else:
        wanted = [maps[g + kv * groups] for g in members for kv in (0, 1)]
    if search == "cholesky":
        chunk_paths = heldout_r2_cholesky(train, heldout, wanted, head_dim, grid)
    else:
        chunk_paths = [heldout_r2_chunks(train, heldout, x, y, head_dim, grid, search=search) for x, y in wanted]
    if kv_mode == "joint":  # (Λ, heads·2) chunks: per head K then V
        return [path.view(len(grid), -1, 2).mean(1) for path in chunk_paths]
    return [torch.stack([k.mean(1), v.mean(1)], dim=1) for k, v in zip(chunk_paths[::2], chunk_paths[1::2])]


def _group_r2_at(train, heldout, maps, kv_mode: str, head_dim: int, group: int, lambdas: list[float]):
    """The float64 held-out R² `(2,)` (K, V) of head group `group` at its K and V λ, by Cholesky."""
    paths = _group_paths(train, heldout, maps, kv_mode, head_dim, sorted(set(lambdas)), "cholesky", only=group)[0]
    order = sorted(set(lambdas))
    return torch.stack([paths[order.index(lambdas[0]), 0], paths[order.index(lambdas[1]), 1]])


def effective_ridge_lambda(config) -> float | dict:
    """The λ a bridge's maps were fitted with: its per-layer choices (`config.ridge_lambdas`) when it has them,
    else its one number (`config.ridge_lambda`; checkpoints from before auto-λ)."""
    if getattr(config, "ridge_lambdas", None):
        return config.ridge_lambdas
    if config.ridge_lambda == "auto":
        raise ConfigurationError(
            "config.ridge_lambda is 'auto' but config.ridge_lambdas (the chosen λ per layer) is missing; calibrate "
            "again, or set ridge_lambda to a number"
        )
    return float(config.ridge_lambda)


def map_group_lambda(
    ridge_lambda, target_layer: int, group: int, head_mode: str, kv_mode: str, num_kv_heads: int, head_dim: int
):
    """The λ of map `group` of target layer `target_layer` (in `heads.map_groups` order) for `solve_ridge`;
    `num_kv_heads` and `head_dim` are the target's.

    Joint maps take `group_lambda`'s per-column λ (K columns, V columns); a separate map (`kv_mode="separate"`:
    keys from keys, or values from values) takes the K or the V choice of its head group.
    """
    if not isinstance(ridge_lambda, dict):
        return float(ridge_lambda)
    heads = num_kv_heads if head_mode == "all_heads" else 1
    if kv_mode == "joint":
        return group_lambda(ridge_lambda, target_layer, group, heads, head_dim)
    head_groups = 1 if head_mode == "all_heads" else num_kv_heads
    kind = "k" if group < head_groups else "v"  # separate groups: keys of every head group, then values
    return float(ridge_lambda[kind][target_layer][group % head_groups])
