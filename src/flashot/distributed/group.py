"""The process group's helpers: its check, exact checksums for the collectives' headers, the agreement
of every rank's arguments (:func:`check_same`, :func:`shared_checks`), and the base of the two wrapper
engines (:class:`GroupEngine`)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist
from torch import Tensor

from ..ops.base import Capability, Engine, ForwardingEngine

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

MOD = 1 << 22  # header integers stay exact in float32

# the exception types a rejecting rank's error keeps on every rank (others become RuntimeError): ranks that
# catch an exception type take the same branch, so their later collectives still pair up
_SHARED_TYPES = {
    t.__name__: t for t in (TypeError, ValueError, NotImplementedError, MemoryError, OverflowError, RuntimeError)
}


def check_group(group: object) -> ProcessGroup:
    """``group`` must be a ``torch.distributed`` process group of an initialised default group."""
    if not dist.is_available():
        raise RuntimeError("group: torch.distributed is not available in this torch build")
    if not dist.is_initialized():
        raise RuntimeError(
            "group: torch.distributed is not initialised; call "
            "torch.distributed.init_process_group(...) first (torchrun sets the environment)"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group: expected a torch.distributed ProcessGroup (e.g. torch.distributed.group.WORLD), "
            f"got {type(group).__name__}"
        )
    return group


def bits_checksum(*ts: Tensor | None) -> int:
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


def fold(v: int) -> int:
    """``v`` hashed to an integer below :data:`MOD` (exact in a float32 header)."""
    return int.from_bytes(hashlib.blake2b(v.to_bytes(8, "little"), digest_size=8).digest(), "little") % MOD


def shared(group: ProcessGroup, local_error: Exception | None, fields: dict[str, Any]) -> list[dict]:
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
    who = (
        f"rank {bad[0]} rejected its input"
        if len(bad) == 1
        else f"ranks {bad} rejected their input; rank {bad[0]}'s error"
    )
    err = _SHARED_TYPES.get(kind, RuntimeError)(f"{who}: {msg} (every rank of the process group raises this)")
    raise err from local_error


def check_same_values(name: str, vals: list, what: str = "options") -> None:
    """``ValueError`` naming ``name`` and the ranks whose value differs from rank 0's (``what``: what every
    rank must pass the same of, for the message)."""
    if any(v != vals[0] for v in vals[1:]):
        bad = [r for r, v in enumerate(vals) if v != vals[0]]
        shown = "; ".join(f"rank {r}: {vals[r]!r}" for r in [0] + bad[:3])
        raise ValueError(
            f"{name}: differs across the ranks of the process group (ranks {bad} differ from "
            f"rank 0; {shown}); every rank must pass the same {what}"
        )


def check_same(
    group: ProcessGroup, fields: dict[str, Any], error: Exception | None = None, what: str = "problem"
) -> list[dict]:
    """All-gather ``fields`` (name -> comparable value) and raise ``ValueError`` naming the first argument
    that differs across ranks, with the ranks and their values.  The all-gather is :func:`shared`'s: a rank
    that rejected its own arguments (:func:`shared_checks`, or ``error``) joins it with its error, and every
    rank raises that.  Names are every rank's (the same mismatch on every rank); those that start with ``_``
    travel without being compared.  Returns every rank's fields."""
    got = shared(group, error, fields)
    for name in dict.fromkeys(k for g in got for k in g if k != "error" and not k.startswith("_")):
        check_same_values(name, [g.get(name, "<missing>") for g in got], what)
    return got


def reject(group: ProcessGroup, error: Exception) -> NoReturn:
    """Raise ``error`` (this rank's rejection of its arguments) on every rank of ``group``: one all-gather, the
    one that opens every distributed call (:func:`check_same`, :func:`~flashot.distributed.points_measures`), so
    that the ranks whose arguments passed raise at their first collective instead of waiting there for the
    process group's timeout.  Never returns."""
    shared(group, error, {})
    raise AssertionError("unreachable")  # shared raised


@contextmanager
def shared_checks(group: ProcessGroup | None, collective: bool = False) -> Iterator[None]:
    """Run a distributed call's LOCAL argument checks (no collective inside): an exception raised in the block
    is sent to the other ranks of ``group`` (:func:`reject`) and every rank raises the same one, naming this
    rank and the argument.  Without ``collective`` the ranks whose checks passed learn of it at the call's first
    collective, which must be :func:`shared`'s all-gather (:func:`check_same`,
    :func:`~flashot.distributed.points_measures`); ``collective=True`` (checks that no collective follows, e.g.
    a constructor's) runs that all-gather on success too.  ``group=None``: the checks raise as in one process."""
    if group is None:
        yield
        return
    check_group(group)
    try:
        yield
    except Exception as e:  # noqa: BLE001 - any rejection must reach the other ranks, or they wait
        reject(group, e)
    if collective:
        shared(group, None, {})


class GroupEngine(ForwardingEngine):
    """A wrapper engine whose primitives are collectives over the ranks of ``group``: ``world``, ``rank``,
    ``name`` = ``label(inner)``, ``stats`` (``calls``: collectives, ``bytes``: bytes received by this rank)
    and the count of calls that the headers carry (ranks at different calls raise)."""

    label = "group"

    def __init__(self, inner: Engine, capabilities: frozenset[Capability], group: ProcessGroup) -> None:
        super().__init__(inner, capabilities)
        self.group = check_group(group)
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.name = f"{self.label}({inner.name})"
        self.stats = {"calls": 0, "bytes": 0}
        self._calls = 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner.name!r}, rank {self.rank} of {self.world})"


def refuse_keywords(engine: str, kw: dict[str, Any]) -> None:
    """The primitives' keywords (``rows=``) are for engines that declare ``Capability.ROW_RANGES``; the group
    engines do not (they accept them only to keep :class:`~flashot.ops.base.ForwardingEngine`'s signature)."""
    if kw:
        raise TypeError(f"{engine} engine: unexpected keyword arguments {sorted(kw)}")
