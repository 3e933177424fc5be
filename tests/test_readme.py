"""Every ``python`` code block of README.md runs as written (issue 13).

The blocks are read from README.md itself, so the README and this test cannot drift apart.
Each block runs in a fresh namespace (blocks are self-contained: no variable comes from an
earlier block), with warnings turned into errors: a solve that does not converge, a CG solve
that misses its tolerance or a deprecated call fails the test.  After a block runs, every
:class:`flashot.OTResult` it left behind must have converged (or have been stopped by its
callback), and the acceleration block must show acceleration helping, as the README says.

The README states how long the blocks take; ``pytest tests/test_readme.py --durations=0``
measures it.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

import flashot
from flashot.ot_samples import OTResult

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks(text: str) -> list[str]:
    """The bodies of the ```python fenced blocks, in order."""
    return [m.group(1) for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)]


BLOCKS = python_blocks(README.read_text())


def _block_id(src: str) -> str:
    first = src.strip().splitlines()[0]
    return re.sub(r"\W+", "_", first)[:40]


def test_readme_has_the_blocks_this_test_expects():
    assert len(BLOCKS) >= 5, "README.md lost its python examples?"
    for src in BLOCKS:  # self-contained: each block imports what it uses
        assert re.search(r"^(import|from) ", src, re.M), src[:80]


def _results(ns: dict) -> dict[str, OTResult]:
    return {k: v for k, v in ns.items() if isinstance(v, OTResult)}


@pytest.mark.parametrize("src", BLOCKS, ids=[_block_id(b) for b in BLOCKS])
def test_readme_block_runs_as_written(src):
    ns: dict = {"__name__": "__readme__"}
    threads = torch.get_num_threads()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"(?!flashot)")
        try:
            exec(compile(src, str(README), "exec"), ns)
        finally:
            torch.set_num_threads(threads)
    results = _results(ns)
    for name, v in ns.items():
        if isinstance(v, flashot.BarycenterResult):
            assert v.converged, f"README barycenter {name!r} did not converge in {v.n_iter} steps"
    for name, r in results.items():
        assert r.converged or r.stopped, f"README result {name!r} did not converge: {r.n_iter} iterations, error {r.error}"
    if "acceleration=" in src:  # the README says acceleration cuts the iterations: show it
        plain, fast = ns["plain"], ns["fast"]
        assert isinstance(plain, OTResult) and isinstance(fast, OTResult)
        assert fast.converged and plain.converged
        assert fast.n_iter < plain.n_iter / 2, (fast.n_iter, plain.n_iter)
        assert abs(float(fast.value) - float(plain.value)) < 1e-3 * abs(float(plain.value))
    if "callback=" in src:
        stopped = [r for r in results.values() if r.stopped]
        assert stopped and all(r.error is not None and r.error < 1e-3 for r in stopped)


def test_python_blocks_parser():
    text = "a\n```python\nx = 1\n```\n```bash\nls\n```\n```python\ny = 2\nz = 3\n```\n"
    assert python_blocks(text) == ["x = 1\n", "y = 2\nz = 3\n"]
    assert flashot.__version__  # the package imported is the one under test
