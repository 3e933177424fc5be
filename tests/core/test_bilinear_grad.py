"""Gradients through ``solve_sample(s, t, cost=FeatureBilinearCost)`` w.r.t. the augmented points.

``C(s_i, t_j) = s_i0 + t_j0 + <s'_i, S t'_j>`` is not translation invariant; ``grad_s C(s_i, t_j) = [1, S t'_j]``
is linear in ``t_j``, so ``d value / d s_i = sum_j P_ij [1, S t'_j]`` is one plan product.  References:
dense torch autograd of ``<P, C(s, t)>`` at the returned plan (the envelope theorem: the entropic OT
value's derivative w.r.t. the cost matrix is the plan), ``torch.logsumexp`` for the softmin primitive,
and central finite differences of re-solved problems.

Measured (float64, N, M = 23, 19, reg = 0.5): gradients ~1e-15 (``dense``, ``tiled``) and ~1e-14 (``cpu``)
relative to the dense reference; the tests ask for 1e-9 there and 1e-6 against finite differences (step 1e-5).
"""

from __future__ import annotations

import pytest
import torch

import flashot
from flashot import ops
from flashot.costs import FeatureBilinearCost
from flashot.ops import get_engine

REG = 0.5
KW = dict(reg=REG, tol=1e-13, max_iter=20000)


def _problem(N=23, M=19, p=4, q=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return r(N), r(N, p), r(M), r(M, q), 0.3 * r(p, q)


def _augmented(u, phi, v, psi, Mm):
    cost, s, t = FeatureBilinearCost.pair(u[None], phi[None], v[None], psi[None], Mm[None])
    return cost, s[0], t[0]


def _available(backend: str) -> None:
    if backend == "cpu":
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


def _rel(got, ref) -> float:
    return float((got - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("backend", ["dense", "tiled", "cpu"])
def test_value_gradient_against_dense_autograd(backend):
    """``value.backward()`` equals autograd of ``<P, C(s, t)>`` with the plan held fixed (dense torch)."""
    _available(backend)
    cost, s, t = _augmented(*_problem())
    sg, tg = s.clone().requires_grad_(), t.clone().requires_grad_()
    r = flashot.solve_sample(sg, tg, cost=cost, backend=backend, **KW)
    assert r.converged and r.backend == backend
    r.value.backward()
    P = r.plan.to_dense().detach()
    s2, t2 = s.clone().requires_grad_(), t.clone().requires_grad_()
    (P * cost.matrix(s2[None], t2[None])[0]).sum().backward()
    assert _rel(sg.grad, s2.grad) < 1e-9
    assert _rel(tg.grad, t2.grad) < 1e-9
    # the bias coordinate's gradient is the marginal: a_i = 1 / N, b_j = 1 / M
    torch.testing.assert_close(sg.grad[:, 0], torch.full_like(s[:, 0], 1 / s.shape[0]), rtol=1e-9, atol=0)


@pytest.mark.parametrize("backend", ["dense", "tiled", "cpu"])
def test_gradient_through_features_finite_differences(backend):
    """Features built from points (``phi = [x, |x|^2]``, ``psi = y``): autograd through :meth:`pair`
    against central differences of re-solved problems."""
    _available(backend)
    g = torch.Generator().manual_seed(3)
    X = torch.randn(17, 2, generator=g, dtype=torch.float64)
    Y = torch.randn(15, 3, generator=g, dtype=torch.float64)
    Mm = 0.4 * torch.randn(1, 3, 3, generator=g, dtype=torch.float64)

    def value(X, Y):
        phi = torch.cat([X, (X * X).sum(-1, keepdim=True)], -1)
        cost, s, t = FeatureBilinearCost.pair(X[:, 0][None], phi[None], Y.sum(-1)[None], Y[None], Mm)
        return flashot.solve_sample(s[0], t[0], cost=cost, backend=backend, **KW).value

    Xg, Yg = X.clone().requires_grad_(), Y.clone().requires_grad_()
    value(Xg, Yg).backward()
    h = 1e-5
    for P, grad, which, (i, d) in ((X, Xg.grad, "x", (4, 1)), (Y, Yg.grad, "y", (9, 2))):
        vals = []
        for sign in (1, -1):
            Q = P.clone()
            Q[i, d] += sign * h
            vals.append(float(value(Q, Y) if which == "x" else value(X, Q)))
        fd = (vals[0] - vals[1]) / (2 * h)
        assert abs(fd - float(grad[i, d])) <= 1e-6 * float(grad.abs().max()), (which, fd, float(grad[i, d]))


@pytest.mark.parametrize("backend", ["dense", "tiled", "cpu"])
def test_softmin_primitive_gradients(backend):
    """``ops.softmin`` with a feature-bilinear cost: gradients w.r.t. ``x``, ``y`` and ``h`` against
    autograd of ``-eps logsumexp(h - C / eps)`` on the dense cost matrix."""
    _available(backend)
    cost, s, t = _augmented(*_problem(seed=5))
    h = torch.randn(t.shape[0], dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    w = torch.randn(s.shape[0], dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    leaves = [z.clone().requires_grad_() for z in (s, t, h)]
    (w * ops.softmin(*leaves, 0.7, cost=cost, backend=backend)).sum().backward()
    ref = [z.clone().requires_grad_() for z in (s, t, h)]
    C = cost.matrix(ref[0][None], ref[1][None])[0]
    (w * (-0.7 * torch.logsumexp(ref[2] - C / 0.7, -1))).sum().backward()
    for got, want in zip(leaves, ref):
        assert _rel(got.grad, want.grad) < 1e-10


def test_matrix_requiring_grad_and_value_linear_raise():
    u, phi, v, psi, Mm = _problem()
    cost, s, t = _augmented(u, phi, v, psi, Mm.clone().requires_grad_())
    with pytest.raises(NotImplementedError, match="matrix M"):
        flashot.solve_sample(s, t, cost=cost, backend="tiled", reg=REG)
    with torch.no_grad():  # without autograd the same cost solves
        assert flashot.solve_sample(s, t, cost=cost, backend="tiled", reg=REG).converged
    cost, s, t = _augmented(u, phi, v, psi, Mm)
    sg = s.clone().requires_grad_()
    r = flashot.solve_sample(sg, t, cost=cost, backend="tiled", reg=REG)
    with pytest.raises(NotImplementedError, match="value_linear"):
        r.value_linear.backward()
