"""Multiscale (coarse-to-fine, block-sparse) Sinkhorn: clusters, block bounds, block-sparse primitives,
pruning, and ``SamplesLoss(backend="multiscale")``.

References: dense torch computations (masked LogSumExp / plan products, all-pairs cost bounds) and
the same coarse-to-fine schedule without pruning (``truncate=None``).  The pruning is the only
approximation the block-sparse engine adds: pruned and unpruned runs agree to 1e-4 relative in
float64 (values, gradients in points and weights, potentials; the issue's tolerance), measured
<= 2e-7 for p = 2 and <= 2e-5 for p = 1 (each temperature prunes with its own margin
``truncate * eps``, so a dropped entry can reach ``e^-truncate`` of ``a_i b_j``).  The schedule
itself (GeomLoss' multiscale) differs from the single-scale one by the coarse stage, as GeomLoss'
does: ``test_kept_fraction_and_trajectory_report`` prints both differences.
"""

from __future__ import annotations

import math

import pytest
import torch

import flashot
import flashot.multiscale as MS
from flashot.clusters import MORTON_BITS, _spread, block_cost_bounds, cluster, coarsen, grid_labels
from flashot.costs import get_cost
from flashot.multiscale import BlockBounds, hierarchy, prune
from flashot.ops import Capability
from flashot.ops.blocksparse import BlockPattern, BlockSparseEngine
from references import masked_bary, masked_softmin, torus

F64 = torch.float64


def _blobs(n, d, seed, centers=((0.0,) * 3, (3.0, 0.5, 0.0)), spread=(0.3, 0.05)):
    """Separated components of very different densities (in d <= 3)."""
    g = torch.Generator().manual_seed(seed)
    parts = []
    for k, (c, s) in enumerate(zip(centers, spread)):
        m = n // len(centers) + (n % len(centers) if k == 0 else 0)
        centre = torch.zeros(d, dtype=F64)
        centre[: min(d, 3)] = torch.tensor(c[: min(d, 3)], dtype=F64)
        parts.append(torch.randn(m, d, generator=g, dtype=F64) * s + centre)
    return torch.cat(parts)


# --- clusters -----------------------------------------------------------------------------------
@pytest.mark.parametrize("d", [1, 2, 3, 5])
def test_clusters_partition_and_centroids(d):
    x = _blobs(500, d, 0)
    a = torch.rand(500, dtype=F64)
    c = cluster(x, a, 0.2)
    assert torch.equal(torch.sort(c.perm).values, torch.arange(500))
    lab = grid_labels(x, 0.2)[c.perm]
    for k in range(c.n_clusters):
        sl = slice(int(c.offsets[k]), int(c.offsets[k + 1]))
        assert (lab[sl] == lab[sl][0]).all() and sl.stop > sl.start
        pts, w = x[c.perm][sl], a[c.perm][sl]
        assert torch.allclose(c.weights[k], w.sum())
        assert torch.allclose(c.centroids[k], (w[:, None] * pts).sum(0) / w.sum())
        assert float((pts - c.centroids[k]).norm(dim=-1).max()) <= float(c.radius[k]) * (1 + 1e-12)
    assert len(torch.unique(lab)) == c.n_clusters  # one cluster per cell, cells never split


def test_block_cost_bounds_are_lower_bounds():
    x, y = _blobs(300, 3, 1), _blobs(200, 3, 2)
    cx, cy = cluster(x, torch.ones(300, dtype=F64), 0.3), cluster(y, torch.ones(200, dtype=F64), 0.5)
    for name in ("sqeuclidean", "half_sqeuclidean", "euclidean"):
        cost = get_cost(name)
        lb = block_cost_bounds(cx, cy, cost)
        C = cost.matrix(x[cx.perm], y[cy.perm])
        for i in range(cx.n_clusters):
            for j in range(cy.n_clusters):
                blk = C[cx.offsets[i] : cx.offsets[i + 1], cy.offsets[j] : cy.offsets[j + 1]]
                assert float(blk.min()) >= float(lb[i, j]) - 1e-12


# --- the block-sparse primitives against masked dense ones ----------------------------------------------
def _pattern_case(seed=3, tile_elems=4096):
    x, y = _blobs(240, 3, seed), _blobs(180, 3, seed + 1)
    cx, cy = cluster(x, torch.ones(240, dtype=F64), 0.25), cluster(y, torch.ones(180, dtype=F64), 0.25)
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(cx.n_clusters, cy.n_clusters, generator=g) < 0.3
    keep[torch.arange(cx.n_clusters), torch.randint(cy.n_clusters, (cx.n_clusters,), generator=g)] = True
    keep[torch.randint(cx.n_clusters, (cy.n_clusters,), generator=g), torch.arange(cy.n_clusters)] = True
    xs, ys = x[cx.perm][None].contiguous(), y[cy.perm][None].contiguous()
    pat = BlockPattern(cx.offsets, cy.offsets, keep, tile_elems=tile_elems)
    mask = torch.repeat_interleave(torch.repeat_interleave(keep, cx.sizes, 0), cy.sizes, 1)
    return xs, ys, pat, mask


@pytest.mark.parametrize("native", [True, False], ids=["cpp", "torch"])
@pytest.mark.parametrize("cost_name", ["sqeuclidean", "euclidean"])
def test_blocksparse_primitives_match_masked_dense(cost_name, native):
    """Both softmin paths (the C++ kernels on the padded column layout, and PyTorch's gathered batches)."""
    xs, ys, pat, mask = _pattern_case()
    assert len(pat.batches) > 1  # several padded batches at this tile size
    eng = BlockSparseEngine([(xs, ys, pat), (ys, xs, pat.T)], native=native)
    assert (eng._lib is not None) == native  # CI builds the cpu engine's kernels
    cost, eps = get_cost(cost_name), 0.05
    g = torch.Generator().manual_seed(0)
    hy, hx = torch.randn(1, 180, generator=g, dtype=F64), torch.randn(1, 240, generator=g, dtype=F64)
    hy[0, 5] = -math.inf  # a zero weight
    C = cost.matrix(xs, ys)[0]
    S = torch.where(mask, hy[0][None] - C / eps, torch.tensor(-math.inf, dtype=F64))
    torch.testing.assert_close(
        eng.softmin(xs, ys, hy, eps, cost)[0], -eps * torch.logsumexp(S, -1), rtol=1e-12, atol=1e-12
    )
    St = torch.where(mask.T, hx[0][None] - C.T / eps, torch.tensor(-math.inf, dtype=F64))
    torch.testing.assert_close(
        eng.softmin(ys, xs, hx, eps, cost)[0], -eps * torch.logsumexp(St, -1), rtol=1e-12, atol=1e-12
    )
    V = torch.randn(1, 180, 4, generator=g, dtype=F64)
    P = torch.where(mask, torch.exp(hx[0][:, None] + hy[0][None] - C / eps), torch.zeros((), dtype=F64))
    for weight, W in (("plan", torch.ones_like(C)), ("cost", C), ("dcost", cost.dcost_weight(C))):
        out = eng.plan_product(xs, ys, hx, hy, eps, V, cost, weight)[0]
        # V has mixed signs, so an entry can cancel far below its summands: the bound is relative to
        # (|P W| @ |V|), the scale of what was summed. Measured on an AVX-512 Xeon: at most 1.2e-12 of
        # that scale (weight "cost"), where the old bound, relative to the cancelled entry itself, saw 2e-11.
        scale = (P * W).abs() @ V[0].abs()
        ratio = ((out - (P * W) @ V[0]).abs() / scale).nan_to_num(0.0)
        assert float(ratio.max()) <= 1e-11, (weight, float(ratio.max()))
    with pytest.raises(RuntimeError, match="no block pattern"):
        eng.softmin(xs, xs, hx, eps, cost)


@pytest.mark.parametrize("shift, passes", [(0.0, 1), (-80.0, 2)])
def test_native_plan_product_one_pass_and_fallback(shift, passes, monkeypatch):
    """The C++ plan product runs in one pass (the weights are the plan entries); a float32 row whose plan mass
    is below 2^-75 (alpha shifted by -80: its entries would fall under float32's normal range) is redone in
    two passes.  Both against the masked dense float64 product on the same (rounded) inputs, 2e-5 relative.
    Without the fallback the second case loses its small entries."""
    import flashot.ops.blocksparse_cpu as BS

    xs, ys, pat, mask = _pattern_case(seed=5)
    xf, yf = xs.float(), ys.float()
    eng = BlockSparseEngine([(xf, yf, pat)])
    assert eng._lib is not None
    cost, eps = get_cost("sqeuclidean"), 0.05
    g = torch.Generator().manual_seed(2)
    hy, V = torch.randn(1, 180, generator=g, dtype=F64), torch.randn(1, 180, 3, generator=g, dtype=F64)
    C = cost.matrix(xs, ys)[0]
    S = torch.where(mask, hy[0][None] - C / eps, torch.tensor(-math.inf, dtype=F64))
    hx = (-torch.logsumexp(S, -1) + shift)[None]  # rows of plan mass 1 (the solver's plans), or e^shift
    calls = []
    real = BS.plan_call
    monkeypatch.setattr(BS, "plan_call", lambda *a: calls.append(a[-1] is None) or real(*a))
    out = eng.plan_product(xf, yf, hx.float(), hy.float(), eps, V.float(), cost)[0].double()
    hx, hy, V = hx.float().double(), hy.float().double(), V.float().double()  # the reference on the rounded inputs
    C = cost.matrix(xf.double(), yf.double())[0]
    P = torch.where(mask, torch.exp(hx[0][:, None] + hy[0][None] - C / eps), torch.zeros((), dtype=F64))
    ref = P @ V[0]
    assert len(calls) == passes and calls[0]
    assert float((out - ref).abs().max() / ref.abs().max()) < 2e-5


def _fused_case(dtype):
    """:func:`_pattern_case` in ``dtype`` plus a symmetric self pattern of x (random blocks, the diagonal, and
    their transposes): ``(xs, ys, pat, mask, cx, kx, mxx, generator)``."""
    xs, ys, pat, mask = _pattern_case(seed=6)
    xs, ys = xs.to(dtype), ys.to(dtype)
    cx = cluster(xs[0].double(), torch.ones(240, dtype=F64), 0.25)
    g = torch.Generator().manual_seed(7)
    kx = torch.rand(pat.keep.shape[0], pat.keep.shape[0], generator=g) < 0.3
    kx = kx | kx.T | torch.eye(pat.keep.shape[0], dtype=torch.bool)
    mxx = torch.repeat_interleave(torch.repeat_interleave(kx, cx.sizes, 0), cx.sizes, 1)
    return xs, ys, pat, mask, cx, kx, mxx, g


@pytest.mark.parametrize("dtype, tol", [(F64, 1e-11), (torch.float32, 2e-5)])
@pytest.mark.parametrize("cost_name", ["sqeuclidean", "euclidean"])
def test_fused_pair_and_sym_steps_match_masked_dense(cost_name, dtype, tol):
    """``softmin_pair`` (one exponential per kept pair for both potentials) and ``softmin_sym`` (the blocks on
    and right of the diagonal of a symmetric pattern) in the C++ kernels, against masked dense LogSumExps in
    float64 on the same (rounded) inputs; tolerance relative to the largest cost.  Row 7 is shifted by -200:
    its sums fall below ``PAIR_MIN_SUM`` and it is recomputed by the block-sparse softmin (in float32 its
    terms underflow to zero, so without that fallback its column sums would lose it and its own value
    would be infinite)."""
    xs, ys, pat, mask, cx, kx, mxx, g = _fused_case(dtype)
    sx = BlockPattern(cx.offsets, cx.offsets, kx)
    assert sx.symmetric and not pat.symmetric
    eng = BlockSparseEngine([(xs, ys, pat), (ys, xs, pat.T), (xs, xs, sx)])
    cost, eps = get_cost(cost_name), 0.05
    # potentials near a Sinkhorn fixed point (the solver's regime): h_x = log a + f / eps with f = softmin(y, g)
    hy = (torch.randn(1, 180, generator=g, dtype=F64) * 0.3 - math.log(180)).to(dtype)
    hx = (math.log(1 / 240) + masked_softmin(xs, ys, hy, mask, eps, cost)[None] / eps).to(dtype)
    hx[0, 7] -= 200.0
    f, gy = eng.softmin_pair(xs, ys, hx, hy, eps, cost)
    assert eng.stats["pair"] == 1 and eng.stats["fixup"] >= 1
    scale = float(cost.matrix(xs.double(), ys.double()).max())
    for out, ref in (
        (f, masked_softmin(xs, ys, hy, mask, eps, cost)),
        (gy, masked_softmin(ys, xs, hx, mask.T, eps, cost)),
    ):
        assert out.dtype == dtype and out.shape == (1, ref.shape[0])
        assert float((out[0].double() - ref).abs().max()) <= tol * scale
    h = hx.clone()
    out = eng.softmin_sym(xs, h, eps, cost)
    assert eng.stats["sym"] == 1
    assert float((out[0].double() - masked_softmin(xs, xs, h, mxx, eps, cost)).abs().max()) <= tol * scale
    # a non-symmetric self pattern: the plain block-sparse softmin
    e2 = BlockSparseEngine(
        [
            (
                xs,
                xs,
                BlockPattern(
                    cx.offsets, cx.offsets, kx & ~torch.eye(len(kx), dtype=torch.bool) | torch.triu(torch.ones_like(kx))
                ),
            )
        ]
    )
    out2 = e2.softmin_sym(xs, h, eps, cost)
    assert e2.stats["sym"] == 0
    m2 = e2.pattern(xs, xs).keep
    m2 = torch.repeat_interleave(torch.repeat_interleave(m2, cx.sizes, 0), cx.sizes, 1)
    assert float((out2[0].double() - masked_softmin(xs, xs, h, m2, eps, cost)).abs().max()) <= tol * scale


@pytest.mark.parametrize("sym", [False, True])
def test_pair_kernel_float32_far_from_the_origin(sym):
    """The fused kernel's float32 sums (``_pair_cpu``: row sums, column sums, the rows' barycentre numerators) on
    clouds translated by 100 along every axis (the costs unchanged), against float64 masked dense sums on the same
    rounded inputs: log-sums within 2e-5 of the largest cost / eps (the untranslated cases' tolerance), barycentres
    within 2e-5 of the clouds' extent.  The kernel scores each row panel in a frame centred on it
    (``panel_local``); scores formed as ``|x|^2 + |y|^2 - 2 <x, y>`` round at the scale of |x|^2 ~ 3 x 10^4 and
    missed this by 100x (the previous kernels: 0.12 in a log-sum here).  Rows whose sums fall below
    ``PAIR_MIN_SUM`` are left out (the engine recomputes them)."""
    from flashot.ops.blocksparse import _cpu_lib, _pair_cpu
    from flashot.ops.cpu.engine import PAIR_MIN_SUM

    xs, ys, pat, mask, cx, kx, mxx, g = _fused_case(F64)
    xs, ys = (xs + 100.0).float(), (ys + 100.0).float()
    cost, eps, tol = get_cost("sqeuclidean"), 0.05, 2e-5
    hy = (torch.randn(1, 180, generator=g, dtype=F64) * 0.3 - math.log(180)).float()
    hx = (math.log(1 / 240) + masked_softmin(xs, ys, hy, mask, eps, cost)[None] / eps).float()
    if sym:  # the symmetric step's potentials: a half step from uniform ones
        la = torch.full((1, 240), -math.log(240), dtype=F64)
        hx = (la + masked_softmin(xs, xs, la, mxx, eps, cost)[None] / eps).float()
        ys, hy, mask, pat = xs, hx, mxx, BlockPattern(cx.offsets, cx.offsets, kx)
    rows, cols, rb, cb = _pair_cpu(_cpu_lib(), pat, xs, ys, hx, hy, eps, cost, sym=sym, bary=2 if sym else 1)
    C = cost.matrix(xs.double(), ys.double())[0]
    E = torch.where(
        mask, torch.exp(hx[0].double()[:, None] + hy[0].double()[None] - C / eps), torch.zeros((), dtype=F64)
    )
    if sym:  # the diagonal blocks' rows plus the blocks right of them, as columns
        rows, rb = rows + cols, rb + cb
    scale = float(C[mask].max()) / eps
    ext = float((xs.double() - 100.0).abs().max())
    for got, ref in ((rows, E.sum(1)),) + (() if sym else ((cols, E.sum(0)),)):
        ok = ref > PAIR_MIN_SUM
        assert int(ok.sum()) >= 0.9 * len(ref)
        assert float((got.double()[ok].log() - ref[ok].log()).abs().max()) <= tol * scale
    ok = E.sum(1) > PAIR_MIN_SUM
    bary = (rb.double() / rows.double()[:, None])[ok]
    assert float((bary - (E @ ys[0].double() / E.sum(1, keepdim=True))[ok]).abs().max()) <= tol * ext


@pytest.mark.parametrize("dtype, tol", [(F64, 1e-11), (torch.float32, 2e-5)])
def test_fused_steps_with_barycentres_match_masked_dense(dtype, tol):
    """``softmin_pair_bary`` / ``softmin_sym_bary`` (the final step: the potentials and, from the same
    exponentials, the barycentres ``sum_j w_ij y_j`` its gradient needs) against float64 masked dense
    softmins and softmaxes; tolerance relative to the largest cost (potentials) and to the cloud's extent
    (barycentres).  Row 7 (shifted by -200) is redone: the softmin and the plan product on its clusters.
    ``|x - y|`` (no barycentre gradient) and D > 3 give None."""
    xs, ys, pat, mask, cx, kx, mxx, g = _fused_case(dtype)
    eng = BlockSparseEngine([(xs, ys, pat), (ys, xs, pat.T), (xs, xs, BlockPattern(cx.offsets, cx.offsets, kx))])
    cost, eps = get_cost("sqeuclidean"), 0.05
    hy = (torch.randn(1, 180, generator=g, dtype=F64) * 0.3 - math.log(180)).to(dtype)
    hx = (math.log(1 / 240) + masked_softmin(xs, ys, hy, mask, eps, cost)[None] / eps).to(dtype)
    hx[0, 7] -= 200.0
    scale = float(cost.matrix(xs.double(), ys.double()).max())
    ext = float(torch.cat([xs, ys], 1).abs().max())
    for cols in (False, True):
        f, gy, bx, by = eng.softmin_pair_bary(xs, ys, hx, hy, eps, cost, cols=cols)
        assert float((f[0].double() - masked_softmin(xs, ys, hy, mask, eps, cost)).abs().max()) <= tol * scale
        assert float((gy[0].double() - masked_softmin(ys, xs, hx, mask.T, eps, cost)).abs().max()) <= tol * scale
        assert bx.shape == (1, 240, 3) and bx.dtype == dtype
        assert float((bx[0].double() - masked_bary(xs, ys, hy, mask, eps, cost)).abs().max()) <= tol * ext
        if cols:
            assert float((by[0].double() - masked_bary(ys, xs, hx, mask.T, eps, cost)).abs().max()) <= tol * ext
        else:
            assert by is None
    assert eng.stats["pair_bary"] == 2 and eng.stats["bary_fixup"] >= 2  # row 7, twice
    h = hx.clone()
    out, b = eng.softmin_sym_bary(xs, h, eps, cost)
    assert eng.stats["sym_bary"] == 1
    assert float((out[0].double() - masked_softmin(xs, xs, h, mxx, eps, cost)).abs().max()) <= tol * scale
    assert float((b[0].double() - masked_bary(xs, xs, h, mxx, eps, cost)).abs().max()) <= tol * ext
    assert eng.softmin_pair_bary(xs, ys, hx, hy, eps, get_cost("euclidean"), cols=True) is None
    x4 = torch.cat([xs, xs[..., :1]], -1)
    e4 = BlockSparseEngine([(x4, x4, BlockPattern(cx.offsets, cx.offsets, kx))])
    assert e4.softmin_sym_bary(x4, h, eps, cost) is None


def _without_barycentres(monkeypatch):
    """The block-sparse engine without its barycentre steps (it stops declaring them)."""
    monkeypatch.setattr(
        BlockSparseEngine,
        "capabilities",
        BlockSparseEngine.capabilities - {Capability.SOFTMIN_PAIR_BARY, Capability.SOFTMIN_SYM_BARY},
    )


@pytest.mark.parametrize("debias, reach", [(True, {}), (False, {}), (True, dict(reach=0.5))])
def test_gradients_from_barycentres_match_plan_products(debias, reach, monkeypatch):
    """A multiscale ``SamplesLoss``'s gradients (points and weights, both sides) with the final step's
    barycentres (the default on the CPU kernels: no plan product) and with them removed (the plan products
    of the envelope gradients, or of the softmins' backward with ``reach``): the same up to float64
    rounding."""
    x, y = _blobs(900, 3, 7), _blobs(700, 3, 8, centers=((0.5, 0.0, 0.0), (3.0, -0.5, 0.0)), spread=(0.2, 0.1))
    a, b = torch.full((900,), 1 / 900, dtype=F64), torch.full((700,), 1 / 700, dtype=F64)
    kw = dict(blur=0.05, debias=debias, backend="multiscale", cluster_scale=0.1, **reach)
    monkeypatch.setattr(MS.fine, "TILE_PRUNING", False)  # the plan products see every pair of the kept blocks
    v1, g1, L = _loss_and_grads(x, y, a, b, **kw)
    st = L.last_multiscale.m.engine.stats
    assert st["pair_bary"] + st["sym_bary"] >= 1 and L.last_multiscale.kept[-1] < 0.5
    _without_barycentres(monkeypatch)
    v0, g0, _ = _loss_and_grads(x, y, a, b, **kw)
    assert abs(float(v1 - v0)) <= 1e-12 * abs(float(v0))
    for u, w in zip(g1, g0):
        assert _rel(u - u.mean(), w - w.mean()) <= 1e-10


def test_float32_gradients_from_barycentres_are_closer_to_float64(monkeypatch):
    """In float32 the barycentres (normalised rows) beat the plan products (whose row masses carry the
    rounding of ``f / eps``): measured 1.0e-5 / 4.1e-6 / 5.1e-7 (x, y, weights) from the float64 gradients
    against 4.7e-5 / 1.1e-4 / 5.1e-7."""

    def grads(dtype):
        x, y = (
            _blobs(900, 3, 7).to(dtype),
            _blobs(700, 3, 8, centers=((0.5, 0.0, 0.0), (3.0, -0.5, 0.0)), spread=(0.2, 0.1)).to(dtype),
        )
        a, b = torch.full((900,), 1 / 900, dtype=dtype), torch.full((700,), 1 / 700, dtype=dtype)
        g = _loss_and_grads(x, y, a, b, blur=0.05, backend="multiscale", cluster_scale=0.1)[1]
        return [t.double() - t.double().mean() for t in g]

    ref, fused = grads(F64), grads(torch.float32)
    _without_barycentres(monkeypatch)
    plan = grads(torch.float32)
    errs = [(_rel(u, r), _rel(w, r)) for u, w, r in zip(fused, plan, ref)]
    assert all(e <= 3e-5 for e, _ in errs), errs
    assert all(e <= w * 1.01 for e, w in errs), errs


def test_cluster_sub_levels_sort_points_inside_their_cells():
    """``cluster(..., sub_levels=L)``: the same cells (the finer grid's codes shifted) with the points of each
    cell in the Morton order of its 2^L finer sub-cells."""
    x = torus(5000, 3)
    a = torch.rand(5000, dtype=F64)
    c0, c3 = cluster(x, a, 0.3), cluster(x, a, 0.3, sub_levels=3)
    assert torch.equal(c0.codes, c3.codes) and torch.equal(c0.offsets, c3.offsets)
    for k in range(c0.n_clusters):  # the same points in each cell
        lo, hi = int(c0.offsets[k]), int(c0.offsets[k + 1])
        assert torch.equal(c0.perm[lo:hi].sort().values, c3.perm[lo:hi].sort().values)
    fine = grid_labels(x, 0.3 / 8)[c3.perm]
    assert bool((fine[1:] >= fine[:-1]).all()) and not bool((grid_labels(x, 0.3 / 8)[c0.perm].diff() >= 0).all())
    assert torch.allclose(c0.centroids, c3.centroids) and torch.allclose(c0.radius, c3.radius)


@pytest.mark.parametrize("sym", [False, True])
def test_tile_pruning_inside_kept_blocks(sym):
    """:class:`TilePruning`: one kept block of 2,400 x 2,000 points (Morton-sorted), potentials near a Sinkhorn
    fixed point at a small eps.  Without a reachable threshold the fused steps equal the masked-dense float64
    softmins; at ``truncate`` 5 they skip tiles (fewer pairs evaluated) and each row's sum loses at most the
    dropped entries, each below ``e^-5 a_i b_j``: ``|delta f_i| <= eps B_i / R_i`` (``R_i`` the row's exact sum,
    ``B_i`` that of its entries below the rule, itself ``<= e^-5 a_i``), checked with a 5% margin; and the
    pairs evaluated are at least those above the rule."""
    from flashot.ops.blocksparse import TilePruning

    x, y = torus(2400, 1), torus(2000, 2, shift=(0.1, 0.0, 0.05))
    if sym:
        y = x
    cx, cy = (
        cluster(x, torch.ones(len(x), dtype=F64), 10.0, sub_levels=5),
        cluster(y, torch.ones(len(y), dtype=F64), 10.0, sub_levels=5),
    )
    assert cx.n_clusters == cy.n_clusters == 1
    xs, ys = x[cx.perm][None].contiguous(), (y[cy.perm][None].contiguous() if not sym else None)
    ys = xs if sym else ys
    N, M = xs.shape[1], ys.shape[1]
    pat = BlockPattern(cx.offsets, cy.offsets, torch.ones(1, 1, dtype=torch.bool))
    cost, eps = get_cost("sqeuclidean"), 0.002
    la, lb = torch.full((N,), -math.log(N), dtype=F64), torch.full((M,), -math.log(M), dtype=F64)
    mask = torch.ones(N, M, dtype=torch.bool)
    g = torch.zeros(1, M, dtype=F64)
    for _ in range(8):  # a few Sinkhorn iterations: realistic potentials
        f = masked_softmin(xs, ys, lb[None] + g / eps, mask, eps, cost)[None]
        g = masked_softmin(ys, xs, la[None] + f / eps, mask.T, eps, cost)[None]
    if sym:
        g = f = 0.5 * (f + g)
    hx, hy = la[None] + f / eps, lb[None] + g / eps
    C = cost.matrix(xs, ys)[0]
    E = torch.exp(hx[0][:, None] + hy[0][None] - C / eps)
    R = E.sum(1)  # exact row sums
    below = E < (la[:, None] + lb[None] - 5.0).exp()  # the entries the rule may drop at truncate 5
    B = (E * below).sum(1)  # their sum: no valid bound drops more from a row
    ref = masked_softmin(xs, ys, hy, mask, eps, cost)
    pats = [(xs, xs, pat)] if sym else [(xs, ys, pat), (ys, xs, pat.T)]
    for trunc, exact in ((1e6, True), (5.0, False)):
        key = BlockSparseEngine.cloud_key
        eng = BlockSparseEngine(pats, tiles=TilePruning({key(xs): la, key(ys): lb}, trunc))
        out = eng.softmin_sym(xs, hx, eps, cost) if sym else eng.softmin_pair(xs, ys, hx, hy, eps, cost)[0]
        err = (out[0] - ref).abs()
        if exact:
            assert float(err.max()) <= 1e-11 * float(C.max())
            full = eng.tile_pairs[0]
        else:
            assert eng.tile_pairs[0] < 0.8 * full  # tiles were skipped
            assert eng.tile_pairs[0] >= int((~below).sum())  # no fewer pairs than those above the rule
            assert bool((err <= 1.05 * eps * B / R + 1e-12).all())
            assert bool((err <= 1.1 * eps * math.exp(-5.0) * la.exp() / R + 1e-12).all())


def test_native_softmin_float32():
    xs, ys, pat, mask = _pattern_case(seed=4)
    xs, ys = xs.float(), ys.float()
    cost, eps = get_cost("half_sqeuclidean"), 0.02
    h = torch.randn(1, 180, generator=torch.Generator().manual_seed(1))
    out = BlockSparseEngine([(xs, ys, pat)]).softmin(xs, ys, h, eps, cost)
    C = cost.matrix(xs.double(), ys.double())[0]
    S = torch.where(mask, h[0].double()[None] - C / eps, torch.tensor(-math.inf, dtype=F64))
    torch.testing.assert_close(out[0].double(), -eps * torch.logsumexp(S, -1), rtol=0, atol=2e-5 * float(C.max()))


def test_pattern_needs_a_block_per_row_and_reports_its_fraction():
    xs, ys, pat, mask = _pattern_case()
    assert pat.fraction == pytest.approx(float(mask.double().mean()))
    keep = pat.keep.clone()
    keep[0] = False
    with pytest.raises(ValueError, match="at least one"):
        BlockPattern(pat.row_offsets, pat.col_offsets, keep)


def test_prune_only_drops_blocks_above_the_margin():
    x, y = _blobs(300, 2, 5), _blobs(250, 2, 6)
    cx, cy = cluster(x, torch.ones(300, dtype=F64), 0.2), cluster(y, torch.ones(250, dtype=F64), 0.2)
    cost, eps, trunc = get_cost("half_sqeuclidean"), 0.01, 5.0
    xs, ys = x[cx.perm], y[cy.perm]
    lb = torch.log(torch.full((1, 250), 1 / 250, dtype=F64))
    f = flashot.ops.softmin(xs, ys, lb[0], eps, cost="half_sqeuclidean")
    g = flashot.ops.softmin(ys, xs, torch.full((300,), -math.log(300), dtype=F64), eps, cost="half_sqeuclidean")
    keep = prune(cx, cy, f, g, eps, trunc, cost, xs, ys)  # with the linear-model bounds
    keep_plain = prune(cx, cy, f, g, eps, trunc, cost)
    assert bool((keep <= keep_plain).all()) and int(keep.sum()) < int(keep_plain.sum())  # tighter
    gap = cost.matrix(xs, ys) - f[:, None] - g[None]
    for i in range(cx.n_clusters):
        for j in range(cy.n_clusters):
            if not keep[i, j]:
                blk = gap[cx.offsets[i] : cx.offsets[i + 1], cy.offsets[j] : cy.offsets[j + 1]]
                assert float(blk.min()) > trunc * eps
    assert 0 < float(keep.double().mean()) < 0.5


# --- SamplesLoss(backend="multiscale") ----------------------------------------------------------------
def _loss_and_grads(x, y, a, b, **kw):
    xs, ys, as_ = x.clone().requires_grad_(), y.clone().requires_grad_(), a.clone().requires_grad_()
    L = flashot.SamplesLoss(**kw)
    v = L(as_, xs, b, ys)
    return v.detach(), torch.autograd.grad(v, (xs, ys, as_)), L


def _rel(u, v):
    return float((u - v).abs().max()) / max(float(v.abs().max()), 1e-300)


@pytest.mark.parametrize(
    "d, p, debias, blur, reach",
    [
        (2, 2, True, 0.02, {}),
        (3, 2, True, 0.05, {}),
        (3, 2, False, 0.05, {}),
        (3, 1, True, 0.05, {}),
        (3, 2, True, 0.05, dict(reach=0.5)),
        (2, 2, False, 0.02, dict(reach_y=1.0)),
        # p = 1 with reach: 1.05e-4 (grad y) at the default truncate=5, 2.2e-5 at 6 (each dropped entry can
        # reach e^-truncate a_i b_j, and p = 1 gradients weigh far pairs fully)
        (3, 1, True, 0.05, dict(reach=1.0, truncate=6)),
    ],
)
def test_pruned_matches_unpruned(d, p, debias, blur, reach):
    x, y = _blobs(1000, d, 7), _blobs(800, d, 8, centers=((0.5, 0.0, 0.0), (3.0, -0.5, 0.0)), spread=(0.2, 0.1))
    g = torch.Generator().manual_seed(9)
    a, b = torch.rand(1000, generator=g, dtype=F64) + 0.2, torch.rand(800, generator=g, dtype=F64) + 0.2
    a, b = a / a.sum(), b / b.sum() * (1.3 if reach else 1.0)  # unbalanced: unequal masses
    reach = dict(reach)
    trunc = reach.pop("truncate", 5)
    kw = dict(p=p, blur=blur, debias=debias, backend="multiscale", cluster_scale=0.1, **reach)
    v0, g0, _ = _loss_and_grads(x, y, a, b, truncate=None, **kw)
    v5, g5, L = _loss_and_grads(x, y, a, b, truncate=trunc, **kw)
    assert L.last_multiscale.kept[-1] < 0.5  # pruning happened
    # measured 2e-7 (p = 2; with reach 9e-7 on the Xeon and Zen 3, 4.4e-6 in a gradient on an AVX-512 Zen 4:
    # which blocks sit at the margin depends on the build's rounding), 2e-5 (p = 1); the bound is 1e-4
    tol = (1e-5 if reach else 1e-6) if p == 2 else 1e-4
    assert abs(float(v5 - v0)) <= tol * abs(float(v0))
    for u, w in zip(g5, g0):
        assert _rel(u - u.mean(), w - w.mean()) <= tol
    F0, G0 = flashot.SamplesLoss(potentials=True, truncate=None, **kw)(a, x, b, y)
    F5, G5 = flashot.SamplesLoss(potentials=True, truncate=5, **kw)(a, x, b, y)
    assert _rel(F5, F0) <= tol and _rel(G5, G0) <= tol


@pytest.mark.parametrize("reach", [dict(reach=0.5), dict(reach_x=0.7, debias=False)])
def test_unbalanced_multiscale_follows_the_single_scale_trajectory(reach):
    """Unbalanced (GeomLoss' reach) and semi-unbalanced SamplesLoss: GeomLoss' schedule is not converged at
    its last temperature (one iteration each), for either solver, so the two land apart by the coarse
    stage's effect; with a fine schedule (scaling = 0.95) they are within 6e-5 (reach) and 1e-3
    (semi-unbalanced, whose converged value is still ~4% away) relative.  Convergence to the same optimum
    is tested with solve_sample below."""
    x, y = _blobs(900, 3, 7), _blobs(700, 3, 8, centers=((0.5, 0.0, 0.0), (3.0, -0.5, 0.0)), spread=(0.2, 0.1))
    a = torch.full((900,), 1 / 900, dtype=F64)
    b = torch.full((700,), 1.4 / 700, dtype=F64)
    kw = dict(blur=0.05, scaling=0.95, **reach)
    vm, _, L = _loss_and_grads(x, y, a, b, backend="multiscale", cluster_scale=0.1, **kw)
    vc, _, _ = _loss_and_grads(x, y, a, b, backend="cpu", **kw)
    assert L.last_multiscale.kept[-1] < 0.5
    assert abs(float(vm - vc)) <= 2e-3 * abs(float(vc))


def test_kept_fraction_and_trajectory_report(capsys):
    """Reports the kept fraction per pruning, and how far the coarse-to-fine schedule lands from the
    single-scale one (GeomLoss' multiscale has the same property) and from a much finer schedule."""
    x, y = torus(3000, 0), torus(3000, 1, (0.3, 0.1, 0.0))
    ones = torch.full((3000,), 1 / 3000, dtype=F64)
    vm, gm, L = _loss_and_grads(x, y, ones, ones, blur=0.02, backend="multiscale")
    vc, gc, _ = _loss_and_grads(x, y, ones, ones, blur=0.02, backend="cpu")
    vf, gf, _ = _loss_and_grads(x, y, ones, ones, blur=0.02, backend="cpu", scaling=0.95)
    kept = L.last_multiscale.kept
    with capsys.disabled():
        print(
            f"\nmultiscale torus n=3000 blur=0.02: kept fractions {[round(k, 4) for k in kept]}; value vs "
            f"single-scale {abs(float(vm - vc)) / float(vc):.2e}, vs scaling=0.95 {abs(float(vm - vf)) / float(vf):.2e} "
            f"(single-scale vs scaling=0.95: {abs(float(vc - vf)) / float(vf):.2e})"
        )
    assert all(b <= a + 1e-12 for a, b in zip(kept, kept[1:])) and kept[-1] < 0.2
    # the two schedules are both GeomLoss' (not converged at the last temperature): within 1% here
    assert abs(float(vm - vc)) <= 1e-2 * float(vc)


def test_float32_and_labels_call():
    x, y = _blobs(800, 3, 11).float(), _blobs(700, 3, 12).float()
    kw = dict(blur=0.05, backend="multiscale", cluster_scale=0.2)
    v32 = flashot.SamplesLoss(**kw)(x, y)
    v64 = flashot.SamplesLoss(**kw)(x.double(), y.double())
    assert v32.dtype == torch.float32 and abs(float(v32) - float(v64)) <= 1e-4 * abs(float(v64))
    lx, ly = grid_labels(x.double(), 0.2), grid_labels(y.double(), 0.2)
    a, b = torch.full((800,), 1 / 800), torch.full((700,), 1 / 700)
    v6 = flashot.SamplesLoss(**kw)(lx, a, x, ly, b, y)
    assert abs(float(v6) - float(v32)) <= 1e-6 * abs(float(v32))


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (
            lambda: flashot.SamplesLoss(backend="multiscale", reach_x=0.5, reach_y=1.0),
            NotImplementedError,
            "reach_x != reach_y",
        ),
        (lambda: flashot.SamplesLoss("hausdorff", backend="multiscale"), NotImplementedError, "sinkhorn"),
        (lambda: flashot.SamplesLoss(cluster_scale=0.1), ValueError, "multiscale"),
        (
            lambda: flashot.SamplesLoss(backend="multiscale")(torch.randn(2, 30, 3), torch.randn(2, 20, 3)),
            NotImplementedError,
            "batch",
        ),
        (
            lambda: flashot.SamplesLoss()(
                torch.zeros(30, dtype=torch.long),
                torch.ones(30) / 30,
                torch.randn(30, 3),
                torch.zeros(20, dtype=torch.long),
                torch.ones(20) / 20,
                torch.randn(20, 3),
            ),
            ValueError,
            "multiscale",
        ),
        (
            lambda: flashot.SamplesLoss(backend="multiscale")(
                torch.zeros(30),
                torch.ones(30) / 30,
                torch.randn(30, 3),
                torch.zeros(20, dtype=torch.long),
                torch.ones(20) / 20,
                torch.randn(20, 3),
            ),
            TypeError,
            "labels_x",
        ),
    ],
)
def test_multiscale_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# --- the pruning hierarchy and its C++ kernel ------------------------------------------------------
def test_morton_spread_matches_the_bit_loop():
    v = torch.randint(0, 2**MORTON_BITS, (20000,), generator=torch.Generator().manual_seed(0))
    for d in (1, 2, 3):
        ref = torch.zeros_like(v)
        for k in range(MORTON_BITS):
            ref |= ((v >> k) & 1) << (k * d)
        assert torch.equal(_spread(v, d), ref), d


@pytest.mark.parametrize("d", [2, 3])
def test_coarsen_nests_the_grid(d):
    """Coarse Morton cells are runs of fine ones and hold the points of the grid twice (four times) as wide."""
    x = _blobs(3000, d, 3)
    a = torch.full((3000,), 1 / 3000, dtype=F64)
    c = cluster(x, a, 0.05)
    xs, as_ = x[c.perm], a[c.perm]
    for levels in (1, 2):
        pc, runs_of = coarsen(c, xs, as_, levels)
        direct = cluster(x, a, 0.05 * 2**levels)
        assert pc.n_clusters == direct.n_clusters
        assert torch.equal(pc.offsets, direct.offsets) and torch.allclose(pc.centroids, direct.centroids)
        assert torch.allclose(pc.weights, direct.weights) and torch.allclose(pc.radius, direct.radius)
        fine_ends = set(c.offsets.tolist())
        assert set(pc.offsets.tolist()) <= fine_ends  # every coarse boundary is a fine one
        assert int(runs_of.numel()) == c.n_clusters and bool((runs_of[1:] >= runs_of[:-1]).all())


def _pruning_case(cost_name, n=4000, scale=0.08):
    x, y = torus(n, 0), torus(n, 1, (0.3, 0.1, 0.0))
    a = torch.full((n,), 1 / n, dtype=F64)
    cost = get_cost(cost_name)
    cx, cy = cluster(x, a, scale), cluster(y, a, scale)
    xs, ys = x[cx.perm], y[cy.perm]
    eps = 0.01 if cost.is_dot else 0.03
    lw = torch.full((n,), -math.log(n), dtype=F64)
    f = flashot.ops.softmin(xs, ys, lw, eps, cost=cost_name)
    g = flashot.ops.softmin(ys, xs, lw, eps, cost=cost_name)
    return cx, cy, xs, ys, a, f, g, eps, cost


@pytest.mark.parametrize("cost_name", ["half_sqeuclidean", "euclidean"])
def test_native_and_hierarchical_pruning_keep_what_the_rule_keeps(cost_name, monkeypatch):
    """The C++ pruning equals the PyTorch one (flat and hierarchical); the hierarchy keeps every block whose
    flat bound is within the margin; no dropped block has an entry within the margin (dense check)."""
    cx, cy, xs, ys, a, f, g, eps, cost = _pruning_case(cost_name)
    monkeypatch.setattr(MS.hierarchies, "COARSE_BLOCKS", 64)  # force a hierarchy on this small problem
    h = hierarchy(cx, cy, xs, ys, a, a)
    assert h is not None and h.cx.n_clusters < cx.n_clusters
    margin = 5 * eps
    keeps = {}
    for mode in ("torch", "native"):
        monkeypatch.setenv("FLASHOT_PRUNE", mode)
        for name, par in (("flat", None), ("hier", h)):
            keeps[mode, name] = BlockBounds.compute(cx, cy, f, g, cost, xs, ys, par, margin).keep(margin)
    for name in ("flat", "hier"):
        assert torch.equal(keeps["torch", name], keeps["native", name]), name
    flat, hier = keeps["native", "flat"], keeps["native", "hier"]
    monkeypatch.setenv("FLASHOT_PRUNE", "torch")
    B = BlockBounds.compute(cx, cy, f, g, cost, xs, ys)._dense(slice(None))
    assert bool(hier[B <= margin].all())  # nothing within the margin is lost by the hierarchy
    assert (
        0.01 < float(hier.double().mean()) < 0.6
        and abs(int(hier.sum()) - int(flat.sum())) <= cx.n_clusters + cy.n_clusters
    )
    gap = cost.matrix(xs, ys) - f[:, None] - g[None]
    # the smallest gap of every block (I, J), from the dense matrix
    ri = torch.repeat_interleave(torch.arange(cx.n_clusters), cx.offsets.diff())
    cj = torch.repeat_interleave(torch.arange(cy.n_clusters), cy.offsets.diff())
    block_min = torch.full((cx.n_clusters * cy.n_clusters,), math.inf, dtype=gap.dtype)
    block_min.scatter_reduce_(0, (ri[:, None] * cy.n_clusters + cj[None]).flatten(), gap.flatten(), "amin")
    assert bool((block_min.view(cx.n_clusters, cy.n_clusters)[~hier] > margin).all())


def test_a_pattern_that_misses_blocks_is_repaired(monkeypatch):
    """After each temperature the bounds are recomputed; a pattern that dropped blocks the new potentials
    keep (here: the first pattern of each temperature keeps only each row's and column's best block) is
    rerun on the union, so the result still matches the unpruned run."""
    x, y = _blobs(900, 3, 7), _blobs(800, 3, 8, centers=((0.5, 0.0, 0.0), (3.0, -0.5, 0.0)), spread=(0.2, 0.1))
    a, b = torch.full((900,), 1 / 900, dtype=F64), torch.full((800,), 1 / 800, dtype=F64)
    kw = dict(blur=0.05, backend="multiscale", cluster_scale=0.1)
    v0, g0, _ = _loss_and_grads(x, y, a, b, truncate=None, **kw)
    real_keeps, seen = MS.coarse_to_fine._keeps, []

    def first_too_small(bounds, eps, truncate):
        # the pattern a temperature starts from: the very first call, or bounds already used for a check
        start = not seen or any(b is bounds for b in seen)
        seen.append(bounds)
        return real_keeps(bounds, eps, -1e300 if start else truncate)

    real_loop, loops = MS.coarse_to_fine.sinkhorn_loop, []

    def counted(m, eps_list, **kw_):
        loops.append(len(eps_list))
        return real_loop(m, eps_list, **kw_)

    monkeypatch.setattr(MS.coarse_to_fine, "_keeps", first_too_small)
    monkeypatch.setattr(MS.coarse_to_fine, "sinkhorn_loop", counted)
    v5, g5, L = _loss_and_grads(x, y, a, b, truncate=5, **kw)
    fine_levels = len(L.last_multiscale.kept)
    assert fine_levels >= 2 and len(loops) == 1 + 2 * fine_levels  # the coarse stage, then every level twice
    assert abs(float(v5 - v0)) <= 1e-4 * abs(float(v0))  # the tolerance; measured 1.1e-5 (gradients)
    for u, w in zip(g5, g0):
        assert _rel(u - u.mean(), w - w.mean()) <= 1e-4


def test_auto_picks_multiscale_where_geomloss_does(monkeypatch):
    """backend='auto' runs coarse-to-fine for one pair of CPU clouds, D <= 3, p = 2, N M above the threshold,
    blur <= diameter / 20 (the same call as backend='multiscale'), and the single-scale engines otherwise."""
    import flashot.samples_loss as SL

    monkeypatch.setattr(SL, "AUTO_MULTISCALE_PAIRS", 900 * 800)
    x, y = _blobs(900, 3, 7), _blobs(800, 3, 8, centers=((0.5, 0.0, 0.0), (3.0, -0.5, 0.0)), spread=(0.2, 0.1))
    auto = flashot.SamplesLoss(blur=0.05)
    v = auto(x, y)
    assert auto.last_multiscale is not None
    assert float(v) == float(flashot.SamplesLoss(blur=0.05, backend="multiscale")(x, y))
    single = float(flashot.SamplesLoss(blur=0.05, backend="cpu")(x, y))
    assert abs(float(v) - single) <= 1e-2 * abs(single)  # GeomLoss' coarse-to-fine trajectory
    unb = flashot.SamplesLoss(blur=0.05, reach=1.0)  # unbalanced too, as GeomLoss
    assert float(unb(x, y)) == float(flashot.SamplesLoss(blur=0.05, reach=1.0, backend="multiscale")(x, y))
    assert unb.last_multiscale is not None
    not_picked = [
        (dict(blur=0.05), (x[:-1], y)),  # N M below the threshold
        (dict(blur=1.0), (x, y)),  # blur > diameter / 20
        (dict(blur=0.05, p=1), (x, y)),
        (dict(blur=0.05, reach_x=1.0, reach_y=2.0), (x, y)),  # debiased two-sided self problems
        (dict(blur=0.05), (torch.cat([x, x[:, :1]], 1), torch.cat([y, y[:, :1]], 1))),  # D = 4
        (dict(blur=0.05), (x.expand(2, -1, -1), y.expand(2, -1, -1))),  # a batch
    ]
    for kw, args in not_picked:
        L = flashot.SamplesLoss(**kw)
        L(*args)
        assert L.last_multiscale is None, kw


# --- solve_sample(backend="multiscale") ------------------------------------------------------------
@pytest.mark.parametrize("cost, reg", [("sqeuclidean", 0.05), ("half_sqeuclidean", 0.02)])
def test_solve_sample_multiscale_matches_the_cpu_engine(cost, reg):
    """POT-style solve coarse-to-fine, then to tol on the pruned points: the value, potentials, marginals and
    gradients of the converged solve match the single-scale cpu engine (float64)."""
    x, y = _blobs(1200, 3, 7), _blobs(1000, 3, 8, centers=((0.5, 0.0, 0.0), (3.0, -0.5, 0.0)), spread=(0.2, 0.1))
    g = torch.Generator().manual_seed(3)
    a, b = torch.rand(1200, generator=g, dtype=F64) + 0.2, torch.rand(1000, generator=g, dtype=F64) + 0.2
    # half the mass on each component of both clouds (else mass must cross a gap of ~3 at reg = 0.05:
    # Sinkhorn then stalls for any engine)
    a = torch.cat([a[:600] / a[:600].sum(), a[600:] / a[600:].sum()]) / 2
    b = torch.cat([b[:500] / b[:500].sum(), b[500:] / b[500:].sum()]) / 2
    out = {}
    for backend in ("multiscale", "cpu"):
        xs = x.clone().requires_grad_()
        r = flashot.solve_sample(xs, y, a, b, reg=reg, cost=cost, backend=backend, tol=1e-10, max_iter=2000)
        assert r.converged, backend
        (gx,) = torch.autograd.grad(r.value, xs)
        out[backend] = (r, gx)
    (r, gx), (r0, gx0) = out["multiscale"], out["cpu"]
    assert r.backend == "multiscale" and r.multiscale.kept[-1] < 0.9
    assert abs(float((r.value - r0.value).detach())) <= 1e-6 * abs(float(r0.value.detach()))
    # (potentials: defined up to a constant per separated component here; the plan is compared instead)
    assert _rel(gx, gx0) <= 1e-4
    # the plan in the inputs' order: marginals by plan products on the pruned blocks, and the dense plan
    ra = (r.plan @ torch.ones(1000, 1, dtype=F64)).squeeze(-1)
    assert float((ra - a).abs().sum()) <= 1e-8
    P, P0 = r.plan.to_dense(), r0.plan.to_dense()
    assert float((P - P0).abs().sum()) <= 1e-4


@pytest.mark.parametrize("unbalanced", [1.0, (None, 0.5)])
def test_solve_sample_multiscale_unbalanced_matches_the_cpu_engine(unbalanced):
    """POT's unbalanced (KL) solve, both sides or one, coarse-to-fine then to tol on the pruned points: value,
    marginals and gradients of the converged solve match the cpu engine (float64)."""
    x, y = _blobs(1000, 3, 7), _blobs(800, 3, 8, centers=((0.5, 0.0, 0.0), (3.0, -0.5, 0.0)), spread=(0.2, 0.1))
    a, b = torch.full((1000,), 1 / 1000, dtype=F64), torch.full((800,), 1.5 / 800, dtype=F64)
    out = {}
    for backend in ("multiscale", "cpu"):
        xs = x.clone().requires_grad_()
        r = flashot.solve_sample(
            xs, y, a, b, reg=0.02, backend=backend, unbalanced=unbalanced, tol=1e-11, max_iter=3000
        )
        assert r.converged, backend
        out[backend] = (r, torch.autograd.grad(r.value, xs)[0])
    (r, gx), (r0, gx0) = out["multiscale"], out["cpu"]
    assert r.multiscale.kept[-1] < 0.5
    assert abs(float((r.value - r0.value).detach())) <= 1e-6 * abs(float(r0.value.detach()))
    assert _rel(gx, gx0) <= 1e-4
    one = torch.ones(800, 1, dtype=F64)
    assert _rel((r.plan @ one).squeeze(-1), (r0.plan @ one).squeeze(-1)) <= 1e-4


def test_solve_sample_multiscale_refusals():
    x, y = torch.randn(50, 3, dtype=F64), torch.randn(40, 3, dtype=F64)
    for kw, exc, match in [
        (dict(acceleration=flashot.Momentum(1.5)), NotImplementedError, "acceleration"),
        (
            dict(potentials_init=(torch.zeros(50, dtype=F64), torch.zeros(40, dtype=F64))),
            NotImplementedError,
            "potentials_init",
        ),
        (dict(truncate=-1.0), ValueError, "truncate"),
    ]:
        with pytest.raises(exc, match=match):
            flashot.solve_sample(x, y, reg=0.1, backend="multiscale", **kw)
    with pytest.raises(NotImplementedError, match="batch"):
        flashot.solve_sample(x.expand(2, -1, -1), y.expand(2, -1, -1), reg=0.1, backend="multiscale")
    with pytest.raises(ValueError, match="cluster_scale"):
        flashot.solve_sample(x, y, reg=0.1, cluster_scale=0.1)
    with pytest.raises(ValueError, match="truncate"):  # a multiscale option given to another engine
        flashot.solve_sample(x, y, reg=0.1, truncate=3.0)
    with pytest.raises(TypeError, match="truncate"):
        flashot.solve_sample(x, y, reg=0.1, truncate="5")


def test_native_plan_product_fallback_redoes_only_the_clusters_of_bad_rows(monkeypatch):
    """One row cluster's plan mass is e^-80 (below 2^-75 in float32): only that cluster is redone in two passes
    (its rows' two-pass calls see that cluster alone), and every row matches the masked dense float64 product."""
    import flashot.ops.blocksparse_cpu as BS

    xs, ys, pat, mask = _pattern_case(seed=5)
    xf, yf = xs.float(), ys.float()
    eng = BlockSparseEngine([(xf, yf, pat)])
    cost, eps = get_cost("sqeuclidean"), 0.05
    g = torch.Generator().manual_seed(2)
    hy, V = torch.randn(1, 180, generator=g, dtype=F64), torch.randn(1, 180, 3, generator=g, dtype=F64)
    C = cost.matrix(xs, ys)[0]
    S = torch.where(mask, hy[0][None] - C / eps, torch.tensor(-math.inf, dtype=F64))
    hx = -torch.logsumexp(S, -1)[None]
    k = 2  # the low-mass cluster
    lo, hi = int(pat.row_offsets[k]), int(pat.row_offsets[k + 1])
    hx[0, lo:hi] -= 80.0
    rows = []
    real = BS.plan_call
    monkeypatch.setattr(BS, "plan_call", lambda *a: rows.append((a[-1] is None, a[2].shape[1])) or real(*a))
    out = eng.plan_product(xf, yf, hx.float(), hy.float(), eps, V.float(), cost)[0].double()
    assert rows == [(True, 240), (False, hi - lo)]
    hx, hy, V = hx.float().double(), hy.float().double(), V.float().double()
    C = cost.matrix(xf.double(), yf.double())[0]
    P = torch.where(mask, torch.exp(hx[0][:, None] + hy[0][None] - C / eps), torch.zeros((), dtype=F64))
    ref = P @ V[0]
    for sl in (slice(lo, hi), slice(0, lo), slice(hi, None)):  # each part against its own scale
        assert float((out[sl] - ref[sl]).abs().max() / ref[sl].abs().max()) < 2e-5, sl


def test_block_and_coarse_scales_halve_to_their_limits():
    """On a regular 100 x 100 grid of spacing 0.01 (cells of side s: about (1 / s)^2 occupied): the fine blocks
    stop halving at 64 points a cell or a quarter of the radius, the coarse cells at ``max_cells`` or a
    quarter of the radius, whichever comes first; the coarse cells go finer than the blocks when the
    blocks are held by their points."""
    from flashot.clusters import block_scale, coarse_scale, occupied_cells

    g = torch.stack(torch.meshgrid(torch.arange(100.0), torch.arange(100.0), indexing="ij"), -1).reshape(-1, 2)
    x = torch.cat([(g + 0.5) * 0.01, torch.zeros(10_000, 1)], 1).double()
    assert occupied_cells(x, 0.1) == 100 and occupied_cells(x, 0.025) == 1600
    assert block_scale(x, x, 0.4, radius=0.01) == 0.1  # 0.05 would hold 25 points a cell
    assert block_scale(x, x, 0.4, radius=0.8) == 0.2  # a quarter of the radius (0.1 would hold 100 points)
    assert coarse_scale(x, x, 0.4, radius=0.01, max_cells=5000) == 0.025  # 6,400 cells at 0.0125
    assert coarse_scale(x, x, 0.4, radius=0.2, max_cells=5000) == 0.05  # a quarter of the radius
    assert coarse_scale(x, x, 0.1, radius=0.01, max_cells=50) == 0.1  # 400 cells at 0.05


def test_converged_is_a_promise_about_the_returned_plan():
    """Issue 34, item 2: with tol the pruning margin is raised to log(1 / tol), so a solve reported converged
    returns a plan whose full (dense) marginals meet tol, and plan @ 1 agrees with them (truncate=5 alone:
    8.6e-5 L1 at tol = 1e-6, and 4.3e-5 between plan @ 1 and the dense row sums)."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(300, 3, generator=g, dtype=torch.float64)
    y = torch.rand(250, 3, generator=g, dtype=torch.float64)
    res = flashot.solve_sample(x, y, reg=0.01, tol=1e-6, backend="multiscale")
    assert res.converged
    P = res.plan.to_dense()
    a, b = torch.full((300,), 1 / 300, dtype=torch.float64), torch.full((250,), 1 / 250, dtype=torch.float64)
    assert float((P.sum(1) - a).abs().sum() + (P.sum(0) - b).abs().sum()) < 2e-6
    assert float((res.plan @ torch.ones(250, dtype=torch.float64) - P.sum(1)).abs().max()) < 1e-8
