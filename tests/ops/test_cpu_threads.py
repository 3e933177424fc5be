"""The ``cpu`` engine's thread team (``parallel.h``): concurrent callers, fork, one thread.

Row-wise kernels (softmin, plan products) compute each row in one task whatever thread runs
it, so their results are bitwise identical across runs, thread counts and concurrent calls;
these tests check that.  Column sums of the fused steps are reduced over fixed groups of rows in
a fixed order (not per thread), so they are bitwise equal too (tests/ops/test_determinism.py has more)."""

from __future__ import annotations

import multiprocessing as mp
import threading

import pytest
import torch

from flashot.costs import get_cost
from flashot.ops.dense import DenseEngine

C = get_cost("sqeuclidean")


def _problem(seed, n=700, m=650, d=5, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(1, n, d, generator=g, dtype=dtype),
        torch.randn(1, m, d, generator=g, dtype=dtype),
        torch.randn(1, m, generator=g, dtype=dtype),
    )


def test_concurrent_python_threads_match_solo_runs_bitwise(lib):
    from flashot.ops.cpu.engine import CpuEngine

    eng = CpuEngine(lib, mode="stream", threads=2)
    probs = [_problem(s) for s in range(6)]
    solo = [eng.softmin(x, y, h, 0.2, C) for x, y, h in probs]
    out: dict[int, list] = {}

    def work(k):
        x, y, h = probs[k]
        out[k] = [eng.softmin(x, y, h, 0.2, C) for _ in range(5)]

    ts = [threading.Thread(target=work, args=(k,)) for k in range(len(probs))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for k, ref in enumerate(solo):
        assert all(torch.equal(o, ref) for o in out[k]), k


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_thread_count_does_not_change_row_results(lib, threads):
    from flashot.ops.cpu.engine import CpuEngine

    x, y, h = _problem(1, dtype=torch.float32)
    ref = CpuEngine(lib, mode="stream", threads=1).softmin(x, y, h, 0.2, C)
    assert torch.equal(CpuEngine(lib, mode="stream", threads=threads).softmin(x, y, h, 0.2, C), ref)
    V = torch.randn(1, 650, 7)
    a = torch.zeros(1, 700)
    p1 = CpuEngine(lib, mode="stream", threads=1).plan_product(x, y, a, h, 0.2, V, C)
    assert torch.equal(CpuEngine(lib, mode="stream", threads=threads).plan_product(x, y, a, h, 0.2, V, C), p1)


def test_fused_steps_agree_across_thread_counts(lib):
    from flashot.ops.cpu.engine import CpuEngine

    x, y, h = _problem(2, d=24)
    hx = torch.zeros(1, 700, dtype=torch.float64)
    outs = [CpuEngine(lib, mode="stream", threads=t).softmin_pair(x, y, hx, h, 0.5, C) for t in (1, 2, 5)]
    alts = [CpuEngine(lib, mode="stream", threads=t).softmin_alt(x, y, hx, h, 0.5, C) for t in (1, 2, 5)]
    for res in (outs, alts):
        for o in res[1:]:
            for a, b in zip(o, res[0]):
                assert torch.equal(a, b)


def _child(q):
    from flashot.ops.cpu.engine import CpuEngine

    torch.set_num_threads(1)  # as DataLoader workers do: PyTorch's own OpenMP pool is not fork-safe
    x, y, h = _problem(3)
    out = CpuEngine(mode="stream", threads=2).softmin(x, y, h, 0.2, C)
    q.put(float((out - DenseEngine().softmin(x, y, h, 0.2, C)).abs().max()))


def test_a_forked_child_gets_a_working_team(lib):
    """DataLoader workers are forked: the parent's worker threads do not exist in the child."""
    from flashot.ops.cpu.engine import CpuEngine

    x, y, h = _problem(4)
    CpuEngine(lib, mode="stream", threads=2).softmin(x, y, h, 0.2, C)  # the parent's team exists
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q,))
    p.start()
    p.join(120)
    if p.is_alive():
        p.kill()
        p.join()
    assert p.exitcode == 0, "the forked child hung or crashed"
    assert q.get(timeout=5) < 1e-10


@pytest.mark.parametrize("mode", ["auto", "cache"])
def test_concurrent_solves_on_the_cached_path_with_a_tight_budget(lib, mode):
    """Two Python threads on the shared engine's cached-cost path, with a budget that holds one
    matrix: each thread's lookups evict the other's matrix and may reuse its buffer (issue 12,
    item 3).  Every result must equal a solo run's to float32 accuracy (1e-4 of its largest entry: not
    bitwise, because after an eviction a pair may be rebuilt as (y, x) instead of (x, y), and a
    cached pass over columns rounds differently from one over rows; a buffer overwritten while
    read gives errors of order 1; auto may also stream a call that the solo run served cached)."""
    from flashot.ops.cpu.engine import CpuEngine

    probs = [_problem(10 + k, n=300, m=280, d=32, dtype=torch.float32) for k in range(2)]
    budget = 300 * 280 * 4 + 1000  # one matrix
    solo = []
    for x, y, h in probs:
        e = CpuEngine(lib, mode=mode, cache_bytes=budget, threads=2)
        e.expect_reuse(x, y, C)
        a = torch.zeros(1, 300)
        V = torch.randn(1, 280, 3, generator=torch.Generator().manual_seed(0))
        solo.append(
            [
                e.softmin(x, y, h, 0.5, C),
                e.softmin(y, x, a, 0.5, C),
                e.softmin_alt(x, y, a, h, 0.5, C)[1],
                e.plan_product(x, y, a, h, 0.5, V, C),
            ]
        )
    shared = CpuEngine(lib, mode=mode, cache_bytes=budget, threads=2)
    bad: list = []
    step = threading.Barrier(2)  # interleave the two threads' solves

    def work(k):
        x, y, h = probs[k]
        a = torch.zeros(1, 300)
        V = torch.randn(1, 280, 3, generator=torch.Generator().manual_seed(0))
        for _ in range(15):
            step.wait(timeout=60)
            shared.expect_reuse(x, y, C)
            got = [
                shared.softmin(x, y, h, 0.5, C),
                shared.softmin(y, x, a, 0.5, C),
                shared.softmin_alt(x, y, a, h, 0.5, C)[1],
                shared.plan_product(x, y, a, h, 0.5, V, C),
            ]
            for g, r in zip(got, solo[k]):
                if (g - r).abs().max() > 1e-4 * float(r.abs().max()):
                    bad.append((k, float((g - r).abs().max())))

    ts = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not bad
    if mode == "cache":  # forced mode evicts whatever is in the way: the matrices did evict each other
        assert shared.stats["cache_build"] > 2
