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

import os

import torch
from torch import Tensor

from ..costs import Cost
from .base import Capability, Engine, Weight
from .block_pattern import BlockPattern, PaddedColumns  # noqa: F401  (PaddedColumns: kept importable here)
from .blocksparse_cpu import TileArgs, cpu_lib, pair_cpu, plan_cpu, softmin_cpu
from .dense import lse_last, weighted_product
from .tile_rule import TILE_MAX_D, TilePruning, tile_args

# the C++ calls' former names (tests and scripts import them from here)
_cpu_lib, _pair_cpu = cpu_lib, pair_cpu

NARROW_K = 4  # plan products with V of at most this many columns run in the C++ kernels (PV_K)


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


class BlockSparseEngine(Engine):
    """The two primitives over the kept blocks of fixed patterns (one problem; see the module docstring).

    ``patterns`` maps ``(row cloud, column cloud)`` tensors (B = 1) to their :class:`BlockPattern`.
    ``native``: ``True`` runs the C++ kernels on the CPU and the Triton kernels on CUDA tensors (PyTorch
    where neither is available), ``False`` PyTorch only, ``"triton"`` the Triton kernels (on CPU tensors
    under ``TRITON_INTERPRET=1``: how they are tested).  The environment variable ``FLASHOT_BLOCKSPARSE``
    (``torch`` or ``triton``) overrides ``native=True``.
    """

    name = "multiscale"
    # FUSED_FINAL_STEP: the solver's final step takes softmin_pair (ops.autograd.softmin_pair_fn), since the fine
    # stage runs few iterations; ROW_RANGES: row_bounds / digest and rows= (a distributed solve's slices)
    capabilities = frozenset(
        {
            Capability.SOFTMIN_PAIR,
            Capability.SOFTMIN_SYM,
            Capability.SOFTMIN_PAIR_BARY,
            Capability.SOFTMIN_SYM_BARY,
            Capability.FUSED_FINAL_STEP,
            Capability.ROW_RANGES,
        }
    )

    def __init__(
        self,
        patterns: list[tuple[Tensor, Tensor, BlockPattern]],
        *,
        native: bool | str = True,
        tiles: TilePruning | None = None,
    ):
        self._patterns = {(self.cloud_key(u), self.cloud_key(v)): p for u, v, p in patterns}
        self._tiles = tiles
        self.tile_pairs = [0]  # pairs the fused C++ steps evaluated with sub-tile pruning (padded columns included)
        native = _kernels_choice(native)
        on_cpu = all(u.device.type == "cpu" and u.dtype in (torch.float32, torch.float64) for u, _, _ in patterns)
        on_cuda = all(u.device.type == "cuda" for u, _, _ in patterns)
        self._lib = cpu_lib(patterns[0][0].dtype) if native is True and on_cpu and patterns else None
        self._triton = _triton_engine() if native == "triton" or (native is True and on_cuda) else None
        # fused C++ calls, the rows / columns whose potentials they recomputed and whose barycentres they redid
        self.stats = {"pair": 0, "sym": 0, "pair_bary": 0, "sym_bary": 0, "fixup": 0, "bary_fixup": 0}

    @staticmethod
    def cloud_key(t: Tensor):
        """A cloud's identity for the engine's patterns: its storage, shape and dtype (not its values)."""
        return t.data_ptr(), tuple(t.shape), t.dtype

    def unsupported(self, device, dtype, cost):
        return None

    def pattern(self, x: Tensor, y: Tensor) -> BlockPattern:
        p = self._patterns.get((self.cloud_key(x), self.cloud_key(y)))
        if p is None:
            raise RuntimeError(
                "multiscale engine: called on a pair of clouds it has no block pattern for "
                "(it is bound to one problem; this is a flashot bug, please report it)"
            )
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

    def softmin(
        self, x: Tensor, y: Tensor, h: Tensor, eps: float, cost: Cost, rows: tuple[int, int] | None = None
    ) -> Tensor:
        """``out_i = -eps log sum_{j in kept(I(i))} exp(h_j - C_ij / eps)``, (1, N); with ``rows=(lo, hi)``
        (whole row clusters) only those rows, (1, hi - lo)."""
        pat, x, _ = self._select(x, y, rows)
        if pat is None:
            return x.new_empty((1, 0))
        if self._triton is not None:
            return self._triton.softmin_blocks(x, y, h, eps, cost, _lists(pat, x.device)).to(x.dtype)
        if self._lib is not None and h.dtype == x.dtype:
            return softmin_cpu(self._lib, pat, x, y, h.contiguous(), eps, cost)
        out = torch.empty(1, x.shape[1], dtype=x.dtype, device=x.device)
        for rows, cols in pat.batches:
            S, _ = self._scores(x, y, h, rows, cols, eps, cost)
            lse = lse_last(S).squeeze(-1)
            valid = rows >= 0
            out[0, rows[valid]] = -eps * lse[valid]
        return out

    def _native(self, *ts: Tensor) -> bool:
        return self._lib is not None and all(t.dtype == ts[0].dtype for t in ts)

    def softmin_pair(
        self, x: Tensor, y: Tensor, hx: Tensor, hy: Tensor, eps: float, cost: Cost
    ) -> tuple[Tensor, Tensor]:
        """``(softmin(x, y, hy), softmin(y, x, hx))`` over the kept blocks; on the CPU kernels one exponential
        per kept pair gives both (``s_ij = hx_i + hy_j - C_ij / eps``: ``softmin(x, y, hy)_i = -eps (log sum_j
        e^{s_ij} - hx_i)``, the same for the columns), as :meth:`flashot.ops.cpu.CpuEngine.softmin_pair`: rows
        and columns whose sum is not finite or below ``PAIR_MIN_SUM`` are recomputed by :meth:`softmin`."""
        pat = self.pattern(x, y)
        if not self._native(x, y, hx, hy):
            return self.softmin(x, y, hy, eps, cost), self.softmin(y, x, hx, eps, cost)
        self.stats["pair"] += 1
        rsum, csum, _, _ = pair_cpu(
            self._lib,
            pat,
            x,
            y,
            hx.contiguous(),
            hy.contiguous(),
            eps,
            cost,
            sym=False,
            tiles=self._tile_args(x, y, hx, hy, eps, cost),
        )
        return self._from_sums(rsum, hx, eps, x, y, hy, cost), self._from_sums(csum, hy, eps, y, x, hx, cost)

    def softmin_sym(self, x: Tensor, h: Tensor, eps: float, cost: Cost) -> Tensor:
        """``softmin(x, x, h)`` over the kept blocks; on the CPU kernels, for a symmetric pattern, from the
        blocks on and right of the diagonal only (``s_ij = h_i + h_j - C_ij / eps`` is symmetric): about half
        the exponentials.  Same safeguards as :meth:`softmin_pair`."""
        pat = self.pattern(x, x)
        if not (self._native(x, h) and pat.symmetric):
            return self.softmin(x, x, h, eps, cost)
        self.stats["sym"] += 1
        rsum, csum, _, _ = pair_cpu(
            self._lib,
            pat,
            x,
            x,
            h.contiguous(),
            h.contiguous(),
            eps,
            cost,
            sym=True,
            tiles=self._tile_args(x, x, h, h, eps, cost),
        )
        return self._from_sums(rsum + csum, h, eps, x, x, h, cost)

    def _tile_args(self, x: Tensor, y: Tensor, hx: Tensor, hy: Tensor, eps: float, cost: Cost) -> TileArgs | None:
        """:func:`pair_cpu`'s ``tiles`` for the fused call on ``(x, y)`` (``y`` is ``x``: a symmetric step) from the
        log-weights of :class:`TilePruning` (None without): :func:`~flashot.ops.tile_rule.tile_args`.  None for
        ``D > TILE_MAX_D``: the kernels prune no tiles there, so the output bounds (whose barycentres the
        kernels give for ``D <= 3`` only) would be work for nothing."""
        t = self._tiles
        if t is None or x.shape[-1] > TILE_MAX_D:
            return None
        la, lb = t.log_weights.get(self.cloud_key(x)), t.log_weights.get(self.cloud_key(y))
        if la is None or lb is None:
            return None
        back = None if x is y else self._patterns.get((self.cloud_key(y), self.cloud_key(x)))
        return tile_args(
            self._lib, self.pattern(x, y), back, x, y, hx, hy, la, lb, eps, cost, t.truncate, self.tile_pairs
        )

    def _bary_ok(self, x: Tensor, h: Tensor, cost: Cost) -> bool:
        """Can the CPU kernels give barycentres here (squared-Euclidean-type cost, D <= 3)?"""
        return self._native(x, h) and cost.is_dot and not getattr(cost, "bilinear", False) and x.shape[-1] <= 3

    def softmin_pair_bary(
        self, x: Tensor, y: Tensor, hx: Tensor, hy: Tensor, eps: float, cost: Cost, cols: bool
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None] | None:
        """:meth:`softmin_pair` ``(f, g)`` and, from the same exponentials, the soft-argmin barycentres ``bx_i =
        sum_j w_ij y_j`` (1, N, D) of ``f = softmin(x, y, hy)`` (``w_ij = exp(hy_j - C_ij / eps + f_i / eps)``)
        and, with ``cols``, ``by`` (1, M, D) of ``g``: the final step's gradient ``2 s (x_i - bx_i)`` per unit
        of ``d value / d f_i`` without a plan-product pass.  None where the kernels cannot (then
        :meth:`softmin_pair` and plan products)."""
        if not (self._bary_ok(x, hx, cost) and self._native(y, hy)):
            return None
        pat = self.pattern(x, y)
        self.stats["pair_bary"] += 1
        rsum, csum, rb, cb = pair_cpu(
            self._lib,
            pat,
            x,
            y,
            hx.contiguous(),
            hy.contiguous(),
            eps,
            cost,
            sym=False,
            bary=2 if cols else 1,
            tiles=self._tile_args(x, y, hx, hy, eps, cost),
        )
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
        rsum, csum, rb, cb = pair_cpu(
            self._lib,
            pat,
            x,
            x,
            h.contiguous(),
            h.contiguous(),
            eps,
            cost,
            sym=True,
            bary=2,
            tiles=self._tile_args(x, x, h, h, eps, cost),
        )
        sums = rsum + csum
        out = self._from_sums(sums, h, eps, x, x, h, cost)
        return out, self._bary(sums, rb + cb, out, eps, x, x, h, cost)

    def _bary(
        self,
        sums: Tensor,
        num: Tensor,
        out: Tensor,
        eps: float,
        pts: Tensor,
        other: Tensor,
        h_other: Tensor,
        cost: Cost,
    ) -> Tensor:
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
            S = plan_cpu(
                self._lib,
                sub,
                pts[:, idx].contiguous(),
                other,
                (out[:, idx] / eps).contiguous(),
                h_other.contiguous(),
                eps,
                V,
                cost,
                "plan",
            )[0]
            sel = bad[idx]
            b[idx[sel]] = S[sel, :-1] / S[sel, -1:]
        return b.unsqueeze(0)

    def _from_sums(
        self, sums: Tensor, h: Tensor, eps: float, pts: Tensor, other: Tensor, h_other: Tensor, cost: Cost
    ) -> Tensor:
        """``-eps (log sums - h)``, (1, N); rows whose sum is unusable are recomputed by the block-sparse
        softmin on the row clusters that hold them."""
        from .cpu.engine import PAIR_MIN_SUM

        out = (-eps * (sums.log() - h[0])).unsqueeze(0)
        bad = ~(torch.isfinite(sums) & (sums >= PAIR_MIN_SUM))
        if bool(bad.any()):
            self.stats["fixup"] += int(bad.sum())
            sub, idx = self.pattern(pts, other).clusters_of(bad)
            redo = softmin_cpu(self._lib, sub, pts[:, idx].contiguous(), other, h_other.contiguous(), eps, cost)
            sel = bad[idx]
            out[0, idx[sel]] = redo[0, sel]
        return out

    def plan_product(
        self, x, y, alpha, beta, eps, V, cost, weight: Weight = "plan", rows: tuple[int, int] | None = None
    ):
        """``out_i = sum_{j in kept(I(i))} exp(alpha_i + beta_j - C_ij / eps) W_ij V_j``, (1, N, K); with
        ``rows=(lo, hi)`` (whole row clusters) only those rows, (1, hi - lo, K)."""
        pat, x, lo = self._select(x, y, rows)
        alpha = alpha[:, lo : lo + x.shape[1]]
        if pat is None:
            return V.new_zeros((1, 0, V.shape[-1]))
        if self._triton is not None:
            return self._triton.plan_product_blocks(x, y, alpha, beta, eps, V, cost, _lists(pat, x.device), weight).to(
                V.dtype
            )
        if self._lib is not None and 1 <= V.shape[-1] <= NARROW_K and V.dtype == x.dtype == alpha.dtype == beta.dtype:
            return plan_cpu(self._lib, pat, x, y, alpha, beta, eps, V.contiguous(), cost, weight)
        out = torch.zeros(1, x.shape[1], V.shape[-1], dtype=x.dtype, device=x.device)
        for rows, cols in pat.batches:
            S, C = self._scores(x, y, beta, rows, cols, eps, cost)
            Vg = torch.where((cols >= 0).unsqueeze(-1), _gather(V[0], cols), torch.zeros((), dtype=V.dtype))
            res = weighted_product(S, C, _gather(alpha[0], rows).unsqueeze(-1), Vg, cost, weight)
            valid = rows >= 0
            out[0, rows[valid]] = res[valid]
        return out
