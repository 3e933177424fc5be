"""torch.compile (Inductor, CPU) as the CPU technology: the d = 3 softmin, timed next to the `cpu` engine.

    python benchmarks/inductor_softmin.py [--n 20000] [--runs 5] [--block 400]

Issue 6 asks for the CPU technology to be picked by measurement.  This script compiles
``out_i = -eps log sum_j exp(h_j - |x_i - y_j|^2 / eps)`` for one block of rows with
``torch.compile`` (Inductor fuses the cost, the bias, ``exp`` and the reduction into one C++
loop, so the (block, m) scores are not materialised), loops over row blocks, and times it
against the ``cpu`` engine (``FLASHOT_CPU_MODE=stream``) and the ``tiled`` engine on the same
float32 data; every result is checked against a float64 reference.  The first call's compile
time is reported separately.  Prints a Markdown table (median of ``--runs``).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import torch


def softmin_rows(x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, inv_eps: float) -> torch.Tensor:
    """LSE_j (h_j - |x_i - y_j|^2 / eps) for a block of rows x (bn, d); y (m, d)."""
    c = ((x[:, None, :] - y[None, :, :]) ** 2).sum(-1)
    return torch.logsumexp(h[None, :] - c * inv_eps, dim=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--block", type=int, default=400)
    ap.add_argument("--eps", type=float, default=0.1)
    args = ap.parse_args()
    if args.n < 1 or args.runs < 1 or args.block < 1 or not args.eps > 0:
        ap.error(f"need --n, --runs, --block >= 1 and --eps > 0 (got {args.n}, {args.runs}, {args.block}, {args.eps})")

    from flashot.costs import get_cost
    from flashot.ops.cpu.engine import CpuEngine
    from flashot.ops.tiled import TiledEngine

    n, eps, bn = args.n, args.eps, args.block
    g = torch.Generator().manual_seed(0)
    x = torch.rand(n, 3, generator=g)
    y = torch.rand(n, 3, generator=g)
    h = torch.randn(n, generator=g) - math.log(n)
    ref = -eps * torch.logsumexp(h.double()[None, :] - torch.cdist(x.double(), y.double()) ** 2 / eps, -1)

    compiled = torch.compile(softmin_rows, dynamic=False)

    def inductor():
        out = torch.empty(n)
        for i0 in range(0, n, bn):  # one compiled shape when bn divides n (400 | 20,000), else two
            out[i0 : i0 + bn] = compiled(x[i0 : i0 + bn], y, h, 1.0 / eps)
        return -eps * out

    cost = get_cost("sqeuclidean")
    cpu, tiled = CpuEngine(mode="stream"), TiledEngine()
    impls = {
        f"torch.compile (Inductor), row blocks of {bn}": inductor,
        "flashot `tiled` (blocked PyTorch)": lambda: tiled.softmin(x[None], y[None], h[None], eps, cost)[0],
        "flashot `cpu` engine (stream)": lambda: cpu.softmin(x[None], y[None], h[None], eps, cost)[0],
    }
    rows = []
    for name, fn in impls.items():
        t0 = time.perf_counter()
        out = fn()
        first = time.perf_counter() - t0
        ts = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            out = fn()
            ts.append(time.perf_counter() - t0)
        rows.append((name, statistics.median(ts), first, float((out.double() - ref).abs().max())))
    base = rows[-1][1]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, n = m = {n}, d = 3, float32, eps = {eps}, "
        f"median of {args.runs}, load average {os.getloadavg()[0]:.2f}\n"
    )
    print("| implementation | s / softmin | vs flashot cpu | first call s | max abs error |\n|---|---|---|---|---|")
    for name, t, first, err in rows:
        print(f"| {name} | {t:.4f} | {t / base:.1f}x | {first:.1f} | {err:.1e} |")


if __name__ == "__main__":
    main()
