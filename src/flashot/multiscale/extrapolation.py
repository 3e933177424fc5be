"""The coarse stage's problem (the centroids) and its potentials carried to the points."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from ..clusters import Clusters, cluster
from ..costs import Cost
from ..measures import Measures
from ..ops import prepare_pair
from ..ops import softmin as ops_softmin
from ..ops.blocksparse import BlockPattern, BlockSparseEngine
from ..solver import SinkhornState, damping
from .linear import segment_max


def coarse_measures(m: Measures, cx: Clusters, cy: Clusters, group: Any = None) -> Measures:
    """The centroids with the cluster weights, on the engine ``auto`` picks for their size (sharded over the
    ranks of ``group``, after checking that every rank has the same centroids)."""
    cost = m.cost
    assert isinstance(cost, Cost)  # multiscale runs the translation-invariant costs (check_multiscale)
    mc = Measures.build(cx.centroids, cy.centroids, cx.weights, cy.weights, cost=cost, backend="auto")
    if group is not None:
        from ..distributed import distribute_measures

        distribute_measures(
            mc, group, names=("centroids of x", "centroids of y", "cluster weights of x", "cluster weights of y")
        )
    return mc


def points_measures(fine: Measures, group: Any = None) -> Measures:
    """``fine`` for the coarse temperatures run on the points (:func:`~flashot.multiscale.scales.coarse_pays`
    false): its own engine, sharded over the ranks of ``group`` when given (a copy: ``fine`` keeps its engine for
    the pruned stage)."""
    if group is None:
        return fine
    from ..distributed import distribute_measures

    return distribute_measures(replace(fine), group)


def _extrapolate(
    pts: Tensor,
    centroids: Tensor,
    w_log: Tensor,
    pot: Tensor,
    eps: float,
    lam: float,
    cost,
    group: Any = None,
    pruned: _ExtrapolationPruning | None = None,
) -> Tensor:
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
        from ..distributed import ShardedEngine

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


def _extrapolate_pruned(
    pts: Tensor, centroids: Tensor, h: Tensor, eps: float, cost, pr: _ExtrapolationPruning
) -> Tensor | None:
    r"""``softmin_J (h_J - C(x_i, c_J) / eps)`` over the centroid groups ``G`` (cells of
    ``EXTRAPOLATION_GROUP x scale``) that a bound keeps for the points' fine cluster ``I``, on the block-sparse
    CPU kernels; None where it would not pay (few centroids, not the CPU kernels, mixed dtypes).

    ``U_I = min_J [C(|c_I - c_J| + r_I) - eps h_J] >= f_i`` for every ``i`` in ``I`` (the softmin is below each
    of its terms; ``J`` over the centroids of the ``EXTRAPOLATION_PROBES`` groups nearest in bound), and the
    block ``(I, G)`` is dropped when ``C(gap_IG) - eps max_G h - U_I > m eps``, ``m = EXTRAPOLATION_TRUNCATE x
    truncate``: then every dropped term is below ``e^{-m}`` times the row's sum.  The block of the centroid
    that gives ``U_I`` is always kept."""
    c0, h0 = centroids[0], h[0]
    if (
        c0.shape[0] < EXTRAPOLATION_MIN_CENTROIDS
        or pts.device.type != "cpu"
        or h.dtype != pts.dtype
        or c0.dtype != pts.dtype
    ):
        return None
    from ..ops.blocksparse_cpu import cpu_lib as load

    if load(pts.dtype) is None:
        return None
    grp = cluster(c0, torch.ones_like(h0), EXTRAPOLATION_GROUP * pr.scale)
    cs, hs = c0[grp.perm].contiguous(), h0[grp.perm].contiguous()
    R, r, Rg = pr.rows.centroids.double(), pr.rows.radius.double(), grp.radius.double()
    d = torch.cdist(R, grp.centroids.double())
    gap = (d - r[:, None] - Rg[None]).clamp_min(0.0)
    low = cost.from_sqdist(gap * gap) - eps * segment_max(hs, grp).double()[None]  # (Kx, Kg) lower bounds
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


def extrapolated_state(
    fine: Measures,
    mc: Measures,
    cx: Clusters,
    cy: Clusters,
    st: SinkhornState,
    eps: float,
    debias: bool,
    group: Any = None,
    rho: tuple[float | None, float | None] = (None, None),
    prune: tuple[float, float | None] | None = None,
) -> SinkhornState:
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
        assert st.f_aa is not None and st.g_bb is not None  # a debiased loop's state
        f_aa = _extrapolate(x, xc, mc.a_log, st.f_aa, eps, lx, cost, group, px)
        g_bb = _extrapolate(y, yc, mc.b_log, st.g_bb, eps, ly, cost, group, py)
    return replace(st, f=f, g=g, f_aa=f_aa, g_bb=g_bb)
