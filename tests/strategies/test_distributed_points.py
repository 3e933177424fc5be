"""Points-sharded mode (``shard="points"``, flashot.distributed) beyond the basic solves of test_distributed.py:
SamplesLoss warm starts over a sequence of calls (one case in replicated mode too), second derivatives and
the gradient of ``value_linear`` (implicit differentiation: ring plan products, all-reduced inner products),
``acceleration`` and the plan's rows (``to_dense``, ``topk``), on 2 and 3 gloo processes.

The ranks run this file's job (``rank_job``, in the process groups the distributed test modules share:
distributed_ranks.py) with uneven slices of the points (test_distributed._cuts), write their
results, and the parent compares them with the same calls in one process (``group=None``): every
per-point quantity put back together in rank order, every whole-problem quantity on every rank,
iteration counts equal, 1e-10 relative in float64 (measured: at most ~1e-12), plan column indices equal.
Also on the ranks: what points mode still refuses (second derivatives of unbalanced values,
``np.asarray(plan)``) raises ``NotImplementedError`` naming the alternative, and bad arguments of the plan's collectives raise on
every rank (the one at fault its own error, the others a ``ValueError`` naming it) without a hang.
"""

from __future__ import annotations

import functools
import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from distributed_ranks import job_results
from test_distributed import F64, RTOL, _data, _leaves, _part, _rel, _slices


def _moved(t: torch.Tensor, step: int, last_only: bool = False) -> torch.Tensor:
    """``t`` displaced by ``step`` small, fixed moves (a gradient-flow-like sequence of problems); with
    ``last_only`` only the last point moves, by ``0.15 step`` (it lies on the last rank: the other ranks
    must learn the displacement from it)."""
    if last_only:
        t = t.clone()
        t[-1] += 0.15 * step
        return t
    g = torch.Generator().manual_seed(7)
    d = torch.randn(t.shape, generator=g, dtype=t.dtype)
    return t + 0.002 * step * d


def _warm(group, part, *, debias=True, potentials=False, p=2, steps=4, weights=True, last_only=False):
    """SamplesLoss(warm_start=True) over ``steps`` calls on slowly moving points: values (or potentials),
    gradients w.r.t. this rank's points and weights, and the iterations each call ran."""
    from flashot import SamplesLoss

    x0, y0, a, b = _data(4, 70, 60)
    x_all = [_moved(x0, k, last_only) for k in range(steps)]  # every rank builds the sequence, keeps its slice
    kw = {} if part is None else {"shard": "points"}
    L = SamplesLoss(
        blur=0.05, p=p, debias=debias, potentials=potentials, backend="cpu", warm_start=True, group=group, **kw
    )
    out = {}
    for k, xk in enumerate(x_all):
        x, y, ak, bk = _leaves(*_slices(part, xk, y0, a, b))
        args = (ak, x, bk, y) if weights else (x, y)
        v = L(*args)
        if potentials:
            out[f"F{k}"], out[f"G{k}"] = v[0].detach(), v[1].detach()
        else:
            v.backward()
            out[f"value{k}"] = v.detach()
            out[f"gx{k}"], out[f"gy{k}"] = x.grad, y.grad
            if weights:
                out[f"ga{k}"], out[f"gb{k}"] = ak.grad, bk.grad
        out[f"n_iter{k}"] = torch.tensor(L.last_n_iter)
    return out


def _linear(group, part, *, cost="sqeuclidean", B=None, method="auto"):
    """``res.value_linear`` (``<C, P>``) and its gradients w.r.t. this rank's points and weights (implicit
    differentiation: ring plan products, the conjugate gradients' inner products all-reduced).  CG runs to
    a relative residual of 1e-12, far below the 1e-10 checked, so that the comparison measures the
    distributed arithmetic, not where CG stopped."""
    from flashot import ImplicitDiff, solve_sample

    x, y, a, b = _leaves(*_slices(part, *_data(5, 50, 40, B=B)))
    kw = {} if part is None else {"shard": "points"}
    res = solve_sample(
        x,
        y,
        a,
        b,
        reg=0.5,
        cost=cost,
        tol=1e-12,
        max_iter=3000,
        backend="cpu",
        method=method,
        implicit=ImplicitDiff(tol=1e-12, max_iter=1000),
        group=group,
        **kw,
    )
    v = res.value_linear
    v.sum().backward()
    return {
        "vlin": v.detach(),
        "gx": x.grad,
        "gy": y.grad,
        "ga": a.grad,
        "gb": b.grad,
        "n_iter": torch.tensor(res.n_iter),
    }


def _accel(group, part, acc: str, *, method="auto", unbalanced=None, reg=0.05):
    """``solve_sample(acceleration=...)`` to ``tol``: Momentum's safeguard and Anderson's Gram matrix and
    right-hand side (inner products over all the potentials: all-reduced) decide the same steps on every
    rank as in one process; values, potentials, gradients, iterations.  tol = 1e-4: every step costs a few
    collectives, and the steps Anderson rejects (its restarts: 3 alternating, 8 symmetric) all come before
    it; a smaller tol adds only plain converging steps (1e-6: 1.3 to 1.7 times as many)."""
    from flashot import Anderson, Momentum, solve_sample

    x, y, a, b = _leaves(*_slices(part, *_data(8, 80, 70)))
    kw = {} if part is None else {"shard": "points"}
    cfg = Momentum(1.6) if acc == "momentum" else Anderson(m=4)
    res = solve_sample(
        x,
        y,
        a,
        b,
        reg=reg,
        tol=1e-4,
        max_iter=2000,
        backend="cpu",
        method=method,
        unbalanced=unbalanced,
        acceleration=cfg,
        inner_iterations=1,
        group=group,
        **kw,
    )
    res.value_dual.backward()
    f, g = res.potentials
    return {
        "value": res.value.detach(),
        "f": f.detach(),
        "g": g.detach(),
        "gx": x.grad,
        "gy": y.grad,
        "ga": a.grad,
        "gb": b.grad,
        "n_iter": torch.tensor(res.n_iter),
    }


def _rows(group, part, *, backend="cpu", B=None, k=3):
    """This rank's rows of the plan (``to_dense``, ``topk``) and of its transpose (ring passes of the other
    side's blocks), against the single process's rows of the same points (of the same potentials: tol = 1e-4
    stops both after 80 steps; the rows need the same potentials on both sides, not converged ones)."""
    from flashot import solve_sample

    x, y, a, b = _slices(part, *_data(9, 40, 33, B=B))
    kw = {} if part is None else {"shard": "points"}
    P = solve_sample(x, y, a, b, reg=0.3, tol=1e-4, max_iter=1000, backend=backend, group=group, **kw).plan
    out = {}
    for name, Q in (("", P), ("T", P.T)):
        out["dense" + name] = Q.to_dense()
        out["topv" + name], out["topi" + name] = Q.topk(k)
    return out


def _hvp(group, part, *, loss=False):
    """Second derivatives: the gradient of ``<gx, Vx> + <ga, Va>`` (``gx``, ``ga`` the first derivatives
    of the value, ``create_graph=True``; ``Vx``, ``Va`` fixed directions, each rank its slices) w.r.t. this
    rank's points and weights (implicit differentiation: ring plan products, CG's inner products
    all-reduced; CG to 1e-12 relative, so that the comparison measures the distributed arithmetic)."""
    from flashot import ImplicitDiff, SamplesLoss, solve_sample

    N, M = 60, 50
    x, y, a, b = _leaves(*_slices(part, *_data(2, N, M)))
    Vx = _part(part, torch.linspace(-1, 1, N * 3, dtype=F64).view(N, 3), -2)
    Va = _part(part, torch.cos(torch.arange(N, dtype=F64)), -1)
    kw = {} if part is None else {"shard": "points"}
    cfg = ImplicitDiff(tol=1e-12, max_iter=1000)
    if loss:  # debiased: the self terms' second derivatives too
        v = SamplesLoss(blur=0.4, backend="cpu", implicit=cfg, group=group, **kw)(a, x, b, y)
    else:
        v = solve_sample(
            x, y, a, b, reg=0.5, tol=1e-12, max_iter=1000, backend="cpu", implicit=cfg, group=group, **kw
        ).value
    gx, ga = torch.autograd.grad(v, (x, a), create_graph=True)
    hx, hy, hA, hB = torch.autograd.grad((gx * Vx).sum() + (ga * Va).sum(), (x, y, a, b))
    return {"value": v.detach(), "gx": gx.detach(), "ga": ga.detach(), "hx": hx, "hy": hy, "hA": hA, "hB": hB}


CASES = {
    "warm_debiased": lambda g, p: _warm(g, p),
    "warm_plain": lambda g, p: _warm(g, p, debias=False, weights=False),
    "warm_p1": lambda g, p: _warm(g, p, p=1, steps=3),
    "warm_potentials": lambda g, p: _warm(g, p, potentials=True, steps=3),
    "warm_one_point_moves": lambda g, p: _warm(g, p, debias=False, steps=3, last_only=True),  # a longer tail
    "warm_replicated": lambda g, p: _warm(g, None, steps=3),  # replicated mode: every rank passes all points
    "linear_grad": lambda g, p: _linear(g, p),
    "linear_grad_euclidean_symmetric": lambda g, p: _linear(g, p, cost="euclidean", method="symmetric"),
    "linear_grad_batched": lambda g, p: _linear(g, p, B=2),
    "momentum_alt": lambda g, p: _accel(g, p, "momentum"),
    "momentum_symmetric": lambda g, p: _accel(g, p, "momentum", method="symmetric", reg=0.2),
    "anderson_alt": lambda g, p: _accel(g, p, "anderson"),
    "anderson_symmetric": lambda g, p: _accel(g, p, "anderson", method="symmetric"),
    "anderson_unbalanced": lambda g, p: _accel(g, p, "anderson", unbalanced=1.0),
    "hvp": lambda g, p: _hvp(g, p),
    "hvp_loss": lambda g, p: _hvp(g, p, loss=True),
    "plan_rows": lambda g, p: _rows(g, p),
    "plan_rows_batched_dense": lambda g, p: _rows(g, p, backend="dense", B=2, k=5),
}
REPLICATED = {"warm_replicated"}  # whole results on every rank
RUN = {
    2: list(CASES),
    # three ranks (a ring with a relay hop, uneven slices about 1:2:3): one case per kind of ring call (warm
    # starts, acceleration, plan rows, implicit differentiation); every case runs on two ranks
    3: ["warm_debiased", "anderson_alt", "plan_rows", "hvp_loss"],
}


def _refusals(group, part) -> dict[str, str | None]:
    """What points-sharded mode still refuses, each with a clear error (run on the ranks only): second
    derivatives of unbalanced values, and the whole plan as an array."""
    from flashot import SamplesLoss, solve_sample

    x, y, _, _ = _slices(part, *_data(6, 30, 20))
    x = x.clone().requires_grad_()
    res = solve_sample(x, y, reg=0.5, unbalanced=1.0, backend="cpu", group=group, shard="points")
    msgs = {}
    try:
        torch.autograd.grad(res.value, x, create_graph=True)
        msgs["create_graph"] = None
    except NotImplementedError as e:
        msgs["create_graph"] = str(e)
    v = SamplesLoss(blur=0.5, reach=1.0, backend="cpu", group=group, shard="points")(x, y)
    try:
        torch.autograd.grad(v, x, create_graph=True)
        msgs["create_graph_loss"] = None
    except NotImplementedError as e:
        msgs["create_graph_loss"] = str(e)
    try:
        import numpy as np

        np.asarray(res.plan)
        msgs["asarray"] = None
    except NotImplementedError as e:
        msgs["asarray"] = str(e)
    return msgs


def _bad_arguments(group, part) -> dict[str, str | None]:
    """Bad arguments of the plan's collectives raise on every rank (the one at fault its own error, the
    others a ValueError naming it), and the ranks stay usable."""
    from flashot import solve_sample

    rank = part[0]
    x, y, _, _ = _slices(part, *_data(6, 30, 20))
    P = solve_sample(x, y, reg=0.5, backend="cpu", group=group, shard="points").plan
    msgs = {}
    for name, call in (
        ("to_dense_limit", lambda: P.to_dense(max_elems=10 if rank == 1 else 10**6)),
        ("topk_too_many", lambda: P.topk(21)),
        ("topk_k_differs", lambda: P.topk(2 + rank)),
    ):
        try:
            call()
            msgs[name] = None
        except (MemoryError, ValueError) as e:
            msgs[name] = f"{type(e).__name__}: {e}"
    msgs["after"] = float(P.to_dense().sum())  # still in step
    return msgs


COUNTED = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "isend", "irecv")


def _collectives(group, part) -> dict[str, dict[str, float]]:
    """torch.distributed calls per Sinkhorn iteration of points-sharded solves (balanced; alternating, symmetric,
    Anderson, Momentum), counted over the ranks' solves of 10 and 20 iterations (the difference over 10): the
    per-iteration cost of the loop in collectives, which the test pins so that a saving cannot silently
    regress.  tol = 1e-30 with ``inner_iterations=1``: every iteration reads its error and rounding floor."""
    import collections
    import warnings

    import torch.distributed as dist

    from flashot import Anderson, Momentum, solve_sample

    x, y, a, b = _slices(part, *_data(3, 60, 50))
    cases = {
        "alternating": {},
        "symmetric": {"method": "symmetric"},
        "anderson": {"acceleration": Anderson()},
        "momentum": {"acceleration": Momentum(1.5)},
    }
    seen: collections.Counter = collections.Counter()
    saved = {n: getattr(dist, n) for n in COUNTED}

    def counting(name):
        def call(*args, **kw):
            seen[name] += 1
            return saved[name](*args, **kw)

        return call

    out = {}
    try:
        for n in COUNTED:
            setattr(dist, n, counting(n))
        for name, kw in cases.items():
            got = []
            for max_iter in (10, 20):
                seen.clear()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)  # tol is not reached, by design
                    res = solve_sample(
                        x, y, a, b, reg=0.5, tol=1e-30, max_iter=max_iter, inner_iterations=1, backend="cpu",
                        group=group, shard="points", **kw,
                    )  # fmt: skip
                assert res.n_iter == max_iter, (name, res.n_iter)
                got.append(dict(seen))
            out[name] = {n: (got[1].get(n, 0) - got[0].get(n, 0)) / 10 for n in COUNTED}
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)
    return out


def _expected_collectives(world: int) -> dict[str, dict[str, float]]:
    """The calls per iteration :func:`_collectives` must find on ``world`` ranks: a softmin's ring pass is W - 1
    hops, a fused pair's W (each an ``isend`` and an ``irecv``, the ranks' calls checked inside the blocks, no
    header collective); one all-reduce for the iteration's errors (with Anderson's Gram matrix and right-hand
    side), one for the rounding floor, one for Anderson's finiteness check of its candidate, and under Momentum
    one for the error of the f half-step and one for its candidate's finiteness (g's travels with g's error)."""
    hops = {
        "alternating": 2 * (world - 1),
        "symmetric": world,
        "anderson": 2 * (world - 1),
        "momentum": 2 * (world - 1),
    }
    reduces = {"alternating": 2, "symmetric": 2, "anderson": 3, "momentum": 4}
    zero = dict.fromkeys(COUNTED, 0.0)
    return {k: {**zero, "all_reduce": float(reduces[k]), "isend": float(h), "irecv": float(h)} for k, h in hops.items()}


def _axis(key: str) -> int | None:
    """The axis along which the ranks' slices of ``key`` are put back together in rank order: -1 for
    per-point vectors, -2 for per-point rows (point gradients, plan rows); None for the whole problem's
    quantities (the same on every rank)."""
    name = key.rstrip("0123456789")
    if name in ("F", "G", "ga", "gb", "f", "g", "hA", "hB"):
        return -1
    if name in ("gx", "gy", "hx", "hy", "dense", "topv", "topi", "denseT", "topvT", "topiT"):
        return -2
    return None


def rank_job(mode: str, rank: int, world: int, pg, out: str) -> None:
    """This rank's part of the compare job of the shared spawns (distributed_ranks.py)."""
    res = {}
    for name in RUN[world]:
        t0 = time.perf_counter()
        res[name] = CASES[name](pg, (rank, world))
        print(f"rank {rank} points {name}: {time.perf_counter() - t0:.2f} s", flush=True)
    res["_refusals"] = _refusals(pg, (rank, world))
    res["_bad"] = _bad_arguments(pg, (rank, world))
    res["_collectives"] = _collectives(pg, (rank, world))
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))


@functools.cache
def _reference(name: str) -> dict:
    """``name``'s calls in one process (``group=None``), computed once for both worlds."""
    return CASES[name](None, None)


@pytest.mark.parametrize("world", [2, 3])
def test_points_mode_matches_single_process(world, tmp_path_factory):
    out = job_results(tmp_path_factory, "test_distributed_points:compare", world)
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(world)]
    worst = {}
    for name in RUN[world]:
        ref = _reference(name)
        parts = [rk[name] for rk in ranks]
        for k, v in ref.items():
            if k.startswith("n_iter"):
                assert all(int(p[k]) == int(v) for p in parts), (name, k, [int(p[k]) for p in parts], int(v))
                continue
            axis = None if name in REPLICATED else _axis(k)
            if axis is None:  # the whole problem's: the same on every rank
                got = [p[k] for p in parts]
            else:
                got = [torch.cat([p[k] for p in parts], axis)]
            if k.startswith("topi"):  # column indices: the same columns
                assert all(torch.equal(t, v) for t in got), (name, k)
                continue
            for t in got:
                worst[f"{name}.{k}"] = r = _rel(t, v)
                assert r <= RTOL, (name, k, r)
    for rk in ranks:  # the refusals name what is refused and the alternative
        for what, msg in rk["_refusals"].items():
            alt = "to_dense" if what == "asarray" else "balanced problems have them"
            assert msg is not None and "shard='points'" in msg and alt in msg, (what, msg)
    for rk in ranks:
        bad = rk["_bad"]
        want = "MemoryError: rank 1 rejected its input: to_dense"  # the same error on every rank
        assert bad["to_dense_limit"] is not None and bad["to_dense_limit"].startswith(want), bad["to_dense_limit"]
        assert bad["topk_too_many"] is not None and "at most 20" in bad["topk_too_many"], bad["topk_too_many"]
        assert bad["topk_k_differs"] is not None and "k: differs" in bad["topk_k_differs"], bad["topk_k_differs"]
        assert bad["after"] > 0
    for rk in ranks:  # calls per iteration on 2 ranks (alternating, symmetric, Anderson, Momentum): 6, 6, 7, 8;
        # 9, 8, 12, 11 with a header all-gather per ring pass and one all-reduce per error / sum / check
        assert rk["_collectives"] == _expected_collectives(world), rk["_collectives"]
    per_case = {n: max(v for k, v in worst.items() if k.startswith(n + ".")) for n in RUN[world]}
    shown = ", ".join(f"{n} {v:.1e}" for n, v in per_case.items())
    print(f"world={world}: worst relative difference per case: {shown}")
