"""The engine contract: two streamed primitives, plus optional fused steps an engine declares.

All tensors are batched and contiguous: ``x`` (B, N, D), ``y`` (B, M, D), same
dtype (float32 or float64) and device.  ``eps`` is a positive Python float.

* ``softmin(x, y, h, eps, cost)``  ->  (B, N)::

      out_i = -eps * log sum_j exp(h_j - C(x_i, y_j) / eps)

* ``plan_product(x, y, alpha, beta, eps, V, cost, weight)``  ->  (B, N, K)::

      out_i = sum_j exp(alpha_i + beta_j - C(x_i, y_j) / eps) * W_ij * V_j

  with ``W_ij = 1`` (``weight="plan"``), ``W_ij = C_ij`` (``"cost"``), or
  ``W_ij = w(C_ij)`` such that ``grad_x C(x_i, y_j) = w * (x_i - y_j)`` (``"dcost"``).
  With ``alpha = f / eps + log a`` and ``beta = g / eps + log b`` this is
  ``P @ V`` for the entropic plan ``P_ij = a_i b_j exp((f_i + g_j - C_ij) / eps)``.

The transposed forms are the same calls with the roles of (x, alpha) and
(y, beta) swapped: every supported cost is symmetric.  Zero weights enter as
``-inf`` log-weights and must contribute exactly nothing (no NaN).

Optional fused steps and hints: an :class:`Engine` subclass lists in ``capabilities`` the
:class:`Capability` members it implements, and the core asks ``engine.supports(cap)`` before it
calls one (otherwise it falls back to the two primitives, with the same maths):

* ``SOFTMIN_PAIR``: ``softmin_pair(x, y, hx, hy, eps, cost)`` -> ``(softmin(x, y, hy), softmin(y, x, hx))``
  in one pass (the symmetric Sinkhorn step);
* ``SOFTMIN_ALT``: ``softmin_alt(x, y, ha, hy, eps, cost, lam)`` -> ``(f, softmin(y, x, ha + lam f / eps))``
  with ``f = softmin(x, y, hy)`` (the alternating step);
* ``SOFTMIN_SYM``: ``softmin_sym(x, h, eps, cost)`` -> ``softmin(x, x, h)`` (the debiasing problems);
* ``SOFTMIN_PAIR_BARY``: ``softmin_pair_bary(x, y, hx, hy, eps, cost, cols)`` -> ``(f, g, bx, by)`` (``by``
  None without ``cols``), the soft-argmin barycentres ``bx_i = sum_j w_ij y_j`` from the same pass, or None
  where the engine cannot give them for these inputs;
* ``SOFTMIN_SYM_BARY``: ``softmin_sym_bary(x, h, eps, cost)`` -> ``(softmin(x, x, h), b)`` or None;
* ``FUSED_FINAL_STEP`` (a hint, no method): the solver's differentiable final step should use
  ``softmin_pair`` too (an engine whose final step is a large share of its work);
* ``EXPECT_REUSE``: ``expect_reuse(x, y, cost)``, called by the solver before it iterates on (x, y)
  (an engine with a cache may prepare it on the first call);
* ``ROW_RANGES``: ``row_bounds(x, y, parts)`` -> ``parts`` ranges ``(lo, hi)`` of the rows of the pair,
  ``digest(x, y)`` -> a (1,) int64 tensor identifying the engine's state for the pair, and ``softmin`` /
  ``plan_product`` accept ``rows=(lo, hi)`` (only those rows): the engine picks the row slices of a
  distributed solve;
* ``RING_VISIT``: ``ring_visit(op, parts, fn, combine)``: the points-sharded engine's pass of every rank's
  block (:class:`flashot.distributed.RingEngine`).

The reason for declaring rather than probing: a capability is a promise about the maths of a method,
so a method that happens to exist under one of these names (a user's helper, a wrapper's attribute)
is never called by mistake, and a wrapper states exactly which fused steps it keeps
(:class:`ForwardingEngine`).  An object registered with :func:`~flashot.ops.register_engine` that
does not subclass :class:`Engine` (it need only have ``softmin`` and ``plan_product``) is wrapped in
:class:`ForeignEngine`, which declares no capability: its fused methods, if any, are not used.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from torch import Tensor

from ..costs import CostLike

Weight = Literal["plan", "cost", "dcost"]
WEIGHTS = ("plan", "cost", "dcost")

__all__ = [
    "Capability",
    "Engine",
    "ForwardingEngine",
    "ForeignEngine",
    "Weight",
    "WEIGHTS",
    "self_softmin",
    "exp_floor",
]


class Capability(enum.Enum):
    """An optional fused step or hint of an engine (see :mod:`flashot.ops.base` for each one's maths).

    ``methods`` names the engine methods a capability stands for (none for a pure hint).

    Example:
        >>> from flashot.ops import Capability
        >>> Capability.SOFTMIN_PAIR.methods
        ('softmin_pair',)
        >>> Capability.FUSED_FINAL_STEP.methods
        ()
    """

    SOFTMIN_PAIR = "softmin_pair"
    SOFTMIN_ALT = "softmin_alt"
    SOFTMIN_SYM = "softmin_sym"
    SOFTMIN_PAIR_BARY = "softmin_pair_bary"
    SOFTMIN_SYM_BARY = "softmin_sym_bary"
    FUSED_FINAL_STEP = "fused_final_step"
    EXPECT_REUSE = "expect_reuse"
    ROW_RANGES = "row_ranges"
    RING_VISIT = "ring_visit"

    @property
    def methods(self) -> tuple[str, ...]:
        """The engine methods that implement this capability."""
        return _METHODS[self]


_METHODS: dict[Capability, tuple[str, ...]] = {
    Capability.SOFTMIN_PAIR: ("softmin_pair",),
    Capability.SOFTMIN_ALT: ("softmin_alt",),
    Capability.SOFTMIN_SYM: ("softmin_sym",),
    Capability.SOFTMIN_PAIR_BARY: ("softmin_pair_bary",),
    Capability.SOFTMIN_SYM_BARY: ("softmin_sym_bary",),
    Capability.FUSED_FINAL_STEP: (),
    Capability.EXPECT_REUSE: ("expect_reuse",),
    Capability.ROW_RANGES: ("row_bounds", "digest"),
    Capability.RING_VISIT: ("ring_visit",),
}


def _missing(engine: object, cap: Capability) -> NotImplementedError:
    return NotImplementedError(
        f"engine {type(engine).__name__} does not declare Capability.{cap.name}; "
        f"check engine.supports(Capability.{cap.name}) before calling it"
    )


def _defines(cls: type, name: str, base: type) -> bool:
    """Does ``cls`` define method ``name`` in a class of its MRO before ``base`` (i.e. not ``base``'s default)?"""
    for k in cls.__mro__:
        if k is base:
            return False
        if name in vars(k):
            return True
    return False


class Engine(abc.ABC):
    """Base class of the engines: two primitives, and the optional fused steps it declares.

    Two primitives on batched, contiguous inputs ``x`` (B, N, D), ``y`` (B, M, D), ``eps > 0``
    and a :class:`~flashot.Cost` ``C``:

    * ``softmin``: ``out_i = -eps log sum_j exp(h_j - C(x_i, y_j) / eps)``, (B, N);
    * ``plan_product``: ``out_i = sum_j exp(alpha_i + beta_j - C(x_i, y_j) / eps) W_ij V_j``,
      (B, N, K), with ``W_ij = 1`` (``"plan"``), ``C_ij`` (``"cost"``) or ``w`` such that
      ``grad_x C = w (x - y)`` (``"dcost"``).

    ``capabilities`` lists the :class:`Capability` members the engine implements (checked when the
    class is defined: each needs its methods); the core calls a fused method only where
    ``supports(cap)``.  The defaults of the optional methods raise ``NotImplementedError`` naming the
    capability.  Register one with :func:`register_engine`; ``-inf`` entries of ``h``, ``alpha``,
    ``beta`` (zero weights) must contribute nothing.

    Example:
        >>> import torch, flashot
        >>> from flashot import ops
        >>> cost = flashot.get_cost("sqeuclidean")
        >>> eng = ops.get_engine("tiled", device=torch.device("cpu"), dtype=torch.float64, cost=cost)
        >>> x, y = torch.randn(1, 5, 2, dtype=torch.float64), torch.randn(1, 6, 2, dtype=torch.float64)
        >>> h = torch.zeros(1, 6, dtype=torch.float64)
        >>> out = eng.softmin(x, y, h, 0.5, cost)
        >>> bool(torch.allclose(out, -0.5 * torch.logsumexp(h[:, None] - cost.matrix(x, y) / 0.5, -1)))
        True
        >>> eng.plan_product(x, y, h[:, :5], h, 0.5, torch.ones(1, 6, 1, dtype=torch.float64), cost).shape
        torch.Size([1, 5, 1])
        >>> eng.supports(ops.Capability.SOFTMIN_PAIR)  # tiled has the two primitives only
        False
    """

    name: str = "engine"
    capabilities: frozenset[Capability] = frozenset()

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        caps = vars(cls).get("capabilities")
        if caps is None:
            return
        if not isinstance(caps, frozenset) or not all(isinstance(c, Capability) for c in caps):
            raise TypeError(f"{cls.__name__}.capabilities: expected a frozenset of Capability, got {caps!r}")
        for cap in caps:
            for m in cap.methods:
                if not _defines(cls, m, Engine):
                    raise TypeError(f"{cls.__name__} declares Capability.{cap.name} but does not define {m}()")

    def supports(self, cap: Capability) -> bool:
        """True when this engine implements the optional step or hint ``cap``."""
        return cap in self.capabilities

    def unsupported(self, device: torch.device, dtype: torch.dtype, cost: CostLike) -> str | None:
        """``None`` when the engine can run this case, else a one-line reason."""
        return None

    @abc.abstractmethod
    def softmin(self, x: Tensor, y: Tensor, h: Tensor, eps: float, cost: CostLike) -> Tensor:
        """``out_i = -eps log sum_j exp(h_j - C(x_i, y_j) / eps)``: (B, N, D), (B, M, D), (B, M) -> (B, N)."""

    @abc.abstractmethod
    def plan_product(
        self,
        x: Tensor,
        y: Tensor,
        alpha: Tensor,
        beta: Tensor,
        eps: float,
        V: Tensor,
        cost: CostLike,
        weight: Weight = "plan",
    ) -> Tensor:
        """``out_i = sum_j exp(alpha_i + beta_j - C(x_i, y_j) / eps) W_ij V_j``: V (B, M, K) -> (B, N, K).

        ``W_ij`` is 1 (``weight="plan"``), ``C(x_i, y_j)`` (``"cost"``) or ``w`` such that
        ``grad_x C(x_i, y_j) = w (x_i - y_j)`` (``"dcost"``).
        """

    # -- optional fused steps (Capability members; see the module docstring) -------------------
    def softmin_pair(
        self, x: Tensor, y: Tensor, hx: Tensor, hy: Tensor, eps: float, cost: CostLike
    ) -> tuple[Tensor, Tensor]:
        """``(softmin(x, y, hy), softmin(y, x, hx))`` in one pass (``Capability.SOFTMIN_PAIR``)."""
        raise _missing(self, Capability.SOFTMIN_PAIR)

    def softmin_alt(
        self, x: Tensor, y: Tensor, ha: Tensor, hy: Tensor, eps: float, cost: CostLike, lam: float = 1.0
    ) -> tuple[Tensor, Tensor]:
        """``(f, softmin(y, x, ha + lam f / eps))``, ``f = softmin(x, y, hy)`` (``Capability.SOFTMIN_ALT``)."""
        raise _missing(self, Capability.SOFTMIN_ALT)

    def softmin_sym(self, x: Tensor, h: Tensor, eps: float, cost: CostLike) -> Tensor:
        """``softmin(x, x, h)`` (``Capability.SOFTMIN_SYM``)."""
        raise _missing(self, Capability.SOFTMIN_SYM)

    def softmin_pair_bary(
        self, x: Tensor, y: Tensor, hx: Tensor, hy: Tensor, eps: float, cost: CostLike, cols: bool
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None] | None:
        """``softmin_pair`` and the barycentres, or None (``Capability.SOFTMIN_PAIR_BARY``)."""
        raise _missing(self, Capability.SOFTMIN_PAIR_BARY)

    def softmin_sym_bary(self, x: Tensor, h: Tensor, eps: float, cost: CostLike) -> tuple[Tensor, Tensor] | None:
        """``softmin_sym`` and its barycentres, or None (``Capability.SOFTMIN_SYM_BARY``)."""
        raise _missing(self, Capability.SOFTMIN_SYM_BARY)

    def expect_reuse(self, x: Tensor, y: Tensor, cost: CostLike) -> None:
        """Hint: the solver will call the engine on ``(x, y)`` many times (``Capability.EXPECT_REUSE``)."""
        raise _missing(self, Capability.EXPECT_REUSE)

    def row_bounds(self, x: Tensor, y: Tensor, parts: int) -> list[tuple[int, int]]:
        """``parts`` row ranges ``(lo, hi)`` of the pair for ``rows=`` (``Capability.ROW_RANGES``)."""
        raise _missing(self, Capability.ROW_RANGES)

    def digest(self, x: Tensor, y: Tensor) -> Tensor:
        """(1,) int64 identifying the engine's state for the pair (``Capability.ROW_RANGES``)."""
        raise _missing(self, Capability.ROW_RANGES)

    def ring_visit(self, op: str, parts: list[Tensor], fn: Callable[..., Any], combine: Callable[..., Any]) -> Any:
        """``combine`` of ``fn(src, *block)`` over every rank's block (``Capability.RING_VISIT``)."""
        raise _missing(self, Capability.RING_VISIT)


class ForwardingEngine(Engine):
    """An engine that wraps ``inner``: it forwards the primitives and every capability it declares.

    ``capabilities`` is ``inner``'s by default, or the given set (a wrapper that keeps only some fused
    steps, or implements some itself): a declared capability whose methods the subclass does not define
    is forwarded to ``inner``, which must then support it (``ValueError`` otherwise).  ``name`` is
    ``inner``'s.  A subclass overrides what it changes (e.g. ``softmin``), nothing else.

    Example:
        >>> import torch, flashot
        >>> from flashot import ops
        >>> class Counting(ops.ForwardingEngine):
        ...     calls = 0
        ...     def softmin(self, x, y, h, eps, cost, **kw):
        ...         self.calls += 1
        ...         return super().softmin(x, y, h, eps, cost, **kw)
        >>> cost = flashot.get_cost("sqeuclidean")
        >>> eng = Counting(ops.get_engine("tiled", device=torch.device("cpu"), dtype=torch.float64, cost=cost))
        >>> x = torch.randn(1, 4, 2, dtype=torch.float64)
        >>> _ = eng.softmin(x, x, torch.zeros(1, 4, dtype=torch.float64), 0.5, cost)
        >>> eng.name, eng.calls, eng.capabilities == eng.inner.capabilities
        ('tiled', 1, True)
    """

    def __init__(self, inner: Engine, capabilities: Iterable[Capability] | None = None):
        self.inner = inner
        self.name = inner.name
        caps = inner.capabilities if capabilities is None else frozenset(capabilities)
        for cap in caps:
            forwarded = [m for m in cap.methods if not _defines(type(self), m, ForwardingEngine)]
            if forwarded and not inner.supports(cap):
                raise ValueError(
                    f"{type(self).__name__}: declares Capability.{cap.name}, which neither it "
                    f"(methods {cap.methods}) nor its inner engine {inner.name!r} implements"
                )
        self.capabilities = frozenset(caps)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"

    def _forward(self, cap: Capability) -> Engine:
        if cap not in self.capabilities:
            raise _missing(self, cap)
        return self.inner

    def unsupported(self, device: torch.device, dtype: torch.dtype, cost: CostLike) -> str | None:
        return self.inner.unsupported(device, dtype, cost)

    def softmin(self, x: Tensor, y: Tensor, h: Tensor, eps: float, cost: CostLike, **kw: Any) -> Tensor:
        return self.inner.softmin(x, y, h, eps, cost, **kw)  # kw: rows= (Capability.ROW_RANGES)

    def plan_product(
        self,
        x: Tensor,
        y: Tensor,
        alpha: Tensor,
        beta: Tensor,
        eps: float,
        V: Tensor,
        cost: CostLike,
        weight: Weight = "plan",
        **kw: Any,
    ) -> Tensor:
        return self.inner.plan_product(x, y, alpha, beta, eps, V, cost, weight, **kw)

    def softmin_pair(
        self, x: Tensor, y: Tensor, hx: Tensor, hy: Tensor, eps: float, cost: CostLike
    ) -> tuple[Tensor, Tensor]:
        return self._forward(Capability.SOFTMIN_PAIR).softmin_pair(x, y, hx, hy, eps, cost)

    def softmin_alt(
        self, x: Tensor, y: Tensor, ha: Tensor, hy: Tensor, eps: float, cost: CostLike, lam: float = 1.0
    ) -> tuple[Tensor, Tensor]:
        return self._forward(Capability.SOFTMIN_ALT).softmin_alt(x, y, ha, hy, eps, cost, lam)

    def softmin_sym(self, x: Tensor, h: Tensor, eps: float, cost: CostLike) -> Tensor:
        return self._forward(Capability.SOFTMIN_SYM).softmin_sym(x, h, eps, cost)

    def softmin_pair_bary(
        self, x: Tensor, y: Tensor, hx: Tensor, hy: Tensor, eps: float, cost: CostLike, cols: bool
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None] | None:
        return self._forward(Capability.SOFTMIN_PAIR_BARY).softmin_pair_bary(x, y, hx, hy, eps, cost, cols=cols)

    def softmin_sym_bary(self, x: Tensor, h: Tensor, eps: float, cost: CostLike) -> tuple[Tensor, Tensor] | None:
        return self._forward(Capability.SOFTMIN_SYM_BARY).softmin_sym_bary(x, h, eps, cost)

    def expect_reuse(self, x: Tensor, y: Tensor, cost: CostLike) -> None:
        return self._forward(Capability.EXPECT_REUSE).expect_reuse(x, y, cost)

    def row_bounds(self, x: Tensor, y: Tensor, parts: int) -> list[tuple[int, int]]:
        return self._forward(Capability.ROW_RANGES).row_bounds(x, y, parts)

    def digest(self, x: Tensor, y: Tensor) -> Tensor:
        return self._forward(Capability.ROW_RANGES).digest(x, y)

    def ring_visit(self, op: str, parts: list[Tensor], fn: Callable[..., Any], combine: Callable[..., Any]) -> Any:
        return self._forward(Capability.RING_VISIT).ring_visit(op, parts, fn, combine)


class ForeignEngine(ForwardingEngine):
    """A user's engine that does not subclass :class:`Engine` (an object with ``softmin`` and
    ``plan_product``, contract above), as :func:`~flashot.ops.register_engine` stores it: the two
    primitives and its ``unsupported`` (when it has one; else every case is accepted), and no
    capability, so any fused method it has is not used (subclass :class:`Engine` and declare them)."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.name = str(getattr(inner, "name", type(inner).__name__))
        self.capabilities = frozenset()
        self._unsupported = getattr(inner, "unsupported", None)

    def unsupported(self, device: torch.device, dtype: torch.dtype, cost: CostLike) -> str | None:
        return None if self._unsupported is None else self._unsupported(device, dtype, cost)


def as_engine(obj: object) -> Engine:
    """``obj`` itself when it is an :class:`Engine`, else wrapped in a :class:`ForeignEngine`."""
    return obj if isinstance(obj, Engine) else ForeignEngine(obj)


def self_softmin(engine: Engine, x: Tensor, h: Tensor, eps: float, cost: CostLike) -> Tensor:
    """``softmin(x, x, h)`` through the engine's ``softmin_sym`` (half the pairs) when it declares one."""
    if engine.supports(Capability.SOFTMIN_SYM):
        return engine.softmin_sym(x, h, eps, cost)
    return engine.softmin(x, x, h, eps, cost)


def exp_floor(dtype: torch.dtype) -> float:
    """Most negative argument passed to ``exp`` after the running max is removed.

    ``torch.exp`` on the CPU is 60-140x slower for float32 arguments below about
    -87.3 (the denormal/underflow path).  Clamping there changes each term by at
    most ~1e-38 next to a leading term of 1, i.e. not at all in float32.
    """
    return -87.0 if dtype == torch.float32 else -708.0
