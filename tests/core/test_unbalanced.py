"""Unbalanced and semi-unbalanced entropic OT against a dense reference, GeomLoss and POT.

Tolerances: float64 1e-6 relative, float32 1e-4 relative (as for the balanced case);
plans / potentials against POT at 1e-8 (both solved to 1e-12 in float64).

Where the peers differ from the mathematics, the tests check the mathematics and the peer's
known difference: GeomLoss' point gradients are (rho + eps/2) / (rho + eps) of the exact ones on
an unbalanced side (autograd through its value formula), and POT 0.9's unbalanced ``value`` drops
the KL terms' masses (0 when both sides are relaxed).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flashot import SamplesLoss, solve_sample

geomloss = pytest.importorskip("geomloss")
ot = pytest.importorskip("ot")
scipy_optimize = pytest.importorskip("scipy.optimize")


pytestmark = pytest.mark.usefixtures("one_thread")


def _rel(u, v):
    u, v = torch.as_tensor(u), torch.as_tensor(v)
    return float((u - v).abs().max() / v.abs().max().clamp_min(1e-300))


def _clouds(n=40, m=50, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 2, generator=g, dtype=dtype)
    y = torch.rand(m, 2, generator=g, dtype=dtype) + 0.3
    a = torch.rand(n, generator=g, dtype=dtype) + 0.5
    b = torch.rand(m, generator=g, dtype=dtype) + 0.5
    return x, y, a / a.sum(), b / b.sum()


def _geomloss_factor(kw):
    """GeomLoss' point gradients / the exact ones on a side relaxed with reach (both sides here)."""
    rho, eps = kw["reach"] ** kw["p"], kw["blur"] ** kw["p"]
    return (rho + eps / 2) / (rho + eps)


def _run(L, a, x, b, y, potentials):
    xx, aa, yy = x.clone().requires_grad_(), a.clone().requires_grad_(), y.clone().requires_grad_()
    out = L(aa, xx, b, yy)
    if potentials:
        return [o.detach() for o in out]
    gx, ga, gy = torch.autograd.grad(out, [xx, aa, yy])
    return [out.detach(), gx, ga, gy]


# --------------------------------------------------------------------------- GeomLoss
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-6), (torch.float32, 1e-4)])
@pytest.mark.parametrize("debias", [False, True])
@pytest.mark.parametrize("potentials", [False, True])
def test_reach_matches_geomloss_tensorized(dtype, tol, debias, potentials):
    x, y, a, b = _clouds(dtype=dtype)
    kw = dict(p=2, blur=0.05, reach=0.5, debias=debias, potentials=potentials, backend="tensorized")
    ref = _run(geomloss.SamplesLoss("sinkhorn", **kw), a, x, b, y, potentials)
    out = _run(SamplesLoss("sinkhorn", **kw), a, x, b, y, potentials)
    _check_against_geomloss(out, ref, kw, tol, potentials)


def _check_against_geomloss(out, ref, kw, tol, potentials=False):
    """Values and potentials equal; point gradients equal after GeomLoss' factor is divided out.
    Weight gradients are not compared (GeomLoss' differ by more than a factor; the reference suite
    checks ours against finite differences)."""
    if potentials:
        for name, u, v in zip(["F", "G"], out, ref):
            assert _rel(u, v) < tol, name
        return
    k = _geomloss_factor(kw)
    for name, u, v in (("value", out[0], ref[0]), ("grad_x", out[1], ref[1] / k), ("grad_y", out[3], ref[3] / k)):
        assert _rel(u, v) < tol, name


# GeomLoss' online backend JIT-compiles a KeOps formula in every fresh environment (about 12 s each on 2
# cores, most of these tests' time): a second opinion, so in the slow run
@pytest.mark.slow
@pytest.mark.parametrize("debias", [False, True])
def test_reach_p1_matches_geomloss(debias):
    """Against GeomLoss' online (KeOps) backend: its tensorized one clamps |x - y|^2 at 1e-8 (a distance of
    1e-4 on the self terms' diagonal), which flashot does not."""
    pytest.importorskip("pykeops")
    x, y, a, b = _clouds()
    kw = dict(p=1, blur=0.1, reach=0.3, debias=debias)
    ref = _run(geomloss.SamplesLoss("sinkhorn", backend="online", **kw), a, x, b, y, False)
    out = _run(SamplesLoss("sinkhorn", backend="tensorized", **kw), a, x, b, y, False)
    _check_against_geomloss(out, ref, kw, 1e-6)


@pytest.mark.slow  # KeOps JIT (above)
def test_reach_online_matches_geomloss_online():
    pytest.importorskip("pykeops")
    x, y, a, b = _clouds(n=60, m=70, dtype=torch.float32, seed=1)
    kw = dict(p=2, blur=0.05, reach=0.4, debias=True)
    ref = _run(geomloss.SamplesLoss("sinkhorn", backend="online", **kw), a, x, b, y, False)
    out = _run(SamplesLoss("sinkhorn", backend="online", **kw), a, x, b, y, False)
    _check_against_geomloss(out, ref, kw, 1e-4)


def test_reach_batched_matches_per_problem():
    x1, y1, a1, b1 = _clouds(seed=2)
    x2, y2, a2, b2 = _clouds(seed=3)
    L = SamplesLoss("sinkhorn", p=2, blur=0.05, reach=0.5, diameter=2.0, backend="tensorized")
    G = geomloss.SamplesLoss("sinkhorn", p=2, blur=0.05, reach=0.5, diameter=2.0, backend="tensorized")
    out = L(torch.stack([a1, a2]), torch.stack([x1, x2]), torch.stack([b1, b2]), torch.stack([y1, y2]))
    ref = torch.stack([G(a1, x1, b1, y1), G(a2, x2, b2, y2)])
    assert _rel(out, ref) < 1e-6


# --------------------------------------------------------------------------- POT
POT_CASES = [1.0, (0.5, 2.0), (0.5, None), (None, 0.3)]


def _pot_pair(ub):
    if isinstance(ub, tuple):
        return tuple(float("inf") if v is None else v for v in ub)
    return ub


@pytest.mark.parametrize("ub", POT_CASES)
@pytest.mark.parametrize("method", ["sinkhorn", "symmetric"])
def test_solve_sample_matches_pot(ub, method):
    rng = np.random.default_rng(0)
    x, y = rng.random((30, 2)), rng.random((35, 2)) + 0.3
    a, b = rng.random(30) + 0.5, rng.random(35) + 0.5
    a, b = a / a.sum(), b / (1.3 * b.sum())  # different masses
    reg = 0.05
    M = ot.dist(x, y)
    ref = ot.solve(M, a, b, reg=reg, unbalanced=_pot_pair(ub), max_iter=100_000, tol=1e-14)
    res = solve_sample(x, y, a, b, reg=reg, unbalanced=ub, max_iter=20_000, tol=1e-12, method=method)
    assert res.converged
    scale = float(ref.value_linear)
    assert abs(res.value_linear - float(ref.value_linear)) < 1e-8 * scale
    P = res.plan.to_dense()
    assert np.abs(P - ref.plan).max() < 1e-8 * ref.plan.max()
    # value: the objective (generalised KL) at the plan, here POT's plan; POT's own value drops the
    # KL terms' masses, which leaves the strict sides' <a, f> (0 when both sides are relaxed)
    rx, ry = (ub, ub) if not isinstance(ub, tuple) else ub
    assert abs(res.value - _primal(M, ref.plan, a, b, reg, rx, ry)) < 1e-8 * scale
    f, g = res.potentials
    pot_value = (a @ f if rx is None else 0.0) + (b @ g if ry is None else 0.0)
    assert abs(float(ref.value) - pot_value) < 1e-8 * scale
    # potentials: flashot returns (f, g) = reg * POT's (log u, log v)
    assert np.abs(res.potentials[0] / reg - ref.potentials[0]).max() < 1e-8
    assert np.abs(res.potentials[1] / reg - ref.potentials[1]).max() < 1e-8
    # marginals of the streamed plan agree with the dense one
    assert np.allclose(res.marginal_a, P.sum(1), rtol=1e-10, atol=0)


@pytest.mark.parametrize("pot_method", ["sinkhorn", "sinkhorn_stabilized"])
def test_plan_matches_sinkhorn_unbalanced(pot_method):
    rng = np.random.default_rng(1)
    x, y = rng.random((25, 3)), rng.random((20, 3))
    a, b = np.full(25, 1 / 25), np.full(20, 1.5 / 20)
    reg, rho = 0.1, 0.7
    M = ot.dist(x, y)
    P_ref, log = ot.unbalanced.sinkhorn_unbalanced(
        a, b, M, reg, rho, method=pot_method, numItermax=100_000, stopThr=1e-14, log=True
    )
    res = solve_sample(x, y, a, b, reg=reg, unbalanced=rho, tol=1e-12, max_iter=20_000)
    assert np.abs(res.plan.to_dense() - P_ref).max() < 1e-8 * P_ref.max()
    assert abs(res.value_linear - log["cost"]) < 1e-8 * log["cost"]
    # value_dual is POT's total cost with the *generalised* KL (mass terms included)
    Pr1, Pr2 = P_ref.sum(1), P_ref.sum(0)

    def gkl(p, q):
        return float(np.sum(p * np.log(p / q)) - p.sum() + q.sum())

    primal = float(np.sum(M * P_ref)) + reg * gkl(P_ref, a[:, None] * b[None]) + rho * gkl(Pr1, a) + rho * gkl(Pr2, b)
    assert abs(res.value_dual - primal) < 1e-8 * abs(primal)


def test_unbalanced_inf_is_balanced():
    x, y, a, b = _clouds(n=20, m=25)
    r0 = solve_sample(x, y, a, b, reg=0.1, tol=1e-10, max_iter=5000)
    r1 = solve_sample(x, y, a, b, reg=0.1, tol=1e-10, max_iter=5000, unbalanced=float("inf"))
    r2 = solve_sample(x, y, a, b, reg=0.1, tol=1e-10, max_iter=5000, unbalanced=(None, math.inf))
    assert r1.unbalanced is None and r2.unbalanced is None
    assert torch.allclose(r0.value, r1.value) and torch.allclose(r0.value, r2.value)


# --------------------------------------------------------------------------- semi-unbalanced: dense reference
def _dense_reference(C, a, b, eps, rho_x, rho_y):
    """Maximise the dense dual with L-BFGS (float64), independent of the Sinkhorn code.

    D(f, g) = phi_x(f) + phi_y(g) - eps <a x b, exp((f + g - C)/eps)> + eps m(a) m(b),
    phi(f) = rho <a, 1 - exp(-f/rho)> (or <a, f> for a strict side).
    """
    n, m = C.shape

    def phi(w, f, rho):
        if rho is None:
            return w @ f, w
        e = np.exp(-f / rho)
        return rho * (w @ (1 - e)), w * e

    def negD(z):
        f, g = z[:n], z[n:]
        K = a[:, None] * b[None] * np.exp((f[:, None] + g[None] - C) / eps)
        px, dpx = phi(a, f, rho_x)
        py, dpy = phi(b, g, rho_y)
        D = px + py - eps * K.sum() + eps * a.sum() * b.sum()
        grad = np.concatenate([dpx - K.sum(1), dpy - K.sum(0)])
        return -D, -grad

    z0 = np.zeros(n + m)
    r = scipy_optimize.minimize(
        negD, z0, jac=True, method="L-BFGS-B", options=dict(maxiter=20_000, ftol=1e-15, gtol=1e-13, maxcor=30)
    )
    f, g = r.x[:n], r.x[n:]
    P = a[:, None] * b[None] * np.exp((f[:, None] + g[None] - C) / eps)
    return f, g, -r.fun, P


def _gkl(p, q):
    return float(np.sum(p * np.log(p / q)) - p.sum() + q.sum())


def _primal(C, P, a, b, eps, rho_x, rho_y):
    v = float(np.sum(C * P)) + eps * _gkl(P, a[:, None] * b[None])
    if rho_x is not None:
        v += rho_x * _gkl(P.sum(1), a)
    if rho_y is not None:
        v += rho_y * _gkl(P.sum(0), b)
    return v


@pytest.mark.parametrize("rhos", [(0.4, None), (None, 0.25), (0.3, 1.2)])
def test_semi_unbalanced_against_dense_dual(rhos):
    rho_x, rho_y = rhos
    rng = np.random.default_rng(5)
    x, y = rng.random((12, 2)), rng.random((15, 2)) + 0.2
    a, b = rng.random(12) + 0.5, rng.random(15) + 0.5
    a, b = a / a.sum(), 0.8 * b / b.sum()
    if rho_x is None:
        a = a * 0.8  # a strict pair of sides needs equal masses; one strict side does not
    eps = 0.1
    C = ((x[:, None] - y[None]) ** 2).sum(-1)
    f_ref, g_ref, D_ref, P_ref = _dense_reference(C, a, b, eps, rho_x, rho_y)
    # the reference itself: primal-dual gap ~ 0, first-order conditions hold
    assert abs(_primal(C, P_ref, a, b, eps, rho_x, rho_y) - D_ref) < 1e-7
    if rho_x is None:
        assert np.abs(P_ref.sum(1) - a).max() < 1e-7
    else:
        assert np.abs(P_ref.sum(1) - a * np.exp(-f_ref / rho_x)).max() < 1e-7

    res = solve_sample(x, y, a, b, reg=eps, unbalanced=rhos, tol=1e-12, max_iter=20_000)
    assert res.converged
    assert abs(res.value_dual - D_ref) < 1e-6 * abs(D_ref)
    assert np.abs(res.potentials[0] - f_ref).max() < 1e-5
    assert np.abs(res.potentials[1] - g_ref).max() < 1e-5
    P = res.plan.to_dense()
    assert np.abs(P - P_ref).max() < 1e-6 * P_ref.max()
    # our own plan: primal value = dual value (zero gap), strict side satisfied
    assert abs(_primal(C, P, a, b, eps, rho_x, rho_y) - res.value_dual) < 1e-8 * abs(D_ref)
    if rho_x is None:
        assert np.abs(P.sum(1) - a).max() < 1e-10
    if rho_y is None:
        assert np.abs(P.sum(0) - b).max() < 1e-10


def test_semi_unbalanced_value_dual_gradients_are_envelope():
    """d value_dual / d x_i = sum_j P_ij grad_x C(x_i, y_j), d/d a_i from the dual (docstring)."""
    rho_x, rho_y, eps = 0.4, None, 0.1
    x, y, a, b = _clouds(n=15, m=18, seed=7)
    xx, aa, yy, bb = (t.clone().requires_grad_() for t in (x, y, a, b))
    xx, yy, aa, bb = (
        x.clone().requires_grad_(),
        y.clone().requires_grad_(),
        a.clone().requires_grad_(),
        b.clone().requires_grad_(),
    )
    res = solve_sample(xx, yy, aa, bb, reg=eps, unbalanced=(rho_x, rho_y), tol=1e-13, max_iter=20_000)
    gx, gy, ga, gb = torch.autograd.grad(res.value_dual, [xx, yy, aa, bb])
    P = res.plan.to_dense().detach()
    f, g = (t.detach() for t in res.potentials)
    gx_ref = 2 * (P.sum(1, keepdim=True) * x - P @ y)
    gy_ref = 2 * (P.sum(0)[:, None] * y - P.T @ x)
    ga_ref = rho_x * (1 - torch.exp(-f / rho_x)) - eps * torch.exp(-f / rho_x) + eps * b.sum()
    gb_ref = g - eps + eps * a.sum()
    for u, v in ((gx, gx_ref), (gy, gy_ref), (ga, ga_ref), (gb, gb_ref)):
        assert _rel(u, v) < 1e-8


def test_semi_unbalanced_samples_loss_against_dense_reference():
    """SamplesLoss(reach_x=..., reach_y=None, tol=1e-12): value and potentials = dense optimum,
    gradients = the envelope gradients (GeomLoss' would be (rho + eps/2) / (rho + eps) of them on
    the relaxed side)."""
    reach, blur = 0.2, 0.6
    rho, eps = reach**2, blur**2
    x, y, a, b = _clouds(n=12, m=14, seed=9)
    kw = dict(
        p=2, blur=blur, reach_x=reach, reach_y=None, debias=False, tol=1e-12, max_iter=20_000, backend="tensorized"
    )
    xx, yy = x.clone().requires_grad_(), y.clone().requires_grad_()
    v = SamplesLoss("sinkhorn", **kw)(a, xx, b, yy)
    gx, gy = torch.autograd.grad(v, [xx, yy])
    F, G = SamplesLoss("sinkhorn", potentials=True, **kw)(a, x, b, y)
    C = 0.5 * ((x[:, None] - y[None]) ** 2).sum(-1)
    f_ref, g_ref, D_ref, P_ref = _dense_reference(C.numpy(), a.numpy(), b.numpy(), eps, rho, None)
    assert abs(float(v.detach()) - D_ref) < 1e-8 * abs(D_ref)
    scale = np.abs(g_ref).max()
    assert np.abs(F.numpy() - f_ref).max() < 1e-6 * scale and np.abs(G.numpy() - g_ref).max() < 1e-6 * scale
    P = torch.from_numpy(P_ref)
    gx_env = P.sum(1, keepdim=True) * x - P @ y
    gy_env = P.sum(0)[:, None] * y - P.T @ x
    assert _rel(gx, gx_env) < 1e-6
    assert _rel(gy, gy_env) < 1e-6


def test_reach_xy_equal_is_reach():
    x, y, a, b = _clouds(seed=11)
    v1 = SamplesLoss(p=2, blur=0.05, reach=0.5)(a, x, b, y)
    v2 = SamplesLoss(p=2, blur=0.05, reach_x=0.5, reach_y=0.5)(a, x, b, y)
    assert _rel(v1, v2) < 1e-12


def test_semi_unbalanced_debiased_zero_on_identical_measures():
    x, _, a, _ = _clouds(seed=12)
    for kw in (dict(reach_x=0.5), dict(reach_y=0.5), dict(reach_x=0.3, reach_y=0.8)):
        v = SamplesLoss(p=2, blur=0.05, **kw)(a, x, a, x)
        assert abs(float(v)) < 1e-10, kw


# --------------------------------------------------------------------------- errors
def test_bad_unbalanced_arguments():
    x, y, a, b = _clouds(n=5, m=6)
    with pytest.raises(ValueError, match="reach"):
        SamplesLoss(reach=0.0)
    with pytest.raises(ValueError, match="reach"):
        SamplesLoss(reach=-1.0)
    with pytest.raises(ValueError, match="reach_x"):
        SamplesLoss(reach_x=-0.5)
    with pytest.raises(ValueError, match="reach"):
        SamplesLoss(reach=0.5, reach_x=0.3)
    with pytest.raises(TypeError, match="reach"):
        SamplesLoss(reach="big")
    with pytest.raises(ValueError, match="unbalanced"):
        solve_sample(x, y, reg=0.1, unbalanced=-1.0)
    with pytest.raises(ValueError, match=r"unbalanced\[1\]"):
        solve_sample(x, y, reg=0.1, unbalanced=(1.0, 0.0))
    with pytest.raises(ValueError, match="unbalanced"):
        solve_sample(x, y, reg=0.1, unbalanced=(1.0, 2.0, 3.0))
    with pytest.raises(ValueError, match="unbalanced_type"):
        solve_sample(x, y, reg=0.1, unbalanced=1.0, unbalanced_type="L2")
    with pytest.raises(ValueError, match="unbalanced_type"):
        solve_sample(x, y, reg=0.1, unbalanced=1.0, unbalanced_type="TV")
    with pytest.raises(TypeError, match="unbalanced"):
        solve_sample(x, y, reg=0.1, unbalanced="KL")


def test_semi_unbalanced_debiased_continuous_in_reach():
    """Two-sided self problems (rho_x != rho_y) agree with GeomLoss' symmetric ones as rho_y -> rho_x."""
    x, y, a, b = _clouds(seed=13)
    ref = geomloss.SamplesLoss("sinkhorn", p=2, blur=0.05, reach=0.5, backend="tensorized")(a, x, b, y)
    v = SamplesLoss(p=2, blur=0.05, reach_x=0.5, reach_y=0.5 * (1 + 1e-9))(a, x, b, y)
    assert _rel(v, ref) < 1e-6
    F, G = SamplesLoss(p=2, blur=0.05, reach_x=0.5, reach_y=0.5 * (1 + 1e-9), potentials=True)(a, x, b, y)
    Fr, Gr = geomloss.SamplesLoss("sinkhorn", p=2, blur=0.05, reach=0.5, potentials=True, backend="tensorized")(
        a, x, b, y
    )
    assert _rel(F, Fr) < 1e-6 and _rel(G, Gr) < 1e-6


def test_semi_unbalanced_debiased_against_dense_reference():
    """S = OT(a, b) - OT(a, a)/2 - OT(b, b)/2, each term the dense optimum of OT_{rho_x, rho_y}
    (loose tolerance: eps-scaling lag, see test_semi_unbalanced_samples_loss_against_dense_reference)."""
    reach, blur = 0.2, 0.6
    rho, eps = reach**2, blur**2
    x, y, a, b = _clouds(n=12, m=14, seed=14)
    v = SamplesLoss("sinkhorn", p=2, blur=blur, reach_x=reach, scaling=0.99, backend="tensorized")(a, x, b, y)

    def D(p, u, q, w):
        C = 0.5 * ((u[:, None] - w[None]) ** 2).sum(-1)
        return _dense_reference(C.numpy(), p.numpy(), q.numpy(), eps, rho, None)[2]

    S_ref = D(a, x, b, y) - 0.5 * D(a, x, a, x) - 0.5 * D(b, y, b, y)
    assert abs(float(v) - S_ref) < 5e-3 * abs(D(a, x, b, y))


# --------------------------------------------------------------------------- second derivatives
@pytest.mark.parametrize("front", ["samples_loss", "samples_loss_debiased", "solve_sample"])
def test_unbalanced_second_derivatives_warn_final_step_only(front):
    """create_graph=True on an unbalanced value warns (its second derivatives are the final step's, as in
    GeomLoss), plain gradients do not, and the first derivatives are the same either way; balanced
    values (exact second derivatives, implicit differentiation) do not warn."""
    import warnings

    x, y, a, b = _clouds(30, 40)

    def value(xx, reach):
        if front == "solve_sample":
            return solve_sample(xx, y, a, b, reg=0.05, unbalanced=reach, tol=1e-10, backend="tiled").value
        return SamplesLoss(blur=0.2, reach=reach, debias=front.endswith("debiased"), backend="tiled")(a, xx, b, y)

    for reach, warns in ((0.5, True), (None, False)):
        results = []
        for create_graph in (False, True):
            xx = x.clone().requires_grad_()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                (gx,) = torch.autograd.grad(value(xx, reach), xx, create_graph=create_graph)
            hits = [w for w in caught if "final Sinkhorn step" in str(w.message)]
            assert len(hits) == int(create_graph and warns), (reach, create_graph, [str(w.message) for w in caught])
            results.append(gx.detach())
        torch.testing.assert_close(results[1], results[0], rtol=1e-10, atol=1e-12)
