"""Stopping rules: tol on the marginal violation (balanced) / potential change (unbalanced),
checked every ``inner_iterations`` steps; max_iter without convergence warns; callbacks."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from flashot import solve_sample

ot = pytest.importorskip("ot")


pytestmark = pytest.mark.usefixtures("one_thread")


def _data(n=30, m=35, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 2, generator=g, dtype=torch.float64)
    y = torch.rand(m, 2, generator=g, dtype=torch.float64) + 0.2
    return x, y


@pytest.mark.parametrize("method", ["sinkhorn", "symmetric"])
def test_balanced_error_is_marginal_violation(method):
    x, y = _data()
    res = solve_sample(x, y, reg=0.05, tol=1e-7, max_iter=5000, method=method)
    assert res.converged and res.status == "converged" and res.error < 1e-7
    assert res.n_iter % 10 == 0  # checked every inner_iterations=10 steps
    # independent check: the plan of the (pre-final-step) state violates the marginals by
    # about the reported error; the final plan's violation is at most of that order
    pa, pb = res.marginals
    viol = float((pa - 1 / 30).abs().sum() + (pb - 1 / 35).abs().sum())
    assert viol < 1e-6


def test_unbalanced_error_is_potential_change_and_converges_to_pot():
    x, y = _data()
    reg, rho = 0.05, 0.5
    res = solve_sample(x, y, reg=reg, unbalanced=rho, tol=1e-9, max_iter=20_000, inner_iterations=1)
    assert res.converged and res.error < 1e-9
    # one more plain step from the returned potentials changes them by <= ~error * reg
    rec = []
    solve_sample(
        x,
        y,
        reg=reg,
        unbalanced=rho,
        tol=None,
        max_iter=2,
        inner_iterations=1,
        potentials_init=res.potentials,
        callback=rec.append,
    )
    assert rec[0].error < 1e-8
    M = ot.dist(x.numpy(), y.numpy())
    a = np.full(30, 1 / 30)
    b = np.full(35, 1 / 35)
    P_ref = ot.unbalanced.sinkhorn_unbalanced(a, b, M, reg, rho, numItermax=100_000, stopThr=1e-13)
    assert np.abs(res.plan.to_dense().numpy() - P_ref).max() < 1e-7 * P_ref.max()


@pytest.mark.parametrize("unbalanced", [None, 0.5])
def test_inner_iterations_rounds_up_to_a_check(unbalanced):
    x, y = _data(seed=1)
    kw = dict(reg=0.05, tol=1e-6, max_iter=5000, unbalanced=unbalanced)
    r1 = solve_sample(x, y, inner_iterations=1, **kw)
    r7 = solve_sample(x, y, inner_iterations=7, **kw)
    assert r1.converged and r7.converged
    assert r7.n_iter == -(-r1.n_iter // 7) * 7  # the first multiple of 7 at or after r1.n_iter
    assert r7.error < 1e-6


def test_max_iter_warns_and_reports_not_converged():
    x, y = _data()
    with pytest.warns(RuntimeWarning, match="did not reach tol"):
        res = solve_sample(x, y, reg=0.01, tol=1e-12, max_iter=25)
    assert not res.converged and res.status == "max_iter reached"
    assert res.n_iter == 25 and res.error is not None and res.error > 1e-12
    with pytest.warns(RuntimeWarning, match="did not reach tol"):
        res = solve_sample(x, y, reg=0.01, tol=1e-12, max_iter=25, unbalanced=(1.0, None))
    assert not res.converged and res.error > 1e-12


def test_tol_none_runs_max_iter_silently():
    x, y = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = solve_sample(x, y, reg=0.05, tol=None, max_iter=13)
    assert res.n_iter == 13 and not res.converged


def test_callback_records_and_error_only_at_checks():
    x, y = _data()
    recs = []
    solve_sample(x, y, reg=0.05, tol=None, max_iter=23, inner_iterations=5, callback=recs.append)
    assert [r.iteration for r in recs] == list(range(1, 24))
    with_err = [r.iteration for r in recs if r.error is not None]
    assert with_err == [5, 10, 15, 20, 23]
    assert all(r.eps == 0.05 for r in recs)
    assert all(b.elapsed >= a.elapsed for a, b in zip(recs, recs[1:]))


def test_callback_returning_true_stops_early():
    x, y = _data()
    seen = []

    def cb(rec):
        seen.append(rec.iteration)
        return rec.iteration == 4

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a user stop is not a convergence failure: no warning
        res = solve_sample(x, y, reg=0.01, tol=1e-12, max_iter=100, callback=cb)
    assert seen == [1, 2, 3, 4]
    assert res.n_iter == 4 and res.stopped and not res.converged
    assert res.status == "stopped by callback"


def test_bad_stopping_arguments():
    x, y = _data(5, 6)
    with pytest.raises(ValueError, match="inner_iterations"):
        solve_sample(x, y, reg=0.1, inner_iterations=0)
    with pytest.raises(TypeError, match="inner_iterations"):
        solve_sample(x, y, reg=0.1, inner_iterations=2.5)
    with pytest.raises(ValueError, match="tol"):
        solve_sample(x, y, reg=0.1, tol=-1.0)
