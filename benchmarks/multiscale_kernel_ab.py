"""A/B two builds of the CPU kernels on the multiscale engine's fused calls, in one process, on one state.

Whole multiscale runs drift by ~15% between processes on the shared VMs used here, more than most kernel
changes.  This script removes the drift from the comparison: it runs one multiscale ``SamplesLoss`` value plus
gradient on the benchmark clouds (``multiscale_bench.surfaces(n)``), captures the first fused call of each kind
(``blocksparse._pair_cpu`` with sub-tile pruning: the first pair step ``pair0``, the first symmetric step
``sym0``, the final pair step with barycentres ``pair1``, the final symmetric step with barycentres ``sym2``),
then runs each captured call ``--rounds`` times on two kernel libraries loaded side by side, alternating which
goes first.  It prints the pairs each evaluated, their median times, the median of the per-round ratios B / A
and the largest relative difference of their outputs (entry by entry: large where an entry is near 0, as the
barycentre numerators can be; `benchmarks/` has no float64 reference for them).  Build the libraries first, for instance with
``FLASHOT_CPU_MARCH=x86-64-v3 flashot build`` on the old and on the new source (float32 block-sparse ``.so`` files, ``flashot_cpu_bs_f32_*.so`` of
``~/.cache/flashot``), then::

    FLASHOT_CPU_MARCH=x86-64-v3 python benchmarks/multiscale_kernel_ab.py OLD.so NEW.so --n 1000000 --rounds 5

(``FLASHOT_CPU_MARCH`` picks the build that runs the captured solve itself; the timed calls use OLD and NEW.)
Name the CPU beside the table.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from multiscale_bench import surfaces

import flashot
from flashot.ops import blocksparse
from flashot.ops.cpu import build


def capture(n: int, power: int = 2, d: int = 3, dtype: torch.dtype = torch.float32) -> dict:
    """The first tile-pruned fused call of each kind in a multiscale value + gradient at n = m."""
    orig = blocksparse.pair_cpu  # the name the engine calls
    calls: dict = {}

    def wrapped(lib, pat, x, y, hx, hy, eps, cost, sym, bary=0, tiles=None, tasks=None):
        if tasks is None and (tiles is not None or d > 3):  # sub-tile pruning is for d <= 3
            calls.setdefault(("sym" if sym else "pair") + str(bary), (pat, x, y, hx, hy, eps, cost, sym, bary, tiles))
        return orig(lib, pat, x, y, hx, hy, eps, cost, sym, bary, tiles, tasks)

    blocksparse.pair_cpu = wrapped
    try:
        x, y = (t.to(dtype) for t in surfaces(n))
        if d > 3:  # the surfaces with d - 3 small extra coordinates (the generic-d kernels)
            g = torch.Generator().manual_seed(0)
            x, y = (torch.cat([t, 0.05 * torch.randn(n, d - 3, generator=g, dtype=t.dtype)], 1) for t in (x, y))
        pts = torch.cat([x, y])
        diam = float((pts.amax(0) - pts.amin(0)).norm())
        loss = flashot.SamplesLoss(p=power, blur=0.01 * diam, backend="multiscale")
        xg = x.clone().requires_grad_()
        torch.autograd.grad(loss(xg, y), xg)
    finally:
        blocksparse.pair_cpu = orig
    return calls


def run_ab(libs: list, args: tuple, rounds: int) -> dict:
    """Alternating timings of one captured call on the two libraries (A first in even rounds)."""
    times: list[list[float]] = [[], []]
    outs: list = [None, None]
    pairs = [0, 0]
    for rnd in range(rounds):
        for k in (0, 1) if rnd % 2 == 0 else (1, 0):
            counter = [0]
            t0 = time.perf_counter()
            tiles = args[-1]._replace(counter=counter) if args[-1] is not None else None  # none for d > 3
            outs[k] = blocksparse._pair_cpu(libs[k], *args[:-1], tiles)
            times[k].append(time.perf_counter() - t0)
            pairs[k] = counter[0]
    diff = max(
        float(((p - q).abs() / q.abs().clamp_min(1e-30)).max()) for p, q in zip(outs[0], outs[1]) if p is not None
    )
    ratios = [b / a for a, b in zip(times[0], times[1])]
    return {
        "pairs": pairs,
        "a": statistics.median(times[0]),
        "b": statistics.median(times[1]),
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "diff": diff,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("old", help="library A (.so)")
    p.add_argument("new", help="library B (.so)")
    p.add_argument("--n", type=int, default=1_000_000, help="points per cloud (default 10^6)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", default="", help="comma-separated subset of pair0,sym0,pair1,sym2")
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "float64"], help="the solve's (and library's) dtype"
    )
    p.add_argument("--d", type=int, default=3, help="dimension: > 3 appends small random coordinates")
    p.add_argument("--p", type=int, default=2, help="the cost's power: 2 (dot-product kernels) or 1 (direct costs)")
    a = p.parse_args()
    libs = []
    for path in (a.old, a.new):
        lib = ctypes.CDLL(path)
        build._bind(lib, f"blocksparse_{build.dtype_suffix(a.dtype)}")  # the captured solve's dtype
        libs.append(lib)
    calls = capture(a.n, a.p, a.d, getattr(torch, a.dtype))
    keep = set(a.calls.split(",")) if a.calls else None
    print(f"n = m = {a.n:,}, {torch.get_num_threads()} threads; A = {a.old}, B = {a.new}")
    print("| call | pairs | A s | B s | B / A (median) | per round | max rel. diff |")
    print("|---|---|---|---|---|---|---|")
    for key, args in calls.items():
        if keep is not None and key not in keep:
            continue
        r = run_ab(libs, args, a.rounds)
        per = ", ".join(f"{v:.3f}" for v in r["ratios"])
        print(
            f"| {key} | {r['pairs'][0]:.3e} | {r['a']:.3f} | {r['b']:.3f} | {r['ratio']:.3f} | {per} | "
            f"{r['diff']:.1e} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
