"""The ``triton`` engine against the ``dense`` oracle, on the CPU via the Triton interpreter.

``TRITON_INTERPRET=1`` is set at import (before any kernel is decorated: the
engine imports its kernels module on first launch), so this file also works
when the whole suite runs in one pytest process.

Tolerances (max |error| relative to max |reference|):
* float64: 1e-10 (observed ~1e-14);
* float32 points vs the float64 oracle on the same points: 2e-5 for values and
  plan products, 5e-5 for gradients, at eps ~ d / 50 (observed <= 3e-6);
* float16 / bfloat16 points vs the float64 oracle on the *same rounded points*
  (so only the float32 accumulation is measured): 2e-5;
* TF32 (opt-in): 2e-2.
Shapes are small and ragged (N = 37, M = 45 against 32 x 32 tiles), B = 2.
The last tests compile every kernel variant for sm_90 without a GPU (Triton's
NVIDIA backend + ptxas, in a subprocess without the interpreter).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import math

import pytest
import torch

pytest.importorskip("triton")

import flashot
from flashot import ops
from flashot.costs import get_cost
from flashot.ops.dense import DenseEngine
from flashot.ops.registry import get_engine
from flashot.ops.triton import TritonEngine, parse_config
from flashot.ops.triton.configs import KernelConfig

DENSE = DenseEngine()
CPU = torch.device("cpu")
B, N, M = 2, 37, 45
TOL = {torch.float64: 1e-10, torch.float32: 2e-5}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert not torch.isnan(a).any(), "NaN in the triton result"
    fin = torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), fin), "finite / infinite entries differ"
    assert torch.equal(a[~fin], b[~fin])
    scale = b[fin].abs().max().clamp_min(1e-300)
    return ((a[fin] - b[fin]).abs().max() / scale).item()


def clouds(D: int, dtype=torch.float64, seed: int = 0, b: int = B, n: int = N, m: int = M):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(b, n, D, generator=g, dtype=torch.float64) - 0.5
    y = torch.rand(b, m, D, generator=g, dtype=torch.float64) - 0.4
    h = torch.randn(b, m, generator=g, dtype=torch.float64)
    h[:, 5] = -math.inf  # a zero-weight point
    return x.to(dtype), y.to(dtype), h.to(dtype)


def engine() -> TritonEngine:
    eng = get_engine("triton", device=CPU, dtype=torch.float64, cost=get_cost("sqeuclidean"))
    assert isinstance(eng, TritonEngine)
    return eng


def eps_for(D: int) -> float:
    """eps ~ a tenth of the mean squared distance: informative, O(1) plans, no underflow."""
    return 0.02 * D + 0.02


SOFTMIN_CASES = (
    [(d, c) for d in (1, 3, 17, 64, 130) for c in ("sqeuclidean", "half_sqeuclidean")]
    + [(d, "euclidean") for d in (1, 3, 17)]
    + [(3, "euclidean_geomloss")]
)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("D,cost", SOFTMIN_CASES)
def test_softmin_matches_dense(D, cost, dtype):
    x, y, h = clouds(D, dtype)
    c, eps = get_cost(cost), eps_for(D)
    out = engine().softmin(x, y, h, eps, c)
    ref = DENSE.softmin(x.double(), y.double(), h.double(), eps, c)
    assert out.shape == (B, N) and out.dtype == dtype
    assert rel_err(out, ref) < TOL[dtype]


PLAN_CASES = [(d, "sqeuclidean") for d in (1, 3, 17, 64, 130)] + [
    (3, "half_sqeuclidean"),
    (3, "euclidean"),
    (17, "euclidean"),
]


@pytest.mark.parametrize("D,cost", PLAN_CASES)
@pytest.mark.parametrize("weight", ["plan", "cost", "dcost"])
def test_plan_product_matches_dense(D, cost, weight):
    x, y, h = clouds(D)
    c, eps = get_cost(cost), eps_for(D)
    alpha = DENSE.softmin(x, y, h, eps, c) / eps  # rows of the plan sum to ~1
    alpha[1, 2] = -math.inf  # a zero-weight row
    V = torch.randn(B, M, 3, dtype=torch.float64)
    out = engine().plan_product(x, y, alpha, h, eps, V, c, weight)
    ref = DENSE.plan_product(x, y, alpha, h, eps, V, c, weight)
    assert out.shape == (B, N, 3)
    assert torch.equal(out[1, 2], torch.zeros(3, dtype=out.dtype))
    assert rel_err(out, ref) < 1e-10


@pytest.mark.parametrize("D", [3, 17])
def test_plan_product_float32_and_wide_V(D):
    """float32 points; K = 70 spans two 64-wide K tiles of the accumulator."""
    x, y, h = clouds(D)
    c, eps = get_cost("sqeuclidean"), eps_for(D)
    alpha = DENSE.softmin(x, y, h, eps, c) / eps
    V = torch.randn(B, M, 70, dtype=torch.float64)
    ref = DENSE.plan_product(x, y, alpha, h, eps, V, c, "plan")
    out = engine().plan_product(x.float(), y.float(), alpha.float(), h.float(), eps, V.float(), c, "plan")
    assert out.dtype == torch.float32
    assert rel_err(out, ref) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [3, 17])
def test_half_inputs_accumulate_in_float32(D, dtype):
    x, y, h = clouds(D, dtype)
    c, eps = get_cost("sqeuclidean"), eps_for(D)
    hf = h.float()
    out = engine().softmin(x, y, hf, eps, c)
    assert out.dtype == torch.float32
    ref = DENSE.softmin(x.double(), y.double(), h.double(), eps, c)
    assert rel_err(out, ref) < TOL[torch.float32]
    alpha = (ref / eps).float()
    V = torch.randn(B, M, 2)
    p = engine().plan_product(x, y, alpha, hf, eps, V, c, "plan")
    q = DENSE.plan_product(x.double(), y.double(), alpha.double(), h.double(), eps, V.double(), c, "plan")
    assert rel_err(p, q) < TOL[torch.float32]


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")
def test_all_minus_inf_rows_give_no_nan():
    x, y, h = clouds(3)
    c = get_cost("sqeuclidean")
    h[1] = -math.inf  # batch 1: no mass at all
    out = engine().softmin(x, y, h, 0.1, c)
    assert torch.isposinf(out[1]).all() and torch.isfinite(out[0]).all()
    alpha = torch.zeros(B, N, dtype=torch.float64)
    alpha[0, :3] = -math.inf
    V = torch.ones(B, M, 2, dtype=torch.float64)
    for w in ("plan", "cost", "dcost"):
        p = engine().plan_product(x, y, alpha, h, 0.1, V, c, w)
        assert not torch.isnan(p).any()
        assert (p[1] == 0).all() and (p[0, :3] == 0).all()
        assert rel_err(p, DENSE.plan_product(x, y, alpha, h, 0.1, V, c, w)) < 1e-10


def test_softmin_pair_is_two_softmins():
    x, y, h = clouds(17, n=37, m=70)
    hx = torch.randn(B, 37, dtype=torch.float64)
    hx[0, 0] = -math.inf
    c, eps = get_cost("half_sqeuclidean"), 0.2
    f, g = engine().softmin_pair(x, y, hx, h, eps, c)
    assert rel_err(f, DENSE.softmin(x, y, h, eps, c)) < 1e-10
    assert rel_err(g, DENSE.softmin(y, x, hx, eps, c)) < 1e-10


@pytest.mark.parametrize(
    "D,cost,dtype",
    [
        (3, "sqeuclidean", torch.float64),
        (17, "half_sqeuclidean", torch.float64),
        (3, "euclidean", torch.float64),
        (17, "sqeuclidean", torch.float32),
        (2, "half_sqeuclidean", torch.float32),
    ],
)
def test_gradients_match_dense_autograd(D, cost, dtype):
    x0, y0, h0 = clouds(D, seed=1)
    eps = eps_for(D)
    wts = torch.randn(B, N, dtype=torch.float64)

    def grads(backend, dt):
        x, y, h = (t.to(dt).detach().requires_grad_() for t in (x0, y0, h0))
        out = ops.softmin(x, y, h, eps, cost=cost, backend=backend)
        (out * wts.to(dt)).sum().backward()
        return out, x.grad, y.grad, h.grad

    ref = grads("dense", torch.float64)
    got = grads("triton", dtype)
    for a, b in zip(got, ref):
        assert a.dtype == dtype
        assert rel_err(a, b) < (1e-9 if dtype == torch.float64 else 5e-5)


def test_fold_matches_dense_in_float64():
    """The FlashSinkhorn bias-folded form (opt-in) is exact in float64."""
    eng = TritonEngine(fold=True)
    for D in (3, 64):
        x, y, h = clouds(D)
        c, eps = get_cost("sqeuclidean"), eps_for(D)
        assert rel_err(eng.softmin(x, y, h, eps, c), DENSE.softmin(x, y, h, eps, c)) < 1e-10
        alpha = DENSE.softmin(x, y, h, eps, c) / eps
        V = torch.randn(B, M, 2, dtype=torch.float64)
        for w in ("plan", "cost", "dcost"):
            ref = DENSE.plan_product(x, y, alpha, h, eps, V, c, w)
            assert rel_err(eng.plan_product(x, y, alpha, h, eps, V, c, w), ref) < 1e-10


def test_direct_threshold_and_tf32_option():
    """d = 5 through tl.dot (direct path off) and the TF32 opt-in both stay close."""
    x, y, h = clouds(5)
    c, eps = get_cost("sqeuclidean"), eps_for(5)
    ref = DENSE.softmin(x, y, h, eps, c)
    assert rel_err(TritonEngine(direct_max_d=0).softmin(x, y, h, eps, c), ref) < 1e-10
    out = TritonEngine(allow_tf32=True, direct_max_d=0).softmin(x.float(), y.float(), h.float(), eps, c)
    assert rel_err(out, ref) < 2e-2


def test_pinned_config(monkeypatch):
    x, y, h = clouds(3)
    c = get_cost("sqeuclidean")
    ref = DENSE.softmin(x, y, h, 0.1, c)
    monkeypatch.setenv("FLASHOT_TRITON_CONFIG", "BLOCK_N=16,BLOCK_M=64,num_warps=2")
    assert rel_err(TritonEngine().softmin(x, y, h, 0.1, c), ref) < 1e-10
    eng = TritonEngine(config="BLOCK_N=64,BLOCK_M=16")
    assert eng.config == KernelConfig(64, 16, 8, 2)  # unspecified keys take the defaults
    assert rel_err(eng.softmin(x, y, h, 0.1, c), ref) < 1e-10


@pytest.mark.parametrize(
    "spec,msg",
    [
        ("BLOCK_N=64,BLOCK_Q=3", "BLOCK_Q"),
        ("BLOCK_N=48", "BLOCK_N"),
        ("num_warps=3", "num_warps"),
        ("BLOCK_M=x", "BLOCK_M"),
    ],
)
def test_bad_config_is_a_clear_error(spec, msg):
    with pytest.raises(ValueError, match=msg):
        parse_config(spec)


def test_forcing_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"needs a CUDA tensor or TRITON_INTERPRET=1; use backend='tiled'"):
        get_engine("triton", device=CPU, dtype=torch.float32, cost=get_cost("sqeuclidean"))
    x, y, h = clouds(3, torch.float32)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        ops.softmin(x, y, h, 0.1, backend="triton")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        TritonEngine().softmin(x, y, h, 0.1, get_cost("sqeuclidean"))


def test_samples_loss_triton_matches_dense():
    g = torch.Generator().manual_seed(3)
    x = torch.rand(30, 3, generator=g, dtype=torch.float64)
    y = torch.rand(26, 3, generator=g, dtype=torch.float64) + 0.2
    for p in (1, 2):
        ref = flashot.SamplesLoss(p=p, blur=0.2, backend="dense")(x, y)
        xt = x.clone().requires_grad_()
        val = flashot.SamplesLoss(p=p, blur=0.2, backend="triton")(xt, y)
        assert abs(val.item() - ref.item()) <= 1e-9 * max(1.0, abs(ref.item()))
        (gx,) = torch.autograd.grad(val, xt)
        # p = 1: plain autograd through the dense engine's sqrt is NaN on the x-x
        # diagonal, so the gradient oracle there is the tiled engine (same formulas).
        xd = x.clone().requires_grad_()
        oracle = "dense" if p == 2 else "tiled"
        (gd,) = torch.autograd.grad(flashot.SamplesLoss(p=p, blur=0.2, backend=oracle)(xd, y), xd)
        assert rel_err(gx, gd) < 1e-8


_AOT_SCRIPT = r'''
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from flashot.ops.triton import kernels as K

assert not hasattr(K.softmin_kernel, "interpreter_builder"), "kernels were decorated in interpreter mode"
target = GPUTarget("cuda", 90, 32)


def comp(fn, ptrs, ints, cx):
    sig = {**ptrs, **{k: "i32" for k in ints}, **{k: "constexpr" for k in cx}}
    triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx), target=target,
                   options={"num_warps": 8, "num_stages": 2})


VARIANTS = {  # name: (BLOCK_D, D_STATIC, DIRECT, ONE_CHUNK, FOLD, COST)
    "direct d=3": (16, 3, True, False, False, 0),
    "dot d<=64": (64, 0, False, True, False, 0),
    "dot folded": (64, 0, False, True, True, 0),
    "dot chunked d>64": (32, 0, False, False, False, 0),
    "euclidean d>16": (16, 0, True, False, False, 1),
}
# (dtype, variant, kernels): all variants in float32, the dot path for the others.
CASES = [("fp32", v, ("softmin", "plan")) for v in VARIANTS] + [
    ("fp32", "dot d<=64", ("pair", "plan_cost", "plan_dcost")), ("fp32", "euclidean d>16", ("plan_dcost",)),
    ("fp64", "dot d<=64", ("softmin", "plan")), ("fp64", "direct d=3", ("softmin",)),
    ("fp16", "dot chunked d>64", ("softmin", "plan")), ("bf16", "dot d<=64", ("softmin",)),
    ("fp32", "direct d=3", ("softmin_bs", "plan_bs")), ("fp32", "dot d<=64", ("softmin_bs", "plan_bs")),
    ("fp64", "euclidean d>16", ("softmin_bs",))]  # the block-sparse (multiscale) kernels
QUICK = [("fp32", "dot d<=64", ("softmin", "plan", "pair")), ("fp32", "direct d=3", ("softmin_bs", "plan_bs"))]
if sys.argv[1:] == ["quick"]:  # one variant of each kernel (the default run)
    CASES = QUICK
else:  # the slow run: all the others
    seen = {(dt, var, k) for dt, var, kerns in QUICK for k in kerns}
    CASES = [(dt, var, tuple(k for k in kerns if (dt, var, k) not in seen)) for dt, var, kerns in CASES]
BS = {p: "*i64" for p in ("tiles_ptr", "cptr_ptr", "ranges_ptr")}
n = 0
for dt, var, kerns in CASES:
    acc = "fp64" if dt == "fp64" else "fp32"
    bd, dst, direct, one, fold, cost = VARIANTS[var]
    cx = dict(BLOCK_N=64, BLOCK_M=64, BLOCK_D=bd, D_STATIC=dst, DIRECT=direct, ONE_CHUNK=one, FOLD=fold,
              COST=cost, PREC="ieee", UPCAST=False)
    io = {"x_ptr": f"*{dt}", "y_ptr": f"*{dt}"}
    for k in kerns:
        if k == "softmin":
            comp(K.softmin_kernel, {**io, **{p: f"*{acc}" for p in ("h_ptr", "out_ptr", "prm_ptr")}},
                 ("N", "M", "D"), cx)
        elif k == "softmin_bs":
            comp(K.softmin_bs_kernel, {**io, **{p: f"*{acc}" for p in ("h_ptr", "out_ptr", "prm_ptr")}, **BS},
                 ("D",), cx)
        elif k == "plan_bs":
            comp(K.plan_bs_kernel, {**io, **{p: f"*{acc}" for p in ("beta_ptr", "alpha_ptr", "v_ptr", "out_ptr", "prm_ptr")},
                                    **BS}, ("D", "K"), {**cx, "BLOCK_K": 32, "WEIGHT": 0})
        elif k == "pair":
            comp(K.softmin_pair_kernel, {**io, **{p: f"*{acc}" for p in ("hy_ptr", "hx_ptr", "f_ptr", "g_ptr", "prm_ptr")}},
                 ("N", "M", "D", "TILES_X"), cx)
        else:
            w = {"plan": 0, "plan_cost": 1, "plan_dcost": 2}[k]
            comp(K.plan_kernel, {**io, **{p: f"*{acc}" for p in ("beta_ptr", "alpha_ptr", "v_ptr", "out_ptr", "prm_ptr")}},
                 ("N", "M", "D", "K"), {**cx, "BLOCK_K": 32, "WEIGHT": w})
        n += 1
print("compiled", n)
'''


@pytest.mark.parametrize("scope", ["quick", pytest.param("rest", marks=pytest.mark.slow)])
def test_kernels_compile_for_sm90(scope, tmp_path):
    """The compiled (non-interpreted) path: kernels go through Triton's NVIDIA backend and
    ptxas for sm_90 (no GPU needed), in a subprocess without TRITON_INTERPRET, so kernels are
    decorated as real JIT functions.  The default run compiles one variant of each of the five
    kernels; the slow run the other 20 of the 25 (every dtype, every dimension path, every cost)."""
    import subprocess
    import sys

    try:
        from triton.backends import backends
    except ImportError:  # pragma: no cover
        pytest.skip("triton without a backend registry")
    if "nvidia" not in backends:
        pytest.skip("triton's NVIDIA backend is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from Triton's cache
    r = subprocess.run([sys.executable, "-c", _AOT_SCRIPT, scope], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"compiled {5 if scope == 'quick' else 20}" in r.stdout, r.stdout


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")
def test_degenerate_shapes():
    x, y, h = clouds(3)
    c = get_cost("sqeuclidean")
    eng = engine()
    assert engine().plan_product(x, y, h[:, :N], h, 0.1, torch.zeros(B, M, 0, dtype=x.dtype), c).shape == (B, N, 0)
    out = eng.softmin(x, y[:, :0], h[:, :0], 0.1, c)  # empty sum: +inf, like the dense engine
    assert torch.isposinf(out).all()
    p = eng.plan_product(x, y[:, :0], h[:, :N], h[:, :0], 0.1, torch.ones(B, 0, 2, dtype=x.dtype), c)
    assert p.shape == (B, N, 2) and (p == 0).all()


def test_large_d_1024():
    """d = 1024: the feature axis is looped over in 32-wide chunks (x tile not kept on chip)."""
    x, y, h = clouds(1024, n=20, m=24)
    c, eps = get_cost("sqeuclidean"), 20.0
    ref = DENSE.softmin(x, y, h, eps, c)
    assert rel_err(engine().softmin(x, y, h, eps, c), ref) < 1e-10
    V = torch.randn(B, 24, 5, dtype=torch.float64)
    for w in ("plan", "cost"):
        out = engine().plan_product(x, y, ref / eps, h, eps, V, c, w)
        assert rel_err(out, DENSE.plan_product(x, y, ref / eps, h, eps, V, c, w)) < 1e-10
