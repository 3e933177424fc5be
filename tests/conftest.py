import os
from pathlib import Path

import pytest
import torch


def rel_err(a, b) -> float:
    """max |a - b| / max |b| (scale-aware elementwise relative error)."""
    a = torch.as_tensor(a).detach().double()
    b = torch.as_tensor(b).detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def pytest_configure(config):
    """Under pytest-xdist (``-n N``), each worker gets its share of the cores for torch's intra-op
    threads (and so the cpu engine's team, which follows torch's count): N workers x all cores
    would oversubscribe the machine."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if os.environ.get("PYTEST_XDIST_WORKER") and workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_sessionstart(session):
    """Compile the native kernels (or find them cached) before the first test, once for the run:
    the first-use compile is a cost of the run, printed here, not of whichever test happens to come
    first (the time guard below would otherwise charge it to that test)."""
    import time

    from flashot.ops.cpu import build

    if build._find_compiler() is None:
        return
    t0 = time.perf_counter()
    try:
        built = list(build.build_all(quiet=True).values())  # compiled together where missing
    except build.BuildError as e:  # the engine tests skip with the reason
        print(f"\nflashot tests: the cpu engine's kernels could not be built: {str(e)[:200]}")
        return
    if not all(cached for _, _, cached, _ in built):
        print(
            f"\nflashot tests: compiled the cpu engine's kernels in {time.perf_counter() - t0:.1f} s "
            f"({', '.join(path for path, *_ in built)})"
        )


@pytest.fixture(scope="session", autouse=True)
def _reference_cache(tmp_path_factory):
    """Where tests/references.py keeps its dense float64 references for this run (``FLASHOT_TEST_REFERENCE_CACHE``):
    the run's temporary directory, shared by the pytest-xdist workers (each has its own below it)."""
    from references import REFERENCE_CACHE

    if os.environ.get(REFERENCE_CACHE):
        yield
        return
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    os.environ[REFERENCE_CACHE] = str(root / "references")
    yield
    os.environ.pop(REFERENCE_CACHE, None)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="module")
def one_thread():
    """Tiny problems: one intra-op thread is much faster (and robust to a loaded machine).

    Opt in per module with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def cpu_lib():
    """The compiled ``cpu`` engine's library (skips only where it cannot be built)."""
    from flashot.ops.cpu import build

    try:
        return build.load()
    except build.BuildError as e:  # pragma: no cover - no toolchain
        pytest.skip(f"no compiled CPU engine: {str(e)[:200]}")


@pytest.fixture(scope="module")
def lib(cpu_lib):
    """Short name of :func:`cpu_lib` (the kernel-level tests call it ``lib``)."""
    return cpu_lib


@pytest.fixture(scope="session")
def shared_build_cache():
    """The kernel cache every test that builds the library in a subprocess uses (tests/cli/test_cli.py,
    tests/ops/test_cpu_build.py, tests/ops/test_native_driver.py, tests/ops/test_isa_matrix.py): the user's own
    flashot cache (``FLASHOT_CACHE_DIR`` or ``~/.cache/flashot``), so each instruction set is
    compiled once per machine -- by the first test that needs it, in the default run or the slow
    one -- and never again.  Tests of the compile itself use fresh directories instead."""
    from flashot.ops.cpu import cachedir

    return Path(cachedir.private_cache_dir())


# ---------------------------------------------------------------------------------------------
# the time guard: a test of the default run may take at most TEST_TIME_LIMIT_S seconds (call,
# setup and teardown each) unless it is marked slow; FLASHOT_TEST_TIME_LIMIT overrides it (0: off)

TEST_TIME_LIMIT_S = 60.0


def _time_limit() -> float:
    v = os.environ.get("FLASHOT_TEST_TIME_LIMIT")
    return TEST_TIME_LIMIT_S if not v else float(v)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    limit = _time_limit()
    if limit <= 0 or rep.outcome != "passed" or item.get_closest_marker("slow") is not None:
        return
    if call.duration > limit:
        rep.outcome = "failed"
        rep.longrepr = (
            f"{item.nodeid}: the {rep.when} took {call.duration:.1f} s, over the default run's "
            f"limit of {limit:g} s (tests/conftest.py): make it smaller or mark it "
            f"@pytest.mark.slow (FLASHOT_TEST_TIME_LIMIT=0 turns the guard off)"
        )
