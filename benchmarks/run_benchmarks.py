#!/usr/bin/env python3
"""Regenerate BENCHMARKS.md (the issue's preset) with ONE command:

    python benchmarks/run_benchmarks.py            # writes BENCHMARKS.md at the repo root
    python benchmarks/run_benchmarks.py --budget 660 --engines auto,tiled \
        --million-from benchmarks/million_run.md   # what generated the committed BENCHMARKS.md

Stages (all numbers measured in this run; each table lists the equivalent
``flashot bench`` command that reproduces it alone):

  A. n = m = 20,000, d = 3, float32, eps = 0.1: flashot + every installed peer,
     median of 3 runs of 10 iterations.
  B. the same with d = 64, 1 run of 3 iterations.
  C. scaling of flashot: time per iteration for n = 5k ... 80k (d = 3), fitted exponent.
  D. n = m = 1,000,000, d = 3, 10 iterations of flashot with its peak RSS.

A total time budget (default 1200 s, ``--budget``) is split between the stages;
solvers that would not fit get fewer runs / iterations (said in the table's
notes) or are skipped with their estimated time.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli_command(cfg) -> str:
    parts = [
        "flashot bench",
        f"--sizes {','.join(map(str, cfg.sizes))}",
        f"--dims {','.join(map(str, cfg.dims))}",
        f"--dtypes {','.join(cfg.dtypes)}",
        f"--iters {cfg.iters}",
        f"--repeats {cfg.repeats}",
        f"--eps {cfg.eps:g}",
        f"--engines {','.join(cfg.engines)}",
        f"--peers {','.join(cfg.peers) if cfg.peers else 'none'}",
    ]
    if cfg.budget:
        parts.append(f"--budget {cfg.budget:.0f}")
    if cfg.solver_budget:
        parts.append(f"--solver-budget {cfg.solver_budget:.0f}")
    if cfg.flashot_budget:
        parts.append(f"--flashot-budget {cfg.flashot_budget:.0f}")
    return " ".join(parts)


def fit_exponent(points: list[tuple[int, float]]) -> float | None:
    """Least-squares slope of log(time) against log(n)."""
    if len(points) < 2:
        return None
    xs = [math.log(n) for n, _ in points]
    ys = [math.log(t) for _, t in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else None


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return out.stdout.strip() + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "?"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "BENCHMARKS.md"))
    ap.add_argument("--engines", default="auto", help="flashot engines (first one is the reference)")
    ap.add_argument("--budget", type=float, default=1200.0, help="total seconds (default 1200)")
    ap.add_argument("--plot", default=None, help="also write the scaling plot (PNG)")
    ap.add_argument(
        "--million-from",
        default=None,
        metavar="MD",
        help="when stage D does not fit the budget, include this separately measured result "
        "(Markdown written by `flashot bench ... --markdown MD`, with a first line saying "
        "when / at which commit it was measured)",
    )
    ap.add_argument(
        "--include",
        action="append",
        default=[],
        metavar="MD",
        help="append this separately measured section (Markdown whose first line is a '## ' title "
        "and which names its command, date, commit and CPU), e.g. benchmarks/isa_run.md",
    )
    args = ap.parse_args(argv)
    for inc in args.include:
        if not os.path.isfile(inc):
            ap.error(f"--include: no such file {inc!r}")

    from flashot.bench import report
    from flashot.bench.core import Config, run_bench
    from flashot.bench.peers import PEERS
    from flashot.ops import engine_names

    if args.million_from and not os.path.isfile(args.million_from):
        ap.error(f"--million-from: no such file {args.million_from!r}")
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [e for e in engines if e != "auto" and e not in engine_names()]
    if bad:
        ap.error(f"--engines: unknown engine(s) {bad}; registered: auto, {', '.join(engine_names())}")
    t0 = time.perf_counter()
    B = args.budget
    load_start = os.getloadavg()
    rates: dict = {}  # per-solver speed estimates shared between the stages

    def left() -> float:
        return B - (time.perf_counter() - t0)

    # ---- A: d = 3 ------------------------------------------------------------------------------
    cfg_a = Config(
        sizes=[20000],
        dims=[3],
        iters=10,
        repeats=3,
        eps=0.1,
        engines=engines,
        peers=list(PEERS),
        budget=0.5 * B,
        solver_budget=0.05 * B,
        flashot_budget=0.1 * B,
    )
    print(f"== stage A: {cli_command(cfg_a)}", file=sys.stderr, flush=True)
    res_a = run_bench(cfg_a, rates=rates)
    print(report.text_table(res_a), file=sys.stderr, flush=True)
    # ---- B: d = 64 -----------------------------------------------------------------------------
    cfg_b = Config(
        sizes=[20000],
        dims=[64],
        iters=3,
        repeats=1,
        eps=0.1,
        engines=engines,
        peers=list(PEERS),
        budget=max(1.0, min(0.38 * B, left() - 0.12 * B)),
        solver_budget=0.035 * B,
        flashot_budget=0.08 * B,
    )
    print(f"== stage B: {cli_command(cfg_b)}", file=sys.stderr, flush=True)
    res_b = run_bench(cfg_b, rates=rates)
    print(report.text_table(res_b), file=sys.stderr, flush=True)
    # ---- C: scaling ----------------------------------------------------------------------------
    cfg_c = Config(
        sizes=[5000, 10000, 20000, 40000, 80000],
        dims=[3],
        iters=3,
        repeats=1,
        eps=0.1,
        engines=engines[:1],
        peers=[],
        budget=max(1.0, left() - 0.02 * B),
        flashot_budget=0.06 * B,
    )
    print(f"== stage C: {cli_command(cfg_c)}", file=sys.stderr, flush=True)
    res_c = run_bench(cfg_c, rates=rates)
    print(report.text_table(res_c), file=sys.stderr, flush=True)
    pts = [(r.problem.n, r.s_per_iter) for r in res_c.rows if r.status == "ok"]
    alpha = fit_exponent(pts)
    # ---- D: one million points -----------------------------------------------------------------
    n_big, it_big = 1_000_000, 10
    cfg_d = Config(
        sizes=[n_big],
        dims=[3],
        iters=it_big,
        repeats=1,
        eps=0.1,
        engines=engines[:1],
        peers=[],
        budget=max(1.0, left()),
        measure_limits=False,
    )
    big_note = ""
    if pts:
        n0, t_0 = max(pts)
        # An exact softmin does n*m work: extrapolate with exponent 2 (the fitted one is noisy on a shared machine).
        est_iter = t_0 * (n_big / n0) ** 2
        est = est_iter * it_big
        if est > left():
            big_note = (
                f"skipped: estimated {est_iter:,.0f} s per iteration (from {n0:,} points at "
                f"{t_0:.3g} s/iter, time proportional to n*m), i.e. ~{est / 3600:,.1f} h for "
                f"{it_big} iterations, > the {max(left(), 0):.0f} s left of the budget"
            )
    else:
        big_note = "skipped: no scaling measurement to estimate its time from"
    res_d = None
    if not big_note:
        print(f"== stage D: {cli_command(cfg_d)}", file=sys.stderr, flush=True)
        res_d = run_bench(cfg_d, rates=rates)
    elapsed = time.perf_counter() - t0
    load_end = os.getloadavg()

    # ---- BENCHMARKS.md -------------------------------------------------------------------------
    mi = report.machine_info()
    mi.pop("load average", None)
    lines = [
        "# Benchmarks",
        "",
        "Generated by ONE command, from the repository root:",
        "",
        "```",
        " ".join(
            ["python benchmarks/run_benchmarks.py"] + [shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)]
        ).strip(),
        "```",
        "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; total run time {elapsed:.0f} s "
        f"(budget {B:.0f} s); flashot commit {git_commit()}",
        "- machine: " + "; ".join(f"{k}: {v}" for k, v in mi.items()),
        f"- load average (1, 5, 15 min) at start {' '.join(f'{x:.2f}' for x in load_start)}, at end "
        f"{' '.join(f'{x:.2f}' for x in load_end)}: a load above the core count means other processes "
        "shared the CPUs and every time below is inflated by an unknown, varying factor",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in report.library_versions().items()),
        f"- flashot engines registered: {', '.join(engine_names())}; reference engine `{engines[0]}`",
    ]
    if "cpu" not in engine_names():
        lines.append(
            "- **generated before the `cpu` engine landed**: `auto` resolves to the `tiled` reference "
            "engine (blocked PyTorch) here; rerun the command after merging it"
        )
    for l in report.limits_lines(res_a):
        lines.append(f"- {l} (measured at the start of stage A, under the same load as the solvers)")
    used = sorted(r.cores_used for r in res_a.rows + res_b.rows + res_c.rows if r.cores_used is not None)
    if used:
        lines.append(
            f"- CPU actually used by the solvers during their timed runs (`cores used`): median "
            f"{used[len(used) // 2]:.2f}, range {used[0]:.2f} to {used[-1]:.2f}, of {os.cpu_count()} cores"
        )
    for l in report.missing_lines(res_a):
        lines.append(f"- missing peer: {l}")
    lines.append(
        "- the `cpu` engine's own measurements (the technology choice: compiled C++/OpenMP against "
        "torch.compile/Inductor and plain torch, measured; design, exp/GEMM limits, the cached-cost vs "
        "streaming crossover that `auto` uses, fused symmetric steps, plan products, float32 accuracy, "
        "SamplesLoss forward + backward against GeomLoss): `benchmarks/CPU_ENGINE.md`"
    )
    lines += [
        "",
        "## How to read the tables",
        "",
        "- Problem: n = m points drawn uniformly in the unit cube (numpy seed 0), uniform weights, cost "
        "|x - y|^2, eps = 0.1, float32.  Every solver runs alternating log-domain Sinkhorn iterations "
        "(a softmin onto x, then onto y) for a fixed count, no early stopping, in its own process.",
        "- `s / iter`: median over the timed runs of (run time / iterations).  A run covers everything "
        "from the points (already in the library's array type) to potentials ready in memory: flashot's "
        "`Measures.build` + `sinkhorn_loop`; for dense solvers the cost matrix too; for OTT the jitted solve "
        "(compiled ahead of time for the full shape, not timed) with `block_until_ready`.  Warm-up (one "
        "iteration on the first 2,048 points of each cloud, same code path) is not timed.",
        "- `vs flashot`: `s / iter` of the solver divided by that of the reference flashot engine, "
        "same run, same problem.  `% HW limit`: max(2nm / exp rate, 4nmd / GEMM rate) / `s / iter`, "
        "with the exp and GEMM rates measured at the start of the run; the exp rate is the faster of "
        "`torch.exp` and flashot's own compiled vector exp (4 MiB buffer, best of 5 rounds), both listed above.",
        "- `cores used`: CPU time of the worker process (all threads) during the timed runs / their wall "
        "time; below the core count it shows how much of the machine the solver actually got (other "
        "processes, or its own serial parts).",
        "- `peak RSS MiB`: the worker process's VmHWM (includes the Python, torch, JAX, ... imports); "
        "`+RSS MiB`: peak minus the RSS just before the first solve (points already loaded).",
        "- `value`: <a, f> + <b, g> from the solver's potentials after its iterations (float64 sum); "
        "`rel. diff`: |value - flashot's value after the same number of iterations| / |flashot's|.",
        "- `torch-blocked` is the naive baseline, plain blocked PyTorch (mm + logsumexp): row blocks of "
        "~2^23 entries, `S = h - addmm(|x|^2 + |y|^2, x, y^T, alpha=-2) / eps`, `-eps * logsumexp(S, 1)`, "
        "alternating, no clamping or other tricks.  `flash-sinkhorn` (GPU only, CUDA + Triton) is called as "
        "`SamplesLoss(backend='alternating', use_epsilon_scaling=False, eps=eps, n_iters=K, half_cost=False, "
        "allow_tf32=False, potentials=True)` on CUDA tensors; without a GPU it is listed as missing.",
        "- POT and OTT update the y-potential first, so they are called with the clouds swapped; "
        "GeomLoss has no fixed-iteration alternating mode, so its own `softmin_tensorized` / "
        "`softmin_online` (KeOps formula `SqDist(X,Y)`, i.e. |x - y|^2, eps unchanged) are driven by a "
        "5-line alternating loop.  POT's marginal checks (iterations 0, 10, ... for `sinkhorn_log`; "
        "10, 20, ... for the lazy solver), POT dense's returned plan and OTT's one error evaluation per "
        "`inner_iterations` are part of their calls and are timed.  Details: `src/flashot/bench/peers.py`.",
        "- `iters x runs` below the preset (10 x 3, resp. 3 x 1) means the solver did not fit its share "
        "of the time budget (`--solver-budget` / `--flashot-budget`: fewer runs, then fewer iterations, "
        "never below 1 x 1; noted per row); peers never run more iterations than the flashot reference; "
        "`skipped` rows did not fit what was left of the stage's total `--budget`.",
        "",
    ]
    lines += [
        "## n = m = 20,000, d = 3, float32, eps = 0.1 (preset: median of 3 runs of 10 iterations)",
        "",
        f"`{cli_command(cfg_a)}`",
        "",
        report.markdown_table(res_a),
        "",
    ]
    lines += [
        "## n = m = 20,000, d = 64, float32, eps = 0.1 (preset: 1 run of 3 iterations)",
        "",
        f"`{cli_command(cfg_b)}`",
        "",
        report.markdown_table(res_b),
        "",
    ]
    lines += [
        f"## Scaling of flashot ({engines[0]}), d = 3, n = m = 5,000 ... 80,000",
        "",
        f"`{cli_command(cfg_c)}`",
        "",
        report.markdown_table(res_c),
        "",
    ]
    if alpha is not None:
        lines.append(
            f"Fitted exponent (least squares of log(s/iter) on log n over {len(pts)} sizes "
            f"{', '.join(f'{n:,}' for n, _ in pts)}): time per iteration ~ n^{alpha:.2f} "
            "(2 would be the O(nm) work of an exact softmin; with solvers getting a fraction of the "
            "cores, see `cores used`, single 1-3 iteration timings are noisy and so is this fit)."
        )
    else:
        lines.append("Fitted exponent: not available (fewer than 2 sizes measured within the budget).")
    lines += [
        "",
        f"## n = m = 1,000,000, d = 3, {it_big} iterations of flashot ({engines[0]}) with peak RSS",
        "",
        f"`{cli_command(cfg_d)}`",
        "",
    ]
    if res_d is not None:
        lines += [report.markdown_table(res_d), ""]
    else:
        lines += [big_note, ""]
        if args.million_from:
            with open(args.million_from) as fh:
                lines += [
                    f"Measured separately with the same command (file `{os.path.relpath(args.million_from, ROOT)}`, "
                    "included by `--million-from`):",
                    "",
                    "\n".join(f"**{ln[3:]}**" if ln.startswith("## ") else ln for ln in fh.read().strip().splitlines()),
                    "",
                ]
    for inc in args.include:
        with open(inc) as fh:
            lines += [
                "",
                fh.read().strip(),
                "",
                f"(Section included from `{os.path.relpath(inc, ROOT)}` by `--include`.)",
                "",
            ]
    with open(args.out, "w") as fh:
        fh.write("\n".join(lines))
    print(f"wrote {args.out} in {elapsed:.0f} s", file=sys.stderr)
    if args.plot:
        from flashot.bench.core import BenchResult

        report.plot(BenchResult(cfg_c, res_c.rows, {}, {}, 0.0), args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
