"""The oracle checks itself: zero primal-dual gap, first-order conditions, envelope gradients equal to
its own finite differences, and a closed form (one point against one point)."""

from __future__ import annotations

import math

import pytest
import torch

import references as ref


def _problem(seed=0, n=9, m=11, masses=(1.0, 1.0)):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 2, generator=g, dtype=torch.float64)
    y = torch.rand(m, 2, generator=g, dtype=torch.float64) + 0.2
    a = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
    b = torch.rand(m, generator=g, dtype=torch.float64) + 0.5
    return x, y, masses[0] * a / a.sum(), masses[1] * b / b.sum()


@pytest.mark.parametrize(
    "rhos,masses",
    [((None, None), (1.0, 1.0)), ((0.3, 0.3), (1.2, 0.7)), ((0.4, None), (1.0, 0.8)), ((None, 0.2), (1.0, 1.0))],
)
def test_gap_and_first_order_conditions(rhos, masses):
    x, y, a, b = _problem(masses=masses)
    C, eps = ref.cost_matrix(x, y), 0.05
    s = ref.solve(C, a, b, eps, *rhos)
    assert s.error < 1e-13
    assert abs(s.primal - s.dual) < 1e-12 * max(1.0, abs(s.dual))
    rx, ry = rhos
    tr = a if rx is None else a * torch.exp(-s.f / rx)
    tc = b if ry is None else b * torch.exp(-s.g / ry)
    assert float((s.plan.sum(1) - tr).abs().max()) < 1e-13
    assert float((s.plan.sum(0) - tc).abs().max()) < 1e-13


def test_envelope_gradient_is_its_finite_difference():
    """d OT / d x_i = sum_j P_ij (x_i - y_j) for C = |x - y|^2 / 2, at the oracle's own precision."""
    x, y, a, b = _problem(seed=1)
    eps = 0.1
    s = ref.solve(ref.cost_matrix(x, y), a, b, eps)
    env = s.plan.sum(1, keepdim=True) * x - s.plan @ y
    d = torch.randn(x.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    fd = ref.finite_difference(lambda t: ref.ot_value(t, y, a, b, eps), x, d)
    assert abs(float((env * d).sum()) - fd) < 1e-8 * abs(fd)


def test_one_point_closed_form():
    """One point of mass ma against one of mass mb, KL penalties rho on both sides: the plan's mass t
    minimises C t + eps (t log(t/(ma mb)) - t + ma mb) + rho (t log(t/ma) - t + ma) + rho (t log(t/mb) - t + mb),
    i.e. log t = (eps log(ma mb) + rho log(ma mb) - C) / (eps + 2 rho)."""
    x, y = torch.tensor([[0.0, 0.0]], dtype=torch.float64), torch.tensor([[0.6, 0.8]], dtype=torch.float64)
    ma, mb, eps, rho = 1.5, 0.5, 0.2, 0.7
    C = 0.5  # |x - y|^2 / 2
    t = math.exp(((eps + rho) * math.log(ma * mb) - C) / (eps + 2 * rho))
    want = (
        C * t
        + eps * (t * math.log(t / (ma * mb)) - t + ma * mb)
        + rho * (t * math.log(t / ma) - t + ma)
        + rho * (t * math.log(t / mb) - t + mb)
    )
    got = ref.ot_value(
        x,
        y,
        torch.tensor([ma], dtype=torch.float64),
        torch.tensor([mb], dtype=torch.float64),
        eps,
        rho_x=rho,
        rho_y=rho,
    )
    assert abs(got - want) < 1e-13
