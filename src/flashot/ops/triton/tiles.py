"""The tile-level pieces of the fused Triton kernels (:mod:`.kernels`), FlashAttention style.

One program owns a tile of ``BLOCK_N`` rows of ``x`` and streams tiles of
``BLOCK_M`` points of ``y`` through it, keeping an online max / sum in base 2::

    t_ij = log2(e) * (beta_j - C_ij / eps)          (scores, log2 units)
    softmin_i = -eps * ln2 * (m_i + log2 sum_j exp2(t_ij - m_i))
    plan_i    = exp2(log2(e) alpha_i + m_i) * sum_j exp2(t_ij - m_i) W_ij V_j

All scalars (``log2(e)``, ``log2(e)/eps``, the cost scale, ...) come from a
small tensor in the accumulation dtype (float32, or float64 for float64 inputs)
so float64 runs never round them to float32.  Squared norms and biases are
computed in-kernel from the tiles already loaded (``|x_i|^2`` once per row tile,
``|y_j|^2`` per streamed tile, ~1/BLOCK_N extra work), so a launch needs no
preparatory torch kernels.  Column tiles past ``M`` get bias ``-inf``; a row
whose scores are all ``-inf`` keeps ``m = -inf`` and is guarded so that no
``-inf - -inf`` (NaN) is ever formed.

Score paths (constexpr):
* ``DIRECT``: ``|x_i - y_j|^2`` from coordinate differences (exact at x = y;
  ``2 d`` flops per pair).  Used for tiny ``d`` and for the euclidean costs.
* dot path: ``|x_i|^2 + |y_j|^2 - 2 <x_i, y_j>`` with ``<x_i, y_j>`` from
  ``tl.dot`` on ``(BLOCK_N, BLOCK_D) x (BLOCK_D, BLOCK_M)`` tiles; the x tile
  stays on chip when ``d <= BLOCK_D`` (``ONE_CHUNK``), else the feature axis is
  looped over in chunks of ``BLOCK_D``.
* ``FOLD`` (dot costs only): the FlashSinkhorn form
  ``t_ij = (2 s log2(e) / eps) <x_i, y_j> + v_j`` with one bias vector per side
  (``v_j = log2(e) (beta_j - s |y_j|^2 / eps)``; the row term is added back after
  the reduction).  One FMA per score instead of four ops, less accurate in float32.
* ``UPCAST``: half-precision tiles are converted to float32 before ``tl.dot``.
  Only used for bfloat16 under ``TRITON_INTERPRET=1``, whose bfloat16 ``tl.dot``
  returns garbage (Triton 3.9); compiled kernels feed bf16 to the tensor cores.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Slots of the per-launch scalar tensor (accumulation dtype).
P_K2, P_SCALE, P_EPS_LN2, P_MIN_SQ, P_DCOST, P_LOG2E = 0, 1, 2, 3, 4, 5
N_PARAMS = 6

# Cost codes (constexpr).
COST_DOT, COST_EUCLID = 0, 1
# Weight codes (constexpr): W_ij = 1, C_ij, w(C_ij) with grad_x C = w (x - y).
W_PLAN, W_COST, W_DCOST = 0, 1, 2


@triton.jit
def load_x_tile(x_ptr, rows, row_ok, D, BLOCK_D: tl.constexpr):
    kk = tl.arange(0, BLOCK_D)
    return tl.load(x_ptr + rows[:, None] * D + kk[None, :], mask=row_ok[:, None] & (kk[None, :] < D), other=0.0)


@triton.jit
def row_sqnorm(
    x_ptr, xt, rows, row_ok, D, acc_ref, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ONE_CHUNK: tl.constexpr
):
    """|x_i|^2 for the row tile, in the accumulation dtype of ``acc_ref``."""
    if ONE_CHUNK:
        xf = xt.to(acc_ref.dtype)
        xsq = tl.sum(xf * xf, axis=1)
    else:
        kk = tl.arange(0, BLOCK_D)
        xsq = tl.zeros((BLOCK_N,), dtype=acc_ref.dtype)
        for k0 in range(0, D, BLOCK_D):
            k = k0 + kk
            xf = tl.load(x_ptr + rows[:, None] * D + k[None, :], mask=row_ok[:, None] & (k[None, :] < D), other=0.0).to(
                acc_ref.dtype
            )
            xsq += tl.sum(xf * xf, axis=1)
    return xsq


@triton.jit
def dot_tile(
    x_ptr,
    y_ptr,
    xt,
    rows,
    cols,
    row_ok,
    col_ok,
    D,
    acc_ref,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """(<x_i, y_j> tile via tl.dot, |y_j|^2 of the column tile), in the accumulation dtype."""
    kk = tl.arange(0, BLOCK_D)
    if ONE_CHUNK:
        yt = tl.load(y_ptr + cols[None, :] * D + kk[:, None], mask=col_ok[None, :] & (kk[:, None] < D), other=0.0)
        yf = yt.to(acc_ref.dtype)
        ysq = tl.sum(yf * yf, axis=0)
        if UPCAST:
            xt = xt.to(tl.float32)
            yt = yt.to(tl.float32)
        dot = tl.dot(xt, yt, input_precision=PREC).to(acc_ref.dtype)
    else:
        dot = tl.zeros((BLOCK_N, BLOCK_M), dtype=acc_ref.dtype)
        ysq = tl.zeros((BLOCK_M,), dtype=acc_ref.dtype)
        for k0 in range(0, D, BLOCK_D):
            k = k0 + kk
            xc = tl.load(x_ptr + rows[:, None] * D + k[None, :], mask=row_ok[:, None] & (k[None, :] < D), other=0.0)
            yc = tl.load(y_ptr + cols[None, :] * D + k[:, None], mask=col_ok[None, :] & (k[:, None] < D), other=0.0)
            yf = yc.to(acc_ref.dtype)
            ysq += tl.sum(yf * yf, axis=0)
            if UPCAST:
                xc = xc.to(tl.float32)
                yc = yc.to(tl.float32)
            dot += tl.dot(xc, yc, input_precision=PREC).to(acc_ref.dtype)
    return dot, ysq


@triton.jit
def tile_scores(
    x_ptr,
    y_ptr,
    xt,
    xsq,
    hb,
    rows,
    cols,
    row_ok,
    col_ok,
    D,
    k2,
    s,
    min_sq,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    D_STATIC: tl.constexpr,
    DIRECT: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    FOLD: tl.constexpr,
    COST: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """(t, C): scores t_ij = hb_j - k2 C_ij (log2 units; hb = log2(e) h) and the cost tile C_ij.

    With ``FOLD`` the returned ``C`` is a dummy and ``t`` lacks the row term
    ``-k2 s |x_i|^2`` (added back by the caller).
    """
    if FOLD:
        dot, ysq = dot_tile(
            x_ptr, y_ptr, xt, rows, cols, row_ok, col_ok, D, k2, BLOCK_N, BLOCK_M, BLOCK_D, ONE_CHUNK, PREC, UPCAST
        )
        sk2 = s * k2
        t = dot * (2.0 * sk2) + (hb - sk2 * ysq)[None, :]
        c = t
    else:
        if DIRECT:
            d2 = tl.zeros((BLOCK_N, BLOCK_M), dtype=k2.dtype)
            if D_STATIC > 0:
                for k in tl.static_range(D_STATIC):
                    xk = tl.load(x_ptr + rows * D + k, mask=row_ok, other=0.0).to(k2.dtype)
                    yk = tl.load(y_ptr + cols * D + k, mask=col_ok, other=0.0).to(k2.dtype)
                    diff = xk[:, None] - yk[None, :]
                    d2 += diff * diff
            else:
                for k in range(D):
                    xk = tl.load(x_ptr + rows * D + k, mask=row_ok, other=0.0).to(k2.dtype)
                    yk = tl.load(y_ptr + cols * D + k, mask=col_ok, other=0.0).to(k2.dtype)
                    diff = xk[:, None] - yk[None, :]
                    d2 += diff * diff
        else:
            dot, ysq = dot_tile(
                x_ptr, y_ptr, xt, rows, cols, row_ok, col_ok, D, k2, BLOCK_N, BLOCK_M, BLOCK_D, ONE_CHUNK, PREC, UPCAST
            )
            d2 = tl.maximum(xsq[:, None] + ysq[None, :] - 2.0 * dot, 0.0)
        if COST == 0:
            c = d2 * s  # dead code (removed by the compiler) unless W_ij = C_ij
            t = hb[None, :] - d2 * (s * k2)
        else:
            c = tl.sqrt(tl.maximum(d2, min_sq))
            t = hb[None, :] - c * k2
    return t, c


@triton.jit
def row_setup(
    x_ptr,
    rows,
    row_ok,
    D,
    k2,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DIRECT: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
):
    """(x tile kept on chip or a dummy, |x_i|^2 or zeros) for one row tile."""
    if ONE_CHUNK:
        xt = load_x_tile(x_ptr, rows, row_ok, D, BLOCK_D)
    else:
        xt = tl.zeros((BLOCK_N,), dtype=k2.dtype)
    if DIRECT:
        xsq = tl.zeros((BLOCK_N,), dtype=k2.dtype)
    else:
        xsq = row_sqnorm(x_ptr, xt, rows, row_ok, D, k2, BLOCK_N, BLOCK_D, ONE_CHUNK)
    return xt, xsq


@triton.jit
def tile_probs(
    x_ptr,
    y_ptr,
    h_ptr,
    xt,
    xsq,
    rows,
    row_ok,
    j0,
    j_hi,
    D,
    k2,
    s,
    min_sq,
    log2e,
    m_i,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    D_STATIC: tl.constexpr,
    DIRECT: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    FOLD: tl.constexpr,
    COST: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One streamed column tile [j0, min(j0 + BLOCK_M, j_hi)): (cols, col_ok, p_ij = exp2(t_ij - m_new_i),
    cost tile, new running max, factor exp2(m_i - m_new_i) that rescales the sums so far)."""
    cols = j0 + tl.arange(0, BLOCK_M)
    col_ok = cols < j_hi
    hb = tl.load(h_ptr + cols, mask=col_ok, other=float("-inf")) * log2e
    t, c = tile_scores(
        x_ptr,
        y_ptr,
        xt,
        xsq,
        hb,
        rows,
        cols,
        row_ok,
        col_ok,
        D,
        k2,
        s,
        min_sq,
        BLOCK_N,
        BLOCK_M,
        BLOCK_D,
        D_STATIC,
        DIRECT,
        ONE_CHUNK,
        FOLD,
        COST,
        PREC,
        UPCAST,
    )
    m_new = tl.maximum(m_i, tl.max(t, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    return cols, col_ok, tl.exp2(t - m_safe[:, None]), c, m_new, tl.exp2(m_i - m_safe)


@triton.jit
def lse_range(
    x_ptr,
    y_ptr,
    h_ptr,
    xt,
    xsq,
    rows,
    row_ok,
    j_lo,
    j_hi,
    D,
    k2,
    s,
    min_sq,
    log2e,
    m_i,
    l_i,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    D_STATIC: tl.constexpr,
    DIRECT: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    FOLD: tl.constexpr,
    COST: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """The online (max m_i, sum l_i) of the row tile's scores, updated over the columns [j_lo, j_hi)."""
    for j0 in range(j_lo, j_hi, BLOCK_M):
        cols, col_ok, p, c, m_i, rescale = tile_probs(
            x_ptr,
            y_ptr,
            h_ptr,
            xt,
            xsq,
            rows,
            row_ok,
            j0,
            j_hi,
            D,
            k2,
            s,
            min_sq,
            log2e,
            m_i,
            BLOCK_N,
            BLOCK_M,
            BLOCK_D,
            D_STATIC,
            DIRECT,
            ONE_CHUNK,
            FOLD,
            COST,
            PREC,
            UPCAST,
        )
        l_i = l_i * rescale + tl.sum(p, axis=1)
    return m_i, l_i


@triton.jit
def softmin_rows(
    x_ptr,
    y_ptr,
    h_ptr,
    out_ptr,
    prm_ptr,
    N,
    M,
    D,
    pid_n,
    pid_b,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    D_STATIC: tl.constexpr,
    DIRECT: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    FOLD: tl.constexpr,
    COST: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """out_i = -eps ln2 (m_i + log2 sum_j exp2(t_ij - m_i)) for one tile of rows."""
    b = pid_b.to(tl.int64)
    x_ptr += b * N * D
    y_ptr += b * M * D
    h_ptr += b * M
    out_ptr += b * N
    k2 = tl.load(prm_ptr + 0)
    s = tl.load(prm_ptr + 1)
    eps_ln2 = tl.load(prm_ptr + 2)
    min_sq = tl.load(prm_ptr + 3)
    log2e = tl.load(prm_ptr + 5)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    xt, xsq = row_setup(x_ptr, rows, row_ok, D, k2, BLOCK_N, BLOCK_D, DIRECT, ONE_CHUNK)
    m_i = tl.full((BLOCK_N,), float("-inf"), dtype=k2.dtype)
    l_i = tl.zeros((BLOCK_N,), dtype=k2.dtype)
    m_i, l_i = lse_range(
        x_ptr,
        y_ptr,
        h_ptr,
        xt,
        xsq,
        rows,
        row_ok,
        0,
        M,
        D,
        k2,
        s,
        min_sq,
        log2e,
        m_i,
        l_i,
        BLOCK_N,
        BLOCK_M,
        BLOCK_D,
        D_STATIC,
        DIRECT,
        ONE_CHUNK,
        FOLD,
        COST,
        PREC,
        UPCAST,
    )
    out = -eps_ln2 * (m_i + tl.log2(l_i))
    if FOLD:
        out += s * xsq
    tl.store(out_ptr + rows, out, mask=row_ok)


@triton.jit
def plan_range(
    x_ptr,
    y_ptr,
    beta_ptr,
    v_ptr,
    xt,
    xsq,
    rows,
    row_ok,
    kc,
    k_ok,
    j_lo,
    j_hi,
    D,
    K,
    k2,
    s,
    min_sq,
    log2e,
    m_i,
    acc,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    D_STATIC: tl.constexpr,
    DIRECT: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    FOLD: tl.constexpr,
    COST: tl.constexpr,
    WEIGHT: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """The online max m_i and the rescaled (BLOCK_N, BLOCK_K) sums of exp2(t_ij - m_i) W_ij V_j, updated
    over the columns [j_lo, j_hi)."""
    for j0 in range(j_lo, j_hi, BLOCK_M):
        cols, col_ok, p, c, m_i, rescale = tile_probs(
            x_ptr,
            y_ptr,
            beta_ptr,
            xt,
            xsq,
            rows,
            row_ok,
            j0,
            j_hi,
            D,
            k2,
            s,
            min_sq,
            log2e,
            m_i,
            BLOCK_N,
            BLOCK_M,
            BLOCK_D,
            D_STATIC,
            DIRECT,
            ONE_CHUNK,
            FOLD,
            COST,
            PREC,
            UPCAST,
        )
        if WEIGHT == 1:
            p = p * c
        if WEIGHT == 2:
            if COST == 1:
                p = tl.where(c > 0.0, p / tl.where(c > 0.0, c, 1.0), 0.0)
        v = tl.load(v_ptr + cols[:, None] * K + kc[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC).to(acc.dtype)
    return m_i, acc


@triton.jit
def plan_store(
    alpha_ptr,
    out_ptr,
    rows,
    row_ok,
    kc,
    k_ok,
    K,
    m_i,
    acc,
    xsq,
    k2,
    s,
    dcost,
    log2e,
    FOLD: tl.constexpr,
    COST: tl.constexpr,
    WEIGHT: tl.constexpr,
):
    """out_i = exp2(m_i + log2(e) alpha_i) acc_i (the row terms the streaming left out), stored."""
    alpha = tl.load(alpha_ptr + rows, mask=row_ok, other=float("-inf"))
    row = m_i + alpha * log2e
    if FOLD:
        row -= s * k2 * xsq
    out = acc * tl.exp2(row)[:, None]
    if WEIGHT == 2:
        if COST == 0:
            out = out * dcost
    tl.store(out_ptr + rows[:, None] * K + kc[None, :], out, mask=row_ok[:, None] & k_ok[None, :])
