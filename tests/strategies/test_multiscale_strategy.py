"""Multiscale is a strategy of the one solve: both front ends run it through :func:`flashot.multiscale.solve`.

``SamplesLoss(backend="multiscale")`` and ``solve_sample(backend="multiscale")`` build their problem and hand it
to the strategy; neither runs the coarse-to-fine loop itself.  Checked by counting the calls of the loop made
from :mod:`flashot.multiscale.strategy`, and by running the strategy directly with each front end's schedule
and refinement: the same numbers, bitwise.
"""

from __future__ import annotations

import pytest
import torch

import flashot
import flashot.multiscale as MS
from flashot.measures import Measures

F64 = torch.float64
pytestmark = pytest.mark.usefixtures("one_thread")  # small problems


def _clouds():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(150, 2, generator=g, dtype=F64)
    y = torch.randn(120, 2, generator=g, dtype=F64) * 0.5 + 1.0
    return x, y


def test_both_front_ends_run_the_one_strategy(monkeypatch):
    x, y = _clouds()
    real, calls = MS.strategy.multiscale_loop, []

    def counted(*args, **kwargs):
        calls.append(kwargs["debias"])
        return real(*args, **kwargs)

    monkeypatch.setattr(MS.strategy, "multiscale_loop", counted)
    L = flashot.SamplesLoss(blur=0.3, backend="multiscale", reach=1.0)
    L(x, y)
    res = flashot.solve_sample(x, y, reg=0.1, backend="multiscale")
    assert calls == [True, False]
    assert L.last_multiscale is not None and res.multiscale is not None


def test_the_strategy_gives_the_front_ends_numbers():
    """The front ends add nothing to the numbers: ``solve`` with their schedule and refinement gives theirs."""
    x, y = _clouds()
    L = flashot.SamplesLoss(blur=0.3, backend="multiscale", debias=False, potentials=True, tol=1e-6)
    F, _ = L(x, y)
    m = Measures.build(x, y, None, None, cost="half_sqeuclidean", backend="auto")
    diameter = max(m.bbox_diameter(), 0.3)
    eps_list = flashot.schedules.epsilon_scaling(2, diameter, 0.3, 0.5)
    run = MS.solve(m, eps_list, MS.MultiscaleConfig(), p=2, diameter=diameter, refine=MS.Refinement(1e-6, 1000))
    f, _, _, _ = flashot.solver.final_step(run.m, run.state)
    assert torch.equal(MS.unsort(f, run.cx.perm)[0], F)

    res = flashot.solve_sample(x, y, reg=0.1, backend="multiscale")
    m = Measures.build(x, y, None, None, cost="sqeuclidean", backend="auto")
    cfg = MS.MultiscaleConfig()
    o = flashot.driver.solve_options(0.1)
    direct = MS.solve_measures(m, o, cfg)
    assert torch.equal(direct.value, res.value) and torch.equal(direct.potentials[0], res.potentials[0])
    assert direct.multiscale.kept == res.multiscale.kept
