"""The C++ pair kernel on a ragged batch's banded patterns (``flashot_blocks.banded``: column sums per run of
consecutive row chunks over their own columns, ``ColSpans`` in ``ops/cpu/colsum.h``).

Oracle: float64 sums over the block-diagonal mask by dense matrices (row sums, column sums, barycentre
numerators), and the same kernel with ``banded`` off (the strided full-width column groups).  Problem sizes are odd
and the chunks' boundaries fall off the SIMD widths; 5 problems give fewer tasks than column groups, 90 more.
"""

from __future__ import annotations

import math

import pytest
import torch

from flashot.costs import get_cost
from flashot.ops.blocksparse import _cpu_lib, _pair_cpu
from flashot.ragged.inputs import RaggedLayout
from flashot.ragged.measures import ragged_engine

F64 = torch.float64
pytestmark = pytest.mark.skipif(_cpu_lib() is None, reason="the C++ block-sparse kernels did not build")


def _batch(sizes_x, sizes_y, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    lay = RaggedLayout(
        torch.tensor([0, *torch.tensor(sizes_x).cumsum(0).tolist()]),
        torch.tensor([0, *torch.tensor(sizes_y).cumsum(0).tolist()]),
    )
    x = torch.randn(1, sum(sizes_x), 3, generator=g, dtype=F64).to(dtype)
    y = (torch.randn(1, sum(sizes_y), 3, generator=g, dtype=F64) * 0.7 + 0.2).to(dtype)
    hx = (torch.randn(1, x.shape[1], generator=g, dtype=F64) * 0.3).to(dtype)
    hy = (torch.randn(1, y.shape[1], generator=g, dtype=F64) * 0.3).to(dtype)
    return lay, x, y, hx, hy


def _mask(lay, a: str, b: str) -> torch.Tensor:
    ia, ib = lay.ids(a, torch.device("cpu")), lay.ids(b, torch.device("cpu"))
    return ia[:, None] == ib[None]


SIZES = {
    "5 problems": ([1, 300, 37, 517, 129], [13, 2, 611, 260, 45]),
    "90 problems": ([(7 * k) % 41 + 1 for k in range(90)], [(11 * k) % 53 + 2 for k in range(90)]),
}


@pytest.mark.parametrize("dtype, tol", [(F64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("case", list(SIZES))
@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("bary", [0, 2])
def test_banded_pair_kernel_matches_masked_dense(dtype, tol, case, sym, bary):
    lay, x, y, hx, hy = _batch(*SIZES[case], dtype)
    eng = ragged_engine(x, y, lay, "cpu", debias=sym)
    if sym:
        y, hy = x, hx
    pat = eng.pattern(x, y)
    lib, cost, eps = _cpu_lib(), get_cost("sqeuclidean"), 0.3
    lanes = lib.flashot_bs_vector_bytes() // x.element_size()
    assert pat.padded(lanes).banded and len(pat.lo) > 1
    outs = {}
    for banded in (True, False):
        pat.padded(lanes).banded = banded
        outs[banded] = _pair_cpu(lib, pat, x, y, hx, hy, eps, cost, sym=sym, bary=bary)
    pat.padded(lanes).banded = True
    rows, cols, rb, cb = outs[True]
    if sym:
        rows, rb = rows + cols, (rb + cb if bary else None)
    mask = _mask(lay, "x", "x" if sym else "y")
    xd, yd = x[0].double(), y[0].double()
    C = cost.matrix(x.double(), y.double())[0]
    E = torch.where(
        mask, torch.exp(hx[0].double()[:, None] + hy[0].double()[None] - C / eps), torch.zeros((), dtype=F64)
    )
    scale = float(C[mask].max()) / eps
    assert float((rows.double().log() - E.sum(1).log()).abs().max()) <= tol * scale
    if bary:
        assert float((rb.double() / rows.double()[:, None] - E @ yd / E.sum(1, keepdim=True)).abs().max()) <= tol * 3
    if not sym:
        assert float((cols.double().log() - E.sum(0).log()).abs().max()) <= tol * scale
        if bary:
            assert float((cb.double() / cols.double()[:, None] - E.T @ xd / E.sum(0)[:, None]).abs().max()) <= tol * 3
    # the strided full-width groups: the same sums, in another order
    for got, ref in zip(outs[True], outs[False]):
        if got is not None:
            assert float((got.double() - ref.double()).abs().max()) <= 10 * tol * float(ref.double().abs().max())


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_banded_engine_steps_match_the_strided_ones(dtype):
    """The engine's fused steps (``softmin_pair``, ``softmin_sym``) with and without the banded column groups."""
    lay, x, y, hx, hy = _batch(*SIZES["90 problems"], dtype, seed=3)
    hx, hy = hx - math.log(40), hy - math.log(40)
    eng = ragged_engine(x, y, lay, "cpu", debias=True)
    cost, eps = get_cost("sqeuclidean"), 0.2
    lib = _cpu_lib()
    lanes = lib.flashot_bs_vector_bytes() // x.element_size()
    pats = [eng.pattern(x, y), eng.pattern(x, x)]
    res = {}
    for banded in (True, False):
        for p in pats:
            p.padded(lanes).banded = banded
        res[banded] = (*eng.softmin_pair(x, y, hx, hy, eps, cost), eng.softmin_sym(x, hx, eps, cost))
    tol = 1e-12 if dtype == F64 else 1e-5
    for a, b in zip(res[True], res[False]):
        assert float((a - b).abs().max()) <= tol * max(1.0, float(b.abs().max()))
