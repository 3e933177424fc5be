r"""``solve_sample``: entropic OT between point clouds, POT / GeomLoss style.

Solves :math:`\min_P \langle C, P\rangle + \varepsilon\, \mathrm{KL}(P \,|\, a \otimes b)`
over couplings of ``a`` and ``b``, with ``C(x, y) = |x - y|^2`` by default and
``reg`` :math:`= \varepsilon`.  The value is POT's (balanced problems); at convergence it
equals :math:`\langle f, a\rangle + \langle g, b\rangle`, computed in increment form above
``100 x`` the largest cost, where log-domain potentials round to ``~ eps 2^-53``
(:func:`flashot.values.hot_value`: accurate at any ``reg``, tending to
:math:`\langle C, a b^\top\rangle`).  With ``unbalanced=`` the marginal constraints become KL
penalties (:mod:`flashot.unbalanced`), on one side only for ``unbalanced=(rho, None)``, and the
value is the objective with generalised KL terms at the returned plan (POT 0.9 drops the KL
terms' masses there).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np

from . import multiscale
from ._checks import check_eps_scale, check_positive, to_tensor
from .driver import (  # noqa: F401  (OTResult ... EPS_SCALING_AUTO: their former home, kept importable)
    EPS_SCALING_AUTO,
    EPS_SCALING_RATIO,
    EPS_SCALING_STEPS,
    GRADS,
    METHODS,
    POT_METHODS,
    LoopConfig,
    SolveOptions,
    Strategy,
    check_equal_masses,
    check_init,
    loop_config,
    make_result,
    pot_uniform,
    solve_measures,
    solve_options,
    solve_problem,
)
from .implicit import ImplicitDiff
from .measures import Measures
from .ragged import RaggedResult, is_ragged_call, ragged_solve_sample
from .results import OTResult
from .solver import IterationRecord


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
    labels: tuple | None = None,
) -> OTResult | RaggedResult:
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
            (|x-y|), or a :class:`~flashot.LabelCost` (with ``labels``).  ``metric`` is POT's name for the
            same argument.  POT's positional order works: ``solve_sample(X_a, X_b, a, b, metric, reg)``.
        labels: with ``cost=LabelCost(W, feature_weight, label_weight)``: ``(labels_a, labels_b)``, integer
            class labels of the points (shape ``X.shape[:-1]``, in ``[0, C_a)`` and ``[0, C_b)``); the cost is
            ``feature_weight |x - y|^2 + label_weight W[l, l']`` (:func:`flashot.otdd`).  Not with
            ``backend="multiscale"`` or ``group``.
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
            from zero potentials are slow and can stop at a wrong plan (``tests/core/test_eps_scaling.py``),
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

    Ragged batches: lists of clouds ``X_a[k]`` (N_k, D), ``X_b[k]`` (M_k, D) (weights None or lists) solve the B
    problems together (:mod:`flashot.ragged`) and return a :class:`~flashot.ragged.RaggedResult`: ``value``
    (B,), ``potentials[k] = (f_k, g_k)``, ``plan(k)``.

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
    if is_ragged_call((X_a, X_b)):  # lists of clouds: a ragged batch (flashot.ragged)
        return ragged_solve_sample(**locals())
    with rank_checks(group):  # local checks only: with a group, a rank's rejection raises on every rank
        a, b = (None if pot_uniform(w) else w for w in (a, b))
        cost = _metric_cost(metric, cost)
        _check_positional_scalars(a, b, reg)
        if group is not None or shard != "replicated":
            from .distributed import check_shard

            check_shard(shard, group)
        opts = solve_options(
            reg,
            reg_type=reg_type,
            unbalanced=unbalanced,
            unbalanced_type=unbalanced_type,
            lazy=lazy,
            batch_size=batch_size,
            method=method,
            n_threads=n_threads,
            max_iter=max_iter,
            tol=tol,
            grad=grad,
            callback=callback,
            inner_iterations=inner_iterations,
            acceleration=acceleration,
            verbose=verbose,
            implicit=implicit,
            eps_scaling=eps_scaling,
            exact_hint="POT's ot.solve_sample",
        )
        is_np, X_a, X_b, a, b = _clouds(X_a, X_b, a, b, cost, labels, backend, group, shard)
        if shard != "points":  # (points mode: points_solve builds this rank's slices inside its first collective)
            m, cluster_scale, truncate = _replicated_measures(
                X_a, X_b, a, b, cost, backend, opts, cluster_scale, truncate, potentials_init
            )
    if shard == "points":  # one problem whose points are split over the ranks (flashot.distributed)
        from .distributed import points_solve

        kw = {"cost": cost, "backend": backend, "group": group, "potentials_init": potentials_init, "numpy": is_np}
        return points_solve(X_a, X_b, a, b, opts=opts, **kw)
    opts, cfg, strategy = _loop_and_strategy(m, opts, backend, group, potentials_init, cluster_scale, truncate)
    solved = solve_problem(m, cfg, strategy)  # the core's one solve (flashot.driver)
    if solved.run is not None:  # coarse-to-fine: the result in the inputs' point order
        return multiscale.pot_result(m, solved, opts, numpy=is_np)
    return make_result(solved.m, solved.state, opts, is_np)


def _loop_and_strategy(
    m: Measures, opts: SolveOptions, backend: str, group, potentials_init, cluster_scale, truncate
) -> tuple[SolveOptions, LoopConfig, Strategy | None]:
    """``solve_sample``'s loop on the prepared pair ``m`` and the strategy that runs it: coarse-to-fine
    (``backend="multiscale"``, :func:`flashot.multiscale.pot_problem`) or single scale (POT's eps-scaling head
    and iterations at ``reg``, :func:`~flashot.driver.loop_config`), over a group's ranks in replicated mode
    (the problem and the options checked across them first; the options returned are this rank's)."""
    if backend == "multiscale":  # the coarse-to-fine strategy (flashot.multiscale), replicated over a group's ranks
        return multiscale.pot_problem(m, opts, multiscale.MultiscaleConfig(cluster_scale, truncate), group=group)
    if group is not None:  # one problem over the ranks of a torch.distributed group
        from .distributed import distribute_solve

        opts = distribute_solve(m, opts, group, potentials_init)
    return opts, loop_config(m, opts, potentials_init), None


def _clouds(X_a, X_b, a, b, cost, labels, backend: str, group, shard: str):
    """``(numpy?, X_a, X_b, a, b)``: the clouds and weights as tensors, the points augmented by their labels
    for a :class:`~flashot.LabelCost`; ``backend="multiscale"`` refused with ``shard="points"``."""
    is_np, X_a, X_b, a, b = _as_tensors(X_a, X_b, a, b)
    if labels is not None or getattr(cost, "labelled", False):
        X_a, X_b = _label_points(X_a, X_b, cost, labels, backend, group)
    if shard == "points" and backend == "multiscale":
        raise NotImplementedError(
            "backend='multiscale' with shard='points': the clustering needs the whole "
            "clouds on every rank; use shard='replicated' (the default: every rank passes "
            "all the points)"
        )
    return is_np, X_a, X_b, a, b


def _metric_cost(metric, cost):
    """POT's ``metric`` name, checked against ``cost`` (one of them names the cost): the cost to use."""
    if metric is not None:
        if not isinstance(metric, str):
            hint = (
                f"; POT's order is (X_a, X_b, a, b, metric, reg): did you mean reg={metric!r}?"
                if isinstance(metric, (int, float)) and not isinstance(metric, bool)
                else ""
            )
            raise TypeError(f"metric: expected a cost name (string), got {type(metric).__name__}{hint}")
        if cost != "sqeuclidean" and metric != cost:
            raise ValueError(f"cost={cost!r} and metric={metric!r} disagree; give one of them")
        cost = metric
    return cost


def _as_tensors(X_a, X_b, a, b):
    """``(numpy?, X_a, X_b, a, b)``: the clouds and weights as tensors (both clouds of one kind)."""
    is_np = isinstance(X_a, np.ndarray)
    if is_np != isinstance(X_b, np.ndarray):
        raise TypeError("X_a and X_b: give both as torch tensors or both as numpy arrays")
    X_a, X_b = to_tensor("X_a", X_a), to_tensor("X_b", X_b)
    if a is not None:
        a = to_tensor("a", a, like=X_a)
    if b is not None:
        b = to_tensor("b", b, like=X_b)
    return is_np, X_a, X_b, a, b


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
        check_init(potentials_init, m)
    return m, cluster_scale, truncate


def _multiscale_measures(X_a, X_b, a, b, cost, o: SolveOptions, potentials_init) -> Measures:
    """``solve_sample(backend="multiscale")``'s checked measures (local checks only: no collective)."""
    refused = [
        name
        for name, bad in (
            ("potentials_init", potentials_init is not None),
            ("acceleration", o.acceleration not in (None, "auto")),
        )
        if bad
    ]
    if refused:
        raise NotImplementedError(f"backend='multiscale' does not support {', '.join(refused)} yet; use backend='auto'")
    m = Measures.build(X_a, X_b, a, b, cost=cost, backend="auto", names=("a", "X_a", "b", "X_b"))
    multiscale.check_pair(m)
    check_eps_scale("reg", o.reg, m.cmax, m.x.dtype)
    if not o.unbalanced:
        check_equal_masses(m)
    return m


def _label_points(X_a, X_b, cost, labels, backend, group):
    """The augmented points ``[X, label]`` of a :class:`~flashot.LabelCost` solve (checked)."""
    if not getattr(cost, "labelled", False):
        raise ValueError("labels: used with cost=flashot.LabelCost(W, ...) only (a class-to-class cost table)")
    if labels is None:
        raise ValueError("cost=LabelCost(...): give the points' class labels, labels=(labels_a, labels_b)")
    if backend == "multiscale" or group is not None:
        raise NotImplementedError(
            "cost=LabelCost(...) runs on one process, single-scale (backend='auto', 'cpu', "
            "'tiled', 'dense' or 'triton'), not with backend='multiscale' or group"
        )
    return cost.augment(X_a, X_b, labels)


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
