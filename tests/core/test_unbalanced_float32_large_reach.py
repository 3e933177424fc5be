"""Hardening (issue 12, item 3): unbalanced values at a large reach, in float32.

``(rho + eps/2) <a, 1 - exp(-f/rho)>`` rounded to 0 in float32 at reach = 1e4 (``f / rho`` ~ 1e-9)
and was 1e-3 off at reach = 100, on every engine, in SamplesLoss and in ``value_dual``.  Now every
such term uses ``expm1``, and float32 agrees with float64 to float32 accuracy.

References (float64, independent of flashot): GeomLoss' tensorized ``SamplesLoss(reach=...)``,
and the primal value with generalised KL terms at POT's unbalanced plan.
Tolerances: float64 vs the references 1e-6 relative (converged solves); float32 vs float64
``F32_RTOL = 64 u`` (u = 2^-23) relative to the value (the iterations accumulate a few u).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from flashot import Anderson, SamplesLoss, solve_sample

geomloss = pytest.importorskip("geomloss")
ot = pytest.importorskip("ot")

pytestmark = pytest.mark.usefixtures("one_thread")

ENGINES = ["dense", "tiled", "cpu"]
REACHES = [1.0, 100.0, 1e4]
F32_RTOL = 64 * 2.0**-23


def _clouds(seed=0, n=50, m=40):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 3, generator=g).double()
    y = (torch.rand(m, 3, generator=g) + 0.2).double()
    return x.float().double(), y.float().double()  # exactly representable in float32


def _close(v32, v64, rtol):
    v32, v64 = float(v32), float(v64)
    assert abs(v32 - v64) <= rtol * abs(v64), (v32, v64, abs(v32 - v64) / abs(v64))


@pytest.mark.parametrize("backend", ENGINES)
@pytest.mark.parametrize("reach", REACHES)
@pytest.mark.parametrize("debias", [True, False])
def test_samples_loss_large_reach_float32(backend, reach, debias):
    x, y = _clouds()
    kw = dict(blur=0.1, reach=reach, debias=debias)
    ref = geomloss.SamplesLoss("sinkhorn", backend="tensorized", **kw)(x, y)
    v64 = SamplesLoss(backend=backend, **kw)(x, y)
    v32 = SamplesLoss(backend=backend, **kw)(x.float(), y.float())
    _close(v64, ref, 1e-6)
    _close(v32, v64, F32_RTOL)


@pytest.mark.parametrize("backend", ["dense", "tiled"])
@pytest.mark.parametrize("reach", REACHES)
def test_samples_loss_semi_unbalanced_large_reach_float32(backend, reach):
    """reach_x only: the two-sided debiasing (rho_x != rho_y) uses the same stable terms."""
    x, y = _clouds(1)
    kw = dict(blur=0.1, reach_x=reach, debias=True, backend=backend)
    v64 = SamplesLoss(**kw)(x, y)
    v32 = SamplesLoss(**kw)(x.float(), y.float())
    _close(v32, v64, F32_RTOL)


def _primal_generalised_kl(x, y, reg, rho_a, rho_b):
    """<C, P> + reg KL(P | a x b) + rho_a KL(P 1 | a) + rho_b KL(P^T 1 | b) at POT's plan, float64."""
    xn, yn = x.numpy(), y.numpy()
    a, b = np.full(len(xn), 1 / len(xn)), np.full(len(yn), 1 / len(yn))
    M = ot.dist(xn, yn)
    P = ot.unbalanced.sinkhorn_unbalanced(
        a, b, M, reg, (rho_a, rho_b), method="sinkhorn_stabilized", numItermax=200_000, stopThr=1e-15
    )

    def gkl(p, q):
        return float(np.sum(p * np.log(p / q)) - p.sum() + q.sum())

    return (
        float(np.sum(M * P)) + reg * gkl(P, a[:, None] * b[None]) + rho_a * gkl(P.sum(1), a) + rho_b * gkl(P.sum(0), b)
    )


@functools.cache
def _primal_of_clouds(seed, reg, rho):
    """:func:`_primal_generalised_kl` on ``_clouds(seed)``, computed once for the three engines."""
    return _primal_generalised_kl(*_clouds(seed), reg, rho, rho)


@pytest.mark.parametrize("backend", ENGINES)
@pytest.mark.parametrize("rho", REACHES)
def test_value_dual_large_rho_float32(backend, rho):
    x, y = _clouds(2)
    reg = 0.05
    kw = dict(reg=reg, unbalanced=rho, backend=backend, tol=None, max_iter=400)
    if rho <= 100:  # at rho = 1e4 both solvers need ~1e6 iterations (the mass mode contracts by ~reg/rho)
        # the same fixed point (tol = 1e-12), reached with Anderson: at rho = 100 plain iterations took 21290
        # steps (13 s per engine), Anderson takes 530 and lands within 5e-14 of POT's value (measured)
        ref = solve_sample(
            x, y, reg=reg, unbalanced=rho, backend=backend, tol=1e-12, max_iter=50_000, acceleration=Anderson(m=5)
        )
        assert ref.converged
        _close(ref.value_dual, _primal_of_clouds(2, reg, rho), 1e-6)
    v64 = solve_sample(x, y, **kw).value_dual
    v32 = solve_sample(x.float(), y.float(), **kw).value_dual
    _close(v32, v64, F32_RTOL)


@pytest.mark.parametrize("rho", REACHES)
def test_value_dual_semi_unbalanced_large_rho_float32(rho):
    x, y = _clouds(3)
    kw = dict(reg=0.05, unbalanced=(rho, None), backend="tiled", tol=None, max_iter=400)
    v64 = solve_sample(x, y, **kw).value_dual
    v32 = solve_sample(x.float(), y.float(), **kw).value_dual
    _close(v32, v64, F32_RTOL)


def test_value_dual_gradients_unchanged_by_the_stable_form():
    """d value_dual / d a_i = rho (1 - e^{-f_i/rho}) - reg e^{-f_i/rho} + reg m(b) (envelope), float64."""
    x, y = _clouds(4)
    rho, reg = 0.7, 0.1
    a = torch.full((50,), 1 / 50, dtype=torch.float64, requires_grad=True)
    res = solve_sample(x, y, a, None, reg=reg, unbalanced=rho, tol=1e-13, max_iter=50_000)
    (ga,) = torch.autograd.grad(res.value_dual, a)
    f = res.potentials[0].detach()
    e = torch.exp(-f / rho)
    expected = rho * (1 - e) - reg * e + reg * 1.0
    assert float((ga - expected).abs().max()) < 1e-9
