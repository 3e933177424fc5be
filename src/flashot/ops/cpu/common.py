"""The compiled kernels' calling conventions, shared by the ``cpu`` engine's streamed and cached paths.

The kernels work in base 2: they take ``h log2(e)`` and ``scale log2(e) / eps`` and return base-2
LogSumExps, which the callers scale by ``ln 2``.  Zero weights (``h = -inf``) are encoded as a finite
log-weight for float32, so the kernels' ``exp2`` needs no ``-inf`` test.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "KIND_DOT",
    "KIND_DIRECT",
    "W_ONE",
    "W_COST",
    "W_INV",
    "LOG2E",
    "LN2",
    "ZERO_W_F32",
    "PAIR_MIN_SUM",
    "NARROW_K",
    "PAD",
    "PLAN_CHUNK_BYTES",
    "SMALL_D",
    "LARGE_D_CFG",
    "L2_BYTES",
    "ptr",
    "encode_zero_weights",
]

KIND_DOT, KIND_DIRECT = 0, 1
W_ONE, W_COST, W_INV = 0, 1, 2
LOG2E = 1.4426950408889634  # the kernels work in base 2: they take h * log2(e), scale * log2(e) / eps
LN2 = 0.6931471805599453
# float32 kernels take zero weights as this finite log-weight (their exp2 needs no -inf test)
ZERO_W_F32 = -1e38
# softmin_pair: a row / column sum below this (or not finite) is recomputed by the plain softmin.
# Terms flushed to zero (< 2^-126 each, < 2^-99 in all for up to 2^27 of them) are then below
# 2^-24 of the sum, i.e. below float32 resolution.
PAIR_MIN_SUM = 2.0**-75
NARROW_K = 4  # plan products with V of at most this many columns take the vectorised-over-j kernel
PAD = 64  # columns are padded to a multiple of this (>= 16 * max vectors per micro-kernel)
PLAN_CHUNK_BYTES = 4 << 20  # cached plan products: rows of weights per GEMM (fits the L2 + L3)
# micro-kernel configuration for D above SMALL_D: 4 rows x 64 columns (see CPU_ENGINE.md).
SMALL_D = 32
LARGE_D_CFG = 3
L2_BYTES = 512 * 1024


def ptr(t: Tensor) -> int:
    """The address the kernels read ``t`` from (``t`` must be contiguous and stay alive for the call)."""
    return t.data_ptr()


def encode_zero_weights(h: Tensor) -> Tensor:
    """In place for float32: -inf log-weights -> ZERO_W_F32 (exp2 of it is exactly 0)."""
    if h.dtype == torch.float32:
        h.clamp_(min=ZERO_W_F32)
    return h
