"""``flashot.solve`` / ``sinkhorn`` / ``sinkhorn2`` on a precomputed cost matrix, against POT.

References: POT 0.9's ``ot.solve``, ``ot.sinkhorn`` and ``ot.sinkhorn2`` (float64, run to
``tol=1e-13``), and for gradients POT's autodiff through its iterations.  Ports of POT's
``test/test_solvers.py`` (``test_solve``, ``test_solve_envelope``, ``test_solve_detach``,
``test_solve_last_step``) are marked.  Tolerances: float64 values and plans 1e-9 relative / 1e-12
absolute (both solvers converged to 1e-13 in L1 marginal error); gradients 1e-7 relative to the
largest entry (CG to 1e-10); float32 and lazy float32 1e-5 relative.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashot
from flashot.ops.dense import DENSE_MAX_BYTES_ENV

ot = pytest.importorskip("ot")

TIGHT = dict(tol=1e-13, max_iter=100000)


def _problem(n=10, m=7, d=2, seed=0, weights=False):
    rng = np.random.RandomState(seed)
    x, y = rng.randn(n, d), rng.randn(m, d)
    M = ot.dist(x, y)
    if not weights:
        return M, ot.unif(n), ot.unif(m)
    a, b = rng.rand(n) + 0.1, rng.rand(m) + 0.1
    return M, a / a.sum(), b / b.sum()


def _close(u, v, rtol=1e-9, atol=1e-12):
    np.testing.assert_allclose(np.asarray(u, dtype=np.float64), np.asarray(v, dtype=np.float64), rtol=rtol, atol=atol)


# --- values and plans against POT ------------------------------------------------------------------
@pytest.mark.parametrize("reg", [10.0, 1.0, 0.1])
@pytest.mark.parametrize("weights", [False, True])
def test_solve_matches_pot(reg, weights):
    """POT test_solvers.py::test_solve (10 x 7 clouds, reg 0.1), over more reg values and weights."""
    M, a, b = _problem(weights=weights)
    ref = ot.solve(M, a, b, reg=reg, tol=1e-13, max_iter=100000)
    res = flashot.solve(M, a, b, reg=reg, **TIGHT)
    assert res.converged and isinstance(res.value, np.float64)
    _close(res.value, ref.value)
    _close(res.value_linear, ref.value_linear)
    _close(np.asarray(res.plan), ref.plan)
    _close(res.marginal_a, a)
    _close(res.marginal_b, b)
    # potentials: POT's are (log u, log v) with P = diag(u) K diag(v), i.e. ours are reg (log u - log a),
    # both defined up to the gauge (f + t, g - t)
    fp, gp = reg * (ref.potentials[0] - np.log(a)), reg * (ref.potentials[1] - np.log(b))
    t = float(np.mean(res.potentials[0] - fp))
    _close(res.potentials[0] - t, fp, atol=1e-9 * reg)
    _close(res.potentials[1] + t, gp, atol=1e-9 * reg)


def test_uniform_defaults_and_empty_lists():
    """POT test_solve: ot.solve(M, reg=reg) (uniform weights) equals the call with explicit uniform a, b."""
    M, a, b = _problem()
    r0 = flashot.solve(M, reg=0.1, **TIGHT)
    r1 = flashot.solve(M, a, b, reg=0.1, **TIGHT)
    r2 = flashot.solve(M, [], [], reg=0.1, **TIGHT)
    _close(r0.value, r1.value, rtol=1e-13)
    _close(r2.value, r1.value, rtol=1e-13)


@pytest.mark.parametrize("unbalanced", [1.0, (0.5, None)])
def test_unbalanced_matches_pot(unbalanced):
    M, a, b = _problem(weights=True)
    reg = 0.5
    ub = unbalanced if not isinstance(unbalanced, tuple) else [unbalanced[0], np.inf]
    ref = ot.solve(M, a, b, reg=reg, unbalanced=ub, tol=1e-13, max_iter=100000)
    res = flashot.solve(M, a, b, reg=reg, unbalanced=unbalanced, tol=1e-13, max_iter=100000)
    _close(np.asarray(res.plan), ref.plan, rtol=1e-8, atol=1e-12)
    # value: the objective with generalised KL terms at the plan (POT drops their masses; its value is
    # then the strict sides' <a, f> alone)
    P, rx, ry = (
        ref.plan,
        unbalanced if not isinstance(unbalanced, tuple) else unbalanced[0],
        None if isinstance(unbalanced, tuple) else unbalanced,
    )
    gkl = lambda p, q: float(np.sum(p * np.log(p / q)) - p.sum() + q.sum())  # noqa: E731
    objective = float(np.sum(M * P)) + reg * gkl(P, a[:, None] * b[None]) + rx * gkl(P.sum(1), a)
    if ry is not None:
        objective += ry * gkl(P.sum(0), b)
    _close(res.value, objective, rtol=1e-8)
    f, g = res.potentials
    _close(ref.value, 0.0 if ry is not None else float(b @ g), rtol=1e-8, atol=1e-10)


def test_batched_matches_loop():
    Ms = np.stack([_problem(seed=s)[0] for s in range(3)])
    res = flashot.solve(torch.from_numpy(Ms), reg=0.3, **TIGHT)
    for k in range(3):
        one = flashot.solve(Ms[k], reg=0.3, **TIGHT)
        _close(res.value[k].item(), one.value, rtol=1e-12)
        _close(res.plan.to_dense()[k].numpy(), np.asarray(one.plan), rtol=1e-10, atol=1e-14)


def test_float32_torch_dtype_preserved():
    M, a, b = _problem(weights=True)
    ref = ot.solve(M, a, b, reg=0.5, tol=1e-13, max_iter=100000)
    res = flashot.solve(
        torch.tensor(M, dtype=torch.float32),
        torch.tensor(a, dtype=torch.float32),
        torch.tensor(b, dtype=torch.float32),
        reg=0.5,
    )
    assert res.value.dtype == torch.float32 and res.potentials[0].dtype == torch.float32
    _close(res.value.item(), ref.value, rtol=1e-5)
    res_np = flashot.solve(M.astype(np.float32), a.astype(np.float32), b.astype(np.float32), reg=0.5)
    assert isinstance(res_np.value, np.float32) and res_np.potentials[0].dtype == np.float32


@pytest.mark.parametrize("reg", [1.0, 0.05])
def test_sinkhorn_and_sinkhorn2_match_pot(reg):
    M, a, b = _problem(weights=True)
    P_ref, log_ref = ot.sinkhorn(a, b, M, reg, stopThr=1e-13, numItermax=100000, log=True, method="sinkhorn_log")
    P, log = flashot.sinkhorn(a, b, M, reg, stopThr=1e-13, numItermax=100000, log=True)
    assert isinstance(P, np.ndarray) and P.shape == M.shape
    _close(P, P_ref)
    # POT's (log u, log v) are defined up to a gauge too
    t = float(np.mean(log["log_u"] - log_ref["log_u"]))
    _close(log["log_u"] - t, log_ref["log_u"], atol=1e-9)
    _close(log["log_v"] + t, log_ref["log_v"], atol=1e-9)
    _close(np.exp(log["log_u"])[:, None] * np.exp(-M / reg) * np.exp(log["log_v"])[None], P_ref)
    _close(
        flashot.sinkhorn2(a, b, M, reg, stopThr=1e-13, numItermax=100000),
        ot.sinkhorn2(a, b, M, reg, stopThr=1e-13, numItermax=100000),
    )


def test_sinkhorn_warmstart_roundtrip():
    """POT's warmstart=(log_u, log_v) of a solved problem: the next solve is converged at once."""
    M, a, b = _problem(weights=True)
    _, log = flashot.sinkhorn(a, b, M, 0.2, stopThr=1e-12, numItermax=100000, log=True)
    _, log2 = flashot.sinkhorn(a, b, M, 0.2, stopThr=1e-10, log=True, warmstart=(log["log_u"], log["log_v"]))
    assert log2["niter"] <= 10 and log2["converged"]


# --- gradients -----------------------------------------------------------------------------------------
def _torch(*arrs):
    return [torch.tensor(v, requires_grad=True) for v in arrs]


def _centered(t):
    return t - t.mean()


@pytest.mark.parametrize("reg", [10.0, 0.2])
def test_value_gradients_match_pot_autodiff(reg):
    """POT test_solvers.py::test_solve_envelope: value's gradients in M, a, b (weights centred: gauge)."""
    M, a, b = _problem(weights=True)
    Mp, ap, bp = _torch(M, a, b)
    vp = ot.solve(Mp, ap, bp, reg=reg, grad="autodiff", tol=1e-13, max_iter=100000).value
    gp = torch.autograd.grad(vp, (Mp, ap, bp))
    Mf, af, bf = _torch(M, a, b)
    vf = flashot.solve(Mf, af, bf, reg=reg, **TIGHT).value
    gf = torch.autograd.grad(vf, (Mf, af, bf))
    assert abs(vf.item() - vp.item()) <= 1e-9 * abs(vp.item())
    for u, v in ((gf[0], gp[0]), (_centered(gf[1]), _centered(gp[1])), (_centered(gf[2]), _centered(gp[2]))):
        assert float((u - v).abs().max()) <= 1e-7 * float(v.abs().max())


@pytest.mark.parametrize("reg", [1.0, 0.1])
def test_sinkhorn2_gradients_match_pot_autodiff(reg):
    """<M, P>'s implicit gradients against POT's autodiff through converged iterations."""
    M, a, b = _problem(weights=True)
    Mp, ap, bp = _torch(M, a, b)
    gp = torch.autograd.grad(ot.sinkhorn2(ap, bp, Mp, reg, stopThr=1e-14, numItermax=200000), (Mp, ap, bp))
    Mf, af, bf = _torch(M, a, b)
    gf = torch.autograd.grad(flashot.sinkhorn2(af, bf, Mf, reg, stopThr=1e-14, numItermax=200000), (Mf, af, bf))
    for u, v in ((gf[0], gp[0]), (_centered(gf[1]), _centered(gp[1])), (_centered(gf[2]), _centered(gp[2]))):
        assert float((u - v).abs().max()) <= 1e-6 * float(v.abs().max())
    # solve(M).value_linear is the same function of (M, a, b)
    Ms, as_, bs = _torch(M, a, b)
    gs = torch.autograd.grad(
        flashot.solve(Ms, as_, bs, reg=reg, tol=1e-14, max_iter=200000).value_linear, (Ms, as_, bs)
    )
    for u, v in zip(gs, gf):
        assert float((_centered(u) - _centered(v)).abs().max()) <= 1e-9 * float(v.abs().max())


def test_sinkhorn2_gradient_finite_differences():
    """d<M, P>/dM against central differences of sinkhorn2 itself (float64, tol 1e-13)."""
    M, a, b = _problem(n=6, m=5, weights=True)
    Mf = torch.tensor(M, requires_grad=True)
    g = torch.autograd.grad(flashot.sinkhorn2(a, b, Mf, 0.3, stopThr=1e-14, numItermax=100000), Mf)[0]
    h = 1e-6
    for i, j in ((0, 0), (2, 3), (5, 4)):
        Mp, Mm = M.copy(), M.copy()
        Mp[i, j] += h
        Mm[i, j] -= h
        fd = (
            flashot.sinkhorn2(a, b, Mp, 0.3, stopThr=1e-14, numItermax=100000)
            - flashot.sinkhorn2(a, b, Mm, 0.3, stopThr=1e-14, numItermax=100000)
        ) / (2 * h)
        assert abs(float(g[i, j]) - fd) <= 1e-6 * float(g.abs().max())


def test_detach_and_unbalanced_gradient_rules():
    """POT test_solvers.py::test_solve_detach: grad='detach' gives no graph; an unbalanced value's and
    value_dual's M-gradient is the plan P (envelope theorem; value is the objective at the plan, not
    POT's mass-less one); value_linear's is refused (not implemented for unbalanced problems)."""
    M, a, b = _problem(weights=True)
    Mt = torch.tensor(M, requires_grad=True)
    res = flashot.solve(Mt, a, b, reg=1.0, grad="detach")
    assert not res.value.requires_grad
    ub = flashot.solve(Mt, a, b, reg=1.0, unbalanced=2.0, **TIGHT)
    with pytest.raises(NotImplementedError, match="value_linear"):
        ub.value_linear.backward()
    for v in (ub.value, ub.value_dual):
        g = torch.autograd.grad(v, Mt)[0]
        _close(g.numpy(), np.asarray(ub.plan), rtol=1e-12)


# --- lazy matrices ---------------------------------------------------------------------------------------
class _CountingLazy:
    """A lazy matrix that records the blocks read."""

    def __init__(self, M):
        self.M, self.shape, self.dtype, self.reads = M, M.shape, M.dtype, []

    def __getitem__(self, key):
        blk = self.M[key]
        self.reads.append(blk.shape)
        return blk


def test_lazy_matrix_streams_tiles(tmp_path, monkeypatch):
    import flashot.ops.tiled as tiled

    monkeypatch.setattr(tiled, "COL_BLOCK", 128)  # several column tiles at this size
    rng = np.random.RandomState(1)
    x, y = rng.randn(1100, 3), rng.randn(500, 3)
    M = ot.dist(x, y)
    ref = flashot.solve(M, reg=1.0)
    lazy = _CountingLazy(M)
    res = flashot.solve(lazy, reg=1.0)
    _close(res.value, ref.value, rtol=1e-12)
    solve_reads = lazy.reads[2:]  # after the range scan (2 row blocks of 1024)
    assert lazy.reads[:2] == [(1024, 500), (76, 500)]
    assert max(r * c for r, c in solve_reads) < M.size  # never the whole matrix at once
    np.save(tmp_path / "M.npy", M.astype(np.float32))
    mm = np.load(tmp_path / "M.npy", mmap_mode="r")
    r32 = flashot.solve(mm, reg=1.0)
    assert isinstance(r32.value, np.float32)
    _close(r32.value, ref.value, rtol=1e-5)


# --- the plan as POT users use it -------------------------------------------------------------------------
def test_plan_sum_and_asarray_for_solve_sample():
    rng = np.random.RandomState(2)
    x, y = rng.randn(40, 2), rng.randn(30, 2)
    a = rng.rand(40)
    a /= a.sum()
    res = flashot.solve_sample(x, y, a, reg=0.5, tol=1e-12, max_iter=10000)
    P = np.asarray(res.plan)
    assert P.shape == (40, 30) and P.dtype == np.float64
    ref = ot.solve_sample(x, y, a, reg=0.5, tol=1e-12, max_iter=10000).plan
    _close(P, ref, rtol=1e-8, atol=1e-13)
    _close(res.plan.sum(), 1.0, rtol=1e-10)
    _close(res.plan.sum(1), a, rtol=1e-10)
    _close(res.plan.sum(0), P.sum(0), rtol=1e-12)
    with pytest.raises(ValueError, match="axis"):
        res.plan.sum(2)


def test_asarray_refused_above_the_limit(monkeypatch):
    M, _, _ = _problem(n=50, m=40)
    res = flashot.solve(M, reg=1.0)
    monkeypatch.setenv(DENSE_MAX_BYTES_ENV, "1000")
    with pytest.raises(MemoryError, match="to_dense"):
        np.asarray(res.plan)


# --- errors ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda M: flashot.solve(M), ValueError, "reg"),
        (lambda M: flashot.solve(M, reg=1.0, c=M), NotImplementedError, "c:"),
        (lambda M: flashot.solve(M, reg=1.0, plan_init=M), NotImplementedError, "potentials_init"),
        (lambda M: flashot.solve(M, reg=1.0, backend="cpu"), ValueError, "tiled"),
        (lambda M: flashot.solve(M[0], reg=1.0), ValueError, "shape"),
        (lambda M: flashot.solve(np.where(M > 1, np.nan, M), reg=1.0), ValueError, "NaN"),
        (lambda M: flashot.solve(M, np.ones(3) / 3, reg=1.0), ValueError, "rows"),
        (lambda M: flashot.solve(M, np.full(10, 0.2), reg=1.0), ValueError, "equal total masses"),
        (lambda M: flashot.solve("M", reg=1.0), TypeError, "M:"),
        (lambda M: flashot.solve(M.astype(int), reg=1.0, max_iter=0), ValueError, "max_iter"),
        (lambda M: flashot.sinkhorn(np.ones(10) / 10, np.ones(7) / 7, M, 1.0, unbalanced=1.0), ValueError, "solve"),
    ],
)
def test_errors(call, exc, match):
    M, _, _ = _problem()
    with pytest.raises(exc, match=match):
        call(M)


def test_cost_matrix_passed_as_cost_is_pointed_to_solve():
    """A matrix given as ``cost=`` names flashot.solve and does not print the matrix."""
    x = torch.randn(20, 2)
    M = torch.rand(20, 20)
    with pytest.raises(TypeError, match="flashot.solve") as e:
        flashot.solve_sample(x, x, cost=M, reg=0.1)
    assert len(str(e.value)) < 300
    with pytest.raises(TypeError, match="flashot.solve") as e:  # cost= takes a function (test_custom_cost.py)
        flashot.SamplesLoss(cost=M)
    assert len(str(e.value)) < 300


def test_public_functions_are_callable():
    """flashot.solve / sinkhorn / sinkhorn2 are functions (no longer submodules)."""
    for f in (flashot.solve, flashot.sinkhorn, flashot.sinkhorn2):
        assert callable(f) and f.__module__ == "flashot.pot_matrix"


def test_barycentric_map_refused_for_a_cost_matrix():
    """The plan of a matrix has index points, not coordinates: the map is refused, plan @ Y is the way."""
    M, a, b = _problem()
    res = flashot.solve(M, reg=1.0, **TIGHT)
    with pytest.raises(ValueError, match="plan @ Y"):
        res.plan.barycentric_map()
    Y = np.random.RandomState(0).randn(7, 2)
    P = np.asarray(res.plan)
    _close(res.plan @ Y / res.plan.sum(1)[:, None], (P @ Y) / P.sum(1)[:, None], rtol=1e-12)


# --- malformed matrices: one clear line naming M (issue 34, item 10) ----------------------------------------
class _Lazy:
    """A lazy matrix with a given shape whose blocks come from ``fn(key)``."""

    def __init__(self, shape, fn):
        self.shape, self.fn = shape, fn

    def __getitem__(self, key):
        return self.fn(key)


def _nan_after(M, reads):
    """Blocks of ``M`` that turn to NaN after ``reads`` reads (after the range scan)."""
    count = [0]

    def fn(key):
        count[0] += 1
        blk = np.array(M[key])
        return blk if count[0] <= reads else np.full_like(blk, np.nan)

    return fn


_M = np.random.RandomState(3).rand(5, 7)


@pytest.mark.parametrize(
    "M, exc, match",
    [
        (np.zeros((0, 3)), ValueError, r"M: .*at least one row and one column, got shape \(0, 3\)"),
        (torch.zeros(4, 0), ValueError, r"M: .*at least one row and one column, got shape \(4, 0\)"),
        (torch.zeros(0, 3, 4), ValueError, r"M: .*batch .*empty"),
        (_Lazy((0, 7), lambda k: _M[k]), ValueError, r"M: .*at least one row and one column, got shape \(0, 7\)"),
        (
            _Lazy((-3, 20), lambda k: _M[k]),
            ValueError,
            r"M: the lazy matrix's shape .*non-negative integers.*\(-3, 20\)",
        ),
        (_Lazy((5.5, 7), lambda k: _M[k]), ValueError, r"M: the lazy matrix's shape .*non-negative integers"),
        (
            _Lazy((5, 7), lambda k: None),
            TypeError,
            (
                r"M: the lazy matrix returned a NoneType for rows 0:1, columns 0:1; "
                r"expected an array of real numbers"
            ),
        ),
        (_Lazy((5, 7), lambda k: "abc"), TypeError, r"M: the lazy matrix returned a str for rows 0:1, columns 0:1"),
        (_Lazy((5, 7), lambda k: np.full((5, 7), "x")), TypeError, r"M: the lazy matrix returned .*dtype <U1"),
        (
            _Lazy((5, 7), _nan_after(_M, 2)),
            ValueError,
            (
                r"M: the lazy matrix returned NaN or Inf values for rows \d+:\d+, "
                r"columns \d+:\d+"
            ),
        ),
    ],
)
def test_malformed_matrix_errors(M, exc, match):
    with pytest.raises(exc, match=match) as e:
        flashot.solve(M, reg=1.0)
    assert "\n" not in str(e.value) and "eps" not in str(e.value)


def test_lazy_nan_on_dense_backend():
    """NaN in the blocks read by the ``dense`` backend (the whole matrix, after the scan) is named too."""
    with pytest.raises(ValueError, match="M: the lazy matrix returned NaN or Inf values for rows 0:5, columns 0:7"):
        flashot.solve(_Lazy((5, 7), _nan_after(_M, 2)), reg=1.0, backend="dense")
