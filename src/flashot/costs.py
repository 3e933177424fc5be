"""Ground costs between point clouds, defined in one place.

Every engine asks a :class:`Cost` for what it needs:

* ``sqeuclidean``      C(x, y) = |x - y|^2                 (POT / OTT convention)
* ``half_sqeuclidean`` C(x, y) = |x - y|^2 / 2             (GeomLoss ``p=2``)
* ``euclidean``        C(x, y) = |x - y|                   (GeomLoss ``p=1``)

The squared costs are *dot-product costs*:
``C_ij = s * (|x_i|^2 + |y_j|^2 - 2 <x_i, y_j>)`` with ``s = cost.scale``, so a
softmin over ``j`` is a row-wise LogSumExp of biased dot-product scores (the
FlashSinkhorn observation).  Engines use :attr:`Cost.is_dot` to take that path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

__all__ = ["Cost", "get_cost", "COSTS", "FeatureBilinearCost", "LabelCost"]


class CostLike(Protocol):
    """What the engines and the core read of a cost (a type for the checker, nothing at run time).

    :class:`Cost`, :class:`FeatureBilinearCost` and :class:`flashot.matrix_measures.MatrixCost` provide it.
    Structural, not a common base class: ``isinstance(cost, Cost)`` (:func:`get_cost`) keeps accepting
    only the translation-invariant costs.
    """

    @property
    def name(self) -> str: ...
    @property
    def scale(self) -> float | None: ...
    @property
    def power(self) -> int: ...
    @property
    def min_sqdist(self) -> float: ...
    @property
    def is_dot(self) -> bool: ...
    @property
    def direct(self) -> bool: ...
    def tile(self, x: Tensor, y: Tensor, /) -> Tensor: ...
    def matrix(self, x: Tensor, y: Tensor, /) -> Tensor: ...
    def from_sqdist(self, d2: Tensor, /) -> Tensor: ...
    def dcost_weight(self, c: Tensor, /) -> Tensor: ...


@dataclass(frozen=True)
class Cost:
    """A translation-invariant ground cost ``C(x, y) = phi(|x - y|^2)``.

    Attributes:
        name: registry name.
        scale: for dot-product costs, ``C = scale * |x - y|^2``; ``None`` otherwise.
        power: ``p`` such that ``C = |x - y|^p / (2 if half else 1)`` (GeomLoss' ``p``).

    The built-in costs (:func:`get_cost`): ``"sqeuclidean"`` ``C = |x - y|^2``,
    ``"half_sqeuclidean"`` ``C = |x - y|^2 / 2`` (GeomLoss' ``p=2``), ``"euclidean"`` ``C = |x - y|``
    (``p=1``).  Every one is symmetric, ``C(x, y) = C(y, x)``.

    Example:
        >>> import torch, flashot
        >>> c = flashot.get_cost("half_sqeuclidean")
        >>> c.scale, c.power, c.is_dot
        (0.5, 2, True)
        >>> x, y = torch.tensor([[0.0, 0.0]]), torch.tensor([[3.0, 4.0]])
        >>> c.matrix(x, y), flashot.get_cost("euclidean").matrix(x, y)  # 25 / 2 and 5
        (tensor([[12.5000]]), tensor([[5.]]))
    """

    name: str
    scale: float | None
    power: int
    min_sqdist: float = 0.0  # euclidean only: GeomLoss' tensorized backend clamps at 1e-8

    @property
    def is_dot(self) -> bool:
        """True when ``C_ij`` is an affine function of ``<x_i, y_j>``."""
        return self.scale is not None

    def from_sqdist(self, d2: Tensor) -> Tensor:
        """Cost values from squared distances (``d2`` already clamped at 0)."""
        if self.scale is not None:
            return d2 * self.scale if self.scale != 1.0 else d2
        return (d2.clamp_min(self.min_sqdist) if self.min_sqdist > 0 else d2).sqrt()

    def dcost_weight(self, c: Tensor) -> Tensor:
        """``w`` such that ``grad_x C(x, y) = w * (x - y)``, from the cost values ``c``."""
        if self.scale is not None:
            return torch.full_like(c, 2.0 * self.scale)
        # zero where the distance is 0, or clamped (the clamp kills the gradient); the 1.001
        # margin absorbs the rounding of sqrt(min_sqdist) in float32.
        return torch.where(c > 1.001 * self.min_sqdist**0.5, 1.0 / c, torch.zeros_like(c))

    @property
    def direct(self) -> bool:
        """Distances computed from coordinate differences (no GEMM expansion).

        The expansion |x|^2 + |y|^2 - 2<x, y> loses ~1e-7 |x|^2 in float32, which
        a square root turns into errors of ~3e-4 |x| near x = y: ``euclidean``
        computes differences directly (exact zero on the diagonal).
        """
        return self.scale is None

    def tile(self, x: Tensor, y: Tensor) -> Tensor:
        """Cost values between batched blocks (B, n, D) and (B, m, D) -> (B, n, m)."""
        if self.direct:
            c = torch.cdist(x, y, compute_mode="donot_use_mm_for_euclid_dist")
            return c.clamp_min_(self.min_sqdist**0.5) if self.min_sqdist > 0 else c
        return self.from_sqdist(sqdist(x, y))

    def matrix(self, x: Tensor, y: Tensor) -> Tensor:
        """Dense cost matrix, (..., N, M).  Only for the ``dense`` engine and tests."""
        if self.direct:
            return self.from_sqdist(((x.unsqueeze(-2) - y.unsqueeze(-3)) ** 2).sum(-1))
        return self.from_sqdist(sqdist(x, y))


def sqdist(x: Tensor, y: Tensor) -> Tensor:
    """Squared distances via one GEMM, clamped at 0: (..., N, D), (..., M, D) -> (..., N, M)."""
    xx = (x * x).sum(-1, keepdim=True)
    yy = (y * y).sum(-1).unsqueeze(-2)
    d2 = (
        torch.baddbmm(xx + yy, x, y.transpose(-1, -2), alpha=-2.0)
        if x.dim() == 3
        else (xx + yy - 2.0 * x @ y.transpose(-1, -2))
    )
    return d2.clamp_min_(0.0) if not d2.requires_grad else d2.clamp_min(0.0)


COSTS: dict[str, Cost] = {
    "sqeuclidean": Cost("sqeuclidean", 1.0, 2),
    "half_sqeuclidean": Cost("half_sqeuclidean", 0.5, 2),
    "euclidean": Cost("euclidean", None, 1),
    # GeomLoss' ``backend="tensorized", p=1`` convention: sqrt(max(|x - y|^2, 1e-8))
    # (we compute |x - y|^2 from differences, GeomLoss by the GEMM expansion).
    "euclidean_geomloss": Cost("euclidean_geomloss", None, 1, 1e-8),
}


def get_cost(cost: str | Cost) -> Cost:
    """Look a cost up by name (``"sqeuclidean"``, ``"half_sqeuclidean"``, ``"euclidean"``).

    ``"sqeuclidean"``: ``C(x, y) = |x - y|^2``; ``"half_sqeuclidean"``: ``C(x, y) = |x - y|^2 / 2``;
    ``"euclidean"``: ``C(x, y) = |x - y|``.  A :class:`Cost` is returned as it is; any other name
    raises ``ValueError`` naming the choices.

    Example:
        >>> import flashot
        >>> flashot.get_cost("sqeuclidean").name
        'sqeuclidean'
        >>> c = flashot.get_cost("euclidean")
        >>> flashot.get_cost(c) is c
        True
    """
    if isinstance(cost, Cost):
        return cost
    if not isinstance(cost, str) or cost not in COSTS:
        raise ValueError(f"cost: expected one of {sorted(COSTS)}, got {cost!r}")
    return COSTS[cost]


@dataclass(frozen=True, eq=False)
class FeatureBilinearCost:
    r"""A *feature-bilinear* cost: per-point biases plus a dot product of features through a small matrix.

    .. math::
        C_{ij} = u_i + v_j + \langle \phi_i, M \psi_j \rangle

    with features :math:`\phi_i \in \mathbb{R}^p`, :math:`\psi_j \in \mathbb{R}^q` and
    :math:`M \in \mathbb{R}^{p \times q}` (per batch entry).  The engines see it as a symmetric cost
    between *augmented points* of dimension ``1 + p + q`` (build them with :meth:`pair`):
    ``s = [u_i, phi_i, 0]`` and ``t = [v_j, 0, psi_j]``, and
    ``C(s, t) = s_0 + t_0 + <s_1:, S t_1:>`` with ``S = [[0, M], [M^T, 0]]`` symmetric, so
    ``C(t, s) = C(s, t)`` and the transposed primitives are the same calls with the sides swapped.
    A tile is one batched GEMM plus the two biases.  Not translation invariant: the points are not
    centred (``solve_sample(s, t, cost=cost)`` takes the augmented points as they are).  Its ``value``
    and potentials are differentiable w.r.t. ``s`` and ``t`` (hence w.r.t. ``u``, ``v``, ``phi``, ``psi``
    built into them by :meth:`pair`): ``d value / d s_i = sum_j P_ij [1, S t'_j]``, a plan product,
    since ``grad_s C(s_i, t_j) = [1, S t'_j]`` is linear in ``t_j``.  Not w.r.t. ``M`` (``S``): a cost
    whose ``S`` requires grad is refused by :meth:`bound` (``d value / d M = Phi^T P Psi`` is
    ``phi.T @ (plan @ psi)``, available from the plan), nor through ``value_linear``.  The linearised
    Gromov-Wasserstein cost is of this kind (:mod:`flashot.gromov`).
    Engines: ``dense`` and ``tiled`` natively; ``cpu`` and ``triton`` through their squared-Euclidean
    kernels (:mod:`flashot.ops.bilinear`: ``C_ij = |xh_i - yh_j|^2 + ox_i + oy_j`` with points of
    dimension ``rank M``), which ``auto`` picks for large problems.
    """

    S: Tensor  # (B, K, K) symmetric, K = p + q
    name: str = "feature_bilinear"
    scale = None  # not a dot-product cost in the sense of ``Cost.is_dot``
    power = 0
    min_sqdist = 0.0
    is_dot = False
    direct = True  # the engines call tile() / matrix(), never the |x - y|^2 expansion
    bilinear = True

    @staticmethod
    def pair(u: Tensor, phi: Tensor, v: Tensor, psi: Tensor, M: Tensor) -> tuple[FeatureBilinearCost, Tensor, Tensor]:
        """``(cost, s, t)`` for biases ``u`` (B, N), ``v`` (B, M), features ``phi`` (B, N, p),
        ``psi`` (B, M, q) and ``M`` (B, p, q): the augmented points ``s`` (B, N, 1 + p + q) and ``t``."""
        B, N, p = phi.shape
        q = psi.shape[-1]
        s = torch.cat([u.unsqueeze(-1), phi, phi.new_zeros(B, N, q)], -1).contiguous()
        t = torch.cat([v.unsqueeze(-1), psi.new_zeros(B, psi.shape[1], p), psi], -1).contiguous()
        return FeatureBilinearCost(FeatureBilinearCost.block(M)), s, t

    @staticmethod
    def block(M: Tensor) -> Tensor:
        """``S = [[0, M], [M^T, 0]]``, (B, p + q, p + q), from ``M`` (B, p, q)."""
        B, p, q = M.shape
        S = M.new_zeros(B, p + q, p + q)
        S[:, :p, p:] = M
        S[:, p:, :p] = M.transpose(-1, -2)
        return S

    def bound(self, x: Tensor, y: Tensor) -> float:
        """``max |C_ij| <= max |u| + max |v| + max_i |S^T phi_i| max_j |psi_j|`` over augmented points
        ``x`` (B, N, 1 + K), ``y`` (B, M, 1 + K) (float64, no N x M matrix); ``ValueError`` when not finite,
        ``NotImplementedError`` when ``S`` requires grad (gradients w.r.t. ``M`` are not implemented)."""
        if torch.is_grad_enabled() and self.S.requires_grad:
            raise NotImplementedError(
                "feature-bilinear cost: gradients w.r.t. its matrix M (S) are not implemented "
                "(only w.r.t. the augmented points); detach M, and take d value / d M = "
                "phi^T P psi from the plan (phi.T @ (plan @ psi))"
            )
        X, Y = x.detach().double(), y.detach().double()
        S = self.S.detach().to(X.device, torch.float64)
        lin = torch.bmm(X[..., 1:], S).norm(dim=-1).amax(-1) * Y[..., 1:].norm(dim=-1).amax(-1)
        b = float((X[..., 0].abs().amax(-1) + Y[..., 0].abs().amax(-1) + lin).max())
        if not math.isfinite(b):
            raise ValueError(f"feature-bilinear cost: its values overflow (bound {b}); rescale the features")
        return b

    def tile(self, x: Tensor, y: Tensor) -> Tensor:
        """Cost values between augmented points (B, n, 1 + K) and (B, m, 1 + K): a fresh (B, n, m) tensor."""
        S = self.S if self.S.dtype == x.dtype and self.S.device == x.device else self.S.to(x.device, x.dtype)
        bias = x[..., :1] + y[..., 0].unsqueeze(-2)
        return torch.baddbmm(bias, torch.bmm(x[..., 1:], S), y[..., 1:].transpose(-1, -2))

    matrix = tile

    def dcost_weight(self, c: Tensor) -> Tensor:
        raise NotImplementedError(
            "a feature-bilinear cost has no gradient of the form w (x - y) (weight='dcost'): "
            "gradients of value_linear w.r.t. its augmented points are not implemented (those "
            "of value and of the potentials are)"
        )

    def from_sqdist(self, d2: Tensor) -> Tensor:
        raise NotImplementedError("a feature-bilinear cost is not a function of squared distances")


@dataclass(frozen=True, eq=False, init=False)
class LabelCost:
    r"""A *label-augmented* cost between labelled points: features plus a class-to-class table.

    .. math::
        C((x, l), (y, l')) = w_f\,|x - y|^2 + w_l\,W[l, l']

    with ``W`` a small (C_a, C_b) table (e.g. the OT distances between the classes' clouds: OTDD,
    :func:`flashot.otdd`), ``w_f = feature_weight`` and ``w_l = label_weight`` (both >= 0).  Give it with
    the labels beside the points: ``solve_sample(X_a, X_b, reg=..., cost=LabelCost(W), labels=(l_a, l_b))``
    or ``SamplesLoss(cost=LabelCost(W), ...)(x, y, labels=(l_x, l_y))``, with integer labels ``l_a`` in
    ``[0, C_a)`` and ``l_b`` in ``[0, C_b)``.

    The engines see *augmented points*: the features with the label as a last column, the ``b`` side's
    labels offset by ``C_a`` (:meth:`augment`), so that one symmetric ``(C_a + C_b)`` square table
    ``T = [[W_aa, W], [W^T, W_bb]]`` serves both orders, ``C(s, t) = C(t, s)`` (the engines' transposed
    calls).  The diagonal blocks, used only by self problems (debiasing), are ``W`` itself when ``W`` is
    square and symmetric (one label set, a symmetric class cost) and NaN otherwise (the front ends refuse
    debiasing then).  ``dense`` computes the formula above on the whole matrix, ``tiled`` on each tile;
    ``cpu`` and ``triton`` run one squared-Euclidean softmin per row class with the label term as a
    column bias (:mod:`flashot.ops.labels`).  Gradients: w.r.t. the points' features (``grad_x C = 2 w_f
    (x - y)``); ``W`` is a constant (``d value / d W[c, c'] = w_l`` times the plan's mass between the
    classes, which :func:`flashot.otdd` uses).

    Example:
        >>> import torch, flashot
        >>> _ = torch.manual_seed(0)
        >>> x, y = torch.randn(20, 2, dtype=torch.float64), torch.randn(30, 2, dtype=torch.float64)
        >>> lx, ly = torch.randint(0, 2, (20,)), torch.randint(0, 3, (30,))
        >>> W = torch.tensor([[0.0, 1.0, 4.0], [1.0, 0.0, 2.0]], dtype=torch.float64)
        >>> cost = flashot.LabelCost(W, feature_weight=1.0, label_weight=0.5)
        >>> res = flashot.solve_sample(x, y, reg=0.1, cost=cost, labels=(lx, ly))
        >>> C = torch.cdist(x, y) ** 2 + 0.5 * W[lx][:, ly]  # the cost it streams, never built
        >>> P = res.plan.to_dense()
        >>> bool(torch.allclose(res.plan.cost_sum(), (C * P).sum()))
        True
    """

    W: Tensor  # (C_a, C_b) float64, CPU, detached
    feature_weight: float
    label_weight: float
    _tables: dict = field(init=False, repr=False, compare=False)  # the cached tables of :meth:`table`
    name = "label"
    scale = None  # not a dot-product cost in the sense of ``Cost.is_dot``
    power = 0
    min_sqdist = 0.0
    is_dot = False
    direct = True  # the engines call tile() / matrix(), never the |x - y|^2 expansion
    labelled = True

    def __init__(self, W: Tensor | Any, feature_weight: float = 1.0, label_weight: float = 1.0) -> None:
        if isinstance(W, Tensor) and W.requires_grad and torch.is_grad_enabled():
            raise NotImplementedError(
                "LabelCost: gradients w.r.t. W are not implemented; pass W.detach() "
                "(d value / d W[c, c'] = label_weight x the plan's mass between classes c, c')"
            )
        if not isinstance(W, Tensor):
            try:
                W = torch.as_tensor(W)
            except (TypeError, ValueError, RuntimeError):
                raise TypeError(
                    f"W: expected a (C_a, C_b) tensor or array of class-to-class costs, got {type(W).__name__}"
                ) from None
        if W.is_complex() or W.dtype == torch.bool:
            raise TypeError(f"W: expected real numbers, got dtype {W.dtype}")
        if W.dim() != 2 or W.shape[0] < 1 or W.shape[1] < 1:
            raise ValueError(f"W: expected a (C_a, C_b) table with C_a, C_b >= 1, got shape {tuple(W.shape)}")
        W = W.detach().to("cpu", torch.float64)
        if not bool(torch.isfinite(W).all()):
            raise ValueError("W: contains NaN or Inf values")
        weights = []
        for wname, v in (("feature_weight", feature_weight), ("label_weight", label_weight)):
            if isinstance(v, (bool, str)) or not hasattr(v, "__float__"):
                raise TypeError(f"{wname}: expected a number >= 0, got {type(v).__name__}")
            v = float(v)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{wname}: expected a finite number >= 0, got {v!r}")
            weights.append(v)
        object.__setattr__(self, "W", W)
        object.__setattr__(self, "feature_weight", weights[0])
        object.__setattr__(self, "label_weight", weights[1])
        object.__setattr__(self, "_tables", {})

    def __repr__(self) -> str:
        return (
            f"LabelCost(W: {tuple(self.W.shape)}, feature_weight={self.feature_weight!r}, "
            f"label_weight={self.label_weight!r})"
        )

    @property
    def n_classes(self) -> tuple[int, int]:
        """``(C_a, C_b)``: the rows and columns of ``W``."""
        return int(self.W.shape[0]), int(self.W.shape[1])

    @property
    def symmetric(self) -> bool:
        """``W`` square and symmetric: self problems (debiasing) are defined, with ``W`` within each side."""
        return self.W.shape[0] == self.W.shape[1] and bool(torch.equal(self.W, self.W.T))

    @property
    def features(self) -> Cost:
        """The feature part ``w_f |x - y|^2`` as a squared-Euclidean :class:`Cost` (``scale = w_f``)."""
        if self.feature_weight == 1.0:
            return COSTS["sqeuclidean"]
        return Cost(f"sqeuclidean*{self.feature_weight!r}", self.feature_weight, 2)

    def table(self, device: torch.device | str | None = None, dtype: torch.dtype = torch.float64) -> Tensor:
        """``T = [[W_aa, W], [W^T, W_bb]]``, (C_a + C_b, C_a + C_b), on ``device`` in ``dtype`` (cached)."""
        key = (str(device), dtype)
        T = self._tables.get(key)
        if T is None:
            ca, cb = self.n_classes
            T = torch.full((ca + cb, ca + cb), math.nan, dtype=torch.float64)
            T[:ca, ca:], T[ca:, :ca] = self.W, self.W.T
            if self.symmetric:
                T[:ca, :ca], T[ca:, ca:] = self.W, self.W
            T = self._tables[key] = T.to(device=device, dtype=dtype)
        return T

    def augment(self, X_a: Tensor, X_b: Tensor, labels: tuple[Any, Any]) -> tuple[Tensor, Tensor]:
        """The augmented points ``[X_a, l_a]`` and ``[X_b, C_a + l_b]`` (points (N, D) or (B, N, D)) for
        ``labels = (l_a, l_b)``: integer tensors (or arrays) of shape ``X.shape[:-1]``, in ``[0, C_a)`` and
        ``[0, C_b)``; ``TypeError`` / ``ValueError`` naming the argument otherwise."""
        if not isinstance(labels, (tuple, list)) or len(labels) != 2:
            raise TypeError(
                "labels: expected a pair (labels_a, labels_b) of integer tensors, one label per point, "
                f"got {type(labels).__name__}"
            )
        out = []
        for name, X in (("X_a", X_a), ("X_b", X_b)):
            if not isinstance(X, Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor, got {type(X).__name__}")
        for side, (X, lab, n, off) in enumerate(
            ((X_a, labels[0], self.W.shape[0], 0), (X_b, labels[1], self.W.shape[1], self.W.shape[0]))
        ):
            name = f"labels[{side}]"
            lab = check_labels(name, lab, X, n, "rows" if side == 0 else "columns")
            if X.is_floating_point() and self.W.shape[0] + self.W.shape[1] > 2.0 / torch.finfo(X.dtype).eps:
                raise ValueError(
                    f"{name}: {self.W.shape[0] + self.W.shape[1]} classes are not exact in {X.dtype} "
                    "points (the labels travel as a coordinate); use float32 or float64 points"
                )
            out.append(torch.cat([X, (lab + off).to(X.dtype).unsqueeze(-1)], -1))
        return out[0], out[1]

    @staticmethod
    def split(x: Tensor) -> tuple[Tensor, Tensor]:
        """``(features, labels)`` of augmented points: (..., n, D) and (..., n) int64 table indices."""
        return x[..., :-1], x[..., -1].round().long()

    def _label_term(self, lx: Tensor, ly: Tensor, like: Tensor) -> Tensor:
        """``w_l T[l_i, l_j]``, (..., n, m): two ``index_select`` per batch entry (rows, then columns; about
        4x faster than one 2-D advanced index), one advanced index for large batches."""
        T = self.table(like.device, like.dtype)
        if lx.dim() == 1 or lx.shape[0] > 16:
            return self.label_weight * T[lx.unsqueeze(-1), ly.unsqueeze(-2)]
        L = torch.stack([T.index_select(0, r).index_select(1, c) for r, c in zip(lx, ly)])
        return L.mul_(self.label_weight) if self.label_weight != 1.0 else L

    def tile(self, x: Tensor, y: Tensor) -> Tensor:
        """Cost values between augmented points (B, n, D + 1) and (B, m, D + 1): a fresh (B, n, m) tensor,
        ``w_f |x - y|^2`` by one GEMM (the points are centred) plus ``w_l T[l_i, l_j]``."""
        (xf, lx), (yf, ly) = self.split(x), self.split(y)
        C = sqdist(xf, yf)
        C = C * self.feature_weight if self.feature_weight != 1.0 else C
        return C + self._label_term(lx, ly, C)

    def matrix(self, x: Tensor, y: Tensor) -> Tensor:
        """The dense matrix (..., N, M) from the formula: ``w_f sum_d (x_id - y_jd)^2 + w_l T[l_i, l_j]``
        (differences, no GEMM: the oracle of the ``dense`` engine and the tests)."""
        (xf, lx), (yf, ly) = self.split(x), self.split(y)
        d2 = ((xf.unsqueeze(-2) - yf.unsqueeze(-3)) ** 2).sum(-1)
        return self.feature_weight * d2 + self._label_term(lx, ly, d2)

    def bound(self, x: Tensor, y: Tensor) -> float:
        """``max |C_ij| <= w_f diag^2 + w_l max |W|`` (``diag`` the features' joint bounding box diagonal);
        ``ValueError`` when the costs would overflow the compute dtype."""
        xf, yf = x[..., :-1].detach(), y[..., :-1].detach()
        lo = torch.minimum(xf.amin(-2), yf.amin(-2)).double()
        hi = torch.maximum(xf.amax(-2), yf.amax(-2)).double()
        d2 = float((hi - lo).pow(2).sum(-1).max()) if xf.shape[-1] else 0.0
        b = self.feature_weight * d2 + self.label_weight * float(self.W.abs().max())
        cdt = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        if not (math.isfinite(b) and b < torch.finfo(cdt).max / 4):
            raise ValueError(
                f"label cost: its values overflow {cdt} (bound {b:.3g}); rescale the points or W, or use float64"
            )
        return b

    def dcost_weight(self, c: Tensor) -> Tensor:
        """``2 w_f``: ``grad_x C = 2 w_f (x - y)`` on the features (the label column has no gradient)."""
        return torch.full_like(c, 2.0 * self.feature_weight)

    def from_sqdist(self, d2: Tensor) -> Tensor:
        raise NotImplementedError("a label-augmented cost is not a function of squared distances")


def check_labels(name: str, lab: Any, X: Tensor, n_classes: int | None, what: str = "") -> Tensor:
    """Integer class labels ``lab`` of the points ``X`` (one per point, shape ``X.shape[:-1]``), in
    ``[0, n_classes)`` (the ``what`` of ``W``; any integers for None), on ``X``'s device, as int64; errors name
    ``name``."""
    if isinstance(lab, np.ndarray):
        if lab.dtype.kind not in "iu":
            raise TypeError(f"{name}: expected integer class labels, got dtype {lab.dtype}")
        lab = torch.from_numpy(np.ascontiguousarray(lab)).to(X.device)
    if not isinstance(lab, Tensor):
        raise TypeError(f"{name}: expected an integer tensor of class labels, got {type(lab).__name__}")
    if lab.is_floating_point() or lab.is_complex() or lab.dtype == torch.bool:
        raise TypeError(f"{name}: expected integer class labels (e.g. torch.long), got dtype {lab.dtype}")
    if tuple(lab.shape) != tuple(X.shape[:-1]):
        raise ValueError(f"{name}: expected shape {tuple(X.shape[:-1])} (one label per point), got {tuple(lab.shape)}")
    if lab.device != X.device:
        raise ValueError(f"{name}: is on {lab.device}, its points on {X.device}")
    if n_classes is not None and lab.numel() and (int(lab.min()) < 0 or int(lab.max()) >= n_classes):
        raise ValueError(
            f"{name}: labels must lie in [0, {n_classes}) (the {what} of W), got the range "
            f"[{int(lab.min())}, {int(lab.max())}]"
        )
    return lab.long()
