"""Entropic Gromov-Wasserstein benchmarks (issue 18): flashot's streamed GW against itself on two
engines and against POT's dense ``ot.gromov.entropic_gromov_wasserstein``.

Data: a generated asymmetric 3-D surface (four ellipsoids of different sizes and orientations) and a
rotated, noised copy of it (``n = m`` points each, float32 for flashot, float64 for POT), square
loss, ``reg = REG_REL * diam_x^2 * diam_y^2`` (POT's ``epsilon``).

Sections (``--sections``):

* ``speed``: one inner Sinkhorn iteration (median of ``--repeats`` alternating steps on the cost of
  the first outer step) and a full GW solve (default ``tol``), ``cpu`` against ``tiled``, at each
  ``--sizes``; the ``tiled`` full solve is measured up to ``--tiled-full-max`` points and
  estimated above as (inner iterations of the ``cpu`` solve) x (``tiled`` inner iteration),
  labelled ``est.``.
* ``big``: ``n = m = --big-n`` on ``--threads`` threads: time and peak RSS of a GW solve with at
  most ``--big-outer`` outer iterations; then POT at ``--pot-n`` (dense: n x n, m x m and n x m
  float64 matrices) and flashot at the same size, both with at most ``--pot-outer`` outer
  iterations, in the same run (ratio per outer iteration).

Each case runs in a fresh subprocess, so its peak RSS (``ru_maxrss``) is its own.

    python benchmarks/gromov_bench.py --sections speed --sizes 5000,20000
    python benchmarks/gromov_bench.py --sections big --big-n 100000 --pot-n 8000 --threads 2

Prints markdown tables; name the CPU beside them (``/proc/cpuinfo``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time

REG_REL = 2e-3


def shape(n: int, seed: int = 0):
    """``n`` points on the surface of four ellipsoids (different radii, centres, orientations): no isometry."""
    import torch

    g = torch.Generator().manual_seed(seed)
    parts = [
        ((0.0, 0.0, 0.0), (1.0, 0.6, 0.5), 0.0),
        ((1.2, 0.3, 0.1), (0.45, 0.35, 0.3), 0.7),
        ((-1.1, -0.2, 0.4), (0.6, 0.2, 0.2), -0.4),
        ((0.2, 0.1, -0.8), (0.25, 0.25, 0.5), 1.1),
    ]
    area = torch.tensor([r[0] * r[1] + r[1] * r[2] + r[0] * r[2] for _, r, _ in parts])
    which = torch.multinomial(area / area.sum(), n, replacement=True, generator=g)
    d = torch.randn(n, 3, generator=g, dtype=torch.float64)
    d = d / d.norm(dim=-1, keepdim=True)
    out = torch.empty(n, 3, dtype=torch.float64)
    for k, (c, r, ang) in enumerate(parts):
        sel = which == k
        ca, sa = math.cos(ang), math.sin(ang)
        rot = torch.tensor(
            [[ca, -sa, 0.0], [sa * 0.8, ca * 0.8, 0.6], [-sa * 0.6, -ca * 0.6, 0.8]], dtype=torch.float64
        )
        out[sel] = (d[sel] * torch.tensor(r, dtype=torch.float64)) @ rot.T + torch.tensor(c, dtype=torch.float64)
    return out


def clouds(n: int, seed: int = 0):
    """``(X, Y, reg)``: the shape, and a rotated, noised, shuffled copy of another sample of it."""
    import torch

    X = shape(n, seed)
    g = torch.Generator().manual_seed(seed + 1)
    Q, _ = torch.linalg.qr(torch.randn(3, 3, generator=g, dtype=torch.float64))
    Y = shape(n, seed + 2) @ Q.T + 0.01 * torch.randn(n, 3, generator=g, dtype=torch.float64)
    dx = float(torch.cdist(X[:2000], X[:2000]).max())
    dy = float(torch.cdist(Y[:2000], Y[:2000]).max())
    return X, Y, REG_REL * dx**2 * dy**2


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def case_inner(n: int, backend: str, repeats: int) -> dict:
    """Median time of one alternating Sinkhorn step on the cost of the first outer GW step."""
    import flashot

    X, Y, reg = clouds(n)
    r = flashot.gromov_wasserstein(X.float(), Y.float(), reg=reg, backend=backend, max_iter=1, inner_max_iter=5)
    mm, g = r.plan._m, r.plan._g
    ha, hy = mm.h_a(None, reg), mm.h_b(g, reg)
    mm.softmin_alt(ha, hy, reg)  # first call: caches, thread team
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mm.softmin_alt(ha, hy, reg)
        times.append(time.perf_counter() - t0)
    return {"n": n, "backend": r.backend, "inner_s": statistics.median(times), "rss_gib": _rss_gib()}


def case_solve(n: int, backend: str, max_iter: int, float64: bool = False, verbose: bool = False) -> dict:
    """A full GW solve (POT's default tol, at most ``max_iter`` outer iterations; ``verbose``: one line per
    outer iteration on stderr)."""
    import torch

    import flashot

    X, Y, reg = clouds(n)
    dt = torch.float64 if float64 else torch.float32
    t0 = time.perf_counter()
    r = flashot.gromov_wasserstein(X.to(dt), Y.to(dt), reg=reg, backend=backend, max_iter=max_iter, verbose=verbose)
    secs = time.perf_counter() - t0
    return {
        "n": n,
        "backend": r.backend,
        "seconds": secs,
        "n_outer": r.n_outer,
        "n_inner": r.n_inner,
        "converged": r.converged,
        "value": float(r.value),
        "rss_gib": _rss_gib(),
    }


def case_pot(n: int, max_iter: int) -> dict:
    import numpy as np
    import ot
    import torch

    X, Y, reg = clouds(n)
    t0 = time.perf_counter()
    C1 = (torch.cdist(X, X) ** 2).numpy()
    C2 = (torch.cdist(Y, Y) ** 2).numpy()
    T, log = ot.gromov.entropic_gromov_wasserstein(
        C1, C2, None, None, "square_loss", epsilon=reg, log=True, max_iter=max_iter
    )
    secs = time.perf_counter() - t0
    n_outer = 10 * (len(log["err"]) - 1) + 1 if len(log["err"]) > 1 else max_iter
    return {
        "n": n,
        "backend": "POT",
        "seconds": secs,
        "value": float(log["gw_dist"]),
        "n_outer_upper": n_outer,
        "rss_gib": _rss_gib(),
        "mass": float(np.sum(T)),
    }


CASES = {"inner": case_inner, "solve": case_solve, "pot": case_pot}


def run_sub(kind: str, threads: int, *args, show_stderr: bool = False) -> dict:
    """Run one case in a fresh process; its stderr is shown as it comes with ``show_stderr`` (progress)."""
    cmd = [sys.executable, __file__, "--one", json.dumps([kind, threads, *args])]
    r = subprocess.run(
        cmd, stdout=subprocess.PIPE, stderr=None if show_stderr else subprocess.PIPE, text=True, check=False
    )
    if r.returncode != 0:
        return {"error": "see its stderr above" if show_stderr else (r.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def section_speed(a) -> None:
    print(f"\n### One inner iteration and a full solve (float32, {a.threads} threads)\n")
    print(
        "| n = m | engine | inner iteration (s, median) | full solve (s) | outer / inner iterations | "
        "tiled / cpu (inner) | tiled / cpu (solve) |"
    )
    print("|---|---|---|---|---|---|---|")
    for n in a.sizes:
        cpu_it = run_sub("inner", a.threads, n, "cpu", a.repeats)
        til_it = run_sub("inner", a.threads, n, "tiled", max(1, a.repeats // 3))
        cpu_solve = run_sub("solve", a.threads, n, "cpu", 1000)
        if n <= a.tiled_full_max:
            til_solve, est = run_sub("solve", a.threads, n, "tiled", 1000), ""
        else:
            til_solve = {
                "seconds": cpu_solve["n_inner"] * til_it["inner_s"],
                "n_outer": cpu_solve["n_outer"],
                "n_inner": cpu_solve["n_inner"],
            }
            est = " (est.)"
        print(
            f"| {n:,} | cpu | {cpu_it['inner_s']:.4f} | {cpu_solve['seconds']:.1f} | "
            f"{cpu_solve['n_outer']} / {cpu_solve['n_inner']} | | |"
        )
        print(
            f"| {n:,} | tiled | {til_it['inner_s']:.3f} | {til_solve['seconds']:.0f}{est} | "
            f"{til_solve['n_outer']} / {til_solve['n_inner']}{est} | {til_it['inner_s'] / cpu_it['inner_s']:.0f}x | "
            f"{til_solve['seconds'] / cpu_solve['seconds']:.0f}x{est} |",
            flush=True,
        )


def section_big(a) -> None:
    print(f"\n### n = m = {a.big_n:,} and POT's dense solver ({a.threads} threads)\n")
    print("| solver | n = m | dtype | outer iterations | inner iterations | seconds | s / outer | peak RSS GiB |")
    print("|---|---|---|---|---|---|---|---|")
    big = run_sub("solve", a.threads, a.big_n, "cpu", a.big_outer, False, a.progress, show_stderr=a.progress)
    if "error" in big:
        print(f"| flashot cpu | {a.big_n:,} | float32 | failed: {big['error']} |")
    else:
        print(
            f"| flashot cpu | {a.big_n:,} | float32 | {big['n_outer']} | {big['n_inner']} | {big['seconds']:.0f} | "
            f"{big['seconds'] / big['n_outer']:.0f} | {big['rss_gib']:.2f} |",
            flush=True,
        )
        print(
            f"\n{big['seconds'] / big['n_inner']:.2f} s per inner iteration (outer-step work included); converged "
            f"(outer tol met): {big['converged']}; GW value {big['value']:.6g}",
            flush=True,
        )
    for n in a.pot_n:
        pot = run_sub("pot", a.threads, n, a.pot_outer)
        ours = run_sub("solve", a.threads, n, "cpu", a.pot_outer, True)
        ours32 = run_sub("solve", a.threads, n, "cpu", a.pot_outer)
        if "error" in pot:
            print(f"| POT dense | {n:,} | float64 | failed: {pot['error']} |")
        else:
            print(
                f"| POT dense | {n:,} | float64 | <= {pot['n_outer_upper']} | | {pot['seconds']:.0f} | "
                f"{pot['seconds'] / pot['n_outer_upper']:.1f} | {pot['rss_gib']:.2f} |"
            )
        for r, dt in ((ours, "float64"), (ours32, "float32")):
            print(
                f"| flashot cpu | {n:,} | {dt} | {r['n_outer']} | {r['n_inner']} | {r['seconds']:.1f} | "
                f"{r['seconds'] / r['n_outer']:.2f} | {r['rss_gib']:.2f} |"
            )
        if "error" not in pot:
            print(
                f"\nPOT / flashot (same n, same outer iterations at most): float64 "
                f"{pot['seconds'] / ours['seconds']:.1f}x time, {pot['rss_gib'] / ours['rss_gib']:.0f}x peak RSS; "
                f"GW values {pot['value']:.6g} (POT) and {ours['value']:.6g} (flashot, float64)",
                flush=True,
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="speed,big")
    ap.add_argument("--sizes", default="5000,20000")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--tiled-full-max", type=int, default=0, help="largest n whose tiled full solve is run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--big-n", type=int, default=100_000)
    ap.add_argument("--big-outer", type=int, default=1000, help="outer iterations at most at --big-n")
    ap.add_argument("--pot-n", default="8000", help="comma list of sizes for POT and flashot")
    ap.add_argument("--pot-outer", type=int, default=1000)
    ap.add_argument(
        "--progress", action="store_true", help="one line per outer iteration of the --big-n solve (stderr)"
    )
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        kind, threads, *args = json.loads(a.one)
        import torch

        torch.set_num_threads(threads)
        print(json.dumps(CASES[kind](*args)))
        return
    a.sizes = [int(s) for s in a.sizes.split(",")]
    a.pot_n = [int(s) for s in a.pot_n.split(",") if s]
    with open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    print(
        f"CPU: {cpu}; torch threads: {a.threads}; load average (1, 5, 15 min) at start "
        f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}"
    )
    for s in a.sections.split(","):
        {"speed": section_speed, "big": section_big}[s](a)
    end = os.getloadavg()
    busy = end[0] > max(a.threads, os.cpu_count() or 1) + 0.5  # this run's own threads count in the load
    print(
        f"\nload average at end {' '.join(f'{v:.2f}' for v in end)}"
        + (" (above this run's threads and the core count: other processes shared the CPUs)" if busy else "")
    )


if __name__ == "__main__":
    main()
