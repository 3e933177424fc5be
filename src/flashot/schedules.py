"""Temperature (epsilon) schedules.

GeomLoss' epsilon-scaling: ``eps`` goes from ``diameter^p`` down to ``blur^p``
geometrically with ratio ``scaling^p``; the listed values are all visited once
and a final extrapolation step at ``blur^p`` follows (see :mod:`flashot.solver`).
"""

from __future__ import annotations

import math

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
