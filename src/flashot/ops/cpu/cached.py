"""The ``cpu`` engine's cached-cost path: a pair's cost matrix, built once, read by memory-bound passes.

For moderate N M and large D, the cost matrix of an (x, y) pair is computed once (one MKL GEMM per row
chunk through torch, on the augmented points ``[x, |x|^2, 1] . [-2y, 1, |y|^2]``); each later softmin
(either direction: ``softmin(y, x)`` streams the transpose) is a memory-bound exp pass over it, and so
is each plan product (weights from ``C`` in row chunks, contracted with ``V`` by a GEMM: the same
arithmetic as the cached softmins, so gradients are consistent with the potentials).  Which pairs are
cached, and for how long, is the engine's choice (:class:`flashot.ops.cpu.engine.CpuEngine`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ...costs import Cost
from ..base import Weight
from . import abi
from .common import LN2, LOG2E, PLAN_CHUNK_BYTES, W_COST, W_INV, W_ONE, encode_zero_weights, ptr

__all__ = ["CachedCalls", "raw_cost_matrix"]


def raw_cost_matrix(
    x: Tensor, y: Tensor, cost: Cost, rows: int = 2048, out: Tensor | None = None
) -> tuple[Tensor, float]:
    """``(C, scale)`` with ``cost(x_i, y_j) = scale * C_ij``, C of shape (B, N, M), built in row chunks.

    Squared costs: ``C = |x|^2 + |y|^2 - 2<x, y>`` as ONE GEMM per chunk on the augmented
    points ``[x, |x|^2, 1]`` and ``[-2y, 1, |y|^2]`` (written straight into C; not clamped:
    the matrix only feeds exponents, where a rounding-level negative entry is harmless,
    like in the streaming kernel).  Euclidean: ``torch.cdist`` from coordinate differences,
    with the cost's clamp.  ``out`` (optional) is reused as the buffer.
    """
    B, N = x.shape[:2]
    M = y.shape[1]
    C = torch.empty(B, N, M, dtype=x.dtype) if out is None else out
    if cost.is_dot:
        ones_x = torch.ones(B, N, 1, dtype=x.dtype)
        ones_y = torch.ones(B, M, 1, dtype=x.dtype)
        xa = torch.cat([x, (x * x).sum(-1, keepdim=True), ones_x], -1)
        yaT = torch.cat([-2.0 * y, ones_y, (y * y).sum(-1, keepdim=True)], -1).transpose(1, 2)
        for b in range(B):
            for i0 in range(0, N, rows):
                i1 = min(N, i0 + rows)
                torch.mm(xa[b, i0:i1], yaT[b], out=C[b, i0:i1])
        return C, float(cost.scale)
    for b in range(B):
        for i0 in range(0, N, rows):
            i1 = min(N, i0 + rows)
            blk = C[b, i0:i1]
            blk.copy_(torch.cdist(x[b, i0:i1], y[b], compute_mode="donot_use_mm_for_euclid_dist"))
            if cost.min_sqdist > 0:
                blk.clamp_min_(math.sqrt(cost.min_sqdist))
    return C, 1.0


def _cached_weight(weight: Weight, scale: float, cost: Cost) -> tuple[int, float, float]:
    """(weight kind, constant factor, threshold) of the cached weights kernel for ``weight``."""
    wk, wconst, wthr = W_ONE, 1.0, 0.0
    if weight == "cost":
        wk, wconst = W_COST, (scale if cost.is_dot else 1.0)
    elif weight == "dcost":
        if cost.is_dot:
            wconst = 2.0 * scale
        else:
            wk = W_INV
            wthr = 1.001 * math.sqrt(cost.min_sqdist) if cost.min_sqdist > 0 else 0.0
    return wk, wconst, wthr


class CachedCalls:
    """The cached-matrix kernels' calls, mixed into :class:`flashot.ops.cpu.engine.CpuEngine`.

    ``C`` is the raw matrix of :func:`raw_cost_matrix` (cost = ``scale * C``); ``transposed``: the
    output runs over its columns.  Reads the engine's ``lib``, ``stats`` and ``_nthreads()``.
    """

    lib: object
    stats: dict

    def _softmin_cached(
        self, C: Tensor, scale: float, transposed: bool, h: Tensor, eps: float, oscale: float | None = None
    ) -> Tensor:
        """LSE pass over the cached raw matrix (cost = scale * C): ``oscale * LSE_2`` of the base-2
        scores ``h log2(e) - scale C log2(e) / eps`` (default ``oscale = -eps ln 2``: the softmin)."""
        B, N, M = C.shape
        lib = self.lib
        f32 = C.dtype == torch.float32
        if transposed:  # out over the columns of C
            out = torch.empty(B, M, dtype=C.dtype)
            fn = lib.flashot_cols_lse_f32 if f32 else lib.flashot_cols_lse_f64
        else:
            out = torch.empty(B, N, dtype=C.dtype)
            fn = lib.flashot_rows_lse_f32 if f32 else lib.flashot_rows_lse_f64
        h2 = encode_zero_weights((h * LOG2E).contiguous())
        args = abi.CachedArgs(
            C=ptr(C),
            h=ptr(h2),
            out=ptr(out),
            N=N,
            M=M,
            k=LOG2E * scale / eps,
            oscale=-eps * LN2 if oscale is None else oscale,
            B=B,
            nth=self._nthreads(),
        )
        rc = abi.call(fn, args)
        if rc != 0:
            raise RuntimeError(f"cpu engine: cached-cost kernel returned {rc}")
        return out

    def _alt_cached(self, C: Tensor, scale: float, ha: Tensor, hy: Tensor, eps: float, lam: float):
        """Alternating step over the cached matrix of (x, y): row LSEs, then the column LSEs with the
        rows' new weights, block of rows by block of rows (C is read from memory once)."""
        B, N, M = C.shape
        f32 = C.dtype == torch.float32
        self.stats["alt_cached"] = self.stats.get("alt_cached", 0) + 1
        h2 = encode_zero_weights((hy * LOG2E).contiguous())
        ha2 = encode_zero_weights((ha * LOG2E).contiguous())
        rlse = torch.empty(B, N, dtype=C.dtype)
        clse = torch.empty(B, M, dtype=C.dtype)
        fn = self.lib.flashot_cached_alt_f32 if f32 else self.lib.flashot_cached_alt_f64
        args = abi.CachedArgs(
            C=ptr(C),
            h=ptr(h2),
            ha=ptr(ha2),
            out=ptr(rlse),
            cols=ptr(clse),
            N=N,
            M=M,
            k=LOG2E * scale / eps,
            lam=float(lam),
            B=B,
            nth=self._nthreads(),
        )
        rc = abi.call(fn, args)
        if rc != 0:
            raise RuntimeError(f"cpu engine: cached alternating kernel returned {rc}")
        return (-eps * LN2) * rlse, (-eps * LN2) * clse

    def _plan_cached(
        self,
        C: Tensor,
        scale: float,
        transposed: bool,
        alpha: Tensor,
        beta: Tensor,
        eps: float,
        V: Tensor,
        cost: Cost,
        weight: Weight,
    ) -> Tensor:
        """Plan product over the cached raw matrix, in two passes (so no over- or underflow).

        ``L`` = base-2 LSE of ``beta log2(e) - k C`` over the summed index (the cached LSE pass),
        then row chunks of weights ``exp2(beta log2(e) - k C - L) W`` (each output's weights sum
        to at most 1) are contracted with ``V`` by a GEMM, and each output is scaled by
        ``exp(alpha + L ln 2)``.  Same score arithmetic as the cached softmin, so potentials from
        it and plan products (gradients) are consistent.  ``transposed``: the output runs over
        the columns of C (``out += P^T V`` chunk by chunk).
        """
        B, N, M = C.shape
        dt = C.dtype
        f32 = dt == torch.float32
        neg = -1e37 if f32 else -1e300  # finite "zero weight" for the kernel's exp2
        k = LOG2E * scale / eps
        L = self._softmin_cached(C, scale, transposed, beta, eps, oscale=1.0)  # over the summed index
        good = torch.isfinite(L) & (L > 0.5 * neg)  # not good: every weight of the sum is zero
        shift = torch.where(good, -L, torch.full_like(L, neg)).contiguous()
        h2 = (beta * LOG2E).clamp_(min=neg).contiguous()
        wk, wconst, wthr = _cached_weight(weight, scale, cost)
        K = V.shape[2]
        # GEMM layouts measured fastest for narrow V (K = 2..8: 3-5x over row-major V) and as fast at K = 65:
        # P V with V column-major; for the transposed product, out^T (K, M) += V_chunk^T P
        if transposed:
            outT = torch.zeros(B, K, M, dtype=dt)
            Vt = V.transpose(1, 2).contiguous()  # (B, K, N)
        else:
            out = torch.empty(B, N, K, dtype=dt)
            Vc = V.transpose(1, 2).contiguous().transpose(1, 2)  # (B, M, K), column-major
        rows = max(16, min(N, PLAN_CHUNK_BYTES // max(1, M * C.element_size())))
        P = torch.empty(rows, M, dtype=dt)
        fn = self.lib.flashot_cached_weights_f32 if f32 else self.lib.flashot_cached_weights_f64
        self.stats["plan_cached"] = self.stats.get("plan_cached", 0) + 1
        for b in range(B):
            for i0 in range(0, N, rows):
                i1 = min(N, i0 + rows)
                Pi = P[: i1 - i0]
                rb, cb = (h2[b, i0:i1], shift[b]) if transposed else (shift[b, i0:i1], h2[b])
                rc = abi.call(
                    fn,
                    abi.WeightsArgs(
                        ptr(C[b, i0:i1]), ptr(rb), ptr(cb), ptr(Pi), i1 - i0, M, k, wthr, wk, self._nthreads()
                    ),
                )
                if rc != 0:
                    raise RuntimeError(f"cpu engine: cached plan kernel returned {rc}")
                if transposed:
                    outT[b].addmm_(Vt[b, :, i0:i1].contiguous(), Pi)
                else:
                    torch.mm(Pi, Vc[b], out=out[b, i0:i1])
        if transposed:
            out = outT.transpose(1, 2)
        factor = torch.where(good, torch.exp(alpha + L * LN2) * wconst, torch.zeros_like(L))
        return (out * factor.unsqueeze(-1)).contiguous()
