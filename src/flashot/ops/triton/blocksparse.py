"""The multiscale engine's block lists in the layout of the Triton block-sparse kernels.

A :class:`~flashot.ops.blocksparse.BlockPattern` keeps, for every row cluster ``I``, some column
clusters; runs of consecutive kept clusters are merged into column ranges ``[start, end)`` of the
(cluster-sorted) column cloud.  The kernels (:func:`.kernels.softmin_bs_kernel`,
:func:`.kernels.plan_bs_kernel`) run one program per row *tile*: at most ``BLOCK_N`` rows of one
row cluster, so a large cluster is split over several programs and a small one wastes the rest of
its tile (the pattern's clusters should hold about ``BLOCK_N`` points or more)::

    softmin:       out_i = -eps log sum_{j in kept(I(i))} exp(h_j - C_ij / eps)
    plan_product:  out_i = sum_{j in kept(I(i))} exp(alpha_i + beta_j - C_ij / eps) W_ij V_j
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["BlockLists"]


class BlockLists:
    """``cptr`` (Kx + 1,) and ``ranges`` (2 R,) int64: the kept column ranges of each row cluster;
    :meth:`tiles` the (first row, end row, row cluster) triples of the row tiles, per tile height."""

    def __init__(self, row_offsets: Tensor, cptr: Tensor, ranges: Tensor):
        self.row_offsets, self.cptr, self.ranges = row_offsets, cptr, ranges
        self._tiles: dict[int, Tensor] = {}

    @classmethod
    def of(cls, pattern, device: torch.device) -> BlockLists:
        """The lists of ``pattern`` (a :class:`~flashot.ops.blocksparse.BlockPattern`) on ``device``,
        cached on the pattern.  ``pattern.padded(1)`` is the unpadded layout: its ranges are column
        indices."""
        cache = pattern.__dict__.setdefault("_triton_lists", {})
        if device not in cache:
            lay = pattern.padded(1)
            cache[device] = cls(pattern.row_offsets.cpu(), lay.cptr.to(device), lay.ranges.to(device))
        return cache[device]

    def tiles(self, block_n: int) -> Tensor:
        """(3 T,) int64 ``(first row, end row, row cluster)`` per tile of at most ``block_n`` rows."""
        if block_n not in self._tiles:
            ro = self.row_offsets
            sizes = ro[1:] - ro[:-1]
            per = (sizes + block_n - 1) // block_n  # tiles of each cluster (0 for an empty cluster)
            cl = torch.repeat_interleave(torch.arange(sizes.shape[0]), per)
            first = torch.cumsum(per, 0) - per
            k = torch.arange(int(per.sum())) - torch.repeat_interleave(first, per)
            start = ro[cl] + k * block_n
            end = torch.minimum(start + block_n, ro[cl + 1])
            self._tiles[block_n] = torch.stack([start, end, cl], -1).reshape(-1).to(self.cptr.device)
        return self._tiles[block_n]
