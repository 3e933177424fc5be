"""How exact is flashot?  Errors against a dense float64 oracle run to convergence (docs/exactness.md).

    python benchmarks/exactness.py [--n 200] [--tables 1,2,3] [--out FILE]

Tables (markdown):
(1) ``SamplesLoss(tol=1e-9)`` and ``solve_sample(tol=1e-9)`` per engine and dtype: relative error of the
    value and of the gradient in x (max |error| / max |exact|) against the oracle (the value of the
    dense problem solved to 1e-13, the envelope gradient from its plans).
(2) GeomLoss' default schedule (``tol=None``) against the converged answer, for several blur /
    diameter ratios: what the default costs in accuracy.
(3) ``solve_sample`` at small epsilon: iterations to ``tol=1e-6`` with the defaults (eps-scaling and
    Anderson below 3e-3 of the largest cost) and with plain iterations (``acceleration=None``).
Points: uniform in the unit square (d = 2), n = m, seed 0.  The oracle is
``tests/references.py`` (no flashot code in it).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import warnings
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

import flashot  # noqa: E402
import references as ref  # noqa: E402


def clouds(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 2, generator=g, dtype=torch.float64)
    y = torch.rand(n, 2, generator=g, dtype=torch.float64) * 0.8 + 0.3
    w = torch.full((n,), 1.0 / n, dtype=torch.float64)
    return x, y, w, w.clone()


def rel(u: torch.Tensor, v: torch.Tensor) -> float:
    u, v = u.detach().double(), v.detach().double()
    return float((u - v).abs().max() / v.abs().max().clamp_min(1e-300))


def exact_divergence(x, y, a, b, eps, rho):
    """(S, dS/dx): the debiased divergence for C = |x - y|^2 / 2 and its envelope gradient."""
    sab = ref.solve(ref.cost_matrix(x, y), a, b, eps, rho, rho)
    saa = ref.solve(ref.cost_matrix(x, x), a, a, eps, rho, rho)
    sbb = ref.solve(ref.cost_matrix(y, y), b, b, eps, rho, rho)
    grad = (sab.plan.sum(1, keepdim=True) * x - sab.plan @ y) - (saa.plan.sum(1, keepdim=True) * x - saa.plan @ x)
    return sab.dual - 0.5 * saa.dual - 0.5 * sbb.dual, grad


def exact_ot(x, y, a, b, eps, rho):
    """(OT, dOT/dx) for C = |x - y|^2 (POT's convention)."""
    s = ref.solve(ref.cost_matrix(x, y, half=False), a, b, eps, rho, rho)
    return s.dual, 2 * (s.plan.sum(1, keepdim=True) * x - s.plan @ y)


def table_engines(n: int) -> list[str]:
    x, y, a, b = clouds(n)
    blur, reg = 0.2, 0.04
    rows = ["| front end | rho | engine | dtype | value rel. error | grad x rel. error |", "|---|---|---|---|---|---|"]
    for rho in (None, 0.25):
        S, gS = exact_divergence(x, y, a, b, blur**2, rho)
        O, gO = exact_ot(x, y, a, b, reg, rho)
        for engine in ("dense", "tiled", "cpu", "multiscale", "triton"):
            for dt in (torch.float64, torch.float32):
                if engine == "triton" and (n > 64 or not torch.cuda.is_available() and dt == torch.float32):
                    continue  # the interpreter is slow: tests/reference covers it on small cases
                xx = x.to(dt).requires_grad_()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    L = flashot.SamplesLoss(
                        "sinkhorn",
                        blur=blur,
                        reach=None if rho is None else rho**0.5,
                        tol=1e-9 if dt == torch.float64 else 1e-6,
                        max_iter=20_000,
                        backend="tensorized" if engine == "dense" else engine,
                    )
                    v = L(a.to(dt), xx, b.to(dt), y.to(dt))
                    (g,) = torch.autograd.grad(v, xx)
                rows.append(
                    f"| SamplesLoss | {rho} | {engine} | {str(dt)[6:]} | {abs(float(v.detach()) - S) / abs(S):.1e} | "
                    f"{rel(g, gS):.1e} |"
                )
                if engine == "multiscale":
                    continue
                xx = x.to(dt).requires_grad_()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    r = flashot.solve_sample(
                        xx,
                        y.to(dt),
                        a.to(dt),
                        b.to(dt),
                        reg=reg,
                        unbalanced=rho,
                        tol=1e-9 if dt == torch.float64 else 1e-6,
                        max_iter=20_000,
                        backend=engine,
                    )
                    (g,) = torch.autograd.grad(r.value, xx)
                rows.append(
                    f"| solve_sample | {rho} | {engine} | {str(dt)[6:]} | {abs(float(r.value.detach()) - O) / abs(O):.1e} | "
                    f"{rel(g, gO):.1e} |"
                )
    return rows


def table_schedule(n: int) -> list[str]:
    x, y, a, b = clouds(n)
    diameter = float((torch.cat([x, y]).amax(0) - torch.cat([x, y]).amin(0)).norm())
    rows = [
        "| blur / diameter | scaling | iterations (schedule) | value rel. error | grad x rel. error |",
        "|---|---|---|---|---|",
    ]
    for frac in (0.3, 0.1, 0.05):  # smaller blurs: the dense oracle needs ~1e5 iterations
        blur = frac * diameter
        S, gS = exact_divergence(x, y, a, b, blur**2, None)
        for scaling in (0.5, 0.9):
            xx = x.clone().requires_grad_()
            L = flashot.SamplesLoss("sinkhorn", blur=blur, scaling=scaling)
            v = L(a, xx, b, y)
            (g,) = torch.autograd.grad(v, xx)
            rows.append(
                f"| {frac} | {scaling} | {L.last_n_iter} | {abs(float(v.detach()) - S) / abs(S):.1e} | {rel(g, gS):.1e} |"
            )
    return rows


def table_small_eps(n: int) -> list[str]:
    x, y, a, b = clouds(n)
    cmax = float(ref.cost_matrix(torch.cat([x, y]), torch.cat([x, y]), half=False).max())
    rows = [
        "| reg / largest cost | dtype | unbalanced | defaults: iterations, converged, error | plain: iterations, converged, error |",
        "|---|---|---|---|---|",
    ]
    for frac in (3e-3, 1e-3, 3e-4, 1e-4):
        for dt in (torch.float64, torch.float32):
            for ub in (None, 1.0):
                cells = []
                for kw in ({}, {"acceleration": None}):
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        r = flashot.solve_sample(x.to(dt), y.to(dt), reg=frac * cmax, unbalanced=ub, **kw)
                    cells.append(f"{r.n_iter}, {'yes' if r.converged else 'no'}, {r.error:.1e}")
                rows.append(f"| {frac:g} | {str(dt)[6:]} | {ub} | {cells[0]} | {cells[1]} |")
    rows += [
        "",
        "At 1e-4 of the largest cost, float64, `acceleration=flashot.Anderson(m=10), max_iter=5000`:",
        "",
        "| unbalanced | iterations, converged, error |",
        "|---|---|",
    ]
    for ub in (None, 1.0):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r = flashot.solve_sample(
                x, y, reg=1e-4 * cmax, unbalanced=ub, max_iter=5000, acceleration=flashot.Anderson(m=10)
            )
        rows.append(f"| {ub} | {r.n_iter}, {'yes' if r.converged else 'no'}, {r.error:.1e} |")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--out", default=None, help="also write the tables to this markdown file")
    ap.add_argument("--tables", default="1,2,3", help="which tables to run (default 1,2,3)")
    args = ap.parse_args()
    wanted = set(args.tables.split(","))
    cpu = platform.processor() or platform.machine()
    lines = [f"flashot {flashot.__version__}, torch {torch.__version__}, {cpu}, n = m = {args.n}", ""]
    for title, fn in (
        ("(1) converged solves against the oracle (blur 0.2 / reg 0.04)", table_engines),
        ("(2) GeomLoss' schedule (tol=None) against the converged divergence", table_schedule),
        ("(3) small epsilon: solve_sample(tol=1e-6, max_iter=1000)", table_small_eps),
    ):
        if title[1] not in wanted:
            continue
        lines += [f"### {title}", ""] + fn(args.n) + [""]
        print(f"{title}: done", file=sys.stderr, flush=True)
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
