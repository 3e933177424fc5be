r"""The sub-tile pruning of the multiscale engine's fused CPU steps (:class:`~flashot.ops.blocksparse.BlockSparseEngine`).

Inside the kept blocks, a fused step (``softmin_pair``, ``softmin_sym`` and their barycentre variants) skips the
tiles (a panel of rows x 64 padded columns) where every entry
:math:`E_{ij} = a_i b_j e^{(f_i + g_j - C_{ij}) / \varepsilon}` is negligible, ``f, g`` the call's input
potentials, by GeomLoss' truncate rule for the inputs or for the outputs ``f', g'`` (the row and column
softmins over the kept blocks):

.. math::
    f_i + g_j - C_{ij} < -t\varepsilon \quad\text{or}\quad
    \big(f'_i + g_j - C_{ij} < -t\varepsilon \ \text{and}\ f_i + g'_j - C_{ij} < -t\varepsilon\big),

``t = truncate``.  The first is :math:`E_{ij} < e^{-t} a_i b_j`; the second says that :math:`E_{ij}` is below
:math:`e^{-t} b_j` times its row's sum and :math:`e^{-t} a_i` times its column's, so that it is negligible in
every output.  At a fixed point (``f' = f``, ``g' = g``) they coincide.  After a jump in the temperature they do
not: the potentials extrapolated from the coarse stage come in ~8 eps above the first fine step's outputs
(measured on the tori of ``benchmarks/multiscale_bench.py``, 10^6 points), and the inputs' rule keeps 1.7
times the pairs of the outputs'.

The outputs are not known before the call, so the kernels take upper bounds of them (:func:`output_bounds`):
the softmin and barycentre at the mean of each run of ``OUTPUT_SAMPLE_STRIDE`` consecutive rows of a cluster,
computed first over the same kept blocks (a fused pair call on those points, about 1 / stride of the call's
rows).  For :math:`C = s|x - y|^2`, :math:`f'(x) - s|x|^2` is concave (:math:`-\varepsilon` times a log-sum-exp of
affine functions of ``x``) with gradient :math:`-2 s\, b(x)`, ``b`` the soft-argmin barycentre, so the tangent
at any point :math:`x_k` bounds :math:`f'` over the cluster (whose rows all sum over the same columns):

.. math::
    f'(x) \le f'(x_k) + s\,(2\langle x_k - b_k, x - x_k\rangle + |x - x_k|^2);

for :math:`C = |x - y|` (clamped or not) :math:`f'` is 1-Lipschitz: :math:`f'(x) \le f'(x_k) + |x - x_k|`.
Each row takes its own run's bound; its slack, :math:`s |x_i - x_k|^2`, is a fraction of eps where runs are
narrow against the kernel (the large clouds this is for).  A probe first samples the runs of every
``PROBE_EVERY``-th row cluster: where the outputs come out less than ``PROBE_MIN_SHIFT`` eps below the inputs
(at or near a fixed point: the rule for the outputs could not skip more) the bounds are not computed and the
inputs' rule alone applies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..costs import Cost
from .blocksparse_cpu import TileArgs, pair_cpu, plan_call, softmin_cpu

OUTPUT_SAMPLE_STRIDE = 256  # the outputs are sampled at the mean of each run of this many rows of a cluster
PROBE_EVERY = 16  # the probe samples the rows of one row cluster in this many
PROBE_MIN_SHIFT = 1.0  # (eps) the least median shift of the outputs below the inputs for which they are bounded
OUTPUT_BOUND_CHUNK = 1 << 18  # rows per chunk when the bounds are evaluated (temporaries of this many x D)
TILE_MAX_D = 3  # the kernels prune tiles for D <= TILE_MAX_D only (kernels.cpp ``TILE_D``: fixed-size packed terms)


@dataclass(frozen=True)
class TilePruning:
    """Sub-tile pruning for :class:`~flashot.ops.blocksparse.BlockSparseEngine`'s fused CPU steps: the clouds'
    log-weights (keyed as the patterns; ``h - log_weights = f / eps`` for the solver's ``h``) and GeomLoss'
    ``truncate``.  The tiles inside the kept blocks where the rule of the module docstring holds (for the call's
    inputs, or for its outputs) are skipped."""

    log_weights: dict
    truncate: float


def tile_args(
    lib,
    pat,
    back,
    x: Tensor,
    y: Tensor,
    hx: Tensor,
    hy: Tensor,
    la: Tensor,
    lb: Tensor,
    eps: float,
    cost: Cost,
    truncate: float,
    counter: list,
) -> TileArgs:
    """:class:`TileArgs` of a fused call on ``(x, y)`` with log-weights ``hx = la + f / eps``, ``hy = lb + g / eps``
    (1, N) and (1, M): ``pat`` the pattern of ``(x, y)``, ``back`` that of ``(y, x)`` (None: ``pat.T``); ``y is x``
    for a symmetric step (one potential: ``gyo = fxo``).  The output bounds are computed only where a probe (the
    clusters ``0, PROBE_EVERY, 2 PROBE_EVERY, ...`` of the rows) finds the outputs at least ``PROBE_MIN_SHIFT``
    eps below the inputs (median): elsewhere the inputs stand for them (``fxo = fx``, ``gyo = gy``: the
    inputs' rule alone), which the outputs' rule could not better by more than that shift."""
    fx, gy = hx[0] - la, hy[0] - lb
    if not _probe_pays(lib, pat, x, y, hx, hy, fx, eps, cost):
        return TileArgs(fx, gy, fx, gy, truncate, counter)
    fxo = output_bounds(lib, pat, x, y, hx, hy, eps, cost)
    gyo = fxo if y is x else output_bounds(lib, back if back is not None else pat.T, y, x, hy, hx, eps, cost)
    return TileArgs(fx, gy, fxo, gyo, truncate, counter)


@dataclass(frozen=True)
class _Runs:
    """Runs of at most ``stride`` consecutive rows inside the row clusters (all of them, or a subset): ``rows``
    (n,) the rows covered, ``run`` (n,) the run of each, ``count`` the number of runs, and ``tasks`` the
    kernels' ``(first, end, cluster)`` over the runs (one sample point per run)."""

    rows: Tensor
    run: Tensor
    count: int
    tasks: Tensor

    @classmethod
    def of(cls, row_offsets: Tensor, stride: int, every: int = 1) -> _Runs:
        ro = row_offsets.cpu()
        sel = torch.arange(0, ro.numel() - 1, every)
        sizes = ro[sel + 1] - ro[sel]
        counts = (sizes + stride - 1) // stride
        starts = torch.cumsum(counts, 0) - counts
        c = torch.repeat_interleave(torch.arange(sel.numel()), sizes)  # each row's (selected) cluster
        local = torch.arange(c.numel()) - (torch.cumsum(sizes, 0) - sizes)[c]
        rows = ro[sel][c] + local
        tasks = torch.stack([starts, starts + counts, sel], -1).reshape(-1).contiguous()
        return cls(rows, starts[c] + local // stride, int(counts.sum()), tasks)

    def mean(self, v: Tensor) -> Tensor:
        """(count, ...) the mean of ``v`` (n, ...) (float64, the covered rows' values) over each run, non-finite
        values left out (0 where none is finite)."""
        ok = torch.isfinite(v)
        n = torch.zeros((self.count,) + v.shape[1:], dtype=torch.float64).index_add_(0, self.run, ok.double())
        tot = torch.zeros((self.count,) + v.shape[1:], dtype=torch.float64).index_add_(
            0, self.run, torch.where(ok, v, 0.0)
        )
        return tot / n.clamp_min(1)


def _sampled_outputs(
    lib, pat, x: Tensor, y: Tensor, hx: Tensor, hy: Tensor, eps: float, cost: Cost, runs: _Runs
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The sample points ``c_k`` (S, D) (the means of the runs, rounded to the clouds' dtype, float64), and the
    outputs ``f'(c_k) / eps`` (S,) and (dot costs) barycentres ``b_k`` (S, D) over the kept blocks of their
    clusters, float64 (``+inf`` where a sum cannot be had: no kept mass, or a sum out of the fused kernel's
    one-pass range after the two-pass plan product too)."""
    from .cpu.engine import PAIR_MIN_SUM

    dot = cost.is_dot
    cent = runs.mean(x[0, runs.rows].double()).to(x.dtype)
    xs = cent[None].contiguous()
    # the sums' scale: the runs' mean log-weight keeps them near the fused call's own
    alpha = runs.mean(hx[0, runs.rows].double()).to(x.dtype)[None].contiguous()
    hy = hy.contiguous()
    mass, _, num, _ = pair_cpu(lib, pat, xs, y, alpha, hy, eps, cost, sym=False, bary=1 if dot else 0, tasks=runs.tasks)
    S = torch.cat([num, mass[:, None]], -1) if dot else mass[:, None]
    if not bool((torch.isfinite(mass) & (mass >= PAIR_MIN_SUM)).all()):  # rare: all of them in two passes
        ones = torch.ones_like(y[..., :1])
        V = (torch.cat([y, ones], -1) if dot else ones).contiguous()
        lse = softmin_cpu(lib, pat, xs, y, hy, eps, cost, base2=True, tasks=runs.tasks)[0].contiguous()
        S = plan_call(lib, pat, xs, y, alpha, hy, eps, V, cost, "plan", lse, runs.tasks)[0][0]
    S = S.double()
    fo = alpha[0].double() - S[:, -1].log()  # -log sum_j exp(hy_j - C_kj / eps)
    b = S[:, :-1] / S[:, -1:] if dot else None
    bad = ~torch.isfinite(fo) if b is None else ~(torch.isfinite(fo) & torch.isfinite(b).all(-1))
    return cent.double(), fo.masked_fill(bad, float("inf")), b


def _probe_pays(lib, pat, x: Tensor, y: Tensor, hx: Tensor, hy: Tensor, fx: Tensor, eps: float, cost: Cost) -> bool:
    """Are the outputs of the rows of every ``PROBE_EVERY``-th cluster ``PROBE_MIN_SHIFT`` eps or more below the
    inputs ``fx`` (N,) (median over their runs)?"""
    runs = _Runs.of(pat.row_offsets, OUTPUT_SAMPLE_STRIDE, PROBE_EVERY)
    _, fo, _ = _sampled_outputs(lib, pat, x, y, hx, hy, eps, cost, runs)
    shift = runs.mean(fx[runs.rows].double()) - fo
    shift = shift[torch.isfinite(shift)]
    return shift.numel() > 0 and float(shift.median()) >= PROBE_MIN_SHIFT


def output_bounds(
    lib, pat, x: Tensor, y: Tensor, hx: Tensor, hy: Tensor, eps: float, cost: Cost, stride: int | None = None
) -> Tensor:
    r"""(N,) float64 upper bounds of :math:`f'_i / \varepsilon`, :math:`f' = \mathrm{softmin}(x, y, h_y)` over the
    kept blocks of ``pat`` (rows ``x`` (1, N, D), columns ``y`` (1, M, D), ``hy`` (1, M)): the tangent (dot costs)
    or Lipschitz (``|x - y|``) bounds of the module docstring at the mean ``c_k`` of each run of ``stride`` rows of
    a cluster (any point bounds the whole cluster, whose rows sum over the same kept columns; each row takes its
    own run's, so ``|x_i - c_k|`` stays within the run's radius), plus a slack for the float32 rounding of the
    kernels' inputs; ``+inf`` where the mean's sum cannot be had.  ``hx`` (1, N): the rows' log-weights of the
    fused call (their mean over a run sets the scale of its sampled sum).  ``stride`` defaults to
    ``OUTPUT_SAMPLE_STRIDE``."""
    runs = _Runs.of(pat.row_offsets, stride or OUTPUT_SAMPLE_STRIDE)
    cent, fo, b = _sampled_outputs(lib, pat, x, y, hx, hy, eps, cost, runs)
    N = x.shape[1]
    out = torch.empty(N, dtype=torch.float64)
    for r0 in range(0, N, OUTPUT_BOUND_CHUNK):
        sl = slice(r0, min(r0 + OUTPUT_BOUND_CHUNK, N))
        k = runs.run[sl]  # every row is covered, in order
        d = x[0, sl].double() - cent[k]  # x_i - c_k
        if cost.is_dot:
            u = fo[k] + (cost.scale / eps) * (2.0 * ((cent[k] - b[k]) * d).sum(-1) + (d * d).sum(-1))
        else:
            u = fo[k] + d.norm(dim=-1) / eps
        out[sl] = u + 1e-6 * u.abs() + 1e-4
    return out
