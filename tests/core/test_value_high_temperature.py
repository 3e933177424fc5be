"""The balanced ``value`` at any temperature: ``solve(M)`` and ``solve_sample`` from reg = 0.1 to
1e20 x the cost scale (issue 34, item 8).

In float64 a log-domain softmin ``-eps log sum_j b_j exp((g_j - C_ij) / eps)`` rounds its sum to
``1 +- 2^-53``, i.e. each potential to ``+- eps 2^-53``: ``<a, f> + <b, g>`` lost its digits from
``eps ~ 1e13 x cost`` (0.266 instead of 0.525 at 1e15, exactly 0 from 1e16, ``converged=True``).

Oracle: Sinkhorn in 80-digit arithmetic (mpmath) on the same float64 costs and weights, the
weights normalised to mass 1 (masses within rounding of 1 are 1: see
:func:`flashot.values.hot_value`), iterated until the potentials move by less than 1e-60, value
``<a, f> + <b, g>``; and the limit ``<M, a b^T>`` at reg -> inf.  Tolerance 1e-12 relative to the
cost scale (the stable value is accurate to a few rounding units of ``cmax``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashot

mpmath = pytest.importorskip("mpmath")

REGS = [1e-1, 1.0, 1e3, 1e6, 1e10, 1e13, 1e15, 1e16, 1e20]


def _oracle(C: np.ndarray, a: np.ndarray, b: np.ndarray, eps: float) -> float:
    """Balanced entropic OT value in 80-digit arithmetic (alternating Sinkhorn to 1e-60)."""
    with mpmath.workdps(80):
        C = [[mpmath.mpf(float(c)) for c in row] for row in C]
        a = [mpmath.mpf(float(v)) for v in a]
        b = [mpmath.mpf(float(v)) for v in b]
        sa, sb = sum(a), sum(b)
        a, b = [v / sa for v in a], [v / sb for v in b]
        e = mpmath.mpf(eps)
        n, m = len(a), len(b)
        f, g = [mpmath.mpf(0)] * n, [mpmath.mpf(0)] * m
        for _ in range(20000):
            f_new = [-e * mpmath.log(sum(b[j] * mpmath.exp((g[j] - C[i][j]) / e) for j in range(m))) for i in range(n)]
            g_new = [
                -e * mpmath.log(sum(a[i] * mpmath.exp((f_new[i] - C[i][j]) / e) for i in range(n))) for j in range(m)
            ]
            move = max(abs(u - v) for u, v in zip(f + g, f_new + g_new))
            f, g = f_new, g_new
            if move < mpmath.mpf(10) ** -60 * (1 + e):
                break
        else:
            raise AssertionError("the oracle did not converge")
        f = [-e * mpmath.log(sum(b[j] * mpmath.exp((g[j] - C[i][j]) / e) for j in range(m))) for i in range(n)]
        return float(sum(ai * fi for ai, fi in zip(a, f)) + sum(bj * gj for bj, gj in zip(b, g)))


def _matrix_problem():
    rng = np.random.RandomState(0)
    M = rng.rand(4, 5)
    b = rng.rand(5) + 0.1
    return M, np.full(4, 0.25), b / b.sum()


def test_solve_matrix_value_at_any_reg():
    """``solve(M)``: value within 1e-12 of the 80-digit oracle at every reg, tending to <M, a b^T>."""
    M, a, b = _matrix_problem()
    limit = float(a @ M @ b)
    for reg in REGS:
        res = flashot.solve(M, a, b, reg=reg, tol=1e-12, max_iter=100000)
        want = _oracle(M, a, b, reg)
        assert res.converged
        assert abs(float(res.value) - want) <= 1e-12 * M.max(), (reg, float(res.value), want)
        assert abs(float(res.value_dual) - want) <= 1e-12 * M.max(), (reg, float(res.value_dual), want)
    assert abs(float(res.value) - limit) <= 1e-12 * M.max()  # reg = 1e20: the limit, to rounding


def test_solve_lazy_and_torch_value_at_high_reg():
    """The same value through a lazy matrix, a torch tensor and a batch (one problem per row of the batch)."""
    M, a, b = _matrix_problem()

    class Lazy:
        shape, dtype = M.shape, M.dtype

        def __getitem__(self, key):
            return M[key]

    for reg in (1e15, 1e20):
        want = _oracle(M, a, b, reg)
        for MM in (Lazy(), torch.from_numpy(M)):
            res = flashot.solve(MM, a, b, reg=reg)
            assert abs(float(res.value) - want) <= 1e-12 * M.max(), (type(MM), reg, float(res.value), want)
        Mb = torch.from_numpy(np.stack([M, 2 * M]))
        res = flashot.solve(Mb, torch.from_numpy(np.stack([a, a])), torch.from_numpy(np.stack([b, b])), reg=reg)
        want2 = _oracle(2 * M, a, b, reg)
        assert np.allclose(res.value.numpy(), [want, want2], rtol=0, atol=2e-12 * M.max()), (reg, res.value, want)


@pytest.mark.parametrize("cost", ["sqeuclidean", "euclidean"])
def test_solve_sample_value_at_any_reg(cost):
    """``solve_sample``: value within 1e-12 x cmax of the oracle on the explicit cost matrix."""
    rng = np.random.RandomState(1)
    x, y = rng.randn(5, 2), rng.randn(4, 2)
    a = rng.rand(5) + 0.1
    a /= a.sum()
    b = np.full(4, 0.25)
    C = flashot.get_cost(cost).matrix(torch.from_numpy(x), torch.from_numpy(y)).numpy()
    cmax = C.max()
    for r in REGS:
        res = flashot.solve_sample(x, y, a, b, reg=r * cmax, cost=cost, tol=1e-12, max_iter=100000)
        want = _oracle(C, a, b, r * cmax)
        assert res.converged
        assert abs(float(res.value) - want) <= 1e-12 * cmax, (r, float(res.value), want)
    assert abs(float(res.value) - float(a @ C @ b)) <= 1e-12 * cmax


def test_float32_value_at_high_reg():
    """float32 inputs: the value to float32 precision of the cost scale (it was 0 from reg ~ 1e16 x cost)."""
    M, a, b = _matrix_problem()
    M32 = M.astype(np.float32)
    for reg in (1e6, 1e16, 1e20):
        want = _oracle(M32.astype(np.float64), a, b, reg)
        res = flashot.solve(
            torch.from_numpy(M32),
            reg=reg,
            a=torch.from_numpy(a.astype(np.float32)),
            b=torch.from_numpy(b.astype(np.float32)),
        )
        assert res.value.dtype == torch.float32
        assert abs(float(res.value) - want) <= 4e-7 * M.max(), (reg, float(res.value), want)


def _directional(fun, t: torch.Tensor, grad: torch.Tensor, h: float, seed: int = 0) -> tuple[float, float]:
    """``(<grad, D>, (fun(t + h D) - fun(t - h D)) / 2h)`` along a random direction ``D``."""
    D = torch.from_numpy(np.random.RandomState(seed).randn(*t.shape))
    return float((grad * D).sum()), (fun(t + h * D) - fun(t - h * D)) / (2 * h)


@pytest.mark.parametrize("reg", [0.5, 1e6])
def test_value_gradients_unchanged(reg):
    """Gradients of ``value`` (in M, x) and ``value_linear`` (in M) against central differences along a
    random direction, at a moderate reg (the ordinary path) and at 1e6 x the cost scale (the stable
    high-temperature value)."""
    M, a, b = _matrix_problem()
    Mt = torch.from_numpy(M).requires_grad_(True)
    at, bt = torch.from_numpy(a), torch.from_numpy(b)
    kw = {"tol": 1e-13, "max_iter": 100000}
    res = flashot.solve(Mt, at, bt, reg=reg, **kw)
    (gM,) = torch.autograd.grad(res.value, Mt)
    got, want = _directional(lambda T: float(flashot.solve(T, at, bt, reg=reg, **kw).value), Mt.detach(), gM, 1e-4)
    assert abs(got - want) <= 1e-8 * abs(want), (got, want)
    if reg == 0.5:  # value_linear: the implicit gradient (unchanged by the high-temperature value)
        (gl,) = torch.autograd.grad(flashot.solve(Mt, at, bt, reg=reg, **kw).value_linear, Mt)
        got, want = _directional(
            lambda T: float(flashot.solve(T, at, bt, reg=reg, **kw).value_linear), Mt.detach(), gl, 1e-5
        )
        assert abs(got - want) <= 1e-7 * abs(want), (got, want)
    rng = np.random.RandomState(2)
    x = torch.from_numpy(rng.randn(4, 2)).requires_grad_(True)
    y = torch.from_numpy(rng.randn(5, 2))
    s = flashot.solve_sample(x, y, at, bt, reg=reg * 10, **kw)
    (gx,) = torch.autograd.grad(s.value, x)
    got, want = _directional(
        lambda X: float(flashot.solve_sample(X, y, at, bt, reg=reg * 10, **kw).value), x.detach(), gx, 1e-4
    )
    assert abs(got - want) <= 1e-8 * abs(want), (got, want)
