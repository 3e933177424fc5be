r"""``solve_sample``: entropic OT between point clouds, POT / GeomLoss style.

Solves :math:`\min_P \langle C, P\rangle + \varepsilon\, \mathrm{KL}(P \,|\, a \otimes b)`
over couplings of ``a`` and ``b``, with ``C(x, y) = |x - y|^2`` by default and
``reg`` :math:`= \varepsilon`.  The value is POT's (balanced problems); at convergence it
equals :math:`\langle f, a\rangle + \langle g, b\rangle`, computed in increment form above
``100 x`` the largest cost, where log-domain potentials round to ``~ eps 2^-53``
(:func:`flashot.implicit.hot_value`: accurate at any ``reg``, tending to
:math:`\langle C, a b^\top\rangle`).  With ``unbalanced=`` the marginal constraints become KL
penalties (:mod:`flashot.unbalanced`), on one side only for ``unbalanced=(rho, None)``, and the
value is the objective with generalised KL terms at the returned plan (POT 0.9 drops the KL
terms' masses there).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor

from ._checks import (
    check_bool,
    check_choice,
    check_dtype,
    check_eps_scale,
    check_int,
    check_positive,
    check_storage,
    to_tensor,
)
from .measures import Measures
from .implicit import ImplicitDiff, check_implicit, sinkhorn_value, with_hot_value
from .plan import LazyPlan
from .schedules import Schedule
from .acceleration import Anderson, check_acceleration
from .solver import IterationRecord, SinkhornState, final_step, sinkhorn_loop
from .unbalanced import dual_value, parse_unbalanced, primal_value, warn_on_second_order

METHODS = {"auto": False, "sinkhorn": False, "sinkhorn_log": False, "alternating": False, "symmetric": True}


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

    def _out(self, t: Tensor):
        if not self._numpy:
            return t
        t = t.detach().cpu()
        return t.numpy()[()] if t.dim() == 0 else t.numpy()  # a numpy scalar of the input's dtype

    @cached_property
    def value_linear(self):
        """``<C, P> = sum_ij C(x_i, y_j) P_ij``, streamed (plan products only): the transport cost
        of the entropic plan, without the ``reg KL(P | a x b)`` term of ``value`` (POT's
        ``sinkhorn2``).

        Differentiable like ``value`` (torch inputs that
        require grad, ``grad`` not ``"detach"``): implicit differentiation through the fixed point
        (:func:`flashot.implicit.linear_value`, the ``implicit=`` settings); balanced problems only, an
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
        from .implicit import linear_value

        p = self.plan
        if isinstance(self.value, Tensor) and self.value.requires_grad:
            v = linear_value(p._m, p._f, p._g, p.eps, unbalanced=self.unbalanced)
        else:
            v = p.cost_sum()
        return self._out(v if p._m.batched else v[0])

    @cached_property
    def marginals(self):
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
    def marginal_a(self):
        return self.marginals[0]

    @property
    def marginal_b(self):
        return self.marginals[1]

    @property
    def status(self) -> str:
        if self.converged:
            return "converged"
        return "stopped by callback" if self.stopped else "max_iter reached"


def solve_sample(
    X_a,
    X_b,
    a=None,
    b=None,
    metric: str | None = None,
    reg: float | None = None,
    *,
    cost: str = "sqeuclidean",
    reg_type: str = "KL",
    unbalanced=None,
    unbalanced_type: str = "KL",
    lazy: bool | None = None,
    batch_size: int | None = None,
    method: str | None = "auto",
    n_threads: int | None = None,
    max_iter: int | None = None,
    potentials_init: tuple | None = None,
    tol: float | None = 1e-6,
    grad: str = "autodiff",
    backend: str = "auto",
    callback: Callable[[IterationRecord], bool | None] | None = None,
    inner_iterations: int = 10,
    acceleration="auto",
    verbose: bool = False,
    implicit: ImplicitDiff | None = None,
    eps_scaling: bool | float | None = None,
    group=None,
    shard: str = "replicated",
    cluster_scale: float | None = None,
    truncate: float | None = 5.0,
) -> OTResult:
    """Entropic OT between weighted point clouds, streamed (no n x m matrix).

    Solves ``min_P <C, P> + reg KL(P | a x b)`` over the couplings of ``a`` and ``b``, with
    ``C(x, y) = |x - y|^2`` by default and ``eps = reg``; the plan is
    ``P_ij = a_i b_j exp((f_i + g_j - C(x_i, y_j)) / reg)`` for the returned potentials ``(f, g)``.

    Args:
        X_a: (N, D) points, or (B, N, D) for B problems at once; torch or numpy.
        X_b: (M, D) points, or (B, M, D); same dtype and device as ``X_a``.
        a: (N,) weights of ``X_a`` (or (B, N)); uniform when None (or POT's ``[]``).  Balanced
            problems: total masses of ``a`` and ``b`` that differ by more than ``MASS_RTOL``
            (1e-3, relative) raise ``ValueError`` (no coupling exists; use ``unbalanced=``).
        b: (M,) weights of ``X_b`` (or (B, M)); uniform when None (or ``[]``).
        cost: ``"sqeuclidean"`` (|x-y|^2), ``"half_sqeuclidean"`` (|x-y|^2 / 2) or ``"euclidean"``
            (|x-y|).  ``metric`` is POT's name for the same argument.  POT's positional order works:
            ``solve_sample(X_a, X_b, a, b, metric, reg)``.
        reg_type: POT's option, accepted: the regulariser is ``KL(P | a x b)`` (POT's default
            ``"KL"``; ``"entropy"`` differs by a constant).
        lazy: POT's option, accepted: the plan is always lazy.
        batch_size: POT's option, accepted: the engines choose their tiles.
        n_threads: POT's option, accepted: the engines choose their threads.
        method: ``"auto"`` / ``"sinkhorn"`` / ``"sinkhorn_log"`` / ``"alternating"`` (alternating
            log-domain updates) or ``"symmetric"`` (averaged, GeomLoss-style); POT's
            ``"sinkhorn_stabilized"`` and ``"sinkhorn_epsilon_scaling"`` map to alternating updates
            (the latter with ``eps_scaling=True``), ``"geomloss*"`` to ``"symmetric"``.
        grad: POT's ``"autodiff"``, ``"envelope"`` and ``"last_step"`` all give flashot's analytic
            gradients (envelope theorem at the returned potentials; equal to autodiff through the
            iterations at convergence); ``"detach"`` returns detached outputs.
        reg: the entropic regularisation epsilon (> 0, required).
        max_iter: iterations (default 1000).  With ``tol=None`` exactly ``max_iter`` run.
        tol: stop when the error drops below it (default 1e-6): the L1 marginal violation
            (balanced) or the sup-norm change of the potentials divided by ``reg`` in one
            iteration (unbalanced).  Rounding bounds what the error can resolve, so the loop
            stops below ``max(tol, floor)`` with
            ``floor = u ((cmax + |f|_inf + |g|_inf) / reg + 2 log2(1 + max(N, M)))`` (``u`` the compute dtype's machine epsilon, ``cmax`` the
            largest cost; 1e-5 to 4e-5 in float32 at ``reg = 0.01 cmax``, negligible in float64); where the
            floor exceeds ``max(tol, 1e-2)`` the solve is never reported as converged.  Not met
            after ``max_iter``: RuntimeWarning naming the cause (too few iterations, weights of
            unequal masses in a balanced problem, or ``reg`` below the dtype's resolution) and
            ``converged=False``.  ``tol=None``: exactly ``max_iter`` iterations, no warning.
            NaN / Inf potentials raise ``FloatingPointError`` (naming ``reg`` and the engine).
        backend: engine name or ``"auto"``; ``"multiscale"``: GeomLoss' coarse-to-fine solver
            (:mod:`flashot.multiscale`) for one pair of clouds, balanced or ``unbalanced`` (D <= 3 prunes best): its schedule down to
            ``reg`` on cluster centroids then on the points with only the blocks of clusters within
            ``truncate * reg`` of the potentials (GeomLoss' ``cluster_scale`` and ``truncate``), then
            the ordinary iterations to ``tol`` on the same blocks (re-pruned if the potentials move).
            With ``tol``, ``truncate`` is raised to ``log(1 / tol)`` (13.8 at the default 1e-6) so that the
            pruning stays within the tolerance ``converged=True`` promises about the returned plan.
            Dropped entries of the plan are below ``e^-truncate a_i b_j``; ``plan @ V`` and the
            gradients use the pruned plan, ``plan.to_dense()`` / ``topk`` the full one of the same
            potentials.  With ``group``: replicated mode only (each rank computes a range of whole row
            clusters; the same result as one process).
        potentials_init: ``(f, g)`` warm start (same shapes as the returned potentials).
        unbalanced: KL marginal penalties (POT's ``unbalanced`` / ``reg_m``): a number ``rho``
            for both sides, or a pair ``(rho_a, rho_b)`` where None (or inf) keeps that
            marginal strict (semi-unbalanced).  ``value`` is the objective with generalised KL
            terms at the returned plan, ``value_dual`` the dual optimum (equal at convergence; both
            with exact envelope gradients).  POT 0.9's ``value`` drops the KL terms' masses (0 when
            both sides are relaxed): flashot does not follow it there.  ``potentials`` are ``(f, g)`` = ``reg`` times
            POT's ``(log u, log v)``; the plan is POT's ``u_i a_i K_ij b_j v_j``.
        unbalanced_type: only ``"KL"``.
        callback: called with an :class:`~flashot.solver.IterationRecord` after each
            iteration (``error`` is None between checks); returning ``True`` stops the
            solve (``converged=False``, ``stopped=True``, no warning).
        inner_iterations: read the error (one device sync) every this many iterations (>= 1,
            default 10) and at the last one; ``tol`` is checked there.
        acceleration: ``"auto"`` (default), None, :class:`flashot.Momentum` ``(omega)`` or
            :class:`flashot.Anderson` ``(m)`` (log-domain, safeguarded; see :mod:`flashot.acceleration`).
            ``"auto"``: :class:`~flashot.Anderson` with alternating updates at ``reg < 3e-3 cmax`` (``cmax``
            the largest cost), where plain iterations contract too slowly to reach ``tol`` in
            ``max_iter`` (``docs/exactness.md``, "Small epsilon", measures both), none elsewhere; None:
            plain iterations.  Any acceleration
            combines with ``eps_scaling`` (its history restarts at every change of eps).
        verbose: progress bar (tqdm if installed, else stderr lines) with iteration, eps, error.
        eps_scaling: epsilon-scaling: iterations at ``eps = cmax, cmax/2, cmax/4, ...`` (3 at each,
            ``cmax`` the largest cost) warm-start the ones at ``reg``; they count in ``max_iter``
            and ``tol`` is only checked at ``reg`` (also after the first two steps, which run at
            ``reg``: a problem they solve stops there).  ``None`` (default): on when ``reg < 3e-3
            cmax`` with alternating updates and no ``potentials_init``: there iterations started
            from zero potentials are slow and can stop at a wrong plan (``tests/test_eps_scaling.py``),
            while above it the schedule only costs iterations; ``True``/``False``: on/off; a number
            in (0, 1): on, with that ratio.
        implicit: :class:`~flashot.ImplicitDiff` settings (CG tolerance, iterations, ridge) of the
            second derivatives of ``value`` (``create_graph=True``, e.g. Hessian-vector products;
            balanced problems).
        group: a ``torch.distributed`` process group (e.g. ``torch.distributed.group.WORLD``): solve ONE
            problem over its ranks, each computing a slice of the rows and all-gathering the
            potentials (:mod:`flashot.distributed`; every rank passes the same points and options,
            checked at the start; a rank that rejects its arguments makes every rank raise the same
            error, naming that rank).  Later plan products (``plan @ V``, ``marginals``, gradients) are
            collective: call them on every rank.
        shard: with ``group``: ``"replicated"`` (default; every rank passes ALL the points and weights) or
            ``"points"`` (every rank passes only its slice of ``X_a``, ``a``, ``X_b``, ``b``; the other
            slices travel around a ring of the ranks: for clouds that do not fit one device).  With
            ``"points"``, ``potentials``, ``marginals`` and the gradients are this rank's slices, ``value``
            the whole problem's; ``a=None`` means ``1 / N`` with ``N`` the points of all ranks;
            ``plan.to_dense()`` and ``plan.topk(k)`` give this rank's rows (see :mod:`flashot.distributed`).

    Returns:
        :class:`OTResult` (numpy outputs when the points were numpy arrays).

    Example:
        >>> import torch, flashot
        >>> _ = torch.manual_seed(0)
        >>> x = torch.randn(20, 2, dtype=torch.float64)
        >>> y = torch.randn(30, 2, dtype=torch.float64) + 1
        >>> res = flashot.solve_sample(x, y, reg=0.1)  # squared Euclidean cost, eps = reg, uniform a, b
        >>> res.converged, res.plan.shape
        (True, (20, 30))
        >>> float((res.plan.sum(axis=1) - 1 / 20).abs().sum()) < 1e-6  # row sums = a
        True
        >>> P = res.plan.to_dense()  # small problems only; value = <C, P> + reg KL
        >>> kl = torch.xlogy(P, P * 20 * 30).sum()
        >>> bool(torch.allclose(res.value, (torch.cdist(x, y) ** 2 * P).sum() + 0.1 * kl))
        True
    """
    with rank_checks(group):  # local checks only: with a group, a rank's rejection raises on every rank
        a, b = (None if _pot_uniform(w) else w for w in (a, b))
        if metric is not None:
            if not isinstance(metric, str):
                hint = f"; POT's order is (X_a, X_b, a, b, metric, reg): did you mean reg={metric!r}?" \
                    if isinstance(metric, (int, float)) and not isinstance(metric, bool) else ""
                raise TypeError(f"metric: expected a cost name (string), got {type(metric).__name__}{hint}")
            if cost != "sqeuclidean" and metric != cost:
                raise ValueError(f"cost={cost!r} and metric={metric!r} disagree; give one of them")
            cost = metric
        _check_positional_scalars(a, b, reg)
        if group is not None or shard != "replicated":
            from .distributed import check_shard

            check_shard(shard, group)
        opts = solve_options(
            reg, reg_type=reg_type, unbalanced=unbalanced, unbalanced_type=unbalanced_type, lazy=lazy,
            batch_size=batch_size, method=method, n_threads=n_threads, max_iter=max_iter, tol=tol, grad=grad,
            callback=callback, inner_iterations=inner_iterations, acceleration=acceleration, verbose=verbose,
            implicit=implicit, eps_scaling=eps_scaling, exact_hint="POT's ot.solve_sample")
        is_np = isinstance(X_a, np.ndarray)
        if is_np != isinstance(X_b, np.ndarray):
            raise TypeError("X_a and X_b: give both as torch tensors or both as numpy arrays")
        X_a, X_b = to_tensor("X_a", X_a), to_tensor("X_b", X_b)
        if a is not None:
            a = to_tensor("a", a, like=X_a)
        if b is not None:
            b = to_tensor("b", b, like=X_b)
        if shard == "points" and backend == "multiscale":
            raise NotImplementedError("backend='multiscale' with shard='points': the clustering needs the whole "
                                      "clouds on every rank; use shard='replicated' (the default: every rank passes "
                                      "all the points)")
        if shard != "points":  # (points mode: points_solve builds this rank's slices inside its first collective)
            m, cluster_scale, truncate = _replicated_measures(X_a, X_b, a, b, cost, backend, opts, cluster_scale,
                                                              truncate, potentials_init)
    if shard == "points":  # one problem whose points are split over the ranks (flashot.distributed)
        from .distributed import points_solve

        return points_solve(X_a, X_b, a, b, cost=cost, backend=backend, opts=opts, group=group,
                            potentials_init=potentials_init, numpy=is_np)
    if backend == "multiscale":
        return _solve_multiscale(m, opts, cluster_scale, truncate, group, is_np)
    if group is not None:  # one problem over the ranks of a torch.distributed group
        from .distributed import distribute_solve

        opts = distribute_solve(m, opts, group, potentials_init)
    return solve_measures(m, opts, potentials_init, numpy=is_np)


def rank_checks(group):
    """The context of a front end's local argument checks: with a ``torch.distributed`` group,
    :func:`flashot.distributed.shared_checks` (a rank that rejects its arguments makes every rank raise the
    same error, instead of leaving them waiting in a collective until the process group's timeout); without
    one, a plain context."""
    if group is None:
        return contextlib.nullcontext()
    from .distributed import shared_checks

    return shared_checks(group)


def _replicated_measures(X_a, X_b, a, b, cost, backend, opts, cluster_scale, truncate, potentials_init):
    """``solve_sample``'s checked measures, ``cluster_scale`` and ``truncate`` (every rank holds all the points):
    the checks of ``backend="multiscale"`` (:func:`_multiscale_measures`) or ``Measures.build`` and
    ``potentials_init``'s shapes, all before any collective."""
    cluster_scale = check_positive("cluster_scale", cluster_scale, allow_none=True)
    truncate = check_positive("truncate", truncate, allow_none=True)
    if backend == "multiscale":
        return _multiscale_measures(X_a, X_b, a, b, cost, opts, potentials_init), cluster_scale, truncate
    for name, v, default in (("cluster_scale", cluster_scale, None), ("truncate", truncate, 5.0)):
        if v != default:
            raise ValueError(f"{name}: used by backend='multiscale' only (GeomLoss' multiscale option)")
    m = Measures.build(X_a, X_b, a, b, cost=cost, backend=backend, names=("a", "X_a", "b", "X_b"))
    if potentials_init is not None:
        _check_init(potentials_init, m)
    return m, cluster_scale, truncate


@dataclass(frozen=True)
class SolveOptions:
    """The validated options of one balanced or (semi-)unbalanced solve (see :func:`solve_sample`)."""

    reg: float
    max_iter: int
    tol: float | None
    method: str
    eps_scaling: float | None  # None: auto; 0: off; else the ratio
    rho_a: float | None  # None: strict marginal
    rho_b: float | None
    inner_iterations: int
    acceleration: Any
    implicit: ImplicitDiff
    callback: Callable[[IterationRecord], bool | None] | None
    verbose: bool
    grad: str

    @property
    def unbalanced(self) -> bool:
        return self.rho_a is not None or self.rho_b is not None


def solve_options(reg, *, reg_type="KL", unbalanced=None, unbalanced_type="KL", lazy=None, batch_size=None,
                  method="auto", n_threads=None, max_iter=None, tol=1e-6, grad="autodiff", callback=None,
                  inner_iterations=10, acceleration="auto", verbose=False, implicit=None, eps_scaling=None,
                  exact_hint: str = "POT") -> SolveOptions:
    """Validate and map the options shared by :func:`solve_sample` and :func:`flashot.solve` (POT's
    names accepted), before any heavy work."""
    method, eps_scaling = _pot_options(method, eps_scaling, reg_type, lazy, batch_size, n_threads, grad)
    if reg is None:
        raise ValueError("reg: flashot solves entropic OT and needs reg > 0 (the epsilon); "
                         f"for exact (unregularised) OT use {exact_hint}")
    reg = check_positive("reg", reg)
    max_iter = check_int("max_iter", 1000 if max_iter is None else max_iter)
    tol = check_positive("tol", tol, allow_none=True)
    check_choice("method", method, METHODS)
    if callback is not None and not callable(callback):
        raise TypeError(f"callback: expected a callable (or None), got {type(callback).__name__}")
    verbose = check_bool("verbose", verbose)
    rho_a, rho_b = parse_unbalanced(unbalanced, unbalanced_type) if unbalanced is not None else (None, None)
    inner_iterations = check_int("inner_iterations", inner_iterations)
    eps_scaling = _check_eps_scaling(eps_scaling)
    acceleration = check_acceleration(acceleration, allow_auto=True)
    if (rho_a is not None or rho_b is not None) and implicit is not None:
        raise NotImplementedError("implicit= (second derivatives) supports balanced OT only; use unbalanced=None")
    implicit = check_implicit(implicit)
    return SolveOptions(reg, max_iter, tol, method, eps_scaling, rho_a, rho_b, inner_iterations, acceleration,
                        implicit, callback, verbose, grad)


def solve_measures(m: Measures, o: SolveOptions, potentials_init=None, *, numpy: bool = False) -> OTResult:
    """Run the solver on prepared measures with validated options; the :class:`OTResult` of both front ends."""
    reg = o.reg
    check_eps_scale("reg", reg, m.cmax, m.x.dtype)
    if not o.unbalanced:
        _check_equal_masses(m)
    init = None if potentials_init is None else _check_init(potentials_init, m)
    symmetric = METHODS[o.method]
    head = _scaling_head(m, reg, o.eps_scaling, init, symmetric)
    st: SinkhornState = sinkhorn_loop(
        m, Schedule(reg, o.max_iter, head), symmetric=symmetric, tol=o.tol, init=init, callback=o.callback,
        rho_x=o.rho_a, rho_y=o.rho_b, inner_iterations=o.inner_iterations,
        acceleration=_acceleration(m, reg, o.acceleration, symmetric), verbose=o.verbose,
    )
    return _result(m, st, o, numpy)


def _result(m: Measures, st: SinkhornState, o: SolveOptions, numpy: bool) -> OTResult:
    """The :class:`OTResult` of a finished loop: the final step, values, potentials and the lazy plan."""
    reg = o.reg
    f, g, _, _ = final_step(m, st, rho_x=o.rho_a, rho_y=o.rho_b)
    plan = LazyPlan(m, f, g, reg, numpy=numpy)
    if o.unbalanced:  # m.full: the whole vectors when the points are split over ranks (else the same)
        r, c = plan.raw_marginals()
        full = m.full("xyxyxy", m.a, m.b, f, g, r, c)
        value = warn_on_second_order(primal_value(*full, reg, o.rho_a, o.rho_b))
        value_dual = warn_on_second_order(dual_value(*full[:4], reg, o.rho_a, o.rho_b))
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


def _multiscale_measures(X_a, X_b, a, b, cost, o: SolveOptions, potentials_init) -> Measures:
    """``solve_sample(backend="multiscale")``'s checked measures (local checks only: no collective)."""
    refused = [name for name, bad in (("potentials_init", potentials_init is not None),
                                      ("acceleration", o.acceleration not in (None, "auto"))) if bad]
    if refused:
        raise NotImplementedError(f"backend='multiscale' does not support {', '.join(refused)} yet; use backend='auto'")
    m = Measures.build(X_a, X_b, a, b, cost=cost, backend="auto", names=("a", "X_a", "b", "X_b"))
    if m.batched:
        raise NotImplementedError("backend='multiscale' takes one pair of clouds (N, D), (M, D), not a batch; "
                                  "use backend='auto'")
    check_eps_scale("reg", o.reg, m.cmax, m.x.dtype)
    if not o.unbalanced:
        _check_equal_masses(m)
    return m


def _solve_multiscale(m: Measures, o: SolveOptions, cluster_scale, truncate, group, numpy: bool) -> OTResult:
    """``solve_sample(backend="multiscale")`` on measures checked by :func:`_multiscale_measures`: GeomLoss'
    coarse-to-fine schedule down to ``reg``, then the ordinary loop to ``tol`` on the pruned points
    (:func:`flashot.multiscale.continue_fine`)."""
    from .multiscale import MultiscaleConfig, continue_fine, in_input_order, multiscale_loop, schedule, truncate_for

    if group is not None:  # replicated mode: the problem and options checked across ranks, callback collective
        from .distributed import distribute_solve

        o = distribute_solve(m, o, group, options={"backend": "multiscale", "cluster_scale": cluster_scale,
                                                   "truncate": truncate})
    diameter = m.bbox_diameter()
    run = multiscale_loop(m, schedule(m.cost, diameter, o.reg), 2 if m.cost.is_dot else 1,
                          MultiscaleConfig(cluster_scale, truncate_for(truncate, o.tol)), debias=False, diameter=diameter,
                          verbose=o.verbose,
                          group=group, rho=(o.rho_a, o.rho_b))
    symmetric = METHODS[o.method]

    def loop(fine: Measures, st: SinkhornState) -> SinkhornState:
        return sinkhorn_loop(fine, Schedule(o.reg, o.max_iter), symmetric=symmetric, tol=o.tol, init=(st.f, st.g),
                             rho_x=o.rho_a, rho_y=o.rho_b, callback=o.callback, inner_iterations=o.inner_iterations,
                             verbose=o.verbose)

    run = continue_fine(run, loop)
    mo, st = in_input_order(m, run)
    res = _result(mo, st, o, numpy)
    res.multiscale = run
    return res


# POT's method names (ot.solve_sample / ot.sinkhorn) -> ours; eps_scaling forced where the name says so
POT_METHODS = {"sinkhorn_stabilized": ("sinkhorn", None), "sinkhorn_epsilon_scaling": ("sinkhorn", True),
               "geomloss": ("symmetric", None), "geomloss_auto": ("symmetric", None),
               "geomloss_tensorized": ("symmetric", None), "geomloss_online": ("symmetric", None)}
GRADS = ("autodiff", "envelope", "last_step", "detach")


def _pot_options(method, eps_scaling, reg_type, lazy, batch_size, n_threads, grad):
    """POT's solve_sample options: map or accept them, or raise naming the mapping."""
    if method is None:
        method = "auto"
    if isinstance(method, str) and method in POT_METHODS:
        method, forced = POT_METHODS[method]
        eps_scaling = forced if eps_scaling is None else eps_scaling
    elif isinstance(method, str) and method not in METHODS:
        raise ValueError(f"method: expected one of {sorted(METHODS) + sorted(POT_METHODS)}, got {method!r} "
                         "(greenkhorn / screenkhorn / exact solvers: use POT; every flashot method is a "
                         "log-domain Sinkhorn)")
    if not isinstance(reg_type, str) or reg_type.lower() not in ("kl", "entropy"):
        raise ValueError(f"reg_type: flashot regularises with KL(P | a x b) ('KL', POT's default; 'entropy' "
                         f"differs by a constant for fixed a, b), got {reg_type!r}")
    if lazy is not None and not isinstance(lazy, bool):
        raise TypeError(f"lazy: expected a bool (flashot's plan is always lazy), got {type(lazy).__name__}")
    for name, v in (("batch_size", batch_size), ("n_threads", n_threads)):
        if v is not None:
            check_int(name, v)  # accepted for POT compatibility; the engines choose tiles and threads
    if grad not in GRADS:
        raise ValueError(f"grad: expected one of {GRADS}, got {grad!r}")
    return method, eps_scaling


def _pot_uniform(w) -> bool:
    """POT's ``a=[]`` / ``b=[]`` (an empty list or array) means uniform weights."""
    return (isinstance(w, (list, tuple)) and len(w) == 0) or (isinstance(w, np.ndarray) and w.size == 0)


def _check_equal_masses(m: Measures) -> None:
    """Balanced OT needs sum(a) = sum(b); masses that differ beyond rounding have no coupling."""
    masses = m.unequal_masses()
    if masses is not None:
        raise ValueError(
            f"a and b: balanced OT needs equal total masses, got {masses[0]:.6g} and {masses[1]:.6g}; "
            "normalise the weights, or use unbalanced= (KL marginal penalties)"
        )


# eps-scaling: the first eps is the largest cost (an upper bound, Measures.cmax), each next one
# EPS_SCALING_RATIO times the previous, EPS_SCALING_STEPS iterations each, until reg; with
# eps_scaling=None it is used when reg < EPS_SCALING_AUTO * cmax and no potentials_init is given.
# Measured (tests/test_eps_scaling.py, the solve_sample docstring): ratio 0.5 x 3 steps left no
# GeomLoss convex-gradient plan wrong (1 step per level: 2 of 24; plain: 21 of 24) and needs no
# more iterations than plain Sinkhorn from reg = 3e-3 cmax down (more above it: off there).
EPS_SCALING_RATIO = 0.5
EPS_SCALING_STEPS = 3
EPS_SCALING_AUTO = 3e-3


def _check_eps_scaling(v) -> float | None:
    """None (auto) stays None; False -> 0 (off); True -> the default ratio; a ratio in (0, 1)."""
    if v is None:
        return None
    if isinstance(v, bool):
        return EPS_SCALING_RATIO if v else 0.0
    if not isinstance(v, (int, float)) or not 0 < v < 1:
        raise ValueError(f"eps_scaling: expected None (auto), True, False or a ratio in (0, 1), got {v!r}")
    return float(v)


def _small_eps(m: Measures, reg: float, symmetric: bool) -> bool:
    """Alternating updates at ``reg < EPS_SCALING_AUTO * cmax``: where the defaults add eps-scaling and Anderson."""
    return not symmetric and reg < EPS_SCALING_AUTO * m.cmax


def _acceleration(m: Measures, reg: float, acceleration, symmetric: bool):
    """``acceleration="auto"``: Anderson at small eps (alternating updates, ``reg < EPS_SCALING_AUTO * cmax``),
    none elsewhere: there it converged where plain iterations did not (docs/exactness.md)."""
    if not (isinstance(acceleration, str) and acceleration == "auto"):
        return acceleration
    return Anderson() if _small_eps(m, reg, symmetric) else None


def _scaling_head(m: Measures, reg: float, ratio: float | None, init, symmetric: bool) -> list[float]:
    """The temperatures run before the ones at ``reg`` (empty when eps-scaling is off)."""
    if ratio is None:  # auto
        ratio = EPS_SCALING_RATIO if init is None and _small_eps(m, reg, symmetric) else 0.0
    if ratio == 0.0 or not math.isfinite(m.cmax) or m.cmax <= reg:
        return []
    head, eps = [reg, reg], float(m.cmax)  # two steps at reg first: a problem they solve stops there
    while eps > reg:
        head += [eps] * EPS_SCALING_STEPS
        eps *= ratio
    return head


def _check_positional_scalars(a, b, reg) -> None:
    """A number passed third or fourth was taken as the weights ``a`` / ``b``: say so."""
    for name, v, pos in (("a", a, "third"), ("b", b, "fourth")):
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            hint = f"solve_sample(X_a, X_b, reg={v!r})" if reg is None else "keywords"
            raise TypeError(
                f"{name}: the {pos} positional argument ({v!r}) was taken as the weights {name!r} of "
                f"{'X_a' if name == 'a' else 'X_b'}, which must be a tensor or array; reg and the other "
                f"options are keyword-only: use {hint}"
            )


def _check_init(init, m: Measures) -> tuple[Tensor, Tensor]:
    if not isinstance(init, (tuple, list)) or len(init) != 2:
        raise TypeError("potentials_init: expected a pair (f, g)")
    out = []
    for name, v, ref in (("potentials_init[0]", init[0], m.a_log), ("potentials_init[1]", init[1], m.b_log)):
        t = to_tensor(name, v)
        check_dtype(name, t)
        check_storage(name, t)
        t = t.unsqueeze(0) if not m.batched else t
        if t.shape != ref.shape:
            shape = tuple(ref.shape) if m.batched else tuple(ref.shape[1:])
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(v.shape)}")
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name}: contains NaN or Inf values")
        out.append(t.detach().to(ref.device, ref.dtype))
    return out[0], out[1]
