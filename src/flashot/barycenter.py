r"""Free-support entropic Wasserstein barycenters, streamed (POT's ``free_support_sinkhorn_barycenter``).

Given K weighted clouds ``(Y_k, a_k)`` with weights ``lambda_k`` (sum 1) and a barycenter support
``X`` (M, D) with fixed weights ``b``, the barycenter minimises ``sum_k lambda_k OT_eps(b_X, a_k)``
over ``X`` for the cost ``|x - y|^2`` at ``eps = reg``.  The fixed-point iteration (Cuturi &
Doucet 2014; POT's algorithm) is

    X  <-  sum_k lambda_k T_k(X),   T_k(X)_i = (P_k Y_k)_i / b_i,

with ``P_k`` the entropic plan between ``(X, b)`` and ``(Y_k, a_k)``: each step is K Sinkhorn
solves (:func:`flashot.solve_sample`, warm-started from the previous step's potentials) and K
streamed plan products, so no K x M x N matrix is ever built.  Clouds of equal size are solved
as one batch.  It stops when ``|X_new - X|_F^2 <= stopThr`` (POT's rule) at a step whose inner
solves all met ``inner_tol`` (a small step made with unconverged plans proves nothing about ``X``),
or after ``numItermax`` steps.  A support point of zero weight ``b_i = 0`` receives no mass (its
update is 0 / 0) and stays where it is.  Not differentiable (run under ``torch.no_grad``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from ._checks import FLOATS, check_bool, check_dtype, check_finite, check_int, check_positive, check_storage, to_tensor
from .measures import MASS_RTOL
from .pot_samples import solve_sample
from .results import OTResult

__all__ = ["free_support_barycenter", "BarycenterResult"]


@dataclass
class BarycenterResult:
    """``X`` (M, D) the barycenter support; ``displacement_square_norms`` per step; ``n_iter``;
    ``converged``: the last step moved ``X`` by ``|X_new - X|_F^2 <= stopThr`` *and* every inner
    solve of that step met ``inner_tol`` (so ``X`` is a fixed point of the map below up to these
    tolerances); ``inner_iterations``: Sinkhorn iterations per step, summed over the clouds;
    ``inner_converged``: every inner solve of the last step converged (``OTResult.converged``:
    ``inner_tol`` met, or the compute dtype's rounding floor above it in float32); ``inner_error``: the
    largest L1 marginal error of the last step's inner solves.

    ``displacement_square_norms[t] = |X_(t+1) - X_t|_F^2`` for the fixed-point step
    ``X <- sum_k lambda_k (P_k Y_k) / b`` (cost ``|x - y|^2``, ``eps = reg``).

    Example:
        >>> import torch, flashot
        >>> _ = torch.manual_seed(0)
        >>> Ys = [torch.randn(10, 2, dtype=torch.float64), torch.randn(12, 2, dtype=torch.float64) + 2]
        >>> X, log = flashot.free_support_barycenter(Ys, None, torch.zeros(5, 2, dtype=torch.float64),
        ...                                          reg=0.5, log=True)
        >>> log.converged, log.inner_converged, log.n_iter == len(log.displacement_square_norms)
        (True, True, True)
    """

    X: Tensor | np.ndarray
    n_iter: int
    converged: bool
    displacement_square_norms: list[float] = field(default_factory=list)
    inner_iterations: list[int] = field(default_factory=list)
    inner_converged: bool = True
    inner_error: float | None = None


def _points(name: str, v, like: Tensor | None = None) -> Tensor:
    """A finite (N, D) cloud (numpy or torch); ``like``: cast to its dtype, same device and D."""
    t = to_tensor(name, v, like=like)
    check_storage(name, t)
    check_dtype(name, t, allow_int=like is not None)
    if like is not None and t.device != like.device:
        raise ValueError(f"{name}: is on {t.device} but X_init is on {like.device}")
    if like is None and t.dtype not in FLOATS:
        raise TypeError(f"{name}: expected float16/bfloat16/float32/float64 points, got {t.dtype}")
    want = "(M, D) points with M, D >= 1" if like is None else f"(N, {like.shape[1]}) points like X_init, N >= 1"
    if t.dim() != 2 or t.shape[0] == 0 or t.shape[1] == 0 or (like is not None and t.shape[1] != like.shape[1]):
        raise ValueError(f"{name}: expected {want}, got shape {tuple(t.shape)}")
    check_finite(name, t)
    return t if like is None else t.to(like.dtype)


def _weights(name: str, v, n: int, like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """Finite non-negative (n,) weights with a positive sum, cast to ``dtype`` (default ``like``'s; lists
    accepted)."""
    dtype = like.dtype if dtype is None else dtype
    if isinstance(v, (list, tuple)):
        try:
            v = np.asarray(v, dtype=np.float64)
        except (TypeError, ValueError):
            raise TypeError(f"{name}: expected a sequence of numbers, a numpy array or a torch.Tensor") from None
    t = to_tensor(name, v, like=like)
    check_storage(name, t)
    check_dtype(name, t, allow_int=True)
    if t.device != like.device:
        raise ValueError(f"{name}: is on {t.device} but X_init is on {like.device}")
    if t.shape != (n,):
        raise ValueError(f"{name}: expected shape ({n},), got {tuple(t.shape)}")
    t = t.to(dtype)
    check_finite(name, t)
    if bool((t < 0).any()):
        raise ValueError(f"{name}: weights must be non-negative")
    if float(t.double().sum()) <= 0:
        raise ValueError(f"{name}: total mass must be positive (got a measure of zero mass)")
    return t


def _check_inputs(measures_locations, measures_weights, X_init, b, weights):
    """Every argument of the barycenter, checked before any solve: errors name these arguments."""
    if not isinstance(measures_locations, (list, tuple)) or len(measures_locations) == 0:
        raise TypeError("measures_locations: expected a non-empty list of (N_k, D) point clouds")
    X = _points("X_init", X_init)
    Ys = [_points(f"measures_locations[{k}]", Y, X) for k, Y in enumerate(measures_locations)]
    K, M = len(Ys), X.shape[0]
    if measures_weights is not None and (not isinstance(measures_weights, (list, tuple)) or len(measures_weights) != K):
        got = (
            f"{len(measures_weights)} items"
            if isinstance(measures_weights, (list, tuple))
            else type(measures_weights).__name__
        )
        raise ValueError(f"measures_weights: expected a list of {K} weight vectors (or None), got {got}")
    As = (
        [None] * K
        if measures_weights is None
        else [
            _weights(f"measures_weights[{k}]", a, Y.shape[0], X) for k, (a, Y) in enumerate(zip(measures_weights, Ys))
        ]
    )
    b = None if b is None else _weights("b", b, M, X)
    mass_b = 1.0 if b is None else float(b.double().sum())
    for k, a in enumerate(As):
        mass_a = 1.0 if a is None else float(a.double().sum())
        if abs(mass_a - mass_b) > MASS_RTOL * max(mass_a, mass_b):
            raise ValueError(
                f"measures_weights[{k}] and b: balanced OT needs equal total masses, got "
                f"{mass_a:.6g} and {mass_b:.6g} (None means mass 1); normalise the weights"
            )
    if weights is None:
        lam = torch.full((K,), 1.0 / K, dtype=torch.float64)
    else:
        lam = _weights("weights", weights, K, X, torch.float64).cpu()
    return X, Ys, As, b, (lam / lam.sum()).tolist()


def free_support_barycenter(
    measures_locations: Sequence,
    measures_weights: Sequence | None,
    X_init: Tensor | np.ndarray,
    reg: float,
    b: Tensor | np.ndarray | None = None,
    weights: Tensor | np.ndarray | Sequence[float] | None = None,
    numItermax: int = 100,
    numInnerItermax: int = 1000,
    stopThr: float = 1e-7,
    verbose: bool = False,
    log: bool = False,
    *,
    inner_tol: float = 1e-6,
    backend: str = "auto",
) -> Tensor | np.ndarray | tuple[Tensor | np.ndarray, BarycenterResult]:
    """Entropic free-support barycenter of K weighted clouds (POT's argument names and order).

    Args:
        measures_locations: K point clouds (N_k, D) (torch or numpy).
        measures_weights: K weight vectors (N_k,) (None: uniform), each of the total mass of ``b``.
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

    Stopping: after a step with ``|X_new - X|_F^2 <= stopThr`` whose inner solves all met ``inner_tol``
    (then ``converged=True``).  A small step made with unconverged plans says nothing about ``X``, so
    the loop goes on (the inner solves are warm-started: each step continues them); if the inner solves
    of the last step did not converge, one RuntimeWarning (``inner_converged=False``).
    Zero weights ``b_i = 0``: the point ``X_i`` carries no mass, its update is ``0 / 0``; it is kept
    where it is (``X_init[i]`` is returned for it).

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
    reg, stopThr = check_positive("reg", reg), check_positive("stopThr", stopThr)
    inner_tol = check_positive("inner_tol", inner_tol)
    numItermax, numInnerItermax = check_int("numItermax", numItermax), check_int("numInnerItermax", numInnerItermax)
    verbose, log = check_bool("verbose", verbose), check_bool("log", log)
    is_np = isinstance(X_init, np.ndarray)
    X, Ys, As, b, lam = _check_inputs(measures_locations, measures_weights, X_init, b, weights)
    res = _iterate(X, Ys, As, b, lam, reg, numItermax, numInnerItermax, stopThr, inner_tol, backend, verbose)
    if not res.inner_converged:
        warnings.warn(
            f"free_support_barycenter: the inner Sinkhorn solves of the last step stopped at "
            f"numInnerItermax={numInnerItermax} before inner_tol={inner_tol:g} (largest L1 marginal "
            f"error {res.inner_error:.3g}), so X is not a barycenter to these tolerances; raise "
            f"numInnerItermax or reg",
            RuntimeWarning,
            stacklevel=2,
        )
    if is_np and isinstance(res.X, Tensor):  # _iterate works on tensors
        res.X = res.X.numpy()
    return (res.X, res) if log else res.X


def _iterate(
    X: Tensor, Ys, As, b, lam, reg, numItermax, numInnerItermax, stopThr, inner_tol, backend, verbose
) -> BarycenterResult:
    """The fixed-point loop ``X <- sum_k lambda_k (P_k Y_k) / b`` (rows with ``b_i = 0`` kept)."""
    groups = _groups(Ys, As)
    M = X.shape[0]
    b_col = (torch.full((M,), 1.0 / M, dtype=X.dtype, device=X.device) if b is None else b).view(1, -1, 1)
    # each group's lambda_k / b_i, (B, M, 1): T = sum_k lambda_k (P_k Y_k) / b; 0 where b_i = 0
    inv_b = torch.where(b_col > 0, 1.0 / b_col, torch.zeros_like(b_col))
    scales = [
        torch.tensor([lam[k] for k in idx], dtype=X.dtype, device=X.device).view(-1, 1, 1) * inv_b
        for idx, _, _ in groups
    ]
    massless = (b_col.view(-1) == 0).view(-1, 1)  # rows kept where they are
    inits: dict[int, tuple | None] = {i: None for i in range(len(groups))}
    res = BarycenterResult(X, 0, False)
    with torch.no_grad(), warnings.catch_warnings():
        # summarised by the caller, once, for the last step (earlier steps' unconverged solves are continued)
        warnings.filterwarnings("ignore", message="Sinkhorn did not reach tol", category=RuntimeWarning)
        for it in range(1, numItermax + 1):
            T, inner, res.inner_converged, res.inner_error = torch.zeros_like(X), 0, True, 0.0
            for gi, (idx, Yg, Ag) in enumerate(groups):
                B = len(idx)
                bb = None if b is None else b.expand(B, *b.shape)
                r = solve_sample(
                    X.expand(B, *X.shape),
                    Yg,
                    bb,
                    Ag,
                    reg=reg,
                    tol=inner_tol,
                    max_iter=numInnerItermax,
                    potentials_init=inits[gi],
                    backend=backend,
                )
                assert isinstance(r, OTResult)  # one batched problem (a RaggedResult is for lists of clouds)
                inits[gi] = r.potentials
                inner += r.n_iter
                res.inner_converged &= bool(r.converged)
                res.inner_error = max(res.inner_error, math.inf if r.error is None else float(r.error))
                T = T + (scales[gi] * (r.plan @ Yg)).sum(0)  # plan @ Yg: (B, M, D), streamed
            T = torch.where(massless, X, T)
            disp = float(((T - X) ** 2).sum())
            X = T
            res.displacement_square_norms.append(disp)
            res.inner_iterations.append(inner)
            if verbose:
                print(
                    f"barycenter step {it}: displacement^2 {disp:.3e}, {inner} Sinkhorn iterations, "
                    f"inner marginal error {res.inner_error:.3e}"
                )
            if disp <= stopThr and res.inner_converged:
                res.converged = True
                break
    res.X, res.n_iter = X, it
    return res


def _groups(Ys: list[Tensor], As: list[Tensor | None]) -> list[tuple[list[int], Tensor, Tensor | None]]:
    """Clouds of the same size (and weights given or not alike) stacked into batches: [(indices, Y, A)]."""
    by_key: dict[tuple, list[int]] = {}
    for k, (Y, A) in enumerate(zip(Ys, As)):
        by_key.setdefault((Y.shape[0], A is None), []).append(k)
    out: list[tuple[list[int], Tensor, Tensor | None]] = []
    for (_, no_w), idx in by_key.items():
        Y = torch.stack([Ys[k] for k in idx])
        given = [w for w in (As[k] for k in idx) if w is not None]  # all of them, or none (the key)
        A = None if no_w else torch.stack(given)
        out.append((idx, Y, A))
    return out
