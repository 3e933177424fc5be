"""The bad-input contract, as one table.

Every public entry point (``SamplesLoss``, ``solve_sample``, the lazy plan, the ``ops``
primitives, the ``flashot`` command line) rejects bad input with the documented exception
type and a message that names the argument, before any heavy work: each case runs with the
engines' primitives (softmin, plan product, cost matrices, the top-k pass) replaced by a
function that fails the test if called.

Exception types (``src/flashot/_checks.py`` states them; docs/conventions.md lists them):

* ``TypeError``: wrong kind of argument (a list or string where a tensor is expected, an int /
  bool / complex tensor where real numbers are computed with, ``bool`` where a number or an
  integer is expected, a non-string option name), or points of two dtypes.
* ``ValueError``: a bad value (shapes, batch sizes, NaN / Inf, negative weights, zero mass,
  parameters out of range, unknown option names, ``meta`` / mismatched devices, an ``eps`` the
  dtype cannot represent at the cost scale).
* ``NotImplementedError``: a GeomLoss / POT option flashot does not implement.
* ``MemoryError``: ``plan.to_dense()`` above ``max_elems``.
* ``RuntimeWarning`` (not an error): balanced problems whose weights have different total
  masses (``SamplesLoss`` at once, ``solve_sample`` when ``tol`` is not met).
* CLI: exit status 2 with ``error: argument --name: ...`` (argparse) on stderr.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import pytest
import torch

import flashot
import flashot.cli
from flashot import ops

NAN, INF = float("nan"), float("inf")
g = torch.Generator().manual_seed(0)
x = torch.randn(10, 3, generator=g)
y = torch.randn(8, 3, generator=g)
a = torch.full((10,), 0.1)
b = torch.full((8,), 1 / 8)
xb, yb = x.expand(2, 10, 3).contiguous(), y.expand(2, 8, 3).contiguous()
h8, z10 = torch.zeros(8), torch.zeros(10)
l10, l8 = torch.arange(10) % 2, torch.arange(8) % 3  # class labels
meta = torch.device("meta")
P = flashot.solve_sample(x, y, reg=0.5, backend="dense").plan  # built before the guard below


class OtherDevice(torch.Tensor):
    """A CPU tensor that reports another device: exercises the device checks without a second device."""

    @property
    def device(self):
        return torch.device("cuda", 7)


def elsewhere(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(OtherDevice)


def SL(*args, **kw):
    return flashot.SamplesLoss(**kw)(*args)


def solve(*args, **kw):
    kw.setdefault("reg", 0.1)
    return flashot.solve_sample(*args, **kw)


def softmin(*args, **kw):
    return ops.softmin(*args, **kw)


def pprod(x_=x, y_=y, alpha=z10, beta=h8, eps=1.0, V=None, **kw):
    return ops.plan_product(x_, y_, alpha, beta, eps, torch.ones(8) if V is None else V, **kw)


def bary(Ys=None, As=None, X0=None, reg=0.5, **kw):
    """free_support_barycenter on two clouds of 8 and 6 points (numpy), support of 4 points."""
    Ys = [y.numpy().astype(np.float64), y[:6].numpy().astype(np.float64)] if Ys is None else Ys
    X0 = x[:4].numpy().astype(np.float64) if X0 is None else X0
    return flashot.free_support_barycenter(Ys, As, X0, reg, **kw)


def _nan_at(v: np.ndarray, i: int = 0) -> np.ndarray:
    v = np.array(v, dtype=np.float64)
    v.flat[i] = NAN
    return v


Y8, Y6, X4 = y.double().numpy(), y[:6].double().numpy(), x[:4].double().numpy()
u8, u6, u4 = np.full(8, 1 / 8), np.full(6, 1 / 6), np.full(4, 1 / 4)


def cli(*argv):
    """The console script: ``sys.exit(main(argv))``."""
    rc = flashot.cli.main(list(argv))
    if rc:
        raise SystemExit(rc)
    return rc


class Case(NamedTuple):
    id: str
    call: Callable[[], object]
    exc: type  # an exception type, or a Warning subclass for documented warnings
    match: str  # regex that the message (stderr for the CLI) must contain: names the argument
    heavy: bool = False  # the case may run the engines (warnings after a solve)


CASES = [
    # ---- SamplesLoss: constructor ------------------------------------------------------------
    Case("SL-blur-zero", lambda: flashot.SamplesLoss(blur=0), ValueError, r"^blur: .*positive"),
    Case("SL-blur-negative", lambda: flashot.SamplesLoss(blur=-1.0), ValueError, r"^blur: .*positive"),
    Case("SL-blur-nan", lambda: flashot.SamplesLoss(blur=NAN), ValueError, r"^blur: .*finite"),
    Case("SL-blur-str", lambda: flashot.SamplesLoss(blur="0.1"), TypeError, r"^blur: .*number, got str"),
    Case("SL-blur-bool", lambda: flashot.SamplesLoss(blur=True), TypeError, r"^blur: .*got bool"),
    Case("SL-blur-pow-underflow", lambda: flashot.SamplesLoss(blur=1e-200), ValueError, r"^blur: blur\*\*2 = 0"),
    Case("SL-blur-pow-overflow", lambda: flashot.SamplesLoss(blur=1e200), ValueError, r"^blur: blur\*\*2 = inf"),
    Case("SL-reach-zero", lambda: flashot.SamplesLoss(reach=0), ValueError, r"^reach: .*positive"),
    Case("SL-reach-nan", lambda: flashot.SamplesLoss(reach=NAN), ValueError, r"^reach: .*positive"),
    Case(
        "SL-reach-and-reach_x", lambda: flashot.SamplesLoss(reach=1.0, reach_x=1.0), ValueError, r"^reach: .*not both"
    ),
    Case("SL-reach_y-str", lambda: flashot.SamplesLoss(reach_y="1"), TypeError, r"^reach_y: "),
    Case("SL-p-3", lambda: flashot.SamplesLoss(p=3), ValueError, r"^p: expected 1 or 2"),
    Case("SL-p-bool", lambda: flashot.SamplesLoss(p=True), TypeError, r"^p: .*got bool"),
    Case("SL-p-str", lambda: flashot.SamplesLoss(p="2"), TypeError, r"^p: .*got str"),
    Case("SL-scaling-one", lambda: flashot.SamplesLoss(scaling=1.0), ValueError, r"^scaling: .*\(0, 1\)"),
    Case("SL-scaling-zero", lambda: flashot.SamplesLoss(scaling=0), ValueError, r"^scaling: .*\(0, 1\)"),
    Case("SL-scaling-str", lambda: flashot.SamplesLoss(scaling="0.5"), TypeError, r"^scaling: "),
    Case("SL-diameter-negative", lambda: flashot.SamplesLoss(diameter=-2.0), ValueError, r"^diameter: "),
    Case("SL-truncate-str", lambda: flashot.SamplesLoss(truncate="5"), TypeError, r"^truncate: "),
    Case("SL-debias-str", lambda: flashot.SamplesLoss(debias="no"), TypeError, r"^debias: expected True or False"),
    Case("SL-potentials-none", lambda: flashot.SamplesLoss(potentials=None), TypeError, r"^potentials: "),
    Case("SL-backend-int", lambda: flashot.SamplesLoss(backend=3), TypeError, r"^backend: expected a string"),
    Case("SL-loss-unknown", lambda: flashot.SamplesLoss(loss="mmd"), ValueError, r"^loss: expected one of .*got .mmd."),
    Case("SL-loss-int", lambda: flashot.SamplesLoss(loss=1), TypeError, r"^loss: "),
    Case("SL-cost-keops-formula", lambda: flashot.SamplesLoss(cost="SqDist(X,Y)"), NotImplementedError, r"^cost: "),
    Case("SL-cost-not-callable", lambda: flashot.SamplesLoss(cost=2.0), TypeError, r"^cost: "),
    Case("SL-cost-online", lambda: flashot.SamplesLoss(cost=lambda u, v: u, backend="online"), ValueError, r"^cost: "),
    Case(
        "SL-multiscale-two-sided-debias",
        lambda: flashot.SamplesLoss(backend="multiscale", reach_x=1.0),
        NotImplementedError,
        r"multiscale.*reach_x != reach_y",
    ),
    Case("SL-cluster-scale-alone", lambda: flashot.SamplesLoss(cluster_scale=0.1), ValueError, r"^cluster_scale: "),
    Case(
        "SL-cluster-scale-negative",
        lambda: flashot.SamplesLoss(backend="multiscale", cluster_scale=-1.0),
        ValueError,
        r"^cluster_scale: ",
    ),
    # a string is a ValueError here (flashot.warmstart.check_warm_start; tests/core/test_warmstart.py relies on it)
    Case("SL-warm_start-str", lambda: flashot.SamplesLoss(warm_start="yes"), ValueError, r"^warm_start: "),
    Case("SL-warm_start-below-1", lambda: flashot.SamplesLoss(warm_start=0.5), ValueError, r"^warm_start: "),
    Case("SL-implicit-int", lambda: flashot.SamplesLoss(implicit=3), TypeError, r"^implicit: "),
    Case(
        "SL-implicit-unbalanced",
        lambda: flashot.SamplesLoss(reach=1.0, implicit=flashot.ImplicitDiff()),
        NotImplementedError,
        r"implicit=",
    ),
    # ---- SamplesLoss: call -------------------------------------------------------------------
    Case("SL-points-list", lambda: SL([[0.0]], y), TypeError, r"^x: expected a torch.Tensor, got list"),
    Case("SL-points-str", lambda: SL(x, "y"), TypeError, r"^y: expected a torch.Tensor, got str"),
    Case("SL-points-int", lambda: SL(x.int(), y), TypeError, r"^x: expected a floating-point tensor"),
    Case("SL-points-1d", lambda: SL(torch.randn(10), y), ValueError, r"^x: expected shape \(N, D\)"),
    Case("SL-points-empty", lambda: SL(torch.randn(0, 3), y), ValueError, r"^x: .*empty"),
    Case("SL-points-dims-differ", lambda: SL(x, y[:, :2]), ValueError, r"^x and y: point dimensions differ"),
    Case("SL-points-ndim-differ", lambda: SL(xb, y), ValueError, r"^x and y: expected both"),
    Case("SL-batch-differ", lambda: SL(xb, y.expand(3, 8, 3)), ValueError, r"^x and y: batch sizes differ"),
    Case("SL-dtypes-differ", lambda: SL(x.double(), y), TypeError, r"^x and y: different dtypes"),
    Case("SL-points-nan", lambda: SL(torch.full((10, 3), NAN), y), ValueError, r"^x: contains NaN"),
    Case("SL-points-inf", lambda: SL(x, torch.full((8, 3), INF)), ValueError, r"^y: contains NaN or Inf"),
    Case("SL-points-meta", lambda: SL(x, y.to(meta)), ValueError, r"^y: is on the 'meta' device"),
    Case("SL-points-overflow", lambda: SL(x * 1e20, y), ValueError, r"^x and y: squared distances .* overflow"),
    Case("SL-weights-list", lambda: SL([0.1] * 10, x, b, y), TypeError, r"^α: expected a torch.Tensor"),
    Case("SL-weights-int", lambda: SL(a, x, torch.ones(8, dtype=torch.long), y), TypeError, r"^β: .*floating"),
    Case("SL-weights-negative", lambda: SL(torch.full((10,), -0.1), x, b, y), ValueError, r"^α: .*non-negative"),
    Case("SL-weights-zero-mass", lambda: SL(torch.zeros(10), x, b, y), ValueError, r"^α: .*zero mass"),
    Case("SL-weights-length", lambda: SL(torch.ones(9) / 9, x, b, y), ValueError, r"^α: expected shape \(10,\)"),
    Case("SL-weights-nan", lambda: SL(a, x, torch.full((8,), NAN), y), ValueError, r"^β: contains NaN"),
    Case(
        "SL-weights-batch",
        lambda: SL(torch.ones(3, 10) / 10, xb, torch.ones(2, 8) / 8, yb),
        ValueError,
        r"^α: expected shape \(2, 10\)",
    ),
    Case("SL-weights-meta", lambda: SL(a.to(meta), x, b, y), ValueError, r"^α: is on the 'meta' device"),
    Case(
        "SL-points-devices-differ",
        lambda: SL(x, elsewhere(y)),
        ValueError,
        r"^x and y: on different devices \(cpu vs cuda:7\)",
    ),
    Case("SL-weights-device", lambda: SL(elsewhere(a), x, b, y), ValueError, r"^α: is on cuda:7 but x is on cpu"),
    Case("SL-backend-unknown", lambda: SL(x, y, backend="gpu-magic"), ValueError, r"^backend: expected 'auto'"),
    Case("SL-three-arguments", lambda: SL(x, y, x), ValueError, r"takes \(x, y\) or \(a, x, b, y\), got 3 arguments"),
    Case("SL-blur-below-dtype", lambda: SL(x, y, blur=1e-20), ValueError, r"^blur: eps = 1e-40 is too small"),
    Case(
        "SL-unequal-masses-warn",
        lambda: SL(a * 2, x, b, y),
        RuntimeWarning,
        r"α and β: total masses differ",
        heavy=True,
    ),
    Case("SL-plan-tol", lambda: flashot.SamplesLoss().plan(x, y, tol=-1.0), ValueError, r"^tol: "),
    Case("SL-plan-max_iter", lambda: flashot.SamplesLoss().plan(x, y, max_iter=0), ValueError, r"^max_iter: "),
    # ---- solve_sample ------------------------------------------------------------------------
    Case("SS-reg-missing", lambda: flashot.solve_sample(x, y), ValueError, r"^reg: .*needs reg > 0"),
    Case("SS-reg-zero", lambda: solve(x, y, reg=0.0), ValueError, r"^reg: expected a positive"),
    Case("SS-reg-inf", lambda: solve(x, y, reg=INF), ValueError, r"^reg: expected a positive finite"),
    Case("SS-reg-str", lambda: solve(x, y, reg="0.1"), TypeError, r"^reg: expected a positive number, got str"),
    Case(
        "SS-reg-below-dtype", lambda: solve(x, y, reg=1e-300), ValueError, r"^reg: eps = .* too small for torch.float32"
    ),
    Case("SS-reg-positional", lambda: flashot.solve_sample(x, y, 0.1), TypeError, r"^a: the third positional"),
    Case("SS-max_iter-zero", lambda: solve(x, y, max_iter=0), ValueError, r"^max_iter: expected an integer >= 1"),
    Case(
        "SS-max_iter-bool", lambda: solve(x, y, max_iter=True), TypeError, r"^max_iter: expected an integer, got bool"
    ),
    Case("SS-max_iter-float", lambda: solve(x, y, max_iter=10.0), TypeError, r"^max_iter: .*got float"),
    Case("SS-tol-negative", lambda: solve(x, y, tol=-1.0), ValueError, r"^tol: "),
    Case("SS-tol-nan", lambda: solve(x, y, tol=NAN), ValueError, r"^tol: "),
    Case("SS-inner_iterations-zero", lambda: solve(x, y, inner_iterations=0), ValueError, r"^inner_iterations: "),
    Case("SS-method-unknown", lambda: solve(x, y, method="newton"), ValueError, r"^method: expected one of"),
    Case("SS-method-int", lambda: solve(x, y, method=1), TypeError, r"^method: expected a string"),
    Case("SS-cost-unknown", lambda: solve(x, y, cost="cosine"), ValueError, r"^cost: expected one of"),
    Case("SS-cost-int", lambda: solve(x, y, cost=2), TypeError, r"^cost: expected a cost name"),
    Case("SS-metric-int", lambda: solve(x, y, metric=2), TypeError, r"^metric: expected a cost name"),
    Case(
        "SS-metric-conflict",
        lambda: solve(x, y, cost="euclidean", metric="sqeuclidean"),
        ValueError,
        r"cost='euclidean' and metric='sqeuclidean'",
    ),
    Case("SS-backend-unknown", lambda: solve(x, y, backend="gpu"), ValueError, r"^backend: expected 'auto'"),
    Case("SS-numpy-and-torch", lambda: solve(x.numpy(), y), TypeError, r"^X_a and X_b: .*numpy"),
    Case(
        "SS-numpy-strings",
        lambda: solve(np.array([["a", "b"]]), np.zeros((2, 2))),
        TypeError,
        r"^X_a: expected a real-valued array",
    ),
    Case("SS-points-list", lambda: solve([[0.0, 1.0]], [[1.0, 0.0]]), TypeError, r"^X_a: expected a torch.Tensor"),
    Case("SS-points-4d", lambda: solve(x[None, None], y), ValueError, r"^X_a: expected shape"),
    Case("SS-batch-differ", lambda: solve(xb, y.expand(3, 8, 3)), ValueError, r"^X_a and X_b: batch sizes"),
    Case("SS-weights-negative", lambda: solve(x, y, a, -b), ValueError, r"^b: weights must be non-negative"),
    Case("SS-weights-zero", lambda: solve(x, y, a, b * 0), ValueError, r"^b: total mass must be positive"),
    Case("SS-weights-length", lambda: solve(x, y, a[:9], b), ValueError, r"^a: expected shape \(10,\)"),
    Case("SS-weights-batched-vs-flat", lambda: solve(xb, yb, a, None), ValueError, r"^a: expected shape \(2, 10\)"),
    Case("SS-weights-inf", lambda: solve(x, y, a, torch.full((8,), INF)), ValueError, r"^b: contains NaN or Inf"),
    Case("SS-init-not-pair", lambda: solve(x, y, potentials_init=z10), TypeError, r"^potentials_init: expected a pair"),
    Case(
        "SS-init-shape",
        lambda: solve(x, y, potentials_init=(z10, torch.zeros(7))),
        ValueError,
        r"^potentials_init\[1\]: expected shape \(8,\)",
    ),
    Case(
        "SS-init-nan",
        lambda: solve(x, y, potentials_init=(torch.full((10,), NAN), h8)),
        ValueError,
        r"^potentials_init\[0\]: contains NaN",
    ),
    Case(
        "SS-init-int",
        lambda: solve(x, y, potentials_init=(z10.long(), h8)),
        TypeError,
        r"^potentials_init\[0\]: expected a floating-point",
    ),
    Case(
        "SS-init-meta",
        lambda: solve(x, y, potentials_init=(z10, h8.to(meta))),
        ValueError,
        r"^potentials_init\[1\]: is on the 'meta' device",
    ),
    Case("SS-unbalanced-negative", lambda: solve(x, y, unbalanced=-1.0), ValueError, r"^unbalanced: "),
    Case("SS-unbalanced-str", lambda: solve(x, y, unbalanced="1"), TypeError, r"^unbalanced: "),
    Case(
        "SS-unbalanced_type",
        lambda: solve(x, y, unbalanced=1.0, unbalanced_type="TV"),
        ValueError,
        r"^unbalanced_type: only 'KL'",
    ),
    Case("SS-acceleration-str", lambda: solve(x, y, acceleration="anderson"), TypeError, r"^acceleration: "),
    Case(
        "SS-Momentum-omega",
        lambda: solve(x, y, acceleration=flashot.Momentum(omega=5)),
        ValueError,
        r"^Momentum.omega: expected a number in \(0, 2\)",
    ),
    Case("SS-Anderson-m", lambda: solve(x, y, acceleration=flashot.Anderson(m=0)), ValueError, r"^Anderson.m: "),
    Case(
        "SS-ImplicitDiff-tol",
        lambda: solve(x, y, implicit=flashot.ImplicitDiff(tol=-1)),
        ValueError,
        r"^ImplicitDiff.tol: ",
    ),
    Case("SS-callback-int", lambda: solve(x, y, callback=3), TypeError, r"^callback: expected a callable"),
    Case("SS-verbose-str", lambda: solve(x, y, verbose="yes"), TypeError, r"^verbose: expected True or False"),
    Case("SS-implicit-str", lambda: solve(x, y, implicit="cg"), TypeError, r"^implicit: "),
    Case(
        "SS-unequal-masses",
        lambda: solve(x, y, a * 2, b, max_iter=20),
        ValueError,
        r"^a and b: balanced OT needs equal total masses, got 2 and 1",
    ),
    Case(
        "SS-method-greenkhorn",
        lambda: solve(x, y, method="greenkhorn"),
        ValueError,
        r"^method: .*greenkhorn / screenkhorn",
    ),
    Case("SS-grad-unknown", lambda: solve(x, y, grad="nope"), ValueError, r"^grad: expected one of"),
    Case(
        "SS-metric-number",
        lambda: flashot.solve_sample(x, y, None, None, 0.5),
        TypeError,
        r"^metric: .*did you mean reg=0\.5",
    ),
    # ---- the lazy plan -----------------------------------------------------------------------
    Case("plan-matmul-shape", lambda: P @ torch.ones(10), ValueError, r"^V: expected shape \(8,\) or \(8, K\)"),
    Case("plan-T-matmul-shape", lambda: P.T @ torch.ones(8), ValueError, r"^V: expected shape \(10,\)"),
    Case("plan-matmul-batched-on-flat", lambda: P @ torch.ones(1, 8, 2), ValueError, r"^V: expected shape"),
    Case("plan-matmul-list", lambda: P @ [1.0] * 8, TypeError, r"^V: expected a torch.Tensor or numpy.ndarray"),
    Case("plan-matmul-nan", lambda: P @ torch.full((8,), NAN), ValueError, r"^V: contains NaN or Inf"),
    Case(
        "plan-matmul-complex",
        lambda: P @ torch.ones(8, dtype=torch.complex64),
        TypeError,
        r"^V: expected a real-valued tensor",
    ),
    Case("plan-matmul-numpy-str", lambda: P @ np.array(["a"] * 8), TypeError, r"^V: expected a real-valued array"),
    Case("plan-matmul-meta", lambda: P @ torch.ones(8, device=meta), ValueError, r"^V: is on the 'meta' device"),
    Case("plan-apply-weight", lambda: P.apply(torch.ones(8), weight="kernel"), ValueError, r"^weight: expected one of"),
    Case("plan-to_dense-limit", lambda: P.to_dense(max_elems=10), MemoryError, r"^to_dense: the plan has 80 entries"),
    Case(
        "plan-to_dense-max_elems-str",
        lambda: P.to_dense(max_elems="big"),
        TypeError,
        r"^max_elems: expected an integer",
    ),
    Case("plan-topk-above-M", lambda: P.topk(9), ValueError, r"^k: expected at most 8"),
    Case("plan-T-topk-above-N", lambda: P.T.topk(11), ValueError, r"^k: expected at most 10"),
    Case("plan-topk-zero", lambda: P.topk(0), ValueError, r"^k: expected an integer >= 1"),
    Case("plan-topk-bool", lambda: P.topk(True), TypeError, r"^k: expected an integer, got bool"),
    Case(
        "pfp-f-shape",
        lambda: flashot.plan_from_potentials(x, y, torch.zeros(9), h8, blur=0.1),
        ValueError,
        r"^f: expected shape \(10,\)",
    ),
    Case(
        "pfp-g-nan",
        lambda: flashot.plan_from_potentials(x, y, z10, torch.full((8,), NAN), blur=0.1),
        ValueError,
        r"^g: contains NaN",
    ),
    Case("pfp-no-temperature", lambda: flashot.plan_from_potentials(x, y, z10, h8), ValueError, r"^blur: required"),
    Case(
        "pfp-blur-and-reg",
        lambda: flashot.plan_from_potentials(x, y, z10, h8, blur=0.1, reg=0.1),
        ValueError,
        r"^blur and reg: give one",
    ),
    # ---- ops primitives ----------------------------------------------------------------------
    Case("softmin-eps-zero", lambda: softmin(x, y, h8, 0.0), ValueError, r"^eps: expected a positive"),
    Case("softmin-eps-nan", lambda: softmin(x, y, h8, NAN), ValueError, r"^eps: expected a positive finite"),
    Case("softmin-eps-str", lambda: softmin(x, y, h8, "1"), TypeError, r"^eps: expected a positive number, got str"),
    Case("softmin-eps-below-dtype", lambda: softmin(x, y, h8, 1e-300), ValueError, r"^eps: eps = .* too small"),
    Case("softmin-h-shape", lambda: softmin(x, y, torch.zeros(7), 1.0), ValueError, r"^h: expected shape \(8,\)"),
    Case("softmin-h-list", lambda: softmin(x, y, [0.0] * 8, 1.0), TypeError, r"^h: expected a torch.Tensor"),
    Case("softmin-h-int", lambda: softmin(x, y, h8.long(), 1.0), TypeError, r"^h: expected a floating-point"),
    Case(
        "softmin-h-complex", lambda: softmin(x, y, h8.to(torch.complex64), 1.0), TypeError, r"^h: expected a floating"
    ),
    Case("softmin-h-nan", lambda: softmin(x, y, torch.full((8,), NAN), 1.0), ValueError, r"^h: contains NaN or \+Inf"),
    Case(
        "softmin-h-posinf", lambda: softmin(x, y, torch.full((8,), INF), 1.0), ValueError, r"^h: contains NaN or \+Inf"
    ),
    Case("softmin-h-meta", lambda: softmin(x, y, h8.to(meta), 1.0), ValueError, r"^h: is on the 'meta' device"),
    Case("softmin-h-device", lambda: softmin(x, y, elsewhere(h8), 1.0), ValueError, r"^h: is on cuda:7, expected cpu"),
    Case("softmin-dims-differ", lambda: softmin(x, y[:, :2], h8, 1.0), ValueError, r"^x and y: point dimensions"),
    Case("softmin-cost-unknown", lambda: softmin(x, y, h8, 1.0, cost="cosine"), ValueError, r"^cost: expected one of"),
    Case(
        "softmin-backend-unknown",
        lambda: softmin(x, y, h8, 1.0, backend="not-an-engine"),
        ValueError,
        r"^backend: expected 'auto'",
    ),
    Case("softmin-backend-int", lambda: softmin(x, y, h8, 1.0, backend=1), TypeError, r"^backend: expected a string"),
    Case(
        "pprod-x-requires-grad",
        lambda: pprod(x_=x.clone().requires_grad_()),
        ValueError,
        r"^x: requires grad, but plan_product is differentiable w.r.t. V only",
    ),
    Case(
        "pprod-beta-requires-grad", lambda: pprod(beta=h8.clone().requires_grad_()), ValueError, r"^beta: requires grad"
    ),
    Case("pprod-alpha-shape", lambda: pprod(alpha=torch.zeros(9)), ValueError, r"^alpha: expected shape \(10,\)"),
    Case(
        "pprod-alpha-posinf", lambda: pprod(alpha=torch.full((10,), INF)), ValueError, r"^alpha: contains NaN or \+Inf"
    ),
    Case("pprod-V-shape", lambda: pprod(V=torch.ones(7)), ValueError, r"^V: expected leading shape \(8,\)"),
    Case("pprod-V-nan", lambda: pprod(V=torch.full((8,), NAN)), ValueError, r"^V: contains NaN"),
    Case("pprod-V-list", lambda: pprod(V=[1.0] * 8), TypeError, r"^V: expected a torch.Tensor"),
    Case("pprod-V-complex", lambda: pprod(V=torch.ones(8, dtype=torch.complex64)), TypeError, r"^V: expected a real"),
    Case("pprod-weight-unknown", lambda: pprod(weight="kernel"), ValueError, r"^weight: expected one of"),
    Case("pprod-eps-negative", lambda: pprod(eps=-1.0), ValueError, r"^eps: "),
    Case("ctransform-g-shape", lambda: ops.c_transform(x, y, torch.zeros(9)), ValueError, r"^g: expected shape \(8,\)"),
    Case(
        "ctransform-g-all-neginf",
        lambda: ops.c_transform(x, y, torch.full((8,), -INF)),
        ValueError,
        r"^g: every entry is -inf",
    ),
    Case("ctransform-g-int", lambda: ops.c_transform(x, y, h8.long()), TypeError, r"^g: expected a floating-point"),
    Case("ctransform-x-list", lambda: ops.c_transform([[0.0]], y), TypeError, r"^x: expected a torch.Tensor"),
    Case("ctransform-cost-unknown", lambda: ops.c_transform(x, y, cost="l1"), ValueError, r"^cost: expected one of"),
    # ---- free_support_barycenter -------------------------------------------------------------
    Case("bary-reg-zero", lambda: bary(reg=0.0), ValueError, r"^reg: expected a positive"),
    Case("bary-reg-str", lambda: bary(reg="1"), TypeError, r"^reg: "),
    Case("bary-stopThr-nan", lambda: bary(stopThr=NAN), ValueError, r"^stopThr: expected a positive finite"),
    Case("bary-numItermax-zero", lambda: bary(numItermax=0), ValueError, r"^numItermax: expected an integer >= 1"),
    Case("bary-numItermax-float", lambda: bary(numItermax=10.0), TypeError, r"^numItermax: expected an integer"),
    Case("bary-numInnerItermax-bool", lambda: bary(numInnerItermax=True), TypeError, r"^numInnerItermax: .*got bool"),
    Case("bary-inner_tol-negative", lambda: bary(inner_tol=-1.0), ValueError, r"^inner_tol: "),
    Case("bary-verbose-str", lambda: bary(verbose="yes"), TypeError, r"^verbose: expected True or False"),
    Case("bary-log-none", lambda: bary(log=None), TypeError, r"^log: expected True or False"),
    Case(
        "bary-locations-empty-list", lambda: bary(Ys=[]), TypeError, r"^measures_locations: expected a non-empty list"
    ),
    Case("bary-locations-array", lambda: bary(Ys=Y8), TypeError, r"^measures_locations: expected a non-empty list"),
    Case(
        "bary-locations-nan",
        lambda: bary(Ys=[Y8, _nan_at(Y6, 3)]),
        ValueError,
        r"^measures_locations\[1\]: contains NaN or Inf",
    ),
    Case("bary-locations-inf", lambda: bary(Ys=[Y8 * INF, Y6]), ValueError, r"^measures_locations\[0\]: contains NaN"),
    Case(
        "bary-locations-dim",
        lambda: bary(Ys=[Y8, Y6[:, :2]]),
        ValueError,
        r"^measures_locations\[1\]: expected \(N, 3\) points like X_init",
    ),
    Case(
        "bary-locations-empty-cloud",
        lambda: bary(Ys=[Y8, Y6[:0]]),
        ValueError,
        r"^measures_locations\[1\]: expected .*got shape \(0, 3\)",
    ),
    Case("bary-locations-1d", lambda: bary(Ys=[Y8[0], Y6]), ValueError, r"^measures_locations\[0\]: expected \(N, 3\)"),
    Case(
        "bary-locations-list",
        lambda: bary(Ys=[Y8.tolist(), Y6]),
        TypeError,
        r"^measures_locations\[0\]: expected a torch.Tensor or numpy.ndarray, got list",
    ),
    Case(
        "bary-locations-complex",
        lambda: bary(Ys=[Y8.astype(np.complex128), Y6]),
        TypeError,
        r"^measures_locations\[0\]: expected a real-valued array",
    ),
    Case(
        "bary-locations-meta",
        lambda: bary(Ys=[torch.zeros(8, 3, device=meta)], X0=torch.zeros(4, 3)),
        ValueError,
        r"^measures_locations\[0\]: is on the 'meta' device",
    ),
    Case(
        "bary-locations-device",
        lambda: bary(Ys=[elsewhere(torch.zeros(8, 3))], X0=torch.zeros(4, 3)),
        ValueError,
        r"^measures_locations\[0\]: is on cuda:7 but X_init is on cpu",
    ),
    Case("bary-X_init-str", lambda: bary(X0="X"), TypeError, r"^X_init: expected a torch.Tensor"),
    Case("bary-X_init-1d", lambda: bary(X0=X4[0]), ValueError, r"^X_init: expected \(M, D\) points"),
    Case("bary-X_init-empty", lambda: bary(X0=X4[:0]), ValueError, r"^X_init: expected \(M, D\) .*got shape \(0, 3\)"),
    Case("bary-X_init-nan", lambda: bary(X0=_nan_at(X4, 5)), ValueError, r"^X_init: contains NaN or Inf"),
    Case(
        "bary-X_init-int-tensor",
        lambda: bary(Ys=[torch.zeros(8, 3)], X0=torch.zeros(4, 3, dtype=torch.long)),
        TypeError,
        r"^X_init: expected a floating-point tensor, got dtype torch.int64",
    ),
    Case("bary-weights-not-list", lambda: bary(As=u8), ValueError, r"^measures_weights: expected a list of 2 weight"),
    Case(
        "bary-weights-count",
        lambda: bary(As=[u8]),
        ValueError,
        r"^measures_weights: expected a list of 2 .*got 1 items",
    ),
    Case("bary-weights-nan", lambda: bary(As=[u8, _nan_at(u6)]), ValueError, r"^measures_weights\[1\]: contains NaN"),
    Case(
        "bary-weights-negative",
        lambda: bary(As=[u8, u6 * [-1, 1, 1, 1, 1, 3]]),
        ValueError,
        r"^measures_weights\[1\]: weights must be non-negative",
    ),
    Case("bary-weights-zero-mass", lambda: bary(As=[u8 * 0, u6]), ValueError, r"^measures_weights\[0\]: total mass"),
    Case(
        "bary-weights-length",
        lambda: bary(As=[u8[:7], u6]),
        ValueError,
        r"^measures_weights\[0\]: expected shape \(8,\)",
    ),
    Case("bary-weights-str", lambda: bary(As=[u8, "uniform"]), TypeError, r"^measures_weights\[1\]: expected a torch"),
    Case(
        "bary-weights-mass-vs-b",
        lambda: bary(As=[u8, u6 * 2]),
        ValueError,
        r"^measures_weights\[1\] and b: balanced OT needs equal total masses, got 2 and 1",
    ),
    Case("bary-b-nan", lambda: bary(b=_nan_at(u4)), ValueError, r"^b: contains NaN or Inf"),
    Case("bary-b-negative", lambda: bary(b=u4 * [2, -1, 1, 2]), ValueError, r"^b: weights must be non-negative"),
    Case("bary-b-zero-mass", lambda: bary(b=u4 * 0), ValueError, r"^b: total mass must be positive"),
    Case("bary-b-length", lambda: bary(b=u8), ValueError, r"^b: expected shape \(4,\), got \(8,\)"),
    Case("bary-b-mass", lambda: bary(b=u4 / 2), ValueError, r"^measures_weights\[0\] and b: .*got 1 and 0.5"),
    Case("bary-b-strings", lambda: bary(b=["a"] * 4), TypeError, r"^b: expected a sequence of numbers"),
    Case("bary-lambda-length", lambda: bary(weights=[1.0]), ValueError, r"^weights: expected shape \(2,\)"),
    Case(
        "bary-lambda-negative", lambda: bary(weights=[1.0, -0.5]), ValueError, r"^weights: weights must be non-negative"
    ),
    Case("bary-lambda-zero", lambda: bary(weights=[0.0, 0.0]), ValueError, r"^weights: total mass must be positive"),
    Case("bary-lambda-inf", lambda: bary(weights=[INF, 1.0]), ValueError, r"^weights: contains NaN or Inf"),
    Case("bary-backend-unknown", lambda: bary(backend="gpu"), ValueError, r"^backend: expected 'auto'"),
    # ---- label-augmented costs (LabelCost) and the dataset distance (otdd) -----------------------
    Case(
        "SS-labels-out-of-range",
        lambda: solve(x, y, cost=flashot.LabelCost(torch.ones(2, 3)), labels=(l10, l8 + 1)),
        ValueError,
        r"^labels\[1\]: .*\[0, 3\)",
    ),
    Case(
        "SS-labels-length",
        lambda: solve(x, y, cost=flashot.LabelCost(torch.ones(2, 3)), labels=(l10[:9], l8)),
        ValueError,
        r"^labels\[0\]: expected shape \(10,\)",
    ),
    Case(
        "SS-labels-float",
        lambda: solve(x, y, cost=flashot.LabelCost(torch.ones(2, 3)), labels=(l10, l8.float())),
        TypeError,
        r"^labels\[1\]: expected integer class labels",
    ),
    Case("SS-labels-without-LabelCost", lambda: solve(x, y, labels=(l10, l8)), ValueError, r"^labels: .*LabelCost"),
    Case(
        "SS-LabelCost-without-labels",
        lambda: solve(x, y, cost=flashot.LabelCost(torch.ones(2, 3))),
        ValueError,
        r"labels=\(labels_a, labels_b\)",
    ),
    Case("SS-LabelCost-W-nan", lambda: flashot.LabelCost(torch.tensor([[0.0, NAN]])), ValueError, r"^W: .*NaN"),
    Case(
        "SS-LabelCost-W-shape",
        lambda: flashot.LabelCost(torch.ones(2, 3, 1)),
        ValueError,
        r"^W: expected a \(C_a, C_b\)",
    ),
    Case(
        "SL-LabelCost-debias-W-not-square",
        lambda: flashot.SamplesLoss(cost=flashot.LabelCost(torch.ones(2, 3))),
        ValueError,
        r"symmetric W",
    ),
    Case(
        "otdd-labels-length", lambda: flashot.otdd(x, l10[:9], y, l8, reg=0.5), ValueError, r"^labels_a: expected shape"
    ),
    Case(
        "otdd-labels-float",
        lambda: flashot.otdd(x, l10, y, l8.double(), reg=0.5),
        TypeError,
        r"^labels_b: expected integer",
    ),
    Case(
        "otdd-dims", lambda: flashot.otdd(x, l10, y[:, :2], l8, reg=0.5), ValueError, r"^X_a and X_b: point dimensions"
    ),
    Case("otdd-reg", lambda: flashot.otdd(x, l10, y, l8, reg=-1.0), ValueError, r"^reg: "),
    # ---- command line ------------------------------------------------------------------------
    Case("cli-unknown-command", lambda: cli("frobnicate"), SystemExit, r"unknown command 'frobnicate'"),
    Case("cli-demo-unknown-flag", lambda: cli("demo", "--bogus"), SystemExit, r"unrecognized arguments: --bogus"),
    Case("cli-demo-n-not-int", lambda: cli("demo", "--n", "abc"), SystemExit, r"argument --n: invalid int value"),
    Case("cli-demo-n-zero", lambda: cli("demo", "--n", "0"), SystemExit, r"argument --n: expected a positive integer"),
    Case(
        "cli-demo-reg-negative", lambda: cli("demo", "--reg", "-1"), SystemExit, r"argument --reg: expected a positive"
    ),
    Case(
        "cli-demo-blur-nan", lambda: cli("demo", "--blur", "nan"), SystemExit, r"argument --blur: expected a positive"
    ),
    Case(
        "cli-demo-backend-unknown",
        lambda: cli("demo", "--n", "50", "--backend", "gpu"),
        SystemExit,
        r"argument --backend: expected 'auto' or one of",
    ),
    Case("cli-build-unknown-flag", lambda: cli("build", "--bogus"), SystemExit, r"unrecognized arguments: --bogus"),
    Case("cli-no-command", lambda: cli(), SystemExit, r"usage: flashot \[--version\]"),
    Case("cli-bench-sizes-zero", lambda: cli("bench", "--sizes", "0"), SystemExit, r"argument --sizes: .*positive"),
    Case(
        "cli-bench-peer-unknown", lambda: cli("bench", "--peers", "nope"), SystemExit, r"--peers: unknown peer 'nope'"
    ),
    Case("cli-bench-unknown-flag", lambda: cli("bench", "--bogus"), SystemExit, r"unrecognized arguments: --bogus"),
]


@pytest.fixture
def no_heavy_work(monkeypatch):
    """Engines' primitives, cost matrices and the top-k pass fail the test if called."""
    from flashot.costs import Cost
    from flashot.ops import ctransform, rowtopk
    from flashot.ops.dense import DenseEngine
    from flashot.ops.tiled import TiledEngine

    def boom(*args, **kwargs):
        raise AssertionError("heavy work started before the input was rejected")

    for cls in (DenseEngine, TiledEngine):
        monkeypatch.setattr(cls, "softmin", boom)
        monkeypatch.setattr(cls, "plan_product", boom)
    monkeypatch.setattr(Cost, "matrix", boom)
    monkeypatch.setattr(rowtopk, "row_topk", boom)
    monkeypatch.setattr(ctransform, "row_topk", boom)
    # small problems pick the dense engine on the CPU; make sure no other one is picked
    monkeypatch.setattr("flashot.ops.registry.CPU_DENSE_LIMIT", 1 << 20, raising=False)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_bad_input(case: Case, request, capsys):
    if not case.heavy:
        request.getfixturevalue("no_heavy_work")
    if issubclass(case.exc, Warning):
        with pytest.warns(case.exc) as rec:
            case.call()
        text = "\n".join(str(w.message) for w in rec if issubclass(w.category, case.exc))
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # an error case must not first warn and run
            with pytest.raises(case.exc) as ei:
                case.call()
        if case.exc is SystemExit:
            assert ei.value.code == 2
            text = capsys.readouterr().err
        else:
            assert type(ei.value) is case.exc, f"{type(ei.value).__name__} is a subclass, not {case.exc.__name__}"
            text = str(ei.value)
    assert re.search(case.match, text), f"{text!r} does not match {case.match!r}"


def test_the_table_covers_every_entry_point():
    prefixes = {c.id.split("-")[0] for c in CASES}
    assert {"SL", "SS", "plan", "pfp", "softmin", "pprod", "ctransform", "cli", "bary"} <= prefixes
    assert len(CASES) >= 40
    assert len({c.id for c in CASES}) == len(CASES)


def test_documented_non_errors():
    """Inputs that look odd but are accepted, as documented (not silently wrong)."""
    # weights of another float dtype than the points are cast
    flashot.SamplesLoss(backend="dense")(a.double(), x, b, y)
    # integer / boolean right-hand sides of a plan product are cast (numpy: to float64)
    assert torch.allclose(P @ torch.ones(8, dtype=torch.long), P @ torch.ones(8))
    assert torch.allclose(P @ torch.ones(8, dtype=torch.bool), P @ torch.ones(8))
    assert (P @ np.ones(8, dtype=int)).dtype == np.float64
    # softmin of h = -inf everywhere (no mass) is +inf, the exact value
    assert torch.isinf(ops.softmin(x, y, torch.full((8,), -INF), 1.0, backend="dense")).all()
    # p given as the float 2.0 is p = 2
    assert flashot.SamplesLoss(p=2.0).p == 2
