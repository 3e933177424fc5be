"""The ``cpu`` engine on each instruction-set path it ships, against plain blocked PyTorch.

For each ``-march`` (``FLASHOT_CPU_MARCH``: ``native``, ``x86-64-v3`` = AVX2 + FMA,
``x86-64-v2`` = SSE4.2) a fresh process builds the kernels (cached after the first time)
and times, in float32 with eps = 0.1 and n = m:

* one streamed softmin (``CpuEngine(mode="stream").softmin``), in G pairs / s;
* K alternating Sinkhorn iterations of ``solve_sample(backend="cpu", tol=None)`` (streaming
  mode), in s / iteration,

and plain blocked PyTorch (``addmm`` + ``logsumexp``) on the same problem in the same
process, so each row's ratio is a same-run ratio.  Also prints a denormal check: the same
alternating solve with ``torch.set_flush_denormal(True)`` on the calling thread; a ratio far
from 1 would mean denormal results reach the slow path (the 6-20x of Intel cores before the
kernels set FTZ/DAZ themselves).

    python benchmarks/isa_bench.py --n 10000 --dims 3,16,64 --threads 1 --out table.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

WORKER = r"""
import json, statistics, sys, time, torch
import flashot
from flashot.bench.peers import TorchBlocked
from flashot.costs import get_cost
from flashot.ops.cpu import build
from flashot.ops.cpu.engine import CpuEngine
a = json.loads(sys.argv[1])
torch.set_num_threads(a["threads"])
lib = build.load(quiet=True)
eng = CpuEngine(lib, mode="stream")
c = get_cost("sqeuclidean")
n, K, reps = a["n"], a["iters"], a["repeats"]
def med(fn):
    fn(); ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts)
out = {"isa": build.BUILD_INFO["isa"], "vbits": lib.flashot_vector_bytes() * 8, "rows": {}}
for d in a["dims"]:
    g = torch.Generator().manual_seed(d)
    x = torch.randn(1, n, d, generator=g) / d ** 0.5
    y = torch.randn(1, n, d, generator=g) / d ** 0.5 + 0.1
    h = torch.randn(1, n, generator=g)
    la = torch.full((n,), -float(torch.log(torch.tensor(float(n)))))
    sm = med(lambda: eng.softmin(x, y, h, 0.1, c))
    solve = lambda: flashot.solve_sample(x[0], y[0], reg=0.1, backend="cpu", tol=None, max_iter=K)
    it = med(solve) / K
    torch.set_flush_denormal(True)
    it_ftz = med(solve) / K
    torch.set_flush_denormal(False)
    def blocked():
        f, gg = torch.zeros(n), torch.zeros(n)
        for _ in range(K):
            f = TorchBlocked.softmin(x[0], y[0], la + gg / 0.1, 0.1)
            gg = TorchBlocked.softmin(y[0], x[0], la + f / 0.1, 0.1)
    bl = med(blocked) / K if a["blocked"] else float("nan")
    out["rows"][d] = {"gpairs": n * n / sm / 1e9, "iter": it, "iter_ftz": it_ftz, "blocked": bl}
print("RESULT " + json.dumps(out))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=10000)
    ap.add_argument("--dims", type=lambda s: [int(v) for v in s.split(",")], default=[3, 16, 64])
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--marches", default="native,x86-64-v3,x86-64-v2")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if min(args.n, args.iters, args.repeats, args.threads, *args.dims) < 1:
        ap.error("--n, --iters, --repeats, --threads and --dims must be >= 1")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    from flashot.cli import cpu_model

    lines = [
        f"CPU: {cpu_model()}; {args.threads} thread(s); float32, eps = 0.1, n = m = {args.n}; softmin: one "
        f"streamed call (G pairs/s); solve: {args.iters} alternating iterations of solve_sample(backend='cpu', "
        f"streaming), s/iter, median of {args.repeats}; blocked = plain blocked PyTorch in the same process; "
        f"FTZ = the same solve with torch.set_flush_denormal(True).",
        "",
        "| -march | vectors | d | softmin G pairs/s | solve s/iter | blocked s/iter | blocked / cpu | "
        "as shipped / with FTZ |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for march in args.marches.split(","):
        env = {**os.environ, "FLASHOT_CPU_MARCH": march, "FLASHOT_CPU_MODE": "stream"}
        payload = json.dumps(
            {
                "n": args.n,
                "dims": args.dims,
                "iters": args.iters,
                "repeats": args.repeats,
                "threads": args.threads,
                "blocked": True,
            }
        )
        r = subprocess.run([sys.executable, "-c", WORKER, payload], capture_output=True, text=True, env=env)
        if r.returncode != 0:
            lines.append(f"| {march} | build or run failed: {r.stderr.strip().splitlines()[-1][:200]} |")
            print(lines[-1], flush=True)
            continue
        res = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
        for d, row in res["rows"].items():
            lines.append(
                f"| {march} | {res['vbits']}-bit | {d} | {row['gpairs']:.2f} | {row['iter']:.4f} | "
                f"{row['blocked']:.3f} | {row['blocked'] / row['iter']:.1f}x | "
                f"{row['iter'] / row['iter_ftz']:.2f} |"
            )
            print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
