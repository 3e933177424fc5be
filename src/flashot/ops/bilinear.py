r"""Feature-bilinear costs on engines that only stream the squared Euclidean cost.

A :class:`~flashot.costs.FeatureBilinearCost` between augmented points ``x_i = [u_i, a_i]`` and
``y_j = [v_j, b_j]`` (``a_i, b_j`` in R^K, ``S`` symmetric K x K) is

.. math::
    C_{ij} = u_i + v_j + \langle a_i, S b_j \rangle
           = |\hat x_i - \hat y_j|^2 + o^x_i + o^y_j,
    \qquad o^x_i = u'_i - |\hat x_i|^2,\quad o^y_j = v'_j - |\hat y_j|^2,

with low-dimensional points ``x^``, ``y^`` such that ``-2 <x^_i, y^_j> = <a_i - a-bar, S (b_j - b-bar)>``
(the means of the features move into the biases ``u'``, ``v'``).  The offsets fold into the
log-weights of the primitives (:mod:`flashot.ops.base`):

* ``softmin(x, y, h) = softmin_sq(x^, y^, h - o^y / eps) + o^x``;
* ``plan_product(x, y, alpha, beta) = plan_product_sq(x^, y^, alpha - o^x / eps, beta - o^y / eps)``
  (``weight="cost"`` adds the offsets times the plain products),

so the ``cpu`` and ``triton`` engines run the same fused sqeuclidean kernels on a problem of
dimension ``r = rank S_eff`` (3-D Gromov-Wasserstein: 4).

The split keeps cancellation small.  The centred features are orthonormalised
(``a - a-bar = Q_x R_x``, thin QR), ``R_x S R_y^T = U diag(sigma) V^T`` (SVD), and
``x^ = k Q_x U sigma^(1/2) / sqrt(2)``, ``y^ = -Q_y V sigma^(1/2) / (k sqrt(2))``: each direction
carries ``sqrt(sigma)`` on both sides (the smallest ``|x^|^2 + |y^|^2`` for the cross term),
``k`` equalises the largest norms, and directions with ``sigma <= RANK_RTOL sigma_1`` (rounding
of the constant feature, rank deficiency) are dropped.  The engine's ``|x^|^2 + |y^|^2 - 2<x^, y^>``
then rounds like the dense engine's ``u + v + <a, S b>``: the float64 results agree with the
``dense`` engine to ~1e-13 relative (``tests/frontends/test_gromov_engines.py``).  The split is computed
in float64 and cached per (points, cost), both orders: the transposed calls reuse it.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

from ..costs import COSTS, Cost
from .base import Capability, Engine, ForwardingEngine, Weight

__all__ = ["BilinearAdapter", "adapt", "split_bilinear"]

SQ = COSTS["sqeuclidean"]
# singular values of the effective bilinear form at most this fraction of the largest are dropped
RANK_RTOL = {torch.float64: 1e-13, torch.float32: 1e-7}
CACHE_ENTRIES = 4


@dataclass
class SqSplit:
    """``C(x_i, y_j) = |xh_i - yh_j|^2 + ox_i + oy_j``: ``xh`` (B, N, r), ``yh`` (B, M, r) in the points'
    dtype, offsets ``ox`` (B, N), ``oy`` (B, M) in float64."""

    xh: Tensor
    yh: Tensor
    ox: Tensor
    oy: Tensor

    def swapped(self) -> SqSplit:
        return SqSplit(self.yh, self.xh, self.oy, self.ox)


def split_bilinear(x: Tensor, y: Tensor, S: Tensor) -> SqSplit:
    """The squared-Euclidean split of ``C_ij = x_i0 + y_j0 + <x_i[1:], S y_j[1:]>`` (see the module docstring).

    ``x`` (B, N, 1 + K), ``y`` (B, M, 1 + K), ``S`` (B, K, K); computed in float64.
    """
    X, Y, S = x.double(), y.double(), S.to(device=x.device, dtype=torch.float64)
    ax, ay = X[..., 1:], Y[..., 1:]
    mx, my = ax.mean(1, keepdim=True), ay.mean(1, keepdim=True)  # (B, 1, K)
    ax, ay = ax - mx, ay - my
    # <a, S b> = <a_c, S b_c> + <a_c, S my> + <mx, S b_c> + <mx, S my>
    Smy = (S @ my.transpose(-1, -2)).squeeze(-1)  # (B, K)
    u = X[..., 0] + (ax @ Smy.unsqueeze(-1)).squeeze(-1) + (mx.squeeze(1) * Smy).sum(-1, keepdim=True)
    v = Y[..., 0] + (ay @ (S.transpose(-1, -2) @ mx.transpose(-1, -2))).squeeze(-1)
    Qx, Rx = torch.linalg.qr(ax)  # (B, N, K), (B, K, K)
    Qy, Ry = torch.linalg.qr(ay)
    U, sig, Vh = torch.linalg.svd(Rx @ S @ Ry.transpose(-1, -2))
    tol = RANK_RTOL.get(x.dtype, RANK_RTOL[torch.float32])
    r = max(1, int((sig > tol * sig[:, :1]).sum(-1).max()))
    root = (sig[:, :r] / 2).sqrt().unsqueeze(1)  # (B, 1, r)
    xh = (Qx @ U[..., :r]) * root
    yh = -(Qy @ Vh.transpose(-1, -2)[..., :r]) * root
    nx, ny = float(xh.norm(dim=-1).max()), float(yh.norm(dim=-1).max())
    if nx > 0 and ny > 0:
        k = math.sqrt(ny / nx)
        xh, yh = xh * k, yh / k
    xh, yh = xh.to(x.dtype).contiguous(), yh.to(x.dtype).contiguous()
    X64, Y64 = xh.double(), yh.double()  # offsets of the points the engine will see
    return SqSplit(xh, yh, u - (X64 * X64).sum(-1), v - (Y64 * Y64).sum(-1))


def _key(t: Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device, t._version)


def _shift(h: Tensor, o: Tensor, eps: float) -> Tensor:
    """``h - o / eps`` rounded once into ``h``'s dtype (``-inf`` stays ``-inf``)."""
    return (h.double() - o / eps).to(h.dtype)


def _add(out: Tensor, o: Tensor) -> Tensor:
    return (out.double() + o).to(out.dtype)


# the fused steps the adapter rewrites on the split (the others, e.g. softmin_sym, are not kept: plain softmins)
_KEPT = frozenset({Capability.SOFTMIN_PAIR, Capability.SOFTMIN_ALT, Capability.EXPECT_REUSE})


class BilinearAdapter(ForwardingEngine):
    """An engine for feature-bilinear costs built on ``inner``'s squared-Euclidean primitives.

    Same contract as every engine (:mod:`flashot.ops.base`): ``softmin`` ``out_i = -eps log sum_j
    exp(h_j - C_ij / eps)`` and ``plan_product`` ``out_i = sum_j exp(alpha_i + beta_j - C_ij / eps) W_ij V_j``,
    for ``C_ij = |xh_i - yh_j|^2 + ox_i + oy_j`` (:func:`split_bilinear`).  Other costs go to ``inner``
    unchanged.  ``name`` is ``inner``'s.  Capabilities: those of ``inner`` among ``softmin_pair``,
    ``softmin_alt`` and ``expect_reuse`` (rewritten here on the split).
    """

    def __init__(self, inner: Engine):
        super().__init__(inner, inner.capabilities & _KEPT)
        self._cache: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"BilinearAdapter({self.inner!r})"

    # -- the split, cached per (x, y, cost) in both orders -------------------------------------
    def split(self, x: Tensor, y: Tensor, cost) -> SqSplit:
        kx, ky = _key(x), _key(y)
        with self._lock:
            for key, flip in (((kx, ky, id(cost)), False), ((ky, kx, id(cost)), True)):
                ent = self._cache.get(key)
                if ent is not None:
                    self._cache.move_to_end(key)
                    return ent[0].swapped() if flip else ent[0]
        sp = split_bilinear(x, y, cost.S)
        with self._lock:  # the entry holds x, y and the cost: their ids and pointers stay theirs
            self._cache[(kx, ky, id(cost))] = (sp, x, y, cost)
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return sp

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()

    # -- contract ------------------------------------------------------------------------------
    def unsupported(self, device: torch.device, dtype: torch.dtype, cost: Cost) -> str | None:
        return self.inner.unsupported(device, dtype, SQ if getattr(cost, "bilinear", False) else cost)

    def softmin(self, x: Tensor, y: Tensor, h: Tensor, eps: float, cost: Cost) -> Tensor:
        """``out_i = -eps log sum_j exp(h_j - C_ij / eps) = softmin_sq(xh, yh, h - oy / eps)_i + ox_i``."""
        if not getattr(cost, "bilinear", False):
            return self.inner.softmin(x, y, h, eps, cost)
        sp = self.split(x, y, cost)
        return _add(self.inner.softmin(sp.xh, sp.yh, _shift(h, sp.oy, eps), eps, SQ), sp.ox)

    def softmin_pair(self, x, y, hx, hy, eps, cost):
        if not getattr(cost, "bilinear", False):
            return self.inner.softmin_pair(x, y, hx, hy, eps, cost)
        sp = self.split(x, y, cost)
        f, g = self.inner.softmin_pair(sp.xh, sp.yh, _shift(hx, sp.ox, eps), _shift(hy, sp.oy, eps), eps, SQ)
        return _add(f, sp.ox), _add(g, sp.oy)

    def softmin_alt(self, x, y, ha, hy, eps, cost, lam=1.0):
        """``f = softmin(x, y, hy)``, ``g = softmin(y, x, ha + lam f / eps)``; with ``f = f_sq + ox``
        the second half-step's log-weights are ``ha + (lam - 1) ox / eps + lam f_sq / eps``."""
        if not getattr(cost, "bilinear", False):
            return self.inner.softmin_alt(x, y, ha, hy, eps, cost, lam)
        sp = self.split(x, y, cost)
        f, g = self.inner.softmin_alt(
            sp.xh, sp.yh, _shift(ha, (1.0 - lam) * sp.ox, eps), _shift(hy, sp.oy, eps), eps, SQ, lam
        )
        return _add(f, sp.ox), _add(g, sp.oy)

    def plan_product(
        self,
        x: Tensor,
        y: Tensor,
        alpha: Tensor,
        beta: Tensor,
        eps: float,
        V: Tensor,
        cost: Cost,
        weight: Weight = "plan",
    ) -> Tensor:
        """``out_i = sum_j exp(alpha_i + beta_j - C_ij / eps) W_ij V_j`` on the split; ``W = C`` is
        ``|xh - yh|^2`` plus the offsets, i.e. ``P_sq^C V + ox P_sq V + P_sq (oy V)``."""
        if not getattr(cost, "bilinear", False):
            return self.inner.plan_product(x, y, alpha, beta, eps, V, cost, weight)
        if weight == "dcost":
            raise NotImplementedError(
                "a feature-bilinear cost has no gradient of the form w (x - y) "
                "(weight='dcost'): gradients of value_linear w.r.t. its "
                "augmented points are not implemented (those of value and of the potentials are)"
            )
        sp = self.split(x, y, cost)
        a2, b2 = _shift(alpha, sp.ox, eps), _shift(beta, sp.oy, eps)
        if weight == "plan":
            return self.inner.plan_product(sp.xh, sp.yh, a2, b2, eps, V, SQ, "plan")
        K = V.shape[-1]
        Vo = torch.cat([V, (V.double() * sp.oy.unsqueeze(-1)).to(V.dtype)], -1).contiguous()
        PV = self.inner.plan_product(sp.xh, sp.yh, a2, b2, eps, Vo, SQ, "plan").double()
        CV = self.inner.plan_product(sp.xh, sp.yh, a2, b2, eps, V, SQ, "cost").double()
        return (CV + sp.ox.unsqueeze(-1) * PV[..., :K] + PV[..., K:]).to(V.dtype)

    def expect_reuse(self, x: Tensor, y: Tensor, cost: Cost) -> None:
        if not getattr(cost, "bilinear", False):
            return self.inner.expect_reuse(x, y, cost)
        sp = self.split(x, y, cost)
        self.inner.expect_reuse(sp.xh, sp.yh, SQ)


_ADAPTERS: dict[int, BilinearAdapter] = {}


def adapt(engine: Engine) -> BilinearAdapter:
    """The (one, cached) :class:`BilinearAdapter` over ``engine``: its squared-Euclidean kernels
    run feature-bilinear costs ``C_ij = u_i + v_j + <phi_i, M psi_j>``."""
    ad = _ADAPTERS.get(id(engine))
    if ad is None or ad.inner is not engine:
        ad = _ADAPTERS[id(engine)] = BilinearAdapter(engine)
    return ad
