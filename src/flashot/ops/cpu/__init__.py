"""Compiled CPU engine (``backend="cpu"``): see :mod:`.engine` and :mod:`.build`."""

from __future__ import annotations

import warnings

__all__ = ["load_engine"]


def load_engine():
    """The ``cpu`` engine, or the ``tiled`` engine with a warning when the kernels cannot be built (no
    compiler and nothing prebuilt or cached, an unsafe cache directory). Each dtype's kernels are compiled at
    their first use (:class:`.build.Kernels`)."""
    from .build import BuildError, kernels

    try:
        lib = kernels("core")
    except (BuildError, OSError) as e:
        from ..tiled import TiledEngine

        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        warnings.warn(
            f"flashot: compiled CPU engine unavailable ({first[:300]}); using the 'tiled' engine",
            RuntimeWarning,
            stacklevel=2,
        )
        return TiledEngine()
    from .engine import CpuEngine

    return CpuEngine(lib)
