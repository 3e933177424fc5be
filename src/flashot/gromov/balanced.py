"""Balanced (fused) GW: the linearised problem, its change of coupling and the outer loop (projected gradient)."""

from __future__ import annotations

import math
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .._checks import compute_dtype
from ..costs import FeatureBilinearCost
from ..driver import solve_measures, solve_options
from ..measures import Measures, log_weights
from ..ops import get_engine
from .checks import ArrayLike, Options, check_inputs
from .features import (
    CHECK_EVERY,
    NOISE_RTOL,
    SMALL_CHANGE,
    bilinear_bound,
    cloud_features,
    mean_cost,
    plan_inner,
    quadratic_form,
    stop_threshold,
    unresolved,
)
from .results import GWPlan, GWResult


@dataclass
class GWRun:
    """The state of the outer loop of :func:`solve_gw`."""

    prev: tuple[Measures, Tensor, Tensor, Tensor] | None = (
        None  # (measures, f, g, GW block of M) of the last coupling; None: a b^T
    )
    res: Any = None  # the last inner OTResult
    cpt: int = 0
    n_inner: int = 0
    err: float | None = None
    converged: bool = False
    stop_at: float | None = None  # the change below which a check stops (None: the floor is above any use)
    unresolved: str | None = None  # why the loop could not converge (rounding), for the warning
    inner_ok: bool = True
    log: dict = field(default_factory=lambda: {"err": [], "value": [], "n_inner": []})


class GWProblem:
    """The fixed parts of a balanced (fused) GW solve: features and biases (float64), the engine, the augmented
    points and the weights (compute dtype); ``FX = FY = None`` for plain GW."""

    def __init__(
        self, X: Tensor, Y: Tensor, a: Tensor, b: Tensor, FX: Tensor | None, FY: Tensor | None, alpha: float, o: Options
    ) -> None:
        self.X, self.Y, self.FX, self.FY, self.alpha, self.reg = X, Y, FX, FY, alpha, o.reg
        self.fused = FX is not None
        self.cdt, self.dev = compute_dtype(X.dtype), X.device
        self.n, self.m = X.shape[0], Y.shape[0]
        self.a64, self.b64 = a.detach().double(), b.detach().double()
        Ex, hx, Rx, Ey, hy, Ry, F, G = self.features(False)
        Ex, hx, Rx, Ey, hy, Ry = Ex.detach(), hx.detach(), Rx.detach(), Ey.detach(), hy.detach(), Ry.detach()
        F, G = (None, None) if F is None or G is None else (F.detach(), G.detach())
        self.Ex, self.hx, self.Rx, self.Ey, self.hy, self.Ry, self.F, self.G = Ex, hx, Rx, Ey, hy, Ry, F, G
        self.p, self.q = Ex.shape[1], Ey.shape[1]
        self.u, self.v = 2.0 * alpha * hx, 2.0 * alpha * hy  # biases of the linearised cost (POT: 2 constC)
        self.Phi, self.Psi = Ex, Ey  # the features of the cost
        if F is not None and G is not None:  # fused
            self.u, self.v = self.u + (1.0 - alpha) * (F * F).sum(-1), self.v + (1.0 - alpha) * (G * G).sum(-1)
            self.Phi, self.Psi = torch.cat([Ex, F], -1), torch.cat([Ey, G], -1)
        cost0, _, _ = self.make_cost(torch.zeros(self.p, self.q, dtype=torch.float64, device=self.dev))
        _, xs, ys = FeatureBilinearCost.pair(
            self.u.unsqueeze(0),
            self.Phi.unsqueeze(0),
            self.v.unsqueeze(0),
            self.Psi.unsqueeze(0),
            torch.zeros(1, self.Phi.shape[1], self.Psi.shape[1], dtype=torch.float64, device=self.dev),
        )
        self.xs, self.ys = xs.to(self.cdt), ys.to(self.cdt)
        K = self.xs.shape[-1]
        self.engine = get_engine(o.backend, device=self.dev, dtype=self.cdt, cost=cost0, size=(1, self.n, self.m, K))
        self.a_c, self.b_c = a.detach().to(self.cdt).unsqueeze(0), b.detach().to(self.cdt).unsqueeze(0)
        self.a_log, self.b_log = log_weights(self.a_c), log_weights(self.b_c)
        self.center = torch.zeros(1, 1, K, dtype=self.cdt, device=self.dev)
        self.Vy = self.right(Ey, hy, G).to(self.cdt).unsqueeze(0).contiguous()

    def features(
        self, with_grad: bool
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
        """``(E_x, h_x, R_x, E_y, h_y, R_y, F, G)`` in float64 (small algebra and biases; the engines run in the
        compute dtype), differentiable w.r.t. the points and features when asked."""
        a64, b64 = self.a64, self.b64
        with torch.set_grad_enabled(with_grad and torch.is_grad_enabled()):
            X64, Y64 = self.X.double(), self.Y.double()
            Xc = X64 - (a64 @ X64.detach() / a64.sum())  # D is translation invariant: centre for accuracy
            Yc = Y64 - (b64 @ Y64.detach() / b64.sum())
            Ex, hx, Rx = cloud_features(Xc, a64)
            Ey, hy, Ry = cloud_features(Yc, b64)
            F: Tensor | None = None
            G: Tensor | None = None
            if self.FX is not None and self.FY is not None:  # fused: |F_i - G_j|^2 is translation invariant, a
                F64, G64 = self.FX.double(), self.FY.double()  # common centre for accuracy
                c = 0.5 * (a64 @ F64.detach() / a64.sum() + b64 @ G64.detach() / b64.sum())
                F, G = F64 - c, G64 - c
        return Ex, hx, Rx, Ey, hy, Ry, F, G

    def make_cost(self, A: Tensor) -> tuple[FeatureBilinearCost, Tensor, float]:
        """``(cost, GW block of M, bound)`` of the linearised cost at the coupling with ``A = E_x^T T E_y``."""
        p, q, alpha = self.p, self.q, self.alpha
        Mm = (-4.0 * alpha) * self.Rx @ A @ self.Ry.T  # the GW block (the only part that changes)
        Mf = Mm
        if self.F is not None:  # fused
            df = self.F.shape[1]
            Mf = torch.zeros(p + df, q + df, dtype=torch.float64, device=self.dev)
            Mf[:p, :q] = Mm
            Mf[p:, q:] = -2.0 * (1.0 - alpha) * torch.eye(df, dtype=torch.float64, device=self.dev)
        cost = FeatureBilinearCost(FeatureBilinearCost.block(Mf.unsqueeze(0)).to(self.cdt))
        bound = float(self.u.abs().max() + self.v.abs().max()) + bilinear_bound(self.Phi, Mf, self.Psi, p, q)
        return cost, Mm, bound

    def measures(self, cost: FeatureBilinearCost, bound: float) -> Measures:
        return Measures(
            self.xs,
            self.ys,
            self.a_c,
            self.b_c,
            self.a_log,
            self.b_log,
            cost,
            self.engine,
            False,
            self.cdt,
            self.center,
            bound,
        )

    def right(self, Ey: Tensor, hy: Tensor, G: Tensor | None) -> Tensor:
        """``[E_y, h_y]`` (and ``[|G|^2, G]`` when fused): ``T @`` it gives ``A``, the value and the row sums."""
        cols = [Ey, hy.unsqueeze(-1)] + ([(G * G).sum(-1, keepdim=True), G] if G is not None else [])
        return torch.cat(cols, -1)

    def loss(self, Ex: Tensor, hx: Tensor, F: Tensor | None, Q: Tensor, r: Tensor) -> tuple[Tensor, Tensor]:
        """``(A, value)`` from ``Q = T @ right(...)`` and the row sums ``r = T 1``."""
        q = self.q
        A = Ex.T @ Q[:, :q]
        val = hx @ r + Q[:, q].sum() - 2.0 * (A * (self.Rx @ A @ self.Ry.T)).sum()
        if F is not None:  # fused: (1 - alpha) <|F_i - G_j|^2, T> + alpha GW
            feat = (F * F).sum(-1) @ r + Q[:, q + 1].sum() - 2.0 * (F * Q[:, q + 2 :]).sum()
            val = self.alpha * val + (1.0 - self.alpha) * feat
        return A, val

    def logs(self, f: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
        """The plan's log-weights ``(f / reg + log a, g / reg + log b)``."""
        return f / self.reg + self.a_log, g / self.reg + self.b_log

    def stats(self, mm: Measures, f: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
        """``(A, value)`` of the plan (f, g) on ``mm``: ``A = E_x^T T E_y`` and the GW loss (float64)."""
        alpha, beta = self.logs(f, g)
        with torch.no_grad():
            Q = self.engine.plan_product(self.xs, self.ys, alpha, beta, self.reg, self.Vy, mm.cost, "plan")[0].double()
        return self.loss(self.Ex, self.hx, self.F, Q, Q[:, 0])

    def sq_norm(self, mm: Measures, f: Tensor, g: Tensor) -> float:
        """``|T|_F^2``: a plan product at eps / 2 with doubled log-weights."""
        reg, a_log, b_log = self.reg, self.a_log, self.b_log
        return plan_inner(self.engine, self.xs, self.ys, 2 * (f / reg + a_log), 2 * (g / reg + b_log), reg / 2, mm.cost)

    def dot(self, m1: Measures, f1: Tensor, g1: Tensor, m2: Measures, f2: Tensor, g2: Tensor) -> float:
        """``<T1, T2>``: a plan product with the mean of the two (feature-bilinear) costs at eps / 2."""
        reg, a_log, b_log = self.reg, self.a_log, self.b_log
        return plan_inner(
            self.engine,
            self.xs,
            self.ys,
            (f1 + f2) / reg + 2 * a_log,
            (g1 + g2) / reg + 2 * b_log,
            reg / 2,
            mean_cost(m1.cost, m2.cost),
        )

    def small_change(
        self, mm: Measures, f: Tensor, g: Tensor, M1: Tensor, f2: Tensor, g2: Tensor, M2: Tensor
    ) -> tuple[float, float]:
        """``(sum_ij T_ij^2 d_ij^2, its rounding error)`` with ``T2 = T exp(d)``: ``|T2 - T|_F^2`` to second order
        in ``d``, one plan product of ``T^2`` with ``z (x) z``.  ``d_ij = (df_i + dg_j - <E_x,i dM, E_y,j>) / eps =
        <w_i, z_j>`` is written as ``alpha_i + beta_j + <p_i, zc_j>`` with ``zc`` the non-constant features of
        ``E_y`` centred (weights ``b``): the constant feature's and the means' terms are folded into ``alpha``, and
        the potentials' gauge (a constant that one inner solve moves from ``g`` to ``f``) is taken out of both, so
        that the terms of the quadratic form cancel as little as they can (:func:`quadratic_form`)."""
        reg, n, m, dev = self.reg, self.n, self.m, self.dev
        one: dict[str, Any] = dict(dtype=torch.float64, device=dev)
        Wr = self.Ex @ (M2 - M1)  # (n, q): the cost's change is <Wr_i, E_y,j>, E_y = [1, |y|^2, y]
        zbar = self.b64 @ self.Ey[:, 1:] / self.b64.sum()
        zc = self.Ey[:, 1:] - zbar
        alpha = (f2[0].double() - f[0].double() - Wr[:, 0] - Wr[:, 1:] @ zbar) / reg
        beta = (g2[0].double() - g[0].double()) / reg
        gauge = self.a64 @ alpha / self.a64.sum()
        w = torch.cat([(alpha - gauge).unsqueeze(-1), torch.ones(n, 1, **one), -Wr[:, 1:] / reg], -1)
        z = torch.cat([torch.ones(m, 1, **one), (beta + gauge).unsqueeze(-1), zc], -1)
        k = z.shape[1]
        Z2 = (z.unsqueeze(-1) * z.unsqueeze(-2)).reshape(1, m, k * k).to(self.cdt).contiguous()
        with torch.no_grad():
            R = self.engine.plan_product(
                self.xs, self.ys, 2 * (f / reg + self.a_log), 2 * (g / reg + self.b_log), reg / 2, Z2, mm.cost
            )
        return quadratic_form(w, R[0].double().reshape(n, k, k), self.cdt)

    def change(
        self,
        mm: Measures,
        f: Tensor,
        g: Tensor,
        Mm: Tensor,
        bound: float,
        prev: tuple[Measures, Tensor, Tensor, Tensor] | None,
    ) -> tuple[float, float, float]:
        """``(|T - T_prev|_F, floor, |T|_F)`` from plan products: ``|T|^2 + |T_prev|^2 - 2 <T, T_prev>``, or the second-order
        form (:meth:`small_change`) below ``SMALL_CHANGE |T|_F`` and wherever the expansion's estimated rounding
        error exceeds ``NOISE_RTOL`` of it and the second-order form's is the smaller (float32 at large n: the
        expansion's sums then cancel to their rounding); ``floor`` is the smallest change the compute dtype
        resolves: the potentials' rounding, and the second-order form's own rounding error where it is used."""
        cur_sq = self.sq_norm(mm, f, g)
        if prev is None:  # T_prev = a b^T: |a|^2 |b|^2 and <T, a b^T> = a^T T b
            prev_sq = float((self.a64 @ self.a64) * (self.b64 @ self.b64))
            with torch.no_grad():
                Tb = self.engine.plan_product(
                    self.xs,
                    self.ys,
                    f / self.reg + self.a_log,
                    g / self.reg + self.b_log,
                    self.reg,
                    self.b_c.unsqueeze(-1),
                    mm.cost,
                )
            cross = float((self.a_c.double() * Tb[..., 0].double()).sum())
        else:
            prev_sq = self.sq_norm(*prev[:3])
            cross = self.dot(mm, f, g, *prev[:3])
        err_sq = cur_sq + prev_sq - 2.0 * cross
        # rounding: each entry of T carries a relative error ~ u (cmax + |f| + |g|) / eps, so the
        # change stalls near this floor (float32: ~1e-7 |T|_F); it cannot resolve a smaller tol.  The
        # expansion cancels: its own error is ~ that relative error times |T|^2 + |T_prev|^2
        u_c = torch.finfo(self.cdt).eps
        scale = (bound + float(f.abs().max()) + float(g.abs().max())) / self.reg + 2.0 * math.log2(
            1 + max(self.n, self.m)
        )
        floor, noise = u_c * scale * math.sqrt(cur_sq), u_c * scale * (cur_sq + prev_sq)
        if prev is not None and (err_sq < SMALL_CHANGE**2 * cur_sq or noise > NOISE_RTOL * max(err_sq, 0.0)):
            # the expansion has lost its digits: the second-order form, where its own rounding is the smaller
            # (or below SMALL_CHANGE, where the expansion says nothing)
            small, small_noise = self.small_change(mm, f, g, Mm, *prev[1:])
            if err_sq < SMALL_CHANGE**2 * cur_sq or small_noise < noise:
                err_sq, floor = small, max(floor, math.sqrt(small_noise))
        return math.sqrt(max(0.0, err_sq)), floor, math.sqrt(cur_sq)

    def value(self, plan: GWPlan, mm: Measures, f: Tensor, g: Tensor) -> Tensor:
        """The loss of the returned coupling, differentiable w.r.t. the points (coupling fixed: envelope theorem)."""
        if torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (self.X, self.Y, self.FX, self.FY)
        ):
            Ex_g, hx_g, _, Ey_g, hy_g, _, F_g, G_g = self.features(True)
            Q = plan.apply(self.right(Ey_g, hy_g, G_g).to(self.cdt))  # differentiable in V (transposed)
            assert isinstance(Q, Tensor)  # a torch V gives a tensor (numpy inputs never require grad)
            Q = Q.double()
            return self.loss(Ex_g, hx_g, F_g, Q, Q[:, 0].detach())[1]  # Q[:, 0] = T 1, a constant
        return self.stats(mm, f, g)[1]

    def entropic(self, value: Tensor, mm: Measures, f: Tensor, g: Tensor) -> float:
        """``value + reg KL(T | a b^T)`` (detached; streamed)."""
        reg, n, m, cdt, dev = self.reg, self.n, self.m, self.cdt, self.dev
        xs, ys = self.xs, self.ys
        with torch.no_grad():
            alpha, beta = self.logs(f, g)
            ones = torch.ones(1, m, 1, dtype=cdt, device=dev)
            lin = self.engine.plan_product(xs, ys, alpha, beta, reg, ones, mm.cost, "cost")[0, :, 0].double().sum()
            rows = self.engine.plan_product(xs, ys, alpha, beta, reg, ones, mm.cost, "plan")[0, :, 0].double()
            cols = self.engine.plan_product(
                ys, xs, beta, alpha, reg, torch.ones(1, n, 1, dtype=cdt, device=dev), mm.cost, "plan"
            )[0, :, 0].double()
            # KL(T | a b^T) = sum T log(T / (a b)) - sum T + sum a b, log(T_ij / (a_i b_j)) = (f_i + g_j - C_ij) / reg
            mass = rows.sum()
            kl = (
                ((rows * f[0].double()).sum() + (cols * g[0].double()).sum() - lin) / reg
                - mass
                + self.a64.sum() * self.b64.sum()
            )
            v = float(value.detach()) + reg * float(kl)
        return v


def gw_loop(pb: GWProblem, o: Options) -> GWRun:
    """The outer loop: linearise at the coupling, solve the entropic OT problem (warm-started), measure the change
    every ``CHECK_EVERY`` outer steps; POT's stopping rule."""
    inner = solve_options(o.reg, max_iter=o.inner_max_iter, tol=o.inner_tol, method="alternating", grad="detach")
    # T_0 = a b^T: A_0 = (E_x^T a)(E_y^T b)^T, |T_0|^2 = |a|^2 |b|^2
    A = torch.outer(pb.Ex.T @ pb.a64, pb.Ey.T @ pb.b64)
    run, init, floor, norm, t0 = GWRun(), None, 0.0, 1.0, time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        while run.cpt < o.max_iter:
            cost, Mm, bound = pb.make_cost(A)
            mm = pb.measures(cost, bound)
            n_warn = len(caught)
            res = run.res = solve_measures(mm, inner, init)
            if len(caught) > n_warn or not res.converged:
                run.inner_ok = False
            f, g = res.plan.raw_potentials
            if o.warmstart:
                init = res.potentials
            run.n_inner += res.n_iter
            A, val = pb.stats(mm, f, g)
            run.log["value"].append(float(val))
            run.log["n_inner"].append(res.n_iter)
            if run.cpt % CHECK_EVERY == 0:
                run.err, floor, norm = pb.change(mm, f, g, Mm, bound, run.prev)
                run.log["err"].append(run.err)
                run.stop_at = stop_threshold(o.tol, floor, norm)
            run.prev = (mm, f, g, Mm)
            if o.verbose:
                e = f"  err {run.err:.3e} (floor {floor:.2e})" if run.cpt % CHECK_EVERY == 0 else ""
                print(
                    f"gromov_wasserstein: outer {run.cpt + 1}/{o.max_iter}  inner {res.n_iter}  value "
                    f"{float(val):.10g}{e}  ({time.perf_counter() - t0:.2f}s)",
                    file=sys.stderr,
                    flush=True,
                )
            run.cpt += 1
            stop_at, err = run.stop_at, run.err  # both set by the same check
            if stop_at is not None and err is not None and run.cpt % CHECK_EVERY == 1 and err <= stop_at:
                run.converged = True
                break
    if not run.converged and run.stop_at is None and run.err is not None:
        run.unresolved = unresolved("gromov_wasserstein", pb.cdt, floor / norm, bound / o.reg)
    for w in caught:  # the inner solves' own non-convergence warnings are summarised below
        if not (issubclass(w.category, RuntimeWarning) and str(w.message).startswith("Sinkhorn did not reach")):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return run


def solve_gw(
    X: ArrayLike,
    Y: ArrayLike,
    a: ArrayLike | None,
    b: ArrayLike | None,
    FX: ArrayLike | None,
    FY: ArrayLike | None,
    alpha: float,
    opts: Options,
) -> GWResult:
    """(Fused) GW with the options of the public functions; ``FX = FY = None`` for plain GW."""
    o = opts.checked()
    X, Y, a, b, FX, FY, is_np = check_inputs(X, Y, a, b, FX, FY)
    pb = GWProblem(X, Y, a, b, FX, FY, alpha, o)
    run = gw_loop(pb, o)
    if run.unresolved:
        warnings.warn(run.unresolved, RuntimeWarning, stacklevel=3)
    if not run.inner_ok:
        warnings.warn(
            f"gromov_wasserstein: some inner Sinkhorn solves did not reach inner_tol={o.inner_tol:g} in "
            f"{o.inner_max_iter} iterations; raise inner_max_iter or reg",
            RuntimeWarning,
            stacklevel=2,
        )
    assert run.prev is not None  # max_iter >= 1 outer steps ran
    mm, f, g, _ = run.prev
    plan = GWPlan(
        mm, f, g, o.reg, (X.detach().to(pb.cdt).unsqueeze(0), Y.detach().to(pb.cdt).unsqueeze(0)), numpy=is_np
    )
    value = pb.value(plan, mm, f, g)
    res = run.res
    value = value.to(X.dtype)
    return GWResult(
        value=value.detach().cpu().numpy()[()] if is_np else value,
        plan=plan,
        potentials=tuple(t.detach().cpu().numpy() for t in res.potentials) if is_np else res.potentials,
        n_outer=run.cpt,
        n_inner=run.n_inner,
        converged=run.converged,
        error=run.err,
        reg=o.reg,
        backend=pb.engine.name,
        inner_converged=run.inner_ok,
        log=run.log,
        _entropic=lambda: pb.entropic(value, mm, f, g),
    )
