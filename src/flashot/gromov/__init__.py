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
through :func:`~flashot.driver.solve_measures` (the one solver), warm-started from the previous potentials.  The same plan product gives the GW
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
``reg``, unchanged up to rounding, in float32 as in float64 (:func:`~flashot.gromov.features.embed`).

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

from .api import (
    fused_gromov_wasserstein,
    gromov_wasserstein,
    semirelaxed_fused_gromov_wasserstein,
    semirelaxed_gromov_wasserstein,
)
from .balanced import GWProblem  # noqa: F401 (tests spy on its change)
from .features import CHECK_EVERY, NOISE_RTOL, SMALL_CHANGE  # noqa: F401
from .results import GWPlan, GWResult  # noqa: F401
from .semirelaxed import SRProblem  # noqa: F401

__all__ = [
    "GWResult",
    "fused_gromov_wasserstein",
    "gromov_wasserstein",
    "semirelaxed_fused_gromov_wasserstein",
    "semirelaxed_gromov_wasserstein",
]
