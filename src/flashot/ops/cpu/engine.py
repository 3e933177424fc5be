"""``cpu`` engine: fused, vectorised, multi-threaded streaming kernels (+ a cached-cost pass).

Streaming (default, :mod:`.streamed`): one compiled kernel computes the dot products, the cost, the
bias, a polynomial ``exp`` and the running LogSumExp, with nothing but O((N + M) D) memory.  The
kernels work in base 2 (they take ``h log2(e)`` and ``scale log2(e) / eps``; :mod:`.common`).

Fused symmetric steps: :meth:`CpuEngine.softmin_pair` gives both potentials of a
symmetric Sinkhorn step from one exponential per pair, :meth:`CpuEngine.softmin_sym`
the debiasing softmin ``softmin(x, x, h)`` from the upper triangle (half the pairs);
rows / columns whose sums are unusable are recomputed by the plain streamed softmin.

Cached cost (:mod:`.cached`): for moderate N M and large D, the cost matrix of an (x, y) pair is
computed once and kept in a small LRU keyed on the tensors' data pointers, shapes, strides and
version counters; later softmins and plan products over the pair are memory-bound passes over it.
``auto`` builds a matrix on the second call on a pair, or on the first after a solver's
:meth:`CpuEngine.expect_reuse` hint (which also marks the matrices of earlier solves as evictable).
The cache holds a reference to ``x`` and ``y``, so their
memory cannot be reused while an entry is alive (no stale hits after a free);
in-place changes through autograd-visible ops bump the version and invalidate.
Budget: ``FLASHOT_CPU_CACHE_BYTES`` (default: 1/8 of the physical memory, or of the
cgroup limit when lower; at least 256 MiB).  An evicted matrix of the same size is
reused as the next one's buffer (a fresh 1.6 GB buffer costs ~0.25 s of page faults).

Options (constructor or environment): ``mode`` = ``"auto"`` | ``"stream"`` |
``"cache"`` (``FLASHOT_CPU_MODE``); ``cache_bytes``; ``threads`` (default
``torch.get_num_threads()``).

Determinism (``tests/ops/test_determinism.py``, ``benchmarks/CPU_ENGINE.md``): every kernel returns
the same bits on every call, for any thread count and schedule: a row is computed whole by one
task, and the column sums of the fused steps (pair, sym, alt, cached alt) are reduced per fixed
group of row blocks and combined in group order (``col_groups`` in colsum.h), never per
thread.  Two things can still change bits, by rounding only: (1) the path: ``auto`` streams a
pair's first call and switches to the cached matrix (cost from a GEMM) on the second call (or the
first after the solver's hint), and what fits the cache depends on what else it holds
(``mode="stream"`` or ``"cache"`` fixes the path; public calls centre their inputs into new tensors,
so repeated identical calls take the same path); (2) torch's GEMMs (the cached matrix, the
cached plan products) may round differently with another torch thread count
(``MKL_CBWR=AUTO,STRICT`` makes them reproducible).
"""

from __future__ import annotations

import math
import os
import threading
import warnings
import weakref
from collections import OrderedDict

import torch
from torch import Tensor

from ...costs import Cost
from ..base import WEIGHTS, Capability, Engine, Weight
from .budget import MIN_DEFAULT_CACHE_BYTES, default_cache_bytes, env_bytes, memory_bytes
from .cached import CachedCalls, raw_cost_matrix
from .common import (
    KIND_DIRECT,
    KIND_DOT,
    L2_BYTES,
    LARGE_D_CFG,
    LN2,
    LOG2E,
    NARROW_K,
    PAD,
    PAIR_MIN_SUM,
    PLAN_CHUNK_BYTES,
    SMALL_D,
    W_COST,
    W_INV,
    W_ONE,
    ZERO_W_F32,
    encode_zero_weights,
)
from .streamed import StreamedCalls

# re-exported for the callers that import them from here: the kernels' conventions (.common), the memory
# budget (.budget) and the cost matrix (.cached)
__all__ = [
    "CpuEngine",
    "memory_bytes",
    "default_cache_bytes",
    "raw_cost_matrix",
    "encode_zero_weights",
    "KIND_DOT",
    "KIND_DIRECT",
    "W_ONE",
    "W_COST",
    "W_INV",
    "LOG2E",
    "LN2",
    "ZERO_W_F32",
    "PAIR_MIN_SUM",
    "NARROW_K",
    "PAD",
    "PLAN_CHUNK_BYTES",
    "SMALL_D",
    "LARGE_D_CFG",
    "L2_BYTES",
    "MIN_DEFAULT_CACHE_BYTES",
    "CACHE_MIN_D",
    "MODES",
    "HOT_CALLS",
    "ALT_MIN_D",
    "ALT_MAX_Y_BYTES",
]

# auto: use the cached cost matrix from the second call on a pair when D >= this
# (measured crossover, see benchmarks/CPU_ENGINE.md) and it fits the budget.
CACHE_MIN_D = 16
MODES = ("auto", "stream", "cache")
# auto: a cached matrix hit within this many cache lookups is never evicted for another one
HOT_CALLS = 8
# softmin_alt fuses the two half-steps from this d on.  Measured at n = m = 20,000, float32, against
# two softmins: d = 4 1.17x, 16 and 17 0.93-1.0x (the scratch traffic eats the saved dot products),
# 20 1.53x, 24 1.6x, 32 1.67x, 48 1.7x, 64 1.75-1.8x (benchmarks/cpu_engine_bench.py --sections alt)
ALT_MIN_D = 20
# ... and while y (M (d + 2) values) stays in the last-level cache: its blocks of rows are small
# (their costs are kept), so y is re-read often (n = m = 80,000, d = 64: 0.86x of two softmins)
ALT_MAX_Y_BYTES = 16 << 20


def _tkey(t: Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t._version)


def _storage_ref(t: Tensor):
    """A weak reference to ``t``'s storage (torch keeps one Python object per live storage), or None."""
    try:
        return weakref.ref(t.untyped_storage())
    except (TypeError, RuntimeError, AttributeError):  # pragma: no cover - old torch
        return None


class CpuEngine(StreamedCalls, CachedCalls, Engine):
    name = "cpu"
    capabilities = frozenset(
        {Capability.SOFTMIN_PAIR, Capability.SOFTMIN_ALT, Capability.SOFTMIN_SYM, Capability.EXPECT_REUSE}
    )

    def __init__(
        self,
        lib=None,
        *,
        mode: str | None = None,
        cache_bytes: int | None = None,
        threads: int | None = None,
        cfg: int | None = None,
        max_entries: int = 3,
    ):
        if lib is None:
            from .build import kernels

            lib = kernels("core")
        self._ready: dict = {}  # dtype -> "" (its kernels are loaded) or why they cannot be
        self.lib = lib  # build.Kernels (each dtype's library loaded at first use), or one ctypes library
        mode = mode if mode is not None else (os.environ.get("FLASHOT_CPU_MODE") or "auto")
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        self.mode = mode
        self.cache_bytes = (
            int(cache_bytes) if cache_bytes is not None else env_bytes("FLASHOT_CPU_CACHE_BYTES", default_cache_bytes())
        )
        if self.cache_bytes < 0:
            raise ValueError(f"cache_bytes: expected >= 0, got {self.cache_bytes}")
        self.threads = threads
        if cfg not in (None, 0, 3):
            raise ValueError(f"cfg: expected None (by d), 0 (4x32 micro-kernel) or 3 (4x64), got {cfg!r}")
        self.cfg = cfg
        self.max_entries = int(max_entries)
        self._cache: OrderedDict = OrderedDict()  # key -> (C, x, y, scale)
        self._last_use: dict = {}  # key -> value of self._calls when the entry was last hit / built
        self._calls = 0
        # pair keys seen once (auto builds on the 2nd call) -> weak references to the pair's storages
        self._seen: OrderedDict = OrderedDict()
        self.stats = {"stream": 0, "cache_hit": 0, "cache_build": 0}
        self._lock = threading.Lock()
        # Held from a cache lookup until the cached matrix has been read: another thread's lookup
        # may evict an entry and reuse its buffer for a new matrix, so cached computations (and
        # builds) are serialised; streaming calls run concurrently.
        self._use_lock = threading.RLock()

    # ------------------------------------------------------------------ contract
    def unsupported(self, device, dtype, cost):
        if torch.device(device).type != "cpu":
            return f"the cpu engine needs CPU tensors, got device {device}; use backend='auto' or 'tiled'"
        if dtype not in (torch.float32, torch.float64):
            return f"the cpu engine supports float32 and float64, got {dtype}; use backend='tiled'"
        if getattr(cost, "bilinear", False):
            return "the cpu engine has no kernels for feature-bilinear costs (Gromov-Wasserstein); use backend='tiled'"
        if not (cost.is_dot or (cost.scale is None and cost.power == 1)):
            return f"the cpu engine does not support cost {cost.name!r}; use backend='tiled'"
        return self._kernels_missing(dtype)

    def _kernels_missing(self, dtype) -> str | None:
        """Load ``dtype``'s kernels (compiled on their first use) -> why they cannot be, or None."""
        from .build import BuildError, Kernels

        if not isinstance(self.lib, Kernels) or self._ready.get(dtype) == "":
            return None
        if dtype not in self._ready:
            try:
                self.lib.part(dtype)
                self._ready[dtype] = ""
            except BuildError as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                self._ready[dtype] = (
                    f"the cpu engine's {dtype} kernels cannot be built ({first[:300]}); use backend='tiled'"
                )
                warnings.warn(f"flashot: {self._ready[dtype]}", RuntimeWarning, stacklevel=3)
        return self._ready[dtype] or None

    def clear_cache(self) -> None:
        """Drop every cached cost matrix (and the references to their x, y)."""
        with self._lock:
            self._cache.clear()
            self._seen.clear()
            self._last_use.clear()

    def softmin(self, x: Tensor, y: Tensor, h: Tensor, eps: float, cost: Cost) -> Tensor:
        x, y, eps = self._check_xy(x, y, eps, cost)
        B, N = x.shape[:2]
        M = y.shape[1]
        h = self._check_vec(h, "h", (B, M), x)
        if N == 0 or M == 0:
            return torch.full((B, N), math.inf, dtype=x.dtype)
        with self._use_lock:
            ent, transposed = self._cached(x, y, cost)
            if ent is not None:
                return self._softmin_cached(ent[0], ent[3], transposed, h, eps)
        self.stats["stream"] += 1
        return self._stream_lse(x, y, h, eps, cost, -eps)

    def softmin_pair(
        self, x: Tensor, y: Tensor, hx: Tensor, hy: Tensor, eps: float, cost: Cost
    ) -> tuple[Tensor, Tensor]:
        """Symmetric Sinkhorn step: ``(softmin(x, y, hy), softmin(y, x, hx))`` with ONE exponential per pair.

        With ``s_ij = hx_i + hy_j - C_ij / eps`` (for ``hx = log a + f/eps``, ``hy = log b + g/eps``
        this is the log of the plan), ``softmin(x, y, hy)_i = -eps (log sum_j e^{s_ij} - hx_i)`` and
        ``softmin(y, x, hx)_j = -eps (log sum_i e^{s_ij} - hy_j)``: one streamed pass gives both sums
        (no running maximum: the potentials of a Sinkhorn iteration keep ``s`` near its fixed-point
        range).  Rows / columns whose sum is not finite or below ``PAIR_MIN_SUM`` (zero weights, or
        potentials far from consistent, e.g. the first step after a jump in eps) are recomputed
        with the ordinary streamed softmin, so the result never depends on that assumption.
        """
        x, y, eps = self._check_xy(x, y, eps, cost)
        B, N = x.shape[:2]
        M = y.shape[1]
        hx = self._check_vec(hx, "hx", (B, N), x)
        hy = self._check_vec(hy, "hy", (B, M), x)
        if N == 0 or M == 0 or self._cached(x, y, cost)[0] is not None:
            return self.softmin(x, y, hy, eps, cost), self.softmin(y, x, hx, eps, cost)
        rsum, csum = self._pair_sums(x, y, hx, hy, eps, cost, sym=False)
        fx = self._from_sums(rsum, hx, eps, x, y, hy, cost)
        fy = self._from_sums(csum, hy, eps, y, x, hx, cost)
        return fx, fy

    def softmin_alt(
        self, x: Tensor, y: Tensor, ha: Tensor, hy: Tensor, eps: float, cost: Cost, lam: float = 1.0
    ) -> tuple[Tensor, Tensor]:
        """Alternating Sinkhorn step: ``fx = softmin(x, y, hy)``, then ``fy = softmin(y, x, ha + lam fx / eps)``.

        For d >= ALT_MIN_D one streamed pass computes both: each block of rows gets its row LSE
        (``fx``) while its costs are kept in a per-thread scratch, then adds its rows, with their
        new weights, to running column LSEs (``fy``), so the dot products are computed once per
        iteration instead of twice.  Same iterates as the two softmins (up to rounding); for
        d < ALT_MIN_D (exp-bound: the scratch traffic would cost more than the recomputed
        dot products) and when y outgrows ALT_MAX_Y_BYTES it makes the two calls.  When the
        pair's cost matrix is cached, one read of it serves both halves (block of rows by block
        of rows); cached as (y, x), two cached softmins.
        """
        x, y, eps = self._check_xy(x, y, eps, cost)
        B, N, D = x.shape
        M = y.shape[1]
        ha = self._check_vec(ha, "ha", (B, N), x)
        hy = self._check_vec(hy, "hy", (B, M), x)
        lam = float(lam)
        if not (math.isfinite(lam) and lam >= 0):
            raise ValueError(f"lam: expected a finite number >= 0, got {lam!r}")
        if N == 0 or M == 0:
            fx = torch.full((B, N), math.inf, dtype=x.dtype)
            return fx, self.softmin(y, x, ha + lam * fx / eps, eps, cost)
        # ONE cache lookup for the first half (a second one would count this call twice in
        # auto's "build on the second call" rule)
        with self._use_lock:
            ent, transposed = self._cached(x, y, cost)
            if ent is not None and not transposed:  # one read of the cached matrix for both halves
                return self._alt_cached(ent[0], ent[3], ha, hy, eps, lam)
            if ent is not None:  # cached as (y, x): its column pass, then the row pass
                fx = self._softmin_cached(ent[0], ent[3], True, hy, eps)
                return fx, self.softmin(y, x, ha + lam * fx / eps, eps, cost)
        if D < ALT_MIN_D or M * (D + 2) * x.element_size() > ALT_MAX_Y_BYTES:  # y: what every block re-reads
            self.stats["stream"] += 1
            fx = self._stream_lse(x, y, hy, eps, cost, -eps)
        else:
            self.stats["alt"] = self.stats.get("alt", 0) + 1
            rlse, clse = self._rowcol("flashot_alt", x, y, ha, hy, eps, cost, lam=lam)
            return (-eps * LN2) * rlse, (-eps * LN2) * clse
        return fx, self.softmin(y, x, ha + lam * fx / eps, eps, cost)

    def softmin_sym(self, x: Tensor, h: Tensor, eps: float, cost: Cost) -> Tensor:
        """``softmin(x, x, h)`` for the symmetric (debiasing) problems, with half the exponentials.

        ``s_ij = h_i + h_j - C(x_i, x_j) / eps`` is symmetric: the kernel computes its upper
        triangle only (by blocks) and adds row and column sums.  Same safeguards as
        :meth:`softmin_pair`.
        """
        x, _, eps = self._check_xy(x, x, eps, cost)
        B, N = x.shape[:2]
        h = self._check_vec(h, "h", (B, N), x)
        if N == 0 or self._cached(x, x, cost)[0] is not None:
            return self.softmin(x, x, h, eps, cost)
        rsum, csum = self._pair_sums(x, x, h, h, eps, cost, sym=True)
        return self._from_sums(rsum + csum, h, eps, x, x, h, cost)

    def plan_product(self, x, y, alpha, beta, eps, V, cost, weight: Weight = "plan"):
        if weight not in WEIGHTS:
            raise ValueError(f"weight: expected one of {WEIGHTS}, got {weight!r}")
        x, y, eps = self._check_xy(x, y, eps, cost, allow_inf=True)  # eps = inf: the energy kernel
        B, N = x.shape[:2]
        M = y.shape[1]
        alpha = self._check_vec(alpha, "alpha", (B, N), x)
        beta = self._check_vec(beta, "beta", (B, M), x)
        if not isinstance(V, Tensor) or V.dim() != 3 or V.shape[:2] != (B, M):
            raise ValueError(
                f"V: expected a tensor of shape ({B}, {M}, K), got "
                f"{tuple(V.shape) if isinstance(V, Tensor) else type(V).__name__}"
            )
        if V.dtype != x.dtype or V.device != x.device:
            raise ValueError(f"V: expected {x.dtype} on {x.device}, got {V.dtype} on {V.device}")
        K = V.shape[2]
        if N == 0 or M == 0 or K == 0:
            return torch.zeros(B, N, K, dtype=x.dtype)
        with self._use_lock:
            ent, transposed = self._cached(x, y, cost)
            if ent is not None:
                return self._plan_cached(ent[0], ent[3], transposed, alpha, beta, eps, V, cost, weight)
        self.stats["stream"] += 1
        return self._plan_streamed(x, y, alpha, beta, eps, V, cost, weight)

    # ------------------------------------------------------------------ helpers
    def _check_xy(self, x, y, eps, cost, allow_inf: bool = False):
        for nm, t in (("x", x), ("y", y)):
            if not isinstance(t, Tensor):
                raise TypeError(f"{nm}: expected a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 3:
                raise ValueError(f"{nm}: expected shape (B, N, D), got {tuple(t.shape)}")
        why = self.unsupported(x.device, x.dtype, cost)
        if why:
            raise ValueError(why)
        if y.dtype != x.dtype or y.device != x.device:
            raise ValueError(f"y: expected {x.dtype} on {x.device} like x, got {y.dtype} on {y.device}")
        if y.shape[0] != x.shape[0] or y.shape[2] != x.shape[2]:
            raise ValueError(f"x {tuple(x.shape)} and y {tuple(y.shape)}: batch and feature sizes differ")
        if isinstance(eps, Tensor):
            eps = float(eps)
        if not isinstance(eps, (int, float)) or not (math.isfinite(eps) or (allow_inf and eps == math.inf)) or eps <= 0:
            raise ValueError(f"eps: expected a positive finite float, got {eps!r}")
        if x.requires_grad or y.requires_grad:
            x, y = x.detach(), y.detach()
        return x.contiguous(), y.contiguous(), float(eps)

    @staticmethod
    def _check_vec(t, nm, shape, x):
        if not isinstance(t, Tensor) or tuple(t.shape) != shape:
            raise ValueError(
                f"{nm}: expected a tensor of shape {shape}, got "
                f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}"
            )
        if t.dtype != x.dtype or t.device != x.device:
            raise ValueError(f"{nm}: expected {x.dtype} on {x.device}, got {t.dtype} on {t.device}")
        return t.detach().contiguous()

    # ------------------------------------------------------------------ cached cost
    def expect_reuse(self, x: Tensor, y: Tensor, cost: Cost) -> None:
        """Hint from a solver that the pair (x, y) will be used many times: in ``auto`` mode its cost
        matrix is then built on the first call instead of the second (when d and the budget
        allow), which saves one streamed pass per solve."""
        if self.mode != "auto":
            return
        kx, ky = _tkey(x), _tkey(y)
        with self._lock:
            if (kx, ky, cost.name) in self._cache or (ky, kx, cost.name) in self._cache:
                return
            self._remember(kx, ky, x, y, cost)
            # A new solve starts: the pairs of earlier solves count as cold, so they may be evicted
            # to make room (their buffer is then reused).  Without this, a loop of solves on fresh
            # tensors (a training loop) found the previous, still "hot" matrix holding the budget
            # and streamed every other solve.
            for key in self._cache:
                self._last_use[key] = -HOT_CALLS - 1

    def _remember(self, kx, ky, x: Tensor, y: Tensor, cost: Cost) -> None:
        """Record the pair as seen once (``_lock`` held), with weak references to its storages."""
        key = (kx, ky, cost.name)
        self._seen[key] = (_storage_ref(x), _storage_ref(y))
        self._seen.move_to_end(key)
        while len(self._seen) > 16:
            self._seen.popitem(last=False)

    def _seen_alive(self, key, x: Tensor, y: Tensor) -> bool:
        """Was this pair seen, and are its tensors' storages still the ones seen?  A key is made of
        data pointers: once a tensor is freed, a new tensor of the same shape can get its address
        (the allocator reuses it), and a stale key would make the new pair build its matrix on its
        FIRST call: the path (streamed or cached, whose results differ by rounding) then depended
        on the allocation history (a SamplesLoss gradient changed between identical calls)."""
        refs = self._seen.get(key)
        if refs is None:
            return False
        for ref, t in zip(refs, (x, y)):
            if ref is not None and ref() is not t.untyped_storage():
                del self._seen[key]  # stale: its tensor is gone
                return False
        return True

    def _cached(self, x: Tensor, y: Tensor, cost: Cost):
        """(C, transposed) when the cached path applies, else (None, False)."""
        if self.mode == "stream":
            return None, False
        with self._lock:
            return self._cached_locked(x, y, cost)

    def _cached_locked(self, x: Tensor, y: Tensor, cost: Cost):
        kx, ky = _tkey(x), _tkey(y)
        self._calls += 1
        for key, tr in (((kx, ky, cost.name), False), ((ky, kx, cost.name), True)):
            ent = self._cache.get(key)
            if ent is not None:
                self._cache.move_to_end(key)
                self._last_use[key] = self._calls
                self.stats["cache_hit"] += 1
                return ent, tr
        B, N, D = x.shape
        M = y.shape[1]
        nbytes = B * N * M * x.element_size()
        if nbytes > self.cache_bytes:
            if self.mode == "cache":
                raise ValueError(
                    f"mode='cache': the cost matrix needs {nbytes} bytes, over the budget of {self.cache_bytes} "
                    f"(FLASHOT_CPU_CACHE_BYTES / cache_bytes); raise it or use mode='auto' or 'stream'"
                )
            return None, False
        if self.mode == "auto":
            if D < CACHE_MIN_D:
                return None, False
            pk = (kx, ky, cost.name)
            pkt = (ky, kx, cost.name)
            if not (self._seen_alive(pk, x, y) or self._seen_alive(pkt, y, x)):
                self._remember(kx, ky, x, y, cost)
                return None, False

        # build, evicting least-recently used entries to stay in budget.  In auto mode only
        # *cold* entries (no hit in the last HOT_CALLS calls) may go: a solver that cycles over
        # more pairs than fit (a debiased loss: xy, xx, yy) keeps what fits and streams the
        # rest, instead of rebuilding a matrix on every call.
        def size(e):
            return e[0].numel() * e[0].element_size()

        used = sum(size(e) for e in self._cache.values())
        victims = []
        for key in self._cache:  # oldest first
            if used + nbytes <= self.cache_bytes and len(self._cache) - len(victims) < self.max_entries:
                break
            if self.mode == "auto" and self._calls - self._last_use.get(key, 0) <= HOT_CALLS:
                continue
            victims.append(key)
            used -= size(self._cache[key])
        if used + nbytes > self.cache_bytes or len(self._cache) - len(victims) >= self.max_entries:
            return None, False  # (auto only: forced mode may evict anything)
        spare = None
        for key in victims:
            ev = self._cache.pop(key)
            self._last_use.pop(key, None)
            if ev[0].numel() == B * N * M and ev[0].dtype == x.dtype:
                spare = ev[0]  # only the cache ever held it: reuse its (already faulted-in) pages
        C, scale = raw_cost_matrix(x, y, cost, out=None if spare is None else spare.view(B, N, M))
        ent = (C, x, y, scale)
        self._cache[(kx, ky, cost.name)] = ent
        self._last_use[(kx, ky, cost.name)] = self._calls
        self.stats["cache_build"] += 1
        return ent, False
