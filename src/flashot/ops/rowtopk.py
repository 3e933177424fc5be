r"""Streamed row-wise top-k of ``beta_j - scale * C(x_i, y_j)``: engine-independent.

The two primitives of :mod:`flashot.ops.base` are *sums* over columns (LogSumExp
and plan products); a top-k (or a min / argmin) is a different reduction, so it
is written once here, directly on tiles of the cost::

    for each row block I:                      best = (-inf values, -1 indices), (B, |I|, k)
        for each column block J:               S = beta_J - scale * C(x_I, y_J)   (one tile)
            best = topk(cat(best, S), k)       a running top-k per row

At most one (B, bn, bm + k) tile is alive, so memory is O(B (N + M) D + B N k),
never O(N M).  The tile shape follows the ``tiled`` engine (same cost tiles, same
element budget), and the code runs on any device torch supports, so every
engine (``dense``, ``tiled``, ``cpu``, ``triton``, ...) gets the operation: a
streaming engine's own speed is not used here, the cost tiles are recomputed in
plain torch.  The ``dense`` engine takes a one-shot path (whole score matrix).

Used by :meth:`flashot.plan.LazyPlan.topk` (largest plan entries per row:
``beta = g / eps + log b``, ``scale = 1 / eps``) and :func:`flashot.ops.c_transform`
(hard c-transform: ``k = 1``, ``beta = g``, ``scale = 1``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..costs import CostLike
from .tiled import TILE_ELEMS, cost_tile, tile_blocks


def row_topk(
    x: Tensor,
    y: Tensor,
    beta: Tensor,
    scale: float,
    cost: CostLike,
    k: int,
    *,
    dense: bool = False,
    tile_elems: int = TILE_ELEMS,
) -> tuple[Tensor, Tensor]:
    """Top-k over ``j`` of ``S_ij = beta_j - scale * C(x_i, y_j)``, per row ``i``.

    Args:
        x: (B, N, D), y: (B, M, D), beta: (B, M) (``-inf`` entries are never picked
            unless fewer than ``k`` finite ones exist), ``1 <= k <= M``.
        dense: compute the whole (B, N, M) score matrix at once (small problems).
    Returns:
        ``(values, indices)``: (B, N, k) scores sorted in decreasing order and
        their column indices (int64).  No autograd.
    """
    B, N, _ = x.shape
    M = y.shape[1]
    if not 1 <= k <= M:
        raise ValueError(f"k: expected 1 <= k <= {M} (the number of columns), got {k}")
    with torch.no_grad():
        if dense:
            S = beta.unsqueeze(-2) - scale * cost.matrix(x, y)
            return torch.topk(S, k, dim=-1, largest=True, sorted=True)
        bn, bm = tile_blocks(B, N, M, max(int(tile_elems), k + 1))
        bm = max(bm, min(M, k))  # a column block holds at least k candidates when possible
        xsq = (x * x).sum(-1)
        ysq = (y * y).sum(-1)
        vals = torch.empty(B, N, k, dtype=x.dtype, device=x.device)
        idx = torch.empty(B, N, k, dtype=torch.long, device=x.device)
        cols = torch.arange(M, device=x.device)
        for i0 in range(0, N, bn):
            i1 = min(N, i0 + bn)
            best_v = best_i = None
            for j0 in range(0, M, bm):
                j1 = min(M, j0 + bm)
                C = cost_tile(cost, x[:, i0:i1], y[:, j0:j1], xsq[:, i0:i1], ysq[:, j0:j1])
                S = C.mul_(-scale).add_(beta[:, None, j0:j1])
                J = cols[j0:j1].expand(B, i1 - i0, j1 - j0)
                if best_v is not None:
                    S = torch.cat([best_v, S], -1)
                    J = torch.cat([best_i, J], -1)
                kk = min(k, S.shape[-1])
                best_v, pos = torch.topk(S, kk, dim=-1, largest=True, sorted=False)
                best_i = torch.gather(J, -1, pos)
            # sort the final k once per row block
            best_v, order = torch.sort(best_v, dim=-1, descending=True)
            vals[:, i0:i1] = best_v
            idx[:, i0:i1] = torch.gather(best_i, -1, order)
        return vals, idx
