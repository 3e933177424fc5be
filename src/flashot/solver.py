r"""The Sinkhorn loop, written once against the softmin primitive.

Log-domain entropic OT between :math:`a = \sum_i a_i \delta_{x_i}` and
:math:`b = \sum_j b_j \delta_{y_j}` at temperature :math:`\varepsilon`:

.. math::
    f_i \leftarrow -\lambda_x \varepsilon \log \sum_j b_j e^{(g_j - C(x_i, y_j))/\varepsilon},
    \qquad
    g_j \leftarrow -\lambda_y \varepsilon \log \sum_i a_i e^{(f_i - C(x_i, y_j))/\varepsilon}

with damping :math:`\lambda = 1 / (1 + \varepsilon / \rho)` for a KL marginal
penalty of strength :math:`\rho` (:math:`\lambda = 1`, balanced, when ``rho`` is None).

* ``symmetric=True``: both potentials from the previous ones, then averaged
  (GeomLoss); the debiasing potentials ``f_aa``, ``g_bb`` are updated alongside.
* ``symmetric=False``: alternating updates (POT / OTT).

Stopping: the error (L1 marginal violation when balanced, sup-norm change of the
potentials / eps when unbalanced) is read off the updates and brought to the host only
every ``inner_iterations`` steps.  Rounding bounds what it can resolve: with ``u`` the
compute dtype's machine epsilon, :func:`rounding_floor` is
``u ((cmax + |f|_inf + |g|_inf) / eps + 2 log2(1 + max(N, M)))`` (``cmax`` the largest cost; the
measured stagnation levels on dense/tiled/cpu are 0.01-0.65 times it).  The loop stops when the
error is below ``max(tol, floor)``; where the floor exceeds ``max(tol, FLOOR_CAP)`` the error
cannot be measured and the solve is never reported as converged.  Optional acceleration
(:mod:`flashot.acceleration`) and progress display (:mod:`flashot.progress`).

The loop never touches tiles or engines: it only calls :class:`~flashot.measures.Measures`.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ._checks import check_int
from .acceleration import Accelerator, Anderson, Momentum, check_acceleration
from .measures import Measures
from .ops.base import Capability
from .progress import make_progress


@dataclass(frozen=True)
class IterationRecord:
    """What a ``callback`` receives after each iteration.

    The callback may return ``True`` to stop the solve early (the result then has
    ``converged=False`` and ``stopped=True``, and no RuntimeWarning is issued).
    ``error`` is only filled in every ``inner_iterations`` steps (and at the last one).
    """

    iteration: int  # 1-based
    eps: float
    error: float | None  # marginal error (balanced) or potential change (unbalanced); None if not computed
    # (computed every ``inner_iterations`` steps and at the last one)
    elapsed: float  # seconds since the loop started


@dataclass
class SinkhornState:
    f: Tensor  # (B, N)  potential on x
    g: Tensor  # (B, M)  potential on y
    f_aa: Tensor | None  # (B, N) symmetric potential of (a, a), debiasing only
    g_bb: Tensor | None
    eps: float  # final temperature
    n_iter: int
    error: float | None
    converged: bool
    stopped: bool = False  # the callback returned True
    # debiasing with rho_x != rho_y: OT(a, a) and OT(b, b) are not symmetric problems and
    # need a second potential each (f_aa / g_aa on the two copies of x, f_bb / g_bb on y)
    g_aa: Tensor | None = None
    f_bb: Tensor | None = None


def _left_at(eps_list: Sequence[float], it: int) -> int:
    """Steps left at the current eps from step ``it`` (1-based) on, this one included (the schedules only
    repeat their final eps, so the count ends at ``len(eps_list)`` unless the next entry differs)."""
    n = len(eps_list)
    return n - it + 1 if eps_list[n - 1] == eps_list[it - 1] else 1


def damping(eps: float, rho: float | None) -> float:
    return 1.0 if rho is None else 1.0 / (1.0 + eps / rho)


def _marginal_part(m: Measures, f_old: Tensor, f_new: Tensor, eps: float, side: str) -> Tensor:
    """This process's part of the L1 error of one marginal of the plan built from (f_old, g), read off the
    update f_new (to be summed over the processes, :func:`_errors`).

    For the plan ``P = a b exp((f_old + g - C)/eps)``, the row sums are
    ``a_i exp((f_old_i - f_new_i)/eps)`` where ``f_new = softmin_x(log b + g/eps)``:
    no extra pass over the data.  Points of zero weight contribute nothing; a NaN or
    Inf anywhere else gives an infinite error (never a small one).  Returns a (B,) tensor (one error per
    problem of a ragged batch: :meth:`~flashot.measures.Measures.per_problem_sum`).
    """
    w = m.a if side == "x" else m.b
    w = w.detach()
    r1 = torch.expm1((f_old - f_new) / eps)  # exp(.) - 1 without rounding exp(.) near 1 first
    finite = torch.isfinite(f_old) & torch.isfinite(f_new)
    per_point = torch.where(finite, (w * r1).abs(), torch.full_like(w, math.inf))
    per_point = torch.where(w > 0, per_point, torch.zeros_like(w))
    return m.per_problem_sum(per_point, side)


def _nan_as_inf(err: Tensor) -> Tensor:
    return torch.where(torch.isnan(err), torch.full_like(err, math.inf), err)


def _error_part(m: Measures, f_old: Tensor, f_new: Tensor, eps: float, side: str, balanced: bool) -> tuple[Tensor, str]:
    """This process's part of the (B,) error of one side, read off an update ``f_new`` computed from the current
    ``f_old``, and the reduction over the processes that completes it: the L1 marginal violation (balanced, a
    sum) or ``max |f_new - f_old| / eps`` (unbalanced, a max)."""
    if balanced:
        return _marginal_part(m, f_old, f_new, eps, side), "sum"
    return m.per_problem_max(_nan_as_inf((f_new - f_old).abs() / eps), side), "max"


def _errors(
    m: Measures, balanced: bool, eps: float, updates: Sequence[tuple], extra: Sequence[tuple[Tensor, str]] = ()
) -> tuple[Tensor, list[Tensor]]:
    """The elementwise max of the ``(old, new, side)`` updates' (B,) errors (NaN / Inf potentials read as an
    infinite error), and the ``extra`` ``(tensor, op)`` reduced in the same call of
    :meth:`~flashot.measures.Measures.reduce_all`: points-sharded, one collective per kind of reduction for a
    whole step's errors and the acceleration's sums, each collective costing far more than its few numbers."""
    red = m.reduce_all([_error_part(m, old, new, eps, side, balanced) for old, new, side in updates] + list(extra))
    err = None
    for e in red[: len(updates)]:
        e = _nan_as_inf(e) if balanced else e
        err = e if err is None else torch.maximum(err, e)
    assert err is not None  # at least one update
    return err, red[len(updates) :]


# Above this floor the error of a check says nothing useful (1% of the mass): no convergence.
FLOOR_CAP = 1e-2


def rounding_floor(m: Measures, f: Tensor, g: Tensor, eps: float) -> Tensor:
    """Smallest error a check can resolve in the compute dtype (0-dim tensor, no sync; see the module
    docstring): potentials carry a rounding error ~ ``u (cmax + |f| + |g|)``, read divided by eps,
    and the streamed sums ~ ``u log2(terms)``."""
    u = torch.finfo(f.dtype).eps
    cmax = m.cmax if math.isfinite(m.cmax) else 0.0
    n = max(m.sizes)
    scale = m.reduce(torch.stack([f.abs().amax(), g.abs().amax()]), "max").sum() + cmax
    return u * (scale / eps + 2.0 * math.log2(1 + n))


def stop_tol(tol: float, floor: float) -> float | None:
    """The error below which a check stops: ``max(tol, floor)``, or None (never) when the floor is
    above both ``tol`` and ``FLOOR_CAP`` (rounding alone then exceeds any useful tolerance)."""
    if floor > max(tol, FLOOR_CAP):
        return None
    return max(tol, floor)


def _advice(m: Measures, tol: float, eps: float, floor: float | None, balanced: bool) -> str:
    """Why a solve did not reach ``tol``: unequal masses, the rounding floor, or too few iterations."""
    if balanced:
        ma, mb = m.masses()
        k = int((ma - mb).abs().argmax())
        gap = float((ma - mb).abs()[k])
        if gap >= max(tol, floor or 0.0):  # the L1 error is at least gap / 2 whatever the iterations
            return (
                f"the two measures have different total masses ({float(ma[k]):.6g} vs {float(mb[k]):.6g}), so "
                "no coupling has both marginals: normalise the weights to the same mass (in float32 or "
                "better), or use unbalanced= (KL marginal penalties)."
            )
    if floor is not None and stop_tol(tol, floor) is None:
        f64 = "" if m.x.dtype == torch.float64 else "float64 or "
        return (
            f"eps is below what {m.x.dtype} resolves at this cost scale: rounding alone moves the "
            f"error by ~{floor:.2g} (largest cost / eps = {m.cmax / eps:.3g}); use {f64}a larger "
            "eps (reg / blur)."
        )
    return "raise max_iter, or use a larger epsilon."


def check_potentials(m: Measures, eps: float, where: str, *pots: Tensor | None) -> None:
    """Raise ``FloatingPointError`` (naming eps and the engine) if a potential holds NaN or Inf.

    Finite inputs give finite potentials in exact arithmetic; a non-finite one means that
    ``cost / eps`` went beyond what the dtype's exp/log can represent (or an engine failed).
    One device sync.
    """
    present = [p for p in pots if p is not None]
    if not present or bool(
        m.reduce(torch.stack([~torch.isfinite(p).all() for p in present]).any().double(), "max") == 0
    ):
        return
    dtype = m.x.dtype
    f64 = "" if dtype == torch.float64 else ", float64"
    raise FloatingPointError(
        f"Sinkhorn: the potentials became NaN or Inf {where} (eps={eps:g}, engine {m.engine.name!r}, {dtype}); "
        f"the largest cost / eps is {m.cmax / eps:.3g}. Use a larger eps (reg / blur){f64} or rescale the "
        "points; a finite cost / eps makes this an engine failure (try backend='tiled')."
    )


@dataclass
class _Iterate:
    """The potentials a loop carries: the cross pair, and the debiasing ones where asked."""

    f: Tensor
    g: Tensor
    f_aa: Tensor | None = None
    g_bb: Tensor | None = None
    g_aa: Tensor | None = None  # two-sided debiasing (rho_x != rho_y) only
    f_bb: Tensor | None = None
    g_plain: Tensor | None = None  # alternating Anderson: the last plain g (returned instead of an extrapolated one)

    def all(self) -> tuple[Tensor | None, ...]:
        return self.f, self.g, self.f_aa, self.g_bb, self.g_aa, self.f_bb


@dataclass(frozen=True)
class _Setup:
    """What stays fixed during a loop: the problem, the schedule and the update rule."""

    m: Measures
    eps_list: Sequence[float]
    symmetric: bool
    debias: bool
    two_sided: bool  # debiasing with rho_x != rho_y: two potentials per self problem
    rho_x: float | None
    rho_y: float | None
    balanced: bool
    acc: Accelerator | None
    momentum: bool
    anderson: bool
    wz: Tensor | None  # Anderson's weights of (f, g) (symmetric updates) and of g (alternating ones)
    wb: Tensor | None
    # a ragged batch: the problem of each entry of f, g and (f, g) (None: the rows are the problems)
    seg: tuple[Tensor | None, Tensor | None, Tensor | None] = (None, None, None)


def _setup(
    m: Measures,
    eps_list: Sequence[float],
    symmetric: bool,
    debias: bool,
    rho_x: float | None,
    rho_y: float | None,
    acceleration,
) -> _Setup:
    a_log = m.a_log
    acc = wz = wb = None
    seg: tuple[Tensor | None, Tensor | None, Tensor | None] = (None, None, None)
    if acceleration is not None:
        n_problems = m.per_problem_sum(m.a.detach(), "x").shape[0]  # a ragged batch: its problems, not its rows
        acc = Accelerator(acceleration, n_problems, a_log.device, a_log.dtype, m.reduce_all)
        # Anderson's least squares weigh each potential by its point's weight (the error's norm)
        wb = m.b.detach().to(a_log.dtype)
        wz = torch.cat([m.a.detach().to(a_log.dtype), wb], -1)
        sx, sy = m.problem_ids("x"), m.problem_ids("y")
        seg = (sx, sy, None if sx is None or sy is None else torch.cat([sx, sy]))
    return _Setup(
        m,
        eps_list,
        symmetric,
        debias,
        debias and rho_x != rho_y,
        rho_x,
        rho_y,
        rho_x is None and rho_y is None,
        acc,
        isinstance(acceleration, Momentum),
        isinstance(acceleration, Anderson),
        wz,
        wb,
        seg,
    )


def _initialise(
    s: _Setup, eps: float, init: tuple[Tensor, Tensor] | None, init_self: tuple[Tensor, Tensor] | None
) -> _Iterate:
    """The starting potentials: ``init``, else one symmetric step from zero (symmetric updates) or zeros;
    the debiasing ones from ``init_self``, else one self step from zero."""
    m = s.m
    lx, ly = damping(eps, s.rho_x), damping(eps, s.rho_y)
    if init is not None:
        f, g = init
    elif s.symmetric:
        sx, sy = m.softmin_pair(m.h_a(None, eps), m.h_b(None, eps), eps)  # (softmin_x(log b), softmin_y(log a))
        f, g = lx * sx, ly * sy
    else:
        f, g = torch.zeros_like(m.a_log), torch.zeros_like(m.b_log)
    z = _Iterate(f, g)
    if s.debias and init_self is not None:
        z.f_aa, z.g_bb = init_self
    elif s.debias:
        z.f_aa, z.g_bb = lx * m.softmin_xx(m.h_a(None, eps), eps), ly * m.softmin_yy(m.h_b(None, eps), eps)
    if s.two_sided:
        z.g_aa, z.f_bb = ly * m.softmin_xx(m.h_a(None, eps), eps), lx * m.softmin_yy(m.h_b(None, eps), eps)
    return z


def _self_step(s: _Setup, z: _Iterate, eps: float) -> list[tuple[Tensor, Tensor, str]]:
    """The debiasing potentials' averaged step (symmetric updates).  Returns their ``(old, new, side)`` updates:
    the self problems must converge too, so their errors count in the step's (:func:`_symmetric_step`)."""
    m = s.m
    lx, ly = damping(eps, s.rho_x), damping(eps, s.rho_y)
    if s.two_sided:
        assert z.f_aa is not None and z.g_aa is not None and z.f_bb is not None and z.g_bb is not None
        ft_aa = lx * m.softmin_xx(m.h_a(z.g_aa, eps), eps)
        gt_aa = ly * m.softmin_xx(m.h_a(z.f_aa, eps), eps)
        ft_bb = lx * m.softmin_yy(m.h_b(z.g_bb, eps), eps)
        gt_bb = ly * m.softmin_yy(m.h_b(z.f_bb, eps), eps)
        updates = [(z.f_aa, ft_aa, "x"), (z.g_aa, gt_aa, "x"), (z.f_bb, ft_bb, "y"), (z.g_bb, gt_bb, "y")]
        z.f_aa, z.g_aa = 0.5 * (z.f_aa + ft_aa), 0.5 * (z.g_aa + gt_aa)
        z.f_bb, z.g_bb = 0.5 * (z.f_bb + ft_bb), 0.5 * (z.g_bb + gt_bb)
        return updates
    if s.debias:
        assert z.f_aa is not None and z.g_bb is not None
        ft_aa = lx * m.softmin_xx(m.h_a(z.f_aa, eps), eps)
        gt_bb = ly * m.softmin_yy(m.h_b(z.g_bb, eps), eps)
        updates = [(z.f_aa, ft_aa, "x"), (z.g_bb, gt_bb, "y")]
        z.f_aa, z.g_bb = 0.5 * (z.f_aa + ft_aa), 0.5 * (z.g_bb + gt_bb)
        return updates
    return []


def _flag_op(s: _Setup) -> str:
    """The reduction of the acceleration's non-finite counts: the errors' (any reduction of counts tells whether
    one is positive), so that both travel in one collective."""
    return "sum" if s.balanced else "max"


def _symmetric_step(s: _Setup, z: _Iterate, eps: float, it: int, need_err: bool) -> Tensor | None:
    """GeomLoss' update: both potentials from the previous pair, averaged with it (then accelerated).  The
    errors of the cross and self updates are reduced in one call (with Anderson's sums)."""
    m, acc = s.m, s.acc
    lx, ly = damping(eps, s.rho_x), damping(eps, s.rho_y)
    sx, sy = m.softmin_pair(m.h_a(z.f, eps), m.h_b(z.g, eps), eps)
    ft, gt = lx * sx, ly * sy
    updates = [(z.f, ft, "x"), (z.g, gt, "y"), *_self_step(s, z, eps)]
    fp, gp = 0.5 * (z.f + ft), 0.5 * (z.g + gt)
    if acc is None:
        err_t = _errors(m, s.balanced, eps, updates)[0] if need_err else None
        z.f, z.g = fp, gp
        return err_t
    if s.momentum:
        err_t = _errors(m, s.balanced, eps, updates)[0]
        w = acc.omega(err_t, eps, _left_at(s.eps_list, it))
        seg_x, seg_y, _ = s.seg
        cf, cg = z.f + acc.spread(w, seg_x) * (fp - z.f), z.g + acc.spread(w, seg_y) * (gp - z.g)
        bad = m.reduce_all([(acc.nonfinite(cf, seg_x), "max"), (acc.nonfinite(cg, seg_y), "max")])
        z.f, z.g = acc.guard(cf, fp, bad[0], seg_x), acc.guard(cg, gp, bad[1], seg_y)
        return err_t
    n = z.f.shape[-1]
    sums = acc.anderson_sums(torch.cat([z.f, z.g], -1), torch.cat([fp, gp], -1), eps, s.wz, s.seg[2])
    err_t, red = _errors(m, s.balanced, eps, updates, [(t, "sum") for t in sums])
    zz = acc.anderson_step(err_t, eps, red, s.seg[2])
    z.f, z.g = zz[..., :n], zz[..., n:]
    return err_t


def _relaxed_step(s: _Setup, z: _Iterate, eps: float, it: int) -> Tensor:
    """Momentum's alternating update: each half-step relaxed, the safeguard comparing the row errors of (f, g)
    before each relaxed step; ``g``'s error and its candidate's finiteness reduced in one call."""
    m, acc, balanced = s.m, s.acc, s.balanced
    assert acc is not None  # relaxed: Momentum, which reads the error at every step
    lx, ly = damping(eps, s.rho_x), damping(eps, s.rho_y)
    f, g = z.f, z.g
    seg_x, seg_y = s.seg[0], s.seg[1]
    fs = lx * m.softmin_x(m.h_b(g, eps), eps)
    err_x, _ = _errors(m, balanced, eps, [(f, fs, "x")])
    w = acc.omega(err_x, eps, _left_at(s.eps_list, it))
    cf = f + acc.spread(w, seg_x) * (fs - f)
    (bad_f,) = m.reduce_all([(acc.nonfinite(cf, seg_x), "max")])
    fn = acc.guard(cf, fs, bad_f, seg_x)
    gs = ly * m.softmin_y(m.h_a(fn, eps), eps)  # g's update needs the relaxed f
    cg = g + acc.spread(w, seg_y) * (gs - g)
    err_y, (bad_g,) = _errors(m, balanced, eps, [(g, gs, "y")], [(acc.nonfinite(cg, seg_y), _flag_op(s))])
    z.f, z.g = fn, acc.guard(cg, gs, bad_g, seg_y)
    return torch.maximum(err_x, err_y)


def _alternating_step(s: _Setup, z: _Iterate, eps: float, it: int, need_err: bool) -> Tensor | None:
    """POT's update: ``f`` from ``g``, then ``g`` from the new ``f`` (each half-step relaxed under
    Momentum, :func:`_relaxed_step`; ``g`` extrapolated under Anderson, the plain one kept in ``z.g_plain``)."""
    if s.momentum and it > 1:  # at it == 1 the initial f is not a potential yet: plain step
        return _relaxed_step(s, z, eps, it)
    m, acc, balanced = s.m, s.acc, s.balanced
    lx, ly = damping(eps, s.rho_x), damping(eps, s.rho_y)
    f, g = z.f, z.g
    sx, sy = m.softmin_alt(m.h_a(None, eps), m.h_b(g, eps), eps, lam=lx)  # both half-steps in one pass where it can
    fs, gs = lx * sx, ly * sy
    if s.anderson:
        assert acc is not None
        # f = S_x(g) with the extrapolated g, so (f, g) has exact rows and the g-side error is its whole error
        # (f's would compare the previous f with an extrapolated g)
        sums = acc.anderson_sums(g, gs, eps, s.wb, s.seg[1])
        err_t, red = _errors(m, balanced, eps, [(g, gs, "y")], [(t, "sum") for t in sums])
        z.f, z.g = fs, acc.anderson_step(err_t, eps, red, s.seg[1])
        z.g_plain = gs  # returned instead of the extrapolated g: (fs, gs) is a plain, consistent pair
        return err_t
    z.f, z.g = fs, gs
    if not need_err:
        return None
    # at it == 1 the initial f (zeros) is not a potential: the g-side error only
    return _errors(m, balanced, eps, [(g, gs, "y")] if it == 1 else [(f, fs, "x"), (g, gs, "y")])[0]


def _read_error(
    s: _Setup, z: _Iterate, err_t: Tensor, eps: float, it: int, tol: float | None
) -> tuple[float, float | None]:
    """The error on the host (one sync), with the rounding floor when a ``tol`` is to be met; non-finite
    potentials raise here."""
    if tol is None:
        err, floor = float(err_t.max()), None
    else:  # one sync for both
        err, floor = torch.stack([err_t.max(), rounding_floor(s.m, z.f, z.g, eps)]).tolist()
    if not math.isfinite(err):  # an overflowing error, or non-finite potentials?
        check_potentials(s.m, eps, f"at iteration {it}", *z.all())
    return err, floor


def sinkhorn_loop(
    m: Measures,
    eps_list: Sequence[float],
    *,
    symmetric: bool = True,
    debias: bool = False,
    rho_x: float | None = None,
    rho_y: float | None = None,
    tol: float | None = None,
    init: tuple[Tensor, Tensor] | None = None,
    init_self: tuple[Tensor, Tensor] | None = None,
    callback: Callable[[IterationRecord], bool | None] | None = None,
    warn: bool = True,
    inner_iterations: int = 10,
    acceleration: Momentum | Anderson | None = None,
    verbose: bool = False,
) -> SinkhornState:
    """Run Sinkhorn iterations, one per entry of ``eps_list``.

    Error: the L1 marginal violation of the current plan for balanced problems, the
    sup-norm change of the potentials divided by eps otherwise; both are read off the
    update (no extra pass over the data).  It is brought to the host (one sync) only every
    ``inner_iterations`` steps and at the last one; the loop stops early there when
    ``tol`` is given and the error is below ``max(tol, rounding floor)`` (:func:`stop_tol`;
    never where the floor exceeds ``max(tol, FLOOR_CAP)``).  ``init = (f, g)`` warm-starts the cross
    potentials and ``init_self = (f_aa, g_bb)`` the debiasing ones (``rho_x == rho_y``).
    ``callback(record)`` runs after every iteration (``record.error`` is None between checks); returning
    ``True`` stops the solve (``stopped=True``, no warning).
    ``acceleration``: None, :class:`~flashot.acceleration.Momentum` or
    :class:`~flashot.acceleration.Anderson` (cross potentials only; the adaptive Momentum is told the steps
    left at the current eps, :func:`_left_at`, to start a relaxed phase only where it can pay off).
    ``verbose`` shows a progress bar updated at the checks.  Runs without autograd.

    The steps: :func:`_initialise`, then per temperature :func:`_symmetric_step` (with :func:`_self_step`
    for the debiasing potentials) or :func:`_alternating_step`, and every ``inner_iterations`` steps
    :func:`_read_error` and the stopping test.
    """
    inner = check_int("inner_iterations", inner_iterations)
    s = _setup(m, eps_list, symmetric, debias, rho_x, rho_y, check_acceleration(acceleration))
    n_total = len(eps_list)
    eps_final = eps_list[n_total - 1] if n_total else None
    progress = make_progress(verbose, n_total)
    want_err = tol is not None or callback is not None or progress.active
    step = _symmetric_step if symmetric else _alternating_step
    t0 = time.perf_counter()
    err_t: Tensor | None = None
    err: float | None = None
    floor: float | None = None  # rounding floor of the error at the last check (when tol is given)
    converged = stopped = False
    it = 0
    if n_total > 1:
        m.expect_reuse()  # e.g. the cpu engine builds its cached cost matrix on the first call
    eps = eps_list[0] if n_total else float("nan")  # bound before the try: its finally reports it
    try:
        with torch.no_grad():
            z = _initialise(s, eps, init, init_self)
            for it, eps in enumerate(eps_list, start=1):
                # read the error every `inner` steps, at the end, and at the end of each eps level
                check = it % inner == 0 or it == n_total or eps_list[it] != eps
                err_t = step(s, z, eps, it, s.acc is not None or (want_err and check))
                err = None
                if check and want_err:
                    assert err_t is not None  # a step computes its error where want_err and check
                    err, floor = _read_error(s, z, err_t, eps, it, tol)
                    progress.update(it, eps, err)
                if callback is not None and callback(IterationRecord(it, eps, err, time.perf_counter() - t0)) is True:
                    stopped = True
                if tol is not None and err is not None and eps == eps_final:  # not during eps-scaling
                    assert floor is not None  # _read_error returns it where tol is given
                    stop_at = stop_tol(tol, floor)
                    if stop_at is not None and err < stop_at:
                        converged = True
                        break
                if stopped:
                    break
        if err_t is not None and err is None:
            err = float(err_t.max())
        if s.anderson and not symmetric and n_total > 0:
            assert z.g_plain is not None  # set by every alternating Anderson step
            z.g = z.g_plain  # an extrapolated g paired with f = S_x(previous g) can carry any mass
        check_potentials(m, eps, f"after {it} iterations", *z.all())
    finally:
        status = "converged" if converged else ("stopped by callback" if stopped else "")
        progress.close(it, eps, err, status)
    if tol is not None and not converged and not stopped and warn:
        warnings.warn(
            f"Sinkhorn did not reach tol={tol:g} in {it} iterations (error {err:.3g}); "
            + _advice(m, tol, eps, floor, s.balanced),
            RuntimeWarning,
            stacklevel=3,
        )
    return SinkhornState(z.f, z.g, z.f_aa, z.g_bb, eps, it, err, converged, stopped, z.g_aa, z.f_bb)


def final_step(
    m: Measures,
    st: SinkhornState,
    *,
    rho_x: float | None = None,
    rho_y: float | None = None,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """One last (parallel) update with autograd on: the envelope-theorem gradients.

    The previous potentials are constants; each new potential is differentiable
    w.r.t. its own side's points only (as in GeomLoss), so
    ``<a, f> + <b, g>`` has the gradient ``sum_j P_ij grad_x C(x_i, y_j)`` in x and
    the potentials as gradients in the weights, without backprop through iterations.
    """
    eps = st.eps
    lx, ly = damping(eps, rho_x), damping(eps, rho_y)
    f, g = m.softmin_grad_pair(m.h_b(st.g, eps), m.h_a(st.f, eps), eps)
    f, g = lx * f, ly * g
    f_aa = g_bb = None
    if st.f_aa is not None:
        f_aa = lx * m.softmin_grad("xx", m.h_a(st.f_aa, eps), eps)
        g_bb = ly * m.softmin_grad("yy", m.h_b(st.g_bb, eps), eps)
    check_potentials(
        m, eps, "in the final step", f.detach(), g.detach(), *(t if t is None else t.detach() for t in (f_aa, g_bb))
    )
    return f, g, f_aa, g_bb


@dataclass(frozen=True)
class Barycentres:
    """Soft-argmin barycentres of the final step's softmins, ``b_i = sum_j w_ij z_j`` (B, N, D) with each
    softmin's row-normalised weights ``w`` (None: not computed): ``xy`` for ``f`` (``z = y``), ``yx`` for
    ``g``, ``xx`` for ``f_aa``, ``yy`` for ``g_bb``.  With them the envelope gradient of a dot-product cost
    ``s |x - y|^2`` is ``2 s a_i (x_i - b_i)``: no plan-product pass (:class:`~flashot.values.OTValueFn`)."""

    xy: Tensor | None = None
    yx: Tensor | None = None
    xx: Tensor | None = None
    yy: Tensor | None = None


def final_values(
    m: Measures, st: SinkhornState
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, Barycentres | None]:
    """The balanced final step's values for :func:`flashot.values.sinkhorn_value` (which uses their values
    only) and, where the engine computes them in the same pass (the block-sparse engine's fused steps:
    ``softmin_pair_bary`` / ``softmin_sym_bary``) and a gradient w.r.t. the points is wanted, the
    :class:`Barycentres` of the sides that need them.  Otherwise :func:`final_step`'s values and None."""
    need_x, need_y = (torch.is_grad_enabled() and t.requires_grad for t in (m.x, m.y))
    pair = m.engine.supports(Capability.SOFTMIN_PAIR_BARY)
    eps = st.eps
    hy, hx = m.h_b(st.g, eps), m.h_a(st.f, eps)
    if not (need_x or need_y) or not pair or hx.dtype != m.x.dtype or hy.dtype != m.x.dtype:
        return (*final_step(m, st), None)
    x, y = m.x.detach(), m.y.detach()
    with torch.no_grad():
        res = m.engine.softmin_pair_bary(x, y, hx, hy, eps, m.cost, cols=need_y)
        if res is None:
            return (*final_step(m, st), None)
        f, g, bx, by = res
        f_aa = g_bb = bxx = byy = None
        if st.f_aa is not None:
            f_aa, bxx = _self_values(m, "xx", m.h_a(st.f_aa, eps), eps, need_x)
            g_bb, byy = _self_values(m, "yy", m.h_b(st.g_bb, eps), eps, need_y)
    check_potentials(m, eps, "in the final step", f, g, f_aa, g_bb)
    return f, g, f_aa, g_bb, Barycentres(bx if need_x else None, by, bxx, byy)


def _self_values(m: Measures, side: str, h: Tensor, eps: float, need: bool) -> tuple[Tensor, Tensor | None]:
    """``softmin(x, x, h)`` (``side`` "xx" or "yy") and, when ``need``-ed and the engine gives them, its
    barycentres (else None)."""
    pts = (m.x if side == "xx" else m.y).detach()
    if need and m.engine.supports(Capability.SOFTMIN_SYM_BARY) and h.dtype == pts.dtype:
        res = m.engine.softmin_sym_bary(pts, h, eps, m.cost)
        if res is not None:
            return res
    return (m.softmin_xx(h, eps) if side == "xx" else m.softmin_yy(h, eps)), None


def balanced_value(a: Tensor, b: Tensor, f: Tensor, g: Tensor) -> Tensor:
    """``<a, f> + <b, g>``, (B,)."""
    return (a * f).sum(-1) + (b * g).sum(-1)
