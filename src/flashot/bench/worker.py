"""Worker process: runs ONE solver on ONE problem and writes a JSON result.

``python -m flashot.bench.worker SPEC.json RESULT.json``.  Running every solver
in its own process isolates imports, caches and allocator state, and lets us
read that solver's own peak resident memory (``VmHWM``).
"""

from __future__ import annotations

import json
import sys
import time
import traceback

WARMUP_N = 2048


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _peak_kib() -> int:
    hwm = _status_kib("VmHWM")
    if hwm is not None:
        return hwm
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def run(spec: dict) -> dict:
    from .peers import get_runner
    from .problems import Problem, ot_value

    prob = Problem(**spec["problem"])
    iters, repeats, record = int(spec["iters"]), int(spec["repeats"]), bool(spec.get("record", False))
    runner = get_runner(spec["solver"])
    out: dict = {"solver": spec["solver"], "version": runner.version()}
    t_start = time.perf_counter()
    x, y = prob.points()
    a, b = prob.weights()
    st = runner.setup(prob, x, y)
    out["rss_before_kib"] = _status_kib("VmRSS")
    t0 = time.perf_counter()
    if spec.get("warmup", True):
        # One iteration on the first WARMUP_N points of each cloud: same code path (first-call costs,
        # thread pools, KeOps / C++ compilation), without paying a full iteration of a big problem.
        k = min(prob.n, prob.m, WARMUP_N)
        small = Problem(k, k, prob.d, prob.dtype, prob.eps, prob.seed)
        runner.warmup(runner.setup(small, x[:k], y[:k]))
    runner.prepare(st, iters)  # e.g. JAX: ahead-of-time compile for the full shape and K (not timed)
    out["warmup_s"] = time.perf_counter() - t0
    times = []
    res = None
    cpu0 = time.process_time()  # all threads of this process
    for r in range(repeats):
        t0 = time.perf_counter()
        res = runner.solve(st, iters, record=record and r == repeats - 1)
        times.append(time.perf_counter() - t0)
    out["cpu_s"] = time.process_time() - cpu0
    assert res is not None, "repeats >= 1"
    out["times"] = times
    out["iters"] = iters
    out["value"] = ot_value(a, b, res.f, res.g)
    if res.trajectory is not None:
        out["trajectory"] = [ot_value(a, b, f, g) for f, g in res.trajectory]
    out["engine"] = res.engine
    out["rss_peak_kib"] = _peak_kib()
    out["total_s"] = time.perf_counter() - t_start
    out["status"] = "ok"
    return out


def main(argv: list[str]) -> int:
    spec_path, result_path = argv
    with open(spec_path) as fh:
        spec = json.load(fh)
    try:
        out = run(spec)
    except Exception as e:  # reported to the parent, which prints it in the table
        out = {
            "status": "error",
            "error": f"{type(e).__name__}: {e}",
            "traceback": traceback.format_exc(),
            "rss_peak_kib": _peak_kib(),
        }
    with open(result_path, "w") as fh:
        json.dump(out, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
