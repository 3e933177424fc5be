"""Iterations (and time) to tolerance with and without acceleration.

    python benchmarks/acceleration.py                 # n=2000, d=2/3, eps 0.05 / 0.01 / 0.003, max_iter 1500
    python benchmarks/acceleration.py --n 500 --eps 0.01

For each (d, eps) solves balanced entropic OT with ``solve_sample`` (cost |x-y|^2,
alternating log-domain updates, float32) between a uniform cloud in the unit cube and
a Gaussian blob, until the L1 marginal violation is below ``--tol`` (checked every
iteration: ``inner_iterations=1``), and prints a markdown table of iterations to
tolerance ("> max_iter" when not reached) and wall time.  ``--unbalanced RHO`` adds
KL marginal penalties (the error is then the potential change / eps).
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

import flashot
from flashot import Anderson, Momentum

CONFIGS = [
    ("plain", None),
    ("Momentum(1.5)", Momentum(1.5)),
    ("Momentum(1.8)", Momentum(1.8)),
    ("Anderson(5)", Anderson(5)),
]


def clouds(n: int, d: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, d, generator=g)
    y = 0.5 + 0.15 * torch.randn(n, d, generator=g)
    return x, y


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--dims", type=int, nargs="+", default=[2, 3])
    p.add_argument("--eps", type=float, nargs="+", default=[0.05, 0.01, 0.003])
    p.add_argument("--tol", type=float, default=1e-5)
    p.add_argument("--max-iter", type=int, default=1500)
    p.add_argument("--unbalanced", type=float, default=None)
    p.add_argument("--backend", default="auto")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    names = [c[0] for c in CONFIGS]
    print(
        f"n={args.n}, tol={args.tol:g}, max_iter={args.max_iter}, unbalanced={args.unbalanced}, "
        f"torch threads={torch.get_num_threads()}\n"
    )
    print("| d | eps | " + " | ".join(names) + " | best speed-up (iters) |")
    print("|---|---|" + "---|" * len(names) + "---|")
    for d in args.dims:
        x, y = clouds(args.n, d)
        for eps in args.eps:
            cells, iters = [], []
            for _, acc in CONFIGS:
                t0 = time.perf_counter()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    r = flashot.solve_sample(
                        x,
                        y,
                        reg=eps,
                        tol=args.tol,
                        max_iter=args.max_iter,
                        method="sinkhorn",
                        inner_iterations=1,
                        acceleration=acc,
                        unbalanced=args.unbalanced,
                        backend=args.backend,
                    )
                dt = time.perf_counter() - t0
                it = r.n_iter if r.converged else None
                iters.append(it)
                cells.append(f"{it} ({dt:.1f} s)" if it is not None else f"> {args.max_iter} ({dt:.1f} s)")
            base = iters[0] if iters[0] is not None else args.max_iter
            best = min((i for i in iters[1:] if i is not None), default=None)
            sp = f"{base / best:.1f}x" + ("" if iters[0] is not None else "+") if best else "-"
            print(f"| {d} | {eps:g} | " + " | ".join(cells) + f" | {sp} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
