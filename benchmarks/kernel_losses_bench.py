"""Kernel norms and the Hausdorff divergence: flashot against GeomLoss on the same problems.

Value + gradient (``L(x, y).backward()``) of ``SamplesLoss(loss, blur=0.5)`` between two
clouds of n points in 3-D (float32), flashot ``backend="auto"`` against GeomLoss 0.3.1
``backend="tensorized"`` (an n x n matrix per term) and, with ``--keops``, ``"online"``
(KeOps; compiles its formulas on first use, excluded from the timing by a warm-up).  GeomLoss'
``"hausdorff"`` raises KeyError in 0.3.1, so that row has flashot only.  Medians of ``--runs``.

    python benchmarks/kernel_losses_bench.py --sizes 2000,10000 --runs 3 [--keops]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import flashot


def timed(fn, runs: int) -> float:
    fn()  # warm-up (compiles, caches)
    ts = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def step(L, x, y):
    def run():
        xr = x.clone().requires_grad_()
        L(xr, y).backward()

    return run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="2000,10000")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--keops", action="store_true")
    p.add_argument("--tensorized-max", type=int, default=10000)
    a = p.parse_args(argv)
    try:
        import geomloss
    except ImportError:
        geomloss = None
    cpu = (
        next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
        if os.path.exists("/proc/cpuinfo")
        else "?"
    )
    print(
        f"CPU: {cpu}, {os.cpu_count()} logical CPUs, torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"float32, d = 3, blur = 0.5, value + gradient, median of {a.runs}\n"
    )
    peers = ["tensorized"] + (["online"] if a.keops else [])
    print("| loss | n = m | flashot s | " + " | ".join(f"GeomLoss {p} s (ratio)" for p in peers) + " |")
    print("|---|---|---|" + "---|" * len(peers))
    for n in [int(s) for s in a.sizes.split(",")]:
        g = torch.Generator().manual_seed(n)
        x, y = torch.randn(n, 3, generator=g), torch.randn(n, 3, generator=g) + 0.5
        for loss in ("gaussian", "laplacian", "energy", "hausdorff"):
            t0 = timed(step(flashot.SamplesLoss(loss, blur=0.5), x, y), a.runs)
            cells = []
            for peer in peers:
                if geomloss is None or loss == "hausdorff" or (peer == "tensorized" and n > a.tensorized_max):
                    cells.append("-")
                    continue
                t1 = timed(step(geomloss.SamplesLoss(loss, blur=0.5, backend=peer), x, y), a.runs)
                cells.append(f"{t1:.3f} ({t1 / t0:.1f}x)")
            print(f"| {loss} | {n:,} | {t0:.3f} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
