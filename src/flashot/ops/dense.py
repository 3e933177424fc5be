"""``dense`` engine: materialises the (B, N, M) cost matrix.

The reference implementation (test oracle, fully differentiable by plain
autograd).  Memory O(B N M).  Where the ``cpu`` engine runs, ``backend="auto"`` picks
``dense`` only for tiny problems (``ops/registry.py``, ``benchmarks/AUTO_CROSSOVER.md``).

Like the streaming engines, the largest exponent of each row is removed before
``exp`` and arguments below the underflow threshold (:func:`~flashot.ops.base.exp_floor`)
never reach ``exp``: on the CPU ``torch.exp`` of float32 arguments below ~-87.3 takes a
60-140x slower path, and at small eps most pairs are there (``torch.logsumexp`` does not
clamp).  Those terms are set to exactly 0 instead, and every other term loses
1.001 exp(floor): next to the row's largest term, which is 1, that is < 2^-125 in float32
and < 2^-1021 in float64, so nothing representable changes, and zero weights (``-inf``)
still contribute exactly nothing.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..costs import Cost
from .base import Weight, exp_floor


def _exp_shifted(S: Tensor, m: Tensor) -> Tensor:
    """``exp(S - m)`` with the arguments below the underflow threshold never passed to
    ``exp``, and their terms set to exactly 0: the clamped exponentials (``exp(floor)``) and
    everything below 1.001 exp(floor) (< 2^-125 in float32) are subtracted off and clipped at
    0, which also makes ``-inf`` (zero weights) exactly 0.  Two cheap passes (a boolean mask
    and ``masked_fill_`` cost ~30x more here).  In place on ``S`` when autograd does not need it."""
    floor = exp_floor(S.dtype)
    cut = 1.001 * math.exp(floor)  # above exp(floor) as computed by any exp: those become 0
    if torch.is_grad_enabled() and (S.requires_grad or m.requires_grad):
        return ((S - m).clamp_min(floor).exp() - cut).clamp_min(0.0)
    return S.sub_(m).clamp_(min=floor).exp_().sub_(cut).clamp_(min=0.0)


def _lse_last(S: Tensor) -> Tensor:
    """``logsumexp`` over the last dimension (kept), with a clamped ``exp``; ``S`` is consumed."""
    if S.shape[-1] == 0:  # the empty sum: log 0
        return S.new_full((*S.shape[:-1], 1), -math.inf)
    m = S.detach().amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # all -inf: log(0) + 0 = -inf
    return torch.log(_exp_shifted(S, m).sum(-1, keepdim=True)) + m


class DenseEngine:
    name = "dense"

    def unsupported(self, device, dtype, cost):
        return None

    def softmin(self, x: Tensor, y: Tensor, h: Tensor, eps: float, cost: Cost) -> Tensor:
        C = cost.matrix(x, y)
        return -eps * _lse_last(h.unsqueeze(-2) - C / eps).squeeze(-1)

    def plan_product(self, x, y, alpha, beta, eps, V, cost, weight: Weight = "plan"):
        C = cost.matrix(x, y)
        # row max taken out before exp (and put back after): exp(alpha + beta - C/eps)
        # directly loses ~1e-7 |alpha| in the exponent, which debiased p=1 gradients amplify.
        S = beta.unsqueeze(-2) - C / eps
        m = S.amax(-1, keepdim=True).clamp_min(torch.finfo(S.dtype).min)
        P = _exp_shifted(S, m) * torch.exp(alpha.unsqueeze(-1) + m)
        if weight == "cost":
            P = P * C
        elif weight == "dcost":
            P = P * cost.dcost_weight(C)
        return P @ V
