"""Kernel sums ``(k ⋆ v)(x_i) = sum_j k(x_i, y_j) v_j``, streamed, differentiable in x, y and v.

The three radial kernels of GeomLoss are plan products of the engines (``ops/base.py``):

* ``gaussian``:  ``k = exp(-|x - y|^2 / (2 s^2))`` = ``exp(-C / eps)``, C = |x - y|^2 / 2, eps = s^2;
* ``laplacian``: ``k = exp(-|x - y| / s)``        = ``exp(-C / eps)``, C = |x - y|,     eps = s;
* ``energy``:    ``k = -|x - y|``                 = ``-exp(-C / eps) C`` with eps = +inf (weight "cost").

The gradient is another plan product: ``grad_x k(x, y) = d * k~(x, y) * w(x, y) * (x - y)``
with ``w`` the engines' ``"dcost"`` weight (``grad_x C = w (x - y)``), ``d = -1 / eps`` and
``k~ = k`` for the exponential kernels, ``d = -1`` and ``k~ = 1`` for the energy kernel.  So

    d/dx_i <u, k ⋆ v> = d u_i (x_i S0_i - S1_i),   S = (K~ ⊙ W) [v, v y]   (one pass, K = N x M)

and the same with the roles of (x, u) and (y, v) swapped for ``y``; ``d/dv = K^T u``.  Where
``w`` is singular (x = y for ``|x - y|``) it is 0, as is the subgradient autograd takes of
GeomLoss' clamped distances.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..costs import Cost, get_cost
from .base import Engine

__all__ = ["KernelSpec", "kernel_spec", "kernel_sum", "KERNELS"]

KERNELS = ("gaussian", "laplacian", "energy")


@dataclass(frozen=True)
class KernelSpec:
    """A kernel as a plan product: ``k = sign * exp(-C / eps) * W`` (W = 1, or C for ``"cost"``)."""

    name: str
    cost: Cost
    eps: float  # math.inf for the energy kernel
    weight: str  # "plan" or "cost"
    sign: float
    dscale: float  # grad_x k = dscale * exp(-C / eps) * w * (x - y)


def kernel_spec(name: str, blur: float) -> KernelSpec:
    """The plan-product form of GeomLoss' kernel ``name`` at scale ``blur``, with exact distances
    (GeomLoss' tensorized backend clamps ``|x - y|^2`` at 1e-8, which moves ``laplacian`` and ``energy``
    values by ~1e-4 times the mass on the diagonal; flashot does not)."""
    euclid = get_cost("euclidean")
    if name == "gaussian":
        eps = blur * blur
        return KernelSpec(name, get_cost("half_sqeuclidean"), eps, "plan", 1.0, -1.0 / eps)
    if name == "laplacian":
        return KernelSpec(name, euclid, float(blur), "plan", 1.0, -1.0 / blur)
    if name == "energy":
        return KernelSpec(name, euclid, math.inf, "cost", -1.0, -1.0)
    raise ValueError(f"kernel: expected one of {KERNELS}, got {name!r}")


def _product(engine: Engine, spec: KernelSpec, x: Tensor, y: Tensor, V: Tensor, weight: str) -> Tensor:
    zx = x.new_zeros(x.shape[:-1])
    zy = y.new_zeros(y.shape[:-1])
    return engine.plan_product(x, y, zx, zy, spec.eps, V.contiguous(), spec.cost, weight)


class KernelSumFn(torch.autograd.Function):
    """``out = k ⋆ v`` on batched tensors: x (B, N, D), y (B, M, D), v (B, M) -> (B, N)."""

    @staticmethod
    def forward(ctx, x: Tensor, y: Tensor, v: Tensor, spec: KernelSpec, engine: Engine):
        out = spec.sign * _product(engine, spec, x.detach(), y.detach(), v.detach().unsqueeze(-1), spec.weight)
        ctx.save_for_backward(x, y, v)
        ctx.spec, ctx.engine = spec, engine
        return out[..., 0]

    @staticmethod
    @once_differentiable
    def backward(ctx, u: Tensor):
        x, y, v = ctx.saved_tensors
        spec, engine = ctx.spec, ctx.engine
        need_x, need_y, need_v = ctx.needs_input_grad[:3]
        gx = gy = gv = None
        if need_v:
            gv = spec.sign * _product(engine, spec, y, x, u.unsqueeze(-1), spec.weight)[..., 0]
        if need_x:
            gx = _side_grad(engine, spec, x, y, u, v)
        if need_y:
            gy = _side_grad(engine, spec, y, x, v, u)
        return gx, gy, gv, None, None


def _side_grad(engine: Engine, spec: KernelSpec, x: Tensor, y: Tensor, u: Tensor, v: Tensor) -> Tensor:
    """``d/dx_i sum_ij u_i k(x_i, y_j) v_j = dscale u_i (x_i S0_i - S1_i)``, S = (K~ ⊙ W)[v, v y]."""
    S = _product(engine, spec, x, y, torch.cat([v.unsqueeze(-1), v.unsqueeze(-1) * y], -1), "dcost")
    return spec.dscale * u.unsqueeze(-1) * (x * S[..., :1] - S[..., 1:])


def kernel_sum(x: Tensor, y: Tensor, v: Tensor, spec: KernelSpec, engine: Engine) -> Tensor:
    """``(k ⋆ v)(x_i) = sum_j k(x_i, y_j) v_j`` for batched tensors, differentiable in x, y and v."""
    return KernelSumFn.apply(x, y, v, spec, engine)
