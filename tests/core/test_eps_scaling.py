"""Epsilon-scaling in ``solve_sample`` (issue 14, item 2).

Ported case: GeomLoss' ``tests/test_ot_solve_matrix.py::test_correct_values_convex_gradients``
with its generator ``tests/generators/convex_gradients.py`` (source points evenly spaced on a
segment, targets moved by the gradient of a random convex function ``sum_j v_j |x - z_j|``, so
the optimal plan is ``diag(weights)``; cost ``|x - y|^2 / 2``, reg = 1e-3, max_iter = 1000,
atol = rtol = 1e-2 on the value, the plan and the marginals).  Re-implemented here with seeded
numpy draws instead of hypothesis.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import flashot
from flashot.pot_samples import EPS_SCALING_AUTO, EPS_SCALING_STEPS
from flashot.schedules import Schedule


def convex_gradient_case(seed: int, B: int, N: int, D: int):
    rng = np.random.default_rng(seed)
    w = rng.uniform(0.01, 1.0, size=(B, N))
    w /= w.sum(1, keepdims=True)
    x = 0.5 * np.ones((B, N, D))
    x[:, :, 0] = np.arange(N) / N
    v = rng.uniform(0.1, 2.0, size=(B, N))
    z = rng.uniform(0.0, 1.0, size=(B, N, D))
    diff = x[:, :, None, :] - z[:, None, :, :]
    nrm = np.sqrt((diff**2).sum(-1, keepdims=True))
    nrm[nrm == 0] = 1
    y = x + (v[:, None, :, None] * diff / nrm).sum(2)
    value = 0.5 * (w * ((x - y) ** 2).sum(-1)).sum(1)
    return x, y, w, value


CASES = [(s, B, N, D) for s in range(6) for (B, N, D) in ((1, 5, 1), (1, 10, 2), (2, 8, 3), (1, 20, 2))]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("seed, B, N, D", CASES)
def test_convex_gradients_converge_to_the_known_plan(seed, B, N, D, dtype):
    x, y, w, value = convex_gradient_case(seed, B, N, D)
    X, Y, W = (torch.tensor(t, dtype=dtype) for t in (x, y, w))
    with warnings.catch_warnings():
        # largest costs 25-190 at reg = 1e-3: tol = 1e-6 is not always reached in 1000 iterations
        # (float64: 7 of 24 cases end at errors 5e-6 to 1.3e-2) and float32 cannot resolve it at
        # all; GeomLoss' criteria below are what its test checks
        warnings.simplefilter("ignore", RuntimeWarning)
        res = flashot.solve_sample(X, Y, W, W, cost="half_sqeuclidean", reg=1e-3, max_iter=1000)
    P = res.plan.to_dense().double()
    expected = torch.diag_embed(torch.tensor(w))
    assert float((P - expected).abs().max()) < 1e-2
    assert np.allclose(res.value_linear.double().numpy(), value, atol=1e-2, rtol=1e-2)
    row, col = res.marginals
    assert float((row.double() - W.double()).abs().max()) < 1e-2
    assert float((col.double() - W.double()).abs().max()) < 1e-2


def _plain_plan_errors(cases) -> list[float]:
    """max |P - diag(w)| of each case after (up to) 1000 plain iterations, the cases of one shape in one
    batched solve: each batch runs all 1000, and the errors are those of one solve per case to 3 digits
    (measured), in a sixth of the time."""
    arrays = [convex_gradient_case(*c)[:3] for c in cases]
    X, Y, W = (torch.tensor(np.concatenate([arr[i] for arr in arrays])) for i in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        res = flashot.solve_sample(X, Y, W, W, cost="half_sqeuclidean", reg=1e-3, max_iter=1000, eps_scaling=False)
    err = (res.plan.to_dense() - torch.diag_embed(W)).abs().amax((-1, -2))
    return [float(e.max()) for e in err.split([c[1] for c in cases])]


def test_plain_iterations_fail_some_of_these_cases():
    """Why the schedule is on by default there: without it, 1000 plain iterations at reg = 1e-3
    leave most of the same plans wrong (21 of 24 here; the issue saw 19 of 40 off by up to 0.14)."""
    failed = 0
    for shape in dict.fromkeys(c[1:] for c in CASES):
        failed += sum(e >= 1e-2 for e in _plain_plan_errors([c for c in CASES if c[1:] == shape]))
    assert failed >= len(CASES) // 2


def test_schedule_and_auto_rule():
    torch.manual_seed(0)
    x, y = torch.rand(50, 2, dtype=torch.float64), torch.rand(40, 2, dtype=torch.float64)
    m_cmax = float(((x[:, None] - y[None]) ** 2).sum(-1).max())
    seen = []
    cb = lambda rec: seen.append(rec.eps)  # noqa: E731
    flashot.solve_sample(x, y, reg=1e-3, callback=cb, tol=None, max_iter=60)
    assert seen[:2] == [1e-3, 1e-3]  # two steps at reg first (a problem they solve stops there)
    head = [e for e in seen[2:] if e > 1e-3]
    assert head and head == sorted(head, reverse=True) and seen[len(head) + 2] == 1e-3
    levels = sorted(set(head), reverse=True)
    assert head == [e for e in levels for _ in range(EPS_SCALING_STEPS)]
    assert all(abs(b / a - 0.5) < 1e-12 for a, b in zip(levels, levels[1:]))
    assert head[0] >= m_cmax  # starts at (an upper bound of) the largest cost
    # off: reg above EPS_SCALING_AUTO x the cost scale, eps_scaling=False, or a warm start
    for kw in ({"reg": 0.5}, {"reg": 1e-3, "eps_scaling": False}):
        seen.clear()
        flashot.solve_sample(x, y, callback=cb, tol=None, max_iter=60, **kw)
        assert set(seen) == {kw["reg"]}
    r = flashot.solve_sample(x, y, reg=1e-3, tol=None, max_iter=60)
    seen.clear()
    flashot.solve_sample(x, y, reg=1e-3, tol=None, max_iter=60, potentials_init=r.potentials, callback=cb)
    assert set(seen) == {1e-3}
    # a ratio
    seen.clear()
    flashot.solve_sample(x, y, reg=1e-3, eps_scaling=0.25, callback=cb, tol=None, max_iter=60)
    levels = sorted({e for e in seen if e > 1e-3}, reverse=True)
    assert all(abs(b / a - 0.25) < 1e-12 for a, b in zip(levels, levels[1:]))
    assert EPS_SCALING_AUTO < 1


def test_tol_is_not_checked_during_the_schedule():
    """A solve never stops (as converged) at a temperature above reg, even where the error of
    that temperature's problem is below tol."""
    torch.manual_seed(1)
    x, y = torch.rand(30, 2, dtype=torch.float64), torch.rand(30, 2, dtype=torch.float64)
    recs = []
    res = flashot.solve_sample(x, y, reg=1e-3, tol=1e-2, inner_iterations=1, callback=recs.append)
    assert res.converged and recs[-1].eps == 1e-3
    assert recs[1].error >= 1e-2  # the two steps at reg did not solve it ...
    assert any(r.eps > 1e-3 and r.error < 1e-2 for r in recs)  # ... the schedule met tol, and went on
    assert res.n_iter > 10


def test_schedule_sequence():
    s = Schedule(1.0, 6, [8.0, 4.0, 2.0])
    assert list(s) == [8.0, 4.0, 2.0, 1.0, 1.0, 1.0] and s[-1] == 1.0 and len(s) == 6
    assert list(Schedule(1.0, 2, [8.0, 4.0, 2.0])) == [8.0, 1.0]  # the last iteration is at reg
    # the error is read at the end of each eps level, so a one-step problem stops after one step
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(1, 2, generator=g, dtype=torch.float64), torch.rand(30, 2, generator=g, dtype=torch.float64)
    res = flashot.solve_sample(x, y, reg=1e-4)
    assert res.converged and res.n_iter == 2
    seen = []
    flashot.solve_sample(
        x, y, reg=1e-4, method="symmetric", tol=None, max_iter=5, callback=lambda rec: seen.append(rec.eps)
    )
    assert set(seen) == {1e-4}  # auto: alternating updates only
    with pytest.raises(ValueError, match="eps_scaling"):
        flashot.solve_sample(torch.rand(3, 2), torch.rand(3, 2), reg=0.1, eps_scaling=2.0)
