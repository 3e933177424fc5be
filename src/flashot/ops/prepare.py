"""Two clouds made ready for the engines: validated, batched, cast, centred, bounded, with their engine.

Shared by the primitives of :mod:`flashot.ops` and by :mod:`flashot.ops.ctransform` (a module of its
own so that neither imports the other's package).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from .._checks import check_dtype, check_pair, check_points, check_storage, compute_dtype
from ..costs import Cost, get_cost
from .base import Engine
from .registry import get_engine

__all__ = ["common_center", "max_cost", "PreparedPair", "prepare_pair", "check_vector"]


def _bounds(x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """Corners ``(lo, hi)`` of the joint bounding box of both clouds, (B, D) each, detached."""
    with torch.no_grad():
        return torch.minimum(x.amin(-2), y.amin(-2)), torch.maximum(x.amax(-2), y.amax(-2))


def common_center(x: Tensor, y: Tensor) -> Tensor:
    """Midpoint of the joint bounding box of both clouds, (B, 1, D), detached.

    ``center = (min(x, y) + max(x, y)) / 2``, coordinate-wise over both clouds.  Every cost is
    translation invariant, ``C(x - c, y - c) = C(x, y)``, so the engines work on ``x - c`` and
    ``y - c``: this keeps the float32 expansion ``|x|^2 + |y|^2 - 2<x, y>`` accurate.

    Example:
        >>> import torch
        >>> from flashot import ops
        >>> x = torch.tensor([[[0.0, 0.0], [2.0, 1.0]]])
        >>> y = torch.tensor([[[4.0, -1.0]]])
        >>> ops.common_center(x, y)
        tensor([[[2., 0.]]])
    """
    lo, hi = _bounds(x, y)
    return ((lo + hi) / 2).unsqueeze(-2)


def max_cost(x: Tensor, y: Tensor, cost: Cost, cdt: torch.dtype, names: tuple[str, str] = ("x", "y")) -> float:
    """Upper bound of ``C(x_i, y_j)`` over all pairs (the cost of the joint bounding box's diagonal).

    Raises ``ValueError`` naming both clouds when the squared distances would overflow the
    compute dtype ``cdt`` (finite points, but ``|x - y|^2`` above its largest finite number):
    every engine forms them (GEMM expansion or differences squared).
    """
    lo, hi = _bounds(x, y)
    d2 = float((hi.double() - lo.double()).pow(2).sum(-1).max())
    big = torch.finfo(cdt).max
    if not d2 < big / 4:  # |x|^2 + |y|^2 + 2|<x, y>| of centred points is at most d2; margin for sums
        raise ValueError(
            f"{names[0]} and {names[1]}: squared distances between the points overflow {cdt} (the bounding "
            f"box's diagonal is {math.sqrt(d2):.3g}, squared {d2:.3g}, above {big / 4:.3g}); rescale the points "
            f"(the value scales with the cost: scale reg / blur**p with it) or use float64"
        )
    return float(cost.from_sqdist(torch.tensor(d2, dtype=torch.float64)))


class PreparedPair(NamedTuple):
    """Two clouds ready for the engines (:func:`prepare_pair`'s result).

    Attributes:
        x: (B, N, D) points minus ``center``, in the compute dtype; keeps autograd history.
        y: (B, M, D) points minus ``center``.
        cost: the :class:`~flashot.Cost` ``C``; ``C(x, y)`` is unchanged by the centring.
        engine: the :class:`Engine` chosen for the problem.
        batched: whether the inputs had a batch axis (outputs drop it otherwise).
        out_dtype: the dtype to return results in (the inputs' dtype).
        center: (B, 1, D), subtracted from both clouds (:func:`common_center`).
        cmax: ``max_ij C(x_i, y_j)`` bound: the cost of the joint bounding box's diagonal, float64.

    Example:
        >>> import torch
        >>> from flashot import ops
        >>> pp = ops.prepare_pair(torch.zeros(3, 2), torch.tensor([[3.0, 4.0]]),
        ...                       cost="sqeuclidean", backend="dense")
        >>> pp.x.shape, pp.batched, pp.engine.name, pp.cmax  # cmax = 3^2 + 4^2
        (torch.Size([1, 3, 2]), False, 'dense', 25.0)
    """

    x: Tensor  # (B, N, D) centred, compute dtype, keeps autograd history
    y: Tensor  # (B, M, D)
    cost: Cost
    engine: Engine
    batched: bool
    out_dtype: torch.dtype
    center: Tensor  # (B, 1, D), subtracted from both clouds
    cmax: float  # upper bound of the cost over all pairs (bounding-box diagonal), float64


def prepare_pair(
    x: Tensor,
    y: Tensor,
    *,
    cost: str | Cost,
    backend: str,
    allow_dense: bool = True,
    names: tuple[str, str] = ("x", "y"),
) -> PreparedPair:
    """Validate two clouds, batch them, cast to the compute dtype, centre them, pick the engine.

    Also bounds the cost (``cmax``) and rejects clouds whose squared distances overflow the
    compute dtype (:func:`max_cost`).

    Returns a :class:`PreparedPair` with ``x - c`` and ``y - c`` for the centre ``c`` of
    :func:`common_center` (``C(x - c, y - c) = C(x, y)``: every cost is translation invariant),
    ``cmax >= max_ij C(x_i, y_j)``, and the engine of ``backend`` for this size.  float16 /
    bfloat16 inputs are computed in float32.

    Example:
        >>> import torch
        >>> from flashot import ops
        >>> x, y = torch.randn(2, 5, 3) + 100, torch.randn(2, 4, 3) + 100
        >>> pp = ops.prepare_pair(x, y, cost="half_sqeuclidean", backend="tiled")
        >>> pp.batched, pp.engine.name, pp.cost.name
        (True, 'tiled', 'half_sqeuclidean')
        >>> bool(torch.allclose(pp.x + pp.center, x)), bool(pp.center.abs().max() > 90)
        (True, True)
    """
    xn, yn = names
    check_points(xn, x)
    check_points(yn, y)
    check_pair(x, y, xn, yn)
    bilinear = getattr(cost, "bilinear", False)  # FeatureBilinearCost: augmented points, no centring
    labelled = getattr(cost, "labelled", False)  # LabelCost: features and a label column, features centred
    if not isinstance(cost, (str, Cost)) and not (bilinear or labelled):
        hint = (
            "; for a precomputed cost matrix use flashot.solve(M, a, b, reg=...) (POT's ot.solve)"
            if hasattr(cost, "shape")
            else ""
        )
        raise TypeError(f"cost: expected a cost name (string) or a flashot.Cost, got {type(cost).__name__}{hint}")
    cost = cost if bilinear or labelled else get_cost(cost)
    batched = x.dim() == 3
    if not batched:
        x, y = x.unsqueeze(0), y.unsqueeze(0)
    out_dtype = x.dtype
    cdt = compute_dtype(x.dtype)
    cmax = cost.bound(x, y) if bilinear or labelled else max_cost(x, y, cost, cdt, names)
    x, y = x.to(cdt), y.to(cdt)
    if labelled:  # translation invariant in the features only: the label column stays as it is
        c = torch.cat([common_center(x[..., :-1], y[..., :-1]), torch.zeros_like(x[:, :1, :1])], -1)
    else:
        c = torch.zeros_like(x[:, :1]) if bilinear else common_center(x, y)
    x, y = (x - c).contiguous(), (y - c).contiguous()
    B, N, D = x.shape
    eng = get_engine(
        backend, device=x.device, dtype=cdt, cost=cost, size=(B, N, y.shape[1], D), allow_dense=allow_dense
    )
    return PreparedPair(x, y, cost, eng, batched, out_dtype, c, cmax)


def check_vector(name: str, v: Tensor, shape, cdt, device) -> Tensor:
    """A tensor argument ``v`` of ``shape`` on ``device`` (NaN and +Inf refused, -Inf allowed: zero weight),
    cast to the compute dtype ``cdt``; the error names ``name``."""
    if not isinstance(v, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(v).__name__}")
    check_dtype(name, v)
    check_storage(name, v)
    if v.device != device:
        raise ValueError(f"{name}: is on {v.device}, expected {device}")
    if tuple(v.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(v.shape)}")
    if bool(torch.isnan(v.detach()).any()) or bool(torch.isposinf(v.detach()).any()):
        raise ValueError(f"{name}: contains NaN or +Inf (-Inf is allowed and means zero weight)")
    return v.to(cdt)
