"""Feature-bilinear costs (Gromov-Wasserstein steps) on the ``cpu`` and ``triton`` engines, through
their squared-Euclidean kernels (``flashot.ops.bilinear``: ``C_ij = |xh_i - yh_j|^2 + ox_i + oy_j``).

References are independent: the cost matrix ``u + v + phi M psi^T`` and logsumexp / matrix products
in torch (float64), the ``dense`` engine on the same GW problem, and POT.  ``triton`` runs under
the interpreter (``TRITON_INTERPRET=1``, set before the kernels are imported), on small problems.

Measured (float64): primitives ~1e-15 relative to the dense reference, GW value and plan products
~1e-14 relative to the ``dense`` engine; the tests ask for 1e-10 (engines) and 1e-6 (POT).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np
import pytest
import torch

import flashot
from flashot.costs import FeatureBilinearCost
from flashot.ops import Capability, get_engine
from flashot.ops.bilinear import BilinearAdapter, split_bilinear
from references import softmin

ot = pytest.importorskip("ot")

# tiny problems, thousands of inner iterations: one intra-op thread is faster, and much faster on a loaded machine
pytestmark = pytest.mark.usefixtures("one_thread")

CPU = torch.device("cpu")
REG = 0.03


def _engine(name: str, dtype=torch.float64):
    cost = FeatureBilinearCost(torch.zeros(1, 2, 2, dtype=dtype))
    if name == "triton":
        pytest.importorskip("triton")
    try:
        eng = get_engine(name, device=CPU, dtype=dtype, cost=cost)
    except ValueError as e:  # the cpu engine could not be built here
        pytest.skip(str(e))
    if eng.name != name:
        pytest.skip(f"backend {name!r} fell back to {eng.name!r}")
    return eng


def _bilinear(B=2, N=37, M=29, p=5, q=4, seed=7, shift=0.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(B, N, generator=g, dtype=torch.float64)
    v = torch.randn(B, M, generator=g, dtype=torch.float64)
    phi = torch.randn(B, N, p, generator=g, dtype=torch.float64) + shift
    psi = torch.randn(B, M, q, generator=g, dtype=torch.float64) - shift
    Mm = 0.3 * torch.randn(B, p, q, generator=g, dtype=torch.float64)
    C = u.unsqueeze(-1) + v.unsqueeze(-2) + phi @ Mm @ psi.transpose(-1, -2)
    cost, s, t = FeatureBilinearCost.pair(u, phi, v, psi, Mm)
    return FeatureBilinearCost(cost.S.to(dtype)), s.to(dtype), t.to(dtype), C


def _rel(got, ref) -> float:
    got, ref = torch.as_tensor(got).double(), torch.as_tensor(ref).double()
    return float((got - ref).abs().max() / ref.abs().max())


def test_split_reproduces_the_cost_in_low_dimension():
    cost, s, t, C = _bilinear(p=5, q=4)
    sp = split_bilinear(s, t, cost.S)
    assert sp.xh.shape == (2, 37, 4) and sp.yh.shape == (2, 29, 4)  # rank <= min(p, q)
    C2 = ((sp.xh.unsqueeze(-2) - sp.yh.unsqueeze(-3)) ** 2).sum(-1) + sp.ox.unsqueeze(-1) + sp.oy.unsqueeze(-2)
    assert _rel(C2, C) < 1e-13
    # the transposed pair is the same split, sides swapped
    spt = split_bilinear(t, s, cost.S)
    C3 = ((spt.xh.unsqueeze(-2) - spt.yh.unsqueeze(-3)) ** 2).sum(-1) + spt.ox.unsqueeze(-1) + spt.oy.unsqueeze(-2)
    assert _rel(C3, C.transpose(-1, -2)) < 1e-13
    # a rank-1 M (and a constant feature column): one dimension
    u, v = torch.zeros(1, 10, dtype=torch.float64), torch.zeros(1, 12, dtype=torch.float64)
    phi = torch.cat([torch.ones(1, 10, 1, dtype=torch.float64), torch.randn(1, 10, 2, dtype=torch.float64)], -1)
    psi = torch.randn(1, 12, 3, dtype=torch.float64)
    M1 = torch.outer(torch.tensor([1.0, 2.0, -1.0]), torch.tensor([0.5, 0.0, 1.0])).double().unsqueeze(0)
    c1, s1, t1 = FeatureBilinearCost.pair(u, phi, v, psi, M1)
    sp1 = split_bilinear(s1, t1, c1.S)
    assert sp1.xh.shape[-1] == 1
    C1 = phi @ M1 @ psi.transpose(-1, -2)
    C1s = ((sp1.xh.unsqueeze(-2) - sp1.yh.unsqueeze(-3)) ** 2).sum(-1) + sp1.ox.unsqueeze(-1) + sp1.oy.unsqueeze(-2)
    assert _rel(C1s, C1) < 1e-13


@pytest.mark.parametrize("name", ["cpu", "triton"])
def test_primitives_against_dense_reference(name):
    eng = _engine(name)
    assert (
        isinstance(eng, BilinearAdapter)
        and eng.unsupported(CPU, torch.float64, FeatureBilinearCost(torch.zeros(1, 2, 2, dtype=torch.float64))) is None
    )
    cost, s, t, C = _bilinear()
    eps = 0.7
    g = torch.Generator().manual_seed(8)
    h = torch.randn(2, 29, generator=g, dtype=torch.float64)
    hx = torch.randn(2, 37, generator=g, dtype=torch.float64)
    h[1, 3] = hx[0, 5] = float("-inf")  # zero weights contribute nothing
    ref = softmin(C, h, eps)
    ref_t = softmin(C.transpose(-1, -2), hx, eps)
    assert _rel(eng.softmin(s, t, h, eps, cost), ref) < 1e-12
    assert _rel(eng.softmin(t, s, hx, eps, cost), ref_t) < 1e-12
    if eng.supports(Capability.SOFTMIN_PAIR):
        f, gg = eng.softmin_pair(s, t, hx, h, eps, cost)
        assert _rel(f, ref) < 1e-12 and _rel(gg, ref_t) < 1e-12
    if eng.supports(Capability.SOFTMIN_ALT):
        lam = 0.8
        f, gg = eng.softmin_alt(s, t, hx, h, eps, cost, lam)
        ref_alt = softmin(C.transpose(-1, -2), hx + lam * ref / eps, eps)
        assert _rel(f, ref) < 1e-12 and _rel(gg, ref_alt) < 1e-12
    V = torch.randn(2, 29, 3, generator=g, dtype=torch.float64)
    U = torch.randn(2, 37, 2, generator=g, dtype=torch.float64)
    K = torch.exp(hx.unsqueeze(-1) + h.unsqueeze(-2) - C / eps)
    for weight, W in (("plan", 1.0), ("cost", C)):
        assert _rel(eng.plan_product(s, t, hx, h, eps, V, cost, weight), (K * W) @ V) < 1e-11
        assert _rel(eng.plan_product(t, s, h, hx, eps, U, cost, weight), (K * W).transpose(-1, -2) @ U) < 1e-11
    with pytest.raises(NotImplementedError, match="dcost"):
        eng.plan_product(s, t, hx, h, eps, V, cost, "dcost")


@pytest.mark.parametrize("name", ["cpu", "triton"])
def test_float32_cancellation_no_worse_than_dense(name):
    """Features far from the origin (|phi| ~ 30): the split's float32 error stays within a small factor
    of the dense engine's on the same float32 inputs (both against the float64 matrix)."""
    eng = _engine(name, torch.float32)
    dense = get_engine("dense", device=CPU, dtype=torch.float32, cost=FeatureBilinearCost(torch.zeros(1, 2, 2)))
    cost, s, t, _ = _bilinear(shift=30.0, dtype=torch.float32)
    C = cost.matrix(s.double(), t.double())  # the float32 inputs, exactly, in float64
    eps = 0.05 * float(C.std())
    h = torch.zeros(2, 29, dtype=torch.float32)
    ref = -eps * torch.logsumexp(-C / eps, -1)
    e_eng = _rel(eng.softmin(s, t, h, eps, cost), ref)
    e_dense = _rel(dense.softmin(s, t, h, eps, cost), ref)
    assert e_eng < 1e-5 and e_eng <= 10 * e_dense + 1e-6, (e_eng, e_dense)
    V = torch.rand(2, 29, 2, dtype=torch.float32)
    f = ref.float()
    alpha, beta = f / eps, torch.zeros(2, 29, dtype=torch.float32)
    K = torch.exp(alpha.double().unsqueeze(-1) - C / eps)
    refp = K @ V.double()
    e_eng = _rel(eng.plan_product(s, t, alpha, beta, eps, V, cost), refp)
    e_dense = _rel(dense.plan_product(s, t, alpha, beta, eps, V, cost), refp)
    assert e_eng < 1e-3 and e_eng <= 10 * e_dense + 1e-5, (e_eng, e_dense)


def _clouds(n=30, m=45, dx=3, dy=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, dx, generator=g, dtype=torch.float64), torch.rand(m, dy, generator=g, dtype=torch.float64))


def _pot(X, Y, reg, **kw):
    C1 = (torch.cdist(X, X) ** 2).numpy()
    C2 = (torch.cdist(Y, Y) ** 2).numpy()
    return ot.gromov.entropic_gromov_wasserstein(
        C1, C2, None, None, "square_loss", epsilon=reg, log=True, stopThr=1e-12, numItermax=5000, **kw
    )


def test_gw_cpu_matches_dense_and_pot():
    _engine("cpu")
    X, Y = _clouds(20, 25, seed=5)  # a real matching in 3440 inner iterations (30 x 45, seed 0: 5560)
    kw = {"reg": REG, "inner_tol": 1e-12, "inner_max_iter": 5000}
    rc = flashot.gromov_wasserstein(X, Y, backend="cpu", **kw)
    rd = flashot.gromov_wasserstein(X, Y, backend="dense", **kw)
    assert rc.backend == "cpu" and rc.converged and rc.inner_converged
    assert rc.n_outer == rd.n_outer and rc.n_inner == rd.n_inner
    assert abs(float(rc.value) - float(rd.value)) <= 1e-10 * float(rd.value)
    V = torch.randn(Y.shape[0], 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    assert _rel(rc.plan @ V, rd.plan @ V) < 1e-10
    T, log = _pot(X, Y, REG)
    assert abs(float(rc.value) - log["gw_dist"]) <= 1e-6 * log["gw_dist"]
    assert _rel(rc.plan @ V, T @ V.numpy()) < 1e-6
    assert _rel(rc.plan.to_dense(), T) < 1e-6
    assert abs(rc.value_entropic - rd.value_entropic) <= 1e-9 * abs(rd.value_entropic)


def test_fused_gw_cpu_matches_pot():
    _engine("cpu")
    X, Y = _clouds(seed=5)
    g = torch.Generator().manual_seed(6)
    FX, FY = torch.rand(30, 2, generator=g, dtype=torch.float64), torch.rand(45, 2, generator=g, dtype=torch.float64)
    C1, C2 = (torch.cdist(X, X) ** 2).numpy(), (torch.cdist(Y, Y) ** 2).numpy()
    M = (torch.cdist(FX, FY) ** 2).numpy()
    T, log = ot.gromov.entropic_fused_gromov_wasserstein(
        M, C1, C2, epsilon=REG, alpha=0.5, log=True, stopThr=1e-12, numItermax=5000
    )
    r = flashot.fused_gromov_wasserstein(
        X, Y, FX, FY, reg=REG, alpha=0.5, backend="cpu", inner_tol=1e-12, inner_max_iter=5000
    )
    assert r.backend == "cpu" and r.converged
    assert abs(float(r.value) - log["fgw_dist"]) <= 1e-6 * log["fgw_dist"]
    assert _rel(r.plan.to_dense(), T) < 1e-6


def test_gw_triton_matches_dense_and_pot():
    """Small and quickly converging (the interpreter runs ~60 ms per kernel call, ~22 calls per outer
    iteration): the outer tol 1e-5 (POT's too) stops both at outer iteration 11, where |T - T_prev| = 8.7e-7
    (at 1e-8 they ran 21)."""
    _engine("triton")
    X, Y = _clouds(12, 15, seed=3)
    reg = 0.3
    kw = {"reg": reg, "inner_tol": 1e-11, "inner_max_iter": 2000, "tol": 1e-5}
    rt = flashot.gromov_wasserstein(X, Y, backend="triton", **kw)
    rd = flashot.gromov_wasserstein(X, Y, backend="dense", **kw)
    assert rt.backend == "triton" and rt.converged and rt.n_outer == rd.n_outer
    assert abs(float(rt.value) - float(rd.value)) <= 1e-10 * float(rd.value)
    V = torch.randn(15, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    assert _rel(rt.plan @ V, rd.plan @ V) < 1e-10
    T, log = _pot(X, Y, reg, tol=kw["tol"])  # POT's outer tolerance (stopThr is its inner one)
    assert len(log["err"]) == len(rt.log["err"]) == 2
    assert abs(float(rt.value) - log["gw_dist"]) <= 1e-6 * log["gw_dist"]
    assert _rel(rt.plan.to_dense(), T) < 1e-6


@pytest.mark.parametrize("name", ["cpu", "triton"])
def test_semirelaxed_fused_matches_dense(name):
    """Semi-relaxed fused GW (one softmin and two plan products per mirror step) on the ``cpu`` and ``triton``
    (interpreter) engines against ``dense``: 21 steps (three change checks), float64."""
    _engine(name)
    X, Y = _clouds(12, 15, seed=4)
    g = torch.Generator().manual_seed(5)
    FX, FY = torch.rand(12, 2, generator=g, dtype=torch.float64), torch.rand(15, 2, generator=g, dtype=torch.float64)
    kw = {"reg": 0.05, "alpha": 0.6, "max_iter": 21, "tol": 1e-12}
    rt = flashot.semirelaxed_fused_gromov_wasserstein(X, Y, FX, FY, backend=name, **kw)
    rd = flashot.semirelaxed_fused_gromov_wasserstein(X, Y, FX, FY, backend="dense", **kw)
    assert rt.backend == name and rt.n_outer == rd.n_outer == 21
    assert abs(float(rt.value) - float(rd.value)) <= 1e-10 * float(rd.value)
    np.testing.assert_allclose(rt.log["err"], rd.log["err"], rtol=1e-5)  # the expansion cancels: ~3e-7 measured
    V = torch.randn(15, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    assert _rel(rt.plan @ V, rd.plan @ V) < 1e-10
    assert (
        _rel(rt.plan.T @ torch.ones(12, dtype=torch.float64), rd.plan.T @ torch.ones(12, dtype=torch.float64)) < 1e-10
    )


def test_gw_float32_cpu_close_to_float64():
    _engine("cpu")
    X, Y = _clouds(seed=13)
    X, Y = 10 * X + 100, 10 * Y - 40  # far from the origin, larger scale
    kw = {"reg": REG * 1e4, "max_iter": 31}  # the same 31 outer steps in each run
    r64 = flashot.gromov_wasserstein(X, Y, backend="dense", **kw)
    r32 = flashot.gromov_wasserstein(X.float(), Y.float(), backend="cpu", **kw)
    rd32 = flashot.gromov_wasserstein(X.float(), Y.float(), backend="dense", **kw)
    assert r32.n_outer == r64.n_outer == 31 and r32.value.dtype == torch.float32
    assert abs(float(r32.value) - float(r64.value)) <= 1e-5 * float(r64.value)
    V = torch.randn(Y.shape[0], 2, dtype=torch.float64)
    e_cpu = _rel(r32.plan @ V.float(), r64.plan @ V)
    e_dense = _rel(rd32.plan @ V.float(), r64.plan @ V)
    assert e_cpu < 2e-3 and e_cpu <= 10 * e_dense + 1e-4, (e_cpu, e_dense)


def test_gw_gradients_cpu_finite_differences():
    _engine("cpu")
    # 1450 inner iterations per solve (seed 6: 2090); |fd - grad| ~1e-10 max |grad| (measured)
    X, Y = _clouds(15, 18, seed=4)
    kw = {"reg": 0.1, "inner_tol": 1e-13, "inner_max_iter": 10000, "tol": 1e-13, "backend": "cpu"}
    Xg, Yg = X.clone().requires_grad_(), Y.clone().requires_grad_()
    r = flashot.gromov_wasserstein(Xg, Yg, **kw)
    r.value.backward()
    h = 1e-5
    for pts, grad, which, (i, d) in ((X, Xg.grad, "x", (3, 1)), (Y, Yg.grad, "y", (11, 0))):
        vals = []
        for sgn in (1, -1):
            P = pts.clone()
            P[i, d] += sgn * h
            Xp, Yp = (P, Y) if which == "x" else (X, P)
            vals.append(flashot.gromov_wasserstein(Xp, Yp, **kw).value_entropic)
        fd = (vals[0] - vals[1]) / (2 * h)
        assert abs(fd - float(grad[i, d])) <= 1e-6 * float(grad.abs().max()), (which, fd, float(grad[i, d]))


def test_auto_picks_the_cpu_engine_for_large_problems():
    eng = _engine("cpu")
    cost, s, _, _ = _bilinear()
    big = (1, 50_000, 50_000, s.shape[-1])
    auto = get_engine("auto", device=CPU, dtype=torch.float32, cost=cost, size=big)
    assert auto.name == "cpu" and isinstance(auto, BilinearAdapter) and auto.inner is eng.inner
    small = (1, 20, 20, s.shape[-1])
    assert get_engine("auto", device=CPU, dtype=torch.float64, cost=cost, size=small).name == "dense"
    # other costs pass through the adapter unchanged
    sq = flashot.get_cost("sqeuclidean")
    x, y = torch.randn(1, 5, 2, dtype=torch.float64), torch.randn(1, 6, 2, dtype=torch.float64)
    h = torch.zeros(1, 6, dtype=torch.float64)
    assert torch.equal(eng.softmin(x, y, h, 0.5, sq), eng.inner.softmin(x, y, h, 0.5, sq))
    X, Y = _clouds(8, 9)
    assert np.isfinite(float(flashot.gromov_wasserstein(X, Y, reg=REG, backend="cpu", max_iter=2).value))


@pytest.mark.parametrize("backend", ["dense", "tiled", "cpu"])
def test_solve_sample_takes_a_feature_bilinear_cost(backend):
    """``solve_sample(s, t, cost=FeatureBilinearCost)`` on the augmented points (not centred): the plan is
    POT's ``ot.sinkhorn`` on the dense cost matrix, on every engine."""
    if backend == "cpu":
        _engine("cpu")
    cost, s, t, C = _bilinear(B=1, N=40, M=50, shift=2.0)
    a, b = np.full(40, 1 / 40), np.full(50, 1 / 50)
    T = ot.sinkhorn(a, b, C[0].numpy(), 1.0, stopThr=1e-13, numItermax=20000)
    r = flashot.solve_sample(s[0], t[0], reg=1.0, cost=cost, backend=backend, tol=1e-12, max_iter=20000)
    assert r.converged and r.backend == backend
    assert _rel(r.plan.to_dense(), T) < 1e-9
    assert abs(float(r.value_linear) - float((C[0].numpy() * T).sum())) < 1e-9 * float(C.abs().max())
    sg = s[0].clone().requires_grad_()  # gradients w.r.t. the augmented points (tests/core/test_bilinear_grad.py)
    flashot.solve_sample(sg, t[0], reg=1.0, cost=cost, backend=backend, tol=1e-12, max_iter=20000).value.backward()
    torch.testing.assert_close(sg.grad[:, 0], torch.full((40,), 1 / 40, dtype=torch.float64), rtol=1e-9, atol=0)
