"""Static checks: ruff's lint over the source, tests, benchmarks and examples (rules: ``[tool.ruff.lint]`` in
pyproject.toml), and mypy over the core (modules and options: ``[tool.mypy]``)."""

from __future__ import annotations

import importlib.util
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _ruff() -> list[str]:
    exe = shutil.which("ruff", path=str(pathlib.Path(sys.executable).parent)) or shutil.which("ruff")
    assert exe, "ruff is missing: it is part of the test extra (pip install -e '.[test]')"
    return [exe]


def test_ruff_check_is_clean():
    r = subprocess.run(_ruff() + ["check", "--no-cache", "src", "tests", "benchmarks", "examples"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_mypy_core_is_clean():
    """mypy on the files listed in ``[tool.mypy]``.  Its incremental cache (``.mypy_cache`` at the repository
    root, git-ignored) makes a repeated run take seconds; a cold one analyses torch's stubs (tens of seconds)."""
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed: it is part of the test extra (pip install -e '.[test]')")
    r = subprocess.run([sys.executable, "-m", "mypy", "--config-file", "pyproject.toml"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
