"""Built-in generated point clouds (no downloads)."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def two_moons_3d(
    n: int, m: int | None = None, *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor]:
    """A noisy helix (n points) and a noisy torus knot (m points) in the unit box, 3-D."""
    m = n if m is None else m
    gen = torch.Generator().manual_seed(seed)
    t = torch.rand(n, generator=gen) * 4 * math.pi
    x = torch.stack([0.3 * torch.cos(t), 0.3 * torch.sin(t), t / (4 * math.pi) - 0.5], -1)
    x = x + 0.03 * torch.randn(n, 3, generator=gen)
    s = torch.rand(m, generator=gen) * 2 * math.pi
    r = 0.3 + 0.1 * torch.cos(3 * s)
    y = torch.stack([r * torch.cos(2 * s), r * torch.sin(2 * s), 0.1 * torch.sin(3 * s)], -1)
    y = y + 0.03 * torch.randn(m, 3, generator=gen) + torch.tensor([0.2, 0.0, 0.1])
    return x.to(dtype), y.to(dtype)
