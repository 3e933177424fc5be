r"""The entropic transport plan as a lazy linear operator.

:math:`P_{ij} = a_i b_j \exp((f_i + g_j - C(x_i, y_j)) / \varepsilon)` is never
stored: ``P @ V`` and ``P.T @ U`` are streamed plan products (memory O(n + m)).
``P @ V`` is differentiable w.r.t. ``V`` (linear: the VJP is ``P^T G``); the plan itself is a
constant (it acts on detached potentials): no gradient flows to the points or weights.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from ._checks import check_choice, check_dtype, check_int, check_storage
from .measures import Measures
from .ops.autograd import plan_apply
from .ops.base import WEIGHTS, Weight

# ``to_dense`` refuses above this many entries (B * N * M): 2**26 = 256 MiB of float32.
DENSE_PLAN_LIMIT = 2**26


class LazyPlan:
    """``P = diag(a) exp((f + g^T - C) / eps) diag(b)``, applied on the fly.

    Shapes are (N, M), or (B, N, M) for batched problems.  ``P @ V`` takes V of
    shape (M,), (M, K) or (B, M, K); numpy arrays in give numpy arrays out.

    ``P_ij = a_i b_j exp((f_i + g_j - C(x_i, y_j)) / eps)``: ``C`` and ``eps`` are those of the
    solve that built it (``reg`` and ``cost`` for :func:`~flashot.solve_sample`, ``blur^p`` and
    ``|x - y|^p / p`` for :class:`~flashot.SamplesLoss`, as :func:`plan_from_potentials` states).

    Example:
        >>> import torch, flashot
        >>> _ = torch.manual_seed(0)
        >>> x, y = torch.randn(4, 2, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
        >>> P = flashot.solve_sample(x, y, reg=0.5).plan
        >>> P
        LazyPlan(shape=(4, 6), eps=0.5, engine=...)
        >>> V = torch.randn(6, 3, dtype=torch.float64)
        >>> bool(torch.allclose(P @ V, P.to_dense() @ V)), (P.T @ torch.ones(4, dtype=torch.float64)).shape
        (True, torch.Size([6]))
    """

    def __init__(self, m: Measures, f: Tensor, g: Tensor, eps: float, *, transposed: bool = False, numpy: bool = False):
        self._m, self._f, self._g, self.eps = m, f.detach(), g.detach(), float(eps)
        self._t, self._numpy = transposed, numpy

    # -- structure -----------------------------------------------------------------
    @property
    def measures(self) -> Measures:
        """The :class:`~flashot.measures.Measures` of the solve (its points, weights, cost and engine)."""
        return self._m

    @property
    def raw_potentials(self) -> tuple[Tensor, Tensor]:
        """``(f, g)`` as the plan holds them: detached, (B, N) and (B, M), in the compute dtype, on the
        centred problem of :attr:`measures` (``OTResult.potentials`` are these with the input's layout restored)."""
        return self._f, self._g

    @property
    def returns_numpy(self) -> bool:
        """Whether products, sums and dense copies come back as numpy arrays (the solve had numpy inputs)."""
        return self._numpy

    @property
    def shape(self) -> tuple[int, ...]:
        B, N, M, _ = self._m.shape
        nm = (M, N) if self._t else (N, M)
        return nm if not self._m.batched else (B, *nm)

    @property
    def T(self) -> LazyPlan:
        """The transposed plan ``P^T`` (M, N), lazy as well: ``(P^T)_ji = P_ij``.

        Example:
            >>> import torch, flashot
            >>> _ = torch.manual_seed(0)
            >>> x, y = torch.randn(4, 2, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
            >>> P = flashot.solve_sample(x, y, reg=0.5).plan  # squared Euclidean cost, eps = 0.5
            >>> P.T.shape, bool(torch.allclose(P.T.to_dense(), P.to_dense().T))
            ((6, 4), True)
        """
        return LazyPlan(self._m, self._f, self._g, self.eps, transposed=not self._t, numpy=self._numpy)

    def __repr__(self) -> str:
        return f"LazyPlan(shape={self.shape}, eps={self.eps:g}, engine={self._m.engine.name!r})"

    # -- the one streamed operation ----------------------------------------------------
    def _sides(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        m = self._m
        alpha = self._f / self.eps + m.a_log
        beta = self._g / self.eps + m.b_log
        if self._t:
            return m.y.detach(), m.x.detach(), beta, alpha
        return m.x.detach(), m.y.detach(), alpha, beta

    def apply(self, V: Tensor | np.ndarray, weight: Weight = "plan") -> Tensor | np.ndarray:
        """``(P ⊙ W) @ V`` (``weight`` as in :func:`flashot.ops.plan_product`); differentiable w.r.t. a
        torch ``V`` that requires grad, returned in ``V``'s dtype.

        ``out_i = sum_j P_ij W_ij V_j`` with ``W_ij = 1`` (``"plan"``, the same as ``P @ V``),
        ``C(x_i, y_j)`` (``"cost"``) or ``w`` with ``grad_x C = w (x - y)`` (``"dcost"``).

        Example:
            >>> import torch, flashot
            >>> _ = torch.manual_seed(0)
            >>> x, y = torch.randn(4, 2, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
            >>> P = flashot.solve_sample(x, y, reg=0.5).plan  # squared Euclidean cost, eps = 0.5
            >>> V = torch.randn(6, dtype=torch.float64)
            >>> C = torch.cdist(x, y) ** 2
            >>> bool(torch.allclose(P.apply(V, weight="cost"), (P.to_dense() * C) @ V))
            True
        """
        check_choice("weight", weight, WEIGHTS)
        is_np = isinstance(V, np.ndarray)
        if isinstance(V, np.ndarray) and V.dtype.kind not in "fiub":
            raise TypeError(f"V: expected a real-valued array, got dtype {V.dtype}")
        Vt = torch.from_numpy(np.ascontiguousarray(V)) if is_np else V
        if not isinstance(Vt, Tensor):
            raise TypeError(f"V: expected a torch.Tensor or numpy.ndarray, got {type(V).__name__}")
        check_dtype("V", Vt, allow_int=True)  # integer / bool values are cast (float64 from numpy)
        check_storage("V", Vt)
        if not Vt.is_floating_point():
            Vt = Vt.to(torch.float64 if is_np else self._m.x.dtype)
        x, y, alpha, beta = self._sides()
        cols = y.shape[1]
        batched = self._m.batched
        vec = Vt.dim() == (2 if batched else 1)
        V3 = Vt.unsqueeze(-1) if vec else Vt
        if not batched:
            V3 = V3.unsqueeze(0)
        if V3.dim() != 3 or V3.shape[:2] != (x.shape[0], cols):
            raise ValueError(
                f"V: expected shape ({cols},) or ({cols}, K)"
                + (" with a leading batch axis" if batched else "")
                + f" for a plan of shape {self.shape}, got {tuple(Vt.shape)}"
            )
        if not bool(torch.isfinite(V3.detach()).all()):
            raise ValueError("V: contains NaN or Inf values")
        out_dtype = Vt.dtype
        V3 = V3.to(device=x.device, dtype=x.dtype)
        out = plan_apply(V3, x, y, alpha, beta, self.eps, self._m.cost, self._m.engine, weight)
        out = out if batched else out[0]
        out = out[..., 0] if vec else out
        out = out.to(out_dtype)
        return out.cpu().numpy() if is_np else out

    def __matmul__(self, V: Tensor | np.ndarray) -> Tensor | np.ndarray:
        return self.apply(V)

    # -- derived quantities ------------------------------------------------------------------
    def _ones(self) -> Tensor:
        x, y, _, _ = self._sides()
        return torch.ones(y.shape[0], y.shape[1], 1, dtype=x.dtype, device=x.device)

    def row_sums(self) -> Tensor | np.ndarray:
        """``P 1`` (streamed): ``r_i = sum_j P_ij``, (N,) (or (B, N)).

        Example:
            >>> import torch, flashot
            >>> _ = torch.manual_seed(0)
            >>> x, y = torch.randn(4, 2, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
            >>> P = flashot.solve_sample(x, y, reg=0.5).plan  # squared Euclidean cost, eps = 0.5
            >>> bool(torch.allclose(P.row_sums(), P.to_dense().sum(1)))
            True
        """
        out = self._apply_raw(self._ones())
        return self._finish(out[..., 0])

    def raw_marginals(self) -> tuple[Tensor, Tensor]:
        """``(P 1, P^T 1)`` as the engine computes them, (B, N) and (B, M), on this process's points (a
        collective in points-sharded mode), without the input's dtype or batch axis restored."""
        return self._apply_raw(self._ones())[..., 0], self.T._apply_raw(self.T._ones())[..., 0]

    def _apply_raw(self, V3: Tensor, weight: Weight = "plan") -> Tensor:
        x, y, alpha, beta = self._sides()
        with torch.no_grad():
            return self._m.engine.plan_product(x, y, alpha, beta, self.eps, V3, self._m.cost, weight)

    def _finish(self, t: Tensor) -> Tensor | np.ndarray:
        t = self._m.restore(t)
        return t.cpu().numpy() if self._numpy else t

    def sum(self, axis: int | None = None) -> Tensor | np.ndarray:
        """NumPy's ``P.sum(axis)``: the total mass (``None``), the column sums ``P^T 1`` (``axis=0``) or
        the row sums ``P 1`` (``axis=1``), per problem for batched plans (axes count from the last two).

        ``sum_ij P_ij``, ``(P^T 1)_j = sum_i P_ij`` or ``(P 1)_i = sum_j P_ij``, streamed.

        Example:
            >>> import torch, flashot
            >>> _ = torch.manual_seed(0)
            >>> x, y = torch.randn(4, 2, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
            >>> P = flashot.solve_sample(x, y, reg=0.5).plan  # squared Euclidean cost, eps = 0.5
            >>> round(float(P.sum()), 6), P.sum(axis=0).shape, P.sum(axis=1).shape
            (1.0, torch.Size([6]), torch.Size([4]))
        """
        if axis is None:
            rows = self.row_sums()
            return rows.sum(-1)
        if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)) or int(axis) not in (0, 1, -1, -2):
            raise ValueError(f"axis: expected None, 0 (column sums) or 1 (row sums), got {axis!r}")
        return self.row_sums() if int(axis) in (1, -1) else self.T.row_sums()

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        """``np.asarray(plan)``: the dense plan (:meth:`to_dense`; ``MemoryError`` above its limits)."""
        try:
            P = self.to_dense()
        except MemoryError as e:
            raise MemoryError(
                f"np.asarray(plan): {e}; for a larger dense plan call plan.to_dense(max_elems=...)"
            ) from None
        P = P if isinstance(P, np.ndarray) else P.detach().cpu().numpy()
        return P.astype(dtype, copy=False) if dtype is not None else P

    def cost_sum(self) -> Tensor:
        """``<C, P> = sum_ij C(x_i, y_j) P_ij`` per problem, (B,) (streamed).

        Example:
            >>> import torch, flashot
            >>> _ = torch.manual_seed(0)
            >>> x, y = torch.randn(4, 2, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
            >>> P = flashot.solve_sample(x, y, reg=0.5).plan  # squared Euclidean cost, eps = 0.5
            >>> C = torch.cdist(x, y) ** 2
            >>> bool(torch.allclose(P.cost_sum(), (C * P.to_dense()).sum()))
            True
        """
        return self._apply_raw(self._ones(), "cost")[..., 0].sum(-1)

    def to_dense(self, max_elems: int = DENSE_PLAN_LIMIT) -> Tensor | np.ndarray:
        """Materialise ``P``; refuses above ``max_elems`` entries, or above the dense engine's byte
        budget ``FLASHOT_DENSE_MAX_BYTES`` (both ``MemoryError``).

        Returns the (N, M) (or (B, N, M)) tensor ``P_ij = exp(alpha_i + beta_j - C(x_i, y_j) / eps)``,
        ``alpha = f / eps + log a``, ``beta = g / eps + log b`` (numpy for numpy inputs).

        Example:
            >>> import torch, flashot
            >>> _ = torch.manual_seed(0)
            >>> x, y = torch.randn(4, 2, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
            >>> P = flashot.solve_sample(x, y, reg=0.5).plan  # squared Euclidean cost, eps = 0.5
            >>> D = P.to_dense()
            >>> D.shape, bool((D >= 0).all())
            (torch.Size([4, 6]), True)
            >>> P.to_dense(max_elems=10)
            Traceback (most recent call last):
            ...
            MemoryError: to_dense: the plan has 24 entries (shape (4, 6)), above max_elems=10; ...
        """
        max_elems = check_int("max_elems", max_elems, minimum=0)
        n = int(np.prod(self.shape))
        if n > max_elems:
            raise MemoryError(
                f"to_dense: the plan has {n:,} entries (shape {self.shape}), above max_elems={max_elems:,}; "
                "use plan @ V, plan.T @ U or raise max_elems explicitly"
            )
        x, y, alpha, beta = self._sides()
        from .ops.dense import check_dense_budget  # the dense engine's byte budget (FLASHOT_DENSE_MAX_BYTES)

        check_dense_budget(x.shape[0], x.shape[1], y.shape[1], x.dtype, x.device)
        with torch.no_grad():
            C = self._m.cost.matrix(x, y)
            P = torch.exp(alpha.unsqueeze(-1) + beta.unsqueeze(-2) - C / self.eps)
        return self._finish(P)

    # -- plan-derived maps -----------------------------------------------------------------
    def barycentric_map(self) -> Tensor | np.ndarray:
        r"""``T(x_i) = sum_j P_ij y_j / sum_j P_ij``: (N, D) (or (B, N, D)), streamed.

        One plan product with ``V = [y, 1]`` (memory O(N + M)).  For ``plan.T``
        the roles swap (a map from the ``y`` points to the ``x`` side).  Rows of
        zero mass (``a_i = 0``) have no image and come back as NaN.

        Example:
            >>> import torch, flashot
            >>> _ = torch.manual_seed(0)
            >>> x, y = torch.randn(4, 2, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
            >>> P = flashot.solve_sample(x, y, reg=0.5).plan  # squared Euclidean cost, eps = 0.5
            >>> T = P.barycentric_map()
            >>> D = P.to_dense()
            >>> T.shape, bool(torch.allclose(T, (D @ y) / D.sum(1, keepdim=True)))
            (torch.Size([4, 2]), True)
        """
        if getattr(self._m.cost, "n_rows", None) is not None:  # a MatrixCost: rows and columns are indices
            raise ValueError(
                "barycentric_map: this plan comes from a cost matrix (flashot.solve), which has no "
                "points to average; use plan @ Y / plan.sum(1)[:, None] with your target points Y"
            )
        x, y, _, _ = self._sides()
        D = y.shape[-1]
        V = torch.cat([y, torch.ones_like(y[..., :1])], -1).contiguous()
        S = self._apply_raw(V)
        with torch.no_grad():
            mass = S[..., D:]
            T = torch.where(mass > 0, S[..., :D] / mass.clamp_min(torch.finfo(S.dtype).tiny), float("nan"))
            T = T + self._m.center  # the measures are stored centred on a common point
            if getattr(self._m.cost, "labelled", False):  # a LabelCost: the features, not the label column
                T = T[..., :-1]
        return self._finish(T)

    def topk(self, k: int) -> tuple[Tensor | np.ndarray, Tensor | np.ndarray]:
        r"""The ``k`` largest entries of each row of ``P`` and their column indices.

        Returns ``(values, indices)`` of shape (N, k) (or (B, N, k)), values sorted
        in decreasing order.  Streamed: a running top-k per row over column tiles
        of the cost (:func:`~flashot.ops.rowtopk.row_topk`), memory O((N + M) D + N k)
        on every engine; no N x M matrix.  ``plan.T.topk(k)`` gives the largest
        entries of each column.  Each row is ranked by ``g_j + eps log b_j - C(x_i, y_j)``
        (``P_ij`` up to the row's factor ``a_i exp(f_i / eps)``).

        Example:
            >>> import torch, flashot
            >>> _ = torch.manual_seed(0)
            >>> x, y = torch.randn(4, 2, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
            >>> P = flashot.solve_sample(x, y, reg=0.5).plan  # squared Euclidean cost, eps = 0.5
            >>> values, indices = P.topk(2)
            >>> ref = P.to_dense().topk(2, dim=1)
            >>> values.shape, bool(torch.equal(indices, ref.indices)), bool(torch.allclose(values, ref.values))
            (torch.Size([4, 2]), True, True)
        """
        from .ops.rowtopk import row_topk

        k = check_int("k", k, minimum=1)
        x, y, alpha, beta = self._sides()
        if k > y.shape[1]:
            raise ValueError(f"k: expected at most {y.shape[1]} (the number of columns of the plan), got {k}")
        vals, idx = row_topk(x, y, beta, 1.0 / self.eps, self._m.cost, k, dense=self._m.engine.name == "dense")
        with torch.no_grad():
            vals = torch.exp(vals + alpha.unsqueeze(-1))
        idx = idx if self._m.batched else idx[0]
        return self._finish(vals), (idx.cpu().numpy() if self._numpy else idx)


_P_COSTS = {1: "euclidean", 2: "half_sqeuclidean"}


def plan_from_potentials(
    x: Tensor | np.ndarray,
    y: Tensor | np.ndarray,
    f: Tensor | np.ndarray,
    g: Tensor | np.ndarray,
    a: Tensor | np.ndarray | None = None,
    b: Tensor | np.ndarray | None = None,
    *,
    blur: float | None = None,
    p: int = 2,
    reg: float | None = None,
    cost: str | None = None,
    backend: str = "auto",
) -> LazyPlan:
    r"""The lazy plan ``P_ij = a_i b_j exp((f_i + g_j - C(x_i, y_j)) / eps)`` of given potentials.

    Two conventions:

    * GeomLoss (default): ``blur`` and ``p`` as in :class:`~flashot.SamplesLoss`,
      ``C = |x - y|^2 / 2`` (``p=2``) or ``|x - y|`` (``p=1``), ``eps = blur^p``.
    * POT / :func:`~flashot.solve_sample`: ``reg`` (= eps) and ``cost``
      (default ``"sqeuclidean"``).

    The potentials must be the *cross* potentials of OT_eps(a, b).  GeomLoss'
    ``SamplesLoss(..., potentials=True)`` returns them only with ``debias=False``;
    with ``debias=True`` it returns ``f - f_aa`` and ``g - g_bb`` (the gradients
    of the Sinkhorn divergence), which do **not** define a transport plan
    (the result would not have marginals ``a``, ``b``).  Use
    ``SamplesLoss(..., debias=False, potentials=True)`` or
    :meth:`flashot.SamplesLoss.plan`, which does this for you.

    Args:
        x: (N, D) or batched (B, N, D) torch tensor.
        y: (M, D) or batched (B, M, D) torch tensor.
        f: (N,) (or (B, N)) potential on ``x``.
        g: (M,) (or (B, M)) potential on ``y``.
        a: (N,) weights of ``x`` (uniform if None).
        b: (M,) weights of ``y`` (uniform if None).

    Example:
        >>> import torch, flashot
        >>> _ = torch.manual_seed(0)
        >>> x, y = torch.randn(20, 2), torch.randn(30, 2)
        >>> F, G = flashot.SamplesLoss(blur=0.5, debias=False, potentials=True)(x, y)
        >>> P = flashot.plan_from_potentials(x, y, F, G, blur=0.5)  # half squared Euclidean cost, eps = 0.25
        >>> P.shape, P.eps
        ((20, 30), 0.25)
        >>> res = flashot.solve_sample(x, y, reg=0.25, cost="half_sqeuclidean")
        >>> P2 = flashot.plan_from_potentials(x, y, *res.potentials, reg=0.25, cost="half_sqeuclidean")
        >>> bool(torch.allclose(P2.to_dense(), res.plan.to_dense()))
        True
    """
    from ._checks import check_eps_scale, check_positive, check_power, to_tensor
    from .measures import Measures

    if reg is not None and blur is not None:
        raise ValueError("blur and reg: give one of them (blur: GeomLoss convention, reg: POT convention)")
    if reg is not None:
        eps = check_positive("reg", reg)
        cost = "sqeuclidean" if cost is None else cost
    else:
        if blur is None:
            raise ValueError("blur: required (GeomLoss convention, eps = blur^p), or give reg= (POT convention)")
        if isinstance(p, bool) or not isinstance(p, (int, float, np.integer, np.floating)):
            raise TypeError(f"p: expected the integer 1 or 2, got {type(p).__name__}")
        if p not in _P_COSTS:
            raise ValueError(f"p: expected 1 or 2, got {p!r}")
        p = int(p)
        if cost is not None:
            raise ValueError("cost: use it with reg= (POT convention); with blur= the cost follows p")
        eps = check_power("blur", check_positive("blur", blur), p)
        cost = _P_COSTS[p]
    is_np = isinstance(x, np.ndarray)
    x, y = to_tensor("x", x), to_tensor("y", y)
    m = Measures.build(
        x,
        y,
        None if a is None else to_tensor("a", a, like=x),
        None if b is None else to_tensor("b", b, like=y),
        cost=cost,
        backend=backend,
    )
    check_eps_scale("reg" if reg is not None else "blur", eps, m.cmax, m.x.dtype)
    pots = []
    for name, v, ref in (("f", f, m.a_log), ("g", g, m.b_log)):
        t = to_tensor(name, v)
        check_dtype(name, t)
        check_storage(name, t)
        t = t.unsqueeze(0) if not m.batched else t
        if tuple(t.shape) != tuple(ref.shape):
            want = tuple(ref.shape) if m.batched else tuple(ref.shape[1:])
            raise ValueError(f"{name}: expected shape {want}, got {tuple(v.shape)}")
        if not bool(torch.isfinite(t.detach()).all()):
            raise ValueError(f"{name}: contains NaN or Inf values")
        pots.append(t.detach().to(ref.device, ref.dtype))
    return LazyPlan(m, pots[0], pots[1], eps, numpy=is_np)
