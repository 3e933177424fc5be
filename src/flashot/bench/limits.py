"""Hardware-limit microbenchmarks, measured in the same run as the solvers.

* ``exp_rate``:  float exponentials per second (``torch.exp`` into a preallocated
  buffer of 2**21 elements, all threads torch uses).
* ``gemm_rate``: flop/s of a square ``torch.mm`` (1536 x 1536 x 1536).

One Sinkhorn iteration (two softmins over n x m pairs) needs at least
``2 n m`` exponentials and, with the GEMM expansion of |x - y|^2, ``4 n m d``
flops, so its time is bounded below by
``limit = max(2 n m / exp_rate, 4 n m d / gemm_rate)``.  Reported as
``limit / measured`` (the fraction of the measured hardware limit reached).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass


@dataclass
class Limits:
    dtype: str
    exp_rate: float  # exponentials / s
    gemm_rate: float  # flop / s
    threads: int

    def per_iter(self, n: int, m: int, d: int) -> float:
        return max(2.0 * n * m / self.exp_rate, 4.0 * n * m * d / self.gemm_rate)


def _best_rate(fn, work: float, reps: int, rounds: int = 3) -> float:
    fn()  # warm
    rates = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        rates.append(work * reps / (time.perf_counter() - t0))
    return statistics.median(rates)


def measure(dtype: str = "float32") -> Limits:
    import torch

    dt = getattr(torch, dtype)
    n = 2**21
    src = torch.rand(n, dtype=dt) * -20.0  # arguments in [-20, 0]: the range a stabilised LSE feeds exp
    dst = torch.empty_like(src)
    exp_rate = _best_rate(lambda: torch.exp(src, out=dst), n, reps=10)
    k = 1536
    A = torch.rand(k, k, dtype=dt)
    B = torch.rand(k, k, dtype=dt)
    C = torch.empty(k, k, dtype=dt)
    gemm_rate = _best_rate(lambda: torch.mm(A, B, out=C), 2.0 * k**3, reps=3)
    return Limits(dtype, exp_rate, gemm_rate, torch.get_num_threads())
