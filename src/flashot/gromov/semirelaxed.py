"""Semi-relaxed (F)GW: mirror descent with only the first marginal constrained."""

from __future__ import annotations

import math
import sys
import time
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from ..costs import FeatureBilinearCost
from ..measures import Measures, log_weights
from ..ops import get_engine
from .checks import ArrayLike, SROptions, check_inputs
from .features import (
    CHECK_EVERY,
    NOISE_RTOL,
    SMALL_CHANGE,
    bilinear_bound,
    embed,
    mean_cost,
    plan_inner,
    quadratic_form,
    quartic,
    stop_threshold,
    unresolved,
)
from .results import GWPlan, GWResult


@dataclass
class SRIterate:
    """``T_ij = a_i / m exp((f_i + g_j - <phi_i, M psi_j>) / reg)``: the cumulated gradients of the mirror steps
    (their row constants dropped: the row normalisation removes them) are the bilinear part ``M`` and the
    column part ``-g``; ``f`` normalises the rows."""

    M: Tensor  # (P, Q) float64
    g: Tensor  # (1, m) float64 (it grows with the steps: accumulated in float64)
    f: Tensor  # (1, n) compute dtype
    mm: Measures


class SRProblem:
    """The fixed parts of a semi-relaxed (F)GW solve: features, engine, augmented points and weights."""

    def __init__(
        self, X: Tensor, Y: Tensor, a: Tensor, FX: Tensor | None, FY: Tensor | None, alpha: float, o: SROptions
    ) -> None:
        self.alpha, self.reg, self.fused = alpha, o.reg, FX is not None
        self.n, self.m = X.shape[0], Y.shape[0]
        # float64 whatever the inputs: the iterate's exponents accumulate every step's cost (|g| / reg grows
        # like steps x cost / reg), which float32 rounds to garbage (plans and changes off by ~1 at 30 x 45)
        self.cdt, self.dev = torch.float64, X.device
        self.a64 = a.detach().double()
        self.w_y = torch.full((self.m,), 1.0 / self.m, dtype=torch.float64, device=self.dev)
        self.X, self.Y, self.FX, self.FY = X, Y, FX, FY
        self.Ex, self.hx, self.Rx, self.Ey, self.Ry, self.Yc, self.F, self.G = self.features(False)
        self.p, self.q = self.Ex.shape[1], self.Ey.shape[1]
        self.Phi = torch.cat([self.Ex, self.F], -1) if self.F is not None else self.Ex
        self.Psi = torch.cat([self.Ey, self.G], -1) if self.G is not None else self.Ey
        P, Q = self.Phi.shape[1], self.Psi.shape[1]
        zero = torch.zeros(1, P, Q, dtype=torch.float64, device=self.dev)
        cost0, xs, ys = FeatureBilinearCost.pair(
            torch.zeros(1, self.n, dtype=torch.float64, device=self.dev),
            self.Phi.unsqueeze(0),
            torch.zeros(1, self.m, dtype=torch.float64, device=self.dev),
            self.Psi.unsqueeze(0),
            zero,
        )
        self.xs, self.ys = xs.to(self.cdt), ys.to(self.cdt)
        self.engine = get_engine(
            o.backend, device=self.dev, dtype=self.cdt, cost=cost0, size=(1, self.n, self.m, self.xs.shape[-1])
        )
        self.a_c = a.detach().to(self.cdt).unsqueeze(0)
        self.b_c = self.w_y.to(self.cdt).unsqueeze(0)
        self.a_log, self.b_log = log_weights(self.a_c), log_weights(self.b_c)
        cols = [self.Ey] + ([self.G] if self.G is not None else [])
        self.Vy = torch.cat(cols, -1).to(self.cdt).unsqueeze(0).contiguous()  # T @ Vy: A (and T G)

    def features(
        self, with_grad: bool
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
        """``(E_x, h_x, R_x, E_y, R_y, Y_c, F, G)`` in float64 (differentiable when asked): ``h_x`` with the weights
        ``a``; ``h_y`` depends on ``q`` and is computed per step (:func:`quartic` of ``Y_c``)."""
        with torch.set_grad_enabled(with_grad and torch.is_grad_enabled()):
            X64, Y64 = self.X.double(), self.Y.double()
            Xc = X64 - self.a64 @ X64.detach() / self.a64.sum()  # D is translation invariant: centre for accuracy
            Yc = Y64 - Y64.detach().mean(0)
            Ex, Rx = embed(Xc)
            Ey, Ry = embed(Yc)
            F: Tensor | None = None
            G: Tensor | None = None
            if self.FX is not None and self.FY is not None:  # fused: |F_i - G_j|^2 is translation invariant, a
                F64, G64 = self.FX.double(), self.FY.double()
                c = 0.5 * (self.a64 @ F64.detach() / self.a64.sum() + G64.detach().mean(0))  # common centre
                F, G = F64 - c, G64 - c
            return Ex, quartic(Xc, self.a64), Rx, Ey, Ry, Yc, F, G

    def iterate(self, M: Tensor, g: Tensor, f: Tensor | None = None) -> SRIterate:
        """The iterate of cumulated ``(M, g)``; ``f`` (the row normaliser) is one softmin when not given."""
        cost = FeatureBilinearCost(FeatureBilinearCost.block(M.unsqueeze(0)).to(self.cdt))
        bound = bilinear_bound(self.Phi, M, self.Psi, self.p, self.q) + float(g.abs().max())
        mm = Measures(
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
            torch.zeros(1, 1, self.xs.shape[-1], dtype=self.cdt, device=self.dev),
            bound,
        )
        if f is None:  # rows of T sum to a: f_i = -reg log sum_j exp(g_j / reg + log(1 / m) - C_ij / reg)
            with torch.no_grad():
                f = self.engine.softmin(self.xs, self.ys, (g / self.reg).to(self.cdt) + self.b_log, self.reg, cost)
        return SRIterate(M, g, f, mm)

    def logs(self, it: SRIterate) -> tuple[Tensor, Tensor]:
        """``(log a + f / reg, log(1 / m) + g / reg)``: the plan's log-weights for the engine's plan products."""
        return it.f / self.reg + self.a_log, (it.g / self.reg).to(self.cdt) + self.b_log

    def marginal_and_products(self, it: SRIterate) -> tuple[Tensor, Tensor]:
        """``(q, Q)``: the free marginal ``q = T^T 1`` (m,) and ``Q = T @ [E_y, G]`` (n, q (+ df)), float64."""
        al, be = self.logs(it)
        ones = torch.ones(1, self.n, 1, dtype=self.cdt, device=self.dev)
        with torch.no_grad():
            q = self.engine.plan_product(self.ys, self.xs, be, al, self.reg, ones, it.mm.cost)[0, :, 0].double()
            Q = self.engine.plan_product(self.xs, self.ys, al, be, self.reg, self.Vy, it.mm.cost)[0].double()
        return q, Q

    def loss(
        self, Ex: Tensor, hx: Tensor, hy: Tensor, F: Tensor | None, G: Tensor | None, Q: Tensor, q: Tensor
    ) -> tuple[Tensor, Tensor]:
        """``(A, value)``: ``A = E_x^T T E_y`` and POT's ``srgw_dist`` (``srfgw_dist`` when fused) from ``Q``, ``q``
        and ``h_y = sum_l q_l |y_j - y_l|^4``: ``<h_x, a> + <h_y, q> - 2 <A, R_x A R_y>`` (``T 1 = a``)."""
        A = Ex.T @ Q[:, : self.q]
        val = hx @ self.a64 + hy @ q - 2.0 * (A * (self.Rx @ A @ self.Ry.T)).sum()
        if F is not None and G is not None:  # fused: (1 - alpha) <|F_i - G_j|^2, T> + alpha srGW
            feat = (F * F).sum(-1) @ self.a64 + (G * G).sum(-1) @ q - 2.0 * (F * Q[:, self.q :]).sum()
            val = self.alpha * val + (1.0 - self.alpha) * feat
        return A, val

    def step(self, it: SRIterate, A: Tensor, hy: Tensor) -> tuple[SRIterate, Tensor]:
        """The mirror step ``T <- diag(a / K 1) K``, ``K = T exp(-grad / reg)``, with POT's gradient
        ``grad = alpha 2 (h_x 1^T + 1 h_y^T - 2 D^x T D^y) + (1 - alpha) M`` less its row constants:
        ``(next iterate, dM)``."""
        al = self.alpha
        dM = torch.zeros_like(it.M)
        dM[: self.p, : self.q] = (-4.0 * al) * self.Rx @ A @ self.Ry.T
        dv = 2.0 * al * hy
        if self.F is not None and self.G is not None:  # fused
            dM[self.p :, self.q :] = (
                -2.0 * (1.0 - al) * torch.eye(self.F.shape[1], dtype=torch.float64, device=self.dev)
            )
            dv = dv + (1.0 - al) * (self.G * self.G).sum(-1)
        return self.iterate(it.M + dM, it.g - dv), dM

    # -- |T - T_prev|_F from plan products (POT's err) -----------------------------------------
    def sq_norm(self, it: SRIterate) -> float:
        """``|T|_F^2``: a plan product at ``reg / 2`` with doubled log-weights."""
        al, be = self.logs(it)
        return plan_inner(self.engine, self.xs, self.ys, 2 * al, 2 * be, self.reg / 2, it.mm.cost)

    def dot(self, i1: SRIterate, i2: SRIterate) -> float:
        """``<T1, T2>``: a plan product with the mean of the two (feature-bilinear) costs at ``reg / 2``."""
        (a1, b1), (a2, b2) = self.logs(i1), self.logs(i2)
        mid = mean_cost(i1.mm.cost, i2.mm.cost)
        return plan_inner(self.engine, self.xs, self.ys, a1 + a2, b1 + b2, self.reg / 2, mid)

    def small_change(self, i1: SRIterate, i2: SRIterate, dM: Tensor) -> tuple[float, float]:
        """``(sum_ij T1_ij T2_ij d_ij^2, its rounding error)`` with ``T2 = T1 exp(d)``, ``d_ij = <w_i, z_j>``
        (``w = [df / reg, 1, -Phi dM / reg]``, ``z = [1, dg / reg, Psi]``): ``|T2 - T1|_F^2 = 4 sum T1 T2 sinh(d / 2)^2``
        to relative order ``d^2 / 12``, one plan product of ``T1 T2`` (the mean cost at ``reg / 2``) with
        ``z (x) z``; no cancellation."""
        reg, dev = self.reg, self.dev
        w = torch.cat(
            [
                ((i2.f - i1.f)[0].double() / reg).unsqueeze(-1),
                torch.ones(self.n, 1, dtype=torch.float64, device=dev),
                -(self.Phi @ dM) / reg,
            ],
            -1,
        )
        z = torch.cat(
            [torch.ones(self.m, 1, dtype=torch.float64, device=dev), ((i2.g - i1.g)[0] / reg).unsqueeze(-1), self.Psi],
            -1,
        )
        k = z.shape[1]
        Z2 = (z.unsqueeze(-1) * z.unsqueeze(-2)).reshape(1, self.m, k * k).to(self.cdt).contiguous()
        (a1, b1), (a2, b2) = self.logs(i1), self.logs(i2)
        mid = mean_cost(i1.mm.cost, i2.mm.cost)
        with torch.no_grad():
            R = self.engine.plan_product(self.xs, self.ys, a1 + a2, b1 + b2, reg / 2, Z2, mid)[0].double()
        return quadratic_form(w, R.reshape(self.n, k, k), self.cdt)

    def change(self, prev: SRIterate, cur: SRIterate, dM: Tensor) -> tuple[float, float, float]:
        """``(|T - T_prev|_F, floor, |T|_F)``: ``|T|^2 + |T_prev|^2 - 2 <T, T_prev>``, or, below ``1e-3 |T|_F`` and
        its rounding error above ``NOISE_RTOL`` of it, :meth:`small_change` when its rounding error is the smaller
        (its truncation error grows with the entries' relative changes, which mirror descent leaves O(1) on
        the decaying entries: the expansion is preferred while it is accurate); ``floor`` is what the compute
        dtype resolves: :func:`gromov_wasserstein`'s floor, or the square root of :meth:`small_change`'s rounding
        error when that form is used (the expansion's error estimate is an overestimate that only chooses)."""
        cur_sq, prev_sq = self.sq_norm(cur), self.sq_norm(prev)
        err_sq = cur_sq + prev_sq - 2.0 * self.dot(cur, prev)
        u = torch.finfo(self.cdt).eps
        scale = (cur.mm.cmax + float(cur.f.abs().max())) / self.reg + 2.0 * math.log2(1 + max(self.n, self.m))
        noise, floor = u * scale * (cur_sq + prev_sq), u * scale * math.sqrt(cur_sq)
        if err_sq < SMALL_CHANGE**2 * cur_sq and noise > NOISE_RTOL * err_sq:
            small, small_noise = self.small_change(prev, cur, dM)
            if small_noise < noise:
                err_sq, floor = small, max(floor, math.sqrt(small_noise))
        return math.sqrt(max(0.0, err_sq)), floor, math.sqrt(cur_sq)

    def value(self, it: SRIterate, plan: GWPlan, q: Tensor, Q: Tensor) -> Tensor:
        """The loss of the final coupling, differentiable w.r.t. the points and features (coupling fixed)."""
        if not (
            torch.is_grad_enabled()
            and any(t is not None and t.requires_grad for t in (self.X, self.Y, self.FX, self.FY))
        ):
            return self.loss(self.Ex, self.hx, quartic(self.Yc, q), self.F, self.G, Q, q)[1]
        Ex, hx, _, Ey, _, Yc, F, G = self.features(True)
        Qg = plan.apply(torch.cat([Ey] + ([G] if G is not None else []), -1).to(self.cdt))
        assert isinstance(Qg, Tensor)  # a torch V gives a tensor (numpy inputs never require grad)
        Qg = Qg.double()
        return self.loss(Ex, hx, quartic(Yc, q), F, G, Qg, q)[1]


def solve_semirelaxed(
    X: ArrayLike,
    Y: ArrayLike,
    a: ArrayLike | None,
    FX: ArrayLike | None,
    FY: ArrayLike | None,
    alpha: float,
    opts: SROptions,
) -> GWResult:
    """Semi-relaxed (fused) GW: POT's mirror descent, each step one softmin and two plan products."""
    o = opts.checked()
    X, Y, a, _, FX, FY, is_np = check_inputs(X, Y, a, None, FX, FY, semirelaxed=True)
    pb = SRProblem(X, Y, a, FX, FY, alpha, o)
    P, Q0 = pb.Phi.shape[1], pb.Psi.shape[1]
    it = pb.iterate(
        torch.zeros(P, Q0, dtype=torch.float64, device=pb.dev),
        torch.zeros(1, pb.m, dtype=torch.float64, device=pb.dev),
        torch.zeros(1, pb.n, dtype=pb.cdt, device=pb.dev),
    )  # T = a 1^T / m
    q, Q = pb.marginal_and_products(it)
    log: dict[str, list] = {"err": [], "value": [], "n_inner": []}
    err: float | None = None
    converged, cpt, t0 = False, 0, time.perf_counter()
    stop_at: float | None = 0.0
    floor, norm = 0.0, 1.0
    name = "semirelaxed_fused_gromov_wasserstein" if pb.fused else "semirelaxed_gromov_wasserstein"
    while cpt < o.max_iter:
        hy = quartic(pb.Yc, q)
        A, _ = pb.loss(pb.Ex, pb.hx, hy, pb.F, pb.G, Q, q)
        nxt, dM = pb.step(it, A, hy)
        if cpt % CHECK_EVERY == 0:
            err, floor, norm = pb.change(it, nxt, dM)
            log["err"].append(err)
            stop_at = stop_threshold(o.tol, floor, norm)
        it = nxt
        q, Q = pb.marginal_and_products(it)
        val = pb.loss(pb.Ex, pb.hx, quartic(pb.Yc, q), pb.F, pb.G, Q, q)[1]
        log["value"].append(float(val))
        log["n_inner"].append(1)
        if o.verbose:
            e = f"  err {err:.3e}" if cpt % CHECK_EVERY == 0 else ""
            print(
                f"{name}: outer {cpt + 1}/{o.max_iter}  value {float(val):.10g}{e}  ({time.perf_counter() - t0:.2f}s)",
                file=sys.stderr,
                flush=True,
            )
        cpt += 1
        if cpt % CHECK_EVERY == 1 and stop_at is not None and err is not None and err <= stop_at:
            converged = True
            break
    if not converged and stop_at is None:
        warnings.warn(unresolved(name, pb.cdt, floor / norm, it.mm.cmax / o.reg), RuntimeWarning, stacklevel=3)
    plan = GWPlan(
        it.mm,
        it.f,
        it.g.to(pb.cdt),
        o.reg,
        (X.detach().to(pb.cdt).unsqueeze(0), Y.detach().to(pb.cdt).unsqueeze(0)),
        numpy=is_np,
    )
    value = pb.value(it, plan, q, Q).to(X.dtype)
    f, g = it.f[0].to(X.dtype), it.g[0].to(X.dtype)
    return GWResult(
        value=value.detach().cpu().numpy()[()] if is_np else value,
        plan=plan,
        potentials=(f.cpu().numpy(), g.cpu().numpy()) if is_np else (f, g),
        n_outer=cpt,
        n_inner=cpt,
        converged=converged,
        error=err,
        reg=o.reg,
        backend=pb.engine.name,
        log=log,
    )
