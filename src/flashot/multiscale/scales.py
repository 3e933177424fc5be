"""The scales of a multiscale solve: GeomLoss' temperature schedule, the temperature at which it jumps from
the clusters to the points, the radius that pruning never cuts, and whether the coarse stage pays."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from ..clusters import Clusters, block_scale, coarse_scale, default_cluster_scale
from ..costs import CostLike
from ..measures import Measures
from ..schedules import epsilon_scaling

if TYPE_CHECKING:
    from .config import MultiscaleConfig


def jump_index(eps_list: list[float], threshold: float) -> int:
    """GeomLoss' rule: the coarse iterations stop before the first ``eps`` (from the third on) below
    ``threshold`` (GeomLoss: ``cluster_scale^p`` for its costs ``|x - y|^p / p``; see
    :func:`jump_threshold`).  Where none is, GeomLoss jumps after the last iteration (the coarse-to-fine
    extrapolation is then its final step); here at least the last temperature runs on the points, so
    the final step is always the ordinary one on converging fine potentials."""
    for i, eps in enumerate(eps_list[2:]):
        if threshold > eps:
            return i + 1
    return max(len(eps_list) - 2, 0)


def jump_threshold(cost: CostLike, scale: float, p: int) -> float:
    """GeomLoss' ``cluster_scale^p`` in the units of ``cost``: ``2 s scale^2`` for ``s |x - y|^2`` (GeomLoss'
    ``|x - y|^2 / 2`` gives ``scale^2``), ``scale`` for ``|x - y|``."""
    return scale**p * (2.0 * cost.scale if cost.scale is not None else 1.0)  # scale is set <=> is_dot


def prune_radius(cost: CostLike, eps: float, truncate: float | None) -> float:
    """Distance below which a pair is never pruned at temperature ``eps`` (``C <= truncate * eps``)."""
    if truncate is None:
        return float("inf")
    c = truncate * eps
    return (c / cost.scale) ** 0.5 if cost.scale is not None else c  # scale is set <=> is_dot


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


def schedule(cost: CostLike, diameter: float, reg: float, scaling: float = 0.5) -> list[float]:
    """GeomLoss' epsilon-scaling down to ``reg`` in the units of ``cost``: for ``s |x - y|^2`` the schedule of
    ``|x - y|^2 / 2`` at ``blur = sqrt(reg / 2s)`` scaled by ``2 s``; for ``|x - y|`` the one of ``p = 1``."""
    if cost.scale is None:  # not is_dot
        return epsilon_scaling(1, max(diameter, reg), reg, scaling)
    k = 2.0 * cost.scale
    blur = (reg / k) ** 0.5
    return [e * k for e in epsilon_scaling(2, max(diameter, blur), blur, scaling)]


def cluster_scales(
    m: Measures, eps: float, cfg: MultiscaleConfig, diameter: float, labels: tuple[Tensor | None, Tensor | None]
) -> tuple[float, float]:
    """The cell sides ``(coarse, fine)`` of the clusterings of ``m``'s clouds (B = 1) for a schedule ending at
    ``eps``.  The fine stage prunes blocks that can be smaller than GeomLoss' clusters (given ``labels``: the
    same); by default the coarse stage runs on those blocks too (and jumps at their scale)."""
    x, y = m.x[0].detach(), m.y[0].detach()
    scale = cfg.cluster_scale if cfg.cluster_scale is not None else default_cluster_scale(diameter, x.shape[-1])
    bs = scale
    if labels[0] is None and labels[1] is None:
        radius = prune_radius(m.cost, eps, cfg.truncate)
        bs = block_scale(x, y, scale, radius)
        if cfg.cluster_scale is None:
            scale = coarse_scale(x, y, bs, radius)
    return scale, bs
