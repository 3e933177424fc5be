r"""Unbalanced (and semi-unbalanced) entropic OT: argument parsing and dual values.

The problem, with KL marginal penalties of strengths :math:`\rho_x, \rho_y`
(``None`` = a strict marginal constraint on that side):

.. math::
    \mathrm{OT}(a, b) = \min_{P \ge 0} \langle C, P\rangle + \varepsilon\,\mathrm{KL}(P | a\otimes b)
        + \rho_x \mathrm{KL}(P 1 | a) + \rho_y \mathrm{KL}(P^\top 1 | b),

with the generalised KL, :math:`\mathrm{KL}(p|q) = \langle p, \log(p/q)\rangle - m(p) + m(q)`.
Its dual is

.. math::
    \max_{f, g}\ \varphi_x(f) + \varphi_y(g)
        - \varepsilon \langle a \otimes b, e^{(f \oplus g - C)/\varepsilon}\rangle
        + \varepsilon\, m(a) m(b),

with :math:`\varphi_x(f) = \rho_x \langle a, 1 - e^{-f/\rho_x}\rangle` (or :math:`\langle a, f\rangle`
for a strict side).  The Sinkhorn fixed point is
:math:`f = -\lambda_x \varepsilon \log \sum_j b_j e^{(g_j - C_{ij})/\varepsilon}`,
:math:`\lambda = \rho / (\rho + \varepsilon)`, and there the marginals of the plan are
:math:`P 1 = a e^{-f/\rho_x}` (or :math:`a` for a strict side), so the mass of the
plan is :math:`m_x = \langle a, e^{-f/\rho_x}\rangle = m_y`.

Values:

* :func:`dual_value`: the exact dual value for any masses, with exact envelope-theorem
  gradients (see its docstring); ``SamplesLoss`` (and :func:`debiased_dual_value` for its
  Sinkhorn divergences) and ``OTResult.value_dual``.  For probability measures its number is
  GeomLoss' ``sinkhorn_cost``, :math:`\sum_{\text{sides}} (\rho + \varepsilon/2) \langle a, 1 - e^{-f/\rho}\rangle`
  (the term :math:`\varepsilon(1 - m(P))` split in halves), but GeomLoss' gradients are plain autograd
  through that formula (its ``UnbalancedWeight.backward`` is never called by torch), i.e.
  :math:`(\rho + \varepsilon/2)/(\rho + \varepsilon)` times the exact gradient on an unbalanced side:
  flashot returns the exact one.
* :func:`primal_value` (``solve_sample``'s ``value``): the objective above evaluated at the returned
  plan, with the dual's (exact, envelope) gradients.  POT 0.9 reports the primal with mass-less
  KL terms, which is identically 0 when both sides are relaxed: flashot does not follow it.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:  # annotations only
    from .measures import Measures
    from .solver import SinkhornState

__all__ = [
    "parse_unbalanced",
    "parse_reach",
    "dual_value",
    "debiased_dual_value",
    "debiased_dual_value_two_sided",
    "primal_value",
]

SECOND_ORDER_WARNING = (
    "second derivatives (create_graph=True) of an unbalanced OT value are those of the final Sinkhorn step "
    "with the previous potentials held fixed (GeomLoss' approximation), not the exact ones; balanced problems "
    "(reach=None / unbalanced=None) have exact ones by implicit differentiation"
)


class _WarnOnSecondOrder(torch.autograd.Function):
    """Identity on an unbalanced value whose backward, when it is itself recorded (``create_graph=True``),
    warns that the second derivatives are the final step's only (see :data:`SECOND_ORDER_WARNING`)."""

    @staticmethod
    def forward(ctx, v):
        return v.clone()

    @staticmethod
    def backward(ctx, grad):
        if torch.is_grad_enabled():
            warnings.warn(SECOND_ORDER_WARNING, RuntimeWarning, stacklevel=2)
        return grad


def warn_on_second_order(v: Tensor) -> Tensor:
    """``v`` unchanged; differentiating it with ``create_graph=True`` warns that its second derivatives are
    the final step's only (its first derivatives are unchanged: see each value's docstring)."""
    return _WarnOnSecondOrder.apply(v) if v.requires_grad else v


def _rho(name: str, v) -> float | None:
    """A penalty strength: positive number, or None / inf for a strict constraint."""
    if v is None:
        return None
    if isinstance(v, Tensor):
        if v.numel() != 1:
            raise ValueError(f"{name}: expected a number, got a tensor of shape {tuple(v.shape)}")
        v = v.item()
    if isinstance(v, np.ndarray) and v.size == 1:
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
        raise TypeError(f"{name}: expected a positive number (or None / inf), got {type(v).__name__}")
    v = float(v)
    if math.isnan(v) or v <= 0:
        raise ValueError(
            f"{name}: the marginal penalty must be a positive number (or None / inf for a strict constraint), got {v}"
        )
    return None if math.isinf(v) else v


def parse_unbalanced(unbalanced: Any, unbalanced_type: str = "KL") -> tuple[float | None, float | None]:
    """POT's ``unbalanced=`` (``rho`` or ``(rho_a, rho_b)``; None / inf = strict) -> (rho_a, rho_b)."""
    if not isinstance(unbalanced_type, str):
        raise TypeError(f"unbalanced_type: expected a string, got {type(unbalanced_type).__name__}")
    if unbalanced_type.lower() != "kl":
        raise ValueError(
            f"unbalanced_type: only 'KL' (Kullback-Leibler marginal penalties) is supported, got {unbalanced_type!r}"
        )
    if unbalanced is None:
        return None, None
    if isinstance(unbalanced, Tensor):
        unbalanced = unbalanced.detach().cpu().numpy()
    if isinstance(unbalanced, np.ndarray):
        unbalanced = unbalanced.reshape(-1).tolist() if unbalanced.ndim > 0 else unbalanced.item()
    if isinstance(unbalanced, (tuple, list)):
        vals = list(unbalanced)
        if len(vals) == 1:
            r = _rho("unbalanced", vals[0])
            return r, r
        if len(vals) != 2:
            raise ValueError(f"unbalanced: expected a number or a pair (rho_a, rho_b), got {len(vals)} values")
        return _rho("unbalanced[0]", vals[0]), _rho("unbalanced[1]", vals[1])
    r = _rho("unbalanced", unbalanced)
    return r, r


def parse_reach(
    reach: float | None, reach_x: float | None, reach_y: float | None, p: int
) -> tuple[float | None, float | None]:
    """GeomLoss' ``reach`` (both sides) or per-side ``reach_x`` / ``reach_y`` -> (rho_x, rho_y) = reach^p."""

    def one(name, v):
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
            raise TypeError(f"{name}: expected a positive number or None, got {type(v).__name__}")
        v = float(v)
        if not v > 0 or math.isnan(v):
            raise ValueError(f"{name}: expected a positive number (or None for a strict marginal), got {v}")
        return None if math.isinf(v) else v**p

    if reach is not None and (reach_x is not None or reach_y is not None):
        raise ValueError("reach: give either reach (both sides) or reach_x / reach_y (per side), not both")
    if reach is not None:
        r = one("reach", reach)
        return r, r
    return one("reach_x", reach_x), one("reach_y", reach_y)


# Every ``1 - exp(-f / rho)`` is written ``-expm1(-f / rho)``: at a large reach ``f / rho`` is tiny
# (1e-9 at reach = 1e4, p = 2) and ``1 - exp(.)`` rounds to 0 in float32 (1e-3 off at reach = 100).
def _one_minus_exp(f: Tensor, rho: float) -> Tensor:
    """``1 - exp(-f / rho)``, accurate to the dtype's precision relative to itself."""
    return -torch.expm1(-f / rho)


def _sum_last(t: Tensor) -> Tensor:
    return t.sum(-1)


# per-side reducers of the value formulas: (sum over x's points, sum over y's points), each (B, N) -> (B,); a
# ragged batch (flashot.ragged, one concatenated problem) passes per-problem segment sums
Sums = tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]
DEFAULT_SUMS: Sums = (_sum_last, _sum_last)


def _debias_side(w: Tensor, f_ab: Tensor, f_aa: Tensor, eps: float, rho: float | None, total=_sum_last) -> Tensor:
    r"""One side of :func:`debiased_dual_value`: ``<w, f_ab - f_aa>`` for a strict side, else
    :math:`(\rho + \varepsilon) D - \tfrac{\varepsilon}{2} D` with
    :math:`D = \langle w, e^{-f_{aa}/\rho} (1 - e^{-(f_{ab} - f_{aa})/\rho})\rangle` and the second
    term detached: the value is GeomLoss' :math:`(\rho + \varepsilon/2) D`, the gradient the exact
    :math:`(\rho + \varepsilon) \partial D` (the derivative of :math:`\varphi - \varepsilon m` of the
    two problems).  The difference of the potentials is taken first (no cancellation of two ~1 terms)."""
    if rho is None:
        return total(w * (f_ab - f_aa))
    D = total(w * torch.exp(-f_aa / rho) * _one_minus_exp(f_ab - f_aa, rho))
    return (rho + eps) * D - 0.5 * eps * D.detach()


def debiased_dual_value(
    a: Tensor,
    b: Tensor,
    f_ba: Tensor,
    g_ab: Tensor,
    f_aa: Tensor,
    g_bb: Tensor,
    eps: float,
    rho_x: float | None,
    rho_y: float | None,
    sums: Sums = DEFAULT_SUMS,
) -> Tensor:
    r"""Sinkhorn divergence :math:`S(a, b) = D(a, b) - \tfrac12 D(a, a) - \tfrac12 D(b, b)`, (B,), each
    :math:`D` the exact dual value of :func:`dual_value`, for ``rho_x == rho_y`` (symmetric self problems,
    one potential each; :func:`debiased_dual_value_two_sided` otherwise).

    For probability measures the value is GeomLoss' ``sinkhorn_cost``; the gradients are the exact envelope
    gradients, where GeomLoss' are :math:`(\rho + \varepsilon/2)/(\rho + \varepsilon)` of them on an
    unbalanced side (autograd through its value formula; its custom backward is never called).  The mass
    terms add up to :math:`-\tfrac{\varepsilon}{2}(m(a) - m(b))^2` (0 for equal masses; GeomLoss omits it).
    ``sums``: the reducers over each side's points (:data:`DEFAULT_SUMS`).
    """
    sx, sy = sums
    ma, mb = sx(a), sy(b)
    return (
        _debias_side(a, f_ba, f_aa, eps, rho_x, sx)
        + _debias_side(b, g_ab, g_bb, eps, rho_y, sy)
        - 0.5 * eps * (ma - mb) ** 2
    )


def self_terms_final(
    m: Measures, st: SinkhornState, rho_x: float | None, rho_y: float | None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Final (differentiable) step of the two-sided self problems ``OT(a, a)``, ``OT(b, b)``
    used for debiasing when ``rho_x != rho_y``: returns ``(f_aa, g_aa, f_bb, g_bb)``, the
    potentials on the first copy (penalty ``rho_x``) and second copy (``rho_y``) of each cloud."""
    from .solver import check_potentials, damping

    eps = st.eps
    lx, ly = damping(eps, rho_x), damping(eps, rho_y)
    f_aa = lx * m.softmin_grad("xx", m.h_a(st.g_aa, eps), eps)
    g_aa = ly * m.softmin_grad("xx", m.h_a(st.f_aa, eps), eps)
    f_bb = lx * m.softmin_grad("yy", m.h_b(st.g_bb, eps), eps)
    g_bb = ly * m.softmin_grad("yy", m.h_b(st.f_bb, eps), eps)
    check_potentials(m, eps, "in the final step", *(t.detach() for t in (f_aa, g_aa, f_bb, g_bb)))
    return f_aa, g_aa, f_bb, g_bb


def debiased_dual_value_two_sided(
    a: Tensor,
    b: Tensor,
    f: Tensor,
    g: Tensor,
    f_aa: Tensor,
    g_aa: Tensor,
    f_bb: Tensor,
    g_bb: Tensor,
    eps: float,
    rho_x: float | None,
    rho_y: float | None,
    sums: Sums = DEFAULT_SUMS,
) -> Tensor:
    """``S = D(a, b) - D(a, a)/2 - D(b, b)/2`` with every term the exact dual value of an
    ``OT_{rho_x, rho_y}`` (:func:`dual_value`), so ``S(a, a) = 0``.  Equals :func:`debiased_dual_value`
    when ``rho_x == rho_y`` (then ``f_aa = g_aa`` and ``f_bb = g_bb``)."""
    sx, sy = sums
    return (
        dual_value(a, b, f, g, eps, rho_x, rho_y, sums)
        - 0.5 * dual_value(a, a, f_aa, g_aa, eps, rho_x, rho_y, (sx, sx))
        - 0.5 * dual_value(b, b, f_bb, g_bb, eps, rho_x, rho_y, (sy, sy))
    )


# -- the exact dual (solve_sample) ---------------------------------------------------------
def _side_parts(w: Tensor, f: Tensor, eps: float, rho: float | None, total=_sum_last) -> tuple[Tensor, Tensor]:
    """(phi, s): ``phi = phi(f)`` and ``s = m_side - m(w)`` (the plan mass seen from this side minus
    the side's own mass; 0 for a strict side), both differentiable, computed with ``expm1``
    (``phi = rho <w, 1 - e^{-f/rho}>``, ``s = <w, e^{-f/rho} - 1>``) so that nothing cancels at a
    large ``rho``."""
    if rho is None:
        s = total(w * f)
        return s, torch.zeros_like(s)
    om = _one_minus_exp(f, rho)
    return rho * total(w * om), -total(w * om)


def dual_value(
    a: Tensor,
    b: Tensor,
    f: Tensor,
    g: Tensor,
    eps: float,
    rho_x: float | None,
    rho_y: float | None,
    sums: Sums = DEFAULT_SUMS,
) -> Tensor:
    r"""Dual value of (semi-)unbalanced entropic OT at the Sinkhorn fixed point, (B,).

    With :math:`m_x = \langle a, e^{-f/\rho_x}\rangle` (or :math:`m(a)`) and :math:`m_y`
    likewise, both equal to the plan mass :math:`m(P)` at the fixed point,

    .. math::
        D = \varphi_x(f) + \varphi_y(g) - \varepsilon\, \tfrac{m_x + m_y}{2} + \varepsilon\, m(a) m(b).

    Gradients: ``f`` and ``g`` come from the final step (each differentiable w.r.t. its
    own side's points only).  Autograd runs through
    :math:`\varphi_x(f) - \varepsilon m_x + \varphi_y(g) - \varepsilon m_y + \varepsilon m(a)m(b)`
    (same value at the fixed point up to the detached :math:`\varepsilon m(P)`), whose
    derivative is exactly the envelope gradient: ``sum_j P_ij grad_x C(x_i, y_j)`` in the
    points and :math:`\partial D / \partial a_i = \rho_x (1 - e^{-f_i/\rho_x}) - \varepsilon e^{-f_i/\rho_x} + \varepsilon m(b)`
    in the weights (:math:`f_i - \varepsilon + \varepsilon m(b)` for a strict side).

    Numerics: :math:`\varphi` and the mass gaps :math:`s = m_x - m(a)` use ``expm1``, and the
    mass terms are grouped as :math:`\varepsilon [m(a) m(b) - m(a) - m(b) + (m(a) + m(b))/2]`
    (exactly 0 for probability measures) plus :math:`-\varepsilon (s_x + s_y) + \varepsilon (s_x + s_y)/2`
    (the second half detached), so no two terms of size ~1 cancel: float32 agrees with float64
    to float32 accuracy at any reach.  ``sums``: the reducers over each side's points (:data:`DEFAULT_SUMS`).
    """
    sx, sy = sums
    phi_x, s_x = _side_parts(a, f, eps, rho_x, sx)
    phi_y, s_y = _side_parts(b, g, eps, rho_y, sy)
    ma, mb = sx(a), sy(b)
    masses = ma * mb - ma - mb + 0.5 * (ma + mb).detach()
    gaps = -(s_x + s_y) + 0.5 * (s_x + s_y).detach()
    return phi_x + phi_y + eps * (masses + gaps)


def _kl(p: Tensor, q: Tensor, total=_sum_last) -> Tensor:
    """Generalised KL, ``<p, log(p / q)> - m(p) + m(q)`` per problem (``0 log 0 = 0``)."""
    pos = p > 0  # zero weights: no mass of the plan there either
    t = torch.where(pos, p * (torch.log(torch.where(pos, p, 1)) - torch.log(torch.where(pos, q, 1))), 0)
    return total(t) - total(p) + total(q)


def primal_value(
    a: Tensor,
    b: Tensor,
    f: Tensor,
    g: Tensor,
    r: Tensor,
    c: Tensor,
    eps: float,
    rho_x: float | None,
    rho_y: float | None,
    sums: Sums = DEFAULT_SUMS,
) -> Tensor:
    r"""The unbalanced objective at the plan :math:`P = a b e^{(f \oplus g - C)/\varepsilon}`, (B,):

    .. math::
        \langle C, P\rangle + \varepsilon \mathrm{KL}(P | a \otimes b)
            + \rho_x \mathrm{KL}(P 1 | a) + \rho_y \mathrm{KL}(P^\top 1 | b)

    (generalised KL; no term for a strict side), from the plan's marginals ``r = P 1`` and ``c = P^T 1``:
    for a Gibbs plan the first two terms are :math:`\langle r, f\rangle + \langle c, g\rangle
    - \varepsilon m(P) + \varepsilon m(a) m(b)`.  The gradients are those of :func:`dual_value` (equal
    at the fixed point, where the primal is not differentiable in closed form without the plan):
    the returned tensor is the dual plus the detached primal-dual gap.

    POT 0.9 (``ot.solve(..., unbalanced=rho)``) evaluates the KL terms without their mass parts, which
    makes its value 0 (up to rounding) whenever both sides are relaxed; this is the objective instead.
    ``sums``: the reducers over each side's points (:data:`DEFAULT_SUMS`).
    """
    sx, sy = sums
    d = dual_value(a, b, f, g, eps, rho_x, rho_y, sums)
    with torch.no_grad():
        fd, gd, r, c = f.detach(), g.detach(), r.detach(), c.detach()
        mass = 0.5 * (sx(r) + sy(c))
        v = sx(r * fd) + sy(c * gd) - eps * mass + eps * sx(a) * sy(b)
        if rho_x is not None:
            v = v + rho_x * _kl(r, a.detach(), sx)
        if rho_y is not None:
            v = v + rho_y * _kl(c, b.detach(), sy)
    return d + (v - d.detach())
