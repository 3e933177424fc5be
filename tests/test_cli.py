"""The console entry point."""

import re
import subprocess
import sys

import flashot
from flashot.data import two_moons_3d


def test_demo_prints_the_solution_it_computed():
    r = subprocess.run(
        [sys.executable, "-m", "flashot.cli", "demo", "--n", "800", "--backend", "tiled"],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stderr
    out = r.stdout
    value = float(re.search(r"value \(OT_eps, POT convention\) = ([0-9.eE+-]+)", out).group(1))
    n_iter = int(re.search(r"iterations = (\d+)", out).group(1))
    div = float(re.search(r"S\(x, y\) = ([0-9.eE+-]+)", out).group(1))
    assert re.search(r"peak RSS = \d+ MiB", out)
    x, y = two_moons_3d(800)
    ref = flashot.solve_sample(x, y, reg=1e-2, tol=1e-3, max_iter=500, backend="dense")
    assert abs(value - float(ref.value)) < 1e-4 * abs(float(ref.value))
    assert abs(n_iter - ref.n_iter) <= 1
    ref_div = flashot.SamplesLoss(blur=0.05, backend="dense")(x, y)
    assert abs(div - float(ref_div)) < 1e-4 * abs(float(ref_div)) + 1e-7


def test_unknown_command_is_an_error():
    r = subprocess.run([sys.executable, "-m", "flashot.cli", "frobnicate"], capture_output=True, text=True)
    assert r.returncode == 2 and "usage" in r.stderr and "unknown command 'frobnicate'" in r.stderr


def test_version_flag():
    r = subprocess.run([sys.executable, "-m", "flashot.cli", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == f"flashot {flashot.__version__}"


def test_build_command_reports_the_isa_and_the_library(tmp_path):
    import os

    from flashot.ops.cpu import build

    if build._find_compiler() is None:
        import pytest

        pytest.skip("no C++ compiler on PATH")
    env = {**os.environ, "FLASHOT_CACHE_DIR": str(tmp_path)}
    args = [sys.executable, "-m", "flashot.cli", "build", "--march", "x86-64-v2"]
    if "sse4_2" not in build._cpu_flags():
        args = args[:-2]
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr
    assert "compiled in" in r.stdout and str(tmp_path) in r.stdout and "threads" in r.stdout
    assert "compiling the CPU kernels once" in r.stderr
    r2 = subprocess.run(args, capture_output=True, text=True, env=env, timeout=900)
    assert r2.returncode == 0 and "found in the cache" in r2.stdout
    if "x86-64-v2" in args:
        assert "128-bit vectors" in r.stdout and "avx" not in r.stdout.split("vectors")[0].split("-march=")[1]
    bad = subprocess.run([sys.executable, "-m", "flashot.cli", "build", "--march", "x; rm -rf /"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 1 and "FLASHOT_CPU_MARCH" in bad.stderr
