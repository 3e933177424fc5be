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

import math
from typing import NamedTuple

import torch
from torch import Tensor

from .._checks import (
    check_choice,
    check_dtype,
    check_eps_scale,
    check_finite,
    check_pair,
    check_points,
    check_positive,
    check_storage,
    compute_dtype,
)
from ..costs import Cost, get_cost
from .autograd import plan_apply, softmin_fn
from .base import WEIGHTS, Engine, Weight
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
    "common_center",
    "prepare_pair",
    "PreparedPair",
]


def _bounds(x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """Corners ``(lo, hi)`` of the joint bounding box of both clouds, (B, D) each, detached."""
    with torch.no_grad():
        return torch.minimum(x.amin(-2), y.amin(-2)), torch.maximum(x.amax(-2), y.amax(-2))


def common_center(x: Tensor, y: Tensor) -> Tensor:
    """Midpoint of the joint bounding box of both clouds, (B, 1, D), detached.

    ``center = (min(x, y) + max(x, y)) / 2``, coordinate-wise over both clouds.  Every cost is
    translation invariant, ``C(x - c, y - c) = C(x, y)``, so the engines work on ``x - c`` and
    ``y - c``: this keeps the float32 expansion ``|x|^2 + |y|^2 - 2<x, y>`` accurate.

    Example:
        >>> import torch
        >>> from flashot import ops
        >>> x = torch.tensor([[[0.0, 0.0], [2.0, 1.0]]])
        >>> y = torch.tensor([[[4.0, -1.0]]])
        >>> ops.common_center(x, y)
        tensor([[[2., 0.]]])
    """
    lo, hi = _bounds(x, y)
    return ((lo + hi) / 2).unsqueeze(-2)


def max_cost(x: Tensor, y: Tensor, cost: Cost, cdt: torch.dtype, names: tuple[str, str] = ("x", "y")) -> float:
    """Upper bound of ``C(x_i, y_j)`` over all pairs (the cost of the joint bounding box's diagonal).

    Raises ``ValueError`` naming both clouds when the squared distances would overflow the
    compute dtype ``cdt`` (finite points, but ``|x - y|^2`` above its largest finite number):
    every engine forms them (GEMM expansion or differences squared).
    """
    lo, hi = _bounds(x, y)
    d2 = float((hi.double() - lo.double()).pow(2).sum(-1).max())
    big = torch.finfo(cdt).max
    if not d2 < big / 4:  # |x|^2 + |y|^2 + 2|<x, y>| of centred points is at most d2; margin for sums
        raise ValueError(
            f"{names[0]} and {names[1]}: squared distances between the points overflow {cdt} (the bounding "
            f"box's diagonal is {math.sqrt(d2):.3g}, squared {d2:.3g}, above {big / 4:.3g}); rescale the points "
            f"(the value scales with the cost: scale reg / blur**p with it) or use float64"
        )
    return float(cost.from_sqdist(torch.tensor(d2, dtype=torch.float64)))


class PreparedPair(NamedTuple):
    """Two clouds ready for the engines (:func:`prepare_pair`'s result).

    Attributes:
        x: (B, N, D) points minus ``center``, in the compute dtype; keeps autograd history.
        y: (B, M, D) points minus ``center``.
        cost: the :class:`~flashot.Cost` ``C``; ``C(x, y)`` is unchanged by the centring.
        engine: the :class:`Engine` chosen for the problem.
        batched: whether the inputs had a batch axis (outputs drop it otherwise).
        out_dtype: the dtype to return results in (the inputs' dtype).
        center: (B, 1, D), subtracted from both clouds (:func:`common_center`).
        cmax: ``max_ij C(x_i, y_j)`` bound: the cost of the joint bounding box's diagonal, float64.

    Example:
        >>> import torch
        >>> from flashot import ops
        >>> pp = ops.prepare_pair(torch.zeros(3, 2), torch.tensor([[3.0, 4.0]]),
        ...                       cost="sqeuclidean", backend="dense")
        >>> pp.x.shape, pp.batched, pp.engine.name, pp.cmax  # cmax = 3^2 + 4^2
        (torch.Size([1, 3, 2]), False, 'dense', 25.0)
    """

    x: Tensor  # (B, N, D) centred, compute dtype, keeps autograd history
    y: Tensor  # (B, M, D)
    cost: Cost
    engine: Engine
    batched: bool
    out_dtype: torch.dtype
    center: Tensor  # (B, 1, D), subtracted from both clouds
    cmax: float  # upper bound of the cost over all pairs (bounding-box diagonal), float64


def prepare_pair(
    x: Tensor,
    y: Tensor,
    *,
    cost: str | Cost,
    backend: str,
    allow_dense: bool = True,
    names: tuple[str, str] = ("x", "y"),
) -> PreparedPair:
    """Validate two clouds, batch them, cast to the compute dtype, centre them, pick the engine.

    Also bounds the cost (``cmax``) and rejects clouds whose squared distances overflow the
    compute dtype (:func:`max_cost`).

    Returns a :class:`PreparedPair` with ``x - c`` and ``y - c`` for the centre ``c`` of
    :func:`common_center` (``C(x - c, y - c) = C(x, y)``: every cost is translation invariant),
    ``cmax >= max_ij C(x_i, y_j)``, and the engine of ``backend`` for this size.  float16 /
    bfloat16 inputs are computed in float32.

    Example:
        >>> import torch
        >>> from flashot import ops
        >>> x, y = torch.randn(2, 5, 3) + 100, torch.randn(2, 4, 3) + 100
        >>> pp = ops.prepare_pair(x, y, cost="half_sqeuclidean", backend="tiled")
        >>> pp.batched, pp.engine.name, pp.cost.name
        (True, 'tiled', 'half_sqeuclidean')
        >>> bool(torch.allclose(pp.x + pp.center, x)), bool(pp.center.abs().max() > 90)
        (True, True)
    """
    xn, yn = names
    check_points(xn, x)
    check_points(yn, y)
    check_pair(x, y, xn, yn)
    bilinear = getattr(cost, "bilinear", False)  # FeatureBilinearCost: augmented points, no centring
    if not isinstance(cost, (str, Cost)) and not bilinear:
        hint = ("; for a precomputed cost matrix use flashot.solve(M, a, b, reg=...) (POT's ot.solve)"
                if hasattr(cost, "shape") else "")
        raise TypeError(f"cost: expected a cost name (string) or a flashot.Cost, got {type(cost).__name__}{hint}")
    cost = cost if bilinear else get_cost(cost)
    batched = x.dim() == 3
    if not batched:
        x, y = x.unsqueeze(0), y.unsqueeze(0)
    out_dtype = x.dtype
    cdt = compute_dtype(x.dtype)
    cmax = cost.bound(x, y) if bilinear else max_cost(x, y, cost, cdt, names)
    x, y = x.to(cdt), y.to(cdt)
    c = torch.zeros_like(x[:, :1]) if bilinear else common_center(x, y)
    x, y = (x - c).contiguous(), (y - c).contiguous()
    B, N, D = x.shape
    eng = get_engine(backend, device=x.device, dtype=cdt, cost=cost, size=(B, N, y.shape[1], D),
                     allow_dense=allow_dense)
    return PreparedPair(x, y, cost, eng, batched, out_dtype, c, cmax)


def _vec(name: str, v: Tensor, shape, cdt, device) -> Tensor:
    if not isinstance(v, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(v).__name__}")
    check_dtype(name, v)
    check_storage(name, v)
    if v.device != device:
        raise ValueError(f"{name}: is on {v.device}, expected {device}")
    if tuple(v.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(v.shape)}")
    if bool(torch.isnan(v.detach()).any()) or bool(torch.isposinf(v.detach()).any()):
        raise ValueError(f"{name}: contains NaN or +Inf (-Inf is allowed and means zero weight)")
    return v.to(cdt)


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
            raise ValueError(f"{name}: requires grad, but plan_product is differentiable w.r.t. V only; "
                             f"detach {name} (or use SamplesLoss / solve_sample for gradients in the points)")


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


from .ctransform import c_transform  # noqa: E402  (needs _prepare above)

__all__ += ["c_transform"]
