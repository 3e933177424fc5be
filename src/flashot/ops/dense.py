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
        S = alpha.unsqueeze(-1) + beta.unsqueeze(-2) - C / eps
        P = torch.exp(S)
        if weight == "cost":
            P = P * C
        elif weight == "dcost":
            P = P * cost.dcost_weight(C)
        return P @ V
