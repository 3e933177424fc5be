r"""One OT problem spread over the ranks of a ``torch.distributed`` process group.

Replicated mode (this module's first slice): every rank holds all the points and weights,
and :class:`ShardedEngine` wraps the ordinary single-device engine (``cpu``, ``tiled``,
``triton``, ``dense``) so that each primitive computes only this rank's contiguous slice of
the output rows and all-gathers the rest:

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

Failure: a rank that dies makes the others' next collective fail (gloo reports the closed
connection, usually at once); a rank that hangs or raises without exiting leaves the others
blocked until the process group's ``timeout`` (``init_process_group(timeout=...)``, 30 minutes
by default in torch), after which they raise.  Use a short timeout in jobs where a hang costs.

Gradients: the backward passes (:mod:`flashot.ops.autograd`, :mod:`flashot.implicit`) are plan
products of the engine, so they shard too; each rank receives the full gradient w.r.t. the
(replicated) points and weights, identical on every rank.

Not done yet: the points-sharded (ring) mode for clouds that do not fit one device.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["ShardedEngine", "distribute_measures", "distribute_solve", "check_group", "check_same"]

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
    that differs across ranks, with the ranks and their values."""
    world = dist.get_world_size(group)
    got: list = [None] * world
    dist.all_gather_object(got, fields, group=group)
    for name in fields:
        vals = [g.get(name, "<missing>") for g in got]
        if any(v != vals[0] for v in vals[1:]):
            bad = [r for r, v in enumerate(vals) if v != vals[0]]
            shown = "; ".join(f"rank {r}: {vals[r]!r}" for r in [0] + bad[:3])
            raise ValueError(f"{name}: differs across the ranks of the process group (ranks {bad} differ from "
                             f"rank 0; {shown}); every rank must pass the same problem")


class ShardedEngine:
    """An engine that computes this rank's slice of the rows with ``inner`` and all-gathers the rest.

    Implements the engine contract (:mod:`flashot.ops.base`) plus ``softmin_pair`` / ``softmin_alt``
    when ``inner`` has them, ``softmin_sym`` and ``expect_reuse``.  ``stats``: ``calls`` (collectives)
    and ``bytes`` (bytes received by this rank's all-gathers, own slice included).
    """

    def __init__(self, inner, group):
        self.inner = inner
        self.group = check_group(group)
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.name = f"sharded({inner.name})"
        self.stats = {"calls": 0, "bytes": 0}
        self._calls = 0
        self._slices: OrderedDict = OrderedDict()
        if hasattr(inner, "softmin_pair"):
            self.softmin_pair = self._softmin_pair
        if hasattr(inner, "softmin_alt"):
            self.softmin_alt = self._softmin_alt

    def __repr__(self) -> str:
        return f"ShardedEngine({self.inner.name!r}, rank {self.rank} of {self.world})"

    def unsupported(self, device, dtype, cost):
        return self.inner.unsupported(device, dtype, cost)

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

    # -- the one collective ---------------------------------------------------------------
    def _exchange(self, op: str, rows: list[tuple[Tensor, int]], partials: list[Tensor], inputs) -> tuple:
        """One all-gather: ``rows`` = (this rank's (B, n_r, ...) slice, N) pieces, concatenated across ranks
        in rank order; ``partials`` = (B, M) pieces, returned stacked as (W, B, M).  A header (op, call
        number, input checksum) checks that all ranks are at the same call with the same inputs."""
        ref = (rows[0][0] if rows else partials[0])
        dtype, device = ref.dtype, ref.device
        self._calls += 1
        chk = _fold(_bits_checksum(*inputs))
        head = torch.tensor([_OPS[op], self._calls % _MOD, chk], dtype=dtype, device=device)
        flat = [head]
        shapes = []
        for t, n in rows:
            B, nr = t.shape[0], t.shape[1]
            rest = tuple(t.shape[2:])
            cap = -(-n // self.world)  # the largest slice
            pad = t.new_zeros((B, cap, *rest))
            pad[:, :nr] = t
            flat.append(pad.reshape(-1))
            shapes.append((B, cap, rest, n))
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
        for B, cap, rest, n in shapes:
            size = B * cap * math.prod(rest)
            parts = []
            for k in range(self.world):
                lo, hi = self.bounds(n, k)
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
        xr = self._rows(x)
        if xr.shape[1] == 0:
            out = x.new_full((x.shape[0], 0), math.inf)
        else:
            out = self.inner.softmin(xr, y, h, eps, cost)
        return self._exchange("softmin", [(out, x.shape[1])], [], (x, y, h))[0]

    def plan_product(self, x, y, alpha, beta, eps, V, cost, weight="plan"):
        xr = self._rows(x)
        if xr.shape[1] == 0:
            out = V.new_zeros((x.shape[0], 0, V.shape[-1]))
        else:
            out = self.inner.plan_product(xr, y, self._vec(alpha), beta, eps, V, cost, weight)
        return self._exchange("plan_product", [(out, x.shape[1])], [], (x, y, alpha, beta, V))[0]

    def _fused(self, op: str, x, y, hx, hy, eps, call) -> tuple[Tensor, Tensor]:
        xr, hr = self._rows(x), self._vec(hx)
        if xr.shape[1] == 0:
            fr = x.new_full((x.shape[0], 0), math.inf)
            gp = x.new_full(hy.shape, math.inf)
        else:
            fr, gp = call(xr, hr)
        f, parts = self._exchange(op, [(fr, x.shape[1])], [gp.contiguous()], (x, y, hx, hy))
        return f, self._lse_combine(parts, eps)

    def _softmin_pair(self, x, y, hx, hy, eps, cost):
        return self._fused("softmin_pair", x, y, hx, hy, eps,
                           lambda xr, hr: self.inner.softmin_pair(xr, y, hr, hy, eps, cost))

    def _softmin_alt(self, x, y, ha, hy, eps, cost, lam=1.0):
        return self._fused("softmin_alt", x, y, ha, hy, eps,
                           lambda xr, hr: self.inner.softmin_alt(xr, y, hr, hy, eps, cost, lam))

    def softmin_sym(self, x: Tensor, h: Tensor, eps: float, cost) -> Tensor:
        xr = self._rows(x)
        if xr.shape[1] == 0:
            out = x.new_full((x.shape[0], 0), math.inf)
        else:
            out = self.inner.softmin(xr, x, h, eps, cost)
        return self._exchange("softmin_sym", [(out, x.shape[1])], [], (x, h))[0]

    def expect_reuse(self, x: Tensor, y: Tensor, cost) -> None:
        hint = getattr(self.inner, "expect_reuse", None)
        if hint is not None and self.bounds(x.shape[1])[1] > self.bounds(x.shape[1])[0]:
            hint(self._rows(x), y, cost)


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
    # float32 at high temperature runs softmins in float64 on ``_engine64``: shard it too
    eng64 = m._engine64  # cached property: resolved now against the sharded engine unless already cached
    if eng64 is inner:
        m.__dict__["_engine64"] = m.engine
    elif not isinstance(eng64, ShardedEngine):
        m.__dict__["_engine64"] = ShardedEngine(eng64, group)
    return m


def _collective_callback(cb, group):
    """A callback whose stop decision is taken by all ranks together (any rank stopping stops all)."""
    def wrapped(rec):
        stop = cb(rec) is True
        t = torch.tensor([1 if stop else 0], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return bool(t.item())
    return wrapped


def distribute_solve(m, opts, group, potentials_init=None):
    """:func:`flashot.solve_sample`'s hook: check the problem and the options across ranks, shard the
    engine, make the callback's stop decision collective and show the progress bar on rank 0 only.
    Returns the options to solve with."""
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
    distribute_measures(m, group, fields, names=("X_a", "X_b", "a", "b"))
    rank = dist.get_rank(group)
    cb = None if opts.callback is None else _collective_callback(opts.callback, group)
    return replace(opts, callback=cb, verbose=opts.verbose and rank == 0)
