"""The fine stage's measures (the clouds sorted by cluster) and their block-sparse engines over kept blocks."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from ..clusters import Clusters
from ..measures import Measures, log_weights
from ..ops.base import Engine
from ..ops.blocksparse import BlockPattern, BlockSparseEngine
from ..ops.tile_rule import TilePruning
from .hierarchies import Hierarchy, hierarchy

SUB_LEVELS = 3  # points sorted inside their cluster by sub-cells 8x finer (compact tiles for TilePruning)
TILE_PRUNING = True  # the fine engines skip the tiles inside kept blocks that the truncate rule drops


@dataclass(frozen=True)
class FineBlocks:
    """The fine clusterings of both clouds and their pruning hierarchies (xy, xx, yy)."""

    cx: Clusters
    cy: Clusters
    xy: Hierarchy | None
    xx: Hierarchy | None
    yy: Hierarchy | None

    @classmethod
    def build(cls, fine: Measures, cx: Clusters, cy: Clusters, debias: bool) -> FineBlocks:
        x, y, a, b = fine.x[0].detach(), fine.y[0].detach(), fine.a[0].detach(), fine.b[0].detach()
        xy = hierarchy(cx, cy, x, y, a, b)
        xx = yy = None
        if debias and xy is not None:
            xx = Hierarchy(xy.cx, xy.cx, xy.px, xy.px)
            yy = Hierarchy(xy.cy, xy.cy, xy.py, xy.py)
        return cls(cx, cy, xy, xx, yy)


def fine_measures(m: Measures, cx: Clusters, cy: Clusters) -> Measures:
    """``m`` with both clouds (and weights) sorted by cluster; gathers keep the autograd history."""
    x, y = m.x[:, cx.perm].contiguous(), m.y[:, cy.perm].contiguous()
    a, b = m.a[:, cx.perm], m.b[:, cy.perm]
    return replace(m, x=x, y=y, a=a, b=b, a_log=log_weights(a), b_log=log_weights(b))


def with_patterns(
    fine: Measures,
    h: FineBlocks,
    keeps: list[Tensor] | None,
    kept: list[float],
    debias: bool,
    group: Any = None,
    truncate: float | None = None,
) -> Measures:
    """``fine`` on a block-sparse engine over the kept blocks ``keeps`` (None: all),
    sharded by whole row clusters over the ranks of ``group`` when given; with ``truncate``, its fused steps
    also skip the tiles inside kept blocks that the same rule drops (:class:`TilePruning`)."""
    x, y = fine.x.detach(), fine.y.detach()
    if keeps is None:
        keeps = [
            torch.ones(u.n_clusters, v.n_clusters, dtype=torch.bool, device=x.device)
            for u, v in ((h.cx, h.cy), (h.cx, h.cx), (h.cy, h.cy))
        ]
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
    engine: Engine = BlockSparseEngine(pats, tiles=tiles)
    if group is not None:
        from ..distributed import ShardedEngine

        engine = ShardedEngine(engine, group)
    return replace(fine, engine=engine)
