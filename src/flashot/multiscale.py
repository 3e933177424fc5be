r"""Coarse-to-fine Sinkhorn with block-sparse fine iterations (GeomLoss' ``backend="multiscale"``).

1. Both clouds are clustered on a voxel grid of side ``cluster_scale`` (:mod:`flashot.clusters`)
   and sorted by cluster.  The fine blocks: GeomLoss' default ``diameter / (sqrt(D) 2000^(1/D))``
   halved while the cells stay wider than a quarter of the last temperature's pruning radius and
   hold >= 64 points on average (:func:`~flashot.clusters.block_scale`): large clouds get finer
   blocks.  The coarse stage, by default: those blocks halved further while both clouds occupy at
   most 10,000 cells (:func:`~flashot.clusters.coarse_scale`), so it jumps to the points later.  A
   given ``cluster_scale`` is GeomLoss' (the coarse stage's); the fine blocks may still be halved
   from it.
2. The epsilon-scaling runs on the cluster centroids with the cluster weights while
   ``eps >= cluster_scale^p`` (GeomLoss' jump rule), with the ordinary engines.
3. The coarse potentials are extrapolated to the points (one softmin against the centroids, on the CPU
   over the groups of centroids that a bound keeps for each fine cluster: :func:`_extrapolate_pruned`),
   and the blocks ``(I, J)`` of clusters are pruned: a block is kept when a lower bound of
   :math:`C(x_i, y_j) - f_i - g_j` over the block is at most ``truncate * eps`` (GeomLoss'
   ``truncate``, default 5) at the temperature about to run (:class:`BlockBounds`: the cost of
   the gap between the clusters' balls minus the potentials' maxima, or, tighter, a bound from a
   linear fit of the potentials over each cluster).  A dropped entry thus has
   :math:`P_{ij} < a_i b_j e^{-\mathrm{truncate}}`.  Each row and column cluster keeps at least
   its best block.  The debiasing problems are pruned alike (``f_aa``, ``g_bb``).
4. The rest of the schedule runs on the points with the block-sparse engine
   (:mod:`flashot.ops.blocksparse`).  On the CPU kernels its fused steps also skip, inside the kept
   blocks, the tiles (a panel of rows x 64 columns; points sorted in a finer Morton order inside their
   cluster, ``SUB_LEVELS``) where the same rule holds for the potentials of the call, its inputs or (bounded
   from sampled points) its outputs (the same linear-model bound, per panel and chunk)
   (:mod:`flashot.ops.tile_rule`), and the final step returns the barycentres its
   gradient needs (:func:`flashot.solver.final_values`): no plan product.  After each temperature the bounds are recomputed from the
   new potentials: where they would keep a block that was dropped, that temperature runs again
   on the union, so the rule holds for the potentials that come out, not only for those that
   went in.  The next temperature prunes from the same bounds with its own (smaller) margin.
5. Above ~2,000 clusters a side, the bounds are computed coarse-to-fine: the fine clusters are
   runs of coarser Morton cells (:func:`~flashot.clusters.coarsen`), the coarse blocks are
   pruned first and only the fine blocks inside kept coarse ones are bounded, in the C++
   kernels (``prune.h``) where they load.

The returned fine :class:`~flashot.measures.Measures` hold the sorted clouds (gathered from the
inputs, so gradients flow back to them) and the engine of the last pruning: the final step,
values and gradients are those of the ordinary solver on the pruned plan.

Distributed (``group``, replicated mode: every rank holds all the points): the coarse stage runs on
:class:`~flashot.distributed.ShardedEngine` (after :func:`~flashot.distributed.distribute_measures`
checks the centroids across ranks), and every fine engine is a ``ShardedEngine`` over the block-sparse
one, each rank computing a range of whole row clusters (balanced by kept pairs).  The extrapolation
to the points is row-sharded too.  Clustering and pruning run on every rank, on the same points and the
same all-gathered potentials, so every rank takes the same pruning decisions; the kept blocks enter the
checksum of every collective.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from .clusters import Clusters, block_scale, cluster, coarse_scale, coarsen, default_cluster_scale
from .measures import Measures, log_weights
from .ops import prepare_pair
from .ops import softmin as ops_softmin
from .ops.base import Engine, ForwardingEngine
from .ops.blocksparse import BlockPattern, BlockSparseEngine
from .ops.cpu import abi
from .ops.tile_rule import TilePruning
from .solver import SinkhornState, damping, sinkhorn_loop


def truncate_for(truncate: float | None, tol: float | None) -> float | None:
    """The pruning margin (units of eps) of a solve asked for ``tol``: at least ``log(1 / tol)``, so that the
    dropped entries of the plan (below ``e^-truncate a_i b_j``) stay within the tolerance that
    ``converged=True`` promises about the returned result (errors fall ~``e^-truncate``: docs/exactness.md)."""
    if truncate is None or tol is None:
        return truncate
    return max(truncate, math.log(1.0 / tol))


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
    hier: "_Hier | None" = None  # the fine clusterings and pruning hierarchies (continue_fine)
    bounds: "list[BlockBounds] | None" = None  # the bounds of the last state
    truncate: float | None = None
    group: Any = None  # the torch.distributed process group of a distributed solve (replicated mode), or None


def jump_index(eps_list: list[float], threshold: float) -> int:
    """GeomLoss' rule: the coarse iterations stop before the first ``eps`` (from the third on) below
    ``threshold`` (GeomLoss: ``cluster_scale^p`` for its costs ``|x - y|^p / p``; see
    :func:`_jump_threshold`).  Where none is, GeomLoss jumps after the last iteration (the coarse-to-fine
    extrapolation is then its final step); here at least the last temperature runs on the points, so
    the final step is always the ordinary one on converging fine potentials."""
    for i, eps in enumerate(eps_list[2:]):
        if threshold > eps:
            return i + 1
    return max(len(eps_list) - 2, 0)


def _jump_threshold(cost, scale: float, p: int) -> float:
    """GeomLoss' ``cluster_scale^p`` in the units of ``cost``: ``2 s scale^2`` for ``s |x - y|^2`` (GeomLoss'
    ``|x - y|^2 / 2`` gives ``scale^2``), ``scale`` for ``|x - y|``."""
    return scale**p * (2.0 * cost.scale if cost.is_dot else 1.0)


def _segment_max(v: Tensor, c: Clusters) -> Tensor:
    """(K,) maximum of the sorted values ``v`` (N,) over each cluster."""
    cid = torch.repeat_interleave(torch.arange(c.n_clusters, device=v.device), c.sizes)
    return torch.full((c.n_clusters,), float("-inf"), dtype=v.dtype, device=v.device).scatter_reduce_(
        0, cid, v, "amax")


@dataclass(frozen=True)
class LinearModel:
    """``f_i = alpha_I + <beta_I, x_i - c_I> + r_i`` with ``|r_i| <= rho_I`` for every point of cluster ``I``
    (least-squares fit per cluster; the bound holds whatever the fit, ``rho`` being measured)."""

    alpha: Tensor  # (K,)
    beta: Tensor  # (K, D)
    rho: Tensor  # (K,)


def _design(c: Clusters, pts: Tensor) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
    """The least-squares design of :func:`linear_model` for ``c`` and its sorted points: the cluster of each
    point, the rows ``[1, x_i - c_I]`` (N, D + 1) and the LU factors of each cluster's Gram matrix.
    It does not depend on the fitted values: cached on ``c`` per points tensor."""
    cache = c.__dict__.setdefault("_designs", {})
    key = (pts.data_ptr(), tuple(pts.shape), pts.dtype)
    if key not in cache:
        K, D = c.n_clusters, pts.shape[-1]
        cid = torch.repeat_interleave(torch.arange(K, device=pts.device), c.sizes)
        A = torch.cat([torch.ones_like(pts[:, :1], dtype=torch.float64),
                       pts.double() - c.centroids.double()[cid]], -1)
        G = torch.zeros(K, D + 1, D + 1, dtype=torch.float64, device=pts.device)
        for lo in range(0, A.shape[0], FIT_CHUNK):  # outer products by chunks: no (N, D + 1, D + 1) temporary
            Ac = A[lo:lo + FIT_CHUNK]
            G.index_add_(0, cid[lo:lo + FIT_CHUNK], Ac.unsqueeze(-1) * Ac.unsqueeze(-2))
        G = G + torch.diag_embed(1e-9 * (1.0 + G.diagonal(dim1=-2, dim2=-1)))  # singular blocks (few points)
        cache.clear()  # one points tensor at a time (the fine stage's)
        cache[key] = (cid, A, torch.linalg.lu_factor(G))
    return cache[key]


def linear_model(c: Clusters, pts: Tensor, f: Tensor) -> LinearModel:
    """Fit :class:`LinearModel` to the values ``f`` (N,) of the sorted points ``pts`` (N, D), float64."""
    with torch.no_grad():
        cid, A, lu = _design(c, pts.detach())
        f = f.double()
        r = torch.zeros(c.n_clusters, A.shape[1], dtype=torch.float64, device=pts.device)
        for lo in range(0, A.shape[0], FIT_CHUNK):  # chunks of points: temporaries of FIT_CHUNK rows
            sl = slice(lo, lo + FIT_CHUNK)
            r.index_add_(0, cid[sl], A[sl] * f[sl].unsqueeze(-1))
        coef = torch.linalg.lu_solve(*lu, r.unsqueeze(-1)).squeeze(-1)
        rho = torch.zeros(c.n_clusters, dtype=torch.float64, device=pts.device)
        for lo in range(0, A.shape[0], FIT_CHUNK):
            sl = slice(lo, lo + FIT_CHUNK)
            res = (f[sl] - (A[sl] * coef[cid[sl]]).sum(-1)).abs()
            rho.scatter_reduce_(0, cid[sl], res, "amax")
        return LinearModel(coef[:, 0], coef[:, 1:], rho)


@dataclass(frozen=True)
class _Terms:
    """Per-cluster terms of the block bounds of one side (float64): centroids ``c``, radii ``r``, the maxima
    ``m`` of the potential and, for dot-product costs (linear models), ``base = alpha + rho``, ``beta``,
    ``|beta|^2``, ``<beta, c>`` and ``c - beta / 2s``."""

    c: Tensor
    r: Tensor
    m: Tensor
    base: Tensor | None = None
    beta: Tensor | None = None
    bb: Tensor | None = None
    bc: Tensor | None = None
    shifted: Tensor | None = None

    @classmethod
    def build(cls, cl: Clusters, f: Tensor, pts: Tensor | None, s: float | None) -> "_Terms":
        c, r, m = cl.centroids.double(), cl.radius.double(), _segment_max(f.double(), cl)
        if pts is None or s is None:
            return cls(c, r, m)
        lm = linear_model(cl, pts, f)
        return cls(c, r, m, lm.alpha + lm.rho, lm.beta, (lm.beta * lm.beta).sum(-1), (lm.beta * c).sum(-1),
                   c - lm.beta / (2 * s))


def _linear_dense(X: _Terms, Y: _Terms, s: float) -> Tensor:
    r"""(Kx, Ky) lower bounds of ``s |x_i - y_j|^2 - f_i - g_j`` over blocks, from the linear models: with
    ``x_i = c_I + a``, ``y_j = c_J + b``, ``d = c_I - c_J``,
    :math:`s|d + a - b|^2 - \langle\beta, a\rangle - \langle\gamma, b\rangle = s|d + a - b - \beta/2s|^2
    + \langle\beta, d\rangle - |\beta|^2/4s - \langle\beta + \gamma, b\rangle`, bounded with ``|a - b| <=
    r_I + r_J`` and ``|b| <= r_J`` (and the same with the roles swapped; the larger bound is kept).
    Exact up to the radii for a transport by translation, where ``f`` and ``g`` are affine."""
    bg = (X.bb[:, None] + Y.bb[None] + 2.0 * X.beta @ Y.beta.T).clamp_min(0.0).sqrt()  # |beta_I + gamma_J|
    rr = X.r[:, None] + Y.r[None]
    gap1 = (torch.cdist(X.shifted, Y.c) - rr).clamp_min(0.0)
    t1 = s * gap1 * gap1 + (X.bc[:, None] - X.beta @ Y.c.T) - (X.bb / (4 * s))[:, None] - bg * Y.r[None]
    gap2 = (torch.cdist(X.c, Y.shifted) - rr).clamp_min(0.0)
    t2 = s * gap2 * gap2 + (Y.bc[None] - X.c @ Y.beta.T) - (Y.bb / (4 * s))[None] - bg * X.r[:, None]
    return -X.base[:, None] - Y.base[None] + torch.maximum(t1, t2)


def _linear_pairs(X: _Terms, Y: _Terms, s: float, I: Tensor, J: Tensor) -> Tensor:
    """:func:`_linear_dense` at the blocks ``(I[k], J[k])`` only."""
    bI, gJ, cI, cJ = X.beta[I], Y.beta[J], X.c[I], Y.c[J]
    bg = (bI + gJ).norm(dim=-1)
    rI, rJ = X.r[I], Y.r[J]
    rr = rI + rJ
    gap1 = ((X.shifted[I] - cJ).norm(dim=-1) - rr).clamp_min(0.0)
    t1 = s * gap1 * gap1 + X.bc[I] - (bI * cJ).sum(-1) - X.bb[I] / (4 * s) - bg * rJ
    gap2 = ((cI - Y.shifted[J]).norm(dim=-1) - rr).clamp_min(0.0)
    t2 = s * gap2 * gap2 + Y.bc[J] - (cI * gJ).sum(-1) - Y.bb[J] / (4 * s) - bg * rI
    return -X.base[I] - Y.base[J] + torch.maximum(t1, t2)


PRUNE_ROWS = 1024  # row clusters per chunk of dense bounds (memory O(PRUNE_ROWS Ky))
PRUNE_CHUNK = 1 << 22  # candidate blocks per chunk of sparse bounds
FLAT_ROWS = 16  # fine rows per task of the C++ pruning without a hierarchy
FIT_CHUNK = 1 << 16  # points per chunk of the linear-model fits (temporaries of FIT_CHUNK x (D + 1)^2 float64)


class BlockBounds:
    """Lower bounds of ``C(x_i, y_j) - f_i - g_j`` over the blocks ``(I, J)`` of two clusterings: the larger
    of the cost of the gap between the clusters' balls minus the maxima of the potentials, and (dot-product
    costs, sorted points given) the linear-model bound, much tighter where the potentials vary across a
    block.  Over every block, or with a pruning :class:`Hierarchy` over the fine blocks inside the coarse
    blocks kept at the margin given to :meth:`compute` (a coarse bound bounds each of its fine blocks, so
    no block below that margin is missed).  :meth:`keep` thresholds them: in the C++ kernels
    (``prune.h``) where they load, else in PyTorch."""

    def __init__(self, X: _Terms, Y: _Terms, cost, s: float | None, coarse: Tensor | None,
                 parents: "Hierarchy | None"):
        self.X, self.Y, self.cost, self.s, self.coarse, self.parents = X, Y, cost, s, coarse, parents
        self.Kx, self.Ky = X.c.shape[0], Y.c.shape[0]

    @classmethod
    def compute(cls, cx: Clusters, cy: Clusters, f: Tensor, g: Tensor, cost, x: Tensor | None = None,
                y: Tensor | None = None, parents: "Hierarchy | None" = None,
                margin: float = float("inf")) -> "BlockBounds":
        s = cost.scale if cost.is_dot and x is not None and y is not None else None
        X, Y = _Terms.build(cx, f, x, s), _Terms.build(cy, g, y, s)
        coarse = None
        if parents is not None:
            coarse = cls.compute(parents.cx, parents.cy, f, g, cost, x, y, margin=margin).keep(margin)
        return cls(X, Y, cost, s, coarse, parents)

    def keep(self, margin: float) -> Tensor:
        """(Kx, Ky) kept blocks: bound <= ``margin``, plus each row's and each column's best block."""
        lib = _cpu_lib() if self.X.c.device.type == "cpu" else None
        if lib is not None:
            return self._keep_native(lib, margin)
        if self.coarse is None:
            rows = [self._dense(slice(r0, r0 + PRUNE_ROWS)) for r0 in range(0, self.Kx, PRUNE_ROWS)]
            B = torch.cat(rows)
            keep = B <= margin
            keep[torch.arange(self.Kx, device=B.device), B.argmin(1)] = True
            keep[B.argmin(0), torch.arange(self.Ky, device=B.device)] = True
            return keep
        I, J = _children(self.coarse, self.parents.px, self.parents.py)
        bound = torch.cat([self._pairs(I[k:k + PRUNE_CHUNK], J[k:k + PRUNE_CHUNK])
                           for k in range(0, I.numel(), PRUNE_CHUNK)])
        keep = torch.zeros(self.Kx, self.Ky, dtype=torch.bool, device=bound.device)
        ok = bound <= margin
        keep[I[ok], J[ok]] = True
        for idx, K in ((I, self.Kx), (J, self.Ky)):
            best = torch.full((K,), float("inf"), dtype=bound.dtype, device=bound.device)
            best.scatter_reduce_(0, idx, bound, "amin")
            on = bound == best[idx]
            keep[I[on], J[on]] = True
        return keep

    def _packed(self, T: _Terms) -> Tensor:
        """The C++ kernel's rows ``[r, m, base, bb, bc, c, beta, u]`` (K, 5 + 3 D)."""
        K, D = T.c.shape
        if self.s is None:
            z = T.c.new_zeros(K)
            return torch.cat([T.r[:, None], T.m[:, None], z[:, None], z[:, None], z[:, None], T.c,
                              T.c.new_zeros(K, 2 * D)], 1).contiguous()
        return torch.cat([T.r[:, None], T.m[:, None], T.base[:, None], T.bb[:, None], T.bc[:, None], T.c, T.beta,
                          T.shifted], 1).contiguous()

    def _keep_native(self, lib, margin: float) -> Tensor:
        Kx, Ky, dev = self.Kx, self.Ky, self.X.c.device
        if self.coarse is None:  # one coarse column over everything, coarse rows of FLAT_ROWS fine rows
            px = torch.cat([torch.arange(0, Kx, FLAT_ROWS), torch.tensor([Kx])])
            py = torch.tensor([0, Ky])
            Kcx = px.numel() - 1
            cptr, ccols = torch.arange(Kcx + 1), torch.zeros(Kcx, dtype=torch.long)
        else:
            px, py = self.parents.px.cpu().contiguous(), self.parents.py.cpu().contiguous()
            Kcx = px.numel() - 1
            Ic, Jc = self.coarse.nonzero(as_tuple=True)
            cptr = torch.zeros(Kcx + 1, dtype=torch.long)
            cptr[1:] = torch.cumsum(torch.bincount(Ic, minlength=Kcx), 0)
            ccols = Jc.contiguous()
        X, Y = self._packed(self.X), self._packed(self.Y)
        keep = torch.zeros(Kx, Ky, dtype=torch.uint8, device=dev)
        if self.s is not None:
            kind, lin, sc, minsq = 1, 1, float(self.s), 0.0
        elif self.cost.is_dot:
            kind, lin, sc, minsq = 1, 0, float(self.cost.scale), 0.0
        else:
            kind, lin, sc, minsq = 0, 0, 1.0, float(self.cost.min_sqdist)
        args = abi.PruneArgs(X.data_ptr(), Y.data_ptr(), cptr.data_ptr(), ccols.data_ptr(), px.data_ptr(),
                             py.data_ptr(), keep.data_ptr(), Ky, Kcx, sc, minsq, float(margin), self.X.c.shape[1], kind,
                             lin, torch.get_num_threads())
        rc = abi.call(lib.flashot_block_keep, args)
        if rc != 0:
            raise RuntimeError(f"multiscale: block pruning kernel returned {rc}")
        return keep.bool()

    def _dense(self, rows: slice) -> Tensor:
        Xr = _Terms(*(None if t is None else t[rows] for t in vars(self.X).values()))
        Y = self.Y
        gap = (torch.cdist(Xr.c, Y.c) - Xr.r[:, None] - Y.r[None]).clamp_min(0.0)
        out = self.cost.from_sqdist(gap * gap) - Xr.m[:, None] - Y.m[None]
        return out if self.s is None else torch.maximum(out, _linear_dense(Xr, Y, self.s))

    def _pairs(self, I: Tensor, J: Tensor) -> Tensor:
        X, Y = self.X, self.Y
        gap = ((X.c[I] - Y.c[J]).norm(dim=-1) - X.r[I] - Y.r[J]).clamp_min(0.0)
        out = self.cost.from_sqdist(gap * gap) - X.m[I] - Y.m[J]
        return out if self.s is None else torch.maximum(out, _linear_pairs(X, Y, self.s, I, J))


def _cpu_lib():
    """The compiled CPU kernels (block pruning), or None (then PyTorch prunes); FLASHOT_PRUNE=torch forces
    PyTorch (tests compare both)."""
    import os

    if os.environ.get("FLASHOT_PRUNE") == "torch":
        return None
    from .ops.blocksparse_cpu import cpu_lib as load

    return load()


def _children(kept: Tensor, px: Tensor, py: Tensor) -> tuple[Tensor, Tensor]:
    """The fine blocks inside the kept coarse blocks: ``px`` / ``py`` (K + 1,) give each coarse
    cluster's run ``[p[k], p[k + 1])`` of fine clusters."""
    Ic, Jc = kept.nonzero(as_tuple=True)
    nx, ny = (px[1:] - px[:-1])[Ic], (py[1:] - py[:-1])[Jc]
    per = nx * ny
    pair = torch.repeat_interleave(torch.arange(Ic.numel(), device=kept.device), per)
    t = torch.arange(int(per.sum()), device=kept.device) - torch.repeat_interleave(torch.cumsum(per, 0) - per, per)
    return px[Ic][pair] + t // ny[pair], py[Jc][pair] + t % ny[pair]


def prune(cx: Clusters, cy: Clusters, f: Tensor, g: Tensor, eps: float, truncate: float | None, cost,
          x: Tensor | None = None, y: Tensor | None = None, parents: "Hierarchy | None" = None) -> Tensor:
    """(Kx, Ky) kept blocks: a lower bound of ``C(x_i, y_j) - f_i - g_j`` over the block (see
    :class:`BlockBounds`) at most ``truncate * eps``, plus each row's and column's best block."""
    if truncate is None:
        return torch.ones(cx.n_clusters, cy.n_clusters, dtype=torch.bool, device=f.device)
    margin = truncate * eps
    return BlockBounds.compute(cx, cy, f, g, cost, x, y, parents, margin).keep(margin)


@dataclass(frozen=True)
class Hierarchy:
    """Coarser clusterings of both sides for :func:`prune`: ``cx`` / ``cy`` over the same sorted clouds,
    ``px`` / ``py`` (K_coarse + 1,) the runs of fine clusters in each coarse one."""

    cx: Clusters
    cy: Clusters
    px: Tensor
    py: Tensor


COARSE_BLOCKS = 2048  # a pruning hierarchy's coarse level has at most about this many clusters per side


def _parent(c: Clusters, xs: Tensor, as_: Tensor) -> tuple[Clusters, Tensor] | None:
    """A coarser Morton clustering of ``c`` with at most ~``COARSE_BLOCKS`` clusters and its runs of fine
    clusters, or None (no Morton codes, or already coarse enough)."""
    if c.codes is None or c.n_clusters <= COARSE_BLOCKS:
        return None
    for levels in range(1, 8):
        pc, parent = coarsen(c, xs, as_, levels)
        if pc.n_clusters <= COARSE_BLOCKS or levels == 7:
            runs = torch.zeros(pc.n_clusters + 1, dtype=torch.long, device=xs.device)
            runs[1:] = torch.cumsum(torch.bincount(parent, minlength=pc.n_clusters), 0)
            return pc, runs
    return None


def hierarchy(cx: Clusters, cy: Clusters, xs: Tensor, ys: Tensor, a: Tensor, b: Tensor) -> Hierarchy | None:
    """The pruning :class:`Hierarchy` of two Morton clusterings, or None where flat pruning is cheap or
    impossible."""
    px, py = _parent(cx, xs, a), _parent(cy, ys, b)
    if px is None and py is None:
        return None
    if px is None:
        px = (cx, torch.arange(cx.n_clusters + 1, device=xs.device))
    if py is None:
        py = (cy, torch.arange(cy.n_clusters + 1, device=ys.device))
    return Hierarchy(px[0], py[0], px[1], py[1])


def _prune_radius(cost, eps: float, truncate: float | None) -> float:
    """Distance below which a pair is never pruned at temperature ``eps`` (``C <= truncate * eps``)."""
    if truncate is None:
        return float("inf")
    c = truncate * eps
    return (c / cost.scale) ** 0.5 if cost.is_dot else c


def _coarse_measures(m: Measures, cx: Clusters, cy: Clusters, group: Any = None) -> Measures:
    """The centroids with the cluster weights, on the engine ``auto`` picks for their size (sharded over the
    ranks of ``group``, after checking that every rank has the same centroids)."""
    mc = Measures.build(cx.centroids, cy.centroids, cx.weights, cy.weights, cost=m.cost, backend="auto")
    if group is not None:
        from .distributed import distribute_measures

        distribute_measures(mc, group, names=("centroids of x", "centroids of y", "cluster weights of x",
                                              "cluster weights of y"))
    return mc


def _points_measures(fine: Measures, group: Any = None) -> Measures:
    """``fine`` for the coarse temperatures run on the points (:func:`coarse_pays` false): its own engine,
    sharded over the ranks of ``group`` when given (a copy: ``fine`` keeps its engine for the pruned stage)."""
    if group is None:
        return fine
    from .distributed import distribute_measures

    return distribute_measures(replace(fine), group)


def _extrapolate(pts: Tensor, centroids: Tensor, w_log: Tensor, pot: Tensor, eps: float, lam: float, cost,
                 group: Any = None, pruned: "_ExtrapolationPruning | None" = None) -> Tensor:
    """Fine potential from a coarse one: ``lam * softmin_J (log w_J + pot_J / eps)`` at the points (B = 1
    tensors); with ``group``, each rank computes its slice of the points (the same engine call as
    :func:`flashot.ops.softmin` on those rows) and all-gathers the rest.  With ``pruned`` (CPU), over the
    centroids that its bounds keep (:func:`_extrapolate_pruned`; every rank computes all the points then: it
    is cheap, and each row's bits depend on neither the thread count nor the rank)."""
    with torch.no_grad():
        h = w_log + pot / eps
        if pruned is not None:
            out = _extrapolate_pruned(pts, centroids, h, eps, cost, pruned)
            if out is not None:
                return lam * out
        if group is None:
            return lam * ops_softmin(pts, centroids, h, eps, cost=cost, backend="auto")
        from .distributed import ShardedEngine

        pp = prepare_pair(pts, centroids, cost=cost, backend="auto")
        eng = ShardedEngine(pp.engine, group)
        return lam * eng.softmin(pp.x, pp.y, h.to(pp.x.dtype), eps, pp.cost).to(pts.dtype)


@dataclass(frozen=True)
class _ExtrapolationPruning:
    """How :func:`_extrapolate_pruned` bounds: the fine clusters of the points (``rows``), the coarse stage's
    cell side ``scale`` and GeomLoss' ``truncate``."""

    rows: Clusters
    scale: float
    truncate: float


EXTRAPOLATION_GROUP = 4  # the pruned extrapolation groups the centroids in cells this many coarse cells wide
EXTRAPOLATION_MIN_CENTROIDS = 1024  # below this many centroids the dense extrapolation is cheap enough
EXTRAPOLATION_TRUNCATE = 2.0  # its margin, in units of truncate * eps (5 gave errors of ~1e-3 eps, 10 ~3e-5)
EXTRAPOLATION_PROBES = 3  # groups whose centroids give each cluster's upper bound U_I


def _extrapolate_pruned(pts: Tensor, centroids: Tensor, h: Tensor, eps: float, cost,
                        pr: _ExtrapolationPruning) -> Tensor | None:
    r"""``softmin_J (h_J - C(x_i, c_J) / eps)`` over the centroid groups ``G`` (cells of
    ``EXTRAPOLATION_GROUP x scale``) that a bound keeps for the points' fine cluster ``I``, on the block-sparse
    CPU kernels; None where it would not pay (few centroids, not the CPU kernels, mixed dtypes).

    ``U_I = min_J [C(|c_I - c_J| + r_I) - eps h_J] >= f_i`` for every ``i`` in ``I`` (the softmin is below each
    of its terms; ``J`` over the centroids of the ``EXTRAPOLATION_PROBES`` groups nearest in bound), and the
    block ``(I, G)`` is dropped when ``C(gap_IG) - eps max_G h - U_I > m eps``, ``m = EXTRAPOLATION_TRUNCATE x
    truncate``: then every dropped term is below ``e^{-m}`` times the row's sum.  The block of the centroid
    that gives ``U_I`` is always kept."""
    c0, h0 = centroids[0], h[0]
    if (c0.shape[0] < EXTRAPOLATION_MIN_CENTROIDS or pts.device.type != "cpu" or h.dtype != pts.dtype
            or c0.dtype != pts.dtype):
        return None
    from .ops.blocksparse_cpu import cpu_lib as load

    if load() is None:
        return None
    grp = cluster(c0, torch.ones_like(h0), EXTRAPOLATION_GROUP * pr.scale)
    cs, hs = c0[grp.perm].contiguous(), h0[grp.perm].contiguous()
    R, r, Rg = pr.rows.centroids.double(), pr.rows.radius.double(), grp.radius.double()
    d = torch.cdist(R, grp.centroids.double())
    gap = (d - r[:, None] - Rg[None]).clamp_min(0.0)
    low = cost.from_sqdist(gap * gap) - eps * _segment_max(hs, grp).double()[None]  # (Kx, Kg) lower bounds
    # U_I from every centroid of the groups of smallest lower bound (a table of each group's indices, padded
    # by repeating its last one)
    sizes = grp.sizes
    k = torch.arange(int(sizes.max()))
    table = torch.minimum(grp.offsets[:-1, None] + k[None], grp.offsets[1:, None] - 1)  # (Kg, max size)
    probe = low.topk(min(EXTRAPOLATION_PROBES, low.shape[1]), dim=1, largest=False).indices  # (Kx, P)
    j = table[probe].flatten(1)  # (Kx, P * max size) centroid indices (sorted order)
    far = (R[:, None] - cs.double()[j]).norm(dim=-1) + r[:, None]
    U = (cost.from_sqdist(far * far) - eps * hs.double()[j]).amin(1)
    keep = low - U[:, None] <= EXTRAPOLATION_TRUNCATE * pr.truncate * eps
    pat = BlockPattern(pr.rows.offsets, grp.offsets, keep)
    eng = BlockSparseEngine([(pts, cs[None], pat)])
    return eng.softmin(pts, cs[None], hs[None], eps, cost)


# the coarse stage runs on the centroids only where that problem is at least this many times smaller than the
# points' (see coarse_pays)
COARSE_MIN_GAIN = 4.0


def coarse_pays(cx: Clusters, cy: Clusters, min_gain: float = COARSE_MIN_GAIN) -> bool:
    """Whether the coarse stage runs on the centroids: ``Kx Ky <= N M / min_gain``.  Elsewhere (clusters of one
    or two points: small clouds, where :func:`~flashot.clusters.coarse_scale` halves the cells down to the
    pruning radius) it saves no work, and its extrapolation to the points is one more, un-averaged, step
    than single scale takes: the fixed schedule's (unconverged) result then differs from single scale's by
    the size of that step.  Its temperatures then run on the points: the same iterations as single scale."""
    n, m = int(cx.offsets[-1]), int(cy.offsets[-1])
    return cx.n_clusters * cy.n_clusters * min_gain <= n * m


SUB_LEVELS = 3  # points sorted inside their cluster by sub-cells 8x finer (compact tiles for TilePruning)
TILE_PRUNING = True  # the fine engines skip the tiles inside kept blocks that the truncate rule drops


def multiscale_loop(m: Measures, eps_list: list[float], p: int, cfg: MultiscaleConfig, *, debias: bool,
                    diameter: float, labels: tuple[Tensor | None, Tensor | None] = (None, None),
                    verbose: bool = False, group: Any = None,
                    rho: tuple[float | None, float | None] = (None, None)) -> MultiscaleRun:
    """Run GeomLoss' symmetric, debiased-or-not schedule ``eps_list`` coarse-to-fine on ``m`` (B = 1); with a
    ``torch.distributed`` ``group``, over its ranks (replicated mode: every rank passes the same ``m``).
    ``rho = (rho_x, rho_y)``: KL marginal penalties (unbalanced OT, GeomLoss' ``reach**p``; None: strict),
    applied at every temperature, coarse and fine, and in the extrapolation (``f = lam_x softmin``, as
    GeomLoss' multiscale does); debiasing needs ``rho_x == rho_y`` here."""
    if debias and rho[0] != rho[1]:
        raise NotImplementedError("backend='multiscale': debiasing with different marginal penalties (reach_x != "
                                  "reach_y) is not implemented; use backend='auto'")
    rx, ry = rho
    D = m.x.shape[-1]
    scale = cfg.cluster_scale if cfg.cluster_scale is not None else default_cluster_scale(diameter, D)
    x, y = m.x[0], m.y[0]
    # the fine stage prunes blocks that can be smaller than GeomLoss' clusters (given labels: the same);
    # by default the coarse stage runs on those blocks too (and jumps at their scale)
    bs = scale
    if labels[0] is None and labels[1] is None:
        radius = _prune_radius(m.cost, eps_list[-1], cfg.truncate)
        bs = block_scale(x.detach(), y.detach(), scale, radius)
        if cfg.cluster_scale is None:
            scale = coarse_scale(x.detach(), y.detach(), bs, radius)
    cx, cy = (cluster(x, m.a[0], scale, labels[0], SUB_LEVELS), cluster(y, m.b[0], scale, labels[1], SUB_LEVELS))
    jump = jump_index(eps_list, _jump_threshold(m.cost, scale, p))
    on_points = not coarse_pays(cx, cy)
    if not on_points:
        mc = _coarse_measures(m, cx, cy, group)
        st = sinkhorn_loop(mc, eps_list[: jump + 1], symmetric=True, debias=debias, rho_x=rx, rho_y=ry,
                           verbose=verbose)
    if bs != scale:
        cx, cy = cluster(x, m.a[0], bs, sub_levels=SUB_LEVELS), cluster(y, m.b[0], bs, sub_levels=SUB_LEVELS)
    fine = _fine_measures(m, cx, cy)
    hier = _Hier.build(fine, cx, cy, debias)
    eps = eps_list[jump]  # the last coarse temperature (eps_list[-1] when no fine iteration follows)
    if on_points:  # single scale's iterations on the (dense) points: no extrapolation step
        st = sinkhorn_loop(_points_measures(fine, group), eps_list[: jump + 1], symmetric=True, debias=debias,
                           rho_x=rx, rho_y=ry, verbose=verbose)
    else:
        st = _extrapolated_state(fine, mc, cx, cy, st, eps, debias, group, rho, (scale, cfg.truncate))
    state = replace(st, eps=eps)
    kept: list[float] = []
    tail = eps_list[jump + 1:]
    if not tail:  # extrapolation only: the final step reads the potentials at this temperature
        bounds = _bounds(fine, hier, state, eps, cfg.truncate)
        fine = _with_patterns(fine, hier, _keeps(bounds, eps, cfg.truncate), kept, debias, group, cfg.truncate)
        return MultiscaleRun(fine, replace(state, eps=eps_list[-1]), cx, cy, kept, jump, hier, bounds, cfg.truncate,
                             group)
    bounds = _bounds(fine, hier, state, max(tail), cfg.truncate)
    for level in sorted(set(tail), reverse=True):
        steps = [e for e in tail if e == level]

        def loop(fine_, st, steps=steps):
            return sinkhorn_loop(fine_, steps, symmetric=True, debias=debias, rho_x=rx, rho_y=ry, init=(st.f, st.g),
                                 init_self=(st.f_aa, st.g_bb) if debias else None)

        fine, state, bounds = _fine_level(fine, hier, state, bounds, level, loop, cfg.truncate, debias, kept, group)
    return MultiscaleRun(fine, replace(state, eps=eps_list[-1]), cx, cy, kept, jump, hier, bounds, cfg.truncate,
                         group)


def continue_fine(run: MultiscaleRun, loop) -> MultiscaleRun:
    """More iterations at the last temperature on the pruned points: ``loop(fine_measures, state)`` -> the
    new state (e.g. the ordinary solver run to a tolerance), with the same a-posteriori check of the pruning
    as every temperature of :func:`multiscale_loop`."""
    eps, kept = run.state.eps, list(run.kept)
    fine, state, bounds = _fine_level(run.m, run.hier, run.state, run.bounds, eps, loop, run.truncate,
                                      run.state.f_aa is not None, kept, run.group)
    return replace(run, m=fine, state=replace(state, eps=eps), kept=kept, bounds=bounds)


def _fine_level(fine: Measures, hier: "_Hier", state: SinkhornState, bounds, level: float, loop, truncate,
                debias: bool, kept: list[float], group: Any = None):
    """``loop(fine, state)`` (iterations at temperature ``level``) on the blocks whose ``bounds`` (from the
    potentials of ``state``) are within ``truncate * level``.  The bounds are then recomputed from the new
    potentials; where they keep a block that was dropped, the iterations run again on the union (once), so
    that every dropped block satisfies the rule for the potentials that come out.  Returns the measures on
    the last engine, the new state and its bounds (valid for margins up to ``truncate * level``)."""
    keeps = _keeps(bounds, level, truncate)
    for attempt in range(2):
        fine = _with_patterns(fine, hier, keeps, kept, debias, group, truncate)
        with warnings.catch_warnings(record=True) as caught:  # shown only for the attempt that is kept
            warnings.simplefilter("always")
            new = loop(fine, state)
        new_bounds = _bounds(fine, hier, new, level, truncate)
        after = _keeps(new_bounds, level, truncate)
        if truncate is None or attempt == 1 or all(bool((a <= k).all()) for a, k in zip(after, keeps)):
            for w in caught:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            return fine, new, new_bounds
        kept.pop()
        keeps = [a | k for a, k in zip(after, keeps)]
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class _Hier:
    """The fine clusterings of both clouds and their pruning hierarchies (xy, xx, yy)."""

    cx: Clusters
    cy: Clusters
    xy: Hierarchy | None
    xx: Hierarchy | None
    yy: Hierarchy | None

    @classmethod
    def build(cls, fine: Measures, cx: Clusters, cy: Clusters, debias: bool) -> "_Hier":
        x, y, a, b = fine.x[0].detach(), fine.y[0].detach(), fine.a[0].detach(), fine.b[0].detach()
        xy = hierarchy(cx, cy, x, y, a, b)
        xx = yy = None
        if debias and xy is not None:
            xx = Hierarchy(xy.cx, xy.cx, xy.px, xy.px)
            yy = Hierarchy(xy.cy, xy.cy, xy.py, xy.py)
        return cls(cx, cy, xy, xx, yy)


def _bounds(fine: Measures, h: "_Hier", st: SinkhornState, eps: float, truncate) -> list[BlockBounds] | None:
    """The :class:`BlockBounds` of the x-y problem and, when debiasing, of the x-x and y-y ones, from the
    potentials of ``st``, for margins up to ``truncate * eps`` (None: no pruning)."""
    if truncate is None:
        return None
    x0, y0, cost, margin = fine.x[0].detach(), fine.y[0].detach(), fine.cost, truncate * eps
    out = [BlockBounds.compute(h.cx, h.cy, st.f[0], st.g[0], cost, x0, y0, h.xy, margin)]
    if st.f_aa is not None:
        out.append(BlockBounds.compute(h.cx, h.cx, st.f_aa[0], st.f_aa[0], cost, x0, x0, h.xx, margin))
        out.append(BlockBounds.compute(h.cy, h.cy, st.g_bb[0], st.g_bb[0], cost, y0, y0, h.yy, margin))
    return out


def _keeps(bounds: list[BlockBounds] | None, eps: float, truncate) -> list[Tensor] | None:
    """The kept blocks at the margin ``truncate * eps`` (None: every block)."""
    return None if bounds is None else [b.keep(truncate * eps) for b in bounds]


def _fine_measures(m: Measures, cx: Clusters, cy: Clusters) -> Measures:
    """``m`` with both clouds (and weights) sorted by cluster; gathers keep the autograd history."""
    x, y = m.x[:, cx.perm].contiguous(), m.y[:, cy.perm].contiguous()
    a, b = m.a[:, cx.perm], m.b[:, cy.perm]
    return replace(m, x=x, y=y, a=a, b=b, a_log=log_weights(a), b_log=log_weights(b))


def _extrapolated_state(fine: Measures, mc: Measures, cx, cy, st: SinkhornState, eps: float,
                        debias: bool, group: Any = None, rho: tuple = (None, None),
                        prune: tuple[float, float | None] | None = None) -> SinkhornState:
    """Coarse potentials (cluster centroids) carried to the sorted points (one damped softmin each:
    ``f = lam_x softmin_J(log b_J + g_J / eps)``, ``lam = 1 / (1 + eps / rho)``, 1 on a strict side); with
    ``prune = (coarse cell side, truncate)``, over the centroids a bound keeps (:func:`_extrapolate_pruned`)."""
    cost = fine.cost
    x, y = fine.x.detach(), fine.y.detach()
    xc, yc = mc.x.detach() + mc.center, mc.y.detach() + mc.center  # back in fine's coordinates
    lx, ly = damping(eps, rho[0]), damping(eps, rho[1])
    px = py = None
    if prune is not None and prune[1] is not None:
        px, py = (_ExtrapolationPruning(c, prune[0], prune[1]) for c in (cx, cy))
    f = _extrapolate(x, yc, mc.b_log, st.g, eps, lx, cost, group, px)
    g = _extrapolate(y, xc, mc.a_log, st.f, eps, ly, cost, group, py)
    f_aa = g_bb = None
    if debias:
        f_aa = _extrapolate(x, xc, mc.a_log, st.f_aa, eps, lx, cost, group, px)
        g_bb = _extrapolate(y, yc, mc.b_log, st.g_bb, eps, ly, cost, group, py)
    return replace(st, f=f, g=g, f_aa=f_aa, g_bb=g_bb)


def _with_patterns(fine: Measures, h: "_Hier", keeps: list[Tensor] | None, kept: list[float],
                   debias: bool, group: Any = None, truncate: float | None = None) -> Measures:
    """``fine`` on a block-sparse engine over the kept blocks ``keeps`` (see :func:`_keeps`; None: all),
    sharded by whole row clusters over the ranks of ``group`` when given; with ``truncate``, its fused steps
    also skip the tiles inside kept blocks that the same rule drops (:class:`TilePruning`)."""
    x, y = fine.x.detach(), fine.y.detach()
    if keeps is None:
        keeps = [torch.ones(u.n_clusters, v.n_clusters, dtype=torch.bool, device=x.device)
                 for u, v in ((h.cx, h.cy), (h.cx, h.cx), (h.cy, h.cy))]
    pxy = BlockPattern(h.cx.offsets, h.cy.offsets, keeps[0])
    pats = [(x, y, pxy), (y, x, pxy.T)]
    if debias:  # symmetric (keep or its transpose): softmin_sym then computes half the blocks
        pats.append((x, x, BlockPattern(h.cx.offsets, h.cx.offsets, keeps[1] | keeps[1].T)))
        pats.append((y, y, BlockPattern(h.cy.offsets, h.cy.offsets, keeps[2] | keeps[2].T)))
    kept.append(pxy.fraction)
    tiles = None
    if truncate is not None and TILE_PRUNING:
        key = BlockSparseEngine.cloud_key
        tiles = TilePruning({key(x): fine.a_log[0].detach(), key(y): fine.b_log[0].detach()}, truncate)
    engine = BlockSparseEngine(pats, tiles=tiles)
    if group is not None:
        from .distributed import ShardedEngine

        engine = ShardedEngine(engine, group)
    return replace(fine, engine=engine)


class InputOrderEngine(ForwardingEngine):
    """A multiscale engine seen in the callers' point order: the fine stage sorts both clouds by cluster, and
    this wrapper permutes the log-weights and ``V`` into that order and the results back, so that the
    ordinary solver, :class:`~flashot.plan.LazyPlan` and the gradients run on the inputs unchanged.

    Bound to the problem ``(x, y)`` of the original measures, like the block-sparse engine it wraps.  It
    declares no capability: the fused steps of the inner engine take the sorted clouds, so only the two
    primitives are permuted.  ``name`` is ``inner``'s: ``"multiscale"``, or ``"sharded(multiscale)"`` in a
    distributed solve."""

    name = "multiscale"

    def __init__(self, inner: Engine, x: Tensor, y: Tensor, xs: Tensor, ys: Tensor, px: Tensor,
                 py: Tensor):
        super().__init__(inner, frozenset())
        inv = [torch.empty_like(p).scatter_(0, p, torch.arange(p.numel(), device=p.device)) for p in (px, py)]
        key = BlockSparseEngine.cloud_key
        self._sides = {key(x): (xs, px, inv[0]), key(y): (ys, py, inv[1])}

    def unsupported(self, device, dtype, cost):
        return None

    def _side(self, t: Tensor):
        hit = self._sides.get(BlockSparseEngine.cloud_key(t))
        if hit is None:
            raise RuntimeError("multiscale engine: called on a cloud of another problem (it is bound to one problem; "
                               "this is a flashot bug, please report it)")
        return hit

    def softmin(self, x: Tensor, y: Tensor, h: Tensor, eps: float, cost) -> Tensor:
        (xs, _, ix), (ys, py, _) = self._side(x), self._side(y)
        return self.inner.softmin(xs, ys, h[:, py], eps, cost)[:, ix]

    def plan_product(self, x, y, alpha, beta, eps, V, cost, weight="plan"):
        (xs, px, ix), (ys, py, _) = self._side(x), self._side(y)
        return self.inner.plan_product(xs, ys, alpha[:, px], beta[:, py], eps, V[:, py], cost, weight)[:, ix]


def unsort(t: Tensor | None, perm: Tensor) -> Tensor | None:
    """Values of sorted points (B, N) back in the input order: ``out[:, perm] = t`` (None stays None)."""
    return None if t is None else torch.empty_like(t).index_copy_(-1, perm, t)


def in_input_order(m: Measures, run: MultiscaleRun) -> tuple[Measures, SinkhornState]:
    """The measures ``m`` (inputs' order) on the pruned engine of ``run``, and its state in that order."""
    px, py = run.cx.perm, run.cy.perm
    eng = InputOrderEngine(run.m.engine, m.x.detach(), m.y.detach(), run.m.x.detach(), run.m.y.detach(), px, py)
    st = run.state
    st = replace(st, f=unsort(st.f, px), g=unsort(st.g, py), f_aa=unsort(st.f_aa, px), g_bb=unsort(st.g_bb, py))
    return replace(m, engine=eng), st


def schedule(cost, diameter: float, reg: float, scaling: float = 0.5) -> list[float]:
    """GeomLoss' epsilon-scaling down to ``reg`` in the units of ``cost``: for ``s |x - y|^2`` the schedule of
    ``|x - y|^2 / 2`` at ``blur = sqrt(reg / 2s)`` scaled by ``2 s``; for ``|x - y|`` the one of ``p = 1``."""
    from .schedules import epsilon_scaling

    if not cost.is_dot:
        return epsilon_scaling(1, max(diameter, reg), reg, scaling)
    k = 2.0 * cost.scale
    blur = (reg / k) ** 0.5
    return [e * k for e in epsilon_scaling(2, max(diameter, blur), blur, scaling)]
