"""Pruning hierarchies: a coarser Morton clustering over the fine clusters, so that the fine blocks are
bounded only inside the coarse blocks kept (:class:`~flashot.multiscale.bounds.BlockBounds`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..clusters import Clusters, coarsen


@dataclass(frozen=True)
class Hierarchy:
    """Coarser clusterings of both sides for :func:`~flashot.multiscale.bounds.prune`: ``cx`` / ``cy`` over the same
    sorted clouds, ``px`` / ``py`` (K_coarse + 1,) the runs of fine clusters in each coarse one."""

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
