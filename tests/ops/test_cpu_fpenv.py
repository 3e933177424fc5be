"""The ``cpu`` engine's floating-point environment: flush-to-zero / denormals-are-zero.

Intel cores take a microcode assist for every denormal result; the kernels' exponentials
underflow by design, so they run with FTZ/DAZ set in every thread (``fpenv.h``).  These tests
check, without timing, that (1) every OpenMP worker that runs a kernel has FTZ and DAZ set
while it runs, (2) the caller's and the workers' bits are the same afterwards as before, and
(3) results agree with float64 references where the flushed terms are below float32
resolution (tolerance: the engine's float32 softmin tolerance, 2e-6 (max C + eps)).
"""

from __future__ import annotations

import ctypes
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from flashot.costs import get_cost
from flashot.ops.dense import DenseEngine

FTZ, DAZ, SEEN = 1, 2, 4
DENSE = DenseEngine()


def _probe(lib) -> list[int]:
    buf = (ctypes.c_int * 256)()
    seen = lib.flashot_fp_probe_read(buf, 256)
    bits = [b for b in buf if b & SEEN]
    assert len(bits) == seen
    return bits


def _workers(lib, nth: int) -> list[int]:
    buf = (ctypes.c_int * nth)()
    team = lib.flashot_fp_bits_workers(buf, nth)
    return list(buf)[:team]


@pytest.mark.parametrize("caller_flush", [False, True])
@pytest.mark.parametrize("call", ["softmin", "plan", "pair", "alt", "cached"])
def test_every_worker_flushes_and_state_is_restored(lib, caller_flush, call):
    from flashot.ops.cpu.engine import CpuEngine

    nth = 2
    eng = CpuEngine(lib, mode="cache" if call == "cached" else "stream", threads=nth)
    c = get_cost("sqeuclidean")
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(1, 300, 24, generator=g), torch.randn(1, 260, 24, generator=g)
    hx, hy = torch.zeros(1, 300), torch.zeros(1, 260)
    prev = torch.set_flush_denormal(caller_flush)
    try:
        assert prev or not caller_flush  # the CPU supports it (x86 SSE3+ / AArch64)
        before = lib.flashot_fp_bits()
        workers_before = _workers(lib, nth)
        assert before == (FTZ | DAZ if caller_flush else 0)
        lib.flashot_fp_probe(1)
        try:
            if call in ("softmin", "cached"):
                eng.softmin(x, y, hy, 0.5, c)
            elif call == "plan":
                eng.plan_product(x, y, hx, hy, 0.5, torch.randn(1, 260, 3), c)
            elif call == "pair":
                eng.softmin_pair(x, y, hx, hy, 0.5, c)
            else:
                eng.softmin_alt(x, y, hx, hy, 0.5, c)
        finally:
            lib.flashot_fp_probe(0)
        seen = _probe(lib)
        assert len(seen) == nth, seen
        assert all(b & (FTZ | DAZ) == FTZ | DAZ for b in seen), seen
        assert lib.flashot_fp_bits() == before
        assert _workers(lib, nth) == workers_before
    finally:
        torch.set_flush_denormal(False)


def test_worker_threads_are_not_left_flushing(lib):
    """A kernel must not leave FTZ/DAZ on in the OpenMP workers (other OpenMP code in the process,
    e.g. PyTorch's own kernels on the same libgomp pool, would silently flush)."""
    from flashot.ops.cpu.engine import CpuEngine

    torch.set_flush_denormal(False)
    eng = CpuEngine(lib, mode="stream", threads=2)
    x = torch.randn(1, 500, 3)
    eng.softmin(x, x, torch.zeros(1, 500), 0.1, get_cost("sqeuclidean"))
    assert all(b == 0 for b in _workers(lib, 2))
    # and torch's own denormal arithmetic still produces denormals afterwards
    tiny = torch.tensor([1e-38], dtype=torch.float32) * torch.tensor([1e-3], dtype=torch.float32)
    assert 0 < float(tiny) < 1.2e-38


@pytest.mark.parametrize("D", [1, 3, 24, 64])
def test_flushed_terms_below_float32_resolution(lib, D):
    """Every column but a few sits 90-104 nats (130-150 in base 2) below the leading one: in
    float32 its term would be a denormal, flushed to zero.  float32 results must agree with a
    float64 dense softmin (where those terms are kept) to float32 accuracy."""
    from flashot.ops.cpu.engine import CpuEngine

    c = get_cost("sqeuclidean")
    g = torch.Generator().manual_seed(D)
    x = 0.3 * torch.randn(2, 70, D, generator=g, dtype=torch.float64)
    y = 0.3 * torch.randn(2, 90, D, generator=g, dtype=torch.float64)
    eps = 0.5 * D
    h = -90.0 - 14.0 * torch.rand(2, 90, generator=g, dtype=torch.float64)
    h[:, ::17] = 0.0  # the leading columns
    for mode in ("stream", "cache"):
        eng = CpuEngine(lib, mode=mode)
        out = eng.softmin(x.float(), y.float(), h.float(), eps, c)
        ref = DENSE.softmin(x.float().double(), y.float().double(), h.float().double(), eps, c)
        cmax = c.matrix(x.float().double(), y.float().double()).max()
        assert torch.isfinite(out).all()
        assert (out.double() - ref).abs().max() <= 2e-6 * (cmax + eps), (mode, (out.double() - ref).abs().max())


def test_plan_product_with_underflowing_entries(lib):
    """Plan entries far below the row's largest (float32 denormals, flushed) leave P @ V equal to
    the float64 plan product up to float32 rounding of the leading entries."""
    from flashot.ops.cpu.engine import CpuEngine

    c = get_cost("sqeuclidean")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 50, 3, generator=g, dtype=torch.float64)
    y = torch.randn(1, 64, 3, generator=g, dtype=torch.float64)
    eps = 0.05  # C / eps up to ~500: most entries underflow float32
    f = DENSE.softmin(x, y, torch.zeros(1, 64, dtype=torch.float64), eps, c)
    alpha = (-f / eps).float()  # normalised rows: the row mass is 1
    beta = torch.zeros(1, 64)
    V = torch.randn(1, 64, 5, generator=g)
    for mode in ("stream", "cache"):
        out = CpuEngine(lib, mode=mode).plan_product(x.float(), y.float(), alpha, beta, eps, V, c)
        ref = DENSE.plan_product(
            x.float().double(), y.float().double(), alpha.double(), beta.double(), eps, V.double(), c
        )
        assert torch.isfinite(out).all()
        assert (out.double() - ref).abs().max() <= 1e-4 * ref.abs().max(), mode
    assert not math.isnan(float(out.sum()))


def test_workers_created_by_a_kernel_do_not_inherit_flushing():
    """Threads the OpenMP runtime creates when a region starts copy the creating thread's control
    register: in a fresh process whose first parallel region is a kernel's, the new workers must
    still be clean afterwards (a scope around the region, not inside it, would leave them
    flushing for the rest of the process)."""
    code = textwrap.dedent("""
        import ctypes, torch
        from flashot.ops.cpu import build
        from flashot.ops.cpu.engine import CpuEngine
        from flashot.costs import get_cost
        lib = build.load(quiet=True)
        x = torch.randn(1, 400, 3)
        CpuEngine(lib, mode="stream", threads=3).softmin(x, x, torch.zeros(1, 400), 0.1, get_cost("sqeuclidean"))
        buf = (ctypes.c_int * 3)()
        team = lib.flashot_fp_bits_workers(buf, 3)
        print("BITS", lib.flashot_fp_bits(), list(buf)[:team])
    """)
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("BITS")][-1]
    assert line == "BITS 0 [0, 0, 0]" or line == "BITS 0 [0]", line
