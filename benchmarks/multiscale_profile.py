"""Where a multiscale ``SamplesLoss`` spends its work: pairs evaluated and CPU time of the pruning.

Same data as ``multiscale_bench.py`` (two generated tori, blur = 0.01 x the diameter, debiased value
plus its gradient in x).  Counts the pairs the block-sparse engine evaluates (softmins: the kept pairs
of each call's pattern; plan products: once, their one pass, not counting rows that fall back to two
passes), divided by ``n^2``, and the process CPU time (all threads) of the block bounds, the forward
and the backward.  A fused step counts its exponentials: ``softmin_pair`` the kept pairs once (for both
potentials), ``softmin_sym`` half of them; their barycentre variants (the final step, which then needs no
plan product for the gradient) the same.  ``--unfused`` runs without the fused steps (two softmins per
symmetric step, a full one per debiasing step, plan products for the gradient), ``--no-bary`` without the
barycentres only (plan products for the gradient), ``--no-tiles`` without the sub-tile pruning inside the kept
blocks, for comparison.  With it, ``tiles`` is the fraction of the fused steps' pairs (padded columns
included, per n^2 as above) that its bounds let through.

    python benchmarks/multiscale_profile.py --n 1000000
    python benchmarks/multiscale_profile.py --n 300000 --cluster-scale 0.02
    python benchmarks/multiscale_profile.py --n 300000 --unfused
    python benchmarks/multiscale_profile.py --n 300000 --no-bary
    python benchmarks/multiscale_profile.py --n 1000000 --no-tiles
    python -m cProfile -s tottime benchmarks/multiscale_profile.py --n 1000000   # by function
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from multiscale_bench import surfaces

import flashot
import flashot.multiscale as MS
from flashot.ops import blocksparse as BS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=100000)
    ap.add_argument("--cluster-scale", type=float, default=None, help="fraction of the diameter (default: GeomLoss')")
    ap.add_argument("--unfused", action="store_true", help="without softmin_pair / softmin_sym and their barycentres")
    ap.add_argument("--no-bary", action="store_true", help="without the barycentre variants (plan products)")
    ap.add_argument("--no-tiles", action="store_true", help="without the sub-tile pruning inside kept blocks")
    a = ap.parse_args()
    MS.fine.TILE_PRUNING = not a.no_tiles
    engines = []
    init = BS.BlockSparseEngine.__init__

    def recorded_init(self, *args, **kw):
        init(self, *args, **kw)
        engines.append(self)

    BS.BlockSparseEngine.__init__ = recorded_init
    if a.unfused or a.no_bary:
        del BS.BlockSparseEngine.softmin_pair_bary, BS.BlockSparseEngine.softmin_sym_bary
    if a.unfused:
        del BS.BlockSparseEngine.softmin_pair, BS.BlockSparseEngine.softmin_sym
    x, y = surfaces(a.n)
    pts = torch.cat([x, y])
    diam = float((pts.amax(0) - pts.amin(0)).norm())
    pairs = {"softmin": 0, "plan": 0}
    prune = [0.0]
    softmin, plan, compute = BS.BlockSparseEngine.softmin, BS.BlockSparseEngine.plan_product, MS.BlockBounds.compute

    def counted_softmin(self, u, v, *args, **kw):
        pairs["softmin"] += self.pattern(u, v).pairs
        return softmin(self, u, v, *args, **kw)

    def counted_plan(self, u, v, *args, **kw):
        pairs["plan"] += self.pattern(u, v).pairs
        return plan(self, u, v, *args, **kw)

    def timed_compute(cls, *args, **kw):
        t0 = time.process_time()
        out = compute.__func__(cls, *args, **kw)
        prune[0] += time.process_time() - t0
        return out

    def counted(name, share):
        fn = getattr(BS.BlockSparseEngine, name)

        def wrapped(self, u, *args, **kw):
            v = args[0] if name.startswith("softmin_pair") else u
            pairs["softmin"] += self.pattern(u, v).pairs * share
            return fn(self, u, *args, **kw)

        return wrapped

    BS.BlockSparseEngine.softmin, BS.BlockSparseEngine.plan_product = counted_softmin, counted_plan
    if not a.unfused:
        BS.BlockSparseEngine.softmin_pair = counted("softmin_pair", 1.0)
        BS.BlockSparseEngine.softmin_sym = counted("softmin_sym", 0.5)
    if not (a.unfused or a.no_bary):
        BS.BlockSparseEngine.softmin_pair_bary = counted("softmin_pair_bary", 1.0)
        BS.BlockSparseEngine.softmin_sym_bary = counted("softmin_sym_bary", 0.5)
    MS.BlockBounds.compute = classmethod(timed_compute)
    kw = {} if a.cluster_scale is None else {"cluster_scale": a.cluster_scale * diam}
    L = flashot.SamplesLoss(blur=0.01 * diam, backend="multiscale", **kw)
    xg = x.clone().requires_grad_()
    w0, t0 = time.perf_counter(), time.process_time()
    v = L(xg, y)
    t1 = time.process_time()
    torch.autograd.grad(v, xg)
    t2 = time.process_time()
    wall = time.perf_counter() - w0
    run = L.last_multiscale
    n2 = float(a.n) ** 2
    tiles = sum(e.tile_pairs[0] for e in engines) / n2
    print(
        f"n = {a.n:,}: {run.cx.n_clusters:,} clusters, kept {[round(k, 4) for k in run.kept]}; pairs per n^2: "
        f"softmins {pairs['softmin'] / n2:.3f}, plan products {pairs['plan'] / n2:.3f}"
        f"{'' if a.no_tiles else f', fused steps after tiles {tiles:.3f}'}; CPU seconds: block "
        f"bounds {prune[0]:.2f}, forward {t1 - t0:.2f}, backward {t2 - t1:.2f}; wall {wall:.1f} s; peak RSS "
        f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB"
    )


if __name__ == "__main__":
    main()
