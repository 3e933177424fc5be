"""A/B two builds of the CPU kernels: the streamed softmin of each compiled library, alternately.

Kernel changes are small against this machine's drift (the same call varies by 10-30% between
processes here), so each round runs A then B (odd rounds B then A), each in a fresh process, and the
table gives the per-round ratio B / A of their throughputs and the median ratio.  The libraries are
``.so`` files of the build cache (``~/.cache/flashot``, or ``FLASHOT_CACHE_DIR``): build the old and
the new source once each (for instance with ``FLASHOT_CPU_MARCH=x86-64-v3 flashot build``), then

    python benchmarks/kernel_ab.py OLD.so NEW.so --d 3 --threads 1 --rounds 6

Each process times ``CpuEngine(lib, mode="stream").softmin`` (or ``--call plan_product`` with 4 columns,
``pair``: ``softmin_pair``, ``sym``: ``softmin_sym``, ``alt``: ``softmin_alt``, ``softmin_T``: the softmin onto y;
``--mode cache`` keeps the cost matrix, which makes ``softmin_T`` the cached column pass) on two ``torch.randn(n, d)`` clouds (``--dtype``, float32
by default; eps = 0.1, median of ``--repeats`` calls after a warm-up; pairs counted as n^2 for every call).
Name the CPU beside the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

WORKER = r"""
import ctypes, json, statistics, sys, time, torch
from flashot.costs import get_cost
from flashot.ops.cpu import build
from flashot.ops.cpu.engine import CpuEngine
a = json.loads(sys.argv[1])
torch.set_num_threads(a["threads"])
lib = ctypes.CDLL(a["lib"])
build._bind(lib)
eng = CpuEngine(lib, mode=a["mode"])
c = get_cost("sqeuclidean")
g = torch.Generator().manual_seed(0)
n, d, dt = a["n"], a["d"], getattr(torch, a["dtype"])
x, y = torch.randn(1, n, d, generator=g, dtype=dt), torch.randn(1, n, d, generator=g, dtype=dt)
h = torch.zeros(1, n, dtype=dt)
V = torch.randn(1, n, 4, generator=g, dtype=dt)
f = eng.softmin(x, y, h, 0.1, c)
calls = {"softmin": lambda: eng.softmin(x, y, h, 0.1, c),
         "plan_product": lambda: eng.plan_product(x, y, f, h, 0.1, V, c, "plan"),
         "pair": lambda: eng.softmin_pair(x, y, h, h, 0.1, c),
         "sym": lambda: eng.softmin_sym(x, h, 0.1, c),
         "alt": lambda: eng.softmin_alt(x, y, h, h, 0.1, c, 0.7),
         "softmin_T": lambda: eng.softmin(y, x, h, 0.1, c)}
call = calls[a["call"]]
call()
ts = []
for _ in range(a["repeats"]):
    t0 = time.perf_counter()
    call()
    ts.append(time.perf_counter() - t0)
print(json.dumps(n * n / statistics.median(ts) / 1e9))
"""


def rate(lib: str, a) -> float:
    arg = json.dumps(
        {
            "lib": lib,
            "n": a.n,
            "d": a.d,
            "threads": a.threads,
            "repeats": a.repeats,
            "dtype": a.dtype,
            "call": a.call,
            "mode": a.mode,
        }
    )
    r = subprocess.run([sys.executable, "-c", WORKER, arg], capture_output=True, text=True, check=True)
    return float(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", help="library A (.so), e.g. the old build")
    ap.add_argument("b", help="library B (.so), e.g. the new build")
    ap.add_argument("--n", type=int, default=10000)
    ap.add_argument("--d", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    ap.add_argument(
        "--call",
        choices=("softmin", "plan_product", "pair", "sym", "alt", "softmin_T"),
        default="softmin",
        help="the engine call timed: softmin, plan_product (plan times 4 columns), the fused "
        "pair step softmin_pair, softmin_sym, the alternating step softmin_alt, or softmin_T (the softmin "
        "onto y: with --mode cache, the column pass over the cached matrix) (default softmin)",
    )
    ap.add_argument(
        "--mode",
        choices=("stream", "cache"),
        default="stream",
        help="the engine's mode: stream (costs recomputed) or cache (the cost matrix kept; small problems)",
    )
    a = ap.parse_args()
    print(
        f"{a.call} ({a.mode}), {a.dtype}, n = m = {a.n:,}, d = {a.d}, {a.threads} thread(s); G pairs / s, median of "
        f"{a.repeats} calls\n"
    )
    print("| round | A | B | B / A |")
    print("|---|---|---|---|")
    ratios = []
    for k in range(a.rounds):
        if k % 2 == 0:
            ra, rb = rate(a.a, a), rate(a.b, a)
        else:
            rb, ra = rate(a.b, a), rate(a.a, a)
        ratios.append(rb / ra)
        print(f"| {k + 1} | {ra:.2f} | {rb:.2f} | {rb / ra:.2f} |", flush=True)
    print(f"\nmedian B / A: {statistics.median(ratios):.2f} (range {min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
