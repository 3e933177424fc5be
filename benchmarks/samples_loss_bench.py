"""The user-facing call: a debiased Sinkhorn divergence and its gradient, flashot vs GeomLoss.

    python benchmarks/samples_loss_bench.py                      # n = m = 20,000, d = 3, blur 0.05
    python benchmarks/samples_loss_bench.py --n 5000 --dims 3,64 --runs 3

Times ``SamplesLoss("sinkhorn", p=2, blur, scaling=0.5, debias=True)(x, y)`` forward +
``backward`` (gradient in x), float32, x uniform in the unit cube and y a Gaussian blob, for:

* ``flashot:cpu``: the compiled engine with the fused symmetric steps (one exponential per
  pair for f and g, the upper triangle only for the debiasing terms);
* ``flashot:cpu-unfused``: the same engine called through plain softmins (what the solver did
  before the fused steps: 4 softmins per iteration);
* ``flashot:tiled``: blocked PyTorch;
* ``geomloss:online`` (KeOps) and ``geomloss:tensorized`` when installed.

Both libraries use the same eps schedule (GeomLoss' ``epsilon_schedule`` with the same
diameter rule), so they run the same number of iterations.  Prints a Markdown table of the
median time over ``--runs`` (after one untimed warm-up call on the full problem), the ratio to
``flashot:cpu``, and each loss value's relative difference from ``flashot:cpu``'s.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time

import torch

import flashot
from flashot.measures import Measures
from flashot.ops import autograd


def clouds(n: int, d: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, d, generator=g)
    y = 0.5 + 0.15 * torch.randn(n, d, generator=g)
    return x, y


class _Unfused:
    """Context manager: plain softmins everywhere (no softmin_pair / softmin_sym): in the solver
    (``Measures``) and in the differentiable final step (``ops.autograd``)."""

    def __enter__(self):
        self.saved = Measures.softmin_pair, Measures._self_softmin, autograd.self_softmin
        Measures.softmin_pair = lambda m, hx, hy, eps: (m.softmin_x(hy, eps), m.softmin_y(hx, eps))
        Measures._self_softmin = lambda m, p, h, eps: m.engine.softmin(p, p, h, eps, m.cost)
        autograd.self_softmin = lambda engine, x, h, eps, cost: engine.softmin(x, x, h, eps, cost)

    def __exit__(self, *exc):
        Measures.softmin_pair, Measures._self_softmin, autograd.self_softmin = self.saved


def make(solver: str, blur: float):
    if solver.startswith("flashot"):
        backend = {"flashot:cpu": "cpu", "flashot:cpu-unfused": "cpu", "flashot:tiled": "tiled"}[solver]
        loss = flashot.SamplesLoss("sinkhorn", p=2, blur=blur, scaling=0.5, backend=backend)
        if solver.endswith("unfused"):

            def run(x, y):
                with _Unfused():
                    return loss(x, y)

            return run
        return loss
    import geomloss

    return geomloss.SamplesLoss("sinkhorn", p=2, blur=blur, scaling=0.5, backend=solver.split(":")[1])


def time_call(fn, x, y, runs: int):
    def once():
        xx = x.clone().requires_grad_(True)
        L = fn(xx, y)
        L.backward()
        return float(L.detach())

    val = once()  # warm-up (compiles, caches)
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        once()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), val


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--dims", default="3")
    ap.add_argument("--blur", type=float, default=0.05)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument(
        "--solvers", default="flashot:cpu,flashot:cpu-unfused,flashot:tiled,geomloss:online,geomloss:tensorized"
    )
    args = ap.parse_args(argv)
    solvers = args.solvers.split(",")
    known = {"flashot:cpu", "flashot:cpu-unfused", "flashot:tiled", "geomloss:online", "geomloss:tensorized"}
    if args.n < 2 or args.runs < 1 or not args.blur > 0:
        ap.error(f"expected --n >= 2, --runs >= 1, --blur > 0; got {args.n}, {args.runs}, {args.blur}")
    if not set(solvers) <= known:
        ap.error(f"--solvers: unknown {sorted(set(solvers) - known)}; known: {sorted(known)}")
    try:
        dims = [int(v) for v in args.dims.split(",")]
    except ValueError:
        ap.error(f"--dims: expected comma-separated integers, got {args.dims!r}")
    if any(d < 1 for d in dims):
        ap.error(f"--dims: expected positive integers, got {args.dims!r}")
    have_geomloss = importlib.util.find_spec("geomloss") is not None
    have_keops = importlib.util.find_spec("pykeops") is not None
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average "
        f"{os.getloadavg()[0]:.2f} at start; n = m = {args.n}, blur {args.blur}, p = 2, scaling 0.5, "
        f"debias, float32, median of {args.runs} runs of forward + backward\n"
    )
    print("| d | solver | s (fwd + bwd) | vs flashot:cpu | loss | rel. diff |")
    print("|---|---|---|---|---|---|")
    for d in dims:
        x, y = clouds(args.n, d)
        ref_t = ref_v = None
        for s in solvers:
            if s.startswith("geomloss") and (not have_geomloss or (s.endswith("online") and not have_keops)):
                print(f"| {d} | {s} | not installed | | | |")
                continue
            if s == "geomloss:tensorized" and args.n * args.n * 4 * 6 > 0.6 * _mem():
                print(f"| {d} | {s} | skipped (needs ~{args.n * args.n * 24 / 2**30:.1f} GiB) | | | |")
                continue
            t, v = time_call(make(s, args.blur), x, y, args.runs)
            if ref_t is None:
                ref_t, ref_v = t, v
            print(
                f"| {d} | {s} | {t:.3f} | {t / ref_t:.2f} | {v:.6g} | {abs(v - ref_v) / abs(ref_v):.1e} |", flush=True
            )
    print(f"\nload average {os.getloadavg()[0]:.2f} at end")
    return 0


def _mem() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


if __name__ == "__main__":
    raise SystemExit(main())
