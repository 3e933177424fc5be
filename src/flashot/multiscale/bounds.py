r"""Block pruning: lower bounds of :math:`C(x_i, y_j) - f_i - g_j` over the blocks of two clusterings, and
the blocks they keep at a margin (in the C++ kernels of ``prune.h`` where they load, else in PyTorch)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from ..clusters import Clusters
from ..costs import CostLike
from ..ops.cpu import abi
from .hierarchies import Hierarchy
from .linear import linear_model, segment_max


class _Linear(NamedTuple):
    """The linear-model terms of :class:`_Terms` (dot-product costs)."""

    base: Tensor
    beta: Tensor
    bb: Tensor
    bc: Tensor
    shifted: Tensor


@dataclass(frozen=True)
class _Terms:
    """Per-cluster terms of the block bounds of one side (float64): centroids ``c``, radii ``r``, the maxima
    ``m`` of the potential and, for dot-product costs (linear models), ``base = alpha + rho``, ``beta``,
    ``|beta|^2``, ``<beta, c>`` and ``c - beta / 2s``."""

    c: Tensor
    r: Tensor
    m: Tensor
    base: Tensor | None = None
    beta: Tensor | None = None
    bb: Tensor | None = None
    bc: Tensor | None = None
    shifted: Tensor | None = None

    def linear(self) -> _Linear:
        """The linear model's terms, present when :meth:`build` had the points and the dot-product scale."""
        base, beta, bb, bc, shifted = self.base, self.beta, self.bb, self.bc, self.shifted
        assert base is not None and beta is not None and bb is not None and bc is not None and shifted is not None
        return _Linear(base, beta, bb, bc, shifted)

    def rows(self, sel: slice) -> _Terms:
        """The terms of the clusters ``sel``."""
        rest = (None if t is None else t[sel] for t in (self.base, self.beta, self.bb, self.bc, self.shifted))
        return _Terms(self.c[sel], self.r[sel], self.m[sel], *rest)

    @classmethod
    def build(cls, cl: Clusters, f: Tensor, pts: Tensor | None, s: float | None) -> _Terms:
        c, r, m = cl.centroids.double(), cl.radius.double(), segment_max(f.double(), cl)
        if pts is None or s is None:
            return cls(c, r, m)
        lm = linear_model(cl, pts, f)
        return cls(
            c,
            r,
            m,
            lm.alpha + lm.rho,
            lm.beta,
            (lm.beta * lm.beta).sum(-1),
            (lm.beta * c).sum(-1),
            c - lm.beta / (2 * s),
        )


def _linear_dense(X: _Terms, Y: _Terms, s: float) -> Tensor:
    r"""(Kx, Ky) lower bounds of ``s |x_i - y_j|^2 - f_i - g_j`` over blocks, from the linear models: with
    ``x_i = c_I + a``, ``y_j = c_J + b``, ``d = c_I - c_J``,
    :math:`s|d + a - b|^2 - \langle\beta, a\rangle - \langle\gamma, b\rangle = s|d + a - b - \beta/2s|^2
    + \langle\beta, d\rangle - |\beta|^2/4s - \langle\beta + \gamma, b\rangle`, bounded with ``|a - b| <=
    r_I + r_J`` and ``|b| <= r_J`` (and the same with the roles swapped; the larger bound is kept).
    Exact up to the radii for a transport by translation, where ``f`` and ``g`` are affine."""
    XL, YL = X.linear(), Y.linear()
    bg = (XL.bb[:, None] + YL.bb[None] + 2.0 * XL.beta @ YL.beta.T).clamp_min(0.0).sqrt()  # |beta_I + gamma_J|
    rr = X.r[:, None] + Y.r[None]
    gap1 = (torch.cdist(XL.shifted, Y.c) - rr).clamp_min(0.0)
    t1 = s * gap1 * gap1 + (XL.bc[:, None] - XL.beta @ Y.c.T) - (XL.bb / (4 * s))[:, None] - bg * Y.r[None]
    gap2 = (torch.cdist(X.c, YL.shifted) - rr).clamp_min(0.0)
    t2 = s * gap2 * gap2 + (YL.bc[None] - X.c @ YL.beta.T) - (YL.bb / (4 * s))[None] - bg * X.r[:, None]
    return -XL.base[:, None] - YL.base[None] + torch.maximum(t1, t2)


def _linear_pairs(X: _Terms, Y: _Terms, s: float, I: Tensor, J: Tensor) -> Tensor:
    """:func:`_linear_dense` at the blocks ``(I[k], J[k])`` only."""
    XL, YL = X.linear(), Y.linear()
    bI, gJ, cI, cJ = XL.beta[I], YL.beta[J], X.c[I], Y.c[J]
    bg = (bI + gJ).norm(dim=-1)
    rI, rJ = X.r[I], Y.r[J]
    rr = rI + rJ
    gap1 = ((XL.shifted[I] - cJ).norm(dim=-1) - rr).clamp_min(0.0)
    t1 = s * gap1 * gap1 + XL.bc[I] - (bI * cJ).sum(-1) - XL.bb[I] / (4 * s) - bg * rJ
    gap2 = ((cI - YL.shifted[J]).norm(dim=-1) - rr).clamp_min(0.0)
    t2 = s * gap2 * gap2 + YL.bc[J] - (cI * gJ).sum(-1) - YL.bb[J] / (4 * s) - bg * rI
    return -XL.base[I] - YL.base[J] + torch.maximum(t1, t2)


PRUNE_ROWS = 1024  # row clusters per chunk of dense bounds (memory O(PRUNE_ROWS Ky))
PRUNE_CHUNK = 1 << 22  # candidate blocks per chunk of sparse bounds
FLAT_ROWS = 16  # fine rows per task of the C++ pruning without a hierarchy


class BlockBounds:
    """Lower bounds of ``C(x_i, y_j) - f_i - g_j`` over the blocks ``(I, J)`` of two clusterings: the larger
    of the cost of the gap between the clusters' balls minus the maxima of the potentials, and (dot-product
    costs, sorted points given) the linear-model bound, much tighter where the potentials vary across a
    block.  Over every block, or with a pruning :class:`Hierarchy` over the fine blocks inside the coarse
    blocks kept at the margin given to :meth:`compute` (a coarse bound bounds each of its fine blocks, so
    no block below that margin is missed).  :meth:`keep` thresholds them: in the C++ kernels
    (``prune.h``) where they load, else in PyTorch."""

    def __init__(
        self,
        X: _Terms,
        Y: _Terms,
        cost: CostLike,
        s: float | None,
        coarse: Tensor | None,
        parents: Hierarchy | None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.X, self.Y, self.cost, self.s, self.coarse, self.parents = X, Y, cost, s, coarse, parents
        self.dtype = dtype  # the problem's: the C++ pruning runs in the block-sparse library of that dtype
        self.Kx, self.Ky = X.c.shape[0], Y.c.shape[0]

    @classmethod
    def compute(
        cls,
        cx: Clusters,
        cy: Clusters,
        f: Tensor,
        g: Tensor,
        cost: CostLike,
        x: Tensor | None = None,
        y: Tensor | None = None,
        parents: Hierarchy | None = None,
        margin: float = float("inf"),
    ) -> BlockBounds:
        s = cost.scale if cost.is_dot and x is not None and y is not None else None
        X, Y = _Terms.build(cx, f, x, s), _Terms.build(cy, g, y, s)
        coarse = None
        if parents is not None:
            coarse = cls.compute(parents.cx, parents.cy, f, g, cost, x, y, margin=margin).keep(margin)
        return cls(X, Y, cost, s, coarse, parents, f.dtype)

    def keep(self, margin: float) -> Tensor:
        """(Kx, Ky) kept blocks: bound <= ``margin``, plus each row's and each column's best block."""
        lib = _cpu_lib(self.dtype) if self.X.c.device.type == "cpu" else None
        if lib is not None:
            return self._keep_native(lib, margin)
        if self.coarse is None or self.parents is None:  # both given or neither (compute)
            rows = [self._dense(slice(r0, r0 + PRUNE_ROWS)) for r0 in range(0, self.Kx, PRUNE_ROWS)]
            B = torch.cat(rows)
            keep = B <= margin
            keep[torch.arange(self.Kx, device=B.device), B.argmin(1)] = True
            keep[B.argmin(0), torch.arange(self.Ky, device=B.device)] = True
            return keep
        I, J = _children(self.coarse, self.parents.px, self.parents.py)
        bound = torch.cat(
            [self._pairs(I[k : k + PRUNE_CHUNK], J[k : k + PRUNE_CHUNK]) for k in range(0, I.numel(), PRUNE_CHUNK)]
        )
        keep = torch.zeros(self.Kx, self.Ky, dtype=torch.bool, device=bound.device)
        ok = bound <= margin
        keep[I[ok], J[ok]] = True
        for idx, K in ((I, self.Kx), (J, self.Ky)):
            best = torch.full((K,), float("inf"), dtype=bound.dtype, device=bound.device)
            best.scatter_reduce_(0, idx, bound, "amin")
            on = bound == best[idx]
            keep[I[on], J[on]] = True
        return keep

    def _packed(self, T: _Terms) -> Tensor:
        """The C++ kernel's rows ``[r, m, base, bb, bc, c, beta, u]`` (K, 5 + 3 D)."""
        K, D = T.c.shape
        if self.s is None:
            z = T.c.new_zeros(K)
            return torch.cat(
                [T.r[:, None], T.m[:, None], z[:, None], z[:, None], z[:, None], T.c, T.c.new_zeros(K, 2 * D)], 1
            ).contiguous()
        L = T.linear()
        return torch.cat(
            [T.r[:, None], T.m[:, None], L.base[:, None], L.bb[:, None], L.bc[:, None], T.c, L.beta, L.shifted], 1
        ).contiguous()

    def _keep_native(self, lib, margin: float) -> Tensor:
        Kx, Ky, dev = self.Kx, self.Ky, self.X.c.device
        if (
            self.coarse is None or self.parents is None
        ):  # one coarse column over everything, coarse rows of FLAT_ROWS fine rows
            px = torch.cat([torch.arange(0, Kx, FLAT_ROWS), torch.tensor([Kx])])
            py = torch.tensor([0, Ky])
            Kcx = px.numel() - 1
            cptr, ccols = torch.arange(Kcx + 1), torch.zeros(Kcx, dtype=torch.long)
        else:
            px, py = self.parents.px.cpu().contiguous(), self.parents.py.cpu().contiguous()
            Kcx = px.numel() - 1
            Ic, Jc = self.coarse.nonzero(as_tuple=True)
            cptr = torch.zeros(Kcx + 1, dtype=torch.long)
            cptr[1:] = torch.cumsum(torch.bincount(Ic, minlength=Kcx), 0)
            ccols = Jc.contiguous()
        X, Y = self._packed(self.X), self._packed(self.Y)
        keep = torch.zeros(Kx, Ky, dtype=torch.uint8, device=dev)
        if self.s is not None:
            kind, lin, sc, minsq = 1, 1, float(self.s), 0.0
        elif self.cost.scale is not None:  # a dot-product cost (is_dot)
            kind, lin, sc, minsq = 1, 0, float(self.cost.scale), 0.0
        else:
            kind, lin, sc, minsq = 0, 0, 1.0, float(self.cost.min_sqdist)
        args = abi.PruneArgs(
            X.data_ptr(),
            Y.data_ptr(),
            cptr.data_ptr(),
            ccols.data_ptr(),
            px.data_ptr(),
            py.data_ptr(),
            keep.data_ptr(),
            Ky,
            Kcx,
            sc,
            minsq,
            float(margin),
            self.X.c.shape[1],
            kind,
            lin,
            torch.get_num_threads(),
        )
        rc = abi.call(lib.flashot_block_keep, args)
        if rc != 0:
            raise RuntimeError(f"multiscale: block pruning kernel returned {rc}")
        return keep.bool()

    def _dense(self, rows: slice) -> Tensor:
        Xr = self.X.rows(rows)
        Y = self.Y
        gap = (torch.cdist(Xr.c, Y.c) - Xr.r[:, None] - Y.r[None]).clamp_min(0.0)
        out = self.cost.from_sqdist(gap * gap) - Xr.m[:, None] - Y.m[None]
        return out if self.s is None else torch.maximum(out, _linear_dense(Xr, Y, self.s))

    def _pairs(self, I: Tensor, J: Tensor) -> Tensor:
        X, Y = self.X, self.Y
        gap = ((X.c[I] - Y.c[J]).norm(dim=-1) - X.r[I] - Y.r[J]).clamp_min(0.0)
        out = self.cost.from_sqdist(gap * gap) - X.m[I] - Y.m[J]
        return out if self.s is None else torch.maximum(out, _linear_pairs(X, Y, self.s, I, J))


def _cpu_lib(dtype: torch.dtype):
    """The compiled CPU kernels (block pruning), or None (then PyTorch prunes); FLASHOT_PRUNE=torch forces
    PyTorch (tests compare both)."""
    if os.environ.get("FLASHOT_PRUNE") == "torch":
        return None
    from ..ops.blocksparse_cpu import cpu_lib as load

    return load(dtype)


def _children(kept: Tensor, px: Tensor, py: Tensor) -> tuple[Tensor, Tensor]:
    """The fine blocks inside the kept coarse blocks: ``px`` / ``py`` (K + 1,) give each coarse
    cluster's run ``[p[k], p[k + 1])`` of fine clusters."""
    Ic, Jc = kept.nonzero(as_tuple=True)
    nx, ny = (px[1:] - px[:-1])[Ic], (py[1:] - py[:-1])[Jc]
    per = nx * ny
    pair = torch.repeat_interleave(torch.arange(Ic.numel(), device=kept.device), per)
    t = torch.arange(int(per.sum()), device=kept.device) - torch.repeat_interleave(torch.cumsum(per, 0) - per, per)
    return px[Ic][pair] + t // ny[pair], py[Jc][pair] + t % ny[pair]


def prune(
    cx: Clusters,
    cy: Clusters,
    f: Tensor,
    g: Tensor,
    eps: float,
    truncate: float | None,
    cost: CostLike,
    x: Tensor | None = None,
    y: Tensor | None = None,
    parents: Hierarchy | None = None,
) -> Tensor:
    """(Kx, Ky) kept blocks: a lower bound of ``C(x_i, y_j) - f_i - g_j`` over the block (see
    :class:`BlockBounds`) at most ``truncate * eps``, plus each row's and column's best block."""
    if truncate is None:
        return torch.ones(cx.n_clusters, cy.n_clusters, dtype=torch.bool, device=f.device)
    margin = truncate * eps
    return BlockBounds.compute(cx, cy, f, g, cost, x, y, parents, margin).keep(margin)
