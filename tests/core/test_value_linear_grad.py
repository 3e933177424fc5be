"""``OTResult.value_linear`` = <C, P> is differentiable (implicit differentiation, flashot.values.LinearValueFn).

References: POT's ``ot.solve_sample`` / ``ot.solve`` with ``grad="autodiff"`` (backprop through its
log-domain Sinkhorn iterations, run to convergence) on float64 torch tensors, and central finite
differences of ``value_linear`` itself (float64, ``tol=1e-12``).  The weight gradients are defined up
to the gauge (a constant): they are compared after removing their mean (= along every mass-preserving
perturbation), and through mass-preserving finite differences.

Tolerances (measured on these problems, float64): with ``ImplicitDiff(ridge=0, tol=1e-14)`` flashot and
POT agree to ~1e-11 relative and to fourth-order finite differences to ~1e-11; the default ridge (1e-8)
alone moves the gradient by ~1e-7 relative, so the default-settings check uses 1e-5.  float32: 2e-3
(3e-4 measured) on the gradients, 2e-4 on the value.
The partial derivative at fixed potentials (no implicit correction) is off by O(1) (checked below), so
every check here fails without the correction.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashot

ot = pytest.importorskip("ot")

TIGHT = flashot.ImplicitDiff(tol=1e-14, max_iter=500, ridge=0.0)
KW64 = dict(tol=1e-13, max_iter=20000, implicit=TIGHT)


def _problem(N=30, M=25, D=2, seed=0, dtype=torch.float64, batch=()):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*batch, N, D, generator=g, dtype=torch.float64)
    y = torch.randn(*batch, M, D, generator=g, dtype=torch.float64) * 0.8 + 0.5
    a = torch.rand(*batch, N, generator=g, dtype=torch.float64) + 0.5
    b = torch.rand(*batch, M, generator=g, dtype=torch.float64) + 0.5
    a, b = a / a.sum(-1, keepdim=True), b / b.sum(-1, keepdim=True)
    return tuple(t.to(dtype) for t in (x, y, a, b))


def _flashot_grads(x, y, a, b, reg, cost="sqeuclidean", **kw):
    X, Y, A, B = (t.clone().requires_grad_() for t in (x, y, a, b))
    res = flashot.solve_sample(X, Y, A, B, reg=reg, cost=cost, **kw)
    v = res.value_linear
    return v.detach(), torch.autograd.grad(v.sum(), (X, Y, A, B))


def _pot_grads(x, y, a, b, reg, cost="sqeuclidean"):
    """POT, autodiff through its log-domain Sinkhorn iterations (converged: 1e-15, 20000 iterations)."""
    X, Y, A, B = (t.clone().requires_grad_() for t in (x, y, a, b))
    C = ot.dist(X, Y, metric="sqeuclidean" if cost == "half_sqeuclidean" else cost)
    if cost == "half_sqeuclidean":
        C = C / 2
    res = ot.solve(C, A, B, reg=reg, max_iter=20000, tol=1e-15, grad="autodiff")
    v = res.value_linear
    return v.detach(), torch.autograd.grad(v, (X, Y, A, B))


def _centred(t):
    return t - t.mean(-1, keepdim=True)


def _rel(u, v):
    return float((u - v).abs().max() / v.abs().max())


@pytest.mark.parametrize(
    "cost,reg", [("sqeuclidean", 0.5), ("sqeuclidean", 0.1), ("half_sqeuclidean", 0.2), ("euclidean", 0.3)]
)
def test_gradients_match_pot_autodiff(cost, reg):
    x, y, a, b = _problem()
    v, (gx, gy, ga, gb) = _flashot_grads(x, y, a, b, reg, cost, **KW64)
    rv, (rx, ry, ra, rb) = _pot_grads(x, y, a, b, reg, cost)
    assert abs(float(v) - float(rv)) < 1e-12 * abs(float(rv))
    assert _rel(gx, rx) < 1e-9
    assert _rel(gy, ry) < 1e-9
    assert _rel(_centred(ga), _centred(ra)) < 1e-9
    assert _rel(_centred(gb), _centred(rb)) < 1e-9


def test_the_implicit_correction_matters():
    """The partial derivative at fixed (f, g) (envelope-style, dense torch) is far from POT: the
    comparisons above test the correction, not just the first term."""
    x, y, a, b = _problem()
    reg = 0.5
    res = flashot.solve_sample(x, y, a, b, reg=reg, tol=1e-13, max_iter=20000)
    f, g = res.potentials
    X = x.clone().requires_grad_()
    C = ((X[:, None] - y[None]) ** 2).sum(-1)
    P = a[:, None] * b[None] * torch.exp((f[:, None] + g[None] - C) / reg)
    (partial,) = torch.autograd.grad((P * C).sum(), X)
    _, (rx, _, _, _) = _pot_grads(x, y, a, b, reg)
    assert _rel(partial, rx) > 1.0


def _value(x, y, a, b, reg, cost="sqeuclidean"):
    return float(flashot.solve_sample(x, y, a, b, reg=reg, cost=cost, tol=1e-12, max_iter=20000).value_linear)


def _fd(fun, h):
    """Fourth-order central difference of t -> fun(t) at 0."""
    return (8 * (fun(h) - fun(-h)) - (fun(2 * h) - fun(-2 * h))) / (12 * h)


@pytest.mark.parametrize("cost,reg", [("sqeuclidean", 0.3), ("half_sqeuclidean", 0.3), ("euclidean", 0.5)])
def test_gradients_match_finite_differences(cost, reg):
    x, y, a, b = _problem(N=20, M=16, seed=1)
    _, (gx, gy, ga, gb) = _flashot_grads(x, y, a, b, reg, cost, **KW64)
    h = 1e-3
    gen = torch.Generator().manual_seed(5)
    dx, dy = torch.randn(x.shape, generator=gen, dtype=x.dtype), torch.randn(y.shape, generator=gen, dtype=y.dtype)
    # mass-preserving weight perturbations (sum zero), |da| <= min(a): the steps (up to 2 x 0.02) keep a > 0
    da, db = (
        _centred(torch.randn(a.shape, generator=gen, dtype=a.dtype)),
        _centred(torch.randn(b.shape, generator=gen, dtype=b.dtype)),
    )
    da, db = da * float(a.min()) / float(da.abs().max()), db * float(b.min()) / float(db.abs().max())
    hw = 2e-2
    checks = [
        (_fd(lambda t: _value(x + t * dx, y, a, b, reg, cost), h), float((gx * dx).sum())),
        (_fd(lambda t: _value(x, y + t * dy, a, b, reg, cost), h), float((gy * dy).sum())),
        (_fd(lambda t: _value(x, y, a + t * da, b, reg, cost), hw), float((ga * da).sum())),
        (_fd(lambda t: _value(x, y, a, b + t * db, reg, cost), hw), float((gb * db).sum())),
    ]
    for fd, an in checks:
        assert abs(fd - an) < 1e-7 * max(abs(an), 1e-2), (fd, an)


def test_batched_matches_pot_per_problem():
    x, y, a, b = _problem(N=18, M=14, batch=(3,), seed=2)
    reg = 0.25
    v, (gx, gy, ga, gb) = _flashot_grads(x, y, a, b, reg, **KW64)
    assert v.shape == (3,)
    for k in range(3):
        rv, (rx, ry, ra, rb) = _pot_grads(x[k], y[k], a[k], b[k], reg)
        assert abs(float(v[k]) - float(rv)) < 1e-12 * abs(float(rv))
        assert _rel(gx[k], rx) < 1e-9 and _rel(gy[k], ry) < 1e-9
        assert _rel(_centred(ga[k]), _centred(ra)) < 1e-9 and _rel(_centred(gb[k]), _centred(rb)) < 1e-9


def test_default_settings_within_1e5():
    """Default ImplicitDiff (tol 1e-6, ridge 1e-8) and default solver tol."""
    x, y, a, b = _problem(seed=3)
    reg = 0.2
    _, (gx, gy, ga, gb) = _flashot_grads(x, y, a, b, reg)
    _, (rx, ry, ra, rb) = _pot_grads(x, y, a, b, reg)
    assert _rel(gx, rx) < 1e-5 and _rel(gy, ry) < 1e-5
    assert _rel(_centred(ga), _centred(ra)) < 1e-5 and _rel(_centred(gb), _centred(rb)) < 1e-5


def test_float32():
    """float32 inputs (float32 solve and plan products) against POT in float64: 2e-3 relative."""
    x, y, a, b = _problem(N=40, M=30, seed=4)
    reg = 0.1
    x32, y32, a32, b32 = (t.float() for t in (x, y, a, b))
    v, (gx, gy, ga, gb) = _flashot_grads(x32, y32, a32, b32, reg)
    assert v.dtype == torch.float32 and gx.dtype == torch.float32 and ga.dtype == torch.float32
    rv, (rx, ry, ra, rb) = _pot_grads(x, y, a, b, reg)
    # the float32 solve stops at its rounding floor (L1 marginal error ~5e-5 here, not tol=1e-6): <C, P>,
    # unlike the stationary value, moves with it (7e-5 relative measured)
    assert abs(float(v) - float(rv)) < 2e-4 * abs(float(rv))
    assert _rel(gx.double(), rx) < 2e-3 and _rel(gy.double(), ry) < 2e-3
    assert _rel(_centred(ga.double()), _centred(ra)) < 2e-3 and _rel(_centred(gb.double()), _centred(rb)) < 2e-3


def test_only_the_inputs_that_require_grad():
    x, y, a, b = _problem(seed=6)
    X = x.clone().requires_grad_()
    res = flashot.solve_sample(X, y, a, b, reg=0.3, **KW64)
    (gx,) = torch.autograd.grad(res.value_linear, X)
    _, (rx, _, _, _) = _pot_grads(x, y, a, b, 0.3)
    assert _rel(gx, rx) < 1e-9


def test_detach_and_no_grad_inputs():
    x, y, a, b = _problem(seed=7)
    X = x.clone().requires_grad_()
    res = flashot.solve_sample(X, y, a, b, reg=0.3, grad="detach")
    assert not res.value_linear.requires_grad
    res = flashot.solve_sample(x, y, a, b, reg=0.3)
    assert not res.value_linear.requires_grad
    ref = flashot.solve_sample(X, y, a, b, reg=0.3).value_linear
    assert ref.requires_grad and float(ref.detach()) == pytest.approx(float(res.value_linear), rel=1e-12)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_numpy_scalar(dtype):
    x, y, a, b = (t.numpy().astype(dtype) for t in _problem(seed=8))
    v = flashot.solve_sample(x, y, a, b, reg=0.3).value_linear
    assert isinstance(v, np.generic) and v.dtype == dtype


def test_unbalanced_gradient_raises():
    x, y, a, b = _problem(seed=9)
    X = x.clone().requires_grad_()
    res = flashot.solve_sample(X, y, a, b, reg=0.3, unbalanced=1.0)
    v = res.value_linear
    assert v.requires_grad and torch.isfinite(v.detach())  # the value itself is available
    assert float(v.detach()) == pytest.approx(
        float(flashot.solve_sample(x, y, a, b, reg=0.3, unbalanced=1.0).value_linear), rel=1e-12
    )
    with pytest.raises(NotImplementedError, match="unbalanced"):
        v.backward()
