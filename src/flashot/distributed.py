r"""One OT problem spread over the ranks of a ``torch.distributed`` process group.

Replicated mode (``shard="replicated"``, the default): every rank holds all the points and weights,
and :class:`ShardedEngine` wraps the ordinary single-device engine (``cpu``, ``tiled``,
``triton``, ``dense``, and the block-sparse engine of ``backend="multiscale"``) so that each
primitive computes only this rank's contiguous slice of the output rows and all-gathers the rest:

* ``softmin(x, y, h)`` and ``plan_product(x, y, ...)``: rank ``r`` computes rows
  ``[r N / W, (r + 1) N / W)`` with the inner engine; one ``all_gather`` of ``O(N K)`` numbers
  gives every rank the whole ``(B, N, K)`` result (exact: no reassociation).
* the fused steps ``softmin_pair`` and ``softmin_alt`` (one pass over the pairs for both
  potentials) keep their fusion: rank ``r`` runs them on ``(x_r, y)``, which gives complete
  rows of ``f`` on ``x_r`` and a *partial* column softmin over ``x_r``; the partials of all
  ranks are combined by a LogSumExp in rank order (``g = -eps log sum_r exp(-g_r / eps)``),
  which differs from one process by float reassociation only.  Both travel in ONE
  ``all_gather`` per step (``W M + N`` numbers received per rank per step; see ``stats``).
* ``softmin_sym`` (debiasing) is a row-sharded ``softmin(x, x, h)``.
* multiscale (:mod:`flashot.multiscale`): the coarse stage and the extrapolation of its potentials
  to the points shard their engine as above; the fine stage's block-sparse engine chooses the slices
  itself (``row_bounds``: ranges of whole row clusters, balanced by kept pairs) and computes only those
  rows (``rows=(lo, hi)``).  Clustering and pruning run on every rank on the same points and
  all-gathered potentials, so the ranks keep the same blocks; a hash of the kept blocks enters every
  header.
  ``shard="points"`` refuses it (the clustering needs the whole clouds).

Because every rank receives the same gathered bits and reduces them in the same order, every
rank holds bit-identical potentials, so the solver (:func:`flashot.solver.sinkhorn_loop`) runs
unchanged on each rank and takes the same stopping decisions.  Every collective also carries a
small header (operation, call number, an exact checksum of the call's inputs): ranks whose call
sequences or inputs diverge raise ``RuntimeError`` naming the ranks at the next call instead of
exchanging mismatched data.  The local reductions of the error check (``torch.sum``) round the
same way on ranks with the same torch build, CPU type and thread count (torchrun's default
``OMP_NUM_THREADS=1`` for every rank); a divergence there is caught by that header.

Front ends: ``solve_sample(..., group=pg)`` and ``SamplesLoss(..., group=pg)`` call
:func:`distribute_measures` after building the measures: it checks that shapes, dtypes, the
points themselves (replicated mode needs the same points on every rank), the cost, the engine
and the options agree across ranks (one ``all_gather_object``; ``ValueError`` naming the
argument and the ranks), then swaps in the sharded engine.  Everything that later applies the
plan (``OTResult.plan @ V``, ``marginals``, ``value_linear``, gradients) is then a collective
too: call it on every rank.

Bad arguments: every rank checks its own arguments first (:func:`shared_checks`: the options, finite points
and weights, shapes and dtypes that fit together), then the first collective of the call, one
``all_gather_object``, carries each rank's verdict with the fields compared across ranks
(:func:`check_same`, :func:`points_measures`): if a rank rejected its arguments, EVERY rank raises the same
exception (the rejecting rank's type and message, prefixed ``rank r rejected its input:``) within that one
collective, in both modes, so that no rank waits for the process group's timeout and ranks that catch the
error take the same branch.  ``SamplesLoss(..., group=pg)`` checks its options that way at construction
(one all-gather: construct it on every rank).

Failure: a rank that dies makes the others' next collective fail (gloo reports the closed
connection, usually at once); a rank that hangs, or raises outside those checks without exiting,
leaves the others blocked until the process group's ``timeout`` (``init_process_group(timeout=...)``,
30 minutes by default in torch), after which they raise.  Use a short timeout in jobs where a hang
costs.

Gradients: the backward passes (:mod:`flashot.ops.autograd`, :mod:`flashot.implicit`) are plan
products of the engine, so they shard too; each rank receives the full gradient w.r.t. the
(replicated) points and weights, identical on every rank.

Points-sharded ("ring") mode, ``shard="points"`` (for clouds that do not fit one device): every
rank passes only ITS slice of ``x`` (and ``a``) and of ``y`` (and ``b``); slices may be uneven, none
empty.  :func:`points_measures` checks the options across ranks, centres every slice on the centre of
ALL the points and bounds the cost over all pairs (one all-reduce of the bounding boxes), and wraps the
engine in a :class:`RingEngine`: each softmin / plan product sends the other side's blocks (points
plus potentials, or plus ``V``) around the ring of ranks and accumulates this rank's rows block by
block with the ordinary engine (LogSumExp / sum), like ring attention; the transposed direction sends
x blocks.  A rank holds its slices plus two blocks in flight (``O((n_r + 2 max m_r) D)`` memory) and
receives ``(W - 1) / W`` of the other cloud per primitive: ``(N + M)(D + 1)(W - 1) / W`` numbers per
alternating iteration (versus ``N + W M`` in replicated mode).  A symmetric step (``softmin_pair``,
GeomLoss' updates) is ONE ring pass: each y block travels with its partial column softmin, which every
rank updates with its rows, and comes home complete after W hops (``M (D + 2)`` numbers received).  The potentials stay sliced: the solver's error,
rounding floor, finiteness check and masses are all-reduced (:meth:`PointsMeasures.reduce`), so every
rank takes the same stopping decision.  Balanced values are the ranks' partial sums ``<a_r, f_r> + <b_r,
g_r>`` all-reduced (:func:`flashot.implicit.sinkhorn_value`), unbalanced ones are computed from
all-gathered ``O(N + M)`` vectors (:meth:`PointsMeasures.full`, differentiable: each rank's backward gets
its own slice); the same on every rank.  Potentials, marginals, ``plan @ V`` and the gradients w.r.t.
points and weights are this rank's slices (the single-process results' slices up to float
reassociation).  Also there: second derivatives of balanced values (``create_graph=True``: implicit
differentiation, whose plan products are ring passes that carry the other ranks' cotangents and whose
conjugate gradients all-reduce their inner products, :mod:`flashot.implicit`), ``value_linear``'s
gradient (the same machinery), ``SamplesLoss(warm_start=...)`` (each rank caches its slices; the
displacement and the cold / warm decision are all-reduced, :mod:`flashot.warmstart`),
``acceleration`` (Anderson's Gram matrix and right-hand side and the finiteness tests all-reduced,
:mod:`flashot.acceleration`), and ``plan.to_dense()`` / ``plan.topk(k)``: THIS rank's rows over all
columns (one ring pass of the column blocks; top-k merged block by block).  Not supported there (a
clear error): second derivatives of unbalanced values and ``np.asarray(plan)`` (the whole plan; naming
``to_dense`` and ``shard='replicated'``).  The user chooses the mode (:func:`pick_shard` states a simple
rule).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from ._checks import check_int
from .driver import check_init, solve_measures
from .measures import Measures, log64
from .ops.base import Capability, Engine, ForwardingEngine
from .ops.dense import check_dense_budget
from .plan import DENSE_PLAN_LIMIT, LazyPlan
from .results import OTResult

__all__ = [
    "SHARDS",
    "PointsMeasures",
    "RingEngine",
    "ShardedEngine",
    "check_group",
    "check_same",
    "distribute_measures",
    "distribute_solve",
    "pick_shard",
    "points_measures",
    "points_solve",
    "reject",
    "shared_checks",
]

_OPS = {"softmin": 1, "plan_product": 2, "softmin_pair": 3, "softmin_alt": 4, "softmin_sym": 5}
_OP_NAMES = {v: k for k, v in _OPS.items()}
_HEADER = 3  # op, call number, input checksum
_MOD = 1 << 22  # header integers stay exact in float32


def check_group(group) -> Any:
    """``group`` must be a ``torch.distributed`` process group of an initialised default group."""
    if not dist.is_available():
        raise RuntimeError("group: torch.distributed is not available in this torch build")
    if not dist.is_initialized():
        raise RuntimeError("group: torch.distributed is not initialised; call "
                           "torch.distributed.init_process_group(...) first (torchrun sets the environment)")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group: expected a torch.distributed ProcessGroup (e.g. torch.distributed.group.WORLD), "
                        f"got {type(group).__name__}")
    return group


def _bits_checksum(*ts: Tensor | None) -> int:
    """An exact, order-sensitive checksum of tensors' bits (integer sums: the same on every rank,
    whatever the thread count)."""
    total = 0
    for t in ts:
        if t is None:
            total = total * 31 + 7
            continue
        t = t.detach().contiguous().reshape(-1)
        if t.numel() == 0:
            total = total * 31 + 11
            continue
        if t.dtype == torch.float64:
            v = t.view(torch.int64)
        elif t.dtype == torch.float32:
            v = t.view(torch.int32).long()
        elif t.is_floating_point():
            v = t.view(torch.int16).long()
        else:
            v = t.long()
        pos = torch.arange(1, v.numel() + 1, dtype=torch.int64, device=v.device)  # on the device: scalars travel
        s1 = int(v.sum())
        s2 = int((v * pos).sum())  # wraps mod 2^64: still deterministic
        total = (total * 1000003 + s1 * 31 + s2 + t.numel()) % (1 << 61)
    return total


def _fold(v: int) -> int:
    """``v`` hashed to an integer below ``_MOD`` (exact in a float32 header)."""
    return int.from_bytes(hashlib.blake2b(v.to_bytes(8, "little"), digest_size=8).digest(), "little") % _MOD


def check_same(group, fields: dict[str, Any]) -> None:
    """All-gather ``fields`` (name -> comparable value) and raise ``ValueError`` naming the first argument
    that differs across ranks, with the ranks and their values.  The all-gather is :func:`_shared`'s: a rank
    that rejected its own arguments (:func:`shared_checks`) joins it with its error, and every rank raises that."""
    got = _shared(group, None, fields)
    for name in dict.fromkeys(k for g in got for k in g if k != "error"):  # every rank's names: the same mismatch
        vals = [g.get(name, "<missing>") for g in got]
        if any(v != vals[0] for v in vals[1:]):
            bad = [r for r, v in enumerate(vals) if v != vals[0]]
            shown = "; ".join(f"rank {r}: {vals[r]!r}" for r in [0] + bad[:3])
            raise ValueError(f"{name}: differs across the ranks of the process group (ranks {bad} differ from "
                             f"rank 0; {shown}); every rank must pass the same problem")


# the fused steps that shard by even row slices (each kept when the inner engine declares it)
_SHARDED_FUSED = frozenset({Capability.SOFTMIN_PAIR, Capability.SOFTMIN_ALT, Capability.EXPECT_REUSE})


class ShardedEngine(ForwardingEngine):
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

    def __init__(self, inner: Engine, group):
        own_rows = inner.supports(Capability.ROW_RANGES)  # the inner engine picks the slices (whole row blocks)
        fused = frozenset() if own_rows else inner.capabilities & _SHARDED_FUSED  # fused forms: even slices
        super().__init__(inner, fused | {Capability.SOFTMIN_SYM})
        self.group = check_group(group)
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.name = f"sharded({inner.name})"
        self.stats = {"calls": 0, "bytes": 0}
        self._calls = 0
        self._slices: OrderedDict = OrderedDict()
        self._own_rows = own_rows

    def __repr__(self) -> str:
        return f"ShardedEngine({self.inner.name!r}, rank {self.rank} of {self.world})"

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
    def _exchange(self, op: str, rows: list[tuple[Tensor, list[tuple[int, int]]]], partials: list[Tensor],
                  inputs) -> tuple:
        """One all-gather: ``rows`` = (this rank's (B, n_r, ...) slice, every rank's rows ``[lo, hi)``) pieces,
        concatenated across ranks in rank order; ``partials`` = (B, M) pieces, returned stacked as (W, B, M).
        A header (op, call number, input checksum) checks that all ranks are at the same call with the same
        inputs."""
        ref = (rows[0][0] if rows else partials[0])
        dtype, device = ref.dtype, ref.device
        self._calls += 1
        chk = _fold(_bits_checksum(*inputs))
        head = torch.tensor([_OPS[op], self._calls % _MOD, chk], dtype=dtype, device=device)
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
            desc = "; ".join(f"rank {k}: {_OP_NAMES.get(heads[k][0], '?')} call {heads[k][1]} inputs {heads[k][2]:#x}"
                             for k in [0] + bad[:3])
            raise RuntimeError(f"distributed Sinkhorn: the ranks diverged ({desc}): every rank must run the same "
                               "calls on the same data (same options, torch build, CPU type and thread count)")
        out = []
        off = _HEADER
        for B, cap, rest, spans in shapes:
            size = B * cap * math.prod(rest)
            parts = []
            for k in range(self.world):
                lo, hi = spans[k]
                parts.append(recv[k][off:off + size].view(B, cap, *rest)[:, : hi - lo])
            out.append(torch.cat(parts, 1))
            off += size
        for p in partials:
            size = p.numel()
            out.append(torch.stack([recv[k][off:off + size].view(p.shape) for k in range(self.world)]))
            off += size
        return tuple(out)

    @staticmethod
    def _lse_combine(parts: Tensor, eps: float) -> Tensor:
        """``-eps log sum_r exp(-parts_r / eps)`` over the (W, ...) partial softmins, in rank order."""
        return -eps * torch.logsumexp(-parts / eps, dim=0)

    # -- the contract ---------------------------------------------------------------------
    def softmin(self, x: Tensor, y: Tensor, h: Tensor, eps: float, cost) -> Tensor:
        return self._softmin("softmin", x, y, h, eps, cost, (x, y, h))

    def _softmin(self, op: str, x: Tensor, y: Tensor, h: Tensor, eps: float, cost, inputs: tuple) -> Tensor:
        def even(xr):
            return x.new_full((x.shape[0], 0), math.inf) if xr is None else self.inner.softmin(xr, y, h, eps, cost)
        return self._row_call(op, x, y, inputs, even, lambda rows: self.inner.softmin(x, y, h, eps, cost, rows=rows))

    def plan_product(self, x, y, alpha, beta, eps, V, cost, weight="plan"):
        def even(xr):
            if xr is None:
                return V.new_zeros((x.shape[0], 0, V.shape[-1]))
            return self.inner.plan_product(xr, y, self._vec(alpha), beta, eps, V, cost, weight)
        return self._row_call("plan_product", x, y, (x, y, alpha, beta, V), even,
                              lambda rows: self.inner.plan_product(x, y, alpha, beta, eps, V, cost, weight, rows=rows))

    def _fused(self, op: str, x, y, hx, hy, eps, call) -> tuple[Tensor, Tensor]:
        xr, hr = self._rows(x), self._vec(hx)
        if xr.shape[1] == 0:
            fr = x.new_full((x.shape[0], 0), math.inf)
            gp = x.new_full(hy.shape, math.inf)
        else:
            fr, gp = call(xr, hr)
        f, parts = self._exchange(op, [(fr, self._spans(x.shape[1]))], [gp.contiguous()], (x, y, hx, hy))
        return f, self._lse_combine(parts, eps)

    def softmin_pair(self, x, y, hx, hy, eps, cost):
        return self._fused("softmin_pair", x, y, hx, hy, eps,
                           lambda xr, hr: self.inner.softmin_pair(xr, y, hr, hy, eps, cost))

    def softmin_alt(self, x, y, ha, hy, eps, cost, lam=1.0):
        return self._fused("softmin_alt", x, y, ha, hy, eps,
                           lambda xr, hr: self.inner.softmin_alt(xr, y, hr, hy, eps, cost, lam))

    def softmin_sym(self, x: Tensor, h: Tensor, eps: float, cost) -> Tensor:
        return self._softmin("softmin_sym", x, x, h, eps, cost, (x, h))

    def expect_reuse(self, x: Tensor, y: Tensor, cost) -> None:
        lo, hi = self.bounds(x.shape[1])
        if hi > lo and self.supports(Capability.EXPECT_REUSE):  # the inner engine takes it, even slices
            self.inner.expect_reuse(self._rows(x), y, cost)


# -- front-end helpers ------------------------------------------------------------------


def distribute_measures(m, group, options: dict[str, Any] | None = None,
                        names: tuple[str, str, str, str] = ("x", "y", "α", "β")):
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
        fields[f"{nm} (shape, dtype)"] = (tuple(t.shape[1 - m.batched:]), str(t.dtype))
    fields["cost"] = getattr(m.cost, "name", repr(m.cost))
    fields["backend (the engine each rank resolved)"] = m.engine.name
    for k, v in (options or {}).items():
        fields[k] = v
    # replicated mode: the data must be the same on every rank (after the shapes: clearer errors first)
    for nm, t in ((xn, m.x), (yn, m.y)):
        fields[f"{nm} (the points: replicated mode needs the same points on every rank)"] = \
            f"bits checksum {_bits_checksum(t):#x}"
    for nm, t in ((an, m.a), (bn, m.b)):
        fields[f"{nm} (the weights)"] = f"bits checksum {_bits_checksum(t):#x}"
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


def _control_device(group) -> torch.device:
    """Where a small control tensor of ``group``'s collectives lives: NCCL takes CUDA tensors only (the current
    device, which torchrun users set with ``torch.cuda.set_device``), gloo and mixed backends CPU ones."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _collective_callback(cb, group):
    """A callback whose stop decision is taken by all ranks together (any rank stopping stops all)."""
    device = _control_device(group)

    def wrapped(rec):
        stop = cb(rec) is True
        t = torch.tensor([1 if stop else 0], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return bool(t.item())
    return wrapped


def distribute_solve(m, opts, group, potentials_init=None, options: dict[str, Any] | None = None):
    """:func:`flashot.solve_sample`'s hook: check the problem and the options (plus ``options``, name ->
    value) across ranks, shard the engine, make the callback's stop decision collective and show the
    progress bar on rank 0 only.  Returns the options to solve with."""
    check_group(group)
    fields = {
        "reg": opts.reg, "max_iter": opts.max_iter, "tol": opts.tol, "method": opts.method,
        "eps_scaling": opts.eps_scaling, "unbalanced": (opts.rho_a, opts.rho_b),
        "inner_iterations": opts.inner_iterations, "acceleration": repr(opts.acceleration),
        "implicit": repr(opts.implicit), "grad": opts.grad, "callback (given or not)": opts.callback is not None,
    }
    if potentials_init is None:
        fields["potentials_init"] = None
    else:
        f0, g0 = potentials_init
        fields["potentials_init"] = tuple(_bits_checksum(torch.as_tensor(t)) for t in (f0, g0))
    fields.update(options or {})
    distribute_measures(m, group, fields, names=("X_a", "X_b", "a", "b"))
    rank = dist.get_rank(group)
    cb = None if opts.callback is None else _collective_callback(opts.callback, group)
    return replace(opts, callback=cb, verbose=opts.verbose and rank == 0)


# =====================================================================================================
# Points-sharded ("ring") mode: every rank holds only its slice of x (and a) and of y (and b)
# =====================================================================================================

SHARDS = ("replicated", "points")
_RING_OPS = {"softmin": 1, "plan_product": 2, "softmin_pair": 3, "to_dense": 4, "topk": 5}
_RING_HEAD = 7  # op, call number, batch, three part widths, this rank's block length


def pick_shard(n: int, m: int, d: int, dtype: torch.dtype = torch.float32, budget_bytes: int = 1 << 30) -> str:
    """``"replicated"`` while all the points, ``(n + m) d`` numbers of ``dtype``, fit ``budget_bytes`` per
    rank (default 1 GiB: replicated mode is faster, it sends only ``O(n + m)`` numbers per iteration),
    else ``"points"`` (each rank then holds ``~(n + m) d / W`` of them)."""
    size = (n + m) * d * torch.empty((), dtype=dtype).element_size()
    return "replicated" if size <= budget_bytes else "points"


def check_shard(shard: str, group) -> str:
    """``shard`` must name a mode of :data:`SHARDS`; ``"points"`` needs a process group."""
    if not isinstance(shard, str) or shard not in SHARDS:
        raise ValueError(f"shard: expected one of {SHARDS}, got {shard!r}")
    if shard == "points" and group is None:
        raise ValueError("shard='points' needs group= (a torch.distributed process group); "
                         "on one process pass all the points without shard=")
    return shard


def _lse2(acc: Tensor, out: Tensor, eps: float) -> Tensor:
    """``-eps log(exp(-acc / eps) + exp(-out / eps))``: two partial softmins over disjoint blocks combined."""
    return -eps * torch.logaddexp(-acc / eps, -out / eps)


class RingEngine(ForwardingEngine):
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

    def __init__(self, inner: Engine, group):
        super().__init__(inner, (inner.capabilities & {Capability.SOFTMIN_PAIR}) | {Capability.RING_VISIT})
        self.group = check_group(group)
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.name = f"ring({inner.name})"
        self.stats = {"calls": 0, "bytes": 0}
        self._calls = 0
        self._next = dist.get_global_rank(group, (self.rank + 1) % self.world)
        self._prev = dist.get_global_rank(group, (self.rank - 1) % self.world)

    def __repr__(self) -> str:
        return f"RingEngine({self.inner.name!r}, rank {self.rank} of {self.world})"

    def _header(self, op: str, parts: list[Tensor]) -> list[int]:
        """All-gather (op, call number, batch, widths, block length); raise if the ranks' calls differ.
        Returns every rank's block length."""
        self._calls += 1
        widths = [p.shape[2] for p in parts] + [0] * (3 - len(parts))
        head = torch.tensor([_RING_OPS[op], self._calls % _MOD, parts[0].shape[0], *widths, parts[0].shape[1]],
                            dtype=torch.int64, device=parts[0].device)
        got = [torch.empty_like(head) for _ in range(self.world)]
        dist.all_gather(got, head, group=self.group)
        self.stats["calls"] += 1
        self.stats["bytes"] += head.numel() * 8 * self.world
        heads = [tuple(int(v) for v in g.tolist()) for g in got]
        if any(h[:-1] != heads[0][:-1] for h in heads[1:]):
            bad = [k for k, h in enumerate(heads) if h[:-1] != heads[0][:-1]]
            names = {v: n for n, v in _RING_OPS.items()}
            desc = "; ".join(f"rank {k}: {names.get(heads[k][0], '?')} call "
                             f"{heads[k][1]}, batch {heads[k][2]}, widths {heads[k][3:6]}" for k in [0] + bad[:3])
            raise RuntimeError(f"distributed Sinkhorn (shard='points'): the ranks diverged ({desc}): every rank must "
                               "run the same calls with the same options")
        return [h[-1] for h in heads]

    @staticmethod
    def _pack(buf: Tensor, parts: list[Tensor], cap: int) -> None:
        off = 0
        for p in parts:
            B, n, w = p.shape
            buf[off:off + B * cap * w].view(B, cap, w)[:, :n] = p
            off += B * cap * w

    @staticmethod
    def _slot(buf: Tensor, parts: list[Tensor], cap: int, k: int) -> Tensor:
        """The (B, cap, w) view of part ``k`` in a packed buffer."""
        off = sum(p.shape[0] * cap * p.shape[2] for p in parts[:k])
        B, _, w = parts[k].shape
        return buf[off:off + B * cap * w].view(B, cap, w)

    @classmethod
    def _unpack(cls, buf: Tensor, parts: list[Tensor], cap: int, n: int) -> list[Tensor]:
        return [cls._slot(buf, parts, cap, k)[:, :n].to(p.dtype).contiguous() for k, p in enumerate(parts)]

    def _ring(self, op: str, parts: list[Tensor], fn, combine) -> Tensor:
        """``combine`` over the ranks' blocks of ``fn(*block)``, ``parts`` = this rank's (B, m_r, w) block.
        Hop ``k`` sends the block held to rank + 1 and receives rank - k - 1's while ``fn`` runs."""
        lens = self._header(op, parts)
        if self.world == 1:
            return fn(*parts)
        dtype = parts[0].dtype
        for p in parts[1:]:
            dtype = torch.promote_types(dtype, p.dtype)
        cap = max(lens)
        buf = parts[0].new_zeros(parts[0].shape[0] * cap * sum(p.shape[2] for p in parts), dtype=dtype)
        self._pack(buf, parts, cap)
        nxt = torch.empty_like(buf)
        acc = None
        for step in range(self.world):
            more = step < self.world - 1
            if more:
                reqs = [dist.isend(buf, self._next, group=self.group), dist.irecv(nxt, self._prev, group=self.group)]
            block = parts if step == 0 else self._unpack(buf, parts, cap, lens[(self.rank - step) % self.world])
            out = fn(*block)
            acc = out if acc is None else combine(acc, out)
            if more:
                for q in reqs:
                    q.wait()
                self.stats["bytes"] += nxt.numel() * nxt.element_size()
                buf, nxt = nxt, buf
        return acc

    def ring_visit(self, op: str, parts: list[Tensor], fn, combine):
        """:meth:`_ring` with ``fn(src, *block)``, ``src`` the rank whose block it is (the blocks arrive in
        the order rank, rank - 1, ..., rank + 1): for results that depend on the block's place (its
        global column indices)."""
        steps = iter(range(self.world))
        return self._ring(op, parts, lambda *blk: fn((self.rank - next(steps)) % self.world, *blk), combine)

    # -- the contract ---------------------------------------------------------------------
    def softmin(self, x: Tensor, y: Tensor, h: Tensor, eps: float, cost) -> Tensor:
        """This rank's rows of ``-eps log sum_j exp(h_j - C(x_i, y_j) / eps)`` over every rank's block (y, h)."""
        def part(yb, hb):
            return self.inner.softmin(x, yb, hb[..., 0], eps, cost)
        return self._ring("softmin", [y, h.unsqueeze(-1)], part, lambda acc, o: _lse2(acc, o, eps))

    def softmin_pair(self, x: Tensor, y: Tensor, hx: Tensor, hy: Tensor, eps: float, cost) -> tuple[Tensor, Tensor]:
        """``(softmin(x, y, hy), softmin(y, x, hx))`` for this rank's rows of x and of y, in ONE ring pass:
        each y block travels with its potential and its partial column softmin, which every rank updates
        with its rows (the inner engine's fused ``softmin_pair``); after W hops each block is home, complete."""
        parts = [y, hy.unsqueeze(-1), hy.unsqueeze(-1)]  # points, log-weights, accumulator (shape only here)
        lens = self._header("softmin_pair", parts)
        f, g = self.inner.softmin_pair(x, y, hx, hy, eps, cost)  # own block: rows of f, partial g over x_r
        if self.world == 1:
            return f, g
        parts[2] = g.unsqueeze(-1)
        dtype = torch.promote_types(torch.promote_types(y.dtype, hy.dtype), g.dtype)
        cap = max(lens)
        buf = y.new_zeros(y.shape[0] * cap * (y.shape[2] + 2), dtype=dtype)
        self._pack(buf, parts, cap)
        nxt = torch.empty_like(buf)
        for hop in range(1, self.world + 1):
            reqs = [dist.isend(buf, self._next, group=self.group), dist.irecv(nxt, self._prev, group=self.group)]
            for q in reqs:
                q.wait()
            self.stats["bytes"] += nxt.numel() * nxt.element_size()
            buf, nxt = nxt, buf
            n = lens[(self.rank - hop) % self.world]
            yb, hb, acc = self._unpack(buf, parts, cap, n)
            if hop == self.world:  # our own block, back with every rank's partial
                return f, acc[..., 0]
            fp, gp = self.inner.softmin_pair(x, yb, hx, hb[..., 0], eps, cost)
            f = _lse2(f, fp, eps)
            self._slot(buf, parts, cap, 2)[:, :n, 0] = _lse2(acc[..., 0], gp, eps).to(dtype)
        raise AssertionError("unreachable")

    def plan_product(self, x, y, alpha, beta, eps, V, cost, weight="plan"):
        """This rank's rows of ``sum_j exp(alpha_i + beta_j - C_ij / eps) W_ij V_j`` over every rank's block."""
        def part(yb, bb, Vb):
            return self.inner.plan_product(x, yb, alpha, bb[..., 0], eps, Vb, cost, weight)
        return self._ring("plan_product", [y, beta.unsqueeze(-1), V], part, torch.add)


class _GatherFn(torch.autograd.Function):
    """All-gather of per-rank (B, n_r) slices into whole vectors; backward: this rank's slice of the
    gradient (every rank computes the same function of the gathered vectors).  The unbalanced
    points-sharded values go through it (the balanced ones through :func:`flashot.implicit.sinkhorn_value`),
    so its backward refuses ``create_graph=True``: those values have first derivatives only (the final
    step's envelope gradients)."""

    @staticmethod
    def forward(ctx, m, sides, *ts):
        ctx.m, ctx.sides = m, sides
        return tuple(m._gather(sides, ts))

    @staticmethod
    def backward(ctx, *grads):
        if torch.is_grad_enabled():
            raise NotImplementedError("second derivatives (create_graph=True) of unbalanced OT are not implemented "
                                      "with shard='points'; balanced problems have them (implicit differentiation)")
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
        return g[:, lo:lo + n]

    def _gather(self, sides: str, ts) -> list[Tensor]:
        """One all-gather of the (B, n_r) slices ``ts`` (padded to the largest slice of their side)."""
        world = dist.get_world_size(self.group)
        caps = {s: max(self.counts[0 if s == "x" else 1]) for s in "xy"}
        dtype = ts[0].dtype
        for t in ts[1:]:
            dtype = torch.promote_types(dtype, t.dtype)
        send = torch.cat([F.pad(t.detach().to(dtype), (0, caps[s] - t.shape[1])).reshape(-1)
                          for t, s in zip(ts, sides)])
        recv = [torch.empty_like(send) for _ in range(world)]
        dist.all_gather(recv, send, group=self.group)
        out, off = [], 0
        for t, s in zip(ts, sides):
            B, cap, c = t.shape[0], caps[s], self.counts[0 if s == "x" else 1]
            out.append(torch.cat([recv[k][off:off + B * cap].view(B, cap)[:, :c[k]] for k in range(world)], 1)
                       .to(t.dtype))
            off += B * cap
        return out

    @cached_property
    def _a_log64(self) -> Tensor:
        return log64(self.a, self.sizes[0])  # uniform weights are 1 / N over all ranks' points

    @cached_property
    def _b_log64(self) -> Tensor:
        return log64(self.b, self.sizes[1])

    def float64_engine(self):
        eng = super().float64_engine()
        return eng if isinstance(eng, RingEngine) else RingEngine(eng, self.group)


# the exception types a rejecting rank's error keeps on every rank (others become RuntimeError): ranks that
# catch an exception type take the same branch, so their later collectives still pair up
_SHARED_TYPES = {t.__name__: t for t in (TypeError, ValueError, NotImplementedError, MemoryError, OverflowError,
                                         RuntimeError)}


def _shared(group, local_error: Exception | None, fields: dict[str, Any]) -> list[dict]:
    """All-gather this rank's error (or None) and ``fields``; if a rank rejected its input, raise on EVERY rank
    the same exception (type and message: the first such rank's, naming it), so that no rank is left waiting
    in a later collective and all ranks take the same branch.  Returns every rank's dict."""
    world = dist.get_world_size(group)
    got: list = [None] * world
    mine = None if local_error is None else (type(local_error).__name__, str(local_error))
    dist.all_gather_object(got, {"error": mine, **fields}, group=group)
    bad = [r for r, g in enumerate(got) if g["error"] is not None]
    if not bad:
        return got
    kind, msg = got[bad[0]]["error"]
    who = f"rank {bad[0]} rejected its input" if len(bad) == 1 else \
        f"ranks {bad} rejected their input; rank {bad[0]}'s error"
    err = _SHARED_TYPES.get(kind, RuntimeError)(f"{who}: {msg} (every rank of the process group raises this)")
    raise err from local_error


def reject(group, error: Exception) -> None:
    """Raise ``error`` (this rank's rejection of its arguments) on every rank of ``group``: one all-gather, the
    one that opens every distributed call (:func:`check_same`, :func:`points_measures`), so that the ranks
    whose arguments passed raise at their first collective instead of waiting there for the process group's
    timeout.  Never returns."""
    _shared(group, error, {})
    raise AssertionError("unreachable")  # _shared raised


@contextmanager
def shared_checks(group, collective: bool = False) -> Iterator[None]:
    """Run a distributed call's LOCAL argument checks (no collective inside): an exception raised in the block
    is sent to the other ranks of ``group`` (:func:`reject`) and every rank raises the same one, naming this
    rank and the argument.  Without ``collective`` the ranks whose checks passed learn of it at the call's first
    collective, which must be :func:`_shared`'s all-gather (:func:`check_same`, :func:`points_measures`);
    ``collective=True`` (checks that no collective follows, e.g. a constructor's) runs that all-gather on
    success too.  ``group=None``: the checks raise as in one process."""
    if group is None:
        yield
        return
    check_group(group)
    try:
        yield
    except Exception as e:  # noqa: BLE001 - any rejection must reach the other ranks, or they wait
        reject(group, e)
    if collective:
        _shared(group, None, {})


def _global_box(xb: Tensor, yb: Tensor, group) -> tuple[Tensor, Tensor]:
    """``(lo, hi)``, (B, D): the joint bounding box of every rank's clouds (one all-reduce)."""
    lo = torch.minimum(xb.detach().amin(-2), yb.detach().amin(-2))
    hi = torch.maximum(xb.detach().amax(-2), yb.detach().amax(-2))
    both = torch.stack([lo, -hi])
    dist.all_reduce(both, op=dist.ReduceOp.MIN, group=group)
    return both[0], -both[1]


def points_measures(x: Tensor, y: Tensor, a: Tensor | None, b: Tensor | None, *, group, build,
                    options: dict[str, Any] | None = None,
                    names: tuple[str, str, str, str] = ("x", "y", "a", "b")) -> PointsMeasures:
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
                raise ValueError(f"{nm}: this rank's slice holds no points (shape {tuple(t.shape)}); shard='points' "
                                 "needs at least one point of each cloud on every rank")
        m, err = build(x, y, a, b), None
    except Exception as e:  # noqa: BLE001 - shared below: every rank raises it
        m, err = None, e
    fields: dict[str, Any] = {}
    if m is not None:
        fields = {"world size": dist.get_world_size(group),
                  f"{xn}, {yn} (batch, dimension, dtype)": (m.x.shape[0], m.x.shape[2], str(m.x.dtype)),
                  "cost": getattr(m.cost, "name", repr(m.cost)),
                  "backend (the engine each rank resolved)": m.engine.name,
                  "weights given": (a is not None, b is not None), **(options or {})}
        fields["_counts"] = (m.x.shape[1], m.y.shape[1])
    got = _shared(group, err, fields)
    for name in fields:
        if name != "_counts":
            check_same_values(name, [g[name] for g in got])
    cx, cy = tuple(g["_counts"][0] for g in got), tuple(g["_counts"][1] for g in got)
    empty = [r for r in range(len(got)) if cx[r] == 0 or cy[r] == 0]
    if empty:
        raise ValueError(f"{xn}, {yn}: rank {empty[0]} holds no points of one cloud ({xn}: {cx}, {yn}: {cy} per "
                         "rank); shard='points' needs at least one point of each cloud on every rank")
    return _global_measures(m, x, y, a, b, group, (cx, cy))


def check_same_values(name: str, vals: list) -> None:
    """``ValueError`` naming ``name`` and the ranks whose value differs from rank 0's."""
    if any(v != vals[0] for v in vals[1:]):
        bad = [r for r, v in enumerate(vals) if v != vals[0]]
        shown = "; ".join(f"rank {r}: {vals[r]!r}" for r in [0] + bad[:3])
        raise ValueError(f"{name}: differs across the ranks of the process group (ranks {bad} differ from "
                         f"rank 0; {shown}); every rank must pass the same options")


def _global_measures(m: Measures, x, y, a, b, group, counts) -> PointsMeasures:
    """Re-centre ``m`` on the centre of all the points, bound the cost over all pairs, weights ``1/N``
    where none were given, and wrap the engine in a :class:`RingEngine`."""
    from .measures import log_weights
    from .ops import max_cost

    cdt = m.x.dtype
    xb, yb = (x, y) if m.batched else (x.unsqueeze(0), y.unsqueeze(0))
    xb, yb = xb.to(cdt), yb.to(cdt)
    lo, hi = _global_box(xb, yb, group)
    c = ((lo + hi) / 2).unsqueeze(-2)
    corners = torch.stack([lo, hi], -2)  # the bounding box of all points: max_cost checks overflow too
    cmax = max_cost(corners, corners, m.cost, cdt)
    diameter = float((hi.amax(0) - lo.amin(0)).double().norm())
    fields = {f.name: getattr(m, f.name) for f in dataclasses.fields(Measures)}
    fields.update(x=(xb - c).contiguous(), y=(yb - c).contiguous(), center=c, cmax=cmax)
    fields["engine"] = RingEngine(m.engine, group)
    for side, w, k in (("a", a, 0), ("b", b, 1)):
        if w is None:
            uni = torch.full_like(fields[side], 1.0 / sum(counts[k]))
            fields[side], fields[f"{side}_log"] = uni, log_weights(uni)
    return PointsMeasures(**fields, group=group, counts=counts, diameter=diameter)


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
    def T(self) -> PointsPlan:
        return PointsPlan(self._m, self._f, self._g, self.eps, transposed=not self._t, numpy=self._numpy)

    def sum(self, axis: int | None = None):
        """``sum_ij P_ij`` over all ranks (``axis=None``), else this rank's column / row sums."""
        if axis is None:
            return self._finish(self._m.reduce(self._apply_raw(self._ones())[..., 0].sum(-1)))
        return super().sum(axis)

    def cost_sum(self) -> Tensor:
        """``<C, P>`` over all ranks, (B,)."""
        return self._m.reduce(super().cost_sum())

    def __array__(self, dtype=None, copy=None):
        raise NotImplementedError("np.asarray(plan): not available for a points-sharded plan (shard='points': "
                                  "each rank holds a slice of the rows); plan.to_dense() gives this rank's rows, "
                                  "shard='replicated' the whole plan")

    def _columns(self) -> tuple[int, list[int]]:
        """``(M, offsets)``: the columns of the plan (over all ranks) and where each rank's block starts."""
        c = self._m.counts[0 if self._t else 1]
        return sum(c), [sum(c[:r]) for r in range(len(c))]

    def _agree(self, error: Exception | None, **fields) -> None:
        """Raise on every rank if one rank's arguments were rejected or ``fields`` differ (before a ring
        pass, which would otherwise wait for the rank that raised)."""
        got = _shared(self._m.group, error, fields)
        for name in fields:
            check_same_values(name, [g[name] for g in got])

    def to_dense(self, max_elems: int = DENSE_PLAN_LIMIT):
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
                raise MemoryError(f"to_dense: this rank's rows of the plan have {n:,} entries (shape "
                                  f"{(x.shape[0], x.shape[1], M)}), above max_elems={max_elems:,}; use plan @ V, "
                                  "plan.T @ U or raise max_elems explicitly")
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

    def topk(self, k: int):
        """The ``k`` largest entries of each of THIS rank's rows over all columns, and their (global)
        column indices: (n_r, k) (or (B, n_r, k)), sorted in decreasing order (the single process's rows
        of this rank's points).  A collective: one ring pass of the column blocks, each rank keeping a
        running top-k of ``g_j + eps log b_j - C(x_i, y_j)`` merged block by block (memory O(n_r k))."""
        from .ops.rowtopk import row_topk

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
    ranks; its gradient (:class:`flashot.implicit.LinearValueFn`: ring plan products, the conjugate
    gradients' inner products all-reduced) gives each rank the gradients w.r.t. its own points and
    weights.  Both are collectives: call them on every rank."""


def _points_result(res: OTResult) -> PointsOTResult:
    """``res`` with the plan of a points-sharded solve."""
    p = res.plan
    out = PointsOTResult(**{f.name: getattr(res, f.name) for f in dataclasses.fields(OTResult)})
    out.plan = PointsPlan(p.measures, *p.raw_potentials, p.eps, numpy=p.returns_numpy)
    return out


def points_solve(X_a: Tensor, X_b: Tensor, a, b, *, cost, backend: str, opts, group, potentials_init=None,
                 numpy: bool = False):
    """:func:`flashot.solve_sample` with ``shard="points"``: ONE problem whose points and weights are split
    over the ranks of ``group`` (this rank passes its slices); potentials, marginals and gradients are this
    rank's slices, values the whole problem's (same on every rank).  Options are checked across ranks.
    ``opts.implicit`` sets the conjugate gradients of the second derivatives and of ``value_linear``'s
    gradient (:mod:`flashot.implicit`, as in one process)."""
    check_group(group)
    fields = {
        "reg": opts.reg, "max_iter": opts.max_iter, "tol": opts.tol, "method": opts.method,
        "eps_scaling": opts.eps_scaling, "unbalanced": (opts.rho_a, opts.rho_b),
        "inner_iterations": opts.inner_iterations, "grad": opts.grad,
        "callback (given or not)": opts.callback is not None, "potentials_init (given or not)": potentials_init is not None,
        "implicit": repr(opts.implicit), "acceleration": repr(opts.acceleration),
    }

    def build(x, y, a_, b_):  # inside points_measures: an error on one rank is raised on every rank
        m = Measures.build(x, y, a_, b_, cost=cost, backend=backend, names=("a", "X_a", "b", "X_b"))
        if potentials_init is not None:  # this rank's slices of the potentials
            check_init(potentials_init, m)
        return m

    m = points_measures(X_a, X_b, a, b, group=group, build=build, options=fields, names=("X_a", "X_b", "a", "b"))
    cb = None if opts.callback is None else _collective_callback(opts.callback, group)
    opts = replace(opts, callback=cb, verbose=opts.verbose and dist.get_rank(group) == 0)
    m.implicit_diff = opts.implicit  # value_linear's gradient of an unbalanced solve (sinkhorn_value sets it else)
    return _points_result(solve_measures(m, opts, potentials_init, numpy=numpy))
