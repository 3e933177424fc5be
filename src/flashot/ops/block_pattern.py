"""The kept blocks of a block-sparse problem (:class:`BlockPattern`) and the C++ kernels' padded layout of its
columns (:class:`PaddedColumns`): the data the ``multiscale`` engine (:mod:`flashot.ops.blocksparse`), its C++
calls (:mod:`flashot.ops.blocksparse_cpu`) and its Triton kernels share."""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor

from .tiled import TILE_ELEMS

__all__ = ["BlockPattern", "PaddedColumns"]


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
            self._symmetric = bool(
                self.keep.shape[0] == self.keep.shape[1]
                and torch.equal(self.row_offsets, self.col_offsets)
                and torch.equal(self.keep, self.keep.T)
            )
        return self._symmetric

    @property
    def T(self) -> BlockPattern:
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

    def rows(self, lo: int, hi: int) -> BlockPattern:
        """The pattern of the rows ``[lo, hi)``, a non-empty range of whole row clusters (row offsets from
        ``lo``; the same kept blocks).  ``ValueError`` if ``lo`` or ``hi`` is not a cluster boundary.
        Cached per range."""
        cache = self.__dict__.setdefault("_rows", {})
        if (lo, hi) not in cache:
            ro = self.row_offsets.cpu()
            k0, k1 = (int(torch.searchsorted(ro, torch.tensor([v]))[0]) for v in (lo, hi))
            if not (0 <= lo < hi <= self.n_rows) or int(ro[k0]) != lo or int(ro[k1]) != hi:
                raise ValueError(
                    f"rows: [{lo}, {hi}) is not a non-empty range of whole row clusters of this pattern "
                    f"({self.keep.shape[0]} clusters over {self.n_rows} rows)"
                )
            cache[(lo, hi)] = BlockPattern(
                self.row_offsets[k0 : k1 + 1] - lo, self.col_offsets, self.keep[k0:k1], self.tile_elems
            )
        return cache[(lo, hi)]

    def clusters_of(self, rows: Tensor) -> tuple[BlockPattern, Tensor]:
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

    def padded(self, unit: int) -> PaddedColumns:
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
            cols[g, : ptr[I + 1] - ptr[I]] = self._cols[ptr[I] : ptr[I + 1]]
        return rows, cols


class PaddedColumns:
    """The C++ block-sparse softmin's view of a :class:`BlockPattern` (see :meth:`BlockPattern.padded`):
    ``pos`` (M,) padded position of each column, ``width`` the padded number of columns, ``tasks``
    (3 Kx,) ``(first row, end row, row cluster)`` per row cluster, ``cptr`` (Kx + 1,) and ``ranges``
    (2 R,) the kept column ranges ``[start, end)`` of each row cluster, ``offsets`` (Ky + 1,) the padded
    column offsets of the clusters.  ``banded``: the row clusters' column ranges move right with the cluster (a
    ragged batch's block-diagonal pattern), so the C++ pair kernel sums the columns of runs of consecutive row
    clusters over their own columns only (``ColSpans`` in ``cpu/colsum.h``) instead of in full-width buffers."""

    def __init__(
        self,
        pos: Tensor,
        width: int,
        tasks: Tensor,
        cptr: Tensor,
        ranges: Tensor,
        offsets: Tensor,
        banded: bool = False,
    ):
        self.pos, self.width, self.tasks, self.cptr, self.ranges = pos, width, tasks, cptr, ranges
        self.offsets, self.banded = offsets, banded
        self.points = None  # (key, yT, yy, y): the column cloud in this layout (padded_y's cache)

    @classmethod
    def build(cls, pat: BlockPattern, unit: int) -> PaddedColumns:
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
