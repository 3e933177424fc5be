"""Bad input raises a clear error naming the argument, before any heavy work."""

import numpy as np
import pytest
import torch

import flashot
from flashot import ops

x = torch.randn(10, 3)
y = torch.randn(8, 3)


@pytest.mark.parametrize(
    "args, exc, match",
    [
        ((x, y[:, :2]), ValueError, "dimensions differ"),
        ((x.double(), y), TypeError, "dtypes"),
        ((x.int(), y), TypeError, "floating-point"),
        ((x[None].expand(2, 10, 3), y[None].expand(3, 8, 3)), ValueError, "batch sizes"),
        ((torch.randn(10), y), ValueError, r"\(N, D\)"),
        ((torch.randn(0, 3), y), ValueError, "empty"),
        ((torch.full((10, 3), float("nan")), y), ValueError, "NaN"),
        ((x, torch.full((8, 3), float("inf"))), ValueError, "Inf"),
        (([[0.0]], y), TypeError, "torch.Tensor"),
    ],
)
def test_points(args, exc, match):
    with pytest.raises(exc, match=match):
        flashot.SamplesLoss()(*args)


@pytest.mark.parametrize(
    "a, match",
    [
        (torch.full((10,), -0.1), "non-negative"),
        (torch.zeros(10), "zero mass"),
        (torch.ones(9), "shape"),
        (torch.tensor([float("nan")] * 10), "NaN"),
        (torch.ones(10).double(), None),  # dtype of weights may differ: cast
    ],
)
def test_weights(a, match):
    b = torch.full((8,), 1 / 8)
    if match is None:
        flashot.SamplesLoss()(a / a.sum(), x, b, y)
        return
    with pytest.raises(ValueError, match=match):
        flashot.SamplesLoss()(a, x, b, y)


def test_parameters():
    with pytest.raises(ValueError, match="blur"):
        flashot.SamplesLoss(blur=0)
    with pytest.raises(ValueError, match="blur"):
        flashot.SamplesLoss(blur=-1.0)
    with pytest.raises(ValueError, match="scaling"):
        flashot.SamplesLoss(scaling=1.0)
    with pytest.raises(ValueError, match="scaling"):
        flashot.SamplesLoss(scaling=0)
    with pytest.raises(ValueError, match="p"):
        flashot.SamplesLoss(p=3)
    with pytest.raises(ValueError, match="diameter"):
        flashot.SamplesLoss(diameter=-2.0)
    with pytest.raises(ValueError, match="backend"):
        flashot.SamplesLoss(backend="gpu-magic")(x, y)
    with pytest.raises(ValueError, match="arguments"):
        flashot.SamplesLoss()(x, y, x)
    with pytest.raises(ValueError, match="reg"):
        flashot.solve_sample(x, y)
    with pytest.raises(ValueError, match="reg"):
        flashot.solve_sample(x, y, reg=0.0)
    with pytest.raises(ValueError, match="max_iter"):
        flashot.solve_sample(x, y, reg=0.1, max_iter=0)
    with pytest.raises(ValueError, match="tol"):
        flashot.solve_sample(x, y, reg=0.1, tol=-1.0)
    with pytest.raises(ValueError, match="method"):
        flashot.solve_sample(x, y, reg=0.1, method="newton")
    with pytest.raises(ValueError, match="cost"):
        flashot.solve_sample(x, y, reg=0.1, cost="cosine")
    with pytest.raises(TypeError, match="numpy"):
        flashot.solve_sample(x.numpy(), y, reg=0.1)
    with pytest.raises(ValueError, match="potentials_init"):
        flashot.solve_sample(x, y, reg=0.1, potentials_init=(torch.zeros(3), torch.zeros(8)))
    with pytest.raises(ValueError, match="eps"):
        ops.softmin(x, y, torch.zeros(8), eps=0.0)
    with pytest.raises(ValueError, match="h"):
        ops.softmin(x, y, torch.zeros(7), eps=1.0)


def test_numpy_object_arrays_rejected():
    with pytest.raises(TypeError, match="X_a"):
        flashot.solve_sample(np.array([["a", "b"]]), np.zeros((2, 2)), reg=0.1)


def test_forcing_an_engine_that_cannot_run_is_a_clear_error():
    with pytest.raises(ValueError, match="backend"):
        ops.softmin(x, y, torch.zeros(8), 1.0, backend="not-an-engine")


def test_validation_happens_before_heavy_work(monkeypatch):
    """A NaN in a huge problem is reported without running any softmin."""
    from flashot.ops.tiled import TiledEngine

    def boom(*a, **k):  # pragma: no cover - must not be called
        raise AssertionError("heavy work started")

    monkeypatch.setattr(TiledEngine, "softmin", boom)
    big = torch.rand(200_000, 3)
    big[-1, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        flashot.SamplesLoss(backend="tiled")(big, big)
