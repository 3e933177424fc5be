"""Regression (found by tests/ops/test_engines_fuzz.py): where an exact plan product overflows, the ``dense``
engine returned NaN (its row factor exp(alpha_i + max_j) was inf and multiplied terms that had
underflowed to 0); the streaming engines and a float64 reference give +-inf there."""

from __future__ import annotations

import math

import pytest
import torch

import flashot
from flashot import ops


@pytest.mark.parametrize("backend", ["dense", "tiled", "cpu"])
def test_overflowing_plan_product_is_inf_not_nan(backend):
    d = torch.float64
    x, y = torch.tensor([[0.0], [1.0]], dtype=d), torch.tensor([[0.0], [3.0]], dtype=d)
    alpha, beta = torch.tensor([800.0, 0.0], dtype=d), torch.zeros(2, dtype=d)
    out = ops.plan_product(x, y, alpha, beta, 0.01, torch.tensor([1.0, -1.0], dtype=d), backend=backend)
    assert out[0] == math.inf
    ref = math.exp(-1.0 / 0.01) - math.exp(-4.0 / 0.01)  # row 1: exp(-C_10/eps) - exp(-C_11/eps)
    assert abs(float(out[1]) - ref) <= 1e-12 * ref


def test_dense_marginals_of_an_early_iterate_are_not_nan():
    g = torch.Generator().manual_seed(230)
    x = torch.randn(1, 5, 1, generator=g, dtype=torch.float64)[0]
    y = (torch.randn(1, 4, 1, generator=g, dtype=torch.float64) + 0.5)[0]
    rows = flashot.solve_sample(
        x, y, reg=1.3070698e-05, tol=None, max_iter=1, method="symmetric", backend="dense"
    ).marginals[0]
    assert not bool(torch.isnan(rows).any()), rows
