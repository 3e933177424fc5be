"""Bitwise A/B of two source trees' CPU kernels: the same calls, their outputs compared bit for bit.

For changes meant to leave every output unchanged (a refactor of the C++ or of its calling convention):
each side runs in its own process with its own package and build cache, e.g. the old tree from git

    git archive main src | tar -x -C /tmp/old
    python benchmarks/bitwise_ab.py /tmp/old/src src --cache /tmp/ab-cache

(each side's libraries are compiled into ``--cache``/a and ``--cache``/b when missing).  The calls: the ``cpu``
engine's streamed softmin (dot and direct costs, d = 1, 2, 3, 7, 40), pair and symmetric steps, alternating
step, plan products (narrow and wide V, the three weights), the cached-matrix softmin (rows and columns),
alternating step and plan product; the block-sparse kernels (softmin, pair step with barycentres and sub-tile
pruning, plan product) on a clustered pattern; and whole multiscale losses (block pruning included); float32 and
float64, two thread counts.  Prints the number of tensors compared and any that differ; exit status 1 if any.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

WORKER = r"""
import math, sys, torch
import flashot
from flashot.costs import get_cost
from flashot.ops.cpu.engine import CpuEngine
from flashot.ops import blocksparse_cpu as BS
from flashot.ops.block_pattern import BlockPattern
from flashot.clusters import cluster

out = {}
def put(key, t):
    if isinstance(t, (tuple, list)):
        for i, u in enumerate(t):
            put(f"{key}.{i}", u)
    elif t is not None:
        out[key] = t.detach().clone()

def dense(dt, nth):
    torch.set_num_threads(nth)
    g = torch.Generator().manual_seed(1)
    for d, (B, N, M) in ((1, (2, 203, 150)), (2, (1, 300, 333)), (3, (2, 257, 190)), (7, (1, 140, 300)),
                         (40, (2, 90, 131))):
        x = torch.randn(B, N, d, generator=g, dtype=dt)
        y = torch.randn(B, M, d, generator=g, dtype=dt) + 0.3
        hx = torch.randn(B, N, generator=g, dtype=dt) * 0.5 - math.log(N)
        hy = torch.randn(B, M, generator=g, dtype=dt) * 0.5 - math.log(M)
        hy[0, 3] = -math.inf
        V = {k: torch.randn(B, M, k, generator=g, dtype=dt) for k in (2, 7)}
        VN = {k: torch.randn(B, N, k, generator=g, dtype=dt) for k in (2, 7)}
        for cname in ("sqeuclidean", "euclidean"):
            c = get_cost(cname)
            for mode in ("stream", "cache"):
                eng = CpuEngine(mode=mode, threads=nth)
                k = f"{dt}.{nth}.{d}.{cname}.{mode}"
                put(k + ".softmin", eng.softmin(x, y, hy, 0.1, c))
                put(k + ".softmin_T", eng.softmin(y, x, hx, 0.1, c))  # cached: the transposed pass
                put(k + ".pair", eng.softmin_pair(x, y, hx, hy, 0.1, c))
                put(k + ".sym", eng.softmin_sym(x, hx, 0.1, c))
                put(k + ".alt", eng.softmin_alt(x, y, hx, hy, 0.1, c, 0.7))
                for w in ("plan", "cost", "dcost"):
                    for kk, VV in V.items():
                        put(f"{k}.plan.{w}.{kk}", eng.plan_product(x, y, hx, hy, 0.1, VV, c, w))
                        put(f"{k}.planT.{w}.{kk}", eng.plan_product(y, x, hy, hx, 0.1, VN[kk], c, w))
                put(k + ".small_eps", eng.softmin(x, y, hy, 1e-4, c))

def blocks(dt, nth):
    torch.set_num_threads(nth)
    g = torch.Generator().manual_seed(2)
    lib = BS.cpu_lib()
    for d in (2, 3, 5):
        x = torch.cat([torch.randn(300, d, generator=g, dtype=torch.float64) * 0.3,
                       torch.randn(200, d, generator=g, dtype=torch.float64) * 0.05 + 3.0])
        y = torch.cat([torch.randn(250, d, generator=g, dtype=torch.float64) * 0.3 + 0.2,
                       torch.randn(150, d, generator=g, dtype=torch.float64) * 0.05 + 3.0])
        cx, cy = cluster(x, torch.ones(500, dtype=torch.float64), 0.25), cluster(y, torch.ones(400, dtype=torch.float64), 0.25)
        keep = torch.rand(cx.n_clusters, cy.n_clusters, generator=g) < 0.35
        keep[torch.arange(cx.n_clusters), torch.randint(cy.n_clusters, (cx.n_clusters,), generator=g)] = True
        keep[torch.randint(cx.n_clusters, (cy.n_clusters,), generator=g), torch.arange(cy.n_clusters)] = True
        kx = torch.rand(cx.n_clusters, cx.n_clusters, generator=g) < 0.4
        kx = kx | kx.T | torch.eye(cx.n_clusters, dtype=torch.bool)
        xs, ys = x[cx.perm][None].to(dt).contiguous(), y[cy.perm][None].to(dt).contiguous()
        pat, sx = BlockPattern(cx.offsets, cy.offsets, keep), BlockPattern(cx.offsets, cx.offsets, kx)
        hx = (torch.randn(1, 500, generator=g, dtype=torch.float64) * 0.3 - math.log(500)).to(dt)
        hy = (torch.randn(1, 400, generator=g, dtype=torch.float64) * 0.3 - math.log(400)).to(dt)
        V = torch.randn(1, 400, 3, generator=g, dtype=torch.float64).to(dt)
        for cname in ("sqeuclidean", "euclidean"):
            c = get_cost(cname)
            k = f"bs.{dt}.{nth}.{d}.{cname}"
            put(k + ".softmin", BS.softmin_cpu(lib, pat, xs, ys, hy, 0.05, c))
            put(k + ".softmin2", BS.softmin_cpu(lib, pat, xs, ys, hy, 0.05, c, base2=True))
            put(k + ".pair", BS.pair_cpu(lib, pat, xs, ys, hx, hy, 0.05, c, sym=False))
            put(k + ".sym", BS.pair_cpu(lib, sx, xs, xs, hx, hx, 0.05, c, sym=True))
            if d <= 3 and c.is_dot:
                put(k + ".bary1", BS.pair_cpu(lib, pat, xs, ys, hx, hy, 0.05, c, sym=False, bary=1))
                put(k + ".bary2", BS.pair_cpu(lib, pat, xs, ys, hx, hy, 0.05, c, sym=False, bary=2))
                put(k + ".barysym", BS.pair_cpu(lib, sx, xs, xs, hx, hx, 0.05, c, sym=True, bary=2))
            if d <= 3:
                cnt = [0]
                fxo, gyo = hx[0] + 0.5, hy[0] + 0.5
                t = BS.TileArgs(hx[0] + 0.1, hy[0], fxo, gyo, 5.0, cnt)
                put(k + ".tiles", BS.pair_cpu(lib, pat, xs, ys, hx, hy, 0.05, c, sym=False, tiles=t))
                out[k + ".tiles.count"] = torch.tensor(cnt)
            for w in ("plan", "cost", "dcost"):
                put(f"{k}.plan.{w}", BS.plan_cpu(lib, pat, xs, ys, hx, hy, 0.05, V, c, w))

def losses(dt, nth):
    torch.set_num_threads(nth)
    g = torch.Generator().manual_seed(3)
    x = torch.cat([torch.randn(700, 3, generator=g, dtype=torch.float64) * 0.3,
                   torch.randn(300, 3, generator=g, dtype=torch.float64) * 0.05 + 2.0]).to(dt)
    y = torch.cat([torch.randn(600, 3, generator=g, dtype=torch.float64) * 0.3 + 0.1,
                   torch.randn(300, 3, generator=g, dtype=torch.float64) * 0.05 + 2.0]).to(dt)
    for kw in (dict(blur=0.05, backend="multiscale", cluster_scale=0.2),
               dict(blur=0.05, backend="multiscale", cluster_scale=0.2, truncate=5),
               dict(blur=0.05, backend="cpu"), dict(blur=0.05, backend="cpu", debias=False)):
        xs = x.clone().requires_grad_()
        v = flashot.SamplesLoss(**kw)(xs, y)
        key = f"loss.{dt}.{nth}." + ".".join(f"{a}={b}" for a, b in kw.items())
        put(key, (v, torch.autograd.grad(v, xs)[0]))

for dt in (torch.float32, torch.float64):
    for nth in (1, 2):
        dense(dt, nth)
        blocks(dt, nth)
        losses(dt, nth)
torch.save(out, sys.argv[1])
print(len(out), "tensors")
"""


def run(src: str, cache: str, path: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(src), "FLASHOT_CACHE_DIR": cache}
    subprocess.run([sys.executable, "-c", WORKER, path], env=env, check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", help="source tree A (the directory holding the flashot package), e.g. the old one")
    ap.add_argument("b", help="source tree B, e.g. the new one")
    ap.add_argument("--cache", default=None, help="build caches (A in CACHE/a, B in CACHE/b); default a temp dir")
    a = ap.parse_args()
    import torch

    base = a.cache or tempfile.mkdtemp(prefix="flashot-bitwise-")
    with tempfile.TemporaryDirectory() as tmp:
        res = []
        for side, src in (("a", a.a), ("b", a.b)):
            os.makedirs(os.path.join(base, side), mode=0o700, exist_ok=True)
            run(src, os.path.join(base, side), os.path.join(tmp, side + ".pt"))
            res.append(torch.load(os.path.join(tmp, side + ".pt")))
    ta, tb = res
    bad = sorted(set(ta) ^ set(tb))
    for k in sorted(set(ta) & set(tb)):
        u, v = ta[k], tb[k]
        same = (
            u.dtype == v.dtype
            and u.shape == v.shape
            and (
                u.numel() == 0
                or bool((u.contiguous().view(-1).view(torch.uint8) == v.contiguous().view(-1).view(torch.uint8)).all())
            )
        )
        if not same:
            bad.append(k)
    print(
        f"{len(set(ta) & set(tb))} tensors compared ({sum(t.numel() for t in ta.values()):,} values), {len(bad)} differ"
    )
    for k in bad[:50]:
        print("  DIFFERS:", k)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
