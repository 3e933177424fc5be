"""Property-based fuzzing (hypothesis) of ``backend="multiscale"`` against single scale and the dense reference.

Problems: d in 1..8, N and M in 1..60 (often tiny), clouds uniform in a box of side 1..4 with an offset, the
second cloud shifted or not, uniform or random weights (``SamplesLoss``: uniform; ``solve_sample``: random,
equal masses when balanced), blur / reg from 0.1 to 2 x the box side, balanced or unbalanced (``reach`` /
``unbalanced`` finite).  Every solve runs to ``tol = 1e-9`` (``truncate`` is then raised to ``log(1 / tol)``:
the dropped plan entries are below ``1e-9 a_i b_j``), so the three answers are the same fixed point:

* ``multiscale`` vs the single-scale ``cpu`` engine and vs the dense float64 engine (``backend="tensorized"`` /
  ``"dense"``: explicit cost matrices): value within ``1e-7`` relative to ``1 + |value|`` (``SamplesLoss``:
  relative to the transport cost's scale, the debiased value being near 0 for close clouds), gradients in x
  within ``1e-5`` relative to the reference's norm (plus a floor of ``1e-9``).
* ``solve_sample``: the value, and the marginals of the returned plan (balanced problems).

Profiles (``tests/fuzzing.py``: ``fuzz_settings``): CI 8 examples per target, long 1,000.
"""

from __future__ import annotations

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import assume, given, note  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import flashot  # noqa: E402
from fuzzing import fuzz_settings  # noqa: E402

F64 = torch.float64
TOL = 1e-9
VALUE_RTOL = 1e-7
GRAD_RTOL = 1e-5


@st.composite
def problems(draw):
    """(x, y, a, b, blur, reach) as float64 tensors: a, b random positive weights of equal mass 1."""
    d = draw(st.integers(1, 8))
    n = draw(st.one_of(st.just(1), st.integers(1, 60)))
    m = draw(st.one_of(st.just(1), st.integers(1, 60)))
    side = draw(st.sampled_from([1.0, 2.0, 4.0]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    offset = draw(st.sampled_from([0.0, -3.0, 10.0]))
    x = offset + side * torch.rand(n, d, generator=gen, dtype=F64)
    shift = draw(st.sampled_from([0.0, 0.1, 0.5])) * side
    y = offset + shift + side * torch.rand(m, d, generator=gen, dtype=F64)
    a = torch.rand(n, generator=gen, dtype=F64) + 0.1
    b = torch.rand(m, generator=gen, dtype=F64) + 0.1
    blur = side * draw(st.sampled_from([0.1, 0.3, 1.0, 2.0]))
    reach = draw(st.sampled_from([None, None, 0.5, 3.0]))
    reach = None if reach is None else reach * side
    note(f"d={d} n={n} m={m} side={side} offset={offset} shift={shift} blur={blur} reach={reach}")
    return x, y, a / a.sum(), b / b.sum(), blur, reach


def _loss(x, y, blur, reach, backend):
    xs = x.clone().requires_grad_()
    L = flashot.SamplesLoss("sinkhorn", p=2, blur=blur, reach=reach, backend=backend, tol=TOL, max_iter=3000)
    v = L(xs, y)
    return float(v.detach()), torch.autograd.grad(v, xs)[0]


def _close_grad(g, g0):
    return float((g - g0).norm()) <= GRAD_RTOL * float(g0.norm()) + 1e-9


@fuzz_settings(8, 1000)
@given(problems())
def test_samples_loss_multiscale_fuzz(prob):
    x, y, _, _, blur, reach = prob
    scale = 1.0 + float(((x.mean(0) - y.mean(0)) ** 2).sum()) + float(x.var(0, unbiased=False).sum())
    v, g = _loss(x, y, blur, reach, "multiscale")
    for backend in ("cpu", "tensorized"):
        v0, g0 = _loss(x, y, blur, reach, backend)
        note(f"{backend}: value {v} vs {v0}, grad err {float((g - g0).norm()):.3e} / {float(g0.norm()):.3e}")
        assert abs(v - v0) <= VALUE_RTOL * scale, backend
        assert _close_grad(g, g0), backend


@fuzz_settings(8, 1000)
@given(problems())
def test_solve_sample_multiscale_fuzz(prob):
    x, y, a, b, blur, reach = prob
    reg = blur**2
    unbalanced = None if reach is None else reach**2
    out = {}
    for backend in ("multiscale", "cpu", "dense"):
        xs = x.clone().requires_grad_()
        r = flashot.solve_sample(xs, y, a, b, reg=reg, unbalanced=unbalanced, backend=backend, tol=TOL, max_iter=3000)
        assume(r.converged)  # (slow unbalanced solves at small reg: every engine alike)
        out[backend] = (float(r.value.detach()), torch.autograd.grad(r.value, xs)[0], r)
    v, g, r = out["multiscale"]
    for backend in ("cpu", "dense"):
        v0, g0, _ = out[backend]
        note(f"{backend}: value {v} vs {v0}, grad err {float((g - g0).norm()):.3e} / {float(g0.norm()):.3e}")
        assert abs(v - v0) <= VALUE_RTOL * (1.0 + abs(v0)), backend
        assert _close_grad(g, g0), backend
    if reach is None:  # balanced: the plan's marginals are the weights
        P = r.plan.to_dense() if hasattr(r.plan, "to_dense") else r.plan
        assert float((P.sum(1) - a).abs().sum()) <= 1e-7
        assert float((P.sum(0) - b).abs().sum()) <= 1e-7
