"""``dense`` engine: materialises the (B, N, M) cost matrix.

The reference implementation (test oracle, fully differentiable by plain
autograd).  Memory O(B N M).  Where the ``cpu`` engine runs, ``backend="auto"`` picks
``dense`` only for tiny problems (``ops/registry.py``, ``benchmarks/AUTO_CROSSOVER.md``).

Like the streaming engines, the largest exponent of each row is removed before
``exp`` and arguments below the underflow threshold (:func:`~flashot.ops.base.exp_floor`)
never reach ``exp``: on the CPU ``torch.exp`` of float32 arguments below ~-87.3 takes a
60-140x slower path, and at small eps most pairs are there (``torch.logsumexp`` does not
clamp).  Those terms are set to exactly 0 instead, and every other term loses
1.001 exp(floor): next to the row's largest term, which is 1, that is < 2^-125 in float32
and < 2^-1021 in float64, so nothing representable changes, and zero weights (``-inf``)
still contribute exactly nothing.

Memory guard: before materialising a (B, N, M) matrix the engine checks its size against
:func:`dense_max_bytes` (``FLASHOT_DENSE_MAX_BYTES``; default 1/16 of the machine's (or
cgroup's) memory, or of the GPU's, at least 256 MiB: a differentiable call keeps a few such
matrices alive) and raises :class:`DenseBudgetError` (a ``MemoryError``) that names the size,
the budget, the variable and the streaming engines, instead of running the machine out of
memory.  ``backend="auto"`` never picks ``dense`` above the budget (``ops/registry.py``).
"""

from __future__ import annotations

import functools
import math
import os

import torch
from torch import Tensor

from ..costs import Cost
from .base import Engine, Weight, exp_floor

DENSE_MAX_BYTES_ENV = "FLASHOT_DENSE_MAX_BYTES"
MIN_DEFAULT_DENSE_BYTES = 256 << 20


class DenseBudgetError(MemoryError):
    """The dense engine would materialise a matrix above its memory budget."""


def default_dense_max_bytes(device: torch.device | str = "cpu") -> int:
    """1/16 of the memory of ``device`` (CPU: the machine's or the cgroup limit; CUDA: the GPU's), at
    least 256 MiB; 1 GiB when unknown."""
    device = torch.device(device)
    return _default_bytes(device.type, device.index)


@functools.cache
def _default_bytes(kind: str, index) -> int:
    device = torch.device(kind, index) if index is not None else torch.device(kind)
    mem = None
    if device.type == "cuda":
        try:
            mem = torch.cuda.get_device_properties(device).total_memory
        except Exception:  # pragma: no cover - no CUDA here
            mem = None
    else:
        from .cpu.engine import memory_bytes

        mem = memory_bytes()
    return 1 << 30 if mem is None else max(MIN_DEFAULT_DENSE_BYTES, mem // 16)


def dense_max_bytes(device: torch.device | str = "cpu") -> int:
    """The dense engine's budget for one (B, N, M) matrix, in bytes: ``FLASHOT_DENSE_MAX_BYTES`` (an
    integer; read at each call) or :func:`default_dense_max_bytes`."""
    v = os.environ.get(DENSE_MAX_BYTES_ENV)
    if v is None or v.strip() == "":
        return default_dense_max_bytes(device)
    try:
        n = int(float(v))
    except ValueError:
        raise ValueError(f"{DENSE_MAX_BYTES_ENV}: expected an integer number of bytes, got {v!r}") from None
    if n < 0:
        raise ValueError(f"{DENSE_MAX_BYTES_ENV}: expected a number of bytes >= 0, got {v!r}")
    return n


def dense_bytes(B: int, N: int, M: int, dtype: torch.dtype) -> int:
    """Bytes of one (B, N, M) matrix of ``dtype``."""
    return int(B) * int(N) * int(M) * dtype.itemsize


def check_dense_budget(B: int, N: int, M: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
    """Raise :class:`DenseBudgetError` when a (B, N, M) matrix of ``dtype`` exceeds :func:`dense_max_bytes`."""
    need = dense_bytes(B, N, M, dtype)
    budget = dense_max_bytes(device)
    if need > budget:
        raise DenseBudgetError(
            f"backend='dense' (GeomLoss' 'tensorized') would materialise a {B} x {N} x {M} {dtype} matrix "
            f"({need:,} bytes, several alive at once), above its budget of {budget:,} bytes; raise it with "
            f"{DENSE_MAX_BYTES_ENV}=<bytes>, or use a streaming engine (memory O(N + M)): backend='auto' "
            f"(SamplesLoss: 'online'), 'cpu', 'tiled' or 'triton'"
        )


def _exp_shifted(S: Tensor, m: Tensor) -> Tensor:
    """``exp(S - m)`` with the arguments below the underflow threshold never passed to
    ``exp``, and their terms set to exactly 0: the clamped exponentials (``exp(floor)``) and
    everything below 1.001 exp(floor) (< 2^-125 in float32) are subtracted off and clipped at
    0, which also makes ``-inf`` (zero weights) exactly 0.  Two cheap passes (a boolean mask
    and ``masked_fill_`` cost ~30x more here).  In place on ``S`` when autograd does not need it."""
    floor = exp_floor(S.dtype)
    cut = 1.001 * math.exp(floor)  # above exp(floor) as computed by any exp: those become 0
    if torch.is_grad_enabled() and (S.requires_grad or m.requires_grad):
        return ((S - m).clamp_min(floor).exp() - cut).clamp_min(0.0)
    return S.sub_(m).clamp_(min=floor).exp_().sub_(cut).clamp_(min=0.0)


def lse_last(S: Tensor) -> Tensor:
    """``logsumexp`` over the last dimension (kept), with a clamped ``exp``; ``S`` is consumed."""
    if S.shape[-1] == 0:  # the empty sum: log 0
        return S.new_full((*S.shape[:-1], 1), -math.inf)
    m = S.detach().amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # all -inf: log(0) + 0 = -inf
    return torch.log(_exp_shifted(S, m).sum(-1, keepdim=True)) + m


class DenseEngine(Engine):
    name = "dense"
    capabilities = frozenset()  # the two primitives only (materialised: the oracle)

    def unsupported(self, device, dtype, cost):
        return None

    def softmin(self, x: Tensor, y: Tensor, h: Tensor, eps: float, cost: Cost) -> Tensor:
        check_dense_budget(x.shape[0], x.shape[1], y.shape[1], x.dtype, x.device)
        C = cost.matrix(x, y)
        return -eps * lse_last(h.unsqueeze(-2) - C / eps).squeeze(-1)

    def plan_product(self, x, y, alpha, beta, eps, V, cost, weight: Weight = "plan"):
        check_dense_budget(x.shape[0], x.shape[1], y.shape[1], x.dtype, x.device)
        C = cost.matrix(x, y)
        return weighted_product(beta.unsqueeze(-2) - C / eps, C, alpha.unsqueeze(-1), V, cost, weight)


def weighted_product(S: Tensor, C: Tensor, alpha: Tensor, V: Tensor, cost: Cost, weight: Weight) -> Tensor:
    """``sum_j exp(alpha_i + S_ij) W_ij V_j`` for scores ``S`` (..., n, m) (consumed), costs ``C``, row
    log-factors ``alpha`` (..., n, 1): the row max is taken out of ``S`` before ``exp`` and put back after
    the sum (``exp(alpha + beta - C/eps)`` directly loses ~1e-7 |alpha| in the exponent, which debiased
    p=1 gradients amplify), and where ``exp(alpha + m)`` overflows the row is +-inf (as in the streaming
    engines), not inf * 0 = NaN from the terms that underflowed."""
    m = S.amax(-1, keepdim=True).clamp_min(torch.finfo(S.dtype).min)
    P = _exp_shifted(S, m)
    if weight == "cost":
        P = P * C
    elif weight == "dcost":
        P = P * cost.dcost_weight(C)
    return (P @ V) * torch.exp(alpha + m)
