r"""Optional accelerations of the Sinkhorn loop (log-domain, safeguarded).

Two small frozen configs, passed as ``acceleration=`` to :func:`flashot.solve_sample`
(or to :func:`flashot.solver.sinkhorn_loop`):

* :class:`Momentum` ``(omega)``: over-relaxation of the potentials.  For the
  alternating (POT) updates it relaxes each half-step,
  ``f <- f + omega (S_x(g) - f)``, then ``g <- g + omega (S_y(f) - g)``
  (the log-domain form of over-relaxed Sinkhorn, ``u <- u^(1-omega) (a / K v)^omega``);
  for the symmetric (GeomLoss) updates it relaxes the averaged step.
  ``omega = 1`` is plain Sinkhorn; ``1 < omega < 2`` accelerates.  ``omega=None`` (default):
  Young's SOR factor estimated from the measured rate of plain steps (see the class).
* :class:`Anderson` ``(m)``: Anderson (type II) extrapolation over the last ``m``
  iterates of the fixed-point map (``g -> S_y(S_x(g))`` for alternating updates,
  ``(f, g) -> averaged step`` for symmetric ones), solved per problem of the batch
  with a small regularised least-squares system whose residuals are weighted by the
  points' weights (the norm of the marginal error: a point of weight 1e-28 whose
  potential still moves would otherwise steer the extrapolation; unweighted, a 1-D
  Gaussian grid at reg = 1.1e-5 cmax stalled at a 25x larger error than plain Sinkhorn).

Both act on potentials (logs of the scalings): they never leave the log domain.
Safeguard: an accelerated candidate with non-finite entries is replaced by the plain
step; when the error (marginal violation, or potential change / eps for unbalanced
problems) measured after an accelerated step exceeds ``safeguard`` times the smallest
error seen so far (Anderson: 1, i.e. any increase; Momentum: 5, since over-relaxed
Sinkhorn oscillates; adaptive Momentum: at least the transient peak its omega implies), the
next step is the plain one; Anderson also restarts its history for that problem, a fixed
Momentum halves ``omega - 1`` for it, the adaptive one estimates omega again.  A bad
extrapolation thus costs one iteration and never derails the solve.  A fixed Momentum also
halves ``omega - 1`` for a problem whose error has not reached a new minimum in 10 steps (an
omega that keeps the error oscillating below the overshoot test but never improving it).  All of this runs on
the device, per problem of the batch, without host synchronisation.  The history is
cleared whenever epsilon changes (epsilon-scaling).

Alternating updates with Anderson: the iterate is ``g`` alone (``f = S_x(g)`` follows),
and the map ``g -> S_y(S_x(g))`` commutes with adding a constant to ``g``, so the
extrapolation also moves ``g`` along constants (measured: 5-25 eps per step at
``reg=1e-3`` on unit Gaussians).  That changes nothing in the iterate, but the pair made of
the previous plain ``f`` and the extrapolated ``g`` then has a plan of mass up to 1e20, so
its row error is meaningless.  The error that measures the iterate, and that the safeguard
must be given, is the column error of the plan ``(S_x(g), g)`` (the loop's ``err_y``), and
the pair to return is the last plain half-step ``(S_x(g), S_y(S_x(g)))``, not the
extrapolated ``g`` with a stale ``f``.

Measured gains: ``benchmarks/ACCELERATION.md`` (``benchmarks/acceleration.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Momentum", "Anderson", "check_acceleration"]

# Momentum: omega - 1 is halved for a problem whose error has not reached a new minimum in
# this many steps.  The reason: a fixed omega too large for the problem can keep the error
# oscillating below the overshoot test without improving it (Momentum(1.5) on 120 x 90 Gaussians
# at eps = 1e-3 sat at ~5x its best error); the stall test catches that, and costs nothing where
# the error keeps decreasing (benchmarks/acceleration.py, benchmarks/ACCELERATION.md).
STALL = 10
# Adaptive Momentum (omega=None): steps per rate estimate, and the largest factor used (Young's omega for
# a plain rate of 0.99934; closer to 2 the relaxed iteration's own rate, omega - 1, approaches 1).
WINDOW = 10
OMEGA_MAX = 1.95
# Two successive plain windows "agree" when their rates differ by at most CONSISTENT (1 - mu): the error
# then decays geometrically, as in the linear regime where Young's formula holds.
CONSISTENT = 0.1
# Over-relaxation at Young's omega for a plain rate rho is worse than plain iterations for its first
# ~HORIZON / sqrt(1 - rho) = HORIZON omega / (2 - omega) steps, with a peak of ~PEAK omega / (2 - omega)
# times the plain error (the linearised two-block model, rho = 0.9 .. 0.9997: last step worse 3 .. 169,
# peak 1.7 .. 22, i.e. ~0.4 omega / (2 - omega)): a relaxed phase starts only with that many steps left,
# and the overshoot safeguard allows twice that peak (at least ``safeguard``).
HORIZON = 3.0
PEAK = 0.8


def _check_safeguard(cls: str, v: object) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 1.0 <= float(v) < float("inf"):
        raise ValueError(f"{cls}.safeguard: expected a finite number >= 1, got {v!r}")


@dataclass(frozen=True)
class Momentum:
    """Over-relaxation of the potentials (1 = plain Sinkhorn).

    The update, in the log domain, with ``S_x(g)_i = -eps log sum_j b_j exp((g_j - C(x_i, y_j)) / eps)``
    (the softmin; ``eps = reg``) and ``S_y`` the same with the sides swapped: alternating updates
    relax each half-step, ``f <- f + omega (S_x(g) - f)``, then ``g <- g + omega (S_y(f) - g)``
    (over-relaxed Sinkhorn, ``u <- u^(1 - omega) (a / K v)^omega``); symmetric updates relax the
    averaged step the same way.

    ``omega=None`` (default): adaptive.  Alternating Sinkhorn is a nonlinear Gauss-Seidel iteration and
    the relaxed one its SOR; near the solution Young's SOR theory gives the best factor from the plain
    iteration's contraction rate ``rho`` (per step)::

        omega = 2 / (1 + sqrt(1 - rho))    (then the rate is omega - 1 < rho),

    and under a factor ``omega`` the observed rate ``mu`` gives ``rho = (mu + omega - 1)^2 / (omega^2 mu)``
    back (Young's relation).  So at each epsilon the steps start plain, ``mu`` is measured as the error's
    geometric decay over windows of ``WINDOW`` steps (per problem of the batch), and omega is set once two
    successive plain windows agree on the rate (within ``CONSISTENT (1 - mu)``: the linear regime), then
    re-estimated after each window.  A window whose error did not decrease, or an overshoot, sends that
    problem back to plain steps and a new estimate.  Reason: a fixed omega helps one problem and slows
    another (1.5 gave 1.48x plain's error after 100 iterations on a 1-D problem at reg = 1e-4 cmax);
    the estimated one adapts to each.  Over-relaxation also has a transient: in the linearised model it
    is worse than plain steps for its first ``~HORIZON omega / (2 - omega)`` steps (peak
    ``~0.4 omega / (2 - omega)`` times the plain error), so a relaxed phase starts only with that many
    steps left at this epsilon (``max_iter`` known to the loop; the same for each later increase of omega)
    and the overshoot test allows twice that peak (``PEAK omega / (2 - omega)``).  Far from the solution
    the transient can last longer than the model says (a 2-D problem at reg = 1e-4 cmax: 2x plain's
    error after 100 and 150 iterations, 0.04x after 300; ``benchmarks/accel_small_eps.py``).
    With epsilon-scaling (3 steps per temperature) the over-relaxation thus only runs at the final
    epsilon.  A number: that fixed factor in (0, 2) from the first step, with ``omega - 1`` halved for a
    problem whose error has not reached a new minimum in ``STALL`` steps.

    ``safeguard`` (>= 1): an over-relaxed step after which the error exceeds ``safeguard``
    times the smallest error seen so far (adaptive: at least the transient peak above) is followed by a
    plain step (adaptive: then a new estimate; fixed: ``omega - 1`` is halved).  Over-relaxed Sinkhorn is
    not monotone in the marginal error, so the default (5) tolerates its oscillations and only stops
    divergence.

    Example:
        >>> import torch, flashot
        >>> _ = torch.manual_seed(0)
        >>> x, y = torch.randn(30, 2, dtype=torch.float64), torch.randn(40, 2, dtype=torch.float64)
        >>> plain = flashot.solve_sample(x, y, reg=0.1)
        >>> fast = flashot.solve_sample(x, y, reg=0.1, acceleration=flashot.Momentum())
        >>> fast.converged, bool(torch.allclose(fast.value, plain.value))
        (True, True)
    """

    omega: float | None = None
    safeguard: float = 5.0

    def __post_init__(self) -> None:
        _check_safeguard("Momentum", self.safeguard)
        w = self.omega
        if w is None:
            return
        if isinstance(w, bool) or not isinstance(w, (int, float)):
            raise TypeError(f"Momentum.omega: expected a number in (0, 2) or None (adaptive), got {type(w).__name__}")
        if not 0.0 < float(w) < 2.0:
            raise ValueError(f"Momentum.omega: expected a number in (0, 2) or None (adaptive), got {w!r}")


@dataclass(frozen=True)
class Anderson:
    """Anderson acceleration with memory ``m`` >= 1 and Tikhonov regularisation ``reg`` >= 0
    (relative to the scale of the residual Gram matrix).

    ``safeguard`` (>= 1): when the error after an extrapolated step exceeds ``safeguard``
    times the smallest error seen so far, the history is cleared and a plain step is taken
    (default 1: any increase).

    The update: with the fixed-point map ``T`` (``g -> S_y(S_x(g))`` for alternating updates,
    ``(f, g) -> averaged step`` for symmetric ones; ``S_x``, ``S_y`` the softmins at ``eps = reg``,
    see :class:`Momentum`), the last ``m + 1`` iterates ``z_i``, their residuals
    ``r_i = T(z_i) - z_i`` and the differences ``dR_i = r_{i+1} - r_i``, ``dT_i = T(z_{i+1}) - T(z_i)``
    (columns of ``dR``, ``dT``)::

        gamma   = argmin_gamma |r_k - dR gamma|^2 + lam |gamma|^2,   lam = reg trace(dR^T dR)
        z_{k+1} = T(z_k) - dT gamma

    (Anderson type II), per problem of the batch.

    Example:
        >>> import torch, flashot
        >>> _ = torch.manual_seed(0)
        >>> x, y = torch.randn(30, 2, dtype=torch.float64), torch.randn(40, 2, dtype=torch.float64)
        >>> plain = flashot.solve_sample(x, y, reg=0.1)
        >>> fast = flashot.solve_sample(x, y, reg=0.1, acceleration=flashot.Anderson(m=5))
        >>> fast.converged, bool(torch.allclose(fast.value, plain.value))
        (True, True)
    """

    m: int = 5
    reg: float = 1e-10
    safeguard: float = 1.0

    def __post_init__(self) -> None:
        _check_safeguard("Anderson", self.safeguard)
        if isinstance(self.m, bool) or not isinstance(self.m, int):
            raise TypeError(f"Anderson.m: expected an integer >= 1, got {type(self.m).__name__}")
        if self.m < 1:
            raise ValueError(f"Anderson.m: expected an integer >= 1, got {self.m}")
        r = self.reg
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not (float(r) >= 0.0) or r == float("inf"):
            raise ValueError(f"Anderson.reg: expected a finite number >= 0, got {r!r}")


def check_acceleration(acc: object, allow_auto: bool = False) -> Momentum | Anderson | str | None:
    """Validate the ``acceleration`` argument (None, Momentum or Anderson; ``"auto"`` where the front end
    chooses, see :func:`flashot.solve_sample`)."""
    if acc is None or isinstance(acc, (Momentum, Anderson)) or (allow_auto and acc == "auto"):
        return acc
    if isinstance(acc, str):
        auto = "'auto', " if allow_auto else ""
        raise TypeError(
            f"acceleration: expected {auto}None, flashot.Momentum(omega=...) or flashot.Anderson(m=...), "
            f"got the string {acc!r}"
        )
    raise TypeError(
        f"acceleration: expected None, flashot.Momentum(omega=...) or flashot.Anderson(m=...), got {type(acc).__name__}"
    )


def _finite_rows(t: Tensor) -> Tensor:
    """(B,) mask: rows of a (B, n) tensor without NaN / Inf."""
    return torch.isfinite(t).all(-1)


def _local(items: Sequence[tuple[Tensor, str]]) -> list[Tensor]:
    """The identity: the potentials are all on this process."""
    return [t for t, _ in items]


class Accelerator:
    """Per-solve state of an acceleration (internal).

    ``omega(err)`` returns the (B, 1) relaxation factors for this step (Momentum);
    ``extrapolate(z, tz, err, eps)`` returns the next iterate given the current one ``z``
    and its plain image ``tz`` (Anderson; Momentum returns ``tz``).  ``err`` is the (B,)
    error of the current iterate, used by the safeguard (no host sync).

    ``reduce_all([(t, op), ...])`` (``op`` ``"sum"`` / ``"max"``) completes over all processes what this one
    computed over its entries of the potentials (points-sharded mode,
    :meth:`flashot.measures.Measures.reduce_all`): Anderson's Gram matrix ``dR^T dR`` and right-hand side
    ``dR^T r`` are sums over all the potentials, and a candidate is finite only if it is finite everywhere,
    so every process takes the same steps.  Each reduction is split out (:meth:`nonfinite` / :meth:`guard`,
    :meth:`anderson_sums` / :meth:`anderson_step`) so that the loop can reduce it together with the step's
    error: one collective per step instead of one per quantity.

    ``batch`` is the number of problems.  Where the iterates' rows are the problems (a (B, n) batch) the
    methods take ``seg=None``; a ragged batch (:mod:`flashot.ragged`) is ONE (1, n) row holding every
    problem's potentials end to end, and ``seg`` (n,) gives the problem of each entry: the errors, the
    safeguards and the factors stay (B,) per problem, Anderson's Gram matrices and right-hand sides are
    segment sums (one small system per problem), and :meth:`spread` gives each entry its problem's
    factor.  Each problem thus takes the steps it would take alone (up to the order of the sums).
    """

    def __init__(
        self,
        cfg: Momentum | Anderson,
        batch: int,
        device: torch.device | str,
        dtype: torch.dtype,
        reduce_all: Callable[[Sequence[tuple[Tensor, str]]], list[Tensor]] = _local,
    ):
        self.cfg = cfg
        self._reduce_all = reduce_all
        self.ref: Tensor | None = None  # smallest error seen since the last change of eps
        self.prev_acc = torch.zeros(batch, dtype=torch.bool, device=device)  # was the last step accelerated?
        self.eps: float | None = None
        self.n_rejected = torch.zeros((), dtype=torch.long, device=device)
        # (B,) steps since each problem's error last reached a new minimum (Momentum's stall test)
        self.since_best = torch.zeros(batch, dtype=torch.long, device=device)
        if isinstance(cfg, Momentum):
            w0 = 1.0 if cfg.omega is None else float(cfg.omega)
            self.w = torch.full((batch, 1), w0, dtype=dtype, device=device)
            self.win_err = torch.full((batch,), float("inf"), dtype=dtype, device=device)  # error at window start
            self.win_n = torch.zeros(batch, dtype=torch.long, device=device)  # steps in the window
        self.X: list[Tensor] = []  # Anderson history: iterates
        self.T: list[Tensor] = []  # and their images
        self.count = 0  # iterates appended so far (global index of the next one)
        self.start: Tensor | None = None  # (B,) first global index of each problem's valid history
        self._work: tuple | None = None  # Anderson: what anderson_sums leaves for anderson_step

    # -- safeguard ----------------------------------------------------------------
    def _at_eps(self, eps: float) -> None:
        """A new eps clears the history and the safeguard's reference."""
        if self.eps is not None and eps != self.eps:
            self.X.clear()
            self.T.clear()
            self.ref = None
            self.start = None
        self.eps = eps

    def _accept(self, err: Tensor, eps: float, factor: Tensor | float | None = None) -> tuple[Tensor, Tensor]:
        """(B,) masks ``(ok, worse)``: may this step be accelerated, and did the last
        accelerated step overshoot?  Updates the safeguard state (no host sync)."""
        self._at_eps(eps)
        finite = torch.isfinite(err)
        if self.ref is None:
            worse = torch.zeros_like(finite)
            self.ref = torch.where(finite, err, torch.full_like(err, float("inf")))
            self.since_best = torch.zeros_like(self.since_best)
        else:
            factor = self.cfg.safeguard if factor is None else factor
            worse = self.prev_acc & ~(err <= factor * self.ref)
            best = finite & (err < self.ref)
            self.since_best = torch.where(best, torch.zeros_like(self.since_best), self.since_best + 1)
            self.ref = torch.where(finite, torch.minimum(self.ref, err), self.ref)
        self.n_rejected += worse.sum()
        return finite & ~worse, worse

    def omega(self, err: Tensor, eps: float, remaining: int | None = None) -> Tensor:
        """(B, 1) factors for this step; ``remaining``: steps left at this eps (None: unknown, unlimited)."""
        assert isinstance(self.cfg, Momentum)
        if self.cfg.omega is None:
            fresh = self.ref is None or eps != self.eps  # first step at this eps
            w = self.w[:, 0]  # the overshoot test allows the linear model's transient peak
            ok, worse = self._accept(err, eps, (PEAK * w / (2.0 - w)).clamp_min(self.cfg.safeguard))
            return self._adaptive_omega(err, ok, worse, fresh, math.inf if remaining is None else remaining)
        ok, worse = self._accept(err, eps)
        # shrink the over-relaxation of the problems that overshot, or that stalled: no new
        # smallest error in STALL steps (then count again from 0)
        stalled = self.since_best >= STALL
        self.since_best = torch.where(stalled, torch.zeros_like(self.since_best), self.since_best)
        shrink = (worse | stalled).unsqueeze(-1)
        self.w = torch.where(shrink, 1.0 + 0.5 * (self.w - 1.0), self.w)
        w = torch.where(ok.unsqueeze(-1), self.w, torch.ones_like(self.w))
        self.prev_acc = ok & (self.w[:, 0] != 1.0)
        return w

    def _adaptive_omega(self, err: Tensor, ok: Tensor, worse: Tensor, fresh: bool, remaining: float) -> Tensor:
        """Momentum(omega=None): Young's factor from the rate measured over each window of WINDOW steps
        (see :class:`Momentum`); plain steps while no estimate is available.  (B, 1), no host sync."""
        w = self.w[:, 0]
        finite = torch.isfinite(err)
        if fresh:  # a new temperature: plain steps, a new estimate
            w = torch.ones_like(w)
            restart = torch.ones_like(finite)
            self.settle = torch.ones_like(finite)
            self.prev_mu = torch.full_like(err, float("nan"))
        else:
            self.win_n = self.win_n + 1
            full = self.win_n >= WINDOW
            measured = full & ~self.settle  # omega was constant over the whole previous window too
            mu = (err / self.win_err).clamp_min(0.0) ** (1.0 / WINDOW)  # observed rate per step
            decreased = mu < 1.0  # False for NaN
            # Young's relation inverted; mu <= omega - 1: at or past the optimum (rate omega - 1): keep omega
            tiny = torch.finfo(mu.dtype).tiny
            rho = torch.where(w == 1.0, mu, (mu + w - 1.0) ** 2 / (w * w * mu.clamp_min(tiny)))
            new_w = (2.0 / (1.0 + torch.sqrt((1.0 - rho).clamp_min(0.0)))).clamp(1.0, OMEGA_MAX)
            w_old = w
            # leave plain steps only once two successive windows agree on the rate (the linear regime)
            steady = (w != 1.0) | ((mu - self.prev_mu).abs() <= CONSISTENT * (1.0 - mu))
            # and raise omega only with enough steps left for the new transient to pay off
            steady = steady & ((new_w <= w) | (HORIZON * new_w / (2.0 - new_w) <= remaining))
            w = torch.where(measured & decreased & (mu > w - 1.0) & steady, new_w, w)
            self.prev_mu = torch.where(
                measured, torch.where(w_old == 1.0, mu, torch.full_like(mu, float("nan"))), self.prev_mu
            )
            back = worse | ~finite | (measured & ~decreased)  # overshoot, or no decrease over a window
            w = torch.where(back, torch.ones_like(w), w)
            restart = back | full
            self.settle = torch.where(restart, w != w_old, self.settle)
        self.win_err = torch.where(restart, torch.where(finite, err, torch.full_like(err, float("inf"))), self.win_err)
        self.win_n = torch.where(restart, torch.zeros_like(self.win_n), self.win_n)
        self.w = w.unsqueeze(-1)
        self.prev_acc = ok & (w != 1.0)
        return torch.where(ok.unsqueeze(-1), self.w, torch.ones_like(self.w))

    @staticmethod
    def spread(t: Tensor, seg: Tensor | None) -> Tensor:
        """Per-problem values ``t`` (B,) or (B, 1) on the iterate's entries: (B, 1) (``seg`` None), else (1, n)
        with each entry's problem's value."""
        if seg is None:
            return t if t.dim() == 2 else t.unsqueeze(-1)
        return t.reshape(-1)[seg].unsqueeze(0)

    def nonfinite(self, t: Tensor, seg: Tensor | None = None) -> Tensor:
        """(B,) per problem, this process's count of NaN / Inf entries of ``t`` (in ``t``'s dtype); reduced over the
        processes (sum or max), 0 means finite everywhere (:meth:`guard`)."""
        if seg is None:
            return (~_finite_rows(t)).to(t.dtype)
        per = (~torch.isfinite(t[0])).to(t.dtype)
        return torch.zeros(self.prev_acc.shape[0], dtype=t.dtype, device=t.device).index_add_(0, seg, per)

    def guard(self, cand: Tensor, plain: Tensor, bad: Tensor, seg: Tensor | None = None) -> Tensor:
        """``cand`` for the problems whose reduced :meth:`nonfinite` count ``bad`` is 0, the plain step elsewhere."""
        return torch.where(self.spread(bad == 0, seg), cand, plain)

    def momentum_guard(self, cand: Tensor, plain: Tensor, seg: Tensor | None = None) -> Tensor:
        """Replace the problems of an over-relaxed candidate that hold NaN / Inf by the plain step."""
        (bad,) = self._reduce_all([(self.nonfinite(cand, seg), "max")])
        return self.guard(cand, plain, bad, seg)

    def _gram(self, A: Tensor, C: Tensor, seg: Tensor | None) -> Tensor:
        """``A^T C`` per problem, (B, p, q), for (B, n, p) and (B, n, q) (ragged: sums over each problem's
        entries of the one (1, n) row, one segment sum per column of ``C``)."""
        if seg is None:
            return A.transpose(-1, -2) @ C
        P = self.prev_acc.shape[0]
        cols = [
            torch.zeros(P, A.shape[-1], dtype=A.dtype, device=A.device).index_add_(0, seg, A[0] * C[0, :, j, None])
            for j in range(C.shape[-1])
        ]
        return torch.stack(cols, -1)

    def extrapolate(
        self, z: Tensor, tz: Tensor, err: Tensor, eps: float, weights: Tensor | None = None, seg: Tensor | None = None
    ) -> Tensor:
        """Anderson's next iterate from the current one ``z`` and its plain image ``tz`` (see :class:`Anderson`),
        each problem's history masked from its last restart; ``seg``: see the class.  :meth:`anderson_sums`, their
        reduction, :meth:`anderson_step`."""
        sums = self.anderson_sums(z, tz, eps, weights, seg)
        return self.anderson_step(err, eps, self._reduce_all([(t, "sum") for t in sums]), seg)

    def anderson_sums(
        self, z: Tensor, tz: Tensor, eps: float, weights: Tensor | None = None, seg: Tensor | None = None
    ) -> list[Tensor]:
        """Anderson's first half: push ``(z, tz)`` to the history and return this process's ``[dR^T dR, dR^T r]``
        over every column of the history (``[]`` with one iterate), for the caller to reduce (sums) and pass to
        :meth:`anderson_step`.  Unmasked: the columns before a problem's last restart, which depends on this
        step's error, are zeroed in :meth:`anderson_step`, so that the loop can reduce these sums together with
        that error (one collective)."""
        assert isinstance(self.cfg, Anderson)
        self._at_eps(eps)
        fresh = self.start is None or not self.X
        self.X.append(z)
        self.T.append(tz)
        self.count += 1
        if len(self.X) > self.cfg.m + 1:
            self.X.pop(0)
            self.T.pop(0)
        k = len(self.X)
        if k < 2:
            self._work = (fresh, tz, None, None)
            return []
        X = torch.stack(self.X, -1)  # (B, n, k)
        T = torch.stack(self.T, -1)
        R = T - X  # residuals of the fixed-point map
        dR = R[..., 1:] - R[..., :-1]
        r = R[..., -1:]
        if weights is not None:  # least squares in the norm the error uses: each potential by its weight
            sw = weights.sqrt().unsqueeze(-1)
            dR, r = dR * sw, r * sw
        self._work = (fresh, tz, T, k)
        return [self._gram(dR, dR, seg), self._gram(dR, r, seg)]

    def anderson_step(self, err: Tensor, eps: float, sums: Sequence[Tensor], seg: Tensor | None = None) -> Tensor:
        """Anderson's second half: the safeguard on ``err`` (the error of the iterate pushed by
        :meth:`anderson_sums`), and the next iterate from ``sums`` (its sums, reduced over the processes)."""
        assert isinstance(self.cfg, Anderson) and self._work is not None
        fresh, tz, T, k = self._work
        self._work = None
        ok, worse = self._accept(err, eps)
        idx = self.count - 1  # the global index of the iterate pushed
        if fresh:
            self.start = torch.full_like(err, idx, dtype=torch.long)
        assert self.start is not None
        # problems that overshot (or whose error is not finite) restart their history here,
        # per problem and without a host sync: older columns are masked out below
        self.start = torch.where(ok, self.start, torch.full_like(self.start, idx))
        if T is None:
            self.prev_acc = torch.zeros_like(ok)
            return tz
        # column i of the differences pairs the entries with global indices (j - 1, j)
        first = torch.arange(idx - k + 1, idx, device=tz.device)  # (k-1,) index j - 1
        valid = (first.unsqueeze(0) >= self.start.unsqueeze(-1)).to(tz.dtype)  # (B, k-1)
        vmask = valid.unsqueeze(1) if seg is None else valid[seg].unsqueeze(0)  # on the entries
        dT = (T[..., 1:] - T[..., :-1]) * vmask
        G = sums[0] * (valid.unsqueeze(-1) * valid.unsqueeze(-2))  # (B, k-1, k-1): over all the potentials
        rhs = sums[1] * valid.unsqueeze(-1)
        scale = G.diagonal(dim1=-2, dim2=-1).sum(-1).clamp_min(torch.finfo(G.dtype).tiny)
        lam = (self.cfg.reg + 1e-14) * scale
        G = G + torch.diag_embed(lam.unsqueeze(-1) + (1.0 - valid))  # masked columns: gamma = 0
        gamma, _ = torch.linalg.solve_ex(G, rhs)  # (B, k-1, 1); never raises
        if seg is None:
            cand = tz - (dT @ gamma)[..., 0]
        else:  # each entry mixed with its problem's coefficients
            cand = tz - (dT[0] * gamma[seg, :, 0]).sum(-1).unsqueeze(0)
        (bad,) = self._reduce_all([(self.nonfinite(cand, seg), "max")])
        good = ok & (valid.sum(-1) > 0) & (bad == 0) & torch.isfinite(gamma).all(-1).all(-1)
        self.prev_acc = good
        return torch.where(self.spread(good, seg), cand, tz)
