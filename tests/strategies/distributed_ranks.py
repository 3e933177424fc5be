"""The distributed tests' ranks: one gloo process group per spawn, shared by several test modules.

Starting a rank costs a Python interpreter that imports torch and flashot (about 2 CPU-seconds each) plus
the process group's set-up and each process's first calls (DistributedDataParallel's, the kernels'), so
the modules' rank-side jobs (``rank_job(mode, rank, world, group, out)`` in each module) run together in a
few spawns (``SPAWNS``): each spawn starts its ranks once (``python distributed_ranks.py <world> <init>
<dir> <job>...``, file:// rendezvous: no port to pick), runs its jobs in order with a barrier between
them, and each job writes its results to its own directory.  A job that raises on a rank writes the
traceback and ends that rank (its peers' collectives then fail at once, closed connection), so every
test of a job reports its own failure: the traceback, or which earlier job of the spawn failed first.

A spawn runs once per test run, whichever test asks first: under pytest-xdist the workers share it
through a file lock in the run's temporary directory (the other worker, if it asks meanwhile, waits:
the ranks keep both cores busy anyway).  The spawns are sized to stay well under the default run's
per-test time limit (tests/conftest.py), whose clock the first asking test's call carries.

The tests that kill or stall a rank (test_distributed.py: dead, stuck) and the torchrun example keep
their own processes."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))  # the repository
JOB_TIMEOUT = 120  # seconds: the shared group's timeout (a job that hangs fails at this point)

# name: (world size, the jobs "module:mode" in the order they run)
SPAWNS = {
    "two": (
        2,
        [
            "test_distributed:compare",
            "test_distributed:mismatch",
            "test_distributed_reject:reject",
            "test_distributed_multiscale:compare",
        ],
    ),
    # (the two 2-rank spawns about equal in time: the test that asks first carries its spawn's time)
    "two_points": (
        2,
        ["test_distributed_points:compare", "test_distributed_oracle:oracle", "test_distributed_multiscale:errors"],
    ),
    "three": (
        3,
        ["test_distributed:compare", "test_distributed_multiscale:compare", "test_distributed_points:compare"],
    ),
}


def launch(args: list[str], world: int, tmp, timeout: float = 120.0, wait_for=None, script: str = HERE):
    """Run ``world`` ranks of ``python script <args[0]> <rank> <args[1:]>...``; wait for those in
    ``wait_for`` (all by default), then kill the others.  Returns the exit codes, the outputs waited for
    (stdout and stderr) and the wall time."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")]),
    )
    procs = [
        subprocess.Popen(
            [sys.executable, script, args[0], str(r), *args[1:]],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    t0 = time.perf_counter()
    outs = []
    try:
        for r, p in enumerate(procs):
            if wait_for is None or r in wait_for:
                outs.append(p.communicate(timeout=max(1.0, timeout - (time.perf_counter() - t0)))[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs], outs, time.perf_counter() - t0


def _job_dir(root: Path, job: str) -> Path:
    return root / job.replace(":", "-")


def _spawn_of(job: str, world: int) -> str:
    names = [n for n, (w, jobs) in SPAWNS.items() if w == world and job in jobs]
    assert len(names) == 1, f"{job} on {world} ranks: in spawns {names} (distributed_ranks.SPAWNS)"
    return names[0]


def _shared_root(tmp_path_factory) -> Path:
    """The run's temporary directory, shared by the pytest-xdist workers (each has its own below it)."""
    base = Path(tmp_path_factory.getbasetemp())
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def job_results(tmp_path_factory, job: str, world: int, timeout: float = 300.0) -> Path:
    """The directory where ``job`` (``"module:mode"``) wrote its ranks' results, running its spawn first
    if no test of this run has; fails the calling test with the rank's traceback if the job failed."""
    import pytest
    from filelock import FileLock

    name = _spawn_of(job, world)
    root = _shared_root(tmp_path_factory) / f"ranks-{name}"
    with FileLock(str(root) + ".lock"):
        done = root / "done.json"
        if not done.exists():
            root.mkdir(exist_ok=True)
            try:
                rcs, outs, wall = launch(
                    [str(world), f"file://{root}/rendezvous", str(root), *SPAWNS[name][1]], world, root, timeout
                )
            except subprocess.TimeoutExpired as e:
                rcs, outs, wall = [None] * world, [f"the spawn ran past {timeout:g} s: {e}"], timeout
            done.write_text(json.dumps({"rcs": rcs, "outs": outs, "wall": wall}))
        report = json.loads(done.read_text())
    d = _job_dir(root, job)
    errors = sorted(d.glob("rank*.error"))
    if errors:
        pytest.fail(f"{job} failed on {errors[0].stem} (spawn {name!r}, {world} ranks):\n{errors[0].read_text()}")
    if not all((d / f"rank{r}.done").exists() for r in range(world)):
        failed = [j for j in SPAWNS[name][1] if list(_job_dir(root, j).glob("rank*.error"))]
        why = f"{failed[0]} failed first" if failed else f"exit codes {report['rcs']}"
        pytest.fail(f"{job} did not run to its end on {world} ranks ({why}):\n" + "\n".join(report["outs"])[-4000:])
    return d


def _rank_main(world: int, rank: int, init: str, out: str, jobs: list[str]) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=JOB_TIMEOUT)
    )
    for job in jobs:
        module, mode = job.split(":")
        d = _job_dir(Path(out), job)
        d.mkdir(exist_ok=True)
        t0 = time.perf_counter()
        try:
            importlib.import_module(module).rank_job(mode, rank, world, dist.group.WORLD, str(d))
        except BaseException:  # noqa: BLE001 - reported by the job's tests
            (d / f"rank{rank}.error").write_text(traceback.format_exc())
            sys.stdout.flush()
            os._exit(1)  # the peers' next collective fails at once; later jobs are reported as not run
        print(f"rank {rank} {job}: {time.perf_counter() - t0:.2f} s", flush=True)
        (d / f"rank{rank}.done").write_text("")
        dist.barrier()  # no rank starts the next job while another still uses the group
    dist.destroy_process_group()
    # torch 2.13's gloo aborts ~8% of clean interpreter exits ("terminate called without an active
    # exception", SIGABRT; pytorch/pytorch#190489): the results are written, so leave without the
    # interpreter's teardown.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5:])
