"""Memory guards (issue 12, item 6): the dense engine (``backend="dense"``, GeomLoss' ``"tensorized"``)
refuses a matrix above its budget (``FLASHOT_DENSE_MAX_BYTES``) with a ``MemoryError`` that names the
size, the budget, the variable and the streaming engines, BEFORE allocating it; ``auto`` never picks
``dense`` above the budget; ``LazyPlan.to_dense`` refuses above ``max_elems`` (``DENSE_PLAN_LIMIT``).
Budgets are set tiny here, so every test is cheap."""

from __future__ import annotations

import pytest
import torch

import flashot
from flashot.costs import Cost, get_cost
from flashot.ops.dense import DENSE_MAX_BYTES_ENV, DenseBudgetError, DenseEngine, dense_max_bytes
from flashot.ops.registry import get_engine

SQ = get_cost("sqeuclidean")


@pytest.fixture
def budget(monkeypatch):
    """Set the dense budget (bytes) for one test."""

    def set_(n):
        monkeypatch.setenv(DENSE_MAX_BYTES_ENV, str(n))

    return set_


@pytest.fixture
def no_matrix(monkeypatch):
    """Any cost-matrix materialisation fails loudly: the guard must raise first."""

    def boom(*a, **k):
        raise AssertionError("a cost matrix was materialised before the guard")

    monkeypatch.setattr(Cost, "matrix", boom)


def _check_message(e, nbytes):
    msg = str(e)
    assert f"{nbytes:,} bytes" in msg, msg  # the size
    assert "budget of 1,000 bytes" in msg, msg  # the budget
    assert DENSE_MAX_BYTES_ENV in msg, msg  # how to raise it
    assert "'auto'" in msg and "'tiled'" in msg and "'online'" in msg, msg  # the alternatives


def test_default_budget_and_bad_values(monkeypatch):
    monkeypatch.delenv(DENSE_MAX_BYTES_ENV, raising=False)
    assert dense_max_bytes() >= 256 << 20
    monkeypatch.setenv(DENSE_MAX_BYTES_ENV, "2e9")
    assert dense_max_bytes() == 2_000_000_000
    for bad in ("lots", "-5"):
        monkeypatch.setenv(DENSE_MAX_BYTES_ENV, bad)
        with pytest.raises(ValueError, match=DENSE_MAX_BYTES_ENV):
            dense_max_bytes()


def test_dense_engine_refuses_before_allocating(budget, no_matrix):
    budget(1000)
    x, y, h = torch.randn(1, 20, 3), torch.randn(1, 30, 3), torch.zeros(1, 30)
    eng = DenseEngine()
    with pytest.raises(MemoryError) as e:
        eng.softmin(x, y, h, 1.0, SQ)
    assert isinstance(e.value, DenseBudgetError)
    _check_message(e.value, 20 * 30 * 4)
    with pytest.raises(DenseBudgetError):
        eng.plan_product(x, y, torch.zeros(1, 20), h, 1.0, torch.ones(1, 30, 1), SQ)
    with pytest.raises(DenseBudgetError):  # float64: 8 bytes per entry
        eng.softmin(x.double(), y.double(), h.double(), 1.0, SQ)


def test_dense_within_budget_runs(budget):
    budget(20 * 30 * 4)  # exactly the matrix: allowed
    x, y, h = torch.randn(1, 20, 3), torch.randn(1, 30, 3), torch.zeros(1, 30)
    out = DenseEngine().softmin(x, y, h, 1.0, SQ)
    assert out.shape == (1, 20) and torch.isfinite(out).all()


def test_forced_dense_fails_fast_through_the_front_ends(budget, no_matrix):
    budget(1000)
    x, y = torch.randn(100, 3), torch.randn(90, 3)
    with pytest.raises(DenseBudgetError) as e:
        get_engine("dense", device=x.device, dtype=torch.float32, cost=SQ, size=(1, 100, 90, 3))
    _check_message(e.value, 100 * 90 * 4)
    with pytest.raises(DenseBudgetError):
        flashot.SamplesLoss("sinkhorn", blur=0.1, backend="tensorized")(x, y)
    with pytest.raises(DenseBudgetError):
        flashot.solve_sample(x, y, reg=0.1, backend="dense")
    with pytest.raises(DenseBudgetError):
        flashot.ops.softmin(x, y, torch.zeros(90), 0.1, backend="dense")


def test_debiasing_matrix_above_budget_is_refused(budget):
    """x-y fits, x-x does not (N > M): the engine's own check catches the N x N debiasing matrix."""
    budget(50 * 10 * 4)
    x, y = torch.randn(50, 2), torch.randn(10, 2)
    with pytest.raises(DenseBudgetError, match="50 x 50"):
        flashot.SamplesLoss("sinkhorn", blur=0.5, backend="tensorized")(x, y)
    flashot.SamplesLoss("sinkhorn", blur=0.5, backend="tensorized", debias=False)(x, y)  # x-y only: fits


@pytest.mark.parametrize("threads", [1, 2])
def test_auto_never_picks_dense_above_the_budget(budget, monkeypatch, threads):
    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        size = (1, 20, 30, 3)  # tiny: auto's speed rule picks dense here
        monkeypatch.delenv(DENSE_MAX_BYTES_ENV, raising=False)
        assert get_engine("auto", device=torch.device("cpu"), dtype=torch.float32, cost=SQ, size=size).name == "dense"
        budget(1000)
        for dev in ("cpu", "meta"):  # meta: the non-CPU rule (DENSE_AUTO_LIMIT)
            eng = get_engine("auto", device=torch.device(dev), dtype=torch.float32, cost=SQ, size=size)
            assert eng.name != "dense", dev
        # and the public API still works (streamed) under a budget that forbids dense
        x, y = torch.randn(20, 3), torch.randn(30, 3)
        val = flashot.SamplesLoss("sinkhorn", blur=0.5)(x, y)
        assert torch.isfinite(val)
    finally:
        torch.set_num_threads(n)


def test_to_dense_refuses_above_its_limit(monkeypatch):
    from flashot.plan import DENSE_PLAN_LIMIT

    x, y = torch.randn(40, 2), torch.randn(30, 2)
    plan = flashot.SamplesLoss("sinkhorn", blur=0.5).plan(x, y)
    P = plan.to_dense()
    assert P.shape == (40, 30)
    assert abs(float(P.sum()) - 1.0) < 1e-4

    def boom(*a, **k):
        raise AssertionError("materialised before the guard")

    monkeypatch.setattr(Cost, "matrix", boom)
    with pytest.raises(MemoryError, match="max_elems"):
        plan.to_dense(max_elems=40 * 30 - 1)
    # the default limit, on a plan whose matrix would not fit it (lazy: nothing is computed)
    n = int(DENSE_PLAN_LIMIT**0.5) + 1
    big = flashot.plan_from_potentials(
        torch.randn(n, 1), torch.randn(n, 1), torch.zeros(n), torch.zeros(n), blur=0.5, backend="tiled"
    )
    with pytest.raises(MemoryError, match=f"{n * n:,} entries"):
        big.to_dense()


def test_to_dense_also_respects_the_byte_budget(monkeypatch):
    """A plan under max_elems but above FLASHOT_DENSE_MAX_BYTES is refused before any matrix is built."""
    x, y = torch.randn(40, 2), torch.randn(30, 2)
    plan = flashot.SamplesLoss("sinkhorn", blur=0.5).plan(x, y)
    monkeypatch.setenv(DENSE_MAX_BYTES_ENV, str(40 * 30 * 4 - 1))
    monkeypatch.setattr(Cost, "matrix", lambda *a, **k: (_ for _ in ()).throw(AssertionError("built")))
    with pytest.raises(MemoryError, match=DENSE_MAX_BYTES_ENV):
        plan.to_dense()
