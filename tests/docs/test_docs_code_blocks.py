"""Every ``python`` code block of README.md and of the docs pages runs as written (issue 13).

The blocks are read from README.md and ``docs/*.md`` themselves, so the pages and this test cannot
drift apart (``docs/coming_from.md`` is left to ``tests/docs/test_coming_from_page.py``, which also checks
each of its blocks against the peer it maps from). Each block runs in a fresh namespace (blocks are
self-contained: no variable comes from an earlier block), with warnings turned into errors: a
solve that does not converge, a CG solve that misses its tolerance or a deprecated call fails the
test.  After a block runs, every :class:`flashot.OTResult` it left behind must have converged (or
have been stopped by its callback), and the acceleration block must show acceleration helping, as
its page says.  A fragment that cannot run alone (a rank's part of a ``torchrun`` script) is
written as a ``{code-block} python`` directive, which this test does not collect.

Blocks are kept small (a few seconds each on two cores); ``pytest tests/docs/test_docs_code_blocks.py
--durations=0`` measures them.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

import flashot
from flashot.pot_samples import OTResult

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# pages whose blocks another test runs (with its own peers and warning filters)
DOCS_TESTED_ELSEWHERE = {"coming_from.md"}
DOC_PAGES = sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in DOCS_TESTED_ELSEWHERE)


def python_blocks(text: str) -> list[str]:
    """The bodies of the ```python fenced blocks, in order."""
    return [m.group(1) for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)]


BLOCKS = python_blocks(README.read_text())
DOC_BLOCKS = [(page, src) for page in DOC_PAGES for src in python_blocks(page.read_text())]
ALL_BLOCKS = [(README, src) for src in BLOCKS] + DOC_BLOCKS


def _ids(blocks: list[tuple[Path, str]]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for page, _ in blocks:
        k = seen[page.name] = seen.get(page.name, -1) + 1
        out.append(f"{page.name}:{k}")
    return out


def test_readme_has_the_blocks_this_test_expects():
    assert len(BLOCKS) >= 5, "README.md lost its python examples?"
    pages = {page.name for page, _ in DOC_BLOCKS}
    for need in ("guide.md", "getting_started.md", "multiscale.md", "gromov.md"):
        assert need in pages, f"docs/{need} lost its python examples?"
    for _, src in ALL_BLOCKS:  # self-contained: each block imports what it uses
        assert re.search(r"^(import|from) ", src, re.M), src[:80]


def _results(ns: dict) -> dict[str, OTResult]:
    return {k: v for k, v in ns.items() if isinstance(v, OTResult)}


@pytest.mark.parametrize(("page", "src"), ALL_BLOCKS, ids=_ids(ALL_BLOCKS))
def test_readme_block_runs_as_written(page, src):
    ns: dict = {"__name__": "__readme__"}
    threads = torch.get_num_threads()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"(?!flashot)")
        try:
            exec(compile(src, str(page), "exec"), ns)
        finally:
            torch.set_num_threads(threads)
    results = _results(ns)
    for name, v in ns.items():
        if isinstance(v, flashot.BarycenterResult):
            assert v.converged, f"{page.name}: barycenter {name!r} did not converge in {v.n_iter} steps"
        if isinstance(v, flashot.GWResult):
            assert v.converged, f"{page.name}: Gromov-Wasserstein {name!r} did not converge in {v.n_outer} steps"
    for name, r in results.items():
        assert r.converged or r.stopped, (
            f"{page.name}: result {name!r} did not converge: {r.n_iter} iterations, error {r.error}"
        )
    if "acceleration=None" in src:  # the page says acceleration cuts the iterations: show it
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
    assert python_blocks("```{code-block} python\nfragment(x_local)\n```\n") == []  # not collected
    assert flashot.__version__  # the package imported is the one under test
