"""Momentum / Anderson acceleration: same solution, fewer iterations, safeguards, validation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from flashot import Anderson, Momentum, solve_sample
from flashot.acceleration import Accelerator

ot = pytest.importorskip("ot")


pytestmark = pytest.mark.usefixtures("one_thread")


def _data(n=60, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 2, generator=g, dtype=torch.float64)
    y = 0.5 + 0.2 * torch.randn(n, 2, generator=g, dtype=torch.float64)
    return x, y


ACCS = [Momentum(1.5), Momentum(1.8), Anderson(5)]


@pytest.mark.parametrize("acc", ACCS, ids=repr)
@pytest.mark.parametrize("method", ["sinkhorn", "symmetric"])
@pytest.mark.parametrize("unbalanced", [None, 0.5])
def test_accelerated_solution_matches_pot(acc, method, unbalanced):
    x, y = _data(40)
    reg = 0.02
    res = solve_sample(
        x, y, reg=reg, tol=1e-10, max_iter=20_000, method=method, acceleration=acc, unbalanced=unbalanced
    )
    assert res.converged
    M = ot.dist(x.numpy(), y.numpy())
    a = b = np.full(40, 1 / 40)
    if unbalanced is None:
        P_ref = ot.sinkhorn(a, b, M, reg, method="sinkhorn_log", numItermax=100_000, stopThr=1e-13)
    else:
        P_ref = ot.unbalanced.sinkhorn_unbalanced(
            a, b, M, reg, unbalanced, method="sinkhorn_stabilized", numItermax=100_000, stopThr=1e-13
        )
    assert np.abs(res.plan.to_dense().numpy() - P_ref).max() < 1e-6 * P_ref.max()


@pytest.mark.parametrize("unbalanced", [None, 1.0])
def test_acceleration_cuts_iterations_at_small_eps(unbalanced):
    x, y = _data(80, seed=1)
    kw = dict(reg=0.005, tol=1e-6, max_iter=5000, inner_iterations=1, unbalanced=unbalanced)
    plain = solve_sample(x, y, acceleration=None, **kw)
    mom = solve_sample(x, y, acceleration=Momentum(1.6), **kw)
    aa = solve_sample(x, y, acceleration=Anderson(5), **kw)
    assert plain.converged and mom.converged and aa.converged
    assert mom.n_iter < 0.7 * plain.n_iter, (plain.n_iter, mom.n_iter)
    assert aa.n_iter < 0.7 * plain.n_iter, (plain.n_iter, aa.n_iter)


def test_batched_acceleration_matches_per_problem():
    x1, y1 = _data(30, seed=2)
    x2, y2 = _data(30, seed=3)
    X, Y = torch.stack([x1, x2]), torch.stack([y1, y2])
    for acc in (Momentum(1.7), Anderson(4)):
        rb = solve_sample(X, Y, reg=0.02, tol=1e-10, max_iter=20_000, acceleration=acc)
        for i, (x, y) in enumerate(((x1, y1), (x2, y2))):
            r = solve_sample(x, y, reg=0.02, tol=1e-10, max_iter=20_000)
            assert torch.allclose(rb.plan.to_dense()[i], r.plan.to_dense(), rtol=0, atol=1e-8)


def test_momentum_near_two_stays_stable():
    """omega = 1.99 oscillates; the safeguard shrinks it and the solve still converges."""
    x, y = _data(50, seed=4)
    res = solve_sample(x, y, reg=0.01, tol=1e-8, max_iter=20_000, acceleration=Momentum(1.99))
    assert res.converged
    f, g = res.potentials
    assert torch.isfinite(f).all() and torch.isfinite(g).all()


def test_safeguard_replaces_non_finite_momentum_step():
    acc = Accelerator(Momentum(1.5), 2, "cpu", torch.float64)
    plain = torch.ones(2, 3)
    cand = torch.tensor([[1.0, float("nan"), 2.0], [3.0, 4.0, 5.0]])
    out = acc.momentum_guard(cand, plain)
    assert torch.equal(out[0], plain[0]) and torch.equal(out[1], cand[1])


def test_safeguard_momentum_falls_back_when_error_grows():
    acc = Accelerator(Momentum(1.8, safeguard=1.0), 1, "cpu", torch.float64)
    w1 = acc.omega(torch.tensor([1.0]), 0.1)
    assert float(w1) == pytest.approx(1.8)  # first step accelerated
    w2 = acc.omega(torch.tensor([2.0]), 0.1)  # error grew after it: plain step, omega shrinks
    assert float(w2) == 1.0 and float(acc.w) == pytest.approx(1.4)
    w3 = acc.omega(torch.tensor([1.5]), 0.1)  # previous step was plain: accelerate again
    assert float(w3) == pytest.approx(1.4)
    w4 = acc.omega(torch.tensor([float("nan")]), 0.1)  # non-finite error: plain
    assert float(w4) == 1.0


def test_safeguard_anderson_restarts_when_error_grows():
    acc = Accelerator(Anderson(3), 1, "cpu", torch.float64)

    def T(z):  # linear contraction, fixed point 2
        return 0.5 * z + 1.0

    z = torch.zeros(1, 4, dtype=torch.float64)
    z1 = acc.extrapolate(z, T(z), torch.tensor([1.0]), 0.1)  # no history yet: plain step
    assert torch.allclose(z1, T(z))
    z2 = acc.extrapolate(z1, T(z1), torch.tensor([0.5]), 0.1)  # Anderson solves it exactly
    assert torch.allclose(z2, torch.full_like(z2, 2.0))
    assert bool(acc.prev_acc[0])
    # pretend the error grew after the extrapolated step: the plain image is returned
    bad = torch.full_like(z2, 7.0)
    z3 = acc.extrapolate(z2, bad, torch.tensor([5.0]), 0.1)
    assert torch.equal(z3, bad) and not bool(acc.prev_acc[0]) and int(acc.n_rejected) == 1


def test_anderson_history_resets_when_eps_changes():
    acc = Accelerator(Anderson(3), 1, "cpu", torch.float64)
    z = torch.zeros(1, 2, dtype=torch.float64)
    acc.extrapolate(z, z + 1, torch.tensor([1.0]), 0.1)
    out = acc.extrapolate(z + 1, z + 1.5, torch.tensor([0.5]), 0.05)
    assert torch.equal(out, z + 1.5) and len(acc.X) == 1


def test_acceleration_with_epsilon_scaling_samples_loss_path():
    """The loop accepts acceleration with a changing eps (history reset at each change)."""
    from flashot.measures import Measures
    from flashot.solver import sinkhorn_loop

    x, y = _data(30)
    m = Measures.build(x, y, None, None, cost="sqeuclidean", backend="dense")
    eps_list = [1.0, 0.5, 0.25, 0.1, 0.05] + [0.05] * 200
    plain = sinkhorn_loop(m, eps_list, symmetric=False)
    for acc in ACCS:
        st = sinkhorn_loop(m, eps_list, symmetric=False, acceleration=acc)
        fp, fa = plain.f - plain.f.mean(), st.f - st.f.mean()
        assert torch.allclose(fp, fa, atol=1e-8)


def test_bad_acceleration_arguments():
    x, y = _data(5)
    with pytest.raises(ValueError, match="omega"):
        Momentum(omega=2.0)
    with pytest.raises(ValueError, match="omega"):
        Momentum(omega=0.0)
    with pytest.raises(TypeError, match="omega"):
        Momentum(omega="fast")
    with pytest.raises(ValueError, match="Anderson.m"):
        Anderson(m=0)
    with pytest.raises(TypeError, match="Anderson.m"):
        Anderson(m=2.5)
    with pytest.raises(ValueError, match="reg"):
        Anderson(reg=-1.0)
    with pytest.raises(ValueError, match="safeguard"):
        Momentum(safeguard=0.5)
    with pytest.raises(TypeError, match="acceleration"):
        solve_sample(x, y, reg=0.1, acceleration="anderson")
    with pytest.raises(TypeError, match="acceleration"):
        solve_sample(x, y, reg=0.1, acceleration=5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        Momentum(1.5).omega = 1.2  # frozen


def test_anderson_not_steered_by_points_of_negligible_weight():
    """Anderson's least squares weigh each residual by its point's weight.  Unweighted, the potentials of
    grid points with Gaussian weights down to 1e-28 (whose moves do not change the plan) steered it to a
    stall at 25x plain Sinkhorn's marginal error at reg = 1.1e-5 cmax (GeomLoss' Bures test case)."""
    x = torch.linspace(-1, 2, 55, dtype=torch.float64)[:, None]
    y = torch.linspace(-1, 2, 57, dtype=torch.float64)[:, None]
    a = torch.exp(-0.5 * ((x[:, 0] - 0.5) / 0.17) ** 2)
    b = torch.exp(-0.5 * ((y[:, 0] - 0.4) / 0.2) ** 2)
    a, b = a / a.sum(), b / b.sum()
    kw = dict(reg=1e-4, max_iter=1000, eps_scaling=True)
    with pytest.warns(RuntimeWarning):  # plain iterations do not reach tol here
        plain = solve_sample(x, y, a, b, acceleration=None, **kw)
    aa = solve_sample(x, y, a, b, acceleration=Anderson(5), **kw)
    assert aa.converged and aa.error < 1e-2 * plain.error, (aa.error, plain.error)
