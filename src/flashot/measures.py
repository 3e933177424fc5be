"""A pair of weighted point clouds, ready for the solver.

Holds batched (B, N, D) / (B, M, D) points centred on a common point (the
costs are translation invariant; centring avoids float32 cancellation in the
GEMM expansion), the weights, their logs (``-inf`` for zero weights) and the
engine.  The solver only calls :meth:`softmin_x` / :meth:`softmin_y` (or both at once,
:meth:`softmin_pair`, for symmetric updates) and the
differentiable variants used in the final step, on log-weights built by :meth:`h_a` /
:meth:`h_b` (``log a + f / eps``).

High temperature.  When ``eps`` is far above the largest cost (``eps > HOT_RATIO * cmax``) a
float32 softmin is rounding noise: in ``h = log b + g / eps`` the informative part ``g / eps``
(and ``C / eps``, both ``<= cmax / eps``) sits below the float32 resolution of ``log b``, so each
potential is off by ``~ eps * 2^-23`` (at blur = 1000 x the diameter that exceeds the Sinkhorn
divergence itself).  There :meth:`h_a` / :meth:`h_b` build ``h`` in float64 (from the float64 log of
the float32 weights) and the softmins run in float64, on the engine when it supports float64
and on ``tiled`` otherwise; the potentials come back in the compute dtype, accurate to its
precision relative to ``cmax``.  Such steps are few (the iterations contract by ``~cmax / eps``),
and the epsilon-scaling's first temperature, ``diameter^p``, is below the threshold.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol, cast

import torch
from torch import Tensor

from ._checks import check_weights
from .costs import Cost, CostLike
from .ops import get_engine, prepare_pair
from .ops.autograd import softmin_fn, softmin_pair_fn
from .ops.base import Capability, Engine, self_softmin


class _GraphCost(Protocol):
    """A cost whose blocks keep their autograd history (``MatrixCost`` with ``graph``; a type for the checker)."""

    def softmin_graph(self, side: str, h: Tensor, eps: float) -> Tensor: ...


# float32 softmins at eps > HOT_RATIO * cmax run in float64 (see the module docstring)
HOT_RATIO = 4.0


def log_weights(a: Tensor) -> Tensor:
    with torch.no_grad():
        out = a.log()
        return out.masked_fill_(a <= 0, float("-inf"))


def log64(w: Tensor, n: int | None = None) -> Tensor:
    """float64 log-weights of ``w``; a row of weights all equal to ``1/N`` rounded to their dtype
    is taken as exactly ``1/N`` (mass 1: at a high temperature a mass off by ``d`` moves the
    uncorrected value ``<a, f> + <b, g>`` by ``~eps d``).  ``n``: ``N`` when ``w`` is a slice of
    the weights (points-sharded mode), else ``w``'s length."""
    w = w.detach()
    n = w.shape[-1] if n is None else n
    out = log_weights(w.double())
    uniform = (w == torch.full_like(w[..., :1], 1.0 / n)).all(-1, keepdim=True)
    return torch.where(uniform, torch.full_like(out, -math.log(n)), out)


# balanced problems: total masses that differ by more than this (relative) have no coupling
MASS_RTOL = 1e-3


@dataclass
class Measures:
    x: Tensor  # (B, N, D), centred, compute dtype (keeps autograd history)
    y: Tensor  # (B, M, D)
    a: Tensor  # (B, N) compute dtype (may require grad)
    b: Tensor  # (B, M)
    a_log: Tensor  # (B, N), detached
    b_log: Tensor  # (B, M), detached
    cost: CostLike
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
    ) -> Measures:
        an, xn, bn, yn = names
        p = prepare_pair(x, y, cost=cost, backend=backend, allow_dense=allow_dense, names=(xn, yn))
        a = check_weights(an, a, x, xn)
        b = check_weights(bn, b, y, yn)
        if not p.batched:
            a, b = a.unsqueeze(0), b.unsqueeze(0)
        a, b = a.to(p.x.dtype), b.to(p.x.dtype)
        return cls(
            p.x, p.y, a, b, log_weights(a), log_weights(b), p.cost, p.engine, p.batched, p.out_dtype, p.center, p.cmax
        )

    # True in flashot.distributed's points-sharded mode (PointsMeasures): x, y, a, b are this rank's slices
    points_sharded = False

    # -- shapes -------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int, int, int]:
        B, N, D = self.x.shape
        return B, N, self.y.shape[1], D

    @property
    def sizes(self) -> tuple[int, int]:
        """``(N, M)``: the points of each cloud (over all ranks in points-sharded mode)."""
        return self.a.shape[-1], self.b.shape[-1]

    # -- reductions over all the points (identity here; all-reduces in points-sharded mode) ----------
    def reduce(self, t: Tensor, op: str = "sum") -> Tensor:
        """``t`` (already reduced over this process's points) combined over the ranks holding the other
        points (``op``: ``"sum"`` or ``"max"``); ``t`` itself on one process."""
        return t

    def reduce_all(self, items: Sequence[tuple[Tensor, str]]) -> list[Tensor]:
        """Each ``(t, op)`` of ``items`` as :meth:`reduce` gives it; in points-sharded mode one collective per
        distinct ``op`` carries them all (the solver reduces an iteration's errors and acceleration sums together:
        a collective costs far more than the few numbers it carries).  The tensors themselves here."""
        return [t for t, _ in items]

    def per_problem_sum(self, t: Tensor, side: str) -> Tensor:
        """(B,) sums of the per-point values ``t`` ((B, N) on ``side`` ``"x"``, (B, M) on ``"y"``) over each
        problem's points: ``t.sum(-1)`` here; a ragged batch (:mod:`flashot.ragged`, one concatenated problem)
        sums each problem's segment, so that errors and masses stay per problem."""
        return t.sum(-1)

    def per_problem_max(self, t: Tensor, side: str) -> Tensor:
        """(B,) maxima of the per-point values ``t`` over each problem's points (as :meth:`per_problem_sum`)."""
        return t.amax(-1)

    def problem_ids(self, side: str) -> Tensor | None:
        """None: the rows of the batch are its problems.  A ragged batch (one concatenated problem) gives the
        (N,) problem of each point of ``side``, so that the acceleration's coefficients stay per problem
        (:class:`~flashot.acceleration.Accelerator`)."""
        return None

    def full(self, sides: str, *ts: Tensor | None) -> tuple:
        """The whole (B, N) / (B, M) vectors of ``ts`` (``sides[k]`` = ``"x"`` or ``"y"``: the cloud of
        ``ts[k]``); ``ts`` itself on one process (differentiable all-gather in points-sharded mode)."""
        return ts

    def bbox_diameter(self) -> float:
        """Diagonal of the joint bounding box of both clouds (all batches together)."""
        from .schedules import max_diameter

        return max_diameter(self.x + self.center, self.y + self.center)

    # -- log-weights (the only way the solver builds softmin inputs) ----------------------
    def hot(self, eps: float) -> bool:
        """True when softmins at ``eps`` run in float64: a float32 problem with ``eps > HOT_RATIO * cmax``."""
        return self.x.dtype != torch.float64 and eps > HOT_RATIO * self.cmax

    def h_a(self, f: Tensor | None, eps: float) -> Tensor:
        """``log a + f / eps`` (``log a`` for ``f=None``): the input of a softmin over x; float64 when hot."""
        if self.hot(eps):
            return self._a_log64 if f is None else self._a_log64 + f.double() / eps
        return self.a_log if f is None else self.a_log + f / eps

    def h_b(self, g: Tensor | None, eps: float) -> Tensor:
        """``log b + g / eps``: the input of a softmin over y; float64 when hot."""
        if self.hot(eps):
            return self._b_log64 if g is None else self._b_log64 + g.double() / eps
        return self.b_log if g is None else self.b_log + g / eps

    @cached_property
    def _a_log64(self) -> Tensor:
        return log64(self.a)

    @cached_property
    def _b_log64(self) -> Tensor:
        return log64(self.b)

    def float64_engine(self) -> Engine:
        """The engine for float64 softmins: ours if it runs float64 here, else ``tiled`` (resolved once, on first
        use, into :attr:`engine64`; a subclass may wrap it)."""
        if self.engine.unsupported(self.x.device, torch.float64, self.cost) is None:
            return self.engine
        return get_engine("tiled", device=self.x.device, dtype=torch.float64, cost=self.cost)

    @cached_property
    def _engine64(self) -> Engine:
        return self.float64_engine()

    @property
    def engine64(self) -> Engine:
        """The engine that runs this problem's float64 softmins (float32 problems at a high temperature)."""
        return self._engine64

    @engine64.setter
    def engine64(self, eng: Engine) -> None:
        self.__dict__["_engine64"] = eng  # replaces the cached one (a distributed solve shards it)

    @cached_property
    def _xy64(self) -> tuple[Tensor, Tensor]:
        return self.x.detach().double(), self.y.detach().double()

    def _route(self, h: Tensor) -> tuple[Engine, Tensor, Tensor]:
        """(engine, x, y) for log-weights ``h``: float64 copies when ``h`` is float64 on a float32 problem."""
        if h.dtype == self.x.dtype:
            return self.engine, self.x.detach(), self.y.detach()
        return (self._engine64, *self._xy64)

    def _back(self, t: Tensor) -> Tensor:
        return t.to(self.x.dtype)

    # -- primitives used by the solver (no autograd) -----------------------------------
    def softmin_x(self, h: Tensor, eps: float) -> Tensor:
        """``f_i = -eps log sum_j exp(h_j - C(x_i, y_j)/eps)``, h: (B, M)."""
        eng, x, y = self._route(h)
        return self._back(eng.softmin(x, y, h, eps, self.cost))

    def softmin_y(self, h: Tensor, eps: float) -> Tensor:
        """``g_j = -eps log sum_i exp(h_i - C(x_i, y_j)/eps)``, h: (B, N)."""
        eng, x, y = self._route(h)
        return self._back(eng.softmin(y, x, h, eps, self.cost))

    def softmin_pair(self, hx: Tensor, hy: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        """``(softmin_x(hy), softmin_y(hx))``: one fused pass where the engine has ``softmin_pair``."""
        eng, x, y = self._route(hx)
        if eng.supports(Capability.SOFTMIN_PAIR):
            sx, sy = eng.softmin_pair(x, y, hx, hy, eps, self.cost)
            return self._back(sx), self._back(sy)
        return self._back(eng.softmin(x, y, hy, eps, self.cost)), self._back(eng.softmin(y, x, hx, eps, self.cost))

    def softmin_alt(self, ha: Tensor, hy: Tensor, eps: float, lam: float = 1.0) -> tuple[Tensor, Tensor]:
        """Alternating step: ``fx = softmin_x(hy)``, then ``softmin_y(ha + lam fx / eps)``; one fused
        pass where the engine has ``softmin_alt``."""
        eng, x, y = self._route(hy)
        if eng.supports(Capability.SOFTMIN_ALT):
            sx, sy = eng.softmin_alt(x, y, ha, hy, eps, self.cost, lam)
            return self._back(sx), self._back(sy)
        fx = eng.softmin(x, y, hy, eps, self.cost)  # kept in h's dtype for the second half-step
        return self._back(fx), self._back(eng.softmin(y, x, ha + lam * fx / eps, eps, self.cost))

    def softmin_xx(self, h: Tensor, eps: float) -> Tensor:
        """``softmin(x, x, h)`` (debiasing); the engine's ``softmin_sym`` when it has one."""
        eng, x, _ = self._route(h)
        return self._back(self_softmin(eng, x, h, eps, self.cost))

    def softmin_yy(self, h: Tensor, eps: float) -> Tensor:
        eng, _, y = self._route(h)
        return self._back(self_softmin(eng, y, h, eps, self.cost))

    def expect_reuse(self) -> None:
        """Tell the engine (if it listens) that the solver will call it on (x, y) many times."""
        if self.engine.supports(Capability.EXPECT_REUSE):
            self.engine.expect_reuse(self.x.detach(), self.y.detach(), self.cost)

    # -- differentiable variants (final step) -------------------------------------------
    def softmin_grad(self, side: str, h: Tensor, eps: float) -> Tensor:
        """Softmin differentiable w.r.t. the *output* side's points only (GeomLoss' rule).

        ``side`` is ``"xy"`` (f on x from y), ``"yx"``, ``"xx"`` or ``"yy"``.
        """
        if getattr(self.cost, "graph", None) is not None:  # a user's cost function: through its matrices
            return cast(_GraphCost, self.cost).softmin_graph(side, h.detach(), eps).to(self.x.dtype)
        pts = {"x": self.x, "y": self.y}
        out, src = pts[side[0]], pts[side[1]].detach()
        if h.dtype == self.x.dtype:
            return softmin_fn(out, src, h.detach(), eps, self.cost, self.engine)
        # high temperature (see h_a): float64 value; autograd goes back through the cast
        out64 = softmin_fn(out.double(), src.double(), h.detach(), eps, self.cost, self._engine64)
        return out64.to(self.x.dtype)

    def softmin_grad_pair(self, hy: Tensor, hx: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        """``(softmin_grad("xy", hy, eps), softmin_grad("yx", hx, eps))``, the values from one fused pass where
        the engine has ``softmin_pair`` (:func:`~flashot.ops.autograd.softmin_pair_fn`)."""
        if getattr(self.cost, "graph", None) is not None or hx.dtype != self.x.dtype or hy.dtype != self.x.dtype:
            return self.softmin_grad("xy", hy, eps), self.softmin_grad("yx", hx, eps)
        return softmin_pair_fn(self.x, self.y, hx.detach(), hy.detach(), eps, self.cost, self.engine)

    def masses(self) -> tuple[Tensor, Tensor]:
        """``(sum a, sum b)`` per problem, (B,) each, in float64 (detached)."""
        ma, mb = self.reduce_all(
            [
                (self.per_problem_sum(self.a.detach().double(), "x"), "sum"),
                (self.per_problem_sum(self.b.detach().double(), "y"), "sum"),
            ]
        )
        return ma, mb

    def unequal_masses(self) -> tuple[float, float] | None:
        """``(sum a, sum b)`` of the first problem whose total masses differ by more than
        ``MASS_RTOL`` (relative; 8 rounding units for float16 / bfloat16 inputs: bfloat16 weights
        of 1/3 sum to 1.00195), else None.  Balanced OT has no coupling between such measures."""
        ma, mb = self.masses()
        gap = (ma - mb).abs() / torch.maximum(ma, mb)
        rtol = MASS_RTOL
        if self.out_dtype in (torch.float16, torch.bfloat16):
            rtol = max(rtol, 8 * torch.finfo(self.out_dtype).eps)
        k = int(gap.argmax())
        return (float(ma[k]), float(mb[k])) if float(gap[k]) > rtol else None

    def restore(self, t: Tensor) -> Tensor:
        """Drop the batch axis if the input had none and cast to the input dtype."""
        t = t if self.batched else t[0]
        return t.to(self.out_dtype)
