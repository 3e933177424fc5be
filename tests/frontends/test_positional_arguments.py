"""Mistakes a newcomer makes in the first minutes get an error that names them (issue 13)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashot


def test_reg_passed_positionally_is_named():
    x, y = torch.randn(5, 2), torch.randn(4, 2)
    with pytest.raises(TypeError, match=r"third positional argument \(0\.1\) was taken as the weights 'a'.*reg=0\.1"):
        flashot.solve_sample(x, y, 0.1)
    with pytest.raises(TypeError, match=r"fourth positional argument \(1\) was taken as the weights 'b'"):
        flashot.solve_sample(x, y, None, 1, reg=0.1)
    # numpy, POT's call form: same message
    with pytest.raises(TypeError, match="taken as the weights 'a'"):
        flashot.solve_sample(np.random.rand(5, 2), np.random.rand(4, 2), 0.5)


def test_real_weights_positionally_still_work():
    x, y = torch.randn(5, 2, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    a, b = torch.full((5,), 0.2, dtype=torch.float64), torch.full((4,), 0.25, dtype=torch.float64)
    r1 = flashot.solve_sample(x, y, a, b, reg=0.5)
    r2 = flashot.solve_sample(x, y, reg=0.5)
    assert torch.equal(r1.potentials[0], r2.potentials[0])
