r"""The optimal transport dataset distance (:func:`flashot.otdd`) between two labelled datasets, streamed.

Following Alvarez-Melis and Fusi's OTDD, with entropic OT throughout (``eps = reg``, uniform weights):

1. the *label cost* ``W[c, c'] = OT_reg(A_c, B_c')`` between the class-conditional clouds ``A_c`` (the
   points of ``X_a`` labelled ``c``) and ``B_c'``, with the cost ``|x - y|^2`` and uniform weights inside each
   class: :func:`flashot.solve_sample`'s value, ``<C, P> + reg KL(P | a x b)`` (POT's ``ot.solve_sample(...,
   reg=reg).value``);
2. the distance ``OT_reg`` between the two labelled clouds (uniform weights) under the label-augmented cost
   ``C((x, l), (y, l')) = feature_weight |x - y|^2 + label_weight W[l, l']`` (:class:`~flashot.LabelCost`),
   the same value convention.

Both stages stream (no N x M matrix): the label-cost stage visits every pair of points once over all the
class pairs, solved together as one ragged batch (:mod:`flashot.ragged`).  The value is differentiable
w.r.t. the points through both stages: at fixed ``W`` by the envelope theorem (:func:`flashot.solve_sample`), and through ``W`` by ``d value / d W[c, c'] = label_weight
* P(c, c')``, the plan's mass between the classes (one plan product).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ._checks import check_pair, check_points, check_positive, to_tensor
from .costs import LabelCost, check_labels
from .pot_samples import solve_sample
from .ragged.measures import BACKENDS as RAGGED_BACKENDS
from .results import OTResult

__all__ = ["otdd", "OTDDResult"]


@dataclass
class OTDDResult:
    """Result of :func:`otdd`.

    Attributes:
        value: the dataset distance, the entropic OT value under the label-augmented cost; differentiable
            w.r.t. torch points that require grad.
        label_cost: ``W``, (C_a, C_b): the entropic OT values between the classes' clouds (rows: the classes
            of ``X_a`` in ``classes_a``'s order; columns: those of ``X_b``).
        classes_a, classes_b: the distinct labels of each dataset, sorted (row / column ``k`` of ``W`` is
            class ``classes_a[k]`` / ``classes_b[k]``).
        result: the :class:`~flashot.OTResult` of the final solve (its ``plan``, ``potentials``, ``n_iter``).
        converged: every solve (the ``C_a C_b`` class pairs and the final one) met ``tol``.

    Example:
        >>> import torch, flashot
        >>> _ = torch.manual_seed(0)
        >>> Xa, la = torch.randn(30, 2, dtype=torch.float64), torch.tensor([3, 7] * 15)
        >>> Xb, lb = torch.randn(20, 2, dtype=torch.float64), torch.arange(20) % 2
        >>> res = flashot.otdd(Xa, la, Xb, lb, reg=0.5)
        >>> res.classes_a.tolist(), res.classes_b.tolist(), res.label_cost.shape, res.converged
        ([3, 7], [0, 1], torch.Size([2, 2]), True)
        >>> bool(torch.isclose(res.plan.to_dense().sum(), torch.tensor(1.0, dtype=torch.float64)))
        True
    """

    value: Any
    label_cost: Any
    classes_a: Any
    classes_b: Any
    result: OTResult
    converged: bool

    @property
    def plan(self):
        """The lazy plan between the labelled clouds (:class:`~flashot.LazyPlan`), streamed products."""
        return self.result.plan

    @property
    def potentials(self):
        """``(f, g)``, the final solve's dual potentials."""
        return self.result.potentials


def otdd(
    X_a,
    labels_a,
    X_b,
    labels_b,
    *,
    reg: float,
    feature_weight: float = 1.0,
    label_weight: float = 1.0,
    tol: float | None = 1e-6,
    max_iter: int | None = None,
    backend: str = "auto",
) -> OTDDResult:
    """The optimal transport dataset distance (OTDD) between labelled datasets ``(X_a, labels_a)``, ``(X_b, labels_b)``.

    ``W[c, c'] = OT_reg(A_c, B_c')`` between the class-conditional clouds (cost ``|x - y|^2``, uniform weights in
    each class), then ``OT_reg`` between the labelled clouds (uniform weights) under
    ``C((x, l), (y, l')) = feature_weight |x - y|^2 + label_weight W[l, l']``; ``OT_reg`` is
    :func:`~flashot.solve_sample`'s value, ``<C, P> + reg KL(P | a x b)`` (POT's ``ot.solve_sample(...).value``).

    Args:
        X_a: (N, D) points (torch or numpy); labels_a: (N,) integer labels (any integers: the distinct ones,
            sorted, are ``W``'s rows).
        X_b: (M, D) points, same dtype and device; labels_b: (M,) integer labels.
        reg: the entropic regularisation (> 0), the same in both stages.
        feature_weight, label_weight: the weights of the two terms of the cost (>= 0).
        tol, max_iter, backend: as in :func:`~flashot.solve_sample`, for every solve (the class pairs: one
            ragged batch, its eps-scaling and ``acceleration="auto"`` decided from the batch's largest cost;
            one solve per pair with ``backend="dense"``).

    Returns:
        :class:`OTDDResult` (``value``, ``label_cost``, the lazy ``plan``; numpy values for numpy points).

    Example:
        >>> import torch, flashot
        >>> _ = torch.manual_seed(0)
        >>> Xa, la = torch.randn(40, 2, dtype=torch.float64), torch.arange(40) % 2
        >>> Xb, lb = torch.randn(30, 2, dtype=torch.float64) + 1, torch.arange(30) % 3
        >>> res = flashot.otdd(Xa, la, Xb, lb, reg=0.1)
        >>> res.label_cost.shape, res.plan.shape
        (torch.Size([2, 3]), (40, 30))
        >>> W = res.label_cost  # W[0, 1]: the OT value between class 0 of Xa and class 1 of Xb
        >>> bool(torch.isclose(W[0, 1], flashot.solve_sample(Xa[la == 0], Xb[lb == 1], reg=0.1).value))
        True
    """
    is_np = isinstance(X_a, np.ndarray)
    if is_np != isinstance(X_b, np.ndarray):
        raise TypeError("X_a and X_b: give both as torch tensors or both as numpy arrays")
    Xa, Xb = to_tensor("X_a", X_a), to_tensor("X_b", X_b)
    for name, X in (("X_a", Xa), ("X_b", Xb)):
        check_points(name, X)
        if X.dim() != 2:
            raise ValueError(f"{name}: expected (N, D) points (one dataset), got shape {tuple(X.shape)}")
    check_pair(Xa, Xb, "X_a", "X_b")
    check_positive("reg", reg)
    LabelCost(torch.zeros(1, 1), feature_weight, label_weight)  # the weights' checks, before any work
    la, lb = check_labels("labels_a", labels_a, Xa, None), check_labels("labels_b", labels_b, Xb, None)
    classes_a, ia = torch.unique(la, sorted=True, return_inverse=True)
    classes_b, ib = torch.unique(lb, sorted=True, return_inverse=True)
    kw = dict(reg=reg, tol=tol, max_iter=max_iter, backend=backend)
    clouds_a = [Xa[ia == k] for k in range(len(classes_a))]
    clouds_b = [Xb[ib == k] for k in range(len(classes_b))]
    W, class_ok = _class_costs(clouds_a, clouds_b, **kw)
    cost = LabelCost(W.detach(), feature_weight, label_weight)
    pts = (X_a, X_b) if is_np else (Xa, Xb)
    lab = (ia.numpy(), ib.numpy()) if is_np else (ia, ib)
    res = solve_sample(*pts, cost=cost, labels=lab, **kw)
    value = res.value
    if not is_np and W.requires_grad:  # d value / d W = label_weight * the plan's mass between the classes
        value = value + label_weight * (_class_masses(res, ia, ib, W.shape) * (W - W.detach())).sum()
    out = (lambda t: t.detach().cpu().numpy()) if is_np else (lambda t: t)
    return OTDDResult(value, out(W), out(classes_a), out(classes_b), res, bool(class_ok and res.converged))


def _class_costs(clouds_a: list[Tensor], clouds_b: list[Tensor], **solve_kw) -> tuple[Tensor, bool]:
    """``W[c, c'] = solve_sample(clouds_a[c], clouds_b[c'], **solve_kw).value`` (uniform weights in each cloud),
    (C_a, C_b), differentiable w.r.t. the clouds; and whether every solve converged.

    The class pairs are independent problems of different sizes: on the backends of the ragged path
    (:data:`flashot.ragged.measures.BACKENDS`) they run as ONE ragged batch (:func:`~flashot.solve_sample` on
    lists of clouds: one block-diagonal problem, each pair's value, gradient and stopping test its own; the
    batch's eps-scaling and ``acceleration="auto"`` decide once, from the largest cost bound of the batch), which
    saves a solve's fixed overhead per pair; elsewhere (``backend="dense"``) one solve per pair."""
    pairs = [(c, d) for c in range(len(clouds_a)) for d in range(len(clouds_b))]
    if solve_kw.get("backend", "auto") in RAGGED_BACKENDS:
        r = solve_sample([clouds_a[c] for c, _ in pairs], [clouds_b[d] for _, d in pairs], **solve_kw)
        return r.value.reshape(len(clouds_a), len(clouds_b)), bool(r.converged)
    values, ok = [], True
    for c, d in pairs:
        one = solve_sample(clouds_a[c], clouds_b[d], **solve_kw)
        values.append(one.value)
        ok = ok and bool(one.converged)
    return torch.stack(values).reshape(len(clouds_a), len(clouds_b)), ok


def _class_masses(res: OTResult, ia: Tensor, ib: Tensor, shape) -> Tensor:
    """``P(c, c') = sum_{i in c, j in c'} P_ij``, (C_a, C_b), detached: one plan product with the columns'
    one-hot classes, then the rows summed per class."""
    with torch.no_grad():
        onehot_b = torch.nn.functional.one_hot(ib, shape[1]).to(res.potentials[0].dtype)
        PB = res.plan @ onehot_b  # (N, C_b): each row's mass per column class
        return torch.zeros(shape, dtype=PB.dtype, device=PB.device).index_add_(0, ia, PB)
