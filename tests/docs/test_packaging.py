"""The package as users get it: a non-editable wheel installed into a fresh virtual environment
runs the CPU kernels from outside the repository; the sdist carries the kernel sources, the
examples and the tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(ROOT, "pyproject.toml")),
                                reason="needs the source tree (pyproject.toml)")


def _build(kind: str, out: str) -> str:
    """Build a wheel or an sdist of the source tree into ``out`` with the running setuptools."""
    code = (f"import sys; from setuptools import build_meta as b; "
            f"print(b.build_{kind}(sys.argv[1]))")
    r = subprocess.run([sys.executable, "-c", code, out], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return os.path.join(out, r.stdout.strip().splitlines()[-1])


def _native_library(cache) -> str:
    """The native library in the run's shared cache, as a process with no FLASHOT_* settings loads it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLASHOT_", "PYTHONPATH"))}
    env["FLASHOT_CACHE_DIR"] = str(cache)
    code = "from flashot.ops.cpu import build; build.load(quiet=True); print(build.BUILD_INFO['path'])"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip().splitlines()[-1]


def test_wheel_in_a_fresh_venv_finds_its_kernels_and_runs(tmp_path, shared_build_cache):
    """The installed wheel's kernel sources hash exactly as the tree's: the cache key is a hash of
    the sources read from the installed package (a missing or changed file changes it), so the
    library compiled from the tree, placed in a fresh cache, is the one the wheel loads -- no
    second compile (the first-use compile itself is tests/ops/test_cpu_build.py's)."""
    pytest.importorskip("setuptools")
    from flashot.ops.cpu import build

    if build._find_compiler() is None:
        pytest.skip("no C++ compiler on PATH")
    lib = _native_library(shared_build_cache)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    shutil.copy(lib, cache / os.path.basename(lib))
    os.chmod(cache / os.path.basename(lib), 0o700)
    whl = _build("wheel", str(tmp_path / "dist"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    r = subprocess.run([sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps", whl],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    # torch and numpy from this environment (a path entry: its .pth files, e.g. an editable
    # flashot, are not processed), flashot itself only from the wheel
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(site, "_deps.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    code = textwrap.dedent("""
        import os, sys, torch, flashot
        assert flashot.__file__.startswith(sys.argv[1]), flashot.__file__
        from flashot.ops.cpu import build
        from flashot.ops.registry import get_engine
        from flashot.costs import get_cost
        eng = get_engine("cpu", device=torch.device("cpu"), dtype=torch.float64, cost=get_cost("sqeuclidean"))
        assert eng.name == "cpu", eng.name
        assert build.BUILD_INFO["path"].startswith(os.environ["FLASHOT_CACHE_DIR"])
        x, y = torch.randn(300, 3, dtype=torch.float64), torch.randn(200, 3, dtype=torch.float64)
        a = flashot.solve_sample(x, y, reg=0.5, backend="cpu")
        b = flashot.solve_sample(x, y, reg=0.5, backend="dense")
        assert abs(float(a.value) - float(b.value)) < 1e-9 * abs(float(b.value)), (a.value, b.value)
        print("WHEEL_OK", build.BUILD_INFO["cached"])
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLASHOT_", "PYTHONPATH"))}
    env["FLASHOT_CACHE_DIR"] = str(cache)
    r = subprocess.run([py, "-c", code, str(venv)], cwd=str(tmp_path), capture_output=True, text=True,
                       timeout=900, env=env)
    assert r.returncode == 0 and "WHEEL_OK True" in r.stdout, (r.stdout[-2000:], r.stderr[-3000:])


def test_sdist_carries_kernel_sources_examples_and_tests(tmp_path):
    pytest.importorskip("setuptools")
    sdist = _build("sdist", str(tmp_path / "dist"))
    with tarfile.open(sdist) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    from flashot.ops.cpu import build

    kernels = [f"src/flashot/ops/cpu/{name}" for name in build.SOURCES]  # every header and translation unit
    for need in (*kernels, "README.md", "tests/ops/test_cpu_engine.py", "tests/native/kernel_check.cpp",
                 "examples/gradient_flow.py"):
        assert need in names, need
