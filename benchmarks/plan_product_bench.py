"""Times the narrow plan products (V of 4 columns) of the CPU kernels, as built now.

Two measurements, float32, 2 threads:

* ``dense``: the ``cpu`` engine's ``plan_product`` at n = m = 20,000 (uniform points in the unit
  cube, eps = 0.01, the rows' plan masses near 1/n), median of 7 calls;
* ``block-sparse``: the two plan products of the gradient of a multiscale ``SamplesLoss`` at
  ``--n`` points (the data of ``multiscale_bench.py``), each called twice more with the same
  arguments and timed.

Used to pick ``Shape::PV_R`` (rows per micro-kernel block) in ``kernels.cpp``: edit it, then run
this script (``FLASHOT_CPU_MARCH=x86-64-v3`` for the AVX2 build)::

    python benchmarks/plan_product_bench.py --n 300000
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from multiscale_bench import surfaces

import flashot
from flashot.costs import get_cost
from flashot.ops import blocksparse as BS
from flashot.ops import get_engine


def dense(n: int = 20000) -> float:
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(1, n, 3, generator=g), torch.rand(1, n, 3, generator=g)
    cost = get_cost("sqeuclidean")
    eng = get_engine("cpu", device=torch.device("cpu"), dtype=torch.float32, cost=cost)
    eps = 0.01
    h = torch.full((1, n), -float(torch.log(torch.tensor(float(n)))))
    alpha = h + eng.softmin(x, y, h, eps, cost) / eps  # rows of plan mass 1 / n
    V = torch.rand(1, n, 4, generator=g)
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        eng.plan_product(x, y, alpha, h, eps, V, cost)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def block_sparse(n: int) -> list[list[float]]:
    """Seconds of two extra calls of each plan product of the gradient."""
    out: list[list[float]] = []
    real = BS.BlockSparseEngine.plan_product

    def timed(self, *args, **kw):
        rep = []
        for _ in range(2):
            t0 = time.perf_counter()
            real(self, *args, **kw)
            rep.append(time.perf_counter() - t0)
        out.append(rep)
        return real(self, *args, **kw)

    BS.BlockSparseEngine.plan_product = timed
    try:
        x, y = surfaces(n)
        pts = torch.cat([x, y])
        diam = float((pts.amax(0) - pts.amin(0)).norm())
        xg = x.clone().requires_grad_()
        v = flashot.SamplesLoss(blur=0.01 * diam, backend="multiscale")(xg, y)
        torch.autograd.grad(v, xg)
    finally:
        BS.BlockSparseEngine.plan_product = real
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=300000, help="points per cloud of the multiscale run")
    a = ap.parse_args()
    from flashot.ops.cpu.build import BUILD_INFO, load

    load(quiet=True)
    print(f"kernels: -march={BUILD_INFO.get('march')}, ISA {', '.join(BUILD_INFO.get('isa', []))}")
    print(f"dense plan product, n = m = 20,000, K = 4: median {dense():.4f} s")
    for k, rep in enumerate(block_sparse(a.n), 1):
        print(f"block-sparse plan product {k} (n = {a.n:,}, K = 4): {', '.join(f'{t:.3f}' for t in rep)} s")


if __name__ == "__main__":
    main()
