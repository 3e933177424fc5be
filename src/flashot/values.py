r"""Differentiable OT values: the dual value with envelope gradients, the high-temperature value, <C, P>.

Balanced entropic OT between :math:`a = \sum_i a_i \delta_{x_i}` and
:math:`b = \sum_j b_j \delta_{y_j}` with a dot-product cost
:math:`C_{ij} = s |x_i - y_j|^2`.  At the Sinkhorn fixed point :math:`(f, g)`
with plan :math:`P_{ij} = a_i b_j e^{(f_i + g_j - C_{ij})/\varepsilon}`, the value
:math:`W = \langle a, f\rangle + \langle b, g\rangle` has the gradients (envelope theorem)

.. math::
    \nabla_{x_i} W = \textstyle\sum_j P_{ij} \nabla_x C(x_i, y_j) = 2s (r_i x_i - (P y)_i),
    \quad \nabla_{y_j} W = 2s (c_j y_j - (P^\top x)_j),
    \quad \nabla_a W = f, \quad \nabla_b W = g,

with :math:`r = P 1`, :math:`c = P^\top 1`.  These are what :class:`OTValueFn`'s
backward returns, computed exactly as the final extrapolation step always did
(GeomLoss' rule; one or two plan products), whenever ``create_graph`` is False.

With ``create_graph=True`` the backward calls :class:`~flashot.implicit.ImplicitGradFn` (second
derivatives by implicit differentiation, :mod:`flashot.implicit`).

**The linear value** :math:`\langle C, P\rangle` (``OTResult.value_linear``, :func:`linear_value`) is
not stationary in :math:`(f, g)`: its first derivatives need the implicit correction of :mod:`flashot.implicit` (``H`` there),
:math:`H w = \varepsilon\, \partial_{(f, g)} \langle C, P\rangle = ((P \odot C) 1, (P \odot C)^\top 1)`,
then :math:`- \partial_\theta \langle w, E\rangle` (:class:`LinearValueFn`; plan products with the
``plan``, ``cost`` and ``dcost`` weights, so ``euclidean`` works too).  This is what POT's
autodiff through the iterations converges to.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .implicit import ImplicitDiff, ImplicitGradFn, check_implicit, first_order, local_sum, safe_log, solve_h
from .solver import Barycentres

if TYPE_CHECKING:  # annotations only
    from .measures import Measures
    from .solver import SinkhornState

__all__ = ["OTValueFn", "LinearValueFn", "sinkhorn_value", "linear_value", "hot_value", "with_hot_value"]


class OTValueFn(torch.autograd.Function):
    """``W = <a, f_new> + <b, g_new>`` with envelope gradients, and second derivatives on demand.

    ``sym=True`` is the self problem OT(a, a) (``y is x``, ``b is a``; pass ``y=x``,
    ``b=a`` and ``g_* = f_*``): ``W = 2 <a, f_new>``, one plan product for ``grad_x``.

    Points-sharded (``reduce`` an all-reduce sum, ``engine`` the ring engine): ``x, a, f_*`` are this
    process's rows and ``y, b, g_*`` its columns; ``W`` is summed over the processes, and the backward
    gives the gradients w.r.t. this process's points and weights (the envelope gradients' plan products
    run over all the points; the second derivatives' conjugate gradients all-reduce their inner
    products).  Every process must run the backward.
    """

    @staticmethod
    def forward(
        ctx, x, y, a, b, f_new, g_new, f_old, g_old, eps, cost, engine, cfg, sym, reduce=local_sum, bary=(None, None)
    ):
        ctx.save_for_backward(x, y, a, b, f_new, g_new, f_old, g_old, *bary)
        ctx.eps, ctx.cost, ctx.engine, ctx.cfg, ctx.sym, ctx.reduce = eps, cost, engine, cfg, sym, reduce
        return reduce((a * f_new).sum(-1) + (b * g_new).sum(-1))

    @staticmethod
    def backward(ctx, G: Tensor):
        x, y, a, b, f_new, g_new, f_old, g_old, bx, by = ctx.saved_tensors
        eps, cost, engine, cfg, sym = ctx.eps, ctx.cost, ctx.engine, ctx.cfg, ctx.sym
        nx, ny, na, nb = ctx.needs_input_grad[:4]
        Gv = G.unsqueeze(-1)
        if torch.is_grad_enabled():  # create_graph=True: a differentiable gradient
            if not cost.is_dot:
                raise NotImplementedError(
                    f"second derivatives (create_graph=True) need a dot-product cost (p=2, 'sqeuclidean' or "
                    f"'half_sqeuclidean'); got cost={cost.name!r}"
                )
            gx, gy, fa, gb = ImplicitGradFn.apply(
                x, y, a, b, f_new, g_new, f_old, g_old, eps, cost, engine, cfg, ctx.reduce
            )
            out = [Gv.unsqueeze(-1) * gx, Gv.unsqueeze(-1) * gy, Gv * fa, Gv * gb]
        else:
            a_log, b_log = safe_log(a.detach()), safe_log(b.detach())
            if sym:  # grad wrt x enters through both slots, equal by symmetry: one pass
                gx, _ = first_order(
                    x.detach(),
                    y.detach(),
                    a_log,
                    b_log,
                    f_new,
                    g_new,
                    f_old,
                    g_old,
                    eps,
                    cost,
                    engine,
                    nx or ny,
                    False,
                    (bx, None),
                )
                gy = gx
            else:
                gx, gy = first_order(
                    x.detach(),
                    y.detach(),
                    a_log,
                    b_log,
                    f_new,
                    g_new,
                    f_old,
                    g_old,
                    eps,
                    cost,
                    engine,
                    nx,
                    ny,
                    (bx, by),
                )
            out = [
                None if gx is None else Gv.unsqueeze(-1) * gx,
                None if gy is None else Gv.unsqueeze(-1) * gy,
                Gv * f_new,
                Gv * g_new,
            ]
        needs = (nx, ny, na, nb)
        out = [o if n else None for o, n in zip(out, needs)]
        return (*out, None, None, None, None, None, None, None, None, None, None, None)


def sinkhorn_value(
    m: Measures,
    st: SinkhornState,
    f: Tensor,
    g: Tensor,
    f_aa: Tensor | None = None,
    g_bb: Tensor | None = None,
    implicit: ImplicitDiff | None = None,
    bary: Barycentres | None = None,
) -> Tensor:
    """``<a, f> + <b, g>`` (minus ``<a, f_aa> + <b, g_bb>`` when given), (B,), balanced problems.

    ``f, g, f_aa, g_bb`` come from :func:`~flashot.solver.final_step` (their values
    only are used) and ``st`` is the loop state (the previous potentials).  First
    derivatives are those of the final step; second derivatives use implicit
    differentiation with the ``implicit`` settings.  Points-sharded measures: the whole problem's
    value (``m.reduce``), each process's gradients w.r.t. its own points and weights.
    """
    cfg = check_implicit(implicit)
    # OTResult.value_linear's gradient (linear_value) uses the same settings; an attribute that Measures does
    # not declare (a field would change dataclasses.fields(Measures), which distributed.py copies)
    cast(Any, m).implicit_diff = cfg
    eps = st.eps
    d = lambda t: t.detach()  # noqa: E731
    x, y, a, b = m.x, m.y, m.a, m.b
    bb = bary if bary is not None else Barycentres()
    v = OTValueFn.apply(
        x, y, a, b, d(f), d(g), d(st.f), d(st.g), eps, m.cost, m.engine, cfg, False, m.reduce, (bb.xy, bb.yx)
    )
    if f_aa is not None:
        # <a, f_aa> = OT(a, a) / 2 and <b, g_bb> = OT(b, b) / 2
        v = v - 0.5 * OTValueFn.apply(
            x,
            x,
            a,
            a,
            d(f_aa),
            d(f_aa),
            d(st.f_aa),
            d(st.f_aa),
            eps,
            m.cost,
            m.engine,
            cfg,
            True,
            m.reduce,
            (bb.xx, None),
        )
        v = v - 0.5 * OTValueFn.apply(
            y,
            y,
            b,
            b,
            d(g_bb),
            d(g_bb),
            d(st.g_bb),
            d(st.g_bb),
            eps,
            m.cost,
            m.engine,
            cfg,
            True,
            m.reduce,
            (bb.yy, None),
        )
    return v


# ----------------------------------------------------------------------------------------------
# The balanced value at a high temperature (eps >> cmax), where <a, f> + <b, g> is rounding noise.
# ----------------------------------------------------------------------------------------------
# balanced values at eps > HOT_VALUE_RATIO * cmax are recomputed by hot_value: below, the log-domain
# potentials' rounding (~ eps 2^-53 in float64) stays under ~1e-14 cmax
HOT_VALUE_RATIO = 100.0
# most refinement passes (each contracts the potentials' error by ~ cmax / eps <= 1 / HOT_VALUE_RATIO)
HOT_VALUE_PASSES = 12
# cost entries per block of rows read by one pass (float64: 8 MiB per temporary)
HOT_VALUE_BLOCK = 1 << 20


def _increment_pass(m, a: Tensor, b: Tensor, f: Tensor, g: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    r"""One alternating Sinkhorn step in increment form, float64, streamed over blocks of rows.

    With :math:`x_{ij} = (f_i + g_j - C_{ij}) / \varepsilon` (small at a high temperature), the row
    update solving :math:`\sum_j b_j e^{(f'_i + g_j - C_{ij})/\varepsilon} = 1` is
    :math:`f'_i = f_i - \varepsilon \log(1 + \sum_j b_j \operatorname{expm1}(x_{ij}))`, and the column
    update from :math:`f'` likewise.  ``expm1`` / ``log1p`` keep the increment's relative accuracy, so the
    potentials come out accurate to rounding of ``cmax`` whatever ``eps`` (a log-sum-exp rounds its sum
    to ``1 +- 2^-53`` and the potentials to ``+- eps 2^-53``).  ``a`` and ``b`` have mass exactly 1.
    """
    x, y = m.x.detach(), m.y.detach()
    Bn, N, K = f.shape[0], f.shape[-1], g.shape[-1]
    rows = max(1, HOT_VALUE_BLOCK // max(1, Bn * K))
    f_new, col = torch.empty_like(f), torch.zeros_like(g)
    for r0 in range(0, N, rows):
        r1 = min(N, r0 + rows)
        C = m.cost.tile(x[:, r0:r1], y).double()
        fr = f[:, r0:r1].unsqueeze(-1)
        s = torch.expm1((fr + g.unsqueeze(-2) - C) / eps)
        fr = fr - eps * torch.log1p((s * b.unsqueeze(-2)).sum(-1, keepdim=True))
        f_new[:, r0:r1] = fr[..., 0]
        s = torch.expm1((fr + g.unsqueeze(-2) - C) / eps)
        col += (s * a[:, r0:r1].unsqueeze(-1)).sum(-2)
    return f_new, g - eps * torch.log1p(col)


def _unit_mass(mass: Tensor, n: int, dtype: torch.dtype) -> Tensor:
    """``mass`` with the values within rounding of 1 (a sum of ``n`` weights normalised in ``dtype``:
    ``4 (log2 n + 2)`` units) set to exactly 1."""
    near = (mass - 1).abs() <= 4 * (math.log2(max(n, 1)) + 2) * torch.finfo(dtype).eps
    return torch.where(near, torch.ones_like(mass), mass)


def _gauge(f: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """``(f - t, g + t)`` with ``t`` the midrange of ``f`` per problem: potentials far from 0 (an offset of
    ``~ eps 2^-53`` left by a log-domain solve) would add their own rounding to every increment."""
    t = (f.amax(-1, keepdim=True) + f.amin(-1, keepdim=True)) / 2
    return f - t, g + t


def hot_value(m: Measures, f: Tensor, g: Tensor, eps: float) -> Tensor | None:
    r"""The balanced value, (B,) float64, accurate at any ``eps > HOT_VALUE_RATIO * cmax``; None below (or
    for points-sharded measures, or when the passes leave non-finite numbers: keep ``<a, f> + <b, g>``).

    At such temperatures ``<a, f> + <b, g>`` from log-domain potentials is off by ``~ eps 2^-53`` (it lost
    every digit from ``eps ~ 1e16 cmax``, tending to 0 instead of ``<C, a b^T>``).  Here, from the
    returned (converged) ``(f, g)``: increment-form passes (:func:`_increment_pass`) on the weights
    normalised to mass 1, until the potentials move by less than ``1e3`` rounding units of their scale
    (at most :data:`HOT_VALUE_PASSES`), then the semi-dual ``<a, f'> + <b, g>`` with
    ``f' = f(g)`` (exact in ``f'``, second order in the error of ``g``).  For masses ``m = sqrt(A B)``
    other than 1 the value is ``m V_1 - eps m log m`` (``V_1`` that of the normalised weights), with
    masses within rounding of 1 taken as 1 (:func:`_unit_mass`): weights normalised in floating point
    would otherwise add ``eps`` times their rounding.  Cost: one pass over the cost matrix per round
    (typically two or three rounds), in float64.
    """
    if getattr(m, "points_sharded", False) or not eps > HOT_VALUE_RATIO * m.cmax:
        return None
    with torch.no_grad():
        a, b = m.a.detach().double(), m.b.detach().double()
        A, B = a.sum(-1), b.sum(-1)
        an, bn = a / A.unsqueeze(-1), b / B.unsqueeze(-1)
        f, g = f.detach().double(), g.detach().double()
        tiny = torch.finfo(torch.float64).eps
        for _ in range(HOT_VALUE_PASSES):
            f, g = _gauge(f, g)
            f1, g1 = _increment_pass(m, an, bn, f, g, eps)
            if not (bool(torch.isfinite(f1).all()) and bool(torch.isfinite(g1).all())):
                return None
            move = max(float((f1 - f).abs().max()), float((g1 - g).abs().max()))
            scale = m.cmax + float(f1.abs().max()) + float(g1.abs().max())
            value = (an * f1).sum(-1) + (bn * g).sum(-1)  # f1 = f(g): the semi-dual at g
            f, g = f1, g1
            if move <= 1e3 * tiny * scale:
                break
        mass = _unit_mass((A * B).sqrt(), max(a.shape[-1], b.shape[-1]), m.a.dtype)
        return mass * value - eps * mass * torch.log(mass)


class _ValueOf(torch.autograd.Function):
    """``new`` in the forward, the gradient of ``value`` in the backward (same quantity, better digits)."""

    @staticmethod
    def forward(ctx, value, new):
        return new.to(value.dtype, copy=True)

    @staticmethod
    def backward(ctx, G):
        return G, None


def with_hot_value(value: Tensor, m: Measures, f: Tensor, g: Tensor, eps: float) -> Tensor:
    """``value`` (a converged balanced ``<a, f> + <b, g>`` with its gradients), its digits replaced by
    :func:`hot_value` at a high temperature; ``value`` itself elsewhere.  The potentials are left as
    they are (their ``~ eps 2^-53`` rounding moves the plan by ``~ 2^-53`` relative only)."""
    hot = hot_value(m, f, g, eps)
    return value if hot is None else _ValueOf.apply(value, hot)


# ----------------------------------------------------------------------------------------------
# <C, P> (OTResult.value_linear) as a differentiable function of (x, y, a, b).
# ----------------------------------------------------------------------------------------------
def _linear_grad_side(x, y, al0, be, a, r0, u0, w_own, w_other, eps, cost, engine, need_pts):
    r"""One side's gradients of ``<C, P>`` (implicit correction included), per unit cotangent.

    ``K0 = exp(al0 + be - C / eps)`` is the plan without this side's weights (``P = diag(a) K0``),
    ``r0 = K0 1``, ``u0 = (K0 ⊙ C) 1``, ``(w_own, w_other)`` the solution of ``H w = (u, v)``.
    With ``grad_x C_ij = W_ij (x_i - y_j)`` (``W`` the ``dcost`` weight)::

        grad_x_i = a_i sum_j K0_ij [ (1 + (w_own_i + w_other_j) / eps) W_ij - (C W)_ij / eps ] (x_i - y_j)
        grad_a_i = u0_i + w_own_i (1 - r0_i) - (K0 w_other)_i

    (the partial derivatives at fixed potentials minus those of ``<w, E>``).  ``C W = 2 s C`` for
    the dot-product costs (``cost`` weight), and ``2 w_f C`` for a :class:`~flashot.LabelCost` (``W = 2 w_f``
    on the features; the label column's entries are discarded by the caller), ``1`` for ``euclidean``
    (``plan`` weight, where ``C > 0``; at ``x_i = y_j`` the factor ``x_i - y_j`` vanishes anyway).
    """
    D = x.shape[-1]
    wo = w_other.unsqueeze(-1)
    gx = None
    labelled = getattr(cost, "labelled", False)
    if cost.is_dot or labelled:
        two_s = 2.0 * (cost.feature_weight if labelled else cost.scale)
        cols = [wo, y, wo * y] if need_pts else [wo]
        S = engine.plan_product(x, y, al0, be, eps, torch.cat(cols, -1).contiguous(), cost, "plan")
        Kw = S[..., 0]
        if need_pts:
            Ky, Kwy = S[..., 1 : D + 1], S[..., D + 1 :]
            Cy = engine.plan_product(x, y, al0, be, eps, y, cost, "cost")
            t = (1.0 + w_own / eps).unsqueeze(-1) * (x * r0.unsqueeze(-1) - Ky)
            t = t + (x * Kw.unsqueeze(-1) - Kwy) / eps - (x * u0.unsqueeze(-1) - Cy) / eps
            gx = (two_s * a).unsqueeze(-1) * t
    else:
        cols = [wo, y] if need_pts else [wo]
        S = engine.plan_product(x, y, al0, be, eps, torch.cat(cols, -1).contiguous(), cost, "plan")
        Kw = S[..., 0]
        if need_pts:
            Ky = S[..., 1:]
            ones = torch.ones_like(wo)
            T = engine.plan_product(
                x, y, al0, be, eps, torch.cat([ones, y, wo, wo * y], -1).contiguous(), cost, "dcost"
            )
            d1, dy, dw, dwy = T[..., :1], T[..., 1 : D + 1], T[..., D + 1 : D + 2], T[..., D + 2 :]
            t = (1.0 + w_own / eps).unsqueeze(-1) * (x * d1 - dy)
            t = t + (x * dw - dwy) / eps - (x * r0.unsqueeze(-1) - Ky) / eps
            gx = a.unsqueeze(-1) * t
    ga = u0 + w_own * (1.0 - r0) - Kw
    return gx, ga


def _cost_sum(x, y, a, b, f, g, eps, cost, engine) -> Tensor:
    """``<C, P>``, (B,): one ``cost`` plan product (no autograd)."""
    with torch.no_grad():
        alpha, beta = f.detach() / eps + safe_log(a.detach()), g.detach() / eps + safe_log(b.detach())
        ones = torch.ones_like(y[..., :1]).detach()
        return engine.plan_product(x.detach(), y.detach(), alpha, beta, eps, ones, cost, "cost")[..., 0].sum(-1)


class LinearValueFn(torch.autograd.Function):
    r"""``<C, P>`` per problem, (B,), as a function of ``(x, y, a, b)`` at the Sinkhorn fixed point.

    Forward: one streamed ``cost`` plan product (as :meth:`LazyPlan.cost_sum`).  Backward: the
    partial derivatives at fixed ``(f, g)`` plus the implicit correction: ``H w = eps
    d<C,P>/d(f, g) = ((P ⊙ C) 1, (P ⊙ C)^T 1)`` solved by :func:`solve_h` (CG, ``cfg``), then
    ``- d/dtheta <w, E>``, ``E = (P 1 - a, P^T 1 - b)``.  Plan products only: memory O(N + M).
    Points-sharded (``reduce`` an all-reduce sum, ``engine`` the ring engine): ``x``, ``a``, ``f`` are
    this process's rows and ``y``, ``b``, ``g`` its columns; the value is summed over the processes and
    each gets the gradients w.r.t. its own points and weights (every process must run the backward).
    The weight gradients are defined up to the gauge (a constant added to ``grad_a`` and
    subtracted from ``grad_b``): only mass-preserving changes of ``a``, ``b`` have a meaning.
    Once differentiable.
    """

    @staticmethod
    def forward(ctx, x, y, a, b, f, g, eps, cost, engine, cfg, reduce=local_sum):
        out = reduce(_cost_sum(x, y, a, b, f, g, eps, cost, engine))
        ctx.save_for_backward(x, y, a, b, f, g)
        ctx.eps, ctx.cost, ctx.engine, ctx.cfg, ctx.reduce = eps, cost, engine, cfg, reduce
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, G: Tensor):
        x, y, a, b, f, g = (t.detach() for t in ctx.saved_tensors)
        eps, cost, engine, cfg = ctx.eps, ctx.cost, ctx.engine, ctx.cfg
        nx, ny, na, nb = ctx.needs_input_grad[:4]
        if cost.min_sqdist > 0:
            raise NotImplementedError(
                f"value_linear: gradients with cost={cost.name!r} (clamped distances) are not implemented; "
                "use cost='euclidean', 'sqeuclidean' or 'half_sqeuclidean'"
            )
        al0, be0 = f / eps, g / eps  # the plan without the weights of one side: P = diag(a) K0 = K0' diag(b)
        al, be = al0 + safe_log(a), be0 + safe_log(b)
        ones_y, ones_x = torch.ones_like(y[..., :1]), torch.ones_like(x[..., :1])
        r0 = engine.plan_product(x, y, al0, be, eps, ones_y, cost, "plan")[..., 0]
        u0 = engine.plan_product(x, y, al0, be, eps, ones_y, cost, "cost")[..., 0]
        c0 = engine.plan_product(y, x, be0, al, eps, ones_x, cost, "plan")[..., 0]
        v0 = engine.plan_product(y, x, be0, al, eps, ones_x, cost, "cost")[..., 0]
        w1, w2 = solve_h(x, y, al, be, a * r0, b * c0, a * u0, b * v0, eps, cost, engine, cfg, ctx.reduce)
        gx = gy = ga = gb = None
        Gv = G.unsqueeze(-1)
        if nx or na:
            px, pa = _linear_grad_side(x, y, al0, be, a, r0, u0, w1, w2, eps, cost, engine, nx)
            gx = Gv.unsqueeze(-1) * px if nx else None
            ga = Gv * pa if na else None
        if ny or nb:
            py, pb = _linear_grad_side(y, x, be0, al, b, c0, v0, w2, w1, eps, cost, engine, ny)
            gy = Gv.unsqueeze(-1) * py if ny else None
            gb = Gv * pb if nb else None
        return gx, gy, ga, gb, None, None, None, None, None, None, None


class _NoGradFn(torch.autograd.Function):
    """Passes a value through and raises ``NotImplementedError(reason)`` if it is differentiated."""

    @staticmethod
    def forward(ctx, value, reason, *inputs):
        ctx.reason = reason
        return value.clone()

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(ctx.reason)


def linear_value(
    m: Measures,
    f: Tensor,
    g: Tensor,
    eps: float,
    *,
    unbalanced: Sequence[float | None] | None = None,
    differentiable: bool = True,
    implicit: ImplicitDiff | None = None,
) -> Tensor:
    r"""``<C, P>`` per problem, (B,), for the plan of the potentials ``(f, g)`` (streamed).

    With ``differentiable=True`` and inputs (``m.x``, ``m.y``, ``m.a``, ``m.b``) that require grad,
    balanced problems get :class:`LinearValueFn` (implicit differentiation through the fixed point,
    ``implicit`` settings; default: those given to :func:`sinkhorn_value` on ``m``, else
    :class:`ImplicitDiff` ``()``); unbalanced ones a value whose backward raises
    ``NotImplementedError``.  Otherwise a plain (detached) value.  Points-sharded measures (``m.reduce``
    an all-reduce): the value is the whole problem's, the gradients this process's slices.
    """
    x, y, a, b = m.x, m.y, m.a, m.b
    f, g = f.detach(), g.detach()
    needs = differentiable and torch.is_grad_enabled() and any(t.requires_grad for t in (x, y, a, b))
    if not needs:
        return m.reduce(_cost_sum(x, y, a, b, f, g, eps, m.cost, m.engine))
    if unbalanced is not None:
        v = m.reduce(_cost_sum(x, y, a, b, f, g, eps, m.cost, m.engine))
        return _NoGradFn.apply(
            v,
            "value_linear: gradients of <C, P> are implemented for balanced problems only (unbalanced="
            f"{tuple(unbalanced)!r} was given); use value / value_dual (differentiable), or grad='detach'",
            x,
            y,
            a,
            b,
        )
    cfg = check_implicit(implicit if implicit is not None else getattr(m, "implicit_diff", None))
    return LinearValueFn.apply(x, y, a, b, f, g, eps, m.cost, m.engine, cfg, m.reduce)
