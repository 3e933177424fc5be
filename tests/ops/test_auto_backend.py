"""``backend="auto"`` picks by measured speed (benchmarks/AUTO_CROSSOVER.md), and what it
picks computes what the ``dense`` oracle computes."""

from __future__ import annotations

import pytest
import torch

import flashot
from flashot import ops
from flashot.costs import get_cost
from flashot.ops import registry
from flashot.ops.registry import get_engine

CPU = torch.device("cpu")
COSTS = ["sqeuclidean", "half_sqeuclidean", "euclidean"]


def _cpu_engine_built() -> bool:
    eng = get_engine("cpu", device=CPU, dtype=torch.float64, cost=get_cost("sqeuclidean"))
    return eng.name == "cpu"  # the loader falls back to ``tiled`` when the kernels cannot be built


@pytest.fixture(scope="module")
def cpu_built():
    if not _cpu_engine_built():  # resolved when a test needs it (a first use compiles the kernels)
        pytest.skip("the compiled cpu engine is unavailable here")


needs_cpu = pytest.mark.usefixtures("cpu_built")


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    n = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(n)


# above the measured crossovers (B N M <= 128^2 with several threads, 32^2 with one), up to above
# the old dense limit (B N M <= 2^21, where auto picked dense, up to 27x slower, before)
SIZES = [
    (1, 129, 128, 3),
    (1, 200, 100, 64),
    (2, 100, 90, 10),
    (1, 256, 256, 1),
    (1, 700, 600, 3),
    (1, 1000, 1200, 2),
    (4, 512, 512, 64),
    (1, 1448, 1448, 3),
    (1, 5000, 5000, 3),
]


@needs_cpu
@pytest.mark.parametrize("size", SIZES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("cost", COSTS)
def test_auto_never_picks_dense_where_the_cpu_engine_runs(size, dtype, cost, threads):
    eng = get_engine("auto", device=CPU, dtype=dtype, cost=get_cost(cost), size=size)
    assert eng.name == "cpu", (size, dtype, cost, threads, eng.name)


@needs_cpu
@pytest.mark.parametrize(
    "size",
    [(1, 8, 8, 1), (1, 32, 32, 3), (4, 16, 16, 15), (1, 32, 32, 64), (1, 128, 128, 3), (4, 64, 64, 10)],
    ids=lambda s: "x".join(map(str, s)),
)
def test_auto_keeps_dense_for_tiny_problems(size, threads):
    # measured: with several threads dense beats the cpu engine (its thread team's cost per call) up to
    # B N M = 128^2; with one thread only solves of B N M <= 32^2 in d < 16, by 1-9%
    B, N, M, D = size
    dense = B * N * M <= 128 * 128 if threads > 1 else (B * N * M <= 32 * 32 and D < 16)
    eng = get_engine("auto", device=CPU, dtype=torch.float32, cost=get_cost("sqeuclidean"), size=size)
    assert eng.name == ("dense" if dense else "cpu")
    assert (
        get_engine(
            "auto", device=CPU, dtype=torch.float32, cost=get_cost("sqeuclidean"), size=size, allow_dense=False
        ).name
        == "cpu"
    )


@pytest.mark.parametrize("size", [(1, 10, 10, 3), (1, 100, 100, 3), (1, 3000, 3000, 3)])
def test_auto_without_dense_is_streaming(size):
    eng = get_engine(
        "auto", device=CPU, dtype=torch.float32, cost=get_cost("sqeuclidean"), size=size, allow_dense=False
    )
    assert eng.name in ("cpu", "tiled")


def test_without_the_cpu_engine_auto_uses_the_measured_dense_tiled_crossover(monkeypatch, threads):
    from flashot.ops.tiled import TiledEngine

    # what the cpu loader returns when the kernels cannot be built
    monkeypatch.setitem(registry._CACHE, "cpu", TiledEngine())
    c = get_cost("sqeuclidean")
    lim = registry.CPU_DENSE_LIMIT
    n = int(lim**0.5)
    small = get_engine("auto", device=CPU, dtype=torch.float32, cost=c, size=(1, n, n, 3))
    big = get_engine("auto", device=CPU, dtype=torch.float32, cost=c, size=(1, 2 * n, 2 * n, 3))
    assert big.name == "tiled"
    assert small.name == ("dense" if lim > 0 else "tiled")


def test_non_cpu_devices_keep_their_rule():
    # no GPU needed: resolving does not touch the device below the dense limit
    eng = get_engine(
        "auto", device=torch.device("cuda"), dtype=torch.float32, cost=get_cost("sqeuclidean"), size=(1, 100, 100, 3)
    )
    assert eng.name == "dense"


# -- what auto computes equals the dense oracle (float64, 1e-10) ------------------------------


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


@pytest.mark.parametrize("cost", COSTS)
@pytest.mark.parametrize("shape", [(1, 150, 130, 3), (2, 300, 250, 10), (1, 900, 800, 2)])
def test_auto_softmin_and_plan_product_equal_dense(cost, shape):
    B, N, M, D = shape
    g = torch.Generator().manual_seed(1)
    x = torch.rand(B, N, D, generator=g, dtype=torch.float64)
    y = torch.rand(B, M, D, generator=g, dtype=torch.float64)
    h = torch.randn(B, M, generator=g, dtype=torch.float64)
    h[:, :3] = -float("inf")  # zero weights
    for eps in (1e-3, 0.05, 1.0):
        ref = ops.softmin(x, y, h, eps, cost=cost, backend="dense")
        out = ops.softmin(x, y, h, eps, cost=cost, backend="auto")
        assert _rel(out, ref) < 1e-10, (eps, _rel(out, ref))
    alpha = torch.randn(B, N, generator=g, dtype=torch.float64) * 0.1
    V = torch.randn(B, M, 2, generator=g, dtype=torch.float64)
    beta = -ops.softmin(y, x, alpha, 0.05, cost=cost, backend="dense") / 0.05  # a sensible pair of scalings
    for weight in ("plan", "cost", "dcost"):
        ref = ops.plan_product(x, y, alpha, beta, 0.05, V, cost=cost, weight=weight, backend="dense")
        out = ops.plan_product(x, y, alpha, beta, 0.05, V, cost=cost, weight=weight, backend="auto")
        assert _rel(out, ref) < 1e-10, (weight, _rel(out, ref))


@pytest.mark.parametrize("p", [1, 2])
def test_auto_samples_loss_value_and_gradient_equal_dense(p):
    g = torch.Generator().manual_seed(2)
    x = torch.rand(400, 3, generator=g, dtype=torch.float64)
    y = torch.rand(350, 3, generator=g, dtype=torch.float64) + 0.2
    out = {}
    for backend in ("auto", "dense"):
        xr = x.clone().requires_grad_()
        L = flashot.SamplesLoss("sinkhorn", p=p, blur=0.05, backend=backend)(xr, y)
        (gx,) = torch.autograd.grad(L, xr)
        out[backend] = (L.detach(), gx)
    assert _rel(out["auto"][0], out["dense"][0]) < 1e-10
    assert _rel(out["auto"][1], out["dense"][1]) < 1e-10


def test_auto_solve_sample_equals_dense():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(500, 2, generator=g, dtype=torch.float64)
    y = torch.randn(450, 2, generator=g, dtype=torch.float64) + 1
    kw = dict(reg=0.05, max_iter=200, tol=None)
    ra, rd = flashot.solve_sample(x, y, **kw), flashot.solve_sample(x, y, backend="dense", **kw)
    assert ra.backend != "dense"
    assert _rel(ra.value, rd.value) < 1e-10
    for pa, pd in zip(ra.potentials, rd.potentials):
        assert _rel(pa, pd) < 1e-10


# -- the dense oracle clamps its exponent (no slow exp path) and stays exact ------------------


def test_dense_clamped_exp_is_exact():
    from flashot.ops.dense import DenseEngine

    g = torch.Generator().manual_seed(4)
    c = get_cost("sqeuclidean")
    for dtype in (torch.float32, torch.float64):
        x = torch.randn(2, 60, 3, generator=g, dtype=torch.float64).to(dtype)
        y = torch.randn(2, 50, 3, generator=g, dtype=torch.float64).to(dtype)
        h = torch.randn(2, 50, generator=g, dtype=torch.float64).to(dtype)
        h[:, :4] = -float("inf")
        for eps in (1e-4, 1e-2, 1.0):  # at 1e-4 almost every argument is below the threshold
            out = DenseEngine().softmin(x, y, h, eps, c)
            ref = -eps * torch.logsumexp(h.unsqueeze(-2) - c.matrix(x, y) / eps, dim=-1)
            assert torch.equal(out, ref), (dtype, eps)
    # zero weights contribute exactly nothing, also to the gradient; an all-zero row gives +inf
    x = torch.randn(1, 5, 2, dtype=torch.float64)
    y = torch.randn(1, 4, 2, dtype=torch.float64)
    h = torch.tensor([[0.0, -float("inf"), 0.5, -float("inf")]], dtype=torch.float64, requires_grad=True)
    (gh,) = torch.autograd.grad(DenseEngine().softmin(x, y, h, 0.1, c).sum(), h)
    assert torch.all(gh[0, [1, 3]] == 0)
    allzero = torch.full((1, 4), -float("inf"), dtype=torch.float64)
    assert torch.all(DenseEngine().softmin(x, y, allzero, 0.1, c) == float("inf"))


def test_geomloss_flow_example_runs_on_the_fast_engine_with_the_same_result():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "geomloss_flow.py"
    spec = importlib.util.spec_from_file_location("geomloss_flow", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    h_auto = mod.run(n=150, lr=0.05, blur=0.05, t_end=0.25)  # 6 steps
    h_dense = mod.run(n=150, lr=0.05, blur=0.05, t_end=0.25, backend="dense")
    assert h_auto["steps"] == 6 and len(h_auto["snapshots"]) == 2
    assert h_auto["losses"][-1] < h_auto["losses"][0]
    assert float((h_auto["x"] - h_dense["x"]).abs().max()) < 1e-4  # float32, 6 steps
    eng = get_engine("auto", device=CPU, dtype=torch.float32, cost=get_cost("half_sqeuclidean"), size=(1, 150, 150, 2))
    assert eng.name != "dense"
