"""One pipeline: every front end builds a problem and calls the core's one solve, :func:`flashot.driver.solve_problem`.

``SamplesLoss`` and ``solve_sample`` (and ``solve``) reach the Sinkhorn loop only through that entry, whatever the
strategy (single scale, coarse-to-fine, warm-started, a ragged batch): checked by replacing the loop, in every
module that holds it, by one that looks for the entry's frame on the stack.  Then the strategies called directly through the entry
give the front ends' numbers, bitwise.
"""

from __future__ import annotations

import sys

import pytest
import torch

import flashot
import flashot.multiscale as MS
from flashot import driver, solver
from flashot.measures import Measures

F64 = torch.float64
pytestmark = pytest.mark.usefixtures("one_thread")  # small problems


def _clouds(n=150, m=120, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=g, dtype=F64)
    y = torch.randn(m, 2, generator=g, dtype=F64) * 0.5 + 1.0
    return x, y


@pytest.fixture
def loops(monkeypatch):
    """The loop's calls, each with whether :func:`~flashot.driver.solve_problem` was on the stack."""
    real, calls = solver.sinkhorn_loop, []

    def watched(*args, **kwargs):
        frame, inside = sys._getframe(1), False
        while frame is not None and not inside:
            inside = frame.f_code is driver.solve_problem.__code__
            frame = frame.f_back
        calls.append(inside)
        return real(*args, **kwargs)

    for mod in list(sys.modules.values()):  # every module that imported the loop by name
        if getattr(mod, "__name__", "").startswith("flashot") and getattr(mod, "sinkhorn_loop", None) is real:
            monkeypatch.setattr(mod, "sinkhorn_loop", watched)
    return calls


CALLS = {
    "single scale": lambda x, y: flashot.SamplesLoss(blur=0.3)(x, y),
    "unbalanced, tol": lambda x, y: flashot.SamplesLoss(blur=0.3, reach=1.0, tol=1e-6)(x, y),
    "semi-unbalanced, debiased": lambda x, y: flashot.SamplesLoss(blur=0.3, reach_x=1.0)(x, y),
    "custom cost": lambda x, y: flashot.SamplesLoss(blur=0.3, cost=lambda u, v: torch.cdist(u, v) ** 2 / 2)(x, y),
    "multiscale": lambda x, y: flashot.SamplesLoss(blur=0.3, backend="multiscale", tol=1e-6)(x, y),
    "solve_sample": lambda x, y: flashot.solve_sample(x, y, reg=0.1),
    "solve_sample, eps-scaling": lambda x, y: flashot.solve_sample(x, y, reg=0.01),
    "solve_sample multiscale": lambda x, y: flashot.solve_sample(x, y, reg=0.1, backend="multiscale"),
    "solve": lambda x, y: flashot.solve(torch.cdist(x, y) ** 2, reg=0.1),
    "ragged SamplesLoss": lambda x, y: flashot.SamplesLoss(blur=0.3, tol=1e-6)([x, x[:50]], [y, y[:70]]),
    "ragged solve_sample": lambda x, y: flashot.solve_sample([x, x[:50]], [y, y[:70]], reg=0.1),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_front_ends_reach_the_loop_only_through_the_one_solve(name, loops):
    CALLS[name](*_clouds())
    assert loops and all(loops), loops


def test_warm_starts_run_inside_the_one_solve(loops):
    x, y = _clouds()
    L = flashot.SamplesLoss(blur=0.1, warm_start=True)
    L(x, y)
    L(x + 1e-3, y)  # the warm tail: the cross problem and both self problems
    assert len(loops) == 4 and all(loops), loops


def test_the_entry_gives_the_front_ends_numbers():
    """The front ends add nothing to the numbers: their config and strategy handed to the entry give theirs."""
    x, y = _clouds()
    L = flashot.SamplesLoss(blur=0.3, debias=False, potentials=True, tol=1e-6)
    F, _ = L(x, y)
    m = Measures.build(x, y, None, None, cost="half_sqeuclidean", backend="auto")
    eps_list = flashot.schedules.epsilon_scaling(2, max(m.bbox_diameter(), 0.3), 0.3, 0.5)
    cfg = driver.LoopConfig(eps_list, tol=1e-6, refine=1000)
    solved = driver.solve_problem(m, cfg)
    f, _, _, _ = solver.final_step(solved.m, solved.state)
    assert torch.equal(m.restore(f), F) and solved.n_iter == L.last_n_iter

    # the coarse-to-fine strategy, the same config
    L = flashot.SamplesLoss(blur=0.3, backend="multiscale", debias=False, potentials=True, tol=1e-6)
    F, _ = L(x, y)
    diameter = max(m.bbox_diameter(), 0.3)
    cfg = driver.LoopConfig(flashot.schedules.epsilon_scaling(2, diameter, 0.3, 0.5), tol=1e-6, refine=1000)
    solved = driver.solve_problem(m, cfg, MS.Multiscale(MS.MultiscaleConfig(), 2, diameter))
    f, _, _, _ = solver.final_step(solved.m, solved.state)
    assert torch.equal(MS.unsort(f, solved.run.cx.perm)[0], F)
    assert solved.n_iter == L.last_n_iter and solved.run.kept == L.last_multiscale.kept

    # POT's single-scale config (eps-scaling head, Anderson at small reg)
    res = flashot.solve_sample(x, y, reg=0.01)
    m = Measures.build(x, y, None, None, cost="sqeuclidean", backend="auto")
    o = driver.solve_options(0.01)
    solved = driver.solve_problem(m, driver.loop_config(m, o))
    direct = driver.make_result(solved.m, solved.state, o, False)
    assert torch.equal(direct.value, res.value) and direct.n_iter == res.n_iter
