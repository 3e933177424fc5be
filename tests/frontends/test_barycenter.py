"""Free-support entropic barycenters (issue 14, item 4) against POT's
``ot.bregman.free_support_sinkhorn_barycenter`` (POT's test ``test_free_support_sinkhorn_barycenter``
in ``test/test_bregman.py`` uses the same call; here with clouds of several sizes and weights)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashot

ot = pytest.importorskip("ot")


def _clouds(seed=0):
    rng = np.random.default_rng(seed)
    Ys = [rng.normal(size=(30, 2)) + [2.0 * k, 0.0] for k in range(3)]  # equal sizes: one batch
    As = [np.full(30, 1 / 30) for _ in range(3)]
    Ys.append(0.5 * rng.normal(size=(20, 2)))  # another size, skewed weights: its own solve
    w = rng.random(20) + 0.1
    As.append(w / w.sum())
    return Ys, As, rng.normal(size=(15, 2))


@pytest.mark.parametrize("backend", ["auto", "tiled", "cpu"])
def test_matches_pot(backend):
    Ys, As, X0 = _clouds()
    ref = ot.bregman.free_support_sinkhorn_barycenter(Ys, As, X0, 0.5, numItermax=20, stopThr=1e-12)
    X, log = flashot.free_support_barycenter(
        Ys, As, X0, 0.5, numItermax=20, stopThr=1e-12, log=True, inner_tol=1e-12, numInnerItermax=5000, backend=backend
    )
    assert isinstance(X, np.ndarray) and X.shape == X0.shape
    assert np.abs(X - ref).max() < 1e-7  # POT's inner solves stop at its stopThr 1e-9
    assert log.n_iter == 20 and len(log.displacement_square_norms) == 20
    # warm starts: later steps need fewer inner iterations than the first
    assert log.inner_iterations[-1] < log.inner_iterations[0]


def test_barycenter_weights_b_and_lambdas_match_pot():
    Ys, As, X0 = _clouds(1)
    b = np.linspace(1, 2, 15)
    b /= b.sum()
    lam = np.array([0.1, 0.2, 0.3, 0.4])
    ref = ot.bregman.free_support_sinkhorn_barycenter(Ys, As, X0, 1.0, b=b, weights=lam, numItermax=10)
    X = flashot.free_support_barycenter(
        Ys, As, X0, 1.0, b=b, weights=lam, numItermax=10, inner_tol=1e-12, numInnerItermax=5000
    )
    assert np.abs(X - ref).max() < 1e-7


def test_float32_torch_and_stopping():
    Ys, As, X0 = _clouds(2)
    ref = flashot.free_support_barycenter(Ys, None, X0, 0.5, numItermax=30, stopThr=1e-300, inner_tol=1e-10)
    Yt = [torch.tensor(Y, dtype=torch.float32) for Y in Ys]
    X0t = torch.tensor(X0, dtype=torch.float32)
    X = flashot.free_support_barycenter(Yt, None, X0t, 0.5, numItermax=30, stopThr=1e-300)
    assert isinstance(X, torch.Tensor) and X.dtype == torch.float32
    assert np.abs(X.double().numpy() - ref).max() < 1e-4
    X, log = flashot.free_support_barycenter(Yt, None, X0t, 0.5, numItermax=500, stopThr=1e-6, log=True)
    assert log.converged and log.n_iter < 500
    assert log.displacement_square_norms[-1] <= 1e-6 < log.displacement_square_norms[0]
    # the weights matter: the given As (skewed 4th cloud) move the barycenter
    Xw = flashot.free_support_barycenter(Ys, As, X0, 0.5, numItermax=30, stopThr=1e-300, inner_tol=1e-10)
    assert np.abs(Xw - ref).max() > 1e-3


@pytest.mark.parametrize(
    "call, exc, msg",
    [
        (lambda Y, A, X: flashot.free_support_barycenter(Y, A, X, 0.0), ValueError, "reg"),
        (lambda Y, A, X: flashot.free_support_barycenter([], A, X, 0.5), TypeError, "measures_locations"),
        (
            lambda Y, A, X: flashot.free_support_barycenter([Y[0][:, :1]], None, X, 0.5),
            ValueError,
            r"measures_locations\[0\]",
        ),
        (lambda Y, A, X: flashot.free_support_barycenter(Y, A[:2], X, 0.5), ValueError, "measures_weights"),
        (lambda Y, A, X: flashot.free_support_barycenter(Y, A, X[0], 0.5), ValueError, "X_init"),
        (lambda Y, A, X: flashot.free_support_barycenter(Y, A, X, 0.5, weights=[1, -1, 1, 1]), ValueError, "weights"),
        (lambda Y, A, X: flashot.free_support_barycenter(Y, A, X, 0.5, numItermax=0), ValueError, "numItermax"),
        (lambda Y, A, X: flashot.free_support_barycenter(Y, A, "X", 0.5), TypeError, "X_init"),
        (
            lambda Y, A, X: flashot.free_support_barycenter(Y, [A[0][:-1]] + A[1:], X, 0.5),
            ValueError,
            r"measures_weights\[0\]: expected shape \(30,\)",
        ),
        (lambda Y, A, X: flashot.free_support_barycenter(Y, A, X, 0.5, inner_tol=-1.0), ValueError, "inner_tol"),
    ],
)
def test_bad_input(call, exc, msg):
    Ys, As, X0 = _clouds()
    with pytest.raises(exc, match=msg):
        call(Ys, As, X0)
