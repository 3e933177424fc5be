"""solve_sample against POT (dense log-domain Sinkhorn and lazy solve_sample)."""

import numpy as np
import pytest
import torch

ot = pytest.importorskip("ot")

import flashot  # noqa: E402 - after the importorskip
from conftest import rel_err  # noqa: E402 - after the importorskip


def _np_problem(N=80, M=60, D=2, seed=0):
    rng = np.random.default_rng(seed)
    xa = rng.normal(size=(N, D))
    xb = rng.normal(size=(M, D)) * 0.7 + 0.5
    a = rng.random(N) + 0.2
    b = rng.random(M) + 0.2
    return xa, xb, a / a.sum(), b / b.sum()


@pytest.mark.parametrize("method", ["sinkhorn", "symmetric"])
@pytest.mark.parametrize("backend", ["dense", "tiled"])
def test_matches_pot_solve(method, backend):
    xa, xb, a, b = _np_problem()
    reg = 0.2
    res = flashot.solve_sample(xa, xb, a, b, reg=reg, tol=1e-11, max_iter=5000, method=method, backend=backend)
    assert res.converged
    M = ot.dist(xa, xb)  # squared Euclidean
    ref = ot.solve(M, a, b, reg=reg, max_iter=5000, tol=1e-12)
    assert isinstance(res.value, float)
    assert abs(res.value - float(ref.value)) < 1e-8 * abs(float(ref.value))
    assert abs(res.value_linear - float(ref.value_linear)) < 1e-8 * abs(float(ref.value_linear))
    P = res.plan.to_dense()
    assert isinstance(P, np.ndarray) and P.shape == (80, 60)
    assert np.abs(P - ref.plan).max() < 1e-9 * ref.plan.max() + 1e-14
    ra, rb = res.marginals
    assert np.abs(ra - a).sum() < 1e-9 and np.abs(rb - b).sum() < 1e-9
    # potentials: POT returns (log u, log v) with P = diag(u) K diag(v), so
    # f = reg (log u - log a); unique up to a constant shift (f + c, g - c)
    f, g = res.potentials
    fp, gp = reg * (ref.potentials[0] - np.log(a)), reg * (ref.potentials[1] - np.log(b))
    shift = (f - fp).mean()
    assert np.abs(f - fp - shift).max() < 1e-7 and np.abs(g - gp + shift).max() < 1e-7


def test_matches_pot_sinkhorn_log_fixed_iterations():
    """tol=None runs exactly max_iter iterations (benchmarks rely on it)."""
    xa, xb, a, b = _np_problem(seed=3)
    reg = 0.05
    # POT updates v (the b side) first; we update the first argument's potential first,
    # so solve the swapped problem: our (f, g) on (xb, xa) are POT's (v, u) scalings.
    # POT starts from u = 1 (log u = 0), i.e. our a-side potential = -reg log a.
    init = (np.zeros_like(b), -reg * np.log(a))
    res = flashot.solve_sample(xb, xa, b, a, reg=reg, tol=None, max_iter=7, potentials_init=init, acceleration=None)
    assert res.n_iter == 7
    M = ot.dist(xa, xb)
    _, log = ot.sinkhorn(a, b, M, reg, method="sinkhorn_log", numItermax=7, stopThr=0, log=True)
    u_pot = reg * (log["log_u"] - np.log(a))
    # our final step recomputes f from g and g from the previous f, which leaves g unchanged
    _, g = res.potentials
    assert np.abs(g - u_pot).max() < 1e-9


def test_matches_pot_lazy_solve_sample():
    xa, xb, a, b = _np_problem(N=150, M=120, D=3, seed=5)
    reg = 0.3
    ref = ot.solve_sample(xa, xb, a, b, reg=reg, lazy=True, max_iter=3000, tol=1e-12)
    res = flashot.solve_sample(xa, xb, a, b, reg=reg, tol=1e-11, max_iter=3000, backend="tiled")
    assert abs(res.value_linear - float(ref.value_linear)) < 1e-7 * abs(float(ref.value_linear))


def test_torch_inputs_differentiable_value():
    xa, xb, a, b = _np_problem()
    x = torch.tensor(xa, requires_grad=True)
    y = torch.tensor(xb)
    res = flashot.solve_sample(x, y, torch.tensor(a), torch.tensor(b), reg=0.2, tol=1e-11, max_iter=5000)
    assert isinstance(res.value, torch.Tensor) and res.value.requires_grad
    (gx,) = torch.autograd.grad(res.value, [x])
    # envelope theorem: grad_x OT = sum_j P_ij * 2 (x_i - y_j) = 2 (a_i x_i - (P y)_i)
    P = torch.tensor(ot.solve(ot.dist(xa, xb), a, b, reg=0.2, max_iter=5000, tol=1e-12).plan)
    ref = 2 * (torch.tensor(a)[:, None] * x.detach() - P @ y)
    assert rel_err(gx, ref) < 1e-7


def test_lazy_plan_operations_match_dense():
    xa, xb, a, b = _np_problem(N=50, M=40)
    res = flashot.solve_sample(torch.tensor(xa), torch.tensor(xb), reg=0.1, backend="tiled")
    P = res.plan.to_dense()
    V = torch.randn(40, 3, dtype=torch.float64)
    U = torch.randn(50, dtype=torch.float64)
    assert rel_err(res.plan @ V, P @ V) < 1e-12
    assert rel_err(res.plan.T @ U, P.T @ U) < 1e-12
    assert res.plan.shape == (50, 40) and res.plan.T.shape == (40, 50)
    C = torch.cdist(torch.tensor(xa), torch.tensor(xb)) ** 2
    assert rel_err(res.value_linear, (P * C).sum()) < 1e-12
    with pytest.raises(MemoryError, match="max_elems"):
        res.plan.to_dense(max_elems=100)
    with pytest.raises(ValueError, match="V"):
        res.plan @ torch.ones(41)


def test_batched_solve_matches_loop():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 40, 2, generator=g, dtype=torch.float64)
    y = torch.randn(3, 30, 2, generator=g, dtype=torch.float64)
    res = flashot.solve_sample(x, y, reg=0.1, tol=1e-10, backend="tiled")
    assert res.value.shape == (3,)
    for k in range(3):
        one = flashot.solve_sample(x[k], y[k], reg=0.1, tol=1e-10, backend="dense")
        assert rel_err(res.value[k], one.value) < 1e-9
    assert res.plan.shape == (3, 40, 30)
