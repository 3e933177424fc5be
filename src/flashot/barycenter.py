r"""Free-support entropic Wasserstein barycenters, streamed (POT's ``free_support_sinkhorn_barycenter``).

Given K weighted clouds ``(Y_k, a_k)`` with weights ``lambda_k`` (sum 1) and a barycenter support
``X`` (M, D) with fixed weights ``b``, the barycenter minimises ``sum_k lambda_k OT_eps(b_X, a_k)``
over ``X`` for the cost ``|x - y|^2`` at ``eps = reg``.  The fixed-point iteration (Cuturi &
Doucet 2014; POT's algorithm) is

    X  <-  sum_k lambda_k T_k(X),   T_k(X)_i = (P_k Y_k)_i / b_i,

with ``P_k`` the entropic plan between ``(X, b)`` and ``(Y_k, a_k)``: each step is K Sinkhorn
solves (:func:`flashot.solve_sample`, warm-started from the previous step's potentials) and K
streamed plan products, so no K x M x N matrix is ever built.  Clouds of equal size are solved
as one batch.  It stops when ``|X_new - X|_F^2 <= stopThr`` (POT's rule) or after ``numItermax``
steps.  Not differentiable (run under ``torch.no_grad``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from ._checks import check_int, check_positive
from .ot_samples import solve_sample

__all__ = ["free_support_barycenter", "BarycenterResult"]


@dataclass
class BarycenterResult:
    """``X`` (M, D) the barycenter support; ``displacement_square_norms`` per step; ``n_iter``;
    ``converged`` (``|X_new - X|^2 <= stopThr`` was reached); ``inner_iterations``: Sinkhorn
    iterations per step, summed over the clouds.

    ``displacement_square_norms[t] = |X_(t+1) - X_t|_F^2`` for the fixed-point step
    ``X <- sum_k lambda_k (P_k Y_k) / b`` (cost ``|x - y|^2``, ``eps = reg``).

    Example:
        >>> import torch, flashot
        >>> _ = torch.manual_seed(0)
        >>> Ys = [torch.randn(10, 2, dtype=torch.float64), torch.randn(12, 2, dtype=torch.float64) + 2]
        >>> X, log = flashot.free_support_barycenter(Ys, None, torch.zeros(5, 2, dtype=torch.float64),
        ...                                          reg=0.5, log=True)
        >>> log.converged, log.n_iter == len(log.displacement_square_norms)
        (True, True)
    """

    X: Tensor | np.ndarray
    n_iter: int
    converged: bool
    displacement_square_norms: list[float] = field(default_factory=list)
    inner_iterations: list[int] = field(default_factory=list)


def _as_tensor(name: str, v, like: Tensor | None = None) -> Tensor:
    if isinstance(v, np.ndarray) or (name in ("b", "weights") and isinstance(v, (list, tuple))):
        v = torch.as_tensor(np.asarray(v, dtype=np.float64))
    if not isinstance(v, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor or numpy array, got {type(v).__name__}")
    if like is not None:
        v = v.to(device=like.device, dtype=like.dtype)
    return v


def _check_inputs(measures_locations, measures_weights, X_init, b, weights):
    if not isinstance(measures_locations, (list, tuple)) or len(measures_locations) == 0:
        raise TypeError("measures_locations: expected a non-empty list of (N_k, D) point clouds")
    is_np = isinstance(X_init, np.ndarray)
    X = _as_tensor("X_init", X_init)
    if X.dim() != 2 or X.shape[0] == 0:
        raise ValueError(f"X_init: expected an (M, D) tensor with M >= 1, got shape {tuple(X.shape)}")
    if not X.is_floating_point():
        raise TypeError(f"X_init: expected floating-point points, got {X.dtype}")
    Ys = [_as_tensor(f"measures_locations[{k}]", Y, X) for k, Y in enumerate(measures_locations)]
    for k, Y in enumerate(Ys):
        if Y.dim() != 2 or Y.shape[1] != X.shape[1]:
            raise ValueError(f"measures_locations[{k}]: expected (N, {X.shape[1]}) points like X_init, "
                             f"got shape {tuple(Y.shape)}")
    K = len(Ys)
    if measures_weights is None:
        As = [None] * K
    else:
        if not isinstance(measures_weights, (list, tuple)) or len(measures_weights) != K:
            raise ValueError(f"measures_weights: expected a list of {K} weight vectors (or None), "
                             f"got {type(measures_weights).__name__}")
        As = [_as_tensor(f"measures_weights[{k}]", a, X) for k, a in enumerate(measures_weights)]
        for k, (a, Y) in enumerate(zip(As, Ys)):
            if a.shape != Y.shape[:1]:
                raise ValueError(f"measures_weights[{k}]: expected shape ({Y.shape[0]},) like "
                                 f"measures_locations[{k}], got {tuple(a.shape)}")
    b = None if b is None else _as_tensor("b", b, X)
    lam = torch.full((K,), 1.0 / K, dtype=torch.float64) if weights is None else _as_tensor("weights", weights).double()
    if lam.shape != (K,) or not bool(torch.isfinite(lam).all()) or bool((lam < 0).any()) or float(lam.sum()) <= 0:
        raise ValueError(f"weights: expected {K} non-negative finite numbers with a positive sum, got {lam.tolist()}")
    return is_np, X, Ys, As, b, (lam / lam.sum()).tolist()


def free_support_barycenter(
    measures_locations: Sequence,
    measures_weights: Sequence | None,
    X_init,
    reg: float,
    b=None,
    weights=None,
    numItermax: int = 100,
    numInnerItermax: int = 1000,
    stopThr: float = 1e-7,
    verbose: bool = False,
    log: bool = False,
    *,
    inner_tol: float = 1e-6,
    backend: str = "auto",
):
    """Entropic free-support barycenter of K weighted clouds (POT's argument names and order).

    Args:
        measures_locations: K point clouds (N_k, D) (torch or numpy).
        measures_weights: K weight vectors (N_k,) (None: uniform).
        X_init: (M, D) initial support of the barycenter (its size M is kept).
        reg: entropic regularisation epsilon (> 0) of each OT_eps(b_X, a_k), cost |x - y|^2.
        b: (M,) barycenter weights (uniform when None).  weights: (K,) lambda_k (uniform).
        numItermax: most fixed-point steps; stopThr: stop when |X_new - X|_F^2 <= stopThr.
        numInnerItermax, inner_tol: each inner Sinkhorn solve's max_iter and tol (L1 marginal).
        log: also return a :class:`BarycenterResult` (POT returns a dict).
        backend: the engine of the inner solves.

    Returns:
        ``X`` (M, D) (numpy if ``X_init`` was), or ``(X, BarycenterResult)`` with ``log=True``.

    ``X`` minimises ``sum_k lambda_k OT_eps(b_X, a_k)`` with ``C(x, y) = |x - y|^2`` and ``eps = reg``,
    by the fixed point ``X <- sum_k lambda_k (P_k Y_k) / b`` (``P_k`` the entropic plan of
    ``(X, b)`` and ``(Y_k, a_k)``).

    Example:
        >>> import torch, flashot
        >>> _ = torch.manual_seed(0)
        >>> Y1 = torch.randn(10, 2, dtype=torch.float64)
        >>> Y2 = Y1 + torch.tensor([4.0, 0.0], dtype=torch.float64)  # the same cloud, shifted
        >>> X = flashot.free_support_barycenter([Y1, Y2], None, torch.randn(6, 2, dtype=torch.float64),
        ...                                     reg=0.1)
        >>> X.shape, round(float(X[:, 0].mean() - Y1[:, 0].mean()), 2)  # half way: shifted by 2
        (torch.Size([6, 2]), 2.0)
    """
    reg = check_positive("reg", reg)
    stopThr = check_positive("stopThr", stopThr)
    inner_tol = check_positive("inner_tol", inner_tol)
    numItermax, numInnerItermax = check_int("numItermax", numItermax), check_int("numInnerItermax", numInnerItermax)
    is_np, X, Ys, As, b, lam = _check_inputs(measures_locations, measures_weights, X_init, b, weights)
    groups = _groups(Ys, As)
    # each group's lambda_k / b_i, (B, M, 1): T = sum_k lambda_k (P_k Y_k) / b
    M = X.shape[0]
    b_col = (torch.full((M,), 1.0 / M, dtype=X.dtype, device=X.device) if b is None else b).view(1, -1, 1)
    scales = [torch.tensor([lam[k] for k in idx], dtype=X.dtype, device=X.device).view(-1, 1, 1) / b_col
              for idx, _, _ in groups]
    inits: dict[int, tuple | None] = {i: None for i in range(len(groups))}
    res = BarycenterResult(X, 0, False)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sinkhorn did not reach tol", category=RuntimeWarning)
        for it in range(1, numItermax + 1):
            T, inner = torch.zeros_like(X), 0
            for gi, (idx, Yg, Ag) in enumerate(groups):
                B = len(idx)
                Xb = X.expand(B, *X.shape)
                bb = None if b is None else b.expand(B, *b.shape)
                r = solve_sample(Xb, Yg, bb, Ag, reg=reg, tol=inner_tol, max_iter=numInnerItermax,
                                 potentials_init=inits[gi], backend=backend)
                inits[gi] = r.potentials
                inner += r.n_iter
                T = T + (scales[gi] * (r.plan @ Yg)).sum(0)  # plan @ Yg: (B, M, D), streamed
            disp = float(((T - X) ** 2).sum())
            X = T
            res.displacement_square_norms.append(disp)
            res.inner_iterations.append(inner)
            if verbose:
                print(f"barycenter step {it}: displacement^2 {disp:.3e}, {inner} Sinkhorn iterations")
            if disp <= stopThr:
                res.converged = True
                break
    res.n_iter = it
    res.X = X.numpy() if is_np else X
    return (res.X, res) if log else res.X


def _groups(Ys: list[Tensor], As: list[Tensor | None]):
    """Clouds of the same size (and weights given or not alike) stacked into batches: [(indices, Y, A)]."""
    by_key: dict[tuple, list[int]] = {}
    for k, (Y, A) in enumerate(zip(Ys, As)):
        by_key.setdefault((Y.shape[0], A is None), []).append(k)
    out = []
    for (_, no_w), idx in by_key.items():
        Y = torch.stack([Ys[k] for k in idx])
        A = None if no_w else torch.stack([As[k] for k in idx])
        out.append((idx, Y, A))
    return out
