r"""Label-augmented costs on engines that only stream the squared Euclidean cost.

For a :class:`~flashot.costs.LabelCost` ``C((x, l), (y, l')) = w_f |x - y|^2 + w_l T[l, l']`` the rows of
one class ``k`` see the label term as a *column bias*:

* ``softmin(x, y, h)_i = softmin_f(x_k, y, h - w_l T[k, l'] / eps)_i`` for the rows ``i`` of class ``k``,
  with ``softmin_f`` the engine's squared-Euclidean softmin of scale ``w_f``;
* ``plan_product(x, y, alpha, beta)_i = plan_product_f(x_k, y, alpha_k, beta - w_l T[k, l'] / eps)_i``
  (``weight="cost"`` adds the plain product of ``w_l T[k, l'_j] V_j``; ``"dcost"`` is ``2 w_f`` times the
  plan: the label term has no gradient).

So one label-cost primitive is one streamed primitive per row class present, each over every column:
``N M`` pairs in all, as one plain call, in the engine's own kernels (no N x M matrix).  The rows are
grouped per call (a stable sort of the labels, ``O(N log N)``).  The engines see only the features; the
bias is rounded once into the log-weights' dtype, like the dense engine's ``h - C / eps``.  No fused step
is kept (the two sides group their rows differently): the core falls back to plain softmins.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import Engine, ForwardingEngine, Weight

__all__ = ["LabelAdapter", "adapt_labels"]


def _labelled(cost) -> bool:
    return getattr(cost, "labelled", False)


def _row_groups(lx: Tensor):
    """``(k, rows)`` for each label ``k`` present in ``lx`` (n,): the rows of that label, increasing."""
    order = torch.argsort(lx, stable=True)
    keys, counts = torch.unique_consecutive(lx[order], return_counts=True)
    start = 0
    for k, c in zip(keys.tolist(), counts.tolist()):
        yield k, order[start : start + c]
        start += c


class LabelAdapter(ForwardingEngine):
    """An engine for label-augmented costs built on ``inner``'s squared-Euclidean primitives.

    Same contract as every engine (:mod:`flashot.ops.base`): ``softmin`` ``out_i = -eps log sum_j
    exp(h_j - C_ij / eps)`` and ``plan_product`` ``out_i = sum_j exp(alpha_i + beta_j - C_ij / eps) W_ij V_j``
    for ``C_ij = w_f |x_i - y_j|^2 + w_l T[l_i, l_j]``, one call of ``inner`` per row class (see the module
    docstring).  Other costs go to ``inner`` unchanged.  ``name`` is ``inner``'s; no capabilities.
    """

    def __init__(self, inner: Engine):
        super().__init__(inner, ())

    def __repr__(self) -> str:
        return f"LabelAdapter({self.inner!r})"

    def unsupported(self, device: torch.device, dtype: torch.dtype, cost) -> str | None:
        return self.inner.unsupported(device, dtype, cost.features if _labelled(cost) else cost)

    def _passes(self, x: Tensor, y: Tensor, eps: float, cost, dtype: torch.dtype):
        """``(b, rows, x_k, y_b, lt)`` per batch entry ``b`` and row class ``k``: the features of the rows of
        class ``k`` (1, n_k, D), the columns' (1, M, D) and the label term ``w_l T[k, l']`` (1, M)."""
        T = cost.table(x.device, dtype)
        for b in range(x.shape[0]):
            (xf, lx), (yf, ly) = cost.split(x[b]), cost.split(y[b])
            yb = yf.unsqueeze(0).contiguous()
            for k, rows in _row_groups(lx):
                yield b, rows, xf[rows].unsqueeze(0).contiguous(), yb, cost.label_weight * T[k, ly].unsqueeze(0)

    def softmin(self, x: Tensor, y: Tensor, h: Tensor, eps: float, cost, **kw) -> Tensor:
        """``out_i = -eps log sum_j exp(h_j - w_l T[k, l_j] / eps - w_f |x_i - y_j|^2 / eps)`` for the rows of class
        ``k``."""
        if not _labelled(cost):
            return self.inner.softmin(x, y, h, eps, cost, **kw)
        out = h.new_empty(x.shape[:2])
        for b, rows, xk, yb, lt in self._passes(x, y, eps, cost, h.dtype):
            out[b, rows] = self.inner.softmin(xk, yb, (h[b : b + 1] - lt / eps).contiguous(), eps, cost.features)[0]
        return out

    def plan_product(
        self,
        x: Tensor,
        y: Tensor,
        alpha: Tensor,
        beta: Tensor,
        eps: float,
        V: Tensor,
        cost,
        weight: Weight = "plan",
        **kw,
    ) -> Tensor:
        """``out_i = sum_j exp(alpha_i + beta_j - C_ij / eps) W_ij V_j`` per row class, on the shifted ``beta``."""
        if not _labelled(cost):
            return self.inner.plan_product(x, y, alpha, beta, eps, V, cost, weight, **kw)
        feat, K = cost.features, V.shape[-1]
        out = V.new_empty(x.shape[0], x.shape[1], K)
        for b, rows, xk, yb, lt in self._passes(x, y, eps, cost, beta.dtype):
            ak, bk, Vb = alpha[b : b + 1, rows].contiguous(), (beta[b : b + 1] - lt / eps).contiguous(), V[b : b + 1]
            if weight == "cost":  # C = w_f |x - y|^2 + w_l T: the feature-cost product plus the plan of w_l T V
                LV = lt.unsqueeze(-1).to(V.dtype) * Vb
                r = self.inner.plan_product(
                    xk, yb, ak, bk, eps, Vb.contiguous(), feat, "cost"
                ) + self.inner.plan_product(xk, yb, ak, bk, eps, LV.contiguous(), feat, "plan")
            else:  # "plan", or "dcost": 2 w_f times the plan, the feature cost's own dcost weight
                r = self.inner.plan_product(xk, yb, ak, bk, eps, Vb.contiguous(), feat, weight)
            out[b, rows] = r[0]
        return out


_ADAPTERS: dict[int, LabelAdapter] = {}


def adapt_labels(engine: Engine) -> LabelAdapter:
    """The (one, cached) :class:`LabelAdapter` over ``engine``: its squared-Euclidean kernels run
    label-augmented costs ``C = w_f |x - y|^2 + w_l W[l, l']``."""
    ad = _ADAPTERS.get(id(engine))
    if ad is None or ad.inner is not engine:
        ad = _ADAPTERS[id(engine)] = LabelAdapter(engine)
    return ad
