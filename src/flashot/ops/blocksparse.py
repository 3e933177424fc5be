r"""Block-sparse versions of the two primitives (the ``multiscale`` engine), in PyTorch on any device.

The points of both clouds are sorted by cluster (:mod:`flashot.clusters`), so a cluster is a
contiguous slice.  A :class:`BlockPattern` lists, for every row cluster ``I``, the column
clusters ``J`` whose block is kept; the primitives then sum over kept blocks only::

    softmin:       out_i = -eps log sum_{j in kept(I(i))} exp(h_j - C_ij / eps)
    plan_product:  out_i = sum_{j in kept(I(i))} exp(alpha_i + beta_j - C_ij / eps) W_ij V_j

For speed in PyTorch, row clusters with similar numbers of kept columns are packed into padded
batches (at most ``TILE_ELEMS`` scores each): the rows and the gathered columns of one batch are
one batched GEMM and one LogSumExp, padding entering as ``-inf`` log-weights (exactly nothing).
The engine is bound to its problem: :class:`BlockSparseEngine` maps the (row cloud, column cloud)
pairs that the solver passes (identified by their storage) to their patterns, and raises on any
other pair rather than computing a different sum.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..costs import Cost
from .base import Weight
from .dense import _exp_shifted, _lse_last
from .tiled import TILE_ELEMS


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
        # flat column indices of the kept blocks, row cluster after row cluster
        starts = torch.repeat_interleave(col_offsets[J] - (torch.cumsum(width, 0) - width), width)
        self._cols = starts + torch.arange(int(width.sum()), device=keep.device)
        self._ptr = torch.zeros(keep.shape[0] + 1, dtype=torch.long, device=keep.device)
        self._ptr[1:] = torch.cumsum(k_row, 0)
        self.batches = self._pack(rs, k_row)

    @property
    def fraction(self) -> float:
        """Kept pairs over all ``N M`` pairs."""
        return self.pairs / (self.n_rows * self.n_cols)

    @property
    def T(self) -> "BlockPattern":
        return BlockPattern(self.col_offsets, self.row_offsets, self.keep.T, self.tile_elems)

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


def _gather(t: Tensor, idx: Tensor) -> Tensor:
    """``t[idx]`` along dim 0 with ``-1`` entries reading row 0 (masked by the caller)."""
    return t[idx.clamp_min(0)]


class BlockSparseEngine:
    """The two primitives over the kept blocks of fixed patterns (one problem; see the module docstring).

    ``patterns`` maps ``(row cloud, column cloud)`` tensors (B = 1) to their :class:`BlockPattern`.
    """

    name = "multiscale"

    def __init__(self, patterns: list[tuple[Tensor, Tensor, BlockPattern]]):
        self._patterns = {(self._key(u), self._key(v)): p for u, v, p in patterns}

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

    def _scores(self, x: Tensor, y: Tensor, h: Tensor, rows: Tensor, cols: Tensor, eps: float, cost: Cost):
        """(G, n, k) scores ``h_j - C_ij / eps`` of one batch (padding columns -inf) and its cost block."""
        xg, yg = _gather(x[0], rows), _gather(y[0], cols)
        C = cost.tile(xg, yg)
        hg = torch.where(cols >= 0, _gather(h[0], cols), torch.full_like(cols, float("-inf"), dtype=h.dtype))
        return hg.unsqueeze(-2) - C / eps, C

    def softmin(self, x: Tensor, y: Tensor, h: Tensor, eps: float, cost: Cost) -> Tensor:
        pat = self.pattern(x, y)
        out = torch.empty(1, x.shape[1], dtype=x.dtype, device=x.device)
        for rows, cols in pat.batches:
            S, _ = self._scores(x, y, h, rows, cols, eps, cost)
            lse = _lse_last(S).squeeze(-1)
            valid = rows >= 0
            out[0, rows[valid]] = -eps * lse[valid]
        return out

    def plan_product(self, x, y, alpha, beta, eps, V, cost, weight: Weight = "plan"):
        pat = self.pattern(x, y)
        out = torch.zeros(1, x.shape[1], V.shape[-1], dtype=x.dtype, device=x.device)
        for rows, cols in pat.batches:
            S, C = self._scores(x, y, beta, rows, cols, eps, cost)
            m = S.amax(-1, keepdim=True).clamp_min(torch.finfo(S.dtype).min)
            P = _exp_shifted(S, m)
            if weight == "cost":
                P = P * C
            elif weight == "dcost":
                P = P * cost.dcost_weight(C)
            Vg = torch.where((cols >= 0).unsqueeze(-1), _gather(V[0], cols), torch.zeros((), dtype=V.dtype))
            a = _gather(alpha[0], rows).unsqueeze(-1)
            res = (P @ Vg) * torch.exp(a + m)
            valid = rows >= 0
            out[0, rows[valid]] = res[valid]
        return out
