"""``cpu`` engine: fused, vectorised, multi-threaded streaming kernels (+ a cached-cost pass).

Streaming (default): one compiled kernel computes dot products (register-blocked
micro-kernel), the cost ``s (|x|^2 + |y|^2 - 2<x, y>)`` (explicit form, as in the
``tiled`` engine, for float32 accuracy), the bias, a polynomial ``exp`` and the
running LogSumExp, with nothing but O((N + M) D) memory.  The kernels work in base 2
(they take ``h log2(e)`` and ``scale log2(e) / eps``).

Fused symmetric steps: :meth:`CpuEngine.softmin_pair` gives both potentials of a
symmetric Sinkhorn step from one exponential per pair, :meth:`CpuEngine.softmin_sym`
the debiasing softmin ``softmin(x, x, h)`` from the upper triangle (half the pairs);
rows / columns whose sums are unusable are recomputed by the plain streamed softmin.

Cached cost: for moderate N M and large D, the cost matrix of an (x, y) pair is
computed once (one MKL GEMM per row chunk through torch, on the augmented points
``[x, |x|^2, 1] . [-2y, 1, |y|^2]``) and kept in a small LRU keyed on the
tensors' data pointers, shapes, strides and version counters; each later softmin
(either direction: ``softmin(y, x)`` streams the transpose) is a memory-bound
exp pass over it, and so is each plan product (weights from ``C`` in row chunks,
contracted with ``V`` by a GEMM: the same arithmetic as the cached softmins, so
gradients are consistent with the potentials).  ``auto`` builds a matrix on the second
call on a pair, or on the first after a solver's :meth:`CpuEngine.expect_reuse` hint
(which also marks the matrices of earlier solves as evictable).  The cache holds a
reference to ``x`` and ``y``, so their
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
group of row blocks and combined in group order (``col_groups`` in kernels.cpp), never per
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
import weakref
from collections import OrderedDict

import torch
from torch import Tensor

from ...costs import Cost
from ..base import WEIGHTS, Capability, Engine, Weight
from . import abi

KIND_DOT, KIND_DIRECT = 0, 1
W_ONE, W_COST, W_INV = 0, 1, 2
LOG2E = 1.4426950408889634  # the kernels work in base 2: they take h * log2(e), scale * log2(e) / eps
LN2 = 0.6931471805599453
# float32 kernels take zero weights as this finite log-weight (their exp2 needs no -inf test)
ZERO_W_F32 = -1e38
# softmin_pair: a row / column sum below this (or not finite) is recomputed by the plain softmin.
# Terms flushed to zero (< 2^-126 each, < 2^-99 in all for up to 2^27 of them) are then below
# 2^-24 of the sum, i.e. below float32 resolution.
PAIR_MIN_SUM = 2.0 ** -75
NARROW_K = 4  # plan products with V of at most this many columns take the vectorised-over-j kernel
PAD = 64  # columns are padded to a multiple of this (>= 16 * max vectors per micro-kernel)

MIN_DEFAULT_CACHE_BYTES = 256 << 20
PLAN_CHUNK_BYTES = 4 << 20  # cached plan products: rows of weights per GEMM (fits the L2 + L3)


def memory_bytes() -> int | None:
    """Physical memory, or the cgroup (v2 / v1) memory limit when that is lower."""
    total = None
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                v = f.read().strip()
            if v.isdigit() and (total is None or int(v) < total):
                total = int(v)
        except OSError:
            pass
    return total


def default_cache_bytes() -> int:
    """1/8 of the machine's (or cgroup's) memory, at least 256 MiB (1 GiB if unknown)."""
    mem = memory_bytes()
    return 1 << 30 if mem is None else max(MIN_DEFAULT_CACHE_BYTES, mem // 8)

# auto: use the cached cost matrix from the second call on a pair when D >= this
# (measured crossover, see benchmarks/CPU_ENGINE.md) and it fits the budget.
CACHE_MIN_D = 16
# micro-kernel configuration for D above SMALL_D: 4 rows x 64 columns (see CPU_ENGINE.md).
SMALL_D = 32
LARGE_D_CFG = 3
L2_BYTES = 512 * 1024
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


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    try:
        return int(float(v))
    except ValueError:
        raise ValueError(f"{name}: expected an integer number of bytes, got {v!r}") from None


def _ptr(t: Tensor) -> int:
    return t.data_ptr()


def _tkey(t: Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t._version)


def _storage_ref(t: Tensor):
    """A weak reference to ``t``'s storage (torch keeps one Python object per live storage), or None."""
    try:
        return weakref.ref(t.untyped_storage())
    except (TypeError, RuntimeError, AttributeError):  # pragma: no cover - old torch
        return None


class CpuEngine(Engine):
    name = "cpu"
    capabilities = frozenset({Capability.SOFTMIN_PAIR, Capability.SOFTMIN_ALT, Capability.SOFTMIN_SYM,
                              Capability.EXPECT_REUSE})

    def __init__(self, lib=None, *, mode: str | None = None, cache_bytes: int | None = None,
                 threads: int | None = None, cfg: int | None = None, max_entries: int = 3):
        if lib is None:
            from .build import load

            lib = load()
        self.lib = lib
        mode = mode if mode is not None else (os.environ.get("FLASHOT_CPU_MODE") or "auto")
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        self.mode = mode
        self.cache_bytes = int(cache_bytes) if cache_bytes is not None else _env_int(
            "FLASHOT_CPU_CACHE_BYTES", default_cache_bytes())
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
        return None

    def clear_cache(self) -> None:
        """Drop every cached cost matrix (and the references to their x, y)."""
        with self._lock:
            self._cache.clear()
            self._seen.clear()
            self._last_use.clear()

    def softmin(self, x: Tensor, y: Tensor, h: Tensor, eps: float, cost: Cost) -> Tensor:
        x, y, eps = self._check_xy(x, y, eps, cost)
        B, N, D = x.shape
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

    def softmin_pair(self, x: Tensor, y: Tensor, hx: Tensor, hy: Tensor, eps: float,
                     cost: Cost) -> tuple[Tensor, Tensor]:
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
        B, N, D = x.shape
        M = y.shape[1]
        hx = self._check_vec(hx, "hx", (B, N), x)
        hy = self._check_vec(hy, "hy", (B, M), x)
        if N == 0 or M == 0 or self._cached(x, y, cost)[0] is not None:
            return self.softmin(x, y, hy, eps, cost), self.softmin(y, x, hx, eps, cost)
        rsum, csum = self._pair_sums(x, y, hx, hy, eps, cost, sym=False)
        fx = self._from_sums(rsum, hx, eps, x, y, hy, cost)
        fy = self._from_sums(csum, hy, eps, y, x, hx, cost)
        return fx, fy

    def softmin_alt(self, x: Tensor, y: Tensor, ha: Tensor, hy: Tensor, eps: float, cost: Cost,
                    lam: float = 1.0) -> tuple[Tensor, Tensor]:
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
        B, N, D = x.shape
        h = self._check_vec(h, "h", (B, N), x)
        if N == 0 or self._cached(x, x, cost)[0] is not None:
            return self.softmin(x, x, h, eps, cost)
        rsum, csum = self._pair_sums(x, x, h, h, eps, cost, sym=True)
        return self._from_sums(rsum + csum, h, eps, x, x, h, cost)

    def _pair_sums(self, x, y, hx, hy, eps, cost, sym: bool):
        self.stats["pair"] = self.stats.get("pair", 0) + 1
        return self._rowcol("flashot_pair", x, y, hx, hy, eps, cost, sym=int(sym))

    def _rowcol(self, name, x, y, hx, hy, eps, cost, lam: float = 0.0, sym: int = 0):
        """Call a kernel with row and column outputs (``flashot_pair``, ``flashot_alt``): ``hx`` on the
        rows (base 2, zero weights encoded), ``hy`` on the columns.  Returns (rows (B, N), cols (B, M))."""
        B, N, _ = x.shape
        M = y.shape[1]
        kind, kcoef, minsq = self.cost_args(cost, eps)
        yT, yy, hs, Mp = self._prep_y(y, hy, kind)
        hx2 = encode_zero_weights((hx * LOG2E).contiguous())
        rows = torch.empty(B, N, dtype=x.dtype)
        cols = torch.empty(B, Mp, dtype=x.dtype)
        fn = getattr(self.lib, name + ("_f32" if x.dtype == torch.float32 else "_f64"))
        args = abi.RowColArgs(self._stream(x, yT, yy, hs, Mp, kind, kcoef, minsq), _ptr(hx2), _ptr(rows), _ptr(cols),
                              lam, sym)
        rc = abi.call(fn, args)
        if rc != 0:
            raise RuntimeError(f"cpu engine: {name} kernel returned {rc}")
        return rows, cols[:, :M]

    def _from_sums(self, sums, h, eps, pts, other, h_other, cost):
        """``-eps (log sums - h)``; entries whose sum is unusable are recomputed by the streamed softmin."""
        out = -eps * (sums.log() - h)
        bad = ~(torch.isfinite(sums) & (sums >= PAIR_MIN_SUM))
        if bool(bad.any()):
            self.stats["pair_fixup"] = self.stats.get("pair_fixup", 0) + int(bad.sum())
            for b in range(out.shape[0]):
                idx = bad[b].nonzero().squeeze(1)
                if idx.numel():
                    sub = pts[b:b + 1, idx].contiguous()
                    out[b, idx] = self._stream_lse(sub, other[b:b + 1], h_other[b:b + 1], eps, cost, -eps)[0]
        return out

    def plan_product(self, x, y, alpha, beta, eps, V, cost, weight: Weight = "plan"):
        if weight not in WEIGHTS:
            raise ValueError(f"weight: expected one of {WEIGHTS}, got {weight!r}")
        x, y, eps = self._check_xy(x, y, eps, cost, allow_inf=True)  # eps = inf: the energy kernel
        B, N, D = x.shape
        M = y.shape[1]
        alpha = self._check_vec(alpha, "alpha", (B, N), x)
        beta = self._check_vec(beta, "beta", (B, M), x)
        if not isinstance(V, Tensor) or V.dim() != 3 or V.shape[:2] != (B, M):
            raise ValueError(f"V: expected a tensor of shape ({B}, {M}, K), got "
                             f"{tuple(V.shape) if isinstance(V, Tensor) else type(V).__name__}")
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
        kind, kcoef, minsq = self.cost_args(cost, eps)
        yT, yy, hs, Mp = self._prep_y(y, beta, kind)
        wk, wconst = W_ONE, 1.0
        if weight == "cost":
            wk = W_COST
            if kind == KIND_DOT:
                wconst = cost.scale  # the kernel's c is |x - y|^2
        elif weight == "dcost":
            if kind == KIND_DOT:
                wconst = 2.0 * cost.scale
            else:
                wk = W_INV
        narrow = K <= NARROW_K
        if narrow:
            # narrow V (marginals, barycentric maps and gradients at d <= 3): V transposed, the
            # contraction vectorised over columns (K FMAs per vector of pairs), fused into the pass
            Kp = K
            Vb = torch.zeros(B, K, Mp, dtype=x.dtype)
            Vb[:, :, :M] = V.transpose(1, 2)
        else:
            lanes = self.lib.flashot_vector_bytes() // x.element_size()  # the kernels' vector width
            Kp = -(-K // lanes) * lanes
            Vb = torch.zeros(B, Mp, Kp, dtype=x.dtype)  # (Mp, Kp) row-major, zero padding
            Vb[:, :M, :K] = V
        args = (kind, kcoef, minsq, wk, wconst, narrow)
        # One pass: the weights are the plan entries exp(alpha_i + beta_j - C_ij / eps) themselves (no
        # LSE pass).  Rows whose plan mass is not finite or below PAIR_MIN_SUM, or whose output
        # overflowed, are redone with two passes (LSE first, weights <= 1).
        out, mass = self._plan_call(x, yT, yy, hs, None, alpha, Vb, Kp, *args)
        bad = torch.isfinite(alpha) & ~(torch.isfinite(mass) & (mass >= PAIR_MIN_SUM) & torch.isfinite(out).all(-1))
        if bool(bad.any()):
            self.stats["plan_fixup"] = self.stats.get("plan_fixup", 0) + int(bad.sum())
            for bb in range(B):
                idx = bad[bb].nonzero().squeeze(1)
                if idx.numel():
                    sub = x[bb:bb + 1, idx].contiguous()
                    yTb, yyb, hsb, Vbb = yT[bb:bb + 1], yy[bb:bb + 1], hs[bb:bb + 1], Vb[bb:bb + 1]
                    lse = self._run_softmin(sub, yTb, yyb, hsb, Mp, kind, kcoef, minsq, 1.0)  # base 2
                    o2, _ = self._plan_call(sub, yTb, yyb, hsb, lse, alpha[bb:bb + 1, idx].contiguous(), Vbb, Kp,
                                            *args)
                    out[bb, idx] = o2[0]
        return out if Kp == K else out[..., :K].contiguous()

    def _plan_call(self, x, yT, yy, hs, lse, alpha, Vb, Kp, kind, kcoef, minsq, wk, wconst, narrow):
        """One plan kernel call: two-pass mode when ``lse`` (base 2) is given, one-pass otherwise."""
        B, N, _ = x.shape
        Mp = hs.shape[1]
        out = torch.empty(B, N, Kp, dtype=x.dtype)
        mass = torch.empty(B, N, dtype=x.dtype)
        fn = self.lib.flashot_plan_f32 if x.dtype == torch.float32 else self.lib.flashot_plan_f64
        args = abi.PlanArgs(self._stream(x, yT, yy, hs, Mp, kind, kcoef, minsq), _ptr(alpha if lse is None else lse),
                            _ptr(alpha), _ptr(Vb), _ptr(out), _ptr(mass), wconst, Kp, int(lse is None), wk, int(narrow))
        rc = abi.call(fn, args)
        if rc != 0:
            raise RuntimeError(f"cpu engine: plan kernel returned {rc}")
        return out, mass

    # ------------------------------------------------------------------ helpers
    def _nthreads(self) -> int:
        return int(self.threads or torch.get_num_threads())

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
            raise ValueError(f"{nm}: expected a tensor of shape {shape}, got "
                             f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
        if t.dtype != x.dtype or t.device != x.device:
            raise ValueError(f"{nm}: expected {x.dtype} on {x.device}, got {t.dtype} on {t.device}")
        return t.detach().contiguous()

    @staticmethod
    def cost_args(cost: Cost, eps: float):
        """(kind, k, minsq): the kernels' base-2 score is ``h * log2(e) - k * c`` with ``k = log2(e) / eps``
        times the cost's scale (dot kind: c = |x - y|^2; direct: c = |x - y|)."""
        if cost.is_dot:
            return KIND_DOT, LOG2E * cost.scale / eps, 0.0
        return KIND_DIRECT, LOG2E / eps, float(cost.min_sqdist)

    @staticmethod
    def _prep_y(y: Tensor, h: Tensor, kind: int):
        B, M, D = y.shape
        Mp = -(-M // PAD) * PAD
        yT = torch.zeros(B, D, Mp, dtype=y.dtype)
        yT[:, :, :M] = y.transpose(1, 2)
        yy = torch.zeros(B, Mp, dtype=y.dtype)
        if kind == KIND_DOT:
            yy[:, :M] = (y * y).sum(-1)
        hs = torch.full((B, Mp), -math.inf, dtype=y.dtype)
        hs[:, :M] = h * LOG2E
        encode_zero_weights(hs)
        return yT, yy, hs, Mp

    def _stream(self, x, yT, yy, hs, Mp, kind, kcoef, minsq) -> abi.Stream:
        """The kernels' description of the streamed clouds (``flashot_stream``): x (B, N, D), y padded to Mp."""
        B, N, D = x.shape
        return abi.Stream(_ptr(x), _ptr(yT), _ptr(yy), _ptr(hs), N, Mp, L2_BYTES, kcoef, minsq, B, D, kind,
                          self._kernel_cfg(D), self._nthreads())

    def _kernel_cfg(self, D: int) -> int:
        if self.cfg is not None:
            return int(self.cfg)
        return 0 if D <= SMALL_D else LARGE_D_CFG

    def _run_softmin(self, x, yT, yy, hs, Mp, kind, kcoef, minsq, oscale):
        B, N, _ = x.shape
        out = torch.empty(B, N, dtype=x.dtype)
        fn = self.lib.flashot_softmin_f32 if x.dtype == torch.float32 else self.lib.flashot_softmin_f64
        rc = abi.call(fn, abi.LseArgs(self._stream(x, yT, yy, hs, Mp, kind, kcoef, minsq), _ptr(out), oscale))
        if rc != 0:
            raise RuntimeError(f"cpu engine: softmin kernel returned {rc}")
        return out

    def _stream_lse(self, x, y, h, eps, cost, oscale):
        kind, kcoef, minsq = self.cost_args(cost, eps)
        yT, yy, hs, Mp = self._prep_y(y, h, kind)
        return self._run_softmin(x, yT, yy, hs, Mp, kind, kcoef, minsq, oscale * LN2)

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
                    f"(FLASHOT_CPU_CACHE_BYTES / cache_bytes); raise it or use mode='auto' or 'stream'")
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

    def _softmin_cached(self, C: Tensor, scale: float, transposed: bool, h: Tensor, eps: float,
                        oscale: float | None = None) -> Tensor:
        """LSE pass over the cached raw matrix (cost = scale * C): ``oscale * LSE_2`` of the base-2
        scores ``h log2(e) - scale C log2(e) / eps`` (default ``oscale = -eps ln 2``: the softmin)."""
        B, N, M = C.shape
        lib = self.lib
        f32 = C.dtype == torch.float32
        if transposed:  # out over the columns of C
            out = torch.empty(B, M, dtype=C.dtype)
            fn = lib.flashot_cols_lse_f32 if f32 else lib.flashot_cols_lse_f64
        else:
            out = torch.empty(B, N, dtype=C.dtype)
            fn = lib.flashot_rows_lse_f32 if f32 else lib.flashot_rows_lse_f64
        h2 = encode_zero_weights((h * LOG2E).contiguous())
        args = abi.CachedArgs(C=_ptr(C), h=_ptr(h2), out=_ptr(out), N=N, M=M, k=LOG2E * scale / eps,
                              oscale=-eps * LN2 if oscale is None else oscale, B=B, nth=self._nthreads())
        rc = abi.call(fn, args)
        if rc != 0:
            raise RuntimeError(f"cpu engine: cached-cost kernel returned {rc}")
        return out

    def _alt_cached(self, C: Tensor, scale: float, ha: Tensor, hy: Tensor, eps: float, lam: float):
        """Alternating step over the cached matrix of (x, y): row LSEs, then the column LSEs with the
        rows' new weights, block of rows by block of rows (C is read from memory once)."""
        B, N, M = C.shape
        f32 = C.dtype == torch.float32
        self.stats["alt_cached"] = self.stats.get("alt_cached", 0) + 1
        h2 = encode_zero_weights((hy * LOG2E).contiguous())
        ha2 = encode_zero_weights((ha * LOG2E).contiguous())
        rlse = torch.empty(B, N, dtype=C.dtype)
        clse = torch.empty(B, M, dtype=C.dtype)
        fn = self.lib.flashot_cached_alt_f32 if f32 else self.lib.flashot_cached_alt_f64
        args = abi.CachedArgs(C=_ptr(C), h=_ptr(h2), ha=_ptr(ha2), out=_ptr(rlse), cols=_ptr(clse), N=N, M=M,
                              k=LOG2E * scale / eps, lam=float(lam), B=B, nth=self._nthreads())
        rc = abi.call(fn, args)
        if rc != 0:
            raise RuntimeError(f"cpu engine: cached alternating kernel returned {rc}")
        return (-eps * LN2) * rlse, (-eps * LN2) * clse

    def _plan_cached(self, C: Tensor, scale: float, transposed: bool, alpha: Tensor, beta: Tensor, eps: float,
                     V: Tensor, cost: Cost, weight: Weight) -> Tensor:
        """Plan product over the cached raw matrix, in two passes (so no over- or underflow).

        ``L`` = base-2 LSE of ``beta log2(e) - k C`` over the summed index (the cached LSE pass),
        then row chunks of weights ``exp2(beta log2(e) - k C - L) W`` (each output's weights sum
        to at most 1) are contracted with ``V`` by a GEMM, and each output is scaled by
        ``exp(alpha + L ln 2)``.  Same score arithmetic as the cached softmin, so potentials from
        it and plan products (gradients) are consistent.  ``transposed``: the output runs over
        the columns of C (``out += P^T V`` chunk by chunk).
        """
        B, N, M = C.shape
        dt = C.dtype
        f32 = dt == torch.float32
        neg = -1e37 if f32 else -1e300  # finite "zero weight" for the kernel's exp2
        k = LOG2E * scale / eps
        L = self._softmin_cached(C, scale, transposed, beta, eps, oscale=1.0)  # over the summed index
        good = torch.isfinite(L) & (L > 0.5 * neg)  # not good: every weight of the sum is zero
        shift = torch.where(good, -L, torch.full_like(L, neg)).contiguous()
        h2 = (beta * LOG2E).clamp_(min=neg).contiguous()
        wk, wconst, wthr = W_ONE, 1.0, 0.0
        if weight == "cost":
            wk, wconst = W_COST, (scale if cost.is_dot else 1.0)
        elif weight == "dcost":
            if cost.is_dot:
                wconst = 2.0 * scale
            else:
                wk = W_INV
                wthr = 1.001 * math.sqrt(cost.min_sqdist) if cost.min_sqdist > 0 else 0.0
        K = V.shape[2]
        # GEMM layouts measured fastest for narrow V (K = 2..8: 3-5x over row-major V) and as fast at K = 65:
        # P V with V column-major; for the transposed product, out^T (K, M) += V_chunk^T P
        if transposed:
            outT = torch.zeros(B, K, M, dtype=dt)
            Vt = V.transpose(1, 2).contiguous()  # (B, K, N)
        else:
            out = torch.empty(B, N, K, dtype=dt)
            Vc = V.transpose(1, 2).contiguous().transpose(1, 2)  # (B, M, K), column-major
        rows = max(16, min(N, PLAN_CHUNK_BYTES // max(1, M * C.element_size())))
        P = torch.empty(rows, M, dtype=dt)
        fn = self.lib.flashot_cached_weights_f32 if f32 else self.lib.flashot_cached_weights_f64
        self.stats["plan_cached"] = self.stats.get("plan_cached", 0) + 1
        for b in range(B):
            for i0 in range(0, N, rows):
                i1 = min(N, i0 + rows)
                Pi = P[: i1 - i0]
                rb, cb = (h2[b, i0:i1], shift[b]) if transposed else (shift[b, i0:i1], h2[b])
                rc = abi.call(fn, abi.WeightsArgs(_ptr(C[b, i0:i1]), _ptr(rb), _ptr(cb), _ptr(Pi), i1 - i0, M, k,
                                                  wthr, wk, self._nthreads()))
                if rc != 0:
                    raise RuntimeError(f"cpu engine: cached plan kernel returned {rc}")
                if transposed:
                    outT[b].addmm_(Vt[b, :, i0:i1].contiguous(), Pi)
                else:
                    torch.mm(Pi, Vc[b], out=out[b, i0:i1])
        if transposed:
            out = outT.transpose(1, 2)
        factor = torch.where(good, torch.exp(alpha + L * LN2) * wconst, torch.zeros_like(L))
        return (out * factor.unsqueeze(-1)).contiguous()


def encode_zero_weights(h: Tensor) -> Tensor:
    """In place for float32: -inf log-weights -> ZERO_W_F32 (exp2 of it is exactly 0)."""
    if h.dtype == torch.float32:
        h.clamp_(min=ZERO_W_F32)
    return h


def raw_cost_matrix(x: Tensor, y: Tensor, cost: Cost, rows: int = 2048,
                    out: Tensor | None = None) -> tuple[Tensor, float]:
    """``(C, scale)`` with ``cost(x_i, y_j) = scale * C_ij``, C of shape (B, N, M), built in row chunks.

    Squared costs: ``C = |x|^2 + |y|^2 - 2<x, y>`` as ONE GEMM per chunk on the augmented
    points ``[x, |x|^2, 1]`` and ``[-2y, 1, |y|^2]`` (written straight into C; not clamped:
    the matrix only feeds exponents, where a rounding-level negative entry is harmless,
    like in the streaming kernel).  Euclidean: ``torch.cdist`` from coordinate differences,
    with the cost's clamp.  ``out`` (optional) is reused as the buffer.
    """
    B, N, D = x.shape
    M = y.shape[1]
    C = torch.empty(B, N, M, dtype=x.dtype) if out is None else out
    if cost.is_dot:
        ones_x = torch.ones(B, N, 1, dtype=x.dtype)
        ones_y = torch.ones(B, M, 1, dtype=x.dtype)
        xa = torch.cat([x, (x * x).sum(-1, keepdim=True), ones_x], -1)
        yaT = torch.cat([-2.0 * y, ones_y, (y * y).sum(-1, keepdim=True)], -1).transpose(1, 2)
        for b in range(B):
            for i0 in range(0, N, rows):
                i1 = min(N, i0 + rows)
                torch.mm(xa[b, i0:i1], yaT[b], out=C[b, i0:i1])
        return C, float(cost.scale)
    for b in range(B):
        for i0 in range(0, N, rows):
            i1 = min(N, i0 + rows)
            blk = C[b, i0:i1]
            blk.copy_(torch.cdist(x[b, i0:i1], y[b], compute_mode="donot_use_mm_for_euclid_dist"))
            if cost.min_sqdist > 0:
                blk.clamp_min_(math.sqrt(cost.min_sqdist))
    return C, 1.0
