"""Generated benchmark problems: the same points for every solver.

A problem is two clouds of ``n`` and ``m`` points drawn uniformly in the unit
cube ``[0, 1]^d`` (numpy ``default_rng(seed)``, x first then y), uniform
weights, cost ``C(x, y) = |x - y|^2`` and temperature ``eps``.  Every solver
process regenerates the points from the seed, so all of them see identical data.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

DTYPES = ("float32", "float64")


@dataclass(frozen=True)
class Problem:
    n: int
    m: int
    d: int
    dtype: str = "float32"
    eps: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        for k in ("n", "m", "d"):
            v = getattr(self, k)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{k}: expected a positive integer, got {v!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {DTYPES}, got {self.dtype!r}")
        if not self.eps > 0:
            raise ValueError(f"eps: expected a positive number, got {self.eps!r}")

    @property
    def pairs(self) -> int:
        return self.n * self.m

    def points(self) -> tuple[np.ndarray, np.ndarray]:
        """(x, y) as C-contiguous numpy arrays of ``dtype``."""
        rng = np.random.default_rng(self.seed)
        x = rng.random((self.n, self.d), dtype=np.float64).astype(self.dtype)
        y = rng.random((self.m, self.d), dtype=np.float64).astype(self.dtype)
        return x, y

    def weights(self) -> tuple[np.ndarray, np.ndarray]:
        return np.full(self.n, 1.0 / self.n, dtype=self.dtype), np.full(self.m, 1.0 / self.m, dtype=self.dtype)

    def to_dict(self) -> dict:
        return asdict(self)

    def label(self) -> str:
        nm = f"n={self.n:,}" if self.n == self.m else f"n={self.n:,} m={self.m:,}"
        return f"{nm} d={self.d} {self.dtype} eps={self.eps:g}"


def ot_value(a: np.ndarray, b: np.ndarray, f: np.ndarray, g: np.ndarray) -> float:
    """``<a, f> + <b, g>`` in float64 (the dual value every solver is compared on)."""
    return float(
        np.dot(np.asarray(a, np.float64), np.asarray(f, np.float64))
        + np.dot(np.asarray(b, np.float64), np.asarray(g, np.float64))
    )
