r"""The core solve on prepared :class:`~flashot.measures.Measures`: the one entry of every front end
(:func:`solve_problem`), and POT's validated options, eps-scaling head and :class:`~flashot.results.OTResult`.

:func:`solve_problem` takes the problem and a :class:`LoopConfig` (the schedule, the updates, debiasing, the
marginal penalties, the stopping rule, the start) and returns a :class:`Solved` state.  A *strategy* (a callable
``(m, config) -> Solved`` built by the front end: GeomLoss' coarse-to-fine
:class:`flashot.multiscale.Multiscale`, the warm starts of :class:`flashot.warmstart.WarmStart`) is chosen there
and runs the loop its own way; without one the loop runs once on ``m``.  The strategies are passed in, not
imported: they may live in a higher layer (multiscale) and the core stays below them.
:class:`~flashot.SamplesLoss` and :func:`~flashot.solve_sample` differ only in how they build the problem and the
config, and in how they read the state out.

Shared by the front ends (:func:`flashot.solve_sample`, :func:`flashot.solve`, the GW solvers) and the
distributed strategy, which is why it lives below them.  Options take POT's names (``method``, ``reg_type``,
...) and map them to the loop's (:func:`solve_options`, :func:`loop_config`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

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
from .acceleration import Anderson, Momentum, check_acceleration
from .implicit import ImplicitDiff, check_implicit
from .measures import Measures
from .results import OTResult, make_result
from .schedules import Schedule, continued
from .solver import IterationRecord, SinkhornState, sinkhorn_loop
from .unbalanced import parse_unbalanced


@dataclass(frozen=True)
class LoopConfig:
    """How :func:`solve_problem` runs the Sinkhorn loop on a prepared problem (the arguments of
    :func:`~flashot.solver.sinkhorn_loop`, frozen).

    ``schedule``: the temperatures, one iteration each (GeomLoss' epsilon-scaling, or POT's eps-scaling head and
    ``max_iter`` iterations at ``reg``: a :class:`~flashot.schedules.Schedule`).  ``refine``: None, or at most this
    many more iterations at the schedule's last temperature, until the error is below ``tol`` (GeomLoss' schedule
    visits its last temperature once: ``SamplesLoss(tol=)`` continues there; a strategy may run them on other
    measures, multiscale on its pruned points).  ``symmetric``: averaged (GeomLoss) or alternating (POT) updates
    (with multiscale: those of the refinement; its schedule is GeomLoss').  ``debias``: also the self problems
    ``OT(a, a)``, ``OT(b, b)``.  ``rho_x``, ``rho_y``: KL marginal penalties (None: strict).  ``init`` /
    ``init_self``: warm starts of the cross / debiasing potentials.  The rest as in ``sinkhorn_loop``."""

    schedule: Sequence[float]
    symmetric: bool = True
    debias: bool = False
    rho_x: float | None = None
    rho_y: float | None = None
    tol: float | None = None
    refine: int | None = None
    init: tuple[Tensor, Tensor] | None = None
    init_self: tuple[Tensor, Tensor] | None = None
    callback: Callable[[IterationRecord], bool | None] | None = None
    inner_iterations: int = 10
    acceleration: Any = None
    verbose: bool = False

    @property
    def temperatures(self) -> Sequence[float]:
        """The schedule the single-scale loop runs: ``schedule``, then the ``refine`` iterations."""
        return self.schedule if self.refine is None else continued(self.schedule, self.refine)


@dataclass(frozen=True)
class Solved:
    """What :func:`solve_problem` returns: the measures the ``state`` belongs to (a strategy's own: multiscale's
    sorted, pruned points), the iterations to report (``n_iter``: a strategy may count its schedule apart from
    ``state.n_iter``) and the strategy's record (``run``: a :class:`~flashot.multiscale.MultiscaleRun`; None
    without one)."""

    m: Measures
    state: SinkhornState
    n_iter: int
    run: Any = None


Strategy = Callable[[Measures, LoopConfig], Solved]


def run_loop(m: Measures, cfg: LoopConfig) -> SinkhornState:
    """The Sinkhorn loop on ``m`` as ``cfg`` says (its :attr:`~LoopConfig.temperatures`): the single-scale
    strategy, and the step the other strategies compose."""
    return sinkhorn_loop(
        m,
        cfg.temperatures,
        symmetric=cfg.symmetric,
        debias=cfg.debias,
        rho_x=cfg.rho_x,
        rho_y=cfg.rho_y,
        tol=cfg.tol,
        init=cfg.init,
        init_self=cfg.init_self,
        callback=cfg.callback,
        inner_iterations=cfg.inner_iterations,
        acceleration=cfg.acceleration,
        verbose=cfg.verbose,
    )


def solve_problem(m: Measures, cfg: LoopConfig, strategy: Strategy | None = None) -> Solved:
    """The one solve of every front end: the prepared problem ``m``, the loop's ``cfg`` and the ``strategy`` the
    front end chose (None: single scale, the loop once on ``m``; else ``strategy(m, cfg)``, e.g. coarse-to-fine
    or warm-started).  Returns the :class:`Solved` state, which the front end reads out (values, potentials,
    a result)."""
    if strategy is not None:
        return strategy(m, cfg)
    st = run_loop(m, cfg)
    return Solved(m, st, st.n_iter)


METHODS = {"auto": False, "sinkhorn": False, "sinkhorn_log": False, "alternating": False, "symmetric": True}


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


def solve_options(
    reg: float | None,
    *,
    reg_type: str = "KL",
    unbalanced: Any = None,
    unbalanced_type: str = "KL",
    lazy: bool | None = None,
    batch_size: int | None = None,
    method: str | None = "auto",
    n_threads: int | None = None,
    max_iter: int | None = None,
    tol: float | None = 1e-6,
    grad: str = "autodiff",
    callback: Callable[[IterationRecord], bool | None] | None = None,
    inner_iterations: int = 10,
    acceleration: Momentum | Anderson | str | None = "auto",
    verbose: bool = False,
    implicit: ImplicitDiff | bool | None = None,
    eps_scaling: bool | float | None = None,
    exact_hint: str = "POT",
) -> SolveOptions:
    """Validate and map the options shared by :func:`solve_sample` and :func:`flashot.solve` (POT's
    names accepted), before any heavy work."""
    method, eps_scaling = _pot_options(method, eps_scaling, reg_type, lazy, batch_size, n_threads, grad)
    if reg is None:
        raise ValueError(
            "reg: flashot solves entropic OT and needs reg > 0 (the epsilon); "
            f"for exact (unregularised) OT use {exact_hint}"
        )
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
    return SolveOptions(
        reg,
        max_iter,
        tol,
        method,
        eps_scaling,
        rho_a,
        rho_b,
        inner_iterations,
        acceleration,
        implicit,
        callback,
        verbose,
        grad,
    )


def loop_config(m: Measures, o: SolveOptions, potentials_init: Any = None) -> LoopConfig:
    """POT's single-scale solve of ``m`` as a :class:`LoopConfig`: ``reg`` checked against the costs, equal
    masses when balanced, ``potentials_init`` checked, the eps-scaling head (:func:`scaling_head`) and
    ``max_iter`` iterations at ``reg`` in one :class:`~flashot.schedules.Schedule`, ``acceleration="auto"``
    resolved."""
    reg = o.reg
    check_eps_scale("reg", reg, m.cmax, m.x.dtype)
    if not o.unbalanced:
        check_equal_masses(m)
    init = None if potentials_init is None else check_init(potentials_init, m)
    symmetric = METHODS[o.method]
    head = scaling_head(m, reg, o.eps_scaling, init, symmetric)
    return LoopConfig(
        Schedule(reg, o.max_iter, head),
        symmetric=symmetric,
        rho_x=o.rho_a,
        rho_y=o.rho_b,
        tol=o.tol,
        init=init,
        callback=o.callback,
        inner_iterations=o.inner_iterations,
        acceleration=auto_acceleration(m, reg, o.acceleration, symmetric),
        verbose=o.verbose,
    )


def solve_measures(m: Measures, o: SolveOptions, potentials_init: Any = None, *, numpy: bool = False) -> OTResult:
    """POT's single-scale solve on prepared measures with validated options (:func:`loop_config`, then
    :func:`solve_problem`); the :class:`OTResult` of :func:`flashot.solve`, the GW solvers and the points-sharded
    :func:`flashot.solve_sample`."""
    return make_result(m, solve_problem(m, loop_config(m, o, potentials_init)).state, o, numpy)


# POT's method names (ot.solve_sample / ot.sinkhorn) -> ours; eps_scaling forced where the name says so
POT_METHODS = {
    "sinkhorn_stabilized": ("sinkhorn", None),
    "sinkhorn_epsilon_scaling": ("sinkhorn", True),
    "geomloss": ("symmetric", None),
    "geomloss_auto": ("symmetric", None),
    "geomloss_tensorized": ("symmetric", None),
    "geomloss_online": ("symmetric", None),
}
GRADS = ("autodiff", "envelope", "last_step", "detach")


def _pot_options(method, eps_scaling, reg_type, lazy, batch_size, n_threads, grad):
    """POT's solve_sample options: map or accept them, or raise naming the mapping."""
    if method is None:
        method = "auto"
    if isinstance(method, str) and method in POT_METHODS:
        method, forced = POT_METHODS[method]
        eps_scaling = forced if eps_scaling is None else eps_scaling
    elif isinstance(method, str) and method not in METHODS:
        raise ValueError(
            f"method: expected one of {sorted(METHODS) + sorted(POT_METHODS)}, got {method!r} "
            "(greenkhorn / screenkhorn / exact solvers: use POT; every flashot method is a "
            "log-domain Sinkhorn)"
        )
    if not isinstance(reg_type, str) or reg_type.lower() not in ("kl", "entropy"):
        raise ValueError(
            f"reg_type: flashot regularises with KL(P | a x b) ('KL', POT's default; 'entropy' "
            f"differs by a constant for fixed a, b), got {reg_type!r}"
        )
    if lazy is not None and not isinstance(lazy, bool):
        raise TypeError(f"lazy: expected a bool (flashot's plan is always lazy), got {type(lazy).__name__}")
    for name, v in (("batch_size", batch_size), ("n_threads", n_threads)):
        if v is not None:
            check_int(name, v)  # accepted for POT compatibility; the engines choose tiles and threads
    if grad not in GRADS:
        raise ValueError(f"grad: expected one of {GRADS}, got {grad!r}")
    return method, eps_scaling


def pot_uniform(w: object) -> bool:
    """POT's ``a=[]`` / ``b=[]`` (an empty list or array) means uniform weights."""
    return (isinstance(w, (list, tuple)) and len(w) == 0) or (isinstance(w, np.ndarray) and w.size == 0)


def check_equal_masses(m: Measures) -> None:
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
# Measured (tests/core/test_eps_scaling.py, the solve_sample docstring): ratio 0.5 x 3 steps left no
# GeomLoss convex-gradient plan wrong (1 step per level: 2 of 24; plain: 21 of 24) and needs no
# more iterations than plain Sinkhorn from reg = 3e-3 cmax down (more above it: off there).
EPS_SCALING_RATIO = 0.5
EPS_SCALING_STEPS = 3
EPS_SCALING_AUTO = 3e-3


def _check_eps_scaling(v: object) -> float | None:
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


def auto_acceleration(m: Measures, reg: float, acceleration: Any, symmetric: bool) -> Momentum | Anderson | None:
    """``acceleration="auto"``: Anderson at small eps (alternating updates, ``reg < EPS_SCALING_AUTO * cmax``),
    none elsewhere: there it converged where plain iterations did not (docs/exactness.md)."""
    if not (isinstance(acceleration, str) and acceleration == "auto"):
        return acceleration
    return Anderson() if _small_eps(m, reg, symmetric) else None


def scaling_head(m: Measures, reg: float, ratio: float | None, init: object, symmetric: bool) -> list[float]:
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


def check_init(init: object, m: Measures) -> tuple[Tensor, Tensor]:
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
