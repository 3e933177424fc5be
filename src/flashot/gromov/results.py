"""The result of the GW solvers and the lazy GW coupling."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..measures import Measures
from ..plan import LazyPlan


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
    def value_entropic(self) -> float:
        """``value + reg KL(T | a b^T)``: the entropic objective whose exact gradient ``value``'s
        gradient is (detached; streamed, one plan product).  ``NotImplementedError`` for the semi-relaxed solvers
        (mirror descent on the unregularised loss: no entropic objective)."""
        if self._entropic is None:
            raise NotImplementedError(
                "value_entropic: the semi-relaxed solvers minimise the unregularised loss "
                "by mirror descent (reg is a step size); use value"
            )
        return self._entropic()

    @property
    def status(self) -> str:
        return "converged" if self.converged else "max_iter reached"


class GWPlan(LazyPlan):
    """The GW coupling between the points ``X`` (rows) and ``Y`` (columns).

    Internally a plan over augmented feature points (:class:`~flashot.costs.FeatureBilinearCost`);
    :meth:`barycentric_map` maps onto the original coordinates of the other cloud."""

    def __init__(
        self,
        m: Measures,
        f: Tensor,
        g: Tensor,
        eps: float,
        pts: tuple[Tensor, Tensor],
        *,
        transposed: bool = False,
        numpy: bool = False,
    ) -> None:
        super().__init__(m, f, g, eps, transposed=transposed, numpy=numpy)
        self._pts = pts  # (X, Y), (1, n, dx) / (1, m, dy), detached, compute dtype

    @property
    def T(self) -> GWPlan:
        return GWPlan(self._m, self._f, self._g, self.eps, self._pts, transposed=not self._t, numpy=self._numpy)

    def barycentric_map(self) -> Tensor | np.ndarray:
        """``sum_j T_ij y_j / sum_j T_ij``: each point of ``X`` mapped into ``Y``'s space (N, dy) (``plan.T``:
        ``Y`` into ``X``'s space); rows of zero mass give NaN."""
        tgt = self._pts[0] if self._t else self._pts[1]
        D = tgt.shape[-1]
        S = self._apply_raw(torch.cat([tgt, torch.ones_like(tgt[..., :1])], -1).contiguous())
        with torch.no_grad():
            mass = S[..., D:]
            T = torch.where(mass > 0, S[..., :D] / mass.clamp_min(torch.finfo(S.dtype).tiny), float("nan"))
        return self._finish(T)
