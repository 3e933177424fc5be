"""Distributed solves against the mathematics, not only against one process (flashot.distributed).

Two gloo ranks run this file's job (``rank_job``, in a process group the distributed test modules share:
distributed_ranks.py) and compute, in replicated mode and in points-sharded mode (uneven slices),
``solve_sample``'s value (cost ``|x - y|^2``, ``eps = reg``) and ``SamplesLoss``' Sinkhorn divergence (cost
``|x - y|^2 / 2``, ``eps = blur^2``), balanced and unbalanced, with their gradients w.r.t. the points.  The
parent checks them against the dense float64 oracle (tests/references.py, run to 1e-13):

* the value against the oracle's (1e-9 relative);
* the whole point gradients against the envelope theorem on the oracle's plans: ``grad_x OT = sum_j P_ij
  d_x C(x_i, y_j)``, and for the divergence's self term ``OT(a, a) / 2`` (``x`` on both sides of a symmetric
  plan) ``sum_j P^aa_ij d_x C(x_i, x_j)`` (1e-7 relative);
* the directional derivative ``<grad, d>`` along a fixed direction of all the points against central finite
  differences (h = 1e-5) of the value (the oracle's: the distributed value equals it to ~1e-14, so its own
  differences would add two solves per case and check nothing more; 1e-6 relative).
"""

from __future__ import annotations

import os
import sys
import time

import torch

HERE = os.path.abspath(__file__)
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # tests/: the shared references
from distributed_ranks import job_results  # noqa: E402
from test_distributed import _part  # noqa: E402

import references as ref  # noqa: E402

F64 = torch.float64
N, M, H = 14, 17, 1e-5
REG, BLUR = 0.2, 0.7  # few iterations to 1e-12: every iteration is a collective
CASES = {  # name: (front end, unbalanced= / reach=, masses of a and b)
    "solve_balanced": ("solve", None, (1.0, 1.0)),
    "solve_unbalanced": ("solve", 0.3, (1.2, 0.7)),
    "loss_balanced": ("loss", None, (1.0, 1.0)),
    "loss_reach": ("loss", 0.6, (1.15, 0.8)),
}


def _data(masses):
    g = torch.Generator().manual_seed(0)
    x = torch.rand(N, 2, generator=g, dtype=F64)
    y = torch.rand(M, 2, generator=g, dtype=F64) * 0.8 + 0.3
    a = torch.rand(N, generator=g, dtype=F64) + 0.5
    b = torch.rand(M, generator=g, dtype=F64) + 0.5
    dx, dy = torch.randn(N, 2, generator=g, dtype=F64), torch.randn(M, 2, generator=g, dtype=F64)
    return x, y, masses[0] * a / a.sum(), masses[1] * b / b.sum(), dx, dy


def _value(kind: str, rho, x, y, a, b, group, shard):
    """The distributed value (a scalar tensor, the same on every rank)."""
    from flashot import SamplesLoss, solve_sample

    if kind == "solve":
        return solve_sample(
            x, y, a, b, reg=REG, unbalanced=rho, tol=1e-12, max_iter=20_000, backend="cpu", group=group, shard=shard
        ).value
    return SamplesLoss(blur=BLUR, reach=rho, tol=1e-12, max_iter=20_000, backend="cpu", group=group, shard=shard)(
        a, x, b, y
    )


def _run(name: str, group, part) -> dict:
    """This rank's value and point gradients (its slices in points mode)."""
    kind, rho, masses = CASES[name]
    x, y, a, b = (_part(part, t, -2 if t.dim() == 2 else -1) for t in _data(masses)[:4])
    shard = "replicated" if part is None else "points"
    xx, yy = x.clone().requires_grad_(), y.clone().requires_grad_()
    v = _value(kind, rho, xx, yy, a, b, group, shard)
    gx, gy = torch.autograd.grad(v, [xx, yy])
    return {"value": float(v.detach()), "gx": gx, "gy": gy}


def rank_job(mode: str, rank: int, world: int, pg, out: str) -> None:
    """This rank's part of the oracle job of the shared spawns (distributed_ranks.py)."""
    res = {}
    for shard, part in (("replicated", None), ("points", (rank, world))):
        for name in CASES:
            t0 = time.perf_counter()
            res[f"{shard} {name}"] = _run(name, pg, part)
            print(f"rank {rank} {shard} {name}: {time.perf_counter() - t0:.2f} s", flush=True)
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))


def _oracle(kind: str, rho, x, y, a, b):
    """The exact value and its point gradients (the envelope theorem on the oracle's plans)."""
    if kind == "solve":  # C = |x - y|^2, eps = reg
        s = ref.solve(ref.cost_matrix(x, y, half=False), a, b, REG, rho, rho)
        gx = 2 * (s.plan.sum(1, keepdim=True) * x - s.plan @ y)
        gy = 2 * (s.plan.sum(0)[:, None] * y - s.plan.T @ x)
        return s.dual, gx, gy
    eps, r = BLUR**2, None if rho is None else rho**2  # C = |x - y|^2 / 2, rho = reach^2

    def solve(u, v, wu, wv):
        return ref.solve(ref.cost_matrix(u, v), wu, wv, eps, r, r)

    xy, xx, yy = solve(x, y, a, b), solve(x, x, a, a), solve(y, y, b, b)
    gx = (xy.plan.sum(1, keepdim=True) * x - xy.plan @ y) - (xx.plan.sum(1, keepdim=True) * x - xx.plan @ x)
    gy = (xy.plan.sum(0)[:, None] * y - xy.plan.T @ x) - (yy.plan.sum(1, keepdim=True) * y - yy.plan @ y)
    return xy.dual - 0.5 * xx.dual - 0.5 * yy.dual, gx, gy


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def test_distributed_values_and_gradients_match_the_oracle(tmp_path_factory):
    out = job_results(tmp_path_factory, "test_distributed_oracle:oracle", 2)
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    worst: dict = {}
    for key in ranks[0]:
        shard, name = key.split(" ")
        kind, rho, masses = CASES[name]
        x, y, a, b, dx, dy = _data(masses)
        if shard == "points":  # this rank's slices, put back together in rank order
            gx, gy = (torch.cat([rk[key][k] for rk in ranks], 0) for k in ("gx", "gy"))
        else:
            gx, gy = ranks[0][key]["gx"], ranks[0][key]["gy"]
        for rk in ranks:  # the whole problem's numbers: the same on every rank
            assert rk[key]["value"] == ranks[0][key]["value"], key
        got = ranks[0][key]
        want, wx, wy = _oracle(kind, rho, x, y, a, b)
        slope = float((gx * dx).sum() + (gy * dy).sum())
        # the closure is called at once, within this iteration
        oracle_fd = ref.finite_difference(
            lambda t: _oracle(kind, rho, t[:N], t[N:], a, b)[0],  # noqa: B023
            torch.cat([x, y]),
            torch.cat([dx, dy]),
            h=H,
        )
        scale = float(gx.abs().sum() * dx.abs().max() + gy.abs().sum() * dy.abs().max())
        worst[key] = errs = {
            "value": abs(got["value"] - want) / abs(want),
            "gx": _rel(gx, wx),
            "gy": _rel(gy, wy),
            "fd": abs(slope - oracle_fd) / scale,
        }
        assert errs["value"] < 1e-9 and max(errs["gx"], errs["gy"]) < 1e-7, (key, errs)
        assert errs["fd"] < 1e-6, (key, errs)
    print("\n".join(f"{k}: " + ", ".join(f"{n} {e:.1e}" for n, e in v.items()) for k, v in worst.items()))
