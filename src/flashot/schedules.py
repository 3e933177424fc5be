"""Temperature (epsilon) schedules.

GeomLoss' epsilon-scaling: ``eps`` goes from ``diameter^p`` down to ``blur^p``
geometrically with ratio ``scaling^p``; the listed values are all visited once
and a final extrapolation step at ``blur^p`` follows (see :mod:`flashot.solver`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import overload

import numpy as np
import torch
from torch import Tensor


def max_diameter(x: Tensor, y: Tensor) -> float:
    """Diagonal of the joint bounding box of both clouds (all batches together)."""
    D = x.shape[-1]
    xs, ys = x.detach().reshape(-1, D), y.detach().reshape(-1, D)
    lo = torch.minimum(xs.amin(0), ys.amin(0))
    hi = torch.maximum(xs.amax(0), ys.amax(0))
    return float((hi - lo).double().norm())


def epsilon_scaling(p: int, diameter: float, blur: float, scaling: float) -> list[float]:
    """``[diameter^p, ..., blur^p]`` with log-spacing ``p log(scaling)`` (GeomLoss' schedule)."""
    logs = np.arange(p * math.log(diameter), p * math.log(blur), p * math.log(scaling))
    return [diameter**p] + [float(np.exp(e)) for e in logs] + [blur**p]


class Schedule(Sequence[float]):
    """``head + [value] * (n - len(head))`` without the list (``n`` may be large): an epsilon-scaling
    ``head`` (possibly empty), then iterations at the final temperature ``value`` until ``n``
    entries (the loop stops earlier once a tolerance is met)."""

    def __init__(self, value: float, n: int, head: Sequence[float] = ()):
        self.value, self.n, self.head = value, n, list(head)[: max(n - 1, 0)]

    def __len__(self) -> int:
        return self.n

    @overload
    def __getitem__(self, i: int) -> float: ...
    @overload
    def __getitem__(self, i: slice) -> list[float]: ...

    def __getitem__(self, i: int | slice) -> float | list[float]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(self.n))]
        if not -self.n <= i < self.n:
            raise IndexError(i)
        i = i % self.n
        return self.head[i] if i < len(self.head) else self.value


def continued(eps_list: Sequence[float], max_iter: int) -> Schedule:
    """``eps_list`` followed by at most ``max_iter`` more iterations at its last temperature."""
    return Schedule(eps_list[-1], len(eps_list) + max_iter, list(eps_list)[:-1])
