"""Acceleration at small epsilon, with the default epsilon-scaling: marginal error after fixed budgets.

    python benchmarks/accel_small_eps.py [--problems a,b,c,d,e] [--budgets 100,300,1000]

For each problem, ``solve_sample(x, y, reg=..., max_iter=max(budgets), tol=None)`` (alternating
updates, ``eps_scaling`` left at its default) with ``acceleration`` = None (plain), ``flashot.Momentum()`` (adaptive),
``flashot.Momentum(1.5)`` and ``flashot.Anderson(m=5)``.  The error (the loop's L1 marginal error,
``res.error``) after each budget (one solve per budget), and the iterations of a ``tol=1e-6`` solve with
``max_iter=max(budgets)`` ("-": not converged).

Problems (seed 0):
  a: 60 x 50 uniform in the unit square, reg = 1e-3, float64 (issue 33's "small epsilon" case)
  b: 1000 x 800 Gaussians N(0, I_3), N(1, I_3), reg = 1e-3, float32 (issue 13's reported case)
  c: 300 x 200 uniform on [0, 1], reg = 1e-3 cmax, float64
  d: 300 x 200 uniform on [0, 1], reg = 1e-4 cmax, float64
  e: 200 x 250 uniform in the unit square, reg = 1e-4 cmax, float64
(``cmax``: flashot's bound on the largest cost, the squared diagonal of the joint bounding box.)
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import flashot
from flashot.schedules import max_diameter


def problem(name: str):
    g = torch.Generator().manual_seed(0)
    f64 = torch.float64
    if name == "a":
        return torch.rand(60, 2, generator=g, dtype=f64), torch.rand(50, 2, generator=g, dtype=f64), 1e-3, None
    if name == "b":
        return torch.randn(1000, 3, generator=g), torch.randn(800, 3, generator=g) + 1, 1e-3, None
    if name in "cd":
        return (
            torch.rand(300, 1, generator=g, dtype=f64),
            torch.rand(200, 1, generator=g, dtype=f64),
            None,
            1e-3 if name == "c" else 1e-4,
        )
    if name == "e":
        return torch.rand(200, 2, generator=g, dtype=f64), torch.rand(250, 2, generator=g, dtype=f64), None, 1e-4
    raise ValueError(f"--problems: unknown problem {name!r}")


# "auto" picks Anderson(m=5) on all these problems (alternating updates, reg < 3e-3 cmax): not repeated.
CONFIGS = [
    ("plain", None),
    ("Momentum(1.5)", flashot.Momentum(1.5)),
    ("Momentum()", flashot.Momentum()),
    ("Anderson(5)", flashot.Anderson(m=5)),
]


def run(x, y, reg, acc, budgets):
    """``res.error`` after each budget (one solve each: Momentum() plans with the iterations left), and
    ``n_iter`` of a ``tol=1e-6`` solve (None if it did not converge within ``max(budgets)``)."""
    t0 = time.perf_counter()
    at = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for b in budgets:
            r = flashot.solve_sample(
                x, y, reg=reg, max_iter=b, tol=None, acceleration=acc, callback=lambda r: None
            )  # a callback: the error is read at the end
            at.append(r.error)
        r = flashot.solve_sample(x, y, reg=reg, max_iter=max(budgets), tol=1e-6, acceleration=acc)
    return at, (r.n_iter if r.converged else None), time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", default="a,b,c,d,e")
    ap.add_argument("--budgets", default="100,300,1000")
    args = ap.parse_args(argv)
    budgets = [int(b) for b in args.budgets.split(",")]
    torch.set_num_threads(1)
    head = " | ".join(f"error @{b}" for b in budgets)
    print(f"| problem | reg / cmax | acceleration | {head} | iterations to 1e-6 | time (s) |")
    print("|---|---|---|" + "---|" * len(budgets) + "---|---|")
    for name in args.problems.split(","):
        x, y, reg, frac = problem(name)
        cmax = max_diameter(x, y) ** 2
        reg = frac * cmax if reg is None else reg
        for label, acc in CONFIGS:
            at, to_tol, dt = run(x, y, reg, acc, budgets)
            cells = " | ".join(f"{e:.2e}" for e in at)
            print(f"| {name} | {reg / cmax:.2g} | {label} | {cells} | {to_tol or '-'} | {dt:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
