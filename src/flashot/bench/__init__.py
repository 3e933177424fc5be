"""``flashot bench``: time flashot against the installed peers on the same problems.

Every solver runs in its own worker process (``flashot.bench.worker``) on the
same generated problem (``problems.Problem``: uniform weights, points uniform in
the unit cube, cost |x - y|^2, temperature eps), for a fixed number of
iterations with no early stopping; warm-up is excluded; the median of the
timed runs divided by the iteration count is reported, with the worker's peak
RSS, the dual value ``<a, f> + <b, g>`` and its relative difference to flashot's
value after the same number of iterations.  See ``peers.py`` for exactly what is
timed for each solver and ``limits.py`` for the hardware limit.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from .core import BenchResult, Config, run_bench
from .peers import PEERS

__all__ = ["main", "run_bench", "Config", "BenchResult", "PEERS"]


def _int_list(name: str):
    def parse(s: str) -> list[int]:
        out = []
        for tok in s.split(","):
            tok = tok.strip().replace("_", "")
            try:
                v = int(float(tok)) if tok.lower().endswith(("e3", "e4", "e5", "e6")) else int(tok)
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"{name}: expected comma-separated positive integers, got {s!r}"
                ) from None
            if v < 1:
                raise argparse.ArgumentTypeError(f"{name}: expected positive integers, got {v}")
            out.append(v)
        return out

    return parse


def _pos_int(name: str):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}: expected a positive integer, got {s!r}") from None
        if v < 1:
            raise argparse.ArgumentTypeError(f"{name}: expected a positive integer, got {v}")
        return v

    return parse


def _pos_float(name: str):
    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}: expected a positive number, got {s!r}") from None
        if not v > 0 or v == float("inf"):
            raise argparse.ArgumentTypeError(f"{name}: expected a positive finite number, got {s}")
        return v

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flashot bench",
        description="Seconds per Sinkhorn iteration of flashot and the installed peers on the same problems "
        "(uniform weights, points in the unit cube, cost |x-y|^2, fixed iterations, no early stopping).",
    )
    p.add_argument(
        "--sizes", type=_int_list("--sizes"), default=[5000, 20000], help="points per cloud, n = m (default 5000,20000)"
    )
    p.add_argument("--dims", type=_int_list("--dims"), default=[3, 64], help="dimensions (default 3,64)")
    p.add_argument("--dtypes", default="float32", help="float32 and/or float64 (default float32)")
    p.add_argument("--iters", type=_pos_int("--iters"), default=10, help="Sinkhorn iterations per run (default 10)")
    p.add_argument(
        "--repeats", type=_pos_int("--repeats"), default=3, help="timed runs; the median is reported (default 3)"
    )
    p.add_argument(
        "--eps", type=_pos_float("--eps"), default=0.1, help="temperature for the cost |x-y|^2 (default 0.1)"
    )
    p.add_argument(
        "--engines",
        default="auto",
        help="flashot engines, comma-separated: 'auto' or any registered engine (default auto)",
    )
    p.add_argument(
        "--peers",
        default="all",
        help=f"comma-separated peers, 'all' or 'none' (default all); known: {', '.join(PEERS)}",
    )
    p.add_argument(
        "--budget",
        type=_pos_float("--budget"),
        default=None,
        help="total seconds: skip remaining runs whose estimated time exceeds what is left",
    )
    p.add_argument(
        "--solver-budget",
        type=_pos_float("--solver-budget"),
        default=None,
        help="seconds per solver and problem: fewer runs, then fewer iterations, never below 1 x 1 "
        "(reported in the notes column)",
    )
    p.add_argument(
        "--flashot-budget",
        type=_pos_float("--flashot-budget"),
        default=None,
        help="like --solver-budget, for the flashot engines (default: --solver-budget)",
    )
    p.add_argument("--timeout", type=_pos_float("--timeout"), default=None, help="hard limit per worker process (s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated points (default 0)")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="run the solvers in this process (quick checks, tests): no memory isolation, no RSS column",
    )
    p.add_argument("--no-limits", action="store_true", help="skip the exp / GEMM throughput measurement")
    p.add_argument("--markdown", metavar="OUT.md", help="also write the table as Markdown")
    p.add_argument("--plot", metavar="OUT.png", help="log-log plot of time per iteration vs n (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar / progress lines")
    return p


def parse_config(argv: list[str]) -> tuple[Config, argparse.Namespace]:
    p = build_parser()
    args = p.parse_args(argv)
    from ..ops import engine_names
    from .problems import DTYPES

    dtypes = [t.strip() for t in args.dtypes.split(",") if t.strip()]
    bad = [t for t in dtypes if t not in DTYPES]
    if bad or not dtypes:
        p.error(f"--dtypes: expected a comma-separated subset of {', '.join(DTYPES)}, got {args.dtypes!r}")
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    known = ["auto"] + engine_names()
    bad = [e for e in engines if e not in known]
    if bad or not engines:
        p.error(
            f"--engines: unknown engine {', '.join(map(repr, bad)) or repr(args.engines)}; "
            f"registered: {', '.join(known)}"
        )
    if len(set(engines)) != len(engines):
        p.error("--engines: an engine is listed twice")
    pe = args.peers.strip()
    if pe == "all":
        peers = list(PEERS)
    elif pe in ("none", ""):
        peers = []
    else:
        peers = [x.strip() for x in pe.split(",") if x.strip()]
        bad = [x for x in peers if x not in PEERS]
        if bad:
            p.error(f"--peers: unknown peer {', '.join(map(repr, bad))}; known: {', '.join(PEERS)}, all, none")
        if len(set(peers)) != len(peers):
            p.error("--peers: a peer is listed twice")
    if args.plot:
        from .report import check_matplotlib

        why = check_matplotlib()
        if why:
            p.error(why)
    cfg = Config(
        sizes=args.sizes,
        dims=args.dims,
        dtypes=dtypes,
        engines=engines,
        peers=peers,
        iters=args.iters,
        repeats=args.repeats,
        eps=args.eps,
        seed=args.seed,
        budget=args.budget,
        solver_budget=args.solver_budget,
        flashot_budget=args.flashot_budget,
        timeout=args.timeout,
        measure_limits=not args.no_limits,
        in_process=args.in_process,
    )
    return cfg, args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg, args = parse_config(argv)
    from . import report

    res = run_bench(cfg, progress=not args.no_progress)
    print(report.text_table(res))
    for line in report.limits_lines(res):
        print(line)
    for line in report.missing_lines(res):
        print(f"missing: {line}")
    print(
        f"total time {res.elapsed_s:.1f} s; s / iter = median over runs of (run time / iterations); "
        "ratios and rel. diff against the first flashot engine in the same run"
    )
    if args.markdown:
        cmd = "flashot bench " + " ".join(shlex.quote(a) for a in argv)
        with open(args.markdown, "w") as fh:
            fh.write(report.markdown_report(res, cmd))
        print(f"wrote {args.markdown}")
    if args.plot:
        report.plot(res, args.plot)
        print(f"wrote {args.plot}")
    ref_failed = any(r.status == "error" and r.solver.startswith("flashot:") for r in res.rows)
    return 1 if ref_failed else 0
