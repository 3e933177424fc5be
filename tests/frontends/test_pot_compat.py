"""POT's calling conventions for ``solve_sample`` (issue 14, item 3), checked against POT itself
(``ot.solve_sample``, POT 0.9.x; its tests ``test/test_solvers.py::test_solve_sample`` call it
with these arguments)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashot

ot = pytest.importorskip("ot")


def _data(dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)
    xs, xt = rng.normal(size=(40, 2)).astype(dtype), (rng.normal(size=(30, 2)) + 1).astype(dtype)
    a = rng.random(40).astype(dtype)
    b = rng.random(30).astype(dtype)
    return xs, xt, a / a.sum(), b / b.sum()


def test_positional_metric_and_reg_in_pots_order():
    xs, xt, a, b = _data()
    ref = ot.solve_sample(xs, xt, a, b, "sqeuclidean", 1.0)
    res = flashot.solve_sample(xs, xt, a, b, "sqeuclidean", 1.0, tol=1e-12, max_iter=10000)
    assert abs(res.value - ref.value) < 1e-8 * abs(ref.value)
    with pytest.raises(
        TypeError, match=r"metric: .*POT's order is \(X_a, X_b, a, b, metric, reg\): did you mean reg=0\.5"
    ):
        flashot.solve_sample(xs, xt, a, b, 0.5)


def test_empty_weights_mean_uniform():
    xs, xt, _, _ = _data()
    r1 = flashot.solve_sample(xs, xt, [], [], reg=1.0)
    r2 = flashot.solve_sample(xs, xt, reg=1.0)
    r3 = flashot.solve_sample(xs, xt, np.array([]), None, reg=1.0)
    assert r1.value == r2.value == r3.value


@pytest.mark.parametrize(
    "method",
    [
        "sinkhorn",
        "sinkhorn_log",
        "sinkhorn_stabilized",
        "sinkhorn_epsilon_scaling",
        "geomloss",
        "geomloss_online",
        None,
    ],
)
def test_pot_method_names_agree_with_pot(method):
    xs, xt, a, b = _data()
    ref = ot.solve_sample(xs, xt, a, b, reg=1.0, max_iter=10000, tol=1e-12)
    res = flashot.solve_sample(xs, xt, a, b, reg=1.0, method=method, tol=1e-12, max_iter=10000)
    assert abs(res.value - ref.value) < 1e-8 * abs(ref.value)


def test_unsupported_pot_methods_name_the_alternative():
    xs, xt, a, b = _data()
    with pytest.raises(ValueError, match="method: .*greenkhorn / screenkhorn / exact solvers: use POT"):
        flashot.solve_sample(xs, xt, a, b, reg=1.0, method="greenkhorn")


def test_accepted_pot_options_and_grad():
    xs, xt, a, b = _data()
    base = flashot.solve_sample(xs, xt, a, b, reg=1.0)
    for kw in (
        {"lazy": True},
        {"batch_size": 128},
        {"n_threads": 4},
        {"reg_type": "KL"},
        {"unbalanced_type": "TV"},
    ):  # unbalanced_type is ignored when unbalanced=None, as in POT
        assert flashot.solve_sample(xs, xt, a, b, reg=1.0, **kw).value == base.value, kw
    with pytest.raises(ValueError, match="grad"):
        flashot.solve_sample(xs, xt, a, b, reg=1.0, grad="nope")
    with pytest.raises(ValueError, match="reg_type"):
        flashot.solve_sample(xs, xt, a, b, reg=1.0, reg_type="L2")
    x = torch.tensor(xs, requires_grad=True)
    r = flashot.solve_sample(x, torch.tensor(xt), torch.tensor(a), torch.tensor(b), reg=1.0, grad="detach")
    assert not r.value.requires_grad and not r.potentials[0].requires_grad
    for g in ("autodiff", "envelope", "last_step"):
        r = flashot.solve_sample(x, torch.tensor(xt), torch.tensor(a), torch.tensor(b), reg=1.0, grad=g)
        assert r.value.requires_grad


def test_numpy_dtype_is_preserved():
    xs, xt, a, b = _data(np.float32)
    res = flashot.solve_sample(xs, xt, a, b, reg=1.0)
    assert isinstance(res.value, np.floating) and res.value.dtype == np.float32
    assert res.potentials[0].dtype == np.float32 and res.value_linear.dtype == np.float32
    ref = ot.solve_sample(
        xs.astype(np.float64),
        xt.astype(np.float64),
        a.astype(np.float64),
        b.astype(np.float64),
        reg=1.0,
        max_iter=10000,
        tol=1e-9,
    )
    assert abs(float(res.value) - ref.value) < 1e-5 * abs(ref.value)


def test_unequal_masses_raise():
    xs, xt, a, b = _data()
    with pytest.raises(ValueError, match="a and b: balanced OT needs equal total masses"):
        flashot.solve_sample(xs, xt, a, 2 * b, reg=1.0)
    flashot.solve_sample(xs, xt, a, 2 * b, reg=1.0, unbalanced=1.0)  # fine with KL penalties


def test_bfloat16_weights_of_equal_intended_mass_are_accepted():
    """bfloat16 weights of 1/3 sum to 1.00195 (above MASS_RTOL = 1e-3): the threshold is 8 rounding
    units for half-precision inputs (found by tests/ops/test_engines_fuzz.py)."""
    x, y = torch.randn(3, 2, dtype=torch.bfloat16), torch.randn(2, 2, dtype=torch.bfloat16)
    a, b = torch.full((3,), 1 / 3, dtype=torch.bfloat16), torch.full((2,), 0.5, dtype=torch.bfloat16)
    assert float(a.double().sum()) > 1.001
    with pytest.warns(RuntimeWarning, match="different total masses"):  # accepted, and the advice says why
        res = flashot.solve_sample(x, y, a, b, reg=1.0)  # tol is not met: the masses differ by 2e-3
    assert res.value.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="equal total masses"):
        flashot.solve_sample(x, y, a, 0.9 * b, reg=1.0)
