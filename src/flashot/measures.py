"""A pair of weighted point clouds, ready for the solver.

Holds batched (B, N, D) / (B, M, D) points centred on a common point (the
costs are translation invariant; centring avoids float32 cancellation in the
GEMM expansion), the weights, their logs (``-inf`` for zero weights) and the
engine.  The solver only calls :meth:`softmin_x` / :meth:`softmin_y` (or both at once,
:meth:`softmin_pair`, for symmetric updates) and the
differentiable variants used in the final step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ._checks import check_weights
from .costs import Cost
from .ops import prepare_pair
from .ops.autograd import softmin_fn
from .ops.base import Engine, self_softmin


def log_weights(a: Tensor) -> Tensor:
    with torch.no_grad():
        out = a.log()
        return out.masked_fill_(a <= 0, float("-inf"))


@dataclass
class Measures:
    x: Tensor  # (B, N, D), centred, compute dtype (keeps autograd history)
    y: Tensor  # (B, M, D)
    a: Tensor  # (B, N) compute dtype (may require grad)
    b: Tensor  # (B, M)
    a_log: Tensor  # (B, N), detached
    b_log: Tensor  # (B, M), detached
    cost: Cost
    engine: Engine
    batched: bool
    out_dtype: torch.dtype
    center: Tensor  # (B, 1, D), subtracted from both clouds
    cmax: float = math.inf  # upper bound of the cost over all pairs (see ``ops.max_cost``)

    @classmethod
    def build(
        cls,
        x: Tensor,
        y: Tensor,
        a: Tensor | None,
        b: Tensor | None,
        *,
        cost: str | Cost,
        backend: str,
        allow_dense: bool = True,
        names: tuple[str, str, str, str] = ("a", "x", "b", "y"),
    ) -> "Measures":
        an, xn, bn, yn = names
        p = prepare_pair(x, y, cost=cost, backend=backend, allow_dense=allow_dense, names=(xn, yn))
        a = check_weights(an, a, x, xn)
        b = check_weights(bn, b, y, yn)
        if not p.batched:
            a, b = a.unsqueeze(0), b.unsqueeze(0)
        a, b = a.to(p.x.dtype), b.to(p.x.dtype)
        return cls(p.x, p.y, a, b, log_weights(a), log_weights(b), p.cost, p.engine, p.batched, p.out_dtype,
                   p.center, p.cmax)

    # -- shapes -------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int, int, int]:
        B, N, D = self.x.shape
        return B, N, self.y.shape[1], D

    # -- primitives used by the solver (no autograd) -----------------------------------
    def softmin_x(self, h: Tensor, eps: float) -> Tensor:
        """``f_i = -eps log sum_j exp(h_j - C(x_i, y_j)/eps)``, h: (B, M)."""
        return self.engine.softmin(self.x.detach(), self.y.detach(), h, eps, self.cost)

    def softmin_y(self, h: Tensor, eps: float) -> Tensor:
        """``g_j = -eps log sum_i exp(h_i - C(x_i, y_j)/eps)``, h: (B, N)."""
        return self.engine.softmin(self.y.detach(), self.x.detach(), h, eps, self.cost)

    def softmin_pair(self, hx: Tensor, hy: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        """``(softmin_x(hy), softmin_y(hx))``: one fused pass where the engine has ``softmin_pair``."""
        pair = getattr(self.engine, "softmin_pair", None)
        if pair is not None:
            return pair(self.x.detach(), self.y.detach(), hx, hy, eps, self.cost)
        return self.softmin_x(hy, eps), self.softmin_y(hx, eps)

    def softmin_alt(self, ha: Tensor, hy: Tensor, eps: float, lam: float = 1.0) -> tuple[Tensor, Tensor]:
        """Alternating step: ``fx = softmin_x(hy)``, then ``softmin_y(ha + lam fx / eps)``; one fused
        pass where the engine has ``softmin_alt``."""
        alt = getattr(self.engine, "softmin_alt", None)
        if alt is not None:
            return alt(self.x.detach(), self.y.detach(), ha, hy, eps, self.cost, lam)
        fx = self.softmin_x(hy, eps)
        return fx, self.softmin_y(ha + lam * fx / eps, eps)

    def softmin_xx(self, h: Tensor, eps: float) -> Tensor:
        """``softmin(x, x, h)`` (debiasing); the engine's ``softmin_sym`` when it has one."""
        return self._self_softmin(self.x.detach(), h, eps)

    def softmin_yy(self, h: Tensor, eps: float) -> Tensor:
        return self._self_softmin(self.y.detach(), h, eps)

    def _self_softmin(self, p: Tensor, h: Tensor, eps: float) -> Tensor:
        return self_softmin(self.engine, p, h, eps, self.cost)

    def expect_reuse(self) -> None:
        """Tell the engine (if it listens) that the solver will call it on (x, y) many times."""
        hint = getattr(self.engine, "expect_reuse", None)
        if hint is not None:
            hint(self.x.detach(), self.y.detach(), self.cost)

    # -- differentiable variants (final step) -------------------------------------------
    def softmin_grad(self, side: str, h: Tensor, eps: float) -> Tensor:
        """Softmin differentiable w.r.t. the *output* side's points only (GeomLoss' rule).

        ``side`` is ``"xy"`` (f on x from y), ``"yx"``, ``"xx"`` or ``"yy"``.
        """
        pts = {"x": self.x, "y": self.y}
        out, src = pts[side[0]], pts[side[1]].detach()
        return softmin_fn(out, src, h.detach(), eps, self.cost, self.engine)

    def restore(self, t: Tensor) -> Tensor:
        """Drop the batch axis if the input had none and cast to the input dtype."""
        t = t if self.batched else t[0]
        return t.to(self.out_dtype)
