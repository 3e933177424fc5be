"""Differentiable softmin, with a backward pass made of plan products.

For ``out_i = -eps log sum_j exp(h_j - C_ij / eps)`` and the soft-argmin weights
``w_ij = exp(h_j - C_ij / eps + out_i / eps)`` (rows sum to 1)::

    d out_i / d x_i = sum_j w_ij grad_x C(x_i, y_j)
    d out_i / d y_j = w_ij grad_y C(x_i, y_j)
    d out_i / d h_j = -eps w_ij

so the backward pass is one plan product per input side and memory stays linear.  For a
:class:`~flashot.costs.FeatureBilinearCost` ``C(x, y) = x_0 + y_0 + <x', S y'>`` the gradient
``grad_x C(x_i, y_j) = [1, S y'_j]`` is linear in ``y_j``: the same plan products with the plan weight
(:func:`plan_grad_x`).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..costs import CostLike
from .base import Capability, Engine, self_softmin


class SoftminFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x: Tensor,
        y: Tensor,
        h: Tensor,
        eps: float,
        cost: CostLike,
        engine: Engine,
        value: Tensor | None = None,
        bary: Tensor | None = None,
    ):
        # value: computed by the caller (a fused step): only the backward is ours.  bary (dot-product costs):
        # the caller's soft-argmin barycentres sum_j w_ij y_j, so the x-gradient needs no plan product
        if value is not None:
            out = value.detach()
        elif x.shape == y.shape and x.data_ptr() == y.data_ptr() and x.stride() == y.stride():
            out = self_softmin(engine, x.detach(), h.detach(), eps, cost)  # softmin(x, x, h)
        else:
            out = engine.softmin(x.detach(), y.detach(), h.detach(), eps, cost)
        ctx.save_for_backward(x, y, h, out, bary)
        ctx.eps, ctx.cost, ctx.engine = eps, cost, engine
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, G: Tensor):
        x, y, h, out, bary = ctx.saved_tensors
        eps, cost, engine = ctx.eps, ctx.cost, ctx.engine
        need_x, need_y, need_h = ctx.needs_input_grad[:3]
        gx = gy = gh = None
        alpha = out / eps
        if getattr(cost, "bilinear", False):
            return (
                *_bilinear_grads(x, y, h, alpha, G, eps, cost, engine, (need_x, need_y, need_h)),
                None,
                None,
                None,
                None,
                None,
            )
        D = x.shape[-1]
        ones = torch.ones_like(y[..., :1])
        if need_x and bary is not None:  # rows with no kept mass (non-finite barycentre): gradient 0
            ok = torch.isfinite(bary).all(-1, keepdim=True)
            gx = (2.0 * cost.scale) * G.unsqueeze(-1) * torch.where(ok, x - bary, torch.zeros_like(x))
        elif need_x and cost.is_dot:
            # dcost weight is the constant 2 s: one plan product gives the barycentre AND the
            # row mass, and the gradient uses the *normalised* weights w_ij / sum_j w_ij.  In exact
            # arithmetic the mass is 1; in float32 ``out / eps`` carries a rounding error of
            # ~ulp(|out|) / eps (4e-4 at |f| ~ 12, eps = 0.0025) that would scale the row's gradient
            S = engine.plan_product(x, y, alpha, h, eps, torch.cat([y, ones], -1), cost, "plan")
            mass = S[..., D]
            ok = torch.isfinite(mass) & (mass > 0)  # not ok: all weights zero (out = +inf), gradient 0
            mass = torch.where(ok, mass, torch.ones_like(mass))
            gx = (2.0 * cost.scale) * G.unsqueeze(-1) * (x - S[..., :D] / mass.unsqueeze(-1))
            gx = torch.where(ok.unsqueeze(-1), gx, torch.zeros_like(gx))
        elif need_x:
            S = engine.plan_product(x, y, alpha, h, eps, torch.cat([y, ones], -1), cost, "dcost")
            gx = G.unsqueeze(-1) * (x * S[..., D:] - S[..., :D])
        if need_y or need_h:
            Gc = G.unsqueeze(-1)
            if cost.is_dot or not need_y:
                # dcost weight is the constant 2 s for dot-product costs: one pass.
                T = engine.plan_product(y, x, h, alpha, eps, torch.cat([Gc * x, Gc], -1), cost, "plan")
                if need_y:
                    gy = (2.0 * cost.scale) * (y * T[..., D:] - T[..., :D])
                if need_h:
                    gh = -eps * T[..., D]
            else:
                T = engine.plan_product(y, x, h, alpha, eps, torch.cat([Gc * x, Gc], -1), cost, "dcost")
                gy = y * T[..., D:] - T[..., :D]
                if need_h:
                    gh = -eps * engine.plan_product(y, x, h, alpha, eps, Gc, cost, "plan")[..., 0]
        return gx, gy, gh, None, None, None, None, None


def plan_grad_x(x: Tensor, y: Tensor, alpha: Tensor, beta: Tensor, eps: float, cost, engine: Engine) -> Tensor:
    """``g_i = sum_j K_ij grad_x C(x_i, y_j)`` with ``K_ij = exp(alpha_i + beta_j - C_ij / eps)``, (B, N, D): one plan
    product.  ``grad_x C = w (x - y)`` (``"dcost"`` weight) for the translation-invariant costs; for a
    :class:`~flashot.costs.FeatureBilinearCost` ``grad_x C(x_i, y_j) = [1, S y'_j]``, linear in ``y_j``."""
    D = x.shape[-1]
    if getattr(cost, "bilinear", False):
        P = engine.plan_product(
            x, y, alpha, beta, eps, torch.cat([torch.ones_like(y[..., :1]), y[..., 1:]], -1), cost, "plan"
        )
        return torch.cat([P[..., :1], torch.bmm(P[..., 1:], cost.S.to(device=x.device, dtype=x.dtype))], -1)
    S = engine.plan_product(x, y, alpha, beta, eps, torch.cat([y, torch.ones_like(y[..., :1])], -1), cost, "dcost")
    return x * S[..., D:] - S[..., :D]


def _bilinear_grads(
    x: Tensor,
    y: Tensor,
    h: Tensor,
    alpha: Tensor,
    G: Tensor,
    eps: float,
    cost,
    engine: Engine,
    need: tuple[bool, bool, bool],
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """VJPs of the softmin for a :class:`~flashot.costs.FeatureBilinearCost` ``C(x, y) = x_0 + y_0 + <x', S y'>``:
    ``grad_x C(x_i, y_j) = [1, S y'_j]`` is linear in ``y_j``, so each side is one plan product
    (``gx_i = G_i [1, S sum_j w_ij y'_j]`` with the row-normalised weights ``w``)."""
    need_x, need_y, need_h = need
    gx = gy = gh = None
    if need_x:  # the row-normalised weights: d out_i / d x_i0 = 1 exactly
        P = plan_grad_x(x, y, alpha, h, eps, cost, engine)
        mass = P[..., :1]
        ok = torch.isfinite(mass) & (mass > 0)  # not ok: all weights zero (out = +inf), gradient 0
        gx = G.unsqueeze(-1) * P / torch.where(ok, mass, torch.ones_like(mass))
        gx = torch.where(ok, gx, torch.zeros_like(gx))
    if need_y or need_h:
        Gc = G.unsqueeze(-1)
        T = engine.plan_product(y, x, h, alpha, eps, torch.cat([Gc, Gc * x[..., 1:]], -1), cost, "plan")
        if need_y:
            gy = torch.cat([T[..., :1], torch.bmm(T[..., 1:], cost.S.to(device=x.device, dtype=x.dtype))], -1)
        if need_h:
            gh = -eps * T[..., 0]
    return gx, gy, gh


def softmin_fn(x: Tensor, y: Tensor, h: Tensor, eps: float, cost: CostLike, engine: Engine) -> Tensor:
    """Softmin that is differentiable w.r.t. ``x``, ``y`` and ``h`` (batched tensors)."""
    if plain_autograd(x, y, h, cost, engine):
        return engine.softmin(x, y, h, eps, cost)
    if (
        engine.supports(Capability.SOFTMIN_SYM_BARY)
        and torch.is_grad_enabled()
        and x.requires_grad
        and x.shape == y.shape
        and x.data_ptr() == y.data_ptr()
        and x.stride() == y.stride()
    ):
        with torch.no_grad():  # softmin(x, x, h) and its barycentres from one (half) pass
            res = engine.softmin_sym_bary(x.detach(), h.detach(), eps, cost)
        if res is not None:
            return SoftminFn.apply(x, y, h, eps, cost, engine, *res)
    return SoftminFn.apply(x, y, h, eps, cost, engine)


def plain_autograd(x: Tensor, y: Tensor, h: Tensor, cost: CostLike, engine: Engine) -> bool:
    """Does :func:`softmin_fn` let autograd see the engine's own torch code?  The dense engine is plain
    torch, so double backward works through it; not for ``|x - y|``, whose autograd derivative at
    ``x = y`` is NaN."""
    return (
        engine.name == "dense"
        and cost.is_dot
        and torch.is_grad_enabled()
        and (x.requires_grad or y.requires_grad or h.requires_grad)
    )


def softmin_pair_fn(
    x: Tensor, y: Tensor, hx: Tensor, hy: Tensor, eps: float, cost: CostLike, engine: Engine
) -> tuple[Tensor, Tensor]:
    """``(softmin_fn(x, y.detach(), hy), softmin_fn(y, x.detach(), hx))``: each potential differentiable w.r.t.
    its own points and its log-weights (the final step of a symmetric solve).  The values come from the
    engine's fused ``softmin_pair`` (one pass for both) where the engine asks for it (``Capability.FUSED_FINAL_STEP``:
    the multiscale engine, whose fine stage runs few iterations, so the final step is a large share of
    its work) and :func:`softmin_fn` would use :class:`SoftminFn`; the backward is :class:`SoftminFn`'s
    either way, from the engine's barycentres (``softmin_pair_bary``, no plan product) when the points need
    a gradient and it gives them.  Elsewhere the final step keeps the two softmins (the same rounding as
    ``dense``)."""
    xd, yd = x.detach(), y.detach()
    fused = engine.supports(Capability.FUSED_FINAL_STEP) and engine.supports(Capability.SOFTMIN_PAIR)
    if not fused or plain_autograd(x, yd, hy, cost, engine) or plain_autograd(y, xd, hx, cost, engine):
        return softmin_fn(x, yd, hy, eps, cost, engine), softmin_fn(y, xd, hx, eps, cost, engine)
    need_x, need_y = (torch.is_grad_enabled() and t.requires_grad for t in (x, y))
    bary = (need_x or need_y) and engine.supports(Capability.SOFTMIN_PAIR_BARY)
    with torch.no_grad():
        res = engine.softmin_pair_bary(xd, yd, hx.detach(), hy.detach(), eps, cost, cols=need_y) if bary else None
        f, g, bx, by = (
            res if res is not None else (*engine.softmin_pair(xd, yd, hx.detach(), hy.detach(), eps, cost), None, None)
        )
    return (SoftminFn.apply(x, yd, hy, eps, cost, engine, f, bx), SoftminFn.apply(y, xd, hx, eps, cost, engine, g, by))


class PlanVFn(torch.autograd.Function):
    """``out = (K ⊙ W) V`` with ``K_ij = exp(alpha_i + beta_j - C_ij / eps)``, differentiable in ``V`` only.

    The product is linear in ``V``: its VJP is the transposed product ``(K ⊙ W)^T G`` (the same call
    with the sides swapped: every cost and weight is symmetric), itself a ``PlanVFn``, so higher
    derivatives w.r.t. ``V`` work too.  ``x``, ``y``, ``alpha``, ``beta`` are constants here.
    """

    @staticmethod
    def forward(
        ctx,
        V: Tensor,
        x: Tensor,
        y: Tensor,
        alpha: Tensor,
        beta: Tensor,
        eps: float,
        cost: CostLike,
        engine: Engine,
        weight: str,
    ):
        ctx.save_for_backward(x, y, alpha, beta)
        ctx.args = (eps, cost, engine, weight)
        return engine.plan_product(x, y, alpha, beta, eps, V.detach().contiguous(), cost, weight)

    @staticmethod
    def backward(ctx, G: Tensor):
        x, y, alpha, beta = ctx.saved_tensors
        gV = PlanVFn.apply(G.contiguous(), y, x, beta, alpha, *ctx.args) if ctx.needs_input_grad[0] else None
        return gV, None, None, None, None, None, None, None, None


def plan_apply(
    V: Tensor,
    x: Tensor,
    y: Tensor,
    alpha: Tensor,
    beta: Tensor,
    eps: float,
    cost: CostLike,
    engine: Engine,
    weight: str = "plan",
) -> Tensor:
    """``(K ⊙ W) V`` on batched tensors (``x``, ``y``, ``alpha``, ``beta`` detached): differentiable
    w.r.t. ``V`` when it requires grad (:class:`PlanVFn`), a plain no-grad engine call otherwise."""
    if torch.is_grad_enabled() and V.requires_grad:
        return PlanVFn.apply(V, x, y, alpha, beta, eps, cost, engine, weight)
    with torch.no_grad():
        return engine.plan_product(x, y, alpha, beta, eps, V.contiguous(), cost, weight)
