"""Multiscale as a strategy of the one solve (:func:`flashot.driver.solve_problem`).

:class:`Multiscale` is the strategy object that :class:`~flashot.SamplesLoss` and :func:`~flashot.solve_sample`
build for ``backend="multiscale"`` and hand to the core's one entry, with their :class:`~flashot.driver.LoopConfig`;
it runs :func:`solve`: GeomLoss' schedule coarse-to-fine
(:func:`~flashot.multiscale.coarse_to_fine.multiscale_loop`), then, when asked, the ordinary iterations at
its last temperature on the pruned points (:func:`~flashot.multiscale.coarse_to_fine.continue_fine`).
:func:`pot_problem` builds ``solve_sample``'s config and strategy; :func:`solve_measures` runs them and returns
an :class:`~flashot.results.OTResult` in the inputs' point order (the counterpart of
:func:`flashot.driver.solve_measures`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from torch import Tensor

from ..driver import METHODS, LoopConfig, Solved, SolveOptions, make_result, solve_problem
from ..measures import Measures
from ..results import OTResult
from ..schedules import Schedule
from ..solver import IterationRecord, SinkhornState, sinkhorn_loop
from .coarse_to_fine import continue_fine, multiscale_loop
from .config import MultiscaleConfig, MultiscaleRun, truncate_for
from .ordering import in_input_order
from .scales import schedule


@dataclass(frozen=True)
class Refinement:
    """The ordinary iterations after the schedule, on the pruned points: at ``eps`` (None: the schedule's last
    temperature), symmetric (GeomLoss) or alternating (POT) updates, until the error is below ``tol`` (None:
    exactly ``max_iter`` iterations), with the loop's ``callback`` and ``inner_iterations``
    (:func:`~flashot.solver.sinkhorn_loop`)."""

    tol: float | None
    max_iter: int
    eps: float | None = None
    symmetric: bool = True
    callback: Callable[[IterationRecord], bool | None] | None = None
    inner_iterations: int = 10


def check_pair(m: Measures) -> None:
    """``backend="multiscale"`` clusters one pair of clouds: a batch raises ``NotImplementedError``."""
    if m.batched:
        raise NotImplementedError(
            "backend='multiscale' takes one pair of clouds (N, D), (M, D), not a batch; use backend='auto' for batches"
        )


def solve(
    m: Measures,
    eps_list: list[float],
    cfg: MultiscaleConfig,
    *,
    p: int,
    diameter: float,
    debias: bool = False,
    rho: tuple[float | None, float | None] = (None, None),
    labels: tuple[Tensor | None, Tensor | None] = (None, None),
    refine: Refinement | None = None,
    verbose: bool = False,
    group: Any = None,
) -> MultiscaleRun:
    """GeomLoss' symmetric schedule ``eps_list`` coarse-to-fine on the pair ``m`` (B = 1; cost ``|x - y|^p / p``
    up to the cost's scale, marginal penalties ``rho``, debiased or not, over the ranks of ``group``: see
    :func:`~flashot.multiscale.coarse_to_fine.multiscale_loop`), then the iterations of ``refine`` on the
    pruned points.  With ``refine``, ``cfg.truncate`` is raised to ``log(1 / refine.tol)``
    (:func:`~flashot.multiscale.config.truncate_for`): the pruning then stays within the tolerance the
    refinement promises.  The returned run holds the fine measures (sorted clouds) and their state."""
    tol = None if refine is None else refine.tol
    run = multiscale_loop(
        m,
        eps_list,
        p,
        replace(cfg, truncate=truncate_for(cfg.truncate, tol)),
        debias=debias,
        diameter=diameter,
        labels=labels,
        verbose=verbose,
        group=group,
        rho=rho,
    )
    if refine is None:
        return run

    def loop(fine: Measures, st: SinkhornState) -> SinkhornState:
        eps = st.eps if refine.eps is None else refine.eps
        return sinkhorn_loop(
            fine,
            Schedule(eps, refine.max_iter),
            symmetric=refine.symmetric,
            debias=debias,
            rho_x=rho[0],
            rho_y=rho[1],
            tol=refine.tol,
            init=(st.f, st.g),
            init_self=None if st.f_aa is None or st.g_bb is None else (st.f_aa, st.g_bb),
            callback=refine.callback,
            inner_iterations=refine.inner_iterations,
            verbose=verbose,
        )

    return continue_fine(run, loop)


@dataclass(frozen=True)
class Multiscale:
    """The coarse-to-fine strategy of :func:`~flashot.driver.solve_problem` (one pair of clouds, B = 1): calling
    it with ``(m, cfg)`` runs :func:`solve` on ``cfg.schedule`` (GeomLoss' decreasing temperatures), with
    ``cfg``'s debiasing, marginal penalties and progress bar, then, with ``cfg.refine``, that many iterations at
    most on the pruned points (:class:`Refinement`: ``cfg``'s updates, ``tol``, callback, ``inner_iterations``)
    at ``eps`` (None: the schedule's last temperature).  ``config``: clusters and pruning; ``p``: the exponent of
    the cost's schedule; ``labels``: GeomLoss' cluster labels; ``group``: replicated over its ranks.  The
    :class:`~flashot.driver.Solved` state holds the sorted fine measures, the run, and ``n_iter`` = the schedule's
    length plus the refinement's iterations."""

    config: MultiscaleConfig
    p: int
    diameter: float
    labels: tuple[Tensor | None, Tensor | None] = (None, None)
    group: Any = None
    eps: float | None = None

    def __call__(self, m: Measures, cfg: LoopConfig) -> Solved:
        check_pair(m)
        refine = None
        if cfg.refine is not None:
            refine = Refinement(
                cfg.tol,
                cfg.refine,
                eps=self.eps,
                symmetric=cfg.symmetric,
                callback=cfg.callback,
                inner_iterations=cfg.inner_iterations,
            )
        eps_list = list(cfg.schedule)
        run = solve(
            m,
            eps_list,
            self.config,
            p=self.p,
            diameter=self.diameter,
            debias=cfg.debias,
            rho=(cfg.rho_x, cfg.rho_y),
            labels=self.labels,
            refine=refine,
            verbose=cfg.verbose,
            group=self.group,
        )
        return Solved(run.m, run.state, len(eps_list) + (0 if refine is None else run.state.n_iter), run)


def pot_problem(
    m: Measures, o: SolveOptions, cfg: MultiscaleConfig, *, group: Any = None
) -> tuple[SolveOptions, LoopConfig, Multiscale]:
    """``solve_sample(backend="multiscale")``'s config and strategy on its checked pair ``m``: GeomLoss'
    coarse-to-fine schedule down to ``o.reg`` (:func:`~flashot.multiscale.scales.schedule`), then the ordinary
    loop (``o``'s updates, ``tol``, ``max_iter``, callback) at ``o.reg`` on the pruned points.  With ``group``
    (replicated mode) the problem and the options are first checked across the ranks (the options returned are
    this rank's)."""
    if group is not None:
        from ..distributed import distribute_solve

        o = distribute_solve(
            m, o, group, options={"backend": "multiscale", "cluster_scale": cfg.cluster_scale, "truncate": cfg.truncate}
        )
    diameter = m.bbox_diameter()
    loop = LoopConfig(
        schedule(m.cost, diameter, o.reg),
        symmetric=METHODS[o.method],
        rho_x=o.rho_a,
        rho_y=o.rho_b,
        tol=o.tol,
        refine=o.max_iter,
        callback=o.callback,
        inner_iterations=o.inner_iterations,
        verbose=o.verbose,
    )
    return o, loop, Multiscale(cfg, 2 if m.cost.is_dot else 1, diameter, group=group, eps=o.reg)


def pot_result(m: Measures, solved: Solved, o: SolveOptions, numpy: bool = False) -> OTResult:
    """The :class:`~flashot.results.OTResult` of a multiscale ``solved`` state of the pair ``m``: in the inputs'
    point order, its ``multiscale`` the run."""
    mo, st = in_input_order(m, solved.run)
    res = make_result(mo, st, o, numpy)
    res.multiscale = solved.run
    return res


def solve_measures(
    m: Measures, o: SolveOptions, cfg: MultiscaleConfig, *, group: Any = None, numpy: bool = False
) -> OTResult:
    """``solve_sample(backend="multiscale")`` on its checked pair ``m``: :func:`pot_problem`, the one solve
    (:func:`~flashot.driver.solve_problem`) and :func:`pot_result`."""
    o, loop, strategy = pot_problem(m, o, cfg, group=group)
    return pot_result(m, solve_problem(m, loop, strategy), o, numpy)
