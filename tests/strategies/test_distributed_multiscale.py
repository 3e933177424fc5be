"""The multiscale solver in a distributed solve (replicated mode) on 2 and 3 gloo processes.

The ranks run this file's jobs (``rank_job``: compare, errors) in the process groups the distributed test
modules share (distributed_ranks.py), and write their results to the job's directory; the parent makes the same calls in one process (``group=None``) and
compares: ``SamplesLoss(backend="multiscale")`` values, potentials and gradients w.r.t. points and weights,
``solve_sample(backend="multiscale")`` values, potentials, marginals, ``plan @ V`` and gradients, the six-argument call with
cluster labels and one DistributedDataParallel SGD step (gradients and parameters), to 1e-10 relative
in float64, the kept fractions of every pruning exactly (the pruning really drops blocks: under 25% of
the pairs are kept at the end), and every rank's results bit for bit.  Also: ``backend="auto"`` picks the
multiscale solver with ``group`` where it does in one process; ``shard="points"`` is refused; options
that differ across ranks and ranks whose pruning diverged raise.  The block-sparse engine's row ranges
(whole row clusters) are checked against its full calls without any process group.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import pytest
import torch

import flashot.multiscale as MS

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from distributed_ranks import job_results

RTOL = 1e-10
F64 = torch.float64


# -- the problems (run with group=pg on every rank, and with group=None in the parent) -----------------


def _torus(n: int, seed: int, shift=(0.0, 0.0, 0.0)) -> torch.Tensor:
    """A torus surface in 3-D (a thin shape: most cluster pairs are far apart, so pruning drops blocks)."""
    g = torch.Generator().manual_seed(seed)
    t, u = (torch.rand(n, generator=g, dtype=F64) * 2 * math.pi for _ in range(2))
    x = torch.stack(
        [(1 + 0.35 * torch.cos(u)) * torch.cos(t), (1 + 0.35 * torch.cos(u)) * torch.sin(t), 0.35 * torch.sin(u)], -1
    )
    return x + torch.tensor(shift, dtype=F64)


def _data(N: int = 2500, M: int = 2000):
    x, y = _torus(N, 0), _torus(M, 1, (0.2, 0.1, 0.0))
    g = torch.Generator().manual_seed(5)
    a, b = torch.rand(N, generator=g, dtype=F64) + 0.5, torch.rand(M, generator=g, dtype=F64) + 0.5
    return x, y, a / a.sum(), b / b.sum()


def _leaves(*ts):
    return [t.clone().requires_grad_() for t in ts]


def _loss(group, **kw) -> dict:
    """Debiased SamplesLoss (softmin_sym on the x-x and y-y patterns too): value, gradients, potentials."""
    from flashot import SamplesLoss

    x, y, a, b = _leaves(*_data())
    L = SamplesLoss(backend=kw.pop("backend", "multiscale"), group=group, **kw)
    v = L(a, x, b, y)
    v.backward()
    run = L.last_multiscale
    F, G = SamplesLoss(backend="multiscale", group=group, potentials=True, **kw)(a, x, b, y)
    return {
        "value": v.detach(),
        "gx": x.grad,
        "gy": y.grad,
        "ga": a.grad,
        "gb": b.grad,
        "F": F,
        "G": G,
        "kept": run.kept,
        "engine": run.m.engine.name,
    }


def _labels(group) -> dict:
    """GeomLoss' six-argument call: the clusters given as labels (a grid of side 0.15 here)."""
    from flashot import SamplesLoss
    from flashot.clusters import grid_labels

    x, y, a, b = _leaves(*_data())
    lx, ly = grid_labels(x.detach(), 0.15), grid_labels(y.detach(), 0.15)
    L = SamplesLoss(backend="multiscale", blur=0.03, group=group)
    v = L(lx, a, x, ly, b, y)
    v.backward()
    return {
        "value": v.detach(),
        "gx": x.grad,
        "gy": y.grad,
        "ga": a.grad,
        "gb": b.grad,
        "kept": L.last_multiscale.kept,
        "engine": L.last_multiscale.m.engine.name,
    }


def _ddp(group, lr: float = 0.5) -> dict:
    """One SGD step of a small model whose loss is the multiscale SamplesLoss, in DistributedDataParallel
    on the ranks (replicated mode: every rank maps all the points), plain in one process."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from flashot import SamplesLoss

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
    with torch.no_grad():  # start near the identity: the image stays a thin shape that pruning thins out
        model[0].weight.mul_(0.1)
        model[2].weight.mul_(0.1)
    net = model if group is None else DDP(model, process_group=group)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    x, y, _, _ = _data(2000, 1800)
    L = SamplesLoss(backend="multiscale", blur=0.03, group=group)
    loss = L(x + net(x), y)
    loss.backward()
    grads = {f"grad{k}": p.grad.clone() for k, p in enumerate(model.parameters())}
    opt.step()
    return {
        "value": loss.detach(),
        "kept": L.last_multiscale.kept,
        **grads,
        **{f"param{k}": p.detach().clone() for k, p in enumerate(model.parameters())},
    }


def _solve(group, **kw) -> dict:
    """solve_sample: the coarse-to-fine schedule, then the ordinary loop to tol on the pruned points."""
    from flashot import solve_sample

    x, y, a, b = _leaves(*_data(2000, 1800))
    res = solve_sample(x, y, a, b, reg=0.01, tol=5e-3, max_iter=300, backend="multiscale", group=group, **kw)
    assert res.converged  # the stopping decision (collective in a distributed solve) was taken
    res.value.backward()
    f, g = res.potentials
    ra, rb = res.marginals  # plan products, V of one column (the C++ kernels)
    V = torch.linspace(-1.0, 1.0, 1800 * 6, dtype=F64).view(1800, 6).sin()
    return {
        "value": res.value.detach(),
        "f": f.detach(),
        "g": g.detach(),
        "ra": ra,
        "rb": rb,
        "PV": res.plan @ V,  # six columns: the PyTorch path of the block-sparse plan product
        "gx": x.grad,
        "gy": y.grad,
        "ga": a.grad,
        "gb": b.grad,
        "n_iter": torch.tensor(res.n_iter),
        "kept": res.multiscale.kept,
        "engine": res.backend,
    }


def _auto(group) -> dict:
    """backend='auto' picks the multiscale solver where one process does (threshold lowered to this size)."""
    import flashot.samples_loss as sl

    old, sl.AUTO_MULTISCALE_PAIRS = sl.AUTO_MULTISCALE_PAIRS, 1000**2
    try:
        out = _loss(group, blur=0.03, backend="auto")
    finally:
        sl.AUTO_MULTISCALE_PAIRS = old
    out["picked"] = out.pop("engine")
    return out


CASES = {
    "loss": lambda g: _loss(g, blur=0.03),
    "loss_p1_not_debiased": lambda g: _loss(g, p=1, blur=0.05, debias=False, cluster_scale=0.1),
    "solve": lambda g: _solve(g),
    "solve_symmetric": lambda g: _solve(g, method="symmetric", cluster_scale=0.1),
    "auto": _auto,
    "labels": _labels,
    "ddp": _ddp,
}
RUN = {2: list(CASES), 3: ["loss", "solve"]}


# -- the ranks ------------------------------------------------------------------------------------------


def _errors(rank: int, pg) -> dict:
    """What each refused or mismatched call raises on this rank (None: it did not raise)."""
    from flashot import SamplesLoss, solve_sample
    from flashot.clusters import cluster
    from flashot.costs import get_cost
    from flashot.distributed import ShardedEngine
    from flashot.ops.blocksparse import BlockPattern, BlockSparseEngine

    x, y, a, b = _data(300, 200)
    attempts = {
        "loss_points": lambda: SamplesLoss(backend="multiscale", group=pg, shard="points")(x, y),
        "solve_points": lambda: solve_sample(x, y, reg=0.1, backend="multiscale", group=pg, shard="points"),
        "loss_truncate": lambda: SamplesLoss(blur=0.1, backend="multiscale", truncate=5.0 + rank, group=pg)(x, y),
        "solve_truncate": lambda: solve_sample(x, y, reg=0.1, backend="multiscale", truncate=5.0 + rank, group=pg),
        "solve_backend": lambda: solve_sample(x, y, reg=0.1, backend="multiscale" if rank == 0 else "cpu", group=pg),
    }
    # two engines whose kept blocks differ across ranks (as if the pruning had diverged)
    cx, cy = cluster(x, a, 0.3), cluster(y, b, 0.3)
    xs, ys = x[cx.perm][None].contiguous(), y[cy.perm][None].contiguous()
    keep = torch.ones(cx.n_clusters, cy.n_clusters, dtype=torch.bool)
    keep[0, -1] = rank == 0
    eng = ShardedEngine(BlockSparseEngine([(xs, ys, BlockPattern(cx.offsets, cy.offsets, keep))]), pg)
    attempts["pruning_diverged"] = lambda: eng.softmin(
        xs, ys, torch.zeros(1, 200, dtype=F64), 0.1, get_cost("sqeuclidean")
    )
    msgs = {}
    for k, fn in attempts.items():
        try:
            fn()
            msgs[k] = None
        except (NotImplementedError, ValueError, RuntimeError) as e:
            msgs[k] = f"{type(e).__name__}: {e}"
    return msgs


def rank_job(mode: str, rank: int, world: int, pg, out: str) -> None:
    """This rank's part of a job of the shared spawns (distributed_ranks.py): compare, errors."""
    if mode == "compare":
        res = {}
        for name in RUN[world]:
            t0 = time.perf_counter()
            res[name] = CASES[name](pg)
            print(f"rank {rank} {name}: {time.perf_counter() - t0:.2f} s", flush=True)
        torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    elif mode == "errors":
        msgs = _errors(rank, pg)
        msgs["after"] = float(_solve(pg)["value"]) if world == 2 else None  # the group is still usable
        with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
            json.dump(msgs, fh)
    else:
        raise ValueError(f"unknown job {mode!r}")


# -- the tests ------------------------------------------------------------------------------------------


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.detach(), ref.detach()
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-300))


@pytest.mark.parametrize("world", [2, 3])
def test_multiscale_matches_single_process(world, tmp_path_factory):
    out = job_results(tmp_path_factory, "test_distributed_multiscale:compare", world)
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(world)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks' thread count (the same reductions in the pruning bounds)
    # the sharded engines run the block-sparse softmins, not the fused steps, so not their sub-tile pruning
    # (which drops entries below e^-truncate a_i b_j inside kept blocks: ~2e-9 relative in these values)
    tiles, MS.fine.TILE_PRUNING = MS.fine.TILE_PRUNING, False
    try:
        refs = {name: CASES[name](None) for name in RUN[world]}  # one process
    finally:
        torch.set_num_threads(threads)
        MS.fine.TILE_PRUNING = tiles
    worst: dict = {}
    for name in RUN[world]:
        ref, got = refs[name], ranks[0][name]
        assert got["kept"] == ref["kept"], (name, got["kept"], ref["kept"])  # the same pruning, every time
        assert ref["kept"][-1] < 0.25, (name, ref["kept"])  # it drops blocks
        for k, v in ref.items():
            if k in ("engine", "picked"):
                assert got[k] == f"sharded({v})", (name, got[k], v)
            elif k == "n_iter":
                assert int(got[k]) == int(v), (name, int(got[k]), int(v))
            elif isinstance(v, torch.Tensor):
                worst[f"{name}.{k}"] = r = _rel(got[k], v)
                assert r <= RTOL, (name, k, r)
        for other in ranks[1:]:  # every rank holds the same bits
            for k, v in got.items():
                assert torch.equal(v, other[name][k]) if isinstance(v, torch.Tensor) else v == other[name][k], (name, k)
    print(f"world={world}: worst relative difference {max(worst.values()):.2e} ({max(worst, key=worst.get)})")


def test_refusals_and_mismatches(tmp_path_factory):
    out = job_results(tmp_path_factory, "test_distributed_multiscale:errors", 2)
    msgs = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    expect = {
        "loss_points": ("NotImplementedError", "shard='points'", "shard='replicated'"),
        "solve_points": ("NotImplementedError", "shard='points'", "shard='replicated'"),
        "loss_truncate": ("ValueError", "truncate: differs", "ranks [1]"),
        "solve_truncate": ("ValueError", "truncate: differs", "ranks [1]"),
        "solve_backend": ("ValueError", "backend", "ranks [1]"),
        "pruning_diverged": ("RuntimeError", "the ranks diverged"),
    }
    for m in msgs:  # every rank raises
        for k, parts in expect.items():
            assert m[k] is not None and all(p in m[k] for p in parts), (k, m[k])
    assert msgs[0]["after"] == msgs[1]["after"]
    print("\n".join(f"{k}: {v}" for k, v in msgs[0].items()))


def test_row_ranges_are_whole_clusters_and_match_the_full_calls():
    """``row_bounds`` cuts whole row clusters, balanced by kept pairs, and the engine's ``rows=`` calls give
    the full calls' rows: bit for bit in the C++ kernels, to float reassociation in PyTorch."""
    from flashot.clusters import cluster
    from flashot.costs import get_cost
    from flashot.ops.blocksparse import BlockPattern, BlockSparseEngine

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(1000, 2, generator=g, dtype=F64), torch.randn(800, 2, generator=g, dtype=F64) + 0.5
    cx, cy = cluster(x, torch.ones(1000, dtype=F64), 0.3), cluster(y, torch.ones(800, dtype=F64), 0.3)
    xs, ys = x[cx.perm][None].contiguous(), y[cy.perm][None].contiguous()
    C = torch.cdist(cx.centroids, cy.centroids)
    keep = C < 1.2
    keep[torch.arange(cx.n_clusters), C.argmin(1)] = True
    pat = BlockPattern(cx.offsets, cy.offsets, keep)
    assert pat.fraction < 0.3
    cost = get_cost("sqeuclidean")
    h, al = torch.randn(1, 800, generator=g, dtype=F64), torch.randn(1, 1000, generator=g, dtype=F64)
    V1, V5 = torch.randn(1, 800, 1, generator=g, dtype=F64), torch.randn(1, 800, 5, generator=g, dtype=F64)
    per_row = (pat._rs * pat._k_row).tolist()  # kept pairs of each row cluster
    bounds = set(cx.offsets.tolist())
    for native in (True, False):
        eng = BlockSparseEngine([(xs, ys, pat)], native=native)
        full = [
            eng.softmin(xs, ys, h, 0.1, cost),
            eng.plan_product(xs, ys, al, h, 0.1, V1, cost),
            eng.plan_product(xs, ys, al, h, 0.1, V5, cost, "cost"),
        ]
        for parts in (1, 2, 3, 7, cx.n_clusters + 5):  # the last: some ranges are empty
            spans = eng.row_bounds(xs, ys, parts)
            assert len(spans) == parts and spans[0][0] == 0 and spans[-1][1] == 1000
            assert all(s[1] == t[0] and s[0] <= s[1] for s, t in zip(spans, spans[1:]))
            assert all(lo in bounds and hi in bounds for lo, hi in spans)
            if parts <= 3:  # balanced: each range within one row cluster's pairs of the ideal share
                ks = [int(torch.searchsorted(cx.offsets, torch.tensor(lo))) for lo, _ in spans] + [cx.n_clusters]
                loads = [sum(per_row[ks[r] : ks[r + 1]]) for r in range(parts)]
                assert max(loads) - pat.pairs / parts <= max(per_row), loads
            if parts > 7:  # more ranges than clusters: some are empty
                assert sum(lo == hi for lo, hi in spans) >= 5
                if native:
                    got = torch.cat([eng.softmin(xs, ys, h, 0.1, cost, rows=s) for s in spans], 1)
                    assert torch.equal(got, full[0])
                continue
            got = [
                torch.cat([eng.softmin(xs, ys, h, 0.1, cost, rows=s) for s in spans], 1),
                torch.cat([eng.plan_product(xs, ys, al, h, 0.1, V1, cost, rows=s) for s in spans], 1),
                torch.cat([eng.plan_product(xs, ys, al, h, 0.1, V5, cost, "cost", rows=s) for s in spans], 1),
            ]
            for k, (u, v) in enumerate(zip(got, full)):
                if native and k < 2:
                    assert torch.equal(u, v), (parts, k)
                else:
                    assert _rel(u, v) <= 1e-12, (native, parts, k, _rel(u, v))
    k = int(cx.sizes.argmax())  # a cluster of several points: a range that starts inside it is refused
    with pytest.raises(ValueError, match="whole row clusters"):
        eng.softmin(xs, ys, h, 0.1, cost, rows=(int(cx.offsets[k]) + 1, int(cx.offsets[k + 1])))
