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
    assert r.returncode == 2 and "usage" in r.stdout
