"""``flashot`` command line: ``flashot demo``, ``flashot build`` and ``flashot bench``."""

from __future__ import annotations

import argparse
import resource
import sys
import time


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {s!r}") from None
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {s}")
    return v


def demo(argv: list[str] | None = None) -> int:
    """Bad options exit with status 2 and an argparse message naming the option, before any work."""
    p = argparse.ArgumentParser(prog="flashot demo", description="Solve a built-in entropic OT problem.")
    p.add_argument("--n", type=_positive_int, default=20_000, help="points per cloud (default 20000)")
    p.add_argument("--reg", type=_positive_float, default=1e-2, help="epsilon for solve_sample (cost |x-y|^2)")
    p.add_argument("--blur", type=_positive_float, default=0.05, help="blur for the Sinkhorn divergence")
    p.add_argument("--backend", default="auto", help="'auto' or an engine name (dense, tiled, cpu, triton)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import torch

    import flashot
    from flashot.costs import get_cost
    from flashot.data import two_moons_3d
    from flashot.ops import engine_names, get_engine

    if args.backend != "auto" and args.backend not in engine_names():
        p.error(f"argument --backend: expected 'auto' or one of {engine_names()}, got {args.backend!r}")
    x, y = two_moons_3d(args.n, seed=args.seed)
    rss0 = _peak_rss_mib()
    print(f"flashot {flashot.__version__} demo: helix vs torus knot, n = m = {args.n:,}, d = 3, float32")

    # resolve the engine first, so that a first-use compile is reported on its own line
    tp = time.perf_counter()
    try:
        eng = get_engine(args.backend, device=x.device, dtype=x.dtype, cost=get_cost("sqeuclidean"),
                         size=(1, args.n, args.n, x.shape[-1]))
    except ValueError as e:  # an engine that cannot run here (e.g. triton without a GPU)
        p.error(f"argument --backend: {e}")
    if eng.name == "cpu":
        from flashot.ops.cpu.build import BUILD_INFO, cache_dir

        if BUILD_INFO.get("cached", True):
            print(f"engine cpu: compiled kernels loaded from the cache ({time.perf_counter() - tp:.2f} s)")
        else:
            print(f"engine cpu: kernels compiled on first use in {BUILD_INFO.get('seconds', 0.0):.1f} s "
                  f"(cached in {cache_dir()} for later runs; not included in the times below)")

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
    print(f"  S(x, y) = {S.item():.6f}   |grad_x S| = {float(grad.norm()):.3e}   time (value + gradient) = {t3 - t2:.2f} s")
    peak = _peak_rss_mib()
    dense_gib = args.n * args.n * 4 / 2**30
    print(f"peak RSS = {peak:.0f} MiB (+{peak - rss0:.0f} MiB during the solves; a dense float32 cost matrix would be {dense_gib:.1f} GiB)")
    return 0


def cpu_model() -> str:
    """The CPU's vendor and model as the OS reports it (benchmarks name it beside every figure)."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model", "CPU part")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def build_cmd(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="flashot build",
        description="Compile the CPU kernels now (for images and CI) instead of at first use, and say what was "
                    "built. The instruction set follows FLASHOT_CPU_MARCH (default native).")
    p.add_argument("--march", default=None, help="build for this -march instead (e.g. x86-64-v3); sets "
                                                  "FLASHOT_CPU_MARCH for this command")
    args = p.parse_args(argv)
    import os

    if args.march is not None:
        os.environ["FLASHOT_CPU_MARCH"] = args.march
    from flashot.ops.cpu import build

    try:
        lib = build.load()
    except build.BuildError as e:
        print(f"flashot build: {e}", file=sys.stderr)
        return 1
    info = build.BUILD_INFO
    how = "found in the cache" if info["cached"] else (f"compiled in {info['seconds']:.1f} s wall, "
                                                       f"{info.get('cpu_seconds', 0.0):.1f} s CPU")
    print(f"CPU kernels for {cpu_model()}: -march={info['march']}, {', '.join(info['isa'])}, "
          f"{lib.flashot_vector_bytes() * 8}-bit vectors, up to {torch_threads()} threads (torch.get_num_threads())")
    print(f"  {how}: {info['path']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("--version", "-V"):
        from . import __version__

        print(f"flashot {__version__}")
        return 0
    cmds = {"demo": demo, "build": build_cmd}
    try:
        from .bench import main as bench_main

        cmds["bench"] = bench_main
    except ImportError as e:  # only when the optional benchmark module is absent
        if "flashot.bench" not in str(e):
            raise
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in cmds:
        out = sys.stdout if argv and argv[0] in ("-h", "--help") else sys.stderr
        if argv and argv[0] not in ("-h", "--help"):
            print(f"flashot: unknown command {argv[0]!r} (choose from {', '.join(cmds)})", file=out)
        print("usage: flashot [--version] {" + ",".join(cmds) + "} [options]\n"
              "  demo   solve a built-in problem (20,000 points per cloud) and print value, iterations, time, memory\n"
              "  build  compile the CPU kernels now (first use would) and print the instruction set and cache path\n"
              + ("  bench  time flashot against installed peers (see flashot bench --help)\n" if "bench" in cmds else ""),
              file=out)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return int(cmds[argv[0]](argv[1:]) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
