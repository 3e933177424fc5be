"""Property-based fuzzing (hypothesis) of :func:`flashot.free_support_barycenter` in float64.

Problems: K = 1..3 clouds of N_k = 1..10 points in D = 1..3 (Gaussian, offset per cloud), a support of
M = 1..6 points, at a coordinate scale ``s`` in [1e-2, 1e2]; ``reg = rho s^2`` with ``rho`` in [0.3, 1]
(the clouds span a few ``s``: the largest cost over ``reg`` stays below ~1e2, where the inner solves and the
dense reference take hundreds of iterations; smaller ``rho`` is too slow for a fuzz test); cloud weights uniform (None) or random with zeros; ``b``
uniform or random with zeros (at least one positive entry); ``lambda`` uniform or random.

Checked for every valid input: a finite ``X`` (no NaN), massless support points (``b_i = 0``) kept at
``X_init[i]``, and ``converged=True`` only with inner solves that met ``inner_tol``; then the
invariants of the mathematics (each up to the solver tolerances, ``TOL_X s``):

* ``converged=True`` is a promise: the exact barycentric map at the returned support, with plans from
  a dense float64 log-domain Sinkhorn (tests/references.py; L1 marginal error < 1e-12), moves ``X`` by
  ``|T(X) - X|_F^2 <= RESID stopThr`` (RESID: the map's step at the returned X is one more fixed-point
  step, of the size of the last one, ``<= stopThr``, plus the inner solves' error; measured ratios are
  printed by ``--hypothesis-show-statistics``);
* permuting the clouds (with their weights and lambdas) and scaling ``lambda`` by a constant (only
  ``lambda / sum(lambda)`` enters) does not change ``X``;
* translating the clouds and ``X_init`` by ``t`` translates ``X`` by ``t`` (``|x - y|^2`` is invariant).

Profiles (``tests/fuzzing.py``: ``fuzz_settings``): CI 10 examples, long 300.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import event, given, note  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import flashot  # noqa: E402
from fuzzing import fuzz_settings  # noqa: E402
from references import log_sinkhorn, sq_dist  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

RESID = 100.0  # |T(X) - X|^2 <= RESID stopThr at a converged result
TOL_X = 1e-6  # invariants: max |X - X'| <= TOL_X s (runs of as many steps; else 10 sqrt(stopThr))
STOP, INNER = 1e-8, 1e-8  # stopThr / s^2 and inner_tol of the runs


def exact_residual(X, Ys, As, b, lam, reg) -> float:
    """``|T(X) - X|_F^2`` for the exact barycentric map ``T(X)_i = sum_k lambda_k (P_k Y_k)_i / b_i``
    (``T(X)_i = X_i`` where ``b_i = 0``)."""
    X = torch.as_tensor(X, dtype=torch.float64)
    M = X.shape[0]
    b = torch.full((M,), 1 / M, dtype=torch.float64) if b is None else torch.as_tensor(b, dtype=torch.float64)
    lam = torch.as_tensor(lam, dtype=torch.float64)
    lam = lam / lam.sum()
    T = torch.zeros_like(X)
    for k, Y in enumerate(Ys):
        Y = torch.as_tensor(Y, dtype=torch.float64)
        a = torch.full((len(Y),), 1 / len(Y), dtype=torch.float64) if As is None else torch.as_tensor(As[k])
        # dense float64 Sinkhorn plan between (X, b) and (Y, a), cost |x - y|^2, marginals within 1e-12 (L1)
        T += lam[k] * (log_sinkhorn(sq_dist(X, Y), b, a, reg, 1e-12)[0] @ Y)
    keep = b > 0
    T[keep] /= b[keep, None]
    T[~keep] = X[~keep]
    return float(((T - X) ** 2).sum())


def _weights(draw, n: int, zeros: bool) -> np.ndarray:
    w = np.array(draw(st.lists(st.floats(0.05, 1.0), min_size=n, max_size=n)))
    if zeros and n > 1:
        mask = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
        if mask.any() and not mask.all():
            w[mask] = 0.0
    return w / w.sum()


@st.composite
def problems(draw):
    K, D, M = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 6))
    s = 10.0 ** draw(st.floats(-2, 2))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    Ns = [draw(st.integers(1, 10)) for _ in range(K)]
    Ys = [s * (rng.normal(size=(n, D)) + 2.0 * rng.normal(size=D)) for n in Ns]
    X0 = s * rng.normal(size=(M, D))
    As = None if draw(st.booleans()) else [_weights(draw, n, True) for n in Ns]
    b = None if draw(st.booleans()) else _weights(draw, M, True)
    lam = None if draw(st.booleans()) else _weights(draw, K, False)
    rho = 10.0 ** draw(st.floats(-0.5, 0))
    return dict(Ys=Ys, As=As, X0=X0, b=b, lam=lam, reg=rho * s * s, s=s)


def _run(Ys, As, X0, b, lam, reg, s, numItermax=100):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        X, log = flashot.free_support_barycenter(
            Ys,
            As,
            X0,
            reg,
            b=b,
            weights=lam,
            numItermax=numItermax,
            numInnerItermax=5000,
            stopThr=STOP * s * s,
            log=True,
            inner_tol=INNER,
        )
    cap = [w for w in rec if "numInnerItermax" in str(w.message)]
    assert bool(cap) == (not log.inner_converged), [str(w.message) for w in rec]
    return X, log


@fuzz_settings(10, 300)
@given(p=problems())
def test_barycenter_invariants(p):
    Ys, As, X0, b, lam, reg, s = (p[k] for k in ("Ys", "As", "X0", "b", "lam", "reg", "s"))
    note(f"K={len(Ys)} N={[len(Y) for Y in Ys]} M={len(X0)} s={s:.3g} reg/s^2={reg / s / s:.3g}")
    X, log = _run(Ys, As, X0, b, lam, reg, s)
    assert X.shape == X0.shape and np.isfinite(X).all()
    if b is not None:
        assert np.array_equal(X[b == 0], X0[b == 0])
    event(f"converged={log.converged}")
    if log.converged:
        assert log.inner_converged and log.inner_error <= INNER
        K = len(Ys)
        lam_ = np.full(K, 1 / K) if lam is None else lam
        ratio = exact_residual(X, Ys, As, b, lam_, reg) / (STOP * s * s)
        event(f"residual / stopThr: 10^{math.floor(math.log10(max(ratio, 1e-30)))}")
        assert ratio <= RESID, ratio

    def close(X2, log2):
        tol = TOL_X * s if log2.n_iter == log.n_iter else 10 * math.sqrt(STOP) * s
        return np.abs(X2 - X).max() <= tol

    # permuting the clouds (with their weights and lambdas), lambdas times 7
    perm = list(range(len(Ys)))[::-1]
    lam7 = (np.full(len(Ys), 1 / len(Ys)) if lam is None else lam)[perm] * 7.0
    Xp, logp = _run([Ys[k] for k in perm], None if As is None else [As[k] for k in perm], X0, b, lam7, reg, s)
    assert close(Xp, logp)
    # translation
    t = s * np.linspace(-3.0, 2.0, X0.shape[1])
    Xt, logt = _run([Y + t for Y in Ys], As, X0 + t, b, lam, reg, s)
    assert close(Xt - t, logt)


def test_copies_of_one_measure():
    """K identical clouds have the barycenter of one (``T`` is the same map); at small reg it is the cloud
    itself (X_init = Y, b = a: the plan is the identity up to exp(-1 / 0.04) relative terms)."""
    rng = np.random.default_rng(3)
    Y = np.stack(np.meshgrid(np.arange(3.0), np.arange(2.0)), -1).reshape(-1, 2)  # 6 points, gap 1
    a = rng.random(6) + 0.5
    a /= a.sum()
    kw = dict(numItermax=50, inner_tol=1e-10, numInnerItermax=5000, stopThr=1e-12)
    X1 = flashot.free_support_barycenter([Y], [a], Y + 0.1, 0.04, b=a, **kw)
    X3 = flashot.free_support_barycenter([Y] * 3, [a] * 3, Y + 0.1, 0.04, b=a, weights=[0.2, 0.3, 0.5], **kw)
    assert np.abs(X3 - X1).max() < 1e-9
    assert np.abs(X1 - Y).max() < 1e-6
