"""The fine stage in the callers' point order: the fine stage sorts both clouds by cluster."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, overload

import torch
from torch import Tensor

from ..costs import CostLike
from ..measures import Measures
from ..ops.base import Engine, ForwardingEngine, Weight
from ..ops.blocksparse import BlockSparseEngine
from ..solver import SinkhornState
from .config import MultiscaleRun


class InputOrderEngine(ForwardingEngine):
    """A multiscale engine seen in the callers' point order: the fine stage sorts both clouds by cluster, and
    this wrapper permutes the log-weights and ``V`` into that order and the results back, so that the
    ordinary solver, :class:`~flashot.plan.LazyPlan` and the gradients run on the inputs unchanged.

    Bound to the problem ``(x, y)`` of the original measures, like the block-sparse engine it wraps.  It
    declares no capability: the fused steps of the inner engine take the sorted clouds, so only the two
    primitives are permuted.  ``name`` is ``inner``'s: ``"multiscale"``, or ``"sharded(multiscale)"`` in a
    distributed solve."""

    name = "multiscale"

    def __init__(self, inner: Engine, x: Tensor, y: Tensor, xs: Tensor, ys: Tensor, px: Tensor, py: Tensor):
        super().__init__(inner, frozenset())
        inv = [torch.empty_like(p).scatter_(0, p, torch.arange(p.numel(), device=p.device)) for p in (px, py)]
        key = BlockSparseEngine.cloud_key
        self._sides = {key(x): (xs, px, inv[0]), key(y): (ys, py, inv[1])}

    def unsupported(self, device: torch.device, dtype: torch.dtype, cost: CostLike) -> str | None:
        return None

    def _side(self, t: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        hit = self._sides.get(BlockSparseEngine.cloud_key(t))
        if hit is None:
            raise RuntimeError(
                "multiscale engine: called on a cloud of another problem (it is bound to one problem; "
                "this is a flashot bug, please report it)"
            )
        return hit

    def softmin(self, x: Tensor, y: Tensor, h: Tensor, eps: float, cost: CostLike, **kw: Any) -> Tensor:
        _no_row_ranges(kw)
        (xs, _, ix), (ys, py, _) = self._side(x), self._side(y)
        return self.inner.softmin(xs, ys, h[:, py], eps, cost)[:, ix]

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
        _no_row_ranges(kw)
        (xs, px, ix), (ys, py, _) = self._side(x), self._side(y)
        return self.inner.plan_product(xs, ys, alpha[:, px], beta[:, py], eps, V[:, py], cost, weight)[:, ix]


def _no_row_ranges(kw: dict[str, Any]) -> None:
    """The keywords of the primitives (``rows=``) are for engines that declare ``Capability.ROW_RANGES``; this
    one does not."""
    if kw:
        raise TypeError(f"multiscale engine: unexpected keyword arguments {sorted(kw)}")


@overload
def unsort(t: Tensor, perm: Tensor) -> Tensor: ...
@overload
def unsort(t: None, perm: Tensor) -> None: ...
def unsort(t: Tensor | None, perm: Tensor) -> Tensor | None:
    """Values of sorted points (B, N) back in the input order: ``out[:, perm] = t`` (None stays None)."""
    return None if t is None else torch.empty_like(t).index_copy_(-1, perm, t)


def in_input_order(m: Measures, run: MultiscaleRun) -> tuple[Measures, SinkhornState]:
    """The measures ``m`` (inputs' order) on the pruned engine of ``run``, and its state in that order."""
    px, py = run.cx.perm, run.cy.perm
    eng = InputOrderEngine(run.m.engine, m.x.detach(), m.y.detach(), run.m.x.detach(), run.m.y.detach(), px, py)
    st = run.state
    st = replace(st, f=unsort(st.f, px), g=unsort(st.g, py), f_aa=unsort(st.f_aa, px), g_bb=unsort(st.g_bb, py))
    return replace(m, engine=eng), st
