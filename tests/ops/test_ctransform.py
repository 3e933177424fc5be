"""Hard c-transform (min / argmin over columns) against dense references."""

import math

import pytest
import torch

from conftest import rel_err
from flashot import ops
from flashot.costs import get_cost
from flashot.ops.rowtopk import row_topk

DT = torch.float64
COSTS = ["sqeuclidean", "half_sqeuclidean", "euclidean"]


def _dense_ref(x, y, g, cost):
    C = get_cost(cost).matrix(x, y)
    return (C - g.unsqueeze(-2)).min(-1)


@pytest.mark.parametrize("cost", COSTS)
@pytest.mark.parametrize("backend", ["dense", "tiled"])
@pytest.mark.parametrize("batched", [False, True])
def test_c_transform_matches_dense(cost, backend, batched):
    lead = (2,) if batched else ()
    x = torch.randn(*lead, 57, 3, dtype=DT)
    y = torch.randn(*lead, 83, 3, dtype=DT) + 0.2
    g = torch.randn(*lead, 83, dtype=DT)
    v, i = ops.c_transform(x, y, g, cost=cost, backend=backend)
    ref = _dense_ref(x, y, g, cost)
    assert v.shape == ref.values.shape and i.dtype == torch.int64
    assert rel_err(v, ref.values) < 1e-12
    assert torch.equal(i, ref.indices)  # continuous random data: no ties


@pytest.mark.parametrize("tile_elems", [7, 100, 777])
def test_running_min_over_many_ragged_tiles(tile_elems):
    x = torch.randn(1, 45, 2, dtype=DT)
    y = torch.randn(1, 131, 2, dtype=DT)
    g = torch.randn(1, 131, dtype=DT)
    vals, idx = row_topk(x, y, g, 1.0, get_cost("sqeuclidean"), 1, tile_elems=tile_elems)
    ref = _dense_ref(x, y, g, "sqeuclidean")
    assert rel_err(-vals[..., 0], ref.values) < 1e-12
    assert torch.equal(idx[..., 0], ref.indices)


def test_nearest_neighbour_and_excluded_points():
    y = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]], dtype=DT)
    x = torch.tensor([[0.9, 0.1], [0.1, 0.2], [0.2, 0.8]], dtype=DT)
    _, i = ops.c_transform(x, y, backend="tiled")
    assert i.tolist() == [1, 0, 2]
    g = torch.tensor([0.0, float("-inf"), 0.0], dtype=DT)  # y_1 excluded
    v, i = ops.c_transform(x, y, g, backend="tiled")
    assert i.tolist() == [0, 0, 2]
    assert math.isclose(float(v[0]), 0.81 + 0.01)


def test_c_transform_is_the_zero_temperature_softmin():
    """softmin_eps(x; y, g / eps) -> min_j C - g_j, within eps log M."""
    x = torch.randn(40, 3, dtype=DT)
    y = torch.randn(60, 3, dtype=DT)
    g = torch.randn(60, dtype=DT)
    v, _ = ops.c_transform(x, y, g, backend="tiled")
    for eps in (1e-2, 1e-3):
        s = ops.softmin(x, y, g / eps, eps, backend="tiled")
        assert ((v - s) >= -1e-12).all()
        assert ((v - s) <= eps * math.log(60) + 1e-12).all()


def test_c_transform_gradients_danskin():
    x = torch.randn(20, 2, dtype=DT, requires_grad=True)
    y = torch.randn(30, 2, dtype=DT, requires_grad=True)
    g = torch.randn(30, dtype=DT, requires_grad=True)
    w = torch.randn(20, dtype=DT)
    v, _ = ops.c_transform(x, y, g, cost="euclidean", backend="tiled")
    got = torch.autograd.grad((v * w).sum(), (x, y, g))
    ref_v = _dense_ref(x, y, g, "euclidean").values  # torch's min backward: one-hot at the argmin
    ref = torch.autograd.grad((ref_v * w).sum(), (x, y, g))
    for a, b in zip(got, ref):
        assert rel_err(a, b) < 1e-12


def test_c_transform_coincident_points_have_finite_gradient():
    x = torch.zeros(3, 2, dtype=DT, requires_grad=True)
    y = torch.zeros(2, 2, dtype=DT)
    v, _ = ops.c_transform(x, y, cost="euclidean", backend="tiled")
    (gx,) = torch.autograd.grad(v.sum(), x)
    assert torch.isfinite(gx).all()


def test_c_transform_float32_far_from_origin():
    x = torch.rand(200, 3) + 1000.0
    y = torch.rand(300, 3) + 1000.0
    v, i = ops.c_transform(x, y, backend="tiled")
    ref = _dense_ref(x.double(), y.double(), torch.zeros(300, dtype=DT), "sqeuclidean")
    assert (i == ref.indices).float().mean() > 0.99
    assert (v.double() - ref.values).abs().max() < 1e-4


def test_c_transform_bad_input():
    x, y = torch.randn(5, 2), torch.randn(6, 2)
    with pytest.raises(ValueError, match="g: expected shape"):
        ops.c_transform(x, y, torch.zeros(5))
    with pytest.raises(ValueError, match="g: contains NaN"):
        ops.c_transform(x, y, torch.full((6,), float("nan")))
    with pytest.raises(ValueError, match="g: every entry is -inf"):
        ops.c_transform(x, y, torch.full((6,), float("-inf")))
    with pytest.raises(TypeError, match="g: expected a torch.Tensor"):
        ops.c_transform(x, y, [0.0] * 6)
    with pytest.raises(ValueError, match="cost"):
        ops.c_transform(x, y, cost="cosine")
    with pytest.raises(ValueError, match="y: point dimensions|x and y"):
        ops.c_transform(x, torch.randn(6, 3))
    with pytest.raises(ValueError, match="k: expected"):
        row_topk(x[None], y[None], torch.zeros(1, 6), 1.0, get_cost("sqeuclidean"), 7)
