"""Hardening (issue 12, item 1): NaN / Inf never read as convergence.

* the error measure reads a NaN or Inf potential as an infinite error (never as 0);
* a non-finite potential stops the solve with a FloatingPointError naming eps and the engine;
* finite points whose squared distances overflow the compute dtype are rejected up front.

References: float64 dense torch (``ops.softmin(backend="dense")``), POT's exact OT (``ot.emd2``)
and the exact scaling law ``OT_{s^2 reg}(s x, s y) = s^2 OT_reg(x, y)`` (squared cost).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from flashot import SamplesLoss, ops, solve_sample
from flashot.measures import Measures
from flashot.ops import register_engine, unregister_engine
from flashot.ops.dense import DenseEngine
from flashot.solver import _errors

pytestmark = pytest.mark.usefixtures("one_thread")

ENGINES = ["dense", "tiled", "cpu"]


def _clouds(dtype, seed=0, n=50, m=40):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, generator=g).to(dtype), torch.rand(m, 3, generator=g).to(dtype)


@pytest.mark.parametrize("side", ["x", "y"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("balanced", [True, False])
def test_error_reads_non_finite_potentials_as_infinite(side, bad, balanced):
    x, y = _clouds(torch.float64)
    m = Measures.build(x, y, None, None, cost="sqeuclidean", backend="dense")
    f_old = torch.zeros_like(m.a_log if side == "x" else m.b_log)
    f_new = f_old.clone()
    f_new[0, 3] = bad
    err = _errors(m, balanced, 0.1, [(f_old, f_new, side)])[0]
    assert bool(torch.isinf(err).all()) and bool((err > 0).all()), err
    if balanced:  # a zero weight hides its point: no marginal error there (0 * inf is not NaN)
        w = torch.ones(50 if side == "x" else 40, dtype=torch.float64)
        w[3] = 0.0
        w = w / w.sum()
        mz = Measures.build(
            x, y, w if side == "x" else None, w if side == "y" else None, cost="sqeuclidean", backend="dense"
        )
        f_new[0, 3] = -float("inf")  # exp((f_old - f_new) / eps) = inf at a zero weight
        assert float(_errors(mz, True, 0.1, [(f_old, f_new, side)])[0].max()) == 0.0


class _PoisonEngine(DenseEngine):
    """The dense engine, except that its softmin returns NaN from the ``after``-th call on."""

    name = "poison"

    def __init__(self, after: int):
        self.after, self.calls = after, 0

    def softmin(self, x, y, h, eps, cost):
        self.calls += 1
        out = super().softmin(x, y, h, eps, cost)
        return out if self.calls < self.after else torch.full_like(out, float("nan"))


@pytest.fixture
def poison():
    def make(after):
        eng = _PoisonEngine(after)
        register_engine("poison", lambda: eng)
        return eng

    yield make
    unregister_engine("poison")


@pytest.mark.parametrize("after", [1, 7, 40])
@pytest.mark.parametrize("method", ["sinkhorn", "symmetric"])
@pytest.mark.parametrize("unbalanced", [None, 0.5])
@pytest.mark.parametrize("tol", [1e-6, None])
def test_nan_softmin_stops_solve_sample(poison, after, method, unbalanced, tol):
    poison(after)
    x, y = _clouds(torch.float64)
    with pytest.raises(FloatingPointError, match=r"eps=0\.05.*'poison'"):
        solve_sample(x, y, reg=0.05, backend="poison", method=method, unbalanced=unbalanced, tol=tol, max_iter=30)


@pytest.mark.parametrize("after", [1, 5, -1])
@pytest.mark.parametrize("reach", [None, 0.5])
def test_nan_softmin_stops_samples_loss(poison, after, reach):
    x, y = _clouds(torch.float64)
    if after == -1:  # poison the last softmin only: one of the final (differentiable) step
        counter = poison(math.inf)
        SamplesLoss(blur=0.05, reach=reach, backend="poison")(x, y)
        after = counter.calls
    poison(after)
    with pytest.raises(FloatingPointError, match=r"eps=.*'poison'"):
        SamplesLoss(blur=0.05, reach=reach, backend="poison")(x, y)


@pytest.mark.parametrize("backend", ENGINES)
@pytest.mark.parametrize("dtype, reg", [(torch.float32, 1e-10), (torch.float64, 1e-20)])
def test_tiny_reg_never_returns_nan_as_converged(backend, dtype, reg):
    """The issue's case: unit-scale clouds, a tiny valid reg.  Either a FloatingPointError that
    names eps and the engine, or a finite result; never NaN / Inf reported as converged."""
    x, y = _clouds(dtype)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            res = solve_sample(x, y, reg=reg, backend=backend)
    except FloatingPointError as e:
        assert f"eps={reg:g}" in str(e) and "engine" in str(e)
        return
    finite = math.isfinite(float(res.value)) and bool(torch.isfinite(res.potentials[0]).all())
    assert finite or not res.converged, (res.value, res.converged, res.error)
    assert res.error is None or not (res.converged and not math.isfinite(res.error))


@pytest.mark.parametrize("backend", ENGINES)
def test_squared_distances_overflowing_the_dtype_are_rejected(backend):
    x, y = _clouds(torch.float32)
    big_x, big_y = x * 1e20, y * 1e20  # finite, but |x - y|^2 ~ 1e40 > float32's 3.4e38
    with pytest.raises(ValueError, match=r"X_a and X_b.*overflow.*float32"):
        solve_sample(big_x, big_y, reg=1.0, backend=backend)
    with pytest.raises(ValueError, match=r"x and y.*overflow"):
        SamplesLoss(backend=backend)(big_x, big_y)
    with pytest.raises(ValueError, match=r"x and y.*overflow"):
        ops.softmin(big_x, big_y, torch.zeros(40), 1.0, backend=backend)


@pytest.mark.parametrize("backend", ["dense", "tiled"])
def test_large_points_in_float64_follow_the_scaling_law(backend):
    """The same points in float64 are fine: OT_{s^2 reg}(s x, s y) = s^2 OT_reg(x, y)."""
    x, y = _clouds(torch.float64)
    s = 1e20
    ref = solve_sample(x, y, reg=0.1, backend="dense", tol=1e-10, max_iter=5000)
    big = solve_sample(x * s, y * s, reg=0.1 * s**2, backend=backend, tol=1e-10, max_iter=5000)
    assert big.converged and ref.converged
    assert abs(float(big.value) / s**2 - float(ref.value)) < 1e-10 * abs(float(ref.value))


def test_float16_points_whose_squares_overflow_float16_are_computed_in_float32():
    """|x|^2 ~ 1e5 overflows float16 (max 65504) but not the float32 compute dtype."""
    x, y = _clouds(torch.float32)
    x16, y16 = (x * 300).half(), (y * 300).half()
    res = solve_sample(x16, y16, reg=2e4, tol=None, max_iter=300)
    ref = solve_sample(x16.double(), y16.double(), reg=2e4, tol=1e-12, max_iter=300)
    assert ref.converged
    assert res.value.dtype == torch.float16 and math.isfinite(float(res.value))
    assert abs(float(res.value) - float(ref.value)) < 2e-3 * abs(float(ref.value))
