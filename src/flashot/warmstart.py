r"""Warm starts for :class:`~flashot.SamplesLoss` (``warm_start=``).

GeomLoss runs an epsilon-scaling schedule ``diameter^p -> blur^p`` from
scratch at every call.  In a loop over slowly changing problems (gradient
flows, registration, training) the previous call's potentials are an excellent
start, and most of the schedule (the coarse scales, whose job is to find the
large-scale structure from nothing) can be skipped.

``SamplesLoss(..., warm_start=True)`` caches, after each call, the last
potentials of the loop (the cross pair ``(f, g)`` and, with ``debias=True``, the
self potentials ``f_aa``, ``g_bb``), detached.  The next call on a problem of
the same shape, dtype and device (and the same ``p``, ``blur``, ``debias``)
starts from them and runs only the tail of the schedule, from
``eps = max(warm_scale * blur, 2 * delta)^p`` down to ``blur^p``, where ``delta``
is the largest displacement of a point since the cached call (the old
potentials are only trusted at scales above it) and ``warm_scale = 4`` for
``warm_start=True`` (pass a number ``>= 1`` to choose it).  Large moves thus
fall back to (most of) the full schedule.  Any other call runs
the full schedule cold (and refills the cache).  ``L.reset_warm_start()``
empties the cache.  The cross problem and each self problem run as separate
loops (the self problems as ``OT(a, a)`` with both potentials warm-started).

Limitation (measured): each warm call runs only a short tail from the previous
call's state, and GeomLoss' schedule never converges at the final temperature,
so over many calls with *large* displacements the error can accumulate (in a
gradient flow with steps of ~blur, values drifted away from the cold ones after
a few steps).  Warm starts here are for small changes between calls (the tests
use displacements of ~0.002 and check the value against a converged
reference).  For flows with large steps, use :func:`~flashot.solve_sample` with
``potentials_init=`` and a ``tol``: every solve converges, and warm starts only
save iterations (``examples/gradient_flow.py``).

The potentials of a point are tied to its index: warm starts are meant for
the *same* particles moving (``x`` at step ``t + 1`` is ``x`` at step ``t`` plus
a small displacement), as in a gradient flow.  ``L.last_n_iter`` holds the
number of Sinkhorn iterations (schedule entries) the last call ran.

Points-sharded (``SamplesLoss(..., group=pg, shard="points")``, :mod:`flashot.distributed`): each rank
caches its own slices of the points and potentials; the displacement ``delta`` is the maximum over all
ranks (an all-reduce) and the cold / warm decision is taken by all ranks together, so every rank runs
the same tail and the result is the single process's up to float reassociation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from .driver import LoopConfig, Solved, run_loop
from .measures import Measures
from .solver import SinkhornState

DEFAULT_WARM_SCALE = 8.0


def check_warm_start(v: object) -> float | None:
    """``False``/``None`` -> None (off); ``True`` -> default scale; a number >= 1 -> that scale."""
    if v is None or v is False:
        return None
    if v is True:
        return DEFAULT_WARM_SCALE
    if isinstance(v, (int, float)) and v >= 1 and v == v and v != float("inf"):
        return float(v)
    raise ValueError(f"warm_start: expected a bool or a number >= 1 (the starting blur multiple), got {v!r}")


def _cold(m, cache, key) -> bool:
    """Whether this call runs the full schedule: no cache or another problem.  Points-sharded
    (``m.points_sharded``), the ranks decide together (any rank cold makes all cold), so that no rank
    runs another schedule than the others."""
    cold = cache is None or cache["key"] != key
    if m.points_sharded:
        cold = bool(m.reduce(torch.tensor([float(cold)], dtype=torch.float64, device=m.x.device), "max")[0] > 0)
    return cold


def _moved(m, cache) -> float:
    """``delta = max_i |x_i - x_i^cached|`` over both clouds (and, points-sharded, over every rank's points:
    one all-reduce, so that every rank starts the same tail)."""
    with torch.no_grad():
        d = torch.stack(
            [
                (m.x.detach() + m.center - cache["x"]).norm(dim=-1).max(),
                (m.y.detach() + m.center - cache["y"]).norm(dim=-1).max(),
            ]
        )
        return float(m.reduce(d, "max").max())


def _self_measures(m, side: str):
    """The self problem OT(a, a) (``side="x"``) or OT(b, b) as measures of their own; points-sharded, the
    counts per rank of that cloud on both sides."""
    pts, w, wl = (m.x, m.a, m.a_log) if side == "x" else (m.y, m.b, m.b_log)
    extra = {}
    if m.points_sharded:
        c = m.counts[0 if side == "x" else 1]
        extra["counts"] = (c, c)
    return dataclasses.replace(m, x=pts, y=pts, a=w, b=w, a_log=wl, b_log=wl, **extra)


@dataclass(frozen=True)
class WarmStart:
    """The warm-start strategy of ``SamplesLoss(warm_start=)`` (a :data:`~flashot.driver.Strategy` of
    :func:`~flashot.driver.solve_problem`): the config's loop, cold (the whole schedule, refilling the cache) or
    warm (the tail from ``max(scale * blur, 4 delta)^p``, cross and self problems as separate loops started from
    the cache), balanced only, without a progress bar.  ``owner`` keeps the cache between calls (its
    ``_warm_cache`` attribute: a :class:`~flashot.SamplesLoss`); ``p``, ``blur`` and the config's ``debias`` key
    it."""

    owner: Any
    scale: float
    p: int
    blur: float

    def __call__(self, m: Measures, cfg: LoopConfig) -> Solved:
        cache = getattr(self.owner, "_warm_cache", None)
        # what a cached state must match: shapes (points-sharded: every rank's number of points, the same on all
        # ranks), dtype, device, and the loss's p, blur, debias
        key = (m.shape, getattr(m, "counts", None), m.x.dtype, m.x.device, self.p, self.blur, cfg.debias)
        quiet = dataclasses.replace(cfg, verbose=False)
        if _cold(m, cache, key):
            st = run_loop(m, quiet)
        else:
            assert cache is not None  # _cold is False only with a cache
            st = self._warm(m, quiet, cache)
        with torch.no_grad():
            self.owner._warm_cache = {
                "key": key,
                "x": (m.x.detach() + m.center).clone(),
                "y": (m.y.detach() + m.center).clone(),
                "f": st.f.detach(),
                "g": st.g.detach(),
                "f_aa": None if st.f_aa is None else st.f_aa.detach(),
                "g_bb": None if st.g_bb is None else st.g_bb.detach(),
            }
        return Solved(m, st, st.n_iter)

    def _warm(self, m: Measures, cfg: LoopConfig, cache: dict) -> SinkhornState:
        """The tail of the schedule from the cached potentials: how far the points moved since the cached call
        sets where it starts (always at least one step at the final eps plus the extrapolation)."""
        eps_list = cfg.schedule
        start = max(self.scale * self.blur, 4.0 * _moved(m, cache)) ** self.p
        tail = [e for e in eps_list if e <= start * (1 + 1e-12)]
        if len(tail) < 2:
            tail = list(eps_list[-2:])
        cross = dataclasses.replace(cfg, schedule=tail, debias=False)
        st = run_loop(m, dataclasses.replace(cross, init=(cache["f"], cache["g"])))
        if not cfg.debias:
            return st
        selfs = []
        for side, h0 in (("x", cache["f_aa"]), ("y", cache["g_bb"])):
            ss = run_loop(_self_measures(m, side), dataclasses.replace(cross, init=(h0, h0)))
            selfs.append(0.5 * (ss.f + ss.g))
        return dataclasses.replace(st, f_aa=selfs[0], g_bb=selfs[1])
