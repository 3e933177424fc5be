"""The documentation site, built once per test run and shared by the tests that need it (the fixture
``docs_build``; a test module imports it: ``from site_build import docs_build_fixture``).

``sphinx -W`` builds the site as ``make docs`` does, the gallery at reduced size
(``FLASHOT_EXAMPLE_SMALL=1``), with ``FLASHOT_EXAMPLE_OUT`` set: each gallery example, run by the build,
also writes its figure and the numbers it prints there, and test_examples.py checks the example's claim
on them instead of running the example a second time.  Under pytest-xdist the workers share one build
through a file lock in the run's temporary directory: the first to need it builds, another waits for it
(two builds would also race on the gallery's folder in the source tree, ``docs/auto_examples``).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import NamedTuple

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


class DocsBuild(NamedTuple):
    html: pathlib.Path  # the site
    examples: pathlib.Path  # FLASHOT_EXAMPLE_OUT of the gallery's run: <example>.png and <example>.json


def _build(out: pathlib.Path) -> dict:
    examples = out / "examples"
    examples.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, FLASHOT_EXAMPLE_SMALL="1", FLASHOT_EXAMPLE_OUT=str(examples), MPLBACKEND="Agg")
    # run_stale_examples: run every example even where an earlier build in this checkout left its output
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-W", "--keep-going", "-q"]
    cmd += ["-D", "sphinx_gallery_conf.run_stale_examples=True"]
    cmd += ["-d", str(out / "doctrees"), str(ROOT / "docs"), str(out / "html")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    return {"rc": proc.returncode, "log": proc.stdout[-4000:] + "\n" + proc.stderr[-8000:]}


@pytest.fixture(scope="session", name="docs_build")
def docs_build_fixture(tmp_path_factory) -> DocsBuild:
    """Build the site as `make docs` does, with the gallery at reduced size (once per run)."""
    try:
        import sphinx  # noqa: F401
        import sphinx_gallery  # noqa: F401
    except ImportError as e:
        pytest.fail(f"the docs requirements are missing ({e}): pip install -r docs/requirements.txt")
    from filelock import FileLock

    base = pathlib.Path(tmp_path_factory.getbasetemp())
    out = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "docs-site"
    with FileLock(str(out) + ".lock"):
        done = out / "done.json"
        if not done.exists():
            report = _build(out)
            done.write_text(json.dumps(report))
        report = json.loads(done.read_text())
    assert report["rc"] == 0, f"sphinx -W failed:\n{report['log']}"
    return DocsBuild(out / "html", out / "examples")
