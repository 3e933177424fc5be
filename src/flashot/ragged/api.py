r"""Ragged batches for the front ends: :func:`ragged_samples_loss` (``SamplesLoss`` on lists of clouds or
PyTorch Geometric batch vectors) and :func:`ragged_solve_sample` (``solve_sample`` on lists of clouds), both
one solve of the concatenated block-diagonal problem (:mod:`flashot.ragged.measures`).

Conventions shared by both:

* one temperature schedule for the whole batch: ``SamplesLoss``' epsilon-scaling starts at the largest
  problem diameter (the diagonal of each problem's own bounding box, both clouds together), ``solve_sample``'s
  optional one at the largest cost bound of the batch.  A problem whose own diameter is smaller gets more
  temperatures than alone; pass ``diameter=`` (``SamplesLoss``) to fix it;
* the batch stops when every problem's error is below ``tol`` (the error reported is the largest);
* an ``acceleration`` acts per problem (:class:`~flashot.acceleration.Accelerator` with the problems' segments:
  each problem's own omega, safeguard and Anderson mixing), as if it ran alone;
* values are per problem, (B,), each a sum over its own points, so ``value[k]``'s gradient reaches problem
  ``k``'s points and weights only (envelope gradients through the final step, as one problem's).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .._checks import check_eps_scale
from ..driver import METHODS, LoopConfig, auto_acceleration, pot_uniform, scaling_head, solve_options, solve_problem
from ..measures import MASS_RTOL, Measures
from ..plan import LazyPlan
from ..schedules import Schedule, epsilon_scaling
from ..solver import SinkhornState, final_step
from ..unbalanced import (
    debiased_dual_value,
    debiased_dual_value_two_sided,
    dual_value,
    primal_value,
    self_terms_final,
    warn_on_second_order,
)
from .inputs import RaggedInput, ragged_input
from .measures import RaggedMeasures, ragged_measures

__all__ = ["RaggedResult", "ragged_samples_loss", "ragged_solve_sample", "problem_diameters"]

_LOSS_BACKENDS = {
    "auto": "auto",
    "online": "auto",
    "tensorized": "tiled",
    "cpu": "cpu",
    "tiled": "tiled",
    "triton": "triton",
}
_P_COSTS = {1: "euclidean", 2: "half_sqeuclidean"}


def problem_diameters(inp: RaggedInput) -> Tensor:
    """(B,) float64: the diagonal of each problem's bounding box (both clouds together), GeomLoss' diameter."""
    lay, x, y = inp.layout, inp.x.detach().double(), inp.y.detach().double()
    D = x.shape[1]
    lo = torch.full((lay.B, D), math.inf, dtype=torch.float64, device=x.device)
    hi = torch.full((lay.B, D), -math.inf, dtype=torch.float64, device=x.device)
    for pts, side in ((x, "x"), (y, "y")):
        idx = lay.ids(side, x.device)[:, None].expand(-1, D)
        lo.scatter_reduce_(0, idx, pts, "amin")
        hi.scatter_reduce_(0, idx, pts, "amax")
    return (hi - lo).norm(dim=1).cpu()


def _refuse(what: str, items: list[tuple[str, bool]]) -> None:
    bad = [name for name, cond in items if cond]
    if bad:
        raise NotImplementedError(
            f"{what} on a ragged batch (lists of clouds / x_batch) does not support "
            f"{', '.join(bad)}; solve the problems one by one for those"
        )


def _loss_args(L, args) -> tuple:
    if len(args) == 2:
        return None, args[0], None, args[1]
    if len(args) == 4:
        return tuple(args)
    raise ValueError(f"SamplesLoss takes (x, y) or (a, x, b, y), got {len(args)} arguments")


def _unequal(m: RaggedMeasures) -> tuple[int | None, Tensor, Tensor]:
    """(the first problem whose total masses differ by more than ``MASS_RTOL``, relative, or None; masses)."""
    ma, mb = m.masses()
    bad = ((ma - mb).abs() > MASS_RTOL * torch.maximum(ma, mb)).nonzero()
    return (int(bad[0, 0]) if bad.numel() else None), ma, mb


def _warn_masses(m: RaggedMeasures) -> None:
    k, ma, mb = _unequal(m)
    if k is not None:
        warnings.warn(
            f"α and β: total masses of problem {k} differ ({float(ma[k]):.6g} vs {float(mb[k]):.6g}): "
            "balanced OT assumes equal masses; normalise the weights, or use reach= (unbalanced OT)",
            RuntimeWarning,
            stacklevel=4,
        )


def ragged_samples_loss(L, args: tuple, x_batch=None, y_batch=None, *, implicit_given: bool = False):
    """``L(*args, x_batch=, y_batch=)`` for a :class:`~flashot.SamplesLoss` ``L`` on a ragged batch: the (B,)
    values (``potentials=True``: ``(F, G)``, lists for list input, concatenated (N,), (M,) for batch vectors).

    Runs ``loss="sinkhorn"`` with the built-in costs, balanced or with ``reach`` / ``reach_x`` / ``reach_y``,
    debiased or not, GeomLoss' schedule and ``tol``; the value of problem ``k`` is the one ``L`` gives on that
    problem alone with the same ``diameter`` (see the module docstring for the schedule).  ``implicit_given``:
    ``L`` was built with ``implicit=`` (refused)."""
    _refuse(
        "SamplesLoss",
        [
            (f"loss={L.loss!r}", L.loss != "sinkhorn"),
            ("cost / kernel functions", L.cost is not None or L.kernel is not None),
            ("backend='multiscale'", L.backend == "multiscale"),
            ("group=", L.group is not None),
            ("warm_start=", L.warm_start is not None),
            ("implicit=", implicit_given),
        ],
    )
    if L.backend not in _LOSS_BACKENDS and L.backend != "multiscale":
        raise ValueError(f"backend: a ragged batch runs on {sorted(_LOSS_BACKENDS)}, got {L.backend!r}")
    a, x, b, y = _loss_args(L, args)
    inp = ragged_input(a, x, b, y, x_batch=x_batch, y_batch=y_batch, names=("α", "x", "β", "y"))
    m = ragged_measures(inp, _P_COSTS[L.p], _LOSS_BACKENDS[L.backend], L.debias, ("α", "x", "β", "y"))
    check_eps_scale("blur", L.blur**L.p, m.cmax, m.x.dtype)
    diameter = L.diameter if L.diameter is not None else float(problem_diameters(inp).max())
    eps_list = epsilon_scaling(L.p, max(diameter, L.blur), L.blur, L.scaling)
    rx, ry = L.rho_x, L.rho_y
    if rx is None and ry is None and (inp.a is not None or inp.b is not None):
        _warn_masses(m)
    refine = None if L.tol is None else L.max_iter  # GeomLoss' schedule, continued at its last temperature
    cfg = LoopConfig(eps_list, debias=L.debias, rho_x=rx, rho_y=ry, tol=L.tol, refine=refine, verbose=L.verbose)
    st = solve_problem(m, cfg).state
    L.last_n_iter, L.last_multiscale = st.n_iter, None
    out = _loss_value(m, st, L.debias, L.potentials, rx, ry)
    if not L.potentials:
        return out.to(m.out_dtype)
    F, G = (t[0].to(m.out_dtype) for t in out)
    return (m.layout.split(F, "x"), m.layout.split(G, "y")) if inp.lists else (F, G)


def _loss_value(m: RaggedMeasures, st: SinkhornState, debias: bool, potentials: bool, rx, ry):
    """The (B,) values of the finished loop ``st``, or the (debiased) potentials ``(F, G)`` (1, N), (1, M)."""
    sx, sy = m.sums
    if st.g_aa is not None:  # debiasing with rho_x != rho_y: two-sided self problems
        f, g, _, _ = final_step(m, replace(st, f_aa=None, g_bb=None), rho_x=rx, rho_y=ry)
        f_aa, g_aa, f_bb, g_bb = self_terms_final(m, st, rx, ry)
        if potentials:
            return f - 0.5 * (f_aa + g_aa), g - 0.5 * (f_bb + g_bb)
        return warn_on_second_order(
            debiased_dual_value_two_sided(m.a, m.b, f, g, f_aa, g_aa, f_bb, g_bb, st.eps, rx, ry, m.sums)
        )
    f, g, f_aa, g_bb = final_step(m, st, rho_x=rx, rho_y=ry)
    if potentials:
        return (f - f_aa, g - g_bb) if debias else (f, g)
    if rx is None and ry is None:
        v = sx(m.a * f) + sy(m.b * g)
        return v - sx(m.a * f_aa) - sy(m.b * g_bb) if debias else v
    if debias:
        return warn_on_second_order(debiased_dual_value(m.a, m.b, f, g, f_aa, g_bb, st.eps, rx, ry, m.sums))
    return warn_on_second_order(dual_value(m.a, m.b, f, g, st.eps, rx, ry, m.sums))


@dataclass
class RaggedResult:
    """Result of :func:`~flashot.solve_sample` on lists of clouds (B problems solved together).

    Attributes:
        value, value_dual: (B,) tensors (numpy for numpy input): problem ``k``'s :class:`~flashot.OTResult`
            ``value`` / ``value_dual``; differentiable w.r.t. every cloud and weight that requires grad.
        potentials: list of ``(f_k, g_k)``, (N_k,), (M_k,).
        n_iter, converged, error, stopped: of the batch: the iterations run, whether every problem met ``tol``,
            the largest problem's last error.
        reg, backend, unbalanced: as :class:`~flashot.OTResult`.

    :meth:`plan` gives problem ``k``'s lazy plan; :attr:`plans` all of them.
    """

    value: Any
    value_dual: Any
    potentials: list
    n_iter: int
    converged: bool
    error: float | None
    reg: float
    backend: str
    stopped: bool = False
    unbalanced: tuple | None = None
    _problem: Any = field(default=None, repr=False)  # (inputs, measures, cost, backend, numpy, f (1, N), g (1, M))

    def __len__(self) -> int:
        return len(self.potentials)

    @property
    def status(self) -> str:
        if self.converged:
            return "converged"
        return "stopped by callback" if self.stopped else "max_iter reached"

    def plan(self, k: int) -> LazyPlan:
        """Problem ``k``'s lazy plan ``P_ij = a_i b_j exp((f_i + g_j - C(x_i, y_j)) / reg)`` (a
        :class:`~flashot.plan.LazyPlan` on that problem's own points, run by the batch's backend)."""
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not -len(self) <= k < len(self):
            raise IndexError(f"plan: problem index {k!r} out of range for a batch of {len(self)} problems")
        k = int(k) % len(self)
        inp, m, cost, backend, numpy, f, g = self._problem
        ox, oy = m.layout.x_offsets.tolist(), m.layout.y_offsets.tolist()
        sx, sy = slice(ox[k], ox[k + 1]), slice(oy[k], oy[k + 1])
        mk = Measures.build(
            inp.x[sx].detach(),
            inp.y[sy].detach(),
            m.a[0, sx].detach(),
            m.b[0, sy].detach(),
            cost=cost,
            backend=backend,
            names=(f"a[{k}]", f"X_a[{k}]", f"b[{k}]", f"X_b[{k}]"),
        )
        return LazyPlan(mk, f[:, sx], g[:, sy], self.reg, numpy=numpy)

    @property
    def plans(self) -> list[LazyPlan]:
        """Every problem's lazy plan (:meth:`plan`)."""
        return [self.plan(k) for k in range(len(self))]


def _pot_kwargs(kw: dict) -> dict:
    """``solve_sample``'s POT options, for :func:`~flashot.driver.solve_options`."""
    keys = (
        "reg_type",
        "unbalanced",
        "unbalanced_type",
        "lazy",
        "batch_size",
        "method",
        "n_threads",
        "max_iter",
        "tol",
        "grad",
        "callback",
        "inner_iterations",
        "verbose",
        "implicit",
        "eps_scaling",
        "acceleration",
    )
    return {k: kw[k] for k in keys if k in kw}


def ragged_solve_sample(X_a, X_b, a=None, b=None, metric=None, reg=None, **kw) -> RaggedResult:
    """:func:`~flashot.solve_sample` on lists of clouds ``X_a[k]`` (N_k, D), ``X_b[k]`` (M_k, D) (weights: None
    or lists); takes ``solve_sample``'s arguments and returns a :class:`RaggedResult`.  Not supported here:
    ``group`` / ``shard``, ``backend="multiscale"``, ``potentials_init`` and ``implicit``.

    ``acceleration`` as for one problem, with every coefficient per problem (:class:`~flashot.Momentum`'s omega
    and safeguard, :class:`~flashot.Anderson`'s mixing from segment sums over each problem's potentials), so each
    problem takes the steps it would take alone; ``"auto"`` decides once for the batch, by the rule of one
    problem on the batch's largest cost bound (Anderson with alternating updates at ``reg < 3e-3 cmax``)."""
    cost, backend = kw.get("cost", "sqeuclidean"), kw.get("backend", "auto")
    if metric is not None:
        if not isinstance(metric, str):
            raise TypeError(f"metric: expected a cost name (string), got {type(metric).__name__}")
        if cost != "sqeuclidean" and metric != cost:
            raise ValueError(f"cost={cost!r} and metric={metric!r} disagree; give one of them")
        cost = metric
    _refuse(
        "solve_sample",
        [
            ("group=", kw.get("group") is not None),
            ("shard='points'", kw.get("shard", "replicated") != "replicated"),
            ("backend='multiscale'", backend == "multiscale"),
            ("cluster_scale=", kw.get("cluster_scale") is not None),
            ("truncate=", kw.get("truncate", 5.0) != 5.0),
            ("potentials_init=", kw.get("potentials_init") is not None),
            ("implicit=", kw.get("implicit") is not None),
            ("labels= (a LabelCost)", kw.get("labels") is not None),
        ],
    )
    o = solve_options(reg, exact_hint="POT's ot.solve_sample", **_pot_kwargs(kw))
    a, b = (None if pot_uniform(w) else w for w in (a, b))  # POT's a=[]: uniform
    numpy = isinstance(X_a, (list, tuple)) and len(X_a) > 0 and isinstance(X_a[0], np.ndarray)
    inp = ragged_input(a, X_a, b, X_b, names=("a", "X_a", "b", "X_b"))
    m = ragged_measures(inp, cost, backend, False, ("a", "X_a", "b", "X_b"))
    check_eps_scale("reg", o.reg, m.cmax, m.x.dtype)
    if not o.unbalanced:
        _check_masses(m)
    symmetric = METHODS[o.method]
    cfg = LoopConfig(
        Schedule(o.reg, o.max_iter, scaling_head(m, o.reg, o.eps_scaling, None, symmetric)),
        symmetric=symmetric,
        tol=o.tol,
        callback=o.callback,
        rho_x=o.rho_a,
        rho_y=o.rho_b,
        inner_iterations=o.inner_iterations,
        acceleration=auto_acceleration(m, o.reg, o.acceleration, symmetric),
        verbose=o.verbose,
    )
    st = solve_problem(m, cfg).state
    return _result(inp, m, st, o, cost, backend, numpy)


def _check_masses(m: RaggedMeasures) -> None:
    k, ma, mb = _unequal(m)
    if k is not None:
        raise ValueError(
            f"a and b: balanced OT needs equal total masses, got {float(ma[k]):.6g} and "
            f"{float(mb[k]):.6g} in problem {k}; normalise the weights, or use unbalanced="
        )


def _result(
    inp: RaggedInput, m: RaggedMeasures, st: SinkhornState, o, cost: str, backend: str, numpy: bool
) -> RaggedResult:
    f, g, _, _ = final_step(m, st, rho_x=o.rho_a, rho_y=o.rho_b)
    sx, sy = m.sums
    if o.unbalanced:
        r, c = LazyPlan(m, f, g, o.reg).raw_marginals()
        value = warn_on_second_order(primal_value(m.a, m.b, f, g, r, c, o.reg, o.rho_a, o.rho_b, m.sums))
        value_dual = warn_on_second_order(dual_value(m.a, m.b, f, g, o.reg, o.rho_a, o.rho_b, m.sums))
    else:
        value = value_dual = sx(m.a * f) + sy(m.b * g)
    if o.grad == "detach":
        value, value_dual, f, g = value.detach(), value_dual.detach(), f.detach(), g.detach()

    def out(t):
        t = t.to(m.out_dtype)
        return t.detach().cpu().numpy() if numpy else t

    pots = list(zip((out(t) for t in m.layout.split(f[0], "x")), (out(t) for t in m.layout.split(g[0], "y"))))
    res = RaggedResult(
        out(value),
        out(value_dual),
        pots,
        st.n_iter,
        st.converged,
        st.error,
        o.reg,
        m.engine.name,
        st.stopped,
        (o.rho_a, o.rho_b) if o.unbalanced else None,
        (inp, m, cost, backend, numpy, f.detach(), g.detach()),
    )
    return res
