"""Hardening (issue 12, item 2): float16 / bfloat16 inputs are computed in float32.

Default (uniform) weights used to be built in the input dtype: 1/N rounded to float16 makes
sum(a) != sum(b) (0.99975 vs 1.00021 for N=120, M=100), so no balanced solve could converge.
Reference: an independent float64 dense log-domain Sinkhorn (torch.logsumexp) on the same
(rounded) points with exact uniform weights.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from flashot import SamplesLoss, solve_sample
from references import sinkhorn_unrolled

pytestmark = pytest.mark.usefixtures("one_thread")

LOW = [torch.float16, torch.bfloat16]


def _clouds(seed=0, n=120, m=100):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, generator=g), torch.rand(m, 3, generator=g)


def dense_sinkhorn64(x, y, reg, iters=3000):
    """POT convention: min <C, P> + reg KL(P | a x b), C = |x - y|^2, uniform weights, float64."""
    x, y = x.double(), y.double()
    C = torch.cdist(x, y) ** 2
    la = torch.full((len(x),), -torch.log(torch.tensor(float(len(x)), dtype=torch.float64)))
    lb = torch.full((len(y),), -torch.log(torch.tensor(float(len(y)), dtype=torch.float64)))
    f, g = sinkhorn_unrolled(C, la, lb, reg, iters)
    return float((la.exp() * f).sum() + (lb.exp() * g).sum()), f, g


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("backend", ["dense", "tiled", "cpu"])
def test_default_weights_converge_in_low_precision(dtype, backend):
    x, y = _clouds()
    xl, yl = x.to(dtype), y.to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "did not reach tol"
        res = solve_sample(xl, yl, reg=0.05, tol=1e-5, backend=backend)
    assert res.converged and res.error < 1e-5
    assert res.value.dtype == dtype and res.potentials[0].dtype == dtype
    ref, f_ref, _ = dense_sinkhorn64(xl, yl, 0.05)
    # float32 compute, then one rounding to the output dtype (8 / 11 significant bits)
    rtol = 2 * torch.finfo(dtype).eps
    assert abs(float(res.value) - ref) <= rtol * abs(ref) + 1e-6
    gauge = float((res.potentials[0].double() - f_ref).mean())  # potentials are defined up to f + t, g - t
    assert float((res.potentials[0].double() - f_ref - gauge).abs().max()) <= 2 * rtol * float(f_ref.abs().max())
    # the returned plan has the uniform marginals (float32 sums, returned in the input dtype)
    ra = res.marginal_a
    assert ra.dtype == dtype
    assert float((ra.double() - 1 / 120).abs().max()) <= 1e-5 + rtol / 120


@pytest.mark.parametrize("dtype", LOW)
def test_samples_loss_low_precision_matches_float64(dtype):
    x, y = _clouds(1)
    xl, yl = x.to(dtype), y.to(dtype)
    out = SamplesLoss(blur=0.1, backend="tiled")(xl, yl)
    ref = SamplesLoss(blur=0.1, backend="dense")(xl.double(), yl.double())
    assert out.dtype == dtype
    assert abs(float(out) - float(ref)) <= 2 * torch.finfo(dtype).eps * abs(float(ref))


@pytest.mark.parametrize("dtype", LOW)
def test_default_weights_are_built_in_the_compute_dtype(dtype):
    from flashot.measures import Measures

    x, y = _clouds()
    m = Measures.build(x.to(dtype), y.to(dtype), None, None, cost="sqeuclidean", backend="tiled")
    assert m.a.dtype == torch.float32 and m.b.dtype == torch.float32
    assert abs(float(m.a.double().sum()) - 1.0) < 1e-6 and abs(float(m.b.double().sum()) - 1.0) < 1e-6
