"""Hardening (issue 12, item 4): float32 at a temperature far above the cost scale.

At ``blur`` = 1000 x the diameter the float32 SamplesLoss was -8.94 on the cpu engine and 0 on
tiled/dense (float64: 0.1352).  The cancellation is in the softmin itself: the solver hands the
engines ``h = log b + g / eps``, and when ``eps >> max C`` the informative part ``g / eps`` (and
``C / eps``) is below the float32 resolution of ``log b``, so every potential is rounding noise of
size ``eps * 2^-23``, which the debiased formula (and any value) then reads.

Natural scale: ``cmax``, the cost of the joint bounding box's diagonal (``diameter^p / p``-ish);
float32 must agree with float64 within ``F32_ATOL = 64 u cmax`` (u = 2^-23).
References (float64, independent of flashot): GeomLoss' tensorized SamplesLoss, the closed-form
limit ``S -> |mean(x) - mean(y)|^2 / 2`` (p = 2) as blur -> inf, and ``<a x b, C>`` for the
entropic value as reg -> inf (POT convention).
"""

from __future__ import annotations

import pytest
import torch

from flashot import SamplesLoss, solve_sample
from flashot.measures import Measures
from flashot.schedules import max_diameter

geomloss = pytest.importorskip("geomloss")

pytestmark = pytest.mark.usefixtures("one_thread")

ENGINES = ["dense", "tiled", "cpu"]
U = 2.0**-23


def _clouds(seed=0, n=50, m=40):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 3, generator=g)
    y = torch.rand(m, 3, generator=g) + 0.2
    return x.double(), y.double()  # float32 values, held in float64


def _cmax(x, y, cost="half_sqeuclidean"):
    return Measures.build(x, y, None, None, cost=cost, backend="dense").cmax


@pytest.mark.parametrize("backend", ENGINES)
@pytest.mark.parametrize("mult", [300, 1000])
@pytest.mark.parametrize("debias", [True, False])
def test_samples_loss_blur_far_above_diameter(backend, mult, debias):
    x, y = _clouds()
    blur = mult * max_diameter(x, y)
    kw = dict(blur=blur, debias=debias)
    ref = float(geomloss.SamplesLoss("sinkhorn", backend="tensorized", **kw)(x, y))
    v64 = float(SamplesLoss(backend=backend, **kw)(x, y))
    v32 = float(SamplesLoss(backend=backend, **kw)(x.float(), y.float()))
    atol = 64 * U * _cmax(x, y)
    assert abs(v64 - ref) <= 16 * 2.0**-52 * blur**2 * 4, (v64, ref)  # float64 rounding at this eps
    assert abs(v32 - v64) <= atol, (v32, v64, atol)
    if debias:  # the blur -> inf limit: half the squared distance of the means (energy distance)
        limit = 0.5 * float(((x.mean(0) - y.mean(0)) ** 2).sum())
        assert abs(v32 - limit) <= atol + 1e-4 / mult * abs(limit)


@pytest.mark.parametrize("backend", ["dense", "tiled"])
@pytest.mark.parametrize("p", [1, 2])
def test_samples_loss_hot_gradients_and_p1(backend, p):
    """Gradients (final step) and the p = 1 cost at blur = 1000 x diameter, float32 vs float64."""
    x, y = _clouds(1)
    blur = 1000 * max_diameter(x, y)
    out = {}
    for dt in (torch.float32, torch.float64):
        xx = x.to(dt).requires_grad_()
        v = SamplesLoss(p=p, blur=blur, backend=backend)(xx, y.to(dt))
        (gx,) = torch.autograd.grad(v, xx)
        out[dt] = (float(v.detach()), gx.double())
    cost = "half_sqeuclidean" if p == 2 else "euclidean"
    atol = 64 * U * _cmax(x, y, cost)
    assert abs(out[torch.float32][0] - out[torch.float64][0]) <= atol
    g64 = out[torch.float64][1]
    assert float((out[torch.float32][1] - g64).abs().max()) <= 1e-4 * float(g64.abs().max())


@pytest.mark.parametrize("backend", ["dense", "tiled"])
def test_samples_loss_hot_unbalanced(backend):
    x, y = _clouds(2)
    d = max_diameter(x, y)
    kw = dict(blur=1000 * d, reach=10 * d, backend=backend)
    v64 = float(SamplesLoss(**kw)(x, y))
    v32 = float(SamplesLoss(**kw)(x.float(), y.float()))
    assert abs(v32 - v64) <= 64 * U * _cmax(x, y)


@pytest.mark.parametrize("backend", ENGINES)
@pytest.mark.parametrize("method", ["sinkhorn", "symmetric"])
def test_solve_sample_reg_far_above_cost(backend, method):
    """POT convention: as reg -> inf the plan tends to a x b and the value to <a x b, C>."""
    x, y = _clouds(3)
    cmax = _cmax(x, y, "sqeuclidean")
    reg = 1000 * cmax
    kw = dict(reg=reg, backend=backend, method=method, tol=1e-6)
    r64 = solve_sample(x, y, **kw)
    r32 = solve_sample(x.float(), y.float(), **kw)
    assert r64.converged and r32.converged
    mean_cost = float((torch.cdist(x, y) ** 2).mean())
    assert abs(float(r64.value) - mean_cost) <= 1e-3 * mean_cost  # O(cmax / reg) from the limit
    assert abs(float(r32.value) - float(r64.value)) <= 64 * U * cmax


@pytest.mark.parametrize("p", [1, 2])
def test_the_usual_schedule_stays_in_the_compute_dtype(p):
    """The first temperature of the epsilon-scaling (diameter^p) is not 'hot': no float64 pass."""
    x, y = _clouds(4)
    cost = "half_sqeuclidean" if p == 2 else "euclidean"
    m = Measures.build(x.float(), y.float(), None, None, cost=cost, backend="tiled")
    assert not m.hot(max_diameter(x, y) ** p)
    assert m.hot(1000 * max_diameter(x, y) ** p)
    m64 = Measures.build(x, y, None, None, cost=cost, backend="tiled")
    assert not m64.hot(1e6 * max_diameter(x, y) ** p)  # float64 problems are never upcast
