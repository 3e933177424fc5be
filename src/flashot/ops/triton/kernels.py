"""Fused Triton kernels for the two streamed primitives: softmin (one side, or both sides of a pair step)
and the plan product, dense and block-sparse; one program per tile of ``BLOCK_N`` rows, streaming the
columns through it (the maths of a tile, the score paths and the scalar slots: :mod:`.tiles`)."""

from __future__ import annotations

import triton
import triton.language as tl

from .tiles import (
    lse_range,
    plan_range,
    plan_store,
    row_setup,
    softmin_rows,
)


@triton.jit
def softmin_kernel(
    x_ptr,
    y_ptr,
    h_ptr,
    out_ptr,
    prm_ptr,
    N,
    M,
    D,
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
    """Grid (cdiv(N, BLOCK_N), B): out[b, i] = softmin_j over y[b] of h[b, j] - C_ij / eps."""
    softmin_rows(
        x_ptr,
        y_ptr,
        h_ptr,
        out_ptr,
        prm_ptr,
        N,
        M,
        D,
        tl.program_id(0),
        tl.program_id(1),
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


@triton.jit
def softmin_pair_kernel(
    x_ptr,
    y_ptr,
    hy_ptr,
    hx_ptr,
    f_ptr,
    g_ptr,
    prm_ptr,
    N,
    M,
    D,
    TILES_X,
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
    """Both halves of a symmetric Sinkhorn step in one launch.

    Grid (cdiv(N, BLOCK_N) + cdiv(M, BLOCK_N), B): programs below ``TILES_X``
    compute f = softmin_x(hy) on rows of x, the others g = softmin_y(hx) on rows of y.
    """
    pid = tl.program_id(0)
    if pid < TILES_X:
        softmin_rows(
            x_ptr,
            y_ptr,
            hy_ptr,
            f_ptr,
            prm_ptr,
            N,
            M,
            D,
            pid,
            tl.program_id(1),
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
    else:
        softmin_rows(
            y_ptr,
            x_ptr,
            hx_ptr,
            g_ptr,
            prm_ptr,
            M,
            N,
            D,
            pid - TILES_X,
            tl.program_id(1),
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


@triton.jit
def plan_kernel(
    x_ptr,
    y_ptr,
    beta_ptr,
    alpha_ptr,
    v_ptr,
    out_ptr,
    prm_ptr,
    N,
    M,
    D,
    K,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
    D_STATIC: tl.constexpr,
    DIRECT: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    FOLD: tl.constexpr,
    COST: tl.constexpr,
    WEIGHT: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Grid (cdiv(N, BLOCK_N), cdiv(K, BLOCK_K), B): out_i = sum_j exp(alpha_i + beta_j - C_ij/eps) W_ij V_j.

    The online max rescales the (BLOCK_N, BLOCK_K) accumulator; alpha enters at the end.
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    x_ptr += b * N * D
    y_ptr += b * M * D
    beta_ptr += b * M
    alpha_ptr += b * N
    v_ptr += b * M * K
    out_ptr += b * N * K
    k2 = tl.load(prm_ptr + 0)
    s = tl.load(prm_ptr + 1)
    min_sq = tl.load(prm_ptr + 3)
    dcost = tl.load(prm_ptr + 4)
    log2e = tl.load(prm_ptr + 5)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    kc = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = kc < K
    xt, xsq = row_setup(x_ptr, rows, row_ok, D, k2, BLOCK_N, BLOCK_D, DIRECT, ONE_CHUNK)
    m_i = tl.full((BLOCK_N,), float("-inf"), dtype=k2.dtype)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=k2.dtype)
    m_i, acc = plan_range(
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
        0,
        M,
        D,
        K,
        k2,
        s,
        min_sq,
        log2e,
        m_i,
        acc,
        BLOCK_N,
        BLOCK_M,
        BLOCK_D,
        D_STATIC,
        DIRECT,
        ONE_CHUNK,
        FOLD,
        COST,
        WEIGHT,
        PREC,
        UPCAST,
    )
    plan_store(alpha_ptr, out_ptr, rows, row_ok, kc, k_ok, K, m_i, acc, xsq, k2, s, dcost, log2e, FOLD, COST, WEIGHT)


# -- block-sparse versions (the multiscale engine; B = 1) ------------------------------------------------
# A program owns one row *tile* of one row cluster (``tiles``: (first row, end row, cluster) triples, at
# most BLOCK_N rows each) and streams only that cluster's kept column ranges: ``ranges[2q], ranges[2q+1]``
# for q in [cptr[cluster], cptr[cluster + 1]), in the columns' (cluster-sorted) order.


@triton.jit
def _bs_tile(tiles_ptr, cptr_ptr, BLOCK_N: tl.constexpr):
    """(rows, row_ok, first range, end range) of this program's row tile."""
    t = tl.program_id(0).to(tl.int64) * 3
    r0 = tl.load(tiles_ptr + t)
    r1 = tl.load(tiles_ptr + t + 1)
    c = tl.load(tiles_ptr + t + 2)
    rows = r0 + tl.arange(0, BLOCK_N)
    return rows, rows < r1, tl.load(cptr_ptr + c), tl.load(cptr_ptr + c + 1)


@triton.jit
def softmin_bs_kernel(
    x_ptr,
    y_ptr,
    h_ptr,
    out_ptr,
    prm_ptr,
    tiles_ptr,
    cptr_ptr,
    ranges_ptr,
    D,
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
    """Grid (number of row tiles,): out_i = -eps log sum_{j in kept(I(i))} exp(h_j - C_ij / eps)."""
    k2 = tl.load(prm_ptr + 0)
    s = tl.load(prm_ptr + 1)
    eps_ln2 = tl.load(prm_ptr + 2)
    min_sq = tl.load(prm_ptr + 3)
    log2e = tl.load(prm_ptr + 5)
    rows, row_ok, q0, q1 = _bs_tile(tiles_ptr, cptr_ptr, BLOCK_N)
    xt, xsq = row_setup(x_ptr, rows, row_ok, D, k2, BLOCK_N, BLOCK_D, DIRECT, ONE_CHUNK)
    m_i = tl.full((BLOCK_N,), float("-inf"), dtype=k2.dtype)
    l_i = tl.zeros((BLOCK_N,), dtype=k2.dtype)
    for q in range(q0, q1):
        j_lo = tl.load(ranges_ptr + 2 * q)
        j_hi = tl.load(ranges_ptr + 2 * q + 1)
        m_i, l_i = lse_range(
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
def plan_bs_kernel(
    x_ptr,
    y_ptr,
    beta_ptr,
    alpha_ptr,
    v_ptr,
    out_ptr,
    prm_ptr,
    tiles_ptr,
    cptr_ptr,
    ranges_ptr,
    D,
    K,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
    D_STATIC: tl.constexpr,
    DIRECT: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    FOLD: tl.constexpr,
    COST: tl.constexpr,
    WEIGHT: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Grid (number of row tiles, cdiv(K, BLOCK_K)): out_i = sum_{j in kept(I(i))} exp(alpha_i + beta_j -
    C_ij / eps) W_ij V_j."""
    k2 = tl.load(prm_ptr + 0)
    s = tl.load(prm_ptr + 1)
    min_sq = tl.load(prm_ptr + 3)
    dcost = tl.load(prm_ptr + 4)
    log2e = tl.load(prm_ptr + 5)
    rows, row_ok, q0, q1 = _bs_tile(tiles_ptr, cptr_ptr, BLOCK_N)
    kc = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = kc < K
    xt, xsq = row_setup(x_ptr, rows, row_ok, D, k2, BLOCK_N, BLOCK_D, DIRECT, ONE_CHUNK)
    m_i = tl.full((BLOCK_N,), float("-inf"), dtype=k2.dtype)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=k2.dtype)
    for q in range(q0, q1):
        j_lo = tl.load(ranges_ptr + 2 * q)
        j_hi = tl.load(ranges_ptr + 2 * q + 1)
        m_i, acc = plan_range(
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
            BLOCK_N,
            BLOCK_M,
            BLOCK_D,
            D_STATIC,
            DIRECT,
            ONE_CHUNK,
            FOLD,
            COST,
            WEIGHT,
            PREC,
            UPCAST,
        )
    plan_store(alpha_ptr, out_ptr, rows, row_ok, kc, k_ok, K, m_i, acc, xsq, k2, s, dcost, log2e, FOLD, COST, WEIGHT)
