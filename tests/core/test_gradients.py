"""Analytic (envelope-theorem) gradients."""

import pytest
import torch

import flashot
from conftest import rel_err
from references import sinkhorn_unrolled


def _graph_size(t: torch.Tensor) -> int:
    seen, stack = set(), [t.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        stack.extend(f for f, _ in fn.next_functions)
    return len(seen)


def test_graph_does_not_grow_with_iterations():
    x = torch.randn(30, 2, dtype=torch.float64, requires_grad=True)
    y = torch.randn(20, 2, dtype=torch.float64)
    sizes = []
    for it in (3, 40):
        res = flashot.solve_sample(x, y, reg=0.1, max_iter=it, tol=None, backend="tiled")
        sizes.append(_graph_size(res.value))
    assert sizes[0] == sizes[1]
    L5 = flashot.SamplesLoss(blur=0.5, backend="tiled")(x, y)
    L50 = flashot.SamplesLoss(blur=0.01, scaling=0.9, backend="tiled")(x, y)  # many more iterations
    assert _graph_size(L5) == _graph_size(L50)


@pytest.mark.parametrize("backend", ["dense", "tiled"])
@pytest.mark.parametrize("method", ["sinkhorn", "symmetric"])
def test_gradcheck_solve_sample(backend, method):
    """At a converged fixed point the envelope gradient is the exact derivative.

    (SamplesLoss' epsilon-scaling does one iteration per temperature, so its gradients
    are GeomLoss' approximations; those are checked against GeomLoss elsewhere.)"""
    # 5 x 4 points (n != m): gradcheck re-solves twice per input (27 here), and these points converge to
    # 1e-14 in ~140 symmetric iterations (7 x 5 points needed ~1040: 40 s per case instead of ~4)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 2, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(4, 2, generator=g, dtype=torch.float64, requires_grad=True)
    a = (torch.rand(5, generator=g, dtype=torch.float64) + 0.5).requires_grad_()
    b = (torch.rand(4, generator=g, dtype=torch.float64) + 0.5).requires_grad_()

    def f(a, x, b, y):
        # weights normalised inside, so perturbations stay balanced
        res = flashot.solve_sample(
            x, y, a / a.sum(), b / b.sum(), reg=0.5, tol=1e-14, max_iter=10_000, method=method, backend=backend
        )
        return res.value

    assert torch.autograd.gradcheck(f, (a, x, b, y), eps=1e-6, atol=1e-6, rtol=1e-4)


def test_solve_sample_gradient_matches_autograd_through_dense_iterations():
    """Reference: plain autograd through many dense log-domain iterations (converged)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(25, 3, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(20, 3, generator=g, dtype=torch.float64, requires_grad=True)
    eps = 0.5
    a = torch.full((25,), 1 / 25, dtype=torch.float64)
    b = torch.full((20,), 1 / 20, dtype=torch.float64)
    C = ((x[:, None] - y[None]) ** 2).sum(-1)
    f, gg = sinkhorn_unrolled(C, a.log(), b.log(), eps, 300)
    ref_val = (a * f).sum() + (b * gg).sum()
    ref = torch.autograd.grad(ref_val, [x, y])
    res = flashot.solve_sample(x, y, reg=eps, tol=1e-13, max_iter=2000, backend="tiled")
    out = torch.autograd.grad(res.value, [x, y])
    assert rel_err(res.value.detach(), ref_val.detach()) < 1e-12
    for o, r in zip(out, ref):
        assert rel_err(o, r) < 1e-8


def test_weights_gradient_is_potential():
    x = torch.randn(12, 2, dtype=torch.float64)
    y = torch.randn(9, 2, dtype=torch.float64)
    a = torch.full((12,), 1 / 12, dtype=torch.float64, requires_grad=True)
    b = torch.full((9,), 1 / 9, dtype=torch.float64, requires_grad=True)
    res = flashot.solve_sample(x, y, a, b, reg=0.3, tol=1e-12, backend="dense")
    ga, gb = torch.autograd.grad(res.value, [a, b])
    f, g = res.potentials
    assert rel_err(ga, f) < 1e-12 and rel_err(gb, g) < 1e-12


def test_half_precision_loss_and_gradient():
    x = torch.randn(60, 3)
    y = torch.randn(50, 3) + 0.5
    ref = flashot.SamplesLoss(backend="tiled")(x.bfloat16().float(), y.bfloat16().float())
    xb = x.bfloat16().requires_grad_()
    out = flashot.SamplesLoss(backend="tiled")(xb, y.bfloat16())
    assert out.dtype == torch.bfloat16
    (gx,) = torch.autograd.grad(out, [xb])
    assert gx.dtype == torch.bfloat16
    assert abs(float(out.detach()) - float(ref)) < 1e-2 * abs(float(ref))
