r"""The tests' shared references: the reference suite's oracle (dense float64 entropic OT run to
convergence, and finite differences), and the dense float64 helpers that several test modules use
(softmin, plan, fixed-step and warm-started Sinkhorn, masked softmins, a reference point cloud).
Test modules in every folder import it as ``references`` (``tests/`` is on ``sys.path``: pytest
puts the folder of ``conftest.py`` there).

Nothing here imports flashot or a peer (the masked helpers use the cost object they are given): the
cost matrix is materialised, the oracle's potentials iterate in the log domain until the
first-order conditions hold to ``tol`` (1e-13 by default), and values come from the dual, checked
against the primal of the plan (their gap is ~0 at the optimum).

Problem (generalised KL, :math:`\mathrm{KL}(p|q) = \langle p, \log(p/q)\rangle - m(p) + m(q)`)::

    OT(a, b) = min_P <C, P> + eps KL(P | a x b) + rho_x KL(P 1 | a) + rho_y KL(P^T 1 | b)

(``rho = None``: a strict marginal constraint on that side).  Dual::

    D(f, g) = phi_x(f) + phi_y(g) - eps <a x b, exp((f + g - C) / eps)> + eps m(a) m(b),
    phi(f) = rho <a, 1 - exp(-f / rho)>   (or <a, f> for a strict side),

maximised by the fixed point of ``f = -lam_x eps log sum_j b_j exp((g_j - C_ij) / eps)``,
``lam = rho / (rho + eps)`` (1 for a strict side), and the same for ``g``.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
from dataclasses import dataclass

import torch
from torch import Tensor

F64 = torch.float64


def sq_dist(x: Tensor, y: Tensor) -> Tensor:
    """``|x_i - y_j|^2`` from coordinate differences (exact at x = y), float64."""
    return ((x.double()[:, None, :] - y.double()[None, :, :]) ** 2).sum(-1)


def cost_matrix(x: Tensor, y: Tensor, p: int = 2, half: bool = True) -> Tensor:
    """``|x - y|^2 / 2`` (``p=2``, GeomLoss' convention; ``half=False``: ``|x - y|^2``) or ``|x - y|`` (``p=1``)."""
    d2 = sq_dist(x, y)
    if p == 1:
        return d2.sqrt()
    return d2 / 2 if half else d2


@dataclass
class Solution:
    f: Tensor
    g: Tensor
    plan: Tensor
    dual: float
    primal: float
    iters: int
    error: float


def _lam(eps: float, rho: float | None) -> float:
    return 1.0 if rho is None else rho / (rho + eps)


def _kl(p: Tensor, q: Tensor) -> Tensor:
    pos = p > 0
    return (
        torch.where(pos, p * (torch.log(torch.where(pos, p, 1)) - torch.log(torch.where(pos, q, 1))), 0).sum()
        - p.sum()
        + q.sum()
    )


def plan(C: Tensor, a: Tensor, b: Tensor, f: Tensor, g: Tensor, eps: float) -> Tensor:
    """The plan of potentials ``(f, g)``: ``P_ij = a_i b_j exp((f_i + g_j - C_ij) / eps)`` (batched or not)."""
    return a.unsqueeze(-1) * b.unsqueeze(-2) * torch.exp((f.unsqueeze(-1) + g.unsqueeze(-2) - C) / eps)


def dual_value(C, a, b, f, g, eps, rho_x=None, rho_y=None) -> float:
    def phi(w, h, rho):
        return (w * h).sum() if rho is None else rho * (w * -torch.expm1(-h / rho)).sum()

    K = plan(C, a, b, f, g, eps)
    return float(phi(a, f, rho_x) + phi(b, g, rho_y) - eps * K.sum() + eps * a.sum() * b.sum())


def primal_value(C, P, a, b, eps, rho_x=None, rho_y=None) -> float:
    v = (C * P).sum() + eps * _kl(P, a[:, None] * b[None, :])
    if rho_x is not None:
        v = v + rho_x * _kl(P.sum(1), a)
    if rho_y is not None:
        v = v + rho_y * _kl(P.sum(0), b)
    return float(v)


def solve(
    C: Tensor,
    a: Tensor,
    b: Tensor,
    eps: float,
    rho_x: float | None = None,
    rho_y: float | None = None,
    tol: float = 1e-13,
    max_iter: int = 200_000,
) -> Solution:
    """Alternating log-domain Sinkhorn in float64 until both marginal conditions hold to ``tol`` (L1):
    ``P 1 = a`` (strict) or ``a exp(-f / rho_x)``, and the same for ``P^T 1``."""
    C, a, b = C.double(), a.double(), b.double()
    la, lb = torch.log(a), torch.log(b)
    lx, ly = _lam(eps, rho_x), _lam(eps, rho_y)
    f = torch.zeros(C.shape[0], dtype=F64)
    g = torch.zeros(C.shape[1], dtype=F64)
    err = math.inf
    for it in range(1, max_iter + 1):
        f = -lx * eps * torch.logsumexp(lb[None, :] + (g[None, :] - C) / eps, 1)
        g = -ly * eps * torch.logsumexp(la[:, None] + (f[:, None] - C) / eps, 0)
        if it % 10 == 0:
            P = plan(C, a, b, f, g, eps)
            tr = a if rho_x is None else a * torch.exp(-f / rho_x)  # after the g-update the columns hold exactly
            err = float((P.sum(1) - tr).abs().sum())
            if err < tol:
                break
    P = plan(C, a, b, f, g, eps)
    return Solution(
        f, g, P, dual_value(C, a, b, f, g, eps, rho_x, rho_y), primal_value(C, P, a, b, eps, rho_x, rho_y), it, err
    )


def ot_value(x, y, a, b, eps, p=2, rho_x=None, rho_y=None, half=True) -> float:
    """OT(a, b) between point clouds (dual value at convergence)."""
    return solve(cost_matrix(x, y, p, half), a, b, eps, rho_x, rho_y).dual


def divergence(x, y, a, b, eps, p=2, rho_x=None, rho_y=None) -> float:
    """Sinkhorn divergence ``S = OT(a, b) - OT(a, a)/2 - OT(b, b)/2``, every term with ``(rho_x, rho_y)``."""
    return (
        ot_value(x, y, a, b, eps, p, rho_x, rho_y)
        - 0.5 * ot_value(x, x, a, a, eps, p, rho_x, rho_y)
        - 0.5 * ot_value(y, y, b, b, eps, p, rho_x, rho_y)
    )


def finite_difference(fn, t: Tensor, direction: Tensor, h: float = 1e-5) -> float:
    """Central difference of the scalar ``fn`` at ``t`` along ``direction`` (O(h^2), float64)."""
    t, direction = t.double(), direction.double()
    return (fn(t + h * direction) - fn(t - h * direction)) / (2 * h)


# --- dense float64 helpers shared by the test modules ---------------------------------------------


def softmin(C: Tensor, h: Tensor, eps: float) -> Tensor:
    """``-eps log sum_j exp(h_j - C_ij / eps)`` over the last axis of ``C`` (``h``: ``(..., M)``): the
    engines' softmin primitive, written densely."""
    return -eps * torch.logsumexp(h.unsqueeze(-2) - C / eps, dim=-1)


def sinkhorn_unrolled(C: Tensor, la: Tensor, lb: Tensor, eps: float, iters: int) -> tuple[Tensor, Tensor]:
    """``iters`` alternating log-domain Sinkhorn steps from ``g = 0`` (``f`` from ``g``, then ``g`` from ``f``;
    ``la``, ``lb``: log-weights), batched or not: ``(f, g)`` of the last step.  A fixed number of steps and no
    stopping rule, so autograd differentiates through the iterations (at convergence that derivative is the
    implicit one)."""
    f, g = torch.zeros_like(la), torch.zeros_like(lb)
    for _ in range(iters):
        f = -eps * torch.logsumexp(lb.unsqueeze(-2) + (g.unsqueeze(-2) - C) / eps, -1)
        g = -eps * torch.logsumexp(la.unsqueeze(-1) + (f.unsqueeze(-1) - C) / eps, -2)
    return f, g


def log_sinkhorn(
    C: Tensor, a: Tensor, b: Tensor, eps: float, tol: float, max_iter: int = 200_000, g: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Balanced alternating log-domain Sinkhorn on an ``(N, M)`` matrix from ``g`` (default 0) until the plan's
    row sums are within ``tol`` of ``a`` (L1, checked every 10 steps): ``(P, g)``.  Zero weights give zero rows
    or columns (``log 0 = -inf``).  Unlike :func:`solve`, it starts from a given ``g`` (the warm start of an
    outer loop) and returns the plan of the last step as is."""
    la, lb = a.log(), b.log()
    g = torch.zeros_like(b) if g is None else g
    for it in range(max_iter):
        f = -eps * torch.logsumexp((g - C) / eps + lb, 1)
        g = -eps * torch.logsumexp((f[:, None] - C) / eps + la[:, None], 0)
        if it % 10 == 0:
            P = torch.exp((f[:, None] + g - C) / eps + la[:, None] + lb)
            if float((P.sum(1) - a).abs().sum()) < tol:
                return P, g
    raise AssertionError("reference Sinkhorn did not converge")


REFERENCE_CACHE = "FLASHOT_TEST_REFERENCE_CACHE"


def _kept_on_disk(fn):
    """``fn(x, y, h, mask, eps, cost)`` with its result kept in the directory ``$FLASHOT_TEST_REFERENCE_CACHE``
    when that is set (off otherwise), keyed by a hash of the arguments' bytes.

    tests/conftest.py sets it to a directory of the test run (shared by the pytest-xdist workers and passed on
    to tests/ops/test_isa_matrix.py's runs of the kernel tests under other instruction sets): these dense
    float64 references are PyTorch's, a pure function of their inputs, so a test that needs one another test
    (or another instruction set's run) computed reads it (at 3,000 x 2,500 points they are most of those
    tests' time).  A file lock per key: two processes asking at once compute it once."""

    @functools.wraps(fn)
    def wrapped(x: Tensor, y: Tensor, h: Tensor, mask: Tensor, eps: float, cost) -> Tensor:
        root = os.environ.get(REFERENCE_CACHE)
        described = repr(cost)
        if not root or not described.startswith("Cost("):  # no cache, or not a built-in cost (fully described)
            return fn(x, y, h, mask, eps, cost)
        key = hashlib.sha256(f"{fn.__name__} {float(eps)!r} {described}".encode())
        for t in (x, y, h, mask):
            t = t.detach().cpu().contiguous()
            key.update(f"{t.dtype} {tuple(t.shape)}".encode())
            key.update(t.view(torch.uint8).numpy().tobytes() if t.dtype != torch.bool else t.numpy().tobytes())
        from filelock import FileLock  # a dependency of torch

        os.makedirs(root, exist_ok=True)
        path = os.path.join(root, key.hexdigest() + ".pt")
        with FileLock(path + ".lock"):
            if os.path.exists(path):
                return torch.load(path)
            out = fn(x, y, h, mask, eps, cost)
            torch.save(out, path + ".tmp")
            os.replace(path + ".tmp", path)
        return out

    return wrapped


def _masked_scores(x: Tensor, y: Tensor, h: Tensor, mask: Tensor, eps: float, cost) -> Tensor:
    """Float64 ``h_j - C_ij / eps`` where ``mask_ij``, ``-inf`` elsewhere: ``(-C / eps) + h`` in place on one
    new N x M buffer (not three: these references are most of their tests' time; a test's own cost may return a
    matrix it keeps), the same numbers as ``torch.where(mask, h - C / eps, -inf)`` bit for bit."""
    S = torch.div(cost.matrix(x.double(), y.double())[0], -eps).add_(h[0].double()[None])
    if not bool(mask.all()):
        S.masked_fill_(~mask, -math.inf)
    return S


@_kept_on_disk
def masked_softmin(x: Tensor, y: Tensor, h: Tensor, mask: Tensor, eps: float, cost) -> Tensor:
    """Float64 softmin ``-eps log sum_{j: mask_ij} exp(h_j - C_ij / eps)`` of one batch entry (``x``, ``y``
    and ``h`` carry a batch axis of size 1; ``cost.matrix`` builds ``C``): the reference of the
    block-sparse engines and of the tile pruning rule."""
    return -eps * torch.logsumexp(_masked_scores(x, y, h, mask, eps, cost), -1)


@_kept_on_disk
def masked_bary(x: Tensor, y: Tensor, h: Tensor, mask: Tensor, eps: float, cost) -> Tensor:
    """Float64 soft-argmin barycentres ``sum_j w_ij y_j`` of :func:`masked_softmin` (rows sum to 1)."""
    return torch.softmax(_masked_scores(x, y, h, mask, eps, cost), -1) @ y[0].double()


def torus(n: int, seed: int, shift=(0.0, 0.0, 0.0)) -> Tensor:
    """``n`` points drawn on a torus in R^3 (radii 1 and 0.35), float64, moved by ``shift``: a clustered
    cloud with empty space between its clusters, the multiscale tests' problem."""
    g = torch.Generator().manual_seed(seed)
    t, u = torch.rand(n, generator=g, dtype=F64) * 2 * math.pi, torch.rand(n, generator=g, dtype=F64) * 2 * math.pi
    x = torch.stack(
        [(1 + 0.35 * torch.cos(u)) * torch.cos(t), (1 + 0.35 * torch.cos(u)) * torch.sin(t), 0.35 * torch.sin(u)], -1
    )
    return x + torch.tensor(shift, dtype=F64)
