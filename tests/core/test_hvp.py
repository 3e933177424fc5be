"""Second derivatives (Hessian-vector products) by implicit differentiation.

References, all independent of the CG code:
* central finite differences of the first-order gradient of a tightly converged
  solve (tol 1e-13, float64): error O(h^2) + O(solve error / h) ~ 1e-8;
* double backward through many *unrolled* dense Sinkhorn iterations (tests/references.py)
  in plain torch (at convergence the unrolled derivative equals the implicit one).
"""

import warnings

import pytest
import torch

import flashot
from conftest import rel_err
from flashot import implicit as imp
from flashot.ops import register_engine, unregister_engine
from flashot.ops.tiled import TiledEngine
from references import sinkhorn_unrolled

DT = torch.float64


class CountingEngine(TiledEngine):
    """A third-party engine: the tiled engine behind a new name, counting primitive calls."""

    name = "counting"

    def __init__(self):
        super().__init__(tile_elems=500)  # many ragged tiles
        self.calls = {"softmin": 0, "plan_product": 0}

    def softmin(self, *a, **k):
        self.calls["softmin"] += 1
        return super().softmin(*a, **k)

    def plan_product(self, *a, **k):
        self.calls["plan_product"] += 1
        return super().plan_product(*a, **k)


_COUNTING = CountingEngine()


@pytest.fixture(scope="module", autouse=True)
def _register_counting():
    register_engine("counting", lambda: _COUNTING)
    yield
    unregister_engine("counting")


def _problem(N=14, M=17, D=2, B=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    lead = () if B is None else (B,)
    x = torch.randn(*lead, N, D, generator=g, dtype=DT)
    y = torch.randn(*lead, M, D, generator=g, dtype=DT) * 0.8 + 0.5
    a = torch.rand(*lead, N, generator=g, dtype=DT) + 0.5
    b = torch.rand(*lead, M, generator=g, dtype=DT) + 0.5
    return x, y, a / a.sum(-1, keepdim=True), b / b.sum(-1, keepdim=True)


def _solve_grads(x, y, a, b, reg, cost, backend, create_graph=False):
    x = x.clone().requires_grad_()
    y = y.clone().requires_grad_()
    a = a.clone().requires_grad_()
    r = flashot.solve_sample(x, y, a, b, reg=reg, cost=cost, tol=1e-13, max_iter=20000, backend=backend)
    gx, gy, ga = torch.autograd.grad(r.value.sum(), (x, y, a), create_graph=create_graph)
    return (gx, gy, ga), (x, y, a)


@pytest.mark.parametrize("backend", ["dense", "tiled", "counting"])
@pytest.mark.parametrize("cost,reg", [("sqeuclidean", 0.5), ("half_sqeuclidean", 0.1)])
def test_hvp_matches_finite_differences(backend, cost, reg):
    x0, y0, a0, b0 = _problem()
    (gx, gy, _), (x, y, a) = _solve_grads(x0, y0, a0, b0, reg, cost, backend, create_graph=True)
    vx, vy = torch.randn_like(x0), torch.randn_like(y0)
    hx, hy, ha = torch.autograd.grad((gx * vx).sum() + (gy * vy).sum(), (x, y, a))
    h = 1e-5
    (px, py, pa), _ = _solve_grads(x0 + h * vx, y0 + h * vy, a0, b0, reg, cost, backend)
    (mx, my, ma), _ = _solve_grads(x0 - h * vx, y0 - h * vy, a0, b0, reg, cost, backend)
    assert rel_err(hx, (px - mx) / (2 * h)) < 1e-5
    assert rel_err(hy, (py - my) / (2 * h)) < 1e-5
    # mixed d^2 W / da d(x, y): the potentials are defined up to a constant (gauge),
    # so compare up to a constant shift.
    fd_a = (pa - ma) / (2 * h)
    assert rel_err(ha - ha.mean(), fd_a - fd_a.mean()) < 1e-5


def test_hvp_wrt_weights_direction():
    """<d/da <v, grad_x W>, u> for a mass-preserving u, against finite differences in a."""
    x0, y0, a0, b0 = _problem(seed=3)
    u = torch.randn_like(a0)
    u = u - u.mean()
    (gx, _, _), (x, _, a) = _solve_grads(x0, y0, a0, b0, 0.3, "sqeuclidean", "tiled", create_graph=True)
    v = torch.randn_like(x0)
    (ha,) = torch.autograd.grad((gx * v).sum(), (a,))
    h = 1e-6
    (px, _, _), _ = _solve_grads(x0, y0, a0 + h * u, b0, 0.3, "sqeuclidean", "tiled")
    (mx, _, _), _ = _solve_grads(x0, y0, a0 - h * u, b0, 0.3, "sqeuclidean", "tiled")
    fd = ((px - mx) / (2 * h) * v).sum()
    assert abs(float((ha * u).sum() - fd)) < 1e-5 * float(fd.abs())


def _unrolled_ot(x, y, a, b, eps, n_iter, scale):
    """Plain-torch log-domain Sinkhorn (alternating), differentiable by unrolling."""
    C = scale * ((x.unsqueeze(-2) - y.unsqueeze(-3)) ** 2).sum(-1)
    la, lb = a.log(), b.log()
    _, g = sinkhorn_unrolled(C, la, lb, eps, n_iter)
    f = -eps * torch.logsumexp(lb.unsqueeze(-2) + (g.unsqueeze(-2) - C) / eps, -1)
    return (a * f).sum(-1) + (b * g).sum(-1)


@pytest.mark.parametrize("backend", ["dense", "tiled"])
def test_hvp_matches_unrolled_dense_autograd(backend):
    x0, y0, a0, b0 = _problem(N=9, M=11, D=3, B=2, seed=1)
    eps = 0.4
    v = torch.randn_like(x0)
    xr = x0.clone().requires_grad_()
    W = _unrolled_ot(xr, y0, a0, b0, eps, 400, 1.0)
    (g_ref,) = torch.autograd.grad(W.sum(), xr, create_graph=True)
    (h_ref,) = torch.autograd.grad((g_ref * v).sum(), xr)

    x = x0.clone().requires_grad_()
    r = flashot.solve_sample(x, y0, a0, b0, reg=eps, tol=1e-13, max_iter=5000, backend=backend)
    assert rel_err(r.value.detach(), W.detach()) < 1e-10
    (g,) = torch.autograd.grad(r.value.sum(), x, create_graph=True)
    assert rel_err(g.detach(), g_ref.detach()) < 1e-8
    (hv,) = torch.autograd.grad((g * v).sum(), x)
    assert rel_err(hv, h_ref) < 1e-6
    assert imp.last_cg_info["residual"] <= 1e-6


def _unrolled_divergence(x, y, eps, n_iter):
    a = torch.full(x.shape[:-1], 1.0 / x.shape[-2], dtype=x.dtype)
    b = torch.full(y.shape[:-1], 1.0 / y.shape[-2], dtype=y.dtype)
    ot = lambda p, q, u, w: _unrolled_ot(p, q, u, w, eps, n_iter, 0.5)  # noqa: E731
    return ot(x, y, a, b) - 0.5 * ot(x, x, a, a) - 0.5 * ot(y, y, b, b)


@pytest.mark.parametrize("backend", ["dense", "tiled"])
def test_samples_loss_debiased_hvp(backend):
    """Double backward of the debiased divergence (cross and both self problems).

    GeomLoss' schedule visits the final eps only briefly, so its gradient is that of a
    nearly (not exactly) converged problem: a slow schedule (scaling 0.999 from
    diameter 1) is used and the tolerance is 2e-3.
    """
    x0, y0, _, _ = _problem(N=12, M=10, D=2, seed=2)
    blur = 0.7
    v, w = torch.randn_like(x0), torch.randn_like(y0)
    xr, yr = x0.clone().requires_grad_(), y0.clone().requires_grad_()
    S_ref = _unrolled_divergence(xr, yr, blur**2, 300)
    gx_r, gy_r = torch.autograd.grad(S_ref, (xr, yr), create_graph=True)
    hx_r, hy_r = torch.autograd.grad((gx_r * v).sum() + (gy_r * w).sum(), (xr, yr))

    L = flashot.SamplesLoss(blur=blur, diameter=1.0, scaling=0.999, backend=backend)
    x, y = x0.clone().requires_grad_(), y0.clone().requires_grad_()
    S = L(x, y)
    gx, gy = torch.autograd.grad(S, (x, y), create_graph=True)
    hx, hy = torch.autograd.grad((gx * v).sum() + (gy * w).sum(), (x, y))
    assert rel_err(S, S_ref.detach()) < 1e-3
    assert rel_err(gx, gx_r) < 2e-3
    assert rel_err(hx, hx_r) < 2e-3
    assert rel_err(hy, hy_r) < 2e-3


def test_batched_hvp_equals_per_problem():
    x0, y0, a0, b0 = _problem(N=8, M=9, D=2, B=3, seed=4)
    v = torch.randn_like(x0)

    def hvp(x0, y0, a0, b0, v):
        x = x0.clone().requires_grad_()
        r = flashot.solve_sample(x, y0, a0, b0, reg=0.3, tol=1e-12, max_iter=5000, backend="tiled")
        (g,) = torch.autograd.grad(r.value.sum(), x, create_graph=True)
        return torch.autograd.grad((g * v).sum(), x)[0]

    hb = hvp(x0, y0, a0, b0, v)
    for i in range(3):
        assert rel_err(hb[i], hvp(x0[i], y0[i], a0[i], b0[i], v[i])) < 1e-8


def test_first_order_path_is_unchanged_and_cheap():
    """create_graph=False: the envelope gradient sum_j P_ij grad C, two plan products, no CG."""
    x0, y0, a0, b0 = _problem(seed=5)
    x, y = x0.clone().requires_grad_(), y0.clone().requires_grad_()
    r = flashot.solve_sample(x, y, a0, b0, reg=0.2, tol=1e-12, max_iter=5000, backend="counting")
    P = r.plan.to_dense()
    imp.last_cg_info.clear()
    before = _COUNTING.calls["plan_product"]
    gx, gy = torch.autograd.grad(r.value, (x, y))
    assert _COUNTING.calls["plan_product"] - before == 2
    assert not imp.last_cg_info
    ref_x = 2 * (P.sum(1, keepdim=True) * x0 - P @ y0)
    ref_y = 2 * (P.sum(0).unsqueeze(-1) * y0 - P.T @ x0)
    assert rel_err(gx, ref_x) < 1e-9
    assert rel_err(gy, ref_y) < 1e-9


def test_full_hessian_is_symmetric():
    """A dense Hessian assembled from HVPs is symmetric (it is a second derivative)."""
    x0, y0, a0, b0 = _problem(N=5, M=6, D=2, seed=6)
    x = x0.clone().requires_grad_()
    r = flashot.solve_sample(x, y0, a0, b0, reg=0.5, tol=1e-13, max_iter=5000, backend="tiled")
    (g,) = torch.autograd.grad(r.value, x, create_graph=True)
    rows = []
    for k in range(x0.numel()):
        e = torch.zeros(x0.numel(), dtype=DT)
        e[k] = 1
        rows.append(torch.autograd.grad(g.reshape(-1) @ e, x, retain_graph=True)[0].reshape(-1))
    H = torch.stack(rows)
    assert rel_err(H, H.T) < 1e-6


def test_implicit_options_and_errors():
    with pytest.raises(ValueError, match="tol"):
        flashot.ImplicitDiff(tol=0)
    with pytest.raises(ValueError, match="max_iter"):
        flashot.ImplicitDiff(max_iter=0)
    with pytest.raises(ValueError, match="ridge"):
        flashot.ImplicitDiff(ridge=-1.0)
    with pytest.raises(TypeError, match="implicit"):
        flashot.SamplesLoss(implicit="cg")
    with pytest.raises(TypeError, match="implicit"):
        flashot.solve_sample(torch.randn(3, 2), torch.randn(3, 2), reg=1.0, implicit=3)
    # too few CG iterations: a warning, not a silent wrong answer
    x0, y0, a0, b0 = _problem(seed=7)
    x = x0.clone().requires_grad_()
    r = flashot.solve_sample(
        x, y0, a0, b0, reg=0.05, tol=1e-10, max_iter=5000, implicit=flashot.ImplicitDiff(max_iter=1), backend="tiled"
    )
    (g,) = torch.autograd.grad(r.value, x, create_graph=True)
    with pytest.warns(RuntimeWarning, match="conjugate gradients"):
        torch.autograd.grad(g.sum(), x)


def test_second_derivatives_need_dot_cost():
    x = torch.randn(6, 2, dtype=DT, requires_grad=True)
    y = torch.randn(7, 2, dtype=DT)
    S = flashot.SamplesLoss(p=1, blur=0.5)(x, y)
    with pytest.raises(NotImplementedError, match="dot-product cost"):
        torch.autograd.grad(S, x, create_graph=True)
    # first order still works for p=1
    (g,) = torch.autograd.grad(flashot.SamplesLoss(p=1, blur=0.5)(x, y), x)
    assert torch.isfinite(g).all()


def test_hvp_float32_tiled_is_close_to_float64():
    x0, y0, a0, b0 = _problem(N=30, M=25, D=3, seed=8)
    v = torch.randn_like(x0)

    def hvp(dtype):
        x = x0.to(dtype).clone().requires_grad_()
        L = flashot.SamplesLoss(blur=0.5, backend="tiled")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            S = L(x, y0.to(dtype))
            (g,) = torch.autograd.grad(S, x, create_graph=True)
            return torch.autograd.grad((g * v.to(dtype)).sum(), x)[0]

    assert rel_err(hvp(torch.float32), hvp(DT)) < 1e-3


def test_float32_hvp_meets_the_default_tol_and_names_float64_when_it_cannot():
    """The user guide's case (docs/guide.md): a float32 HVP at reg = 0.1 reaches the default CG tol (1e-6)
    without a warning and agrees with a float64 HVP; a tol below float32's rounding floor
    warns, and the warning names float64 as the way out."""
    torch.manual_seed(0)
    x64, y64 = torch.randn(300, 3, dtype=torch.float64), torch.randn(250, 3, dtype=torch.float64) + 1
    v = torch.randn(300, 3, dtype=torch.float64)

    def hvp(dtype, implicit=None):
        x = x64.to(dtype).requires_grad_()
        r = flashot.solve_sample(
            x,
            y64.to(dtype),
            reg=0.5,
            tol=1e-12 if dtype == torch.float64 else 1e-6,
            max_iter=5000,
            implicit=implicit,
            backend="tiled",
        )
        (g,) = torch.autograd.grad(r.value, x, create_graph=True)
        (h,) = torch.autograd.grad(g, x, grad_outputs=v.to(dtype))
        return h.double()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        h32 = hvp(torch.float32)
    assert imp.last_cg_info["residual"] <= 1e-6 == imp.last_cg_info["tol"]
    h64 = hvp(torch.float64)
    assert rel_err(h32, h64) < 1e-3  # measured 4.7e-5
    with pytest.warns(RuntimeWarning, match="float64"):
        hvp(torch.float32, flashot.ImplicitDiff(tol=1e-12, max_iter=30))
