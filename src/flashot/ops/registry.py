"""One registry of engines; ``backend="auto"`` picks by device and size.

Engines are registered by name with a loader, so optional engines (``triton``,
the compiled CPU engine) are imported only when used.  A loader that raises
:class:`EngineUnavailable` makes the engine unavailable with a reason; ``auto``
then falls back, and forcing it raises a clear error.

``auto`` on CPU tensors picks the faster engine by size: ``dense`` for tiny problems, then the
``cpu`` engine (when built; float32 / float64 and its costs), else ``tiled``.  The reason is a
fixed cost per call: the cpu engine's thread team costs ~0.05 ms per call with two threads, which
one dense matrix of a tiny problem beats, while above that the compiled streaming kernels win by a
margin that grows with N M.  The fixed cost depends on the thread count, so the crossover does:

* one thread: ``dense`` only for B N M <= 32^2 and d < 16 (at d >= 16 the cpu engine works from a
  cached cost matrix and wins at every size);
* more threads: ``dense`` for B N M <= 128^2, ``cpu`` above.

Without the cpu engine (no compiler, other costs): ``dense`` up to B N M = 128^2 (where it beats
``tiled`` by 5-30%), ``tiled`` above.  The limits are crossovers measured with ``benchmarks/auto_crossover.py`` (one softmin,
and a full ``SamplesLoss`` value and gradient, float32 and float64, d = 1..64, N = M = 8..4096;
the figures are in ``benchmarks/AUTO_CROSSOVER.md``).  Re-run it after changing an engine's
per-call cost or threading: it moves these limits.

Other devices keep ``dense`` up to ``DENSE_AUTO_LIMIT`` (a crossover not yet measured on a GPU),
then ``triton`` / ``tiled``.

Memory: ``auto`` never picks ``dense`` for a (B, N, M) matrix above the dense engine's budget
(``FLASHOT_DENSE_MAX_BYTES``, :func:`~flashot.ops.dense.dense_max_bytes`), and a forced
``backend="dense"`` above it raises :class:`~flashot.ops.dense.DenseBudgetError` here, before any
work (the engine checks again before each matrix, e.g. the N x N debiasing terms).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..costs import CostLike
from .base import Engine, as_engine
from .dense import check_dense_budget, dense_bytes, dense_max_bytes

__all__ = [
    "EngineUnavailable",
    "register_engine",
    "get_engine",
    "engine_names",
    "DENSE_AUTO_LIMIT",
    "CPU_DENSE_LIMIT",
    "CPU_DENSE_LIMIT_1T",
    "CPU_DENSE_MAX_D_1T",
]

# ``auto`` on non-CPU devices uses the dense engine when B * N * M is at most this (8 MiB of float32).
DENSE_AUTO_LIMIT = 2**21
# ``auto`` on CPU tensors (measured crossovers, see the module docstring): dense when
# B * N * M <= CPU_DENSE_LIMIT, or, when torch runs one thread, only when B * N * M <=
# CPU_DENSE_LIMIT_1T and d < CPU_DENSE_MAX_D_1T; then the cpu engine (tiled without it).
CPU_DENSE_LIMIT = 128 * 128
CPU_DENSE_LIMIT_1T = 32 * 32
CPU_DENSE_MAX_D_1T = 16


class EngineUnavailable(RuntimeError):
    """An engine cannot run here (missing package, wrong device, ...).

    Raised by an engine's loader (:func:`register_engine`) when it cannot compute its primitives,
    ``softmin``: ``out_i = -eps log sum_j exp(h_j - C(x_i, y_j) / eps)`` and ``plan_product``:
    ``out_i = sum_j exp(alpha_i + beta_j - C(x_i, y_j) / eps) W_ij V_j``, on this machine.
    ``backend="auto"`` then skips the engine; asking for it by name raises ``ValueError`` with
    the loader's reason.

    Example:
        >>> import torch, flashot
        >>> from flashot import ops
        >>> def loader():
        ...     raise ops.EngineUnavailable("needs a GPU")
        >>> ops.register_engine("gpu_only", loader)
        >>> ops.get_engine("gpu_only", device=torch.device("cpu"), dtype=torch.float32,
        ...                cost=flashot.get_cost("sqeuclidean"))
        Traceback (most recent call last):
        ...
        ValueError: backend='gpu_only' cannot run this problem: needs a GPU. Use backend='auto' or 'tiled'.
        >>> ops.unregister_engine("gpu_only")
    """


_LOADERS: dict[str, Callable[[], Engine]] = {}
_CACHE: dict[str, Engine] = {}
# Order in which ``auto`` tries streaming engines, per device type.
_AUTO_ORDER: dict[str, list[str]] = {"cuda": ["triton", "tiled"]}


def register_engine(name: str, loader: Callable[[], Engine]) -> None:
    """Register ``loader`` (called once, lazily) under ``name``.

    ``loader()`` returns an engine: an object whose ``softmin`` computes
    ``out_i = -eps log sum_j exp(h_j - C(x_i, y_j) / eps)`` and whose ``plan_product`` computes
    ``out_i = sum_j exp(alpha_i + beta_j - C(x_i, y_j) / eps) W_ij V_j`` on batched (B, N, D)
    inputs (contract: :mod:`flashot.ops.base`), or raises :class:`EngineUnavailable`.  The name is
    then accepted as ``backend=`` everywhere; registering a name again replaces its loader.

    Fused steps (``softmin_pair``, ``softmin_sym``, ...) are used only when the engine subclasses
    :class:`~flashot.ops.Engine` and declares them in ``capabilities`` (:class:`~flashot.ops.Capability`).
    Any other object is wrapped in a :class:`~flashot.ops.base.ForeignEngine` that declares none: its two
    primitives (and its ``unsupported(device, dtype, cost)``, when it has one) are all that is called.

    Example:
        >>> import torch, flashot
        >>> from flashot import ops
        >>> cost = flashot.get_cost("sqeuclidean")
        >>> dense = ops.get_engine("dense", device=torch.device("cpu"), dtype=torch.float64, cost=cost)
        >>> ops.register_engine("my_engine", lambda: dense)  # e.g. a wrapper that counts calls
        >>> x, y = torch.randn(5, 2, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
        >>> h = torch.zeros(6, dtype=torch.float64)
        >>> bool(torch.equal(ops.softmin(x, y, h, 0.5, backend="my_engine"),
        ...                  ops.softmin(x, y, h, 0.5, backend="dense")))
        True
        >>> ops.unregister_engine("my_engine")
    """
    _LOADERS[name] = loader
    _CACHE.pop(name, None)


def unregister_engine(name: str) -> None:
    """Remove an engine registered with :func:`register_engine` (no error if it is absent).

    The built-in engines (``dense``, ``tiled``, ``triton``, ``cpu``) cannot be removed.

    Afterwards ``backend=name`` raises ``ValueError`` (the engine's ``softmin`` and
    ``plan_product``, ``out_i = -eps log sum_j exp(h_j - C_ij / eps)`` and
    ``out_i = sum_j exp(alpha_i + beta_j - C_ij / eps) W_ij V_j``, are no longer reachable).

    Example:
        >>> import torch, flashot
        >>> from flashot import ops
        >>> cost = flashot.get_cost("sqeuclidean")
        >>> ops.register_engine("tmp", lambda: ops.get_engine("tiled", device=torch.device("cpu"),
        ...                                                    dtype=torch.float32, cost=cost))
        >>> "tmp" in ops.engine_names()
        True
        >>> ops.unregister_engine("tmp"); ops.unregister_engine("tmp")  # absent: no error
        >>> "tmp" in ops.engine_names()
        False
    """
    if not isinstance(name, str):
        raise TypeError(f"unregister_engine: name must be a string, got {type(name).__name__}")
    if name in _BUILTIN:
        raise ValueError(f"unregister_engine: {name!r} is a built-in engine")
    _LOADERS.pop(name, None)
    _CACHE.pop(name, None)


def engine_names() -> list[str]:
    """The names accepted as ``backend=`` besides ``"auto"``, sorted: the built-in engines
    (``cpu``, ``dense``, ``tiled``, ``triton``, whether or not they can run here) and those added
    with :func:`register_engine`.

    Each names an implementation of the same two primitives,
    ``softmin``: ``out_i = -eps log sum_j exp(h_j - C(x_i, y_j) / eps)`` and ``plan_product``:
    ``out_i = sum_j exp(alpha_i + beta_j - C(x_i, y_j) / eps) W_ij V_j``.

    Example:
        >>> from flashot import ops
        >>> {"cpu", "dense", "tiled", "triton"} <= set(ops.engine_names())
        True
    """
    return sorted(_LOADERS)


def _load(name: str) -> Engine:
    if name not in _CACHE:
        _CACHE[name] = as_engine(_LOADERS[name]())  # a user's object without the base class: no capability
    return _CACHE[name]


def _try(name: str, device: torch.device, dtype: torch.dtype, cost: CostLike) -> tuple[Engine | None, str]:
    if name not in _LOADERS:
        return None, f"engine {name!r} is not registered"
    try:
        eng = _load(name)
    except EngineUnavailable as e:
        return None, str(e)
    if getattr(cost, "labelled", False) and name not in ("dense", "tiled"):
        # dense and tiled compute a label-augmented cost's tiles; the others run one squared-Euclidean
        # pass per row class with the label term as a column bias (ops/labels.py)
        from .labels import adapt_labels

        eng = adapt_labels(eng)
    why = eng.unsupported(device, dtype, cost)
    if why and getattr(cost, "bilinear", False):
        # no native kernels for a feature-bilinear cost: run it as sqeuclidean + offsets (ops/bilinear.py)
        from .bilinear import adapt

        eng = adapt(eng)
        why = eng.unsupported(device, dtype, cost)
    return (None, why) if why else (eng, "")


def get_engine(
    backend: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    cost: CostLike,
    size: tuple[int, int, int, int] = (1, 1, 1, 1),
    allow_dense: bool = True,
) -> Engine:
    """Resolve ``backend`` (an engine name or ``"auto"``) for a (B, N, M, D) problem.

    ``allow_dense=False`` makes ``auto`` pick a streaming engine whatever the size.

    The engine returned computes ``softmin``: ``out_i = -eps log sum_j exp(h_j - C(x_i, y_j) / eps)``
    and ``plan_product``: ``out_i = sum_j exp(alpha_i + beta_j - C(x_i, y_j) / eps) W_ij V_j``
    for the ``cost`` ``C`` (:class:`~flashot.Cost`) on batched inputs; ``auto`` picks by device
    and size (``dense`` for small ``B N M``, see :mod:`flashot.ops.registry`).

    Example:
        >>> import torch, flashot
        >>> from flashot import ops
        >>> cost = flashot.get_cost("sqeuclidean")
        >>> cpu = torch.device("cpu")
        >>> ops.get_engine("auto", device=cpu, dtype=torch.float32, cost=cost, size=(1, 10, 10, 2)).name
        'dense'
        >>> eng = ops.get_engine("auto", device=cpu, dtype=torch.float32, cost=cost, size=(1, 10, 10, 2),
        ...                      allow_dense=False)
        >>> eng.name in ("cpu", "tiled")  # cpu when its kernels are built
        True
    """
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a string, got {type(backend).__name__}")
    B, N, M, D = size
    if backend != "auto":
        if backend not in _LOADERS:
            raise ValueError(f"backend: expected 'auto' or one of {engine_names()}, got {backend!r}")
        eng, why = _try(backend, device, dtype, cost)
        if eng is None:
            raise ValueError(f"backend={backend!r} cannot run this problem: {why}. Use backend='auto' or 'tiled'.")
        if backend == "dense":
            check_dense_budget(B, N, M, dtype, device)  # before any work
        return eng
    pairs = B * N * M
    # never materialise above the dense engine's memory budget, whatever the size rules say
    allow_dense = allow_dense and dense_bytes(B, N, M, dtype) <= dense_max_bytes(device)
    if device.type == "cpu":
        if allow_dense and pairs <= CPU_DENSE_LIMIT:
            if torch.get_num_threads() > 1 or (pairs <= CPU_DENSE_LIMIT_1T and D < CPU_DENSE_MAX_D_1T):
                return _load("dense")
        eng, _ = _try("cpu", device, dtype, cost)
        if eng is not None and eng.name == "cpu":
            return eng
        # no cpu engine (or the tiled fallback of a failed build): dense vs tiled
        return _load("dense") if allow_dense and pairs <= CPU_DENSE_LIMIT else _load("tiled")
    if allow_dense and pairs <= DENSE_AUTO_LIMIT:
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
