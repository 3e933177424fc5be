r"""Implicit differentiation of OT values: second derivatives, and the correction the linear value needs.

**Second order** (``create_graph=True``): the backward of :class:`~flashot.values.OTValueFn` calls
:class:`ImplicitGradFn`, a differentiable function of ``(x, y, a, b)`` with the
same outputs, whose own backward accounts for the dependence of the potentials
on the inputs.  With the balance equations :math:`E(f, g, \theta) = (P 1 - a,
P^\top 1 - b) = 0`, :math:`\partial E / \partial (f, g) = H / \varepsilon`,

.. math::
    H = \begin{pmatrix} \mathrm{diag}(r) & P \\ P^\top & \mathrm{diag}(c) \end{pmatrix},

the implicit function theorem gives, for a scalar :math:`L(\theta, f, g)` (the
cotangent-weighted gradient), :math:`dL/d\theta = \partial_\theta L -
\partial_\theta \langle w, E\rangle` with :math:`H w = \varepsilon\, \partial_{(f, g)} L`.
:math:`H` is symmetric positive semi-definite with the one null vector
:math:`(1, -1)` (the gauge :math:`f + t, g - t`): the right-hand side is
projected off it and the system solved by conjugate gradients, Jacobi
(``diag(r, c)``) preconditioned, with a small ridge; every matrix-vector
product is two plan products, so memory stays O(N + M).  The partial
derivatives come from :class:`PlanProductFn`, a plan product whose backward is
again plan products (with ``V ⊗ y``-shaped right-hand sides, O(K D) columns).

The second derivatives w.r.t. the weights ``a``, ``b`` are defined up to that
gauge (a constant); the ones w.r.t. the points are not affected.  Only balanced
problems and dot-product costs (``p=2``, ``sqeuclidean``, ``half_sqeuclidean``)
have second derivatives; the others raise :class:`NotImplementedError` on
``create_graph=True``.

The values themselves and their first-order gradients (the envelope theorem) are in :mod:`flashot.values`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .costs import Cost
from .ops.autograd import plan_grad_x
from .ops.base import Engine

if TYPE_CHECKING:  # annotations only
    pass

__all__ = ["ImplicitDiff", "PlanProductFn", "ImplicitGradFn", "check_implicit", "conjugate_gradient", "safe_log"]


@dataclass(frozen=True)
class ImplicitDiff:
    """Settings of the implicit differentiation behind second derivatives (Hessian-vector products)
    and the gradient of ``OTResult.value_linear``.

    Attributes:
        tol: relative residual at which conjugate gradients stop (``|r| <= tol |b|``).  In
            float32 rounding can floor the residual above 1e-6 at small eps (2e-5 was seen at
            reg = 0.01 on unit-variance clouds); CG then runs to ``max_iter`` and warns.  A looser
            tol costs accuracy: at reg = 0.1, tol = 1e-5 / 1e-4 / 3.4e-4 changed a float32 HVP by
            0.03-0.07% / 0.7% / 1.2-1.7% against tol = 1e-6.
        max_iter: most CG iterations (each costs two streamed plan products);
            a :class:`RuntimeWarning` is raised when ``tol`` is not met.
        ridge: Tikhonov term added to the (preconditioned, unit-diagonal) system;
            keeps CG stable when the plan is close to degenerate.  It biases the solution: the
            default 1e-8 moved float64 ``value_linear`` gradients by ~1e-7 (relative) against POT's
            autodiff (reg = 0.5, 30 x 25 points); ``ridge=0`` agreed to ~1e-11.

    The system solved (see :mod:`flashot.implicit`): at the balanced fixed point, with
    ``r = P 1``, ``c = P^T 1`` and ``eps = reg``, conjugate gradients solve
    ``H w = eps d_(f, g) L`` with ``H = [[diag(r), P], [P^T, diag(c)]]`` (Jacobi preconditioned,
    plus ``ridge``; every product with ``H`` is two plan products).

    Example:
        >>> import torch, flashot
        >>> _ = torch.manual_seed(0)
        >>> x = torch.randn(8, 2, dtype=torch.float64, requires_grad=True)
        >>> y = torch.randn(10, 2, dtype=torch.float64)
        >>> res = flashot.solve_sample(x, y, reg=0.5, implicit=flashot.ImplicitDiff(tol=1e-8))
        >>> g, = torch.autograd.grad(res.value, x, create_graph=True)
        >>> hv, = torch.autograd.grad((g * torch.ones_like(x)).sum(), x)  # a Hessian-vector product
        >>> hv.shape
        torch.Size([8, 2])
    """

    tol: float = 1e-6
    max_iter: int = 100
    ridge: float = 1e-8

    def __post_init__(self) -> None:
        for name in ("tol", "ridge"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or v != v:
                raise ValueError(f"ImplicitDiff.{name}: expected a non-negative number, got {v!r}")
        if not self.tol > 0:
            raise ValueError(f"ImplicitDiff.tol: expected a positive number, got {self.tol!r}")
        if isinstance(self.max_iter, bool) or not isinstance(self.max_iter, int) or self.max_iter < 1:
            raise ValueError(f"ImplicitDiff.max_iter: expected an integer >= 1, got {self.max_iter!r}")


def check_implicit(implicit: object) -> ImplicitDiff:
    if implicit is None:
        return ImplicitDiff()
    if not isinstance(implicit, ImplicitDiff):
        raise TypeError(f"implicit: expected a flashot.ImplicitDiff or None, got {type(implicit).__name__}")
    return implicit


# ----------------------------------------------------------------------------------------------
# A plan product that autograd can differentiate (dot-product costs), backward = plan products.
# ----------------------------------------------------------------------------------------------
class PlanProductFn(torch.autograd.Function):
    r"""``out_i = sum_j exp(alpha_i + beta_j - C_ij / eps) V_j``, differentiable in all tensors.

    For ``C = s |x - y|^2`` and a cotangent ``G`` (B, N, K), with ``P`` the kernel above:
    ``dV = P^T G``, ``dalpha_i = <G_i, out_i>``, ``dbeta_j = <V_j, (P^T G)_j>``,
    ``dx_i = -(2s/eps) (dalpha_i x_i - sum_k G_ik (P (V ⊗ y))_ik)`` and
    ``dy_j = -(2s/eps) (dbeta_j y_j - sum_k V_jk (P^T (G ⊗ x))_jk)``: two plan products.
    Once differentiable.
    """

    @staticmethod
    def forward(ctx, x, y, alpha, beta, V, eps: float, cost: Cost, engine: Engine):
        out = engine.plan_product(
            x.detach(), y.detach(), alpha.detach(), beta.detach(), eps, V.detach().contiguous(), cost, "plan"
        )
        ctx.save_for_backward(x, y, alpha, beta, V, out)
        ctx.eps, ctx.cost, ctx.engine = eps, cost, engine
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, G: Tensor):
        x, y, alpha, beta, V, out = ctx.saved_tensors
        eps, cost, engine = ctx.eps, ctx.cost, ctx.engine
        nx, ny, na, nb, nv = ctx.needs_input_grad[:5]
        B, N, K = out.shape
        M, D = y.shape[1], y.shape[2]
        two_s = 2.0 * cost.scale
        gx = gy = ga = gb = gV = None
        G = G.contiguous()
        if ny or nb or nv:
            W = G if not ny else torch.cat([G, (G.unsqueeze(-1) * x.unsqueeze(-2)).reshape(B, N, K * D)], -1)
            T = engine.plan_product(y, x, beta, alpha, eps, W.contiguous(), cost, "plan")
            PtG = T[..., :K]
            gV = PtG if nv else None
            gbeta = (V * PtG).sum(-1)
            gb = gbeta if nb else None
            if ny:
                R = torch.einsum("bmk,bmkd->bmd", V, T[..., K:].reshape(B, M, K, D))
                gy = -(two_s / eps) * (gbeta.unsqueeze(-1) * y - R)
        if nx or na:
            galpha = (G * out).sum(-1)
            ga = galpha if na else None
            if nx:
                W = (V.unsqueeze(-1) * y.unsqueeze(-2)).reshape(B, M, K * D).contiguous()
                S = engine.plan_product(x, y, alpha, beta, eps, W, cost, "plan")
                Q = torch.einsum("bnk,bnkd->bnd", G, S.reshape(B, N, K, D))
                gx = -(two_s / eps) * (galpha.unsqueeze(-1) * x - Q)
        return gx, gy, ga, gb, gV, None, None, None


def safe_log(a: Tensor) -> Tensor:
    """``log a`` with ``-inf`` at zero weights and a finite (unused) derivative there."""
    pos = a > 0
    return torch.where(pos, torch.where(pos, a, torch.ones_like(a)).log(), torch.full_like(a, float("-inf")))


def _plan_grads(X, Y, alpha, beta, eps, cost, engine):
    """Differentiable ``(gx, gy, r, c)`` of the plan ``exp(alpha + beta - C/eps)`` (dot costs)."""
    two_s = 2.0 * cost.scale
    o1 = PlanProductFn.apply(X, Y, alpha, beta, torch.cat([torch.ones_like(Y[..., :1]), Y], -1), eps, cost, engine)
    o2 = PlanProductFn.apply(Y, X, beta, alpha, torch.cat([torch.ones_like(X[..., :1]), X], -1), eps, cost, engine)
    gx = two_s * (o1[..., :1] * X - o1[..., 1:])
    gy = two_s * (o2[..., :1] * Y - o2[..., 1:])
    return gx, gy, o1[..., 0], o2[..., 0]


def local_sum(t: Tensor) -> Tensor:
    """The identity: sums over this process's entries are already sums over all of them."""
    return t


def conjugate_gradient(
    matvec: Callable[[Tensor], Tensor],
    rhs: Tensor,
    tol: float,
    max_iter: int,
    reduce: Callable[[Tensor], Tensor] = local_sum,
) -> tuple[Tensor, int, float]:
    """Batched conjugate gradients on (B, n) vectors; returns (solution, iterations, max rel. residual).

    ``reduce`` completes the inner products ``<u, v> = sum_k u_k v_k`` when the vectors are split over
    processes (points-sharded mode: an all-reduce of the (B,) partial sums), so that every process
    takes the same steps and the same stopping decision."""
    tiny = torch.finfo(rhs.dtype).tiny
    sol = torch.zeros_like(rhs)
    r = rhs.clone()
    p = r.clone()
    rs = reduce((r * r).sum(-1))
    bnorm = rs.sqrt().clamp_min(tiny)
    it = 0
    for it in range(1, max_iter + 1):
        if bool((rs.sqrt() <= tol * bnorm).all()):
            it -= 1
            break
        Ap = matvec(p)
        pAp = reduce((p * Ap).sum(-1))
        step = torch.where(pAp > 0, rs / pAp.clamp_min(tiny), torch.zeros_like(rs))
        sol = sol + step.unsqueeze(-1) * p
        r = r - step.unsqueeze(-1) * Ap
        rs_new = reduce((r * r).sum(-1))
        beta = torch.where(rs > 0, rs_new / rs.clamp_min(tiny), torch.zeros_like(rs))
        p = r + beta.unsqueeze(-1) * p
        rs = rs_new
    return sol, it, float((rs.sqrt() / bnorm).max())


# The last CG solve's (iterations, relative residual): for tests and diagnostics.
last_cg_info: dict = {}


def solve_h(
    x: Tensor,
    y: Tensor,
    alpha: Tensor,
    beta: Tensor,
    r: Tensor,
    c: Tensor,
    rhs_f: Tensor,
    rhs_g: Tensor,
    eps: float,
    cost: Cost,
    engine: Engine,
    cfg: ImplicitDiff,
    reduce: Callable[[Tensor], Tensor] = local_sum,
) -> tuple[Tensor, Tensor]:
    """``w = (w1, w2)`` with ``H w = (rhs_f, rhs_g)``, ``H = [[diag(r), P], [P^T, diag(c)]]``.

    ``P = exp(alpha + beta - C / eps)`` with marginals ``r``, ``c``; the right-hand side is projected
    off the gauge null vector ``(1, -1)`` and the system solved by CG, Jacobi (``diag(r, c)``)
    preconditioned, with ``cfg``'s ridge and tolerance (a RuntimeWarning when it is not met).
    Every matrix-vector product is two plan products.  Points-sharded (``reduce`` an all-reduce sum):
    every vector holds this process's entries (its rows of x, then of y) and ``reduce`` completes the
    inner products (the projection's and CG's); the plan products are the ring engine's.
    """
    N = r.shape[-1]
    Dg = torch.cat([r, c], -1)
    live = Dg > torch.finfo(Dg.dtype).tiny
    Dinv_sqrt = torch.where(live, Dg.clamp_min(torch.finfo(Dg.dtype).tiny).rsqrt(), torch.zeros_like(Dg))
    null = torch.cat([r.sqrt(), -c.sqrt()], -1)  # K's null vector D^1/2 (1, -1)
    null = null / reduce((null * null).sum(-1)).sqrt().unsqueeze(-1).clamp_min(torch.finfo(Dg.dtype).tiny)

    def proj(v):
        return v - reduce((v * null).sum(-1)).unsqueeze(-1) * null

    def matvec(zv):
        w = zv * Dinv_sqrt
        w1, w2 = w[..., :N], w[..., N:]
        Pw2 = engine.plan_product(x, y, alpha, beta, eps, w2.unsqueeze(-1).contiguous(), cost, "plan")[..., 0]
        Ptw1 = engine.plan_product(y, x, beta, alpha, eps, w1.unsqueeze(-1).contiguous(), cost, "plan")[..., 0]
        Hw = torch.cat([r * w1 + Pw2, Ptw1 + c * w2], -1)
        return proj(Hw * Dinv_sqrt) + cfg.ridge * zv

    rhs = proj(torch.cat([rhs_f, rhs_g], -1) * Dinv_sqrt)
    with torch.no_grad():
        tol = cfg.tol
        zsol, iters, res = conjugate_gradient(matvec, rhs, tol, cfg.max_iter, reduce)
    last_cg_info.update(iterations=iters, residual=res, tol=tol)
    if res > tol:
        warnings.warn(
            f"implicit differentiation: conjugate gradients reached a relative residual of {res:.2e} "
            f"after {iters} iterations (tol={tol:g}); raise ImplicitDiff(max_iter=...) or the blur/reg"
            + (
                ", or use float64 (float32 rounding can floor the residual above 1e-6)"
                if rhs.dtype == torch.float32
                else ""
            ),
            RuntimeWarning,
            stacklevel=3,
        )
    w = proj(zsol) * Dinv_sqrt
    return w[..., :N], w[..., N:]


class ImplicitGradFn(torch.autograd.Function):
    """``(grad_x W, grad_y W, grad_a W, grad_b W)`` as a function of ``(x, y, a, b)``.

    Forward: the first-order gradients (as :class:`OTValueFn` computes them).
    Backward: implicit differentiation through the Sinkhorn fixed point, linearised
    at ``(f, g)`` (see the module docstring).  Once differentiable.
    """

    @staticmethod
    def forward(ctx, x, y, a, b, f_new, g_new, f_old, g_old, eps, cost, engine, cfg, reduce=local_sum):
        a_log, b_log = safe_log(a.detach()), safe_log(b.detach())
        gx, gy = first_order(
            x.detach(), y.detach(), a_log, b_log, f_new, g_new, f_old, g_old, eps, cost, engine, True, True
        )
        ctx.save_for_backward(x, y, a, b, f_new, g_new)
        ctx.eps, ctx.cost, ctx.engine, ctx.cfg, ctx.reduce = eps, cost, engine, cfg, reduce
        return gx, gy, f_new.clone(), g_new.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, vx, vy, uf, ug):
        x, y, a, b, f, g = ctx.saved_tensors
        eps, cost, engine, cfg = ctx.eps, ctx.cost, ctx.engine, ctx.cfg
        with torch.enable_grad():
            X, Y, A, Bw, F, Gp = (t.detach().requires_grad_() for t in (x, y, a, b, f, g))
            alpha, beta = F / eps + safe_log(A), Gp / eps + safe_log(Bw)
            gx, gy, r, c = _plan_grads(X, Y, alpha, beta, eps, cost, engine)
            L = (vx * gx).sum() + (vy * gy).sum() + (uf * F).sum() + (ug * Gp).sum()
            dX, dY, dA, dB, dF, dG = torch.autograd.grad(L, (X, Y, A, Bw, F, Gp), allow_unused=True)
        r, c = r.detach(), c.detach()
        alpha, beta = alpha.detach(), beta.detach()
        z = lambda t, ref: torch.zeros_like(ref) if t is None else t  # noqa: E731
        dX, dY, dA, dB, dF, dG = z(dX, x), z(dY, y), z(dA, a), z(dB, b), z(dF, f), z(dG, g)

        w1, w2 = solve_h(x, y, alpha, beta, r, c, eps * dF, eps * dG, eps, cost, engine, cfg, ctx.reduce)

        # - d/dtheta <w, E(theta, f, g)>,  <w, E> = sum_ij P_ij (w1_i + w2_j) - <w1, a> - <w2, b>
        with torch.enable_grad():
            X, Y, A, Bw = (t.detach().requires_grad_() for t in (x, y, a, b))
            al, be = f / eps + safe_log(A), g / eps + safe_log(Bw)
            o = PlanProductFn.apply(X, Y, al, be, torch.stack([torch.ones_like(w2), w2], -1), eps, cost, engine)
            E = (o[..., 0] * w1 + o[..., 1]).sum()
            eX, eY, eA, eB = torch.autograd.grad(E, (X, Y, A, Bw))
        return (dX - eX, dY - eY, dA - eA + w1, dB - eB + w2, None, None, None, None, None, None, None, None, None)


def first_order(
    x: Tensor,
    y: Tensor,
    a_log: Tensor,
    b_log: Tensor,
    f_new: Tensor,
    g_new: Tensor,
    f_old: Tensor,
    g_old: Tensor,
    eps: float,
    cost: Cost,
    engine: Engine,
    need_x: bool,
    need_y: bool,
    bary: tuple[Tensor | None, Tensor | None] = (None, None),
) -> tuple[Tensor | None, Tensor | None]:
    """Envelope gradients of ``<a, f_new> + <b, g_new>`` (GeomLoss' last-step rule), no autograd.

    ``grad_x_i = sum_j P_ij grad_x C(x_i, y_j)`` with ``P`` built from ``(f_new, g_old)``,
    ``grad_y`` with ``P`` built from ``(f_old, g_new)``: one plan product per side
    (:func:`~flashot.ops.autograd.plan_grad_x`), or, given that side's soft-argmin barycentre ``b_i =
    sum_j P_ij y_j / a_i`` (``bary``, from the final step's pass: :class:`~flashot.solver.Barycentres`), for
    ``s |x - y|^2``: ``2 s a_i (x_i - b_i)`` (0 where ``b_i`` is not finite: the row has no plan mass).
    """
    gx = gy = None
    with torch.no_grad():
        if need_x:
            gx = _from_bary(x, a_log, bary[0], cost)
            if gx is None:
                gx = plan_grad_x(x, y, f_new / eps + a_log, g_old / eps + b_log, eps, cost, engine)
        if need_y:
            gy = _from_bary(y, b_log, bary[1], cost)
            if gy is None:
                gy = plan_grad_x(y, x, g_new / eps + b_log, f_old / eps + a_log, eps, cost, engine)
    return gx, gy


def _from_bary(x: Tensor, a_log: Tensor, b: Tensor | None, cost) -> Tensor | None:
    """``2 s a_i (x_i - b_i)`` (zero where ``b_i`` is not finite), or None without ``b``."""
    if b is None:
        return None
    ok = torch.isfinite(b).all(-1, keepdim=True)
    return (2.0 * cost.scale) * a_log.exp().unsqueeze(-1) * torch.where(ok, x - b, torch.zeros_like(x))
