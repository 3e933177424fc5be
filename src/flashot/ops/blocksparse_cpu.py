"""The ``multiscale`` engine's calls into the C++ block-sparse kernels (B = 1, CPU, float32 / float64).

The kernels stream the kept column ranges of each row cluster of a :class:`~flashot.ops.block_pattern.BlockPattern`
in the padded layout of :class:`~flashot.ops.block_pattern.PaddedColumns`; :class:`TileArgs` carries the sub-tile
pruning of one fused call (:mod:`flashot.ops.tile_rule`).  Used by :class:`~flashot.ops.blocksparse.BlockSparseEngine`
and by the tile rule's sampled outputs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..costs import Cost
from .base import Weight
from .block_pattern import BlockPattern
from .cpu import abi

__all__ = ["TileArgs", "cpu_lib", "padded_y", "softmin_cpu", "pair_cpu", "plan_cpu", "plan_call"]


class TileArgs(NamedTuple):
    """The sub-tile pruning of one fused call (:func:`pair_cpu`): the inputs ``fx = f /
    eps`` (N,) and ``gy = g / eps`` (M,), upper bounds ``fxo`` (N,) and ``gyo`` (M,) of the call's outputs in the
    same units, GeomLoss' ``truncate``, and ``counter``: a one-element list to which the pairs evaluated are
    added."""

    fx: Tensor
    gy: Tensor
    fxo: Tensor
    gyo: Tensor
    truncate: float
    counter: list


def cpu_lib(dtype: torch.dtype = torch.float32):
    """The compiled block-sparse CPU kernels with ``dtype``'s library loaded (:class:`.cpu.build.Kernels`), or
    None where they cannot be built, or for another dtype (the PyTorch path then runs)."""
    if dtype not in (torch.float32, torch.float64):
        return None
    try:
        from .cpu.build import BuildError, load_blocksparse
    except ImportError:  # pragma: no cover
        return None
    try:
        return load_blocksparse(dtype)
    except BuildError:
        return None


def _stream(
    x: Tensor, yT: Tensor, yy: Tensor, hs: Tensor, width: int, kind: int, kcoef: float, minsq: float
) -> abi.Stream:
    """The kernels' ``flashot_stream`` for the rows ``x`` (1, N, D) against the padded columns (B = 1)."""
    from .cpu.engine import LARGE_D_CFG, SMALL_D

    N, D = x.shape[-2], x.shape[-1]
    return abi.Stream(
        x.data_ptr(),
        yT.data_ptr(),
        yy.data_ptr(),
        hs.data_ptr(),
        N,
        width,
        0,
        kcoef,
        minsq,
        1,
        D,
        kind,
        0 if D <= SMALL_D else LARGE_D_CFG,
        torch.get_num_threads(),
    )


def _blocks(lay, tasks: Tensor) -> abi.Blocks:
    """The kernels' ``flashot_blocks`` of a padded layout, for the row tasks ``tasks``."""
    return abi.Blocks(
        tasks.data_ptr(),
        lay.cptr.data_ptr(),
        lay.ranges.data_ptr(),
        lay.offsets.data_ptr(),
        tasks.numel() // 3,
        int(lay.banded),
    )


def padded_y(lib, pat: BlockPattern, y: Tensor, h: Tensor, kind: int):
    """The kernels' layout of the columns (cpu/streamed.py ``prep_y``, cluster by cluster): ``(layout, yT, yy, hs)``."""
    from .cpu.engine import KIND_DOT, LOG2E, encode_zero_weights

    D = y.shape[-1]
    lanes = lib.flashot_bs_vector_bytes() // y.element_size()
    lay = pat.padded(lanes if D <= 3 else 4 * lanes)  # the micro-kernels' column step (1 or <= 4 vectors)
    y0 = y[0]
    key = (y0.data_ptr(), y0._version, tuple(y0.shape), y0.dtype, kind)
    if lay.points is None or lay.points[0] != key:  # the padded points: once per (pattern, cloud)
        yT = torch.zeros(D, lay.width, dtype=y.dtype)
        yT[:, lay.pos] = y0.T
        yy = torch.zeros(lay.width, dtype=y.dtype)
        if kind == KIND_DOT:
            yy[lay.pos] = (y0 * y0).sum(-1)
        lay.points = (key, yT, yy, y0)  # y0 held: its storage (data_ptr in the key) cannot be reused meanwhile
    _, yT, yy, _ = lay.points
    hs = torch.full((lay.width,), float("-inf"), dtype=y.dtype)
    hs[lay.pos] = h[0] * LOG2E
    encode_zero_weights(hs)
    return lay, yT, yy, hs


def softmin_cpu(
    lib,
    pat: BlockPattern,
    x: Tensor,
    y: Tensor,
    h: Tensor,
    eps: float,
    cost: Cost,
    base2: bool = False,
    tasks: Tensor | None = None,
) -> Tensor:
    """The block-sparse softmin by the C++ kernels (B = 1, CPU, float32 / float64); ``base2``: the row
    LSE in base 2 instead (the plan product's first pass); ``tasks``: other rows than the pattern's (``(first row,
    end row, row cluster)`` per row cluster, as :class:`PaddedColumns`)."""
    from .cpu.engine import LN2, CpuEngine

    N = x.shape[1]
    kind, kcoef, minsq = CpuEngine.cost_args(cost, eps)
    lay, yT, yy, hs = padded_y(lib, pat, y, h, kind)
    xc = x[0].contiguous()
    out = torch.empty(N, dtype=x.dtype)
    tasks = lay.tasks if tasks is None else tasks
    fn = lib.flashot_softmin_bs_f32 if x.dtype == torch.float32 else lib.flashot_softmin_bs_f64
    lse = abi.LseArgs(
        _stream(xc, yT, yy, hs, lay.width, kind, kcoef, minsq), out.data_ptr(), 1.0 if base2 else -eps * LN2
    )
    rc = abi.call(fn, abi.LseBsArgs(lse, _blocks(lay, tasks)))
    if rc != 0:
        raise RuntimeError(f"multiscale engine: block-sparse softmin kernel returned {rc}")
    return out.unsqueeze(0)


def pair_cpu(
    lib,
    pat: BlockPattern,
    x: Tensor,
    y: Tensor,
    hx: Tensor,
    hy: Tensor,
    eps: float,
    cost: Cost,
    sym: bool,
    bary: int = 0,
    tiles: TileArgs | None = None,
    tasks: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """``flashot_pair_bs``: ``(rsum (N,), csum (M,), rb, cb)``, the row and column sums of ``exp(s_ij)``, ``s_ij =
    hx_i + hy_j - C_ij / eps``, over the kept blocks, one exponential per pair.  ``sym`` (``y`` is ``x``, a
    symmetric pattern): the blocks right of the diagonal give both sums and the diagonal ones the row sums only,
    so the full row sums are ``rsum + csum``.  ``bary`` (D <= 3): 1, also ``rb = sum_j exp(s_ij) y_j`` (N, D);
    2, also ``cb = sum_i exp(s_ij) x_i`` (M, D) (``sym`` needs 2); else both None.  ``tiles``: sub-tile pruning
    (the kernels' ``TileBounds``): the tiles where every entry is below ``e^-truncate`` of its share of the row
    and column sums the call puts out (``fxo_i + g_j - C_ij / eps < -truncate`` and ``f_i + gyo_j - C_ij / eps <
    -truncate``) or below ``e^-truncate a_i b_j`` (GeomLoss' rule for the inputs) are skipped.  ``tasks``: other
    rows than the pattern's, as in :func:`softmin_cpu` (not with ``sym``)."""
    from .cpu.engine import LOG2E, CpuEngine, encode_zero_weights

    N, D = x.shape[1], x.shape[2]
    kind, kcoef, minsq = CpuEngine.cost_args(cost, eps)
    lay, yT, yy, hs = padded_y(lib, pat, y, hy, kind)
    hx2 = encode_zero_weights((hx[0] * LOG2E).contiguous())
    xc = x[0].contiguous()
    rows = torch.empty(N, dtype=x.dtype)
    cols = torch.empty((1 + D if bary == 2 else 1) * lay.width, dtype=x.dtype)
    rb = torch.empty(N, D, dtype=x.dtype) if bary else None
    fx = gy = fxo = gyo = None
    thr, done = 0.0, torch.zeros(1, dtype=torch.int64)
    if tiles is not None:
        fx, fxo = ((t * LOG2E).to(x.dtype).contiguous() for t in (tiles.fx, tiles.fxo))
        gy, gyo = (torch.full((lay.width,), float("-inf"), dtype=x.dtype) for _ in range(2))
        gy[lay.pos] = (tiles.gy * LOG2E).to(x.dtype)
        gyo[lay.pos] = (tiles.gyo * LOG2E).to(x.dtype)
        thr = tiles.truncate * LOG2E
    tasks = lay.tasks if tasks is None else tasks
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    fn = lib.flashot_pair_bs_f32 if x.dtype == torch.float32 else lib.flashot_pair_bs_f64
    rowcol = abi.RowColArgs(
        _stream(xc, yT, yy, hs, lay.width, kind, kcoef, minsq),
        hx2.data_ptr(),
        rows.data_ptr(),
        cols.data_ptr(),
        0.0,
        int(sym),
    )
    rc = abi.call(
        fn,
        abi.PairBsArgs(
            rowcol,
            _blocks(lay, tasks),
            ptr(rb),
            ptr(fx),
            ptr(gy),
            ptr(fxo),
            ptr(gyo),
            done.data_ptr(),
            thr,
            int(bary == 2),
        ),
    )
    if rc != 0:
        raise RuntimeError(f"multiscale engine: block-sparse pair kernel returned {rc}")
    if tiles is not None:
        tiles.counter[0] += int(done)
    cb = cols[lay.width :].view(D, lay.width)[:, lay.pos].T if bary == 2 else None
    return rows, cols[: lay.width][lay.pos], rb, cb


def plan_cpu(
    lib,
    pat: BlockPattern,
    x: Tensor,
    y: Tensor,
    alpha: Tensor,
    beta: Tensor,
    eps: float,
    V: Tensor,
    cost: Cost,
    weight: Weight,
) -> Tensor:
    """The block-sparse plan product by the C++ kernels (V of at most ``NARROW_K`` columns, B = 1).  One pass:
    the weights are the plan entries ``exp(alpha_i + beta_j - C_ij / eps)`` themselves (as the ``cpu``
    engine's plan product), which neither overflow nor lose the row when its plan mass is between
    ``PAIR_MIN_SUM`` and 1-ish (the solver's plans).  Rows whose mass is outside that range or whose output
    is not finite are redone in two passes (the row LSE first, every weight <= 1), on the row clusters that
    hold them only."""
    from .cpu.engine import PAIR_MIN_SUM

    out, mass = plan_call(lib, pat, x, y, alpha, beta, eps, V, cost, weight, None)
    al = alpha[0]
    bad = torch.isfinite(al) & ~(torch.isfinite(mass) & (mass >= PAIR_MIN_SUM) & torch.isfinite(out[0]).all(-1))
    if bool(bad.any()):
        sub, idx = pat.clusters_of(bad)
        xs, als = x[:, idx].contiguous(), alpha[:, idx].contiguous()
        lse = softmin_cpu(lib, sub, xs, y, beta, eps, cost, base2=True)[0].contiguous()
        redo, _ = plan_call(lib, sub, xs, y, als, beta, eps, V, cost, weight, lse)
        sel = bad[idx]
        out[0, idx[sel]] = redo[0, sel]
    return out


def plan_call(
    lib,
    pat: BlockPattern,
    x: Tensor,
    y: Tensor,
    alpha: Tensor,
    beta: Tensor,
    eps: float,
    V: Tensor,
    cost: Cost,
    weight: Weight,
    lse: Tensor | None,
    tasks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """One ``flashot_plan_bs`` call: ``(out (1, N, K), plan mass per row (N,))``; two-pass mode when the row
    LSE ``lse`` (base 2) is given, one-pass otherwise; ``tasks`` as in :func:`softmin_cpu`."""
    from .cpu.engine import KIND_DOT, W_COST, W_INV, W_ONE, CpuEngine

    N, K = x.shape[1], V.shape[-1]
    kind, kcoef, minsq = CpuEngine.cost_args(cost, eps)
    lay, yT, yy, hs = padded_y(lib, pat, y, beta, kind)
    wk, wconst = W_ONE, 1.0
    if weight == "cost":
        wk, wconst = W_COST, (cost.scale if kind == KIND_DOT else 1.0)  # the kernels' c is |x - y|^2 (dot)
    elif weight == "dcost":
        wk, wconst = (W_ONE, 2.0 * cost.scale) if kind == KIND_DOT else (W_INV, 1.0)
    VTk = torch.zeros(K, lay.width, dtype=x.dtype)
    VTk[:, lay.pos] = V[0].T
    xc, al = x[0].contiguous(), alpha[0].contiguous()
    out = torch.empty(N, K, dtype=x.dtype)
    mass = torch.empty(N, dtype=x.dtype)
    tasks = lay.tasks if tasks is None else tasks
    fn = lib.flashot_plan_bs_f32 if x.dtype == torch.float32 else lib.flashot_plan_bs_f64
    plan = abi.PlanArgs(
        _stream(xc, yT, yy, hs, lay.width, kind, kcoef, minsq),
        (al if lse is None else lse).data_ptr(),
        al.data_ptr(),
        VTk.data_ptr(),
        out.data_ptr(),
        mass.data_ptr(),
        wconst,
        K,
        int(lse is None),
        wk,
        1,
    )
    rc = abi.call(fn, abi.PlanBsArgs(plan, _blocks(lay, tasks)))
    if rc != 0:
        raise RuntimeError(f"multiscale engine: block-sparse plan kernel returned {rc}")
    return out.unsqueeze(0), mass
