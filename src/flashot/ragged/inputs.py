"""A ragged batch's input: lists of clouds, or concatenated clouds with PyTorch Geometric batch vectors, checked
before any work and turned into concatenated points with the offsets of each problem (:class:`RaggedLayout`).

Errors name the argument: ``x[3]`` for the fourth cloud of a list, ``x_batch`` for a batch vector.  Shapes,
lengths, empty clouds and batch vectors raise ``ValueError``; a wrong kind of argument ``TypeError``
(:mod:`flashot._checks`' contract).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
from torch import Tensor

from .._checks import FLOATS, check_storage, check_weights, to_tensor

__all__ = ["RaggedLayout", "RaggedInput", "ragged_input", "is_ragged_call"]


@dataclass(frozen=True, eq=False)
class RaggedLayout:
    """``B`` problems laid end to end: problem ``k`` owns the points ``[x_offsets[k], x_offsets[k + 1])`` of the
    concatenated ``x`` and ``[y_offsets[k], y_offsets[k + 1])`` of ``y`` ((B + 1,) int64, on the CPU)."""

    x_offsets: Tensor
    y_offsets: Tensor

    @property
    def B(self) -> int:
        return self.x_offsets.numel() - 1

    def offsets(self, side: str) -> Tensor:
        return self.x_offsets if side == "x" else self.y_offsets

    def sizes(self, side: str) -> Tensor:
        o = self.offsets(side)
        return o[1:] - o[:-1]

    @cached_property
    def _ids(self) -> dict:
        return {}

    def ids(self, side: str, device: torch.device) -> Tensor:
        """(N,) the problem of each point of ``side`` (``"x"`` or ``"y"``), on ``device`` (cached)."""
        key = (side, str(device))
        if key not in self._ids:
            self._ids[key] = torch.repeat_interleave(torch.arange(self.B), self.sizes(side)).to(device)
        return self._ids[key]

    def sum(self, t: Tensor, side: str) -> Tensor:
        """(B,) sums of the per-point values ``t`` ((N,) or (1, N)) over each problem's points; differentiable."""
        t = t.reshape(-1)
        return torch.zeros(self.B, dtype=t.dtype, device=t.device).index_add(0, self.ids(side, t.device), t)

    def amax(self, t: Tensor, side: str) -> Tensor:
        """(B,) maxima of the per-point values ``t`` ((N,) or (1, N)) over each problem's points."""
        t = t.reshape(-1)
        out = torch.full((self.B,), -torch.inf, dtype=t.dtype, device=t.device)
        return out.scatter_reduce(0, self.ids(side, t.device), t, "amax")

    def split(self, t: Tensor, side: str) -> list[Tensor]:
        """The per-point tensor ``t`` ((N, ...)) cut into the problems' pieces."""
        return list(torch.split(t, self.sizes(side).tolist()))


@dataclass(frozen=True, eq=False)
class RaggedInput:
    """Concatenated points ``x`` (N, D), ``y`` (M, D) (autograd history kept), weights (None: uniform within
    each problem), the layout, and whether the clouds came as lists (outputs then come back as lists)."""

    x: Tensor
    y: Tensor
    a: Tensor | None
    b: Tensor | None
    layout: RaggedLayout
    lists: bool


def is_ragged_call(args: tuple, x_batch=None, y_batch=None) -> bool:
    """Whether a front end's positional ``args`` (``(x, y)`` / ``(a, x, b, y)``) or batch vectors ask for a ragged
    batch: a list / tuple whose first item is a tensor or an array (a list of clouds; a nested list of numbers is
    not one), or ``x_batch`` / ``y_batch`` given."""
    if x_batch is not None or y_batch is not None:
        return True
    return any(isinstance(v, (list, tuple)) and len(v) > 0 and isinstance(v[0], (Tensor, np.ndarray)) for v in args)


def _offsets(sizes: list[int]) -> Tensor:
    out = torch.zeros(len(sizes) + 1, dtype=torch.long)
    out[1:] = torch.cumsum(torch.as_tensor(sizes, dtype=torch.long), 0)
    return out


def _cloud(name: str, v, ref: Tensor | None, ref_name: str) -> Tensor:
    """One cloud of a list: a floating (N, D) tensor (numpy accepted), N >= 1, the dimension, dtype and device of
    the first cloud ``ref``."""
    t = to_tensor(name, v)
    if t.dtype not in FLOATS:
        raise TypeError(f"{name}: expected a floating-point tensor (float16/bfloat16/float32/float64), got {t.dtype}")
    check_storage(name, t)
    if t.dim() != 2:
        raise ValueError(f"{name}: expected one cloud of shape (N, D) per problem, got shape {tuple(t.shape)}")
    if t.shape[0] == 0:
        raise ValueError(f"{name}: the point cloud is empty (shape {tuple(t.shape)}); every problem needs points")
    if t.shape[1] == 0:
        raise ValueError(f"{name}: points have dimension 0 (shape {tuple(t.shape)})")
    if ref is not None:
        if t.shape[1] != ref.shape[1]:
            raise ValueError(f"{name}: points of dimension {t.shape[1]}, but {ref_name} has dimension {ref.shape[1]}")
        if t.device != ref.device:
            raise ValueError(f"{name}: is on {t.device} but {ref_name} is on {ref.device}")
        if t.dtype != ref.dtype:
            raise TypeError(f"{name}: dtype {t.dtype} differs from {ref_name}'s ({ref.dtype})")
    return t


def _finite(name: str, x: Tensor, layout: RaggedLayout, side: str, lists: bool) -> None:
    bad = ~torch.isfinite(x.detach()).all(-1)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        k = int(layout.ids(side, torch.device("cpu"))[i]) if lists else None
        raise ValueError(f"{name}[{k}]: contains NaN or Inf values" if lists else f"{name}: contains NaN or Inf values")


def _from_lists(a, xs, b, ys, names) -> RaggedInput:
    an, xn, bn, yn = names
    for n, v in ((xn, xs), (yn, ys)):
        if not isinstance(v, (list, tuple)):
            raise TypeError(
                f"{n}: a ragged batch takes lists of clouds for both {xn} and {yn}, got {type(v).__name__} for {n}"
            )
    if len(xs) == 0:
        raise ValueError(f"{xn}: the list of clouds is empty")
    if len(ys) != len(xs):
        raise ValueError(f"{yn}: expected {len(xs)} clouds (one per cloud of {xn}), got {len(ys)}")
    x0 = _cloud(f"{xn}[0]", xs[0], None, "")
    xs = [x0] + [_cloud(f"{xn}[{k}]", v, x0, f"{xn}[0]") for k, v in enumerate(xs) if k > 0]
    ys = [_cloud(f"{yn}[{k}]", v, x0, f"{xn}[0]") for k, v in enumerate(ys)]
    layout = RaggedLayout(_offsets([len(v) for v in xs]), _offsets([len(v) for v in ys]))
    ws = []
    for wn, w, pts, pn in ((an, a, xs, xn), (bn, b, ys, yn)):
        if w is None:
            ws.append(None)
            continue
        if not isinstance(w, (list, tuple)):
            raise TypeError(
                f"{wn}: with lists of clouds, give the weights as a list too (or None), got {type(w).__name__}"
            )
        if len(w) != len(pts):
            raise ValueError(f"{wn}: expected {len(pts)} weight vectors (one per cloud of {pn}), got {len(w)}")
        ws.append(
            torch.cat(
                [
                    check_weights(f"{wn}[{k}]", to_tensor(f"{wn}[{k}]", v, like=p), p, f"{pn}[{k}]").reshape(-1)
                    for k, (v, p) in enumerate(zip(w, pts))
                ]
            )
        )
    x, y = torch.cat(xs), torch.cat(ys)
    _finite(xn, x, layout, "x", True)
    _finite(yn, y, layout, "y", True)
    return RaggedInput(x, y, ws[0], ws[1], layout, True)


def _batch_vector(name: str, v, n: int, pts_name: str) -> Tensor:
    """A PyTorch Geometric batch vector: (n,) integers, sorted, non-negative (on the CPU on return)."""
    if not isinstance(v, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor of problem indices, got {type(v).__name__}")
    if v.is_floating_point() or v.is_complex() or v.dtype == torch.bool:
        raise TypeError(f"{name}: expected an integer tensor of problem indices, got {v.dtype}")
    if tuple(v.shape) != (n,):
        raise ValueError(
            f"{name}: expected shape ({n},) (one problem index per point of {pts_name}), got {tuple(v.shape)}"
        )
    v = v.detach().cpu().long()
    if n and int(v.min()) < 0:
        raise ValueError(f"{name}: problem indices must be >= 0, got {int(v.min())}")
    if n > 1 and bool((v[1:] < v[:-1]).any()):
        i = int((v[1:] < v[:-1]).nonzero()[0, 0])
        raise ValueError(
            f"{name}: must be sorted (the points of each problem contiguous, as torch_geometric's "
            f"batch vectors), but entry {i + 1} ({int(v[i + 1])}) follows {int(v[i])}"
        )
    return v


def _from_batch(a, x, b, y, x_batch, y_batch, names) -> RaggedInput:
    an, xn, bn, yn = names
    for n, v in (("x_batch", x_batch), ("y_batch", y_batch)):
        if v is None:
            raise ValueError(f"{n}: missing; give both x_batch and y_batch (PyTorch Geometric batch vectors)")
    for n, v in ((xn, x), (yn, y)):
        if isinstance(v, (list, tuple)):
            raise TypeError(f"{n}: with x_batch / y_batch, pass the concatenated points as one (N, D) tensor")
    x = _cloud(xn, x, None, "")
    y = _cloud(yn, y, x, xn)
    bx = _batch_vector("x_batch", x_batch, x.shape[0], xn)
    by = _batch_vector("y_batch", y_batch, y.shape[0], yn)
    B = max(int(bx[-1]), int(by[-1])) + 1
    cx, cy = torch.bincount(bx, minlength=B), torch.bincount(by, minlength=B)
    for n, c, other in (("x_batch", cx, "y_batch"), ("y_batch", cy, "x_batch")):
        if bool((c == 0).any()):
            k = int((c == 0).nonzero()[0, 0])
            raise ValueError(
                f"{n}: problem {k} has no points (the indices run 0..{B - 1} over x_batch and y_batch "
                f"together, and every problem needs points on both sides; out of range of {other}?)"
            )
    layout = RaggedLayout(_offsets(cx.tolist()), _offsets(cy.tolist()))
    ws = []
    for wn, w, pts, pn, side in ((an, a, x, xn, "x"), (bn, b, y, yn, "y")):
        if w is None:
            ws.append(None)
            continue
        w = check_weights(wn, to_tensor(wn, w, like=pts), pts, pn)
        if bool((layout.sum(w.detach().double(), side) <= 0).any()):
            k = int((layout.sum(w.detach().double(), side) <= 0).nonzero()[0, 0])
            raise ValueError(f"{wn}: problem {k} has total mass 0 (every problem needs a positive mass)")
        ws.append(w)
    _finite(xn, x, layout, "x", False)
    _finite(yn, y, layout, "y", False)
    return RaggedInput(x, y, ws[0], ws[1], layout, False)


def ragged_input(a, x, b, y, *, x_batch=None, y_batch=None, names=("a", "x", "b", "y")) -> RaggedInput:
    """Check a ragged batch and lay it out: lists of clouds ``x[k]`` (N_k, D), ``y[k]`` (M_k, D) with optional
    lists of weights, or (x_batch / y_batch given) concatenated (N, D), (M, D) points with sorted problem indices
    (PyTorch Geometric's convention) and optional (N,), (M,) weights.  ``names``: the front end's names of
    ``(a, x, b, y)``."""
    if x_batch is None and y_batch is None:
        return _from_lists(a, x, b, y, names)
    return _from_batch(a, x, b, y, x_batch, y_batch, names)
