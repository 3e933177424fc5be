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
from typing import Any

import torch

from .measures import Measures
from .schedules import continued
from .solver import SinkhornState, sinkhorn_loop

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


def _key(module, m):
    """What a cached state must match: shapes (and, points-sharded, the number of points of every rank,
    the same on all ranks), dtype, device and the loss's ``p``, ``blur``, ``debias``."""
    return (m.shape, getattr(m, "counts", None), m.x.dtype, m.x.device, module.p, module.blur, module.debias)


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


def warm_loop(module: Any, m: Measures, eps_list: list[float]) -> SinkhornState:
    """The Sinkhorn loop of ``module`` (a SamplesLoss), warm-started from its cache when valid."""
    cache = getattr(module, "_warm_cache", None)
    key = _key(module, m)
    tol = module.tol

    def extended(sched):  # with tol: continued at the last temperature until the error is below tol
        return sched if tol is None else continued(sched, module.max_iter)

    if _cold(m, cache, key):
        st = sinkhorn_loop(m, extended(eps_list), symmetric=True, debias=module.debias, tol=tol)
        n_iter = st.n_iter
    else:
        assert cache is not None  # _cold is False only with a cache
        moved = _moved(m, cache)  # how far did the points move since the cached call?
        start = max(module.warm_start * module.blur, 4.0 * moved) ** module.p
        tail = [e for e in eps_list if e <= start * (1 + 1e-12)]
        if len(tail) < 2:  # always at least one step at the final eps plus the extrapolation
            tail = eps_list[-2:]
        st = sinkhorn_loop(m, extended(tail), symmetric=True, init=(cache["f"], cache["g"]), tol=tol)
        n_iter = st.n_iter
        if module.debias:
            f_aa, g_bb = None, None
            for side in ("x", "y"):
                h0 = cache["f_aa"] if side == "x" else cache["g_bb"]
                ss = sinkhorn_loop(_self_measures(m, side), extended(tail), symmetric=True, init=(h0, h0), tol=tol)
                if side == "x":
                    f_aa = 0.5 * (ss.f + ss.g)
                else:
                    g_bb = 0.5 * (ss.f + ss.g)
            st = dataclasses.replace(st, f_aa=f_aa, g_bb=g_bb)
    with torch.no_grad():
        module._warm_cache = {
            "key": key,
            "x": (m.x.detach() + m.center).clone(),
            "y": (m.y.detach() + m.center).clone(),
            "f": st.f.detach(),
            "g": st.g.detach(),
            "f_aa": None if st.f_aa is None else st.f_aa.detach(),
            "g_bb": None if st.g_bb is None else st.g_bb.detach(),
        }
    module.last_n_iter = n_iter
    return st
