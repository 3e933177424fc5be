"""A rank that rejects its input makes every rank raise the same clear error at once (flashot.distributed).

Two gloo ranks run this file's job (``rank_job``, in a process group the distributed test modules share:
distributed_ranks.py), each case on a fresh group with a timeout of ``PG_TIMEOUT`` seconds.  In each case rank 1
passes a bad argument (an invalid ``reg`` or ``blur``, NaN / Inf in points or weights, a dimension or a dtype
that its own other argument does not match, a wrong number of arguments) and rank 0 a valid one, in
replicated and points-sharded mode, through ``solve_sample`` and ``SamplesLoss``.  Every rank must raise the
same exception (type and message, naming the argument and rank 1) well within the timeout: a rank left
waiting in a collective would only fail at the timeout, with gloo's error.  Afterwards the group still works.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from distributed_ranks import job_results
from test_distributed import _data, _slices

PG_TIMEOUT = 20  # seconds: a rank left waiting fails here, far later than FAST
FAST = 5.0  # seconds: every rank must have raised by then (measured: well under 1 s)
NAN = float("nan")


def _cases(pg, rank: int) -> dict:
    """name -> (argument the error must name, a call that is valid on rank 0 and rejected on rank 1)."""
    from flashot import SamplesLoss, solve_sample

    x, y, a, b = _data(0, 12, 10)
    bad = rank == 1
    xl, yl, al, bl = _slices((rank, 2), x, y, a, b)
    pts = {"group": pg, "shard": "points", "backend": "cpu"}
    rep = {"group": pg, "backend": "cpu"}
    return {
        "reg": ("reg", lambda: solve_sample(x, y, reg=-1.0 if bad else 0.1, **rep)),
        "nan_x": ("X_a", lambda: solve_sample(x * NAN if bad else x, y, reg=0.1, **rep)),
        "inf_y": ("X_b", lambda: solve_sample(x, y + (float("inf") if bad else 0.0), reg=0.1, **rep)),
        "nan_a": ("a", lambda: solve_sample(x, y, a * NAN if bad else a, b, reg=0.1, **rep)),
        "dimension": ("X_a and X_b", lambda: solve_sample(x, y[:, :2] if bad else y, reg=0.1, **rep)),
        "dtype": ("X_a and X_b", lambda: solve_sample(x.float() if bad else x, y, reg=0.1, **rep)),
        "multiscale_reg": ("reg", lambda: solve_sample(x, y, reg=-1.0 if bad else 0.1, backend="multiscale", group=pg)),
        "loss_blur": ("blur", lambda: SamplesLoss(blur=-1.0 if bad else 0.1, group=pg, backend="cpu")(x, y)),
        "loss_nan_b": ("β", lambda: SamplesLoss(blur=0.1, group=pg, backend="cpu")(a, x, b * NAN if bad else b, y)),
        "loss_arguments": (
            "SamplesLoss takes",
            lambda: SamplesLoss(blur=0.1, group=pg, backend="cpu")(*((x, y, x) if bad else (x, y))),
        ),
        "points_reg": ("reg", lambda: solve_sample(xl, yl, reg=-1.0 if bad else 0.1, **pts)),
        "points_inf_b": ("b", lambda: solve_sample(xl, yl, al, bl + (float("inf") if bad else 0.0), reg=0.1, **pts)),
        "points_int_x": ("X_a", lambda: solve_sample(xl.long() if bad else xl, yl, reg=0.1, **pts)),
        "points_loss_blur": ("blur", lambda: SamplesLoss(blur=-1.0 if bad else 0.1, **pts)(xl, yl)),
        "points_loss_nan_x": ("x", lambda: SamplesLoss(blur=0.1, **pts)(xl * NAN if bad else xl, yl)),
    }


def rank_job(mode: str, rank: int, world: int, pg, out: str) -> None:
    """This rank's part of the reject job of the shared spawns (distributed_ranks.py).  Each case runs on a
    fresh group with the short timeout; the shared group (a longer timeout) only lines the ranks up between
    cases, so that a rank left waiting in one case cannot pair its collective with the next case's."""
    import torch.distributed as dist

    from flashot import solve_sample

    got: dict = {}
    path = os.path.join(out, f"rank{rank}.json")
    for name in _cases(None, rank):
        case_pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=PG_TIMEOUT))
        _, call = _cases(case_pg, rank)[name]
        t0 = time.perf_counter()
        try:
            call()
            got[name] = {"error": None}
        except Exception as e:  # noqa: BLE001 - what this rank sees, whatever it is
            got[name] = {"type": type(e).__name__, "error": str(e)}
        got[name]["elapsed"] = time.perf_counter() - t0
        with open(path, "w") as fh:  # after every case: what a hung run reached stays readable
            json.dump(got, fh)
        dist.barrier(group=pg)
    case_pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=PG_TIMEOUT))
    x, y, a, b = _data(0, 12, 10)
    got["after"] = float(solve_sample(x, y, reg=0.1, backend="cpu", group=case_pg).value)
    xl, yl, _, _ = _slices((rank, 2), x, y, a, b)
    got["after_points"] = float(solve_sample(xl, yl, reg=0.1, backend="cpu", group=case_pg, shard="points").value)
    with open(path, "w") as fh:
        json.dump(got, fh)


def test_rejected_input_raises_on_every_rank_at_once(tmp_path_factory):
    out = job_results(tmp_path_factory, "test_distributed_reject:reject", 2)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    names = {k: arg for k, (arg, _) in _cases(None, 0).items()}
    report = "\n".join(f"{k}: " + " | ".join(str(rk.get(k)) for rk in ranks) for k in names)
    for name, arg in names.items():
        r0, r1 = ranks[0].get(name), ranks[1].get(name)
        assert r0 is not None and r1 is not None, f"{name}: a rank never finished this case\n{report}"
        for r in (r0, r1):
            assert r["error"] is not None and r["elapsed"] < FAST, f"{name}: {r}\n{report}"
        assert (r0["type"], r0["error"]) == (r1["type"], r1["error"]), f"{name}: the ranks raised differently\n{report}"
        assert "rank 1" in r0["error"] and arg in r0["error"], f"{name}: {r0['error']}"
    assert ranks[0]["after"] == ranks[1]["after"] and ranks[0]["after_points"] == ranks[1]["after_points"]
    print(report)
