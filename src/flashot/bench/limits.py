"""Hardware-limit microbenchmarks, measured in the same run as the solvers.

* ``exp_rate_torch``: float exponentials per second of ``torch.exp`` into a
  preallocated buffer of 2**21 elements (all threads torch uses).
* ``exp_rate_flashot``: the same for flashot's own compiled vector exponential
  (``flashot_vexp_f32`` / ``_f64`` of the ``cpu`` engine's library: ``dst = 2**src``,
  base 2, which costs what ``exp`` costs), on an L3-resident buffer of 2**20
  elements called repeatedly, ``torch.get_num_threads()`` threads.  ``None`` when
  the ``cpu`` engine's kernels cannot be built here (``build_error`` says why).
* ``exp_rate``: the faster of the two, i.e. the best exp throughput this machine
  demonstrably reaches.  (``torch.exp`` alone is several times slower than a
  fused kernel's vector exp, so a limit based on it could be "exceeded".)
* ``gemm_rate``: flop/s of a square ``torch.mm`` (1536 x 1536 x 1536).

Arguments of both exp measurements are uniform in [-20, 0], the range a
stabilised LogSumExp feeds its exponential.

One Sinkhorn iteration (two softmins over n x m pairs) needs at least
``2 n m`` exponentials and, with the GEMM expansion of |x - y|^2, ``4 n m d``
flops, so its time is bounded below by
``limit = max(2 n m / exp_rate, 4 n m d / gemm_rate)``.  Reported as
``limit / measured`` (the fraction of the measured hardware limit reached).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

VEXP_N = 2**20  # elements of the flashot vector-exp buffer: 4 MiB (float32), L3-resident; smaller buffers
# measure the per-call OpenMP fork/join more than the exponentials (2**16: ~10 G/s, 2**20: ~20 G/s here)


@dataclass
class Limits:
    dtype: str
    exp_rate_torch: float  # torch.exp, exponentials / s
    gemm_rate: float  # flop / s
    threads: int
    exp_rate_flashot: float | None = None  # flashot's compiled vector exp, exponentials / s (None: not built)
    build_error: str | None = None  # why exp_rate_flashot is None

    @property
    def exp_rate(self) -> float:
        """The faster exp measured: what the limit uses."""
        return max(r for r in (self.exp_rate_torch, self.exp_rate_flashot) if r is not None)

    @property
    def exp_source(self) -> str:
        """Which measurement ``exp_rate`` comes from."""
        fl = self.exp_rate_flashot
        return "flashot vexp" if fl is not None and fl > self.exp_rate_torch else "torch.exp"

    def per_iter(self, n: int, m: int, d: int) -> float:
        return max(2.0 * n * m / self.exp_rate, 4.0 * n * m * d / self.gemm_rate)


def _best_rate(fn, work: float, reps: int, rounds: int = 5) -> float:
    """The best rate over ``rounds`` rounds: a limit is what the machine demonstrably does, and
    interference from other processes can only lower a round's rate."""
    fn()  # warm
    rates = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        rates.append(work * reps / (time.perf_counter() - t0))
    return max(rates)


def flashot_exp_rate(dtype: str = "float32", threads: int | None = None) -> float:
    """Exponentials / s of flashot's compiled vector exp (raises ``BuildError`` if it cannot be built)."""
    import torch

    from ..ops.cpu.build import load

    lib = load()
    fn = lib.flashot_vexp_f32 if dtype == "float32" else lib.flashot_vexp_f64
    nth = torch.get_num_threads() if threads is None else threads
    src = torch.rand(VEXP_N, dtype=getattr(torch, dtype)) * -20.0
    dst = torch.empty_like(src)
    ps, pd = src.data_ptr(), dst.data_ptr()
    return _best_rate(lambda: fn(ps, pd, VEXP_N, nth), VEXP_N, reps=40)


def measure(dtype: str = "float32") -> Limits:
    import torch

    from ..ops.cpu.build import BuildError

    dt = getattr(torch, dtype)
    n = 2**21
    src = torch.rand(n, dtype=dt) * -20.0  # arguments in [-20, 0]: the range a stabilised LSE feeds exp
    dst = torch.empty_like(src)
    exp_rate = _best_rate(lambda: torch.exp(src, out=dst), n, reps=10)
    try:
        exp_flashot, err = flashot_exp_rate(dtype), None
    except BuildError as e:
        exp_flashot, err = None, str(e).splitlines()[0][:200] if str(e) else type(e).__name__
    k = 1536
    A = torch.rand(k, k, dtype=dt)
    B = torch.rand(k, k, dtype=dt)
    C = torch.empty(k, k, dtype=dt)
    gemm_rate = _best_rate(lambda: torch.mm(A, B, out=C), 2.0 * k**3, reps=3)
    return Limits(dtype, exp_rate, gemm_rate, torch.get_num_threads(), exp_flashot, err)
