"""Lazy-plan operations (barycentric map, top-k, plan from potentials) against dense plans."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import flashot
from conftest import rel_err
from flashot.costs import get_cost
from flashot.ops import register_engine, unregister_engine
from flashot.ops.rowtopk import row_topk
from flashot.ops.tiled import TiledEngine
from references import plan

DT = torch.float64


class ScaledTiled(TiledEngine):
    """A third-party engine (tiny ragged tiles) to show the plan ops use only the contract."""

    name = "ragged"

    def __init__(self):
        super().__init__(tile_elems=333)


@pytest.fixture(scope="module", autouse=True)
def _register():
    register_engine("ragged", ScaledTiled)
    yield
    unregister_engine("ragged")


def _dense_plan(x, y, a, b, f, g, eps, cost):
    return plan(get_cost(cost).matrix(x, y), a, b, f, g, eps)


_SOLVED = {}


def _solve(backend, batched=False, N=47, M=61, D=3):
    """Converged potentials (dense solve, cached), the lazy plan on ``backend`` and the dense plan."""
    if batched not in _SOLVED:
        lead = (2,) if batched else ()
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(*lead, N, D, dtype=DT, generator=gen)
        y = torch.randn(*lead, M, D, dtype=DT, generator=gen) * 0.7 + 3.0  # far from x: centring undone
        a = torch.rand(*lead, N, dtype=DT, generator=gen) + 0.1
        b = torch.rand(*lead, M, dtype=DT, generator=gen) + 0.1
        a, b = a / a.sum(-1, keepdim=True), b / b.sum(-1, keepdim=True)
        res = flashot.solve_sample(x, y, a, b, reg=0.3, tol=1e-10, backend="dense")
        _SOLVED[batched] = (x, y, a, b, *res.potentials)
    x, y, a, b, f, g = _SOLVED[batched]
    plan = flashot.plan_from_potentials(x, y, f, g, a, b, reg=0.3, backend=backend)
    P = _dense_plan(x, y, a, b, f, g, 0.3, "sqeuclidean")
    return plan, P, x, y


@pytest.mark.parametrize("backend", ["dense", "tiled", "ragged"])
@pytest.mark.parametrize("batched", [False, True])
def test_barycentric_map_matches_dense(backend, batched):
    plan, P, x, y = _solve(backend, batched)
    T = plan.barycentric_map()
    ref = (P @ y) / P.sum(-1, keepdim=True)
    assert T.shape == x.shape
    assert rel_err(T, ref) < 1e-10
    Ty = plan.T.barycentric_map()
    ref_y = (P.transpose(-1, -2) @ x) / P.sum(-2).unsqueeze(-1)
    assert rel_err(Ty, ref_y) < 1e-10


def test_barycentric_map_zero_mass_rows_are_nan():
    x, y = torch.randn(6, 2, dtype=DT), torch.randn(5, 2, dtype=DT)
    a = torch.tensor([0.2, 0.2, 0.0, 0.2, 0.2, 0.2], dtype=DT)
    T = flashot.solve_sample(x, y, a, reg=0.5, backend="tiled").plan.barycentric_map()
    assert torch.isnan(T[2]).all() and torch.isfinite(T[[0, 1, 3, 4, 5]]).all()


@pytest.mark.parametrize("backend", ["dense", "tiled", "ragged"])
@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("k", [1, 5])
def test_topk_matches_dense(backend, batched, k):
    plan, P, _, _ = _solve(backend, batched)
    vals, idx = plan.topk(k)
    ref = torch.topk(P, k, dim=-1)
    assert vals.shape == ref.values.shape and idx.dtype == torch.int64
    assert rel_err(vals, ref.values) < 1e-10
    assert torch.equal(idx, ref.indices)
    vals_t, idx_t = plan.T.topk(k)
    ref_t = torch.topk(P.transpose(-1, -2), k, dim=-1)
    assert rel_err(vals_t, ref_t.values) < 1e-10
    assert torch.equal(idx_t, ref_t.indices)


@pytest.mark.parametrize("tile_elems", [5, 64, 1000])
@pytest.mark.parametrize("k", [1, 3, 40])
def test_running_topk_across_tiles(tile_elems, k):
    x = torch.randn(2, 23, 2, dtype=DT)
    y = torch.randn(2, 71, 2, dtype=DT)
    beta = torch.randn(2, 71, dtype=DT)
    beta[:, 4] = float("-inf")
    v, i = row_topk(x, y, beta, 2.5, get_cost("sqeuclidean"), k, tile_elems=tile_elems)
    S = beta.unsqueeze(-2) - 2.5 * get_cost("sqeuclidean").matrix(x, y)
    ref = torch.topk(S, k, dim=-1)
    assert rel_err(v, ref.values) < 1e-12
    assert torch.equal(i, ref.indices)


def test_topk_and_barycentric_numpy_in_numpy_out():
    x, y = np.random.rand(30, 2), np.random.rand(20, 2)
    res = flashot.solve_sample(x, y, reg=0.1, backend="tiled")
    P = res.plan.to_dense()
    v, i = res.plan.topk(2)
    assert isinstance(v, np.ndarray) and isinstance(i, np.ndarray)
    np.testing.assert_allclose(v, -np.sort(-P, axis=1)[:, :2], rtol=1e-10)
    T = res.plan.barycentric_map()
    assert isinstance(T, np.ndarray)
    np.testing.assert_allclose(T, P @ y / P.sum(1, keepdims=True), rtol=1e-10)


def test_plan_ops_bad_input():
    res = flashot.solve_sample(torch.randn(8, 2), torch.randn(9, 2), reg=0.5, backend="tiled")
    with pytest.raises(ValueError, match="k: expected an integer >= 1"):
        res.plan.topk(0)
    with pytest.raises(TypeError, match="k: expected an integer"):
        res.plan.topk(2.5)
    with pytest.raises(ValueError, match="k: expected at most 9"):
        res.plan.topk(10)
    with pytest.raises(ValueError, match="V: expected shape"):
        res.plan @ torch.randn(8, 2)
    with pytest.raises(ValueError, match="V: expected shape"):
        res.plan.T @ torch.randn(9, 2)


def test_plan_from_solve_sample_potentials():
    x, y = torch.randn(30, 3, dtype=DT), torch.randn(25, 3, dtype=DT)
    res = flashot.solve_sample(x, y, reg=0.2, tol=1e-10, backend="tiled")
    f, g = res.potentials
    P = flashot.plan_from_potentials(x, y, f, g, reg=0.2, backend="tiled")
    V = torch.randn(25, 4, dtype=DT)
    assert rel_err(P @ V, res.plan @ V) < 1e-12
    assert (
        rel_err(
            P.to_dense(),
            _dense_plan(
                x, y, torch.full((30,), 1 / 30, dtype=DT), torch.full((25,), 1 / 25, dtype=DT), f, g, 0.2, "sqeuclidean"
            ),
        )
        < 1e-12
    )


@pytest.mark.parametrize("p", [1, 2])
def test_plan_from_geomloss_style_potentials(p):
    """SamplesLoss(debias=False, potentials=True): a_i b_j exp((F_i + G_j - C_ij) / blur^p)."""
    x, y = torch.randn(40, 2, dtype=DT), torch.randn(35, 2, dtype=DT) + 0.5
    blur = 0.5
    F, G = flashot.SamplesLoss(p=p, blur=blur, debias=False, potentials=True, scaling=0.9)(x, y)
    P = flashot.plan_from_potentials(x, y, F, G, blur=blur, p=p, backend="tiled")
    cost = "half_sqeuclidean" if p == 2 else "euclidean"
    ref = _dense_plan(
        x, y, torch.full((40,), 1 / 40, dtype=DT), torch.full((35,), 1 / 35, dtype=DT), F, G, blur**p, cost
    )
    assert rel_err(P.to_dense(), ref) < 1e-12
    # nearly balanced: these are the cross potentials of a (nearly) converged problem
    assert float((P.row_sums() - 1 / 40).abs().sum()) < 0.05


def test_samples_loss_plan_is_refined_to_tol():
    x, y = torch.randn(50, 2, dtype=DT), torch.randn(60, 2, dtype=DT) + 1.0
    L = flashot.SamplesLoss(blur=0.3, backend="tiled")  # debias=True: plan() still uses cross potentials
    P = L.plan(x, y, tol=1e-8)
    assert float((P.row_sums() - 1 / 50).abs().sum()) < 1e-8
    assert float((P.T.row_sums() - 1 / 60).abs().sum()) < 2e-8
    ref = flashot.solve_sample(x, y, cost="half_sqeuclidean", reg=0.09, tol=1e-12, max_iter=10000)
    assert rel_err(P.to_dense(), ref.plan.to_dense()) < 1e-6
    raw = L.plan(x, y, tol=None)  # GeomLoss' own potentials, unrefined
    assert float((raw.row_sums() - 1 / 50).abs().sum()) > 1e-6


def test_plan_from_potentials_bad_input():
    x, y = torch.randn(5, 2), torch.randn(6, 2)
    f, g = torch.zeros(5), torch.zeros(6)
    with pytest.raises(ValueError, match="blur and reg"):
        flashot.plan_from_potentials(x, y, f, g, blur=0.1, reg=0.1)
    with pytest.raises(ValueError, match="blur: required"):
        flashot.plan_from_potentials(x, y, f, g)
    with pytest.raises(ValueError, match="g: expected shape"):
        flashot.plan_from_potentials(x, y, f, torch.zeros(5), blur=0.1)
    with pytest.raises(ValueError, match="f: contains NaN"):
        flashot.plan_from_potentials(x, y, torch.full((5,), float("nan")), g, blur=0.1)
    with pytest.raises(ValueError, match="p: expected 1 or 2"):
        flashot.plan_from_potentials(x, y, f, g, blur=0.1, p=3)


MEM_SCRIPT = textwrap.dedent(
    """
    import resource, torch, flashot
    torch.set_num_threads(2)
    n, m = 100_000, 2_000
    x = torch.rand(n, 3); y = torch.rand(m, 3)
    f = torch.zeros(n); g = torch.zeros(m)
    small = flashot.plan_from_potentials(x[:500], y[:300], f[:500], g[:300], reg=0.05, backend="tiled")
    small.topk(4); small.barycentric_map()  # warm-up: allocator, thread pools
    P = flashot.plan_from_potentials(x, y, f, g, reg=0.05, backend="tiled")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    v, i = P.topk(4)
    T = P.barycentric_map()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert torch.isfinite(v).all() and torch.isfinite(T).all() and i.shape == (n, 4)
    print((after - before) / 1024.0)
    """
)


def test_topk_and_barycentric_map_memory_is_linear():
    """n = 100,000 x m = 2,000 (a dense float32 plan: 0.8 GB, a dense top-k index 1.6 GB)."""
    r = subprocess.run([sys.executable, "-c", MEM_SCRIPT], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    grown_mib = float(r.stdout.strip().splitlines()[-1])
    assert grown_mib < 300, grown_mib
