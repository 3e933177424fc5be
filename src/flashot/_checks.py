"""Input contract: every public entry point validates here, before heavy work.

Errors name the argument and what was expected.  Points become (B, N, D)
tensors and weights (B, N) tensors of one floating dtype on one device.

Exception types (``tests/frontends/test_bad_input.py`` holds the table of cases):

* ``TypeError``: an argument of the wrong kind: not a tensor / array, a tensor of a
  non-floating dtype (int, bool, complex) where real numbers are computed with, a string or
  ``bool`` where a number or an integer is expected, a non-string option name, points
  ``x`` and ``y`` of different dtypes.
* ``ValueError``: a value outside the contract: shapes and batch sizes, empty clouds,
  NaN / Inf, negative weights or a zero total mass, numbers out of range (``eps``,
  ``reg``, ``blur``, ``tol``, ``max_iter`` ...), unknown option names (backend, cost,
  method, weight), tensors on the ``meta`` device or on different devices, an engine that
  cannot run the problem, an ``eps`` the compute dtype cannot represent at this cost scale.
* ``NotImplementedError``: GeomLoss / POT options that flashot does not implement.
* ``MemoryError``: :meth:`~flashot.plan.LazyPlan.to_dense` above ``max_elems``.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any, Literal, overload

import numpy as np
import torch
from torch import Tensor

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def to_tensor(name: str, v: Any, *, like: Tensor | None = None) -> Tensor:
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


def check_dtype(name: str, t: Tensor, *, allow_int: bool = False) -> None:
    """``t`` holds real numbers: floating point (``allow_int``: integer and bool too, cast later)."""
    if t.is_floating_point():
        return
    if allow_int and not t.is_complex():
        return
    want = "a real-valued tensor" if allow_int else "a floating-point tensor"
    raise TypeError(f"{name}: expected {want}, got dtype {t.dtype}")


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
        raise ValueError(
            f"{xname} and {yname}: expected both (N, D) or both (B, N, D), got {tuple(x.shape)} and {tuple(y.shape)}"
        )
    if x.shape[-1] != y.shape[-1]:
        raise ValueError(f"{xname} and {yname}: point dimensions differ ({x.shape[-1]} vs {y.shape[-1]})")
    if x.dim() == 3 and x.shape[0] != y.shape[0]:
        raise ValueError(f"{xname} and {yname}: batch sizes differ ({x.shape[0]} vs {y.shape[0]})")
    if x.device != y.device:
        raise ValueError(f"{xname} and {yname}: on different devices ({x.device} vs {y.device})")
    if x.dtype != y.dtype:
        raise TypeError(f"{xname} and {yname}: different dtypes ({x.dtype} vs {y.dtype})")


@overload
def check_positive(name: str, v: object, *, allow_none: Literal[False] = False) -> float: ...
@overload
def check_positive(name: str, v: object, *, allow_none: bool) -> float | None: ...


def check_positive(name: str, v: object, *, allow_none: bool = False) -> float | None:
    """``v`` as a positive finite ``float`` (a number, not a ``bool``); None passes where ``allow_none``."""
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
        raise TypeError(f"{name}: expected a positive number, got {type(v).__name__}")
    out = float(v)
    if not math.isfinite(out) or out <= 0:
        raise ValueError(f"{name}: expected a positive finite number, got {out}")
    return out


def check_bool(name: str, v: object) -> bool:
    """A flag: ``bool`` (or numpy bool, or the integers 0 / 1); a string or None is an error, not truthy."""
    if isinstance(v, (bool, np.bool_)) or (isinstance(v, (int, np.integer)) and v in (0, 1)):
        return bool(v)
    raise TypeError(f"{name}: expected True or False, got {v!r}")


def check_choice(name: str, v: object, choices: Collection[str]) -> str:
    """One of the option names ``choices``: TypeError for a non-string, ValueError for an unknown one."""
    if not isinstance(v, str):
        raise TypeError(f"{name}: expected a string, one of {sorted(choices)}, got {type(v).__name__}")
    if v not in choices:
        raise ValueError(f"{name}: expected one of {sorted(choices)}, got {v!r}")
    return v


def check_power(name: str, v: float, p: int) -> float:
    """``v ** p`` (a temperature ``blur^p`` or a scale ``diameter^p``), positive and finite in float64."""
    try:
        out = float(v) ** p
    except OverflowError:
        out = math.inf
    if not (0 < out < math.inf):
        raise ValueError(
            f"{name}: {name}**{p} = {out:g} is not a positive finite float64 (got {name}={v!r}); "
            "rescale the points and this parameter together"
        )
    return out


def check_eps_scale(name: str, eps: float, cmax: float, dtype: torch.dtype) -> None:
    """The temperature ``eps`` (given as ``name``: eps, reg or blur) is usable in the compute ``dtype``:
    a normal number there, and ``cmax / eps`` (the largest cost over ``eps``) finite in it.  Below
    that ``C / eps`` is 0 / 0 or overflows and the outputs are NaN."""
    fi = torch.finfo(dtype)
    if eps < fi.tiny or not cmax / eps < fi.max:
        raise ValueError(
            f"{name}: eps = {eps:g} is too small for {dtype} at this cost scale (largest cost {cmax:.3g}, "
            f"largest cost / eps = {cmax / eps:.3g}; {dtype} needs eps >= {fi.tiny:.3g} and a ratio below "
            f"{fi.max:.3g}); use a larger {name}, float64, or rescale the points"
        )


@overload
def check_int(name: str, v: object, *, minimum: int = 1, allow_none: Literal[False] = False) -> int: ...
@overload
def check_int(name: str, v: object, *, minimum: int = 1, allow_none: bool) -> int | None: ...


def check_int(name: str, v: object, *, minimum: int = 1, allow_none: bool = False) -> int | None:
    """``v`` as an ``int`` (a Python or NumPy integer, not a ``bool``) of at least ``minimum``; None passes
    where ``allow_none`` (the overloads tell a type checker that it cannot come back otherwise)."""
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
