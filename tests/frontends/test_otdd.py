"""Label-augmented costs (``LabelCost``) and the OT dataset distance (``flashot.otdd``).

Oracles, float64: the formula ``C = w_f |x - y|^2 + w_l W[l, l']`` written out densely here (the primitives
of every engine, both orders), POT computing the same definitions (``ot.solve`` on that dense matrix for
the solves, ``ot.solve_sample`` per class pair for ``W``; tolerance 1e-8), the dense float64 oracle of
tests/references.py for ``W`` where POT's plain iterations do not converge, central finite differences
for the gradients.  Bad inputs raise before any solve.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashot
from flashot import ops
from flashot.costs import LabelCost

ot = pytest.importorskip("ot")
pytestmark = pytest.mark.usefixtures("one_thread")  # small problems

ENGINES = ["dense", "tiled", "cpu", "triton"]
F64 = torch.float64


def _engine(name: str, cost) -> ops.Engine:
    try:
        return ops.get_engine(name, device=torch.device("cpu"), dtype=F64, cost=cost)
    except ValueError as e:  # triton without a GPU (or a CPU-interpreting triton)
        pytest.skip(str(e)[:120])


def _data(B=None, N=23, M=17, D=3, ca=3, cb=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    lead = () if B is None else (B,)
    X = torch.randn(*lead, N, D, generator=g, dtype=F64)
    Y = torch.randn(*lead, M, D, generator=g, dtype=F64) + 0.5
    la = torch.randint(0, ca, (*lead, N), generator=g)
    lb = torch.randint(0, cb, (*lead, M), generator=g)
    W = torch.rand(ca, cb, generator=g, dtype=F64) * 2 - 0.5  # negative entries too
    return X, Y, la, lb, W


def _formula(X, Y, la, lb, W, fw, lw):
    """The augmented cost, densely, from its definition."""
    d2 = ((X.unsqueeze(-2) - Y.unsqueeze(-3)) ** 2).sum(-1)
    return fw * d2 + lw * W[la.unsqueeze(-1), lb.unsqueeze(-2)]


def _close(u, v, rtol):
    u, v = (torch.as_tensor(t, dtype=F64) if not isinstance(t, torch.Tensor) else t.detach().double() for t in (u, v))
    assert float((u - v).abs().max()) <= rtol * max(float(v.abs().max()), 1e-300), float((u - v).abs().max())


# -- the primitives: every engine against the formula ------------------------------------------------
@pytest.mark.parametrize("engine", ENGINES)
def test_primitives_equal_the_dense_formula(engine):
    X, Y, la, lb, W = _data(B=2)
    fw, lw, eps = 0.7, 1.3, 0.3
    cost = LabelCost(W, fw, lw)
    eng = _engine(engine, cost)
    x, y = cost.augment(X, Y, (la, lb))
    C = _formula(X, Y, la, lb, W, fw, lw)
    g = torch.Generator().manual_seed(1)
    hy, hx = torch.randn(2, 17, generator=g, dtype=F64), torch.randn(2, 23, generator=g, dtype=F64)
    hy[0, 3] = -torch.inf  # a zero weight contributes nothing
    _close(eng.softmin(x, y, hy, eps, cost), -eps * torch.logsumexp(hy.unsqueeze(-2) - C / eps, -1), 1e-12)
    _close(
        eng.softmin(y, x, hx, eps, cost),  # the transposed call: C(y, x) = C(x, y)^T
        -eps * torch.logsumexp(hx.unsqueeze(-2) - C.transpose(-1, -2) / eps, -1),
        1e-12,
    )
    V = torch.randn(2, 17, 2, generator=g, dtype=F64)
    K = torch.exp(hx.unsqueeze(-1) + hy.unsqueeze(-2) - C / eps)
    for weight, Wt in (("plan", 1.0), ("cost", C), ("dcost", 2 * fw)):
        _close(eng.plan_product(x, y, hx, hy, eps, V, cost, weight), (K * Wt) @ V, 1e-12)
    U = torch.randn(2, 23, 1, generator=g, dtype=F64)
    _close(eng.plan_product(y, x, hy, hx, eps, U, cost, "cost"), (K * C).transpose(-1, -2) @ U, 1e-12)


@pytest.mark.parametrize("engine", ENGINES)
def test_solve_sample_equals_pot_on_the_dense_cost(engine):
    X, Y, la, lb, W = _data()
    fw, lw, reg = 0.5, 2.0, 1.0
    cost = LabelCost(W, fw, lw)
    _engine(engine, cost)
    res = flashot.solve_sample(X, Y, reg=reg, cost=cost, labels=(la, lb), backend=engine, tol=1e-11, max_iter=20000)
    C = _formula(X, Y, la, lb, W, fw, lw)
    ref = ot.solve(C.numpy(), reg=reg, max_iter=20000, tol=1e-13)
    assert res.converged
    _close(res.value, float(ref.value), 1e-8)
    _close(res.plan.to_dense(), torch.as_tensor(ref.plan), 1e-7)
    _close(res.plan.cost_sum(), float(ref.value_linear), 1e-8)
    assert res.plan.barycentric_map().shape == X.shape  # the features, not the label column
    assert res.plan.T.barycentric_map().shape == Y.shape


@pytest.mark.parametrize("engine", ["dense", "tiled", "cpu"])
def test_float32_agrees_with_float64(engine):
    X, Y, la, lb, W = _data(N=120, M=100)
    cost = LabelCost(W, 1.0, 0.5)
    ref = flashot.solve_sample(X, Y, reg=0.2, cost=cost, labels=(la, lb), backend="dense", tol=1e-9)
    res = flashot.solve_sample(X.float(), Y.float(), reg=0.2, cost=cost, labels=(la, lb), backend=engine, tol=1e-5)
    assert res.converged and res.value.dtype == torch.float32
    _close(res.value, ref.value, 1e-5)


def test_batched_and_numpy_inputs():
    X, Y, la, lb, W = _data(B=2)
    cost = LabelCost(W, 1.0, 1.0)
    res = flashot.solve_sample(X, Y, reg=0.5, cost=cost, labels=(la, lb), tol=1e-11, max_iter=20000)
    for k in range(2):
        one = flashot.solve_sample(X[k], Y[k], reg=0.5, cost=cost, labels=(la[k], lb[k]), tol=1e-11, max_iter=20000)
        _close(res.value[k], one.value, 1e-9)
    npres = flashot.solve_sample(
        X[0].numpy(), Y[0].numpy(), reg=0.5, cost=cost, labels=(la[0].numpy(), lb[0].numpy()), tol=1e-11, max_iter=20000
    )
    assert isinstance(npres.value, np.floating)
    _close(npres.value, res.value[0], 1e-9)


@pytest.mark.parametrize("engine", ["dense", "tiled", "cpu"])
def test_value_gradient_matches_finite_differences(engine):
    X, Y, la, lb, W = _data(N=12, M=9, D=2)
    cost = LabelCost(W, 0.8, 1.5)
    kw = dict(reg=0.5, cost=cost, labels=(la, lb), backend=engine, tol=1e-13, max_iter=50000)
    Xr, Yr = X.clone().requires_grad_(), Y.clone().requires_grad_()
    gx, gy = torch.autograd.grad(flashot.solve_sample(Xr, Yr, **kw).value, (Xr, Yr))
    h = 1e-5
    for P, G, which in ((X, gx, 0), (Y, gy, 1)):
        for idx in ((0, 0), (4, 1), (P.shape[0] - 1, 1)):
            E = torch.zeros_like(P)
            E[idx] = h
            args = [(X + E, Y), (X - E, Y)] if which == 0 else [(X, Y + E), (X, Y - E)]
            vp, vm = (flashot.solve_sample(*a, **kw).value for a in args)
            assert abs(float(G[idx]) - float(vp - vm) / (2 * h)) <= 1e-7 * max(1.0, abs(float(G[idx])))


@pytest.mark.parametrize("engine", ["dense", "cpu"])
def test_value_linear_gradient_matches_finite_differences(engine):
    """``<C, P>``: implicit differentiation through the fixed point, the label cost's ``C W = 2 w_f C``."""
    X, Y, la, lb, W = _data(N=12, M=9, D=2)
    kw = dict(reg=0.5, cost=LabelCost(W, 0.8, 1.5), labels=(la, lb), backend=engine, tol=1e-13, max_iter=50000)
    Xr, Yr = X.clone().requires_grad_(), Y.clone().requires_grad_()
    gx, gy = torch.autograd.grad(flashot.solve_sample(Xr, Yr, **kw).value_linear, (Xr, Yr))
    h = 1e-5
    for idx in ((0, 0), (5, 1)):
        E = torch.zeros_like(X)
        E[idx] = h
        fx = flashot.solve_sample(X + E, Y, **kw).value_linear - flashot.solve_sample(X - E, Y, **kw).value_linear
        E = torch.zeros_like(Y)
        E[idx] = h
        fy = flashot.solve_sample(X, Y + E, **kw).value_linear - flashot.solve_sample(X, Y - E, **kw).value_linear
        assert abs(float(gx[idx]) - float(fx) / (2 * h)) <= 1e-6 * max(1.0, abs(float(gx[idx])))
        assert abs(float(gy[idx]) - float(fy) / (2 * h)) <= 1e-6 * max(1.0, abs(float(gy[idx])))


# -- SamplesLoss ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["tensorized", "online"])
def test_samples_loss_label_cost(backend):
    X, Y, la, lb, _ = _data(ca=3, cb=3)
    W = torch.rand(3, 3, dtype=F64)
    W = W + W.T  # debiasing: one label set, a symmetric table
    cost = LabelCost(W, 0.7, 1.3)
    blur, reg = 0.8, 0.64
    kw = dict(reg=reg, cost=cost, tol=1e-12, max_iter=20000)
    ab = flashot.solve_sample(X, Y, labels=(la, lb), **kw).value
    aa = flashot.solve_sample(X, X, labels=(la, la), **kw).value
    bb = flashot.solve_sample(Y, Y, labels=(lb, lb), **kw).value
    L = flashot.SamplesLoss(cost=cost, blur=blur, debias=False, tol=1e-12, max_iter=20000, backend=backend)
    _close(L(X, Y, labels=(la, lb)), ab, 1e-9)
    L = flashot.SamplesLoss(cost=cost, blur=blur, tol=1e-12, max_iter=20000, backend=backend)
    _close(L(X, Y, labels=(la, lb)), ab - (aa + bb) / 2, 1e-8)


# -- otdd ---------------------------------------------------------------------------------------------
def _pot_otdd(Xa, la, Xb, lb, reg, fw, lw):
    """POT computing the same definitions: W per class pair with ot.solve_sample, then ot.solve on the
    dense augmented cost (uniform weights throughout)."""
    ca, cb = np.unique(la), np.unique(lb)
    W = np.array(
        [
            [float(ot.solve_sample(Xa[la == c], Xb[lb == d], reg=reg, max_iter=20000, tol=1e-13).value) for d in cb]
            for c in ca
        ]
    )
    ia, ib = np.searchsorted(ca, la), np.searchsorted(cb, lb)
    C = fw * ot.dist(Xa, Xb) + lw * W[ia][:, ib]
    return float(ot.solve(C, reg=reg, max_iter=20000, tol=1e-13).value), W


@pytest.mark.parametrize("fw, lw", [(1.0, 1.0), (0.5, 2.0)])
def test_otdd_equals_pot(fw, lw):
    g = torch.Generator().manual_seed(3)
    Xa = torch.randn(36, 2, generator=g, dtype=F64)
    Xb = torch.randn(28, 2, generator=g, dtype=F64) * 1.5 + 0.5
    la = torch.tensor([2, 5, 9] * 12)[torch.randperm(36, generator=g)]  # any integers: sorted classes
    lb = torch.randint(0, 2, (28,), generator=g)
    res = flashot.otdd(Xa, la, Xb, lb, reg=0.5, feature_weight=fw, label_weight=lw, tol=1e-11, max_iter=20000)
    value, W = _pot_otdd(Xa.numpy(), la.numpy(), Xb.numpy(), lb.numpy(), 0.5, fw, lw)
    assert res.converged and res.classes_a.tolist() == [2, 5, 9] and res.classes_b.tolist() == [0, 1]
    _close(res.label_cost, torch.as_tensor(W), 1e-8)
    _close(res.value, value, 1e-8)
    assert res.plan.shape == (36, 28) and res.potentials[0].shape == (36,)
    npres = flashot.otdd(
        Xa.numpy(),
        la.numpy(),
        Xb.numpy(),
        lb.numpy(),
        reg=0.5,
        feature_weight=fw,
        label_weight=lw,
        tol=1e-11,
        max_iter=20000,
    )
    assert isinstance(npres.value, np.floating) and isinstance(npres.label_cost, np.ndarray)
    _close(npres.value, value, 1e-8)


@pytest.mark.parametrize("backends, reg", [(("dense",), 0.2), (("tiled", "cpu"), 0.1)], ids=["dense", "tiled+cpu"])
def test_otdd_label_cost_ragged_and_loop(backends, reg):
    """W from the one ragged batch of class pairs (tiled, cpu) and from the per-pair loop (dense) against the
    dense float64 oracle of tests/references.py run to convergence (1e-10): the batch at a reg where it picks
    eps-scaling and Anderson, where pair (1, 1) alone with plain iterations (the loop's, POT's) does not reach
    1e-11 in 20000 iterations (POT's value there is 2e-7 off).  ``converged`` is False when a solve stops at
    ``max_iter``.  The engines of one reg share the oracle's values (most of the test's time)."""
    import references as ref

    g = torch.Generator().manual_seed(6)
    Xa = torch.randn(45, 2, generator=g, dtype=F64)
    Xb = torch.randn(38, 2, generator=g, dtype=F64) + 1.0
    la, lb = torch.arange(45) % 3, torch.arange(38) % 4
    want = torch.zeros(3, 4, dtype=F64)
    for c in range(3):
        for d in range(4):
            x, y = Xa[la == c], Xb[lb == d]
            a, b = (torch.full((len(t),), 1.0 / len(t), dtype=F64) for t in (x, y))
            want[c, d] = ref.ot_value(x, y, a, b, reg, 2, half=False)
    for backend in backends:
        res = flashot.otdd(Xa, la, Xb, lb, reg=reg, tol=1e-11, max_iter=20000, backend=backend)
        assert res.converged, backend
        err = ((res.label_cost - want).abs() / want.abs()).max()
        assert float(err) <= 1e-10, (backend, res.label_cost, want)
        with pytest.warns(RuntimeWarning, match="did not reach tol"):
            short = flashot.otdd(Xa, la, Xb, lb, reg=reg, tol=1e-11, max_iter=3, backend=backend)
        assert not short.converged, backend


def test_otdd_gradient_matches_finite_differences():
    """Through both stages: the final solve at fixed W and W's own dependence on the points."""
    g = torch.Generator().manual_seed(4)
    Xa, Xb = torch.randn(14, 2, generator=g, dtype=F64), torch.randn(12, 2, generator=g, dtype=F64) + 0.3
    la, lb = torch.arange(14) % 2, torch.arange(12) % 3
    kw = dict(reg=0.5, label_weight=1.7, tol=1e-13, max_iter=50000)
    Xr = Xa.clone().requires_grad_()
    (G,) = torch.autograd.grad(flashot.otdd(Xr, la, Xb, lb, **kw).value, Xr)
    h = 1e-5
    for idx in ((0, 0), (5, 1), (13, 0)):
        E = torch.zeros_like(Xa)
        E[idx] = h
        vp, vm = flashot.otdd(Xa + E, la, Xb, lb, **kw).value, flashot.otdd(Xa - E, la, Xb, lb, **kw).value
        fd = float(vp - vm) / (2 * h)
        assert abs(float(G[idx]) - fd) <= 1e-7 * max(1.0, abs(fd)), (idx, float(G[idx]), fd)


# -- bad input: clear errors before any work ----------------------------------------------------------
def _bad_solve_cases():
    X, Y, la, lb, W = _data()
    c = LabelCost(W)
    return [
        (
            "labels out of range",
            lambda: flashot.solve_sample(X, Y, reg=1, cost=c, labels=(la, lb + 4)),
            ValueError,
            r"labels\[1\]: labels must lie in \[0, 4\)",
        ),
        (
            "negative label",
            lambda: flashot.solve_sample(X, Y, reg=1, cost=c, labels=(la - 1, lb)),
            ValueError,
            r"labels\[0\]: labels must lie in \[0, 3\)",
        ),
        (
            "wrong length",
            lambda: flashot.solve_sample(X, Y, reg=1, cost=c, labels=(la[:-1], lb)),
            ValueError,
            r"labels\[0\]: expected shape \(23,\)",
        ),
        (
            "float labels",
            lambda: flashot.solve_sample(X, Y, reg=1, cost=c, labels=(la.double(), lb)),
            TypeError,
            "integer class labels",
        ),
        ("not a pair", lambda: flashot.solve_sample(X, Y, reg=1, cost=c, labels=la), TypeError, "a pair"),
        (
            "labels without LabelCost",
            lambda: flashot.solve_sample(X, Y, reg=1, labels=(la, lb)),
            ValueError,
            "LabelCost",
        ),
        ("LabelCost without labels", lambda: flashot.solve_sample(X, Y, reg=1, cost=c), ValueError, "labels="),
        (
            "mismatched dims",
            lambda: flashot.solve_sample(X, Y[:, :2], reg=1, cost=c, labels=(la, lb)),
            ValueError,
            "dimensions differ",
        ),
        (
            "multiscale",
            lambda: flashot.solve_sample(X, Y, reg=1, cost=c, labels=(la, lb), backend="multiscale"),
            NotImplementedError,
            "multiscale",
        ),
        ("W 1-D", lambda: LabelCost(torch.ones(3)), ValueError, r"W: expected a \(C_a, C_b\) table"),
        ("W empty", lambda: LabelCost(torch.ones(0, 2)), ValueError, r"W: expected a \(C_a, C_b\) table"),
        ("W NaN", lambda: LabelCost(torch.tensor([[0.0, float("nan")]])), ValueError, "W: contains NaN"),
        ("W Inf", lambda: LabelCost(np.array([[0.0, np.inf]])), ValueError, "W: contains NaN or Inf"),
        ("W string", lambda: LabelCost("W"), TypeError, "W: expected"),
        ("negative weight", lambda: LabelCost(W, feature_weight=-1.0), ValueError, "feature_weight"),
        ("weight string", lambda: LabelCost(W, label_weight="1"), TypeError, "label_weight"),
        ("W grad", lambda: LabelCost(W.clone().requires_grad_()), NotImplementedError, "W.detach"),
        ("debias, W not square", lambda: flashot.SamplesLoss(cost=c), ValueError, "symmetric W"),
        (
            "loss labels without LabelCost",
            lambda: flashot.SamplesLoss()(X, Y, labels=(la, lb)),
            ValueError,
            "LabelCost",
        ),
        (
            "loss LabelCost without labels",
            lambda: flashot.SamplesLoss(cost=c, debias=False)(X, Y),
            ValueError,
            "labels=",
        ),
        (
            "loss hausdorff",
            lambda: flashot.SamplesLoss("hausdorff", cost=c, debias=False),
            NotImplementedError,
            "sinkhorn",
        ),
    ]


@pytest.mark.parametrize("case", _bad_solve_cases(), ids=lambda c: c[0])
def test_bad_input_is_refused(case):
    _, fn, exc, match = case
    with pytest.raises(exc, match=match):
        fn()


def test_otdd_bad_input_before_any_solve(monkeypatch):
    import flashot.dataset_distance as mod

    def no_work(*a, **k):
        raise AssertionError("a solve ran before the checks")

    monkeypatch.setattr(mod, "_class_costs", no_work)
    monkeypatch.setattr(mod, "solve_sample", no_work)
    X, Y, la, lb, _ = _data()
    cases = [
        (lambda: flashot.otdd(X, la[:-1], Y, lb, reg=1), ValueError, r"labels_a: expected shape \(23,\)"),
        (lambda: flashot.otdd(X, la, Y, lb.float(), reg=1), TypeError, "labels_b: expected integer"),
        (lambda: flashot.otdd(X, la, Y[:, :2], lb, reg=1), ValueError, "dimensions differ"),
        (lambda: flashot.otdd(X, la, Y, lb, reg=0), ValueError, "reg"),
        (lambda: flashot.otdd(X, la, Y, lb, reg=1, label_weight=float("nan")), ValueError, "label_weight"),
        (lambda: flashot.otdd(X[None], la[None], Y[None], lb[None], reg=1), ValueError, r"\(N, D\) points"),
        (lambda: flashot.otdd(X, la, Y.numpy(), lb, reg=1), TypeError, "both as torch"),
    ]
    for fn, exc, match in cases:
        with pytest.raises(exc, match=match):
            fn()


def test_triton_without_gpu_names_the_alternative():
    X, Y, la, lb, W = _data()
    try:
        ops.get_engine("triton", device=torch.device("cpu"), dtype=F64, cost=LabelCost(W))
    except ValueError:
        with pytest.raises(ValueError, match="tiled"):
            flashot.solve_sample(X, Y, reg=1, cost=LabelCost(W), labels=(la, lb), backend="triton")
    else:  # pragma: no cover - a CPU-interpreting triton: covered by the primitives' test
        pytest.skip("triton runs here")
