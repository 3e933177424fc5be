"""Block-size configurations: a small fixed candidate list, autotuning, pinning.

* Pinning: ``TritonEngine(config="BLOCK_N=64,BLOCK_M=64,num_warps=4")`` or the
  environment variable ``FLASHOT_TRITON_CONFIG`` (same syntax; the constructor
  argument wins).  Pinned configs skip autotuning (for benchmarks).
* Under ``TRITON_INTERPRET=1`` one small config is used and nothing is timed.
* Otherwise the first launch for a key ``(kernel, pow2 bucket of n, pow2 bucket
  of m, d, dtype, path)`` times every candidate once (after a compile run) and
  caches the fastest; the candidate lists have 4 entries so first use stays short.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["KernelConfig", "parse_config", "pinned_config", "candidates", "INTERPRET_CONFIG", "interpret_enabled"]

ENV_CONFIG = "FLASHOT_TRITON_CONFIG"
_KEYS = {"BLOCK_N": "block_n", "BLOCK_M": "block_m", "num_warps": "num_warps", "num_stages": "num_stages"}


@dataclass(frozen=True)
class KernelConfig:
    """Row tile ``block_n``, streamed column tile ``block_m`` and launch options."""

    block_n: int = 64
    block_m: int = 64
    num_warps: int = 8
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_n", "block_m"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 16 or v & (v - 1):
                raise ValueError(f"{name.upper()}: expected a power of two >= 16 (tl.dot needs 16), got {v!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps: expected 1, 2, 4, 8 or 16, got {self.num_warps!r}")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"num_stages: expected 1..8, got {self.num_stages!r}")

    def __str__(self) -> str:
        return f"BLOCK_N={self.block_n},BLOCK_M={self.block_m},num_warps={self.num_warps},num_stages={self.num_stages}"


def parse_config(spec: str | KernelConfig) -> KernelConfig:
    """``"BLOCK_N=64,BLOCK_M=64,num_warps=4[,num_stages=2]"`` -> :class:`KernelConfig`."""
    if isinstance(spec, KernelConfig):
        return spec
    if not isinstance(spec, str):
        raise TypeError(
            f"config: expected a string like 'BLOCK_N=64,BLOCK_M=64,num_warps=4', got {type(spec).__name__}"
        )
    kw: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, val = part.partition("=")
        key = key.strip()
        if not sep or key not in _KEYS:
            raise ValueError(f"config: cannot parse {part!r} in {spec!r}; expected keys {sorted(_KEYS)}")
        try:
            kw[_KEYS[key]] = int(val)
        except ValueError:
            raise ValueError(f"config: {key} must be an integer, got {val!r}") from None
    return KernelConfig(**kw)


def pinned_config() -> KernelConfig | None:
    """The config pinned by ``FLASHOT_TRITON_CONFIG``, if any (read at call time)."""
    spec = os.environ.get(ENV_CONFIG, "").strip()
    return parse_config(spec) if spec else None


def interpret_enabled() -> bool:
    """True when ``TRITON_INTERPRET`` asks for the CPU interpreter (read at call time)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


# One small config for the interpreter: 32 x 32 tiles keep numpy overhead low
# while test sizes (<= 70) still span several ragged tiles.
INTERPRET_CONFIG = KernelConfig(32, 32, 4, 1)

# Candidates chosen from an offline sm_90 compile (ptxas register / spill report,
# no GPU run): every entry compiles without register spills for its path in
# float32 strict mode for the softmin kernel, except (128, 64, 8) on the d = 64
# dot path (152 B stack), kept because it may still win.  Larger tiles (128 x 128,
# or 64 x 64 with 4 warps on the dot path) spill hundreds of bytes: left out.
_DIRECT = [
    KernelConfig(64, 64, 8, 2),
    KernelConfig(128, 64, 8, 2),
    KernelConfig(32, 64, 4, 2),
    KernelConfig(64, 32, 4, 2),
]
_DOT_SMALL = [
    KernelConfig(64, 64, 8, 2),
    KernelConfig(64, 32, 4, 2),
    KernelConfig(32, 64, 4, 2),
    KernelConfig(128, 64, 8, 2),
]
# The plan-product kernel also holds a (BLOCK_N, 32) accumulator: on the one-chunk
# dot path only these two stay spill-free.
_DOT_SMALL_PLAN = [KernelConfig(64, 64, 8, 2), KernelConfig(64, 32, 4, 2)]
_DOT_LARGE = [
    KernelConfig(64, 64, 8, 2),
    KernelConfig(128, 64, 8, 2),
    KernelConfig(32, 64, 4, 2),
    KernelConfig(64, 32, 4, 2),
]


def candidates(d: int, direct: bool, plan: bool = False) -> list[KernelConfig]:
    """The fixed candidate list for dimension ``d`` on the given score path and kernel."""
    if direct:
        return list(_DIRECT)
    if d <= 64:
        return list(_DOT_SMALL_PLAN if plan else _DOT_SMALL)
    return list(_DOT_LARGE)
