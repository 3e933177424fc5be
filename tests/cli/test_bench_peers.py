"""``flashot bench``: the torch-blocked baseline, the flash-sinkhorn runner (fake module), the exp limit."""

from __future__ import annotations

import importlib.machinery
import math
import sys
import types

import numpy as np
import pytest
import torch

from flashot.bench import limits as limits_mod
from flashot.bench import main
from flashot.bench import peers as peers_mod
from flashot.bench.core import BenchResult, Config, run_bench
from flashot.bench.limits import Limits
from flashot.bench.problems import Problem
from flashot.bench.report import limits_lines

TINY = ["--sizes", "300", "--dims", "3", "--iters", "2", "--repeats", "1", "--no-progress"]


def _solve(name, prob, iters):
    r = peers_mod.get_runner(name)
    x, y = prob.points()
    return r.solve(r.setup(prob, x, y), iters)


# ----------------------------------------------------------------------------- torch-blocked
@pytest.mark.parametrize("dtype, tol", [("float64", 1e-10), ("float32", 2e-5)])
@pytest.mark.parametrize("block_entries", [peers_mod.BLOCK_ENTRIES, 300 * 7])  # one block; 43 uneven blocks
def test_torch_blocked_potentials_match_flashot_dense(monkeypatch, dtype, tol, block_entries):
    monkeypatch.setattr(peers_mod, "BLOCK_ENTRIES", block_entries)
    prob = Problem(300, 280, 3, dtype, 0.1, 0)
    ref = _solve("flashot:dense", prob, 3)
    got = _solve("torch-blocked", prob, 3)
    assert got.f.shape == (300,) and got.g.shape == (280,)
    scale = np.abs(ref.f).max()
    assert np.abs(got.f - ref.f).max() < tol * scale
    assert np.abs(got.g - ref.g).max() < tol * scale


def test_torch_blocked_is_alternating_from_zero():
    """One iteration: f = softmin(x, y, log b), then g from that f (not from g = 0)."""
    prob = Problem(50, 40, 2, "float64", 0.2, 1)
    x, y = (torch.from_numpy(t) for t in prob.points())
    res = _solve("torch-blocked", prob, 1)
    eps = prob.eps
    C = ((x[:, None] - y[None]) ** 2).sum(-1)
    f = -eps * torch.logsumexp(math.log(1 / 40) - C / eps, dim=1)
    g = -eps * torch.logsumexp(math.log(1 / 50) + f[:, None] / eps - C / eps, dim=0)
    np.testing.assert_allclose(res.f, f.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(res.g, g.numpy(), rtol=1e-12, atol=1e-12)


def test_torch_blocked_in_the_bench_agrees(capsys):
    assert "torch-blocked" in peers_mod.PEERS
    rc = main(TINY + ["--in-process", "--no-limits", "--peers", "torch-blocked"])
    assert rc == 0
    res = run_bench(
        Config(
            sizes=[300], dims=[3], iters=2, repeats=1, peers=["torch-blocked"], in_process=True, measure_limits=False
        ),
        progress=False,
    )
    row = [r for r in res.rows if r.solver == "torch-blocked"][0]
    assert row.status == "ok" and row.rel_diff < 1e-5, (row.status, row.reason, row.rel_diff)


# ----------------------------------------------------------------------------- the exp limit
def test_limit_uses_the_faster_exp():
    n, m, d = 1000, 800, 3
    fast_flashot = Limits("float32", exp_rate_torch=1e9, gemm_rate=1e15, threads=2, exp_rate_flashot=4e9)
    assert fast_flashot.exp_rate == 4e9 and fast_flashot.exp_source == "flashot vexp"
    assert fast_flashot.per_iter(n, m, d) == pytest.approx(2 * n * m / 4e9)
    slow_flashot = Limits("float32", exp_rate_torch=3e9, gemm_rate=1e15, threads=2, exp_rate_flashot=1e9)
    assert slow_flashot.exp_rate == 3e9 and slow_flashot.exp_source == "torch.exp"
    assert slow_flashot.per_iter(n, m, d) == pytest.approx(2 * n * m / 3e9)
    no_build = Limits(
        "float32",
        exp_rate_torch=2e9,
        gemm_rate=1e15,
        threads=2,
        exp_rate_flashot=None,
        build_error="no C++ compiler found",
    )
    assert no_build.per_iter(n, m, d) == pytest.approx(2 * n * m / 2e9)
    # GEMM-bound case still wins when it is the slower bound
    gemm_bound = Limits("float32", exp_rate_torch=1e9, gemm_rate=1e9, threads=2, exp_rate_flashot=4e9)
    assert gemm_bound.per_iter(n, m, d) == pytest.approx(4 * n * m * d / 1e9)


def test_limits_line_shows_both_exp_rates():
    res = BenchResult(
        Config(sizes=[1], dims=[1]),
        [],
        {},
        {
            "float32": Limits("float32", 2.3e9, 1e11, 2, 9.1e9),
            "float64": Limits("float64", 2.0e9, 5e10, 2, None, "g++ failed: boom"),
        },
        0.0,
    )
    l32, l64 = limits_lines(res)
    assert "torch.exp 2.3 G/s" in l32 and "flashot compiled vector exp 9.1 G/s" in l32
    assert "the faster (flashot vexp, 9.1 G/s)" in l32
    assert "not measured (g++ failed: boom)" in l64 and "the faster (torch.exp, 2 G/s)" in l64


def test_measure_records_both_rates_and_survives_a_build_error(monkeypatch):
    from flashot.ops.cpu import build

    calls = []

    def fake_rate(fn, work, reps, rounds=3):  # run the measured call once, report a rate per call site
        fn()
        calls.append(work)
        return {2**21: 2e9, limits_mod.VEXP_N: 7e9}.get(work, 1e11)

    monkeypatch.setattr(limits_mod, "_best_rate", fake_rate)
    lim = limits_mod.measure("float32")
    assert (lim.exp_rate_torch, lim.exp_rate_flashot, lim.exp_rate) == (2e9, 7e9, 7e9)
    assert limits_mod.VEXP_N in calls

    def broken():
        raise build.BuildError("no C++ compiler found (set CXX or install g++)")

    monkeypatch.setattr(build, "load", broken)
    lim = limits_mod.measure("float64")
    assert lim.exp_rate_flashot is None and "no C++ compiler" in lim.build_error
    assert lim.exp_rate == lim.exp_rate_torch == 2e9


def test_flashot_vexp_rate_is_measured_for_real():
    pytest.importorskip("flashot.ops.cpu.build")
    from flashot.ops.cpu.build import BuildError

    try:
        rate = limits_mod.flashot_exp_rate("float32")
    except BuildError as e:
        pytest.skip(f"cpu kernels not built: {e}")
    assert rate > 1e6


# ----------------------------------------------------------------------------- flash-sinkhorn (fake module)
class _FakeSamplesLoss:
    """Mimics ``flash_sinkhorn.SamplesLoss`` of flash-sinkhorn 0.4.1 (keyword names, defaults, the checks the
    runner relies on, the (a, x, b, y) call and the alternating potentials), computed densely on any device."""

    calls: list = []

    def __init__(
        self,
        loss="sinkhorn",
        *,
        p=2,
        blur=0.05,
        reach=None,
        reach_x=None,
        reach_y=None,
        scaling=0.5,
        debias=False,
        potentials=False,
        backend="symmetric",
        normalize=True,
        use_epsilon_scaling=True,
        last_extrapolation=True,
        allow_tf32=True,
        truncate_tf32=None,
        use_exp2=True,
        autotune=True,
        half_cost=False,
        eps=None,
        n_iters=None,
        diameter=None,
        eps_list=None,
        threshold=None,
        inner_iterations=10,
        pad_to_multiple=None,
        tol=None,
    ):
        if loss != "sinkhorn" or p != 2:
            raise ValueError("only loss='sinkhorn', p=2")
        if backend == "alternating":
            if use_epsilon_scaling:
                raise ValueError('backend="alternating" requires use_epsilon_scaling=False.')
            if eps is None or n_iters is None:
                raise ValueError('backend="alternating" requires eps and n_iters to be specified.')
        self.kw = dict(
            blur=blur,
            debias=debias,
            potentials=potentials,
            backend=backend,
            allow_tf32=allow_tf32,
            use_epsilon_scaling=use_epsilon_scaling,
            half_cost=half_cost,
            eps=eps,
            n_iters=n_iters,
            threshold=threshold,
            eps_list=eps_list,
            reach=reach,
        )
        self.cost_scale = 0.5 if half_cost else 1.0

    def __call__(self, *args):
        if len(args) == 4:
            a, x, b, y = args
        else:
            (x, y), a, b = args, None, None
        type(self).calls.append(dict(self.kw, nargs=len(args), device=x.device.type))
        kw = self.kw
        if kw["backend"] != "alternating" or kw["use_epsilon_scaling"] or not kw["potentials"] or kw["debias"]:
            raise NotImplementedError("the fake only does the fixed-eps alternating potentials")
        if kw["eps_list"] is not None or kw["threshold"] is not None or kw["reach"] is not None:
            raise NotImplementedError("the fake does no eps list, early stop or unbalanced OT")
        x, y = x.double(), y.double()
        n, m = len(x), len(y)
        la = torch.full((n,), -math.log(n), dtype=torch.float64) if a is None else a.double().log()
        lb = torch.full((m,), -math.log(m), dtype=torch.float64) if b is None else b.double().log()
        eps = kw["eps"]
        C = self.cost_scale * ((x[:, None] - y[None]) ** 2).sum(-1)
        f, g = torch.zeros(n, dtype=torch.float64), torch.zeros(m, dtype=torch.float64)
        for _ in range(kw["n_iters"]):  # GeomLoss convention, f first
            f = -eps * torch.logsumexp(lb + (g - C) / eps, dim=1)
            g = -eps * torch.logsumexp(la[:, None] + (f[:, None] - C) / eps, dim=0)
        return f.float(), g.float()


@pytest.fixture
def fake_flash_sinkhorn(monkeypatch):
    mod = types.ModuleType("flash_sinkhorn")
    mod.__spec__ = importlib.machinery.ModuleSpec("flash_sinkhorn", None)
    mod.__version__ = "0.4.1"
    _FakeSamplesLoss.calls = []
    mod.SamplesLoss = _FakeSamplesLoss
    monkeypatch.setitem(sys.modules, "flash_sinkhorn", mod)
    if peers_mod.importlib.util.find_spec("triton") is None:
        monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton"))
        sys.modules["triton"].__spec__ = importlib.machinery.ModuleSpec("triton", None)
    return mod


def test_flash_sinkhorn_maps_our_problem_onto_its_api(monkeypatch, fake_flash_sinkhorn):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(peers_mod.FlashSinkhorn, "device", "cpu")  # no GPU here: the fake runs anywhere
    runner = peers_mod.get_runner("flash-sinkhorn")
    assert runner.missing() is None
    prob = Problem(300, 300, 3, "float32", 0.1, 0)
    x, y = prob.points()
    st = runner.setup(prob, x, y)
    runner.prepare(st, 4)
    res = runner.solve(st, 4)
    calls = _FakeSamplesLoss.calls
    assert [c["n_iters"] for c in calls] == [1, 4]  # untimed autotune call on the full shape, then the solve
    c = calls[-1]
    assert c["backend"] == "alternating" and c["use_epsilon_scaling"] is False
    assert c["eps"] == pytest.approx(prob.eps) and c["blur"] == pytest.approx(math.sqrt(prob.eps))
    assert c["half_cost"] is False  # cost |x - y|^2, potentials unscaled
    assert c["potentials"] is True and c["debias"] is False and c["threshold"] is None
    assert c["allow_tf32"] is False
    assert c["nargs"] == 4  # (a, x, b, y): our weights
    ref = _solve("flashot:dense", prob, 4)
    assert np.abs(res.f - ref.f).max() < 1e-5 and np.abs(res.g - ref.g).max() < 1e-5
    # the fake can tell a wrong cost convention apart: halving the cost moves the potentials
    half = _FakeSamplesLoss(**dict(runner.loss_kwargs(prob.eps, 4), half_cost=True))
    fh, _ = half(st["a"], st["x"], st["b"], st["y"])
    assert np.abs(fh.double().numpy() - ref.f).max() > 1e-2


def test_flash_sinkhorn_runner_in_the_bench(monkeypatch, fake_flash_sinkhorn):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(peers_mod.FlashSinkhorn, "device", "cpu")
    res = run_bench(
        Config(
            sizes=[300], dims=[3], iters=3, repeats=1, peers=["flash-sinkhorn"], in_process=True, measure_limits=False
        ),
        progress=False,
    )
    row = [r for r in res.rows if r.solver == "flash-sinkhorn"][0]
    assert row.status == "ok", row.reason
    assert row.iters == 3 and row.rel_diff < 1e-5


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only report")
def test_flash_sinkhorn_is_missing_without_cuda(monkeypatch, fake_flash_sinkhorn, capsys):
    why = peers_mod.get_runner("flash-sinkhorn").missing()  # installed (the fake), but no GPU
    assert why and "needs CUDA" in why and "not installed" not in why and "\n" not in why
    rc = main(TINY + ["--in-process", "--no-limits", "--peers", "torch-blocked,flash-sinkhorn"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "missing: flash-sinkhorn: GPU only: needs CUDA (torch.cuda.is_available() is False)" in out
    assert "torch-blocked" in out


def test_flash_sinkhorn_not_installed_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_sinkhorn", None)
    why = peers_mod.get_runner("flash-sinkhorn").missing()
    assert "not installed (flash_sinkhorn" in why
    if not torch.cuda.is_available():
        assert "needs CUDA" in why
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    why = peers_mod.get_runner("flash-sinkhorn").missing()
    assert why.startswith("not installed (flash_sinkhorn") and "CUDA" not in why
