"""Hardening (issue 12, item 6): plan products, zero weights and devices.

* ``plan @ V`` and ``ops.plan_product`` are differentiable w.r.t. ``V`` (linear: the VJP is
  ``P^T G``); reference: autograd through the dense float64 plan ``P`` built in torch.
* ``ops.plan_product`` rejects NaN / Inf in ``V`` (as ``plan @ V`` does), naming ``V``, and
  a gradient it cannot give (x, y, alpha, beta) raises instead of being dropped.
* The ``tiled`` softmin of an all-zero-weight row is ``+inf`` (like dense / cpu, and the
  closed form ``-eps log 0``), not 3.4e37.
* Meta-device (and non-strided) tensors are rejected up front, naming the argument.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flashot import SamplesLoss, ops, solve_sample
from flashot.plan import plan_from_potentials

pytestmark = pytest.mark.usefixtures("one_thread")

ENGINES = ["dense", "tiled", "cpu"]


def _clouds(dtype=torch.float64, seed=0, n=20, m=15):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, generator=g, dtype=dtype), torch.rand(m, 3, generator=g, dtype=dtype)


def _dense_plan(x, y, f, g, reg):
    """P_ij = a_i b_j exp((f_i + g_j - |x_i - y_j|^2) / reg), uniform weights, float64 torch."""
    x, y, f, g = (t.detach().double() for t in (x, y, f, g))
    C = torch.cdist(x, y) ** 2
    return torch.exp((f[:, None] + g[None] - C) / reg) / (len(x) * len(y))


@pytest.mark.parametrize("backend", ENGINES)
@pytest.mark.parametrize("vec", [True, False])
def test_plan_matmul_is_differentiable_in_V(backend, vec):
    x, y = _clouds()
    res = solve_sample(x, y, reg=0.1, backend=backend, tol=1e-9)
    P = _dense_plan(x, y, *res.potentials, 0.1)
    V = torch.rand(15, *(() if vec else (4,)), dtype=torch.float64, requires_grad=True)
    out = res.plan @ V
    assert out.requires_grad
    G = torch.rand_like(out)
    (gV,) = torch.autograd.grad(out, V, G)
    assert torch.allclose(out.detach(), P @ V.detach(), rtol=1e-10, atol=0)
    assert torch.allclose(gV, P.T @ G, rtol=1e-10, atol=0)
    # the transposed plan too, and a second derivative (the map is linear: d/dG <P^T G, W>)
    U = torch.rand(20, dtype=torch.float64, requires_grad=True)
    (gU,) = torch.autograd.grad((res.plan.T @ U).sum(), U, create_graph=True)
    assert torch.allclose(gU, P.sum(1), rtol=1e-10, atol=0)
    # cost-weighted products are linear in V as well
    Vc = torch.rand(15, 2, dtype=torch.float64, requires_grad=True)
    (gc,) = torch.autograd.grad(res.plan.apply(Vc, "cost").sum(), Vc)
    C = torch.cdist(x, y) ** 2
    assert torch.allclose(gc, (P * C).T @ torch.ones(20, 2, dtype=torch.float64), rtol=1e-10, atol=0)


def test_plan_matmul_float32_V_gradient_and_numpy():
    x, y = _clouds(torch.float32)
    res = solve_sample(x, y, reg=0.1, tol=1e-6)
    P = _dense_plan(x, y, *res.potentials, 0.1)
    V = torch.rand(15, 3, requires_grad=True)
    (gV,) = torch.autograd.grad((res.plan @ V).sum(), V)
    assert gV.dtype == torch.float32
    assert float((gV.double() - P.T @ torch.ones(20, 3, dtype=torch.float64)).abs().max()) < 1e-6
    out = res.plan @ np.ones((15, 2))  # numpy in, numpy out, no autograd
    assert isinstance(out, np.ndarray)


@pytest.mark.parametrize("backend", ENGINES)
def test_ops_plan_product_is_differentiable_in_V(backend):
    x, y = _clouds()
    alpha, beta = torch.randn(20, dtype=torch.float64), torch.randn(15, dtype=torch.float64)
    V = torch.rand(15, 2, dtype=torch.float64, requires_grad=True)
    out = ops.plan_product(x, y, alpha, beta, 0.3, V, backend=backend)
    K = torch.exp(alpha[:, None] + beta[None] - torch.cdist(x, y) ** 2 / 0.3)
    G = torch.rand_like(out)
    (gV,) = torch.autograd.grad(out, V, G)
    assert torch.allclose(out.detach(), K @ V.detach(), rtol=1e-10, atol=0)
    assert torch.allclose(gV, K.T @ G, rtol=1e-10, atol=0)


@pytest.mark.parametrize("name", ["x", "y", "alpha", "beta"])
def test_ops_plan_product_refuses_a_gradient_it_cannot_give(name):
    x, y = _clouds()
    args = dict(x=x, y=y, alpha=torch.zeros(20, dtype=torch.float64), beta=torch.zeros(15, dtype=torch.float64))
    args[name] = args[name].clone().requires_grad_()
    V = torch.rand(15, dtype=torch.float64)
    with pytest.raises(ValueError, match=rf"^{name}: .*differentiable"):
        ops.plan_product(args["x"], args["y"], args["alpha"], args["beta"], 0.3, V)
    with torch.no_grad():  # no gradient requested: fine
        ops.plan_product(args["x"], args["y"], args["alpha"], args["beta"], 0.3, V)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_plan_product_and_plan_matmul_reject_non_finite_V_alike(bad):
    x, y = _clouds()
    V = torch.rand(15, 2, dtype=torch.float64)
    V[3, 1] = bad
    with pytest.raises(ValueError, match=r"^V: contains NaN or Inf"):
        ops.plan_product(x, y, torch.zeros(20, dtype=torch.float64), torch.zeros(15, dtype=torch.float64), 0.3, V)
    res = solve_sample(x, y, reg=0.1)
    with pytest.raises(ValueError, match=r"^V: contains NaN or Inf"):
        res.plan @ V


@pytest.mark.parametrize("backend", ENGINES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_all_zero_weight_softmin_is_plus_inf(backend, dtype):
    """-eps log(sum of nothing) = +inf, on every engine; partly zero rows are unaffected."""
    x, y = _clouds(dtype)
    h = torch.full((2, 15), -math.inf, dtype=dtype)
    h[1, :5] = 0.0
    out = ops.softmin(x.expand(2, -1, -1), y.expand(2, -1, -1), h, 0.1, backend=backend)
    assert bool(torch.isposinf(out[0]).all()), out[0]
    ref = -0.1 * torch.logsumexp(-(torch.cdist(x, y[:5]).double() ** 2) / 0.1, -1)
    tol = (1e-5 if dtype == torch.float32 else 1e-10) * float(ref.abs().max())
    assert float((out[1].double() - ref).abs().max()) <= tol


def test_tiled_plan_product_of_an_all_zero_weight_row_is_zero():
    x, y = _clouds()
    beta = torch.full((15,), -math.inf, dtype=torch.float64)
    out = ops.plan_product(
        x, y, torch.zeros(20, dtype=torch.float64), beta, 0.1, torch.ones(15, dtype=torch.float64), backend="tiled"
    )
    assert bool((out == 0).all())


def _meta(shape):
    return torch.empty(*shape, device="meta")


@pytest.mark.parametrize("which", ["x", "y"])
def test_meta_points_are_rejected_by_name(which):
    x, y = _clouds(torch.float32)
    xm = _meta(x.shape) if which == "x" else x
    ym = _meta(y.shape) if which == "y" else y
    name = {"x": "X_a", "y": "X_b"}[which]
    with pytest.raises(ValueError, match=rf"^{name}: .*meta"):
        solve_sample(xm, ym, reg=0.1)
    with pytest.raises(ValueError, match=rf"^{which}: .*meta"):
        SamplesLoss()(xm, ym)
    with pytest.raises(ValueError, match=rf"^{which}: .*meta"):
        ops.softmin(xm, ym, torch.zeros(15), 0.1)
    with pytest.raises(ValueError, match=rf"^{which}: .*meta"):
        plan_from_potentials(xm, ym, torch.zeros(20), torch.zeros(15), reg=0.1)


def test_meta_weights_h_and_V_are_rejected_by_name():
    x, y = _clouds(torch.float32)
    with pytest.raises(ValueError, match=r"^a: .*meta"):
        solve_sample(x, y, _meta((20,)), None, reg=0.1)
    with pytest.raises(ValueError, match=r"^h: .*meta"):
        ops.softmin(x, y, _meta((15,)), 0.1)
    with pytest.raises(ValueError, match=r"^V: .*meta"):
        ops.plan_product(x, y, torch.zeros(20), torch.zeros(15), 0.1, _meta((15, 2)))
    res = solve_sample(x, y, reg=0.1)
    with pytest.raises(ValueError, match=r"^V: .*meta"):
        res.plan @ _meta((15, 2))


def test_sparse_points_are_rejected_by_name():
    x, y = _clouds(torch.float32)
    with pytest.raises(ValueError, match=r"^X_a: .*(strided|sparse)"):
        solve_sample(x.to_sparse(), y, reg=0.1)
