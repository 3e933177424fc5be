r"""Coarse-to-fine Sinkhorn with block-sparse fine iterations (GeomLoss' ``backend="multiscale"``).

1. Both clouds are clustered on a voxel grid of side ``cluster_scale`` (:mod:`flashot.clusters`;
   default ``diameter / (sqrt(D) 2000^(1/D))`` as GeomLoss) and sorted by cluster.
2. The epsilon-scaling runs on the cluster centroids with the cluster weights while
   ``eps >= cluster_scale^p`` (GeomLoss' jump rule), with the ordinary engines.
3. The coarse potentials are extrapolated to the points (one softmin against the centroids),
   and the blocks ``(I, J)`` of clusters are pruned: a block is kept when the lower bound
   :math:`\underline{C}_{IJ} - \max_{i \in I} f_i - \max_{j \in J} g_j` of
   :math:`C(x_i, y_j) - f_i - g_j` over the block is at most ``truncate * eps`` (GeomLoss'
   ``truncate``, default 5), :math:`\underline{C}_{IJ}` being the cost of the gap between the
   clusters' balls (:func:`~flashot.clusters.block_cost_bounds`).  A dropped entry thus has
   :math:`P_{ij} < a_i b_j e^{-\mathrm{truncate}}`.  Each row and column cluster keeps at least
   its best block.  The debiasing problems are pruned alike (``f_aa``, ``g_bb``).
4. The rest of the schedule runs on the points with the block-sparse engine
   (:mod:`flashot.ops.blocksparse`), and the pruning is refreshed from the current potentials
   at every temperature (it can only tighten as eps decreases).

The returned fine :class:`~flashot.measures.Measures` hold the sorted clouds (gathered from the
inputs, so gradients flow back to them) and the engine of the last pruning: the final step,
values and gradients are those of the ordinary solver on the pruned plan.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from .clusters import Clusters, block_cost_bounds, block_scale, cluster, default_cluster_scale
from .measures import Measures, log_weights
from .ops import softmin as ops_softmin
from .ops.blocksparse import BlockPattern, BlockSparseEngine
from .solver import SinkhornState, sinkhorn_loop


@dataclass(frozen=True)
class MultiscaleConfig:
    """GeomLoss' multiscale options: ``cluster_scale`` (None: from the diameter and the dimension) and
    ``truncate`` (pruning margin in units of eps; None keeps every block)."""

    cluster_scale: float | None = None
    truncate: float | None = 5.0


@dataclass
class MultiscaleRun:
    """What a multiscale solve leaves behind: the fine measures (sorted clouds, last engine), the
    loop state, the clusterings, and the kept fraction of pairs (x-y problem) at each pruning."""

    m: Measures
    state: SinkhornState
    cx: Clusters
    cy: Clusters
    kept: list[float]
    jump: int  # index in eps_list of the last coarse temperature


def jump_index(eps_list: list[float], scale: float, p: int) -> int:
    """GeomLoss' rule: the coarse iterations stop before the first ``eps`` (from the third on) below
    ``cluster_scale^p``.  Where none is, GeomLoss jumps after the last iteration (the coarse-to-fine
    extrapolation is then its final step); here at least the last temperature runs on the points, so
    the final step is always the ordinary one on converging fine potentials."""
    for i, eps in enumerate(eps_list[2:]):
        if scale**p > eps:
            return i + 1
    return max(len(eps_list) - 2, 0)


def _segment_max(v: Tensor, c: Clusters) -> Tensor:
    """(K,) maximum of the sorted values ``v`` (N,) over each cluster."""
    cid = torch.repeat_interleave(torch.arange(c.n_clusters, device=v.device), c.sizes)
    return torch.full((c.n_clusters,), float("-inf"), dtype=v.dtype, device=v.device).scatter_reduce_(
        0, cid, v, "amax")


PRUNE_ROWS = 1024  # row clusters per chunk of lower bounds (memory O(PRUNE_ROWS Ky))


@dataclass(frozen=True)
class LinearModel:
    """``f_i = alpha_I + <beta_I, x_i - c_I> + r_i`` with ``|r_i| <= rho_I`` for every point of cluster ``I``
    (least-squares fit per cluster; the bound holds whatever the fit, ``rho`` being measured)."""

    alpha: Tensor  # (K,)
    beta: Tensor  # (K, D)
    rho: Tensor  # (K,)


def linear_model(c: Clusters, pts: Tensor, f: Tensor) -> LinearModel:
    """Fit :class:`LinearModel` to the values ``f`` (N,) of the sorted points ``pts`` (N, D), float64."""
    with torch.no_grad():
        K, D = c.n_clusters, pts.shape[-1]
        cid = torch.repeat_interleave(torch.arange(K, device=pts.device), c.sizes)
        A = torch.cat([torch.ones_like(pts[:, :1], dtype=torch.float64),
                       pts.double() - c.centroids.double()[cid]], -1)  # (N, D + 1)
        f = f.double()
        G = torch.zeros(K, D + 1, D + 1, dtype=torch.float64, device=pts.device).index_add_(
            0, cid, A.unsqueeze(-1) * A.unsqueeze(-2))
        r = torch.zeros(K, D + 1, dtype=torch.float64, device=pts.device).index_add_(0, cid, A * f.unsqueeze(-1))
        G = G + torch.diag_embed(1e-9 * (1.0 + G.diagonal(dim1=-2, dim2=-1)))  # singular blocks (few points)
        coef = torch.linalg.solve(G, r)
        res = (f - (A * coef[cid]).sum(-1)).abs()
        rho = torch.zeros(K, dtype=torch.float64, device=pts.device).scatter_reduce_(0, cid, res, "amax")
        return LinearModel(coef[:, 0], coef[:, 1:], rho)


def _linear_bounds(cx: Clusters, cy: Clusters, mf: LinearModel, mg: LinearModel, s: float, rows: slice) -> Tensor:
    r"""Lower bounds of ``s |x_i - y_j|^2 - f_i - g_j`` over blocks, from the linear models: with
    ``x_i = c_I + a``, ``y_j = c_J + b``, ``d = c_I - c_J``,
    :math:`s|d + a - b|^2 - \langleeta, aangle - \langle\gamma, bangle = s|d + a - b - eta/2s|^2
    + \langleeta, dangle - |eta|^2/4s - \langleeta + \gamma, bangle`, bounded with ``|a - b| <=
    r_I + r_J`` and ``|b| <= r_J`` (and the same with the roles swapped; the larger bound is kept).
    Exact up to the radii for a transport by translation, where ``f`` and ``g`` are affine."""
    cI, cJ = cx.centroids[rows].double(), cy.centroids.double()
    rI, rJ = cx.radius[rows].double(), cy.radius.double()
    b, gm = mf.beta[rows], mg.beta
    base = -(mf.alpha[rows] + mf.rho[rows]).unsqueeze(-1) - (mg.alpha + mg.rho).unsqueeze(0)
    bb, gg = (b * b).sum(-1), (gm * gm).sum(-1)
    bg = (bb.unsqueeze(-1) + gg.unsqueeze(0) + 2.0 * b @ gm.T).clamp_min(0.0).sqrt()  # |beta_I + gamma_J|
    rr = rI.unsqueeze(-1) + rJ.unsqueeze(0)
    gap1 = (torch.cdist(cI - b / (2 * s), cJ) - rr).clamp_min(0.0)
    t1 = s * gap1 * gap1 + ((b * cI).sum(-1).unsqueeze(-1) - b @ cJ.T) - (bb / (4 * s)).unsqueeze(-1) - bg * rJ
    gap2 = (torch.cdist(cI, cJ - gm / (2 * s)) - rr).clamp_min(0.0)
    t2 = (s * gap2 * gap2 + ((gm * cJ).sum(-1).unsqueeze(0) - cI @ gm.T) - (gg / (4 * s)).unsqueeze(0)
          - bg * rI.unsqueeze(-1))
    return base + torch.maximum(t1, t2)


def prune(cx: Clusters, cy: Clusters, f: Tensor, g: Tensor, eps: float, truncate: float | None, cost,
          x: Tensor | None = None, y: Tensor | None = None) -> Tensor:
    """(Kx, Ky) kept blocks: a lower bound of ``C(x_i, y_j) - f_i - g_j`` over the block at most
    ``truncate * eps``, plus each row's and column's best block.  The bound is the larger of
    ``block_cost_bounds - max_I f - max_J g`` and, for dot-product costs with the sorted points ``x``, ``y``
    given, :func:`_linear_bounds` (much tighter where the potentials vary across a block); computed by
    chunks of rows."""
    Kx, Ky = cx.n_clusters, cy.n_clusters
    if truncate is None:
        return torch.ones(Kx, Ky, dtype=torch.bool, device=f.device)
    fmax, gmax = _segment_max(f.double(), cx), _segment_max(g.double(), cy)
    models = None
    if cost.is_dot and x is not None and y is not None:
        models = linear_model(cx, x, f), linear_model(cy, y, g)
    keep = torch.empty(Kx, Ky, dtype=torch.bool, device=f.device)
    best_col = torch.full((Ky,), float("inf"), dtype=torch.float64, device=f.device)
    best_row = torch.zeros(Ky, dtype=torch.long, device=f.device)
    for r0 in range(0, Kx, PRUNE_ROWS):
        r1 = min(Kx, r0 + PRUNE_ROWS)
        gap = block_cost_bounds(cx, cy, cost, rows=slice(r0, r1)) - fmax[r0:r1, None] - gmax[None]
        if models is not None:
            gap = torch.maximum(gap, _linear_bounds(cx, cy, *models, cost.scale, slice(r0, r1)))
        keep[r0:r1] = gap <= truncate * eps
        keep[torch.arange(r0, r1), gap.argmin(1)] = True
        cmin, arg = gap.min(0)
        better = cmin < best_col
        best_col = torch.where(better, cmin, best_col)
        best_row = torch.where(better, arg + r0, best_row)
    keep[best_row, torch.arange(Ky)] = True
    return keep


def _prune_radius(cost, eps: float, truncate: float | None) -> float:
    """Distance below which a pair is never pruned at temperature ``eps`` (``C <= truncate * eps``)."""
    if truncate is None:
        return float("inf")
    c = truncate * eps
    return (c / cost.scale) ** 0.5 if cost.is_dot else c


def _coarse_measures(m: Measures, cx: Clusters, cy: Clusters) -> Measures:
    """The centroids with the cluster weights, on the engine ``auto`` picks for their size."""
    return Measures.build(cx.centroids, cy.centroids, cx.weights, cy.weights, cost=m.cost, backend="auto")


def _extrapolate(pts: Tensor, centroids: Tensor, w_log: Tensor, pot: Tensor, eps: float, lam: float, cost) -> Tensor:
    """Fine potential from a coarse one: ``lam * softmin_J (log w_J + pot_J / eps)`` at the points."""
    with torch.no_grad():
        return lam * ops_softmin(pts, centroids, w_log + pot / eps, eps, cost=cost, backend="tiled")


def multiscale_loop(m: Measures, eps_list: list[float], p: int, cfg: MultiscaleConfig, *, debias: bool,
                    diameter: float, labels: tuple[Tensor | None, Tensor | None] = (None, None),
                    verbose: bool = False) -> MultiscaleRun:
    """Run GeomLoss' symmetric, debiased-or-not schedule ``eps_list`` coarse-to-fine on ``m`` (B = 1)."""
    D = m.x.shape[-1]
    scale = cfg.cluster_scale if cfg.cluster_scale is not None else default_cluster_scale(diameter, D)
    x, y = m.x[0], m.y[0]
    cx, cy = cluster(x, m.a[0], scale, labels[0]), cluster(y, m.b[0], scale, labels[1])
    jump = jump_index(eps_list, scale, p)
    mc = _coarse_measures(m, cx, cy)
    st = sinkhorn_loop(mc, eps_list[: jump + 1], symmetric=True, debias=debias, verbose=verbose)
    # the fine stage prunes blocks that can be smaller than the coarse clusters (given labels: the same)
    if labels[0] is None and labels[1] is None:
        radius = _prune_radius(m.cost, eps_list[-1], cfg.truncate)
        bs = block_scale(x.detach(), y.detach(), scale, radius)
        if bs < scale:
            cx, cy = cluster(x, m.a[0], bs), cluster(y, m.b[0], bs)
    fine = _fine_measures(m, cx, cy)
    eps = eps_list[jump]  # the last coarse temperature (eps_list[-1] when no fine iteration follows)
    state = replace(_extrapolated_state(fine, mc, cx, cy, st, eps, debias), eps=eps)
    kept: list[float] = []
    tail = eps_list[jump + 1:]
    for level in sorted(set(tail), reverse=True) or [eps]:
        # pruned with the margin of the temperature the potentials were computed at (the larger one)
        fine = _with_patterns(fine, cx, cy, state, max(state.eps, level), cfg.truncate, debias, kept)
        if not tail:  # extrapolation only: the final step reads the potentials at this temperature
            break
        steps = [e for e in tail if e == level]
        state = sinkhorn_loop(fine, steps, symmetric=True, debias=debias, init=(state.f, state.g),
                              init_self=(state.f_aa, state.g_bb) if debias else None)
    return MultiscaleRun(fine, replace(state, eps=eps_list[-1]), cx, cy, kept, jump)


def _fine_measures(m: Measures, cx: Clusters, cy: Clusters) -> Measures:
    """``m`` with both clouds (and weights) sorted by cluster; gathers keep the autograd history."""
    x, y = m.x[:, cx.perm].contiguous(), m.y[:, cy.perm].contiguous()
    a, b = m.a[:, cx.perm], m.b[:, cy.perm]
    return replace(m, x=x, y=y, a=a, b=b, a_log=log_weights(a), b_log=log_weights(b))


def _extrapolated_state(fine: Measures, mc: Measures, cx, cy, st: SinkhornState, eps: float,
                        debias: bool) -> SinkhornState:
    """Coarse potentials (cluster centroids) carried to the sorted points."""
    cost = fine.cost
    x, y = fine.x.detach(), fine.y.detach()
    xc, yc = mc.x.detach() + mc.center, mc.y.detach() + mc.center  # back in fine's coordinates
    f = _extrapolate(x, yc, mc.b_log, st.g, eps, 1.0, cost)
    g = _extrapolate(y, xc, mc.a_log, st.f, eps, 1.0, cost)
    f_aa = g_bb = None
    if debias:
        f_aa = _extrapolate(x, xc, mc.a_log, st.f_aa, eps, 1.0, cost)
        g_bb = _extrapolate(y, yc, mc.b_log, st.g_bb, eps, 1.0, cost)
    return replace(st, f=f, g=g, f_aa=f_aa, g_bb=g_bb)


def _with_patterns(fine: Measures, cx, cy, st: SinkhornState, eps: float, truncate, debias: bool,
                   kept: list[float]) -> Measures:
    """``fine`` on a block-sparse engine pruned from the potentials of ``st`` at temperature ``eps``."""
    x, y, cost = fine.x.detach(), fine.y.detach(), fine.cost
    x0, y0 = x[0], y[0]
    pxy = BlockPattern(cx.offsets, cy.offsets, prune(cx, cy, st.f[0], st.g[0], eps, truncate, cost, x0, y0))
    pats = [(x, y, pxy), (y, x, pxy.T)]
    if debias:
        kxx = prune(cx, cx, st.f_aa[0], st.f_aa[0], eps, truncate, cost, x0, x0)
        kyy = prune(cy, cy, st.g_bb[0], st.g_bb[0], eps, truncate, cost, y0, y0)
        pats.append((x, x, BlockPattern(cx.offsets, cx.offsets, kxx)))
        pats.append((y, y, BlockPattern(cy.offsets, cy.offsets, kyy)))
    kept.append(pxy.fraction)
    return replace(fine, engine=BlockSparseEngine(pats))
