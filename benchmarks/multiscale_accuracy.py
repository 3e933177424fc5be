"""How far multiscale lands from single scale, with GeomLoss' schedule and with ``tol=``.

Both backends follow an epsilon schedule; with the default fixed schedule neither is run to
convergence, so they can differ by the schedule's own error.  With ``tol=`` both iterate at the
final epsilon until the marginal error is below ``tol`` and must agree.

    python benchmarks/multiscale_accuracy.py [--n 2000] [--blur 0.02]
"""

from __future__ import annotations

import argparse

import torch

import flashot


def loss_and_grad(x, y, backend, **kw):
    x = x.clone().requires_grad_(True)
    L = flashot.SamplesLoss(blur=kw.pop("blur"), backend=backend, **kw)
    v = L(x, y)
    (g,) = torch.autograd.grad(v, x)
    return v.item(), g


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--blur", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    gen = torch.Generator().manual_seed(a.seed)
    x = 0.1 * torch.randn(a.n, 2, generator=gen, dtype=torch.float64) + 0.5
    y = 0.1 * torch.randn(a.n, 2, generator=gen, dtype=torch.float64) + 0.6
    print(f"2-D Gaussian clouds, n = m = {a.n}, blur {a.blur}, float64")
    print("schedule          | value rel. diff | gradient rel. diff (L2)")
    for label, kw in (("GeomLoss' (fixed)", {}), ("tol=1e-7", {"tol": 1e-7, "max_iter": 10000})):
        v1, g1 = loss_and_grad(x, y, "cpu", blur=a.blur, **kw)
        v2, g2 = loss_and_grad(x, y, "multiscale", blur=a.blur, **kw)
        dv = abs(v2 - v1) / abs(v1)
        dg = ((g2 - g1).norm() / g1.norm()).item()
        print(f"{label:17s} | {dv:15.2e} | {dg:.2e}")


if __name__ == "__main__":
    main()
