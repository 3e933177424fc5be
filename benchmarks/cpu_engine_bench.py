"""Focused measurements of the compiled ``cpu`` engine (issue 6, engine part).

Prints markdown tables: hardware throughput (exp, GEMM), time per fixed-eps
Sinkhorn iteration (two softmins) for ``cpu`` vs ``tiled`` in the same run,
the cached-cost pass vs streaming and their crossover in d, the n*m scaling
exponent, the n = m = 1e6 run (peak RSS, in a subprocess) and the first-call
compile time (fresh cache dir, in a subprocess).

    python benchmarks/cpu_engine_bench.py                 # everything but the 1e6 run
    python benchmarks/cpu_engine_bench.py --million 10    # + 10 iterations at n = m = 1e6
    python benchmarks/cpu_engine_bench.py --quick         # small sizes, smoke test

Times are medians of ``--runs`` (>= 3) runs, wall clock.  The load average is
printed: on a shared machine other processes inflate every number (ratios
measured in the same run are more robust than absolute times).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

import torch

from flashot.costs import get_cost
from flashot.ops.cpu.build import BUILD_INFO, load
from flashot.ops.cpu.engine import CACHE_MIN_D, CpuEngine
from flashot.ops.tiled import TiledEngine

COST = get_cost("sqeuclidean")


# Wall clock; with --threads 1 the CPU time of the calling thread instead, which
# is what the code costs even when other processes share the cores.
CLOCK = time.perf_counter


def med(fn, runs):
    fn()  # warm-up
    ts = []
    for _ in range(runs):
        t = CLOCK()
        fn()
        ts.append(CLOCK() - t)
    return statistics.median(ts)


def problem(n, m, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, n, d, generator=g, dtype=dtype)
    y = torch.randn(1, m, d, generator=g, dtype=dtype) + 0.5
    return x, y


def sinkhorn_iter(eng, x, y, eps, state):
    """One fixed-eps alternating iteration as two plain softmins (x->y, then y->x with the new f)."""
    f, g, la, lb = state
    f = eng.softmin(x, y, lb + g / eps, eps, COST)
    g = eng.softmin(y, x, la + f / eps, eps, COST)
    state[0], state[1] = f, g


def time_iter(eng, n, d, runs, eps=None):
    x, y = problem(n, n, d)
    eps = eps or 0.05 * d
    la = torch.full((1, n), -math.log(n))
    state = [torch.zeros(1, n), torch.zeros(1, n), la, la.clone()]
    return med(lambda: sinkhorn_iter(eng, x, y, eps, state), runs)


def hw_throughput(lib, runs):
    nth = torch.get_num_threads()
    n = 1 << 20  # 4 MiB of float32 (L3): smaller buffers mostly time the per-call fork/join
    a = -torch.rand(n) * 80.0
    o = torch.empty_like(a)
    reps = 40
    t = med(lambda: [lib.flashot_vexp_f32(a.data_ptr(), o.data_ptr(), n, nth) for _ in range(reps)], runs)
    ours = n * reps / t
    a_big = -torch.rand(n) * 200.0
    t = med(lambda: [torch.exp(a, out=o) for _ in range(reps // 10)], runs)
    texp = n * (reps // 10) / t
    t = med(lambda: [torch.exp(a_big, out=o) for _ in range(2)], runs)
    texp_uf = n * 2 / t
    gemm = {}
    for d in (3, 64):
        A = torch.randn(4096, d)
        Bm = torch.randn(d, 4096)
        C = torch.empty(4096, 4096)
        t = med(lambda: torch.mm(A, Bm, out=C), runs)
        gemm[d] = 2 * 4096 * 4096 * d / t
    return {"vexp": ours, "torch_exp": texp, "torch_exp_underflow": texp_uf, "gemm": gemm}


def accuracy(lib):
    """float32 against float64: SamplesLoss gradients (the user-facing number) and one softmin."""
    import flashot
    from flashot.ops import register_engine
    from flashot.ops.dense import DenseEngine

    print("## Accuracy, float32 against float64\n")
    print(
        "SamplesLoss('sinkhorn', p=2, blur=0.05, scaling=0.9) value + gradient in x; n = m = 500, "
        "x uniform in the unit cube, y = another uniform cloud + 0.2; max |grad32 - grad64| / max |grad64| "
        "(reference: the `dense` engine in float64), seeds 1, 2, 3.  `cpu stream` / `cpu cache`: the cpu "
        "engine in mode `stream` / `cache` (budget 1 GiB: every matrix cached).\n"
    )
    print("| d | tiled | cpu stream | cpu cache |\n|---|---|---|---|")
    modes = {"tiled": None, "cpu stream": "stream", "cpu cache": "cache"}
    for d in (3, 64):
        cells = []
        for mode in modes.values():
            errs = []
            for seed in (1, 2, 3):
                g = torch.Generator().manual_seed(seed)
                x = torch.rand(500, d, generator=g, dtype=torch.float64)
                y = torch.rand(500, d, generator=g, dtype=torch.float64) + 0.2

                def grad(dt, backend):
                    xr = x.to(dt).clone().requires_grad_(True)
                    flashot.SamplesLoss("sinkhorn", p=2, blur=0.05, scaling=0.9, backend=backend)(
                        xr, y.to(dt)
                    ).backward()
                    return xr.grad.double()

                g64 = grad(torch.float64, "dense")
                if mode is None:
                    g32 = grad(torch.float32, "tiled")
                else:
                    eng = CpuEngine(lib, mode=mode, cache_bytes=1 << 30)
                    register_engine(f"bench-cpu-{mode}", lambda eng=eng: eng)
                    g32 = grad(torch.float32, f"bench-cpu-{mode}")
                errs.append(((g32 - g64).abs().max() / g64.abs().max()).item())
            cells.append(" ".join(f"{e:.1e}" for e in errs))
        print(f"| {d} | " + " | ".join(cells) + " |")
    # one softmin at d = 64 with C / eps ~ 1e4, on the rounded inputs
    c = COST
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 400, 64, generator=g, dtype=torch.float64)
    y = torch.randn(1, 400, 64, generator=g, dtype=torch.float64) * 0.8 + 0.5
    ctr = (torch.cat([x, y], 1).amin(1) + torch.cat([x, y], 1).amax(1)) / 2
    x, y = (x - ctr).float(), (y - ctr).float()
    eps = 0.0025
    dense = DenseEngine()
    h = (-dense.softmin(y.double(), x.double(), torch.zeros(1, 400, dtype=torch.float64), eps, c) / eps).float()
    ref = dense.softmin(x.double(), y.double(), h.double(), eps, c)
    print(
        "\nOne softmin, d = 64, n = m = 400 Gaussian points, eps = 0.0025 (C / eps up to ~1e5), max abs error "
        "against float64 on the same rounded inputs:\n"
    )
    print("| tiled | cpu stream | cpu cache |\n|---|---|---|")
    engs = [TiledEngine()] + [CpuEngine(lib, mode=mode, cache_bytes=1 << 30) for mode in ("stream", "cache")]
    errs = [(e.softmin(x, y, h, eps, c).double() - ref).abs().max().item() for e in engs]
    print("| " + " | ".join(f"{e:.1e}" for e in errs) + " |\n")
    # its x-gradient (the softmin backward: one plan product), max error / max |grad64|
    from flashot.ops.autograd import softmin_fn

    def sgrad(dtype, eng):
        xr = x.to(dtype).clone().requires_grad_(True)
        softmin_fn(xr, y.to(dtype), h.to(dtype), eps, c, eng).sum().backward()
        return xr.grad.double()

    g64 = sgrad(torch.float64, dense)
    errs = [((sgrad(torch.float32, e) - g64).abs().max() / g64.abs().max()).item() for e in engs]
    print("Its x-gradient (max error / max |grad64|):\n\n| tiled | cpu stream | cpu cache |\n|---|---|---|")
    print("| " + " | ".join(f"{e:.1e}" for e in errs) + " |\n")


def solve_loop(lib, n, d=64, solves=4, iters=3):
    """A loop of solves on fresh tensors (as in training): Measures.build + one sinkhorn_loop each."""
    from flashot.measures import Measures
    from flashot.ops import register_engine
    from flashot.solver import sinkhorn_loop

    eng = CpuEngine(lib, mode="auto")
    register_engine("bench-cpu-loop", lambda: eng)
    print(
        f"## A loop of {solves} solves on fresh tensors, n = m = {n}, d = {d}, {iters} alternating iterations each "
        f"(auto mode, default cache budget {eng.cache_bytes / 2**30:.1f} GiB)\n"
    )
    print("| solve | s / iter | streamed calls | matrices built |\n|---|---|---|---|")
    x, y = problem(n, n, d)
    for k in range(solves):
        s0 = dict(eng.stats)
        t0 = CLOCK()
        m = Measures.build(x[0] + 1e-3 * k, y[0], None, None, cost="sqeuclidean", backend="bench-cpu-loop")
        sinkhorn_loop(m, [0.05 * d] * iters, symmetric=False, tol=None, warn=False)
        t = (CLOCK() - t0) / iters
        print(
            f"| {k + 1} | {t:.3f} | {eng.stats['stream'] - s0['stream']} | {eng.stats['cache_build'] - s0['cache_build']} |"
        )
    print()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--million", type=int, default=0, help="iterations at n = m = 1e6 (0: skip)")
    ap.add_argument("--skip-tiled", action="store_true")
    ap.add_argument("--skip-compile", action="store_true")
    ap.add_argument(
        "--cache-budget", type=float, default=2 * 2**30, help="bytes for the cached-cost row at d = 64 (0: skip)"
    )
    ap.add_argument(
        "--threads", type=int, default=0, help="torch and engine threads (default: torch's); 1 measures thread CPU time"
    )
    ap.add_argument(
        "--clock",
        choices=["wall", "thread", "cpu"],
        default=None,
        help="wall: perf_counter (default for >1 thread); thread: thread_time (default for "
        "--threads 1); cpu: process_time / threads, i.e. the wall time on idle cores "
        "if the work is balanced (run with OMP_WAIT_POLICY=passive so spinning is not counted)",
    )
    ap.add_argument("--cache-n", default="5000,20000", help="sizes n = m for the cached-vs-streaming crossover")
    ap.add_argument(
        "--sections",
        default="hw,iter,alt,plan,accuracy,loop,cache,scaling",
        help="comma-separated subset of hw,iter,alt,plan,accuracy,loop,cache,scaling",
    )
    args = ap.parse_args()
    global CLOCK
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.threads == 1:
        CLOCK = time.thread_time
    if args.clock == "wall":
        CLOCK = time.perf_counter
    elif args.clock == "thread":
        CLOCK = time.thread_time
    elif args.clock == "cpu":
        _nt = torch.get_num_threads()

        def cpu_per_thread():
            return time.process_time() / _nt

        CLOCK = cpu_per_thread
    sections = set(args.sections.split(","))
    runs = max(3, args.runs)
    n = 4000 if args.quick else args.n
    lib = load()
    nth = torch.get_num_threads()
    print(
        f"# flashot cpu engine benchmark\n\ntorch {torch.__version__}, {nth} threads, clock {CLOCK.__name__}, "
        f"load average {os.getloadavg()[0]:.2f} at start, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, "
        f"build {BUILD_INFO}\n"
    )

    hw = hw_throughput(lib, runs) if sections & {"hw", "iter"} else None
    if "hw" in sections:
        print("## Hardware throughput (float32)\n")
        print("| quantity | value |\n|---|---|")
        print(f"| flashot vector exp2 (4 MiB buffer, {nth} threads) | {hw['vexp'] / 1e9:.2f} G exp/s |")
        print(f"| torch.exp, arguments in [-80, 0] | {hw['torch_exp'] / 1e9:.2f} G exp/s |")
        print(f"| torch.exp, arguments in [-200, 0] (underflow path) | {hw['torch_exp_underflow'] / 1e9:.3f} G exp/s |")
        for d, g in hw["gemm"].items():
            print(f"| torch.mm 4096x{d} @ {d}x4096 | {g / 1e9:.1f} GFLOP/s ({g / (2 * d) / 1e9:.2f} G pairs/s) |")
        print()

    cpu = CpuEngine(lib, mode="stream", threads=nth)
    tiled = TiledEngine()
    if "iter" in sections:
        print(f"## Fixed-eps iterations (two softmins), n = m = {n}, float32\n")
        print("| d | cpu s/iter | tiled s/iter | speed-up | G pairs/s | limit s/iter | % of limit |")
        print("|---|---|---|---|---|---|---|")
        for d in (3, 64):
            tc = time_iter(cpu, n, d, runs)
            tt = float("nan") if args.skip_tiled else time_iter(tiled, n, d, runs)
            pairs = 2 * n * n
            # limit: GEMM (2 d flops per pair, at the measured GEMM rate) + one exp per pair
            gflops = hw["gemm"][64] if d >= 64 else hw["gemm"][3]
            lim = pairs * (2 * d / gflops + 1 / hw["vexp"]) if d >= 64 else pairs / hw["vexp"]
            print(
                f"| {d} | {tc:.3f} | {tt:.3f} | {tt / tc:.1f}x | {pairs / tc / 1e9:.2f} | {lim:.3f} | {100 * lim / tc:.0f}% |"
            )
            tt64 = tt
        # the cached-cost pass at the same size (needs B*N*M*4 bytes of budget)
        need = n * n * 4
        if need <= args.cache_budget:
            x, y = problem(n, n, 64)
            cached = CpuEngine(lib, mode="cache", cache_bytes=args.cache_budget, threads=nth)
            t0 = CLOCK()
            cached.softmin(x, y, torch.zeros(1, n), 0.05 * 64, COST)
            tb = CLOCK() - t0
            cached.clear_cache()
            tcache = time_iter(cached, n, 64, runs)
            print(
                f"| 64, cached cost (budget {args.cache_budget / 2**30:.1f} GiB, build {tb:.2f} s once) | "
                f"{tcache:.3f} | {tt64:.3f} | {tt64 / tcache:.1f}x | {2 * n * n / tcache / 1e9:.2f} | | |"
            )
        print(
            "\nlimit: d = 3: one exp per pair at the measured vector-exp rate; "
            "d = 64: GEMM at the measured torch.mm rate + one exp per pair.\n"
        )

    if "plan" in sections:
        # single plan products as the softmin backward issues them: weight "dcost", V = [y, 1]
        npl = 4000 if args.quick else n
        print(
            f"## Plan products (K = d + 1: weight dcost, V = [y, 1], as in the gradient; K = 1: the marginal), "
            f"n = m = {npl}, float32\n"
        )
        print("| d, K | cpu s | tiled s | speed-up | cpu softmin s | plan / softmin | cpu, cached cost s | speed-up |")
        print("|---|---|---|---|---|---|---|---|")
        for d, K in ((3, 4), (64, 65), (64, 1)):
            x, y = problem(npl, npl, d)
            a0 = torch.full((1, npl), -math.log(npl))
            f = cpu.softmin(x, y, a0, 0.05 * d, COST)
            V = torch.cat([y, torch.ones(1, npl, 1)], -1).contiguous() if K == d + 1 else torch.ones(1, npl, K)
            args_pp = (x, y, a0 + f / (0.05 * d), a0, 0.05 * d, V, COST, "dcost" if K == d + 1 else "plan")
            tc = med(lambda: cpu.plan_product(*args_pp), runs)
            tt = med(lambda: tiled.plan_product(*args_pp), runs)
            ts = med(lambda: cpu.softmin(x, y, a0, 0.05 * d, COST), runs)
            cached_cells = "| |"
            if d >= CACHE_MIN_D and npl * npl * 4 <= args.cache_budget:
                # after the solver's softmins built the matrix (the build is not timed here)
                cached = CpuEngine(lib, mode="cache", cache_bytes=args.cache_budget, threads=nth)
                cached.softmin(x, y, a0, 0.05 * d, COST)
                tk = med(lambda: cached.plan_product(*args_pp), runs)
                cached.clear_cache()
                cached_cells = f"{tk:.4f} | {tt / tk:.1f}x |"
            print(f"| {d}, {K} | {tc:.4f} | {tt:.4f} | {tt / tc:.1f}x | {ts:.4f} | {tc / ts:.2f} | {cached_cells}")
        print()

    if "accuracy" in sections:
        accuracy(lib)

    if "loop" in sections:
        solve_loop(lib, 4000 if args.quick else n)

    if "alt" in sections:
        # the fused alternating step against its two softmins (streaming)
        sizes = (
            [(2000, 24), (2000, 64)] if args.quick else [(n, 16), (n, 20), (n, 32), (n, 64), (4 * n, 24), (4 * n, 64)]
        )
        print("## Fused alternating step (softmin_alt) against two softmins, streaming, float32\n")
        print("| n = m | d | two softmins s | softmin_alt s | speed-up | fused? |\n|---|---|---|---|---|---|")
        for na, d in sizes:
            x, y = problem(na, na, d)
            la = torch.full((1, na), -math.log(na))
            eps = 0.05 * d
            t2 = med(lambda: cpu.softmin(y, x, la + cpu.softmin(x, y, la, eps, COST) / eps, eps, COST), runs)
            before = cpu.stats.get("alt", 0)
            ta = med(lambda: cpu.softmin_alt(x, y, la, la, eps, COST), runs)
            fused = "yes" if cpu.stats.get("alt", 0) > before else "no (fallback)"
            print(f"| {na:,} | {d} | {t2:.4f} | {ta:.4f} | {t2 / ta:.2f}x | {fused} |")
        if n * n * 4 <= args.cache_budget:  # over the cached matrix: one read for both halves
            x, y = problem(n, n, 64)
            la = torch.full((1, n), -math.log(n))
            cached = CpuEngine(lib, mode="cache", cache_bytes=args.cache_budget, threads=nth)
            cached.softmin(x, y, la, 3.2, COST)  # build (not timed)
            t2 = med(lambda: cached.softmin(y, x, la + cached.softmin(x, y, la, 3.2, COST) / 3.2, 3.2, COST), runs)
            ta = med(lambda: cached.softmin_alt(x, y, la, la, 3.2, COST), runs)
            print(f"| {n:,} | 64, cached cost | {t2:.4f} | {ta:.4f} | {t2 / ta:.2f}x | yes (cached) |")
            cached.clear_cache()
        print()

    if "cache" in sections:
        # cached cost vs streaming, crossover in d, at each n of --cache-n
        for nc in [2000] if args.quick else [int(v) for v in args.cache_n.split(",")]:
            print(f"## Cached cost matrix vs streaming, n = m = {nc}, float32 (s/iter; build = one-off)\n")
            print("| d | stream s/iter | cached s/iter | build s | faster |\n|---|---|---|---|---|")
            for d in (3, 8, 16, 32, 64, 128):
                x, y = problem(nc, nc, d)
                ts = time_iter(cpu, nc, d, runs)
                cached = CpuEngine(lib, mode="cache", threads=nth, cache_bytes=args.cache_budget)
                t0 = CLOCK()
                cached.softmin(x, y, torch.zeros(1, nc), 0.05 * d, COST)
                tb = CLOCK() - t0
                cached.clear_cache()
                tcache = time_iter(cached, nc, d, runs)
                print(f"| {d} | {ts:.4f} | {tcache:.4f} | {tb:.3f} | {'cached' if tcache < ts else 'stream'} |")
            print()

    if "scaling" in sections:
        # scaling
        sizes = [1000, 2000, 4000, 8000] if args.quick else [5000, 10000, 20000, 40000, 80000]
        print("## Scaling, d = 3, float32\n")
        print("| n = m | s/iter | G pairs/s |\n|---|---|---|")
        ts = []
        for s in sizes:
            t = time_iter(cpu, s, 3, runs)
            ts.append(t)
            print(f"| {s} | {t:.4f} | {2 * s * s / t / 1e9:.2f} |")
        lx = [math.log(s) for s in sizes]
        ly = [math.log(t) for t in ts]
        mx, my = statistics.mean(lx), statistics.mean(ly)
        slope = sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)
        print(f"\nfitted exponent: time ~ n^{slope:.2f} (n*m = n^2 expects 2.00)\n")

    if not args.skip_compile:
        code = "import time; t=time.perf_counter(); from flashot.ops.cpu.build import load, BUILD_INFO; load(); print(BUILD_INFO['seconds'], time.perf_counter()-t, BUILD_INFO.get('cpu_seconds', 0.0))"
        with tempfile.TemporaryDirectory() as d:
            env = dict(os.environ, FLASHOT_CACHE_DIR=d)
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
            r2 = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        c1 = r.stdout.split()
        c2 = r2.stdout.split()
        print("## First-call compile\n")
        print(
            f"| | seconds |\n|---|---|\n| compile (fresh cache), wall | {float(c1[0]):.1f} |\n"
            f"| compile, compiler CPU time | {float(c1[2]):.1f} |\n"
            f"| load, fresh cache (incl. compile) | {float(c1[1]):.1f} |\n| load, cached | {float(c2[1]):.2f} |\n"
        )

    if args.million:
        code = textwrap.dedent(f"""
            import math, resource, time, torch
            from flashot.ops.cpu.engine import CpuEngine
            from flashot.costs import get_cost
            c = get_cost("sqeuclidean"); eng = CpuEngine()
            n = 1_000_000; eps = 0.15
            g = torch.Generator().manual_seed(0)
            x = torch.randn(1, n, 3, generator=g); y = torch.randn(1, n, 3, generator=g) + 0.5
            la = torch.full((1, n), -math.log(n)); f = torch.zeros(1, n); gg = torch.zeros(1, n)
            t0 = time.perf_counter()
            for it in range({args.million}):
                t = time.perf_counter()
                f = eng.softmin(x, y, la + gg / eps, eps, c)
                gg = eng.softmin(y, x, la + f / eps, eps, c)
                rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
                print(f"iter {{it}}: {{time.perf_counter() - t:.1f}} s, peak RSS {{rss:.3f}} GiB", flush=True)
            print(f"TOTAL {{time.perf_counter() - t0:.1f}} s, finite {{bool(torch.isfinite(f).all() and torch.isfinite(gg).all())}}")
        """)
        print(f"## n = m = 1,000,000, d = 3, {args.million} iterations (subprocess)\n")
        subprocess.run([sys.executable, "-c", code])
    print(f"\nload average {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
