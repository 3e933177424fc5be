"""The multiscale engine's sub-tile pruning rule (:mod:`flashot.ops.tile_rule`): upper bounds of a fused call's
outputs from sampled points, and the tiles a fused step may skip with them.

References: dense float64 masked softmins and exponentials.  A tile may be skipped when each of its entries
``E_ij = a_i b_j exp((f_i + g_j - C_ij) / eps)`` is below ``e^-truncate a_i b_j`` (GeomLoss' rule for the inputs)
or below ``e^-truncate b_j R_i`` and ``e^-truncate a_i C_j`` (``R_i``, ``C_j`` the exact row and column sums:
the rule for the outputs).  A row's output then moves by at most ``eps B_i / R_i`` (``B_i`` the sum of its
entries in that set), which the tests check with a 5% margin, together with "no fewer pairs evaluated than
those outside the set" (no valid bound skips more).
"""

from __future__ import annotations

import math

import pytest
import torch

from flashot.clusters import cluster
from flashot.costs import get_cost
from flashot.ops import tile_rule
from flashot.ops.blocksparse import BlockPattern, BlockSparseEngine, _cpu_lib
from flashot.ops.tile_rule import TilePruning, output_bounds, tile_args
from references import masked_softmin, torus

F64 = torch.float64
pytestmark = pytest.mark.skipif(_cpu_lib() is None, reason="the C++ kernels cannot be built here")


def _clustered_case(cell=0.5, seed=3):
    """Two tori sorted by cells of side ``cell`` (Morton sub-cells inside), a pattern keeping each row cluster's
    blocks within reach (centroid distance < 1.2) and its nearest one: ``(xs, ys, pat, mask)``."""
    x, y = torus(1500, seed), torus(1200, seed + 1, shift=(0.1, 0.0, 0.05))
    cx = cluster(x, torch.ones(len(x), dtype=F64), cell, sub_levels=3)
    cy = cluster(y, torch.ones(len(y), dtype=F64), cell, sub_levels=3)
    d = torch.cdist(cx.centroids, cy.centroids)
    keep = d < 1.2
    keep[torch.arange(keep.shape[0]), d.argmin(1)] = True
    keep[d.argmin(0), torch.arange(keep.shape[1])] = True
    pat = BlockPattern(cx.offsets, cy.offsets, keep)
    rx = torch.repeat_interleave(torch.arange(cx.n_clusters), cx.sizes)
    ry = torch.repeat_interleave(torch.arange(cy.n_clusters), cy.sizes)
    return x[cx.perm][None].contiguous(), y[cy.perm][None].contiguous(), pat, keep[rx][:, ry]


@pytest.mark.parametrize("cost_name", ["sqeuclidean", "half_sqeuclidean", "euclidean"])
@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("stride", [16, 256])
def test_output_bounds_bound_the_softmin(cost_name, dtype, stride):
    """``output_bounds`` >= the masked softmin of the same (rounded) inputs, for every row, and within a few eps
    of it (bounds from the means of runs of ``stride`` rows: 16 gives about two runs a cluster here, 256 one)."""
    xs, ys, pat, mask = _clustered_case()
    cost, eps = get_cost(cost_name), 0.05
    g = torch.Generator().manual_seed(5)
    M = ys.shape[1]
    hy = (torch.rand(1, M, generator=g, dtype=F64) - 0.5) - math.log(M)
    xs_, ys_, hy_ = xs.to(dtype), ys.to(dtype), hy.to(dtype)
    hx = torch.full((1, xs.shape[1]), -math.log(xs.shape[1]), dtype=dtype)
    u = output_bounds(_cpu_lib(), pat, xs_, ys_, hx, hy_, eps, cost, stride=stride)
    exact = masked_softmin(xs_, ys_, hy_, mask, eps, cost) / eps
    gap = u - exact
    assert bool(torch.isfinite(u).all())
    assert float(gap.min()) >= 0.0
    # median slack measured (eps; stride 16, 256): sqeuclidean 0.37, 0.77; half 0.17, 0.35; euclidean 2.8, 4.0
    measured = {"sqeuclidean": (0.37, 0.77), "half_sqeuclidean": (0.17, 0.35), "euclidean": (2.8, 4.0)}
    assert float(gap.median()) <= 1.5 * measured[cost_name][stride == 256]


def _one_block(sym):
    x, y = torus(3000, 1), torus(2500, 2, shift=(0.1, 0.0, 0.05))
    if sym:
        y = x
    cx = cluster(x, torch.ones(len(x), dtype=F64), 10.0, sub_levels=5)
    cy = cluster(y, torch.ones(len(y), dtype=F64), 10.0, sub_levels=5)
    xs = x[cx.perm][None].contiguous()
    ys = xs if sym else y[cy.perm][None].contiguous()
    return xs, ys, BlockPattern(cx.offsets, cy.offsets, torch.ones(1, 1, dtype=torch.bool))


def _near_fixed_point(xs, ys, eps, cost, sym):
    N, M = xs.shape[1], ys.shape[1]
    la, lb = torch.full((N,), -math.log(N), dtype=F64), torch.full((M,), -math.log(M), dtype=F64)
    mask = torch.ones(N, M, dtype=torch.bool)
    g = torch.zeros(1, M, dtype=F64)
    for _ in range(8):
        f = masked_softmin(xs, ys, lb[None] + g / eps, mask, eps, cost)[None]
        g = masked_softmin(ys, xs, la[None] + f / eps, mask.T, eps, cost)[None]
    if sym:
        f = g = 0.5 * (f + g)
    return la, lb, f, g


@pytest.mark.parametrize("sym", [False, True])
def test_outputs_rule_after_a_jump(sym, monkeypatch):
    """Potentials 4 eps above a near fixed point (as after the coarse-to-fine extrapolation, where the outputs come
    out ~8 eps below the inputs): the fused step skips more tiles than by the inputs' rule alone (forced with an
    unreachable probe threshold), each row loses at most what the rule allows (checked against the dense float64
    step), and no fewer pairs are evaluated than those outside the set the rule may drop.  One block of 3,000
    points much wider than the kernel (so that it has many tiles): the outputs are sampled at every row
    (``OUTPUT_SAMPLE_STRIDE = 1``, exact up to the slack; the default runs span far more than the kernel here),
    eps = 0.03."""
    xs, ys, pat = _one_block(sym)
    cost, eps, trunc = get_cost("sqeuclidean"), 0.03, 5.0
    la, lb, f, g = _near_fixed_point(xs, ys, eps, cost, sym)
    f, g = f + 4 * eps, g + 4 * eps
    hx, hy = la[None] + f / eps, lb[None] + g / eps
    C = cost.matrix(xs, ys)[0]
    E = torch.exp(hx[0][:, None] + hy[0][None] - C / eps)
    R, Cs = E.sum(1), E.sum(0)
    ab = la[:, None].exp() * lb[None].exp()
    droppable = (E < ab * math.exp(-trunc)) | (
        (E < lb[None].exp() * math.exp(-trunc) * R[:, None]) & (E < la[:, None].exp() * math.exp(-trunc) * Cs[None])
    )
    B = (E * droppable).sum(1)
    ref = masked_softmin(xs, ys, hy, torch.ones_like(E, dtype=torch.bool), eps, cost)
    key = BlockSparseEngine.cloud_key
    pats = [(xs, xs, pat)] if sym else [(xs, ys, pat), (ys, xs, pat.T)]
    monkeypatch.setattr(tile_rule, "OUTPUT_SAMPLE_STRIDE", 1)
    counts = {}
    for name, shift in (("inputs", math.inf), ("outputs", tile_rule.PROBE_MIN_SHIFT)):
        monkeypatch.setattr(tile_rule, "PROBE_MIN_SHIFT", shift)
        eng = BlockSparseEngine(pats, tiles=TilePruning({key(xs): la, key(ys): lb}, trunc))
        out = eng.softmin_sym(xs, hx, eps, cost) if sym else eng.softmin_pair(xs, ys, hx, hy, eps, cost)[0]
        err = (out[0] - ref).abs()
        counts[name] = eng.tile_pairs[0]
        assert bool((err <= 1.05 * eps * B / R + 1e-12).all())
    assert counts["outputs"] >= int((~droppable).sum()) // (2 if sym else 1)
    # measured 0.92 (pair) and 0.91 (sym), AVX-512 and AVX2 builds alike: the tiles (96 x 64 on AVX-512, 64 x 64
    # on AVX2) are wide against the kernel here, so most of them straddle both rules' margins (at 3 x 10^6 points,
    # 0.80 over a whole solve)
    assert counts["outputs"] < 0.97 * counts["inputs"]


@pytest.mark.parametrize("sym", [False, True])
def test_probe_skips_the_bounds_near_a_fixed_point(sym, monkeypatch):
    """Near a fixed point the outputs are not bounded (the inputs stand for them: the inputs' rule alone); 4 eps
    above it they are, and the bounds lie below the inputs (runs of 16 rows: narrow against the kernel)."""
    monkeypatch.setattr(tile_rule, "OUTPUT_SAMPLE_STRIDE", 16)
    xs, ys, pat = _one_block(sym)
    cost, eps = get_cost("sqeuclidean"), 0.03
    la, lb, f, g = _near_fixed_point(xs, ys, eps, cost, sym)
    lib = _cpu_lib()
    for up, bounded in ((0.0, False), (4.0, True)):
        hx, hy = la[None] + (f / eps + up), lb[None] + (g / eps + up)
        back = None if sym else pat.T
        t = tile_args(
            lib,
            pat,
            back,
            xs,
            ys if not sym else xs,
            hx,
            hy if not sym else hx,
            la,
            lb if not sym else la,
            eps,
            cost,
            5.0,
            [0],
        )
        assert (t.fxo is not t.fx) == bounded and (t.gyo is not t.gy) == bounded
        if bounded:
            assert float((t.fxo - t.fx).median()) < -2.0 and float((t.gyo - t.gy).median()) < -2.0
