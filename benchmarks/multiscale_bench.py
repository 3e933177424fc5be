"""Multiscale (coarse-to-fine, block-sparse) against the single-scale ``cpu`` engine, issue 15.

Two generated 3-D surfaces (a torus and a shifted, slightly rotated torus of different thickness),
``n = m`` points each, blur = 0.01 x the diameter, a full debiased ``SamplesLoss`` value plus its
gradient in x.  Each case runs in a fresh subprocess so that its peak RSS is its own.  The ``cpu``
engine runs where ``n <= --cpu-max`` and is extrapolated as ``n m`` beyond (marked).

    python benchmarks/multiscale_bench.py --sizes 20000,100000 --cpu-max 100000
    python benchmarks/multiscale_bench.py --sizes 1000000 --cluster-scales default,0.02
    python benchmarks/multiscale_bench.py --sizes 20000,100000 --geomloss 100000

``--geomloss N`` also runs GeomLoss' own ``SamplesLoss("sinkhorn", backend="multiscale")`` (KeOps,
its default ``cluster_scale``, the same blur and default schedule) at the sizes up to ``N``.  KeOps
compiles its formulas on first use: each such case first makes one untimed call on 2,000 points of
the same clouds (printed as ``compile s``), so the timed call reuses the compiled formulas.

Prints a markdown table (time in seconds, peak RSS in GiB, kept fraction of the pairs at the last
pruning, relative difference of the values); name the CPU beside it (``lscpu``).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import resource
import subprocess
import sys
import time


def surfaces(n: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)

    def torus(R, r, shift, angle):
        t, u = torch.rand(n, generator=g) * 2 * math.pi, torch.rand(n, generator=g) * 2 * math.pi
        p = torch.stack(
            [(R + r * torch.cos(u)) * torch.cos(t), (R + r * torch.cos(u)) * torch.sin(t), r * torch.sin(u)], -1
        )
        c, s = math.cos(angle), math.sin(angle)
        rot = torch.tensor([[c, 0.0, s], [0.0, 1.0, 0.0], [-s, 0.0, c]])
        return p @ rot.T + torch.tensor(shift)

    return torus(1.0, 0.35, (0.0, 0.0, 0.0), 0.0), torus(1.0, 0.25, (0.3, 0.1, 0.0), 0.3)


def geomloss_case(n: int) -> dict:
    """GeomLoss' multiscale backend on the same clouds and blur (compile call untimed, reported)."""
    import torch
    from geomloss import SamplesLoss

    x, y = surfaces(n)
    pts = torch.cat([x, y])
    diam = float((pts.amax(0) - pts.amin(0)).norm())
    L = SamplesLoss("sinkhorn", p=2, blur=0.01 * diam, backend="multiscale")
    t0 = time.perf_counter()
    xw = x[:2000].clone().requires_grad_()
    torch.autograd.grad(L(xw, y[:2000]), xw)  # KeOps compiles its formulas here (cached on disk)
    compile_s = time.perf_counter() - t0
    xg = x.clone().requires_grad_()
    t0 = time.perf_counter()
    v = L(xg, y)
    (gx,) = torch.autograd.grad(v, xg)
    secs = time.perf_counter() - t0
    return {
        "n": n,
        "backend": "geomloss",
        "seconds": secs,
        "compile_s": compile_s,
        "value": float(v.detach()),
        "grad_norm": float(gx.norm()),
        "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def one_case(n: int, backend: str, cluster_scale: str) -> dict:
    import torch

    import flashot

    if backend == "geomloss":
        return geomloss_case(n)
    x, y = surfaces(n)
    pts = torch.cat([x, y])
    diam = float((pts.amax(0) - pts.amin(0)).norm())
    kw = {}
    if backend == "multiscale" and cluster_scale != "default":
        kw["cluster_scale"] = float(cluster_scale) * diam
    L = flashot.SamplesLoss(blur=0.01 * diam, backend=backend, **kw)
    xg = x.clone().requires_grad_()
    from flashot.ops.cpu.build import BuildError, load

    try:  # the kernels built (or loaded) before the clock: a first use compiles them (~25 s on 2 cores)
        load(quiet=True)
    except BuildError:  # no compiler: the PyTorch paths run, as in the timed call
        pass
    t0 = time.perf_counter()
    v = L(xg, y)
    (gx,) = torch.autograd.grad(v, xg)
    secs = time.perf_counter() - t0
    out = {
        "n": n,
        "backend": backend,
        "cluster_scale": cluster_scale,
        "seconds": secs,
        "value": float(v),
        "grad_norm": float(gx.norm()),
        "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }
    if backend == "multiscale":
        run = L.last_multiscale
        out.update(kept=run.kept[-1], clusters=run.cx.n_clusters)
    return out


def run_sub(n: int, backend: str, cluster_scale: str) -> dict:
    r = subprocess.run(
        [sys.executable, __file__, "--one", f"{n},{backend},{cluster_scale}"],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="20000,100000")
    ap.add_argument("--cluster-scales", default="default", help="comma list: 'default' or fractions of the diameter")
    ap.add_argument("--cpu-max", type=int, default=100000, help="largest n run on the cpu engine (extrapolated above)")
    ap.add_argument(
        "--geomloss", type=int, default=0, help="largest n run on GeomLoss' multiscale backend (KeOps; 0: none)"
    )
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        n, backend, cs = a.one.split(",")
        print(json.dumps(one_case(int(n), backend, cs)))
        return
    print(f"# {platform.processor() or platform.machine()}, python {platform.python_version()}")
    print(
        "| n = m | engine | cluster_scale | clusters | kept | seconds | peak RSS GiB | vs cpu (time) | value rel. diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    mine: dict[int, float] = {}
    ref = None
    for n in (int(s) for s in a.sizes.split(",")):
        if n <= a.cpu_max:
            ref = run_sub(n, "cpu", "-")
            ref_secs, note = ref["seconds"], ""
            print(f"| {n:,} | cpu | - | - | 1 | {ref_secs:.1f} | {ref['rss_gib']:.2f} | 1.0x | - |", flush=True)
        elif ref is not None:
            ref_secs = ref["seconds"] * (n / ref["n"]) ** 2
            note = " (cpu extrapolated as n m)"
        else:
            ref_secs, note = math.nan, ""
        for cs in a.cluster_scales.split(","):
            r = run_sub(n, "multiscale", cs)
            same = ref is not None and ref["n"] == n
            diff = f"{abs(r['value'] - ref['value']) / abs(ref['value']):.1e}" if same else "-"
            speed = f"{ref_secs / r['seconds']:.1f}x{note}" if math.isfinite(ref_secs) else "- (no cpu run)"
            print(
                f"| {n:,} | multiscale | {cs} | {r['clusters']:,} | {r['kept']:.4f} | {r['seconds']:.1f} | "
                f"{r['rss_gib']:.2f} | {speed} | {diff} |",
                flush=True,
            )
            mine.setdefault(n, r["seconds"])
        if n <= a.geomloss:
            r = run_sub(n, "geomloss", "-")
            same = ref is not None and ref["n"] == n
            diff = f"{abs(r['value'] - ref['value']) / abs(ref['value']):.1e}" if same else "-"
            speed = f"{ref_secs / r['seconds']:.1f}x{note}" if math.isfinite(ref_secs) else "- (no cpu run)"
            print(
                f"| {n:,} | geomloss multiscale (compile {r['compile_s']:.0f} s, untimed) | default | - | - | "
                f"{r['seconds']:.1f} ({r['seconds'] / mine[n]:.1f}x flashot's) | {r['rss_gib']:.2f} | {speed} | "
                f"{diff} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
