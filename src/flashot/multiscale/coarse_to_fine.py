"""The coarse-to-fine loop: GeomLoss' schedule on the clusters' centroids, then on the points over the blocks
that the bounds keep, re-pruned at every temperature (see :mod:`flashot.multiscale`)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from torch import Tensor

from ..clusters import cluster
from ..measures import Measures
from ..solver import SinkhornState, sinkhorn_loop
from .bounds import BlockBounds
from .config import MultiscaleConfig, MultiscaleRun
from .extrapolation import coarse_measures, extrapolated_state, points_measures
from .fine import SUB_LEVELS, FineBlocks, fine_measures, with_patterns
from .scales import cluster_scales, coarse_pays, jump_index, jump_threshold

# iterations at one temperature on the fine measures: (measures, state) -> the new state
FineLoop = Callable[[Measures, SinkhornState], SinkhornState]


def multiscale_loop(
    m: Measures,
    eps_list: list[float],
    p: int,
    cfg: MultiscaleConfig,
    *,
    debias: bool,
    diameter: float,
    labels: tuple[Tensor | None, Tensor | None] = (None, None),
    verbose: bool = False,
    group: Any = None,
    rho: tuple[float | None, float | None] = (None, None),
) -> MultiscaleRun:
    """Run GeomLoss' symmetric, debiased-or-not schedule ``eps_list`` coarse-to-fine on ``m`` (B = 1); with a
    ``torch.distributed`` ``group``, over its ranks (replicated mode: every rank passes the same ``m``).
    ``rho = (rho_x, rho_y)``: KL marginal penalties (unbalanced OT, GeomLoss' ``reach**p``; None: strict),
    applied at every temperature, coarse and fine, and in the extrapolation (``f = lam_x softmin``, as
    GeomLoss' multiscale does); debiasing needs ``rho_x == rho_y`` here."""
    if debias and rho[0] != rho[1]:
        raise NotImplementedError(
            "backend='multiscale': debiasing with different marginal penalties (reach_x != "
            "reach_y) is not implemented; use backend='auto'"
        )
    rx, ry = rho
    x, y = m.x[0], m.y[0]
    scale, bs = cluster_scales(m, eps_list[-1], cfg, diameter, labels)
    cx, cy = (cluster(x, m.a[0], scale, labels[0], SUB_LEVELS), cluster(y, m.b[0], scale, labels[1], SUB_LEVELS))
    jump = jump_index(eps_list, jump_threshold(m.cost, scale, p))
    on_points = not coarse_pays(cx, cy)
    if not on_points:
        mc = coarse_measures(m, cx, cy, group)
        st = sinkhorn_loop(mc, eps_list[: jump + 1], symmetric=True, debias=debias, rho_x=rx, rho_y=ry, verbose=verbose)
    if bs != scale:
        cx, cy = cluster(x, m.a[0], bs, sub_levels=SUB_LEVELS), cluster(y, m.b[0], bs, sub_levels=SUB_LEVELS)
    fine = fine_measures(m, cx, cy)
    hier = FineBlocks.build(fine, cx, cy, debias)
    eps = eps_list[jump]  # the last coarse temperature (eps_list[-1] when no fine iteration follows)
    if on_points:  # single scale's iterations on the (dense) points: no extrapolation step
        st = sinkhorn_loop(
            points_measures(fine, group),
            eps_list[: jump + 1],
            symmetric=True,
            debias=debias,
            rho_x=rx,
            rho_y=ry,
            verbose=verbose,
        )
    else:
        st = extrapolated_state(fine, mc, cx, cy, st, eps, debias, group, rho, (scale, cfg.truncate))
    state = replace(st, eps=eps)
    kept: list[float] = []
    tail = eps_list[jump + 1 :]
    if not tail:  # extrapolation only: the final step reads the potentials at this temperature
        bounds = _bounds(fine, hier, state, eps, cfg.truncate)
        fine = with_patterns(fine, hier, _keeps(bounds, eps, cfg.truncate), kept, debias, group, cfg.truncate)
        return MultiscaleRun(
            fine, replace(state, eps=eps_list[-1]), cx, cy, kept, jump, hier, bounds, cfg.truncate, group
        )
    bounds = _bounds(fine, hier, state, max(tail), cfg.truncate)
    for level in sorted(set(tail), reverse=True):
        steps = [e for e in tail if e == level]

        def loop(fine_, st, steps=steps):
            return sinkhorn_loop(
                fine_,
                steps,
                symmetric=True,
                debias=debias,
                rho_x=rx,
                rho_y=ry,
                init=(st.f, st.g),
                init_self=(st.f_aa, st.g_bb) if debias else None,
            )

        fine, state, bounds = _fine_level(fine, hier, state, bounds, level, loop, cfg.truncate, debias, kept, group)
    return MultiscaleRun(fine, replace(state, eps=eps_list[-1]), cx, cy, kept, jump, hier, bounds, cfg.truncate, group)


def continue_fine(run: MultiscaleRun, loop: FineLoop) -> MultiscaleRun:
    """More iterations at the last temperature on the pruned points: ``loop(fine_measures, state)`` -> the
    new state (e.g. the ordinary solver run to a tolerance), with the same a-posteriori check of the pruning
    as every temperature of :func:`multiscale_loop`."""
    eps, kept = run.state.eps, list(run.kept)
    assert run.hier is not None  # multiscale_loop always leaves its fine blocks
    fine, state, bounds = _fine_level(
        run.m, run.hier, run.state, run.bounds, eps, loop, run.truncate, run.state.f_aa is not None, kept, run.group
    )
    return replace(run, m=fine, state=replace(state, eps=eps), kept=kept, bounds=bounds)


def _fine_level(
    fine: Measures,
    hier: FineBlocks,
    state: SinkhornState,
    bounds: list[BlockBounds] | None,
    level: float,
    loop: FineLoop,
    truncate: float | None,
    debias: bool,
    kept: list[float],
    group: Any = None,
) -> tuple[Measures, SinkhornState, list[BlockBounds] | None]:
    """``loop(fine, state)`` (iterations at temperature ``level``) on the blocks whose ``bounds`` (from the
    potentials of ``state``) are within ``truncate * level``.  The bounds are then recomputed from the new
    potentials; where they keep a block that was dropped, the iterations run again on the union (once), so
    that every dropped block satisfies the rule for the potentials that come out.  Returns the measures on
    the last engine, the new state and its bounds (valid for margins up to ``truncate * level``)."""
    keeps = _keeps(bounds, level, truncate)
    for attempt in range(2):
        fine = with_patterns(fine, hier, keeps, kept, debias, group, truncate)
        with warnings.catch_warnings(record=True) as caught:  # shown only for the attempt that is kept
            warnings.simplefilter("always")
            new = loop(fine, state)
        new_bounds = _bounds(fine, hier, new, level, truncate)
        after = _keeps(new_bounds, level, truncate)
        if after is None or keeps is None or attempt == 1 or all(bool((a <= k).all()) for a, k in zip(after, keeps)):
            for w in caught:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            return fine, new, new_bounds
        kept.pop()
        keeps = [a | k for a, k in zip(after, keeps)]
    raise AssertionError("unreachable")


def _bounds(
    fine: Measures, h: FineBlocks, st: SinkhornState, eps: float, truncate: float | None
) -> list[BlockBounds] | None:
    """The :class:`BlockBounds` of the x-y problem and, when debiasing, of the x-x and y-y ones, from the
    potentials of ``st``, for margins up to ``truncate * eps`` (None: no pruning)."""
    if truncate is None:
        return None
    x0, y0, cost, margin = fine.x[0].detach(), fine.y[0].detach(), fine.cost, truncate * eps
    out = [BlockBounds.compute(h.cx, h.cy, st.f[0], st.g[0], cost, x0, y0, h.xy, margin)]
    if st.f_aa is not None and st.g_bb is not None:  # debiasing: both or neither
        out.append(BlockBounds.compute(h.cx, h.cx, st.f_aa[0], st.f_aa[0], cost, x0, x0, h.xx, margin))
        out.append(BlockBounds.compute(h.cy, h.cy, st.g_bb[0], st.g_bb[0], cost, y0, y0, h.yy, margin))
    return out


def _keeps(bounds: list[BlockBounds] | None, eps: float, truncate: float | None) -> list[Tensor] | None:
    """The kept blocks at the margin ``truncate * eps`` (None: every block; ``bounds`` is None without ``truncate``)."""
    return None if bounds is None or truncate is None else [b.keep(truncate * eps) for b in bounds]
