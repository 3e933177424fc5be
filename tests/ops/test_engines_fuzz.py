"""Property-based fuzzing (hypothesis) of every engine against a float64 dense reference.

Targets: ``flashot.ops.softmin`` (value, and gradients in x, y, h), ``flashot.ops.plan_product``
(weights plan / cost / dcost), ``flashot.solve_sample`` (value, potentials, marginals) and
``flashot.SamplesLoss`` (value and gradients in both clouds), ``flashot.solve`` on cost matrices given
dense and lazy (value, marginals and plan from reg 0.1 to 1e20 x the cost spread; the errors of malformed
lazy matrices: section "solve(M)" below), on the engines ``dense``, ``tiled``
and ``cpu`` plus variants registered for this module only (``tiled`` with 1-, 37- and
777-element tiles; ``cpu`` streamed-only, cached-matrix, and either micro-kernel shape), and
``triton`` through its interpreter in the long profile.

Problems (:func:`problems`): batched or not (B = 1..3), N and M from 1 (often exactly 1) to 300,
d in {1, 2, 3, 5, 16, 1000}, contiguous or strided views, dtypes float64 / float32 / float16 /
bfloat16 (half precision is computed in float32), coordinate scales 1e-4..1e4, offsets up to 1e5, blur 1e-4..1e3 x the
diameter (temperature ``eps = blur^p``: 1e-8..1e6 x the squared diameter for squared costs),
weights spread over up to 30 decades, zero weights, duplicated points (within a cloud and
across the clouds).

The reference is written here and in tests/references.py, independently of the library: the explicit float64 cost
matrix of the points *as rounded to the dtype under test* and ``torch.logsumexp``.  The
solvers are compared iterate for iterate: the reference replays the documented iteration
(``solver.py``: alternating updates from zero potentials, or GeomLoss' averaged symmetric
updates from the softmins of the log-weights, then one parallel final update;
``SamplesLoss``: the same symmetric loop over the epsilon-scaling schedule, debiasing
potentials alongside, final step differentiable w.r.t. the output side's points only).
``solve_sample`` runs with ``tol=None`` (exactly ``max_iter`` = 1..12 iterations) and
``eps_scaling=False`` for that comparison; with the default ``eps_scaling=None`` (a schedule
not replayed here) only the schedule-free facts are checked.

Allowed outcomes: agreement within the tolerance below, or a documented ``ValueError`` naming
the argument (only for inputs that the cast to the dtype under test made non-finite, and for
balanced weights whose masses the rounding to bfloat16 made differ by more than 1e-3).  NaN or
Inf in an output of valid input is a failure, except +-Inf where the reference plus its
tolerance overflows the output dtype (IEEE overflow of the requested type: float16 outputs
above 65504, marginals of an early Sinkhorn iterate above 1e308).  One region is excluded, with a
comment at the check: plan products whose plan *entries* overflow the compute dtype.  (The
``dense`` engine's NaN instead of +-Inf where an exact plan product overflows, found here, is
fixed: tests/ops/test_dense_overflow.py.)

Tolerances (one place: the constants below), as absolute bounds derived from the rounding unit
``u`` of the *compute* dtype (2^-53 float64, 2^-24 float32, also for float16 / bfloat16
inputs) plus the output dtype's own rounding (and subnormal spacing):

* softmin ``-eps log sum_j exp(h_j - C_ij / eps)``: the cost tile is formed with an absolute
  error ``~ u * sqrt(d) * cbox`` (GEMM expansion of centred points; ``cbox`` = the cost of the
  bounding-box diagonal), ``h_j`` is held to ``u |h_j|``, and a sum of M exponentials is off by
  at most ``M u`` relatively, i.e. ``eps M u`` after ``-eps log``; the cpu kernels add ``H u eps``
  (their running max sits up to ``H`` above the largest exponent: :data:`HEADROOM`).  So
  ``|out - ref| <= K_SOFTMIN u (DF cbox + eps (max|h| + M + 4 + H) + max|ref|)``, ``DF = 1 + sqrt(d) / 4``.
  Relative to eps this is the usual "float32 error ~ |cost| / eps * 2^-24".
* plan products: each term ``exp(alpha_i + beta_j - C_ij / eps)`` has its exponent off by
  ``r = K_PLAN u (|alpha| + |beta| + DF cbox / eps + M + 4)``: a relative error ``expm1(r)`` of
  ``sum_j |P_ij W_ij V_j|`` (plus ``u DF cbox sum_j P_ij |V_j|`` for ``W = C``, ``u DF cbox / C`` relative
  for ``W = 1 / C``), and the terms every engine drops or flushes (:data:`DROP`, :data:`FLUSH`,
  FTZ).  With ``u r >~ 1`` (float32 at eps ~ 1e-8 cbox) float32 resolves the exponent, not the value.
* solvers: every softmin step is non-expansive in the sup norm (shifting ``h`` by ``t / eps``
  shifts the output by at most ``t``), so the float32 errors of K steps add up at most
  linearly: potentials within ``(2 K + 4) delta``, with ``delta`` the softmin bound above taken
  at the largest potentials the reference visits; values within ``(|a| + |b|) x`` that.
  Marginals (rebuilt from the returned potentials): relative ``expm1(r)`` as for plan products.
  Gradients ``sum_j pi_ij w_ij (x_i - y_j)``: the row weights ``pi`` carry a relative error of
  ``expm1(2 (potential error + u DF cbox) / eps)``.  In float32 at ``blur = 1e-4`` of the
  diameter this exceeds 1, and the check reduces to finiteness and the magnitude bound
  ``|grad_i| <= 2 sum_j pi_ij |w_ij| |x_i - y_j|`` (true for the exact gradient): the honest
  float32 limit, not a loosened test.
* Measured (``--hypothesis-show-statistics`` prints the ``max err/tol`` buckets; the search is
  steered towards the worst ratio with ``hypothesis.target``): the largest errors seen in
  thousands of random examples per target are 0.1-0.7 of these bounds (the safety factors
  ``K_* = 16`` cover the constants the first-order bounds leave out).

Profiles: ``ci`` (default: 250-600 examples per target, derandomized so CI is deterministic,
no example database, one intra-op thread; the file runs in ~11 s on two cores at load 3, 45 s
at load 8) and ``long`` (``FLASHOT_FUZZ=long``: 3,000-10,000 fresh random examples per target,
default threads, the ``triton`` engine through its interpreter when Triton is installed, its
examples limited to B N M <= 400; expect an hour or more).  The profiles are
registered here and applied per test, not loaded globally, so other test files keep their own
hypothesis settings.  Run the long one with::

    FLASHOT_FUZZ=long .venv/bin/python -m pytest tests/ops/test_engines_fuzz.py -x -q --hypothesis-show-statistics

``FLASHOT_FUZZ_EXAMPLES=N`` overrides the number of examples per target and
``FLASHOT_FUZZ_ENGINES=triton,cpu`` restricts the engines.  A failure prints the example
(its seed regenerates the tensors) and a ``@reproduce_failure`` blob.
"""

from __future__ import annotations

import math
import os
import warnings

import pytest

hypothesis = pytest.importorskip("hypothesis")
from fuzzing import PROFILE, fuzz_settings  # noqa: E402  (the profiles: tests/fuzzing.py)

if PROFILE == "long":
    # the triton engine runs on the CPU only through its interpreter, which must be on before
    # the kernels are decorated (tests/ops/test_triton.py does the same at import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from hypothesis import assume, event, given, note, target  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import flashot  # noqa: E402
from flashot import ops  # noqa: E402
from flashot.costs import get_cost  # noqa: E402
from flashot.schedules import epsilon_scaling  # noqa: E402
from references import softmin as ref_softmin  # noqa: E402  (-eps log sum_j exp(h_j - C_ij / eps))

# --------------------------------------------------------------------------------------------
# engines


def _available(name: str) -> bool:
    try:
        eng = ops.get_engine(name, device=torch.device("cpu"), dtype=torch.float32, cost=get_cost("sqeuclidean"))
    except Exception:  # noqa: BLE001 - not built / not installed here
        return False
    return eng.name == name


ENGINES = [e for e in ("dense", "tiled", "cpu") if _available(e)]
if PROFILE == "long" and os.environ.get("TRITON_INTERPRET") == "1" and _available("triton"):
    ENGINES.append("triton")
if os.environ.get("FLASHOT_FUZZ_ENGINES"):  # e.g. FLASHOT_FUZZ_ENGINES=triton,cpu: fuzz only these
    _want = [e.strip() for e in os.environ["FLASHOT_FUZZ_ENGINES"].split(",") if e.strip()]
    ENGINES = [e for e in _want if e in ENGINES]
    if not ENGINES:
        raise RuntimeError(f"FLASHOT_FUZZ_ENGINES={os.environ['FLASHOT_FUZZ_ENGINES']!r}: none available here")


# Variants of our engines, registered (public register_engine) for this module's tests only:
# tiny tiles for ``tiled`` (ragged row / column blocks, one-row tiles), and the ``cpu`` engine's
# streamed-only and cached-matrix modes and its two micro-kernel shapes.
def _variant_loaders() -> dict:
    from flashot.ops.tiled import TiledEngine

    out = {f"tiled~{k}": (lambda k=k: TiledEngine(tile_elems=k)) for k in (1, 37, 777)}
    if "cpu" in ENGINES:
        from flashot.ops.cpu.engine import CpuEngine

        out.update(
            {
                "cpu~stream": lambda: CpuEngine(mode="stream"),
                "cpu~cache": lambda: CpuEngine(mode="cache"),
                "cpu~cfg0": lambda: CpuEngine(cfg=0),
                "cpu~cfg3": lambda: CpuEngine(cfg=3),
            }
        )
    return {k: v for k, v in out.items() if k.split("~")[0] in ENGINES}


VARIANTS = _variant_loaders()
ENGINE_CHOICES = st.sampled_from(ENGINES + sorted(VARIANTS))


def sized(engine: str, p: dict) -> str:
    """Tiles of 1 or 37 elements loop in Python over every row: only for small problems (time).
    The Triton interpreter takes ~2.5 s per softmin at 300 x 300 (0.03 s at 20 x 20): triton
    examples are limited to B N M <= 400 (larger draws are rejected)."""
    pairs = (p["B"] or 1) * p["n"] * p["m"]
    if engine in ("tiled~1", "tiled~37") and pairs > 2000:
        return "tiled~777"
    assume(not (base(engine) == "triton" and pairs > 400))
    return engine


def base(engine: str) -> str:
    """The engine's own name (``"cpu~stream"`` -> ``"cpu"``)."""
    return engine.split("~")[0]


@pytest.fixture(scope="module", autouse=True)
def _engine_variants():
    for name, loader in VARIANTS.items():
        ops.register_engine(name, loader)
    yield
    for name in VARIANTS:
        ops.unregister_engine(name)


pytestmark = pytest.mark.usefixtures("one_thread") if PROFILE == "ci" else []

# --------------------------------------------------------------------------------------------
# tolerances (one place)

# rounding unit of the compute dtype: float16 / bfloat16 inputs are computed in float32
_U = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.float16: 2.0**-24, torch.bfloat16: 2.0**-24}
# rounding unit of the output dtype (results are cast back to the input dtype)
_U_OUT = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
K_SOFTMIN = 16.0  # safety factor over the first-order bound of one softmin (see the docstring)
K_PLAN = 16.0  # same, plan products (relative to sum |P W V|)
K_GRAD = 16.0  # same, gradients
# every engine drops the terms of a sum below exp(floor) x the largest term (ops/base.py exp_floor:
# -87 in float32, -708 in float64), and float32 kernels flush denormals: allowance per term
DROP = {torch.float32: math.exp(-87.0), torch.float64: math.exp(-708.0)}
# The cpu kernels set exponentials below 2^-124 (float32) / 2^-1009 (float64) to exactly 0
# (kernels.cpp Consts<T>::LO; no denormal reaches memory): an absolute allowance per term.
FLUSH = {torch.float32: 2.0**-124, torch.float64: 2.0**-1009}
# The cpu kernels keep their running max up to H above the largest exponent (kernels.cpp
# Consts<T>::H: 100 in float64, 30 in float32), so m + log2(sum) rounds two numbers of size ~H:
# an extra error of ~ H u eps in a softmin (measured: up to 87 u eps in float64, single term).
HEADROOM = {"cpu": {torch.float64: 100.0, torch.float32: 30.0}}


def headroom(engine: str, dtype: torch.dtype) -> float:
    return HEADROOM.get(engine, {}).get(torch.float64 if dtype == torch.float64 else torch.float32, 0.0)


def unit(dtype: torch.dtype) -> float:
    return _U[dtype]


def dim_factor(d: int) -> float:
    """Growth of the rounding error of a length-d dot product (sqrt(d) typical; generous)."""
    return 1.0 + math.sqrt(d) / 4.0


# --------------------------------------------------------------------------------------------
# the float64 reference (independent of the library)

P_OF = {"sqeuclidean": 2, "half_sqeuclidean": 2, "euclidean": 1, "euclidean_geomloss": 1}


def ref_cost(x: torch.Tensor, y: torch.Tensor, cost: str) -> torch.Tensor:
    """Explicit (B, N, M) cost matrix from coordinate differences, float64; differentiable, with
    a zero gradient of |x - y| at coincident points (the library's convention)."""
    d2 = ((x.unsqueeze(-2) - y.unsqueeze(-3)) ** 2).sum(-1)
    if cost == "sqeuclidean":
        return d2
    if cost == "half_sqeuclidean":
        return d2 / 2
    if cost == "euclidean_geomloss":
        d2 = d2.clamp_min(1e-8)
    pos = d2 > 0
    safe = torch.where(pos, d2, torch.ones_like(d2))
    return torch.where(pos, safe.sqrt(), torch.zeros_like(d2))


def ref_dcost_weight(C: torch.Tensor, cost: str) -> torch.Tensor:
    if cost == "sqeuclidean":
        return torch.full_like(C, 2.0)
    if cost == "half_sqeuclidean":
        return torch.ones_like(C)
    if cost == "euclidean":
        return torch.where(C > 0, 1.0 / torch.where(C > 0, C, torch.ones_like(C)), torch.zeros_like(C))
    raise AssertionError(cost)


def bbox_cost(x: torch.Tensor, y: torch.Tensor, cost: str) -> float:
    """Cost of the joint bounding box's diagonal (all batches), float64."""
    pts = torch.cat([x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])]).double()
    diag2 = float(((pts.amax(0) - pts.amin(0)) ** 2).sum())
    return {"sqeuclidean": diag2, "half_sqeuclidean": diag2 / 2}.get(cost, math.sqrt(diag2))


def finite_max(t: torch.Tensor) -> float:
    t = t.detach().double()
    t = t[torch.isfinite(t)]
    return float(t.abs().max()) if t.numel() else 0.0


def batched(t: torch.Tensor, is_batched: bool) -> torch.Tensor:
    return t if is_batched else t.unsqueeze(0)


# --------------------------------------------------------------------------------------------
# problem generation


class Problem(dict):
    """The drawn problem; printed by its description (the seed regenerates the tensors)."""

    def __repr__(self) -> str:
        return f"<{self['desc']}>"


DTYPES = [torch.float64, torch.float32, torch.float32, torch.float16, torch.bfloat16]


@st.composite
def problems(draw, *, max_n: int = 24, big_n: int = 300, dtypes=DTYPES):
    """Two clouds with weights, as float64 values already rounded to ``dtype`` (see ``cast``).

    Sizes: 1, up to ``max_n``, or (d <= 16) up to ``big_n``: several vector blocks and padded
    column panels of the cpu kernels (64 columns), ragged edges."""
    dtype = draw(st.sampled_from(dtypes))
    B = draw(st.sampled_from([None, None, 1, 2, 3]))
    d = draw(st.sampled_from([1, 1, 2, 3, 5, 16, 1000]))
    cap = 6 if d >= 100 else max_n
    size = st.one_of(st.just(1), st.integers(1, cap), st.integers(cap, big_n if d < 100 else cap))
    n = draw(size)
    m = draw(size)
    log_scale = draw(st.floats(-4.0, 4.0))
    log_offset = draw(st.one_of(st.none(), st.floats(0.0, 5.0)))
    dup = draw(st.sampled_from(["none", "none", "within", "across", "all"]))
    skew = draw(st.sampled_from([0.0, 0.0, 3.0, 12.0, 30.0]))  # decades spanned by the weights
    zeros = draw(st.sampled_from([0.0, 0.0, 0.3]))
    strided = draw(st.sampled_from([False, False, True]))  # non-contiguous views of every input
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    Bs = B or 1
    scale = 10.0**log_scale
    x = torch.randn(Bs, n, d, generator=g, dtype=torch.float64) * scale
    y = torch.randn(Bs, m, d, generator=g, dtype=torch.float64) * scale + 0.5 * scale
    if log_offset is not None:
        off = (torch.rand(d, generator=g, dtype=torch.float64) * 2 - 1) * 10.0**log_offset
        x, y = x + off, y + off
    if dup == "within" and n > 1:
        k = torch.randint(0, n, (n,), generator=g)
        x = x[:, k]
    elif dup == "across":
        k = torch.randint(0, n, (m,), generator=g)
        take = torch.rand(m, generator=g) < 0.5
        y = torch.where(take[None, :, None], x[:, k], y)
    elif dup == "all":  # every point of y is a point of x, and x has repeats
        x = x[:, torch.randint(0, n, (n,), generator=g)]
        y = x[:, torch.randint(0, n, (m,), generator=g)]

    def weights(k):
        w = 10.0 ** (-skew * torch.rand(Bs, k, generator=g, dtype=torch.float64))
        if zeros and k > 1:
            z = torch.rand(Bs, k, generator=g) < zeros
            z[:, torch.randint(0, k, (1,), generator=g)] = False  # keep some mass
            w = w.masked_fill(z, 0.0)
        return w / w.sum(-1, keepdim=True)

    a, b = weights(n), weights(m)
    return Problem(
        dtype=dtype,
        B=B,
        n=n,
        m=m,
        d=d,
        x=x,
        y=y,
        a=a,
        b=b,
        seed=seed,
        scale=scale,
        strided=strided,
        gen=g,
        desc=f"dtype={dtype} B={B} n={n} m={m} d={d} scale=1e{log_scale:.2f} "
        f"offset={None if log_offset is None else f'1e{log_offset:.2f}'} dup={dup} "
        f"skew={skew} zeros={zeros} strided={strided} seed={seed}",
    )


def cast(
    t: torch.Tensor, dtype: torch.dtype, is_batched: bool, strided: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input for the library, its float64 value for the reference): the reference sees the
    rounded input, so only the computation is measured.  ``strided``: a non-contiguous view
    (every other element of a wider tensor) with the same values."""
    ti = t.to(dtype)
    ti = ti if is_batched else ti[0]
    if strided:
        ti = torch.stack([ti, torch.full_like(ti, float("nan"))], -1)[..., 0]
        assert not ti.is_contiguous() or ti.numel() <= 1
    return ti, batched(ti.double(), is_batched)


def temperature(p: dict, cost: str, log_ratio: float) -> tuple[float, float]:
    """(eps, blur) with blur = ratio x the diameter of the rounded clouds (their coordinate scale
    when they collapsed to one point) and eps = blur^p."""
    x = p["x"].to(p["dtype"]).double()
    y = p["y"].to(p["dtype"]).double()
    pts = torch.cat([x.reshape(-1, p["d"]), y.reshape(-1, p["d"])])
    pts = pts[torch.isfinite(pts).all(-1)]
    diam = float((pts.amax(0) - pts.amin(0)).norm()) if pts.numel() else 0.0
    if not diam > 0:
        diam = p["scale"]
    blur = 10.0**log_ratio * diam
    eps = blur ** P_OF[cost]
    return eps, blur


def nonfinite_inputs(**tensors: torch.Tensor) -> list[str]:
    return [k for k, t in tensors.items() if not bool(torch.isfinite(t).all())]


def expect_documented_error(names: list[str], fn) -> None:
    """Inputs made non-finite by the cast: the call must raise ValueError naming one of them."""
    event("outcome: documented ValueError (input non-finite after the cast)")
    with pytest.raises(ValueError) as info:
        fn()
    msg = str(info.value)
    assert any(nm in msg for nm in names), msg


def check_close(out: torch.Tensor, ref: torch.Tensor, tol, what: str) -> None:
    """``|out - ref| <= tol`` elementwise, ``out`` (any dtype) against the float64 ``ref``.

    Non-finite outputs fail, except +-Inf where ``|ref| + tol`` overflows ``out``'s dtype (IEEE
    overflow of the requested type, e.g. float16 outputs above 65504)."""
    event("outcome: compared")
    out = out.detach()
    ref = ref.detach().double()
    tol = torch.as_tensor(tol, dtype=torch.float64).detach()
    tol = tol.expand_as(ref) if tol.dim() == 0 else tol
    fi = torch.finfo(out.dtype)
    tol = tol + 2 * fi.tiny * fi.eps  # the output dtype's subnormal spacing (float16 outputs below 6e-5)
    o = out.double()
    may_overflow = (ref.abs() + tol) > fi.max
    ok_inf = torch.isinf(o) & (may_overflow | (o == ref)) & ((o > 0) == (ref > 0))
    bad_nf = ~torch.isfinite(o) & ~ok_inf
    assert not bool(bad_nf.any()), f"{what}: non-finite output {o[bad_nf][:5]} where the reference is {ref[bad_nf][:5]}"
    err = torch.where(ok_inf, torch.zeros_like(o), (o - ref).abs())
    excess = torch.where(torch.isfinite(tol), err - tol, torch.full_like(err, -1.0))
    ratio = torch.where(torch.isfinite(tol) & (tol > 0), err / tol, torch.zeros_like(err))
    worst = float(ratio.max()) if ratio.numel() else 0.0
    # steer the search towards the largest error relative to its bound (targeted PBT), and report
    # how close the runs come to the bounds (--hypothesis-show-statistics)
    target(worst, label=what)
    event(f"max err/tol, {what.split('[')[0]}: " + ("0" if worst == 0 else f"1e{math.floor(math.log10(worst))}"))
    if excess.numel() and float(excess.max()) > 0:
        i = int(excess.flatten().argmax())
        raise AssertionError(
            f"{what}: |out - ref| = {float(err.flatten()[i]):.3g} > tol {float(tol.flatten()[i]):.3g} "
            f"(out {float(o.flatten()[i]):.6g}, ref {float(ref.flatten()[i]):.6g}, max|ref| {finite_max(ref):.3g})"
        )


def check_grad(got: torch.Tensor, want: torch.Tensor, tol_pt: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """Per-point gradients (..., D): ``|got_i - want_i| <= tol_pt_i`` plus the output dtype's rounding
    (and subnormal spacing) per coordinate; +-Inf only where the gradient may exceed the output
    dtype (float16 above 65504)."""
    got = got.double()
    fo, d = torch.finfo(dtype), got.shape[-1]
    full = tol_pt + (2 * _U_OUT[dtype] * want.norm(dim=-1) + 2 * fo.tiny * fo.eps) * math.sqrt(d) + 1e-300
    over = (want.abs() + full.unsqueeze(-1)) > fo.max
    assert bool((torch.isfinite(got) | over).all()), f"{what}: non-finite {got[~torch.isfinite(got)][:4]}"
    fin = torch.isfinite(got).all(-1)
    check_ratio((got - want).norm(dim=-1)[fin], full[fin], what)


def check_ratio(err: torch.Tensor, tol: torch.Tensor, what: str) -> None:
    """``err <= tol`` elementwise (errors already reduced, e.g. per-point vector norms)."""
    ratio = err / tol
    worst = float(ratio.max()) if ratio.numel() else 0.0
    target(worst, label=what)
    event(f"max err/tol, {what.split('[')[0]} grad: " + ("0" if worst == 0 else f"1e{math.floor(math.log10(worst))}"))
    if worst > 1:
        i = int(ratio.flatten().argmax())
        raise AssertionError(f"{what}: error {float(err.flatten()[i]):.3g} > tol {float(tol.flatten()[i]):.3g}")


COSTS_OPS = ["sqeuclidean", "half_sqeuclidean", "euclidean", "euclidean_geomloss"]
LOG_BLUR = st.floats(-4.0, 3.0)  # blur = 1e-4 .. 1e3 x the diameter


# --------------------------------------------------------------------------------------------
# softmin


@fuzz_settings(600, 10000)
@given(
    p=problems(),
    engine=ENGINE_CHOICES,
    cost=st.sampled_from(COSTS_OPS),
    log_blur=LOG_BLUR,
    hmode=st.sampled_from(["logw", "potential", "wild"]),
)
def test_softmin(p, engine, cost, log_blur, hmode):
    engine = sized(engine, p)
    note(p["desc"] + f" engine={engine} cost={cost} log_blur={log_blur:.3f} hmode={hmode}")
    dtype, isb = p["dtype"], p["B"] is not None
    eps, _ = temperature(p, cost, log_blur)
    x, x64 = cast(p["x"], dtype, isb, p["strided"])
    y, y64 = cast(p["y"], dtype, isb, p["strided"])
    cbox = bbox_cost(x64, y64, cost) if torch.isfinite(x64).all() and torch.isfinite(y64).all() else math.inf
    g = p["gen"]
    h = p["b"].log()  # -inf at zero weights
    if hmode == "potential":  # log b + g / eps with g of the size of the costs
        h = h + (torch.rand(h.shape, generator=g, dtype=torch.float64) * 2 - 1) * min(cbox, 1e300) / eps
    elif hmode == "wild":  # large unrelated log-weights
        h = h + torch.randn(h.shape, generator=g, dtype=torch.float64) * 30
    h_in, h64 = cast(h, dtype, isb, p["strided"])
    bad = nonfinite_inputs(x=x, y=y) + (["h"] if bool((torch.isnan(h_in) | torch.isposinf(h_in)).any()) else [])
    note(f"eps={eps:.3g} cbox={cbox:.3g}")
    if bad:
        expect_documented_error(bad, lambda: ops.softmin(x, y, h_in, eps, cost=cost, backend=engine))
        return
    if not bool(torch.isfinite(h64).any(-1).all()):
        return  # a row of zero weights only (h rounded to -inf everywhere): +inf, covered elsewhere
    out = batched(ops.softmin(x, y, h_in, eps, cost=cost, backend=engine), isb)
    assert out.dtype == dtype and out.shape == h64.shape[:1] + x64.shape[1:2]
    ref = ref_softmin(ref_cost(x64, y64, cost), h64, eps)
    u = unit(dtype)
    tol = (
        K_SOFTMIN
        * u
        * (
            dim_factor(p["d"]) * cbox
            + eps * (finite_max(h64) + p["m"] + 4 + headroom(base(engine), dtype))
            + finite_max(ref)
        )
    )
    tol = tol + 2 * _U_OUT[dtype] * ref.abs()
    check_close(out, ref, tol, f"softmin[{engine}]")


@fuzz_settings(250, 5000)
@given(
    p=problems(big_n=100),
    engine=ENGINE_CHOICES,
    cost=st.sampled_from(COSTS_OPS[:3]),
    log_blur=LOG_BLUR,
    hmode=st.sampled_from(["logw", "potential"]),
)
def test_softmin_grad(p, engine, cost, log_blur, hmode):
    """Gradients of ``<w, softmin(x, y, h)>`` in x, y and h (-inf entries of h included)."""
    engine = sized(engine, p)
    note(p["desc"] + f" engine={engine} cost={cost} log_blur={log_blur:.3f} hmode={hmode}")
    dtype, isb = p["dtype"], p["B"] is not None
    eps, _ = temperature(p, cost, log_blur)
    x, x64 = cast(p["x"], dtype, isb, p["strided"])
    y, y64 = cast(p["y"], dtype, isb, p["strided"])
    if nonfinite_inputs(x=x, y=y):
        return  # the ValueError is checked by test_softmin
    cbox = bbox_cost(x64, y64, cost)
    g = p["gen"]
    h = p["b"].log()
    if hmode == "potential":
        h = h + (torch.rand(h.shape, generator=g, dtype=torch.float64) * 2 - 1) * cbox / eps
    h_in, h64 = cast(h, dtype, isb, p["strided"])
    if bool((torch.isnan(h_in) | torch.isposinf(h_in)).any()) or not bool(torch.isfinite(h64).any(-1).all()):
        return
    w = torch.randn(h64.shape[0], p["n"], generator=g, dtype=torch.float64)  # the outer weights
    xg, yg, hg = (t.detach().clone().requires_grad_() for t in (x, y, h_in))
    out = ops.softmin(xg, yg, hg, eps, cost=cost, backend=engine)
    gx, gy, gh = torch.autograd.grad((batched(out, isb).double() * w).sum(), [xg, yg, hg])
    x64g, y64g, h64g = (t.clone().requires_grad_() for t in (x64, y64, h64))
    ref = ref_softmin(ref_cost(x64g, y64g, cost), h64g, eps)
    rx, ry, rh = torch.autograd.grad((ref * w).sum(), [x64g, y64g, h64g])
    # the softmax weights pi_ij carry a relative error expm1(r): r = the softmin bound / eps
    u, DF = unit(dtype), dim_factor(p["d"])
    r = K_GRAD * u * (DF * cbox + eps * (finite_max(h64) + p["m"] + 4 + headroom(base(engine), dtype))) / eps
    # (+ the output dtype's rounding of the upstream gradient w and of the results)
    amp = math.expm1(min(r, 50.0)) + 4 * _U_OUT[dtype]
    C = ref_cost(x64, y64, cost)
    pi = torch.softmax(h64.unsqueeze(-2) - C / eps, -1) * w.abs().unsqueeze(-1)  # (B, N, M), rows |w_i|
    wc = ref_dcost_weight(C, cost)
    dist = (x64.unsqueeze(-2) - y64.unsqueeze(-3)).norm(dim=-1)
    diam = math.sqrt(bbox_cost(x64, y64, "sqeuclidean"))
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    under = DROP[cdt] * (p["m"] + 1) + (p["m"] + 2) * torch.finfo(cdt).tiny  # dropped / flushed terms
    tol_x = (
        amp * (pi * wc * dist).sum(-1)
        + K_GRAD * u * DF * diam * (pi * wc).sum(-1)
        + under * w.abs() * (wc * dist).amax(-1)
    )
    tol_y = (
        amp * (pi * wc * dist).sum(-2)
        + K_GRAD * u * DF * diam * (pi * wc).sum(-2)
        + under * (w.abs().unsqueeze(-1) * wc * dist).amax(-2) * p["n"]
    )
    tol_h = amp * eps * pi.sum(-2) + under * eps * w.abs().sum(-1, keepdim=True)
    # intermediates below the smallest normal number are flushed (FTZ) whatever they multiply
    ftz = (p["n"] + p["m"] + 4) * torch.finfo(cdt).tiny * float(w.abs().max())
    tol_x, tol_y = tol_x + ftz, tol_y + ftz
    for got, want, tol, name in ((gx, rx, tol_x, "x"), (gy, ry, tol_y, "y")):
        check_grad(batched(got, isb), want, tol, dtype, f"softmin[{engine}] grad {name}")
    check_close(batched(gh, isb), rh, tol_h, f"softmin[{engine}] grad h")
    zero = torch.isneginf(h64)
    if bool(zero.any()):  # zero weights get exactly zero gradient
        assert bool((batched(gh, isb).double()[zero] == 0).all()), f"softmin[{engine}] grad h at -inf entries"


# --------------------------------------------------------------------------------------------
# plan products


@fuzz_settings(600, 10000)
@given(
    p=problems(),
    engine=ENGINE_CHOICES,
    cost=st.sampled_from(COSTS_OPS),
    log_blur=LOG_BLUR,
    weight=st.sampled_from(["plan", "cost", "dcost"]),
    k=st.sampled_from([None, 1, 3]),
    noise=st.sampled_from([0.0, 1.0, 5.0]),
)
def test_plan_product(p, engine, cost, log_blur, weight, k, noise):
    if weight == "dcost" and cost == "euclidean_geomloss":
        cost = "euclidean"  # the clamp's threshold makes w discontinuous at |x - y| = 1e-4: not fuzzable
    engine = sized(engine, p)
    note(p["desc"] + f" engine={engine} cost={cost} log_blur={log_blur:.3f} weight={weight} k={k} noise={noise}")
    dtype, isb = p["dtype"], p["B"] is not None
    eps, _ = temperature(p, cost, log_blur)
    x, x64 = cast(p["x"], dtype, isb, p["strided"])
    y, y64 = cast(p["y"], dtype, isb, p["strided"])
    g = p["gen"]
    Bs, n, m = x64.shape[0], p["n"], p["m"]
    if nonfinite_inputs(x=x, y=y):
        V = torch.ones(y.shape[:-1], dtype=dtype)
        z = torch.zeros(x.shape[:-1], dtype=dtype)
        expect_documented_error(
            nonfinite_inputs(x=x, y=y),
            lambda: ops.plan_product(
                x, y, z, torch.zeros(y.shape[:-1], dtype=dtype), eps, V, cost=cost, weight=weight, backend=engine
            ),
        )
        return
    cbox = bbox_cost(x64, y64, cost)
    C = ref_cost(x64, y64, cost)
    # scaled potentials: beta = log b (+ noise), alpha the matching c-transform (+ noise): rows of
    # the plan sum to about a_i, as in a Sinkhorn plan, and nothing overflows
    beta = p["b"].log() + noise * torch.randn(Bs, m, generator=g, dtype=torch.float64)
    alpha = p["a"].log() - torch.logsumexp(beta.unsqueeze(-2) - C / eps, -1)
    alpha = alpha + noise * torch.randn(Bs, n, generator=g, dtype=torch.float64)
    alpha_in, alpha64 = cast(alpha, dtype, isb, p["strided"])
    beta_in, beta64 = cast(beta, dtype, isb, p["strided"])
    Vshape = (Bs, m) if k is None else (Bs, m, k)
    V = torch.randn(Vshape, generator=g, dtype=torch.float64) * 10.0 ** float(torch.randint(-3, 4, (1,), generator=g))
    V_in, V64 = cast(V, dtype, isb, p["strided"])
    bad = [nm for nm, t in (("alpha", alpha_in), ("beta", beta_in)) if bool((torch.isnan(t) | torch.isposinf(t)).any())]
    bad += nonfinite_inputs(V=V_in)
    if bad:
        expect_documented_error(
            bad, lambda: ops.plan_product(x, y, alpha_in, beta_in, eps, V_in, cost=cost, weight=weight, backend=engine)
        )
        return
    out = ops.plan_product(x, y, alpha_in, beta_in, eps, V_in, cost=cost, weight=weight, backend=engine)
    assert out.dtype == dtype
    out = batched(out, isb)
    V3 = V64 if k is not None else V64.unsqueeze(-1)
    out3 = out if k is not None else out.unsqueeze(-1)
    P = torch.exp(alpha64.unsqueeze(-1) + beta64.unsqueeze(-2) - C / eps)
    W = {"plan": torch.ones_like(C), "cost": C, "dcost": ref_dcost_weight(C, cost) if weight == "dcost" else None}[
        weight
    ]
    ref = (P * W) @ V3
    absref = (P * W.abs()) @ V3.abs()
    u, DF = unit(dtype), dim_factor(p["d"])
    rel = DF * cbox / eps + finite_max(alpha64) + finite_max(beta64) + m + 4
    # an exponent off by K u rel: a relative error of expm1(K u rel) (beyond 1 when u rel ~ 1: float32 at
    # eps ~ 1e-8 cbox resolves the exponent, not the value)
    tol = math.expm1(min(K_PLAN * u * rel, 700.0)) * absref
    if weight == "cost":  # C itself carries an absolute error ~ u DF cbox
        tol = tol + K_PLAN * u * DF * cbox * (P @ V3.abs())
    if weight == "dcost" and cost == "euclidean":  # w = 1 / C: relative error u DF cbox / C
        tol = tol + K_PLAN * u * DF * cbox * ((P * W * W) @ V3.abs())
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    # terms below exp(floor) x the row's largest are dropped (or flushed to zero) by every engine
    rowmax = P.amax(-1, keepdim=True)
    tol = tol + 2 * DROP[cdt] * (m + 1) * rowmax * finite_max(V3) * max(1.0, finite_max(W))
    # ... and plan entries below FLUSH are exactly 0 in the cpu kernels (denormals flushed)
    tol = tol + FLUSH[cdt] * (W.abs() @ V3.abs())
    # ... and so is every intermediate below the smallest normal number (FTZ), then scaled by V
    tol = tol + (m + 2) * torch.finfo(cdt).tiny * max(1.0, finite_max(V3))
    tol = tol + 2 * _U_OUT[dtype] * ref.abs()
    note(f"eps={eps:.3g} cbox={cbox:.3g} rel={rel:.3g}")
    # Excluded region: rows with a plan entry exp(alpha_i + beta_j - C_ij / eps) above the compute
    # dtype's largest number (unrealistic for a Sinkhorn plan, whose entries are <= 1; reached here
    # by alpha rounded to bfloat16 at eps ~ 1e-7 cbox).  There the intermediate overflows and every
    # engine may return +-inf (or NaN from inf - inf) even where the sum with V is representable.
    # (The dense engine returned NaN instead of +-inf where the exact product overflows; fixed,
    # regression test in tests/ops/test_dense_overflow.py.)
    log_big = math.log(torch.finfo(cdt).max) - 1.0
    expo = alpha64.unsqueeze(-1) + beta64.unsqueeze(-2) - C / eps
    keep = (expo.amax(-1) <= log_big).unsqueeze(-1).expand_as(ref)
    check_close(out3[keep], ref[keep], tol[keep], f"plan_product[{engine}, {weight}]")
    zero_rows = torch.isneginf(alpha64)
    if bool(zero_rows.any()):  # zero row weight: exactly zero rows
        assert bool((out3.double()[zero_rows] == 0).all())


# --------------------------------------------------------------------------------------------
# solve_sample


def ref_sinkhorn(C, la, lb, eps, iters: int, symmetric: bool):
    """The documented iteration, float64: returns (f, g, largest |potential| visited)."""
    Sx = lambda gg: ref_softmin(C, lb + gg / eps, eps)  # noqa: E731  f_i from g
    Sy = lambda ff: ref_softmin(C.transpose(-1, -2), la + ff / eps, eps)  # noqa: E731  g_j from f
    if symmetric:
        f, g = Sx(torch.zeros_like(lb)), Sy(torch.zeros_like(la))
    else:
        f, g = torch.zeros_like(la), torch.zeros_like(lb)
    big = max(finite_max(f), finite_max(g))
    for _ in range(iters):
        if symmetric:
            f, g = 0.5 * (f + Sx(g)), 0.5 * (g + Sy(f))
        else:
            f = Sx(g)
            g = Sy(f)
        big = max(big, finite_max(f), finite_max(g))
    f, g = Sx(g), Sy(f)  # the final (parallel) step
    return f, g, max(big, finite_max(f), finite_max(g))


@fuzz_settings(300, 4000)
@given(
    p=problems(max_n=16, big_n=100),
    engine=ENGINE_CHOICES,
    cost=st.sampled_from(["sqeuclidean", "half_sqeuclidean", "euclidean"]),
    log_blur=LOG_BLUR,
    method=st.sampled_from(["sinkhorn_log", "symmetric"]),
    iters=st.integers(1, 12),
    scaling=st.sampled_from([False, False, None]),
)
def test_solve_sample(p, engine, cost, log_blur, method, iters, scaling):
    """``eps_scaling=False``: iterate for iterate against the reference.  ``None`` (the default: an
    epsilon-scaling schedule for alternating solves at small reg) is not replayed here: then only
    the schedule-free facts are checked (finite potentials, ``value = <a, f> + <b, g>``, marginals of
    the returned potentials' plan)."""
    engine = sized(engine, p)
    note(
        p["desc"] + f" engine={engine} cost={cost} log_blur={log_blur:.3f} method={method} iters={iters} "
        f"eps_scaling={scaling}"
    )
    dtype, isb = p["dtype"], p["B"] is not None
    eps, _ = temperature(p, cost, log_blur)
    x, x64 = cast(p["x"], dtype, isb, p["strided"])
    y, y64 = cast(p["y"], dtype, isb, p["strided"])
    a, a64 = cast(p["a"], dtype, isb, p["strided"])
    b, b64 = cast(p["b"], dtype, isb, p["strided"])

    def run():
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # tol=None: no warning is expected
            # eps_scaling=False, acceleration=None: exactly ``iters`` plain iterations at ``reg`` (the reference
            # below); the defaults switch alternating solves at small reg to epsilon-scaling and Anderson
            return flashot.solve_sample(
                x,
                y,
                a,
                b,
                cost=cost,
                reg=eps,
                tol=None,
                max_iter=iters,
                method=method,
                backend=engine,
                eps_scaling=scaling,
                acceleration=None,
            )

    bad = nonfinite_inputs(X_a=x, X_b=y)
    if bad:
        expect_documented_error(bad, run)
        return
    if not (bool((a64.sum(-1) > 0).all()) and bool((b64.sum(-1) > 0).all())):
        return  # the rounding of skewed weights to a half-precision dtype left no mass
    gap = float(((a64.sum(-1) - b64.sum(-1)).abs() / torch.maximum(a64.sum(-1), b64.sum(-1))).max())
    try:
        res = run()
    except ValueError as e:
        # documented: balanced masses that differ by more than 1e-3 (weights rounded to bfloat16)
        assert gap > 1e-3 and "a and b" in str(e) and "masses" in str(e), str(e)
        event("outcome: documented ValueError (unequal masses after the cast)")
        return
    assert res.backend == base(engine)
    C = ref_cost(x64, y64, cost)
    la, lb = a64.log(), b64.log()
    f_ref, g_ref, big = ref_sinkhorn(C, la, lb, eps, iters, method == "symmetric")
    value_ref = (a64 * f_ref).sum(-1) + (b64 * g_ref).sum(-1)
    cbox = bbox_cost(x64, y64, cost)
    u, DF = unit(dtype), dim_factor(p["d"])
    lw = max(finite_max(la), finite_max(lb))
    delta = K_SOFTMIN * u * (DF * cbox + eps * (lw + max(p["n"], p["m"]) + 4 + headroom(base(engine), dtype)) + big)
    e_pot = (2 * iters + 4) * delta
    note(f"eps={eps:.3g} cbox={cbox:.3g} big={big:.3g} e_pot={e_pot:.3g}")
    f, g = (batched(t, isb) for t in res.potentials)
    uo = _U_OUT[dtype]
    mass = a64.sum(-1) + b64.sum(-1)
    if scaling is False:
        check_close(f, f_ref, e_pot + 2 * uo * f_ref.abs(), f"solve_sample[{engine}] f")
        check_close(g, g_ref, e_pot + 2 * uo * g_ref.abs(), f"solve_sample[{engine}] g")
        check_close(
            batched(res.value, isb), value_ref, mass * e_pot + 2 * uo * value_ref.abs(), f"solve_sample[{engine}] value"
        )
    else:
        fo = torch.finfo(dtype)
        if dtype in (torch.float32, torch.float64):  # (float16 potentials may exceed 65504)
            assert bool(torch.isfinite(f).all()) and bool(torch.isfinite(g).all()), "non-finite potentials"
        pot = max(finite_max(f), finite_max(g))
        if bool(torch.isfinite(f.double()).all()) and bool(torch.isfinite(g.double()).all()):
            v64 = (a64 * f.double()).sum(-1) + (b64 * g.double()).sum(-1)
            # the library sums the compute-dtype potentials, we the output-dtype ones: both roundings
            check_close(
                batched(res.value, isb),
                v64,
                mass * (K_SOFTMIN * u + 2 * uo) * pot + 2 * fo.tiny * fo.eps * mass + 2 * uo * v64.abs(),
                f"solve_sample[{engine}] value = <a, f> + <b, g>",
            )
    # marginals of the plan of the returned potentials (streamed by the engine) against the same
    # plan in float64; float16 outputs also round the potentials (by uo |f|)
    f64, g64 = f.double(), g.double()
    if not (bool(torch.isfinite(f64).all()) and bool(torch.isfinite(g64).all())):
        return  # potentials beyond float16's range (checked above): no plan to rebuild from them
    logP = la.unsqueeze(-1) + lb.unsqueeze(-2) + (f64.unsqueeze(-1) + g64.unsqueeze(-2) - C) / eps
    pot = finite_max(f64) + finite_max(g64)
    fo = torch.finfo(dtype)  # the returned potentials are rounded to the output dtype (subnormals included)
    rel = (
        K_PLAN * u * (DF * cbox / eps + pot / eps + 2 * lw + max(p["n"], p["m"]) + 4)
        + 4 * (uo * pot + fo.tiny * fo.eps) / eps
    )
    # an exponent off by rel: the value lies within exp(+-rel) of the reference (log domain: the
    # reference itself may underflow float64 at eps = 1e-8 cbox)
    log_amp = rel if rel > 30 else math.log(math.expm1(rel))
    event(f"marginal bound: {'vacuous (rel >= 1)' if rel >= 1 else 'relative (rel < 1)'}")
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    ra, rb = (batched(t, isb) for t in res.marginals)
    for got, lp, side in ((ra, logP, "a"), (rb, logP.transpose(-1, -2), "b")):
        lref = torch.logsumexp(lp, -1)
        refm = lref.exp()
        drop = DROP[cdt] * (lp.shape[-1] + 1) * lp.amax(-1).exp()
        ftz = (lp.shape[-1] + 2) * torch.finfo(cdt).tiny  # results below the smallest normal: flushed (cpu)
        tol = (lref + log_amp).exp() + drop + ftz + 2 * uo * refm
        keep = torch.ones_like(refm, dtype=torch.bool)  # (dense's NaN here was fixed: tests/ops/test_dense_overflow.py)
        check_close(got[keep], refm[keep], tol[keep], f"solve_sample[{engine}] marginal {side}")


# --------------------------------------------------------------------------------------------
# SamplesLoss


@fuzz_settings(250, 3000)
@given(
    p=problems(max_n=12, big_n=64),
    engine=ENGINE_CHOICES,
    pp=st.sampled_from([1, 2]),
    log_blur=LOG_BLUR,
    scaling=st.sampled_from([0.5, 0.7]),
    debias=st.booleans(),
    weighted=st.booleans(),
)
def test_samples_loss(p, engine, pp, log_blur, scaling, debias, weighted):
    engine = sized(engine, p)
    note(p["desc"] + f" engine={engine} p={pp} log_blur={log_blur:.3f} scaling={scaling} debias={debias}")
    dtype, isb = p["dtype"], p["B"] is not None
    cost = "half_sqeuclidean" if pp == 2 else "euclidean"
    _, blur = temperature(p, "euclidean", log_blur)
    x, x64 = cast(p["x"], dtype, isb, p["strided"])
    y, y64 = cast(p["y"], dtype, isb, p["strided"])
    a, a64 = cast(p["a"], dtype, isb, p["strided"])
    b, b64 = cast(p["b"], dtype, isb, p["strided"])
    if not weighted:
        a = b = None
        a64 = torch.full_like(x64[..., 0], 1.0 / p["n"])
        b64 = torch.full_like(y64[..., 0], 1.0 / p["m"])
    bad = nonfinite_inputs(x=x, y=y)
    if bad:
        L = flashot.SamplesLoss(p=pp, blur=blur, scaling=scaling, debias=debias, backend=engine)
        expect_documented_error(bad, lambda: L(x, y) if a is None else L(a, x, b, y))
        return
    if not (bool((a64.sum(-1) > 0).all()) and bool((b64.sum(-1) > 0).all())):
        return
    pts = torch.cat([x64.reshape(-1, p["d"]), y64.reshape(-1, p["d"])])
    diameter = float((pts.amax(0) - pts.amin(0)).norm())
    if not diameter > 0:
        diameter = p["scale"]
    L = flashot.SamplesLoss(p=pp, blur=blur, diameter=diameter, scaling=scaling, debias=debias, backend=engine)
    xg, yg = x.detach().clone().requires_grad_(), y.detach().clone().requires_grad_()
    ma, mb = a64.sum(-1), b64.sum(-1)
    unequal = bool(((ma - mb).abs() > 1e-3 * torch.maximum(ma, mb)).any())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if unequal:  # weights rounded to a half-precision dtype: the documented RuntimeWarning
            warnings.filterwarnings("ignore", message=".*total masses differ", category=RuntimeWarning)
        val = L(xg, yg) if a is None else L(a, xg, b, yg)
    gx, gy = torch.autograd.grad(val.sum(), [xg, yg])
    assert val.dtype == dtype

    # reference: the same schedule, symmetric averaged updates, then the final step
    eps_list = epsilon_scaling(pp, max(diameter, blur), blur, scaling)
    Cxy, Cxx, Cyy = ref_cost(x64, y64, cost), ref_cost(x64, x64, cost), ref_cost(y64, y64, cost)
    la, lb = a64.log(), b64.log()
    S = ref_softmin
    e0 = eps_list[0]
    f, g = S(Cxy, lb, e0), S(Cxy.transpose(-1, -2), la, e0)
    faa, gbb = S(Cxx, la, e0), S(Cyy, lb, e0)
    big = max(map(finite_max, (f, g, faa, gbb)))
    for e in eps_list:
        f, g = 0.5 * (f + S(Cxy, lb + g / e, e)), 0.5 * (g + S(Cxy.transpose(-1, -2), la + f / e, e))
        if debias:
            faa, gbb = 0.5 * (faa + S(Cxx, la + faa / e, e)), 0.5 * (gbb + S(Cyy, lb + gbb / e, e))
        big = max(big, *map(finite_max, (f, g, faa, gbb)))
    eps = eps_list[-1]
    x64g, y64g = x64.clone().requires_grad_(), y64.clone().requires_grad_()
    fF = S(ref_cost(x64g, y64, cost), lb + g / eps, eps)
    gF = S(ref_cost(y64g, x64, cost), la + f / eps, eps)
    v_ref = (a64 * fF).sum(-1) + (b64 * gF).sum(-1)
    if debias:
        faaF = S(ref_cost(x64g, x64, cost), la + faa / eps, eps)
        gbbF = S(ref_cost(y64g, y64, cost), lb + gbb / eps, eps)
        v_ref = v_ref - (a64 * faaF).sum(-1) - (b64 * gbbF).sum(-1)
    gx_ref, gy_ref = torch.autograd.grad(v_ref.sum(), [x64g, y64g])

    cbox = bbox_cost(x64, y64, cost)
    u, DF, uo = unit(dtype), dim_factor(p["d"]), _U_OUT[dtype]
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    lw = max(finite_max(la), finite_max(lb))
    delta = K_SOFTMIN * u * (DF * cbox + e0 * (lw + max(p["n"], p["m"]) + 4 + headroom(base(engine), dtype)) + big)
    e_pot = (len(eps_list) + 3) * delta
    note(f"blur={blur:.3g} eps={eps:.3g} steps={len(eps_list)} cbox={cbox:.3g} big={big:.3g} e_pot={e_pot:.3g}")
    n_terms = 4 if debias else 2
    check_close(batched(val, isb), v_ref, n_terms * e_pot + 2 * uo * v_ref.abs(), f"SamplesLoss[{engine}] value")

    # gradients: |grad_i - ref_i| <= (expm1(r) + K u DF) sum_j pi_ij |w_ij| |x_i - y_j| (+ rounding of
    # the differences), r = 2 (potential error + u DF cbox) / eps; every term is a plan row of the reference
    def gabs(C_, X, Y, lh, eps):
        pi = torch.softmax(lh.unsqueeze(-2) - C_ / eps, -1)  # rows sum to 1 (times the weight below)
        w = ref_dcost_weight(C_, cost)
        dist = (X.unsqueeze(-2) - Y.unsqueeze(-3)).norm(dim=-1)
        return (pi * w * dist).sum(-1), (pi * w).sum(-1), (w * dist).amax(-1) * pi.shape[-1]

    r = 2 * (e_pot + K_GRAD * u * DF * cbox) / eps
    amp = math.expm1(min(r, 50.0)) + K_GRAD * u * DF
    event(
        f"gradient bound: {'magnitude only (r >= 1)' if r >= 1 else 'relative (r < 1)'} {'float64' if dtype == torch.float64 else 'float32 compute'}"
    )
    diam = math.sqrt(float(((pts.amax(0) - pts.amin(0)) ** 2).sum()))
    for grad, ref, W, X, Y, lh, hs, Cs, _lself, side in (
        (gx, gx_ref, a64, x64, y64, lb + g / eps, la + faa / eps, Cxx, la, "x"),
        (gy, gy_ref, b64, y64, x64, la + f / eps, lb + gbb / eps, Cyy, lb, "y"),
    ):
        G, Wsum, Gmax = gabs(ref_cost(X, Y, cost), X, Y, lh, eps)
        if debias:
            G2, W2, Gmax2 = gabs(Cs, X, X, hs, eps)
            G, Wsum, Gmax = G + G2, Wsum + W2, Gmax + Gmax2
        # + the terms every engine drops: below exp(floor) times the row's largest (exp_floor, ops/base.py)
        tol_pt = W * (amp * G + K_GRAD * u * DF * diam * Wsum + 2 * DROP[cdt] * Gmax)
        note(f"grad {side}: r={r:.3g}")
        check_grad(batched(grad, isb), ref, tol_pt, dtype, f"SamplesLoss[{engine}] grad {side}")


# --------------------------------------------------------------------------------------------
# solve(M): precomputed cost matrices, dense and lazy
#
# Random float64 (n, m) cost matrices (n, m in 1..12, entries in [0, 1) times a scale 1e-3..1e3, plus an
# offset, sometimes all equal), weights uniform or spread over up to 6 decades, given as a numpy array,
# a torch tensor, a lazy object returning numpy or torch blocks (no dtype attribute / a torch dtype),
# or a numpy.memmap, solved on ``tiled`` (blocks of a random number of rows and columns: ``COL_BLOCK``,
# the range scan's ``SCAN_ROWS`` and the high-temperature value's ``HOT_VALUE_BLOCK`` patched) or
# ``dense``, reg from 0.1 to 1e3 x the spread of the costs (ordinary) or 1e5 to 1e20 x (high temperature).
#
# Reference: float64 alternating Sinkhorn in the log domain (torch.logsumexp), run until the potentials
# move by less than the softmins' rounding, ``8 (n + m) 2^-53 (cmax + eps + max |f| + max |g|)``; value
# ``<a, f> + <b, g>``.  Its rounding is ``~ eps 2^-53`` per
# softmin, so at the high temperatures the reference is the second-order expansion
# ``<C, a b^T> - |R|^2_{a b} / (2 eps)`` (``R`` = ``C`` minus its a b-weighted additive part), exact to
# ``O(cmax^3 / eps^2)`` (< 1e-10 cmax from 1e5 cmax up).
# Tolerances (cmax = largest |cost|, spread = max - min): value ``1e-11 spread + 1e-13 eps + 1e-14 cmax`` (``eps``
# capped at 100 cmax at the high temperatures, where flashot's value no longer rounds like ``eps``); plan
# marginals (flashot stops at tol = 1e-12, L1) ``1e-10`` absolute; plan entries (ordinary temperatures)
# ``1e-7`` of the largest entry.

_MATRIX_FORMS = ["numpy", "torch", "lazy-numpy", "lazy-torch", "memmap"]


class _LazyBlocks:
    """A lazy matrix (``.shape`` and ``[r0:r1, c0:c1]``) over a float64 array; torch blocks when ``as_torch``."""

    def __init__(self, M, as_torch: bool):
        self.M, self.shape, self.as_torch = M, M.shape, as_torch
        if as_torch:
            self.dtype = torch.float64

    def __getitem__(self, key):
        blk = self.M[key]
        return torch.from_numpy(np.array(blk)) if self.as_torch else blk


class _patched:
    """Set module attributes for the duration of a ``with`` (hypothesis examples cannot use monkeypatch)."""

    def __init__(self, *triples):
        self.triples, self.saved = triples, []

    def __enter__(self):
        for mod, name, v in self.triples:
            self.saved.append((mod, name, getattr(mod, name)))
            setattr(mod, name, v)

    def __exit__(self, *exc):
        for mod, name, v in reversed(self.saved):
            setattr(mod, name, v)


@st.composite
def cost_matrices(draw):
    n, m = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    scale = 10.0 ** draw(st.floats(-3.0, 3.0))
    offset = draw(st.sampled_from([0.0, 0.0, 1.0, -5.0]))
    C = (torch.rand(n, m, generator=g, dtype=torch.float64) + offset) * scale
    if draw(st.sampled_from([False] * 5 + [True])):
        C = torch.full_like(C, (0.5 + offset) * scale)
    skew = draw(st.sampled_from([0.0, 0.0, 1.0, 6.0]))

    def weights(k):
        if skew == 0.0 and draw(st.booleans()):
            return None
        w = 10.0 ** (-skew * torch.rand(k, generator=g, dtype=torch.float64))
        return w / w.sum()

    a, b = weights(n), weights(m)
    return Problem(
        C=C,
        a=a,
        b=b,
        n=n,
        m=m,
        desc=f"n={n} m={m} scale={scale:.3g} offset={offset} skew={skew} seed={seed} uniform={(a is None, b is None)}",
    )


def _as_form(C: torch.Tensor, form: str, tmp: str):
    M = C.numpy()
    if form == "numpy":
        return M
    if form == "torch":
        return C.clone()
    if form == "memmap":
        mm = np.lib.format.open_memmap(os.path.join(tmp, "M.npy"), mode="w+", dtype=np.float64, shape=M.shape)
        mm[:] = M
        mm.flush()
        return np.load(os.path.join(tmp, "M.npy"), mmap_mode="r")
    return _LazyBlocks(M, as_torch=form == "lazy-torch")


def ref_matrix_sinkhorn(C, a, b, eps):
    """Converged float64 alternating Sinkhorn: (f, g), value ``<a, f> + <b, g>``."""
    la, lb = a.log(), b.log()
    f, g = torch.zeros_like(a), torch.zeros_like(b)
    floor = 8 * 2.0**-53 * (C.shape[0] + C.shape[1]) * (float(C.abs().max()) + eps)  # the softmins' rounding
    for _ in range(100000):
        f_new = ref_softmin(C, lb + g / eps, eps)
        g_new = ref_softmin(C.T, la + f_new / eps, eps)
        move = max(float((f_new - f).abs().max()), float((g_new - g).abs().max()))
        f, g = f_new, g_new
        if move <= floor + 8 * 2.0**-53 * (float(f.abs().max()) + float(g.abs().max())):
            break
    else:
        raise AssertionError("the reference Sinkhorn did not converge")
    f = ref_softmin(C, lb + g / eps, eps)
    return f, g, float((a * f).sum() + (b * g).sum())


def ref_matrix_hot_value(C, a, b, eps):
    """Second-order high-temperature expansion ``<C, a b^T> - |R|^2_{a b} / (2 eps)``."""
    r, c, mean = C @ b, a @ C, float(a @ C @ b)
    R = C - r[:, None] - c[None, :] + mean
    return mean - float(a @ (R * R) @ b) / (2 * eps)


@fuzz_settings(15, 1500)
@given(
    p=cost_matrices(),
    form=st.sampled_from(_MATRIX_FORMS),
    backend=st.sampled_from(["auto", "auto", "dense"]),
    hot=st.booleans(),
    log_reg=st.floats(0.0, 1.0),
    blocks=st.tuples(*[st.integers(1, 13)] * 3),
)
def test_solve_matrix(p, form, backend, hot, log_reg, blocks):
    """``flashot.solve(M)`` on every form of the same matrix: value, plan marginals and plan against the
    float64 reference (tolerances above)."""
    import tempfile

    from flashot import matrix_measures, values
    from flashot.ops import tiled

    C, a, b, n, m = p["C"], p["a"], p["b"], p["n"], p["m"]
    spread = float(C.max() - C.min())
    cmax = float(C.abs().max())
    unit = max(spread, 1e-3 * cmax, 1e-300)
    eps = unit * 10.0 ** (5.0 + 15.0 * log_reg if hot else -1.0 + 4.0 * log_reg)
    note(p["desc"] + f" form={form} backend={backend} eps={eps:.3g} (spread {spread:.3g}) blocks={blocks}")
    a64 = a if a is not None else torch.full((n,), 1.0 / n, dtype=torch.float64)
    b64 = b if b is not None else torch.full((m,), 1.0 / m, dtype=torch.float64)
    with (
        tempfile.TemporaryDirectory() as tmp,
        _patched(
            (tiled, "COL_BLOCK", blocks[0]),
            (matrix_measures, "SCAN_ROWS", blocks[1]),
            (values, "HOT_VALUE_BLOCK", blocks[2]),
        ),
    ):
        M = _as_form(C, form, tmp)
        res = flashot.solve(M, a, b, reg=eps, backend=backend, tol=1e-12, max_iter=100000)
        value = float(res.value)
        ra, rb = (np.asarray(t, dtype=np.float64) for t in res.marginals)
        P = np.asarray(res.plan, dtype=np.float64)
        del M
    assert res.converged, res
    if hot:
        want = ref_matrix_hot_value(C, a64, b64, eps)
    else:
        f_ref, g_ref, want = ref_matrix_sinkhorn(C, a64, b64, eps)
        Pref = (a64[:, None] * b64[None, :] * ((f_ref[:, None] + g_ref[None, :] - C) / eps).exp()).numpy()
        assert np.abs(P - Pref).max() <= 1e-7 * Pref.max(), np.abs(P - Pref).max() / Pref.max()
    # flashot's value below 100 cmax (values.HOT_VALUE_RATIO) and the ordinary reference: ~ eps 2^-53 each
    tol = 1e-11 * spread + 1e-13 * (min(eps, 100 * cmax) if hot else eps) + 1e-14 * cmax
    target(abs(value - want) / tol, label="solve(M) value err/tol")
    assert abs(value - want) <= tol, (value, want, tol)
    assert np.abs(ra - a64.numpy()).max() <= 1e-10 and np.abs(rb - b64.numpy()).max() <= 1e-10


_MALFORMED = {
    "negative shape": (lambda M: _Shaped((-M.shape[0], M.shape[1]), M), ValueError, "M: the lazy matrix's shape"),
    "empty shape": (lambda M: _Shaped((0, M.shape[1]), M), ValueError, "at least one row and one column"),
    "float shape": (lambda M: _Shaped((M.shape[0] + 0.5, M.shape[1]), M), ValueError, "M: the lazy matrix's shape"),
    "None blocks": (lambda M: _Blocks(M, lambda blk: None), TypeError, "M: the lazy matrix returned a NoneType"),
    "str blocks": (lambda M: _Blocks(M, lambda blk: "block"), TypeError, "M: the lazy matrix returned a str"),
    "object blocks": (
        lambda M: _Blocks(M, lambda blk: blk.astype(object)),
        TypeError,
        "M: the lazy matrix returned .* of dtype object",
    ),
    "wrong block shape": (
        lambda M: _Blocks(M, lambda blk: np.zeros((blk.shape[0] + 1, blk.shape[1]))),
        ValueError,
        "M: the lazy matrix returned a block of shape",
    ),
}


class _Shaped:
    def __init__(self, shape, M):
        self.shape, self.M = shape, M

    def __getitem__(self, key):
        return self.M[key]


class _Blocks:
    """Blocks of ``M`` passed through ``fn``; with ``after``, only from the ``after``-th read on."""

    def __init__(self, M, fn, after: int = 0):
        self.M, self.shape, self.fn, self.after, self.reads = M, M.shape, fn, after, 0

    def __getitem__(self, key):
        self.reads += 1
        blk = np.array(self.M[key])
        return self.fn(blk) if self.reads > self.after else blk


@fuzz_settings(15, 1000)
@given(
    p=cost_matrices(),
    kind=st.sampled_from(sorted(_MALFORMED) + ["NaN later", "Inf later"]),
    after=st.integers(0, 3),
    where=st.floats(0.0, 1.0),
    backend=st.sampled_from(["auto", "dense"]),
)
def test_solve_matrix_malformed(p, kind, after, where, backend):
    """Malformed lazy matrices: the documented one-line error naming ``M`` (never a raw IndexError, a
    torch reduction error, or advice about eps), whichever read first meets the defect."""
    import re

    M = p["C"].numpy()
    note(p["desc"] + f" kind={kind} after={after} backend={backend}")
    if kind in _MALFORMED:
        make, exc, match = _MALFORMED[kind]
        lazy = make(M)
    else:
        bad = np.nan if kind == "NaN later" else np.inf

        def poison(blk):
            blk.reshape(-1)[int(where * (blk.size - 1))] = bad
            return blk

        lazy, exc, match = (
            _Blocks(M, poison, after),
            ValueError,
            r"M: the lazy matrix returned NaN or Inf values for rows",
        )
    with pytest.raises(exc) as e:
        flashot.solve(lazy, reg=float(M.max() - M.min()) + 1.0, backend=backend)
    msg = str(e.value)
    assert re.search(match, msg) and "\n" not in msg and "eps" not in msg, msg
