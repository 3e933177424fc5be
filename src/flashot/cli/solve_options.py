"""``flashot solve``'s options: the parser (its help text states the file formats and the two temperature
conventions) and the checks of option combinations that argparse cannot express, all before any file is read."""

from __future__ import annotations

import argparse

from .options import FLOAT_MIN, MAX_ITER, blur, int_type, positive_float, positive_int
from .output import one_line, print_warnings

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


def _unbalanced_arg(s: str) -> float | None | tuple[float | None, float | None]:
    """``--unbalanced``: one KL penalty rho for both sides, or two (``inf`` for a strict side)."""
    parts = [t.strip() for t in s.split(",")]
    if len(parts) not in (1, 2):
        raise argparse.ArgumentTypeError(f"expected RHO or RHO_A,RHO_B, got {s!r}")
    out: list[float | None] = []
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
    return out[0] if len(out) == 1 else (out[0], out[1])


def solve_parser() -> argparse.ArgumentParser:
    """The parser of ``flashot solve``."""
    from ..io import DEFAULT_MAX_BYTES, DEFAULT_MAX_POINTS

    p = argparse.ArgumentParser(
        prog="flashot solve",
        description=_SOLVE_DESC,
        epilog=_SOLVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("source", help="source points x (.npy, .npz, .csv, .txt or .ply)")
    p.add_argument("target", help="target points y (same formats; same dimension d)")
    t = p.add_mutually_exclusive_group(required=True)
    t.add_argument("--reg", type=positive_float, help="epsilon, with the cost --cost (default |x - y|^2)")
    t.add_argument("--blur", type=blur, help="GeomLoss' blur: cost |x - y|^2 / 2 and epsilon = blur^2")
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
        "--tol", type=positive_float, default=1e-6, help="stop when the marginal error is below this (default 1e-6)"
    )
    p.add_argument(
        "--max-iter",
        type=int_type(1, MAX_ITER),
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
        type=positive_int,
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
        type=positive_int,
        default=DEFAULT_MAX_POINTS,
        help=f"refuse files with more points (default {DEFAULT_MAX_POINTS:,})",
    )
    p.add_argument(
        "--max-bytes",
        type=positive_int,
        default=DEFAULT_MAX_BYTES,
        help=f"refuse arrays (or text files) larger than this many bytes (default {DEFAULT_MAX_BYTES:,})",
    )
    return p


def check_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse (exit 2) the combinations of options that contradict each other, and a --backend that cannot run."""
    if args.blur is not None and args.cost is not None:
        p.error("argument --cost: not with --blur (which means the cost |x - y|^2 / 2)")
    if (args.map or args.topk) and not args.out:
        p.error("arguments --map / --topk: need --out FILE.npz")
    if args.weights_column is not None and (args.source_weights or args.target_weights):
        p.error("argument --weights-column: not with --source-weights / --target-weights")
    check_backend(p, args)


def check_backend(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse (exit 2) a --backend that solve_sample cannot run here, before any file is read.

    Accepted: 'auto', 'multiscale' and the engines of :func:`flashot.ops.engine_names` that can run
    on the CPU in the compute dtype: the command hands numpy arrays to solve_sample, so it computes
    on the CPU, and an engine that needs CUDA tensors (triton) would only fail after the files."""
    if args.backend in ("auto", "multiscale"):
        return
    import warnings

    import torch

    from ..costs import get_cost
    from ..ops import engine_names, get_engine

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
            why = one_line(e).removeprefix(f"backend={args.backend!r} cannot run this problem: ")
            p.error(f"argument --backend: {args.backend!r} cannot run here (flashot solve computes on the CPU): {why}")
    print_warnings("flashot solve", caught)
