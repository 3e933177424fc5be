"""A/B two builds of the CPU kernels: the streamed softmin of each compiled library, alternately.

Kernel changes are small against this machine's drift (the same call varies by 10-30% between
processes here), so each round runs A then B (odd rounds B then A), each in a fresh process, and the
table gives the per-round ratio B / A of their throughputs and the median ratio.  The libraries are
``.so`` files of the build cache (``~/.cache/flashot``, or ``FLASHOT_CACHE_DIR``): build the old and
the new source once each (for instance with ``FLASHOT_CPU_MARCH=x86-64-v3 flashot build``), then

    python benchmarks/kernel_ab.py OLD.so NEW.so --d 3 --threads 1 --rounds 6

Each process times ``CpuEngine(lib, mode="stream").softmin`` on two ``torch.randn(n, d)`` clouds
(float32, eps = 0.1, median of ``--repeats`` calls after a warm-up).  Name the CPU beside the table.
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
eng = CpuEngine(lib, mode="stream")
c = get_cost("sqeuclidean")
g = torch.Generator().manual_seed(0)
n, d = a["n"], a["d"]
x, y, h = torch.randn(1, n, d, generator=g), torch.randn(1, n, d, generator=g), torch.zeros(1, n)
eng.softmin(x, y, h, 0.1, c)
ts = []
for _ in range(a["repeats"]):
    t0 = time.perf_counter()
    eng.softmin(x, y, h, 0.1, c)
    ts.append(time.perf_counter() - t0)
print(json.dumps(n * n / statistics.median(ts) / 1e9))
"""


def rate(lib: str, a) -> float:
    arg = json.dumps({"lib": lib, "n": a.n, "d": a.d, "threads": a.threads, "repeats": a.repeats})
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
    a = ap.parse_args()
    print(f"n = m = {a.n:,}, d = {a.d}, {a.threads} thread(s); G pairs / s, median of {a.repeats} calls\n")
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
