r"""The Sinkhorn loop, written once against the softmin primitive.

Log-domain entropic OT between :math:`a = \sum_i a_i \delta_{x_i}` and
:math:`b = \sum_j b_j \delta_{y_j}` at temperature :math:`\varepsilon`:

.. math::
    f_i \leftarrow -\lambda_x \varepsilon \log \sum_j b_j e^{(g_j - C(x_i, y_j))/\varepsilon},
    \qquad
    g_j \leftarrow -\lambda_y \varepsilon \log \sum_i a_i e^{(f_i - C(x_i, y_j))/\varepsilon}

with damping :math:`\lambda = 1 / (1 + \varepsilon / \rho)` for a KL marginal
penalty of strength :math:`\rho` (:math:`\lambda = 1`, balanced, when ``rho`` is None).

* ``symmetric=True``: both potentials from the previous ones, then averaged
  (GeomLoss); the debiasing potentials ``f_aa``, ``g_bb`` are updated alongside.
* ``symmetric=False``: alternating updates (POT / OTT).

The loop never touches tiles or engines: it only calls :class:`~flashot.measures.Measures`.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from .measures import Measures


@dataclass(frozen=True)
class IterationRecord:
    """What a ``callback`` receives after each iteration."""

    iteration: int  # 1-based
    eps: float
    error: float | None  # marginal error (balanced) or potential change (unbalanced); None if not computed
    elapsed: float  # seconds since the loop started


@dataclass
class SinkhornState:
    f: Tensor  # (B, N)  potential on x
    g: Tensor  # (B, M)  potential on y
    f_aa: Tensor | None  # (B, N) symmetric potential of (a, a), debiasing only
    g_bb: Tensor | None
    eps: float  # final temperature
    n_iter: int
    error: float | None
    converged: bool


def damping(eps: float, rho: float | None) -> float:
    return 1.0 if rho is None else 1.0 / (1.0 + eps / rho)


def _marginal_error(m: Measures, f_old: Tensor, f_new: Tensor, eps: float, side: str) -> Tensor:
    """L1 error of one marginal of the plan built from (f_old, g), read off the update f_new.

    For the plan ``P = a b exp((f_old + g - C)/eps)``, the row sums are
    ``a_i exp((f_old_i - f_new_i)/eps)`` where ``f_new = softmin_x(log b + g/eps)``:
    no extra pass over the data.  Returns a (B,) tensor.
    """
    w = m.a if side == "x" else m.b
    w = w.detach()
    r = torch.exp((f_old - f_new) / eps)
    return (w * (r - 1.0)).abs().nansum(-1)


def sinkhorn_loop(
    m: Measures,
    eps_list: Sequence[float],
    *,
    symmetric: bool = True,
    debias: bool = False,
    rho_x: float | None = None,
    rho_y: float | None = None,
    tol: float | None = None,
    init: tuple[Tensor, Tensor] | None = None,
    callback: Callable[[IterationRecord], None] | None = None,
    warn: bool = True,
) -> SinkhornState:
    """Run Sinkhorn iterations, one per entry of ``eps_list``.

    Stops early when ``tol`` is given and the error drops below it (the error is
    the L1 marginal violation for balanced problems, the sup-norm change of the
    potentials divided by eps otherwise).  ``init = (f, g)`` warm-starts the cross
    potentials.  Runs without autograd.
    """
    balanced = rho_x is None and rho_y is None
    a_log, b_log = m.a_log, m.b_log
    n_total = len(eps_list)
    track = tol is not None or callback is not None
    t0 = time.perf_counter()
    err_t: Tensor | None = None
    converged = False
    it = 0
    with torch.no_grad():
        eps = eps_list[0]
        lx, ly = damping(eps, rho_x), damping(eps, rho_y)
        if init is not None:
            f, g = init
        elif symmetric:
            f, g = lx * m.softmin_x(b_log, eps), ly * m.softmin_y(a_log, eps)
        else:
            f, g = torch.zeros_like(a_log), torch.zeros_like(b_log)
        f_aa = g_bb = None
        if debias:
            f_aa, g_bb = lx * m.softmin_xx(a_log, eps), ly * m.softmin_yy(b_log, eps)

        for it, eps in enumerate(eps_list, start=1):
            lx, ly = damping(eps, rho_x), damping(eps, rho_y)
            if symmetric:
                ft = lx * m.softmin_x(b_log + g / eps, eps)
                gt = ly * m.softmin_y(a_log + f / eps, eps)
                if track:
                    if balanced:
                        err_t = torch.maximum(
                            _marginal_error(m, f, ft, eps, "x"), _marginal_error(m, g, gt, eps, "y")
                        )
                    else:
                        err_t = torch.maximum((ft - f).abs().amax(-1), (gt - g).abs().amax(-1)) / eps
                if debias:
                    ft_aa = lx * m.softmin_xx(a_log + f_aa / eps, eps)
                    gt_bb = ly * m.softmin_yy(b_log + g_bb / eps, eps)
                    f_aa, g_bb = 0.5 * (f_aa + ft_aa), 0.5 * (g_bb + gt_bb)
                f, g = 0.5 * (f + ft), 0.5 * (g + gt)
            else:
                fn = lx * m.softmin_x(b_log + g / eps, eps)
                if track and it > 1:
                    err_t = (
                        _marginal_error(m, f, fn, eps, "x")
                        if balanced
                        else (fn - f).abs().amax(-1) / eps
                    )
                f = fn
                g = ly * m.softmin_y(a_log + f / eps, eps)
            err = None if err_t is None else float(err_t.max())
            if callback is not None:
                callback(IterationRecord(it, eps, err, time.perf_counter() - t0))
            if tol is not None and err is not None and err < tol:
                converged = True
                break
    err = None if err_t is None else float(err_t.max())
    if tol is not None and not converged and warn:
        warnings.warn(
            f"Sinkhorn did not reach tol={tol:g} in {it} iterations (error {err:.3g}); "
            "raise max_iter, or use a larger epsilon.",
            RuntimeWarning,
            stacklevel=3,
        )
    return SinkhornState(f, g, f_aa, g_bb, eps, it, err, converged)


def final_step(
    m: Measures,
    st: SinkhornState,
    *,
    rho_x: float | None = None,
    rho_y: float | None = None,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """One last (parallel) update with autograd on: the envelope-theorem gradients.

    The previous potentials are constants; each new potential is differentiable
    w.r.t. its own side's points only (as in GeomLoss), so
    ``<a, f> + <b, g>`` has the gradient ``sum_j P_ij grad_x C(x_i, y_j)`` in x and
    the potentials as gradients in the weights, without backprop through iterations.
    """
    eps = st.eps
    lx, ly = damping(eps, rho_x), damping(eps, rho_y)
    f = lx * m.softmin_grad("xy", m.b_log + st.g / eps, eps)
    g = ly * m.softmin_grad("yx", m.a_log + st.f / eps, eps)
    f_aa = g_bb = None
    if st.f_aa is not None:
        f_aa = lx * m.softmin_grad("xx", m.a_log + st.f_aa / eps, eps)
        g_bb = ly * m.softmin_grad("yy", m.b_log + st.g_bb / eps, eps)
    return f, g, f_aa, g_bb


def balanced_value(a: Tensor, b: Tensor, f: Tensor, g: Tensor) -> Tensor:
    """``<a, f> + <b, g>``, (B,)."""
    return (a * f).sum(-1) + (b * g).sum(-1)
