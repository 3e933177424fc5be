"""Streaming engines against the dense oracle (float64, tight tolerances)."""

import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import rel_err
from flashot import ops
from flashot.costs import get_cost
from flashot.ops.dense import DenseEngine
from flashot.ops.tiled import TiledEngine

COSTS = ["sqeuclidean", "half_sqeuclidean", "euclidean", "euclidean_geomloss"]


def _problem(B, N, M, D, dtype=torch.float64):
    x = torch.randn(B, N, D, dtype=dtype)
    y = torch.randn(B, M, D, dtype=dtype) * 0.7 + 0.3
    h = torch.randn(B, M, dtype=dtype)
    h[:, 2] = float("-inf")  # a zero weight
    alpha = 0.1 * torch.randn(B, N, dtype=dtype)
    alpha[:, 1] = float("-inf")
    V = torch.randn(B, M, 4, dtype=dtype)
    return x, y, h, alpha, V


@pytest.mark.parametrize("cost", COSTS)
@pytest.mark.parametrize("shape", [(1, 37, 53, 3), (2, 130, 61, 17), (3, 5, 300, 1)])
@pytest.mark.parametrize("eps", [0.02, 1.0])
def test_tiled_matches_dense(cost, shape, eps):
    c = get_cost(cost)
    x, y, h, alpha, V = _problem(*shape)
    dense, tiled = DenseEngine(), TiledEngine(tile_elems=777)  # many ragged tiles
    ref = dense.softmin(x, y, h, eps, c)
    out = tiled.softmin(x, y, h, eps, c)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 1e-12
    for w in ["plan", "cost", "dcost"]:
        ref = dense.plan_product(x, y, alpha, h, eps, V, c, w)
        out = tiled.plan_product(x, y, alpha, h, eps, V, c, w)
        assert torch.isfinite(out).all()
        # the GeomLoss clamp makes 1/C reach 1e4 near coincident points (D = 1): looser
        tol = 1e-8 if cost == "euclidean_geomloss" else 1e-10
        assert rel_err(out, ref) < tol, w
        assert (out[:, 1] == 0).all()  # zero row weight gives an exact zero row


def test_public_primitives_shapes_and_backends():
    x, y = torch.randn(40, 3, dtype=torch.float64), torch.randn(30, 3, dtype=torch.float64)
    h = torch.randn(30, dtype=torch.float64)
    a = torch.randn(40, dtype=torch.float64) * 0.1
    V = torch.randn(30, dtype=torch.float64)
    s_d = ops.softmin(x, y, h, 0.3, backend="dense")
    s_t = ops.softmin(x, y, h, 0.3, backend="tiled")
    assert s_d.shape == (40,) and rel_err(s_t, s_d) < 1e-12
    # independent reference: explicit formula
    C = ((x[:, None] - y[None]) ** 2).sum(-1)
    ref = -0.3 * torch.logsumexp(h[None] - C / 0.3, 1)
    assert rel_err(s_d, ref) < 1e-12
    p = ops.plan_product(x, y, a, h, 0.3, V, backend="tiled")
    ref = (torch.exp(a[:, None] + h[None] - C / 0.3) @ V[:, None])[:, 0]
    assert p.shape == (40,) and rel_err(p, ref) < 1e-12


def test_float32_far_from_origin():
    """|x|^2 + |y|^2 - 2<x,y> cancels in float32 near 1e4: centring must save it."""
    g = torch.Generator().manual_seed(1)
    x64 = torch.randn(200, 3, generator=g, dtype=torch.float64) * 0.5 + 1e4
    y64 = torch.randn(150, 3, generator=g, dtype=torch.float64) * 0.5 + 1e4 + 0.2
    h64 = torch.zeros(150, dtype=torch.float64) - torch.log(torch.tensor(150.0, dtype=torch.float64))
    eps = 0.05
    ref = ops.softmin(x64, y64, h64, eps, backend="dense")
    for backend in ["dense", "tiled"]:
        out = ops.softmin(x64.float(), y64.float(), h64.float(), eps, backend=backend)
        # float32 rounding of the *inputs* at 1e4 is ~5e-4 absolute; the value scale is |x-y|^2 ~ 1.
        assert (out.double() - ref).abs().max() < 5e-3, backend
    # without centring the float32 expansion is wrong by O(1): show that the test can fail
    x32, y32 = x64.float(), y64.float()
    naive = (x32 * x32).sum(-1)[:, None] + (y32 * y32).sum(-1)[None] - 2 * x32 @ y32.T
    naive_sm = -eps * torch.logsumexp(h64.float()[None] - naive.clamp_min(0) / eps, 1)
    assert (naive_sm.double() - ref).abs().max() > 5e-2


def test_half_precision_inputs_are_computed_in_float32():
    x = torch.randn(50, 3)
    y = torch.randn(40, 3)
    h = torch.zeros(40)
    ref = ops.softmin(x.half().float(), y.half().float(), h, 0.5, backend="dense")
    for dt in (torch.float16, torch.bfloat16):
        out = ops.softmin(x.to(dt), y.to(dt), h.to(dt), 0.5, backend="tiled")
        assert out.dtype == dt
        # computed in float32 from the rounded inputs: only the output's own rounding differs
        assert (out.float() - ref).abs().max() <= 2 * torch.finfo(dt).eps * ref.abs().max()
        ref_dt = ops.softmin(x.to(dt).float(), y.to(dt).float(), h.to(dt).float(), 0.5, backend="dense")
        assert rel_err(out.float(), ref_dt) < 1e-2


def test_auto_picks_dense_only_for_tiny_problems():
    from flashot.ops.registry import get_engine

    c = get_cost("sqeuclidean")

    def pick(n, d=3):
        return get_engine("auto", device=torch.device("cpu"), dtype=torch.float32, cost=c, size=(1, n, n, d)).name

    # the crossover depends on torch's thread count (the cpu engine's fixed cost per call does):
    # check both regimes whatever the count this process runs with (pytest-xdist workers run one)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            assert pick(30) == "dense", t
            assert pick(10_000) != "dense", t
        torch.set_num_threads(2)
        assert pick(100) == "dense"
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(ValueError, match="backend"):
        get_engine("nope", device=torch.device("cpu"), dtype=torch.float32, cost=c)


def test_gradients_of_softmin_match_dense_autograd():
    x = torch.randn(2, 23, 3, dtype=torch.float64, requires_grad=True)
    y = torch.randn(2, 31, 3, dtype=torch.float64, requires_grad=True)
    h = torch.randn(2, 31, dtype=torch.float64, requires_grad=True)
    G = torch.randn(2, 23, dtype=torch.float64)
    for cost in ["sqeuclidean", "euclidean"]:
        ref = torch.autograd.grad((ops.softmin(x, y, h, 0.2, cost=cost, backend="dense") * G).sum(), [x, y, h])
        out = torch.autograd.grad((ops.softmin(x, y, h, 0.2, cost=cost, backend="tiled") * G).sum(), [x, y, h])
        for r, o in zip(ref, out):
            assert rel_err(o, r) < 1e-10, cost


def test_softmin_gradcheck_tiled():
    x = torch.randn(6, 2, dtype=torch.float64, requires_grad=True)
    y = torch.randn(5, 2, dtype=torch.float64, requires_grad=True)
    h = torch.randn(5, dtype=torch.float64, requires_grad=True)
    f = lambda x, y, h: ops.softmin(x, y, h, 0.3, backend="tiled")  # noqa: E731
    assert torch.autograd.gradcheck(f, (x, y, h))


MEM_SCRIPT = textwrap.dedent(
    """
    import resource, torch
    from flashot.ops.tiled import TiledEngine
    from flashot.costs import get_cost
    torch.set_num_threads(2)
    n = 30_000
    x = torch.rand(1, n, 3); y = torch.rand(1, n, 3); h = torch.full((1, n), -11.5)
    eng = TiledEngine()
    eng.softmin(x[:, :100], y[:, :100], h[:, :100], 0.1, get_cost("sqeuclidean"))  # warm-up allocs
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = eng.softmin(x, y, h, 0.1, get_cost("sqeuclidean"))
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert torch.isfinite(out).all()
    print((after - before) / 1024.0)
    """
)


@pytest.mark.slow
def test_tiled_memory_is_linear():
    """One softmin over n = m = 30,000 in less than 300 MiB (a dense float32 C would be 3.6 GB: linear memory
    is more than ten times below what a quadratic one needs, at a third of the work of 50,000)."""
    r = subprocess.run([sys.executable, "-c", MEM_SCRIPT], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    grown_mib = float(r.stdout.strip().splitlines()[-1])
    assert grown_mib < 300, grown_mib


def test_register_and_unregister_engine():
    from flashot.ops import engine_names, register_engine, unregister_engine
    from flashot.ops.tiled import TiledEngine

    x, y = torch.randn(20, 2), torch.randn(25, 2)
    h = torch.zeros(25)
    register_engine("tmp-tiled", lambda: TiledEngine(tile_elems=64))
    try:
        assert "tmp-tiled" in engine_names()
        out = ops.softmin(x, y, h, 0.5, backend="tmp-tiled")
        ref = ops.softmin(x, y, h, 0.5, backend="dense")
        assert (out - ref).abs().max() < 1e-5
    finally:
        unregister_engine("tmp-tiled")
    assert "tmp-tiled" not in engine_names()
    with pytest.raises(ValueError, match="expected 'auto' or one of"):
        ops.softmin(x, y, h, 0.5, backend="tmp-tiled")
    unregister_engine("tmp-tiled")  # absent: no error
    with pytest.raises(ValueError, match="built-in"):
        unregister_engine("tiled")


def test_unregister_engine_rejects_a_non_string():
    from flashot.ops import unregister_engine

    with pytest.raises(TypeError, match="string"):
        unregister_engine(["tiled"])
