"""Warm starts: fewer iterations, same answer (against converged references)."""

import pytest
import torch

import flashot
from conftest import rel_err

DT = torch.float64


def _clouds(N=60, M=70, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, 2, dtype=DT, generator=g)
    y = torch.randn(M, 2, dtype=DT, generator=g) * 0.5 + torch.tensor([1.5, 0.0], dtype=DT)
    return x, y, g


@pytest.mark.parametrize("method", ["sinkhorn", "symmetric"])
@pytest.mark.parametrize("backend", ["dense", "tiled"])
def test_solve_sample_warm_start_on_a_perturbed_problem(method, backend):
    x, y, gen = _clouds()
    first = flashot.solve_sample(x, y, reg=0.2, tol=1e-7, max_iter=20000, method=method, backend=backend)
    x2 = x + 0.002 * torch.randn(x.shape, dtype=DT, generator=gen)
    cold = flashot.solve_sample(x2, y, reg=0.2, tol=1e-7, max_iter=20000, method=method, backend=backend)
    warm = flashot.solve_sample(
        x2, y, reg=0.2, tol=1e-7, max_iter=20000, method=method, backend=backend, potentials_init=first.potentials
    )
    assert cold.converged and warm.converged
    assert warm.n_iter < 0.6 * cold.n_iter, (warm.n_iter, cold.n_iter)
    assert rel_err(warm.value, cold.value) < 1e-6
    # same plan (potentials agree up to the gauge f + t, g - t)
    V = torch.randn(70, 3, dtype=DT)
    assert rel_err(warm.plan @ V, cold.plan @ V) < 1e-6


def test_solve_sample_warm_start_bad_input():
    x, y, _ = _clouds(10, 12)
    with pytest.raises(ValueError, match=r"potentials_init\[1\]: expected shape"):
        flashot.solve_sample(x, y, reg=0.1, potentials_init=(torch.zeros(10), torch.zeros(10)))
    with pytest.raises(TypeError, match="potentials_init"):
        flashot.solve_sample(x, y, reg=0.1, potentials_init=torch.zeros(10))


def _reference_divergence(x, y, blur, debias):
    """OT_eps with the GeomLoss cost |x-y|^2/2 at eps = blur^2, solved to tol 1e-11."""

    def ot(p, q):
        return flashot.solve_sample(
            p, q, cost="half_sqeuclidean", reg=blur**2, tol=1e-8, max_iter=100000, method="symmetric"
        ).value

    v = ot(x, y)
    if debias:
        v = v - 0.5 * ot(x, x) - 0.5 * ot(y, y)
    return float(v)


@pytest.mark.parametrize("debias", [True, False])
@pytest.mark.parametrize("scaling", [0.5, 0.9])
def test_samples_loss_warm_start_fewer_iterations_same_value(debias, scaling):
    x, y, gen = _clouds()
    blur = 0.3
    cold = flashot.SamplesLoss(blur=blur, scaling=scaling, debias=debias, backend="tiled")
    warm = flashot.SamplesLoss(blur=blur, scaling=scaling, debias=debias, backend="tiled", warm_start=2.0)
    warm(x, y)  # fills the cache (full schedule)
    cold(x, y)
    n_full = cold.last_n_iter
    assert warm.last_n_iter == n_full
    x2 = x + 0.002 * torch.randn(x.shape, dtype=DT, generator=gen)
    v_cold, v_warm = float(cold(x2, y)), float(warm(x2, y))
    assert warm.last_n_iter <= 0.6 * n_full, (warm.last_n_iter, n_full)
    ref = _reference_divergence(x2, y, blur, debias)
    # GeomLoss' schedule is itself approximate: the warm value must be at least as close
    # to the converged reference (up to 1e-4 relative) and agree with the cold one to 1e-2.
    assert abs(v_warm - ref) <= abs(v_cold - ref) + 1e-4 * abs(ref), (v_warm, v_cold, ref)
    assert abs(v_warm - v_cold) <= 1e-2 * abs(ref)


def test_samples_loss_warm_start_gradients_and_cache_rules():
    x, y, gen = _clouds(60, 70)
    L = flashot.SamplesLoss(blur=0.1, backend="tiled", warm_start=2.0)
    xr = x.clone().requires_grad_()
    L(xr, y)
    n_full = L.last_n_iter
    # a gradient step, then a warm call: gradients close to the cold ones
    x2 = (x + 0.002 * torch.randn(x.shape, dtype=DT, generator=gen)).requires_grad_()
    (g_warm,) = torch.autograd.grad(L(x2, y), x2)
    assert L.last_n_iter < n_full
    assert torch.isfinite(g_warm).all()
    # another shape: the cache does not apply, the full schedule runs
    L(x[:50], y)
    Lfull = flashot.SamplesLoss(blur=0.1, backend="tiled")
    Lfull(x[:50], y)
    assert L.last_n_iter == Lfull.last_n_iter
    L.reset_warm_start()
    L(x[:50], y)
    assert L.last_n_iter == Lfull.last_n_iter
    # potentials=True works with warm starts too
    Lp = flashot.SamplesLoss(blur=0.1, backend="tiled", warm_start=True, potentials=True)
    F1, G1 = Lp(x, y)
    F2, G2 = Lp(x, y)
    assert Lp.last_n_iter < n_full
    assert rel_err(F2, F1) < 5e-2


def test_warm_start_bad_input():
    with pytest.raises(ValueError, match="warm_start"):
        flashot.SamplesLoss(warm_start=0.5)
    with pytest.raises(ValueError, match="warm_start"):
        flashot.SamplesLoss(warm_start="yes")
