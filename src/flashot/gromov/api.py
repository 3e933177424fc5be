"""The public GW solvers: argument lists, docstrings and POT's conventions; the work is in
:mod:`.balanced` and :mod:`.semirelaxed`."""

from __future__ import annotations

from .balanced import solve_gw
from .checks import ArrayLike, Options, SROptions, check_alpha
from .results import GWResult
from .semirelaxed import solve_semirelaxed


def gromov_wasserstein(
    X: ArrayLike,
    Y: ArrayLike,
    a: ArrayLike | None = None,
    b: ArrayLike | None = None,
    *,
    reg: float,
    loss_fun: str = "square_loss",
    max_iter: int = 1000,
    tol: float = 1e-9,
    inner_max_iter: int = 1000,
    inner_tol: float = 1e-9,
    warmstart: bool = True,
    backend: str = "auto",
    verbose: bool = False,
    G0: ArrayLike | None = None,
    solver: str = "PGD",
) -> GWResult:
    r"""Entropic Gromov-Wasserstein between point clouds in different spaces, streamed.

    POT's ``ot.gromov.entropic_gromov_wasserstein(C1, C2, a, b, "square_loss", epsilon=reg)`` with
    ``C1 = |X_i - X_k|^2`` and ``C2 = |Y_j - Y_l|^2``, in memory O((n + m)(dx + dy)): the same
    linearised cost, epsilon convention, initial coupling ``a b^T``, outer iterations and stopping
    rule (see :mod:`flashot.gromov`).

    Args:
        X, Y: (n, dx) and (m, dy) points (``dx != dy`` allowed), torch tensors or numpy arrays, same dtype.
        a, b: weights (n,), (m,) of equal total mass; uniform when None.
        reg: the entropic regularisation (POT's ``epsilon``), > 0, in units of the linearised cost
            (~ 4 diameter(X)^2 diameter(Y)^2).
        loss_fun: only ``"square_loss"`` (POT's default).
        max_iter, tol: outer iterations at most, and the bound on ``|T - T_prev|_F`` read every 10th
            outer iteration (POT's defaults 1000 and 1e-9).  The change is computed from plan products
            (``|T|^2 + |T'|^2 - 2 <T, T'>`` while it is above ``1e-3 |T|_F``, then to second order in
            ``log(T' / T)``, which does not cancel).  Rounding bounds what it can resolve: the loop also
            stops below ``u ((cmax + |f|_inf + |g|_inf) / reg + 2 log2(1 + max(n, m))) |T|_F`` (``u`` the
            compute dtype's machine epsilon, ``cmax`` a bound on the linearised cost; ~1e-7 |T|_F in
            float32 at reg = 0.03 cmax, negligible in float64), as the Sinkhorn solver does; where that
            floor exceeds ``max(tol, 1e-2 |T|_F)`` (float32 with ``reg`` below ~6e-6 cmax) the loop never
            reports convergence and warns (RuntimeWarning) at the end.
        inner_max_iter, inner_tol: iterations and tolerance (L1 marginal error) of each inner Sinkhorn
            solve (POT's ``ot.sinkhorn`` defaults: 1000, 1e-9); an inner solve that does not meet
            ``inner_tol`` gives one RuntimeWarning for the whole run and ``inner_converged=False``.
        warmstart: start each inner solve from the previous potentials (default True).
        backend: ``"auto"`` (``dense`` for small problems, else ``cpu`` on CPU tensors, ``triton`` on
            GPUs, ``tiled`` without them), or an engine name.  ``cpu`` and ``triton`` run the
            feature-bilinear cost on their squared-Euclidean kernels (:mod:`flashot.ops.bilinear`).
        verbose: one line per outer iteration on stderr (value, inner iterations, change of the
            coupling when measured).
        G0, solver: POT's options; only ``G0=None`` (the coupling ``a b^T``) and ``solver="PGD"``.

    Returns:
        :class:`GWResult` (numpy ``value`` and plan outputs when ``X`` was a numpy array).

    ``min_T sum_ijkl (|X_i - X_k|^2 - |Y_j - Y_l|^2)^2 T_ij T_kl + reg KL(T | a b^T)`` over the
    couplings of ``a`` and ``b`` (``eps = reg``), by projected gradient: each outer step solves an
    entropic OT problem whose cost is the gradient of the quartic term at the current ``T``.

    Example:
        >>> import torch, flashot
        >>> _ = torch.manual_seed(0)
        >>> X = torch.randn(6, 2, dtype=torch.float64)
        >>> R = torch.tensor([[0.0, -1.0], [1.0, 0.0]], dtype=torch.float64)
        >>> same = flashot.gromov_wasserstein(X, X @ R.T + 3, reg=10.0, tol=1e-5, inner_tol=1e-6)
        >>> other = flashot.gromov_wasserstein(X, torch.randn(6, 3, dtype=torch.float64), reg=10.0,
        ...                                    tol=1e-5, inner_tol=1e-6)
        >>> same.converged, bool(same.value < other.value)  # GW ignores rotations and translations
        (True, True)
    """
    opts = Options(reg, loss_fun, max_iter, tol, inner_max_iter, inner_tol, warmstart, backend, verbose, G0, solver)
    return solve_gw(X, Y, a, b, None, None, 1.0, opts)


def fused_gromov_wasserstein(
    X: ArrayLike,
    Y: ArrayLike,
    FX: ArrayLike,
    FY: ArrayLike,
    a: ArrayLike | None = None,
    b: ArrayLike | None = None,
    *,
    reg: float,
    alpha: float = 0.5,
    loss_fun: str = "square_loss",
    max_iter: int = 1000,
    tol: float = 1e-9,
    inner_max_iter: int = 1000,
    inner_tol: float = 1e-9,
    warmstart: bool = True,
    backend: str = "auto",
    verbose: bool = False,
    G0: ArrayLike | None = None,
    solver: str = "PGD",
) -> GWResult:
    r"""Entropic fused Gromov-Wasserstein, streamed: POT's ``ot.gromov.entropic_fused_gromov_wasserstein``.

    That is POT's ``entropic_fused_gromov_wasserstein(M, C1, C2, a, b, "square_loss", epsilon=reg, alpha=alpha)``
    with the feature cost ``M_ij = |FX_i - FY_j|^2``.

    Each outer step's cost is ``alpha`` times the linearised GW cost plus ``(1 - alpha) M``, again
    feature-bilinear (the features ``FX``, ``FY`` join ``[1, |x|^2, x]`` and ``[1, |y|^2, y]``); the value is
    ``(1 - alpha) <M, T> + alpha GW(T)`` (POT's ``fgw_dist``), differentiable w.r.t. the points and the
    features (envelope theorem).  ``FX`` (n, df) and ``FY`` (m, df) share their dimension; the other
    arguments are those of :func:`gromov_wasserstein`.

    It solves, with ``M_ij = |FX_i - FY_j|^2`` and ``eps = reg``,
    ``min_T (1 - alpha) <M, T> + alpha sum_ijkl (|X_i - X_k|^2 - |Y_j - Y_l|^2)^2 T_ij T_kl + reg KL(T | a b^T)``.

    Example:
        >>> import torch, flashot
        >>> _ = torch.manual_seed(0)
        >>> X, Y = torch.randn(6, 2, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64)
        >>> FX, FY = torch.randn(6, 4, dtype=torch.float64), torch.randn(7, 4, dtype=torch.float64)
        >>> res = flashot.fused_gromov_wasserstein(X, Y, FX, FY, reg=5.0, alpha=0.5, tol=1e-5, inner_tol=1e-6)
        >>> res.converged, res.plan.shape
        (True, (6, 7))
    """
    opts = Options(reg, loss_fun, max_iter, tol, inner_max_iter, inner_tol, warmstart, backend, verbose, G0, solver)
    return solve_gw(X, Y, a, b, FX, FY, check_alpha(alpha), opts)


def semirelaxed_gromov_wasserstein(
    X: ArrayLike,
    Y: ArrayLike,
    a: ArrayLike | None = None,
    *,
    reg: float,
    loss_fun: str = "square_loss",
    max_iter: int = 10000,
    tol: float = 1e-9,
    backend: str = "auto",
    verbose: bool = False,
    G0: ArrayLike | None = None,
) -> GWResult:
    r"""Entropic semi-relaxed Gromov-Wasserstein, streamed: POT's ``ot.gromov.entropic_semirelaxed_gromov_wasserstein``.

    POT's ``entropic_semirelaxed_gromov_wasserstein(C1, C2, a, "square_loss", epsilon=reg)`` with
    ``C1 = |X_i - X_k|^2`` and ``C2 = |Y_j - Y_l|^2``, in memory O((n + m)(dx + dy)): the coupling's rows
    sum to ``a``, its columns ``q = T^T 1`` are free.  Mirror descent in the KL geometry from
    ``T = a 1^T / m``: ``T <- diag(a / (K 1)) K`` with ``K = T * exp(-grad(T) / reg)`` (one row-wise
    softmin per step, see :mod:`flashot.gromov`); POT's stopping rule (``|T - T_prev|_F <= tol`` read at
    outer iterations 1, 11, 21, ...).

    Args:
        X, Y: (n, dx) and (m, dy) points (``dx != dy`` allowed), torch tensors or numpy arrays, same dtype.
            The solver computes in float64 whatever their dtype (the iterate's exponents accumulate every
            step's cost: float32 loses the plan and the change of the coupling); results come in their dtype.
        a: weights (n,) of ``X``; uniform when None.  ``Y`` has no weights (its marginal is free).
        reg: the step's temperature (POT's ``epsilon``), > 0, in units of the linearised cost
            (~ 4 diameter(X)^2 diameter(Y)^2); smaller steps (larger ``reg``) need more iterations.
        loss_fun: only ``"square_loss"``.
        max_iter, tol: iterations at most (POT's default 1e4) and the bound on ``|T - T_prev|_F`` (1e-9),
            measured as in :func:`gromov_wasserstein` (with the same rounding floor).
        backend, verbose: as in :func:`gromov_wasserstein`.
        G0: only None (POT's default ``a 1^T / m``).

    Returns:
        :class:`GWResult`: ``value`` the semi-relaxed GW loss of the coupling (POT's ``log["srgw_dist"]``,
        differentiable w.r.t. torch points that require grad by the envelope theorem at the returned
        coupling), ``n_outer`` the mirror steps (``n_inner = n_outer``: one softmin each), ``plan`` lazy.

    ``min_T sum_ijkl (|X_i - X_k|^2 - |Y_j - Y_l|^2)^2 T_ij T_kl`` over ``T >= 0`` with ``T 1 = a``, by KL mirror
    descent with step ``1 / reg``.

    Example:
        >>> import torch, flashot
        >>> _ = torch.manual_seed(0)
        >>> X, Y = torch.randn(6, 2, dtype=torch.float64), torch.randn(9, 3, dtype=torch.float64)
        >>> res = flashot.semirelaxed_gromov_wasserstein(X, Y, reg=5.0, tol=1e-7)
        >>> T = res.plan.to_dense()
        >>> res.converged, bool(torch.allclose(T.sum(1), torch.full((6,), 1 / 6, dtype=torch.float64)))
        (True, True)
        >>> DX, DY = torch.cdist(X, X) ** 2, torch.cdist(Y, Y) ** 2
        >>> srgw = ((DX[:, None, :, None] - DY[None, :, None, :]) ** 2 * T[:, :, None, None] * T).sum()
        >>> bool(torch.allclose(res.value, srgw))
        True
    """
    opts = SROptions(reg, loss_fun, max_iter, tol, backend, verbose, G0)
    return solve_semirelaxed(X, Y, a, None, None, 1.0, opts)


def semirelaxed_fused_gromov_wasserstein(
    X: ArrayLike,
    Y: ArrayLike,
    FX: ArrayLike,
    FY: ArrayLike,
    a: ArrayLike | None = None,
    *,
    reg: float,
    alpha: float = 0.5,
    loss_fun: str = "square_loss",
    max_iter: int = 10000,
    tol: float = 1e-9,
    backend: str = "auto",
    verbose: bool = False,
    G0: ArrayLike | None = None,
) -> GWResult:
    r"""Entropic semi-relaxed fused GW, streamed: POT's ``ot.gromov.entropic_semirelaxed_fused_gromov_wasserstein``.

    That is POT's ``entropic_semirelaxed_fused_gromov_wasserstein(M, C1, C2, a, "square_loss", epsilon=reg,
    alpha=alpha)`` with ``M_ij = |FX_i - FY_j|^2``: the step's gradient is ``alpha`` times the semi-relaxed GW
    gradient plus ``(1 - alpha) M``; ``value`` is ``(1 - alpha) <M, T> + alpha srGW(T)`` (POT's
    ``log["srfgw_dist"]``), differentiable w.r.t. the points and the features.  ``FX`` (n, df), ``FY`` (m, df);
    the other arguments are those of :func:`semirelaxed_gromov_wasserstein`.

    It minimises ``(1 - alpha) <M, T> + alpha sum_ijkl (|X_i - X_k|^2 - |Y_j - Y_l|^2)^2 T_ij T_kl`` over
    ``T >= 0`` with ``T 1 = a`` (KL mirror descent, step ``1 / reg``).

    Example:
        >>> import torch, flashot
        >>> _ = torch.manual_seed(0)
        >>> X, Y = torch.randn(6, 2, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
        >>> FX, FY = torch.randn(6, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
        >>> res = flashot.semirelaxed_fused_gromov_wasserstein(X, Y, FX, FY, reg=5.0, alpha=0.5, tol=1e-7)
        >>> res.converged, res.plan.shape
        (True, (6, 8))
    """
    opts = SROptions(reg, loss_fun, max_iter, tol, backend, verbose, G0)
    return solve_semirelaxed(X, Y, a, FX, FY, check_alpha(alpha), opts)
