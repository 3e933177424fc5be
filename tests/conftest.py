import os

import pytest
import torch


def rel_err(a, b) -> float:
    """max |a - b| / max |b| (scale-aware elementwise relative error)."""
    a = torch.as_tensor(a).detach().double()
    b = torch.as_tensor(b).detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


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
def private_build_cache(tmp_path_factory):
    """A private (0700) kernel cache shared by the tests that build the library in a subprocess
    (tests/test_cli.py, tests/test_cpu_build.py): each full build costs ~35 s on 2 cores, so the
    x86-64-v2 library is compiled once for all of them."""
    d = tmp_path_factory.mktemp("flashot-cache")
    os.chmod(d, 0o700)
    return d
