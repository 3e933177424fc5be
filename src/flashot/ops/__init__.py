"""The two streamed primitives and the engines behind them.

``softmin``:       out_i = -eps * log sum_j exp(h_j - C(x_i, y_j) / eps)
``plan_product``:  out_i = sum_j exp(alpha_i + beta_j - C(x_i, y_j) / eps) W_ij V_j

Both accept (N, D) or (B, N, D) points, pick an engine with ``backend=``
(``"auto"``, ``"dense"``, ``"tiled"``, and the optional ``"triton"`` / ``"cpu"``),
centre both clouds on a common point (C is translation invariant; this avoids
float32 cancellation in |x|^2 + |y|^2 - 2<x, y>), and compute float16/bfloat16
inputs in float32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._checks import (
    check_choice,
    check_dtype,
    check_eps_scale,
    check_finite,
    check_positive,
    check_storage,
)
from ..costs import Cost
from .autograd import plan_apply, softmin_fn
from .base import WEIGHTS, Capability, Engine, ForwardingEngine, Weight
from .ctransform import c_transform
from .prepare import PreparedPair, common_center, max_cost, prepare_pair  # noqa: F401  (max_cost: kept here)
from .prepare import check_vector as _vec
from .registry import EngineUnavailable, engine_names, get_engine, register_engine, unregister_engine

__all__ = [
    "softmin",
    "plan_product",
    "get_engine",
    "register_engine",
    "unregister_engine",
    "engine_names",
    "EngineUnavailable",
    "Engine",
    "Capability",
    "ForwardingEngine",
    "common_center",
    "prepare_pair",
    "PreparedPair",
    "c_transform",
]


def softmin(
    x: Tensor, y: Tensor, h: Tensor, eps: float, *, cost: str | Cost = "sqeuclidean", backend: str = "auto"
) -> Tensor:
    """``out_i = -eps * log sum_j exp(h_j - C(x_i, y_j) / eps)``, streamed.

    Args:
        x: (N, D) or (B, N, D) points.  y: (M, D) or (B, M, D) points.
        h: (M,) or (B, M) log-weights (``-inf`` = zero weight).
        eps: temperature > 0.
    Returns:
        (N,) or (B, N), differentiable w.r.t. ``x``, ``y`` and ``h``.

    ``C`` is ``cost`` (default ``C(x, y) = |x - y|^2``) and ``eps`` the temperature; with
    ``h_j = g_j / eps + log b_j`` this is the Sinkhorn update of ``f`` (the c-transform as eps -> 0).

    Example:
        >>> import torch
        >>> from flashot import ops
        >>> _ = torch.manual_seed(0)
        >>> x, y, h = torch.randn(5, 2), torch.randn(6, 2), torch.randn(6)
        >>> out = ops.softmin(x, y, h, 0.5)
        >>> ref = -0.5 * torch.logsumexp(h - torch.cdist(x, y) ** 2 / 0.5, dim=1)
        >>> out.shape, bool(torch.allclose(out, ref, atol=1e-5))
        (torch.Size([5]), True)
    """
    eps = check_positive("eps", eps)
    pp = prepare_pair(x, y, cost=cost, backend=backend)
    x_, y_, cost, eng, batched, out_dtype = pp[:6]
    cdt = x_.dtype
    check_eps_scale("eps", eps, pp.cmax, cdt)
    h_ = _vec("h", h, y.shape[:-1], cdt, x.device)
    if not batched:
        h_ = h_.unsqueeze(0)
    out = softmin_fn(x_, y_, h_, eps, cost, eng)
    out = out if batched else out[0]
    return out.to(out_dtype)


def plan_product(
    x: Tensor,
    y: Tensor,
    alpha: Tensor,
    beta: Tensor,
    eps: float,
    V: Tensor,
    *,
    cost: str | Cost = "sqeuclidean",
    weight: Weight = "plan",
    backend: str = "auto",
) -> Tensor:
    """``out_i = sum_j exp(alpha_i + beta_j - C(x_i, y_j) / eps) W_ij V_j``, streamed.

    ``V`` is (M,), (M, K) or (B, M, K), finite; ``weight`` selects ``W`` (``"plan"``: 1,
    ``"cost"``: C_ij, ``"dcost"``: w with grad_x C = w (x - y)).  Differentiable w.r.t. ``V``
    (linear: the VJP is the transposed product); ``x``, ``y``, ``alpha`` and ``beta`` are
    constants, and one that requires grad (with grad mode on) raises rather than having its
    gradient silently dropped (detach it).

    ``C`` is ``cost`` (default ``C(x, y) = |x - y|^2``) and ``eps`` the temperature; with
    ``alpha = f / eps + log a`` and ``beta = g / eps + log b`` this is ``P @ V`` for the entropic plan
    ``P_ij = a_i b_j exp((f_i + g_j - C(x_i, y_j)) / eps)``.

    Example:
        >>> import torch
        >>> from flashot import ops
        >>> _ = torch.manual_seed(0)
        >>> x, y = torch.randn(5, 2, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
        >>> alpha, beta = torch.randn(5, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
        >>> V = torch.randn(6, 3, dtype=torch.float64)
        >>> C = torch.cdist(x, y) ** 2
        >>> K = torch.exp(alpha[:, None] + beta[None, :] - C / 0.5)
        >>> bool(torch.allclose(ops.plan_product(x, y, alpha, beta, 0.5, V), K @ V))
        True
        >>> bool(torch.allclose(ops.plan_product(x, y, alpha, beta, 0.5, V, weight="cost"), (K * C) @ V))
        True
    """
    eps = check_positive("eps", eps)
    check_choice("weight", weight, WEIGHTS)
    _no_grad_inputs(x=x, y=y, alpha=alpha, beta=beta)
    pp = prepare_pair(x, y, cost=cost, backend=backend)
    x_, y_, cost, eng, batched, out_dtype = pp[:6]
    cdt = x_.dtype
    check_eps_scale("eps", eps, pp.cmax, cdt)
    a_ = _vec("alpha", alpha, x.shape[:-1], cdt, x.device)
    b_ = _vec("beta", beta, y.shape[:-1], cdt, x.device)
    V_, vec = _values("V", V, y.shape[:-1], batched)
    V_ = V_.to(x.device, cdt)
    if not batched:
        a_, b_, V_ = a_.unsqueeze(0), b_.unsqueeze(0), V_.unsqueeze(0)
    out = plan_apply(V_, x_.detach(), y_.detach(), a_.detach(), b_.detach(), eps, cost, eng, weight)
    out = out if batched else out[0]
    out = out[..., 0] if vec else out
    return out.to(out_dtype)


def _no_grad_inputs(**tensors: Tensor) -> None:
    if not torch.is_grad_enabled():
        return
    for name, t in tensors.items():
        if isinstance(t, Tensor) and t.requires_grad:
            raise ValueError(
                f"{name}: requires grad, but plan_product is differentiable w.r.t. V only; "
                f"detach {name} (or use SamplesLoss / solve_sample for gradients in the points)"
            )


def _values(name: str, V, lead, batched: bool) -> tuple[Tensor, bool]:
    """Right-hand side of a plan product: a finite dense tensor (M,), (M, K) or batched; returns
    it with a trailing K axis, and whether it had none."""
    if not isinstance(V, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(V).__name__}")
    check_dtype(name, V, allow_int=True)  # integer / bool values are cast to the compute dtype
    check_storage(name, V)
    vec = V.dim() == (1 if not batched else 2)
    V_ = V.unsqueeze(-1) if vec else V
    if V_.dim() != len(lead) + 1 or V_.shape[:-1] != lead:
        raise ValueError(f"{name}: expected leading shape {tuple(lead)}, got {tuple(V.shape)}")
    check_finite(name, V.detach())
    return V_, vec
