"""Distributed Sinkhorn (flashot.distributed, replicated and points-sharded modes) on 2 and 3 gloo processes.

The ranks run this file's jobs (``rank_job``: compare, mismatch) in the process groups the distributed
test modules share (distributed_ranks.py: one spawn per group of jobs, file:// rendezvous), and write their
results to the job's directory; the parent compares them with the same calls made in one process
(``group=None``): values, potentials, marginals and gradients w.r.t. points and weights to 1e-10
relative in float64 (measured: at most ~1e-13), and checks that every rank holds bit-identical results
(replicated mode) or that the ranks' slices, put back together, are the single-process result (points
mode, uneven slices).  Also: one DistributedDataParallel SGD step against the same step in one process,
the mismatch checks, a rank that dies mid-solve, a rank that stays alive but stops calling (the
process-group timeout; these two start their own ranks: ``python tests/strategies/test_distributed.py
<mode> <rank> <world> <init> <dir>``), and the torchrun example.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from distributed_ranks import job_results, launch

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))  # the repository
RTOL = 1e-10
STUCK_TIMEOUT = 5  # seconds: the process-group timeout of the failure tests
F64 = torch.float64


# -- the problems (run with group=pg on every rank, and with group=None in the parent) -----------------


def _data(seed: int, N: int, M: int, D: int = 3, B: int | None = None):
    g = torch.Generator().manual_seed(seed)
    lead = () if B is None else (B,)
    x = torch.randn(*lead, N, D, generator=g, dtype=F64)
    y = 0.8 * torch.randn(*lead, M, D, generator=g, dtype=F64) + 0.3
    a = torch.rand(*lead, N, generator=g, dtype=F64) + 0.5
    b = torch.rand(*lead, M, generator=g, dtype=F64) + 0.5
    return x, y, a / a.sum(-1, keepdim=True), b / b.sum(-1, keepdim=True)


def _leaves(*ts):
    return [t.clone().requires_grad_() for t in ts]


def _cuts(n: int, world: int) -> list[int]:
    """Uneven slices for shard='points': rank r gets about (r + 1) shares (n=7 over 3 ranks: 1, 2, 4)."""
    tot = world * (world + 1) // 2
    return [n * (k * (k + 1) // 2) // tot for k in range(world + 1)]


def _part(part, t: torch.Tensor, dim: int) -> torch.Tensor:
    """This rank's slice of ``t`` along ``dim`` (all of it when ``part`` is None)."""
    if part is None:
        return t
    r, w = part
    c = _cuts(t.shape[dim], w)
    return t.narrow(dim, c[r], c[r + 1] - c[r])


def _slices(part, x, y, a, b):
    return _part(part, x, -2), _part(part, y, -2), _part(part, a, -1), _part(part, b, -1)


def _solve(group, part=None, *, backend="cpu", N=150, M=130, B=None, reg=0.1, tol=None, max_iter=60, init=False, **kw):
    from flashot import solve_sample

    x, y, a, b = _leaves(*_slices(part, *_data(0, N, M, B=B)))
    if init:  # a warm start: this rank's slices of fixed potentials
        kw["potentials_init"] = (0.3 * x.detach()[..., 0], -0.2 * y.detach()[..., 1])
    shard = {} if part is None else {"shard": "points"}
    res = solve_sample(x, y, a, b, reg=reg, tol=tol, max_iter=max_iter, backend=backend, group=group, **shard, **kw)
    res.value_dual.sum().backward()  # = value when balanced; the dual (mass terms included) differentiates in a, b
    ra, rb = res.marginals  # row-sharded plan products (collective)
    f, g = res.potentials
    return {
        "value": res.value.detach(),
        "f": f.detach(),
        "g": g.detach(),
        "ra": ra,
        "rb": rb,
        "gx": x.grad,
        "gy": y.grad,
        "ga": a.grad,
        "gb": b.grad,
        "n_iter": torch.tensor(res.n_iter),
        "total": res.plan.sum(),
        "cost": res.plan.cost_sum(),
        "backend": res.backend,
    }


def _loss(group, part=None, *, backend="cpu", N=140, M=120, B=None, **kw):
    from flashot import SamplesLoss

    x, y, a, b = _leaves(*_slices(part, *_data(1, N, M, B=B)))
    if part is not None:
        kw["shard"] = "points"
    L = SamplesLoss(blur=0.1, backend=backend, group=group, **kw)
    v = L(a, x, b, y)
    v.sum().backward()
    F, G = SamplesLoss(blur=0.1, backend=backend, group=group, potentials=True, **kw)(a, x, b, y)
    return {
        "value": v.detach(),
        "F": F.detach(),
        "G": G.detach(),
        "gx": x.grad,
        "gy": y.grad,
        "ga": a.grad,
        "gb": b.grad,
    }


def _hvp(group, part=None):
    """Second derivatives (implicit differentiation, flashot.implicit): its CG's plan products shard too."""
    from flashot import solve_sample

    x, y, a, b = _data(2, 60, 50)
    x = x.clone().requires_grad_()
    res = solve_sample(x, y, a, b, reg=0.5, tol=1e-11, max_iter=500, backend="cpu", group=group)
    (gx,) = torch.autograd.grad(res.value, x, create_graph=True)
    (hv,) = torch.autograd.grad((gx * torch.linspace(-1, 1, gx.numel(), dtype=F64).view_as(gx)).sum(), x)
    return {"value": res.value.detach(), "gx": gx.detach(), "hv": hv, "n_iter": torch.tensor(res.n_iter)}


def _ddp(group, part=None, lr=0.5):
    """One SGD step of a small model whose loss is SamplesLoss: wrapped in DistributedDataParallel on the
    ranks (replicated mode: every rank maps all the points; points mode: every rank maps its slice and the
    loss is multiplied by the world size, since DDP averages the ranks' gradients), plain in one process."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from flashot import SamplesLoss

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
    net = model if group is None else DDP(model, process_group=group)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    x, y, _, _ = _data(3, 90, 70)
    x, y = _part(part, x, -2), _part(part, y, -2)
    shard = {} if part is None else {"shard": "points"}
    scale = 1 if part is None else part[1]
    loss = SamplesLoss(blur=0.2, backend="cpu", group=group, **shard)(net(x), y)
    (scale * loss).backward()
    opt.step()
    return {"value": loss.detach(), **{f"param{k}": p.detach().clone() for k, p in enumerate(model.parameters())}}


CASES = {
    "balanced_cpu_alt": lambda g, p: _solve(g, p, reg=0.5, tol=1e-10, max_iter=500),  # fused softmin_alt; tol
    "balanced_cpu_symmetric": lambda g, p: _solve(g, p, method="symmetric"),  # fused softmin_pair
    "unbalanced_cpu": lambda g, p: _solve(g, p, unbalanced=0.5),
    "semi_unbalanced_symmetric": lambda g, p: _solve(g, p, unbalanced=(1.0, None), method="symmetric"),
    "eps_scaling": lambda g, p: _solve(g, p, reg=0.02, eps_scaling=True, max_iter=80),
    "balanced_tiled": lambda g, p: _solve(g, p, backend="tiled", N=90, M=70),  # no fused steps
    "batched_dense_symmetric": lambda g, p: _solve(g, p, backend="dense", B=2, N=40, M=31, method="symmetric"),
    "warm_start": lambda g, p: _solve(g, p, N=60, M=50, reg=0.5, init=True, tol=1e-9, max_iter=300),
    "loss_debiased": lambda g, p: _loss(g, p),  # softmin_pair + softmin_sym
    "loss_unbalanced_debiased": lambda g, p: _loss(g, p, reach=0.5),
    "loss_two_sided": lambda g, p: _loss(g, p, N=50, M=40, reach_x=0.5, reach_y=1.0),
    "loss_p1_batched": lambda g, p: _loss(g, p, p=1, B=2, N=30, M=25),
    "tiny": lambda g, p: _solve(g, p, N=2, M=5),  # empty slices on 3 ranks
    "uneven": lambda g, p: _solve(g, p, N=7, M=6, reg=0.5, max_iter=40),  # 7 = 1 + 2 + 4 on 3 ranks
    "ddp": _ddp,
    "hvp": _hvp,
}
RUN = {
    2: [
        "balanced_cpu_alt",
        "balanced_cpu_symmetric",
        "unbalanced_cpu",
        "semi_unbalanced_symmetric",
        "eps_scaling",
        "balanced_tiled",
        "batched_dense_symmetric",
        "loss_debiased",
        "loss_unbalanced_debiased",
        "loss_p1_batched",
        "hvp",
        "ddp",
    ],
    # three ranks in replicated mode: every rank holds all the points, so a third rank adds only a wider
    # all-reduce; the ring cases below (RING[3]) are where three ranks differ from two
    3: ["balanced_cpu_symmetric", "tiny"],
}
# points-sharded mode (shard="points"): every rank passes its slice (_cuts: uneven), against one process
RING = {
    2: [
        "balanced_cpu_alt",
        "balanced_cpu_symmetric",
        "unbalanced_cpu",
        "semi_unbalanced_symmetric",
        "eps_scaling",
        "batched_dense_symmetric",
        "warm_start",
        "loss_debiased",
        "loss_unbalanced_debiased",
        "loss_two_sided",
        "loss_p1_batched",
        "uneven",
        "ddp",
    ],
    3: ["balanced_cpu_alt", "loss_debiased", "loss_two_sided", "uneven"],
}
X_SIDE = {"f", "ra", "gx", "ga", "F"}  # per-rank slices of the x side in points mode (gx: points axis -2)
Y_SIDE = {"g", "rb", "gy", "gb", "G"}


# -- the ranks ------------------------------------------------------------------------------------------


def _raised(fn, errors: type[BaseException] | tuple = ValueError) -> str | None:
    """The message of the ``errors`` that ``fn()`` raised, or None when it returned."""
    try:
        fn()
    except errors as e:
        return str(e)
    return None


def rank_job(mode: str, rank: int, world: int, pg, out: str) -> None:
    """This rank's part of a job of the shared spawns (distributed_ranks.py): compare, mismatch."""
    if mode == "compare":
        res = {"rep": {}, "ring": {}}
        for kind, names, part in (("rep", RUN[world], None), ("ring", RING[world], (rank, world))):
            for name in names:
                t0 = time.perf_counter()
                res[kind][name] = CASES[name](pg, part)
                print(f"rank {rank} {kind} {name}: {time.perf_counter() - t0:.2f} s", flush=True)
        torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    elif mode == "mismatch":
        from flashot import SamplesLoss, solve_sample

        x, y, a, b = _data(0, 50, 40)
        msgs = {}
        attempts = {
            "reg": lambda: solve_sample(x, y, reg=0.1 if rank == 0 else 0.2, backend="cpu", group=pg),
            "shape": lambda: solve_sample(x if rank == 0 else x[:-1], y, reg=0.1, backend="cpu", group=pg),
            "points": lambda: solve_sample(x if rank == 0 else x + 1e-12, y, reg=0.1, backend="cpu", group=pg),
            "dtype": lambda: solve_sample(
                x if rank == 0 else x.float(), y if rank == 0 else y.float(), reg=0.1, backend="cpu", group=pg
            ),
            "option": lambda: solve_sample(x, y, reg=0.1, max_iter=100 + rank, backend="cpu", group=pg),
            "blur": lambda: SamplesLoss(blur=0.1 if rank == 0 else 0.05, backend="cpu", group=pg)(x, y),
            "weights": lambda: SamplesLoss(blur=0.1, backend="cpu", group=pg)(a if rank == 0 else a.flip(0), x, b, y),
        }
        msgs.update({k: _raised(fn) for k, fn in attempts.items()})
        # ranks whose calls diverge later (here: different inputs to the same primitive) are caught by the
        # header of the next collective
        from flashot.costs import get_cost
        from flashot.distributed import ShardedEngine
        from flashot.ops import get_engine

        cost = get_cost("sqeuclidean")
        eng = ShardedEngine(get_engine("cpu", device=x.device, dtype=F64, cost=cost), pg)
        try:
            eng.softmin(x[None], y[None], torch.zeros(1, 40, dtype=F64) + rank, 0.1, cost)
            msgs["diverged"] = None
        except RuntimeError as e:
            msgs["diverged"] = str(e)
        # points-sharded mode: the slices differ by design; options, dimensions, empty slices and a rank's
        # own input error are shared, so that every rank raises
        xl, yl, al, bl = _slices((rank, 2), x, y, a, b)
        ring = {
            "ring_reg": lambda: solve_sample(
                xl, yl, reg=0.1 if rank == 0 else 0.2, backend="cpu", group=pg, shard="points"
            ),
            "ring_dim": lambda: solve_sample(
                xl if rank == 0 else xl[:, :2],
                yl if rank == 0 else yl[:, :2],
                reg=0.1,
                backend="cpu",
                group=pg,
                shard="points",
            ),
            "ring_weights_given": lambda: solve_sample(
                xl,
                yl,
                al if rank == 0 else None,
                bl if rank == 0 else None,
                reg=0.1,
                backend="cpu",
                group=pg,
                shard="points",
            ),
            "ring_empty": lambda: solve_sample(
                xl if rank == 0 else xl[:0], yl, reg=0.1, backend="cpu", group=pg, shard="points"
            ),
            "ring_bad_input": lambda: solve_sample(
                xl if rank == 0 else xl * float("nan"), yl, reg=0.1, backend="cpu", group=pg, shard="points"
            ),
            "ring_blur": lambda: SamplesLoss(blur=0.1 if rank == 0 else 0.05, backend="cpu", group=pg, shard="points")(
                xl, yl
            ),
        }
        msgs.update({k: _raised(fn) for k, fn in ring.items()})
        from flashot.distributed import RingEngine

        reng = RingEngine(get_engine("cpu", device=x.device, dtype=F64, cost=cost), pg)
        try:
            if rank == 0:
                reng.softmin(xl[None], yl[None], torch.zeros(1, yl.shape[0], dtype=F64), 0.1, cost)
            else:
                reng.plan_product(
                    xl[None],
                    yl[None],
                    torch.zeros(1, xl.shape[0], dtype=F64),
                    torch.zeros(1, yl.shape[0], dtype=F64),
                    0.1,
                    yl[None],
                    cost,
                )
            msgs["ring_diverged"] = None
        except RuntimeError as e:
            msgs["ring_diverged"] = str(e)
        msgs.update(_ring_diverged_in_transfer(pg, rank, xl, yl))
        # still usable afterwards, and the same call on every rank agrees
        v = solve_sample(x, y, reg=0.1, backend="cpu", group=pg).value
        msgs["after"] = float(v)
        msgs["after_ring"] = float(solve_sample(xl, yl, reg=0.1, backend="cpu", group=pg, shard="points").value)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
            json.dump(msgs, fh)
    else:
        raise ValueError(f"unknown job {mode!r}")


def _ring_diverged_in_transfer(pg, rank: int, xl: torch.Tensor, yl: torch.Tensor) -> dict[str, str | None]:
    """A points-sharded solve's ring engine (``counts`` given) checks the ranks' calls inside the block transfers
    (no collective of its own): ranks at another operation of the same size, or at another engine's call
    number, both raise "the ranks diverged" (2 ranks, the mismatch job's slices)."""
    from flashot.costs import get_cost
    from flashot.distributed import RingEngine
    from flashot.ops import get_engine

    cost = get_cost("sqeuclidean")
    c = [_cuts(n, 2) for n in (50, 40)]  # the mismatch job's points per rank
    counts = tuple([s[k + 1] - s[k] for k in range(2)] for s in c)

    def engine():
        return RingEngine(get_engine("cpu", device=xl.device, dtype=F64, cost=cost), pg, counts)

    h = torch.zeros(1, yl.shape[0], dtype=F64)
    msgs: dict[str, str | None] = {}
    eng = engine()
    attempts = {
        # rank 1 runs a plan-rows pass of the same blocks (the same size) where rank 0 runs a softmin
        "ring_in_transfer_op": lambda: (
            eng.softmin(xl[None], yl[None], h, 0.1, cost)
            if rank == 0
            else eng.ring_visit("to_dense", [yl[None], h.unsqueeze(-1)], lambda src, yb, hb: yb.sum(), torch.add)
        ),
        # rank 1 runs its first call on a new engine where rank 0 runs its second
        "ring_in_transfer_call": lambda: (eng if rank == 0 else engine()).softmin(xl[None], yl[None], h, 0.1, cost),
    }
    for k, fn in attempts.items():
        msgs[k] = _raised(fn, RuntimeError)
        if k == "ring_in_transfer_op":  # the ranks' transfers stayed paired: the engine goes on (call 2 on both)
            msgs["ring_in_transfer_after"] = str(eng.softmin(xl[None], yl[None], h, 0.1, cost).shape)
    return msgs


def _worker(mode: str, rank: int, world: int, init: str, out: str) -> None:
    """A rank of the failure tests (its own processes: one of them dies or stalls)."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=STUCK_TIMEOUT)
    )
    if mode in ("dead", "stuck"):
        from flashot import solve_sample

        x, y, _, _ = _data(0, 200, 180)

        def cb(rec):
            if rank == 1 and rec.iteration == 5:
                if mode == "dead":
                    os._exit(3)  # the process dies mid-solve
                time.sleep(STUCK_TIMEOUT + 6)  # alive, but does not join the next collective in time
                os._exit(4)
            return False

        t0 = time.perf_counter()
        try:
            solve_sample(x, y, reg=0.05, tol=None, max_iter=400, backend="cpu", callback=cb, group=dist.group.WORLD)
            msg = None
        except Exception as e:  # noqa: BLE001 - what the surviving rank sees
            msg = f"{type(e).__name__}: {e}"
        with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
            json.dump({"error": msg, "elapsed": time.perf_counter() - t0}, fh)
        os._exit(0)  # do not wait for the dead / stuck peer in the process group's teardown
    raise ValueError(f"unknown mode {mode!r}")


def _launch(mode: str, world: int, tmp, timeout: float = 120.0, wait_for=None):
    """Run this file's ranks (the failure tests); wait for those in ``wait_for`` (all by default), then
    kill the others."""
    return launch([mode, str(world), f"file://{tmp}/rendezvous", str(tmp)], world, tmp, timeout, wait_for, HERE)


# -- the tests ------------------------------------------------------------------------------------------


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return float((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-300))


def _check(name: str, ref: dict, got: dict, worst: dict) -> None:
    for k, v in ref.items():
        if k == "backend":
            assert got[k] in (f"sharded({v})", f"ring({v})"), (name, got[k], v)
            continue
        if k == "n_iter":
            assert int(got[k]) == int(v), (name, int(got[k]), int(v))
            continue
        assert got[k] is not None and v is not None, (name, k)
        r = _rel(got[k], v)
        worst[f"{name}.{k}"] = r
        assert r <= RTOL, (name, k, r)


@functools.cache
def _reference(name: str) -> dict:
    """``name``'s call in one process (``group=None``), computed once for both worlds."""
    return CASES[name](None, None)


@pytest.mark.parametrize("world", [2, 3])
def test_matches_single_process(world, tmp_path_factory):
    """Replicated mode (every rank holds bit-identical results) and points-sharded mode (every rank's slices,
    put back together, and the values) against the same calls in one process."""
    out = job_results(tmp_path_factory, "test_distributed:compare", world)
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(world)]
    worst: dict = {}
    refs = {name: _reference(name) for name in dict.fromkeys(RUN[world] + RING[world])}  # one process
    for name in RUN[world]:
        got = ranks[0]["rep"][name]
        _check(name, refs[name], got, worst)
        for other in ranks[1:]:  # every rank holds the same bits
            for k, v in got.items():
                if isinstance(v, torch.Tensor):
                    assert torch.equal(v, other["rep"][name][k]), (name, k)
    for name in RING[world]:
        ref = refs[name]
        parts = [rk["ring"][name] for rk in ranks]
        got = {}
        for k, v in parts[0].items():
            if k in X_SIDE or k in Y_SIDE:  # this rank's slices: put back together in rank order
                got[k] = torch.cat([p[k] for p in parts], -2 if k in ("gx", "gy") else -1)
            else:  # the whole problem's: the same on every rank
                got[k] = v
                for p in parts[1:]:
                    assert not isinstance(v, torch.Tensor) or torch.equal(v, p[k]) or _rel(p[k], v) <= RTOL, (name, k)
        _check("ring " + name, ref, got, worst)
    print(f"world={world}: worst relative difference {max(worst.values()):.2e} ({max(worst, key=worst.get)})")


def test_mismatch_is_detected(tmp_path_factory):
    out = job_results(tmp_path_factory, "test_distributed:mismatch", 2)
    msgs = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    expect = {
        "reg": "reg:",
        "shape": "X_a (shape, dtype)",
        "points": "X_a (the points",
        "dtype": "X_a (shape, dtype)",
        "option": "max_iter:",
        "blur": "blur:",
        "weights": "α (the weights)",
    }
    for m in msgs:  # both ranks raise, with the same message
        for k, start in expect.items():
            assert m[k] is not None and m[k].startswith(start), (k, m[k])
            assert "ranks [1]" in m[k] and "rank 0:" in m[k] and "rank 1:" in m[k], m[k]
    assert msgs[0]["after"] == msgs[1]["after"]
    assert abs(msgs[0]["after_ring"] - msgs[0]["after"]) <= 1e-12 * abs(msgs[0]["after"])  # both modes, one problem
    for m in msgs:
        assert m["diverged"] is not None and "the ranks diverged" in m["diverged"], m["diverged"]
        assert m["ring_diverged"] is not None and "the ranks diverged" in m["ring_diverged"], m["ring_diverged"]
    assert msgs[0]["ring_in_transfer_after"] == "torch.Size([1, 16])", msgs[0]["ring_in_transfer_after"]
    in_transfer = {"ring_in_transfer_op": "rank 1: to_dense call 1", "ring_in_transfer_call": "rank 1: softmin call 1"}
    for k, want in in_transfer.items():
        assert msgs[0][k] == msgs[1][k], (k, msgs[0][k], msgs[1][k])  # the same error on every rank
        assert msgs[0][k] is not None and "the ranks diverged" in msgs[0][k] and want in msgs[0][k], msgs[0][k]
    ring = {
        "ring_reg": ("reg: differs", "ranks [1]"),
        "ring_dim": ("(batch, dimension, dtype): differs", "ranks [1]"),
        "ring_weights_given": ("weights given: differs", "ranks [1]"),
        "ring_empty": ("holds no points",),
        "ring_blur": ("blur: differs", "ranks [1]"),
    }
    for m in msgs:
        for k, parts in ring.items():
            assert m[k] is not None and all(p in m[k] for p in parts), (k, m[k])
    assert msgs[0]["ring_empty"].startswith("rank 1 rejected its input")
    assert "NaN" in msgs[1]["ring_bad_input"] and msgs[0]["ring_bad_input"].startswith("rank 1 rejected its input"), (
        msgs[0]["ring_bad_input"],
        msgs[1]["ring_bad_input"],
    )
    print("\n".join(f"{k}: {v}" for k, v in msgs[0].items()))


@pytest.mark.parametrize("mode", ["dead", "stuck"])
def test_failed_rank_makes_the_others_fail(mode, tmp_path):
    """A rank that exits mid-solve: the survivor's next collective fails at once (closed connection); a
    rank that stays alive without joining: the survivor fails at the process-group timeout (5 s here)."""
    rcs, outs, wall = _launch(mode, 2, tmp_path, timeout=90, wait_for=None if mode == "dead" else [0])
    if mode == "dead":
        assert rcs[1] == 3
    rep = json.loads((tmp_path / "rank0.json").read_text())
    assert rep["error"] is not None, "\n".join(outs)
    assert rep["elapsed"] < (STUCK_TIMEOUT + 15 if mode == "stuck" else 15), rep
    print(f"{mode}: rank 0 failed after {rep['elapsed']:.1f} s: {rep['error'][:200]}")


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])


def test_torchrun_example_matches_one_process():
    """examples/distributed_solve.py under torchrun (2 ranks) prints what one process computes."""
    import re

    from flashot import SamplesLoss, solve_sample

    root = ROOT
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(root, "src"), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            os.path.join(root, "examples", "distributed_solve.py"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    m = re.search(
        r"2 ranks, engine sharded\(cpu\): OT = ([-\d.]+) .*\|grad x\| = ([-\d.]+), S_eps = ([-\d.]+)", p.stdout
    )
    assert m, p.stdout
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6000, 3, generator=gen).requires_grad_()
    y = torch.randn(5000, 3, generator=gen) + 1.0
    res = solve_sample(x, y, reg=0.1)
    res.value.backward()
    loss = SamplesLoss(blur=0.05)(x, y)
    ref = (res.value.item(), float(x.grad.norm()), loss.item())
    mp = re.search(r"points-sharded, engine ring\(cpu\): OT = ([-\d.]+) .*\|grad x\| = ([-\d.]+)", p.stdout)
    assert mp, p.stdout
    got = tuple(float(v) for v in m.groups()) + tuple(float(v) for v in mp.groups())
    ref = ref + ref[:2]  # the points-sharded solve is the same problem
    for g, r in zip(got, ref):  # printed to 6 decimals; float32 sums in another order: 1e-5 relative
        assert abs(g - r) <= 1e-5 * abs(r) + 1e-6, (got, ref)


def test_control_tensors_follow_the_backend(monkeypatch):
    """The collective stop decision's tensor: CUDA for NCCL (which refuses CPU tensors), CPU for gloo."""
    import flashot.distributed.solve as D

    monkeypatch.setattr(D.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(D.torch.cuda, "current_device", lambda: 1)
    assert D._control_device(None) == torch.device("cuda", 1)
    monkeypatch.setattr(D.dist, "get_backend", lambda group=None: "gloo")
    assert D._control_device(None) == torch.device("cpu")
