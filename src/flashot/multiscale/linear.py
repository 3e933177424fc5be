"""Per-cluster linear models of a potential, the tight part of the block bounds (:mod:`.bounds`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..clusters import Clusters

FIT_CHUNK = 1 << 16  # points per chunk of the linear-model fits (temporaries of FIT_CHUNK x (D + 1)^2 float64)


def segment_max(v: Tensor, c: Clusters) -> Tensor:
    """(K,) maximum of the sorted values ``v`` (N,) over each cluster."""
    cid = torch.repeat_interleave(torch.arange(c.n_clusters, device=v.device), c.sizes)
    return torch.full((c.n_clusters,), float("-inf"), dtype=v.dtype, device=v.device).scatter_reduce_(0, cid, v, "amax")


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
        A = torch.cat([torch.ones_like(pts[:, :1], dtype=torch.float64), pts.double() - c.centroids.double()[cid]], -1)
        G = torch.zeros(K, D + 1, D + 1, dtype=torch.float64, device=pts.device)
        for lo in range(0, A.shape[0], FIT_CHUNK):  # outer products by chunks: no (N, D + 1, D + 1) temporary
            Ac = A[lo : lo + FIT_CHUNK]
            G.index_add_(0, cid[lo : lo + FIT_CHUNK], Ac.unsqueeze(-1) * Ac.unsqueeze(-2))
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
