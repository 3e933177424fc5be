"""Semi-relaxed entropic (fused) Gromov-Wasserstein: ``flashot.semirelaxed_gromov_wasserstein`` and
``semirelaxed_fused_gromov_wasserstein`` against POT's ``ot.gromov.entropic_semirelaxed_gromov_wasserstein`` and
``entropic_semirelaxed_fused_gromov_wasserstein`` (square loss, same epsilon, initial coupling ``a 1^T / m``, mirror
steps and stopping rule), invariances, envelope gradients against dense torch autograd at the returned coupling
and against finite differences, and bad input.

Measured (float64, n, m = 25-45, reg = 0.03-0.1): value ~1e-11 relative or better, dense plan ~5e-12, the changes
``|T - T_prev|_F`` within 3e-3 relative of POT's (mostly < 1e-4) until they reach the rounding floor of the
streamed measurement (~1e-7 in float64 once the coupling is nearly a hard assignment); the tests ask for 1e-6
(value, plan products), 1e-2 (changes) and use tolerances above that floor.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashot
from flashot.costs import FeatureBilinearCost
from flashot.ops import get_engine

ot = pytest.importorskip("ot")

REG = 0.03
TOL = 1e-6


def _clouds(n=30, m=45, dx=3, dy=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, dx, generator=g, dtype=torch.float64), torch.rand(m, dy, generator=g, dtype=torch.float64))


def _sq(Z: torch.Tensor) -> np.ndarray:
    return (torch.cdist(Z, Z) ** 2).numpy()


def _rel(u, v) -> float:
    u, v = np.asarray(u, dtype=np.float64), np.asarray(v, dtype=np.float64)
    return float(np.abs(u - v).max() / np.abs(v).max())


def _available(backend: str) -> None:
    if backend != "cpu":
        return
    try:
        eng = get_engine(
            "cpu",
            device=torch.device("cpu"),
            dtype=torch.float64,
            cost=FeatureBilinearCost(torch.zeros(1, 2, 2, dtype=torch.float64)),
        )
    except ValueError as e:  # the cpu engine could not be built here
        pytest.skip(str(e))
    if eng.name != "cpu":
        pytest.skip(f"backend 'cpu' fell back to {eng.name!r}")


def _same_run(r, log, dist: float, T: np.ndarray, a: np.ndarray) -> None:
    """Same outer iterations (POT's rule: |T - T_prev|_F read at 1, 11, 21, ...), value, plan and marginals."""
    assert r.converged
    assert len(r.log["err"]) == len(log["err"])
    assert r.n_outer == r.n_inner == 10 * (len(log["err"]) - 1) + 1 == len(r.log["value"])
    # the late checks are differences of nearly equal couplings: rounding-level differences (the cpu engine's
    # float64 softmin is within 4e-16 of dense) grow over the steps; measured on an AVX-512 Intel Xeon,
    # |T - T_prev| ~ 4e-6 came out 1.1% (4.3e-8) away from POT's, so the bound has an absolute part
    np.testing.assert_allclose(r.log["err"], log["err"], rtol=1e-2, atol=1e-6 * max(log["err"]))
    assert abs(float(r.value) - dist) <= 1e-6 * abs(dist)
    assert _rel(r.log["value"][-1], dist) < 1e-6
    m, n = T.shape[1], T.shape[0]
    V = torch.randn(m, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    U = torch.randn(n, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    assert _rel(r.plan @ V, T @ V.numpy()) < 1e-6
    assert _rel(r.plan.T @ U, T.T @ U.numpy()) < 1e-6
    assert _rel(r.plan.to_dense(), T) < 1e-6
    rows = r.plan @ torch.ones(m, dtype=torch.float64)
    np.testing.assert_allclose(rows.numpy(), a, rtol=1e-10)  # the constrained marginal
    # the free marginal moved away from uniform (a real semi-relaxed solution)
    q = T.sum(0)
    assert q.max() > 2.0 / m and q.min() < 0.5 / m


@pytest.mark.parametrize("backend", ["dense", "tiled"])
@pytest.mark.parametrize("weighted", [False, True])
def test_matches_pot(backend, weighted):
    X, Y = _clouds()
    a = None
    if weighted:
        a = torch.rand(X.shape[0], generator=torch.Generator().manual_seed(1), dtype=torch.float64) + 0.5
        a = a / a.sum()
    an = np.full(X.shape[0], 1 / X.shape[0]) if a is None else a.numpy()
    T, log = ot.gromov.entropic_semirelaxed_gromov_wasserstein(
        _sq(X), _sq(Y), an, "square_loss", epsilon=REG, tol=TOL, max_iter=10000, log=True
    )
    r = flashot.semirelaxed_gromov_wasserstein(X, Y, a, reg=REG, tol=TOL, backend=backend)
    assert r.backend == backend
    _same_run(r, log, log["srgw_dist"], T, an)


@pytest.mark.parametrize("backend", ["dense", "tiled", "cpu"])
def test_fused_matches_pot(backend):
    _available(backend)
    g = torch.Generator().manual_seed(1)
    X, Y = _clouds(25, 35, seed=1)
    FX = torch.rand(25, 4, generator=g, dtype=torch.float64)
    FY = torch.rand(35, 4, generator=g, dtype=torch.float64)
    a = torch.rand(25, generator=g, dtype=torch.float64) + 0.5
    a = a / a.sum()
    M = (torch.cdist(FX, FY) ** 2).numpy()
    T, log = ot.gromov.entropic_semirelaxed_fused_gromov_wasserstein(
        M, _sq(X), _sq(Y), a.numpy(), "square_loss", epsilon=0.05, alpha=0.3, tol=TOL, max_iter=10000, log=True
    )
    r = flashot.semirelaxed_fused_gromov_wasserstein(X, Y, FX, FY, a, reg=0.05, alpha=0.3, tol=TOL, backend=backend)
    assert r.backend == backend
    _same_run(r, log, log["srfgw_dist"], T, a.numpy())


def test_alpha_one_is_plain_and_alpha_zero_is_features_only():
    """``alpha = 1``: the features do not matter (plain srGW); ``alpha = 0``: one mirror step puts each row on the
    feature-nearest columns (the GW term is off), the value is ``<M, T>``."""
    X, Y = _clouds(12, 15, seed=8)
    g = torch.Generator().manual_seed(9)
    FX, FY = torch.rand(12, 2, generator=g, dtype=torch.float64), torch.rand(15, 2, generator=g, dtype=torch.float64)
    plain = flashot.semirelaxed_gromov_wasserstein(X, Y, reg=REG, tol=TOL)
    fused = flashot.semirelaxed_fused_gromov_wasserstein(X, Y, FX, FY, reg=REG, alpha=1.0, tol=TOL)
    assert plain.n_outer == fused.n_outer
    assert abs(float(plain.value) - float(fused.value)) <= 1e-10 * abs(float(plain.value))
    feat = flashot.semirelaxed_fused_gromov_wasserstein(X, Y, FX, FY, reg=REG, alpha=0.0, tol=TOL)
    T = feat.plan.to_dense()
    M = torch.cdist(FX, FY) ** 2
    assert abs(float(feat.value) - float((M * T).sum())) <= 1e-10 * float((M * T).sum())
    assert bool((T.argmax(1) == M.argmin(1)).all())


def test_invariance_rotation_reflection_translation():
    X, Y = _clouds(seed=4)
    r0 = flashot.semirelaxed_gromov_wasserstein(X, Y, reg=REG, tol=TOL)
    Q, _ = torch.linalg.qr(torch.randn(3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5)))
    Q[:, 0] = -Q[:, 0]  # a reflection too
    X2 = X @ Q.T + torch.tensor([3.0, -1.0, 0.5], dtype=torch.float64)
    Y2 = Y * torch.tensor([-1.0, 1.0], dtype=torch.float64) + 2.0
    r1 = flashot.semirelaxed_gromov_wasserstein(X2, Y2, reg=REG, tol=TOL)
    assert r0.n_outer == r1.n_outer
    assert abs(float(r1.value) - float(r0.value)) <= 1e-8 * abs(float(r0.value))
    V = torch.randn(Y.shape[0], 2, dtype=torch.float64)
    assert _rel(r1.plan @ V, r0.plan @ V) < 1e-6


def _srgw_dense(X, Y, T):
    DX, DY = torch.cdist(X, X) ** 2, torch.cdist(Y, Y) ** 2
    return ((DX[:, None, :, None] - DY[None, :, None, :]) ** 2 * T[:, :, None, None] * T).sum()


def test_gradients_dense_autograd_and_finite_differences():
    """``value.backward()`` is the gradient of the loss at the returned coupling (dense torch autograd of
    ``sum_ijkl (DX_ik - DY_jl)^2 T_ij T_kl`` with ``T`` fixed), which at the stationary point the mirror descent
    converges to is the derivative of the solved value (envelope theorem): central differences of re-solved
    problems agree to the accuracy of the stopping point."""
    X, Y = _clouds(20, 25, seed=6)
    kw = dict(reg=0.05, tol=1e-9, max_iter=20000)
    Xg, Yg = X.clone().requires_grad_(), Y.clone().requires_grad_()
    r = flashot.semirelaxed_gromov_wasserstein(Xg, Yg, **kw)
    assert r.value.requires_grad and r.converged
    r.value.backward()
    X2, Y2 = X.clone().requires_grad_(), Y.clone().requires_grad_()
    _srgw_dense(X2, Y2, r.plan.to_dense().detach()).backward()
    assert _rel(Xg.grad, X2.grad) < 1e-9 and _rel(Yg.grad, Y2.grad) < 1e-9
    h = 1e-5
    for P, grad, which, (i, d) in ((X, Xg.grad, "x", (0, 2)), (Y, Yg.grad, "y", (7, 1))):
        vals = []
        for sign in (1, -1):
            Q = P.clone()
            Q[i, d] += sign * h
            vals.append(
                float(flashot.semirelaxed_gromov_wasserstein(*((Q, Y) if which == "x" else (X, Q)), **kw).value)
            )
        fd = (vals[0] - vals[1]) / (2 * h)
        assert abs(fd - float(grad[i, d])) <= 1e-4 * float(grad.abs().max()), (which, fd, float(grad[i, d]))


def test_fused_gradients_dense_autograd():
    g = torch.Generator().manual_seed(11)
    X, Y = _clouds(15, 18, seed=10)
    FX, FY = torch.rand(15, 3, generator=g, dtype=torch.float64), torch.rand(18, 3, generator=g, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (X, Y, FX, FY)]
    r = flashot.semirelaxed_fused_gromov_wasserstein(*leaves, reg=0.05, alpha=0.4, tol=TOL)
    r.value.backward()
    T = r.plan.to_dense().detach()
    ref = [t.clone().requires_grad_() for t in (X, Y, FX, FY)]
    (0.4 * _srgw_dense(ref[0], ref[1], T) + 0.6 * (torch.cdist(ref[2], ref[3]) ** 2 * T).sum()).backward()
    for got, want in zip(leaves, ref):
        assert _rel(got.grad, want.grad) < 1e-9


def test_numpy_verbose_and_result(capsys):
    X, Y = _clouds(8, 9, seed=12)
    r = flashot.semirelaxed_gromov_wasserstein(X.numpy(), Y.numpy(), reg=REG, tol=TOL, verbose=True)
    assert isinstance(r.value, np.floating) and isinstance(r.plan @ np.ones(9), np.ndarray)
    assert r.potentials[0].shape == (8,) and r.potentials[1].shape == (9,)
    assert r.status == "converged" and r.backend == "dense"
    err = capsys.readouterr().err
    assert err.count("semirelaxed_gromov_wasserstein: outer") == r.n_outer
    with pytest.raises(NotImplementedError, match="value_entropic"):
        _ = r.value_entropic
    with torch.no_grad():
        Xg = X.clone().requires_grad_()
        assert not flashot.semirelaxed_gromov_wasserstein(Xg, Y, reg=REG, max_iter=3).value.requires_grad
    bary = r.plan.barycentric_map()
    assert bary.shape == (8, 2)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(reg=0.0), ValueError, "reg"),
        (dict(reg=REG, loss_fun="kl_loss"), ValueError, "square_loss"),
        (dict(reg=REG, G0="product"), NotImplementedError, "G0"),
        (dict(reg=REG, max_iter=0), ValueError, "max_iter"),
        (dict(reg=REG, tol=-1.0), ValueError, "tol"),
        (dict(reg=REG, backend=3), TypeError, "backend"),
        (dict(reg=REG, verbose="yes"), TypeError, "verbose"),
    ],
)
def test_bad_options(kwargs, exc, match):
    X, Y = _clouds(5, 6)
    with pytest.raises(exc, match=match):
        flashot.semirelaxed_gromov_wasserstein(X, Y, **kwargs)


def test_bad_inputs():
    X, Y = _clouds(5, 6)
    with pytest.raises(TypeError):
        flashot.semirelaxed_gromov_wasserstein(X, Y, None, None, reg=REG)  # no second marginal
    with pytest.raises(TypeError, match="same dtype"):
        flashot.semirelaxed_gromov_wasserstein(X, Y.float(), reg=REG)
    with pytest.raises(ValueError, match="a"):
        flashot.semirelaxed_gromov_wasserstein(X, Y, torch.ones(4, dtype=torch.float64) / 4, reg=REG)
    with pytest.raises(TypeError, match="numpy"):
        flashot.semirelaxed_gromov_wasserstein(X.numpy(), Y, reg=REG)
    with pytest.raises(ValueError, match="alpha"):
        flashot.semirelaxed_fused_gromov_wasserstein(X, Y, X, Y[:, :1].repeat(1, 3), reg=REG, alpha=1.5)
    with pytest.raises(ValueError, match="FX and FY"):
        flashot.semirelaxed_fused_gromov_wasserstein(X, Y, X[:4], Y[:, :1].repeat(1, 3), reg=REG)
    with pytest.raises(NotImplementedError, match="weights"):
        flashot.semirelaxed_gromov_wasserstein(X, Y, (torch.ones(5, dtype=torch.float64) / 5).requires_grad_(), reg=REG)


def test_float32_inputs_run_in_float64():
    """The iterate's exponents accumulate every step's cost: the solver computes in float64 whatever the inputs'
    dtype (float32 lost the plan entirely at this size) and returns float32 results equal to the float64 run's."""
    X, Y = _clouds(20, 25, seed=13)
    X32, Y32 = X.float(), Y.float()
    Xg = X32.clone().requires_grad_()
    r32 = flashot.semirelaxed_gromov_wasserstein(Xg, Y32, reg=REG, tol=TOL, backend="tiled")
    r64 = flashot.semirelaxed_gromov_wasserstein(X32.double(), Y32.double(), reg=REG, tol=TOL, backend="tiled")
    assert r32.n_outer == r64.n_outer  # (the float32 weights 1 / n differ from float64's by ~1e-8)
    np.testing.assert_allclose(r32.log["err"], r64.log["err"], rtol=1e-2)  # measured: ~4e-3 at the last check
    assert r32.value.dtype == torch.float32 and r32.potentials[0].dtype == torch.float32
    assert abs(float(r32.value.detach()) - float(r64.value)) <= 1e-6 * float(r64.value)
    V = torch.randn(25, 2)
    assert (r32.plan @ V).dtype == torch.float32
    assert _rel(r32.plan @ V, r64.plan @ V.double()) < 1e-6
    r32.value.backward()
    assert Xg.grad.dtype == torch.float32 and bool(torch.isfinite(Xg.grad).all())
