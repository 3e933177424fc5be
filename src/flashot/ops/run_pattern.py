"""Block patterns where every row cluster keeps ONE run of consecutive column clusters (:class:`RunPattern`),
built in memory linear in the clusters: the block-diagonal patterns of ragged batches (:mod:`flashot.ragged`).

A :class:`~flashot.ops.block_pattern.BlockPattern` stores its kept blocks as a dense ``(Kx, Ky)`` boolean
matrix, which a batch of ``B`` problems would make ``O(B^2)``.  Here row cluster ``I`` keeps the column
clusters ``[lo_I, hi_I)``: the C++ kernels' padded layout, the Triton kernels' lists and the PyTorch path's
padded batches are built from these two vectors directly, and the dense ``keep`` matrix only on demand (the
distributed helpers', which ragged batches do not use).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .block_pattern import BlockPattern, PaddedColumns
from .tiled import TILE_ELEMS

__all__ = ["RunPattern"]


class RunPattern(BlockPattern):
    """Row cluster ``I`` (rows ``[row_offsets[I], row_offsets[I + 1])``) keeps the column clusters ``[lo[I],
    hi[I])`` of ``col_offsets``.

    Args:
        row_offsets, col_offsets: (Kx + 1,), (Ky + 1,) int64 cluster boundaries.
        lo, hi: (Kx,) int64, ``0 <= lo < hi <= Ky``: the kept run of each row cluster.
        symmetric: the caller asserts ``row_offsets == col_offsets`` and that the kept blocks are symmetric
            (``softmin_sym`` then computes the blocks on and right of the diagonal only).
    """

    def __init__(
        self,
        row_offsets: Tensor,
        col_offsets: Tensor,
        lo: Tensor,
        hi: Tensor,
        *,
        symmetric: bool = False,
        tile_elems: int = TILE_ELEMS,
    ):
        self.row_offsets, self.col_offsets, self.lo, self.hi = row_offsets, col_offsets, lo, hi
        self.tile_elems = int(tile_elems)
        self.n_rows, self.n_cols = int(row_offsets[-1]), int(col_offsets[-1])
        if lo.numel() != row_offsets.numel() - 1 or bool((lo >= hi).any()):
            raise ValueError("RunPattern: every row cluster must keep a non-empty run of column clusters")
        self._rs = row_offsets[1:] - row_offsets[:-1]
        self._k_row = col_offsets[hi] - col_offsets[lo]  # kept columns of each row cluster
        self.pairs = int((self._rs * self._k_row).sum())
        self._symmetric = bool(symmetric)

    @property
    def n_row_clusters(self) -> int:
        return self.lo.numel()

    @property
    def keep(self) -> Tensor:  # type: ignore[override]
        """The dense ``(Kx, Ky)`` kept blocks, built on first use (not by the solver's paths)."""
        if "_keep" not in self.__dict__:
            j = torch.arange(self.col_offsets.numel() - 1, device=self.lo.device)
            self._keep = (j[None] >= self.lo[:, None]) & (j[None] < self.hi[:, None])
        return self._keep

    @property
    def _IJ(self) -> tuple[Tensor, Tensor]:  # the kept blocks (digest)
        n = self.hi - self.lo
        I = torch.repeat_interleave(torch.arange(n.numel(), device=n.device), n)
        J = torch.arange(int(n.sum()), device=n.device) - torch.repeat_interleave(torch.cumsum(n, 0) - n, n)
        return I, J + self.lo[I]

    @property
    def symmetric(self) -> bool:  # type: ignore[override]
        return self._symmetric

    @property
    def T(self) -> BlockPattern:  # type: ignore[override]
        raise NotImplementedError("RunPattern.T: build the transposed runs explicitly")

    def padded(self, unit: int) -> PaddedColumns:
        """The C++ kernels' layout (see :meth:`BlockPattern.padded`): one column range per row cluster; ``banded``
        where the runs move right with the row cluster (a ragged batch's patterns)."""
        cache = self.__dict__.setdefault("_padded", {})
        if unit not in cache:
            co, ro = self.col_offsets.cpu(), self.row_offsets.cpu()
            sizes = co[1:] - co[:-1]
            poff = torch.zeros_like(co)
            poff[1:] = torch.cumsum((sizes + unit - 1) // unit * unit, 0)
            cid = torch.repeat_interleave(torch.arange(sizes.shape[0]), sizes)
            pos = poff[cid] + torch.arange(int(co[-1])) - co[cid]
            lo, hi = self.lo.cpu(), self.hi.cpu()
            K = lo.numel()
            ranges = torch.stack([poff[lo], poff[hi]], -1).reshape(-1).contiguous()
            tasks = torch.stack([ro[:-1], ro[1:], torch.arange(K)], -1).reshape(-1).contiguous()
            banded = bool((lo[1:] >= lo[:-1]).all() and (hi[1:] >= hi[:-1]).all())
            cache[unit] = PaddedColumns(
                pos, int(poff[-1]), tasks, torch.arange(K + 1), ranges, poff.contiguous(), banded=banded
            )
        return cache[unit]

    def clusters_of(self, rows: Tensor) -> tuple[RunPattern, Tensor]:
        """The pattern restricted to the row clusters holding a ``True`` of ``rows`` (n_rows,) bool, and the
        indices of their rows (see :meth:`BlockPattern.clusters_of`)."""
        ro = self.row_offsets.cpu()
        sizes = ro[1:] - ro[:-1]
        cid = torch.repeat_interleave(torch.arange(sizes.numel()), sizes)
        hit = torch.zeros(sizes.numel(), dtype=torch.bool)
        hit[cid[rows.cpu()]] = True
        k = hit.nonzero().squeeze(1)
        offsets = torch.zeros(k.numel() + 1, dtype=torch.long)
        offsets[1:] = torch.cumsum(sizes[k], 0)
        index = hit[cid].nonzero().squeeze(1)
        dev = self.row_offsets.device
        kd = k.to(self.lo.device)
        sub = RunPattern(offsets.to(dev), self.col_offsets, self.lo[kd], self.hi[kd], tile_elems=self.tile_elems)
        return sub, index.to(rows.device)

    @property
    def batches(self) -> list[tuple[Tensor, Tensor]]:  # type: ignore[override]
        """The PyTorch path's padded ``(rows, cols)`` index batches (``-1`` = padding): row clusters in
        decreasing order of kept columns, grouped while the padded group holds at most ``tile_elems`` scores."""
        if "_run_batches" not in self.__dict__:
            ro, co = self.row_offsets.tolist(), self.col_offsets.tolist()
            lo, hi, rs, kr = self.lo.tolist(), self.hi.tolist(), self._rs.tolist(), self._k_row.tolist()
            order = sorted(range(len(lo)), key=lambda i: -kr[i])
            out, group, n_max, k_max = [], [], 0, 0
            for i in order:
                n2, k2 = max(n_max, rs[i]), max(k_max, kr[i])
                if group and (len(group) + 1) * n2 * k2 > self.tile_elems:
                    out.append(self._run_batch(group, n_max, k_max, ro, co, lo, hi))
                    group, n2, k2 = [], rs[i], kr[i]
                group.append(i)
                n_max, k_max = n2, k2
            out.append(self._run_batch(group, n_max, k_max, ro, co, lo, hi))
            self._run_batches = out
        return self._run_batches

    def _run_batch(self, group, n_max, k_max, ro, co, lo, hi) -> tuple[Tensor, Tensor]:
        dev = self.row_offsets.device
        rows = torch.full((len(group), n_max), -1, dtype=torch.long, device=dev)
        cols = torch.full((len(group), k_max), -1, dtype=torch.long, device=dev)
        for g, i in enumerate(group):
            rows[g, : ro[i + 1] - ro[i]] = torch.arange(ro[i], ro[i + 1], device=dev)
            c0, c1 = co[lo[i]], co[hi[i]]
            cols[g, : c1 - c0] = torch.arange(c0, c1, device=dev)
        return rows, cols
