"""The auto-λ search and refit of one map from the calibration rows
(`hf_kvbridge.fitting.statistics.rows.RowStatistics`)
against the same from their sums (`KVStatistics`), side by side in one process on the same rows, when there are
fewer training tokens than map inputs (`n < p`; issue 25, item 2).

With `n` training tokens the standardized training Gram block `Z = XsᵀXs` has rank below `n`, and every ridge map
lies in the row space of the training rows, `W(λ) = D^-½ Xsᵀ (XsXsᵀ + λI)⁻¹ Ys`: `hf_kvbridge.fitting.solve` runs the
held-out λ path on the `n × n` kernel's eigenpairs and the refit as one `n × n` Cholesky per λ when the statistics
are rows. The `p × p` work (`14/3 · p³` for the `eigh`, `4p³` for the held-out rotation) becomes `O(n²p)`.
Calibration keeps the rows when that is cheaper (`calibration.rows_are_cheaper`).

The script builds random rows driven by shared latent factors (`X = F A + noise`, `Y = F B + noise`), puts them in
both kinds of statistics, runs `heldout_r2_chunks` and `solve_ridge` on each, and reports each one's time, the
largest held-out R² difference over the λ grid, the chosen λ per K/V and the weights' largest relative difference.
`--row-only-p` times the rows alone (at `p` = 12,288 the sums' search takes about 10 minutes on 2 cores). Run it on
a quiet machine.

    python scripts/measure_row_solve.py --p 6144 --row-only-p 12288 --tokens 1792 --heldout 256 --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

from hf_kvbridge.fitting.solve import LAMBDA_GRID, heldout_r2_chunks, solve_ridge
from hf_kvbridge.fitting.statistics.dense import KVStatistics
from hf_kvbridge.fitting.statistics.rows import RowStatistics
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


def _statistics(x, y, rows: bool):
    p, q = x.shape[1], y.shape[1]
    layout = (p // (2 * HEAD_DIM), 1, 1, HEAD_DIM)
    heads = {"target_kv_heads": q // (2 * HEAD_DIM)}
    if rows:
        stats = RowStatistics(*layout, sources=range(layout[0]), targets=[0], **heads)
    else:
        stats = KVStatistics(*layout, **heads)
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


def _solve(train, held, p: int, q: int) -> dict:
    """The library's λ search on `train`/`held`, the chosen λ per K/V and the refit on both: times and results."""
    x_idx, y_idx = torch.arange(p), torch.arange(q)
    started = time.perf_counter()
    r2 = heldout_r2_chunks(train, held, x_idx, y_idx, HEAD_DIM)
    search = time.perf_counter() - started
    lam_k, lam_v = _chosen(r2).tolist()
    per_column = torch.tensor([lam_k, lam_v], dtype=F64).repeat_interleave(HEAD_DIM).repeat(q // (2 * HEAD_DIM))
    started = time.perf_counter()
    weight, bias = solve_ridge(train + held, x_idx, y_idx, per_column)
    refit = time.perf_counter() - started
    return {"r2": r2, "lambda_kv": [lam_k, lam_v], "weight": weight, "bias": bias, "search": search, "refit": refit}


def measure(p: int, q: int, n: int, heldout: int, library: bool = True) -> dict:
    """Rows against sums (`library`; else the rows alone) on one random problem of `p` inputs and `q` outputs."""
    x, y = _rows(p, q, n + heldout, seed=p)
    record = {"p": p, "q": q, "train_tokens": n, "heldout_tokens": heldout, "lambdas": len(LAMBDA_GRID)}
    rows = _solve(_statistics(x[:n], y[:n], True), _statistics(x[n:], y[n:], True), p, q)
    record.update(row_search_seconds=round(rows["search"], 3), row_refit_seconds=round(rows["refit"], 3))
    record["row_lambda_kv"] = rows["lambda_kv"]
    if not library:
        return record
    sums = _solve(_statistics(x[:n], y[:n], False), _statistics(x[n:], y[n:], False), p, q)
    record.update(library_search_seconds=round(sums["search"], 3), library_refit_seconds=round(sums["refit"], 3))
    record["library_lambda_kv"] = sums["lambda_kv"]
    record["max_abs_r2_difference"] = float((sums["r2"] - rows["r2"]).abs().max())
    for name in ("weight", "bias"):
        difference = (sums[name] - rows[name]).abs().max() / sums[name].abs().max()
        record[f"max_relative_{name}_difference"] = float(difference)
    record["row_vs_library"] = round((rows["search"] + rows["refit"]) / (sums["search"] + sums["refit"]), 4)
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
            f"p={p} q={args.outputs} n={args.tokens}+{args.heldout}: rows: search {record['row_search_seconds']} s "
            f"refit {record['row_refit_seconds']} s, λ K/V {record['row_lambda_kv']}"
        )
        if library:
            line += (
                f"; sums: search {record['library_search_seconds']} s, refit {record['library_refit_seconds']} s, "
                f"λ K/V {record['library_lambda_kv']}; max |ΔR²| {record['max_abs_r2_difference']:.1e}, "
                f"weights {record['max_relative_weight_difference']:.1e}; rows/sums {record['row_vs_library']}"
            )
        print(line)
    write_measurement(args.out, records=records)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
