r"""A ragged batch as ONE problem on the concatenated clouds whose kernel is block-diagonal.

Problem ``k``'s rows see only problem ``k``'s columns, so the Sinkhorn updates of the concatenated problem are
the updates of every problem at once, and the core loop (:func:`flashot.solver.sinkhorn_loop`) runs unchanged:

.. math::
    f_i = -\varepsilon \log \sum_{j \in k(i)} b_j e^{(g_j - C(x_i, y_j))/\varepsilon}

with ``k(i)`` the problem of point ``i``.  The engine is the block-sparse one of the ``multiscale`` solver
(:class:`~flashot.ops.blocksparse.BlockSparseEngine`) on :class:`~flashot.ops.run_pattern.RunPattern` s: each
problem's rows are cut into chunks of at most ``ROW_CHUNK`` rows (fewer where a chunk times the problem's
columns would exceed the PyTorch path's ``TILE_ELEMS`` scores, so its temporaries stay bounded); a chunk of
``x`` keeps the columns of its problem in ``y``, and for the debiasing problems ``(x, x)`` and ``(y, y)`` the
chunks of its own problem, a symmetric pattern on which ``softmin_sym`` computes only the blocks on and right
of the diagonal.  Everything is linear in the points: the patterns hold a few integers per chunk.

Weights are per problem (uniform ones are ``1 / N_k``), and :class:`RaggedMeasures` sums the solver's
per-point errors and masses per problem (:meth:`~flashot.measures.Measures.per_problem_sum`): the loop's
error is the largest problem's, so ``tol`` holds for every problem when it stops.  Each problem is centred on
its own mean before concatenation (the costs are translation invariant; the float32 expansion of the cost then
sees each problem's own scale).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from .._checks import compute_dtype
from ..measures import Measures, log_weights
from ..ops.blocksparse import BlockSparseEngine
from ..ops.blocksparse_cpu import cpu_lib
from ..ops.run_pattern import RunPattern
from ..ops.tiled import TILE_ELEMS
from .inputs import RaggedInput, RaggedLayout

__all__ = ["ROW_CHUNK", "BACKENDS", "RaggedEngine", "RaggedMeasures", "ragged_measures", "ragged_engine", "row_chunks"]

ROW_CHUNK = 256  # rows per chunk: the C++ kernels' tasks (threads balance over them) and the sym pattern's blocks
# backend -> BlockSparseEngine's ``native``: the C++ kernels (cpu), PyTorch (tiled), the Triton kernels (triton);
# "auto": C++ on CPU tensors, Triton on CUDA ones, PyTorch where neither is available
BACKENDS = {"auto": True, "cpu": True, "tiled": False, "triton": "triton"}


@dataclass
class RaggedMeasures(Measures):
    """:class:`~flashot.measures.Measures` of a ragged batch: the concatenated clouds, per-problem sums."""

    layout: RaggedLayout | None = None

    def per_problem_sum(self, t: Tensor, side: str) -> Tensor:
        return self.layout.sum(t, side)

    def per_problem_max(self, t: Tensor, side: str) -> Tensor:
        return self.layout.amax(t, side)

    def problem_ids(self, side: str) -> Tensor:
        return self.layout.ids(side, self.a.device)

    def log64(self, side: str) -> Tensor:
        """float64 log-weights of ``side`` (1, N), a problem's weights all equal to ``1 / N_k`` rounded to their
        dtype taken as exactly ``1 / N_k`` (:func:`~flashot.measures.log64`, per problem).  Cached."""
        cache = self.__dict__.setdefault("_log64", {})
        if side not in cache:
            lay, w = self.layout, (self.a if side == "x" else self.b).detach()[0]
            ids = lay.ids(side, w.device)
            n = lay.sizes(side).to(w.device, torch.float64)[ids]
            same = (w == (1.0 / n).to(w.dtype)).double()
            uniform = (lay.sum(same, side) == lay.sizes(side).to(w.device, torch.float64))[ids]
            cache[side] = torch.where(uniform, -n.log(), log_weights(w.double()))[None]
        return cache[side]

    def h_a(self, f: Tensor | None, eps: float) -> Tensor:
        if not self.hot(eps):
            return super().h_a(f, eps)
        return self.log64("x") if f is None else self.log64("x") + f.double() / eps

    def h_b(self, g: Tensor | None, eps: float) -> Tensor:
        if not self.hot(eps):
            return super().h_b(g, eps)
        return self.log64("y") if g is None else self.log64("y") + g.double() / eps

    @property
    def sums(self) -> tuple:
        """The per-side reducers of :mod:`flashot.unbalanced`'s value formulas: per-problem sums, (B,)."""
        lay = self.layout
        return (lambda t: lay.sum(t, "x")), (lambda t: lay.sum(t, "y"))


def row_chunks(offsets: Tensor, cols: Tensor) -> tuple[Tensor, Tensor]:
    """``(chunk offsets (C + 1,), problem of each chunk (C,))``: each problem's rows ``[offsets[k], offsets[k +
    1])`` cut into near-equal chunks of at most ``min(ROW_CHUNK, TILE_ELEMS // cols[k])`` rows (at least 1)."""
    n = offsets[1:] - offsets[:-1]
    per = (TILE_ELEMS // cols.clamp_min(1)).clamp(1, ROW_CHUNK)
    c = (n + per - 1) // per
    p = torch.repeat_interleave(torch.arange(n.numel()), c)
    first = torch.cumsum(c, 0) - c
    j = torch.arange(int(c.sum())) - first[p]
    out = torch.empty(p.numel() + 1, dtype=torch.long)
    out[:-1] = offsets[p] + j * n[p] // c[p]
    out[-1] = offsets[-1]
    return out, p


def _cross(lay: RaggedLayout, side: str, dev: torch.device) -> RunPattern:
    """Chunks of ``side``'s rows, each keeping its problem's columns on the other side (one cluster a problem);
    the pattern's tensors on the clouds' device ``dev`` (the PyTorch path indexes the clouds with them)."""
    other = "y" if side == "x" else "x"
    ro, p = row_chunks(lay.offsets(side), lay.sizes(other))
    return RunPattern(ro.to(dev), lay.offsets(other).to(dev), p.to(dev), (p + 1).to(dev))


def _self(lay: RaggedLayout, side: str, dev: torch.device) -> RunPattern:
    """Chunks of ``side``'s rows against the same chunks as columns, each keeping the chunks of its problem."""
    ro, p = row_chunks(lay.offsets(side), lay.sizes(side))
    first = torch.zeros(lay.B + 1, dtype=torch.long)
    first[1:] = torch.cumsum(torch.bincount(p, minlength=lay.B), 0)
    return RunPattern(ro.to(dev), ro.to(dev), first[p].to(dev), first[p + 1].to(dev), symmetric=True)


class RaggedEngine(BlockSparseEngine):
    """The block-sparse engine of a batch, which also knows copies of its clouds: the float64 ones of
    float32 problems at a high temperature (:meth:`~flashot.measures.Measures.hot`) are new tensors, which
    the patterns (keyed by the clouds' storage) do not hold; a cloud of another storage is matched to ``x`` or
    ``y`` by its values (O(N) per call, never cached: a freed copy's storage can be reused by another)."""

    def __init__(self, patterns, x: Tensor, y: Tensor, *, native):
        super().__init__(patterns, native=native)
        self.clouds = (x, y)

    def _matches(self, t: Tensor) -> list[Tensor]:
        """The clouds of the batch that ``t`` is (by storage) or equals (by values)."""
        key = self.cloud_key(t)
        if any(key == self.cloud_key(c) for c in self.clouds):
            return [t]
        return [c for c in self.clouds if t.shape == c.shape and torch.equal(t.to(c.dtype), c)]

    def pattern(self, x: Tensor, y: Tensor):
        for u in self._matches(x):
            for v in self._matches(y):
                try:
                    return super().pattern(u, v)
                except RuntimeError:  # equal clouds: the pair may be registered the other way
                    continue
        raise RuntimeError(
            "ragged engine: called on a cloud of another problem (this is a flashot bug, please report it)"
        )


def ragged_engine(x: Tensor, y: Tensor, lay: RaggedLayout, backend: str, debias: bool) -> BlockSparseEngine:
    """The block-sparse engine of the batch on the concatenated (1, N, D), (1, M, D) clouds ``x``, ``y`` (see the
    module docstring); its ``name`` is ``ragged(<backend>)``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: a ragged batch runs on {sorted(BACKENDS)}, got {backend!r}")
    if backend == "cpu" and (x.device.type != "cpu" or cpu_lib(x.dtype) is None):
        why = f"the points are on {x.device}" if x.device.type != "cpu" else "its C++ kernels did not build"
        raise ValueError(f"backend: 'cpu' cannot run this ragged batch ({why}); use backend='auto' or 'tiled'")
    dev = x.device
    pats = [(x, y, _cross(lay, "x", dev)), (y, x, _cross(lay, "y", dev))]
    if debias:
        pats += [(x, x, _self(lay, "x", dev)), (y, y, _self(lay, "y", dev))]
    eng = RaggedEngine(pats, x, y, native=BACKENDS[backend])
    eng.name = f"ragged({backend})"
    return eng


def _centres(inp: RaggedInput) -> tuple[Tensor, Tensor]:
    """Each problem's mean point (detached), gathered per point of ``x`` and of ``y``."""
    lay, x, y = inp.layout, inp.x.detach(), inp.y.detach()
    ix, iy = lay.ids("x", x.device), lay.ids("y", y.device)
    s = torch.zeros(lay.B, x.shape[1], dtype=torch.float64, device=x.device)
    s.index_add_(0, ix, x.double()).index_add_(0, iy, y.double())
    n = (lay.sizes("x") + lay.sizes("y")).to(device=x.device, dtype=torch.float64)
    c = (s / n[:, None]).to(x.dtype)
    return c[ix], c[iy]


def uniform_weights(lay: RaggedLayout, side: str, like: Tensor) -> Tensor:
    """``1 / N_k`` on each point of problem ``k``, in the compute dtype (as :func:`~flashot._checks.check_weights`
    rounds ``1 / N`` for one problem)."""
    w = (1.0 / lay.sizes(side).double())[lay.ids(side, torch.device("cpu"))]
    return w.to(device=like.device, dtype=compute_dtype(like.dtype))


def ragged_measures(
    inp: RaggedInput, cost: str, backend: str, debias: bool, names: tuple[str, str, str, str] = ("a", "x", "b", "y")
) -> RaggedMeasures:
    """The :class:`RaggedMeasures` of a checked batch: each problem centred, the clouds and weights concatenated,
    on :func:`ragged_engine` (``debias``: with the ``(x, x)`` and ``(y, y)`` patterns)."""
    cx, cy = _centres(inp)
    lay = inp.layout
    a = inp.a if inp.a is not None else uniform_weights(lay, "x", inp.x)
    b = inp.b if inp.b is not None else uniform_weights(lay, "y", inp.y)
    m = Measures.build(inp.x - cx, inp.y - cy, a, b, cost=cost, backend="tiled", names=names)
    eng = ragged_engine(m.x.detach(), m.y.detach(), lay, backend, debias)
    base = {f.name: getattr(m, f.name) for f in fields(Measures)}
    base["engine"] = eng
    return RaggedMeasures(**base, layout=lay)
