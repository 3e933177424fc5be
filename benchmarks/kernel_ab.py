"""A/B two builds of the CPU kernels: the streamed softmin of each compiled library, alternately.

Kernel changes are small against this machine's drift (the same call varies by 10-30% between
processes here), so each round runs A then B (odd rounds B then A), each in a fresh process, and the
table gives the per-round ratio B / A of their throughputs and the median ratio.  The libraries are
``.so`` files of the build cache (``~/.cache/flashot``, or ``FLASHOT_CACHE_DIR``), the core library of the
dtype timed (``flashot_cpu_f32_*.so`` for float32, ``flashot_cpu_f64_*.so`` for ``--dtype float64``): build the
old and the new source once each (for instance with ``FLASHOT_CPU_MARCH=x86-64-v3 flashot build``), then

    python benchmarks/kernel_ab.py OLD.so NEW.so --d 3 --threads 1 --rounds 6

Each process times ``CpuEngine(lib, mode="stream").softmin`` (or ``--call plan_product`` with 4 columns,
``pair``: ``softmin_pair``, ``sym``: ``softmin_sym``, ``alt``: ``softmin_alt``, ``softmin_T``: the softmin onto y;
``--mode cache`` keeps the cost matrix, which makes ``softmin_T`` the cached column pass) on two ``torch.randn(n, d)`` clouds (``--dtype``, float32
by default; eps = 0.1, median of ``--repeats`` calls after a warm-up; pairs counted as n^2 for every call).
Name the CPU beside the table.

``--same-process`` loads both libraries into one process instead and alternates their calls (A B, then
B A, ``--repeats`` times each): the process-to-process spread (whole processes here run 10-30% apart)
drops out, and it prints the B / A ratio of the fastest calls and the median of the per-pair ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

SETUP = r"""
import ctypes, json, statistics, sys, time, torch
from flashot.costs import get_cost
from flashot.ops.cpu import build
from flashot.ops.cpu.engine import CpuEngine
a = json.loads(sys.argv[1])
torch.set_num_threads(a["threads"])
c = get_cost("sqeuclidean")
g = torch.Generator().manual_seed(0)
n, d, dt = a["n"], a["d"], getattr(torch, a["dtype"])
x, y = torch.randn(1, n, d, generator=g, dtype=dt), torch.randn(1, n, d, generator=g, dtype=dt)
h = torch.zeros(1, n, dtype=dt)
V = torch.randn(1, n, 4, generator=g, dtype=dt)

def the_call(path):
    lib = ctypes.CDLL(path)  # the core library of a["dtype"] (core_f32 or core_f64)
    dt = build.dtype_suffix(a["dtype"])
    build._bind(lib, f"core_{dt}")
    eng = CpuEngine(build.Kernels("core", parts={dt: lib}), mode=a["mode"])
    f = eng.softmin(x, y, h, 0.1, c)
    calls = {"softmin": lambda: eng.softmin(x, y, h, 0.1, c),
             "plan_product": lambda: eng.plan_product(x, y, f, h, 0.1, V, c, "plan"),
             "pair": lambda: eng.softmin_pair(x, y, h, h, 0.1, c),
             "sym": lambda: eng.softmin_sym(x, h, 0.1, c),
             "alt": lambda: eng.softmin_alt(x, y, h, h, 0.1, c, 0.7),
             "softmin_T": lambda: eng.softmin(y, x, h, 0.1, c)}
    call = calls[a["call"]]
    call()
    return call

def timed(call):
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0
"""
WORKER = (
    SETUP
    + r"""
call = the_call(a["lib"])
ts = [timed(call) for _ in range(a["repeats"])]
print(json.dumps(n * n / statistics.median(ts) / 1e9))
"""
)
SAME_PROCESS = (
    SETUP
    + r"""
calls = [the_call(a["lib"]), the_call(a["lib_b"])]
ts = [[], []]
for k in range(a["repeats"]):
    for i in ((0, 1) if k % 2 == 0 else (1, 0)):
        ts[i].append(timed(calls[i]))
pairs = [ta / tb for ta, tb in zip(ts[0], ts[1])]
print(json.dumps([min(ts[0]) / min(ts[1]), statistics.median(pairs)]))
"""
)


def rate(lib: str, a, script: str = WORKER, lib_b: str = "") -> float:
    arg = json.dumps(
        {
            "lib": lib,
            "lib_b": lib_b,
            "n": a.n,
            "d": a.d,
            "threads": a.threads,
            "repeats": a.repeats,
            "dtype": a.dtype,
            "call": a.call,
            "mode": a.mode,
        }
    )
    r = subprocess.run([sys.executable, "-c", script, arg], capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


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
    ap.add_argument(
        "--same-process",
        action="store_true",
        help="both libraries in one process, their calls alternated (--repeats each): prints the B / A "
        "throughput ratio of the fastest calls and the median per-pair ratio",
    )
    a = ap.parse_args()
    if a.same_process:
        best, pair = rate(a.a, a, SAME_PROCESS, a.b)
        print(
            f"{a.call} ({a.mode}), {a.dtype}, n = m = {a.n:,}, d = {a.d}, {a.threads} thread(s), one process, "
            f"{a.repeats} calls each: B / A throughput {best:.3f} (fastest calls), {pair:.3f} (median per pair)"
        )
        return
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
