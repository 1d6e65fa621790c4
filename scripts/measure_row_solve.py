"""The auto-λ search and refit of one map from the calibration rows themselves, when there are fewer training tokens
than map inputs (`n < p`), against the library's solve from sufficient statistics, side by side in one process
(issue 25, item 2).

With `n` training tokens the standardized, centered training Gram block `Z = XsᵀXs` (`Xs`: the `n × p` centered
rows, each feature divided by its floored standard deviation and all by `√n`) has rank at most `n − 1`, and the
standardized cross block `XsᵀYs` lies in `Xs`'s row space. So the ridge map for every λ lives in that row space:

    W(λ) = D^-½ (Z + λI)⁻¹ XsᵀYs = D^-½ Xsᵀ (XsXsᵀ + λI)⁻¹ Ys,

and one eigendecomposition of the `n × n` kernel `K = XsXsᵀ = U S² Uᵀ` gives the right singular vectors
`Vr = Xsᵀ U S⁻¹` `(p, r)` in which the library's held-out λ path (`hf_kvbridge.solve.heldout_r2_chunks`) can run on
`r × r` and `r × q` blocks instead of `p × p` and `p × q`. The `p × p` work, `14/3 · p³` for the `eigh` and `4p³`
for the held-out rotation, becomes `2n²p` for the kernel and `2n'np` for the held-out rows' products. The refit
(`hf_kvbridge.solve.solve_ridge` on train + held-out) likewise becomes one `n × n` Cholesky per distinct λ.

This needs the rows, not their sums: `n · (p + q)` numbers a map instead of `p² + pq`, which is less exactly when
`n < p`. The paper's 8 × 256 proof run (about 1,800 training tokens, `p` = 12,288) is that case; its 500 × 1,024
tokens are not.

The script builds random rows driven by shared latent factors (`X = F A + noise`, `Y = F B + noise`), sums them
into the library's float64 `KVStatistics`, runs the library's search and refit and the row form on the same rows,
and reports each one's time, the largest held-out R² difference over the λ grid, the chosen λ per K/V and the
weights' largest relative difference. `--row-only-p` times the row form alone (at `p` = 12,288 the library's search
takes about 10 minutes on 2 cores). Run it on a quiet machine.

    python scripts/measure_row_solve.py --p 6144 --row-only-p 12288 --tokens 1792 --heldout 256 --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

from hf_kvbridge.solve import LAMBDA_GRID, heldout_r2_chunks, solve_ridge
from hf_kvbridge.statistics import KVStatistics
from hf_kvbridge.tools.bench.report import write_measurement

HEAD_DIM = 128
F64 = torch.float64


def _rows(p: int, q: int, n: int, seed: int, rank: int = 64):
    """Random rows `x (n, p)`, `y (n, q)` in float32, as calibration's K/V rows are, driven by `rank` shared latent
    factors (K/V rows of neighbouring layers are strongly correlated), features of unequal scale and a little noise,
    so that the held-out λ path has an interior best."""
    gen = torch.Generator().manual_seed(seed)
    latent = torch.randn(n, rank, generator=gen)  # (n, rank)
    scale = torch.rand(p, generator=gen).add_(0.1)  # (p,)
    x = (latent @ torch.randn(rank, p, generator=gen) + 0.3 * torch.randn(n, p, generator=gen)) * scale
    y = latent @ torch.randn(rank, q, generator=gen) + 0.5 * torch.randn(n, q, generator=gen)
    return x, y


def _standardize(x: torch.Tensor, mean: torch.Tensor, root: torch.Tensor) -> torch.Tensor:
    return (x.to(F64) - mean) / root / x.shape[0] ** 0.5  # (n, p) Xs


def _root(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(mean (p,), root (p,))`: the rows' mean and floored standard deviation, as `solve._feature_scale` floors the
    Gram block's diagonal."""
    x = x.to(F64)
    mean = x.mean(0)
    variance = (x - mean).pow_(2).mean(0)
    return mean, variance.clamp_min(1e-6 * variance.mean().clamp_min(torch.finfo(F64).tiny)).sqrt()


def row_heldout_r2(x, y, xh, yh, head_dim: int, lambdas=LAMBDA_GRID):
    """`heldout_r2_chunks` of the map `y ≈ x W + b` fitted on rows `x (n, p)`, `y (n, q)` and scored on `xh`, `yh`,
    from the `n × n` kernel: returns `(r2 (Λ, q // head_dim), seconds by step)`."""
    steps = {}
    started = time.perf_counter()
    mx, root = _root(x)
    my = y.to(F64).mean(0)
    xs = _standardize(x, mx, root)  # (n, p)
    ys = (y.to(F64) - my) / x.shape[0] ** 0.5  # (n, q)
    kernel = xs @ xs.T  # (n, n) XsXsᵀ
    s2, u = torch.linalg.eigh(kernel)
    keep = s2 > s2.max() * x.shape[0] * torch.finfo(F64).eps  # the rank: the centering drops one
    s2, u = s2[keep], u[:, keep]  # (r,), (n, r)
    s = s2.sqrt()
    steps["kernel_eigh"] = time.perf_counter() - started
    started = time.perf_counter()
    a = s[:, None] * (u.T @ ys)  # (r, q) Vrᵀ XsᵀYs = S Uᵀ Ys
    hmx, hmy = xh.to(F64).mean(0), yh.to(F64).mean(0)
    xhs = _standardize(xh, hmx, root)  # (n', p) held-out, the training scale
    yhs = (yh.to(F64) - hmy) / xh.shape[0] ** 0.5  # (n', q)
    proj = (xhs @ xs.T) @ u / s  # (n', r) Xh Vr
    m = proj.T @ proj  # (r, r) Vrᵀ Z' Vr
    c = proj.T @ yhs  # (r, q)
    shift = (u.T @ (xs @ ((hmx - mx) / root))) / s  # (r,) Vrᵀ (held-out − train mean)
    hvy = yhs.pow(2).sum(0)  # (q,)
    steps["heldout_products"] = time.perf_counter() - started
    started = time.perf_counter()
    offset = hmy - my
    chunks = y.shape[1] // head_dim
    sst = hvy.view(chunks, head_dim).sum(-1).clamp_min(torch.finfo(F64).tiny)
    out = torch.empty(len(lambdas), chunks, dtype=F64)
    for i, lam in enumerate(lambdas):
        w = a / (s2 + lam)[:, None]  # (r, q)
        mse = hvy - 2 * (c * w).sum(0) + (m @ w).mul_(w).sum(0) + (offset - shift @ w) ** 2
        out[i] = 1 - mse.clamp_min(0).view(chunks, head_dim).sum(-1) / sst
    steps["lambda_loop"] = time.perf_counter() - started
    return out, steps


def row_refit(x, y, lambdas: torch.Tensor):
    """`solve_ridge` on rows `x (n, p)`, `y (n, q)` with one λ per output column (`lambdas (q,)`), by
    `W = D^-½ Xsᵀ (XsXsᵀ + λI)⁻¹ Ys`: returns `(weight (p, q), bias (q,))`."""
    mx, root = _root(x)
    my = y.to(F64).mean(0)
    xs = _standardize(x, mx, root)  # (n, p)
    ys = (y.to(F64) - my) / x.shape[0] ** 0.5  # (n, q)
    kernel = xs @ xs.T  # (n, n)
    dual = torch.empty_like(ys)  # (n, q)
    for value in lambdas.unique().tolist():
        columns = (lambdas == value).nonzero().squeeze(1)
        system = kernel.clone()
        system.diagonal().add_(value)
        dual[:, columns] = torch.cholesky_solve(ys[:, columns], torch.linalg.cholesky(system))
    weight = (xs.T @ dual) / root[:, None]  # (p, q)
    return weight, my - mx @ weight


def _statistics(x, y) -> KVStatistics:
    p, q = x.shape[1], y.shape[1]
    stats = KVStatistics(p // (2 * HEAD_DIM), 1, 1, HEAD_DIM, target_kv_heads=q // (2 * HEAD_DIM))
    for start in range(0, x.shape[0], 256):
        stats.update(x[start : start + 256], y[start : start + 256])
    return stats


def _chosen(r2: torch.Tensor) -> torch.Tensor:
    """Per output column, the λ with the best mean held-out R² of its kind (K chunks, V chunks), as
    `choose_ridge_lambdas` picks for one all-heads joint map: `(q,)`."""
    per_kind = r2.view(len(LAMBDA_GRID), -1, 2).mean(1)  # (Λ, 2): chunks alternate key, value per head
    best = per_kind.argmax(0)  # (2,)
    grid = torch.tensor(LAMBDA_GRID, dtype=F64)
    return grid[best]


def measure(p: int, q: int, n: int, heldout: int, library: bool = True) -> dict:
    x, y = _rows(p, q, n + heldout, seed=p)
    xt, yt, xh, yh = x[:n], y[:n], x[n:], y[n:]
    record = {"p": p, "q": q, "train_tokens": n, "heldout_tokens": heldout, "lambdas": len(LAMBDA_GRID)}
    started = time.perf_counter()
    row_r2, row_steps = row_heldout_r2(xt, yt, xh, yh, HEAD_DIM)
    record["row_search_seconds"] = round(time.perf_counter() - started, 3)
    record["row_search_steps"] = {k: round(v, 3) for k, v in row_steps.items()}
    lam_k, lam_v = _chosen(row_r2).tolist()
    per_column = torch.tensor([lam_k, lam_v], dtype=F64).repeat_interleave(HEAD_DIM).repeat(q // (2 * HEAD_DIM))
    started = time.perf_counter()
    row_weight, row_bias = row_refit(x, y, per_column)
    record["row_refit_seconds"] = round(time.perf_counter() - started, 3)
    record["row_lambda_kv"] = [lam_k, lam_v]
    if not library:
        return record
    train, held = _statistics(xt, yt), _statistics(xh, yh)
    x_idx, y_idx = torch.arange(p), torch.arange(q)
    started = time.perf_counter()
    lib_r2 = heldout_r2_chunks(train, held, x_idx, y_idx, HEAD_DIM)
    record["library_search_seconds"] = round(time.perf_counter() - started, 3)
    started = time.perf_counter()
    lib_weight, lib_bias = solve_ridge(train + held, x_idx, y_idx, per_column)
    record["library_refit_seconds"] = round(time.perf_counter() - started, 3)
    record["library_lambda_kv"] = _chosen(lib_r2).tolist()
    record["max_abs_r2_difference"] = float((lib_r2 - row_r2).abs().max())
    record["max_relative_weight_difference"] = float((lib_weight - row_weight).abs().max() / lib_weight.abs().max())
    record["max_relative_bias_difference"] = float((lib_bias - row_bias).abs().max() / lib_bias.abs().max())
    record["row_vs_library"] = round(
        (record["row_search_seconds"] + record["row_refit_seconds"])
        / (record["library_search_seconds"] + record["library_refit_seconds"]),
        4,
    )
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--p", type=int, nargs="*", default=[6144], help="map inputs: both paths")
    parser.add_argument("--row-only-p", type=int, nargs="*", default=[12288], help="map inputs: the row form only")
    parser.add_argument("--outputs", type=int, default=2048, help="map output columns q (whole heads of 2·128)")
    parser.add_argument("--tokens", type=int, default=1792, help="training tokens n (fewer than p)")
    parser.add_argument("--heldout", type=int, default=256, help="held-out tokens")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="row_solve.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    records = []
    for p, library in [(p, True) for p in args.p] + [(p, False) for p in args.row_only_p]:
        if args.tokens >= p:
            parser.error(f"--tokens {args.tokens} is not fewer than p = {p}: the row form is for n < p")
        record = measure(p, args.outputs, args.tokens, args.heldout, library)
        records.append(record)
        line = (
            f"p={p} q={args.outputs} n={args.tokens}+{args.heldout}: row form search {record['row_search_seconds']} s "
            f"{record['row_search_steps']}, refit {record['row_refit_seconds']} s, λ K/V {record['row_lambda_kv']}"
        )
        if library:
            line += (
                f"; library search {record['library_search_seconds']} s, refit {record['library_refit_seconds']} s, "
                f"λ K/V {record['library_lambda_kv']}; max |ΔR²| {record['max_abs_r2_difference']:.1e}, "
                f"weights {record['max_relative_weight_difference']:.1e}; row/library {record['row_vs_library']}"
            )
        print(line)
    write_measurement(args.out, records=records)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
