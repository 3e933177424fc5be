"""Points-sharded ("ring") mode's engine: every rank holds only its slice of the points, and the other
side's blocks travel around the ring of ranks (see :mod:`flashot.distributed`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..costs import CostLike
from ..ops.base import Capability, Engine, Weight
from .group import GroupEngine, refuse_keywords

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

_RING_OPS = {"softmin": 1, "plan_product": 2, "softmin_pair": 3, "to_dense": 4, "topk": 5}
# the header of every block sent (int64 words, whatever the block's dtype): operation, call number, batch, three
# widths, the block buffer's rows (``cap``), then the block's own rows and its rank.  At the front: a shorter
# block received (another call's, under gloo) still shows it
_HEAD = ("op", "call", "batch", "w0", "w1", "w2", "cap", "rows", "src")
_AGREE = 7  # the words every rank's header must share (the rest is the block's own)
_ROWS = _HEAD.index("rows")


def _lse2(acc: Tensor, out: Tensor, eps: float) -> Tensor:
    """``-eps log(exp(-acc / eps) + exp(-out / eps))``: two partial softmins over disjoint blocks combined."""
    return -eps * torch.logaddexp(-acc / eps, -out / eps)


def _head_len(dtype: torch.dtype) -> int:
    """Elements of ``dtype`` that hold the header's int64 words."""
    return len(_HEAD) * 8 // torch.empty((), dtype=dtype).element_size()


class _Pass:
    """One ring pass's blocks: a flat buffer of the parts' promoted dtype, the header (:data:`_HEAD`) in its
    first bytes, then each part as (B, ``cap``, w) (``cap``: the rows of the ranks' longest block), and an
    empty buffer of the same size to receive the next block in."""

    def __init__(self, head: tuple[int, ...], parts: list[Tensor], cap: int) -> None:
        dtype = parts[0].dtype
        for p in parts[1:]:
            dtype = torch.promote_types(dtype, p.dtype)
        self.parts, self.cap, self.hl = parts, cap, _head_len(dtype)
        self.buf = parts[0].new_zeros(self.hl + parts[0].shape[0] * cap * sum(p.shape[2] for p in parts), dtype=dtype)
        self.buf[: self.hl].view(torch.int64).copy_(torch.tensor(head, dtype=torch.int64))  # exact in any dtype
        for k, p in enumerate(parts):
            self.slot(k)[:, : p.shape[1]] = p
        self.nxt = torch.empty_like(self.buf)

    def slot(self, k: int) -> Tensor:
        """The (B, cap, w) view of part ``k`` in the buffer held."""
        off = self.hl + sum(p.shape[0] * self.cap * p.shape[2] for p in self.parts[:k])
        B, _, w = self.parts[k].shape
        return self.buf[off : off + B * self.cap * w].view(B, self.cap, w)

    def head(self) -> tuple[int, ...]:
        """The header of the block held (one small read to the host)."""
        return tuple(int(v) for v in self.buf[: self.hl].view(torch.int64).tolist())

    def block(self, n: int) -> list[Tensor]:
        """The parts of the block held, of ``n`` rows (its header's), each in its part's dtype."""
        return [self.slot(k)[:, :n].to(p.dtype).contiguous() for k, p in enumerate(self.parts)]

    def swap(self) -> None:
        self.buf, self.nxt = self.nxt, self.buf


class RingEngine(GroupEngine):
    """An engine over points sharded across the ranks of ``group`` (ring attention's scheme).

    ``softmin(x, y, h)`` and ``plan_product(x, y, alpha, beta, V)`` take THIS rank's rows (``x``,
    ``alpha``) and THIS rank's block of the other side (``y`` with ``h`` / ``beta`` and ``V``) and
    return this rank's rows of the result over ALL ranks' blocks:
    ``out_i = -eps log sum_r sum_{j in block r} exp(h_j - C(x_i, y_j) / eps)``, or the plain sum of the
    block products.  The blocks travel around the ring ``r -> r + 1`` (W - 1 hops; the next block is
    sent / received without blocking while ``inner`` works on the current one, so a rank holds two
    blocks at a time) and the partial results are combined as they arrive (LogSumExp / sum).

    The ranks' calls are checked inside the transfer itself: every block travels with a header (operation,
    call number, batch, widths, buffer rows; then the block's rows and rank), every block visits every rank,
    and after the pass each rank compares all W headers, so that ranks at different calls all raise
    ``RuntimeError`` with the same message instead of mixing blocks.  The buffers are sized without a
    collective from ``counts`` (every rank's number of points of each cloud: :class:`PointsMeasures` passes
    them): the longest block of the cloud this rank's block belongs to, or of both clouds where some rank
    holds as many points of each (its block does not tell the cloud there; the ranks' buffers must be the same
    size).  Reason: a separate all-gather of the header before each pass cost one more collective than the
    transfer itself per pass (W = 2), the largest per-iteration overhead of small solves.  Without ``counts``
    each call starts with that all-gather (operation, call number, batch, widths, block lengths) instead.  The
    in-transfer check needs the ranks' buffers to have the same size: ranks whose calls differ in the size of
    their blocks (another width or cloud) make the transfer itself fail (gloo: "Received data size doesn't
    match expected size", which ends the receiving process).

    ``stats``: ``calls`` (ring passes) and ``bytes`` received by this rank.  Capabilities: ``ring_visit``, and
    ``softmin_pair`` (one ring pass) where ``inner`` declares it.
    """

    label = "ring"

    def __init__(
        self, inner: Engine, group: ProcessGroup, counts: tuple[Sequence[int], Sequence[int]] | None = None
    ) -> None:
        super().__init__(inner, (inner.capabilities & {Capability.SOFTMIN_PAIR}) | {Capability.RING_VISIT}, group)
        self._next = dist.get_global_rank(group, (self.rank + 1) % self.world)
        self._prev = dist.get_global_rank(group, (self.rank - 1) % self.world)
        self.counts: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        if counts is not None:
            cx, cy = (tuple(int(v) for v in c) for c in counts)
            if len(cx) != self.world or len(cy) != self.world:
                raise ValueError(f"counts: expected {self.world} numbers of points per cloud, got {len(cx)}, {len(cy)}")
            self.counts = (cx, cy)

    def _cap(self, op: str, parts: list[Tensor]) -> int:
        """The rows of this pass's buffers: the same on every rank that runs the same call (from ``counts``, or
        from the header all-gather without them); counts this call."""
        self._calls += 1
        self.stats["calls"] += 1
        if self.counts is None:
            return max(self._header(op, parts))
        cx, cy = self.counts
        n = parts[0].shape[1]
        if any(a == b for a, b in zip(cx, cy)):  # some rank cannot tell the clouds apart by its block's rows
            return max(n, *cx, *cy)
        if n == cx[self.rank]:
            return max(cx)
        return max(cy) if n == cy[self.rank] else max(n, *cx, *cy)  # neither: the headers will differ

    def _header(self, op: str, parts: list[Tensor]) -> list[int]:
        """All-gather (op, call number, batch, widths, block length); raise if the ranks' calls differ.
        Returns every rank's block length."""
        mine = [*self._head(op, parts, 0)[:6], parts[0].shape[1]]
        head = torch.tensor(mine, dtype=torch.int64, device=parts[0].device)
        got = [torch.empty_like(head) for _ in range(self.world)]
        dist.all_gather(got, head, group=self.group)
        self.stats["bytes"] += head.numel() * 8 * self.world
        heads = [tuple(int(v) for v in g.tolist()) for g in got]
        self._check([h[:6] for h in heads])
        return [h[-1] for h in heads]

    def _head(self, op: str, parts: list[Tensor], cap: int) -> tuple[int, ...]:
        """This rank's header (:data:`_HEAD`) of a pass over ``parts``."""
        widths = [p.shape[2] for p in parts] + [0] * (3 - len(parts))
        return (_RING_OPS[op], self._calls, parts[0].shape[0], *widths, cap, parts[0].shape[1], self.rank)

    def _check(self, heads: Sequence[tuple[int, ...]]) -> None:
        """Raise (the same error on every rank: every rank holds every rank's header) unless the ranks' headers
        agree (:data:`_AGREE` words) and each came from its rank (a full header's last word)."""
        agree = [h[:_AGREE] for h in heads]
        bad = [k for k, h in enumerate(heads) if agree[k] != agree[0] or (len(h) == len(_HEAD) and h[-1] != k)]
        if not bad:
            return
        names = {v: n for n, v in _RING_OPS.items()}
        desc = "; ".join(
            f"rank {k}: {names.get(heads[k][0], '?')} call {heads[k][1]}, batch {heads[k][2]}, widths {heads[k][3:6]}"
            for k in [0] + [b for b in bad if b != 0][:3]
        )
        raise RuntimeError(
            f"distributed Sinkhorn (shard='points'): the ranks diverged ({desc}): every rank must "
            "run the same calls with the same options"
        )

    def _start(self, ps: _Pass) -> list:
        """Start one hop: send the block held to rank + 1 and receive rank - 1's (:meth:`_arrived`)."""
        return [dist.isend(ps.buf, self._next, group=self.group), dist.irecv(ps.nxt, self._prev, group=self.group)]

    def _arrived(self, ps: _Pass, reqs: list) -> tuple[int, ...]:
        """Wait for a hop (:meth:`_start`), hold the block received; returns its header."""
        for q in reqs:
            q.wait()
        self.stats["bytes"] += ps.nxt.numel() * ps.nxt.element_size()
        ps.swap()
        return ps.head()

    def _ring(
        self, op: str, parts: list[Tensor], fn: Callable[..., Tensor], combine: Callable[[Tensor, Tensor], Tensor]
    ) -> Tensor:
        """``combine`` over the ranks' blocks of ``fn(src, *block)``, ``parts`` = this rank's (B, m_r, w) block,
        ``src`` the rank whose block it is.  Hop ``k`` sends the block held to rank + 1 and receives rank - k - 1's
        while ``fn`` runs; a block whose header differs is not computed on (the check raises after the pass)."""
        cap = self._cap(op, parts)
        if self.world == 1:
            return fn(self.rank, *parts)
        mine = self._head(op, parts, cap)
        heads: list = [mine] * self.world  # rank src's header, once its block is held
        ps = _Pass(mine, parts, cap)
        acc: Tensor | None = None
        ok = True  # every header so far agrees with this rank's
        for step in range(self.world):
            src = (self.rank - step) % self.world
            more = step < self.world - 1
            if more:
                reqs = self._start(ps)
            if ok:
                out = fn(src, *(parts if step == 0 else ps.block(heads[src][_ROWS])))
                acc = out if acc is None else combine(acc, out)
            if more:
                h = heads[(src - 1) % self.world] = self._arrived(ps, reqs)
                ok = ok and h[:_AGREE] == mine[:_AGREE]
        self._check(heads)
        assert acc is not None  # world >= 2 blocks combined
        return acc

    def ring_visit(
        self, op: str, parts: list[Tensor], fn: Callable[..., Tensor], combine: Callable[[Tensor, Tensor], Tensor]
    ) -> Tensor:
        """:meth:`_ring` with ``fn(src, *block)``, ``src`` the rank whose block it is (the blocks arrive in
        the order rank, rank - 1, ..., rank + 1): for results that depend on the block's place (its
        global column indices)."""
        return self._ring(op, parts, fn, combine)

    # -- the contract ---------------------------------------------------------------------
    def softmin(self, x: Tensor, y: Tensor, h: Tensor, eps: float, cost: CostLike, **kw: Any) -> Tensor:
        """This rank's rows of ``-eps log sum_j exp(h_j - C(x_i, y_j) / eps)`` over every rank's block (y, h)."""
        refuse_keywords("ring", kw)

        def part(src, yb, hb):
            return self.inner.softmin(x, yb, hb[..., 0], eps, cost)

        return self._ring("softmin", [y, h.unsqueeze(-1)], part, lambda acc, o: _lse2(acc, o, eps))

    def softmin_pair(
        self, x: Tensor, y: Tensor, hx: Tensor, hy: Tensor, eps: float, cost: CostLike
    ) -> tuple[Tensor, Tensor]:
        """``(softmin(x, y, hy), softmin(y, x, hx))`` for this rank's rows of x and of y, in ONE ring pass:
        each y block travels with its potential and its partial column softmin, which every rank updates
        with its rows (the inner engine's fused ``softmin_pair``); after W hops each block is home, complete."""
        parts = [y, hy.unsqueeze(-1), hy.unsqueeze(-1)]  # points, log-weights, accumulator (shape only here)
        cap = self._cap("softmin_pair", parts)
        f, g = self.inner.softmin_pair(x, y, hx, hy, eps, cost)  # own block: rows of f, partial g over x_r
        if self.world == 1:
            return f, g
        parts[2] = g.unsqueeze(-1)
        mine = self._head("softmin_pair", parts, cap)
        heads: list = [mine] * self.world
        ps = _Pass(mine, parts, cap)
        ok = True
        for hop in range(1, self.world):
            h = heads[(self.rank - hop) % self.world] = self._arrived(ps, self._start(ps))
            ok = ok and h[:_AGREE] == mine[:_AGREE]
            if ok:
                yb, hb, acc = ps.block(h[_ROWS])
                fp, gp = self.inner.softmin_pair(x, yb, hx, hb[..., 0], eps, cost)
                f = _lse2(f, fp, eps)
                ps.slot(2)[:, : h[_ROWS], 0] = _lse2(acc[..., 0], gp, eps).to(ps.buf.dtype)
        self._arrived(ps, self._start(ps))  # our own block, back with every rank's partial
        self._check(heads)
        return f, ps.block(mine[_ROWS])[2][..., 0]

    def plan_product(
        self,
        x: Tensor,
        y: Tensor,
        alpha: Tensor,
        beta: Tensor,
        eps: float,
        V: Tensor,
        cost: CostLike,
        weight: Weight = "plan",
        **kw: Any,
    ) -> Tensor:
        """This rank's rows of ``sum_j exp(alpha_i + beta_j - C_ij / eps) W_ij V_j`` over every rank's block."""
        refuse_keywords("ring", kw)

        def part(src, yb, bb, Vb):
            return self.inner.plan_product(x, yb, alpha, bb[..., 0], eps, Vb, cost, weight)

        return self._ring("plan_product", [y, beta.unsqueeze(-1), V], part, torch.add)
