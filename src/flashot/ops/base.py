"""The engine contract: two streamed primitives, nothing else.

All tensors are batched and contiguous: ``x`` (B, N, D), ``y`` (B, M, D), same
dtype (float32 or float64) and device.  ``eps`` is a positive Python float.

* ``softmin(x, y, h, eps, cost)``  ->  (B, N)::

      out_i = -eps * log sum_j exp(h_j - C(x_i, y_j) / eps)

* ``plan_product(x, y, alpha, beta, eps, V, cost, weight)``  ->  (B, N, K)::

      out_i = sum_j exp(alpha_i + beta_j - C_ij / eps) * W_ij * V_j

  with ``W_ij = 1`` (``weight="plan"``), ``W_ij = C_ij`` (``"cost"``), or
  ``W_ij = w(C_ij)`` such that ``grad_x C(x_i, y_j) = w * (x_i - y_j)`` (``"dcost"``).
  With ``alpha = f / eps + log a`` and ``beta = g / eps + log b`` this is
  ``P @ V`` for the entropic plan ``P_ij = a_i b_j exp((f_i + g_j - C_ij) / eps)``.

Optional: ``softmin_pair(x, y, hx, hy, eps, cost)`` -> ``(softmin(x, y, hy), softmin(y, x, hx))``
in one pass (the symmetric Sinkhorn step), ``softmin_sym(x, h, eps, cost)`` ->
``softmin(x, x, h)`` (the debiasing problems), and ``softmin_alt(x, y, ha, hy, eps, cost, lam)``
-> ``(f, softmin(y, x, ha + lam f / eps))`` with ``f = softmin(x, y, hy)`` (the alternating
step); the solver falls back to ``softmin`` calls for engines without them.

Optional hint: ``expect_reuse(x, y, cost)``, called by the solver before it iterates on
(x, y) (an engine with a cache may prepare it on the first call).

The transposed forms are the same calls with the roles of (x, alpha) and
(y, beta) swapped: every supported cost is symmetric.  Zero weights enter as
``-inf`` log-weights and must contribute exactly nothing (no NaN).
"""

from __future__ import annotations

from typing import Literal, Protocol

import torch
from torch import Tensor

from ..costs import Cost

Weight = Literal["plan", "cost", "dcost"]
WEIGHTS = ("plan", "cost", "dcost")


class Engine(Protocol):
    """What every engine implements (see the module docstring for the maths).

    Two primitives on batched, contiguous inputs ``x`` (B, N, D), ``y`` (B, M, D), ``eps > 0``
    and a :class:`~flashot.Cost` ``C``:

    * ``softmin``: ``out_i = -eps log sum_j exp(h_j - C(x_i, y_j) / eps)``, (B, N);
    * ``plan_product``: ``out_i = sum_j exp(alpha_i + beta_j - C(x_i, y_j) / eps) W_ij V_j``,
      (B, N, K), with ``W_ij = 1`` (``"plan"``), ``C_ij`` (``"cost"``) or ``w`` such that
      ``grad_x C = w (x - y)`` (``"dcost"``).

    Register one with :func:`register_engine`; ``-inf`` entries of ``h``, ``alpha``, ``beta``
    (zero weights) must contribute nothing.

    Example:
        >>> import torch, flashot
        >>> from flashot import ops
        >>> cost = flashot.get_cost("sqeuclidean")
        >>> eng = ops.get_engine("tiled", device=torch.device("cpu"), dtype=torch.float64, cost=cost)
        >>> x, y = torch.randn(1, 5, 2, dtype=torch.float64), torch.randn(1, 6, 2, dtype=torch.float64)
        >>> h = torch.zeros(1, 6, dtype=torch.float64)
        >>> out = eng.softmin(x, y, h, 0.5, cost)
        >>> bool(torch.allclose(out, -0.5 * torch.logsumexp(h[:, None] - cost.matrix(x, y) / 0.5, -1)))
        True
        >>> eng.plan_product(x, y, h[:, :5], h, 0.5, torch.ones(1, 6, 1, dtype=torch.float64), cost).shape
        torch.Size([1, 5, 1])
    """

    name: str

    def unsupported(self, device: torch.device, dtype: torch.dtype, cost: Cost) -> str | None:
        """``None`` when the engine can run this case, else a one-line reason."""

    def softmin(self, x: Tensor, y: Tensor, h: Tensor, eps: float, cost: Cost) -> Tensor:
        """``out_i = -eps log sum_j exp(h_j - C(x_i, y_j) / eps)``: (B, N, D), (B, M, D), (B, M) -> (B, N)."""
        ...

    def plan_product(
        self,
        x: Tensor,
        y: Tensor,
        alpha: Tensor,
        beta: Tensor,
        eps: float,
        V: Tensor,
        cost: Cost,
        weight: Weight = "plan",
    ) -> Tensor:
        """``out_i = sum_j exp(alpha_i + beta_j - C(x_i, y_j) / eps) W_ij V_j``: V (B, M, K) -> (B, N, K).

        ``W_ij`` is 1 (``weight="plan"``), ``C(x_i, y_j)`` (``"cost"``) or ``w`` such that
        ``grad_x C(x_i, y_j) = w (x_i - y_j)`` (``"dcost"``).
        """
        ...


def self_softmin(engine: Engine, x: Tensor, h: Tensor, eps: float, cost: Cost) -> Tensor:
    """``softmin(x, x, h)`` through the engine's ``softmin_sym`` (half the pairs) when it has one."""
    sym = getattr(engine, "softmin_sym", None)
    if sym is not None:
        return sym(x, h, eps, cost)
    return engine.softmin(x, x, h, eps, cost)


def exp_floor(dtype: torch.dtype) -> float:
    """Most negative argument passed to ``exp`` after the running max is removed.

    ``torch.exp`` on the CPU is 60-140x slower for float32 arguments below about
    -87.3 (the denormal/underflow path).  Clamping there changes each term by at
    most ~1e-38 next to a leading term of 1, i.e. not at all in float32.
    """
    return -87.0 if dtype == torch.float32 else -708.0
