"""The numeric option types the commands share: argparse ``type=`` functions that refuse, with a message
naming the bound, a value the solvers would refuse or mis-handle later (after the files were read)."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable

# Bounds of the numeric options.  Floats must be normal float64 numbers (a subnormal reg, tol or
# rho has lost its precision, and the solvers refuse or mis-handle it); integers are capped where a
# larger value can only overflow something (a Python index, a torch seed) or would never finish.
FLOAT_MIN = sys.float_info.min  # 2.2e-308, the smallest normal float64
MAX_ITER = 2**31 - 1  # iteration counts fit a signed 32-bit integer
MAX_COUNT = 2**62  # --max-points, --max-bytes, --topk: beyond any memory, and f.read(n + 1) still fits a C ssize_t
SEEDS = (-(2**63), 2**64 - 1)  # torch.Generator.manual_seed's range
DEMO_MAX_N = 10_000_000  # the default --max-points of flashot solve


def int_type(lo: int = 1, hi: int = MAX_COUNT) -> Callable[[str], int]:
    """An argparse type: an integer in [lo, hi] (lo = 1: "a positive integer")."""

    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {s[:40]!r}") from None
        if lo != 1 and not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"expected an integer from {lo:,} to {hi:,}, got {s[:40]}")
        if v < 1:
            raise argparse.ArgumentTypeError(f"expected a positive integer, got {s[:40]}")
        if v > hi:
            raise argparse.ArgumentTypeError(f"expected at most {hi:,}, got {s[:40]}")
        return v

    return parse


positive_int = int_type()


def positive_float(s: str) -> float:
    """An argparse type: a positive finite normal float64."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {s[:40]!r}") from None
    if not FLOAT_MIN <= v < float("inf"):
        raise argparse.ArgumentTypeError(
            f"expected a positive finite number of at least {FLOAT_MIN:.2g} (the smallest normal float64), got {s[:40]}"
        )
    return v


def blur(s: str) -> float:
    """GeomLoss' blur: eps = blur^2 must be a positive normal float64 (1.5e-154 <= blur <= 1.3e154)."""
    v = positive_float(s)
    if FLOAT_MIN <= v * v < float("inf"):
        return v
    from decimal import Decimal

    sq = f"{Decimal(s.strip()) ** 2:.3g}"
    lo, hi = math.sqrt(FLOAT_MIN), math.sqrt(sys.float_info.max)
    how = (
        f"overflows float64 (largest {sys.float_info.max:.2g})"
        if v > 1
        else f"underflows the smallest normal float64 ({FLOAT_MIN:.2g})"
    )
    raise argparse.ArgumentTypeError(
        f"blur^2 = {sq} {how}: expected {lo:.2g} <= blur <= {hi:.2g} (rescale the points and the blur together)"
    )
