r"""Kernel norms (MMD) and Hausdorff divergences: GeomLoss' other ``SamplesLoss`` losses.

Kernel norms (``loss="gaussian" | "laplacian" | "energy"``), GeomLoss' definition::

    L(a, b) = 1/2 <a - b, k ⋆ (a - b)>
            = 1/2 sum_ij a_i a_j k(x_i, x_j) + 1/2 sum_ij b_i b_j k(y_i, y_j) - sum_ij a_i b_j k(x_i, y_j)

with ``k = exp(-|x-y|^2 / (2 blur^2))``, ``exp(-|x-y| / blur)`` or ``-|x-y|``; each ``k ⋆ v``
is one streamed plan product of the engines (:mod:`flashot.ops.kernel_sum`).  ``potentials=True``
returns GeomLoss' ``(k ⋆ (a - b) on x, k ⋆ (b - a) on y)``: the gradients of ``L`` w.r.t. the
weights.

Hausdorff divergence (``loss="hausdorff"``), with the softmin ``s_m(z) = -eps log sum_k m_k
exp(-C(z, z_k) / eps)``, ``C = |x-y|^p / p`` as for ``"sinkhorn"`` and ``eps = blur^p``::

    H(a, b) = 1/2 <a, s_b - s_a> + 1/2 <b, s_a - s_b>

(Feydy et al., AISTATS 2019, "Interpolating between optimal transport and MMD using Sinkhorn
divergences"): as blur -> 0, ``s_m(z)`` is the cost to the nearest point of ``m`` and ``H`` the
symmetric Chamfer / ICP loss ``1/2 sum_i a_i C(x_i, y) + 1/2 sum_j b_j C(y_j, x)``; as blur grows
it tends to the kernel norm of ``-C``.  GeomLoss 0.3.1 lists the loss but its ``SamplesLoss
("hausdorff")`` raises ``KeyError``; flashot implements the definition above.  ``potentials=True``
returns the gradients of ``H`` w.r.t. the weights (by autograd through the softmins).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .implicit import safe_log
from .measures import Measures
from .ops.autograd import softmin_fn
from .ops.kernel_sum import KERNELS, kernel_spec, kernel_sum
from .ops.registry import get_engine

__all__ = ["KERNELS", "kernel_loss", "hausdorff_loss", "kernel_matrix_loss"]


def _engine_for(name: str, m: Measures, backend: str):
    """The energy kernel needs eps = +inf (no exponential): the dense, tiled and cpu engines take it."""
    if name != "energy" or m.engine.name in ("dense", "tiled", "cpu"):
        return m.engine
    if backend not in ("auto", "online"):
        raise ValueError(
            f"loss='energy' does not run on backend={backend!r} (its kernel -|x - y| has no exponential, "
            "which that engine's kernels assume); use backend='cpu', 'tiled' or 'auto'"
        )
    return get_engine("tiled", device=m.x.device, dtype=m.x.dtype, cost=m.cost)


def kernel_loss(name: str, m: Measures, blur: float, backend: str, potentials: bool) -> Tensor | tuple[Tensor, Tensor]:
    """GeomLoss' kernel norm ``1/2 |a - b|_k^2`` (B,), or its potentials ``(k ⋆ (a - b), k ⋆ (b - a))``."""
    spec = kernel_spec(name, blur)
    eng = _engine_for(name, m, backend)
    x, y, a, b = m.x, m.y, m.a, m.b
    ax, bx = kernel_sum(x, x, a, spec, eng), kernel_sum(x, y, b, spec, eng)
    by = kernel_sum(y, y, b, spec, eng)
    if potentials:
        ay = kernel_sum(y, x, a, spec, eng)
        return ax - bx, by - ay
    return 0.5 * (a * ax).sum(-1) + 0.5 * (b * by).sum(-1) - (a * bx).sum(-1)


def _hausdorff(x: Tensor, y: Tensor, a: Tensor, b: Tensor, eps: float, cost, eng) -> Tensor:
    la, lb = safe_log(a), safe_log(b)
    if getattr(cost, "graph", None) is not None:  # a user's cost function: its matrices, by autograd

        def sm(side, h):
            return cost.softmin_graph(side, h, eps).to(a.dtype)
    else:
        pts = {"x": x, "y": y}

        def sm(side, h):
            return softmin_fn(pts[side[0]], pts[side[1]], h, eps, cost, eng)

    s_bx, s_ax, s_ay, s_by = sm("xy", lb), sm("xx", la), sm("yx", la), sm("yy", lb)
    return 0.5 * (a * (s_bx - s_ax)).sum(-1) + 0.5 * (b * (s_ay - s_by)).sum(-1)


def hausdorff_loss(m: Measures, eps: float, potentials: bool) -> Tensor | tuple[Tensor, Tensor]:
    """The Hausdorff divergence ``H(a, b)`` (B,) at temperature ``eps``, or its weight gradients
    ``(dH/da, dH/db)`` (detached)."""
    x, y, a, b, eng, cost = m.x, m.y, m.a, m.b, m.engine, m.cost
    if m.hot(eps):  # float32 softmins at eps >> cost lose their digits: float64, as the solver does
        x, y, a, b, eng = x.double(), y.double(), a.double(), b.double(), m.engine64
    if not potentials:
        return _hausdorff(x, y, a, b, eps, cost, eng).to(m.x.dtype)
    a, b = a.detach().requires_grad_(), b.detach().requires_grad_()
    with torch.enable_grad():
        H = _hausdorff(x.detach(), y.detach(), a, b, eps, cost, eng)
        F, G = torch.autograd.grad(H.sum(), (a, b))
    return F.to(m.x.dtype), G.to(m.x.dtype)


def kernel_matrix_loss(m: Measures, potentials: bool) -> Tensor | tuple[Tensor, Tensor]:
    """GeomLoss' kernel norm for a user's kernel function, on its (B, N, M) matrices ``K_xy``, ``K_yx``,
    ``K_xx``, ``K_yy`` (``m.cost.graph``, with autograd history in both arguments):
    ``1/2 <a, K_xx a> + 1/2 <b, K_yy b> - <a, K_xy b>``, or its weight gradients
    ``(K_xx a - K_xy b, K_yy b - K_yx a)``."""
    K: dict[str, Tensor] | None = getattr(m.cost, "graph", None)  # a MatrixCost built from the user's function
    assert K is not None, "kernel_matrix_loss needs a cost with its matrices (flashot.matrix_measures)"
    a, b = m.a, m.b

    def mv(side: str, w: Tensor) -> Tensor:
        return (K[side] @ w.unsqueeze(-1)).squeeze(-1)

    if potentials:
        a, b = a.detach(), b.detach()
        return mv("xx", a) - mv("xy", b), mv("yy", b) - mv("yx", a)
    return 0.5 * (a * mv("xx", a)).sum(-1) + 0.5 * (b * mv("yy", b)).sum(-1) - (a * mv("xy", b)).sum(-1)
