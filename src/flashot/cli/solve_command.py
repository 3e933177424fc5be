"""``flashot solve``: read two point clouds (and weights) from files, run ``solve_sample`` on them, print the
results (text or ``--json``) and write them (``--out``, an ``.npz``)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from ..results import OTResult
from .output import one_line, print_warnings
from .solve_options import PROGRESS_MIN_PAIRS, check_options, solve_parser

if TYPE_CHECKING:
    import numpy as np

_COST_TEXT = {"sqeuclidean": "|x-y|^2", "half_sqeuclidean": "|x-y|^2/2", "euclidean": "|x-y|"}


class _CliError(Exception):
    """A one-line error for the user (exit status 1)."""


def solve_cmd(argv: list[str] | None = None) -> int:
    """``flashot solve``: exit 0 on success (also when ``tol`` was not reached: see ``converged``),
    1 on an input or solver error (one line on stderr), 2 on a bad option (argparse)."""
    p = solve_parser()
    args = p.parse_args(argv)
    check_options(p, args)
    try:
        return _solve(args, p)
    except _CliError as e:
        print(f"flashot solve: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("flashot solve: interrupted", file=sys.stderr)
        return 130


def _read_inputs(
    args: argparse.Namespace, p: argparse.ArgumentParser
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None, list[str]]:
    """The two clouds and their weights, read and checked (``--out``'s directory too) before any work."""
    from .. import io as fio

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


def _temperature(args: argparse.Namespace) -> tuple[str, float, str]:
    """(cost, reg, a line saying which): ``--blur`` is GeomLoss' convention, cost |x-y|^2/2 at eps = blur^2."""
    if args.blur is not None:
        return (
            "half_sqeuclidean",
            args.blur**2,
            f"blur = {args.blur:g}: cost |x-y|^2/2, eps = blur^2 = {args.blur**2:g}",
        )
    cost = args.cost or "sqeuclidean"
    return cost, args.reg, f"cost {_COST_TEXT[cost]}, eps = reg = {args.reg:g}"


def _run_solve(
    args: argparse.Namespace,
    x: np.ndarray,
    y: np.ndarray,
    a: np.ndarray | None,
    b: np.ndarray | None,
    dtype: type[np.floating],
    cost: str,
    reg: float,
) -> OTResult:
    """``flashot.solve_sample`` with its warnings printed as one line each on stderr."""
    import warnings

    import flashot

    def cast(v: np.ndarray | None) -> np.ndarray | None:
        return None if v is None else v.astype(dtype)

    verbose = not args.quiet and x.shape[0] * y.shape[0] >= PROGRESS_MIN_PAIRS
    caught: list[warnings.WarningMessage] | None = []
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
        raise _CliError(one_line(e)) from None
    print_warnings("flashot solve", caught)
    assert isinstance(res, OTResult)  # 2-D arrays: one problem, not a ragged batch (RaggedResult)
    return res


def _write_out(
    args: argparse.Namespace,
    res: OTResult,
    a: np.ndarray | None,
    b: np.ndarray | None,
    n: int,
    m: int,
    reg: float,
    cost: str,
    t_solve: float,
) -> tuple[list[str], float]:
    """``--out``: the potentials, weights and (``--map``, ``--topk``) plan extras in one ``.npz``."""
    import numpy as np

    from .. import __version__

    f, g = res.potentials
    arrays: dict[str, Any] = {
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
        raise _CliError(one_line(e)) from None
    extras_s = time.perf_counter() - t1
    try:
        with open(args.out, "wb") as fh:
            np.savez(fh, **arrays)
    except OSError as e:
        raise _CliError(f"--out {args.out}: cannot write ({e.strerror or e})") from None
    return sorted(arrays), extras_s


def _solve(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    import json

    import numpy as np

    from .. import __version__

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
    result: dict[str, Any] = {
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
