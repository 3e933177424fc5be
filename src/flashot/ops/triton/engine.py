"""``triton`` engine: fused FlashAttention-style kernels for softmin and plan products.

``softmin``:      out_i = -eps log sum_j exp(h_j - C_ij / eps)           (one pass over y)
``plan_product``: out_i = sum_j exp(alpha_i + beta_j - C_ij / eps) W_ij V_j  (one pass per K tile)
``softmin_pair``: (f, g) = (softmin(x, y, hy), softmin(y, x, hx)) in one launch.

Design (see :mod:`.kernels`):

* Small ``d`` (``d <= direct_max_d``, default 8) and the euclidean costs use
  coordinate differences, ``|x_i - y_j|^2 = sum_k (x_ik - y_jk)^2``: ``2 d``
  flops per pair, exact at ``x = y``.  Padding d = 3 to the 16-wide MMA tile
  would do >5x the work, and strict-fp32 ``tl.dot`` runs on FMA units anyway.
* Larger ``d`` uses ``tl.dot``; the feature axis is padded to a power of two
  >= 16 and the x tile kept on chip up to 64, and looped over in chunks of 32
  beyond (any ``d``; tested up to 130 on the interpreter, 1024 in
  ``benchmarks/gpu_check.py``).  The chunk sizes come from an offline sm_90
  compile: wider chunks spill registers in strict fp32.
* Explicit vs folded scores: by default the cost tile ``s (|x|^2 + |y|^2 -
  2 <x, y>)`` is formed first, then ``h - C / eps`` (as the ``tiled`` engine).
  ``fold=True`` (or ``FLASHOT_TRITON_FOLD=1``) uses the FlashSinkhorn form
  ``(2 s / eps) <x, y> + [h - s |y|^2 / eps]`` (one FMA per score).  Measured
  with float32 inputs on the Triton interpreter (n = m = 64, unit-cube points,
  centred, sqeuclidean), max error relative to the max of the float64 dense
  result, for (softmin value, grad x, grad y, grad h):

      d=3,  eps=0.0025: direct 1.8e-7 1.2e-6 1.7e-6 9e-7 | explicit 6e-7 4.6e-6 2.7e-6 3e-6 | fold 1.1e-6 7.5e-6 1e-5 5.9e-6
      d=17, eps=0.0025: explicit 2.7e-7 4.3e-5 1.2e-4 1.0e-4 | fold 1.9e-7 6.4e-5 1.1e-4 8.9e-5
      d=64, eps=0.0025: explicit 3.0e-7 3.1e-4 4.0e-4 4.1e-4 | fold 2.0e-7 3.4e-4 5.1e-4 4.9e-4
      d=64, eps=0.05:   explicit 1.8e-7 1.8e-5 3.3e-5 2.7e-5 | fold 2.2e-7 2.8e-5 3.1e-5 2.7e-5

  At d >= 17 and eps = 0.0025 (C / eps ~ 4000) both are limited by float32
  itself (the potentials f / eps carry ~1e-4 absolute rounding error), so the
  difference there is small; at d = 3 the direct form is 3-6x more accurate
  than folding.  So the explicit form (and the direct form for tiny d) is the
  default.  The GPU accumulation order differs from numpy's, so
  ``benchmarks/gpu_check.py`` re-measures value and gradient errors of both
  forms on the card ("grad f32 explicit / fold" rows).
* float32 is strict IEEE by default; TF32 tensor cores are opt-in with
  ``allow_tf32=True`` or ``FLASHOT_TRITON_TF32=1`` (~1e-3 relative error).
* float16 / bfloat16 points are read as such (``tl.dot`` on half inputs) and
  everything is accumulated in float32; results are float32.  float64 inputs
  are computed in float64 throughout (the scalars are loaded from a float64
  tensor, never rounded to float32).
* ``-inf`` log-weights give exactly zero weight; a row with no mass gives
  ``+inf`` (softmin) or 0 (plan product), never NaN.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable

import torch
from torch import Tensor

from ...costs import Cost
from ..base import Capability, Engine, Weight
from .configs import INTERPRET_CONFIG, KernelConfig, candidates, interpret_enabled, parse_config, pinned_config

__all__ = ["TritonEngine"]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_WEIGHT_CODES = {"plan": 0, "cost": 1, "dcost": 2}
ONE_CHUNK_MAX_D = 64  # x tile kept on chip up to this padded dimension
MAX_BATCH = 65535  # CUDA grid y / z limit
D_CHUNK = 32  # feature chunk beyond it (64 spills registers in fp32 on sm_90)

_CPU_REASON = "backend='triton' needs a CUDA tensor or TRITON_INTERPRET=1; use backend='tiled'"


def _env_flag(name: str) -> bool | None:
    v = os.environ.get(name)
    if v is None or not v.strip():
        return None
    return v.strip().lower() in ("1", "true", "yes", "on")


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


class TritonEngine(Engine):
    """Engine ``triton``.

    Args:
        config: pin one block configuration (a :class:`KernelConfig` or a string
            ``"BLOCK_N=64,BLOCK_M=64,num_warps=4"``); default: ``FLASHOT_TRITON_CONFIG``
            if set, else autotuned over a small fixed list (one small config under
            ``TRITON_INTERPRET=1``).
        allow_tf32: float32 dot products on TF32 tensor cores (default False, or
            ``FLASHOT_TRITON_TF32``).
        fold: FlashSinkhorn bias folding for dot costs (default False, or ``FLASHOT_TRITON_FOLD``).
        direct_max_d: largest ``d`` that uses coordinate differences instead of ``tl.dot``.
    """

    name = "triton"
    capabilities = frozenset({Capability.SOFTMIN_PAIR})

    def __init__(
        self,
        config: str | KernelConfig | None = None,
        allow_tf32: bool | None = None,
        fold: bool | None = None,
        direct_max_d: int = 8,
    ):
        self.config = parse_config(config) if config is not None else None
        self.allow_tf32 = allow_tf32
        self.fold = fold
        self.direct_max_d = int(direct_max_d)
        self._tuned: dict[tuple, KernelConfig] = {}
        self._prm_cache: dict[tuple, Tensor] = {}

    # -- contract -----------------------------------------------------------------
    def unsupported(self, device: torch.device, dtype: torch.dtype, cost: Cost) -> str | None:
        if dtype not in _DTYPES:
            return (
                f"backend='triton' supports float16/bfloat16/float32/float64 points, got {dtype}; use backend='tiled'"
            )
        if getattr(cost, "bilinear", False):
            return (
                "backend='triton' has no kernels for feature-bilinear costs (Gromov-Wasserstein); use backend='tiled'"
            )
        if device.type == "cuda":
            return None
        if device.type == "cpu" and interpret_enabled():
            return None
        if device.type == "cpu":
            return _CPU_REASON
        return f"backend='triton' needs a CUDA tensor (got device {device.type!r}); use backend='tiled'"

    def softmin(self, x: Tensor, y: Tensor, h: Tensor, eps: float, cost: Cost) -> Tensor:
        """out_i = -eps log sum_j exp(h_j - C(x_i, y_j) / eps), (B, N)."""
        return self._softmin(x, y, h, eps, cost)

    def softmin_pair(
        self, x: Tensor, y: Tensor, hx: Tensor, hy: Tensor, eps: float, cost: Cost
    ) -> tuple[Tensor, Tensor]:
        """Symmetric Sinkhorn step in one launch: ``(softmin(x, y, hy), softmin(y, x, hx))``."""
        return self._softmin(x, y, hy, eps, cost, hx=hx)

    def plan_product(
        self,
        x: Tensor,
        y: Tensor,
        alpha: Tensor,
        beta: Tensor,
        eps: float,
        V: Tensor,
        cost: Cost,
        weight: Weight = "plan",
    ) -> Tensor:
        """out_i = sum_j exp(alpha_i + beta_j - C_ij / eps) W_ij V_j, (B, N, K)."""
        if weight not in _WEIGHT_CODES:
            raise ValueError(f"weight: expected one of {tuple(_WEIGHT_CODES)}, got {weight!r}")
        x, y, kern = self._check(x, y, eps)
        B, N, D = x.shape
        M = y.shape[1]
        if V.dim() != 3 or V.shape[:2] != (B, M):
            raise ValueError(f"V: expected shape ({B}, {M}, K), got {tuple(V.shape)}")
        fold = self._fold(cost, D) and weight != "cost"
        acc = _acc_dtype(x.dtype)
        prm = self._params(eps, cost, acc, x.device)
        hb = beta.to(acc).contiguous()
        ha = alpha.to(acc).contiguous()
        K = V.shape[2]
        Vc = V.to(acc).contiguous()
        out = torch.empty(B, N, K, dtype=acc, device=x.device)
        if N == 0 or K == 0:
            return out
        if M == 0:
            return out.zero_()
        block_k = min(32, max(16, _pow2(K)))  # 64 spills registers in strict fp32
        cx = self._constexprs(x, D, cost, fold)

        def launch(cfg: KernelConfig) -> None:
            grid = (triton_cdiv(N, cfg.block_n), triton_cdiv(K, block_k), B)
            kern.plan_kernel[grid](
                x,
                y,
                hb,
                ha,
                Vc,
                out,
                prm,
                N,
                M,
                D,
                K,
                BLOCK_N=cfg.block_n,
                BLOCK_M=cfg.block_m,
                BLOCK_K=block_k,
                WEIGHT=_WEIGHT_CODES[weight],
                num_warps=cfg.num_warps,
                num_stages=cfg.num_stages,
                **cx,
            )

        self._run(("plan", weight, min(K, 64)), x, N, M, D, cx, launch)
        return out

    # -- block-sparse (the multiscale engine's primitives on a GPU) --------------------------
    def softmin_blocks(self, x: Tensor, y: Tensor, h: Tensor, eps: float, cost: Cost, lists) -> Tensor:
        """out_i = -eps log sum_{j in kept(I(i))} exp(h_j - C_ij / eps) over the kept column ranges of
        ``lists`` (a :class:`~flashot.ops.triton.blocksparse.BlockLists`), (1, N); B = 1."""
        x, y, kern = self._check_blocks(x, y, eps)
        N, D = x.shape[1], x.shape[2]
        fold = self._fold(cost, D)
        acc = _acc_dtype(x.dtype)
        prm = self._params(eps, cost, acc, x.device)
        hy = h.to(acc).contiguous()
        cx = self._constexprs(x, D, cost, fold)
        out = torch.full((1, N), math.inf, dtype=acc, device=x.device)

        def launch(cfg: KernelConfig) -> None:
            tiles = lists.tiles(cfg.block_n)
            if tiles.numel():
                kern.softmin_bs_kernel[(tiles.numel() // 3,)](
                    x,
                    y,
                    hy,
                    out,
                    prm,
                    tiles,
                    lists.cptr,
                    lists.ranges,
                    D,
                    BLOCK_N=cfg.block_n,
                    BLOCK_M=cfg.block_m,
                    num_warps=cfg.num_warps,
                    num_stages=cfg.num_stages,
                    **cx,
                )

        self._run(("softmin_bs",), x, N, y.shape[1], D, cx, launch)
        return out

    def plan_product_blocks(
        self,
        x: Tensor,
        y: Tensor,
        alpha: Tensor,
        beta: Tensor,
        eps: float,
        V: Tensor,
        cost: Cost,
        lists,
        weight: Weight = "plan",
    ) -> Tensor:
        """out_i = sum_{j in kept(I(i))} exp(alpha_i + beta_j - C_ij / eps) W_ij V_j over the kept column
        ranges of ``lists``, (1, N, K); B = 1."""
        if weight not in _WEIGHT_CODES:
            raise ValueError(f"weight: expected one of {tuple(_WEIGHT_CODES)}, got {weight!r}")
        x, y, kern = self._check_blocks(x, y, eps)
        N, D, M = x.shape[1], x.shape[2], y.shape[1]
        if V.dim() != 3 or V.shape[:2] != (1, M):
            raise ValueError(f"V: expected shape (1, {M}, K), got {tuple(V.shape)}")
        fold = self._fold(cost, D) and weight != "cost"
        acc = _acc_dtype(x.dtype)
        prm = self._params(eps, cost, acc, x.device)
        hb, ha, Vc = beta.to(acc).contiguous(), alpha.to(acc).contiguous(), V.to(acc).contiguous()
        K = V.shape[2]
        out = torch.zeros(1, N, K, dtype=acc, device=x.device)
        if K == 0:
            return out
        block_k = min(32, max(16, _pow2(K)))
        cx = self._constexprs(x, D, cost, fold)

        def launch(cfg: KernelConfig) -> None:
            tiles = lists.tiles(cfg.block_n)
            if tiles.numel():
                grid = (tiles.numel() // 3, triton_cdiv(K, block_k))
                kern.plan_bs_kernel[grid](
                    x,
                    y,
                    hb,
                    ha,
                    Vc,
                    out,
                    prm,
                    tiles,
                    lists.cptr,
                    lists.ranges,
                    D,
                    K,
                    BLOCK_N=cfg.block_n,
                    BLOCK_M=cfg.block_m,
                    BLOCK_K=block_k,
                    WEIGHT=_WEIGHT_CODES[weight],
                    num_warps=cfg.num_warps,
                    num_stages=cfg.num_stages,
                    **cx,
                )

        self._run(("plan_bs", weight, min(K, 64)), x, N, M, D, cx, launch)
        return out

    def _check_blocks(self, x: Tensor, y: Tensor, eps: float):
        if x.dim() != 3 or x.shape[0] != 1:
            raise ValueError(f"x: the block-sparse kernels take one problem, shape (1, N, D); got {tuple(x.shape)}")
        return self._check(x, y, eps)

    # -- internals ----------------------------------------------------------------
    def _softmin(self, x, y, h, eps, cost, hx=None):
        x, y, kern = self._check(x, y, eps)
        B, N, D = x.shape
        M = y.shape[1]
        fold = self._fold(cost, D)
        acc = _acc_dtype(x.dtype)
        prm = self._params(eps, cost, acc, x.device)
        hy = h.to(acc).contiguous()
        cx = self._constexprs(x, D, cost, fold)
        f = torch.empty(B, N, dtype=acc, device=x.device)
        if hx is None:
            if N == 0:
                return f

            def launch(cfg: KernelConfig) -> None:
                grid = (triton_cdiv(N, cfg.block_n), B)
                kern.softmin_kernel[grid](
                    x,
                    y,
                    hy,
                    f,
                    prm,
                    N,
                    M,
                    D,
                    BLOCK_N=cfg.block_n,
                    BLOCK_M=cfg.block_m,
                    num_warps=cfg.num_warps,
                    num_stages=cfg.num_stages,
                    **cx,
                )

            self._run(("softmin",), x, N, M, D, cx, launch)
            return f
        hxc = hx.to(acc).contiguous()
        g = torch.empty(B, M, dtype=acc, device=x.device)
        if N == 0 or M == 0:
            return self._softmin(x, y, h, eps, cost), self._softmin(y, x, hx, eps, cost)

        def launch_pair(cfg: KernelConfig) -> None:
            tiles_x = triton_cdiv(N, cfg.block_n)
            grid = (tiles_x + triton_cdiv(M, cfg.block_n), B)
            kern.softmin_pair_kernel[grid](
                x,
                y,
                hy,
                hxc,
                f,
                g,
                prm,
                N,
                M,
                D,
                tiles_x,
                BLOCK_N=cfg.block_n,
                BLOCK_M=cfg.block_m,
                num_warps=cfg.num_warps,
                num_stages=cfg.num_stages,
                **cx,
            )

        self._run(("pair",), x, N, M, D, cx, launch_pair)
        return f, g

    def _check(self, x: Tensor, y: Tensor, eps: float):
        if x.dim() != 3 or y.dim() != 3 or x.shape[0] != y.shape[0] or x.shape[2] != y.shape[2]:
            raise ValueError(f"x, y: expected (B, N, D) and (B, M, D), got {tuple(x.shape)} and {tuple(y.shape)}")
        if x.dtype not in _DTYPES or y.dtype != x.dtype:
            raise TypeError(f"x, y: expected one of {_DTYPES} (same for both), got {x.dtype} and {y.dtype}")
        if not (isinstance(eps, (int, float)) and eps > 0 and math.isfinite(eps)):
            raise ValueError(f"eps: expected a positive finite float, got {eps!r}")
        why = self.unsupported(x.device, x.dtype, _ANY_COST)
        if why:
            raise ValueError(why)
        if x.shape[0] > MAX_BATCH:
            raise ValueError(
                f"x: backend='triton' launches the batch on a grid axis limited to {MAX_BATCH}, "
                f"got B = {x.shape[0]}; split the batch or use backend='tiled'"
            )
        from .loader import kernels_for_device

        return x.contiguous(), y.contiguous(), kernels_for_device(x.device)

    def _fold(self, cost: Cost, D: int) -> bool:
        fold = self.fold if self.fold is not None else bool(_env_flag("FLASHOT_TRITON_FOLD"))
        return bool(fold and cost.is_dot)

    def _direct(self, cost: Cost, D: int, fold: bool) -> bool:
        return (not cost.is_dot) or (D <= self.direct_max_d and not fold)

    def _constexprs(self, x: Tensor, D: int, cost: Cost, fold: bool) -> dict:
        direct = self._direct(cost, D, fold)
        block_d = max(16, _pow2(D))
        one_chunk = (not direct) and block_d <= ONE_CHUNK_MAX_D
        if not one_chunk:
            block_d = D_CHUNK if not direct else 16
        tf32 = self.allow_tf32 if self.allow_tf32 is not None else bool(_env_flag("FLASHOT_TRITON_TF32"))
        prec = "tf32" if (tf32 and x.dtype == torch.float32) else "ieee"
        # The interpreter's bfloat16 tl.dot is broken (Triton 3.9): upcast there only.
        upcast = x.dtype == torch.bfloat16 and (interpret_enabled() or x.device.type != "cuda")
        return dict(
            BLOCK_D=block_d,
            D_STATIC=D if (direct and D <= 16) else 0,
            DIRECT=direct,
            ONE_CHUNK=one_chunk,
            FOLD=fold,
            COST=0 if cost.is_dot else 1,
            PREC=prec,
            UPCAST=upcast,
        )

    def _params(self, eps: float, cost: Cost, acc: torch.dtype, device: torch.device) -> Tensor:
        """Per-launch scalars on the device, cached so a Sinkhorn loop does no host-to-device copy."""
        s = cost.scale if cost.is_dot else 1.0
        key = (float(eps), s, cost.min_sqdist, acc, device)
        prm = self._prm_cache.get(key)
        if prm is None:
            if len(self._prm_cache) >= 256:
                self._prm_cache.clear()
            prm = torch.tensor([LOG2E / eps, s, eps * LN2, cost.min_sqdist, 2.0 * s, LOG2E], dtype=acc, device=device)
            self._prm_cache[key] = prm
        return prm

    def _run(
        self, kind: tuple, x: Tensor, N: int, M: int, D: int, cx: dict, launch: Callable[[KernelConfig], None]
    ) -> None:
        cfg = self.config or pinned_config()
        if cfg is None and (x.device.type != "cuda" or interpret_enabled()):
            cfg = INTERPRET_CONFIG
        # Triton launches on the current CUDA device: make it the tensors' device.
        with torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext():
            if cfg is None:
                key = (kind, _pow2(N), _pow2(M), D, x.dtype, x.device, tuple(sorted(cx.items())))
                cfg = self._tuned.get(key)
                if cfg is None:
                    cfg = self._tune(candidates(D, cx["DIRECT"], plan=kind[0] == "plan"), launch)
                    self._tuned[key] = cfg
            launch(cfg)

    @staticmethod
    def _tune(cands: list[KernelConfig], launch: Callable[[KernelConfig], None]) -> KernelConfig:
        """Time each candidate (one compile run, then best of 3) and return the fastest."""
        best, best_t, errors = None, float("inf"), []
        for cfg in cands:
            try:
                launch(cfg)
                torch.cuda.synchronize()
                times = []
                for _ in range(3):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    launch(cfg)
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end))
            except Exception as e:  # a config may not fit (shared memory, registers)
                errors.append(f"{cfg}: {type(e).__name__}: {e}")
                continue
            if min(times) < best_t:
                best, best_t = cfg, min(times)
        if best is None:
            raise RuntimeError("triton engine: no candidate config could run:\n" + "\n".join(errors))
        return best

    def tuned_configs(self) -> dict[tuple, KernelConfig]:
        """The autotuning cache (key -> chosen config), e.g. to report in benchmarks."""
        return dict(self._tuned)


class _AnyCost:
    is_dot = True


_ANY_COST = _AnyCost()


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
