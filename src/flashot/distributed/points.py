"""Points-sharded mode's problem: :class:`PointsMeasures`, this rank's slices of the points and weights
of ONE problem over the ranks, built by :func:`points_measures` (see :mod:`flashot.distributed`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from ..costs import Cost
from ..measures import Measures, log64, log_weights
from ..ops import max_cost
from ..ops.base import Engine
from .group import check_group, check_same
from .ring import RingEngine

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class _GatherFn(torch.autograd.Function):
    """All-gather of per-rank (B, n_r) slices into whole vectors; backward: this rank's slice of the
    gradient (every rank computes the same function of the gathered vectors).  The unbalanced
    points-sharded values go through it (the balanced ones through :func:`flashot.values.sinkhorn_value`),
    so its backward refuses ``create_graph=True``: those values have first derivatives only (the final
    step's envelope gradients)."""

    @staticmethod
    def forward(ctx, m, sides, *ts):
        ctx.m, ctx.sides = m, sides
        return tuple(m._gather(sides, ts))

    @staticmethod
    def backward(ctx, *grads):
        if torch.is_grad_enabled():
            raise NotImplementedError(
                "second derivatives (create_graph=True) of unbalanced OT are not implemented "
                "with shard='points'; balanced problems have them (implicit differentiation)"
            )
        return (None, None, *(None if g is None else ctx.m._own(s, g) for g, s in zip(grads, ctx.sides)))


@dataclass
class PointsMeasures(Measures):
    """:class:`~flashot.measures.Measures` of this rank's slices (points-sharded mode).

    ``x``, ``y``, ``a``, ``b`` hold this rank's points and weights (centred on the centre of ALL the
    points: the same numbers as one process), ``engine`` is a :class:`RingEngine`, ``cmax`` and
    ``diameter`` bound all the points; ``counts`` = (points of x per rank, points of y per rank).  The
    solver's sums and maxima over points go through :meth:`reduce` (all-reduce), values through
    :meth:`full` (differentiable all-gather of ``O(N + M)`` numbers).
    """

    group: Any = None
    counts: tuple = ((), ())
    diameter: float = 0.0
    points_sharded = True

    @property
    def sizes(self) -> tuple[int, int]:
        return sum(self.counts[0]), sum(self.counts[1])

    def reduce(self, t: Tensor, op: str = "sum") -> Tensor:
        t = t.detach().clone().contiguous()
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=self.group)
        return t

    def reduce_all(self, items: Sequence[tuple[Tensor, str]]) -> list[Tensor]:
        """One all-reduce per distinct op: that op's tensors flattened into one of their promoted dtype, then split
        back (each in its own dtype and shape)."""
        out: list[Tensor] = [t for t, _ in items]
        for op in dict.fromkeys(o for _, o in items):
            idx = [k for k, (_, o) in enumerate(items) if o == op]
            ts = [items[k][0].detach() for k in idx]
            dtype = ts[0].dtype
            for t in ts[1:]:
                dtype = torch.promote_types(dtype, t.dtype)
            flat = torch.cat([t.reshape(-1).to(dtype) for t in ts])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=self.group)
            for k, t, piece in zip(idx, ts, flat.split([t.numel() for t in ts])):
                out[k] = piece.view(t.shape).to(t.dtype)
        return out

    def full(self, sides: str, *ts: Tensor | None) -> tuple:
        keep = [k for k, t in enumerate(ts) if t is not None]
        got = _GatherFn.apply(self, "".join(sides[k] for k in keep), *(ts[k] for k in keep))
        out: list = [None] * len(ts)
        for k, t in zip(keep, got):
            out[k] = t
        return tuple(out)

    def bbox_diameter(self) -> float:
        return self.diameter

    def _offset(self, side: str) -> tuple[int, int]:
        c = self.counts[0 if side == "x" else 1]
        r = dist.get_rank(self.group)
        return sum(c[:r]), c[r]

    def _own(self, side: str, g: Tensor) -> Tensor:
        lo, n = self._offset(side)
        return g[:, lo : lo + n]

    def _gather(self, sides: str, ts) -> list[Tensor]:
        """One all-gather of the (B, n_r) slices ``ts`` (padded to the largest slice of their side)."""
        world = dist.get_world_size(self.group)
        caps = {s: max(self.counts[0 if s == "x" else 1]) for s in "xy"}
        dtype = ts[0].dtype
        for t in ts[1:]:
            dtype = torch.promote_types(dtype, t.dtype)
        send = torch.cat(
            [F.pad(t.detach().to(dtype), (0, caps[s] - t.shape[1])).reshape(-1) for t, s in zip(ts, sides)]
        )
        recv = [torch.empty_like(send) for _ in range(world)]
        dist.all_gather(recv, send, group=self.group)
        out, off = [], 0
        for t, s in zip(ts, sides):
            B, cap, c = t.shape[0], caps[s], self.counts[0 if s == "x" else 1]
            out.append(
                torch.cat([recv[k][off : off + B * cap].view(B, cap)[:, : c[k]] for k in range(world)], 1).to(t.dtype)
            )
            off += B * cap
        return out

    @cached_property
    def _a_log64(self) -> Tensor:
        return log64(self.a, self.sizes[0])  # uniform weights are 1 / N over all ranks' points

    @cached_property
    def _b_log64(self) -> Tensor:
        return log64(self.b, self.sizes[1])

    def float64_engine(self) -> Engine:
        eng = super().float64_engine()
        return eng if isinstance(eng, RingEngine) else RingEngine(eng, self.group, self.counts)


def _global_box(xb: Tensor, yb: Tensor, group) -> tuple[Tensor, Tensor]:
    """``(lo, hi)``, (B, D): the joint bounding box of every rank's clouds (one all-reduce)."""
    lo = torch.minimum(xb.detach().amin(-2), yb.detach().amin(-2))
    hi = torch.maximum(xb.detach().amax(-2), yb.detach().amax(-2))
    both = torch.stack([lo, -hi])
    dist.all_reduce(both, op=dist.ReduceOp.MIN, group=group)
    return both[0], -both[1]


def points_measures(
    x: Tensor,
    y: Tensor,
    a: Tensor | None,
    b: Tensor | None,
    *,
    group: ProcessGroup,
    build: Callable[[Tensor, Tensor, Tensor | None, Tensor | None], Measures],
    options: dict[str, Any] | None = None,
    names: tuple[str, str, str, str] = ("x", "y", "a", "b"),
) -> PointsMeasures:
    """This rank's slices ``x`` (n_r, D), ``y`` (m_r, D), ``a``, ``b`` as :class:`PointsMeasures` of ONE
    problem over the ranks of ``group``: ``build(x, y, a, b)`` validates them locally (the front end's
    ``Measures.build``); every rank raises if one fails or if the dimension, batch, dtype, cost, engine or
    ``options`` differ (``ValueError`` naming them and the ranks).  ``a=None``: weights ``1 / N`` with
    ``N`` the points over all ranks.  Centre and ``cmax`` come from the bounding box of all the points."""
    check_group(group)
    xn, yn = names[:2]
    try:
        for nm, t in ((xn, x), (yn, y)):
            if isinstance(t, Tensor) and t.dim() >= 2 and t.shape[-2] == 0:
                raise ValueError(
                    f"{nm}: this rank's slice holds no points (shape {tuple(t.shape)}); shard='points' "
                    "needs at least one point of each cloud on every rank"
                )
        m, err = build(x, y, a, b), None
    except Exception as e:  # noqa: BLE001 - shared below: every rank raises it
        m, err = None, e
    fields: dict[str, Any] = {}
    if m is not None:
        fields = {
            "world size": dist.get_world_size(group),
            f"{xn}, {yn} (batch, dimension, dtype)": (m.x.shape[0], m.x.shape[2], str(m.x.dtype)),
            "cost": getattr(m.cost, "name", repr(m.cost)),
            "backend (the engine each rank resolved)": m.engine.name,
            "weights given": (a is not None, b is not None),
            **(options or {}),
        }
        fields["_counts"] = (m.x.shape[1], m.y.shape[1])
    got = check_same(group, fields, err, what="options")  # _counts: not compared
    cx, cy = tuple(g["_counts"][0] for g in got), tuple(g["_counts"][1] for g in got)
    empty = [r for r in range(len(got)) if cx[r] == 0 or cy[r] == 0]
    if empty:
        raise ValueError(
            f"{xn}, {yn}: rank {empty[0]} holds no points of one cloud ({xn}: {cx}, {yn}: {cy} per "
            "rank); shard='points' needs at least one point of each cloud on every rank"
        )
    assert m is not None  # a rank whose build failed made check_same raise on every rank
    return _global_measures(m, x, y, a, b, group, (cx, cy))


def _global_measures(m: Measures, x, y, a, b, group, counts) -> PointsMeasures:
    """Re-centre ``m`` on the centre of all the points, bound the cost over all pairs, weights ``1/N``
    where none were given, and wrap the engine in a :class:`RingEngine`."""
    cdt = m.x.dtype
    xb, yb = (x, y) if m.batched else (x.unsqueeze(0), y.unsqueeze(0))
    xb, yb = xb.to(cdt), yb.to(cdt)
    lo, hi = _global_box(xb, yb, group)
    c = ((lo + hi) / 2).unsqueeze(-2)
    corners = torch.stack([lo, hi], -2)  # the bounding box of all points: max_cost checks overflow too
    cost = m.cost
    assert isinstance(cost, Cost)  # Measures.build's: a built-in cost (points mode takes no other)
    cmax = max_cost(corners, corners, cost, cdt)
    diameter = float((hi.amax(0) - lo.amin(0)).double().norm())
    fields = {f.name: getattr(m, f.name) for f in dataclasses.fields(Measures)}
    fields.update(x=(xb - c).contiguous(), y=(yb - c).contiguous(), center=c, cmax=cmax)
    fields["engine"] = RingEngine(m.engine, group, counts)
    for side, w, k in (("a", a, 0), ("b", b, 1)):
        if w is None:
            uni = torch.full_like(fields[side], 1.0 / sum(counts[k]))
            fields[side], fields[f"{side}_log"] = uni, log_weights(uni)
    return PointsMeasures(**fields, group=group, counts=counts, diameter=diameter)
