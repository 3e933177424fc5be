"""The argument checks of :class:`~flashot.SamplesLoss` (GeomLoss' options): each raises before any work,
naming the option and, where one exists, the alternative."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from .kernel_losses import KERNELS

__all__ = [
    "LOSSES",
    "FUNCTION_BACKENDS",
    "check_custom",
    "check_labels",
    "check_label_cost",
    "check_loss_and_p",
    "check_multiscale",
    "check_scaling",
    "check_group",
]

LOSSES = ("sinkhorn", "hausdorff", *KERNELS)
FUNCTION_BACKENDS = ("auto", "tensorized", "dense", "tiled")


def check_custom(loss: str, cost, kernel, backend, implicit, warm_start) -> None:
    """GeomLoss' ``cost`` / ``kernel`` functions (tensorized backend); KeOps formula strings are refused."""
    for name, v, losses in (("cost", cost, ("sinkhorn", "hausdorff")), ("kernel", kernel, KERNELS)):
        if v is None:
            continue
        if isinstance(v, str):
            raise NotImplementedError(
                f"{name}: KeOps formula strings are not supported (they belong to GeomLoss' "
                f"online backend); pass a python function {name}(x, y) -> (B, N, M) tensor"
            )
        if not callable(v):
            hint = "; for a precomputed cost matrix use flashot.solve(M, a, b, reg=...)" if hasattr(v, "shape") else ""
            raise TypeError(f"{name}: expected a function (x, y) -> (B, N, M) tensor, got {type(v).__name__}{hint}")
        if loss not in losses:
            raise ValueError(f"{name}: applies to loss in {losses}, not loss={loss!r}")
        if backend not in FUNCTION_BACKENDS:
            raise ValueError(
                f"{name}: a {name} function materialises its matrices (GeomLoss' 'tensorized' backend); "
                f"use backend='auto' or 'tensorized', not {backend!r}"
            )
        if implicit is not None or (warm_start is not False and warm_start is not None):
            raise NotImplementedError(f"implicit= and warm_start= are not implemented with a {name} function")


def check_labels(name: str, lab, x: Tensor) -> Tensor:
    """Cluster labels of the six-argument call: an integer tensor with one label per point."""
    if not isinstance(lab, Tensor) or lab.is_floating_point() or lab.is_complex() or lab.dtype == torch.bool:
        raise TypeError(
            f"{name}: expected an integer tensor of cluster labels, got "
            f"{type(lab).__name__ if not isinstance(lab, Tensor) else lab.dtype}"
        )
    if tuple(lab.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"{name}: expected shape {tuple(x.shape[:-1])} (one label per point), got {tuple(lab.shape)}")
    return lab


def check_label_cost(loss: str, debias, backend, group, cost) -> None:
    """A :class:`~flashot.LabelCost` as ``cost``: ``loss="sinkhorn"`` on one process, single-scale; debiasing needs
    a square, symmetric ``W`` (the self problems' class costs)."""
    if loss != "sinkhorn" or backend == "multiscale" or group is not None:
        raise NotImplementedError(
            "cost=LabelCost(...) runs loss='sinkhorn' on one process, single-scale (not backend='multiscale' or group)"
        )
    if debias is True and not cost.symmetric:
        what = "not symmetric" if cost.W.shape[0] == cost.W.shape[1] else f"of shape {tuple(cost.W.shape)}"
        raise ValueError(
            f"cost=LabelCost(W) with debias=True: the self problems need a square, symmetric W (one "
            f"label set), got W {what}; use debias=False"
        )


def check_loss_and_p(loss: str, p: int) -> int:
    """``loss`` one of :data:`LOSSES`, ``p`` 1 or 2 (returned as an int)."""
    if not isinstance(loss, str):
        raise TypeError(f"loss: expected a string ('sinkhorn'), got {type(loss).__name__}")
    if loss not in LOSSES:
        raise ValueError(f"loss: expected one of {LOSSES}, got {loss!r}")
    if isinstance(p, bool) or not isinstance(p, (int, float, np.integer, np.floating)):
        raise TypeError(f"p: expected the integer 1 or 2, got {type(p).__name__}")
    if p not in (1, 2):
        raise ValueError(f"p: expected 1 or 2, got {p!r}")
    return int(p)


def check_multiscale(backend, loss, cost, implicit, warm_start, debias, cluster_scale, rho_x, rho_y) -> None:
    """The options ``backend="multiscale"`` runs with (and ``cluster_scale`` only with it)."""
    multiscale = backend == "multiscale"
    if cluster_scale is not None and not multiscale:
        raise ValueError("cluster_scale: used by backend='multiscale' only (GeomLoss' clustering scale)")
    if multiscale and (
        loss != "sinkhorn"
        or cost is not None
        or implicit is not None
        or (warm_start is not False and warm_start is not None)
    ):
        raise NotImplementedError(
            "backend='multiscale' runs loss='sinkhorn' with the built-in costs (p=1 or 2), "
            "without implicit= or warm_start=; use backend='auto' for the others"
        )
    if multiscale and debias and rho_x != rho_y:
        raise NotImplementedError(
            "backend='multiscale': debiasing with reach_x != reach_y (two-sided self "
            "problems) is not implemented; use backend='auto', or reach= for both sides"
        )


def check_scaling(scaling: float) -> None:
    """GeomLoss' eps-scaling ratio: a number in (0, 1)."""
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float, np.integer, np.floating)):
        raise TypeError(f"scaling: expected a number in (0, 1), got {type(scaling).__name__}")
    if not 0 < scaling < 1:
        raise ValueError(f"scaling: expected a number in (0, 1), got {scaling!r}")


def check_group(group, shard: str, loss: str, cost, multiscale: bool) -> None:
    """The options of a distributed loss (``group`` / ``shard``)."""
    if multiscale and shard == "points":
        raise NotImplementedError(
            "backend='multiscale' with shard='points': the clustering needs the whole clouds "
            "on every rank; use shard='replicated' (the default: every rank passes all the "
            "points)"
        )
    if group is not None and (loss != "sinkhorn" or cost is not None):
        raise NotImplementedError(
            "group: distributed solves support loss='sinkhorn' with the built-in costs "
            "(p=1 or 2), not cost functions or kernel norms"
        )
    from .distributed import check_shard

    check_shard(shard, group)
