"""The features of one cloud (float64, differentiable), bounds and the stopping rule shared by the GW loops.

Pure functions of tensors and numbers: the balanced (:mod:`.balanced`) and semi-relaxed (:mod:`.semirelaxed`)
solvers both build their linearised costs and measure the change of the coupling with them."""

from __future__ import annotations

import math
import sys

import torch
from torch import Tensor

from ..costs import CostLike, FeatureBilinearCost
from ..ops.base import Engine
from ..solver import FLOOR_CAP

# POT reads the change of the coupling every CHECK_EVERY outer iterations (cpt % 10 == 0)
CHECK_EVERY = 10
# below this relative change the expansion |T|^2 + |T'|^2 - 2 <T, T'> has lost its digits to
# cancellation: the change is then taken from the second-order form (``small_change``)
SMALL_CHANGE = 1e-3
# the expansion is kept while its estimated rounding error (an overestimate, ~10x on the semi-relaxed tests'
# problems) is below this fraction of |T - T'|^2 (or the second-order form's error is the larger)
NOISE_RTOL = 0.1


def embed(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(E, R)`` for a centred cloud x (n, d): dimensionless features ``E = [1, |x|^2 / L^2, x / L]`` (n, d + 2)
    and ``R`` with ``|x_i - x_k|^2 = (E R E^T)_ik`` (``R`` carries the units: ``L^2``).

    ``L`` is the cloud's radius (the largest ``|x_i|``) rounded to a power of two (1 for a single point), a
    constant for autograd.  With ``[1, |x|^2, x]`` the features would mix the units ``1, L^2, L``, and the bound
    on the linearised cost ``max |u| + max |v| + max_i |phi_i M| max_j |psi_j|`` (which sets the solver's rounding
    floors, eps-scaling and acceleration, relative to ``reg``) would grow like ``L^2 + L^-2``: scaling both clouds
    by ``s`` and ``reg`` by ``s^4``, the same problem, changed the float32 solves (18% at ``s = 1e3``).  With
    dimensionless features that bound over ``reg`` moves by ~20% at most over all scales (by the rounding of
    ``L``), and not at all for ``s`` a power of two.  The power of two keeps the division exact: every product
    of features and ``M`` rounds as it did with ``[1, |x|^2, x]``, so float64 results are unchanged."""
    d = x.shape[1]
    L = float(x.detach().norm(dim=-1).max())
    L = 2.0 ** round(math.log2(L)) if sys.float_info.min < L * L < math.inf else 1.0  # a single point: any L
    s = (x * x).sum(-1, keepdim=True) / (L * L)
    E = torch.cat([torch.ones_like(s), s, x / L], -1)
    R = torch.zeros(d + 2, d + 2, dtype=x.dtype, device=x.device)
    R[0, 1] = R[1, 0] = L * L
    R[2:, 2:] = (-2.0 * L * L) * torch.eye(d, dtype=x.dtype, device=x.device)
    return E, R


def quartic(x: Tensor, w: Tensor) -> Tensor:
    """``h_i = sum_k w_k |x_i - x_k|^4`` (n,) for a cloud x (n, d) (centred, for accuracy) and weights w (n,),
    from moments: expanding ``(s_i + s_k - 2 <x_i, x_k>)^2`` with ``s = |x|^2`` costs O(n d^2), no n x n matrix."""
    s = (x * x).sum(-1)
    w0, s1, s2 = w.sum(), (w * s).sum(), (w * s * s).sum()
    m1 = w @ x
    m3 = (w * s) @ x
    sig = x.T @ (w.unsqueeze(-1) * x)
    return s * s * w0 + s2 + 4.0 * ((x @ sig) * x).sum(-1) + 2.0 * s * s1 - 4.0 * s * (x @ m1) - 4.0 * (x @ m3)


def cloud_features(x: Tensor, w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(E, h, R)``: :func:`embed` and :func:`quartic` of a centred cloud x (n, d) with weights w (n,)."""
    E, R = embed(x)
    return E, quartic(x, w), R


def bilinear_bound(Phi: Tensor, M: Tensor, Psi: Tensor, p: int, q: int) -> float:
    """A bound on ``|<phi_i, M psi_j>|`` for ``M`` block diagonal (the GW block ``[:p, :q]``, the fused features'
    block after it): ``max_i |phi_i M| max_j |psi_j|`` per block.  Per block, so that the bound has the cost's
    units: the GW block is in length^4 and the features' block in feature length^2."""
    b = float((Phi[:, :p] @ M[:p, :q]).norm(dim=-1).max() * Psi[:, :q].norm(dim=-1).max())
    if M.shape[0] > p:
        b += float((Phi[:, p:] @ M[p:, q:]).norm(dim=-1).max() * Psi[:, q:].norm(dim=-1).max())
    return b


def stop_threshold(tol: float, floor: float, norm: float) -> float | None:
    """The change of the coupling below which a check stops: ``max(tol, floor)`` (POT's ``tol``; ``floor`` the
    smallest change the compute dtype resolves), or None (no convergence) when the floor exceeds both ``tol``
    and ``FLOOR_CAP |T|_F``: rounding alone then moves the coupling by more than any useful tolerance (the
    Sinkhorn solver's rule, :func:`flashot.solver.stop_tol`, relative to the coupling's norm)."""
    if floor > max(tol, FLOOR_CAP * norm):
        return None
    return max(tol, floor)


def unresolved(name: str, dtype: torch.dtype, rel_floor: float, ratio: float) -> str:
    """The warning of a loop whose rounding floor kept it from converging."""
    f64 = "" if dtype == torch.float64 else "float64 inputs or "
    return (
        f"{name}: {str(dtype).replace('torch.', '')} rounding moves the coupling by ~{rel_floor:.2g} of its "
        f"norm (largest cost / reg = {ratio:.3g}): the change of the coupling cannot be resolved, the result is "
        f"not converged; use {f64}a larger reg"
    )


def quadratic_form(w: Tensor, R: Tensor, cdt: torch.dtype) -> tuple[float, float]:
    """``(sum_i w_i^T R_i w_i, its rounding error)`` for ``R`` (n, k, k) from a plan product in ``cdt``: the terms
    ``w_k w_l R_kl`` cancel to the small ``d^2`` (``d`` is a sum of terms of size ``|grad| / eps``), and
    ``|w_k w_l R_kl| <= |w_k| |w_l| sqrt(R_kk R_ll)``, rows rounding independently."""
    b = (w.abs() * R.diagonal(dim1=-2, dim2=-1).clamp_min(0).sqrt()).sum(-1) ** 2
    return float(torch.einsum("ik,ikl,il->", w, R, w)), torch.finfo(cdt).eps * float(b.norm())


def plan_inner(
    engine: Engine, xs: Tensor, ys: Tensor, alpha: Tensor, beta: Tensor, eps: float, cost: CostLike
) -> float:
    """``sum_ij exp(alpha_i + beta_j - C_ij / eps)`` (one plan product with ones): with the summed log-weights of two
    plans at ``reg``, ``eps = reg / 2`` and their mean cost (:func:`mean_cost`) it is ``<T1, T2>``, and ``|T|_F^2``
    with doubled log-weights; both GW loops measure the change of the coupling from these."""
    ones = torch.ones(1, ys.shape[1], 1, dtype=xs.dtype, device=xs.device)
    with torch.no_grad():
        r = engine.plan_product(xs, ys, alpha, beta, eps, ones, cost)
    return float(r.double().sum())


def mean_cost(c1: CostLike, c2: CostLike) -> FeatureBilinearCost:
    """The mean of two feature-bilinear costs (itself feature-bilinear): ``T1 T2`` is a plan of it at ``reg / 2``.
    Typed as any cost because the GW loops pass their ``Measures.cost``, always a :class:`FeatureBilinearCost`."""
    assert isinstance(c1, FeatureBilinearCost) and isinstance(c2, FeatureBilinearCost)
    return FeatureBilinearCost(0.5 * (c1.S + c2.S))
