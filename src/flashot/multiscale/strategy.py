"""Multiscale as a strategy of the one solve: the entry points of the front ends.

:func:`solve` is the one coarse-to-fine path of :class:`~flashot.SamplesLoss` and
:func:`~flashot.solve_sample` (their ``backend="multiscale"``): GeomLoss' schedule coarse-to-fine
(:func:`~flashot.multiscale.coarse_to_fine.multiscale_loop`), then, when asked, the ordinary iterations at
its last temperature on the pruned points (:func:`~flashot.multiscale.coarse_to_fine.continue_fine`).
:func:`solve_measures` is ``solve_sample``'s: the counterpart of :func:`flashot.driver.solve_measures`,
returning an :class:`~flashot.results.OTResult` in the inputs' point order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from torch import Tensor

from ..driver import METHODS, SolveOptions, make_result
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


def solve_measures(
    m: Measures, o: SolveOptions, cfg: MultiscaleConfig, *, group: Any = None, numpy: bool = False
) -> OTResult:
    """``solve_sample(backend="multiscale")`` on its checked pair ``m``: GeomLoss' coarse-to-fine schedule
    down to ``o.reg`` (:func:`~flashot.multiscale.scales.schedule`), then the ordinary loop (``o``'s updates,
    ``tol``, ``max_iter``, callback) on the pruned points, through :func:`solve`; the result in the inputs'
    point order, its ``multiscale`` the run.  With ``group`` (replicated mode) the problem and the options are
    first checked across the ranks."""
    if group is not None:
        from ..distributed import distribute_solve

        o = distribute_solve(
            m, o, group, options={"backend": "multiscale", "cluster_scale": cfg.cluster_scale, "truncate": cfg.truncate}
        )
    diameter = m.bbox_diameter()
    refine = Refinement(
        o.tol,
        o.max_iter,
        eps=o.reg,
        symmetric=METHODS[o.method],
        callback=o.callback,
        inner_iterations=o.inner_iterations,
    )
    run = solve(
        m,
        schedule(m.cost, diameter, o.reg),
        cfg,
        p=2 if m.cost.is_dot else 1,
        diameter=diameter,
        rho=(o.rho_a, o.rho_b),
        refine=refine,
        verbose=o.verbose,
        group=group,
    )
    mo, st = in_input_order(m, run)
    res = make_result(mo, st, o, numpy)
    res.multiscale = run
    return res
