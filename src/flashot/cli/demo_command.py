"""``flashot demo``: solve a built-in problem (two 3-D curves) with ``solve_sample`` and ``SamplesLoss``, print
value, iterations, times and peak memory, and draw a 2-D transport (:mod:`flashot.demo_picture`)."""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

from ..demo_picture import DEMO_PNG, demo_png
from .options import DEMO_MAX_N, SEEDS, blur, int_type, positive_float
from .output import one_line, peak_rss_mib

if TYPE_CHECKING:
    import torch


def demo(argv: list[str] | None = None) -> int:
    """Bad options exit with status 2 and an argparse message naming the option, before any work."""
    p = argparse.ArgumentParser(prog="flashot demo", description="Solve a built-in entropic OT problem.")
    p.add_argument(
        "--n",
        type=int_type(1, DEMO_MAX_N),
        default=20_000,
        help=f"points per cloud (default 20000, at most {DEMO_MAX_N:,})",
    )
    p.add_argument("--reg", type=positive_float, default=1e-2, help="epsilon for solve_sample (cost |x-y|^2)")
    p.add_argument("--blur", type=blur, default=0.05, help="blur for the Sinkhorn divergence")
    p.add_argument("--backend", default="auto", help="'auto' or an engine name (dense, tiled, cpu, triton)")
    p.add_argument("--seed", type=int_type(*SEEDS), default=0)
    p.add_argument(
        "--png",
        default=DEMO_PNG,
        metavar="PATH",
        help=f"write a picture of a 2-D transport (points and barycentric-map arrows) here "
        f"(default {DEMO_PNG}; needs matplotlib)",
    )
    p.add_argument("--no-png", action="store_true", help="do not write the picture")
    args = p.parse_args(argv)
    from flashot.ops import engine_names

    if args.backend != "auto" and args.backend not in engine_names():
        p.error(f"argument --backend: expected 'auto' or one of {engine_names()}, got {args.backend!r}")
    try:
        return _demo_run(args, p)
    except ValueError as e:  # the problem is built in: what the solvers refuse is an option (reg, blur)
        p.error(one_line(e))


def _report_engine(args: argparse.Namespace, p: argparse.ArgumentParser, x: torch.Tensor) -> None:
    """Resolve the engine before the solves, so that a first-use compile is reported on its own line."""
    from flashot.costs import get_cost
    from flashot.ops import get_engine

    tp = time.perf_counter()
    try:
        eng = get_engine(
            args.backend,
            device=x.device,
            dtype=x.dtype,
            cost=get_cost("sqeuclidean"),
            size=(1, args.n, args.n, x.shape[-1]),
        )
    except ValueError as e:  # an engine that cannot run here (e.g. triton without a GPU)
        p.error(f"argument --backend: {e}")
    if eng.name != "cpu":
        return
    from flashot.ops.cpu.build import BUILD_INFO, cache_dir

    if BUILD_INFO.get("prebuilt"):
        print(
            f"engine cpu: prebuilt {BUILD_INFO['prebuilt']} kernels loaded ({time.perf_counter() - tp:.2f} s; "
            f"the best level of the wheel this CPU runs)"
        )
    elif BUILD_INFO.get("cached", True):
        print(f"engine cpu: compiled kernels loaded from the cache ({time.perf_counter() - tp:.2f} s)")
    else:
        print(
            f"engine cpu: kernels compiled on first use in {BUILD_INFO.get('seconds', 0.0):.1f} s "
            f"(cached in {cache_dir()} for later runs; not included in the times below)"
        )


def _demo_run(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    import torch

    import flashot
    from flashot.data import two_moons_3d

    x, y = two_moons_3d(args.n, seed=args.seed)
    rss0 = peak_rss_mib()
    print(f"flashot {flashot.__version__} demo: helix vs torus knot, n = m = {args.n:,}, d = 3, float32")
    _report_engine(args, p, x)

    t0 = time.perf_counter()
    res = flashot.solve_sample(x, y, reg=args.reg, tol=1e-3, max_iter=500, backend=args.backend)
    t1 = time.perf_counter()
    print(f"solve_sample  reg={args.reg:g}  engine={res.backend}")
    print(f"  value (OT_eps, POT convention) = {float(res.value):.6f}")
    print(f"  iterations = {res.n_iter}  converged = {res.converged}  marginal error = {res.error:.2e}")
    print(f"  time = {t1 - t0:.2f} s")

    xg = x.clone().requires_grad_()
    L = flashot.SamplesLoss("sinkhorn", p=2, blur=args.blur, backend=args.backend)
    t2 = time.perf_counter()
    S = L(xg, y)
    (grad,) = torch.autograd.grad(S, [xg])
    t3 = time.perf_counter()
    print(f"SamplesLoss(p=2, blur={args.blur:g}) debiased Sinkhorn divergence")
    print(
        f"  S(x, y) = {S.item():.6f}   |grad_x S| = {float(grad.norm()):.3e}   time (value + gradient) = {t3 - t2:.2f} s"
    )
    peak = peak_rss_mib()
    dense_gib = args.n * args.n * 4 / 2**30
    print(
        f"peak RSS = {peak:.0f} MiB (+{peak - rss0:.0f} MiB during the solves; a dense float32 cost matrix would be {dense_gib:.1f} GiB)"
    )
    if not args.no_png:
        return demo_png(args.png, args.backend, args.seed)
    return 0
