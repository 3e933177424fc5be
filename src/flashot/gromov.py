r"""Entropic Gromov-Wasserstein in linear memory, streamed by the same engines and the same solver.

POT's ``ot.gromov.entropic_gromov_wasserstein`` (``loss_fun="square_loss"``, projected gradient
descent, Peyre, Cuturi & Solomon 2016) for squared-Euclidean intra-space costs
:math:`D^x_{ik} = |x_i - x_k|^2`, :math:`D^y_{jl} = |y_j - y_l|^2`, without any n x m, n x n or
m x m matrix.  Each outer step solves the entropic OT problem (``reg`` = POT's ``epsilon``)

.. math::
    T \leftarrow \arg\min_{T \in \Pi(a, b)} \langle C(T_{prev}), T \rangle + \varepsilon\, \mathrm{KL}(T | a b^T),
    \qquad C(T) = 2\,(D^x)^{\circ 2} a\, 1^T + 2\, 1\, b^T (D^y)^{\circ 2} - 4\, D^x T D^y

(POT's ``2 * tensor_product(constC, hC1, hC2, T)``), from ``T = a b^T``.  The key identity
(Scetbon, Peyre & Cuturi 2022): with the per-point features ``E_x = [1, |x|^2, x]`` and
``D^x = E_x R_x E_x^T`` (``R_x`` swaps the first two columns and scales the others by -2),

.. math::
    D^x T D^y = E_x R_x A R_y E_y^T, \qquad A = E_x^T T E_y \in \mathbb{R}^{(d_x + 2) \times (d_y + 2)},

so ``C(T)`` is a :class:`~flashot.costs.FeatureBilinearCost` (biases ``2 (D^x)^{\circ 2} a`` and
``2 (D^y)^{\circ 2} b`` from moments of the clouds, matrix ``-4 R_x A R_y``) and ``A`` is one plan
product ``T @ E_y``.  The ``cpu`` and ``triton`` engines run it as a squared-Euclidean cost between
low-dimensional points plus per-point offsets (:mod:`flashot.ops.bilinear`).  The inner problems run
through :func:`~flashot.ot_samples.solve_measures` (the one solver), warm-started from the previous potentials.  The same plan product gives the GW
loss of each iterate (POT's ``gwloss``)

.. math::
    \mathrm{GW}(T) = \langle (D^x)^{\circ 2} a, T 1 \rangle + \langle (D^y)^{\circ 2} b, T^T 1\rangle
    - 2 \langle A, R_x A R_y \rangle .

Stopping follows POT: every 10th outer iteration (the 1st, 11th, ...) the change of the coupling
:math:`\|T - T_{prev}\|_F` is measured, from plan products only (``|T|^2`` is a plan product at
``eps / 2``, ``<T, T'>`` one with the mean of the two costs, also feature-bilinear), and the loop
stops when it is at most ``tol`` (or the compute dtype's rounding floor; a floor above ``1e-2 |T|_F`` never
stops the loop: ``converged=False`` and a RuntimeWarning).

Units: the features are dimensionless, ``E_x = [1, |x|^2 / L_x^2, x / L_x]`` with ``L_x`` the radius of the
centred cloud (a power of two), and ``R_x`` carries ``L_x^2``; the cost bound that sets the rounding floors,
eps-scaling and acceleration is taken per block of ``M``.  Scaling both clouds by ``s`` and ``reg`` by ``s^4``
(the same problem: value times ``s^4``, the same coupling) then leaves what the engines see, relative to
``reg``, unchanged up to rounding, in float32 as in float64 (:func:`_embed`).

Semi-relaxed GW (:func:`semirelaxed_gromov_wasserstein`, POT's ``entropic_semirelaxed_gromov_wasserstein``):
only ``T 1 = a`` is imposed, ``q = T^T 1`` is free, and ``reg`` is the step of a KL mirror descent from
``T = a 1^T / m``:

.. math::
    T \leftarrow \mathrm{diag}(a / K 1) K, \quad K = T \odot \exp(-G(T) / \varepsilon), \qquad
    G(T) = 2\,(D^x)^{\circ 2} a\, 1^T + 2\, 1\, q^T (D^y)^{\circ 2} - 4\, D^x T D^y

(fused: ``alpha G + (1 - alpha) M``).  ``h^q_j = sum_l q_l |y_j - y_l|^4`` comes from moments of ``Y`` weighted by
``q`` (O(m dy^2)).  ``log T`` accumulates the steps' costs, all feature-bilinear in the same features, and the row
constants drop out of the normalisation: ``T_ij = a_i / m exp((f_i + g_j - <phi_i, M psi_j>) / eps)`` with the
cumulated ``M`` and ``g`` (float64) and ``f`` one row softmin per step; ``q`` and ``A`` are two plan products.
The loss (POT's ``srgw_dist``) is ``<(D^x)^2 a, a> + <(D^y)^2 q, q> - 2 <A, R_x A R_y>``.  The change of the
coupling is measured as below, with a second-order form weighted by ``T T_prev`` (relative truncation
``d^2 / 12``) when the expansion has lost its digits; both carry a rounding estimate, and the loop stops at
``max(tol, floor)`` (``floor`` ~1e-7 in float64 once the coupling is nearly a hard assignment: the cumulated
exponents are large).  It computes in float64 whatever the inputs' dtype: those exponents grow like steps x
cost / eps, which float32 rounds beyond use.

Gradients: ``value`` is differentiable w.r.t. the points (torch inputs that require grad) by the
envelope theorem at the returned coupling: the coupling is held fixed and ``A``, the biases and
the marginal terms are differentiated (plan products w.r.t. their right-hand side).  This is the
exact gradient of the entropic objective ``GW(T) + reg KL(T | a b^T)`` at its stationary point
(``value_entropic``), and the gradient POT's ``entropic_gromov_wasserstein2`` assigns to ``gw_dist``.
"""

from __future__ import annotations

import math
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ._checks import (
    FLOATS,
    check_bool,
    check_finite,
    check_int,
    check_positive,
    check_storage,
    check_weights,
    compute_dtype,
    to_tensor,
)
from .costs import FeatureBilinearCost
from .measures import Measures, log_weights
from .driver import solve_measures, solve_options
from .ops import get_engine
from .plan import LazyPlan
from .solver import FLOOR_CAP

__all__ = ["GWResult", "fused_gromov_wasserstein", "gromov_wasserstein", "semirelaxed_fused_gromov_wasserstein",
           "semirelaxed_gromov_wasserstein"]

# POT reads the change of the coupling every CHECK_EVERY outer iterations (cpt % 10 == 0)
CHECK_EVERY = 10
# below this relative change the expansion |T|^2 + |T'|^2 - 2 <T, T'> has lost its digits to
# cancellation: the change is then taken from the second-order form (``small_change``)
SMALL_CHANGE = 1e-3
# the expansion is kept while its estimated rounding error (an overestimate, ~10x on the semi-relaxed tests'
# problems) is below this fraction of |T - T'|^2 (or the second-order form's error is the larger)
NOISE_RTOL = 0.1


@dataclass
class GWResult:
    """Result of :func:`gromov_wasserstein` (and of the fused and semi-relaxed solvers).

    Attributes:
        value: (fused: ``(1 - alpha) <M, T> + alpha`` times) the GW loss of the returned coupling, ``sum_{ijkl} (D^x_ik - D^y_jl)^2 T_ij T_kl`` in
            POT's form (``log["gw_dist"]`` of ``ot.gromov.entropic_gromov_wasserstein``; no entropy
            term); differentiable w.r.t. torch points that require grad (envelope theorem, see the
            module docstring).
        plan: the coupling as a :class:`~flashot.plan.LazyPlan` (``plan @ V``, ``plan.T @ U``, ...).
        potentials: ``(f, g)`` of the last linearised OT problem.
        n_outer: outer (linearisation) iterations run; n_inner: Sinkhorn iterations, all outer
            steps together; inner_converged: every inner solve met ``inner_tol``.
        converged: ``|T - T_prev|_F <= tol`` at a check; error: the last change measured.
        log: ``{"err": [...], "value": [...], "n_inner": [...]}``: the change at each check
            (POT's ``log["err"]``), the GW loss and the Sinkhorn iterations of each outer step.

    Semi-relaxed solvers: ``value`` is POT's ``srgw_dist`` (``srfgw_dist``); ``n_outer`` counts the mirror
    steps, each one softmin (``n_inner = n_outer``, ``log["n_inner"]`` all ones); ``potentials`` ``(f, g)``
    represent the coupling ``T_ij = a_i / m exp((f_i + g_j - <phi_i, M psi_j>) / reg)`` (``g`` the cumulated
    column terms of the steps, not dual potentials); ``value_entropic`` raises.

    ``value = sum_ijkl (|X_i - X_k|^2 - |Y_j - Y_l|^2)^2 T_ij T_kl`` (GW), or
    ``(1 - alpha) <M, T> + alpha`` times it (fused), at the coupling ``T`` of the entropic problem
    with ``eps = reg``.

    Example:
        >>> import torch, flashot
        >>> _ = torch.manual_seed(0)
        >>> X, Y = torch.randn(6, 2, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64)
        >>> res = flashot.gromov_wasserstein(X, Y, reg=5.0, tol=1e-5, inner_tol=1e-6)
        >>> res.status, res.plan.shape, len(res.log["value"]) == res.n_outer
        ('converged', (6, 7), True)
        >>> T = res.plan.to_dense()
        >>> DX, DY = torch.cdist(X, X) ** 2, torch.cdist(Y, Y) ** 2
        >>> gw = ((DX[:, None, :, None] - DY[None, :, None, :]) ** 2 * T[:, :, None, None] * T).sum()
        >>> bool(torch.allclose(res.value, gw))
        True
    """

    value: Any
    plan: LazyPlan
    potentials: tuple[Any, Any]
    n_outer: int
    n_inner: int
    converged: bool
    error: float | None
    reg: float
    backend: str
    inner_converged: bool = True
    log: dict = field(default_factory=dict)
    _entropic: Any = field(default=None, repr=False)

    @property
    def value_entropic(self):
        """``value + reg KL(T | a b^T)``: the entropic objective whose exact gradient ``value``'s
        gradient is (detached; streamed, one plan product).  ``NotImplementedError`` for the semi-relaxed solvers
        (mirror descent on the unregularised loss: no entropic objective)."""
        if self._entropic is None:
            raise NotImplementedError("value_entropic: the semi-relaxed solvers minimise the unregularised loss "
                                      "by mirror descent (reg is a step size); use value")
        return self._entropic()

    @property
    def status(self) -> str:
        return "converged" if self.converged else "max_iter reached"


class GWPlan(LazyPlan):
    """The GW coupling between the points ``X`` (rows) and ``Y`` (columns).

    Internally a plan over augmented feature points (:class:`~flashot.costs.FeatureBilinearCost`);
    :meth:`barycentric_map` maps onto the original coordinates of the other cloud."""

    def __init__(self, m, f, g, eps, pts, *, transposed=False, numpy=False):
        super().__init__(m, f, g, eps, transposed=transposed, numpy=numpy)
        self._pts = pts  # (X, Y), (1, n, dx) / (1, m, dy), detached, compute dtype

    @property
    def T(self) -> GWPlan:
        return GWPlan(self._m, self._f, self._g, self.eps, self._pts, transposed=not self._t, numpy=self._numpy)

    def barycentric_map(self):
        """``sum_j T_ij y_j / sum_j T_ij``: each point of ``X`` mapped into ``Y``'s space (N, dy) (``plan.T``:
        ``Y`` into ``X``'s space); rows of zero mass give NaN."""
        tgt = self._pts[0] if self._t else self._pts[1]
        D = tgt.shape[-1]
        S = self._apply_raw(torch.cat([tgt, torch.ones_like(tgt[..., :1])], -1).contiguous())
        with torch.no_grad():
            mass = S[..., D:]
            T = torch.where(mass > 0, S[..., :D] / mass.clamp_min(torch.finfo(S.dtype).tiny), float("nan"))
        return self._finish(T)


# ---------------------------------------------------------------------------------------------
# features of one cloud (float64, differentiable)


def _embed(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(E, R)`` for a centred cloud x (n, d): dimensionless features ``E = [1, |x|^2 / L^2, x / L]`` (n, d + 2)
    and ``R`` with ``|x_i - x_k|^2 = (E R E^T)_ik`` (``R`` carries the units: ``L^2``).

    ``L`` is the cloud's radius (the largest ``|x_i|``) rounded to a power of two (1 for a single point), a
    constant for autograd.  With ``[1, |x|^2, x]`` the features would mix the units ``1, L^2, L``, and the bound
    on the linearised cost ``max |u| + max |v| + max_i |phi_i M| max_j |psi_j|`` (which sets the solver's rounding
    floors, eps-scaling and acceleration, relative to ``reg``) would grow like ``L^2 + L^-2``: scaling both clouds
    by ``s`` and ``reg`` by ``s^4``, the same problem, changed the float32 solves (18% at ``s = 1e3``).  With
    dimensionless features that bound over ``reg`` moves by ~20% at most over all scales (by the rounding of
    ``L``), and not at all for ``s`` a power of two.  The power of two keeps the division exact: every product
    of features and ``M`` rounds as it did with ``[1, |x|^2, x]``, so float64 results are unchanged."""
    d = x.shape[1]
    L = float(x.detach().norm(dim=-1).max())
    L = 2.0 ** round(math.log2(L)) if sys.float_info.min < L * L < math.inf else 1.0  # a single point: any L
    s = (x * x).sum(-1, keepdim=True) / (L * L)
    E = torch.cat([torch.ones_like(s), s, x / L], -1)
    R = torch.zeros(d + 2, d + 2, dtype=x.dtype, device=x.device)
    R[0, 1] = R[1, 0] = L * L
    R[2:, 2:] = (-2.0 * L * L) * torch.eye(d, dtype=x.dtype, device=x.device)
    return E, R


def _quartic(x: Tensor, w: Tensor) -> Tensor:
    """``h_i = sum_k w_k |x_i - x_k|^4`` (n,) for a cloud x (n, d) (centred, for accuracy) and weights w (n,),
    from moments: expanding ``(s_i + s_k - 2 <x_i, x_k>)^2`` with ``s = |x|^2`` costs O(n d^2), no n x n matrix."""
    s = (x * x).sum(-1)
    w0, s1, s2 = w.sum(), (w * s).sum(), (w * s * s).sum()
    m1 = w @ x
    m3 = (w * s) @ x
    sig = x.T @ (w.unsqueeze(-1) * x)
    return s * s * w0 + s2 + 4.0 * ((x @ sig) * x).sum(-1) + 2.0 * s * s1 - 4.0 * s * (x @ m1) - 4.0 * (x @ m3)


def _features(x: Tensor, w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(E, h, R)``: :func:`_embed` and :func:`_quartic` of a centred cloud x (n, d) with weights w (n,)."""
    E, R = _embed(x)
    return E, _quartic(x, w), R


def _bilinear_bound(Phi: Tensor, M: Tensor, Psi: Tensor, p: int, q: int) -> float:
    """A bound on ``|<phi_i, M psi_j>|`` for ``M`` block diagonal (the GW block ``[:p, :q]``, the fused features'
    block after it): ``max_i |phi_i M| max_j |psi_j|`` per block.  Per block, so that the bound has the cost's
    units: the GW block is in length^4 and the features' block in feature length^2."""
    b = float((Phi[:, :p] @ M[:p, :q]).norm(dim=-1).max() * Psi[:, :q].norm(dim=-1).max())
    if M.shape[0] > p:
        b += float((Phi[:, p:] @ M[p:, q:]).norm(dim=-1).max() * Psi[:, q:].norm(dim=-1).max())
    return b


def _check_cloud(name: str, x) -> Tensor:
    x = to_tensor(name, x)
    if not isinstance(x, Tensor) or x.dtype not in FLOATS:
        raise TypeError(f"{name}: expected a floating-point tensor (float16/bfloat16/float32/float64), got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    check_storage(name, x)
    if x.dim() == 3:
        raise NotImplementedError(f"{name}: batched clouds (B, N, D) are not supported by gromov_wasserstein yet; "
                                  "loop over the batch")
    if x.dim() != 2:
        raise ValueError(f"{name}: expected shape (N, D), got {tuple(x.shape)}")
    if x.shape[0] == 0:
        raise ValueError(f"{name}: the point cloud is empty (shape {tuple(x.shape)})")
    if x.shape[1] == 0:
        raise ValueError(f"{name}: points have dimension 0 (shape {tuple(x.shape)})")
    check_finite(name, x.detach())
    return x


def gromov_wasserstein(
    X,
    Y,
    a=None,
    b=None,
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
    G0=None,
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
    opts = _Options(reg, loss_fun, max_iter, tol, inner_max_iter, inner_tol, warmstart, backend, verbose, G0, solver)
    return _gromov(X, Y, a, b, None, None, 1.0, opts)


def fused_gromov_wasserstein(
    X,
    Y,
    FX,
    FY,
    a=None,
    b=None,
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
    G0=None,
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
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= float(alpha) <= 1.0:
        raise ValueError(f"alpha: expected a number in [0, 1] (the weight of the GW term), got {alpha!r}")
    opts = _Options(reg, loss_fun, max_iter, tol, inner_max_iter, inner_tol, warmstart, backend, verbose, G0, solver)
    return _gromov(X, Y, a, b, FX, FY, float(alpha), opts)


@dataclass(frozen=True)
class _Options:
    """The options shared by :func:`gromov_wasserstein` and :func:`fused_gromov_wasserstein`."""

    reg: float
    loss_fun: str
    max_iter: int
    tol: float
    inner_max_iter: int
    inner_tol: float
    warmstart: bool
    backend: str
    verbose: bool
    G0: Any
    solver: str

    def checked(self) -> _Options:
        """A copy with validated values (clear errors before any work)."""
        if self.loss_fun != "square_loss":
            raise ValueError(f"loss_fun: only 'square_loss' (|a - b|^2, POT's default) is supported, got "
                             f"{self.loss_fun!r}")
        if self.solver != "PGD":
            raise ValueError(f"solver: only 'PGD' (POT's default: projected gradient / Sinkhorn steps), got "
                             f"{self.solver!r}")
        if self.G0 is not None:
            raise NotImplementedError("G0: a dense initial coupling is not supported (it would be n x m); the "
                                      "initial coupling is a b^T")
        if not isinstance(self.backend, str):
            raise TypeError(f"backend: expected a string, got {type(self.backend).__name__}")
        return _Options(check_positive("reg", self.reg), self.loss_fun, check_int("max_iter", self.max_iter),
                        check_positive("tol", self.tol), check_int("inner_max_iter", self.inner_max_iter),
                        check_positive("inner_tol", self.inner_tol), check_bool("warmstart", self.warmstart),
                        self.backend, check_bool("verbose", self.verbose), None, self.solver)


def _check_inputs(X, Y, a, b, FX, FY, semirelaxed: bool = False) -> tuple:
    """Validated ``(X, Y, a, b, FX, FY, is_np)`` (clear errors before any work); ``FX = FY = None`` for plain GW,
    ``b`` uniform when ``semirelaxed`` (no second marginal)."""
    is_np = isinstance(X, np.ndarray)
    if is_np != isinstance(Y, np.ndarray):
        raise TypeError("X and Y: give both as torch tensors or both as numpy arrays")
    X, Y = _check_cloud("X", X), _check_cloud("Y", Y)
    if X.dtype != Y.dtype:
        raise TypeError(f"X and Y: expected the same dtype, got {X.dtype} and {Y.dtype}")
    if X.device != Y.device:
        raise ValueError(f"X and Y: are on different devices ({X.device} and {Y.device})")
    if FX is not None:
        if isinstance(FX, np.ndarray) != is_np or isinstance(FY, np.ndarray) != is_np:
            raise TypeError("FX and FY: give them as the points (torch tensors or numpy arrays)")
        FX, FY = _check_cloud("FX", FX), _check_cloud("FY", FY)
        if FX.shape[0] != X.shape[0] or FY.shape[0] != Y.shape[0]:
            raise ValueError(f"FX and FY: expected one feature vector per point ({X.shape[0]} and {Y.shape[0]}), "
                             f"got shapes {tuple(FX.shape)} and {tuple(FY.shape)}")
        if FX.shape[1] != FY.shape[1]:
            raise ValueError(f"FX and FY: the feature cost |FX_i - FY_j|^2 needs one feature dimension, got "
                             f"{FX.shape[1]} and {FY.shape[1]}")
        if FX.dtype != X.dtype or FY.dtype != X.dtype or FX.device != X.device or FY.device != X.device:
            raise TypeError(f"FX and FY: expected the dtype and device of X ({X.dtype}, {X.device})")
    a = check_weights("a", None if a is None else to_tensor("a", a, like=X), X, "X")
    if semirelaxed:  # the second marginal is free: uniform weights only centre Y
        b = torch.full((Y.shape[0],), 1.0 / Y.shape[0], dtype=Y.dtype, device=Y.device)
    else:
        b = check_weights("b", None if b is None else to_tensor("b", b, like=Y), Y, "Y")
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        raise NotImplementedError("a, b: gradients of the GW value w.r.t. the weights are not implemented (only "
                                  "w.r.t. the points and features); detach the weights")
    ma, mb = float(a.detach().double().sum()), float(b.detach().double().sum())
    if not semirelaxed and abs(ma - mb) > 1e-3 * max(ma, mb):
        raise ValueError(f"a and b: Gromov-Wasserstein couples measures of equal total mass, got {ma:.6g} and "
                         f"{mb:.6g}; normalise the weights")
    return X, Y, a, b, FX, FY, is_np


def _stop_at(tol: float, floor: float, norm: float) -> float | None:
    """The change of the coupling below which a check stops: ``max(tol, floor)`` (POT's ``tol``; ``floor`` the
    smallest change the compute dtype resolves), or None (no convergence) when the floor exceeds both ``tol``
    and ``FLOOR_CAP |T|_F``: rounding alone then moves the coupling by more than any useful tolerance (the
    Sinkhorn solver's rule, :func:`flashot.solver.stop_tol`, relative to the coupling's norm)."""
    if floor > max(tol, FLOOR_CAP * norm):
        return None
    return max(tol, floor)


def _unresolved(name: str, dtype: torch.dtype, rel_floor: float, ratio: float) -> str:
    """The warning of a loop whose rounding floor kept it from converging."""
    f64 = "" if dtype == torch.float64 else "float64 inputs or "
    return (f"{name}: {str(dtype).replace('torch.', '')} rounding moves the coupling by ~{rel_floor:.2g} of its "
            f"norm (largest cost / reg = {ratio:.3g}): the change of the coupling cannot be resolved, the result is "
            f"not converged; use {f64}a larger reg")


def _quadratic_form(w: Tensor, R: Tensor, cdt: torch.dtype) -> tuple[float, float]:
    """``(sum_i w_i^T R_i w_i, its rounding error)`` for ``R`` (n, k, k) from a plan product in ``cdt``: the terms
    ``w_k w_l R_kl`` cancel to the small ``d^2`` (``d`` is a sum of terms of size ``|grad| / eps``), and
    ``|w_k w_l R_kl| <= |w_k| |w_l| sqrt(R_kk R_ll)``, rows rounding independently."""
    b = (w.abs() * R.diagonal(dim1=-2, dim2=-1).clamp_min(0).sqrt()).sum(-1) ** 2
    return float(torch.einsum("ik,ikl,il->", w, R, w)), torch.finfo(cdt).eps * float(b.norm())


@dataclass
class _GWRun:
    """The state of the outer loop of :func:`_gromov`."""

    prev: tuple | None = None  # (measures, f, g, GW block of M) of the last coupling; None: a b^T
    res: Any = None  # the last inner OTResult
    cpt: int = 0
    n_inner: int = 0
    err: float | None = None
    converged: bool = False
    stop_at: float | None = None  # the change below which a check stops (None: the floor is above any use)
    unresolved: str | None = None  # why the loop could not converge (rounding), for the warning
    inner_ok: bool = True
    log: dict = field(default_factory=lambda: {"err": [], "value": [], "n_inner": []})


class _GWProblem:
    """The fixed parts of a balanced (fused) GW solve: features and biases (float64), the engine, the augmented
    points and the weights (compute dtype); ``FX = FY = None`` for plain GW."""

    def __init__(self, X: Tensor, Y: Tensor, a: Tensor, b: Tensor, FX, FY, alpha: float, o: _Options):
        self.X, self.Y, self.FX, self.FY, self.alpha, self.reg = X, Y, FX, FY, alpha, o.reg
        self.fused = FX is not None
        self.cdt, self.dev = compute_dtype(X.dtype), X.device
        self.n, self.m = X.shape[0], Y.shape[0]
        self.a64, self.b64 = a.detach().double(), b.detach().double()
        Ex, hx, Rx, Ey, hy, Ry, F, G = (None if t is None else t.detach() for t in self.features(False))
        self.Ex, self.hx, self.Rx, self.Ey, self.hy, self.Ry, self.F, self.G = Ex, hx, Rx, Ey, hy, Ry, F, G
        self.p, self.q = Ex.shape[1], Ey.shape[1]
        self.u, self.v = 2.0 * alpha * hx, 2.0 * alpha * hy  # biases of the linearised cost (POT: 2 constC)
        self.Phi, self.Psi = Ex, Ey  # the features of the cost
        if self.fused:
            self.u, self.v = self.u + (1.0 - alpha) * (F * F).sum(-1), self.v + (1.0 - alpha) * (G * G).sum(-1)
            self.Phi, self.Psi = torch.cat([Ex, F], -1), torch.cat([Ey, G], -1)
        cost0, _, _ = self.make_cost(torch.zeros(self.p, self.q, dtype=torch.float64, device=self.dev))
        _, xs, ys = FeatureBilinearCost.pair(self.u.unsqueeze(0), self.Phi.unsqueeze(0), self.v.unsqueeze(0),
                                             self.Psi.unsqueeze(0),
                                             torch.zeros(1, self.Phi.shape[1], self.Psi.shape[1], dtype=torch.float64,
                                                         device=self.dev))
        self.xs, self.ys = xs.to(self.cdt), ys.to(self.cdt)
        K = self.xs.shape[-1]
        self.engine = get_engine(o.backend, device=self.dev, dtype=self.cdt, cost=cost0, size=(1, self.n, self.m, K))
        self.a_c, self.b_c = a.detach().to(self.cdt).unsqueeze(0), b.detach().to(self.cdt).unsqueeze(0)
        self.a_log, self.b_log = log_weights(self.a_c), log_weights(self.b_c)
        self.center = torch.zeros(1, 1, K, dtype=self.cdt, device=self.dev)
        self.Vy = self.right(Ey, hy, G).to(self.cdt).unsqueeze(0).contiguous()

    def features(self, with_grad: bool) -> tuple:
        """``(E_x, h_x, R_x, E_y, h_y, R_y, F, G)`` in float64 (small algebra and biases; the engines run in the
        compute dtype), differentiable w.r.t. the points and features when asked."""
        a64, b64 = self.a64, self.b64
        with torch.set_grad_enabled(with_grad and torch.is_grad_enabled()):
            X64, Y64 = self.X.double(), self.Y.double()
            Xc = X64 - (a64 @ X64.detach() / a64.sum())  # D is translation invariant: centre for accuracy
            Yc = Y64 - (b64 @ Y64.detach() / b64.sum())
            Ex, hx, Rx = _features(Xc, a64)
            Ey, hy, Ry = _features(Yc, b64)
            if self.fused:  # |F_i - G_j|^2 is translation invariant: a common centre for accuracy
                F64, G64 = self.FX.double(), self.FY.double()
                c = 0.5 * (a64 @ F64.detach() / a64.sum() + b64 @ G64.detach() / b64.sum())
                F, G = F64 - c, G64 - c
            else:
                F = G = None
        return Ex, hx, Rx, Ey, hy, Ry, F, G

    def make_cost(self, A: Tensor) -> tuple[FeatureBilinearCost, Tensor, float]:
        """``(cost, GW block of M, bound)`` of the linearised cost at the coupling with ``A = E_x^T T E_y``."""
        p, q, alpha = self.p, self.q, self.alpha
        Mm = (-4.0 * alpha) * self.Rx @ A @ self.Ry.T  # the GW block (the only part that changes)
        Mf = Mm
        if self.fused:
            df = self.F.shape[1]
            Mf = torch.zeros(p + df, q + df, dtype=torch.float64, device=self.dev)
            Mf[:p, :q] = Mm
            Mf[p:, q:] = -2.0 * (1.0 - alpha) * torch.eye(df, dtype=torch.float64, device=self.dev)
        cost = FeatureBilinearCost(FeatureBilinearCost.block(Mf.unsqueeze(0)).to(self.cdt))
        bound = float(self.u.abs().max() + self.v.abs().max()) + _bilinear_bound(self.Phi, Mf, self.Psi, p, q)
        return cost, Mm, bound

    def measures(self, cost: FeatureBilinearCost, bound: float) -> Measures:
        return Measures(self.xs, self.ys, self.a_c, self.b_c, self.a_log, self.b_log, cost, self.engine, False,
                        self.cdt, self.center, bound)

    def right(self, Ey, hy, G) -> Tensor:
        """``[E_y, h_y]`` (and ``[|G|^2, G]`` when fused): ``T @`` it gives ``A``, the value and the row sums."""
        cols = [Ey, hy.unsqueeze(-1)] + ([(G * G).sum(-1, keepdim=True), G] if self.fused else [])
        return torch.cat(cols, -1)

    def loss(self, Ex, hx, F, Q, r) -> tuple[Tensor, Tensor]:
        """``(A, value)`` from ``Q = T @ right(...)`` and the row sums ``r = T 1``."""
        q = self.q
        A = Ex.T @ Q[:, :q]
        val = hx @ r + Q[:, q].sum() - 2.0 * (A * (self.Rx @ A @ self.Ry.T)).sum()
        if self.fused:  # (1 - alpha) <|F_i - G_j|^2, T> + alpha GW
            feat = (F * F).sum(-1) @ r + Q[:, q + 1].sum() - 2.0 * (F * Q[:, q + 2:]).sum()
            val = self.alpha * val + (1.0 - self.alpha) * feat
        return A, val

    def logs(self, f: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
        """The plan's log-weights ``(f / reg + log a, g / reg + log b)``."""
        return f / self.reg + self.a_log, g / self.reg + self.b_log

    def stats(self, mm: Measures, f: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
        """``(A, value)`` of the plan (f, g) on ``mm``: ``A = E_x^T T E_y`` and the GW loss (float64)."""
        alpha, beta = self.logs(f, g)
        with torch.no_grad():
            Q = self.engine.plan_product(self.xs, self.ys, alpha, beta, self.reg, self.Vy, mm.cost, "plan")[0].double()
        return self.loss(self.Ex, self.hx, self.F, Q, Q[:, 0])

    def sq_norm(self, mm: Measures, f: Tensor, g: Tensor) -> float:
        """``|T|_F^2``: a plan product at eps / 2 with doubled log-weights."""
        reg, a_log, b_log = self.reg, self.a_log, self.b_log
        ones = torch.ones(1, self.m, 1, dtype=self.cdt, device=self.dev)
        with torch.no_grad():
            r = self.engine.plan_product(self.xs, self.ys, 2 * (f / reg + a_log), 2 * (g / reg + b_log), reg / 2,
                                         ones, mm.cost)
        return float(r.double().sum())

    def dot(self, m1: Measures, f1, g1, m2: Measures, f2, g2) -> float:
        """``<T1, T2>``: a plan product with the mean of the two (feature-bilinear) costs at eps / 2."""
        reg, a_log, b_log = self.reg, self.a_log, self.b_log
        mid = FeatureBilinearCost(0.5 * (m1.cost.S + m2.cost.S))
        ones = torch.ones(1, self.m, 1, dtype=self.cdt, device=self.dev)
        with torch.no_grad():
            r = self.engine.plan_product(self.xs, self.ys, (f1 + f2) / reg + 2 * a_log, (g1 + g2) / reg + 2 * b_log,
                                         reg / 2, ones, mid)
        return float(r.double().sum())

    def small_change(self, mm: Measures, f, g, M1, f2, g2, M2) -> tuple[float, float]:
        """``(sum_ij T_ij^2 d_ij^2, its rounding error)`` with ``T2 = T exp(d)``: ``|T2 - T|_F^2`` to second order
        in ``d``, one plan product of ``T^2`` with ``z (x) z``.  ``d_ij = (df_i + dg_j - <E_x,i dM, E_y,j>) / eps =
        <w_i, z_j>`` is written as ``alpha_i + beta_j + <p_i, zc_j>`` with ``zc`` the non-constant features of
        ``E_y`` centred (weights ``b``): the constant feature's and the means' terms are folded into ``alpha``, and
        the potentials' gauge (a constant that one inner solve moves from ``g`` to ``f``) is taken out of both, so
        that the terms of the quadratic form cancel as little as they can (:func:`_quadratic_form`)."""
        reg, n, m, dev = self.reg, self.n, self.m, self.dev
        one = dict(dtype=torch.float64, device=dev)
        Wr = self.Ex @ (M2 - M1)  # (n, q): the cost's change is <Wr_i, E_y,j>, E_y = [1, |y|^2, y]
        zbar = self.b64 @ self.Ey[:, 1:] / self.b64.sum()
        zc = self.Ey[:, 1:] - zbar
        alpha = (f2[0].double() - f[0].double() - Wr[:, 0] - Wr[:, 1:] @ zbar) / reg
        beta = (g2[0].double() - g[0].double()) / reg
        gauge = self.a64 @ alpha / self.a64.sum()
        w = torch.cat([(alpha - gauge).unsqueeze(-1), torch.ones(n, 1, **one), -Wr[:, 1:] / reg], -1)
        z = torch.cat([torch.ones(m, 1, **one), (beta + gauge).unsqueeze(-1), zc], -1)
        k = z.shape[1]
        Z2 = (z.unsqueeze(-1) * z.unsqueeze(-2)).reshape(1, m, k * k).to(self.cdt).contiguous()
        with torch.no_grad():
            R = self.engine.plan_product(self.xs, self.ys, 2 * (f / reg + self.a_log), 2 * (g / reg + self.b_log),
                                         reg / 2, Z2, mm.cost)
        return _quadratic_form(w, R[0].double().reshape(n, k, k), self.cdt)

    def change(self, mm: Measures, f: Tensor, g: Tensor, Mm: Tensor, bound: float, prev) -> tuple[float, float, float]:
        """``(|T - T_prev|_F, floor, |T|_F)`` from plan products: ``|T|^2 + |T_prev|^2 - 2 <T, T_prev>``, or the second-order
        form (:meth:`small_change`) below ``SMALL_CHANGE |T|_F`` and wherever the expansion's estimated rounding
        error exceeds ``NOISE_RTOL`` of it and the second-order form's is the smaller (float32 at large n: the
        expansion's sums then cancel to their rounding); ``floor`` is the smallest change the compute dtype
        resolves: the potentials' rounding, and the second-order form's own rounding error where it is used."""
        cur_sq = self.sq_norm(mm, f, g)
        if prev is None:  # T_prev = a b^T: |a|^2 |b|^2 and <T, a b^T> = a^T T b
            prev_sq = float((self.a64 @ self.a64) * (self.b64 @ self.b64))
            with torch.no_grad():
                Tb = self.engine.plan_product(self.xs, self.ys, f / self.reg + self.a_log, g / self.reg + self.b_log,
                                              self.reg, self.b_c.unsqueeze(-1), mm.cost)
            cross = float((self.a_c.double() * Tb[..., 0].double()).sum())
        else:
            prev_sq = self.sq_norm(*prev[:3])
            cross = self.dot(mm, f, g, *prev[:3])
        err_sq = cur_sq + prev_sq - 2.0 * cross
        # rounding: each entry of T carries a relative error ~ u (cmax + |f| + |g|) / eps, so the
        # change stalls near this floor (float32: ~1e-7 |T|_F); it cannot resolve a smaller tol.  The
        # expansion cancels: its own error is ~ that relative error times |T|^2 + |T_prev|^2
        u_c = torch.finfo(self.cdt).eps
        scale = (bound + float(f.abs().max()) + float(g.abs().max())) / self.reg + 2.0 * math.log2(1 + max(self.n,
                                                                                                         self.m))
        floor, noise = u_c * scale * math.sqrt(cur_sq), u_c * scale * (cur_sq + prev_sq)
        if prev is not None and (err_sq < SMALL_CHANGE**2 * cur_sq or noise > NOISE_RTOL * max(err_sq, 0.0)):
            # the expansion has lost its digits: the second-order form, where its own rounding is the smaller
            # (or below SMALL_CHANGE, where the expansion says nothing)
            small, small_noise = self.small_change(mm, f, g, Mm, *prev[1:])
            if err_sq < SMALL_CHANGE**2 * cur_sq or small_noise < noise:
                err_sq, floor = small, max(floor, math.sqrt(small_noise))
        return math.sqrt(max(0.0, err_sq)), floor, math.sqrt(cur_sq)

    def value(self, plan: GWPlan, mm: Measures, f: Tensor, g: Tensor) -> Tensor:
        """The loss of the returned coupling, differentiable w.r.t. the points (coupling fixed: envelope theorem)."""
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (self.X, self.Y, self.FX,
                                                                                         self.FY)):
            Ex_g, hx_g, _, Ey_g, hy_g, _, F_g, G_g = self.features(True)
            Q = plan.apply(self.right(Ey_g, hy_g, G_g).to(self.cdt)).double()  # differentiable in V (transposed)
            return self.loss(Ex_g, hx_g, F_g, Q, Q[:, 0].detach())[1]  # Q[:, 0] = T 1, a constant
        return self.stats(mm, f, g)[1]

    def entropic(self, value: Tensor, mm: Measures, f: Tensor, g: Tensor) -> float:
        """``value + reg KL(T | a b^T)`` (detached; streamed)."""
        reg, n, m, cdt, dev = self.reg, self.n, self.m, self.cdt, self.dev
        xs, ys = self.xs, self.ys
        with torch.no_grad():
            alpha, beta = self.logs(f, g)
            ones = torch.ones(1, m, 1, dtype=cdt, device=dev)
            lin = self.engine.plan_product(xs, ys, alpha, beta, reg, ones, mm.cost, "cost")[0, :, 0].double().sum()
            rows = self.engine.plan_product(xs, ys, alpha, beta, reg, ones, mm.cost, "plan")[0, :, 0].double()
            cols = self.engine.plan_product(ys, xs, beta, alpha, reg, torch.ones(1, n, 1, dtype=cdt, device=dev),
                                            mm.cost, "plan")[0, :, 0].double()
            # KL(T | a b^T) = sum T log(T / (a b)) - sum T + sum a b, log(T_ij / (a_i b_j)) = (f_i + g_j - C_ij) / reg
            mass = rows.sum()
            kl = ((rows * f[0].double()).sum() + (cols * g[0].double()).sum() - lin) / reg - mass \
                + self.a64.sum() * self.b64.sum()
            v = float(value.detach()) + reg * float(kl)
        return v


def _gw_loop(pb: _GWProblem, o: _Options) -> _GWRun:
    """The outer loop: linearise at the coupling, solve the entropic OT problem (warm-started), measure the change
    every ``CHECK_EVERY`` outer steps; POT's stopping rule."""
    inner = solve_options(o.reg, max_iter=o.inner_max_iter, tol=o.inner_tol, method="alternating", grad="detach")
    # T_0 = a b^T: A_0 = (E_x^T a)(E_y^T b)^T, |T_0|^2 = |a|^2 |b|^2
    A = torch.outer(pb.Ex.T @ pb.a64, pb.Ey.T @ pb.b64)
    run, init, floor, norm, t0 = _GWRun(), None, 0.0, 1.0, time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        while run.cpt < o.max_iter:
            cost, Mm, bound = pb.make_cost(A)
            mm = pb.measures(cost, bound)
            n_warn = len(caught)
            res = run.res = solve_measures(mm, inner, init)
            if len(caught) > n_warn or not res.converged:
                run.inner_ok = False
            f, g = res.plan.raw_potentials
            if o.warmstart:
                init = res.potentials
            run.n_inner += res.n_iter
            A, val = pb.stats(mm, f, g)
            run.log["value"].append(float(val))
            run.log["n_inner"].append(res.n_iter)
            if run.cpt % CHECK_EVERY == 0:
                run.err, floor, norm = pb.change(mm, f, g, Mm, bound, run.prev)
                run.log["err"].append(run.err)
                run.stop_at = _stop_at(o.tol, floor, norm)
            run.prev = (mm, f, g, Mm)
            if o.verbose:
                e = f"  err {run.err:.3e} (floor {floor:.2e})" if run.cpt % CHECK_EVERY == 0 else ""
                print(f"gromov_wasserstein: outer {run.cpt + 1}/{o.max_iter}  inner {res.n_iter}  value "
                      f"{float(val):.10g}{e}  ({time.perf_counter() - t0:.2f}s)", file=sys.stderr, flush=True)
            run.cpt += 1
            if run.stop_at is not None and run.cpt % CHECK_EVERY == 1 and run.err <= run.stop_at:
                run.converged = True
                break
    if not run.converged and run.stop_at is None and run.err is not None:
        run.unresolved = _unresolved("gromov_wasserstein", pb.cdt, floor / norm, bound / o.reg)
    for w in caught:  # the inner solves' own non-convergence warnings are summarised below
        if not (issubclass(w.category, RuntimeWarning) and str(w.message).startswith("Sinkhorn did not reach")):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return run


def _gromov(X, Y, a, b, FX, FY, alpha: float, opts: _Options) -> GWResult:
    """(Fused) GW with the options of the public functions; ``FX = FY = None`` for plain GW."""
    o = opts.checked()
    X, Y, a, b, FX, FY, is_np = _check_inputs(X, Y, a, b, FX, FY)
    pb = _GWProblem(X, Y, a, b, FX, FY, alpha, o)
    run = _gw_loop(pb, o)
    if run.unresolved:
        warnings.warn(run.unresolved, RuntimeWarning, stacklevel=3)
    if not run.inner_ok:
        warnings.warn(f"gromov_wasserstein: some inner Sinkhorn solves did not reach inner_tol={o.inner_tol:g} in "
                      f"{o.inner_max_iter} iterations; raise inner_max_iter or reg", RuntimeWarning, stacklevel=2)
    mm, f, g, _ = run.prev
    plan = GWPlan(mm, f, g, o.reg, (X.detach().to(pb.cdt).unsqueeze(0), Y.detach().to(pb.cdt).unsqueeze(0)),
                  numpy=is_np)
    value = pb.value(plan, mm, f, g)
    res = run.res
    value = value.to(X.dtype)
    return GWResult(
        value=value.detach().cpu().numpy()[()] if is_np else value,
        plan=plan,
        potentials=tuple(t.detach().cpu().numpy() for t in res.potentials) if is_np else res.potentials,
        n_outer=run.cpt,
        n_inner=run.n_inner,
        converged=run.converged,
        error=run.err,
        reg=o.reg,
        backend=pb.engine.name,
        inner_converged=run.inner_ok,
        log=run.log,
        _entropic=lambda: pb.entropic(value, mm, f, g),
    )


# ---------------------------------------------------------------------------------------------
# semi-relaxed (F)GW: mirror descent with only the first marginal constrained


def semirelaxed_gromov_wasserstein(
    X,
    Y,
    a=None,
    *,
    reg: float,
    loss_fun: str = "square_loss",
    max_iter: int = 10000,
    tol: float = 1e-9,
    backend: str = "auto",
    verbose: bool = False,
    G0=None,
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
    opts = _SROptions(reg, loss_fun, max_iter, tol, backend, verbose, G0)
    return _semirelaxed(X, Y, a, None, None, 1.0, opts)


def semirelaxed_fused_gromov_wasserstein(
    X,
    Y,
    FX,
    FY,
    a=None,
    *,
    reg: float,
    alpha: float = 0.5,
    loss_fun: str = "square_loss",
    max_iter: int = 10000,
    tol: float = 1e-9,
    backend: str = "auto",
    verbose: bool = False,
    G0=None,
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
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= float(alpha) <= 1.0:
        raise ValueError(f"alpha: expected a number in [0, 1] (the weight of the GW term), got {alpha!r}")
    opts = _SROptions(reg, loss_fun, max_iter, tol, backend, verbose, G0)
    return _semirelaxed(X, Y, a, FX, FY, float(alpha), opts)


@dataclass(frozen=True)
class _SROptions:
    """The options of the semi-relaxed solvers."""

    reg: float
    loss_fun: str
    max_iter: int
    tol: float
    backend: str
    verbose: bool
    G0: Any

    def checked(self) -> _SROptions:
        """A copy with validated values (the checks of :class:`_Options`)."""
        reg = _Options(self.reg, self.loss_fun, 1, 1.0, 1, 1.0, True, self.backend, False, self.G0, "PGD").checked().reg
        return _SROptions(reg, self.loss_fun, check_int("max_iter", self.max_iter),
                          check_positive("tol", self.tol), self.backend, check_bool("verbose", self.verbose), None)


@dataclass
class _SRIterate:
    """``T_ij = a_i / m exp((f_i + g_j - <phi_i, M psi_j>) / reg)``: the cumulated gradients of the mirror steps
    (their row constants dropped: the row normalisation removes them) are the bilinear part ``M`` and the
    column part ``-g``; ``f`` normalises the rows."""

    M: Tensor  # (P, Q) float64
    g: Tensor  # (1, m) float64 (it grows with the steps: accumulated in float64)
    f: Tensor  # (1, n) compute dtype
    mm: Measures


class _SRProblem:
    """The fixed parts of a semi-relaxed (F)GW solve: features, engine, augmented points and weights."""

    def __init__(self, X: Tensor, Y: Tensor, a: Tensor, FX, FY, alpha: float, o: _SROptions):
        self.alpha, self.reg, self.fused = alpha, o.reg, FX is not None
        self.n, self.m = X.shape[0], Y.shape[0]
        # float64 whatever the inputs: the iterate's exponents accumulate every step's cost (|g| / reg grows
        # like steps x cost / reg), which float32 rounds to garbage (plans and changes off by ~1 at 30 x 45)
        self.cdt, self.dev = torch.float64, X.device
        self.a64 = a.detach().double()
        self.w_y = torch.full((self.m,), 1.0 / self.m, dtype=torch.float64, device=self.dev)
        self.X, self.Y, self.FX, self.FY = X, Y, FX, FY
        self.Ex, self.hx, self.Rx, self.Ey, self.Ry, self.Yc, self.F, self.G = self.features(False)
        self.p, self.q = self.Ex.shape[1], self.Ey.shape[1]
        self.Phi = torch.cat([self.Ex, self.F], -1) if self.fused else self.Ex
        self.Psi = torch.cat([self.Ey, self.G], -1) if self.fused else self.Ey
        P, Q = self.Phi.shape[1], self.Psi.shape[1]
        zero = torch.zeros(1, P, Q, dtype=torch.float64, device=self.dev)
        cost0, xs, ys = FeatureBilinearCost.pair(torch.zeros(1, self.n, dtype=torch.float64, device=self.dev),
                                                 self.Phi.unsqueeze(0),
                                                 torch.zeros(1, self.m, dtype=torch.float64, device=self.dev),
                                                 self.Psi.unsqueeze(0), zero)
        self.xs, self.ys = xs.to(self.cdt), ys.to(self.cdt)
        self.engine = get_engine(o.backend, device=self.dev, dtype=self.cdt, cost=cost0,
                                 size=(1, self.n, self.m, self.xs.shape[-1]))
        self.a_c = a.detach().to(self.cdt).unsqueeze(0)
        self.b_c = self.w_y.to(self.cdt).unsqueeze(0)
        self.a_log, self.b_log = log_weights(self.a_c), log_weights(self.b_c)
        cols = [self.Ey] + ([self.G] if self.fused else [])
        self.Vy = torch.cat(cols, -1).to(self.cdt).unsqueeze(0).contiguous()  # T @ Vy: A (and T G)

    def features(self, with_grad: bool) -> tuple:
        """``(E_x, h_x, R_x, E_y, R_y, Y_c, F, G)`` in float64 (differentiable when asked): ``h_x`` with the weights
        ``a``; ``h_y`` depends on ``q`` and is computed per step (:func:`_quartic` of ``Y_c``)."""
        with torch.set_grad_enabled(with_grad and torch.is_grad_enabled()):
            X64, Y64 = self.X.double(), self.Y.double()
            Xc = X64 - self.a64 @ X64.detach() / self.a64.sum()  # D is translation invariant: centre for accuracy
            Yc = Y64 - Y64.detach().mean(0)
            Ex, Rx = _embed(Xc)
            Ey, Ry = _embed(Yc)
            F = G = None
            if self.fused:  # |F_i - G_j|^2 is translation invariant: a common centre for accuracy
                F64, G64 = self.FX.double(), self.FY.double()
                c = 0.5 * (self.a64 @ F64.detach() / self.a64.sum() + G64.detach().mean(0))
                F, G = F64 - c, G64 - c
            return Ex, _quartic(Xc, self.a64), Rx, Ey, Ry, Yc, F, G

    def iterate(self, M: Tensor, g: Tensor, f: Tensor | None = None) -> _SRIterate:
        """The iterate of cumulated ``(M, g)``; ``f`` (the row normaliser) is one softmin when not given."""
        cost = FeatureBilinearCost(FeatureBilinearCost.block(M.unsqueeze(0)).to(self.cdt))
        bound = _bilinear_bound(self.Phi, M, self.Psi, self.p, self.q) + float(g.abs().max())
        mm = Measures(self.xs, self.ys, self.a_c, self.b_c, self.a_log, self.b_log, cost, self.engine, False,
                      self.cdt, torch.zeros(1, 1, self.xs.shape[-1], dtype=self.cdt, device=self.dev), bound)
        if f is None:  # rows of T sum to a: f_i = -reg log sum_j exp(g_j / reg + log(1 / m) - C_ij / reg)
            with torch.no_grad():
                f = self.engine.softmin(self.xs, self.ys, (g / self.reg).to(self.cdt) + self.b_log, self.reg, cost)
        return _SRIterate(M, g, f, mm)

    def logs(self, it: _SRIterate) -> tuple[Tensor, Tensor]:
        """``(log a + f / reg, log(1 / m) + g / reg)``: the plan's log-weights for the engine's plan products."""
        return it.f / self.reg + self.a_log, (it.g / self.reg).to(self.cdt) + self.b_log

    def marginal_and_products(self, it: _SRIterate) -> tuple[Tensor, Tensor]:
        """``(q, Q)``: the free marginal ``q = T^T 1`` (m,) and ``Q = T @ [E_y, G]`` (n, q (+ df)), float64."""
        al, be = self.logs(it)
        ones = torch.ones(1, self.n, 1, dtype=self.cdt, device=self.dev)
        with torch.no_grad():
            q = self.engine.plan_product(self.ys, self.xs, be, al, self.reg, ones, it.mm.cost)[0, :, 0].double()
            Q = self.engine.plan_product(self.xs, self.ys, al, be, self.reg, self.Vy, it.mm.cost)[0].double()
        return q, Q

    def loss(self, Ex, hx, hy, F, G, Q, q) -> tuple[Tensor, Tensor]:
        """``(A, value)``: ``A = E_x^T T E_y`` and POT's ``srgw_dist`` (``srfgw_dist`` when fused) from ``Q``, ``q``
        and ``h_y = sum_l q_l |y_j - y_l|^4``: ``<h_x, a> + <h_y, q> - 2 <A, R_x A R_y>`` (``T 1 = a``)."""
        A = Ex.T @ Q[:, :self.q]
        val = hx @ self.a64 + hy @ q - 2.0 * (A * (self.Rx @ A @ self.Ry.T)).sum()
        if self.fused:  # (1 - alpha) <|F_i - G_j|^2, T> + alpha srGW
            feat = (F * F).sum(-1) @ self.a64 + (G * G).sum(-1) @ q - 2.0 * (F * Q[:, self.q:]).sum()
            val = self.alpha * val + (1.0 - self.alpha) * feat
        return A, val

    def step(self, it: _SRIterate, A: Tensor, hy: Tensor) -> tuple[_SRIterate, Tensor]:
        """The mirror step ``T <- diag(a / K 1) K``, ``K = T exp(-grad / reg)``, with POT's gradient
        ``grad = alpha 2 (h_x 1^T + 1 h_y^T - 2 D^x T D^y) + (1 - alpha) M`` less its row constants:
        ``(next iterate, dM)``."""
        al = self.alpha
        dM = torch.zeros_like(it.M)
        dM[:self.p, :self.q] = (-4.0 * al) * self.Rx @ A @ self.Ry.T
        dv = 2.0 * al * hy
        if self.fused:
            dM[self.p:, self.q:] = -2.0 * (1.0 - al) * torch.eye(self.F.shape[1], dtype=torch.float64, device=self.dev)
            dv = dv + (1.0 - al) * (self.G * self.G).sum(-1)
        return self.iterate(it.M + dM, it.g - dv), dM

    # -- |T - T_prev|_F from plan products (POT's err) -----------------------------------------
    def sq_norm(self, it: _SRIterate) -> float:
        """``|T|_F^2``: a plan product at ``reg / 2`` with doubled log-weights."""
        al, be = self.logs(it)
        ones = torch.ones(1, self.m, 1, dtype=self.cdt, device=self.dev)
        with torch.no_grad():
            r = self.engine.plan_product(self.xs, self.ys, 2 * al, 2 * be, self.reg / 2, ones, it.mm.cost)
        return float(r.double().sum())

    def dot(self, i1: _SRIterate, i2: _SRIterate) -> float:
        """``<T1, T2>``: a plan product with the mean of the two (feature-bilinear) costs at ``reg / 2``."""
        (a1, b1), (a2, b2) = self.logs(i1), self.logs(i2)
        mid = FeatureBilinearCost(0.5 * (i1.mm.cost.S + i2.mm.cost.S))
        ones = torch.ones(1, self.m, 1, dtype=self.cdt, device=self.dev)
        with torch.no_grad():
            r = self.engine.plan_product(self.xs, self.ys, a1 + a2, b1 + b2, self.reg / 2, ones, mid)
        return float(r.double().sum())

    def small_change(self, i1: _SRIterate, i2: _SRIterate, dM: Tensor) -> tuple[float, float]:
        """``(sum_ij T1_ij T2_ij d_ij^2, its rounding error)`` with ``T2 = T1 exp(d)``, ``d_ij = <w_i, z_j>``
        (``w = [df / reg, 1, -Phi dM / reg]``, ``z = [1, dg / reg, Psi]``): ``|T2 - T1|_F^2 = 4 sum T1 T2 sinh(d / 2)^2``
        to relative order ``d^2 / 12``, one plan product of ``T1 T2`` (the mean cost at ``reg / 2``) with
        ``z (x) z``; no cancellation."""
        reg, dev = self.reg, self.dev
        w = torch.cat([((i2.f - i1.f)[0].double() / reg).unsqueeze(-1), torch.ones(self.n, 1, dtype=torch.float64,
                                                                                    device=dev),
                       -(self.Phi @ dM) / reg], -1)
        z = torch.cat([torch.ones(self.m, 1, dtype=torch.float64, device=dev),
                       ((i2.g - i1.g)[0] / reg).unsqueeze(-1), self.Psi], -1)
        k = z.shape[1]
        Z2 = (z.unsqueeze(-1) * z.unsqueeze(-2)).reshape(1, self.m, k * k).to(self.cdt).contiguous()
        (a1, b1), (a2, b2) = self.logs(i1), self.logs(i2)
        mid = FeatureBilinearCost(0.5 * (i1.mm.cost.S + i2.mm.cost.S))
        with torch.no_grad():
            R = self.engine.plan_product(self.xs, self.ys, a1 + a2, b1 + b2, reg / 2, Z2, mid)[0].double()
        return _quadratic_form(w, R.reshape(self.n, k, k), self.cdt)

    def change(self, prev: _SRIterate, cur: _SRIterate, dM: Tensor) -> tuple[float, float, float]:
        """``(|T - T_prev|_F, floor, |T|_F)``: ``|T|^2 + |T_prev|^2 - 2 <T, T_prev>``, or, below ``1e-3 |T|_F`` and
        its rounding error above ``NOISE_RTOL`` of it, :meth:`small_change` when its rounding error is the smaller
        (its truncation error grows with the entries' relative changes, which mirror descent leaves O(1) on
        the decaying entries: the expansion is preferred while it is accurate); ``floor`` is what the compute
        dtype resolves: :func:`gromov_wasserstein`'s floor, or the square root of :meth:`small_change`'s rounding
        error when that form is used (the expansion's error estimate is an overestimate that only chooses)."""
        cur_sq, prev_sq = self.sq_norm(cur), self.sq_norm(prev)
        err_sq = cur_sq + prev_sq - 2.0 * self.dot(cur, prev)
        u = torch.finfo(self.cdt).eps
        scale = (cur.mm.cmax + float(cur.f.abs().max())) / self.reg + 2.0 * math.log2(1 + max(self.n, self.m))
        noise, floor = u * scale * (cur_sq + prev_sq), u * scale * math.sqrt(cur_sq)
        if err_sq < SMALL_CHANGE**2 * cur_sq and noise > NOISE_RTOL * err_sq:
            small, small_noise = self.small_change(prev, cur, dM)
            if small_noise < noise:
                err_sq, floor = small, max(floor, math.sqrt(small_noise))
        return math.sqrt(max(0.0, err_sq)), floor, math.sqrt(cur_sq)

    def value(self, it: _SRIterate, plan: GWPlan, q: Tensor, Q: Tensor) -> Tensor:
        """The loss of the final coupling, differentiable w.r.t. the points and features (coupling fixed)."""
        if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                                for t in (self.X, self.Y, self.FX, self.FY))):
            return self.loss(self.Ex, self.hx, _quartic(self.Yc, q), self.F, self.G, Q, q)[1]
        Ex, hx, _, Ey, _, Yc, F, G = self.features(True)
        Qg = plan.apply(torch.cat([Ey] + ([G] if self.fused else []), -1).to(self.cdt)).double()
        return self.loss(Ex, hx, _quartic(Yc, q), F, G, Qg, q)[1]


def _semirelaxed(X, Y, a, FX, FY, alpha: float, opts: _SROptions) -> GWResult:
    """Semi-relaxed (fused) GW: POT's mirror descent, each step one softmin and two plan products."""
    o = opts.checked()
    X, Y, a, _, FX, FY, is_np = _check_inputs(X, Y, a, None, FX, FY, semirelaxed=True)
    pb = _SRProblem(X, Y, a, FX, FY, alpha, o)
    P, Q0 = pb.Phi.shape[1], pb.Psi.shape[1]
    it = pb.iterate(torch.zeros(P, Q0, dtype=torch.float64, device=pb.dev),
                    torch.zeros(1, pb.m, dtype=torch.float64, device=pb.dev),
                    torch.zeros(1, pb.n, dtype=pb.cdt, device=pb.dev))  # T = a 1^T / m
    q, Q = pb.marginal_and_products(it)
    log = {"err": [], "value": [], "n_inner": []}
    err, converged, cpt, t0 = None, False, 0, time.perf_counter()
    stop_at, floor, norm = 0.0, 0.0, 1.0
    name = "semirelaxed_fused_gromov_wasserstein" if pb.fused else "semirelaxed_gromov_wasserstein"
    while cpt < o.max_iter:
        hy = _quartic(pb.Yc, q)
        A, _ = pb.loss(pb.Ex, pb.hx, hy, pb.F, pb.G, Q, q)
        nxt, dM = pb.step(it, A, hy)
        if cpt % CHECK_EVERY == 0:
            err, floor, norm = pb.change(it, nxt, dM)
            log["err"].append(err)
            stop_at = _stop_at(o.tol, floor, norm)
        it = nxt
        q, Q = pb.marginal_and_products(it)
        val = pb.loss(pb.Ex, pb.hx, _quartic(pb.Yc, q), pb.F, pb.G, Q, q)[1]
        log["value"].append(float(val))
        log["n_inner"].append(1)
        if o.verbose:
            e = f"  err {err:.3e}" if cpt % CHECK_EVERY == 0 else ""
            print(f"{name}: outer {cpt + 1}/{o.max_iter}  value {float(val):.10g}{e}  "
                  f"({time.perf_counter() - t0:.2f}s)", file=sys.stderr, flush=True)
        cpt += 1
        if cpt % CHECK_EVERY == 1 and stop_at is not None and err <= stop_at:
            converged = True
            break
    if not converged and stop_at is None:
        warnings.warn(_unresolved(name, pb.cdt, floor / norm, it.mm.cmax / o.reg), RuntimeWarning, stacklevel=3)
    plan = GWPlan(it.mm, it.f, it.g.to(pb.cdt), o.reg, (X.detach().to(pb.cdt).unsqueeze(0),
                                                        Y.detach().to(pb.cdt).unsqueeze(0)), numpy=is_np)
    value = pb.value(it, plan, q, Q).to(X.dtype)
    f, g = it.f[0].to(X.dtype), it.g[0].to(X.dtype)
    return GWResult(
        value=value.detach().cpu().numpy()[()] if is_np else value,
        plan=plan,
        potentials=(f.cpu().numpy(), g.cpu().numpy()) if is_np else (f, g),
        n_outer=cpt,
        n_inner=cpt,
        converged=converged,
        error=err,
        reg=o.reg,
        backend=pb.engine.name,
        log=log,
    )
