"""Every instruction-set path the ``cpu`` engine ships is built and tested, not only the one
``-march=native`` selects here: the engine's test modules run again, in a subprocess, with
``FLASHOT_CPU_MARCH`` = ``x86-64-v3`` (AVX2 + FMA, 32-byte vectors) and ``x86-64-v2`` (SSE4.2,
16-byte vectors).  (``native`` is the ordinary run; AArch64 / NEON runs under qemu-user:
``tests/native/run_arm64.sh``.)  Marked slow: CI runs it in its second step."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from flashot.ops.cpu import build

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
# multiscale and tile_rule: the block-sparse kernels and their tile pruning; GeomLoss' online parity: float32
# gradients through the plan product, whose rounding differs per instruction set (test_online states the figures)
MODULES = [
    "ops/test_cpu_engine.py",
    "ops/test_cpu_fpenv.py",
    "strategies/test_multiscale.py",
    "ops/test_tile_rule.py",
    "frontends/test_geomloss_parity.py::test_online",
]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86-64 levels"),
    pytest.mark.skipif(build._find_compiler() is None, reason="no C++ compiler on PATH"),
]


@pytest.mark.parametrize("march,vbytes", [("x86-64-v3", 32), ("x86-64-v2", 16)])
def test_engine_suite_under_march(shared_build_cache, march, vbytes):
    missing = [f for f in build._X86_LEVELS[march] if f not in build._cpu_flags()]
    if missing:
        pytest.skip(f"this CPU cannot run {march} (lacks {', '.join(missing)})")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHOT_")}
    # the run's shared cache (tests/conftest.py): the default run's build tests compiled these levels already
    env.update(FLASHOT_CPU_MARCH=march, FLASHOT_CACHE_DIR=str(shared_build_cache))
    check = (
        "from flashot.ops.cpu import build; lib = build.load(quiet=True); "
        "print('VBYTES', lib.flashot_vector_bytes(), sorted(build.BUILD_INFO['isa']))"
    )
    r = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0 and f"VBYTES {vbytes} " in r.stdout, (r.stdout, r.stderr[-2000:])
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            "-m",
            "not slow",
            *[os.path.join(TESTS, m) for m in MODULES],
        ],
        capture_output=True,
        text=True,
        timeout=1800,
        env=env,
        cwd=os.path.dirname(TESTS),
    )
    tail = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    assert r.returncode == 0 and " passed" in tail and "failed" not in tail, r.stdout[-4000:] + r.stderr[-2000:]
