"""Ragged batches (:mod:`flashot.ragged`, issue 38): lists of clouds and PyTorch Geometric batch vectors.

Oracle: a Python loop over the problems with the same options (``SamplesLoss`` / ``solve_sample`` on each pair),
float64, values and gradients (points and weights) to 1e-12 (observed ~1e-14: the same iterations, summed in
another order).  Fixed schedules (``SamplesLoss``' with a given ``diameter``, ``solve_sample`` with ``tol=None``)
so that both run the same iterations; ``tol`` is checked per problem.  Engines: ``cpu`` (C++ kernels), ``tiled``
(the PyTorch path) and, in a subprocess under ``TRITON_INTERPRET=1``, ``triton`` on tiny problems.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import flashot
from flashot.ops.run_pattern import RunPattern
from flashot.ops.tiled import TILE_ELEMS
from flashot.ragged import RaggedResult
from flashot.ragged.inputs import RaggedLayout
from flashot.ragged.measures import ROW_CHUNK, row_chunks

N_SIZES, M_SIZES = [5, 17, 9, 1, 23], [8, 4, 30, 2, 11]
F64 = torch.float64


def clouds(seed=0, grad=True, dtype=F64, n=N_SIZES, m=M_SIZES):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(k, 2, generator=g, dtype=dtype).requires_grad_(grad) for k in n]
    ys = [(torch.randn(k, 2, generator=g, dtype=dtype) * 0.8 + 0.3).requires_grad_(grad) for k in m]
    return xs, ys


def weights(sizes, seed, grad=True):
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in sizes:
        w = torch.rand(k, generator=g, dtype=F64) + 0.2
        out.append((w / w.sum()).requires_grad_(grad))
    return out


def close(a, b, tol=1e-12):
    a, b = torch.as_tensor(a).detach(), torch.as_tensor(b).detach()
    return float((a - b).abs().max()) <= tol * max(1.0, float(b.abs().max()))


def grads(v, leaves):
    return torch.autograd.grad(v.sum(), leaves, allow_unused=True)


LOSS_CASES = [
    dict(),
    dict(debias=False),
    dict(p=1),
    dict(p=1, debias=False),
    dict(reach=0.7),
    dict(reach=0.5, debias=False),
    dict(reach_x=0.6, debias=False),
    dict(reach_x=0.6, reach_y=1.5),  # two-sided debiasing
]


@pytest.mark.parametrize("backend", ["cpu", "tiled"])
@pytest.mark.parametrize("kw", LOSS_CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "default")
def test_samples_loss_equals_loop(backend, kw):
    xs, ys = clouds()
    a, b = weights(N_SIZES, 1), weights(M_SIZES, 2)
    L = flashot.SamplesLoss(blur=0.3, diameter=4.0, backend=backend, **kw)
    v = L(a, xs, b, ys)
    assert v.shape == (len(xs),) and v.dtype == F64
    ref = torch.stack([L(*t) for t in zip(a, xs, b, ys)])
    assert close(v, ref)
    leaves = [*xs, *ys, *a, *b]
    for g, r in zip(grads(v, leaves), grads(ref, leaves)):
        assert close(g, r)


def test_uniform_weights_default_diameter_and_pyg():
    """``L(xs, ys)``: uniform weights per problem; default diameter = the largest problem's, so the loop with
    that diameter agrees; the PyTorch Geometric call on the concatenated points gives the same values."""
    xs, ys = clouds(grad=False)
    L = flashot.SamplesLoss(blur=0.2)
    v = L(xs, ys)
    diam = max(float(flashot.schedules.max_diameter(x, y)) for x, y in zip(xs, ys))
    Ld = flashot.SamplesLoss(blur=0.2, diameter=diam)
    assert close(v, torch.stack([Ld(x, y) for x, y in zip(xs, ys)]))
    x, y = torch.cat(xs).requires_grad_(), torch.cat(ys)
    bx = torch.repeat_interleave(torch.arange(len(xs)), torch.tensor(N_SIZES))
    by = torch.repeat_interleave(torch.arange(len(ys)), torch.tensor(M_SIZES))
    w = L(x, y, x_batch=bx, y_batch=by)
    assert close(w, v)
    (gx,) = torch.autograd.grad(w[2], x)  # one problem's value moves its own points only
    own = bx == 2
    assert float(gx[~own].abs().max()) == 0.0 and float(gx[own].abs().max()) > 0


def test_potentials_are_per_problem():
    xs, ys = clouds(grad=False)
    L = flashot.SamplesLoss(blur=0.3, diameter=4.0, potentials=True)
    F, G = L(xs, ys)
    assert isinstance(F, list) and [len(f) for f in F] == N_SIZES and [len(g) for g in G] == M_SIZES
    for k, (x, y) in enumerate(zip(xs, ys)):
        f, g = L(x, y)
        assert close(F[k], f) and close(G[k], g)


def test_tol_holds_for_every_problem():
    xs, ys = clouds(grad=False)
    L = flashot.SamplesLoss(blur=0.7, diameter=4.0, tol=1e-9, debias=False)
    v = L(xs, ys)
    ref = torch.stack([L(x, y) for x, y in zip(xs, ys)])
    assert close(v, ref, 1e-7)
    res = flashot.solve_sample(xs, ys, reg=0.2, tol=1e-9)
    assert res.converged and res.error < 1e-9
    for k in range(len(xs)):
        r = res.plan(k).row_sums()
        assert float((r - 1.0 / N_SIZES[k]).abs().sum()) < 1e-9


@pytest.mark.parametrize("backend", ["cpu", "tiled"])
@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(cost="euclidean"),
        dict(unbalanced=0.8),
        dict(unbalanced=(0.5, None)),
        dict(method="symmetric"),
        dict(eps_scaling=True),
    ],
    ids=["sq", "euclidean", "unbalanced", "semi", "symmetric", "eps_scaling"],
)
def test_solve_sample_equals_loop(backend, kw):
    xs, ys = clouds()
    a, b = weights(N_SIZES, 3), weights(M_SIZES, 4)
    res = flashot.solve_sample(xs, ys, a, b, reg=0.4, tol=None, max_iter=40, backend=backend, **kw)
    assert isinstance(res, RaggedResult) and res.value.shape == (len(xs),) and len(res.potentials) == len(xs)
    refs = [flashot.solve_sample(*t, reg=0.4, tol=None, max_iter=40, backend=backend, **kw) for t in zip(xs, ys, a, b)]
    if kw.get("eps_scaling"):  # one schedule for the batch, from the largest cost bound: the loop differs
        assert all(abs(float(res.value[k].detach()) - float(r.value.detach())) < 1e-3 for k, r in enumerate(refs))
        return
    assert close(res.value, torch.stack([r.value for r in refs]))
    assert close(res.value_dual, torch.stack([r.value_dual for r in refs]))
    for k, r in enumerate(refs):
        assert close(res.potentials[k][0], r.potentials[0]) and close(res.potentials[k][1], r.potentials[1])
        V = torch.randn(M_SIZES[k], 2, dtype=F64)
        assert close(res.plan(k) @ V, r.plan @ V)
    leaves = [*xs, *ys, *a, *b]
    for g, r in zip(grads(res.value, leaves), grads(torch.stack([r.value for r in refs]), leaves)):
        assert close(g, r)


def test_float32_and_numpy():
    xs, ys = clouds(grad=False, dtype=torch.float32)
    L = flashot.SamplesLoss(blur=0.3, diameter=4.0)
    v = L(xs, ys)
    assert v.dtype == torch.float32 and close(v, torch.stack([L(x, y) for x, y in zip(xs, ys)]), 1e-5)
    for blur, debias in ((100.0, True), (100.0, False)):  # high temperature: float64 softmins on copies
        Lh = flashot.SamplesLoss(blur=blur, diameter=4.0, debias=debias)
        assert close(Lh(xs, xs), torch.stack([Lh(x, x) for x in xs]), 1e-6)
        assert close(Lh(xs, ys), torch.stack([Lh(x, y) for x, y in zip(xs, ys)]), 1e-6)
    res = flashot.solve_sample([x.numpy() for x in xs], [y.numpy() for y in ys], reg=0.5)
    ref = flashot.solve_sample(xs[1].numpy(), ys[1].numpy(), reg=0.5)
    assert res.value.shape == (5,) and abs(res.value[1] - ref.value) < 1e-4
    assert res.potentials[1][0].shape == (17,) and type(res.potentials[1][0]).__module__ == "numpy"


def test_many_tiny_problems_linear_memory():
    """3,000 problems: the patterns hold O(chunks) integers (no dense (Kx, Ky) matrix is built) and the values
    match the loop on a sample."""
    g = torch.Generator().manual_seed(5)
    sizes = torch.randint(1, 6, (3000,), generator=g).tolist()
    xs = [torch.randn(k, 2, generator=g, dtype=F64) for k in sizes]
    ys = [torch.randn(k, 2, generator=g, dtype=F64) for k in reversed(sizes)]
    res = flashot.solve_sample(xs, ys, reg=1.0, tol=None, max_iter=10, backend="cpu")
    m = res._problem[1]
    for pat in m.engine._patterns.values():
        assert isinstance(pat, RunPattern) and "_keep" not in pat.__dict__
    for k in (0, 1234, 2999):
        assert close(res.value[k], flashot.solve_sample(xs[k], ys[k], reg=1.0, tol=None, max_iter=10).value)


def test_row_chunks():
    offsets = torch.tensor([0, 3, 1003, 1010, 6010])
    cols = torch.tensor([5, 2000, 100_000, 10**7])
    ro, p = row_chunks(offsets, cols)
    sizes = ro[1:] - ro[:-1]
    assert int(ro[-1]) == 6010 and bool((sizes >= 1).all()) and bool((sizes <= ROW_CHUNK).all())
    assert bool(((sizes * cols[p] <= TILE_ELEMS) | (sizes == 1)).all())
    assert torch.equal(torch.bincount(p), torch.tensor([1, 4, 1, 5000]))
    lay = RaggedLayout(offsets, torch.tensor([0, 1, 2, 3, 4]))
    assert torch.equal(lay.sum(torch.ones(6010, dtype=F64), "x"), torch.tensor([3.0, 1000, 7, 5000], dtype=F64))


BAD = [
    # (call, exception, text)
    (lambda L, xs, ys: L(xs, ys[:-1]), ValueError, "y: expected 5 clouds"),
    (lambda L, xs, ys: L(xs, [ys[0][:, :1]] + ys[1:]), ValueError, "y[0]: points of dimension 1"),
    (lambda L, xs, ys: L(xs[:2] + [xs[2][:0]] + xs[3:], ys), ValueError, "x[2]: the point cloud is empty"),
    (lambda L, xs, ys: L(xs, []), ValueError, "y: expected 5 clouds"),
    (lambda L, xs, ys: L(xs, torch.cat(ys)), TypeError, "y: a ragged batch takes lists"),
    (lambda L, xs, ys: L(xs, [y.float() for y in ys]), TypeError, "y[0]: dtype"),
    (lambda L, xs, ys: L(xs[:1] + [xs[1][0]] + xs[2:], ys), ValueError, "x[1]: expected one cloud of shape (N, D)"),
    (
        lambda L, xs, ys: L([torch.ones(3)] * 5, xs, [torch.ones(2)] + [torch.ones(n) for n in M_SIZES[1:]], ys),
        ValueError,
        "α[0]: expected shape (5,)",
    ),
    (lambda L, xs, ys: L([torch.ones(n) for n in N_SIZES][:4], xs, None, ys), ValueError, "α: expected 5 weight"),
    (lambda L, xs, ys: L([x.detach() * float("nan") for x in xs[:1]] + xs[1:], ys), ValueError, "x[0]: contains NaN"),
]


def _pyg():
    x, y = torch.randn(6, 2, dtype=F64), torch.randn(5, 2, dtype=F64)
    return x, y, torch.tensor([0, 0, 1, 1, 1, 2]), torch.tensor([0, 1, 1, 2, 2])


BAD_PYG = [
    (lambda L, x, y, bx, by: L(x, y, x_batch=bx), ValueError, "y_batch: missing"),
    (lambda L, x, y, bx, by: L(x, y, x_batch=bx.flip(0), y_batch=by), ValueError, "x_batch: must be sorted"),
    (lambda L, x, y, bx, by: L(x, y, x_batch=bx - 1, y_batch=by), ValueError, "x_batch: problem indices must be >= 0"),
    (lambda L, x, y, bx, by: L(x, y, x_batch=bx[:-1], y_batch=by), ValueError, "x_batch: expected shape (6,)"),
    (lambda L, x, y, bx, by: L(x, y, x_batch=bx, y_batch=by + 1), ValueError, "x_batch: problem 3 has no points"),
    (
        lambda L, x, y, bx, by: L(x, y, x_batch=bx, y_batch=torch.tensor([0, 2, 2, 2, 2])),
        ValueError,
        "y_batch: problem 1 has no points",
    ),
    (lambda L, x, y, bx, by: L(x, y, x_batch=bx.double(), y_batch=by), TypeError, "x_batch: expected an integer"),
    (lambda L, x, y, bx, by: L(x, y[:, :1], x_batch=bx, y_batch=by), ValueError, "y: points of dimension 1"),
    (
        lambda L, x, y, bx, by: L(torch.tensor([0.0, 0, 1, 1, 1, 1], dtype=F64), x, None, y, x_batch=bx, y_batch=by),
        ValueError,
        "α: problem 0 has total mass 0",
    ),
]


@pytest.mark.parametrize("case", range(len(BAD)))
def test_bad_lists(case):
    call, exc, text = BAD[case]
    xs, ys = clouds(grad=False)
    with pytest.raises(exc) as e:
        call(flashot.SamplesLoss(blur=0.3), xs, ys)
    assert text in str(e.value)


@pytest.mark.parametrize("case", range(len(BAD_PYG)))
def test_bad_batch_vectors(case):
    call, exc, text = BAD_PYG[case]
    with pytest.raises(exc) as e:
        call(flashot.SamplesLoss(blur=0.3), *_pyg())
    assert text in str(e.value)


def test_bad_solve_sample_and_options():
    xs, ys = clouds(grad=False)
    with pytest.raises(ValueError, match=r"X_b: expected 5 clouds"):
        flashot.solve_sample(xs, ys[:3], reg=0.1)
    with pytest.raises(ValueError, match=r"X_a\[1\]: the point cloud is empty"):
        flashot.solve_sample([xs[0], xs[1][:0]] + xs[2:], ys, reg=0.1)
    with pytest.raises(ValueError, match=r"problem 0"):
        flashot.solve_sample(xs, ys, [2 * torch.ones(n, dtype=F64) / n for n in N_SIZES], None, reg=0.1)
    with pytest.raises(ValueError, match="backend"):
        flashot.solve_sample(xs, ys, reg=0.1, backend="dense")
    with pytest.raises(NotImplementedError, match="potentials_init"):
        flashot.solve_sample(xs, ys, reg=0.1, potentials_init=(None, None))
    with pytest.raises(NotImplementedError, match="loss='hausdorff'"):
        flashot.SamplesLoss("hausdorff", blur=0.3)(xs, ys)
    with pytest.raises(NotImplementedError, match="backend='multiscale'"):
        flashot.SamplesLoss(blur=0.3, backend="multiscale")(xs, ys)
    with pytest.raises(IndexError):
        flashot.solve_sample(xs, ys, reg=0.5).plan(5)


TRITON_SCRIPT = textwrap.dedent("""
    import torch, flashot
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, 2, generator=g, dtype=torch.float64).requires_grad_() for n in (3, 9, 40)]
    ys = [torch.randn(n, 2, generator=g, dtype=torch.float64) for n in (7, 2, 33)]
    L = flashot.SamplesLoss(blur=0.3, diameter=4.0, backend="triton")
    v = L(xs, ys)
    ref = torch.stack([flashot.SamplesLoss(blur=0.3, diameter=4.0, backend="tiled")(x, y) for x, y in zip(xs, ys)])
    gv, gr = torch.autograd.grad(v.sum(), xs), torch.autograd.grad(ref.sum(), xs)
    err = max(float((v - ref).abs().max()), max(float((a - b).abs().max()) for a, b in zip(gv, gr)))
    assert err < 1e-12, err
    print("ok", err)
""")


def test_triton_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", TRITON_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


@pytest.mark.parametrize("backend", ["cpu", "tiled"])
def test_each_problem_against_the_dense_oracle(backend):
    """Independent of flashot's per-problem solvers: every problem's debiased divergence (|x - y|^2 / 2,
    eps = blur^2) and solve_sample value (|x - y|^2, eps = reg) against the dense float64 oracle of
    tests/references.py run to convergence, and the divergence's x-gradient against central finite
    differences of that oracle."""
    import references as ref

    xs, ys = clouds(seed=3, n=[5, 9, 3], m=[7, 4, 6])
    uniform = [torch.full((len(c),), 1.0 / len(c), dtype=F64) for c in xs + ys]
    a_s, b_s = uniform[: len(xs)], uniform[len(xs) :]
    blur, reg = 0.7, 0.3
    S = flashot.SamplesLoss(blur=blur, tol=1e-12, max_iter=100_000, backend=backend)(xs, ys)
    grads = torch.autograd.grad(S.sum(), xs)
    S = S.detach()
    res = flashot.solve_sample(
        [x.detach() for x in xs], [y.detach() for y in ys], reg=reg, tol=1e-12, max_iter=100_000, backend=backend
    )
    g = torch.Generator().manual_seed(5)
    for k, (x, y, a, b) in enumerate(zip(xs, ys, a_s, b_s)):
        x, y = x.detach(), y.detach()
        want = ref.divergence(x, y, a, b, blur**2)
        assert abs(float(S[k]) - want) <= 1e-9 * abs(want), (k, float(S[k]), want)
        want = ref.ot_value(x, y, a, b, reg, 2, half=False)
        assert abs(float(res.value[k]) - want) <= 1e-9 * abs(want), (k, float(res.value[k]), want)
        d = torch.randn(x.shape, generator=g, dtype=F64)
        fd = ref.finite_difference(lambda t, y=y, a=a, b=b: ref.divergence(t, y, a, b, blur**2), x, d)
        got = float((grads[k] * d).sum())
        assert abs(got - fd) <= 1e-6 * max(1.0, abs(fd)), (k, got, fd)


# Accelerations (issue 38): per-problem coefficients.  A small eps (reg = 0.05, largest cost ~20) where plain
# iterations are slow; eps_scaling off in the fixed-iteration comparisons (the batch's schedule starts at the
# batch's largest cost, a single problem's at its own).
ACC_REG = 0.05


@pytest.mark.parametrize("acc", [flashot.Momentum(1.5), flashot.Momentum()], ids=["fixed", "adaptive"])
@pytest.mark.parametrize("kw", [dict(), dict(method="symmetric"), dict(unbalanced=0.8)], ids=["alt", "sym", "unb"])
def test_momentum_equals_loop(acc, kw):
    """Momentum's omega is per problem (its safeguard, stall test and Young estimate read each problem's error):
    the same iterations as each problem alone, so values and gradients agree at a fixed iteration count."""
    xs, ys = clouds(seed=7)
    opts = dict(reg=ACC_REG, tol=None, max_iter=100, eps_scaling=False, acceleration=acc, backend="cpu", **kw)
    res = flashot.solve_sample(xs, ys, **opts)
    refs = torch.stack([flashot.solve_sample(x, y, **opts).value for x, y in zip(xs, ys)])
    assert close(res.value, refs)
    for g, r in zip(grads(res.value, xs + ys), grads(refs, xs + ys)):
        assert close(g, r, 1e-11)


@pytest.mark.parametrize(
    "backend, kw",
    [("cpu", dict()), ("tiled", dict()), ("cpu", dict(method="symmetric")), ("cpu", dict(unbalanced=0.8))],
    ids=["alt-cpu", "alt-tiled", "sym-cpu", "unb-cpu"],
)
def test_anderson_per_problem(backend, kw):
    """Anderson mixes each problem's own history (a Gram system per problem, from segment sums).  Its
    extrapolation amplifies rounding (the same problem on two engines differs by 0.1 after 20 steps at this
    eps), so the comparison is at convergence: values against each problem's single Anderson solve and (balanced)
    the dense float64 oracle, gradients against the single solves."""
    import references as ref

    xs, ys = clouds(seed=7)
    opts = dict(reg=ACC_REG, tol=1e-12, max_iter=5000, acceleration=flashot.Anderson(), backend=backend, **kw)
    res = flashot.solve_sample(xs, ys, **opts)
    assert res.converged
    singles = [flashot.solve_sample(x, y, **opts) for x, y in zip(xs, ys)]
    refs = torch.stack([r.value for r in singles])
    assert close(res.value, refs, 1e-10)
    for g, r in zip(grads(res.value, xs + ys), grads(refs, xs + ys)):
        assert close(g, r, 1e-9)
    if not kw.get("unbalanced"):
        for k, (x, y) in enumerate(zip(xs, ys)):
            a, b = (torch.full((len(t),), 1.0 / len(t), dtype=F64) for t in (x, y))
            want = ref.ot_value(x.detach(), y.detach(), a, b, ACC_REG, 2, half=False)
            got = float(res.value[k].detach())
            assert abs(got - want) <= 1e-10 * abs(want), (k, got, want)


def test_acceleration_cuts_iterations():
    """At small eps the accelerated batches stop in far fewer iterations than plain ones (each problem still
    meets tol: the batch's error is the largest problem's); "auto" picks Anderson there, as for one problem."""
    xs, ys = clouds(seed=7, grad=False)
    opts = dict(reg=ACC_REG, tol=1e-9, max_iter=5000, eps_scaling=False)
    n = {}
    for name, acc in (("plain", None), ("anderson", flashot.Anderson()), ("momentum", flashot.Momentum())):
        res = flashot.solve_sample(xs, ys, acceleration=acc, **opts)
        assert res.converged and res.error < 1e-9
        for k in range(len(xs)):
            assert float((res.plan(k).row_sums() - 1.0 / N_SIZES[k]).abs().sum()) < 1e-8
        n[name] = res.n_iter
    assert n["anderson"] * 4 < n["plain"] and n["momentum"] * 2 < n["plain"], n
    auto = flashot.solve_sample(xs, ys, reg=ACC_REG, tol=1e-9, max_iter=5000)
    plain = flashot.solve_sample(xs, ys, reg=ACC_REG, tol=1e-9, max_iter=5000, acceleration=None)
    assert auto.converged and auto.n_iter * 2 < plain.n_iter, (auto.n_iter, plain.n_iter)
