r"""Voxel-grid clustering of a weighted cloud, for the multiscale solver (:mod:`flashot.multiscale`).

Points are put in cubic cells of side ``scale`` (GeomLoss' ``cluster_scale``; or given labels),
the cells are ordered along a Morton (Z-order) curve so that neighbouring cells are close in
memory, and the points are sorted by cell: cluster ``k`` is the contiguous slice
``offsets[k]:offsets[k + 1]`` of the sorted cloud.  Each cluster has its total weight, its
centre of mass :math:`c_k = \sum_{i \in k} a_i x_i / \sum_{i \in k} a_i` (the plain mean for a
cluster of zero mass) and its radius :math:`r_k = \max_{i \in k} |x_i - c_k|`, from which
:func:`block_cost_bounds` bounds the cost between two clusters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .costs import CostLike

# bits per coordinate of the Morton code: 3 * 21 = 63 bits in an int64
MORTON_BITS = 21


@dataclass(frozen=True)
class Clusters:
    perm: Tensor  # (N,) int64: sorted cloud = cloud[perm]
    offsets: Tensor  # (K + 1,) int64: cluster k = sorted[offsets[k]:offsets[k + 1]]
    centroids: Tensor  # (K, D)
    weights: Tensor  # (K,)
    radius: Tensor  # (K,)
    codes: Tensor | None = None  # (K,) the cells' Morton codes (grid clusters of D <= 3), else None

    @property
    def n_clusters(self) -> int:
        return int(self.offsets.shape[0]) - 1

    @property
    def sizes(self) -> Tensor:
        return self.offsets[1:] - self.offsets[:-1]


def default_cluster_scale(diameter: float, dim: int) -> float:
    """GeomLoss' default: ``diameter / (sqrt(D) 2000^(1/D))``, about 2,000 cells over the bounding box."""
    return diameter / (dim**0.5 * 2000 ** (1.0 / dim))


# (shift, mask) steps that spread the low bits of an integer ``dim`` apart (bit k to bit k * dim)
_SPREAD_STEPS = {
    2: [
        (16, 0x0000FFFF0000FFFF),
        (8, 0x00FF00FF00FF00FF),
        (4, 0x0F0F0F0F0F0F0F0F),
        (2, 0x3333333333333333),
        (1, 0x5555555555555555),
    ],
    3: [
        (32, 0x001F00000000FFFF),
        (16, 0x001F0000FF0000FF),
        (8, 0x100F00F00F00F00F),
        (4, 0x10C30C30C30C30C3),
        (2, 0x1249249249249249),
    ],
}


def _spread(v: Tensor, dim: int) -> Tensor:
    """Bits of ``v`` (< 2^MORTON_BITS) spread ``dim`` apart: bit k moves to bit k * dim."""
    if dim == 1:
        return v.clone()
    out = v & ((1 << MORTON_BITS) - 1)
    for shift, mask in _SPREAD_STEPS[dim]:
        out = (out | (out << shift)) & mask
    return out


def grid_labels(x: Tensor, scale: float) -> Tensor:
    """(N,) int64 cell labels of ``x`` (N, D) for cells of side ``scale``, in Morton order for D <= 3
    (row-major order of the cell coordinates above)."""
    return _grid_codes(x, scale)[0]


def _grid_codes(x: Tensor, scale: float) -> tuple[Tensor, bool]:
    """:func:`grid_labels` and whether they are Morton codes (D <= 3 and few enough cells per axis)."""
    with torch.no_grad():
        q = torch.floor((x - x.amin(0)) / scale).long()  # (N, D) >= 0
        N, D = q.shape
        code = torch.zeros(N, dtype=torch.long, device=x.device)
        if D <= 3 and int(q.max()) < 2**MORTON_BITS:
            for d in range(D):
                code |= _spread(q[:, d], D) << d
            return code, True
        extent = q.amax(0) + 1
        for d in range(D):
            code = code * extent[d] + q[:, d]
        return code, False


def cluster(
    x: Tensor, a: Tensor, scale: float | None = None, labels: Tensor | None = None, sub_levels: int = 0
) -> Clusters:
    """Cluster the cloud ``x`` (N, D) with weights ``a`` (N,) in cells of side ``scale``, or by the
    integer ``labels`` (N,) (GeomLoss' six-argument call); clusters are ordered by label.  ``sub_levels``
    (grid cells, D <= 3): the points of each cell are also sorted in the Morton order of its ``2^sub_levels``
    times finer sub-cells (runs of consecutive points are then compact: the block-sparse kernels' tiles);
    the cells are those of the finer grid's codes shifted, which nest exactly."""
    with torch.no_grad():
        x, a = x.detach(), a.detach()
        if labels is None and sub_levels > 0:
            fine, morton = _grid_codes(x, scale / 2**sub_levels)
            if morton:
                fine_sorted, perm = torch.sort(fine, stable=True)
                uniq, counts = torch.unique_consecutive(fine_sorted >> (x.shape[-1] * sub_levels), return_counts=True)
                return _summaries(x[perm], a[perm], perm, counts, uniq)
        if labels is not None:
            lab, morton = labels.to(x.device).long(), False
        else:
            assert scale is not None, "cluster: give a scale or labels"
            lab, morton = _grid_codes(x, scale)
        lab_sorted, perm = torch.sort(lab, stable=True)
        uniq, counts = torch.unique_consecutive(lab_sorted, return_counts=True)
        return _summaries(x[perm], a[perm], perm, counts, uniq if morton else None)


def _summaries(xs: Tensor, as_: Tensor, perm: Tensor, counts: Tensor, codes: Tensor | None) -> Clusters:
    """The :class:`Clusters` of the sorted cloud ``xs`` (N, D), weights ``as_``, cut into runs of ``counts``."""
    K = counts.shape[0]
    offsets = torch.zeros(K + 1, dtype=torch.long, device=xs.device)
    offsets[1:] = torch.cumsum(counts, 0)
    cid = torch.repeat_interleave(torch.arange(K, device=xs.device), counts)  # cluster of each sorted point
    w = torch.zeros(K, dtype=as_.dtype, device=xs.device).index_add_(0, cid, as_)
    sx = torch.zeros(K, xs.shape[1], dtype=xs.dtype, device=xs.device).index_add_(0, cid, as_.unsqueeze(-1) * xs)
    mean = torch.zeros_like(sx).index_add_(0, cid, xs) / counts.unsqueeze(-1).to(xs.dtype)
    pos = (w > 0).unsqueeze(-1)
    cent = torch.where(pos, sx / torch.where(pos, w.unsqueeze(-1), torch.ones_like(sx)), mean)
    dist = (xs - cent[cid]).norm(dim=-1)
    radius = torch.zeros(K, dtype=xs.dtype, device=xs.device).scatter_reduce_(0, cid, dist, "amax")
    return Clusters(perm, offsets, cent, w, radius, codes)


def coarsen(c: Clusters, xs: Tensor, as_: Tensor, levels: int) -> tuple[Clusters, Tensor]:
    """The clusters of cells ``2^levels`` times wider than ``c``'s, over the same sorted cloud ``xs`` (N, D)
    with weights ``as_`` (so each coarse cluster is a run of consecutive fine ones: Morton codes nest),
    and the (K_fine,) index of each fine cluster's parent.  Needs ``c`` built on a Morton grid."""
    if c.codes is None:
        raise ValueError("coarsen: the clusters have no Morton codes (given labels, D > 3 or too many cells)")
    with torch.no_grad():
        parent_code = c.codes >> (xs.shape[-1] * levels)
        uniq, fine_per = torch.unique_consecutive(parent_code, return_counts=True)
        parent = torch.repeat_interleave(torch.arange(uniq.shape[0], device=xs.device), fine_per)
        counts = torch.zeros(uniq.shape[0], dtype=torch.long, device=xs.device).index_add_(0, parent, c.sizes)
        return _summaries(xs, as_, c.perm, counts, uniq), parent


def block_cost_bounds(cx: Clusters, cy: Clusters, cost: CostLike, rows: slice = slice(None)) -> Tensor:
    """(Kx, Ky) lower bounds of ``C(x_i, y_j)`` over ``i`` in cluster ``I``, ``j`` in cluster ``J``:
    the cost of the gap ``max(0, |c_I - c_J| - r_I - r_J)`` (every supported cost increases with
    the distance); ``rows`` selects row clusters."""
    with torch.no_grad():
        d = torch.cdist(cx.centroids[rows].double(), cy.centroids.double())
        gap = (d - cx.radius[rows].double().unsqueeze(-1) - cy.radius.double().unsqueeze(0)).clamp_min(0.0)
        return cost.from_sqdist(gap * gap)


# blocks of the fine (block-sparse) stage hold about this many points at least on average
MIN_BLOCK_POINTS = 64


def occupied_cells(x: Tensor, scale: float) -> int:
    """Number of non-empty cells of side ``scale`` over the cloud ``x`` (N, D)."""
    return int(torch.unique(grid_labels(x, scale)).numel())


def block_scale(x: Tensor, y: Tensor, start: float, radius: float, min_points: int = MIN_BLOCK_POINTS) -> float:
    """Side of the fine stage's blocks: ``start`` halved while the blocks stay wider than ``radius / 4``
    (``radius``: the pruning distance at the last temperature) and hold at least ``min_points`` points on
    average in both clouds (smaller ones waste the kernels' vector lanes and multiply the blocks).

    A kept region is about ``radius`` plus two block radii wide, so finer blocks prune more, and the
    coarse stage (run on these blocks or finer ones by default, :func:`coarse_scale`) jumps later;
    below ``radius / 4``, or with fewer points a block, the pairs saved no longer pay for the extra
    blocks (BENCHMARKS.md, "Block and coarse-cell sizes")."""
    s = start
    while s / 2 >= radius / 4:
        if min(x.shape[0] / occupied_cells(x, s / 2), y.shape[0] / occupied_cells(y, s / 2)) < min_points:
            break
        s /= 2
    return s


# the coarse stage's clusters: at most this many a side (its dense softmins cost up to this squared per
# step, and the extrapolation to the points N times this)
COARSE_MAX_CELLS = 10_000


def coarse_scale(x: Tensor, y: Tensor, start: float, radius: float, max_cells: int = COARSE_MAX_CELLS) -> float:
    """Side of the coarse stage's clusters (by default): the fine blocks' side ``start`` halved while both
    clouds occupy at most ``max_cells`` cells and the cells stay wider than ``radius / 4`` (as
    :func:`block_scale`).  The coarse stage needs no minimum of points per cell, so it can run on finer
    cells than the fine blocks and jump to the points later: a finer coarse stage can skip a fine
    temperature, the most expensive steps (BENCHMARKS.md, "Block and coarse-cell sizes")."""
    s = start
    while s / 2 >= radius / 4 and max(occupied_cells(x, s / 2), occupied_cells(y, s / 2)) <= max_cells:
        s /= 2
    return s
