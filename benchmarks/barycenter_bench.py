"""Free-support barycenter: flashot against POT on the same problems, and flashot alone at scale.

K = 3 clouds of n points in 2-D (Gaussian blobs at three centres), a barycenter support of
M points, reg = 0.05 (cost |x - y|^2, clouds of unit scale), a fixed number of fixed-point
steps (stopThr = 0, so both libraries do the same number of steps).  POT
(``ot.bregman.free_support_sinkhorn_barycenter``, float64, dense M x n cost matrices) runs where
``--pot-max`` allows; flashot runs float32 and float64 with ``backend="auto"``.

    python benchmarks/barycenter_bench.py --sizes 2000,10000,100000 --support 1000 --steps 5
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

import flashot


def clouds(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    centres = np.array([[0.0, 0.0], [3.0, 0.0], [1.5, 2.5]])
    return [rng.normal(size=(n, 2)) * (0.5 + 0.25 * k) + c for k, c in enumerate(centres)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="2000,10000,100000")
    p.add_argument("--support", type=int, default=1000)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--reg", type=float, default=0.05)
    p.add_argument("--pot-max", type=int, default=10000, help="largest n for POT (dense M x n float64)")
    a = p.parse_args(argv)
    cpu = (
        next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
        if os.path.exists("/proc/cpuinfo")
        else "?"
    )
    print(
        f"CPU: {cpu}, {os.cpu_count()} logical CPUs, torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"K = 3 clouds, support M = {a.support}, reg = {a.reg}, {a.steps} fixed-point steps (stopThr = 0)\n"
    )
    print("| n per cloud | solver | seconds | inner Sinkhorn iterations | max |X - X_POT| |")
    print("|---|---|---|---|---|")
    try:
        import ot
    except ImportError:
        ot = None
    for n in [int(s) for s in a.sizes.split(",")]:
        Ys = clouds(n)
        X0 = np.random.default_rng(1).normal(size=(a.support, 2)) + [1.5, 1.0]
        ref = None
        if ot is not None and n <= a.pot_max:
            t = time.perf_counter()
            ref = ot.bregman.free_support_sinkhorn_barycenter(
                Ys, [np.full(n, 1 / n)] * 3, X0, a.reg, numItermax=a.steps, stopThr=0.0
            )
            print(f"| {n:,} | POT {ot.__version__} (float64, dense) | {time.perf_counter() - t:.2f} | | |")
        for dt in (torch.float32, torch.float64):
            Yt = [torch.tensor(Y, dtype=dt) for Y in Ys]
            t = time.perf_counter()
            X, log = flashot.free_support_barycenter(
                Yt, None, torch.tensor(X0, dtype=dt), a.reg, numItermax=a.steps, stopThr=1e-300, log=True
            )
            dt_s = time.perf_counter() - t
            diff = "" if ref is None else f"{np.abs(X.double().numpy() - ref).max():.1e}"
            print(f"| {n:,} | flashot ({str(dt)[6:]}) | {dt_s:.2f} | {sum(log.inner_iterations)} | {diff} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
