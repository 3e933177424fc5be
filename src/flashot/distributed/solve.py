"""The entry points of :func:`flashot.solve_sample` with ``group=``: :func:`distribute_solve` (replicated
mode) and :func:`points_solve` (``shard="points"``), and the choice of the mode (:func:`pick_shard`)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import Tensor

from ..costs import Cost
from ..driver import SolveOptions, check_init, solve_measures
from ..measures import Measures
from .group import bits_checksum, check_group
from .points import points_measures
from .points_result import PointsOTResult, points_result
from .replicated import distribute_measures

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

SHARDS = ("replicated", "points")


def pick_shard(n: int, m: int, d: int, dtype: torch.dtype = torch.float32, budget_bytes: int = 1 << 30) -> str:
    """``"replicated"`` while all the points, ``(n + m) d`` numbers of ``dtype``, fit ``budget_bytes`` per
    rank (default 1 GiB: replicated mode is faster, it sends only ``O(n + m)`` numbers per iteration),
    else ``"points"`` (each rank then holds ``~(n + m) d / W`` of them)."""
    size = (n + m) * d * torch.empty((), dtype=dtype).element_size()
    return "replicated" if size <= budget_bytes else "points"


def check_shard(shard: str, group: ProcessGroup | None) -> str:
    """``shard`` must name a mode of :data:`SHARDS`; ``"points"`` needs a process group."""
    if not isinstance(shard, str) or shard not in SHARDS:
        raise ValueError(f"shard: expected one of {SHARDS}, got {shard!r}")
    if shard == "points" and group is None:
        raise ValueError(
            "shard='points' needs group= (a torch.distributed process group); "
            "on one process pass all the points without shard="
        )
    return shard


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


def _option_fields(opts) -> dict[str, Any]:
    """The solve options that every rank must pass the same (name -> comparable value)."""
    return {
        "reg": opts.reg,
        "max_iter": opts.max_iter,
        "tol": opts.tol,
        "method": opts.method,
        "eps_scaling": opts.eps_scaling,
        "unbalanced": (opts.rho_a, opts.rho_b),
        "inner_iterations": opts.inner_iterations,
        "acceleration": repr(opts.acceleration),
        "implicit": repr(opts.implicit),
        "grad": opts.grad,
        "callback (given or not)": opts.callback is not None,
    }


def _rank_options(opts, group):
    """``opts`` for this rank: the callback's stop decision collective, the progress bar on rank 0 only."""
    cb = None if opts.callback is None else _collective_callback(opts.callback, group)
    return replace(opts, callback=cb, verbose=opts.verbose and dist.get_rank(group) == 0)


def distribute_solve(
    m: Measures,
    opts: SolveOptions,
    group: ProcessGroup,
    potentials_init: tuple[Any, Any] | None = None,
    options: dict[str, Any] | None = None,
) -> SolveOptions:
    """:func:`flashot.solve_sample`'s hook: check the problem and the options (plus ``options``, name ->
    value) across ranks, shard the engine, make the callback's stop decision collective and show the
    progress bar on rank 0 only.  Returns the options to solve with."""
    check_group(group)
    fields = _option_fields(opts)
    if potentials_init is None:
        fields["potentials_init"] = None
    else:
        f0, g0 = potentials_init
        fields["potentials_init"] = tuple(bits_checksum(torch.as_tensor(t)) for t in (f0, g0))
    fields.update(options or {})
    distribute_measures(m, group, fields, names=("X_a", "X_b", "a", "b"))
    return _rank_options(opts, group)


def points_solve(
    X_a: Tensor,
    X_b: Tensor,
    a: Tensor | None,
    b: Tensor | None,
    *,
    cost: str | Cost,
    backend: str,
    opts: SolveOptions,
    group: ProcessGroup,
    potentials_init: tuple[Any, Any] | None = None,
    numpy: bool = False,
) -> PointsOTResult:
    """:func:`flashot.solve_sample` with ``shard="points"``: ONE problem whose points and weights are split
    over the ranks of ``group`` (this rank passes its slices); potentials, marginals and gradients are this
    rank's slices, values the whole problem's (same on every rank).  Options are checked across ranks.
    ``opts.implicit`` sets the conjugate gradients of the second derivatives and of ``value_linear``'s
    gradient (:mod:`flashot.implicit`, as in one process)."""
    check_group(group)
    fields = {**_option_fields(opts), "potentials_init (given or not)": potentials_init is not None}

    def build(
        x: Tensor, y: Tensor, a_: Tensor | None, b_: Tensor | None
    ) -> Measures:  # inside points_measures: an error on one rank is raised on every rank
        m = Measures.build(x, y, a_, b_, cost=cost, backend=backend, names=("a", "X_a", "b", "X_b"))
        if potentials_init is not None:  # this rank's slices of the potentials
            check_init(potentials_init, m)
        return m

    m = points_measures(X_a, X_b, a, b, group=group, build=build, options=fields, names=("X_a", "X_b", "a", "b"))
    opts = _rank_options(opts, group)
    cast(
        Any, m
    ).implicit_diff = opts.implicit  # value_linear's gradient of an unbalanced solve (sinkhorn_value sets it else)
    return points_result(solve_measures(m, opts, potentials_init, numpy=numpy))
