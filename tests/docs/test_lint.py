"""ruff's lint over the source, tests, benchmarks and examples (rules: ``[tool.ruff.lint]`` in pyproject.toml)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _ruff() -> list[str]:
    exe = shutil.which("ruff", path=str(pathlib.Path(sys.executable).parent)) or shutil.which("ruff")
    assert exe, "ruff is missing: it is part of the test extra (pip install -e '.[test]')"
    return [exe]


def test_ruff_check_is_clean():
    r = subprocess.run(_ruff() + ["check", "--no-cache", "src", "tests", "benchmarks", "examples"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
