r"""Block-sparse versions of the two primitives (the ``multiscale`` engine), in PyTorch on any device.

The points of both clouds are sorted by cluster (:mod:`flashot.clusters`), so a cluster is a
contiguous slice.  A :class:`BlockPattern` lists, for every row cluster ``I``, the column
clusters ``J`` whose block is kept; the primitives then sum over kept blocks only::

    softmin:       out_i = -eps log sum_{j in kept(I(i))} exp(h_j - C_ij / eps)
    plan_product:  out_i = sum_{j in kept(I(i))} exp(alpha_i + beta_j - C_ij / eps) W_ij V_j

For speed in PyTorch, row clusters with similar numbers of kept columns are packed into padded
batches (at most ``TILE_ELEMS`` scores each): the rows and the gathered columns of one batch are
one batched GEMM and one LogSumExp, padding entering as ``-inf`` log-weights (exactly nothing).
On the CPU the softmin runs in the C++ kernels of the ``cpu`` engine (``flashot_softmin_bs``:
each row cluster streams its kept column ranges with the dense LSE micro-kernels, the columns of
each cluster padded to the kernels' step), and so do the plan products with a narrow ``V`` (at most 4
columns: marginals, and the gradients for d <= 3) in one pass (two where a row's plan mass is out of
range); wider ones run in PyTorch.  The solver's symmetric steps are fused there as in the ``cpu``
engine: :meth:`BlockSparseEngine.softmin_pair` gives both potentials from one exponential per kept pair
(``flashot_pair_bs``, column sums per fixed group of row clusters, so the bits do not depend on the thread
count), and :meth:`BlockSparseEngine.softmin_sym` (debiasing, a symmetric pattern) computes only the
blocks on and right of the diagonal.  Their ``_bary`` variants (the final step) also return the soft-argmin
barycentres ``sum_j w_ij y_j`` from the same exponentials, so the gradient needs no plan product; with a
:class:`~flashot.ops.tile_rule.TilePruning` the fused steps skip the tiles inside kept blocks that GeomLoss'
truncate rule drops for the call's input potentials or for its outputs (:mod:`flashot.ops.tile_rule`).  On CUDA
tensors both primitives run in the Triton kernels (:mod:`flashot.ops.triton.blocksparse`: one program
per row tile of a cluster, streaming its kept column ranges with an online LogSumExp, any ``V``
width).  The engine is bound to its problem: :class:`BlockSparseEngine` maps the (row cloud, column cloud)
pairs that the solver passes (identified by their storage) to their patterns, and raises on any
other pair rather than computing a different sum.

Row ranges (a distributed solve, :class:`flashot.distributed.ShardedEngine`): ``softmin`` and
``plan_product`` take ``rows=(lo, hi)``, a range of whole row clusters, and compute only those rows
(each row's sum is the same as in the full call: the same kept columns, the same kernels);
:meth:`BlockSparseEngine.row_bounds` splits the rows of a pair into such ranges, balanced by kept pairs.
"""

from __future__ import annotations

import hashlib
import os

import torch
from torch import Tensor

from ..costs import Cost
from .base import Weight
from .dense import _lse_last, weighted_product
from .tiled import TILE_ELEMS
from .tile_rule import TILE_MAX_D, TileArgs, TilePruning, tile_args

NARROW_K = 4  # plan products with V of at most this many columns run in the C++ kernels (PV_K)


class BlockPattern:
    """Kept (row cluster, column cluster) blocks of an N x M problem, ready for gathered batches.

    Args:
        row_offsets, col_offsets: (Kx + 1,), (Ky + 1,) cluster boundaries in the sorted clouds.
        keep: (Kx, Ky) bool; every row cluster must keep at least one block.
    """

    def __init__(self, row_offsets: Tensor, col_offsets: Tensor, keep: Tensor, tile_elems: int = TILE_ELEMS):
        self.row_offsets, self.col_offsets, self.keep = row_offsets, col_offsets, keep
        self.tile_elems = int(tile_elems)
        rs, cs = row_offsets[1:] - row_offsets[:-1], col_offsets[1:] - col_offsets[:-1]
        self.n_rows, self.n_cols = int(row_offsets[-1]), int(col_offsets[-1])
        I, J = keep.nonzero(as_tuple=True)
        if I.numel() == 0 or int(torch.bincount(I, minlength=keep.shape[0]).min()) == 0:
            raise ValueError("BlockPattern: every row cluster must keep at least one column block")
        width = cs[J]  # columns of each kept block
        k_row = torch.zeros(keep.shape[0], dtype=torch.long, device=keep.device).index_add_(0, I, width)
        self.pairs = int((rs * k_row).sum())
        self._rs, self._k_row, self._IJ = rs, k_row, (I, J)

    @property
    def batches(self) -> list[tuple[Tensor, Tensor]]:
        """The PyTorch path's padded ``(rows, cols)`` index batches, built on first use (O(kept pairs
        / rows) memory: the C++ path never builds them)."""
        if "_batches" not in self.__dict__:
            I, J = self._IJ
            width = (self.col_offsets[1:] - self.col_offsets[:-1])[J]
            # flat column indices of the kept blocks, row cluster after row cluster
            starts = torch.repeat_interleave(self.col_offsets[J] - (torch.cumsum(width, 0) - width), width)
            self._cols = starts + torch.arange(int(width.sum()), device=self.keep.device)
            self._ptr = torch.zeros(self.keep.shape[0] + 1, dtype=torch.long, device=self.keep.device)
            self._ptr[1:] = torch.cumsum(self._k_row, 0)
            self._batches = self._pack(self._rs, self._k_row)
        return self._batches

    @property
    def fraction(self) -> float:
        """Kept pairs over all ``N M`` pairs."""
        return self.pairs / (self.n_rows * self.n_cols)

    @property
    def symmetric(self) -> bool:
        """Square with the same clusters on both sides and ``keep == keep.T`` (the patterns of ``(x, x)``
        pairs; :meth:`BlockSparseEngine.softmin_sym` then computes half the blocks).  Cached."""
        if "_symmetric" not in self.__dict__:
            self._symmetric = bool(self.keep.shape[0] == self.keep.shape[1]
                                   and torch.equal(self.row_offsets, self.col_offsets)
                                   and torch.equal(self.keep, self.keep.T))
        return self._symmetric

    @property
    def T(self) -> "BlockPattern":
        return BlockPattern(self.col_offsets, self.row_offsets, self.keep.T.contiguous(), self.tile_elems)

    def split(self, parts: int) -> list[tuple[int, int]]:
        r"""``parts`` contiguous row ranges ``[lo, hi)`` of whole row clusters covering the rows, balanced by
        kept pairs: range ``r`` ends at the cluster boundary whose count of kept pairs before it is nearest
        to ``(r + 1) P / parts`` (``P`` = :attr:`pairs`).  Integer arithmetic: the same on every process.
        A range may be empty (more parts than row clusters).  Cached per ``parts``."""
        cache = self.__dict__.setdefault("_splits", {})
        if parts not in cache:
            if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
                raise ValueError(f"parts: expected a positive integer, got {parts!r}")
            cum = torch.zeros(self.keep.shape[0] + 1, dtype=torch.long)
            cum[1:] = torch.cumsum((self._rs * self._k_row).cpu(), 0)
            cuts, ro = [0], self.row_offsets.cpu().tolist()
            for r in range(1, parts):
                target = r * self.pairs // parts
                k = int(torch.searchsorted(cum, torch.tensor([target]))[0])  # cum[k - 1] < target <= cum[k]
                if k > 0 and target - int(cum[k - 1]) < int(cum[k]) - target:
                    k -= 1
                cuts.append(max(cuts[-1], k))
            cuts.append(self.keep.shape[0])
            cache[parts] = [(ro[cuts[r]], ro[cuts[r + 1]]) for r in range(parts)]
        return cache[parts]

    def rows(self, lo: int, hi: int) -> "BlockPattern":
        """The pattern of the rows ``[lo, hi)``, a non-empty range of whole row clusters (row offsets from
        ``lo``; the same kept blocks).  ``ValueError`` if ``lo`` or ``hi`` is not a cluster boundary.
        Cached per range."""
        cache = self.__dict__.setdefault("_rows", {})
        if (lo, hi) not in cache:
            ro = self.row_offsets.cpu()
            k0, k1 = (int(torch.searchsorted(ro, torch.tensor([v]))[0]) for v in (lo, hi))
            if not (0 <= lo < hi <= self.n_rows) or int(ro[k0]) != lo or int(ro[k1]) != hi:
                raise ValueError(f"rows: [{lo}, {hi}) is not a non-empty range of whole row clusters of this pattern "
                                 f"({self.keep.shape[0]} clusters over {self.n_rows} rows)")
            cache[(lo, hi)] = BlockPattern(self.row_offsets[k0:k1 + 1] - lo, self.col_offsets, self.keep[k0:k1],
                                           self.tile_elems)
        return cache[(lo, hi)]

    def clusters_of(self, rows: Tensor) -> tuple["BlockPattern", Tensor]:
        """The pattern restricted to the row clusters that hold a ``True`` of ``rows`` (n_rows,) bool, and the
        (n_sub,) indices of their rows: the rows of the restricted pattern are ``x[:, index]``."""
        ro = self.row_offsets.cpu()
        sizes = ro[1:] - ro[:-1]
        cid = torch.repeat_interleave(torch.arange(self.keep.shape[0]), sizes)
        hit = torch.zeros(self.keep.shape[0], dtype=torch.bool)
        hit[cid[rows.cpu()]] = True
        k = hit.nonzero().squeeze(1)
        offsets = torch.zeros(k.numel() + 1, dtype=torch.long)
        offsets[1:] = torch.cumsum(sizes[k], 0)
        index = hit[cid].nonzero().squeeze(1)  # the clusters' rows, in order
        dev = self.row_offsets.device
        sub = BlockPattern(offsets.to(dev), self.col_offsets, self.keep[k.to(self.keep.device)], self.tile_elems)
        return sub, index.to(rows.device)

    @property
    def digest(self) -> int:
        """A 62-bit hash of the cluster boundaries and the kept blocks (processes that must agree on the
        pruning compare it; see :class:`flashot.distributed.ShardedEngine`)."""
        if "_digest" not in self.__dict__:
            h = hashlib.blake2b(digest_size=8)
            for t in (self.row_offsets, self.col_offsets, *self._IJ):
                h.update(t.detach().cpu().to(torch.int64).numpy().tobytes())
            self._digest = int.from_bytes(h.digest(), "little") >> 2
        return self._digest

    def padded(self, unit: int) -> "PaddedColumns":
        """The columns laid out cluster by cluster, each cluster padded to a multiple of ``unit`` (the C++
        kernels' column step), and each row cluster's kept column ranges in that layout (runs of
        consecutive kept clusters merged into one range).  Cached per ``unit``."""
        cache = self.__dict__.setdefault("_padded", {})
        if unit not in cache:
            cache[unit] = PaddedColumns.build(self, unit)
        return cache[unit]

    def _pack(self, rs: Tensor, k_row: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Padded ``(rows, cols)`` index batches, (G, n) and (G, k), ``-1`` = padding."""
        order = torch.argsort(k_row, descending=True).tolist()
        rs_l, k_l = rs.tolist(), k_row.tolist()
        ro, ptr = self.row_offsets.tolist(), self._ptr.tolist()
        dev = self.keep.device
        batches, group = [], []
        n_max = k_max = 0
        for I in order:
            n2, k2 = max(n_max, rs_l[I]), max(k_max, k_l[I])
            if group and (len(group) + 1) * n2 * k2 > self.tile_elems:
                batches.append(self._batch(group, n_max, k_max, ro, ptr, dev))
                group, n2, k2 = [], rs_l[I], k_l[I]
            group.append(I)
            n_max, k_max = n2, k2
        batches.append(self._batch(group, n_max, k_max, ro, ptr, dev))
        return batches

    def _batch(self, group, n_max, k_max, ro, ptr, dev):
        rows = torch.full((len(group), n_max), -1, dtype=torch.long, device=dev)
        cols = torch.full((len(group), k_max), -1, dtype=torch.long, device=dev)
        for g, I in enumerate(group):
            rows[g, : ro[I + 1] - ro[I]] = torch.arange(ro[I], ro[I + 1], device=dev)
            cols[g, : ptr[I + 1] - ptr[I]] = self._cols[ptr[I]:ptr[I + 1]]
        return rows, cols


class PaddedColumns:
    """The C++ block-sparse softmin's view of a :class:`BlockPattern` (see :meth:`BlockPattern.padded`):
    ``pos`` (M,) padded position of each column, ``width`` the padded number of columns, ``tasks``
    (3 Kx,) ``(first row, end row, row cluster)`` per row cluster, ``cptr`` (Kx + 1,) and ``ranges``
    (2 R,) the kept column ranges ``[start, end)`` of each row cluster, ``offsets`` (Ky + 1,) the padded
    column offsets of the clusters."""

    def __init__(self, pos: Tensor, width: int, tasks: Tensor, cptr: Tensor, ranges: Tensor, offsets: Tensor):
        self.pos, self.width, self.tasks, self.cptr, self.ranges = pos, width, tasks, cptr, ranges
        self.offsets = offsets
        self.points = None  # (key, yT, yy, y): the column cloud in this layout (_padded_y's cache)

    @classmethod
    def build(cls, pat: BlockPattern, unit: int) -> "PaddedColumns":
        co, ro, keep = pat.col_offsets.cpu(), pat.row_offsets.cpu(), pat.keep.cpu()
        sizes = co[1:] - co[:-1]
        padded = (sizes + unit - 1) // unit * unit
        poff = torch.zeros_like(co)
        poff[1:] = torch.cumsum(padded, 0)
        cid = torch.repeat_interleave(torch.arange(sizes.shape[0]), sizes)
        pos = poff[cid] + torch.arange(int(co[-1])) - co[cid]
        prev = torch.nn.functional.pad(keep[:, :-1], (1, 0))
        nxt = torch.nn.functional.pad(keep[:, 1:], (0, 1))
        si, sj = (keep & ~prev).nonzero(as_tuple=True)  # run starts, row-major order
        _, ej = (keep & ~nxt).nonzero(as_tuple=True)  # run ends, same order
        ranges = torch.stack([poff[sj], poff[ej + 1]], -1).reshape(-1).contiguous()
        cptr = torch.zeros(keep.shape[0] + 1, dtype=torch.long)
        cptr[1:] = torch.cumsum(torch.bincount(si, minlength=keep.shape[0]), 0)
        K = keep.shape[0]
        tasks = torch.stack([ro[:-1], ro[1:], torch.arange(K)], -1).reshape(-1).contiguous()
        return cls(pos, int(poff[-1]), tasks, cptr, ranges, poff.contiguous())


def _cpu_lib():
    """The compiled block-sparse CPU kernels, or None where they cannot be built (the PyTorch path then
    runs)."""
    try:
        from .cpu.build import BuildError, load_blocksparse
    except ImportError:  # pragma: no cover
        return None
    try:
        return load_blocksparse()
    except BuildError:
        return None


def _padded_y(lib, pat: BlockPattern, y: Tensor, h: Tensor, kind: int):
    """The kernels' layout of the columns (engine.py ``_prep_y``, cluster by cluster): ``(layout, yT, yy, hs)``."""
    from .cpu.engine import KIND_DOT, LOG2E, _encode_zero_weights

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
    _encode_zero_weights(hs)
    return lay, yT, yy, hs


def _softmin_cpu(lib, pat: BlockPattern, x: Tensor, y: Tensor, h: Tensor, eps: float, cost: Cost,
                 base2: bool = False, tasks: Tensor | None = None) -> Tensor:
    """The block-sparse softmin by the C++ kernels (B = 1, CPU, float32 / float64); ``base2``: the row
    LSE in base 2 instead (the plan product's first pass); ``tasks``: other rows than the pattern's (``(first row,
    end row, row cluster)`` per row cluster, as :class:`PaddedColumns`)."""
    from .cpu.engine import LARGE_D_CFG, LN2, SMALL_D, CpuEngine

    N, D = x.shape[1], x.shape[2]
    kind, kcoef, minsq = CpuEngine._cost_args(cost, eps)
    lay, yT, yy, hs = _padded_y(lib, pat, y, h, kind)
    xc = x[0].contiguous()
    out = torch.empty(N, dtype=x.dtype)
    tasks = lay.tasks if tasks is None else tasks
    fn = lib.flashot_softmin_bs_f32 if x.dtype == torch.float32 else lib.flashot_softmin_bs_f64
    rc = fn(xc.data_ptr(), yT.data_ptr(), yy.data_ptr(), hs.data_ptr(), out.data_ptr(), lay.width, D,
            tasks.data_ptr(), tasks.numel() // 3, lay.cptr.data_ptr(), lay.ranges.data_ptr(), kcoef, minsq, kind,
            1.0 if base2 else -eps * LN2, 0 if D <= SMALL_D else LARGE_D_CFG, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"multiscale engine: block-sparse softmin kernel returned {rc}")
    return out.unsqueeze(0)


def _pair_cpu(lib, pat: BlockPattern, x: Tensor, y: Tensor, hx: Tensor, hy: Tensor, eps: float, cost: Cost,
              sym: bool, bary: int = 0, tiles: TileArgs | None = None, tasks: Tensor | None = None
              ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """``flashot_pair_bs``: ``(rsum (N,), csum (M,), rb, cb)``, the row and column sums of ``exp(s_ij)``, ``s_ij =
    hx_i + hy_j - C_ij / eps``, over the kept blocks, one exponential per pair.  ``sym`` (``y`` is ``x``, a
    symmetric pattern): the blocks right of the diagonal give both sums and the diagonal ones the row sums only,
    so the full row sums are ``rsum + csum``.  ``bary`` (D <= 3): 1, also ``rb = sum_j exp(s_ij) y_j`` (N, D);
    2, also ``cb = sum_i exp(s_ij) x_i`` (M, D) (``sym`` needs 2); else both None.  ``tiles``: sub-tile pruning
    (the kernels' ``TileBounds``): the tiles where every entry is below ``e^-truncate`` of its share of the row
    and column sums the call puts out (``fxo_i + g_j - C_ij / eps < -truncate`` and ``f_i + gyo_j - C_ij / eps <
    -truncate``) or below ``e^-truncate a_i b_j`` (GeomLoss' rule for the inputs) are skipped.  ``tasks``: other
    rows than the pattern's, as in :func:`_softmin_cpu` (not with ``sym``)."""
    from .cpu.engine import LARGE_D_CFG, LOG2E, SMALL_D, CpuEngine, _encode_zero_weights

    N, D = x.shape[1], x.shape[2]
    kind, kcoef, minsq = CpuEngine._cost_args(cost, eps)
    lay, yT, yy, hs = _padded_y(lib, pat, y, hy, kind)
    hx2 = _encode_zero_weights((hx[0] * LOG2E).contiguous())
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
    rc = fn(xc.data_ptr(), yT.data_ptr(), yy.data_ptr(), hs.data_ptr(), hx2.data_ptr(), rows.data_ptr(),
            cols.data_ptr(), ptr(rb), int(bary == 2), ptr(fx), ptr(gy), ptr(fxo), ptr(gyo), thr, done.data_ptr(),
            lay.width, D,
            tasks.data_ptr(), tasks.numel() // 3, lay.cptr.data_ptr(), lay.ranges.data_ptr(), lay.offsets.data_ptr(),
            kcoef, minsq, kind, 0 if D <= SMALL_D else LARGE_D_CFG, int(sym), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"multiscale engine: block-sparse pair kernel returned {rc}")
    if tiles is not None:
        tiles.counter[0] += int(done)
    cb = cols[lay.width:].view(D, lay.width)[:, lay.pos].T if bary == 2 else None
    return rows, cols[:lay.width][lay.pos], rb, cb


def _plan_cpu(lib, pat: BlockPattern, x: Tensor, y: Tensor, alpha: Tensor, beta: Tensor, eps: float, V: Tensor,
              cost: Cost, weight: Weight) -> Tensor:
    """The block-sparse plan product by the C++ kernels (V of at most ``NARROW_K`` columns, B = 1).  One pass:
    the weights are the plan entries ``exp(alpha_i + beta_j - C_ij / eps)`` themselves (as the ``cpu``
    engine's plan product), which neither overflow nor lose the row when its plan mass is between
    ``PAIR_MIN_SUM`` and 1-ish (the solver's plans).  Rows whose mass is outside that range or whose output
    is not finite are redone in two passes (the row LSE first, every weight <= 1), on the row clusters that
    hold them only."""
    from .cpu.engine import PAIR_MIN_SUM

    out, mass = _plan_call(lib, pat, x, y, alpha, beta, eps, V, cost, weight, None)
    al = alpha[0]
    bad = torch.isfinite(al) & ~(torch.isfinite(mass) & (mass >= PAIR_MIN_SUM) & torch.isfinite(out[0]).all(-1))
    if bool(bad.any()):
        sub, idx = pat.clusters_of(bad)
        xs, als = x[:, idx].contiguous(), alpha[:, idx].contiguous()
        lse = _softmin_cpu(lib, sub, xs, y, beta, eps, cost, base2=True)[0].contiguous()
        redo, _ = _plan_call(lib, sub, xs, y, als, beta, eps, V, cost, weight, lse)
        sel = bad[idx]
        out[0, idx[sel]] = redo[0, sel]
    return out


def _plan_call(lib, pat: BlockPattern, x: Tensor, y: Tensor, alpha: Tensor, beta: Tensor, eps: float, V: Tensor,
               cost: Cost, weight: Weight, lse: Tensor | None, tasks: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """One ``flashot_plan_bs`` call: ``(out (1, N, K), plan mass per row (N,))``; two-pass mode when the row
    LSE ``lse`` (base 2) is given, one-pass otherwise; ``tasks`` as in :func:`_softmin_cpu`."""
    from .cpu.engine import KIND_DOT, W_COST, W_INV, W_ONE, CpuEngine

    N, D, K = x.shape[1], x.shape[2], V.shape[-1]
    kind, kcoef, minsq = CpuEngine._cost_args(cost, eps)
    lay, yT, yy, hs = _padded_y(lib, pat, y, beta, kind)
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
    rc = fn(xc.data_ptr(), yT.data_ptr(), yy.data_ptr(), hs.data_ptr(), (al if lse is None else lse).data_ptr(),
            al.data_ptr(), VTk.data_ptr(), K, out.data_ptr(), mass.data_ptr(), int(lse is None), lay.width, D,
            tasks.data_ptr(), tasks.numel() // 3, lay.cptr.data_ptr(), lay.ranges.data_ptr(), kcoef, minsq, kind,
            wk, wconst, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"multiscale engine: block-sparse plan kernel returned {rc}")
    return out.unsqueeze(0), mass


KERNELS_ENV = "FLASHOT_BLOCKSPARSE"


def _kernels_choice(native: bool | str) -> bool | str:
    """``native`` checked, with ``FLASHOT_BLOCKSPARSE`` (``torch`` / ``triton``) overriding ``True``."""
    if native not in (True, False, "triton"):
        raise ValueError(f"native: expected True, False or 'triton', got {native!r}")
    env = os.environ.get(KERNELS_ENV, "").strip().lower()
    if native is not True or not env:
        return native
    if env not in ("torch", "triton"):
        raise ValueError(f"{KERNELS_ENV}: expected 'torch' or 'triton', got {env!r}")
    return False if env == "torch" else "triton"


def _triton_engine():
    """A :class:`~flashot.ops.triton.TritonEngine` for the block-sparse kernels, or None without Triton
    (the PyTorch path then runs)."""
    try:
        from .triton import TritonEngine
    except ImportError:
        return None
    return TritonEngine()


def _lists(pat: BlockPattern, device: torch.device):
    from .triton.blocksparse import BlockLists

    return BlockLists.of(pat, device)


def _gather(t: Tensor, idx: Tensor) -> Tensor:
    """``t[idx]`` along dim 0 with ``-1`` entries reading row 0 (masked by the caller)."""
    return t[idx.clamp_min(0)]


class BlockSparseEngine:
    """The two primitives over the kept blocks of fixed patterns (one problem; see the module docstring).

    ``patterns`` maps ``(row cloud, column cloud)`` tensors (B = 1) to their :class:`BlockPattern`.
    ``native``: ``True`` runs the C++ kernels on the CPU and the Triton kernels on CUDA tensors (PyTorch
    where neither is available), ``False`` PyTorch only, ``"triton"`` the Triton kernels (on CPU tensors
    under ``TRITON_INTERPRET=1``: how they are tested).  The environment variable ``FLASHOT_BLOCKSPARSE``
    (``torch`` or ``triton``) overrides ``native=True``.
    """

    name = "multiscale"
    fused_final_step = True  # the solver's final step takes softmin_pair (ops.autograd.softmin_pair_fn)

    def __init__(self, patterns: list[tuple[Tensor, Tensor, BlockPattern]], *, native: bool | str = True,
                 tiles: "TilePruning | None" = None):
        self._patterns = {(self._key(u), self._key(v)): p for u, v, p in patterns}
        self._tiles = tiles
        self.tile_pairs = [0]  # pairs the fused C++ steps evaluated with sub-tile pruning (padded columns included)
        native = _kernels_choice(native)
        on_cpu = all(u.device.type == "cpu" and u.dtype in (torch.float32, torch.float64) for u, _, _ in patterns)
        on_cuda = all(u.device.type == "cuda" for u, _, _ in patterns)
        self._lib = _cpu_lib() if native is True and on_cpu else None
        self._triton = _triton_engine() if native == "triton" or (native is True and on_cuda) else None
        # fused C++ calls, the rows / columns whose potentials they recomputed and whose barycentres they redid
        self.stats = {"pair": 0, "sym": 0, "pair_bary": 0, "sym_bary": 0, "fixup": 0, "bary_fixup": 0}

    @staticmethod
    def _key(t: Tensor):
        return t.data_ptr(), tuple(t.shape), t.dtype

    def unsupported(self, device, dtype, cost):
        return None

    def pattern(self, x: Tensor, y: Tensor) -> BlockPattern:
        p = self._patterns.get((self._key(x), self._key(y)))
        if p is None:
            raise RuntimeError("multiscale engine: called on a pair of clouds it has no block pattern for "
                               "(it is bound to one problem; this is a flashot bug, please report it)")
        return p

    def row_bounds(self, x: Tensor, y: Tensor, parts: int) -> list[tuple[int, int]]:
        """``parts`` contiguous ranges of whole row clusters of ``x`` for the pair ``(x, y)``, balanced by kept
        pairs (:meth:`BlockPattern.split`): the row slices of a distributed solve."""
        return self.pattern(x, y).split(parts)

    def digest(self, x: Tensor, y: Tensor) -> Tensor:
        """(1,) int64: a hash of the pair's kept blocks (:attr:`BlockPattern.digest`)."""
        return torch.tensor([self.pattern(x, y).digest], dtype=torch.int64)

    def _select(self, x: Tensor, y: Tensor, rows: tuple[int, int] | None) -> tuple[BlockPattern | None, Tensor, int]:
        """(pattern, rows of ``x``, first row) for the rows ``[lo, hi)`` (whole row clusters; all when None);
        the pattern is None for an empty range."""
        pat = self.pattern(x, y)
        if rows is None:
            return pat, x, 0
        lo, hi = (int(v) for v in rows)
        if lo == hi and 0 <= lo <= x.shape[1]:
            return None, x[:, lo:hi], lo
        return pat.rows(lo, hi), x[:, lo:hi], lo

    def _scores(self, x: Tensor, y: Tensor, h: Tensor, rows: Tensor, cols: Tensor, eps: float, cost: Cost):
        """(G, n, k) scores ``h_j - C_ij / eps`` of one batch (padding columns -inf) and its cost block."""
        xg, yg = _gather(x[0], rows), _gather(y[0], cols)
        C = cost.tile(xg, yg)
        hg = torch.where(cols >= 0, _gather(h[0], cols), torch.full_like(cols, float("-inf"), dtype=h.dtype))
        return hg.unsqueeze(-2) - C / eps, C

    def softmin(self, x: Tensor, y: Tensor, h: Tensor, eps: float, cost: Cost,
                rows: tuple[int, int] | None = None) -> Tensor:
        """``out_i = -eps log sum_{j in kept(I(i))} exp(h_j - C_ij / eps)``, (1, N); with ``rows=(lo, hi)``
        (whole row clusters) only those rows, (1, hi - lo)."""
        pat, x, _ = self._select(x, y, rows)
        if pat is None:
            return x.new_empty((1, 0))
        if self._triton is not None:
            return self._triton.softmin_blocks(x, y, h, eps, cost, _lists(pat, x.device)).to(x.dtype)
        if self._lib is not None and h.dtype == x.dtype:
            return _softmin_cpu(self._lib, pat, x, y, h.contiguous(), eps, cost)
        out = torch.empty(1, x.shape[1], dtype=x.dtype, device=x.device)
        for rows, cols in pat.batches:
            S, _ = self._scores(x, y, h, rows, cols, eps, cost)
            lse = _lse_last(S).squeeze(-1)
            valid = rows >= 0
            out[0, rows[valid]] = -eps * lse[valid]
        return out

    def _native(self, *ts: Tensor) -> bool:
        return self._lib is not None and all(t.dtype == ts[0].dtype for t in ts)

    def softmin_pair(self, x: Tensor, y: Tensor, hx: Tensor, hy: Tensor, eps: float,
                     cost: Cost) -> tuple[Tensor, Tensor]:
        """``(softmin(x, y, hy), softmin(y, x, hx))`` over the kept blocks; on the CPU kernels one exponential
        per kept pair gives both (``s_ij = hx_i + hy_j - C_ij / eps``: ``softmin(x, y, hy)_i = -eps (log sum_j
        e^{s_ij} - hx_i)``, the same for the columns), as :meth:`flashot.ops.cpu.CpuEngine.softmin_pair`: rows
        and columns whose sum is not finite or below ``PAIR_MIN_SUM`` are recomputed by :meth:`softmin`."""
        pat = self.pattern(x, y)
        if not self._native(x, y, hx, hy):
            return self.softmin(x, y, hy, eps, cost), self.softmin(y, x, hx, eps, cost)
        self.stats["pair"] += 1
        rsum, csum, _, _ = _pair_cpu(self._lib, pat, x, y, hx.contiguous(), hy.contiguous(), eps, cost, sym=False,
                                     tiles=self._tile_args(x, y, hx, hy, eps, cost))
        return self._from_sums(rsum, hx, eps, x, y, hy, cost), self._from_sums(csum, hy, eps, y, x, hx, cost)

    def softmin_sym(self, x: Tensor, h: Tensor, eps: float, cost: Cost) -> Tensor:
        """``softmin(x, x, h)`` over the kept blocks; on the CPU kernels, for a symmetric pattern, from the
        blocks on and right of the diagonal only (``s_ij = h_i + h_j - C_ij / eps`` is symmetric): about half
        the exponentials.  Same safeguards as :meth:`softmin_pair`."""
        pat = self.pattern(x, x)
        if not (self._native(x, h) and pat.symmetric):
            return self.softmin(x, x, h, eps, cost)
        self.stats["sym"] += 1
        rsum, csum, _, _ = _pair_cpu(self._lib, pat, x, x, h.contiguous(), h.contiguous(), eps, cost, sym=True,
                                     tiles=self._tile_args(x, x, h, h, eps, cost))
        return self._from_sums(rsum + csum, h, eps, x, x, h, cost)

    def _tile_args(self, x: Tensor, y: Tensor, hx: Tensor, hy: Tensor, eps: float, cost: Cost) -> TileArgs | None:
        """:func:`_pair_cpu`'s ``tiles`` for the fused call on ``(x, y)`` (``y`` is ``x``: a symmetric step) from the
        log-weights of :class:`TilePruning` (None without): :func:`~flashot.ops.tile_rule.tile_args`.  None for
        ``D > TILE_MAX_D``: the kernels prune no tiles there, so the output bounds (whose barycentres the
        kernels give for ``D <= 3`` only) would be work for nothing."""
        t = self._tiles
        if t is None or x.shape[-1] > TILE_MAX_D:
            return None
        la, lb = t.log_weights.get(self._key(x)), t.log_weights.get(self._key(y))
        if la is None or lb is None:
            return None
        back = None if x is y else self._patterns.get((self._key(y), self._key(x)))
        return tile_args(self._lib, self.pattern(x, y), back, x, y, hx, hy, la, lb, eps, cost, t.truncate,
                         self.tile_pairs)

    def _bary_ok(self, x: Tensor, h: Tensor, cost: Cost) -> bool:
        """Can the CPU kernels give barycentres here (squared-Euclidean-type cost, D <= 3)?"""
        return self._native(x, h) and cost.is_dot and not getattr(cost, "bilinear", False) and x.shape[-1] <= 3

    def softmin_pair_bary(self, x: Tensor, y: Tensor, hx: Tensor, hy: Tensor, eps: float, cost: Cost,
                          cols: bool) -> tuple[Tensor, Tensor, Tensor, Tensor | None] | None:
        """:meth:`softmin_pair` ``(f, g)`` and, from the same exponentials, the soft-argmin barycentres ``bx_i =
        sum_j w_ij y_j`` (1, N, D) of ``f = softmin(x, y, hy)`` (``w_ij = exp(hy_j - C_ij / eps + f_i / eps)``)
        and, with ``cols``, ``by`` (1, M, D) of ``g``: the final step's gradient ``2 s (x_i - bx_i)`` per unit
        of ``d value / d f_i`` without a plan-product pass.  None where the kernels cannot (then
        :meth:`softmin_pair` and plan products)."""
        if not (self._bary_ok(x, hx, cost) and self._native(y, hy)):
            return None
        pat = self.pattern(x, y)
        self.stats["pair_bary"] += 1
        rsum, csum, rb, cb = _pair_cpu(self._lib, pat, x, y, hx.contiguous(), hy.contiguous(), eps, cost, sym=False,
                                       bary=2 if cols else 1, tiles=self._tile_args(x, y, hx, hy, eps, cost))
        f, g = self._from_sums(rsum, hx, eps, x, y, hy, cost), self._from_sums(csum, hy, eps, y, x, hx, cost)
        bx = self._bary(rsum, rb, f, eps, x, y, hy, cost)
        return f, g, bx, (self._bary(csum, cb, g, eps, y, x, hx, cost) if cols else None)

    def softmin_sym_bary(self, x: Tensor, h: Tensor, eps: float, cost: Cost) -> tuple[Tensor, Tensor] | None:
        """:meth:`softmin_sym` and its barycentres ``b_i = sum_j w_ij x_j`` (1, N, D) from the same (half)
        exponentials (see :meth:`softmin_pair_bary`); None where the kernels cannot."""
        pat = self.pattern(x, x)
        if not (self._bary_ok(x, h, cost) and pat.symmetric):
            return None
        self.stats["sym_bary"] += 1
        rsum, csum, rb, cb = _pair_cpu(self._lib, pat, x, x, h.contiguous(), h.contiguous(), eps, cost, sym=True,
                                       bary=2, tiles=self._tile_args(x, x, h, h, eps, cost))
        sums = rsum + csum
        out = self._from_sums(sums, h, eps, x, x, h, cost)
        return out, self._bary(sums, rb + cb, out, eps, x, x, h, cost)

    def _bary(self, sums: Tensor, num: Tensor, out: Tensor, eps: float, pts: Tensor, other: Tensor,
              h_other: Tensor, cost: Cost) -> Tensor:
        """``num / sums`` (1, N, D); rows whose sum is unusable (as in :meth:`_from_sums`) are redone by the plan
        product ``sum_j exp(out_i / eps + h_j - C_ij / eps) [other_j, 1]`` on their row clusters.  Rows with
        no kept mass stay non-finite (their gradient is zero)."""
        from .cpu.engine import PAIR_MIN_SUM

        b = num / sums.unsqueeze(-1)
        bad = ~(torch.isfinite(sums) & (sums >= PAIR_MIN_SUM) & torch.isfinite(b).all(-1))
        if bool(bad.any()):
            self.stats["bary_fixup"] += int(bad.sum())
            sub, idx = self.pattern(pts, other).clusters_of(bad)
            V = torch.cat([other, torch.ones_like(other[..., :1])], -1).contiguous()
            S = _plan_cpu(self._lib, sub, pts[:, idx].contiguous(), other, (out[:, idx] / eps).contiguous(),
                          h_other.contiguous(), eps, V, cost, "plan")[0]
            sel = bad[idx]
            b[idx[sel]] = S[sel, :-1] / S[sel, -1:]
        return b.unsqueeze(0)

    def _from_sums(self, sums: Tensor, h: Tensor, eps: float, pts: Tensor, other: Tensor, h_other: Tensor,
                   cost: Cost) -> Tensor:
        """``-eps (log sums - h)``, (1, N); rows whose sum is unusable are recomputed by the block-sparse
        softmin on the row clusters that hold them."""
        from .cpu.engine import PAIR_MIN_SUM

        out = (-eps * (sums.log() - h[0])).unsqueeze(0)
        bad = ~(torch.isfinite(sums) & (sums >= PAIR_MIN_SUM))
        if bool(bad.any()):
            self.stats["fixup"] += int(bad.sum())
            sub, idx = self.pattern(pts, other).clusters_of(bad)
            redo = _softmin_cpu(self._lib, sub, pts[:, idx].contiguous(), other, h_other.contiguous(), eps, cost)
            sel = bad[idx]
            out[0, idx[sel]] = redo[0, sel]
        return out

    def plan_product(self, x, y, alpha, beta, eps, V, cost, weight: Weight = "plan",
                     rows: tuple[int, int] | None = None):
        """``out_i = sum_{j in kept(I(i))} exp(alpha_i + beta_j - C_ij / eps) W_ij V_j``, (1, N, K); with
        ``rows=(lo, hi)`` (whole row clusters) only those rows, (1, hi - lo, K)."""
        pat, x, lo = self._select(x, y, rows)
        alpha = alpha[:, lo:lo + x.shape[1]]
        if pat is None:
            return V.new_zeros((1, 0, V.shape[-1]))
        if self._triton is not None:
            return self._triton.plan_product_blocks(x, y, alpha, beta, eps, V, cost, _lists(pat, x.device),
                                                    weight).to(V.dtype)
        if self._lib is not None and 1 <= V.shape[-1] <= NARROW_K and V.dtype == x.dtype == alpha.dtype == beta.dtype:
            return _plan_cpu(self._lib, pat, x, y, alpha, beta, eps, V.contiguous(), cost, weight)
        out = torch.zeros(1, x.shape[1], V.shape[-1], dtype=x.dtype, device=x.device)
        for rows, cols in pat.batches:
            S, C = self._scores(x, y, beta, rows, cols, eps, cost)
            Vg = torch.where((cols >= 0).unsqueeze(-1), _gather(V[0], cols), torch.zeros((), dtype=V.dtype))
            res = weighted_product(S, C, _gather(alpha[0], rows).unsqueeze(-1), Vg, cost, weight)
            valid = rows >= 0
            out[0, rows[valid]] = res[valid]
        return out
