"""Time of the held-out λ search of one map, two exact ways, side by side in one process (issue 25, item 3).

- `eigh` (what `hf_kvbridge.fitting.solve.heldout_r2_chunks` does): one eigendecomposition of the standardized train
Gram
  block `Z = V Λ Vᵀ`, the held-out Gram block rotated into its basis (`M = Vᵀ Z' V`, two `p × p × p` products), the
  cross blocks rotated (`p × p × q` each), then per λ one `p × p × q` product;
- `cholesky`: per λ one Cholesky factorisation of `Z + λI`, two triangular solves for the map `W(λ)` and one
  `p × p × q` product with the held-out Gram block: BLAS-3 only, no eigendecomposition, the same three `p × p`
  matrices.

Both give every λ's held-out mean squared error per output column; the script reports their largest difference
(relative to the column's variance) so the comparison is between equal results. The matrices are random (an SPD
Gram block of rank `min(p, 512)` plus 1 % noise): the cost does not depend on the values. Run it on a quiet machine.

    python scripts/measure_solve_paths.py --p 4096 6144 --outputs 2048 --threads 2 --out solve_paths.json

`--outputs` is `q`, the map's output columns (2,048 for the paper's all-heads joint map of Qwen3-0.6B → 1.7B, whose
`p` is `k · 2,048`).
"""

from __future__ import annotations

import argparse
import time

import torch

from hf_kvbridge.fitting.solve import LAMBDA_GRID, rotate_, strip_rows
from hf_kvbridge.tools.bench.report import write_measurement


def _problem(p: int, q: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    f64 = torch.float64

    def gram():
        x = torch.randn(p, min(p, 512), generator=gen, dtype=f64)
        z = x @ x.T / x.shape[1]
        z.diagonal().add_(0.01)
        root = z.diagonal().sqrt()
        return z.div_(root[:, None]).div_(root[None, :])  # (p, p) standardized: unit diagonal

    z, held = gram(), gram()
    a = torch.randn(p, q, generator=gen, dtype=f64)  # (p, q) standardized cross block, train
    c = a + 0.1 * torch.randn(p, q, generator=gen, dtype=f64)  # (p, q) held-out
    vy = torch.full((q,), float(p), dtype=f64)  # (q,) held-out variance of each output column
    return z, held, a, c, vy


def eigh_path(z, held, a, c, vy, lambdas):
    """`heldout_r2_chunks`' steps on standardized moments: returns `(mse (Λ, q), seconds by step)`."""
    block = strip_rows(z.shape[0])
    steps = {}
    started = time.perf_counter()
    evals, evecs = torch.linalg.eigh(z)
    evals.clamp_min_(0)
    steps["eigh"] = time.perf_counter() - started
    started = time.perf_counter()
    m = rotate_(held.clone(), evecs, block)  # (p, p) Vᵀ Z' V
    ra, rc = evecs.T @ a, evecs.T @ c  # (p, q)
    steps["rotation"] = time.perf_counter() - started
    started = time.perf_counter()
    mse = torch.empty(len(lambdas), a.shape[1], dtype=torch.float64)
    for i, lam in enumerate(lambdas):
        w = ra / (evals + lam)[:, None]  # (p, q)
        mse[i] = vy - 2 * (rc * w).sum(0) + (m @ w).mul_(w).sum(0)
    steps["lambda_loop"] = time.perf_counter() - started
    return mse, steps


def cholesky_path(z, held, a, c, vy, lambdas):
    """One Cholesky factorisation of `Z + λI` per λ: returns `(mse (Λ, q), seconds by step)`."""
    steps = {"cholesky": 0.0, "triangular_solves": 0.0, "heldout_product": 0.0}
    factor = torch.empty_like(z)  # (p, p)
    mse = torch.empty(len(lambdas), a.shape[1], dtype=torch.float64)
    for i, lam in enumerate(lambdas):
        started = time.perf_counter()
        factor.copy_(z).diagonal().add_(lam)
        torch.linalg.cholesky_ex(factor, out=(factor, torch.empty((), dtype=torch.int32)))
        mid = time.perf_counter()
        w = torch.linalg.solve_triangular(factor.mT, torch.linalg.solve_triangular(factor, a, upper=False), upper=True)
        end = time.perf_counter()
        mse[i] = vy - 2 * (c * w).sum(0) + (held @ w).mul_(w).sum(0)
        steps["cholesky"] += mid - started
        steps["triangular_solves"] += end - mid
        steps["heldout_product"] += time.perf_counter() - end
    return mse, steps


def measure(p: int, q: int, lambdas=LAMBDA_GRID) -> dict:
    """Both paths on one random problem of `p` inputs and `q` outputs."""
    problem = _problem(p, q)
    eigh_mse, eigh_steps = eigh_path(*problem, lambdas)
    chol_mse, chol_steps = cholesky_path(*problem, lambdas)
    eigh_s, chol_s = sum(eigh_steps.values()), sum(chol_steps.values())
    return {
        "p": p,
        "q": q,
        "lambdas": len(lambdas),
        "eigh_seconds": round(eigh_s, 3),
        "eigh_steps": {k: round(v, 3) for k, v in eigh_steps.items()},
        "cholesky_seconds": round(chol_s, 3),
        "cholesky_steps": {k: round(v, 3) for k, v in chol_steps.items()},
        "cholesky_vs_eigh": round(chol_s / eigh_s, 3),
        "max_relative_mse_difference": float(((eigh_mse - chol_mse).abs() / problem[4]).max()),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--p", type=int, nargs="+", default=[4096, 6144], help="map input features")
    parser.add_argument("--outputs", type=int, default=2048, help="map output columns q")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="solve_paths.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    records = []
    for p in args.p:
        record = measure(p, args.outputs)
        records.append(record)
        print(
            f"p={p} q={args.outputs}: eigh path {record['eigh_seconds']} s {record['eigh_steps']}; cholesky path "
            f"{record['cholesky_seconds']} s {record['cholesky_steps']} ({record['cholesky_vs_eigh']}×); "
            f"max |Δ mse| / var {record['max_relative_mse_difference']:.1e}"
        )
    write_measurement(args.out, records=records)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
