"""Invariants and limits that hold whatever the implementation: symmetry, S(a, a) = 0, S >= 0, the exact
effect of translating one cloud, unbalanced -> balanced as rho -> inf, kernel losses against their
definitions, and entropic OT between Gaussians approached by samples at the expected rate."""

from __future__ import annotations

import math

import pytest
import torch

import flashot
import references as ref

pytestmark = pytest.mark.usefixtures("one_thread")


def _cloud(n, seed, shift=0.0, d=2):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, d, generator=g, dtype=torch.float64) + shift
    w = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
    return x, w / w.sum()


@pytest.mark.parametrize("kw", [dict(), dict(p=1), dict(reach=0.5), dict(reach_x=0.5, reach_y=1.5)], ids=str)
def test_divergence_symmetric_zero_on_diagonal_nonnegative(kw):
    """S(a, b) = S(b, a), S(a, a) = 0 and S >= 0 on four pairs of clouds, given as one batch of four (each
    entry its own problem: the values equal one call per pair to 4e-15, measured, in a third of the time)."""
    L = flashot.SamplesLoss("sinkhorn", blur=0.3, tol=1e-12, max_iter=20_000, **kw)
    x, a = (torch.stack(t) for t in zip(*[_cloud(12, seed) for seed in range(4)]))
    y, b = (torch.stack(t) for t in zip(*[_cloud(15, seed + 100, shift=0.2 * seed) for seed in range(4)]))
    sab, sba, saa = L(a, x, b, y), L(b, y, a, x), L(a, x, a, x)
    assert sab.shape == (4,)
    for i in range(4):
        if "reach_x" not in kw:  # reach_x != reach_y is not symmetric in its arguments
            assert abs(float(sab[i] - sba[i])) < 1e-12 * max(1.0, abs(float(sab[i])))
        assert abs(float(saa[i])) < 1e-13
    assert float(sab.min()) >= 0


def test_translation_of_one_cloud():
    """Balanced OT with C = |x - y|^2 / 2: moving y by t adds |t|^2 / 2 - <t, E_a[x] - E_b[y]> exactly
    (sum_ij P_ij (x_i - y_j) = E_a[x] - E_b[y] for every coupling; the entropy term does not move)."""
    x, a = _cloud(11, 0)
    y, b = _cloud(13, 1, shift=0.3)
    t = torch.tensor([0.7, -0.4], dtype=torch.float64)
    L = flashot.SamplesLoss("sinkhorn", blur=0.3, debias=False, tol=1e-12, max_iter=20_000)
    gap = a @ x - b @ y
    want = float(L(a, x, b, y)) + 0.5 * float(t @ t) - float(t @ gap)
    assert abs(float(L(a, x, b, y + t)) - want) < 1e-11
    # and the debiased divergence: the self terms do not move at all
    S = flashot.SamplesLoss("sinkhorn", blur=0.3, tol=1e-12, max_iter=20_000)
    assert abs(float(S(a, x, b, y + t)) - float(S(a, x, b, y)) - 0.5 * float(t @ t) + float(t @ gap)) < 1e-11


def test_unbalanced_tends_to_balanced():
    """|OT_rho - OT| = O(1 / rho): the gap shrinks ~10x per decade of rho (solve_sample, generalised KL)."""
    x, a = _cloud(10, 2)
    y, b = _cloud(12, 3, shift=0.4)
    eps = 0.5  # the iterations contract by rho / (rho + eps): a large eps keeps them few
    bal = float(flashot.solve_sample(x, y, a, b, reg=eps, tol=1e-13, max_iter=50_000).value)
    assert abs(bal - ref.ot_value(x, y, a, b, eps, half=False)) < 1e-10 * abs(bal)
    gaps = [
        abs(float(flashot.solve_sample(x, y, a, b, reg=eps, unbalanced=rho, tol=1e-10, max_iter=50_000).value) - bal)
        for rho in (5.0, 50.0, 500.0)
    ]
    assert 5 < gaps[0] / gaps[1] < 20 and 5 < gaps[1] / gaps[2] < 20, gaps


@pytest.mark.parametrize("loss", ["gaussian", "laplacian", "energy"])
def test_kernel_losses_against_their_definition(loss):
    """``1/2 <a - b, k * (a - b)>`` as a dense double sum, and its gradient by finite differences."""
    x, a = _cloud(12, 4)
    y, b = _cloud(9, 5, shift=0.3)
    blur = 0.4
    kern = {
        "gaussian": lambda d2: torch.exp(-d2 / (2 * blur**2)),
        "laplacian": lambda d2: torch.exp(-d2.sqrt() / blur),
        "energy": lambda d2: -d2.sqrt(),
    }[loss]

    def exact(xx):
        z = torch.cat([xx, y])
        w = torch.cat([a, -b])
        return float(0.5 * w @ kern(ref.sq_dist(z, z)) @ w)

    xx = x.clone().requires_grad_()
    v = flashot.SamplesLoss(loss, blur=blur)(a, xx, b, y)
    assert abs(float(v.detach()) - exact(x)) < 1e-12 * abs(exact(x))
    (gx,) = torch.autograd.grad(v, xx)
    d = torch.randn(x.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    fd = ref.finite_difference(exact, x, d, h=1e-6)
    assert abs(float((gx * d).sum()) - fd) < 1e-7 * float(gx.abs().sum())


def _gaussian_ot(A, B, eps):
    """Entropic OT between centred Gaussians N(0, A), N(0, B), cost |x - y|^2 / 2, eps KL(P | a x b):
    half of Janati et al.'s (2020) OT_sigma with cost |x - y|^2 and 2 sigma^2 = 2 eps (sigma^2 = eps)."""
    d = A.shape[0]
    s2 = eps
    ev, V = torch.linalg.eigh(A)
    A12 = V @ torch.diag(ev.sqrt()) @ V.T
    M = 4 * A12 @ B @ A12 + s2 * s2 * torch.eye(d, dtype=A.dtype)
    ev, V = torch.linalg.eigh(M)
    Ds = V @ torch.diag(ev.sqrt()) @ V.T
    full = (
        torch.trace(A)
        + torch.trace(B)
        - torch.trace(Ds)
        + d * s2 * (1 - math.log(2 * s2))
        + s2 * torch.logdet(Ds + s2 * torch.eye(d, dtype=A.dtype))
    )
    return 0.5 * float(full)


def test_gaussian_closed_form_approached_by_samples():
    """OT_eps between n-sample empirical measures of two Gaussians tends to the closed form with error
    O(n^-1/2) (the sample complexity of entropic OT); averaged over 24 seeds, 16x the samples should
    divide the error by ~4 (accepted: 2.5 to 6.5; other groups of 24 seeds gave 3.7 to 5.0)."""
    A = torch.tensor([[1.0, 0.3], [0.3, 0.5]], dtype=torch.float64)
    B = torch.tensor([[0.6, -0.2], [-0.2, 0.8]], dtype=torch.float64)
    eps = 0.5
    want = _gaussian_ot(A, B, eps)
    LA, LB = torch.linalg.cholesky(A), torch.linalg.cholesky(B)
    L = flashot.SamplesLoss("sinkhorn", blur=math.sqrt(eps), debias=False, tol=1e-9, max_iter=10_000)
    errs = {}
    for n in (64, 1024):
        e = []
        for seed in range(24):
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(n, 2, generator=g, dtype=torch.float64) @ LA.T
            y = torch.randn(n, 2, generator=g, dtype=torch.float64) @ LB.T
            e.append((float(L(x, y)) - want) ** 2)
        errs[n] = math.sqrt(sum(e) / len(e))
    ratio = errs[64] / errs[1024]
    assert 2.5 < ratio < 6.5, (errs, ratio)
