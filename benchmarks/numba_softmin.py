"""numba as the CPU technology: the d = 3 streaming softmin written in numba, timed next to the `cpu` engine.

    python -m venv /tmp/nb && /tmp/nb/bin/pip install numba torch==2.13.0 && /tmp/nb/bin/pip install --no-deps -e .
    /tmp/nb/bin/python benchmarks/numba_softmin.py [--n 20000] [--runs 5]
    # optional: /tmp/nb/bin/pip install intel-cmplr-lib-rt  (numba then vectorises exp with SVML)

numba is not a dependency of flashot: this script exists to measure whether one would pay
off (issue 6 asks for the technology to be picked by measurement).  It times
``out_i = -eps log sum_j exp(h_j - |x_i - y_j|^2 / eps)`` at n = m, d = 3, float32, on all
threads, three ways, each with ``parallel=True, fastmath=True`` over rows and the points
stored as coordinate arrays (so LLVM can vectorise over j):

* ``two-pass``: the row maximum first, then the sum of exponentials (no rescaling);
* ``online``: one pass with a running maximum (rescale when it grows);
* ``bounded``: one pass, shifted by an upper bound ``max_j h_j`` (exact when no score
  exceeds it by more than the float range: checked, else the row is recomputed).

and the ``cpu`` engine (``FLASHOT_CPU_MODE=stream``) on the same data; every result is
checked against a float64 torch reference.  Prints a Markdown table (median of ``--runs``,
after a warm-up call that includes numba's JIT compile, which is reported separately).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--eps", type=float, default=0.1)
    args = ap.parse_args()
    if args.n < 1 or args.runs < 1 or not args.eps > 0:
        ap.error(f"need --n >= 1, --runs >= 1 and --eps > 0 (got {args.n}, {args.runs}, {args.eps})")

    import numba
    from numba import njit, prange

    f32 = np.float32

    @njit(parallel=True, fastmath=True, cache=False)
    def two_pass(x0, x1, x2, y0, y1, y2, h, inv_eps, out):
        n, m = x0.shape[0], y0.shape[0]
        for i in prange(n):
            a0, a1, a2 = x0[i], x1[i], x2[i]
            mx = f32(-np.inf)
            for j in range(m):
                d0, d1, d2 = a0 - y0[j], a1 - y1[j], a2 - y2[j]
                s = h[j] - (d0 * d0 + d1 * d1 + d2 * d2) * inv_eps
                mx = max(mx, s)
            acc = f32(0.0)
            for j in range(m):
                d0, d1, d2 = a0 - y0[j], a1 - y1[j], a2 - y2[j]
                acc += np.exp(h[j] - (d0 * d0 + d1 * d1 + d2 * d2) * inv_eps - mx)
            out[i] = mx + np.log(acc)

    @njit(parallel=True, fastmath=True, cache=False)
    def online(x0, x1, x2, y0, y1, y2, h, inv_eps, out):
        n, m = x0.shape[0], y0.shape[0]
        for i in prange(n):
            a0, a1, a2 = x0[i], x1[i], x2[i]
            mx = f32(-np.inf)
            acc = f32(0.0)
            for j in range(m):
                d0, d1, d2 = a0 - y0[j], a1 - y1[j], a2 - y2[j]
                s = h[j] - (d0 * d0 + d1 * d1 + d2 * d2) * inv_eps
                if s > mx:
                    acc = acc * np.exp(mx - s)
                    mx = s
                acc += np.exp(s - mx)
            out[i] = mx + np.log(acc)

    @njit(parallel=True, fastmath=True, cache=False)
    def bounded(x0, x1, x2, y0, y1, y2, h, inv_eps, hmax, out):
        n, m = x0.shape[0], y0.shape[0]
        for i in prange(n):
            a0, a1, a2 = x0[i], x1[i], x2[i]
            acc = f32(0.0)
            for j in range(m):
                d0, d1, d2 = a0 - y0[j], a1 - y1[j], a2 - y2[j]
                acc += np.exp(h[j] - (d0 * d0 + d1 * d1 + d2 * d2) * inv_eps - hmax)
            out[i] = hmax + np.log(acc)  # -inf if everything underflowed: recomputed below

    import torch

    from flashot.costs import get_cost
    from flashot.ops.cpu.engine import CpuEngine

    n, eps = args.n, args.eps
    rng = np.random.default_rng(0)
    x = rng.random((n, 3), dtype=np.float32)
    y = rng.random((n, 3), dtype=np.float32)
    h = (rng.standard_normal(n) - math.log(n)).astype(np.float32)
    xs = [np.ascontiguousarray(x[:, k]) for k in range(3)]
    ys = [np.ascontiguousarray(y[:, k]) for k in range(3)]
    inv = f32(1.0 / eps)
    out = np.empty(n, dtype=np.float32)
    hmax = f32(h.max())

    xt, yt, ht = torch.from_numpy(x)[None], torch.from_numpy(y)[None], torch.from_numpy(h)[None]
    ref = -eps * torch.logsumexp(ht.double()[:, None, :] - torch.cdist(xt.double(), yt.double()) ** 2 / eps, -1)[0]
    ref_lse = (-ref / eps).numpy()

    runs = {
        "numba two-pass": lambda: two_pass(*xs, *ys, h, inv, out),
        "numba online max": lambda: online(*xs, *ys, h, inv, out),
        "numba bounded (max h)": lambda: bounded(*xs, *ys, h, inv, hmax, out),
    }
    rows = []
    for name, fn in runs.items():
        t0 = time.perf_counter()
        fn()
        jit = time.perf_counter() - t0
        ts = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        ok = np.isfinite(out)
        err = float(np.max(np.abs(out[ok] - ref_lse[ok]) * eps)) if ok.any() else float("nan")
        rows.append((name, statistics.median(ts), jit, err, int((~ok).sum())))

    eng = CpuEngine(mode="stream")
    cost = get_cost("sqeuclidean")
    fn = lambda: eng.softmin(xt, yt, ht, eps, cost)  # noqa: E731
    fn()
    ts = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        o = fn()
        ts.append(time.perf_counter() - t0)
    rows.append(
        ("flashot cpu engine (stream)", statistics.median(ts), 0.0, float((o[0].double() - ref).abs().max()), 0)
    )

    base = rows[-1][1]
    svml = "yes" if numba.config.USING_SVML else "no"
    print(
        f"numba {numba.__version__} (SVML: {svml}), torch {torch.__version__}, {numba.get_num_threads()} threads, "
        f"n = m = {n}, d = 3, float32, eps = {eps}, median of {args.runs}, load average "
        f"{os.getloadavg()[0]:.2f}\n"
    )
    print("| implementation | s / softmin | vs flashot cpu | first call (JIT) s | max abs error | rows not finite |")
    print("|---|---|---|---|---|---|")
    for name, t, jit, err, bad in rows:
        print(f"| {name} | {t:.4f} | {t / base:.1f}x | {jit:.1f} | {err:.1e} | {bad} |")


if __name__ == "__main__":
    main()
