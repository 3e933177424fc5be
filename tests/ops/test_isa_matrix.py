"""Every instruction-set path the ``cpu`` engine ships is built and tested, not only the one
``-march=native`` selects here: the engine's kernel tests run again, in a subprocess, with
``FLASHOT_CPU_MARCH`` = ``x86-64-v3`` (AVX2 + FMA, 32-byte vectors) and ``x86-64-v2`` (SSE4.2,
16-byte vectors).  (``native`` is the ordinary run; AArch64 / NEON runs under qemu-user:
``tests/native/run_arm64.sh``.)  Marked slow: CI runs it in its second step.  A level whose library
reports the instruction-set macros and vector width of the run's own build (x86-64-v3 on a CPU with AVX2
and no AVX-512) compiles the same kernel source paths the default run tested: its suite is skipped, saying
so, and the wheel test (tests/docs/test_packaging.py) still runs that level's library against the dense
engine.

What runs per level is what the instruction set changes: every test of the kernels themselves (softmin,
plan product, column sums, the fused steps, the block-sparse kernels, their pruning and tile pruning, in
float32 and float64, at sizes that end in partial vectors) and one whole multiscale solve against the cpu
engine; not the multiscale module's tests of PyTorch code (clusters, patterns, arguments, reports) nor its
other whole solves, which are the same calls in another order (``NOT_PER_LEVEL``).  The dense float64
references of these tests are PyTorch's, the same for every level: they are computed by the first level's
run and read by the next (``FLASHOT_TEST_REFERENCE_CACHE``, tests/references.py)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from flashot.ops.cpu import build
from references import REFERENCE_CACHE

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
# multiscale and tile_rule: the block-sparse kernels and their tile pruning; ragged_kernels: their banded sums; GeomLoss' online parity: float32
# gradients through the plan product, whose rounding differs per instruction set (test_online states the figures)
MODULES = [
    "ops/test_cpu_engine.py",
    "ops/test_cpu_fpenv.py",
    "strategies/test_multiscale.py",
    "strategies/test_ragged_kernels.py",
    "ops/test_tile_rule.py",
    "frontends/test_geomloss_parity.py::test_online",
]

# tests of the modules above whose code under test does not depend on the instruction set (PyTorch code, argument
# checks, reports) or that repeat, as whole solves, kernel calls the other tests check one by one
NOT_PER_LEVEL = [
    "test_clusters_partition_and_centroids",
    "test_block_cost_bounds_are_lower_bounds",
    "test_cluster_sub_levels_sort_points_inside_their_cells",
    "test_pattern_needs_a_block_per_row_and_reports_its_fraction",
    "test_pruned_matches_unpruned",
    "test_unbalanced_multiscale_follows_the_single_scale_trajectory",
    "test_kept_fraction_and_trajectory_report",
    "test_float32_and_labels_call",
    "test_multiscale_errors",
    "test_morton_spread_matches_the_bit_loop",
    "test_coarsen_nests_the_grid",
    "test_auto_picks_multiscale_where_geomloss_does",
    "test_solve_sample_multiscale_unbalanced_matches_the_cpu_engine",
    "test_solve_sample_multiscale_refusals",
    "test_block_and_coarse_scales_halve_to_their_limits",
    "test_converged_is_a_promise_about_the_returned_plan",
    "test_fallback_to_tiled_when_build_fails",
    "test_fallback_real_compiler_failure",
    "test_registry_auto_picks_cpu",
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
    env[REFERENCE_CACHE] = os.environ[REFERENCE_CACHE]  # the run's references (tests/conftest.py)
    check = (
        "from flashot.ops.cpu import build; lib = build.load(quiet=True); "
        "print('VBYTES', lib.flashot_vector_bytes(), sorted(build.BUILD_INFO['isa']))"
    )
    r = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0 and f"VBYTES {vbytes} " in r.stdout, (r.stdout, r.stderr[-2000:])
    lib = build.load(quiet=True)  # the build the default run's engine tests use (native unless told otherwise)
    here = f"VBYTES {lib.flashot_vector_bytes()} {sorted(build.BUILD_INFO['isa'])}"
    if here in r.stdout.splitlines():
        pytest.skip(
            f"{march} compiles the kernel paths of this run's own build here ({here}: the same instruction-set "
            "macros and vector width), which the default run's engine tests ran; test_packaging's wheel test runs "
            f"the {march} library itself against the dense engine"
        )
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
            "-k",
            "not (" + " or ".join(NOT_PER_LEVEL) + ")",
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
