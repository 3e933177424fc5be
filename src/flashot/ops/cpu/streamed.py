"""The ``cpu`` engine's streamed path: the compiled kernels' arguments for (x, y) pairs, and their calls.

One kernel call computes dot products (register-blocked micro-kernel), the cost ``s (|x|^2 + |y|^2 -
2<x, y>)`` (explicit form, as in the ``tiled`` engine, for float32 accuracy), the bias, a polynomial
``exp2`` and the running LogSumExp, with nothing but O((N + M) D) memory.  The columns (``y``) are
passed transposed and padded to a multiple of ``PAD`` (their padding has zero weight), so the
micro-kernel never tests for a ragged edge.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ...costs import Cost
from . import abi
from .common import (
    KIND_DIRECT,
    KIND_DOT,
    L2_BYTES,
    LARGE_D_CFG,
    LN2,
    LOG2E,
    NARROW_K,
    PAD,
    PAIR_MIN_SUM,
    SMALL_D,
    W_COST,
    W_INV,
    W_ONE,
    encode_zero_weights,
    ptr,
)

__all__ = ["StreamedCalls", "cost_args", "prep_y"]


def cost_args(cost: Cost, eps: float) -> tuple[int, float, float]:
    """(kind, k, minsq): the kernels' base-2 score is ``h * log2(e) - k * c`` with ``k = log2(e) / eps``
    times the cost's scale (dot kind: c = |x - y|^2; direct: c = |x - y|)."""
    if cost.is_dot:
        return KIND_DOT, LOG2E * cost.scale / eps, 0.0
    return KIND_DIRECT, LOG2E / eps, float(cost.min_sqdist)


def prep_y(y: Tensor, h: Tensor, kind: int) -> tuple[Tensor, Tensor, Tensor, int]:
    """The columns as the kernels read them: ``(yT (B, D, Mp), |y|^2 (B, Mp), h log2(e) (B, Mp), Mp)``,
    padded to ``Mp``, a multiple of ``PAD``, with zero-weight columns."""
    B, M, D = y.shape
    Mp = -(-M // PAD) * PAD
    yT = torch.zeros(B, D, Mp, dtype=y.dtype)
    yT[:, :, :M] = y.transpose(1, 2)
    yy = torch.zeros(B, Mp, dtype=y.dtype)
    if kind == KIND_DOT:
        yy[:, :M] = (y * y).sum(-1)
    hs = torch.full((B, Mp), -math.inf, dtype=y.dtype)
    hs[:, :M] = h * LOG2E
    encode_zero_weights(hs)
    return yT, yy, hs, Mp


def _plan_weight(weight: str, kind: int, cost: Cost) -> tuple[int, float]:
    """(weight kind, constant factor) of the streamed plan kernel for ``weight`` (the kernel's c is
    ``|x - y|^2`` for the dot kind, so the cost's scale goes into the factor)."""
    wk, wconst = W_ONE, 1.0
    if weight == "cost":
        wk = W_COST
        if kind == KIND_DOT:
            wconst = cost.scale  # the kernel's c is |x - y|^2
    elif weight == "dcost":
        if kind == KIND_DOT:
            wconst = 2.0 * cost.scale
        else:
            wk = W_INV
    return wk, wconst


class StreamedCalls:
    """The streamed kernels' calls, mixed into :class:`flashot.ops.cpu.engine.CpuEngine`.

    Reads the engine's ``lib`` (the loaded kernels), ``threads``, ``cfg`` (micro-kernel choice, None:
    by d) and ``stats``.  Inputs are validated, contiguous and detached by the engine's public methods.
    """

    lib: object
    threads: int | None
    cfg: int | None
    stats: dict

    cost_args = staticmethod(cost_args)

    def _nthreads(self) -> int:
        return int(self.threads or torch.get_num_threads())

    def _kernel_cfg(self, D: int) -> int:
        if self.cfg is not None:
            return int(self.cfg)
        return 0 if D <= SMALL_D else LARGE_D_CFG

    def _stream(self, x, yT, yy, hs, Mp, kind, kcoef, minsq) -> abi.Stream:
        """The kernels' description of the streamed clouds (``flashot_stream``): x (B, N, D), y padded to Mp."""
        B, N, D = x.shape
        return abi.Stream(
            ptr(x),
            ptr(yT),
            ptr(yy),
            ptr(hs),
            N,
            Mp,
            L2_BYTES,
            kcoef,
            minsq,
            B,
            D,
            kind,
            self._kernel_cfg(D),
            self._nthreads(),
        )

    def _run_softmin(self, x, yT, yy, hs, Mp, kind, kcoef, minsq, oscale):
        B, N, _ = x.shape
        out = torch.empty(B, N, dtype=x.dtype)
        fn = self.lib.flashot_softmin_f32 if x.dtype == torch.float32 else self.lib.flashot_softmin_f64
        rc = abi.call(fn, abi.LseArgs(self._stream(x, yT, yy, hs, Mp, kind, kcoef, minsq), ptr(out), oscale))
        if rc != 0:
            raise RuntimeError(f"cpu engine: softmin kernel returned {rc}")
        return out

    def _stream_lse(self, x, y, h, eps, cost, oscale):
        kind, kcoef, minsq = cost_args(cost, eps)
        yT, yy, hs, Mp = prep_y(y, h, kind)
        return self._run_softmin(x, yT, yy, hs, Mp, kind, kcoef, minsq, oscale * LN2)

    def _pair_sums(self, x, y, hx, hy, eps, cost, sym: bool):
        self.stats["pair"] = self.stats.get("pair", 0) + 1
        return self._rowcol("flashot_pair", x, y, hx, hy, eps, cost, sym=int(sym))

    def _rowcol(self, name, x, y, hx, hy, eps, cost, lam: float = 0.0, sym: int = 0):
        """Call a kernel with row and column outputs (``flashot_pair``, ``flashot_alt``): ``hx`` on the
        rows (base 2, zero weights encoded), ``hy`` on the columns.  Returns (rows (B, N), cols (B, M))."""
        B, N, _ = x.shape
        M = y.shape[1]
        kind, kcoef, minsq = cost_args(cost, eps)
        yT, yy, hs, Mp = prep_y(y, hy, kind)
        hx2 = encode_zero_weights((hx * LOG2E).contiguous())
        rows = torch.empty(B, N, dtype=x.dtype)
        cols = torch.empty(B, Mp, dtype=x.dtype)
        fn = getattr(self.lib, name + ("_f32" if x.dtype == torch.float32 else "_f64"))
        args = abi.RowColArgs(
            self._stream(x, yT, yy, hs, Mp, kind, kcoef, minsq), ptr(hx2), ptr(rows), ptr(cols), lam, sym
        )
        rc = abi.call(fn, args)
        if rc != 0:
            raise RuntimeError(f"cpu engine: {name} kernel returned {rc}")
        return rows, cols[:, :M]

    def _from_sums(self, sums, h, eps, pts, other, h_other, cost):
        """``-eps (log sums - h)``; entries whose sum is unusable are recomputed by the streamed softmin."""
        out = -eps * (sums.log() - h)
        bad = ~(torch.isfinite(sums) & (sums >= PAIR_MIN_SUM))
        if bool(bad.any()):
            self.stats["pair_fixup"] = self.stats.get("pair_fixup", 0) + int(bad.sum())
            for b in range(out.shape[0]):
                idx = bad[b].nonzero().squeeze(1)
                if idx.numel():
                    sub = pts[b : b + 1, idx].contiguous()
                    out[b, idx] = self._stream_lse(sub, other[b : b + 1], h_other[b : b + 1], eps, cost, -eps)[0]
        return out

    def _plan_streamed(self, x, y, alpha, beta, eps, V, cost, weight) -> Tensor:
        """Streamed plan product ``out_i = sum_j exp(alpha_i + beta_j - C_ij / eps) W_ij V_j`` (B, N, K)."""
        B, M = y.shape[:2]
        K = V.shape[2]
        kind, kcoef, minsq = cost_args(cost, eps)
        yT, yy, hs, Mp = prep_y(y, beta, kind)
        wk, wconst = _plan_weight(weight, kind, cost)
        narrow = K <= NARROW_K
        if narrow:
            # narrow V (marginals, barycentric maps and gradients at d <= 3): V transposed, the
            # contraction vectorised over columns (K FMAs per vector of pairs), fused into the pass
            Kp = K
            Vb = torch.zeros(B, K, Mp, dtype=x.dtype)
            Vb[:, :, :M] = V.transpose(1, 2)
        else:
            lanes = self.lib.flashot_vector_bytes() // x.element_size()  # the kernels' vector width
            Kp = -(-K // lanes) * lanes
            Vb = torch.zeros(B, Mp, Kp, dtype=x.dtype)  # (Mp, Kp) row-major, zero padding
            Vb[:, :M, :K] = V
        args = (kind, kcoef, minsq, wk, wconst, narrow)
        # One pass: the weights are the plan entries exp(alpha_i + beta_j - C_ij / eps) themselves (no
        # LSE pass).  Rows whose plan mass is not finite or below PAIR_MIN_SUM, or whose output
        # overflowed, are redone with two passes (LSE first, weights <= 1).
        out, mass = self._plan_call(x, yT, yy, hs, None, alpha, Vb, Kp, *args)
        bad = torch.isfinite(alpha) & ~(torch.isfinite(mass) & (mass >= PAIR_MIN_SUM) & torch.isfinite(out).all(-1))
        if bool(bad.any()):
            self._plan_fixup(out, bad, x, yT, yy, hs, alpha, Vb, Kp, args)
        return out if Kp == K else out[..., :K].contiguous()

    def _plan_fixup(self, out, bad, x, yT, yy, hs, alpha, Vb, Kp, args) -> None:
        """Redo the ``bad`` rows of ``out`` in place with two passes (base-2 LSE first, weights <= 1)."""
        kind, kcoef, minsq = args[:3]
        Mp = hs.shape[1]
        self.stats["plan_fixup"] = self.stats.get("plan_fixup", 0) + int(bad.sum())
        for bb in range(x.shape[0]):
            idx = bad[bb].nonzero().squeeze(1)
            if idx.numel():
                sub = x[bb : bb + 1, idx].contiguous()
                yTb, yyb, hsb, Vbb = yT[bb : bb + 1], yy[bb : bb + 1], hs[bb : bb + 1], Vb[bb : bb + 1]
                lse = self._run_softmin(sub, yTb, yyb, hsb, Mp, kind, kcoef, minsq, 1.0)  # base 2
                o2, _ = self._plan_call(sub, yTb, yyb, hsb, lse, alpha[bb : bb + 1, idx].contiguous(), Vbb, Kp, *args)
                out[bb, idx] = o2[0]

    def _plan_call(self, x, yT, yy, hs, lse, alpha, Vb, Kp, kind, kcoef, minsq, wk, wconst, narrow):
        """One plan kernel call: two-pass mode when ``lse`` (base 2) is given, one-pass otherwise."""
        B, N, _ = x.shape
        Mp = hs.shape[1]
        out = torch.empty(B, N, Kp, dtype=x.dtype)
        mass = torch.empty(B, N, dtype=x.dtype)
        fn = self.lib.flashot_plan_f32 if x.dtype == torch.float32 else self.lib.flashot_plan_f64
        args = abi.PlanArgs(
            self._stream(x, yT, yy, hs, Mp, kind, kcoef, minsq),
            ptr(alpha if lse is None else lse),
            ptr(alpha),
            ptr(Vb),
            ptr(out),
            ptr(mass),
            wconst,
            Kp,
            int(lse is None),
            wk,
            int(narrow),
        )
        rc = abi.call(fn, args)
        if rc != 0:
            raise RuntimeError(f"cpu engine: plan kernel returned {rc}")
        return out, mass
