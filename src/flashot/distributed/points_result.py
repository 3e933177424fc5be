"""Points-sharded mode's results: :class:`PointsPlan`, the plan whose rows are this rank's, and
:class:`PointsOTResult` (see :mod:`flashot.distributed`)."""

from __future__ import annotations

import dataclasses
from typing import NoReturn

import numpy as np
import torch
from torch import Tensor

from .._checks import check_int
from ..ops.base import ForwardingEngine
from ..ops.dense import check_dense_budget
from ..plan import DENSE_PLAN_LIMIT, LazyPlan
from ..results import OTResult
from .group import check_same
from .points import PointsMeasures


class PointsPlan(LazyPlan):
    """The plan of a points-sharded solve: ``P @ V`` takes this rank's rows of ``V`` (its points of the
    column cloud) and returns this rank's rows (a collective: call it on every rank); ``sum()`` and
    ``cost_sum()`` are totals over all ranks; ``to_dense()`` and ``topk(k)`` this rank's rows over all
    columns (collectives too).  ``shape`` is the whole plan's."""

    @property
    def shape(self) -> tuple[int, ...]:
        N, M = self._m.sizes
        nm = (M, N) if self._t else (N, M)
        return nm if not self._m.batched else (self._m.x.shape[0], *nm)

    @property
    def _points(self) -> PointsMeasures:
        """The plan's measures: a points-sharded plan is built on :class:`PointsMeasures` only."""
        m = self._m
        assert isinstance(m, PointsMeasures)
        return m

    @property
    def T(self) -> PointsPlan:
        return PointsPlan(self._m, self._f, self._g, self.eps, transposed=not self._t, numpy=self._numpy)

    def sum(self, axis: int | None = None) -> Tensor | np.ndarray:
        """``sum_ij P_ij`` over all ranks (``axis=None``), else this rank's column / row sums."""
        if axis is None:
            return self._finish(self._m.reduce(self._apply_raw(self._ones())[..., 0].sum(-1)))
        return super().sum(axis)

    def cost_sum(self) -> Tensor:
        """``<C, P>`` over all ranks, (B,)."""
        return self._m.reduce(super().cost_sum())

    def __array__(self, dtype: object = None, copy: bool | None = None) -> NoReturn:
        raise NotImplementedError(
            "np.asarray(plan): not available for a points-sharded plan (shard='points': "
            "each rank holds a slice of the rows); plan.to_dense() gives this rank's rows, "
            "shard='replicated' the whole plan"
        )

    def _columns(self) -> tuple[int, list[int]]:
        """``(M, offsets)``: the columns of the plan (over all ranks) and where each rank's block starts."""
        c = self._points.counts[0 if self._t else 1]
        return sum(c), [sum(c[:r]) for r in range(len(c))]

    def _agree(self, error: Exception | None, **fields) -> None:
        """Raise on every rank if one rank's arguments were rejected or ``fields`` differ (before a ring
        pass, which would otherwise wait for the rank that raised)."""
        check_same(self._points.group, fields, error, what="options")

    def to_dense(self, max_elems: int = DENSE_PLAN_LIMIT) -> Tensor | np.ndarray:
        """THIS rank's rows of ``P`` over all columns: (n_r, M) (or (B, n_r, M)), ``P_ij = exp(alpha_i +
        beta_j - C(x_i, y_j) / eps)``, the single process's rows of this rank's points.  A collective (one
        ring pass of the column blocks: points and ``beta``): call it on every rank.  ``max_elems`` bounds
        this rank's entries; ``MemoryError`` (on the rank over it, ``ValueError`` naming it on the others)
        as for one process."""
        err = None
        x, y, alpha, beta = self._sides()
        M, _ = self._columns()
        try:
            max_elems = check_int("max_elems", max_elems, minimum=0)
            n = x.shape[0] * x.shape[1] * M
            if n > max_elems:
                raise MemoryError(
                    f"to_dense: this rank's rows of the plan have {n:,} entries (shape "
                    f"{(x.shape[0], x.shape[1], M)}), above max_elems={max_elems:,}; use plan @ V, "
                    "plan.T @ U or raise max_elems explicitly"
                )
            check_dense_budget(x.shape[0], x.shape[1], M, x.dtype, x.device)
        except (MemoryError, TypeError, ValueError) as e:
            err = e
        self._agree(err)

        def block(src, yb, bb):
            C = self._m.cost.matrix(x, yb)
            return [(src, torch.exp(alpha.unsqueeze(-1) + bb[..., 0].unsqueeze(-2) - C / self.eps))]

        with torch.no_grad():
            parts = self._m.engine.ring_visit("to_dense", [y, beta.unsqueeze(-1)], block, lambda acc, o: acc + o)
        return self._finish(torch.cat([P for _, P in sorted(parts, key=lambda t: t[0])], -1))

    def topk(self, k: int) -> tuple[Tensor | np.ndarray, Tensor | np.ndarray]:
        """The ``k`` largest entries of each of THIS rank's rows over all columns, and their (global)
        column indices: (n_r, k) (or (B, n_r, k)), sorted in decreasing order (the single process's rows
        of this rank's points).  A collective: one ring pass of the column blocks, each rank keeping a
        running top-k of ``g_j + eps log b_j - C(x_i, y_j)`` merged block by block (memory O(n_r k))."""
        from ..ops.rowtopk import row_topk

        err = None
        M, offsets = self._columns()
        try:
            k = check_int("k", k, minimum=1)
            if k > M:
                raise ValueError(f"k: expected at most {M} (the number of columns of the plan), got {k}")
        except (TypeError, ValueError) as e:
            err = e
        self._agree(err, k=k)
        x, y, alpha, beta = self._sides()
        eng = self._m.engine
        dense = (eng.inner if isinstance(eng, ForwardingEngine) else eng).name == "dense"

        def block(src, yb, bb):
            v, i = row_topk(x, yb, bb[..., 0], 1.0 / self.eps, self._m.cost, min(k, yb.shape[1]), dense=dense)
            return v, i + offsets[src]

        def merge(acc, o):
            v, i = torch.cat([acc[0], o[0]], -1), torch.cat([acc[1], o[1]], -1)
            top = v.topk(min(k, v.shape[-1]), dim=-1)
            return top.values, i.gather(-1, top.indices)

        with torch.no_grad():
            vals, idx = self._m.engine.ring_visit("topk", [y, beta.unsqueeze(-1)], block, merge)
            vals = torch.exp(vals + alpha.unsqueeze(-1))
        idx = idx if self._m.batched else idx[0]
        return self._finish(vals), (idx.cpu().numpy() if self._numpy else idx)


class PointsOTResult(OTResult):
    """:class:`~flashot.OTResult` of a points-sharded solve: ``value_linear`` is ``<C, P>`` summed over all
    ranks; its gradient (:class:`flashot.values.LinearValueFn`: ring plan products, the conjugate
    gradients' inner products all-reduced) gives each rank the gradients w.r.t. its own points and
    weights.  Both are collectives: call them on every rank."""


def points_result(res: OTResult) -> PointsOTResult:
    """``res`` with the plan of a points-sharded solve."""
    p = res.plan
    out = PointsOTResult(**{f.name: getattr(res, f.name) for f in dataclasses.fields(OTResult)})
    out.plan = PointsPlan(p.measures, *p.raw_potentials, p.eps, numpy=p.returns_numpy)
    return out
