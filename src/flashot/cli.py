"""``flashot`` command line: ``flashot solve``, ``flashot demo``, ``flashot build`` and ``flashot bench``."""

from __future__ import annotations

import argparse
import math
import os
import resource
import sys
import time

from .demo_picture import DEMO_PNG, demo_png


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# Bounds of the numeric options.  Floats must be normal float64 numbers (a subnormal reg, tol or
# rho has lost its precision, and the solvers refuse or mis-handle it); integers are capped where a
# larger value can only overflow something (a Python index, a torch seed) or would never finish.
FLOAT_MIN = sys.float_info.min  # 2.2e-308, the smallest normal float64
MAX_ITER = 2**31 - 1  # iteration counts fit a signed 32-bit integer
MAX_COUNT = 2**62  # --max-points, --max-bytes, --topk: beyond any memory, and f.read(n + 1) still fits a C ssize_t
SEEDS = (-(2**63), 2**64 - 1)  # torch.Generator.manual_seed's range
DEMO_MAX_N = 10_000_000  # the default --max-points of flashot solve


def _int_type(lo: int = 1, hi: int = MAX_COUNT):
    """An argparse type: an integer in [lo, hi] (lo = 1: "a positive integer")."""

    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {s[:40]!r}") from None
        if lo != 1 and not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"expected an integer from {lo:,} to {hi:,}, got {s[:40]}")
        if v < 1:
            raise argparse.ArgumentTypeError(f"expected a positive integer, got {s[:40]}")
        if v > hi:
            raise argparse.ArgumentTypeError(f"expected at most {hi:,}, got {s[:40]}")
        return v

    return parse


_positive_int = _int_type()


def _positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {s[:40]!r}") from None
    if not FLOAT_MIN <= v < float("inf"):
        raise argparse.ArgumentTypeError(
            f"expected a positive finite number of at least {FLOAT_MIN:.2g} (the smallest normal float64), got {s[:40]}"
        )
    return v


def _blur(s: str) -> float:
    """GeomLoss' blur: eps = blur^2 must be a positive normal float64 (1.5e-154 <= blur <= 1.3e154)."""
    v = _positive_float(s)
    if FLOAT_MIN <= v * v < float("inf"):
        return v
    from decimal import Decimal

    sq = f"{Decimal(s.strip()) ** 2:.3g}"
    lo, hi = math.sqrt(FLOAT_MIN), math.sqrt(sys.float_info.max)
    how = (
        f"overflows float64 (largest {sys.float_info.max:.2g})"
        if v > 1
        else f"underflows the smallest normal float64 ({FLOAT_MIN:.2g})"
    )
    raise argparse.ArgumentTypeError(
        f"blur^2 = {sq} {how}: expected {lo:.2g} <= blur <= {hi:.2g} (rescale the points and the blur together)"
    )


def demo(argv: list[str] | None = None) -> int:
    """Bad options exit with status 2 and an argparse message naming the option, before any work."""
    p = argparse.ArgumentParser(prog="flashot demo", description="Solve a built-in entropic OT problem.")
    p.add_argument(
        "--n",
        type=_int_type(1, DEMO_MAX_N),
        default=20_000,
        help=f"points per cloud (default 20000, at most {DEMO_MAX_N:,})",
    )
    p.add_argument("--reg", type=_positive_float, default=1e-2, help="epsilon for solve_sample (cost |x-y|^2)")
    p.add_argument("--blur", type=_blur, default=0.05, help="blur for the Sinkhorn divergence")
    p.add_argument("--backend", default="auto", help="'auto' or an engine name (dense, tiled, cpu, triton)")
    p.add_argument("--seed", type=_int_type(*SEEDS), default=0)
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
        p.error(_one_line(e))


def _demo_run(args, p) -> int:
    import torch

    import flashot
    from flashot.costs import get_cost
    from flashot.data import two_moons_3d
    from flashot.ops import get_engine

    x, y = two_moons_3d(args.n, seed=args.seed)
    rss0 = _peak_rss_mib()
    print(f"flashot {flashot.__version__} demo: helix vs torus knot, n = m = {args.n:,}, d = 3, float32")

    # resolve the engine first, so that a first-use compile is reported on its own line
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
    if eng.name == "cpu":
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
    peak = _peak_rss_mib()
    dense_gib = args.n * args.n * 4 / 2**30
    print(
        f"peak RSS = {peak:.0f} MiB (+{peak - rss0:.0f} MiB during the solves; a dense float32 cost matrix would be {dense_gib:.1f} GiB)"
    )
    if not args.no_png:
        return demo_png(args.png, args.backend, args.seed)
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
        description="Load the CPU kernels now (for images and CI) instead of at first use -- the wheel's prebuilt "
        "ones, or compiled here -- and say which. The instruction set follows FLASHOT_CPU_MARCH "
        "(default: the best prebuilt level this CPU runs, else native).",
    )
    p.add_argument(
        "--march",
        default=None,
        help="build for this -march instead (e.g. x86-64-v3, or native to "
        "compile for this CPU); sets FLASHOT_CPU_MARCH for this command",
    )
    p.add_argument(
        "--info",
        action="store_true",
        help="say which kernels would be used (prebuilt variant, compiler, cache) without compiling anything",
    )
    args = p.parse_args(argv)
    import os

    if args.march is not None:
        os.environ["FLASHOT_CPU_MARCH"] = args.march
    from flashot.ops.cpu import build

    if args.info:
        return _build_info(build)
    try:
        lib = build.load()
        build.load_blocksparse()
    except build.BuildError as e:
        print(f"flashot build: {e}", file=sys.stderr)
        return 1
    info = build.BUILD_INFO
    how = f"prebuilt {info['prebuilt']}" if info.get("prebuilt") else f"-march={info['march']}"
    print(
        f"CPU kernels for {cpu_model()}: {how}, {', '.join(info['isa'])}, "
        f"{lib.flashot_vector_bytes() * 8}-bit vectors, up to {torch_threads()} threads (torch.get_num_threads())"
    )
    for name, facts in (("core", info), ("blocksparse", info["blocksparse"])):
        if facts.get("prebuilt"):
            how = f"prebuilt {facts['prebuilt']} (compiled by {facts['compiler']}), from the installed package"
        else:
            how = (
                "found in the cache"
                if facts["cached"]
                else (f"compiled in {facts['seconds']:.1f} s wall, {facts.get('cpu_seconds', 0.0):.1f} s CPU")
            )
        print(f"  {name}: {how}: {facts['path']}")
    return 0


def _build_info(build) -> int:
    """``flashot build --info``: the prebuilt variants and the one selected, or what first use compiles."""
    import platform

    try:
        st = build.prebuilt_status()
    except build.BuildError as e:
        print(f"flashot build: {e}", file=sys.stderr)
        return 1
    print(
        f"CPU: {cpu_model()} ({platform.machine()}); prebuilt variants in this install: "
        f"{', '.join(st['shipped']) or 'none'}; this CPU runs: {', '.join(st['runs']) or 'none'}"
    )
    if st["selected"]:
        print(
            f"kernels: prebuilt {st['selected']} (compiled by {st['compiler']}) from {st['dir']}; no compiler needed "
            f"(FLASHOT_CPU_MARCH=native compiles for this exact CPU instead)"
        )
        return 0
    cxx = build.find_compiler()
    print(
        f"kernels: compiled on first use with -march={build.march()}: {st['reason']}; compiler: "
        f"{cxx or 'none found (set CXX or install g++)'}; cache: {build.cache_dir()}"
    )
    return 0


PROGRESS_MIN_PAIRS = 1_000_000  # n * m from which `flashot solve` shows a progress bar (unless --quiet)

_SOLVE_DESC = """\
Entropic optimal transport between two point clouds read from files, streamed (no n x m matrix).

Files: .npy (a 2-D array, n x d), .npz (an array named 'points', or the only array; an array
named 'weights' beside it gives the weights), .csv / .txt (one point per row; comma or whitespace
separated; '#' comments; a first row without any number is a header of names; any other field
must be a decimal number), .ply (ASCII or binary_little_endian; the vertex x, y, z properties). Weights: --weights-column (a column index or header name, or a
.ply vertex property, removed from the coordinates) or --source-weights / --target-weights files;
uniform otherwise. Balanced problems normalise each side's weights to total mass 1; --unbalanced
keeps them as given.

Temperature, one of:
  --reg EPS    cost C = |x - y|^2 (POT's solve_sample; --cost changes it), epsilon = EPS;
               the value is POT's <C, P> + EPS KL(P | a x b).
  --blur B     GeomLoss' convention for p = 2: cost C = |x - y|^2 / 2 and epsilon = B^2
               (B is a length, in the units of the points); the value is the entropic OT
               cost OT_eps with that cost (not the debiased Sinkhorn divergence).

Files are untrusted: shapes and sizes are checked from the headers before any data is read,
nothing is unpickled, and paths that are not regular files are refused. Errors are one line
on stderr with exit status 1 (2 for bad options)."""

_SOLVE_EPILOG = """\
--out writes an .npz (numpy.load(path) reads it, no pickle): value, f, g (the potentials,
numpy float64), a, b (the weights used), n_iter, converged, error, reg (the epsilon), cost,
backend, time_s, version; with --map: barycentric_map (n x d, T(x_i) = sum_j P_ij y_j /
sum_j P_ij); with --topk K: topk_values and topk_indices (n x K, the K largest plan entries of
each row and their target indices).

example:
  flashot solve source.ply target.csv --weights-column w --blur 0.05 --out result.npz --map"""


_COST_TEXT = {"sqeuclidean": "|x-y|^2", "half_sqeuclidean": "|x-y|^2/2", "euclidean": "|x-y|"}


class _CliError(Exception):
    """A one-line error for the user (exit status 1)."""


def _unbalanced_arg(s: str):
    parts = [t.strip() for t in s.split(",")]
    if len(parts) not in (1, 2):
        raise argparse.ArgumentTypeError(f"expected RHO or RHO_A,RHO_B, got {s!r}")
    out = []
    for t in parts:
        if t.lower() in ("inf", "none", "strict"):
            out.append(None)
            continue
        try:
            v = float(t)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"invalid value {t!r} (a positive number, or inf for a strict side)"
            ) from None
        if not FLOAT_MIN <= v < float("inf"):
            raise argparse.ArgumentTypeError(
                f"expected a positive number of at least {FLOAT_MIN:.2g} "
                f"(the smallest normal float64), or inf, got {t[:40]}"
            )
        out.append(v)
    if all(v is None for v in out):
        raise argparse.ArgumentTypeError("both sides strict is balanced OT: leave out --unbalanced")
    return out[0] if len(out) == 1 else tuple(out)


def _solve_parser() -> argparse.ArgumentParser:
    from .io import DEFAULT_MAX_BYTES, DEFAULT_MAX_POINTS

    p = argparse.ArgumentParser(
        prog="flashot solve",
        description=_SOLVE_DESC,
        epilog=_SOLVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("source", help="source points x (.npy, .npz, .csv, .txt or .ply)")
    p.add_argument("target", help="target points y (same formats; same dimension d)")
    t = p.add_mutually_exclusive_group(required=True)
    t.add_argument("--reg", type=_positive_float, help="epsilon, with the cost --cost (default |x - y|^2)")
    t.add_argument("--blur", type=_blur, help="GeomLoss' blur: cost |x - y|^2 / 2 and epsilon = blur^2")
    p.add_argument(
        "--cost",
        choices=("sqeuclidean", "half_sqeuclidean", "euclidean"),
        default=None,
        help="with --reg: sqeuclidean |x-y|^2 (default), half_sqeuclidean |x-y|^2/2 or euclidean |x-y|",
    )
    p.add_argument(
        "--unbalanced",
        type=_unbalanced_arg,
        metavar="RHO[,RHO_B]",
        help="KL marginal penalties (POT's reg_m): one value for both sides, or two; "
        "'inf' keeps that side strict (semi-unbalanced)",
    )
    p.add_argument(
        "--tol", type=_positive_float, default=1e-6, help="stop when the marginal error is below this (default 1e-6)"
    )
    p.add_argument(
        "--max-iter",
        type=_int_type(1, MAX_ITER),
        default=1000,
        help=f"iteration limit (default 1000, at most {MAX_ITER:,})",
    )
    p.add_argument(
        "--backend",
        default="auto",
        help="'auto', an engine name (dense, tiled, cpu; triton needs CUDA tensors, and this "
        "command computes on the CPU) or 'multiscale' (GeomLoss' coarse-to-fine solver)",
    )
    p.add_argument("--float32", action="store_true", help="compute in float32 (faster; default float64)")
    p.add_argument(
        "--weights-column",
        metavar="COL",
        help="take the weights from this column of both files (index, negative from the end, "
        "or header name / .ply property)",
    )
    p.add_argument("--source-weights", metavar="FILE", help="weights of the source points (one per point)")
    p.add_argument("--target-weights", metavar="FILE", help="weights of the target points (one per point)")
    p.add_argument("--out", metavar="FILE.npz", help="write the results to this .npz (see below)")
    p.add_argument("--map", action="store_true", help="with --out: also the barycentric map T(x_i)")
    p.add_argument(
        "--topk",
        type=_positive_int,
        metavar="K",
        help="with --out: also the K largest plan entries of each row and their columns",
    )
    p.add_argument("--json", action="store_true", help="print the results as one JSON object on stdout")
    p.add_argument(
        "--quiet",
        "-q",
        action="store_true",
        help=f"no progress bar (shown on stderr when n * m >= {PROGRESS_MIN_PAIRS:,})",
    )
    p.add_argument(
        "--max-points",
        type=_positive_int,
        default=DEFAULT_MAX_POINTS,
        help=f"refuse files with more points (default {DEFAULT_MAX_POINTS:,})",
    )
    p.add_argument(
        "--max-bytes",
        type=_positive_int,
        default=DEFAULT_MAX_BYTES,
        help=f"refuse arrays (or text files) larger than this many bytes (default {DEFAULT_MAX_BYTES:,})",
    )
    return p


def solve_cmd(argv: list[str] | None = None) -> int:
    """``flashot solve``: exit 0 on success (also when ``tol`` was not reached: see ``converged``),
    1 on an input or solver error (one line on stderr), 2 on a bad option (argparse)."""
    p = _solve_parser()
    args = p.parse_args(argv)
    if args.blur is not None and args.cost is not None:
        p.error("argument --cost: not with --blur (which means the cost |x - y|^2 / 2)")
    if (args.map or args.topk) and not args.out:
        p.error("arguments --map / --topk: need --out FILE.npz")
    if args.weights_column is not None and (args.source_weights or args.target_weights):
        p.error("argument --weights-column: not with --source-weights / --target-weights")
    _check_backend(p, args)
    try:
        return _solve(args, p)
    except _CliError as e:
        print(f"flashot solve: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("flashot solve: interrupted", file=sys.stderr)
        return 130


def _check_backend(p, args) -> None:
    """Refuse (exit 2) a --backend that solve_sample cannot run here, before any file is read.

    Accepted: 'auto', 'multiscale' and the engines of :func:`flashot.ops.engine_names` that can run
    on the CPU in the compute dtype: the command hands numpy arrays to solve_sample, so it computes
    on the CPU, and an engine that needs CUDA tensors (triton) would only fail after the files."""
    if args.backend in ("auto", "multiscale"):
        return
    import warnings

    import torch

    from .costs import get_cost
    from .ops import engine_names, get_engine

    if args.backend not in engine_names():
        p.error(
            f"argument --backend: expected 'auto' or one of {[*engine_names(), 'multiscale']}, got {args.backend!r}"
        )
    cost = "half_sqeuclidean" if args.blur is not None else (args.cost or "sqeuclidean")
    dtype = torch.float32 if args.float32 else torch.float64
    with warnings.catch_warnings(record=True) as caught:  # e.g. the cpu engine's build falling back
        warnings.simplefilter("always")
        try:
            get_engine(args.backend, device=torch.device("cpu"), dtype=dtype, cost=get_cost(cost))
        except ValueError as e:
            why = _one_line(e).removeprefix(f"backend={args.backend!r} cannot run this problem: ")
            p.error(f"argument --backend: {args.backend!r} cannot run here (flashot solve computes on the CPU): {why}")
    for w in caught:
        print(f"flashot solve: warning: {_one_line(w.message)}", file=sys.stderr)


def _read_inputs(args, p):
    """The two clouds and their weights, read and checked (``--out``'s directory too) before any work."""
    from . import io as fio

    limits = fio.Limits(max_points=args.max_points, max_bytes=args.max_bytes)
    if args.out:
        out_dir = os.path.dirname(os.path.abspath(args.out))
        if os.path.isdir(args.out):
            raise _CliError(f"--out {args.out}: is a directory")
        if not os.path.isdir(out_dir):
            raise _CliError(f"--out {args.out}: the directory {out_dir} does not exist")
    try:
        xs = fio.read_points(args.source, limits, args.weights_column)
        ys = fio.read_points(args.target, limits, args.weights_column)
        a, b = xs.weights, ys.weights
        if args.source_weights:
            a = fio.read_weights(args.source_weights, xs.points.shape[0], limits)
        if args.target_weights:
            b = fio.read_weights(args.target_weights, ys.points.shape[0], limits)
    except fio.InputError as e:
        raise _CliError(str(e)) from None
    x, y = xs.points, ys.points
    if x.shape[1] != y.shape[1]:
        raise _CliError(
            f"dimensions differ: {args.source} has d = {x.shape[1]}, {args.target} has "
            f"d = {y.shape[1]} (points of both clouds need the same number of coordinates)"
        )
    if args.topk is not None and args.topk > y.shape[0]:
        p.error(f"argument --topk: {args.topk} is above the number of target points ({y.shape[0]})")
    if args.unbalanced is None:  # balanced OT compares distributions: total mass 1 on each side
        a = None if a is None else a / a.sum()
        b = None if b is None else b / b.sum()
    wsrc = [s for s in (xs.source or args.source_weights, ys.source or args.target_weights) if s]
    return x, y, a, b, wsrc


def _temperature(args) -> tuple[str, float, str]:
    """(cost, reg, a line saying which): ``--blur`` is GeomLoss' convention, cost |x-y|^2/2 at eps = blur^2."""
    if args.blur is not None:
        return (
            "half_sqeuclidean",
            args.blur**2,
            f"blur = {args.blur:g}: cost |x-y|^2/2, eps = blur^2 = {args.blur**2:g}",
        )
    cost = args.cost or "sqeuclidean"
    return cost, args.reg, f"cost {_COST_TEXT[cost]}, eps = reg = {args.reg:g}"


def _run_solve(args, x, y, a, b, dtype, cost: str, reg: float):
    """``flashot.solve_sample`` with its warnings printed as one line each on stderr."""
    import warnings

    import flashot

    def cast(v):
        return None if v is None else v.astype(dtype)

    verbose = not args.quiet and x.shape[0] * y.shape[0] >= PROGRESS_MIN_PAIRS
    caught = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            res = flashot.solve_sample(
                x.astype(dtype),
                y.astype(dtype),
                cast(a),
                cast(b),
                reg=reg,
                cost=cost,
                unbalanced=args.unbalanced,
                tol=args.tol,
                max_iter=args.max_iter,
                backend=args.backend,
                verbose=verbose,
            )
    except (ValueError, TypeError, FloatingPointError, MemoryError, NotImplementedError) as e:
        raise _CliError(_one_line(e)) from None
    for w in caught:
        print(f"flashot solve: warning: {_one_line(w.message)}", file=sys.stderr)
    return res


def _write_out(args, res, a, b, n: int, m: int, reg: float, cost: str, t_solve: float) -> tuple[list[str], float]:
    """``--out``: the potentials, weights and (``--map``, ``--topk``) plan extras in one ``.npz``."""
    import numpy as np

    from . import __version__

    f, g = res.potentials
    arrays = {
        "value": np.float64(float(res.value)),
        "f": np.asarray(f, dtype=np.float64),
        "g": np.asarray(g, dtype=np.float64),
        "a": np.full(n, 1.0 / n) if a is None else np.asarray(a, dtype=np.float64),
        "b": np.full(m, 1.0 / m) if b is None else np.asarray(b, dtype=np.float64),
        "n_iter": np.int64(res.n_iter),
        "converged": np.bool_(res.converged),
        "error": np.float64(np.nan if res.error is None else res.error),
        "reg": np.float64(reg),
        "cost": np.str_(cost),
        "backend": np.str_(res.backend),
        "time_s": np.float64(t_solve),
        "version": np.str_(__version__),
    }
    t1 = time.perf_counter()
    try:
        if args.map:
            arrays["barycentric_map"] = np.asarray(res.plan.barycentric_map(), dtype=np.float64)
        if args.topk:
            vals, idx = res.plan.topk(args.topk)
            arrays["topk_values"], arrays["topk_indices"] = np.asarray(vals, dtype=np.float64), np.asarray(idx)
    except (ValueError, FloatingPointError, MemoryError) as e:
        raise _CliError(_one_line(e)) from None
    extras_s = time.perf_counter() - t1
    try:
        with open(args.out, "wb") as fh:
            np.savez(fh, **arrays)
    except OSError as e:
        raise _CliError(f"--out {args.out}: cannot write ({e.strerror or e})") from None
    return sorted(arrays), extras_s


def _solve(args, p) -> int:
    import json

    import numpy as np

    from . import __version__

    t_read = time.perf_counter()
    x, y, a, b, wsrc = _read_inputs(args, p)
    t_read = time.perf_counter() - t_read
    n, m, d = x.shape[0], y.shape[0], x.shape[1]
    dtype = np.float32 if args.float32 else np.float64
    cost, reg, temp = _temperature(args)
    t0 = time.perf_counter()
    res = _run_solve(args, x, y, a, b, dtype, cost, reg)
    t_solve = time.perf_counter() - t0
    value = float(res.value)
    result = {
        "value": value,
        "n_iter": int(res.n_iter),
        "converged": bool(res.converged),
        "error": None if res.error is None else float(res.error),
        "time_s": t_solve,
        "read_s": t_read,
        "reg": reg,
        "cost": cost,
        "backend": res.backend,
        "dtype": np.dtype(dtype).name,
        "unbalanced": args.unbalanced,
        "n": n,
        "m": m,
        "d": d,
        "source": args.source,
        "target": args.target,
        "out": args.out,
        "version": __version__,
    }
    if args.out:
        result["written"], result["extras_s"] = _write_out(args, res, a, b, n, m, reg, cost, t_solve)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"flashot {__version__} solve: {args.source} ({n:,} points) -> {args.target} ({m:,} points), d = {d}")
    print(
        f"  {temp}"
        + (f", unbalanced rho = {args.unbalanced}" if args.unbalanced is not None else "")
        + (f"; weights from {', '.join(wsrc)}" if wsrc else "; uniform weights")
    )
    print(f"  value = {value:.10g}")
    err = "n/a" if res.error is None else f"{res.error:.3e}"
    print(f"  iterations = {res.n_iter}  converged = {res.converged}  error = {err}")
    print(f"  time = {t_solve:.3f} s (engine {res.backend}, {np.dtype(dtype).name}; reading the files {t_read:.3f} s)")
    if args.out:
        print(f"  wrote {args.out}: {', '.join(result['written'])}")
    return 0


def _one_line(e) -> str:
    lines = str(e).strip().splitlines()
    return (lines[0] if lines else type(e).__name__)[:500]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("--version", "-V"):
        from . import __version__

        print(f"flashot {__version__}")
        return 0
    cmds = {"solve": solve_cmd, "demo": demo, "build": build_cmd}
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
        print(
            "usage: flashot [--version] {" + ",".join(cmds) + "} [options]\n"
            "  solve  entropic OT between two point-cloud files (.npy .npz .csv .txt .ply); see flashot solve --help\n"
            "  demo   solve a built-in problem (20,000 points per cloud) and print value, iterations, time, memory;\n"
            "         writes a PNG of a 2-D transport (barycentric-map arrows) when matplotlib is installed\n"
            "  build  load the CPU kernels now (the wheel's prebuilt ones, or compiled here: first use would) and print\n"
            "         the instruction set and path; --info says which would be used, compiling nothing\n"
            + ("  bench  time flashot against installed peers (see flashot bench --help)\n" if "bench" in cmds else ""),
            file=out,
        )
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return int(cmds[argv[0]](argv[1:]) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
