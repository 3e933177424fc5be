"""Input checks and the validated options of the GW solvers (clear errors before any work)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .._checks import (
    FLOATS,
    check_bool,
    check_finite,
    check_int,
    check_positive,
    check_storage,
    check_weights,
    to_tensor,
)

# What the public GW functions take as points, features and weights: torch tensors or numpy arrays (results in kind)
ArrayLike = Tensor | np.ndarray


def check_alpha(alpha: object) -> float:
    """``alpha`` of the fused solvers as a float in [0, 1] (the weight of the GW term)."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= float(alpha) <= 1.0:
        raise ValueError(f"alpha: expected a number in [0, 1] (the weight of the GW term), got {alpha!r}")
    return float(alpha)


def check_cloud(name: str, x: object) -> Tensor:
    """``x`` as a finite floating-point tensor of shape (N, D), N and D >= 1 (clear errors otherwise)."""
    x = to_tensor(name, x)
    if not isinstance(x, Tensor) or x.dtype not in FLOATS:
        raise TypeError(
            f"{name}: expected a floating-point tensor (float16/bfloat16/float32/float64), got "
            f"{getattr(x, 'dtype', type(x).__name__)}"
        )
    check_storage(name, x)
    if x.dim() == 3:
        raise NotImplementedError(
            f"{name}: batched clouds (B, N, D) are not supported by gromov_wasserstein yet; loop over the batch"
        )
    if x.dim() != 2:
        raise ValueError(f"{name}: expected shape (N, D), got {tuple(x.shape)}")
    if x.shape[0] == 0:
        raise ValueError(f"{name}: the point cloud is empty (shape {tuple(x.shape)})")
    if x.shape[1] == 0:
        raise ValueError(f"{name}: points have dimension 0 (shape {tuple(x.shape)})")
    check_finite(name, x.detach())
    return x


@dataclass(frozen=True)
class Options:
    """The options shared by :func:`gromov_wasserstein` and :func:`fused_gromov_wasserstein`."""

    reg: float
    loss_fun: str
    max_iter: int
    tol: float
    inner_max_iter: int
    inner_tol: float
    warmstart: bool
    backend: str
    verbose: bool
    G0: Any
    solver: str

    def checked(self) -> Options:
        """A copy with validated values (clear errors before any work)."""
        if self.loss_fun != "square_loss":
            raise ValueError(
                f"loss_fun: only 'square_loss' (|a - b|^2, POT's default) is supported, got {self.loss_fun!r}"
            )
        if self.solver != "PGD":
            raise ValueError(
                f"solver: only 'PGD' (POT's default: projected gradient / Sinkhorn steps), got {self.solver!r}"
            )
        if self.G0 is not None:
            raise NotImplementedError(
                "G0: a dense initial coupling is not supported (it would be n x m); the initial coupling is a b^T"
            )
        if not isinstance(self.backend, str):
            raise TypeError(f"backend: expected a string, got {type(self.backend).__name__}")
        return Options(
            check_positive("reg", self.reg),
            self.loss_fun,
            check_int("max_iter", self.max_iter),
            check_positive("tol", self.tol),
            check_int("inner_max_iter", self.inner_max_iter),
            check_positive("inner_tol", self.inner_tol),
            check_bool("warmstart", self.warmstart),
            self.backend,
            check_bool("verbose", self.verbose),
            None,
            self.solver,
        )


def check_inputs(
    X: ArrayLike,
    Y: ArrayLike,
    a: ArrayLike | None,
    b: ArrayLike | None,
    FX: ArrayLike | None,
    FY: ArrayLike | None,
    semirelaxed: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None, Tensor | None, bool]:
    """Validated ``(X, Y, a, b, FX, FY, is_np)`` (clear errors before any work); ``FX = FY = None`` for plain GW,
    ``b`` uniform when ``semirelaxed`` (no second marginal)."""
    is_np = isinstance(X, np.ndarray)
    if is_np != isinstance(Y, np.ndarray):
        raise TypeError("X and Y: give both as torch tensors or both as numpy arrays")
    X, Y = check_cloud("X", X), check_cloud("Y", Y)
    if X.dtype != Y.dtype:
        raise TypeError(f"X and Y: expected the same dtype, got {X.dtype} and {Y.dtype}")
    if X.device != Y.device:
        raise ValueError(f"X and Y: are on different devices ({X.device} and {Y.device})")
    Fx: Tensor | None = None  # the features, checked (None: plain GW)
    Fy: Tensor | None = None
    if FX is not None:
        if isinstance(FX, np.ndarray) != is_np or isinstance(FY, np.ndarray) != is_np:
            raise TypeError("FX and FY: give them as the points (torch tensors or numpy arrays)")
        Fx, Fy = FX, FY = check_cloud("FX", FX), check_cloud("FY", FY)
        if FX.shape[0] != X.shape[0] or FY.shape[0] != Y.shape[0]:
            raise ValueError(
                f"FX and FY: expected one feature vector per point ({X.shape[0]} and {Y.shape[0]}), "
                f"got shapes {tuple(FX.shape)} and {tuple(FY.shape)}"
            )
        if FX.shape[1] != FY.shape[1]:
            raise ValueError(
                f"FX and FY: the feature cost |FX_i - FY_j|^2 needs one feature dimension, got "
                f"{FX.shape[1]} and {FY.shape[1]}"
            )
        if FX.dtype != X.dtype or FY.dtype != X.dtype or FX.device != X.device or FY.device != X.device:
            raise TypeError(f"FX and FY: expected the dtype and device of X ({X.dtype}, {X.device})")
    a = check_weights("a", None if a is None else to_tensor("a", a, like=X), X, "X")
    if semirelaxed:  # the second marginal is free: uniform weights only centre Y
        b = torch.full((Y.shape[0],), 1.0 / Y.shape[0], dtype=Y.dtype, device=Y.device)
    else:
        b = check_weights("b", None if b is None else to_tensor("b", b, like=Y), Y, "Y")
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        raise NotImplementedError(
            "a, b: gradients of the GW value w.r.t. the weights are not implemented (only "
            "w.r.t. the points and features); detach the weights"
        )
    ma, mb = float(a.detach().double().sum()), float(b.detach().double().sum())
    if not semirelaxed and abs(ma - mb) > 1e-3 * max(ma, mb):
        raise ValueError(
            f"a and b: Gromov-Wasserstein couples measures of equal total mass, got {ma:.6g} and "
            f"{mb:.6g}; normalise the weights"
        )
    return X, Y, a, b, Fx, Fy, is_np


@dataclass(frozen=True)
class SROptions:
    """The options of the semi-relaxed solvers."""

    reg: float
    loss_fun: str
    max_iter: int
    tol: float
    backend: str
    verbose: bool
    G0: Any

    def checked(self) -> SROptions:
        """A copy with validated values (the checks of :class:`Options`)."""
        reg = Options(self.reg, self.loss_fun, 1, 1.0, 1, 1.0, True, self.backend, False, self.G0, "PGD").checked().reg
        return SROptions(
            reg,
            self.loss_fun,
            check_int("max_iter", self.max_iter),
            check_positive("tol", self.tol),
            self.backend,
            check_bool("verbose", self.verbose),
            None,
        )
