"""``dense`` engine: materialises the (B, N, M) cost matrix.

The reference implementation (test oracle, fully differentiable by plain
autograd) and the fastest choice for tiny problems.  Memory O(B N M).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..costs import Cost
from .base import Weight


class DenseEngine:
    name = "dense"

    def unsupported(self, device, dtype, cost):
        return None

    def softmin(self, x: Tensor, y: Tensor, h: Tensor, eps: float, cost: Cost) -> Tensor:
        C = cost.matrix(x, y)
        return -eps * torch.logsumexp(h.unsqueeze(-2) - C / eps, dim=-1)

    def plan_product(self, x, y, alpha, beta, eps, V, cost, weight: Weight = "plan"):
        C = cost.matrix(x, y)
        # row max taken out before exp (and put back after): exp(alpha + beta - C/eps)
        # directly loses ~1e-7 |alpha| in the exponent, which debiased p=1 gradients amplify.
        S = beta.unsqueeze(-2) - C / eps
        m = S.amax(-1, keepdim=True).clamp_min(torch.finfo(S.dtype).min)
        P = torch.exp(S - m) * torch.exp(alpha.unsqueeze(-1) + m)
        if weight == "cost":
            P = P * C
        elif weight == "dcost":
            P = P * cost.dcost_weight(C)
        return P @ V
