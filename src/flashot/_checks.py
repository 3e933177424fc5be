"""Input contract: every public entry point validates here, before heavy work.

Errors name the argument and what was expected.  Points become (B, N, D)
tensors and weights (B, N) tensors of one floating dtype on one device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def to_tensor(name: str, v, *, like: Tensor | None = None) -> Tensor:
    """Accept a torch tensor or a numpy array / sequence of numbers."""
    if isinstance(v, Tensor):
        return v
    if isinstance(v, np.ndarray):
        if v.dtype.kind not in "fiu":
            raise TypeError(f"{name}: expected a real-valued array, got dtype {v.dtype}")
        t = torch.from_numpy(np.ascontiguousarray(v))
        if not t.is_floating_point():
            t = t.to(like.dtype if like is not None else torch.float64)
        return t
    raise TypeError(f"{name}: expected a torch.Tensor or numpy.ndarray, got {type(v).__name__}")


def check_storage(name: str, t: Tensor) -> None:
    """A dense tensor with data: not on the ``meta`` device (shapes only), not sparse / non-strided."""
    if t.device.type == "meta":
        raise ValueError(f"{name}: is on the 'meta' device (a tensor without data); pass a CPU or CUDA tensor")
    if t.layout != torch.strided:
        raise ValueError(f"{name}: expected a dense (strided) tensor, got layout {t.layout}; call .to_dense()")


def check_finite(name: str, t: Tensor) -> None:
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name}: contains NaN or Inf values")


def check_points(name: str, x: Tensor) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOATS:
        raise TypeError(f"{name}: expected a floating-point tensor (float16/bfloat16/float32/float64), got {x.dtype}")
    check_storage(name, x)
    if x.dim() not in (2, 3):
        raise ValueError(f"{name}: expected shape (N, D) or (B, N, D), got {tuple(x.shape)}")
    if x.shape[-2] == 0:
        raise ValueError(f"{name}: the point cloud is empty (shape {tuple(x.shape)})")
    if x.shape[-1] == 0:
        raise ValueError(f"{name}: points have dimension 0 (shape {tuple(x.shape)})")
    if x.dim() == 3 and x.shape[0] == 0:
        raise ValueError(f"{name}: the batch is empty (shape {tuple(x.shape)})")
    check_finite(name, x.detach())
    return x


def check_weights(name: str, a: Tensor | None, x: Tensor, points_name: str) -> Tensor:
    """Weights matching points ``x`` ((N,) or (B, N)); ``None`` means uniform 1/N.

    Uniform weights are built in the compute dtype (:func:`compute_dtype`: float32 for
    float16/bfloat16 points): 1/N rounded to 8 or 11 significant bits would give two clouds
    different total masses (0.99975 vs 1.00021 for N=120, M=100), and no balanced solve converges.
    """
    lead = x.shape[:-1]
    if a is None:
        return torch.full(lead, 1.0 / lead[-1], dtype=compute_dtype(x.dtype), device=x.device)
    if not isinstance(a, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(a).__name__}")
    if a.dtype not in FLOATS:
        raise TypeError(f"{name}: expected a floating-point tensor, got {a.dtype}")
    check_storage(name, a)
    if a.device != x.device:
        raise ValueError(f"{name}: is on {a.device} but {points_name} is on {x.device}")
    if a.shape != lead:
        if a.dim() == len(lead) + 1 and a.shape[-1] == 1 and a.shape[:-1] == lead:
            a = a.squeeze(-1)
        else:
            raise ValueError(
                f"{name}: expected shape {tuple(lead)} to match {points_name} {tuple(x.shape)}, got {tuple(a.shape)}"
            )
    ad = a.detach()
    check_finite(name, ad)
    if bool((ad < 0).any()):
        raise ValueError(f"{name}: weights must be non-negative")
    if bool((ad.sum(-1) <= 0).any()):
        raise ValueError(f"{name}: total mass must be positive (got a measure of zero mass)")
    return a


def check_pair(x: Tensor, y: Tensor, xname: str = "x", yname: str = "y") -> None:
    if x.dim() != y.dim():
        raise ValueError(f"{xname} and {yname}: expected both (N, D) or both (B, N, D), got {tuple(x.shape)} and {tuple(y.shape)}")
    if x.shape[-1] != y.shape[-1]:
        raise ValueError(f"{xname} and {yname}: point dimensions differ ({x.shape[-1]} vs {y.shape[-1]})")
    if x.dim() == 3 and x.shape[0] != y.shape[0]:
        raise ValueError(f"{xname} and {yname}: batch sizes differ ({x.shape[0]} vs {y.shape[0]})")
    if x.device != y.device:
        raise ValueError(f"{xname} and {yname}: on different devices ({x.device} vs {y.device})")
    if x.dtype != y.dtype:
        raise TypeError(f"{xname} and {yname}: different dtypes ({x.dtype} vs {y.dtype})")


def check_positive(name: str, v, *, allow_none: bool = False) -> float | None:
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
        raise TypeError(f"{name}: expected a positive number, got {type(v).__name__}")
    v = float(v)
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name}: expected a positive finite number, got {v}")
    return v


def check_int(name: str, v, *, minimum: int = 1, allow_none: bool = False) -> int | None:
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name}: expected an integer, got {type(v).__name__}")
    if v < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {v}")
    return int(v)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float16/bfloat16 are computed in float32."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
