"""Property-based fuzzing (hypothesis) of Gromov-Wasserstein across scales and dtypes (issue 34).

Problems: X (n, dx), Y (m, dy) with n, m in 5..30 and dx, dy in 1..3 (uniform in a box or Gaussian, offset,
uniform or random weights), a scale ``s`` in [1e-3, 1e3] applied to both clouds and ``s^4`` to ``reg``, dtype
float32 or float64, engine ``dense`` or ``cpu``.  ``reg = rho max(D^x) max(D^y)`` with ``rho`` in [0.05, 1] (the
linearised cost is at most ~4 max(D^x) max(D^y)): one stationary point reached from ``a b^T`` in tens of outer
steps (smaller ``rho`` takes hundreds: too slow for a fuzz test).

The reference is written here (its Sinkhorn in tests/references.py), independently of the library: POT's projected gradient in dense float64 torch
(``C(T) = 2 (D^x)^2 a 1^T + 2 1 b^T (D^y)^2 - 4 D^x T D^y``, each step a log-domain Sinkhorn solve to 1e-13),
from ``T = a b^T``, on the points *as rounded to the dtype under test*, divided by ``s`` (the unit scale; the
mathematics says ``value(s) = s^4 value(1)`` and the coupling does not depend on ``s``), run until the coupling
changes by less than 1e-12.

Checked: ``converged=True``; ``value / s^4`` against the reference's GW loss, and the dense plan against its
coupling (max abs difference relative to ``max T``).  Tolerances: float64 ``1e-7`` (value) and ``1e-5``
(plan), from the stopping tolerances (1e-9 on ``|T - T_prev|_F``); float32 ``K u (4 / rho + log2(nm))``
with ``u = 2^-24`` (the rounding of one linearised cost over ``reg``, which every exponent carries) times
``K = 32`` (value) and ``K = 1000`` (plan: the coupling is a fixed point of the projected-gradient map, whose
conditioning amplifies the exponents' rounding; the value is stationary in it).  Measured over 60 examples
(``FLASHOT_FUZZ_EXAMPLES=60``, the error / tolerance buckets are printed by ``--hypothesis-show-statistics``):
the largest errors are below 0.1 of these tolerances (float32 and float64, value and plan).

Profiles (``tests/fuzzing.py``: ``fuzz_settings``): CI 6 examples (a few seconds), long 300.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import event, given, note  # noqa: E402 - after the importorskip
from hypothesis import strategies as st  # noqa: E402 - after the importorskip

import flashot  # noqa: E402 - after the importorskip
from fuzzing import fuzz_settings  # noqa: E402 - after the importorskip
from references import log_sinkhorn  # noqa: E402 - after the importorskip

pytestmark = pytest.mark.usefixtures("one_thread")

U32 = 2.0**-24
K_VALUE, K_PLAN = 32.0, 1000.0
F64_VALUE, F64_PLAN = 1e-7, 1e-5


def _cpu_available() -> bool:
    from flashot.costs import FeatureBilinearCost
    from flashot.ops import get_engine

    try:
        eng = get_engine(
            "cpu", device=torch.device("cpu"), dtype=torch.float32, cost=FeatureBilinearCost(torch.zeros(1, 2, 2))
        )
    except ValueError:  # the cpu engine could not be built here
        return False
    return eng.name == "cpu"


ENGINES = ["dense"] + (["cpu"] if _cpu_available() else [])


def gw_reference(X: torch.Tensor, Y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, reg: float):
    """POT's entropic GW (square loss, projected gradient from ``a b^T``) in dense float64: ``(value, T)``."""
    DX, DY = torch.cdist(X, X) ** 2, torch.cdist(Y, Y) ** 2
    const = 2.0 * ((DX**2) @ a).unsqueeze(1) + 2.0 * ((DY**2) @ b).unsqueeze(0)
    T, g = torch.outer(a, b), torch.zeros_like(b)
    for _ in range(5000):
        T_new, g = log_sinkhorn(const - 4.0 * DX @ T @ DY, a, b, reg, 1e-13, 100000, g)  # L1 marginal error 1e-13
        done = float((T_new - T).norm()) < 1e-12
        T = T_new
        if done:
            break
    else:
        raise AssertionError("reference GW did not converge")
    value = ((DX**2) @ a) @ a + ((DY**2) @ b) @ b - 2.0 * (DX @ T @ DY * T).sum()
    return float(value), T


@st.composite
def gw_problems(draw):
    n, m = draw(st.integers(5, 30)), draw(st.integers(5, 30))
    dx, dy = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    gauss = draw(st.booleans())
    X = (
        torch.randn(n, dx, generator=gen, dtype=torch.float64)
        if gauss
        else torch.rand(n, dx, generator=gen, dtype=torch.float64)
    )
    Y = (
        torch.randn(m, dy, generator=gen, dtype=torch.float64)
        if gauss
        else torch.rand(m, dy, generator=gen, dtype=torch.float64)
    )
    X = X + 10.0 * draw(st.floats(-1.0, 1.0))  # an offset: GW is translation invariant
    if draw(st.booleans()):
        a = torch.rand(n, generator=gen, dtype=torch.float64) + 0.2
        b = torch.rand(m, generator=gen, dtype=torch.float64) + 0.2
        a, b = a / a.sum(), b / b.sum()
    else:
        a, b = torch.full((n,), 1.0 / n, dtype=torch.float64), torch.full((m,), 1.0 / m, dtype=torch.float64)
    s = 10.0 ** draw(st.floats(-3.0, 3.0))
    rho = 10.0 ** draw(st.floats(math.log10(0.05), 0.0))
    return {"X": X, "Y": Y, "a": a, "b": b, "s": s, "rho": rho, "seed": seed}


@fuzz_settings(6, 300)
@given(p=gw_problems(), dtype=st.sampled_from([torch.float32, torch.float64]), engine=st.sampled_from(ENGINES))
def test_gw_scale_dtype_fuzz(p, dtype, engine):
    s = p["s"]
    Xs, Ys = (s * p["X"]).to(dtype), (s * p["Y"]).to(dtype)
    a, b = p["a"].to(dtype), p["b"].to(dtype)
    # the reference at the unit scale, on the points as rounded to the dtype under test
    X1, Y1 = Xs.double() / s, Ys.double() / s
    a1, b1 = a.double() / a.double().sum(), b.double() / b.double().sum()
    DXmax, DYmax = float((torch.cdist(X1, X1) ** 2).max()), float((torch.cdist(Y1, Y1) ** 2).max())
    reg1 = p["rho"] * DXmax * DYmax
    value_ref, T_ref = gw_reference(X1, Y1, a1, b1, reg1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        r = flashot.gromov_wasserstein(Xs, Ys, a, b, reg=reg1 * s**4, backend=engine)
    # an inner solve that did not reach inner_tol says so (a warning and inner_converged=False); the result is
    # then compared all the same: converged=True promises the coupling
    event(f"inner_converged={r.inner_converged}, warnings={len(caught)}")
    T = r.plan.to_dense().double()
    value = float(r.value) / s**4
    if dtype == torch.float64:
        tol_value, tol_plan = F64_VALUE, F64_PLAN
    else:
        resolution = U32 * (4.0 / p["rho"] + math.log2(X1.shape[0] * Y1.shape[0]))
        tol_value, tol_plan = K_VALUE * resolution, K_PLAN * resolution
    err_value = abs(value - value_ref) / abs(value_ref)
    err_plan = float((T - T_ref).abs().max() / T_ref.max())
    note(
        f"s={s:.3g} rho={p['rho']:.3g} n_outer={r.n_outer} value {value:.10g} ref {value_ref:.10g} "
        f"err/tol value {err_value / tol_value:.3g} plan {err_plan / tol_plan:.3g}"
    )
    kind = "float64" if dtype == torch.float64 else "float32"
    for what, ratio in (("value", err_value / tol_value), ("plan", err_plan / tol_plan)):
        event(f"{kind} {what} err/tol: " + ("0" if ratio == 0 else f"1e{math.floor(math.log10(ratio))}"))
    assert r.converged
    assert err_value <= tol_value
    assert err_plan <= tol_plan
