"""The result of an entropic OT solve (:class:`OTResult`, POT's names) and its making from a finished loop
(:func:`make_result`: the final step, the values, the lazy plan), shared by the front ends and strategies."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Protocol

from torch import Tensor

from .measures import Measures
from .plan import LazyPlan
from .solver import SinkhornState, final_step
from .unbalanced import dual_value, primal_value, warn_on_second_order
from .values import sinkhorn_value, with_hot_value

if TYPE_CHECKING:  # annotations only
    import numpy as np

    from .implicit import ImplicitDiff

__all__ = ["OTResult", "make_result"]


@dataclass
class OTResult:
    """Result of :func:`solve_sample` (POT's ``OTResult`` names).

    Attributes:
        value: entropic OT value ``<C, P> + reg KL(P | a x b)`` (= ``<f, a> + <g, b>``
            at convergence); differentiable w.r.t. torch inputs that require grad.
        potentials: ``(f, g)`` dual potentials, (N,), (M,) (or batched).
        plan: the lazy transport plan (:class:`~flashot.plan.LazyPlan`).
        n_iter, converged, error: iterations run, whether ``tol`` was met, and the last
            error read (L1 marginal violation when balanced, ``max |change of f, g| / reg``
            for (semi-)unbalanced problems).
        stopped: the ``callback`` returned True.
        value_dual: the optimal value with generalised KL divergences (mass terms included),
            ``min <C, P> + reg KL(P|a x b) + rho_a KL(P 1|a) + rho_b KL(P^T 1|b)``, from the dual;
            exact envelope gradients.  Equals ``value`` for balanced problems.  For unbalanced
            ones ``value`` is that objective evaluated at the returned plan (the two agree at
            convergence), with the same gradients (:func:`flashot.unbalanced.primal_value`); POT 0.9
            drops the KL terms' masses there, which makes its value 0 when both sides are relaxed.
        unbalanced: ``(rho_a, rho_b)`` (None = strict side), or None when balanced.
        multiscale: with ``backend="multiscale"``, the :class:`~flashot.multiscale.MultiscaleRun`
            (``kept``: the kept fraction of the pairs at each pruning; clusters), else None.

    The plan is ``P_ij = a_i b_j exp((f_i + g_j - C(x_i, y_j)) / reg)`` (``eps = reg``, ``C`` the
    cost of the solve, ``|x - y|^2`` by default).

    Example:
        >>> import torch, flashot
        >>> _ = torch.manual_seed(0)
        >>> res = flashot.solve_sample(torch.randn(5, 2), torch.randn(6, 2), reg=0.5)
        >>> res.status, res.potentials[0].shape, res.plan.shape
        ('converged', torch.Size([5]), (5, 6))
        >>> bool(abs(res.value - res.value_dual) < 1e-6)  # balanced: the same number
        True
    """

    value: Any
    potentials: tuple[Any, Any]
    plan: LazyPlan
    n_iter: int
    converged: bool
    error: float | None
    reg: float
    backend: str
    _numpy: bool = field(default=False, repr=False)
    stopped: bool = False
    unbalanced: tuple | None = None
    multiscale: Any = field(default=None, repr=False)  # backend="multiscale": the run (kept fractions, clusters)
    value_dual: Any = None

    @property
    def returns_numpy(self) -> bool:
        """Whether the values, potentials and plan products come back as numpy arrays (numpy inputs)."""
        return self._numpy

    def _out(self, t: Tensor) -> Any:
        if not self._numpy:
            return t
        t = t.detach().cpu()
        return t.numpy()[()] if t.dim() == 0 else t.numpy()  # a numpy scalar of the input's dtype

    @cached_property
    def value_linear(self) -> Any:
        """``<C, P> = sum_ij C(x_i, y_j) P_ij``, streamed (plan products only): the transport cost
        of the entropic plan, without the ``reg KL(P | a x b)`` term of ``value`` (POT's
        ``sinkhorn2``).

        Differentiable like ``value`` (torch inputs that
        require grad, ``grad`` not ``"detach"``): implicit differentiation through the fixed point
        (:func:`flashot.values.linear_value`, the ``implicit=`` settings); balanced problems only, an
        unbalanced one's backward raises ``NotImplementedError``.

        Example:
            >>> import torch, flashot
            >>> _ = torch.manual_seed(0)
            >>> x, y = torch.randn(5, 2, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
            >>> res = flashot.solve_sample(x, y, reg=0.5)
            >>> P = res.plan.to_dense()
            >>> bool(torch.allclose(res.value_linear, (torch.cdist(x, y) ** 2 * P).sum()))
            True
        """
        from .values import linear_value

        p = self.plan
        if isinstance(self.value, Tensor) and self.value.requires_grad:
            v = linear_value(p.measures, *p.raw_potentials, p.eps, unbalanced=self.unbalanced)
        else:
            v = p.cost_sum()
        return self._out(v if p.measures.batched else v[0])

    @cached_property
    def marginals(self) -> tuple[Tensor | np.ndarray, Tensor | np.ndarray]:
        """``(P 1, P^T 1)``: the row sums (N,) and column sums (M,) of the plan, streamed.

        They equal ``(a, b)`` up to ``tol`` (L1) for a converged balanced solve.

        Example:
            >>> import torch, flashot
            >>> _ = torch.manual_seed(0)
            >>> res = flashot.solve_sample(torch.randn(5, 2), torch.randn(6, 2), reg=0.5)
            >>> row, col = res.marginals
            >>> bool(torch.allclose(row, torch.full((5,), 1 / 5), atol=1e-5)), col.shape
            (True, torch.Size([6]))
        """
        return self.plan.row_sums(), self.plan.T.row_sums()

    @property
    def marginal_a(self) -> Tensor | np.ndarray:
        return self.marginals[0]

    @property
    def marginal_b(self) -> Tensor | np.ndarray:
        return self.marginals[1]

    @property
    def status(self) -> str:
        if self.converged:
            return "converged"
        return "stopped by callback" if self.stopped else "max_iter reached"


class ResultOptions(Protocol):
    """What :func:`make_result` reads of the solve's options (:class:`flashot.driver.SolveOptions`, which imports
    this module: a structural type keeps the import one-way)."""

    @property
    def reg(self) -> float: ...
    @property
    def rho_a(self) -> float | None: ...
    @property
    def rho_b(self) -> float | None: ...
    @property
    def unbalanced(self) -> bool: ...
    @property
    def implicit(self) -> ImplicitDiff | None: ...
    @property
    def grad(self) -> str: ...


def make_result(m: Measures, st: SinkhornState, o: ResultOptions, numpy: bool) -> OTResult:
    """The :class:`OTResult` of a finished loop: the final step, values, potentials and the lazy plan (``o``: the
    solve's :class:`~flashot.driver.SolveOptions`)."""
    reg = o.reg
    f, g, _, _ = final_step(m, st, rho_x=o.rho_a, rho_y=o.rho_b)
    plan = LazyPlan(m, f, g, reg, numpy=numpy)
    if o.unbalanced:  # m.full: the whole vectors when the points are split over ranks (else the same)
        r, c = plan.raw_marginals()
        fa, fb, ff, fg, fr, fc = m.full("xyxyxy", m.a, m.b, f, g, r, c)
        value = warn_on_second_order(primal_value(fa, fb, ff, fg, fr, fc, reg, o.rho_a, o.rho_b))
        value_dual = warn_on_second_order(dual_value(fa, fb, ff, fg, reg, o.rho_a, o.rho_b))
    else:  # points-sharded too: summed over the ranks, each rank's gradients its slices
        value = value_dual = sinkhorn_value(m, st, f, g, implicit=o.implicit)
        if st.converged:  # else the value of the returned iterate, <a, f> + <b, g> as it is
            value = value_dual = with_hot_value(value, m, f, g, reg)
    res = OTResult(
        value=None,
        potentials=(None, None),
        plan=plan,
        n_iter=st.n_iter,
        converged=st.converged,
        error=st.error,
        reg=reg,
        backend=m.engine.name,
        _numpy=numpy,
        stopped=st.stopped,
        unbalanced=(o.rho_a, o.rho_b) if o.unbalanced else None,
    )
    if o.grad == "detach":
        value, value_dual, f, g = value.detach(), value_dual.detach(), f.detach(), g.detach()
    res.value = res._out(m.restore(value))
    res.value_dual = res._out(m.restore(value_dual))
    res.potentials = (res._out(m.restore(f)), res._out(m.restore(g)))
    return res
