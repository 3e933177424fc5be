"""The ``cpu`` engine under load: alone, then beside 1 and 2 busy competing processes.

Users run flashot beside DataLoader workers and other jobs.  For each OpenMP wait policy
(libgomp's default, ``OMP_WAIT_POLICY=PASSIVE``, ``ACTIVE``) and each load (0, 1, 2
single-threaded busy-spin processes, like DataLoader workers decoding data), a fresh
process times K alternating Sinkhorn iterations (float32, eps = 0.1, n = m) with

* ``flashot cpu``: ``flashot.solve_sample(..., backend="cpu", tol=None, max_iter=K)``
  (streaming mode, so every run does the same work), and
* ``torch-blocked``: plain blocked PyTorch (``addmm`` + ``logsumexp``, the peer of
  ``flashot bench``),

both on ``torch.get_num_threads()`` threads (the machine's cores).  Reported: medians of
``--repeats`` runs and the slowdown factor against the same config's unloaded median.
Also measured: ``torch.set_num_threads(1)`` (what DataLoader workers set), and several Python
threads solving at once.

    python benchmarks/load_bench.py --n 8000 --dims 3,64 --iters 4 --repeats 5 --out table.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

POLICIES = {"default": {}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"}, "active": {"OMP_WAIT_POLICY": "ACTIVE"}}

WORKER = r"""
import json, statistics, sys, threading, time, torch
import flashot
from flashot.bench.peers import TorchBlocked
args = json.loads(sys.argv[1])
n, K, reps = args["n"], args["iters"], args["repeats"]
if args.get("threads"):
    torch.set_num_threads(args["threads"])
out = {}
for d in args["dims"]:
    g = torch.Generator().manual_seed(d)
    x = torch.randn(n, d, generator=g) / d ** 0.5
    y = torch.randn(n, d, generator=g) / d ** 0.5 + 0.1
    la = torch.full((n,), -float(torch.log(torch.tensor(float(n)))))
    def run_cpu():
        flashot.solve_sample(x, y, reg=0.1, backend="cpu", tol=None, max_iter=K)
    def run_blocked():
        f, gg = torch.zeros(n), torch.zeros(n)
        for _ in range(K):
            f = TorchBlocked.softmin(x, y, la + gg / 0.1, 0.1)
            gg = TorchBlocked.softmin(y, x, la + f / 0.1, 0.1)
    def run_threads():  # several Python threads solving at once (each opens its own team)
        ts = [threading.Thread(target=run_cpu) for _ in range(args.get("py_threads", 2))]
        [t.start() for t in ts]; [t.join() for t in ts]
    fns = {"cpu": run_cpu, "blocked": run_blocked}
    if args.get("py_threads"):
        fns = {"cpu": run_cpu, "cpu_threads": run_threads}
    for name, fn in fns.items():
        fn()  # warm-up (and first-use compile)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
        out[f"{name}_d{d}"] = statistics.median(ts) / K
print("RESULT " + json.dumps(out))
"""


def _spinners(k: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(k)]


def _measure(env_extra: dict, load: int, args, **kw) -> dict:
    env = {**os.environ, "FLASHOT_CPU_MODE": "stream", **env_extra}
    spin = _spinners(load)
    try:
        time.sleep(0.5)
        payload = json.dumps({"n": args.n, "dims": args.dims, "iters": args.iters, "repeats": args.repeats, **kw})
        r = subprocess.run(
            [sys.executable, "-c", WORKER, payload], capture_output=True, text=True, env=env, timeout=3600
        )
    finally:
        for p in spin:
            p.kill()
            p.wait()
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-2000:])
    return json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=8000)
    ap.add_argument("--dims", type=lambda s: [int(v) for v in s.split(",")], default=[3, 64])
    ap.add_argument("--iters", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--loads", type=lambda s: [int(v) for v in s.split(",")], default=[0, 1, 2])
    ap.add_argument("--policies", default="default,passive,active")
    ap.add_argument(
        "--cycles",
        type=int,
        default=1,
        help="run the loads in turn this many times and report medians per load (evens out a noisy machine)",
    )
    ap.add_argument("--out", default=None, help="write the markdown table here too")
    args = ap.parse_args(argv)
    if args.n < 1 or args.iters < 1 or args.repeats < 1 or any(d < 1 for d in args.dims):
        ap.error("--n, --iters, --repeats and --dims must be >= 1")
    pols = args.policies.split(",")
    bad = [p for p in pols if p not in POLICIES]
    if bad:
        ap.error(f"--policies: unknown {bad}; choose from {list(POLICIES)}")
    import torch

    from flashot.cli import cpu_model

    lines = [
        f"CPU: {cpu_model()}, {os.cpu_count()} logical CPUs, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; n = m = {args.n}, float32, eps = 0.1, {args.iters} alternating "
        f"iterations per run, median of {args.repeats} runs (and of {args.cycles} cycles over the loads); s/iter "
        f"(slowdown vs unloaded, same policy).",
        "",
        "| policy | load | " + " | ".join(f"cpu d={d} | blocked d={d}" for d in args.dims) + " |",
        "|---|---|" + "---|---|" * len(args.dims),
    ]
    for pol in pols:
        runs: dict[int, list[dict]] = {ld: [] for ld in args.loads}
        for _ in range(max(1, args.cycles)):
            for load in args.loads:
                runs[load].append(_measure(POLICIES[pol], load, args))
        med = {ld: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for ld, rs in runs.items()}
        base = None
        for load in args.loads:
            res = med[load]
            base = base or res
            cells = []
            for d in args.dims:
                for k in ("cpu", "blocked"):
                    v = res[f"{k}_d{d}"]
                    cells.append(f"{v:.3f} ({v / base[f'{k}_d{d}']:.2f}x)")
            lines.append(f"| {pol} | {load} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    lines += ["", "| case | " + " | ".join(f"cpu d={d}" for d in args.dims) + " |", "|---|" + "---|" * len(args.dims)]
    one = _measure({}, 0, args, threads=1)
    lines.append("| torch.set_num_threads(1) | " + " | ".join(f"{one[f'cpu_d{d}']:.3f}" for d in args.dims) + " |")
    thr = _measure({}, 0, args, py_threads=2)
    lines.append(
        "| 2 Python threads at once (per solve) | "
        + " | ".join(f"{thr[f'cpu_threads_d{d}'] / 2:.3f}" for d in args.dims)
        + " |"
    )
    lines.append("| one solve alone (same run) | " + " | ".join(f"{thr[f'cpu_d{d}']:.3f}" for d in args.dims) + " |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
