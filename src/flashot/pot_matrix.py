r"""POT's matrix solvers on a precomputed cost: :func:`solve` (``ot.solve``), :func:`sinkhorn`
(``ot.sinkhorn``) and :func:`sinkhorn2` (``ot.sinkhorn2``).

Solves :math:`\min_P \langle M, P\rangle + \varepsilon\, \mathrm{KL}(P \,|\, a \otimes b)` over
couplings of ``a`` and ``b`` for a given cost matrix ``M`` (``reg`` :math:`= \varepsilon`), with
the same solver, options and :class:`~flashot.OTResult` as :func:`~flashot.solve_sample`.  ``M``
is dense (torch or numpy) or lazy (:mod:`flashot.matrix_measures`: e.g. a ``numpy.memmap`` larger
than memory, read one tile at a time by the ``tiled`` engine).

Gradients with respect to a dense torch ``M``: ``value`` and ``value_dual`` have
:math:`\partial / \partial M = P` (envelope theorem); :func:`sinkhorn2`'s
:math:`\langle M, P\rangle` has the implicit derivative
:math:`P \odot (1 + (u \oplus v - M) / \varepsilon)` with :math:`(u, v)` the solution of the
balance equations' adjoint system (:func:`linear_cost_grads`).  Gradients in ``a`` and ``b``
are those of :func:`~flashot.solve_sample` (the potentials; for :func:`sinkhorn2`, implicit too).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from .driver import pot_uniform, solve_measures, solve_options
from .implicit import conjugate_gradient
from .matrix_measures import is_lazy_matrix, matrix_measures
from .results import OTResult

__all__ = ["solve", "sinkhorn", "sinkhorn2"]


def solve(
    M,
    a=None,
    b=None,
    reg: float | None = None,
    c=None,
    reg_type: str = "KL",
    unbalanced=None,
    unbalanced_type: str = "KL",
    method: str | None = None,
    n_threads: int | None = 1,
    max_iter: int | None = None,
    plan_init=None,
    potentials_init=None,
    tol: float | None = 1e-6,
    verbose: bool = False,
    grad: str = "autodiff",
    *,
    backend: str = "auto",
    callback=None,
    inner_iterations: int = 10,
    acceleration="auto",
    eps_scaling: bool | float | None = None,
) -> OTResult:
    """Entropic OT on a precomputed cost matrix, POT's ``ot.solve(M, a, b, reg=...)``.

    Solves ``min_P <M, P> + reg KL(P | a x b)`` over the couplings of ``a`` and ``b`` (``C_ij = M_ij``,
    ``eps = reg``); the plan is ``P_ij = a_i b_j exp((f_i + g_j - M_ij) / reg)``.

    Args:
        M: (N, M) or (B, N, M) costs: torch tensor, numpy array, or a lazy 2-D matrix (an object
            with ``.shape`` and slicing by ``[r0:r1, c0:c1]``, e.g. ``numpy.memmap``).
        a, b: row / column weights (uniform when None or ``[]``).
        reg: epsilon (> 0, required: flashot is entropic; exact OT is POT's ``ot.solve``).
        backend: ``"auto"`` (= ``"tiled"``: streamed, memory O(N + M) beyond the matrix) or ``"dense"``.
        others: :func:`~flashot.solve_sample`'s options (POT's names and conventions).  ``c`` (a
            reference measure other than ``a b^T``) and ``plan_init`` are not implemented
            (``NotImplementedError``; warm-start with ``potentials_init``).

    Returns:
        :class:`~flashot.OTResult`: ``value``, ``value_linear`` (``<M, P>``), ``potentials``, the
        lazy ``plan`` (``plan @ V``, ``plan.sum(axis)``, ``np.asarray(plan)`` for small plans).

    Example:
        >>> import torch, flashot
        >>> _ = torch.manual_seed(0)
    >>> M = torch.rand(5, 7, dtype=torch.float64)
        >>> res = flashot.solve(M, reg=0.1)
        >>> bool(abs(res.plan.sum() - 1) < 1e-6)
        True
    """
    if c is not None:
        raise NotImplementedError(
            "c: a reference measure other than a b^T is not implemented (flashot regularises "
            "with KL(P | a x b)); fold log(c / (a b^T)) into M instead"
        )
    if plan_init is not None:
        raise NotImplementedError("plan_init: not implemented; warm-start with potentials_init=(f, g)")
    opts = solve_options(
        reg,
        reg_type=reg_type,
        unbalanced=unbalanced,
        unbalanced_type=unbalanced_type,
        method=method,
        n_threads=n_threads,
        max_iter=max_iter,
        tol=tol,
        grad=grad,
        callback=callback,
        inner_iterations=inner_iterations,
        acceleration=acceleration,
        verbose=verbose,
        eps_scaling=eps_scaling,
        exact_hint="POT's ot.solve",
    )
    a, b = (None if pot_uniform(w) else w for w in (a, b))
    m = matrix_measures(M, a, b, backend=backend)
    res = solve_measures(m, opts, potentials_init, numpy=isinstance(M, np.ndarray) or is_lazy_matrix(M))
    if opts.grad == "detach" or not torch.is_grad_enabled() or not isinstance(M, Tensor):
        return res
    if M.requires_grad:
        _attach_cost_grad(res, M, m)
    if M.requires_grad or m.a.requires_grad or m.b.requires_grad:
        if opts.unbalanced:
            res.__dict__["value_linear"] = _RefuseGrad.apply(m.restore(res.plan.cost_sum()), M, m.a, m.b)
        else:  # the cached_property's value: <M, P> with implicit gradients in M, a, b
            f, g = res.plan.raw_potentials
            alpha, beta = m.a_log + f / res.reg, m.b_log + g / res.reg
            res.__dict__["value_linear"] = m.restore(_LinearCost.apply(M, m.a, m.b, alpha, beta, res.reg, m.cost.M))
    return res


class _RefuseGrad(torch.autograd.Function):
    """A value whose backward raises: ``value_linear`` of an unbalanced problem on a matrix."""

    @staticmethod
    def forward(ctx, v, *inputs):
        return v.clone()

    @staticmethod
    def backward(ctx, G):
        raise NotImplementedError(
            "the gradient of value_linear of an unbalanced problem is not implemented "
            "(balanced problems only); differentiate value_dual instead"
        )


def _attach_cost_grad(res: OTResult, M: Tensor, m) -> None:
    """Give ``value`` and ``value_dual`` the envelope gradient ``P`` in ``M``."""
    P = _DensePlan(res, m)
    res.value_dual = _CostEnvelope.apply(res.value_dual, M, P)
    res.value = _CostEnvelope.apply(res.value, M, P)


class _DensePlan:
    """The plan of a result as a dense (B, N, M) tensor, computed on demand (backward only)."""

    def __init__(self, res: OTResult, m):
        f, g = res.plan.raw_potentials
        self.alpha = m.a_log + f / res.reg
        self.beta = m.b_log + g / res.reg
        self.m, self.eps = m, res.reg

    def __call__(self) -> Tensor:
        Mt = self.m.cost.M
        return torch.exp(self.alpha.unsqueeze(-1) + self.beta.unsqueeze(-2) - Mt / self.eps)


class _CostEnvelope(torch.autograd.Function):
    """``value`` unchanged; its gradient in ``M`` is ``G P`` (the envelope theorem)."""

    @staticmethod
    def forward(ctx, value, M, plan):
        ctx.plan, ctx.shape, ctx.dtype = plan, M.shape, M.dtype
        return value.clone()

    @staticmethod
    def backward(ctx, G):
        P = ctx.plan()
        G3 = G.reshape(-1, 1, 1) if G.dim() <= 1 else G
        return G, (G3 * P).reshape(ctx.shape).to(ctx.dtype), None


def sinkhorn(
    a,
    b,
    M,
    reg: float,
    method: str = "sinkhorn",
    numItermax: int = 1000,
    stopThr: float = 1e-9,
    verbose: bool = False,
    log: bool = False,
    warn: bool = True,
    warmstart=None,
    **kwargs,
):
    """POT's ``ot.sinkhorn``: the entropic plan of the cost ``M`` as a dense matrix (the type of ``M``).

    ``P = diag(u) exp(-M / reg) diag(v)`` with ``u = a exp(f / reg)``, ``v = b exp(g / reg)``;
    ``log=True`` also returns POT's log dict (``u``, ``v``, ``log_u``, ``log_v``, ``niter``, ``err``).
    ``stopThr`` is flashot's ``tol`` (the L1 marginal violation, at least POT's L2 one), floored by
    rounding (see :func:`~flashot.solve_sample`); ``warmstart = (log_u, log_v)`` as in POT.
    Other keyword arguments go to :func:`solve` (``backend``, ``eps_scaling``, ...).

    ``C_ij = M_ij``, ``eps = reg``: ``P`` minimises ``<M, P> + reg KL(P | a x b)`` over the couplings
    of ``a`` and ``b``.

    Example:
        >>> import torch, flashot
        >>> _ = torch.manual_seed(0)
        >>> a, b = torch.full((5,), 0.2, dtype=torch.float64), torch.full((7,), 1 / 7, dtype=torch.float64)
        >>> M = torch.rand(5, 7, dtype=torch.float64)
        >>> P = flashot.sinkhorn(a, b, M, reg=0.1)
        >>> P.shape, bool(torch.allclose(P.sum(1), a)), bool(torch.allclose(P.sum(0), b))
        (torch.Size([5, 7]), True, True)
    """
    res = _pot_solve(a, b, M, reg, method, numItermax, stopThr, verbose, warn, warmstart, kwargs)
    P = res.plan.to_dense(max_elems=_plan_limit(res))
    return (P, _log(res)) if log else P


def sinkhorn2(
    a,
    b,
    M,
    reg: float,
    method: str = "sinkhorn",
    numItermax: int = 1000,
    stopThr: float = 1e-9,
    verbose: bool = False,
    log: bool = False,
    warn: bool = True,
    warmstart=None,
    **kwargs,
):
    """POT's ``ot.sinkhorn2``: the linear cost ``<M, P>`` of the entropic plan (not the entropic value).

    Differentiable in a dense torch ``M``, ``a`` and ``b`` by implicit differentiation at the returned
    potentials (:func:`linear_cost_grads`; POT differentiates through its iterations, which agrees at
    convergence).  ``log=True`` also returns POT's log dict.

    ``sum_ij M_ij P_ij`` for the plan of :func:`sinkhorn` (``C_ij = M_ij``, ``eps = reg``).

    Example:
        >>> import torch, flashot
        >>> _ = torch.manual_seed(0)
        >>> a, b = torch.full((5,), 0.2, dtype=torch.float64), torch.full((7,), 1 / 7, dtype=torch.float64)
        >>> M = torch.rand(5, 7, dtype=torch.float64, requires_grad=True)
        >>> loss = flashot.sinkhorn2(a, b, M, reg=0.1)
        >>> P = flashot.sinkhorn(a, b, M.detach(), reg=0.1)
        >>> bool(torch.allclose(loss, (M * P).sum()))
        True
        >>> loss.backward(); M.grad.shape
        torch.Size([5, 7])
    """
    res = _pot_solve(a, b, M, reg, method, numItermax, stopThr, verbose, warn, warmstart, kwargs)
    v = res.value_linear
    return (v, _log(res)) if log else v


def _pot_solve(a, b, M, reg, method, numItermax, stopThr, verbose, warn, warmstart, kwargs) -> OTResult:
    import warnings

    if kwargs.pop("unbalanced", None) is not None:
        raise ValueError("unbalanced: ot.sinkhorn is balanced; use flashot.solve(M, a, b, reg=..., unbalanced=rho)")
    init = None
    if warmstart is not None:  # POT's (log_u, log_v): potentials are reg * (log u - log a)
        init = _warm_potentials(warmstart, a, b, reg)
    with warnings.catch_warnings():
        if not warn:
            warnings.simplefilter("ignore", RuntimeWarning)
        return solve(
            M,
            a,
            b,
            reg=reg,
            method=method,
            max_iter=numItermax,
            tol=stopThr,
            verbose=verbose,
            potentials_init=init,
            **kwargs,
        )


def _warm_potentials(warmstart, a, b, reg):
    if not isinstance(warmstart, (tuple, list)) or len(warmstart) != 2:
        raise TypeError("warmstart: expected POT's pair (log_u, log_v)")
    out = []
    for lu, w in zip(warmstart, (a, b)):
        lu_t = torch.as_tensor(np.asarray(lu) if not isinstance(lu, Tensor) else lu)
        if w is None or pot_uniform(w):
            lw = torch.full_like(lu_t, -float(np.log(lu_t.shape[-1])), dtype=torch.float64)
        else:
            lw = torch.as_tensor(np.asarray(w) if not isinstance(w, Tensor) else w.detach()).double().log()
        out.append(reg * (lu_t.double() - lw))
    return out[0], out[1]


def _plan_limit(res: OTResult) -> int:
    from .plan import DENSE_PLAN_LIMIT

    n = int(np.prod(res.plan.shape))
    return max(n, DENSE_PLAN_LIMIT) if not is_lazy_matrix(res.plan.measures.cost.M) else DENSE_PLAN_LIMIT


def _log(res: OTResult) -> dict:
    f, g = res.potentials
    m = res.plan.measures
    f_raw, g_raw = res.plan.raw_potentials
    log_u = m.restore(m.a_log + f_raw / res.reg)
    log_v = m.restore(m.b_log + g_raw / res.reg)
    if res.returns_numpy:
        log_u, log_v = log_u.cpu().numpy(), log_v.cpu().numpy()
        exp = np.exp
    else:
        exp = torch.exp
    return {
        "u": exp(log_u),
        "v": exp(log_v),
        "log_u": log_u,
        "log_v": log_v,
        "niter": res.n_iter,
        "err": [res.error],
        "converged": res.converged,
        "potentials": (f, g),
    }


def linear_cost_grads(
    M: Tensor, a: Tensor, b: Tensor, alpha: Tensor, beta: Tensor, eps: float, tol: float = 1e-10, max_iter: int = 1000
) -> tuple[Tensor, Tensor, Tensor]:
    r"""Implicit gradients of :math:`L = \langle M, P\rangle` at a Sinkhorn fixed point, dense.

    With :math:`P = e^{\alpha \oplus \beta - M/\varepsilon}` (``alpha = log a + f / eps``, ``beta``
    likewise), the balance equations :math:`E = (P1 - a, P^\top 1 - b) = 0` have the Jacobian
    :math:`H / \varepsilon` in :math:`(f, g)`, :math:`H = [[\mathrm{diag}(P1), P], [P^\top,
    \mathrm{diag}(P^\top 1)]]`.  Solving :math:`H (u, v) = ((P \odot M) 1, (P \odot M)^\top 1)` (CG,
    Jacobi-preconditioned, off the null vector :math:`(1, -1)`) gives
    :math:`\partial L / \partial M = P \odot (1 + (u \oplus v - M)/\varepsilon)` and
    :math:`\partial L / \partial a_i = ((P \odot (M - u \oplus v)) 1)_i / a_i + u_i` (``b`` likewise;
    the pair is defined up to the gauge ``(+t, -t)``).  Returns ``(dM, da, db)``: (B, N, M), (B, N), (B, M).
    """
    P = torch.exp(alpha.unsqueeze(-1) + beta.unsqueeze(-2) - M / eps)
    r, c = P.sum(-1), P.sum(-2)
    PM = P * M
    N = r.shape[-1]
    tiny = torch.finfo(P.dtype).tiny
    d = torch.cat([r, c], -1).clamp_min(tiny).rsqrt()  # Jacobi scaling D^-1/2
    null = torch.cat([r.sqrt(), -c.sqrt()], -1)  # D^1/2 (1, -1): the scaled system's null vector
    null = null / null.norm(dim=-1, keepdim=True).clamp_min(tiny)

    def project(z: Tensor) -> Tensor:
        return z - (z * null).sum(-1, keepdim=True) * null

    def matvec(z: Tensor) -> Tensor:
        w = z * d
        u, v = w[..., :N].unsqueeze(-1), w[..., N:].unsqueeze(-1)
        Hw = torch.cat([r * w[..., :N] + (P @ v)[..., 0], c * w[..., N:] + (P.transpose(-1, -2) @ u)[..., 0]], -1)
        return project(Hw * d) + 1e-12 * z

    z, _, _ = conjugate_gradient(matvec, project(torch.cat([PM.sum(-1), PM.sum(-2)], -1) * d), tol, max_iter)
    w = z * d
    u, v = w[..., :N], w[..., N:]
    S = u.unsqueeze(-1) + v.unsqueeze(-2)
    dM = P * (1 + (S - M) / eps)
    Q = P * (M - S)

    def per_weight(q: Tensor, wt: Tensor, pot: Tensor) -> Tensor:  # zero weights: no row, no gradient
        return torch.where(wt > 0, q / torch.where(wt > 0, wt, torch.ones_like(wt)) + pot, torch.zeros_like(pot))

    return dM, per_weight(Q.sum(-1), a, u), per_weight(Q.sum(-2), b, v)


class _LinearCost(torch.autograd.Function):
    """``<M, P>`` per problem, (B,), with the implicit gradients of :func:`linear_cost_grads`."""

    @staticmethod
    def forward(ctx, M, a, b, alpha, beta, eps, Mc):
        ctx.save_for_backward(a, b, alpha, beta)
        ctx.eps, ctx.Mc, ctx.shape, ctx.dtype = eps, Mc, M.shape, M.dtype
        P = torch.exp(alpha.unsqueeze(-1) + beta.unsqueeze(-2) - Mc / eps)
        return (P * Mc).sum((-1, -2))

    @staticmethod
    def backward(ctx, G):
        a, b, alpha, beta = ctx.saved_tensors
        dM, da, db = linear_cost_grads(ctx.Mc, a.detach(), b.detach(), alpha, beta, ctx.eps)
        Gv = G.unsqueeze(-1)
        return ((Gv.unsqueeze(-1) * dM).reshape(ctx.shape).to(ctx.dtype), Gv * da, Gv * db, None, None, None, None)
