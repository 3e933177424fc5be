"""Points-sharded ("ring") mode's engine: every rank holds only its slice of the points, and the other
side's blocks travel around the ring of ranks (see :mod:`flashot.distributed`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..costs import CostLike
from ..ops.base import Capability, Engine, Weight
from .group import MOD, GroupEngine, refuse_keywords

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

_RING_OPS = {"softmin": 1, "plan_product": 2, "softmin_pair": 3, "to_dense": 4, "topk": 5}


def _lse2(acc: Tensor, out: Tensor, eps: float) -> Tensor:
    """``-eps log(exp(-acc / eps) + exp(-out / eps))``: two partial softmins over disjoint blocks combined."""
    return -eps * torch.logaddexp(-acc / eps, -out / eps)


class RingEngine(GroupEngine):
    """An engine over points sharded across the ranks of ``group`` (ring attention's scheme).

    ``softmin(x, y, h)`` and ``plan_product(x, y, alpha, beta, V)`` take THIS rank's rows (``x``,
    ``alpha``) and THIS rank's block of the other side (``y`` with ``h`` / ``beta`` and ``V``) and
    return this rank's rows of the result over ALL ranks' blocks:
    ``out_i = -eps log sum_r sum_{j in block r} exp(h_j - C(x_i, y_j) / eps)``, or the plain sum of the
    block products.  The blocks travel around the ring ``r -> r + 1`` (W - 1 hops; the next block is
    sent / received without blocking while ``inner`` works on the current one, so a rank holds two
    blocks at a time) and the partial results are combined as they arrive (LogSumExp / sum).  Each call
    starts with one small all-gather (operation, call number, batch, widths, block lengths) that checks
    that the ranks are at the same call.  ``stats``: ``calls`` and ``bytes`` received by this rank.
    Capabilities: ``ring_visit``, and ``softmin_pair`` (one ring pass) where ``inner`` declares it.
    """

    label = "ring"

    def __init__(self, inner: Engine, group: ProcessGroup) -> None:
        super().__init__(inner, (inner.capabilities & {Capability.SOFTMIN_PAIR}) | {Capability.RING_VISIT}, group)
        self._next = dist.get_global_rank(group, (self.rank + 1) % self.world)
        self._prev = dist.get_global_rank(group, (self.rank - 1) % self.world)

    def _header(self, op: str, parts: list[Tensor]) -> list[int]:
        """All-gather (op, call number, batch, widths, block length); raise if the ranks' calls differ.
        Returns every rank's block length."""
        self._calls += 1
        widths = [p.shape[2] for p in parts] + [0] * (3 - len(parts))
        head = torch.tensor(
            [_RING_OPS[op], self._calls % MOD, parts[0].shape[0], *widths, parts[0].shape[1]],
            dtype=torch.int64,
            device=parts[0].device,
        )
        got = [torch.empty_like(head) for _ in range(self.world)]
        dist.all_gather(got, head, group=self.group)
        self.stats["calls"] += 1
        self.stats["bytes"] += head.numel() * 8 * self.world
        heads = [tuple(int(v) for v in g.tolist()) for g in got]
        if any(h[:-1] != heads[0][:-1] for h in heads[1:]):
            bad = [k for k, h in enumerate(heads) if h[:-1] != heads[0][:-1]]
            names = {v: n for n, v in _RING_OPS.items()}
            desc = "; ".join(
                f"rank {k}: {names.get(heads[k][0], '?')} call "
                f"{heads[k][1]}, batch {heads[k][2]}, widths {heads[k][3:6]}"
                for k in [0] + bad[:3]
            )
            raise RuntimeError(
                f"distributed Sinkhorn (shard='points'): the ranks diverged ({desc}): every rank must "
                "run the same calls with the same options"
            )
        return [h[-1] for h in heads]

    @staticmethod
    def _pack(buf: Tensor, parts: list[Tensor], cap: int) -> None:
        off = 0
        for p in parts:
            B, n, w = p.shape
            buf[off : off + B * cap * w].view(B, cap, w)[:, :n] = p
            off += B * cap * w

    @staticmethod
    def _slot(buf: Tensor, parts: list[Tensor], cap: int, k: int) -> Tensor:
        """The (B, cap, w) view of part ``k`` in a packed buffer."""
        off = sum(p.shape[0] * cap * p.shape[2] for p in parts[:k])
        B, _, w = parts[k].shape
        return buf[off : off + B * cap * w].view(B, cap, w)

    @classmethod
    def _unpack(cls, buf: Tensor, parts: list[Tensor], cap: int, n: int) -> list[Tensor]:
        return [cls._slot(buf, parts, cap, k)[:, :n].to(p.dtype).contiguous() for k, p in enumerate(parts)]

    def _packed(self, parts: list[Tensor], lens: list[int]) -> tuple[Tensor, Tensor, int]:
        """This rank's block ``parts`` packed in a flat buffer sized for the ranks' longest block (``cap`` rows,
        the parts' promoted dtype), and an empty buffer of the same size to receive the next block in."""
        dtype = parts[0].dtype
        for p in parts[1:]:
            dtype = torch.promote_types(dtype, p.dtype)
        cap = max(lens)
        buf = parts[0].new_zeros(parts[0].shape[0] * cap * sum(p.shape[2] for p in parts), dtype=dtype)
        self._pack(buf, parts, cap)
        return buf, torch.empty_like(buf), cap

    def _send(self, buf: Tensor, nxt: Tensor) -> list:
        """Start one hop: send ``buf`` to rank + 1 and receive rank - 1's block in ``nxt``."""
        return [dist.isend(buf, self._next, group=self.group), dist.irecv(nxt, self._prev, group=self.group)]

    def _arrived(self, reqs: list, nxt: Tensor) -> None:
        """Wait for a hop (:meth:`_send`) and count the bytes received."""
        for q in reqs:
            q.wait()
        self.stats["bytes"] += nxt.numel() * nxt.element_size()

    def _ring(
        self, op: str, parts: list[Tensor], fn: Callable[..., Tensor], combine: Callable[[Tensor, Tensor], Tensor]
    ) -> Tensor:
        """``combine`` over the ranks' blocks of ``fn(*block)``, ``parts`` = this rank's (B, m_r, w) block.
        Hop ``k`` sends the block held to rank + 1 and receives rank - k - 1's while ``fn`` runs."""
        lens = self._header(op, parts)
        if self.world == 1:
            return fn(*parts)
        buf, nxt, cap = self._packed(parts, lens)
        acc: Tensor | None = None
        for step in range(self.world):
            more = step < self.world - 1
            if more:
                reqs = self._send(buf, nxt)
            block = parts if step == 0 else self._unpack(buf, parts, cap, lens[(self.rank - step) % self.world])
            out = fn(*block)
            acc = out if acc is None else combine(acc, out)
            if more:
                self._arrived(reqs, nxt)
                buf, nxt = nxt, buf
        assert acc is not None  # world >= 2 blocks combined
        return acc

    def ring_visit(
        self, op: str, parts: list[Tensor], fn: Callable[..., Tensor], combine: Callable[[Tensor, Tensor], Tensor]
    ) -> Tensor:
        """:meth:`_ring` with ``fn(src, *block)``, ``src`` the rank whose block it is (the blocks arrive in
        the order rank, rank - 1, ..., rank + 1): for results that depend on the block's place (its
        global column indices)."""
        steps = iter(range(self.world))
        return self._ring(op, parts, lambda *blk: fn((self.rank - next(steps)) % self.world, *blk), combine)

    # -- the contract ---------------------------------------------------------------------
    def softmin(self, x: Tensor, y: Tensor, h: Tensor, eps: float, cost: CostLike, **kw: Any) -> Tensor:
        """This rank's rows of ``-eps log sum_j exp(h_j - C(x_i, y_j) / eps)`` over every rank's block (y, h)."""
        refuse_keywords("ring", kw)

        def part(yb, hb):
            return self.inner.softmin(x, yb, hb[..., 0], eps, cost)

        return self._ring("softmin", [y, h.unsqueeze(-1)], part, lambda acc, o: _lse2(acc, o, eps))

    def softmin_pair(
        self, x: Tensor, y: Tensor, hx: Tensor, hy: Tensor, eps: float, cost: CostLike
    ) -> tuple[Tensor, Tensor]:
        """``(softmin(x, y, hy), softmin(y, x, hx))`` for this rank's rows of x and of y, in ONE ring pass:
        each y block travels with its potential and its partial column softmin, which every rank updates
        with its rows (the inner engine's fused ``softmin_pair``); after W hops each block is home, complete."""
        parts = [y, hy.unsqueeze(-1), hy.unsqueeze(-1)]  # points, log-weights, accumulator (shape only here)
        lens = self._header("softmin_pair", parts)
        f, g = self.inner.softmin_pair(x, y, hx, hy, eps, cost)  # own block: rows of f, partial g over x_r
        if self.world == 1:
            return f, g
        parts[2] = g.unsqueeze(-1)
        buf, nxt, cap = self._packed(parts, lens)
        for hop in range(1, self.world + 1):
            self._arrived(self._send(buf, nxt), nxt)
            buf, nxt = nxt, buf
            n = lens[(self.rank - hop) % self.world]
            yb, hb, acc = self._unpack(buf, parts, cap, n)
            if hop == self.world:  # our own block, back with every rank's partial
                return f, acc[..., 0]
            fp, gp = self.inner.softmin_pair(x, yb, hx, hb[..., 0], eps, cost)
            f = _lse2(f, fp, eps)
            self._slot(buf, parts, cap, 2)[:, :n, 0] = _lse2(acc[..., 0], gp, eps).to(buf.dtype)
        raise AssertionError("unreachable")

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

        def part(yb, bb, Vb):
            return self.inner.plan_product(x, yb, alpha, bb[..., 0], eps, Vb, cost, weight)

        return self._ring("plan_product", [y, beta.unsqueeze(-1), V], part, torch.add)
