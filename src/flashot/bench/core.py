"""Orchestration: plan every (problem, solver) cell, run it in a worker process, collect rows."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .limits import Limits
from .peers import get_runner
from .problems import Problem

PROBE_N = 2048  # points per cloud of the probe run used to estimate a solver's time


@dataclass
class Config:
    sizes: list[int]
    dims: list[int]
    dtypes: list[str] = field(default_factory=lambda: ["float32"])
    engines: list[str] = field(default_factory=lambda: ["auto"])
    peers: list[str] = field(default_factory=list)
    iters: int = 10
    repeats: int = 3
    eps: float = 0.1
    seed: int = 0
    budget: float | None = None  # total seconds; cells whose estimate exceeds what is left are skipped
    solver_budget: float | None = None  # seconds per solver and cell: fewer runs, then fewer iterations (>= 1 x 1)
    flashot_budget: float | None = None  # the same for flashot engines (default: solver_budget)
    timeout: float | None = None  # hard limit per worker process
    measure_limits: bool = True
    in_process: bool = False  # run solvers in this process (fast, for tests): no memory isolation, no RSS


@dataclass
class Row:
    problem: Problem
    solver: str
    status: str = "ok"  # ok | skipped | error
    reason: str = ""
    iters: int = 0
    repeats: int = 0
    times: list[float] = field(default_factory=list)
    version: str = ""
    engine: str | None = None
    value: float | None = None
    trajectory: list[float] | None = None
    rss_peak_mib: float | None = None
    rss_before_mib: float | None = None
    cpu_s: float | None = None  # process CPU time (all threads) during the timed runs
    wall_s: float = 0.0
    # filled after the cell is complete
    ratio: float | None = None
    rel_diff: float | None = None
    hw_fraction: float | None = None
    reduced: str = ""
    is_ref: bool = False  # the cell's reference flashot run

    @property
    def s_per_iter(self) -> float | None:
        if self.status != "ok" or not self.times:
            return None
        return statistics.median(self.times) / self.iters

    @property
    def cores_used(self) -> float | None:
        if self.cpu_s is None or not self.times:
            return None
        return self.cpu_s / sum(self.times)

    @property
    def delta_mib(self) -> float | None:
        if self.rss_peak_mib is None or self.rss_before_mib is None:
            return None
        return self.rss_peak_mib - self.rss_before_mib


@dataclass
class BenchResult:
    config: Config
    rows: list[Row]
    missing: dict[str, str]
    limits: dict[str, Limits]
    elapsed_s: float


def mem_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def run_worker(
    solver: str,
    prob: Problem,
    iters: int,
    repeats: int,
    *,
    record: bool,
    timeout: float | None,
    in_process: bool = False,
) -> tuple[dict, float]:
    """Run one worker process; returns (its JSON result or an error dict, wall seconds)."""
    if in_process:
        from .worker import run

        t0 = time.perf_counter()
        try:
            res = run(dict(solver=solver, problem=prob.to_dict(), iters=iters, repeats=repeats, record=record))
        except Exception as e:
            res = {"status": "error", "error": f"{type(e).__name__}: {e}"}
        res.pop("rss_peak_kib", None)
        res.pop("rss_before_kib", None)
        return res, time.perf_counter() - t0
    with tempfile.TemporaryDirectory(prefix="flashot-bench-") as tmp:
        spec_p, res_p = os.path.join(tmp, "spec.json"), os.path.join(tmp, "result.json")
        with open(spec_p, "w") as fh:
            json.dump(dict(solver=solver, problem=prob.to_dict(), iters=iters, repeats=repeats, record=record), fh)
        t0 = time.perf_counter()
        try:
            p = subprocess.run(
                [sys.executable, "-m", "flashot.bench.worker", spec_p, res_p],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return {"status": "error", "error": f"timed out after {timeout:.0f} s"}, time.perf_counter() - t0
        wall = time.perf_counter() - t0
        if os.path.exists(res_p):
            with open(res_p) as fh:
                return json.load(fh), wall
        tail = (p.stdout or "").strip().splitlines()[-3:]
        how = f"killed by signal {-p.returncode}" if p.returncode < 0 else f"exit code {p.returncode}"
        if p.returncode == -9:
            how += " (out of memory?)"
        return {"status": "error", "error": f"worker {how}: {' | '.join(tail)}"}, wall


class Planner:
    """Estimates a solver's time on a problem from its earlier runs (or a small probe)."""

    def __init__(self, cfg: Config, t_start: float, rates: dict | None = None):
        self.cfg = cfg
        self.t_start = t_start
        # solver -> list of (d, seconds per pair-iteration, worker overhead seconds); may be shared between runs
        self.rates: dict[str, list[tuple[int, float, float]]] = {} if rates is None else rates

    def solver_budget(self, solver: str) -> float | None:
        if solver.startswith("flashot:") and self.cfg.flashot_budget is not None:
            return self.cfg.flashot_budget
        return self.cfg.solver_budget

    def remaining(self) -> float | None:
        if self.cfg.budget is None:
            return None
        return self.cfg.budget - (time.perf_counter() - self.t_start)

    def learn(self, solver: str, prob: Problem, res: dict, wall: float) -> None:
        if res.get("status") != "ok":
            return
        t_iter = statistics.median(res["times"]) / res["iters"]
        rate = t_iter / prob.pairs
        overhead = max(0.0, wall - sum(res["times"]))  # start-up, imports, data, warm-up, compile
        self.rates.setdefault(solver, []).append((prob.d, rate, overhead))

    def _rate(self, solver: str, prob: Problem) -> tuple[float, float] | None:
        known = self.rates.get(solver)
        if not known:
            return None
        same_d = [r for r in known if r[0] == prob.d]
        d, rate, overhead = (same_d or known)[-1]
        if not same_d and prob.d > d:  # work per pair grows with d (a guess; the worker timeout backs it up)
            rate *= (prob.d / max(d, 1)) ** 0.5
        return rate, min(r[2] for r in known)

    def estimate(self, solver: str, prob: Problem, iters: int, repeats: int) -> float | None:
        r = self._rate(solver, prob)
        if r is None:
            return None
        rate, overhead = r
        return overhead + rate * prob.pairs * iters * repeats

    def needs_probe(self, solver: str, prob: Problem) -> bool:
        budgeted = self.cfg.budget is not None or self.solver_budget(solver) is not None
        return budgeted and self._rate(solver, prob) is None

    def probe(self, solver: str, prob: Problem) -> str | None:
        """Run a small version of the problem to learn the solver's rate; returns an error or None."""
        small = Problem(min(prob.n, PROBE_N), min(prob.m, PROBE_N), prob.d, prob.dtype, prob.eps, prob.seed)
        rem = self.remaining()
        res, wall = run_worker(
            solver, small, 2, 1, record=False, timeout=rem if rem and rem > 0 else None, in_process=self.cfg.in_process
        )
        if res.get("status") != "ok":
            return res.get("error", "probe failed")
        self.learn(solver, small, res, wall)
        return None

    def plan(self, solver: str, prob: Problem, iters: int, repeats: int) -> tuple[int, int, str]:
        """(iters, repeats, skip reason or '')."""
        sb = self.solver_budget(solver)
        if sb is not None:
            est = self.estimate(solver, prob, iters, repeats)
            if est is not None and est > sb and repeats > 1:
                repeats = 1
                est = self.estimate(solver, prob, iters, repeats)
            known = self._rate(solver, prob)  # not None: est is not None
            if est is not None and est > sb and known is not None:
                rate, overhead = known
                # Never below 1 iteration x 1 run: the per-solver budget trims, the total budget skips.
                iters = max(1, min(iters, int((sb - overhead) / (rate * prob.pairs))))
        rem = self.remaining()
        if rem is not None:
            est = self.estimate(solver, prob, iters, repeats)
            if est is not None and est > rem:
                return iters, repeats, f"estimated {est:.0f} s > remaining budget {max(rem, 0):.0f} s"
            if rem <= 0:
                return iters, repeats, "budget exhausted"
        return iters, repeats, ""


def _progress(total: int):
    try:
        from tqdm import tqdm

        return tqdm(total=total, file=sys.stderr, unit="run", dynamic_ncols=True)
    except ImportError:
        return None


def _run_one(cfg: Config, planner: Planner, s: str, prob: Problem, row: Row, iters: int) -> bool:
    """One solver on one problem: skipped where memory or the time budget rule it out, else timed in a
    worker; fills ``row`` (status, times, value, ...).  True when it ran and succeeded."""
    runner = get_runner(s)
    mem = mem_available_bytes()
    if runner.bytes_per_pair and mem is not None and runner.bytes_per_pair * prob.pairs > 0.8 * mem:
        row.status, row.reason = (
            "skipped",
            (
                f"needs ~{runner.bytes_per_pair * prob.pairs / 2**30:.1f} GiB "
                f"(dense n x m arrays), {mem / 2**30:.1f} GiB available"
            ),
        )
        return False
    if planner.needs_probe(s, prob):
        err = planner.probe(s, prob)
        if err:
            row.status, row.reason = "error", f"probe failed: {err}"
            return False
    k, r, skip = planner.plan(s, prob, iters, cfg.repeats)
    if skip:
        row.status, row.reason = "skipped", skip
        return False
    notes = []
    if iters < cfg.iters:
        notes.append(f"iterations capped at flashot's {iters}")
    if k < iters or r < cfg.repeats:
        notes.append(f"reduced from {iters}x{cfg.repeats} to fit the time budget")
    row.reduced = "; ".join(notes)
    limits_t = [t for t in (cfg.timeout, planner.remaining()) if t is not None]
    sb = planner.solver_budget(s)
    if sb is not None:  # estimates can be off: stop a worker well past its budget
        limits_t.append(2 * sb + 60)
    timeout = max(1.0, min(limits_t)) if limits_t else None
    res, wall = run_worker(s, prob, k, r, record=row.is_ref, timeout=timeout, in_process=cfg.in_process)
    row.wall_s = wall
    row.iters, row.repeats = k, r
    if res.get("rss_peak_kib") is not None:
        row.rss_peak_mib = res["rss_peak_kib"] / 1024
    if res.get("status") != "ok":
        row.status, row.reason = "error", res.get("error", "unknown error")
        return False
    planner.learn(s, prob, res, wall)
    row.times = res["times"]
    row.version = res.get("version", row.version)
    row.engine = res.get("engine")
    row.value = res["value"]
    row.trajectory = res.get("trajectory")
    row.cpu_s = res.get("cpu_s")
    row.rss_before_mib = res["rss_before_kib"] / 1024 if res.get("rss_before_kib") else None
    return True


def run_bench(
    cfg: Config,
    *,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    rates: dict | None = None,
) -> BenchResult:
    """Every active solver on every problem of ``cfg`` (flashot's first engine first: the reference whose
    iteration count caps the others'), within the time budget."""
    t_start = time.perf_counter()
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    solvers = [f"flashot:{e}" for e in cfg.engines] + list(cfg.peers)
    missing = {s: why for s in solvers if (why := get_runner(s).missing())}
    active = [s for s in solvers if s not in missing]
    limits: dict[str, Limits] = {}
    if cfg.measure_limits:
        from .limits import measure

        for dt in cfg.dtypes:
            limits[dt] = measure(dt)
    problems = [Problem(n, n, d, dt, cfg.eps, cfg.seed) for dt in cfg.dtypes for d in cfg.dims for n in cfg.sizes]
    planner = Planner(cfg, t_start, rates)
    rows: list[Row] = []
    total = len(problems) * len(active)
    bar = _progress(total) if progress else None
    done = 0
    for prob in problems:
        cell: list[Row] = []
        ref_iters = None  # iterations of the reference (first flashot) run, when it ran
        for s in active:
            done += 1
            if bar is not None:
                bar.set_description(f"{s} n={prob.n} d={prob.d}")
            elif progress:
                log(f"[{done}/{total}] {s} on {prob.label()}")
            row = Row(prob, s, version=get_runner(s).version())
            cell.append(row)
            row.is_ref = s == active[0] and s.startswith("flashot:")
            iters = cfg.iters if row.is_ref or ref_iters is None else min(cfg.iters, ref_iters)
            if _run_one(cfg, planner, s, prob, row, iters) and row.is_ref:
                ref_iters = row.iters
            _tick(bar)
        _finish_cell(cell, limits.get(prob.dtype))
        rows.extend(cell)
        if bar is None and progress:
            for row in cell:
                log(f"    {row.solver}: {_short(row)}")
    if bar is not None:
        bar.close()
    return BenchResult(cfg, rows, missing, limits, time.perf_counter() - t_start)


def _tick(bar: Any) -> None:
    if bar is not None:
        bar.update(1)


def _short(row: Row) -> str:
    if row.status != "ok":
        return f"{row.status}: {row.reason}"
    return f"{row.s_per_iter:.4g} s/iter ({row.iters} iters x {row.repeats} runs)"


def _finish_cell(cell: list[Row], lim: Limits | None) -> None:
    """Ratios, agreement and hardware fraction against the cell's first flashot row."""
    ref = next((r for r in cell if r.is_ref), None)
    ref_spi = ref.s_per_iter if ref is not None and ref.status == "ok" else None
    for row in cell:
        spi = row.s_per_iter  # None unless the row is ok and timed
        if row.status != "ok" or spi is None:
            continue
        p = row.problem
        if lim is not None:
            row.hw_fraction = lim.per_iter(p.n, p.m, p.d) / spi
        if ref is None or ref_spi is None:
            continue
        row.ratio = spi / ref_spi
        traj = ref.trajectory or []
        if row.value is None:
            continue
        if 1 <= row.iters <= len(traj):
            v_ref = traj[row.iters - 1]
            row.rel_diff = abs(row.value - v_ref) / max(abs(v_ref), 1e-300)
        elif math.isfinite(row.value) and row.iters == ref.iters and ref.value is not None:
            row.rel_diff = abs(row.value - ref.value) / max(abs(ref.value), 1e-300)
