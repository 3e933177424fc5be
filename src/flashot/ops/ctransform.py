r"""The hard (``eps -> 0``) c-transform, streamed: semi-dual OT and nearest neighbours.

.. math::
    g^c(x_i) = \min_j \; C(x_i, y_j) - g_j, \qquad j^*(i) = \operatorname{argmin}_j \; C(x_i, y_j) - g_j

With ``g = 0`` this is nearest-neighbour assignment (``j*`` is the nearest
``y`` under ``C``); with ``g`` the dual potential of semi-discrete OT, ``j*``
is the Laguerre cell of ``x_i`` and ``mean_i g^c(x_i) + <b, g>`` the semi-dual
objective.  It is the ``eps -> 0`` limit of the softmin
``-eps log sum_j exp((g_j - C_ij) / eps)`` (at uniform weights), computed
exactly by a running min / argmin over column tiles
(:func:`~flashot.ops.rowtopk.row_topk` with ``k = 1``): memory O(N + M), no
N x M matrix, on every engine (the ``dense`` engine takes a one-shot path).

The values are differentiable (Danskin's theorem: the derivative is that of
``C(x_i, y_{j*}) - g_{j*}`` at the fixed minimiser), recomputed from the
indices with plain autograd, so gradients flow to ``x``, ``y`` and ``g``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..costs import Cost
from .prepare import check_vector, prepare_pair
from .rowtopk import row_topk

__all__ = ["c_transform"]


def c_transform(
    x: Tensor,
    y: Tensor,
    g: Tensor | None = None,
    *,
    cost: str | Cost = "sqeuclidean",
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """``values_i = min_j C(x_i, y_j) - g_j`` and ``indices_i = argmin_j``, streamed.

    Args:
        x: (N, D) or (B, N, D) points.  y: (M, D) or (B, M, D) points.
        g: (M,) or (B, M) potential on ``y``; ``None`` means zero (nearest
            neighbour).  ``+inf``/NaN are rejected; ``-inf`` excludes a point.
        cost: ``"sqeuclidean"``, ``"half_sqeuclidean"`` or ``"euclidean"``.
        backend: engine name or ``"auto"`` (``"dense"`` materialises the N x M
            scores; every other engine uses the streamed tile pass).
    Returns:
        ``(values, indices)``: (N,) / (B, N) in ``x``'s dtype (differentiable),
        and int64 indices into ``y``.  Ties go to one of the minimisers.

    ``C`` is ``cost`` (default ``C(x, y) = |x - y|^2``); no ``eps``: this is the ``eps -> 0`` limit
    of :func:`softmin` with ``h = -g / eps`` (unregularised OT's c-transform, ``g^c``).

    Example:
        >>> import torch
        >>> from flashot import ops
        >>> x = torch.tensor([[0.0, 0.0], [5.0, 5.0]])
        >>> y = torch.tensor([[1.0, 0.0], [4.0, 4.0], [0.0, 3.0]])
        >>> values, indices = ops.c_transform(x, y)  # g = 0: nearest neighbours
        >>> values, indices
        (tensor([1., 2.]), tensor([0, 1]))
        >>> ops.c_transform(x, y, torch.tensor([0.0, 0.0, 9.0]))[1]  # argmin_j C(x_i, y_j) - g_j
        tensor([2, 1])
    """
    pp = prepare_pair(x, y, cost=cost, backend=backend)
    x_, y_, cost_, eng, batched, out_dtype = pp.x, pp.y, pp.cost, pp.engine, pp.batched, pp.out_dtype
    cdt = x_.dtype
    if g is None:
        g_ = torch.zeros(y_.shape[:-1], dtype=cdt, device=y_.device)
    else:
        g_ = check_vector("g", g, y.shape[:-1], cdt, x.device)
        if not batched:
            g_ = g_.unsqueeze(0)
        if bool(torch.isneginf(g_.detach()).all(-1).any()):
            raise ValueError("g: every entry is -inf in some problem (no admissible column)")
    _, idx = row_topk(x_, y_, g_.detach(), 1.0, cost_, 1, dense=eng.name == "dense")
    idx = idx[..., 0]  # (B, N)
    # Recompute the minimal values from the indices, with autograd (Danskin).
    D = x_.shape[-1]
    yj = torch.gather(y_, 1, idx.unsqueeze(-1).expand(-1, -1, D))
    gj = torch.gather(g_, 1, idx)
    d2 = ((x_ - yj) ** 2).sum(-1)
    if cost_.is_dot:
        c = d2 * cost_.scale
    else:
        d2 = d2.clamp_min(cost_.min_sqdist) if cost_.min_sqdist > 0 else d2
        pos = d2 > 0  # sqrt'(0) is infinite: use the subgradient 0 at coincident points
        c = torch.where(pos, d2.clamp_min(torch.finfo(d2.dtype).tiny).sqrt(), torch.zeros_like(d2))
    vals = c - gj
    if not batched:
        vals, idx = vals[0], idx[0]
    return vals.to(out_dtype), idx
