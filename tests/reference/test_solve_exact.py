"""``solve_sample`` and ``solve`` against the mathematics: values against the dense float64 oracle, their
gradients (points, weights, the cost matrix) and second derivatives against finite differences.

POT-style problems: cost ``|x - y|^2``, ``eps = reg``.  For unbalanced problems ``value`` is the objective
``<C, P> + reg KL(P | a x b) + rho_a KL(P 1 | a) + rho_b KL(P^T 1 | b)`` (generalised KL) at the returned
plan, equal at convergence to the dual optimum ``value_dual`` (POT 0.9's value differs: see
``tests/core/test_unbalanced.py``).
"""

from __future__ import annotations

import pytest
import torch

import flashot
import references as ref

pytestmark = pytest.mark.usefixtures("one_thread")

REG, N, M = 0.08, 13, 16
UNBALANCED = [None, 0.3, (0.3, 0.7), (0.25, None), (None, 0.4)]


def _data(ub, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(N, 2, generator=g, dtype=torch.float64)
    y = torch.rand(M, 2, generator=g, dtype=torch.float64) * 0.8 + 0.2
    a = torch.rand(N, generator=g, dtype=torch.float64) + 0.5
    b = torch.rand(M, generator=g, dtype=torch.float64) + 0.5
    ma, mb = (1.0, 1.0) if ub is None else (1.0, 1.0) if isinstance(ub, tuple) and None in ub else (1.2, 0.7)
    if isinstance(ub, tuple) and ub[0] is None:
        ma, mb = 1.0, 0.75  # a strict side a, a relaxed side b
    if isinstance(ub, tuple) and ub[1] is None:
        ma, mb = 0.75, 1.0
    return x, y, ma * a / a.sum(), mb * b / b.sum()


def _rhos(ub):
    return (None, None) if ub is None else ub if isinstance(ub, tuple) else (ub, ub)


def _exact(ub):
    rx, ry = _rhos(ub)
    return lambda x, y, a, b: ref.ot_value(x, y, a, b, REG, 2, rx, ry, half=False)


def _directions(x, a, balanced, seed=1):
    g = torch.Generator().manual_seed(seed)
    dx = torch.randn(x.shape, generator=g, dtype=torch.float64)
    da = torch.randn(a.shape, generator=g, dtype=torch.float64)
    return dx, (da - da.mean() if balanced else da)


def _close(got, want, scale, tol):
    assert abs(got - want) < tol * scale, (got, want)


@pytest.mark.parametrize("ub", UNBALANCED, ids=str)
@pytest.mark.parametrize("backend", ["dense", "cpu", "tiled"])
def test_solve_sample_value_and_gradients(ub, backend):
    x, y, a, b = _data(ub)
    xx, aa = x.clone().requires_grad_(), a.clone().requires_grad_()
    res = flashot.solve_sample(xx, y, aa, b, reg=REG, unbalanced=ub, tol=1e-12, max_iter=50_000, backend=backend)
    assert res.converged
    exact = _exact(ub)
    want = exact(x, y, a, b)
    _close(float(res.value.detach()), want, abs(want), 1e-9)
    _close(float(res.value_dual.detach()), want, abs(want), 1e-9)
    gx, ga = torch.autograd.grad(res.value, [xx, aa])
    dx, da = _directions(x, a, ub is None)
    fd_x = ref.finite_difference(lambda t: exact(t, y, a, b), x, dx)
    fd_a = ref.finite_difference(lambda t: exact(x, y, t, b), a, da, h=1e-6)
    _close(float((gx * dx).sum()), fd_x, float(gx.abs().sum() * dx.abs().max()), 1e-6)
    _close(float((ga * da).sum()), fd_a, float(ga.abs().sum() * da.abs().max()), 1e-6)


def test_value_linear_and_its_gradient():
    """``value_linear = <C, P*>`` and its x-gradient (implicit differentiation through the fixed point)."""
    x, y, a, b = _data(None)
    xx = x.clone().requires_grad_()
    res = flashot.solve_sample(xx, y, a, b, reg=REG, tol=1e-12, max_iter=50_000)

    def linear(t):
        s = ref.solve(ref.cost_matrix(t, y, half=False), a, b, REG)
        return float((ref.cost_matrix(t, y, half=False) * s.plan).sum())

    want = linear(x)
    _close(float(res.value_linear.detach()), want, want, 1e-9)
    (gx,) = torch.autograd.grad(res.value_linear, xx)
    dx, _ = _directions(x, a, True)
    _close(float((gx * dx).sum()), ref.finite_difference(linear, x, dx), float(gx.abs().sum() * dx.abs().max()), 1e-5)


def test_second_derivatives():
    """Hessian-vector product of the balanced value (``create_graph=True``) against finite differences of the
    oracle's envelope gradient ``2 sum_j P_ij (x_i - y_j)``."""
    x, y, a, b = _data(None)
    xx = x.clone().requires_grad_()
    res = flashot.solve_sample(
        xx, y, a, b, reg=REG, tol=1e-12, max_iter=50_000, implicit=flashot.ImplicitDiff(tol=1e-12, ridge=0.0)
    )
    (gx,) = torch.autograd.grad(res.value, xx, create_graph=True)
    v, w = _directions(x, a, True, seed=2)[0], _directions(x, a, True, seed=3)[0]
    (hv,) = torch.autograd.grad((gx * v).sum(), xx)

    def envelope(t):
        s = ref.solve(ref.cost_matrix(t, y, half=False), a, b, REG)
        return float((2 * (s.plan.sum(1, keepdim=True) * t - s.plan @ y) * w).sum())

    fd = ref.finite_difference(envelope, x, v)
    _close(float((hv * w).sum()), fd, float(hv.abs().sum() * w.abs().max()), 1e-6)


@pytest.mark.parametrize("ub", [None, 0.3, (None, 0.4)], ids=str)
def test_solve_matrix_value_and_gradient(ub):
    """``flashot.solve(M, a, b)`` (a precomputed matrix): value and d value / d M = P (envelope theorem)."""
    x, y, a, b = _data(ub)
    C = ref.cost_matrix(x, y, half=False)
    CC = C.clone().requires_grad_()
    res = flashot.solve(CC, a, b, reg=REG, unbalanced=ub, tol=1e-12, max_iter=50_000)
    rx, ry = _rhos(ub)
    s = ref.solve(C, a, b, REG, rx, ry)
    _close(float(res.value.detach()), s.dual, abs(s.dual), 1e-9)
    (gC,) = torch.autograd.grad(res.value, CC)
    assert float((gC - s.plan).abs().max()) < 1e-9 * float(s.plan.max())


def test_gromov_wasserstein_gradient_is_the_entropic_objectives():
    """``gromov_wasserstein``'s ``value`` carries the exact gradient of the entropic objective
    ``value_entropic = GW(T) + reg KL(T | a b^T)`` (envelope theorem at the stationary coupling; POT's
    convention for ``gw_dist``), checked by finite differences of ``value_entropic`` re-solved; it is not the
    derivative of ``value`` alone (the coupling moves), which the test shows too."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(9, 2, generator=g, dtype=torch.float64)
    Y = torch.randn(11, 3, generator=g, dtype=torch.float64)
    kw = dict(reg=10.0, tol=1e-11, inner_tol=1e-12, max_iter=5000, inner_max_iter=100_000)
    XX = X.clone().requires_grad_()
    res = flashot.gromov_wasserstein(XX, Y, **kw)
    assert res.converged
    (gX,) = torch.autograd.grad(res.value, XX)
    d = torch.randn(X.shape, generator=g, dtype=torch.float64)
    fd_e = ref.finite_difference(lambda t: float(flashot.gromov_wasserstein(t, Y, **kw).value_entropic), X, d)
    fd_v = ref.finite_difference(lambda t: float(flashot.gromov_wasserstein(t, Y, **kw).value), X, d)
    got = float((gX * d).sum())
    assert abs(got - fd_e) < 1e-6 * abs(fd_e), (got, fd_e)
    assert abs(got - fd_v) > 1e-3 * abs(fd_v)
