"""Scale invariance of (semi-relaxed) Gromov-Wasserstein (issue 34, finding 4).

Scaling both clouds by ``s`` and ``reg`` by ``s^4`` is the same problem: the coupling is unchanged and the
value is multiplied by ``s^4``.  The oracle is the float64 ``dense`` solve at ``s = 1``; float32 runs on the
``dense`` and ``cpu`` engines at ``s`` in {1e-2, 1, 1e3} must give its value and plan to float32 accuracy and
keep ``converged=True`` honest.  A float32 problem whose rounding cannot resolve a useful change of the
coupling is reported as not converged, with a RuntimeWarning.

Measured on this problem (12 x 15, reg = 0.1; float32, after the fix): value within 1.2e-6 relative of the
float64 oracle and plan products within 3e-6 at every scale on both engines (the tests ask for 1e-5 and 1e-4).
Before the fix the features ``[1, |x|^2, x]`` mixed the units ``1, s^2, s``, so the bound on the cost, which sets
the rounding floor of the stopping rule, eps-scaling and Anderson, grew like ``s^2 + s^-2`` relative to ``reg``: at ``s = 1e3``
the float32 solve of a 20 x 25 problem at reg = 0.03 stopped after one outer step with the value 0.143 instead
of 0.0567 (``converged=True``); here the inner solves at ``s = 1e3`` (and ``1e-2`` on ``cpu``) stopped reaching
their tolerance, and far below float32's resolution the loop reported convergence at its first check.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

import flashot

pytestmark = pytest.mark.usefixtures("one_thread")

REG = 0.1
SR_TOL = 1e-7
SCALES = [1e-2, 1.0, 1e3]


def _clouds(n=12, m=15, dx=3, dy=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, dx, generator=g, dtype=torch.float64), torch.rand(m, dy, generator=g, dtype=torch.float64))


def _engine_or_skip(name: str) -> None:
    if name == "cpu":
        from flashot.costs import FeatureBilinearCost
        from flashot.ops import get_engine

        try:
            eng = get_engine(
                "cpu", device=torch.device("cpu"), dtype=torch.float32, cost=FeatureBilinearCost(torch.zeros(1, 2, 2))
            )
        except ValueError as e:  # the cpu engine could not be built here
            pytest.skip(str(e))
        if eng.name != "cpu":
            pytest.skip("the cpu engine is not available here")


def _rel(u: torch.Tensor, v: torch.Tensor) -> float:
    return float((u.double() - v.double()).abs().max() / v.double().abs().max())


@functools.cache
def _oracle(semirelaxed: bool):
    """The float64 ``dense`` solve at ``s = 1``: its value, ``plan @ V`` for a fixed ``V``, ``V`` and the value's
    gradient w.r.t. ``X``."""
    X, Y = _clouds()
    X = X.clone().requires_grad_(True)
    V = torch.randn(Y.shape[0], 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    if semirelaxed:
        r = flashot.semirelaxed_gromov_wasserstein(X, Y, reg=REG, tol=SR_TOL, backend="dense")
    else:
        r = flashot.gromov_wasserstein(X, Y, reg=REG, backend="dense")
    assert r.converged
    (grad,) = torch.autograd.grad(r.value, X)
    return float(r.value.detach()), r.plan @ V, V, grad, r.n_outer


@pytest.mark.parametrize("backend", ["dense", "cpu"])
@pytest.mark.parametrize("s", SCALES)
def test_float32_value_and_plan_are_scale_invariant(backend, s):
    _engine_or_skip(backend)
    value64, PV64, V, _, _ = _oracle(False)
    X, Y = _clouds()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the inner solves resolve their tolerance at every scale
        r = flashot.gromov_wasserstein((s * X).float(), (s * Y).float(), reg=REG * s**4, backend=backend)
    assert r.converged and r.value.dtype == torch.float32
    assert abs(float(r.value) / s**4 - value64) <= 1e-5 * value64
    assert _rel(r.plan @ V.float(), PV64) < 1e-4


@pytest.mark.parametrize("s", [1e-2, 1e3])
def test_float64_scaled_problem_is_the_same_problem(s):
    """float64: the same outer iterations, the value times ``s^4`` and the coupling unchanged up to rounding,
    the gradient w.r.t. the points times ``s^3``."""
    value64, PV64, V, grad64, n_outer = _oracle(False)
    X, Y = _clouds()
    Xs = (s * X).requires_grad_(True)
    r = flashot.gromov_wasserstein(Xs, s * Y, reg=REG * s**4, backend="dense")
    assert r.converged and r.n_outer == n_outer
    assert abs(float(r.value.detach()) / s**4 - value64) <= 1e-10 * value64
    assert _rel(r.plan @ V, PV64) < 1e-8
    (grad,) = torch.autograd.grad(r.value, Xs)
    assert _rel(grad / s**3, grad64) < 1e-8


@pytest.mark.parametrize("s", [1e-2, 1e3])
def test_semirelaxed_scale_invariant(s):
    """The semi-relaxed solver computes in float64: float32 inputs at any scale give the oracle's value times
    ``s^4`` and its coupling, to the inputs' rounding."""
    value64, PV64, V, _, _ = _oracle(True)
    X, Y = _clouds()
    r = flashot.semirelaxed_gromov_wasserstein(
        (s * X).float(), (s * Y).float(), reg=REG * s**4, tol=SR_TOL, backend="dense"
    )
    assert r.converged
    assert abs(float(r.value) / s**4 - value64) <= 1e-5 * value64
    assert _rel(r.plan @ V.float(), PV64) < 1e-4


def test_float32_floor_above_any_useful_tol_is_not_converged():
    """``reg`` far below what float32 resolves at this cost scale (cost / reg ~ 1e6: rounding alone moves
    the coupling by more than 1% of its norm): the loop must not report convergence, and it says why."""
    X, Y = _clouds(8, 9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = flashot.gromov_wasserstein(X.float(), Y.float(), reg=1e-7, max_iter=11, inner_max_iter=20, backend="dense")
    assert not r.converged and r.status == "max_iter reached"
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert any("float32 rounding moves the coupling" in m and "not converged" in m for m in messages), messages
