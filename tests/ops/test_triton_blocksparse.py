"""The Triton block-sparse kernels (the multiscale engine's primitives on a GPU) on the CPU via the
Triton interpreter, against an explicit masked dense computation in float64.

Reference: the full n x m cost matrix, scores ``h_j - C_ij / eps`` set to ``-inf`` outside the kept
blocks, then a LogSumExp (softmin) or ``exp(alpha_i + S_ij) W_ij @ V`` (plan products).  Tolerances
(max |error| relative to max |reference|): float64 1e-12 (observed ~1e-15), float32 points 2e-5.
Clusters of uneven sizes, one larger than two 32-row tiles, one empty, kept column runs of several
clusters; d = 3 (coordinate differences), 20 (one ``tl.dot`` chunk) and 40 (chunked feature axis).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

pytest.importorskip("triton")

from flashot.costs import get_cost
from flashot.ops.blocksparse import BlockPattern
from flashot.ops.triton import TritonEngine
from flashot.ops.triton.blocksparse import BlockLists

ROW_SIZES = [5, 70, 0, 17, 33, 1]
COL_SIZES = [12, 3, 40, 9, 30]


def offsets(sizes: list[int]) -> torch.Tensor:
    return torch.tensor([0] + sizes).cumsum(0)


def problem(D: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    N, M = sum(ROW_SIZES), sum(COL_SIZES)
    x = (torch.rand(1, N, D, generator=g, dtype=torch.float64) - 0.5).to(dtype)
    y = (torch.rand(1, M, D, generator=g, dtype=torch.float64) - 0.4).to(dtype)
    keep = torch.rand(len(ROW_SIZES), len(COL_SIZES), generator=g) < 0.5
    keep[torch.arange(len(ROW_SIZES)), torch.arange(len(ROW_SIZES)) % len(COL_SIZES)] = True
    keep[1] = torch.tensor([True, True, False, True, True])  # runs of consecutive kept clusters
    pat = BlockPattern(offsets(ROW_SIZES), offsets(COL_SIZES), keep)
    h = torch.randn(1, M, generator=g, dtype=torch.float64)
    alpha = torch.randn(1, N, generator=g, dtype=torch.float64)
    V = torch.randn(1, M, 3, generator=g, dtype=torch.float64)
    return x, y, h, alpha, V, pat


def mask(pat: BlockPattern) -> torch.Tensor:
    ro, co = pat.row_offsets, pat.col_offsets
    rid = torch.repeat_interleave(torch.arange(len(ro) - 1), ro[1:] - ro[:-1])
    cid = torch.repeat_interleave(torch.arange(len(co) - 1), co[1:] - co[:-1])
    return pat.keep[rid][:, cid]


def dense_scores(x, y, h, eps, cost, pat):
    C = cost.matrix(x.double(), y.double())[0] if hasattr(cost, "matrix") else None
    if C is None:
        d2 = torch.cdist(x[0].double(), y[0].double()) ** 2
        C = d2 * cost.scale if cost.is_dot else d2.sqrt()
    S = torch.where(mask(pat), h[0] - C / eps, torch.tensor(float("-inf"), dtype=torch.float64))
    return S, C


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    return ((a - b).abs().max() / b.abs().max()).item()


TOL = {torch.float64: 1e-12, torch.float32: 2e-5}


@pytest.mark.parametrize("D", [3, 20, 40])
@pytest.mark.parametrize("cost_name", ["sqeuclidean", "euclidean"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_softmin_blocks_matches_masked_dense(D, cost_name, dtype):
    x, y, h, _, _, pat = problem(D, dtype)
    cost, eps = get_cost(cost_name), 0.05
    out = TritonEngine().softmin_blocks(x, y, h.to(dtype), eps, cost, BlockLists.of(pat, x.device))
    S, _ = dense_scores(x, y, h.to(dtype).double(), eps, cost, pat)
    ref = -eps * torch.logsumexp(S, -1)
    assert out.shape == (1, x.shape[1])
    assert rel(out[0], ref) < TOL[dtype]


@pytest.mark.parametrize("D", [3, 20])
@pytest.mark.parametrize("cost_name", ["sqeuclidean", "euclidean"])
@pytest.mark.parametrize("weight", ["plan", "cost", "dcost"])
def test_plan_product_blocks_matches_masked_dense(D, cost_name, weight):
    x, y, h, alpha, V, pat = problem(D, torch.float64, seed=1)
    cost, eps = get_cost(cost_name), 0.05
    out = TritonEngine().plan_product_blocks(x, y, alpha, h, eps, V, cost, BlockLists.of(pat, x.device), weight)
    S, C = dense_scores(x, y, h, eps, cost, pat)
    P = torch.exp(alpha[0, :, None] + S)
    if weight == "cost":
        P = P * C
    elif weight == "dcost":
        P = P * cost.dcost_weight(C)
    ref = P @ V[0]
    assert out.shape == (1, x.shape[1], 3)
    assert rel(out[0], ref) < TOL[torch.float64]


def test_tiles_cover_every_row_once():
    pat = problem(3, torch.float64)[-1]
    for bn in (16, 32, 64):
        t = BlockLists.of(pat, torch.device("cpu")).tiles(bn).view(-1, 3)
        assert ((t[:, 1] - t[:, 0]) <= bn).all() and ((t[:, 1] - t[:, 0]) > 0).all()
        covered = torch.cat([torch.arange(int(a), int(b)) for a, b, _ in t.tolist()])
        assert torch.equal(covered, torch.arange(sum(ROW_SIZES)))
        ro = pat.row_offsets
        assert all(ro[c] <= a and b <= ro[c + 1] for a, b, c in t.tolist())


def test_blocks_need_one_problem():
    x, y, h, _, _, pat = problem(3, torch.float64)
    with pytest.raises(ValueError, match=r"one problem, shape \(1, N, D\)"):
        TritonEngine().softmin_blocks(
            x.expand(2, -1, -1),
            y.expand(2, -1, -1),
            h.expand(2, -1),
            0.1,
            get_cost("sqeuclidean"),
            BlockLists.of(pat, x.device),
        )


# --- the multiscale engine on the Triton kernels ------------------------------------------------------
def _clustered(seed: int = 3):
    from flashot.clusters import cluster

    g = torch.Generator().manual_seed(seed)
    x = torch.cat(
        [
            torch.randn(150, 3, generator=g, dtype=torch.float64) * 0.3,
            torch.randn(90, 3, generator=g, dtype=torch.float64) * 0.05 + torch.tensor([3.0, 0.5, 0.0]),
        ]
    )
    y = torch.randn(180, 3, generator=g, dtype=torch.float64) * 0.4
    cx, cy = (
        cluster(x, torch.ones(240, dtype=torch.float64), 0.6),
        cluster(y, torch.ones(180, dtype=torch.float64), 0.6),
    )
    keep = torch.rand(cx.n_clusters, cy.n_clusters, generator=g) < 0.3
    keep[torch.arange(cx.n_clusters), torch.randint(cy.n_clusters, (cx.n_clusters,), generator=g)] = True
    keep[torch.randint(cx.n_clusters, (cy.n_clusters,), generator=g), torch.arange(cy.n_clusters)] = True
    assert 4 <= cx.n_clusters <= 40 and not keep.all()
    xs, ys = x[cx.perm][None].contiguous(), y[cy.perm][None].contiguous()
    return xs, ys, BlockPattern(cx.offsets, cy.offsets, keep)


def test_engine_triton_path_equals_pytorch_path():
    """BlockSparseEngine(native="triton") against its PyTorch path: both directions, a row range of whole
    clusters (the distributed hook), and a plan product wider than the C++ kernels take (K = 6)."""
    from flashot.ops.blocksparse import BlockSparseEngine

    xs, ys, pat = _clustered()
    pairs = [(xs, ys, pat), (ys, xs, pat.T)]
    tri, ref = BlockSparseEngine(pairs, native="triton"), BlockSparseEngine(pairs, native=False)
    assert tri._triton is not None and tri._lib is None
    cost, eps = get_cost("sqeuclidean"), 0.05
    g = torch.Generator().manual_seed(1)
    hy, hx = (
        torch.randn(1, 180, generator=g, dtype=torch.float64),
        torch.randn(1, 240, generator=g, dtype=torch.float64),
    )
    V = torch.randn(1, 180, 6, generator=g, dtype=torch.float64)
    assert rel(tri.softmin(xs, ys, hy, eps, cost)[0], ref.softmin(xs, ys, hy, eps, cost)[0]) < 1e-12
    assert rel(tri.softmin(ys, xs, hx, eps, cost)[0], ref.softmin(ys, xs, hx, eps, cost)[0]) < 1e-12
    for weight in ("plan", "cost", "dcost"):
        assert (
            rel(
                tri.plan_product(xs, ys, hx, hy, eps, V, cost, weight)[0],
                ref.plan_product(xs, ys, hx, hy, eps, V, cost, weight)[0],
            )
            < 1e-12
        )
    lo, hi = tri.row_bounds(xs, ys, 2)[1]
    assert (
        rel(tri.softmin(xs, ys, hy, eps, cost, rows=(lo, hi))[0], ref.softmin(xs, ys, hy, eps, cost)[0, lo:hi]) < 1e-12
    )
    assert (
        rel(
            tri.plan_product(xs, ys, hx, hy, eps, V, cost, rows=(lo, hi))[0],
            ref.plan_product(xs, ys, hx, hy, eps, V, cost)[0, lo:hi],
        )
        < 1e-12
    )


def test_samples_loss_multiscale_on_triton_kernels(monkeypatch):
    """A whole SamplesLoss(backend="multiscale") value and gradient with every block-sparse primitive on
    the Triton kernels (FLASHOT_BLOCKSPARSE=triton) equals the default (C++) run: float64, 1e-10."""
    import flashot
    import flashot.ops.blocksparse as BS

    g = torch.Generator().manual_seed(5)
    x = torch.rand(150, 1, generator=g, dtype=torch.float64) * 10  # 1-D: few, full clusters (the interpreter
    y = torch.rand(130, 1, generator=g, dtype=torch.float64) * 8 + 1  # runs one program per row tile)

    def run():
        xx = x.clone().requires_grad_(True)
        L = flashot.SamplesLoss(p=2, blur=0.1, scaling=0.5, backend="multiscale", cluster_scale=1.0)
        val = L(xx, y)
        (gx,) = torch.autograd.grad(val, xx)
        return val.detach(), gx, L.last_multiscale.kept

    calls = {"n": 0}
    real = BS._triton_engine

    def counting():
        eng = real()
        for name in ("softmin_blocks", "plan_product_blocks"):
            fn = getattr(eng, name)

            def wrapped(*a, _fn=fn, **k):
                calls["n"] += 1
                return _fn(*a, **k)

            setattr(eng, name, wrapped)
        return eng

    # the Triton engine has no fused steps, so no sub-tile pruning inside kept blocks: compare without it
    monkeypatch.setattr(flashot.multiscale.fine, "TILE_PRUNING", False)
    v0, g0, kept0 = run()
    monkeypatch.setenv("FLASHOT_BLOCKSPARSE", "triton")
    monkeypatch.setattr(BS, "_triton_engine", counting)
    v1, g1, kept1 = run()
    assert calls["n"] > 10  # the fine stage really ran on the Triton kernels
    assert min(kept0) < 0.9 and kept0 == kept1  # blocks were pruned, identically
    assert abs(float(v1 - v0)) <= 1e-10 * abs(float(v0))
    assert rel(g1, g0) < 1e-10


def test_blocksparse_kernels_env_is_checked(monkeypatch):
    from flashot.ops.blocksparse import BlockSparseEngine

    xs, ys, pat = _clustered()
    monkeypatch.setenv("FLASHOT_BLOCKSPARSE", "cuda")
    with pytest.raises(ValueError, match="FLASHOT_BLOCKSPARSE: expected 'torch' or 'triton'"):
        BlockSparseEngine([(xs, ys, pat)])
    monkeypatch.setenv("FLASHOT_BLOCKSPARSE", "torch")
    eng = BlockSparseEngine([(xs, ys, pat)])
    assert eng._lib is None and eng._triton is None
    with pytest.raises(ValueError, match="native: expected True, False or 'triton'"):
        BlockSparseEngine([(xs, ys, pat)], native="cuda")
