"""Peak memory of one map's solve, measured: the held-out λ search (`choose_ridge_lambdas`) and the refit on train +
held-out (`solve_ridge` with the chosen per-column λ), each in a fresh subprocess per case.

The statistics are real float32 [`BlockStatistics`] (one target layer from `k` source layers, all heads, K and V
jointly) filled with random moments (an SPD Gram block), so the solve runs the code path calibration runs. Memory is
the process's peak resident set size above what it held just before (Linux `VmHWM`, reset through
`/proc/self/clear_refs`), reported in units of one `p × p` float64 matrix (`p²·8` bytes) next to the plan
(`hf_kvbridge.fitting.budget.solve_bytes`).

    python scripts/measure_solve_memory.py --p 2048 4096 [--json out.json] [--code OLD_CHECKOUT]

`--code` puts another checkout's `hf_kvbridge` first on the path (to measure an older solve). Large allocations go
through `mmap` (`MALLOC_MMAP_THRESHOLD_`), so freed matrices leave the resident set, as torch's do on real shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> int:
    """Resets the peak resident set size to the current one and returns it."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def shape(p: int, head_dim: int, k: int | None = None) -> tuple[int, int]:
    """`(k, heads)` with `k · heads · 2·head_dim = p`: 6 source layers when that divides, as the paper's top-k."""
    for layers in (6, 4, 3, 2, 1) if k is None else (k,):
        if p % (layers * 2 * head_dim) == 0:
            return layers, p // (layers * 2 * head_dim)
    raise SystemExit(f"p={p} is not k · heads · 2·{head_dim} for any k ≤ 6")


def child(p: int, head_dim: int, seed: int, k: int | None = None) -> dict:
    import torch

    from hf_kvbridge.fitting import solve
    from hf_kvbridge.fitting.statistics.blocks import BlockStatistics
    from hf_kvbridge.utils.heads import map_groups

    k, heads = shape(p, head_dim, k)
    row = heads * 2 * head_dim
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(p, row, generator=gen, dtype=torch.float64) / p**0.5  # the relation both parts share
    basis = torch.randn(p, min(p, 512), generator=gen, dtype=torch.float64)  # the inputs' shared correlations
    parts = []
    for _ in range(2):  # train, held-out
        stats = BlockStatistics(k, 1, heads, head_dim, sources=list(range(k)), targets=[0])
        n = 4 * p
        gram = basis @ basis.T / basis.shape[1]
        gram.diagonal().add_(0.05 + torch.rand(p, generator=gen, dtype=torch.float64))
        cross = gram @ (weight + torch.randn(p, row, generator=gen, dtype=torch.float64) / p)
        stats.count = n
        stats.xx[0].copy_(gram * n)
        stats.xy[0].copy_(cross * n)
        stats.yy[0].copy_(((weight * cross).sum(0) * 1.2 + 0.1) * n)
        x_mean = torch.randn(p, generator=gen, dtype=torch.float64)
        stats.x_mean[0].copy_(x_mean)
        stats.y_mean[0].copy_(x_mean @ weight + 1.0)  # the means follow the relation too
        del gram, cross
        parts.append(stats)
    del weight, basis
    train, held = parts
    layers = [list(range(k))]
    # load the LAPACK/BLAS kernels (and their fixed buffers) before measuring
    small = torch.eye(64, dtype=torch.float64) * 2
    torch.linalg.eigh(small)
    torch.linalg.cholesky_ex(small)
    torch.linalg.lstsq(small, small, driver="gelsd")
    del small
    unit = p * p * 8

    base = search_base = _reset_peak()
    started = time.perf_counter()
    lambdas, r2 = solve.choose_ridge_lambdas(train, held, layers, "all_heads", heads, head_dim)
    search_seconds = time.perf_counter() - started
    search = _status("VmHWM") - base
    merged = train.merge_(held)
    del held
    ((x_idx, y_idx),) = map_groups(merged, layers[0], 0, "all_heads")
    lam = solve.map_group_lambda(lambdas, 0, 0, "all_heads", "joint", heads, head_dim)
    base = _reset_peak()
    started = time.perf_counter()
    weight, bias = solve.solve_ridge(merged, x_idx, y_idx, lam)
    refit_seconds = time.perf_counter() - started
    refit = _status("VmHWM") - base
    # getrusage's peak cannot be reset: above the resident set before the search, it is the solve's peak whenever
    # that is above the setup's (true from p ≈ 2,000: the setup holds no more than the statistics and two blocks)
    maxrss_delta = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - search_base
    plan = None
    try:
        from hf_kvbridge.fitting.budget import solve_bytes

        plan = solve_bytes(k, row)
    except ImportError:
        pass
    return {
        "p": p,
        "k": k,
        "width": row,
        "solve_module": solve.__file__,
        "lambda_k": lambdas["k"][0][0],
        "lambda_v": lambdas["v"][0][0],
        "search_bytes": search,
        "refit_bytes": refit,
        "peak_bytes": max(search, refit),
        "peak_units": round(max(search, refit) / unit, 3),
        "search_units": round(search / unit, 3),
        "refit_units": round(refit / unit, 3),
        "plan_bytes": plan,
        "plan_units": None if plan is None else round(plan / unit, 3),
        "weight_finite": bool(torch.isfinite(weight).all()),
        "maxrss_delta_bytes": maxrss_delta,
        "search_seconds": round(search_seconds, 2),
        "refit_seconds": round(refit_seconds, 2),
        "threads": torch.get_num_threads(),
    }


def measure(
    p: int,
    head_dim: int = 128,
    seed: int = 0,
    code: str | None = None,
    threads: int | None = None,
    k: int | None = None,
) -> dict:
    """One case in a fresh interpreter; returns its JSON record."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([code or root, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    command = [sys.executable, os.path.abspath(__file__), "--child", "--p", str(p), "--head-dim", str(head_dim)]
    command += ["--seed", str(seed)] + ([] if k is None else ["--k", str(k)])
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"measuring p={p} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--p", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--k", type=int, default=None, help="source layers per map (default: 6, 4, 3, 2 or 1)")
    parser.add_argument("--code", default=None, help="a checkout whose hf_kvbridge to measure")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the measured process")
    parser.add_argument("--json", default=None, help="write the records here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.p[0], args.head_dim, args.seed, args.k)))
        return
    records = []
    for p in args.p:
        record = measure(p, args.head_dim, args.seed, args.code, threads=args.threads, k=args.k)
        records.append(record)
        print(json.dumps(record), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
