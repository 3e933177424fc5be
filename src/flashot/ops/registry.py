"""One registry of engines; ``backend="auto"`` picks by device and size.

Engines are registered by name with a loader, so optional engines (``triton``,
the compiled CPU engine) are imported only when used.  A loader that raises
:class:`EngineUnavailable` makes the engine unavailable with a reason; ``auto``
then falls back, and forcing it raises a clear error.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..costs import Cost
from .base import Engine

__all__ = ["EngineUnavailable", "register_engine", "get_engine", "engine_names", "DENSE_AUTO_LIMIT"]

# ``auto`` uses the dense engine when B * N * M is at most this (8 MiB of float32).
DENSE_AUTO_LIMIT = 2**21


class EngineUnavailable(RuntimeError):
    """An engine cannot run here (missing package, wrong device, ...)."""


_LOADERS: dict[str, Callable[[], Engine]] = {}
_CACHE: dict[str, Engine] = {}
# Order in which ``auto`` tries streaming engines, per device type.
_AUTO_ORDER: dict[str, list[str]] = {"cuda": ["triton", "tiled"], "cpu": ["cpu", "tiled"]}


def register_engine(name: str, loader: Callable[[], Engine]) -> None:
    """Register ``loader`` (called once, lazily) under ``name``."""
    _LOADERS[name] = loader
    _CACHE.pop(name, None)


def unregister_engine(name: str) -> None:
    """Remove an engine registered with :func:`register_engine` (no error if it is absent).

    The built-in engines (``dense``, ``tiled``, ``triton``, ``cpu``) cannot be removed."""
    if not isinstance(name, str):
        raise TypeError(f"unregister_engine: name must be a string, got {type(name).__name__}")
    if name in _BUILTIN:
        raise ValueError(f"unregister_engine: {name!r} is a built-in engine")
    _LOADERS.pop(name, None)
    _CACHE.pop(name, None)


def engine_names() -> list[str]:
    return sorted(_LOADERS)


def _load(name: str) -> Engine:
    if name not in _CACHE:
        _CACHE[name] = _LOADERS[name]()
    return _CACHE[name]


def _try(name: str, device: torch.device, dtype: torch.dtype, cost: Cost) -> tuple[Engine | None, str]:
    if name not in _LOADERS:
        return None, f"engine {name!r} is not registered"
    try:
        eng = _load(name)
    except EngineUnavailable as e:
        return None, str(e)
    why = eng.unsupported(device, dtype, cost)
    return (None, why) if why else (eng, "")


def get_engine(
    backend: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    cost: Cost,
    size: tuple[int, int, int, int] = (1, 1, 1, 1),
    allow_dense: bool = True,
) -> Engine:
    """Resolve ``backend`` (an engine name or ``"auto"``) for a (B, N, M, D) problem.

    ``allow_dense=False`` makes ``auto`` pick a streaming engine whatever the size.
    """
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a string, got {type(backend).__name__}")
    if backend != "auto":
        if backend not in _LOADERS:
            raise ValueError(f"backend: expected 'auto' or one of {engine_names()}, got {backend!r}")
        eng, why = _try(backend, device, dtype, cost)
        if eng is None:
            raise ValueError(f"backend={backend!r} cannot run this problem: {why}. "
                             f"Use backend='auto' or 'tiled'.")
        return eng
    B, N, M, D = size
    if allow_dense and B * N * M <= DENSE_AUTO_LIMIT:
        return _load("dense")
    for name in _AUTO_ORDER.get(device.type, ["tiled"]):
        eng, _ = _try(name, device, dtype, cost)
        if eng is not None:
            return eng
    return _load("tiled")


def _dense():
    from .dense import DenseEngine

    return DenseEngine()


def _tiled():
    from .tiled import TiledEngine

    return TiledEngine()


register_engine("dense", _dense)
register_engine("tiled", _tiled)


def _triton():
    try:
        from .triton import TritonEngine
    except ImportError as e:  # triton missing or broken
        raise EngineUnavailable(f"backend='triton' needs the triton package ({e}); use backend='tiled'") from e
    return TritonEngine()


register_engine("triton", _triton)


def _cpu():
    # Compiles the fused kernels at first use (cached on disk); degrades to the
    # ``tiled`` engine with a warning when no compiler is available.
    from .cpu import load_engine

    return load_engine()


register_engine("cpu", _cpu)

_BUILTIN = frozenset(_LOADERS)  # the engines registered above
