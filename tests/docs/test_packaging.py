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
pytestmark = pytest.mark.skipif(
    not os.path.exists(os.path.join(ROOT, "pyproject.toml")), reason="needs the source tree (pyproject.toml)"
)


def _build(kind: str, out: str, kernels: str = "none", cache=None, timeout: int = 300) -> str:
    """Build a wheel or an sdist of the source tree into ``out`` with the running setuptools.

    ``kernels``: ``FLASHOT_WHEEL_KERNELS`` (default ``none``: a source-only wheel); ``cache``: the
    kernel cache the prebuilt ones come from (the test run's shared one: no second compile)."""
    code = f"import sys; from setuptools import build_meta as b; print(b.build_{kind}(sys.argv[1]))"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHOT_")}
    env["FLASHOT_WHEEL_KERNELS"] = kernels
    if cache is not None:
        env["FLASHOT_CACHE_DIR"] = str(cache)
    r = subprocess.run(
        [sys.executable, "-c", code, out], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return os.path.join(out, r.stdout.strip().splitlines()[-1])


def _native_library(cache, dtype: str = "float64") -> str:
    """The native core library of ``dtype`` in the run's shared cache, as a process with no FLASHOT_* settings
    loads it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLASHOT_", "PYTHONPATH"))}
    env["FLASHOT_CACHE_DIR"] = str(cache)
    code = (
        f"from flashot.ops.cpu import build; build.load({dtype!r}, quiet=True); "
        f"print(build.BUILD_INFO['libraries']['core_' + build.dtype_suffix({dtype!r})]['path'])"
    )
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
    py = _venv_with_wheel(tmp_path, whl)  # flashot only from the wheel
    venv = tmp_path / "venv"
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
    r = subprocess.run(
        [py, "-c", code, str(venv)], cwd=str(tmp_path), capture_output=True, text=True, timeout=900, env=env
    )
    assert r.returncode == 0 and "WHEEL_OK True" in r.stdout, (r.stdout[-2000:], r.stderr[-3000:])


def test_sdist_carries_kernel_sources_examples_and_tests(tmp_path):
    pytest.importorskip("setuptools")
    sdist = _build("sdist", str(tmp_path / "dist"))
    with tarfile.open(sdist) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    from flashot.ops.cpu import build

    kernels = [f"src/flashot/ops/cpu/{name}" for name in build.SOURCES]  # every header and translation unit
    for need in (
        *kernels,
        "setup.py",
        "README.md",
        "tests/ops/test_cpu_engine.py",
        "tests/native/kernel_check.cpp",
        "examples/gradient_flow.py",
    ):
        assert need in names, need


def _venv_with_wheel(tmp_path, whl) -> str:
    """A fresh venv with ``whl`` installed (no dependencies) -> its python; torch and numpy from this
    environment (a path entry: its .pth files, e.g. an editable flashot, are not processed)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    # (no PYTHONPATH: a source tree on it, with its *.egg-info, would look to pip like flashot installed)
    r = subprocess.run(
        [sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps", whl],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    site = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    with open(os.path.join(site, "_deps.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    return py


# each prebuilt variant loads (chosen by FLASHOT_CPU_MARCH) and agrees with the dense engine
VARIANT_CHECK = textwrap.dedent("""
    import sys, torch, flashot
    from flashot.ops.cpu import build
    x, y = torch.randn(300, 3, dtype=torch.float64), torch.randn(200, 3, dtype=torch.float64)
    a = flashot.solve_sample(x, y, reg=0.5, backend="cpu")
    b = flashot.solve_sample(x, y, reg=0.5, backend="dense")
    assert a.backend == "cpu" and abs(float(a.value) - float(b.value)) < 1e-9 * abs(float(b.value))
    assert build.BUILD_INFO["path"].startswith(sys.argv[1]), build.BUILD_INFO["path"]
    print("VARIANT", build.BUILD_INFO["prebuilt"], build.BUILD_INFO["isa"])
""")


# The levels the wheel below carries: the ones the test run compiles anyway (tests/ops/test_isa_matrix.py and
# test_cpu_build.py), so they come from the run's shared cache.  x86-64-v4 is left out: its code paths are the ones
# -march=native compiles on an AVX-512 CPU (tests/ops/test_prebuilt.py checks that the kernels choose them by
# macros v4 defines), which the default run compiles and tests; it would be one more full compile of the four
# libraries.  That a wheel built with FLASHOT_WHEEL_KERNELS unset carries every level is test_prebuilt.py's.
WHEEL_TEST_LEVELS = {"x86_64": ("x86-64-v3", "x86-64-v2"), "aarch64": ("armv8-a",)}


@pytest.mark.slow  # builds the wheel: two levels x four libraries (from the shared cache when compiled there)
def test_prebuilt_wheel_runs_the_demo_without_a_compiler(tmp_path, shared_build_cache):
    """Issue 37: the wheel carries the kernels of the levels it is built with (WHEEL_TEST_LEVELS), tagged
    py3-none-<platform>; installed in a fresh venv with no compiler on PATH and an empty cache, ``flashot demo``
    (at 2,000 points) runs on the prebuilt level this CPU runs best, compiling nothing and warning nothing, and
    every level the CPU runs agrees with the dense engine."""
    import platform
    import time
    import zipfile

    from flashot.ops.cpu import build, prebuilt

    arch = prebuilt.arch(platform.machine())
    if build._find_compiler() is None or arch is None:
        pytest.skip("needs a C++ compiler and an x86-64 or AArch64 machine")
    src = tmp_path / "src"  # a copy: the build writes build/ and *.egg-info beside the sources
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(
            ".git",
            ".venv",
            "build",
            "dist",
            "*.egg-info",
            "__pycache__",
            ".pytest_cache",
            ".hypothesis",
            "*.png",
            ".whl",
            ".gl",
        ),
    )
    code = "import sys; from setuptools import build_meta as b; print(b.build_wheel(sys.argv[1]))"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHOT_")}
    env.update(FLASHOT_WHEEL_KERNELS=",".join(WHEEL_TEST_LEVELS[arch]), FLASHOT_CACHE_DIR=str(shared_build_cache))
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "dist")],
        cwd=str(src),
        capture_output=True,
        text=True,
        timeout=1800,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    whl = str(tmp_path / "dist" / r.stdout.strip().splitlines()[-1])
    assert whl.endswith(f"-py3-none-{sysconfig.get_platform().replace('-', '_').replace('.', '_')}.whl"), whl
    variants = WHEEL_TEST_LEVELS[arch]
    assert set(variants) <= set(prebuilt.VARIANTS[arch])
    with zipfile.ZipFile(whl) as z:
        names = set(z.namelist())
    assert {f"flashot/ops/cpu/prebuilt/{v}/{lib}.so" for v in variants for lib in build.LIBRARIES} <= names
    if arch == "x86_64" and shutil.which("objdump"):  # no register wider than the level allows
        with zipfile.ZipFile(whl) as z:
            z.extractall(tmp_path / "unzipped", [n for n in names if n.endswith(".so")])
        for v, wider in (("x86-64-v2", ("%ymm", "%zmm")), ("x86-64-v3", ("%zmm",))):
            for lib in build.LIBRARIES:
                asm = subprocess.run(
                    ["objdump", "-d", str(tmp_path / "unzipped" / f"flashot/ops/cpu/prebuilt/{v}/{lib}.so")],
                    capture_output=True,
                    text=True,
                    timeout=300,
                ).stdout
                assert len(asm) > 10_000 and not any(r in asm for r in wider), (v, lib)
    py = _venv_with_wheel(tmp_path, whl)
    bindir = os.path.dirname(py)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    env = {"PATH": bindir, "HOME": str(tmp_path), "FLASHOT_CACHE_DIR": str(cache), "LANG": "C.UTF-8"}
    assert (
        subprocess.run(
            [py, "-c", "import shutil; print(shutil.which('g++') or shutil.which('c++'))"],
            env=env,
            capture_output=True,
            text=True,
        ).stdout.strip()
        == "None"
    )
    want = prebuilt.select_variant(build._cpu_flags(), platform.machine(), variants)
    r = subprocess.run(
        [os.path.join(bindir, "flashot"), "build", "--info"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=str(tmp_path),
    )
    assert r.returncode == 0 and f"kernels: prebuilt {want} " in r.stdout, (r.stdout, r.stderr)
    t0 = time.perf_counter()
    # 2,000 points, not the default 20,000: what this checks (the kernels that load, nothing compiled or
    # warned) does not depend on the size, and the default size would be most of this test's time
    r = subprocess.run(
        [os.path.join(bindir, "flashot"), "demo", "--no-png", "--n", "2000"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=str(tmp_path),
    )
    secs = time.perf_counter() - t0
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"engine cpu: prebuilt {want} kernels loaded" in r.stdout and "engine=cpu" in r.stdout, r.stdout
    assert r.stderr == "", r.stderr[-3000:]  # no warning, no compile message
    assert os.listdir(cache) == [], os.listdir(cache)  # nothing compiled, nothing cached
    print(f"flashot demo from the wheel: {secs:.1f} s ({want})")
    for v in variants:
        if prebuilt.runs_on(v, build._cpu_flags(), platform.machine()):
            r = subprocess.run(
                [py, "-c", VARIANT_CHECK, os.path.dirname(os.path.dirname(py))],
                capture_output=True,
                text=True,
                timeout=300,
                env={**env, "FLASHOT_CPU_MARCH": v},
            )
            assert r.returncode == 0 and f"VARIANT {v} " in r.stdout, (r.stdout, r.stderr[-3000:])
    # native means compile for this CPU: without a compiler that is a clear error, not a prebuilt fallback
    r = subprocess.run(
        [os.path.join(bindir, "flashot"), "build"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "FLASHOT_CPU_MARCH": "native"},
    )
    assert r.returncode == 1 and "no C++ compiler found" in r.stderr, (r.stdout, r.stderr)
