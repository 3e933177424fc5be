"""Distributed Sinkhorn (flashot.distributed) on 1 and W gloo processes on one machine, both modes.

    python benchmarks/distributed_bench.py                      # n = m = 20000, d = 3, worlds 1 and 2
    python benchmarks/distributed_bench.py --n 40000 --d 64 --worlds 1 2 --threads 1 --shards points

Each world size runs ``solve_sample(x, y, reg=..., tol=None, group=WORLD)`` twice, with ``--iters``
and ``--iters + --extra`` iterations (``--repeats`` times: medians), and reports per Sinkhorn
iteration (the difference of the two runs divided by ``--extra``: start-up, the final step and the
gradients cancel out):

* seconds per iteration (slowest rank) and the speed-up over world size 1;
* bytes received per iteration per rank (``ShardedEngine.stats``: all-gathers, own slice included;
  ``RingEngine.stats``: ring blocks and call headers) and the number of collectives (replicated) or
  ring passes (points) per iteration.

``--shards replicated points`` (default both): replicated mode (every rank passes all the points) and
points-sharded mode (``shard="points"``: every rank passes n / W points of each cloud; blocks travel
around the ring).

Every process runs ``--threads`` torch / engine threads (default 1), so W processes use W times the
cores of one: the speed-up measures how well one problem splits, not a fixed core budget.  The cpu
engine runs in ``--mode`` (default ``stream``: no cached cost matrix, the regime of large n).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)


def worker(rank: int, world: int, init: str, out: str, a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    from flashot import solve_sample

    g = torch.Generator().manual_seed(0)
    dt = torch.float32 if a.dtype == "float32" else torch.float64
    x = torch.randn(a.n, a.d, generator=g).to(dt)
    y = (torch.randn(a.n, a.d, generator=g) + 0.5).to(dt)
    if a.shard == "points":  # this rank's slices only
        x, y = (t[rank * a.n // world : (rank + 1) * a.n // world].clone() for t in (x, y))
    rep = {}
    kw = {
        "reg": a.reg,
        "tol": None,
        "eps_scaling": False,
        "method": a.method,
        "backend": a.backend,
        "grad": "detach",
        "group": dist.group.WORLD,
        "shard": a.shard,
    }
    solve_sample(x, y, max_iter=1, **kw)  # warm-up: engine load, threads, first-call costs
    for _ in range(a.repeats):
        for k in (a.iters, a.iters + a.extra):
            dist.barrier()
            t0 = time.perf_counter()
            res = solve_sample(x, y, max_iter=k, **kw)
            dt_ = time.perf_counter() - t0
            eng = res.plan._m.engine
            rep.setdefault(
                k,
                {
                    "time": [],
                    "bytes": eng.stats["bytes"],
                    "calls": eng.stats["calls"],
                    "engine": eng.name,
                    "value": float(res.value),
                },
            )["time"].append(dt_)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(rep, fh)
    dist.barrier()  # no rank tears the group down while another still uses it
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo can abort at interpreter exit (pytorch/pytorch#190489): skip the teardown


def run_world(world: int, a: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), FLASHOT_CPU_MODE=a.mode)
        args = [f"--{k}={v}" for k, v in vars(a).items() if k not in ("worlds", "worker", "shards")]
        procs = [
            subprocess.Popen([sys.executable, HERE, "--worker", f"{r},{world},file://{tmp}/rdv,{tmp}", *args], env=env)
            for r in range(world)
        ]
        for p in procs:
            if p.wait() != 0:
                raise SystemExit(f"world {world}: a rank failed (exit {p.returncode})")
        reps = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(world)]
    k1, k2 = str(a.iters), str(a.iters + a.extra)
    # per repeat: the slowest rank's difference of the two runs; the median over the repeats
    per_rep = [max((r[k2]["time"][i] - r[k1]["time"][i]) / a.extra for r in reps) for i in range(a.repeats)]
    per_it = statistics.median(per_rep)
    r0 = reps[0]
    return {
        "world": world,
        "s_per_iter": per_it,
        "engine": r0[k2]["engine"],
        "value": r0[k2]["value"],
        "bytes_per_iter": (r0[k2]["bytes"] - r0[k1]["bytes"]) / a.extra,
        "calls_per_iter": (r0[k2]["calls"] - r0[k1]["calls"]) / a.extra,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=20000, help="points per cloud (n = m)")
    p.add_argument("--d", type=int, default=3)
    p.add_argument("--reg", type=float, default=0.1)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--backend", default="cpu")
    p.add_argument("--method", default="alternating", choices=["alternating", "symmetric"])
    p.add_argument("--mode", default="stream", help="FLASHOT_CPU_MODE of the cpu engine")
    p.add_argument("--threads", type=int, default=1, help="torch / engine threads per process")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--extra", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3, help="timed pairs of runs per world; the median is shown")
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--shards", nargs="+", default=["replicated", "points"], choices=["replicated", "points"])
    p.add_argument("--shard", default="replicated", help=argparse.SUPPRESS)  # the workers' mode
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        r, w, init, out = a.worker.split(",")
        worker(int(r), int(w), init, out, a)
        return
    print(
        f"n = m = {a.n}, d = {a.d}, {a.dtype}, reg = {a.reg}, backend {a.backend} (mode {a.mode}), "
        f"method {a.method}, {a.threads} thread(s) per process; per iteration over {a.extra} iterations"
    )
    print(
        f"{'shard':>10} {'world':>5} {'s/iter':>10} {'speed-up':>9} {'bytes received/iter/rank':>25} "
        f"{'calls/iter':>11}  value"
    )
    base = None  # the first run (world 1 of the first mode): every ratio is against it
    for shard in a.shards:
        a.shard = shard
        for w in a.worlds:
            r = run_world(w, a)
            base = r["s_per_iter"] if base is None else base
            print(
                f"{shard:>10} {w:>5} {r['s_per_iter']:>10.4f} {base / r['s_per_iter']:>8.2f}x "
                f"{r['bytes_per_iter']:>25.0f} {r['calls_per_iter']:>11.1f}  {r['value']:.8g} ({r['engine']})",
                flush=True,
            )


if __name__ == "__main__":
    main()
