"""``flashot.otdd``'s label-cost stage as one ragged batch vs a Python loop over the class pairs (issue 38).

Default case: 10 classes x 10 classes, 100 to 300 points per class (uniform sizes), D = 5, float32, each class
a unit Gaussian around its own mean (means of scale 2), ``reg`` = 0.5, ``tol`` = 1e-6, ``backend="cpu"``.  Times
the whole :func:`flashot.otdd` (both stages) with the class pairs run as one batch (the default) and as one
``solve_sample`` per pair (the loop ``backend="dense"`` keeps, here on the same engine), interleaved over
``--repeats`` runs; reports the medians of wall and CPU (user + sys) time, their ratios, the batch's and the
loop's largest iteration counts and the largest relative difference of ``W``.

    PYTHONPATH=src python benchmarks/otdd_batch.py [--classes 10] [--min 100] [--max 300] [--reg 0.5] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from unittest import mock

import torch

import flashot
import flashot.dataset_distance as dd


def _data(args, gen, n_total_cls):
    pts, labels = [], []
    means = 2.0 * torch.randn(n_total_cls, args.dim, generator=gen)
    for c in range(n_total_cls):
        k = int(torch.randint(args.min, args.max + 1, (1,), generator=gen))
        pts.append(torch.randn(k, args.dim, generator=gen) + means[c])
        labels.append(torch.full((k,), c))
    return torch.cat(pts), torch.cat(labels)


def _loop(clouds_a, clouds_b, **kw):
    """One solve per class pair (what ``backend="dense"`` runs), recording the largest iteration count."""
    values, ok, its = [], True, []
    for a in clouds_a:
        for b in clouds_b:
            r = flashot.solve_sample(a, b, **kw)
            values.append(r.value)
            ok, its = ok and bool(r.converged), its + [r.n_iter]
    _loop.n_iter = max(its)
    return torch.stack(values).reshape(len(clouds_a), len(clouds_b)), ok


def _timed(fn):
    t, c = time.perf_counter(), os.times()
    out = fn()
    c2 = os.times()
    return time.perf_counter() - t, (c2.user - c.user) + (c2.system - c.system), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--min", type=int, default=100)
    ap.add_argument("--max", type=int, default=300)
    ap.add_argument("--dim", type=int, default=5)
    ap.add_argument("--reg", type=float, default=0.5)
    ap.add_argument("--tol", type=float, default=1e-6)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch (and C++ kernel) threads; default torch's")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    Xa, la = _data(args, gen, args.classes)
    Xb, lb = _data(args, gen, args.classes)
    Xb = Xb + 0.3
    kw = dict(reg=args.reg, tol=args.tol, backend=args.backend)

    def batch():
        return flashot.otdd(Xa, la, Xb, lb, **kw)

    def loop():
        with mock.patch.object(dd, "_class_costs", _loop):
            return flashot.otdd(Xa, la, Xb, lb, **kw)

    rows = {"batch": [], "loop": []}
    for _ in range(args.repeats):
        for name, fn in (("batch", batch), ("loop", loop)):
            wall, cpu, res = _timed(fn)
            rows[name].append((wall, cpu, res))
    med = {k: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v)) for k, v in rows.items()}
    Wb, Wl = rows["batch"][-1][2].label_cost, rows["loop"][-1][2].label_cost
    diff = float(((Wb - Wl).abs() / Wl.abs()).max())
    with torch.no_grad():
        clouds_a = [Xa[la == c] for c in range(args.classes)]
        clouds_b = [Xb[lb == c] for c in range(args.classes)]
        pairs = [(a, b) for a in clouds_a for b in clouds_b]
        nb = flashot.solve_sample([p[0] for p in pairs], [p[1] for p in pairs], **kw).n_iter
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{args.classes} x {args.classes} classes, {args.min}-{args.max} points per class, D={args.dim}, float32")
    for k, (w, c) in med.items():
        print(f"{k:6s} wall {w:.3f} s  cpu {c:.3f} s  converged {rows[k][-1][2].converged}")
    print(f"loop / batch: wall {med['loop'][0] / med['batch'][0]:.2f}x, cpu {med['loop'][1] / med['batch'][1]:.2f}x")
    print(f"iterations: batch {nb}, loop's largest {_loop.n_iter}; max relative |W_batch - W_loop| {diff:.2e}")


if __name__ == "__main__":
    main()
