"""Replicated mode (``shard="replicated"``): every rank holds all the points, and
:class:`ShardedEngine` computes this rank's slice of the output rows and all-gathers the rest
(see :mod:`flashot.distributed`)."""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
import torch.distributed as dist
from torch import Tensor

from ..costs import CostLike
from ..measures import Measures
from ..ops.base import Capability, Engine, Weight
from .group import MOD, GroupEngine, bits_checksum, check_group, check_same, fold, refuse_keywords

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

_OPS = {"softmin": 1, "plan_product": 2, "softmin_pair": 3, "softmin_alt": 4, "softmin_sym": 5}
_OP_NAMES = {v: k for k, v in _OPS.items()}
_HEADER = 3  # op, call number, input checksum

# the fused steps that shard by even row slices (each kept when the inner engine declares it)
_SHARDED_FUSED = frozenset({Capability.SOFTMIN_PAIR, Capability.SOFTMIN_ALT, Capability.EXPECT_REUSE})


class _RowRanges(Protocol):
    """The primitives of an engine that declares ``Capability.ROW_RANGES``: they also take ``rows=(lo, hi)``,
    the output rows to compute (of the whole clouds)."""

    def softmin(
        self, x: Tensor, y: Tensor, h: Tensor, eps: float, cost: CostLike, *, rows: tuple[int, int]
    ) -> Tensor: ...

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
        *,
        rows: tuple[int, int],
    ) -> Tensor: ...


class ShardedEngine(GroupEngine):
    """An engine that computes this rank's slice of the rows with ``inner`` and all-gathers the rest.

    Implements the engine contract (:mod:`flashot.ops.base`) and declares ``softmin_sym`` (a row-sharded
    ``softmin(x, x, h)``), plus ``softmin_pair`` / ``softmin_alt`` / ``expect_reuse`` where ``inner``
    declares them and does not pick the slices itself.  ``stats``: ``calls`` (collectives)
    and ``bytes`` (bytes received by this rank's all-gathers, own slice included).

    An inner engine bound to fixed row blocks (the multiscale engine,
    :class:`~flashot.ops.blocksparse.BlockSparseEngine`) chooses the slices itself: ``row_bounds(x, y,
    world)`` gives every rank's rows ``[lo, hi)`` of the pair (whole row clusters) and its ``softmin`` /
    ``plan_product`` take ``rows=(lo, hi)`` and the whole clouds; its ``digest(x, y)`` (the kept blocks)
    enters the header's checksum, so ranks whose pruning diverged raise at that call
    (``Capability.ROW_RANGES``).
    """

    label = "sharded"

    def __init__(self, inner: Engine, group: ProcessGroup) -> None:
        own_rows = inner.supports(Capability.ROW_RANGES)  # the inner engine picks the slices (whole row blocks)
        fused = frozenset() if own_rows else inner.capabilities & _SHARDED_FUSED  # fused forms: even slices
        super().__init__(inner, fused | {Capability.SOFTMIN_SYM}, group)
        self._slices: OrderedDict = OrderedDict()
        self._own_rows = own_rows

    @property
    def _own(self) -> _RowRanges:
        """``inner`` with its ``rows=`` keyword: only where it declares ``Capability.ROW_RANGES`` (``_own_rows``)."""
        assert self._own_rows
        return cast(_RowRanges, self.inner)

    # -- slices ---------------------------------------------------------------------
    def bounds(self, n: int, rank: int | None = None) -> tuple[int, int]:
        r = self.rank if rank is None else rank
        return r * n // self.world, (r + 1) * n // self.world

    def _rows(self, t: Tensor) -> Tensor:
        """This rank's rows of (B, N, ...) ``t``, contiguous.  Memoised on the tensor (pointer, shape,
        strides, version), so repeated calls pass the inner engine the same tensor (the cpu engine's
        cost-matrix cache keys on it); for B = 1 the slice is a view (no copy)."""
        lo, hi = self.bounds(t.shape[1])
        if lo == 0 and hi == t.shape[1]:
            return t
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t._version, lo, hi)
        hit = self._slices.get(key)
        if hit is not None:
            self._slices.move_to_end(key)
            return hit[1]
        s = t[:, lo:hi].contiguous()
        self._slices[key] = (t, s)  # keeps t alive: its pointer cannot be reused while the entry lives
        while len(self._slices) > 8:
            self._slices.popitem(last=False)
        return s

    def _vec(self, h: Tensor) -> Tensor:
        """This rank's entries of a (B, N) vector."""
        lo, hi = self.bounds(h.shape[1])
        return h if (lo, hi) == (0, h.shape[1]) else h[:, lo:hi].contiguous()

    def _spans(self, n: int) -> list[tuple[int, int]]:
        """Every rank's even slice ``[lo, hi)`` of ``n`` rows (:meth:`bounds`)."""
        return [self.bounds(n, k) for k in range(self.world)]

    def _row_call(self, op: str, x: Tensor, y: Tensor, inputs: tuple, even, own) -> Tensor:
        """This rank's rows of a row-wise primitive on ``(x, y)``, all-gathered: ``even(x_r)`` on this rank's
        even slice (``None`` when it is empty), or, where the inner engine picks the slices, ``own(rows)``
        with this rank's ``rows=(lo, hi)`` of ``inner.row_bounds`` (checksummed with ``inner.digest``)."""
        if self._own_rows:
            spans = self.inner.row_bounds(x, y, self.world)
            out = own(spans[self.rank])
            inputs = (*inputs, self.inner.digest(x, y))
        else:
            spans, xr = self._spans(x.shape[1]), self._rows(x)
            out = even(xr if xr.shape[1] else None)
        return self._exchange(op, [(out, spans)], [], inputs)[0]

    # -- the one collective ---------------------------------------------------------------
    def _exchange(
        self, op: str, rows: list[tuple[Tensor, list[tuple[int, int]]]], partials: list[Tensor], inputs
    ) -> tuple:
        """One all-gather: ``rows`` = (this rank's (B, n_r, ...) slice, every rank's rows ``[lo, hi)``) pieces,
        concatenated across ranks in rank order; ``partials`` = (B, M) pieces, returned stacked as (W, B, M).
        A header (op, call number, input checksum) checks that all ranks are at the same call with the same
        inputs."""
        ref = rows[0][0] if rows else partials[0]
        dtype, device = ref.dtype, ref.device
        self._calls += 1
        chk = fold(bits_checksum(*inputs))
        head = torch.tensor([_OPS[op], self._calls % MOD, chk], dtype=dtype, device=device)
        flat = [head]
        shapes = []
        for t, spans in rows:
            B, nr = t.shape[0], t.shape[1]
            rest = tuple(t.shape[2:])
            cap = max(hi - lo for lo, hi in spans)  # the largest slice
            pad = t.new_zeros((B, cap, *rest))
            pad[:, :nr] = t
            flat.append(pad.reshape(-1))
            shapes.append((B, cap, rest, spans))
        for p in partials:
            flat.append(p.reshape(-1))
        send = torch.cat(flat).contiguous()
        recv = [torch.empty_like(send) for _ in range(self.world)]
        dist.all_gather(recv, send, group=self.group)
        self.stats["calls"] += 1
        self.stats["bytes"] += send.numel() * send.element_size() * self.world
        heads = [tuple(int(v) for v in r[:_HEADER].tolist()) for r in recv]
        if any(h != heads[0] for h in heads[1:]):
            bad = [k for k, h in enumerate(heads) if h != heads[0]]
            desc = "; ".join(
                f"rank {k}: {_OP_NAMES.get(heads[k][0], '?')} call {heads[k][1]} inputs {heads[k][2]:#x}"
                for k in [0] + bad[:3]
            )
            raise RuntimeError(
                f"distributed Sinkhorn: the ranks diverged ({desc}): every rank must run the same "
                "calls on the same data (same options, torch build, CPU type and thread count)"
            )
        out = []
        off = _HEADER
        for B, cap, rest, spans in shapes:
            size = B * cap * math.prod(rest)
            parts = []
            for k in range(self.world):
                lo, hi = spans[k]
                parts.append(recv[k][off : off + size].view(B, cap, *rest)[:, : hi - lo])
            out.append(torch.cat(parts, 1))
            off += size
        for p in partials:
            size = p.numel()
            out.append(torch.stack([recv[k][off : off + size].view(p.shape) for k in range(self.world)]))
            off += size
        return tuple(out)

    @staticmethod
    def _lse_combine(parts: Tensor, eps: float) -> Tensor:
        """``-eps log sum_r exp(-parts_r / eps)`` over the (W, ...) partial softmins, in rank order."""
        return -eps * torch.logsumexp(-parts / eps, dim=0)

    # -- the contract ---------------------------------------------------------------------
    def softmin(self, x: Tensor, y: Tensor, h: Tensor, eps: float, cost: CostLike, **kw: Any) -> Tensor:
        refuse_keywords("sharded", kw)
        return self._softmin("softmin", x, y, h, eps, cost, (x, y, h))

    def _softmin(self, op: str, x: Tensor, y: Tensor, h: Tensor, eps: float, cost: CostLike, inputs: tuple) -> Tensor:
        def even(xr: Tensor | None) -> Tensor:
            return x.new_full((x.shape[0], 0), math.inf) if xr is None else self.inner.softmin(xr, y, h, eps, cost)

        return self._row_call(op, x, y, inputs, even, lambda rows: self._own.softmin(x, y, h, eps, cost, rows=rows))

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
        refuse_keywords("sharded", kw)

        def even(xr: Tensor | None) -> Tensor:
            if xr is None:
                return V.new_zeros((x.shape[0], 0, V.shape[-1]))
            return self.inner.plan_product(xr, y, self._vec(alpha), beta, eps, V, cost, weight)

        return self._row_call(
            "plan_product",
            x,
            y,
            (x, y, alpha, beta, V),
            even,
            lambda rows: self._own.plan_product(x, y, alpha, beta, eps, V, cost, weight, rows=rows),
        )

    def _fused(self, op: str, x, y, hx, hy, eps, call) -> tuple[Tensor, Tensor]:
        xr, hr = self._rows(x), self._vec(hx)
        if xr.shape[1] == 0:
            fr = x.new_full((x.shape[0], 0), math.inf)
            gp = x.new_full(hy.shape, math.inf)
        else:
            fr, gp = call(xr, hr)
        f, parts = self._exchange(op, [(fr, self._spans(x.shape[1]))], [gp.contiguous()], (x, y, hx, hy))
        return f, self._lse_combine(parts, eps)

    def softmin_pair(
        self, x: Tensor, y: Tensor, hx: Tensor, hy: Tensor, eps: float, cost: CostLike
    ) -> tuple[Tensor, Tensor]:
        return self._fused(
            "softmin_pair", x, y, hx, hy, eps, lambda xr, hr: self.inner.softmin_pair(xr, y, hr, hy, eps, cost)
        )

    def softmin_alt(
        self, x: Tensor, y: Tensor, ha: Tensor, hy: Tensor, eps: float, cost: CostLike, lam: float = 1.0
    ) -> tuple[Tensor, Tensor]:
        return self._fused(
            "softmin_alt", x, y, ha, hy, eps, lambda xr, hr: self.inner.softmin_alt(xr, y, hr, hy, eps, cost, lam)
        )

    def softmin_sym(self, x: Tensor, h: Tensor, eps: float, cost: CostLike) -> Tensor:
        return self._softmin("softmin_sym", x, x, h, eps, cost, (x, h))

    def expect_reuse(self, x: Tensor, y: Tensor, cost: CostLike) -> None:
        lo, hi = self.bounds(x.shape[1])
        if hi > lo and self.supports(Capability.EXPECT_REUSE):  # the inner engine takes it, even slices
            self.inner.expect_reuse(self._rows(x), y, cost)


def distribute_measures(
    m: Measures,
    group: ProcessGroup,
    options: dict[str, Any] | None = None,
    names: tuple[str, str, str, str] = ("x", "y", "α", "β"),
) -> Measures:
    """Check that every rank of ``group`` holds the same problem, then shard ``m``'s engine (in place).

    Compared: the shapes, dtypes and bits of the (centred) points and of the weights, the cost, the
    engine, and ``options`` (name -> value).  ``ValueError`` names the first that differs (``names``: the
    caller's names of x, y, a, b) and the ranks.  Returns ``m``.
    """
    xn, yn, an, bn = names
    check_group(group)
    if isinstance(m.engine, ShardedEngine):
        return m
    fields: dict[str, Any] = {"world size": dist.get_world_size(group)}
    for nm, t in ((xn, m.x), (yn, m.y), (an, m.a), (bn, m.b)):
        fields[f"{nm} (shape, dtype)"] = (tuple(t.shape[1 - m.batched :]), str(t.dtype))
    fields["cost"] = getattr(m.cost, "name", repr(m.cost))
    fields["backend (the engine each rank resolved)"] = m.engine.name
    for k, v in (options or {}).items():
        fields[k] = v
    # replicated mode: the data must be the same on every rank (after the shapes: clearer errors first)
    for nm, t in ((xn, m.x), (yn, m.y)):
        fields[f"{nm} (the points: replicated mode needs the same points on every rank)"] = (
            f"bits checksum {bits_checksum(t):#x}"
        )
    for nm, t in ((an, m.a), (bn, m.b)):
        fields[f"{nm} (the weights)"] = f"bits checksum {bits_checksum(t):#x}"
    check_same(group, fields)
    inner = m.engine
    m.engine = ShardedEngine(inner, group)
    # float32 at high temperature runs softmins in float64 on ``engine64``: shard it too
    eng64 = m.engine64  # cached: resolved now against the sharded engine unless already cached
    if eng64 is inner:
        m.engine64 = m.engine
    elif not isinstance(eng64, ShardedEngine):
        m.engine64 = ShardedEngine(eng64, group)
    return m
