"""``tiled`` engine: blocked PyTorch with an online LogSumExp, on any device.

Rows and columns are both blocked; at most one (B, bn, bm) tile of scores is
alive at a time, so memory is O(B (N + M) D + B bn bm), never O(N M).

Each tile computes the cost block explicitly (for dot-product costs one batched
GEMM: ``|x_i|^2 + |y_j|^2 - 2 <x_i, y_j>``), then ``h_j - C_ij / eps``.  Folding
the biases into the GEMM (``(2 s / eps) <x_i, y_j> + [h_j - s |y_j|^2 / eps]``)
saves two elementwise passes but, measured in float32 at blur = 0.05, makes the
gradients ~7x less accurate (5e-4 vs 7e-5 max-relative against float64): the
reference streaming engine keeps the explicit form.  The running max is
subtracted before ``exp``, whose argument is clamped at the underflow threshold
(:func:`~flashot.ops.base.exp_floor`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..costs import Cost
from .base import Engine, Weight, exp_floor

# Elements of one score tile (B * bn * bm).  2**21 float32 = 8 MiB.
TILE_ELEMS = 2**21
COL_BLOCK = 4096


def tile_blocks(B: int, N: int, M: int, tile_elems: int) -> tuple[int, int]:
    """``(bn, bm)``: rows and columns of a (B, bn, bm) tile of at most about ``tile_elems`` entries."""
    bm = min(M, COL_BLOCK)
    bn = max(1, min(N, tile_elems // max(1, B * bm)))
    if bn < 16 and bm > 256:  # huge batch: shrink columns instead of rows
        bm = max(256, tile_elems // max(1, B * 16))
        bn = max(1, min(N, tile_elems // max(1, B * bm)))
    return bn, bm


def cost_tile(cost: Cost, xi: Tensor, yj: Tensor, xsq: Tensor, ysq: Tensor) -> Tensor:
    """(B, bn, bm) cost block; a fresh tensor the caller may overwrite."""
    if cost.direct:
        return cost.tile(xi, yj)
    d2 = torch.baddbmm(ysq.unsqueeze(1), xi, yj.transpose(1, 2), alpha=-2.0)
    d2.add_(xsq.unsqueeze(2)).clamp_min_(0.0)
    if cost.is_dot:
        return d2.mul_(cost.scale) if cost.scale != 1.0 else d2
    return cost.from_sqdist(d2)


class TiledEngine(Engine):
    name = "tiled"
    capabilities = frozenset()  # the two primitives only

    def __init__(self, tile_elems: int = TILE_ELEMS):
        self.tile_elems = int(tile_elems)

    def unsupported(self, device, dtype, cost):
        return None

    def _sweep(self, x, y, beta, eps, cost, V=None, weight: Weight = "plan"):
        """Online-LSE sweep. Returns (m, s) with lse = m + log s (V None), or (m, acc)."""
        B, N, _ = x.shape
        M = y.shape[1]
        bn, bm = tile_blocks(B, N, M, self.tile_elems)
        floor = exp_floor(x.dtype)
        lowest = torch.finfo(x.dtype).min
        xsq = (x * x).sum(-1)
        ysq = (y * y).sum(-1)
        m_all = torch.empty(B, N, dtype=x.dtype, device=x.device)
        acc_all = torch.empty(B, N, *(() if V is None else (V.shape[-1],)), dtype=x.dtype, device=x.device)
        for i0 in range(0, N, bn):
            i1 = min(N, i0 + bn)
            m_run = torch.full((B, i1 - i0), lowest, dtype=x.dtype, device=x.device)
            acc = torch.zeros_like(acc_all[:, i0:i1])
            for j0 in range(0, M, bm):
                j1 = min(M, j0 + bm)
                C = cost_tile(cost, x[:, i0:i1], y[:, j0:j1], xsq[:, i0:i1], ysq[:, j0:j1])
                W = None
                if weight == "cost":
                    W = C.clone()
                elif weight == "dcost":
                    W = cost.dcost_weight(C)
                S = C.mul_(-1.0 / eps).add_(beta[:, None, j0:j1])
                m_new = torch.maximum(m_run, S.amax(-1))
                rescale = torch.exp(m_run - m_new)
                S.sub_(m_new.unsqueeze(-1)).clamp_(min=floor).exp_()
                if V is None:
                    acc.mul_(rescale).add_(S.sum(-1))
                else:
                    if W is not None:
                        S.mul_(W)
                    acc.mul_(rescale.unsqueeze(-1)).baddbmm_(S, V[:, j0:j1])
                m_run = m_new
            m_all[:, i0:i1] = m_run
            acc_all[:, i0:i1] = acc
        return m_all, acc_all

    def softmin(self, x: Tensor, y: Tensor, h: Tensor, eps: float, cost: Cost) -> Tensor:
        m, s = self._sweep(x, y, h, eps, cost)
        # a row whose running max never left its start saw only zero weights (-inf): the clamped
        # exponentials then sum to ~1e-38 each, so take the empty sum's value, -eps log 0 = +inf
        empty = m == torch.finfo(m.dtype).min
        return torch.where(empty, torch.full_like(m, torch.inf), -eps * (m + torch.log(s)))

    def plan_product(self, x, y, alpha, beta, eps, V, cost, weight: Weight = "plan"):
        m, acc = self._sweep(x, y, beta, eps, cost, V, weight)
        return acc * torch.exp(alpha + m).unsqueeze(-1)
