"""The documentation site builds (offline, warnings as errors) and renders in a real browser.

The site is built once per run, as ``make docs`` does (``sphinx -W``, the gallery at reduced
size: ``FLASHOT_EXAMPLE_SMALL=1``; tests/docs/site_build.py), into a temporary folder; this module
serves it on 127.0.0.1 and opens the home page, the API page and a gallery page in headless
Chromium (Debian's ``chromium``,
driven by Playwright; Playwright never downloads a browser here).  On each page: no console
errors, no failed requests, every image loaded (non-zero ``naturalWidth``), every internal
link answers HTTP 200.

Needs the docs requirements (``pip install -r docs/requirements.txt``, which the README's
test command runs) and Chromium (``apt-get install chromium``, which tests/ci.sh runs as root);
skips with a message only where no Chromium can be found.  ``FLASHOT_CHROMIUM`` names another
Chromium binary.
"""

from __future__ import annotations

import functools
import http.server
import os
import pathlib
import re
import shutil
import threading
import urllib.error
import urllib.parse
import urllib.request

import pytest
from site_build import docs_build_fixture  # noqa: F401 - the fixture docs_build, one build per run

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = ["index.html", "api.html", "auto_examples/plot_colour_transfer.html"]


def _chromium() -> str | None:
    for name in (os.environ.get("FLASHOT_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


@pytest.fixture(scope="module")
def site(docs_build):
    """The site built once for the run (tests/docs/site_build.py): its html folder."""
    return docs_build.html


def test_site_builds_offline_with_every_page(site):
    for page in PAGES + [
        "concepts.html",
        "getting_started.html",
        "benchmarks.html",
        "coming_from.html",
        "auto_examples/index.html",
        "guide.html",
        "engines.html",
        "multiscale.html",
        "gromov.html",
        "distributed.html",
        "cli.html",
        "conventions.html",
        "exactness.html",
        "development.html",
    ]:
        assert (site / page).is_file(), page
    # offline: no page loads a script, style sheet, image or font from another host
    remote = re.compile(
        r"<(?:script|img|iframe|source)\b[^>]*\bsrc=[\"']?(?:https?:)?//"
        r"|<link\b[^>]*\bhref=[\"']?(?:https?:)?//"
    )
    for p in site.rglob("*.html"):
        m = remote.search(p.read_text())
        assert m is None, f"{p.relative_to(site)} loads from another host: {m.group(0)}"
    assert (site / "_static" / "mathjax" / "tex-chtml.js").is_file()
    # every public name has its entry in the API reference
    import flashot
    import flashot.ops

    api = (site / "api.html").read_text()
    for name in [n for n in flashot.__all__ if n != "__version__"]:
        assert f'id="flashot.{name}"' in api, name
    for name in flashot.ops.__all__:
        assert f'id="flashot.ops.{name}"' in api, name
    # the benchmark page includes BENCHMARKS.md itself
    assert "How to read the tables" in (site / "benchmarks.html").read_text()


@pytest.fixture(scope="module")
def server(site):
    handler = functools.partial(_QuietHandler, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def browser():
    exe = _chromium()
    if exe is None:
        pytest.skip(
            "no Chromium found (apt-get install chromium, as root; or set FLASHOT_CHROMIUM): "
            "the browser checks of the docs site did not run"
        )
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as e:
        pytest.fail(f"playwright is missing ({e}): pip install -r docs/requirements.txt")
    with sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=exe, headless=True, args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
        )
        yield b
        b.close()


_IMAGES_JS = """async () => {
  const out = [];
  for (const img of Array.from(document.images)) {
    img.loading = 'eager';            // lazy images: load them now
    try { await img.decode(); } catch (e) {}
    out.push([img.currentSrc || img.src, img.naturalWidth]);
  }
  return out;
}"""


@pytest.mark.parametrize("page", PAGES)
def test_page_renders_in_chromium(page, server, browser):
    ctx = browser.new_context()
    tab = ctx.new_page()
    problems = []
    tab.on("console", lambda m: m.type == "error" and problems.append(f"console: {m.text}"))
    tab.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    tab.on("requestfailed", lambda r: problems.append(f"request failed: {r.url} ({r.failure})"))
    tab.on("response", lambda r: r.status >= 400 and problems.append(f"HTTP {r.status}: {r.url}"))
    resp = tab.goto(server + page, wait_until="load")
    assert resp is not None and resp.status == 200
    tab.wait_for_load_state("networkidle")

    images = tab.evaluate(_IMAGES_JS)
    broken = [src for src, width in images if not width]
    assert not broken, f"{page}: images that did not load: {broken}"
    if page.startswith("auto_examples/"):
        gallery = [src for src, _ in images if "/_images/sphx_glr_" in src]
        assert gallery, f"{page}: no gallery figure on the page ({images})"
        # the maths of the example's text is typeset, by the site's own MathJax
        tab.wait_for_selector("mjx-container", timeout=15_000)

    hrefs = tab.eval_on_selector_all("a[href]", "els => els.map(e => e.href)")
    internal = sorted({urllib.parse.urldefrag(h)[0] for h in hrefs if h.startswith(server)})
    assert len(internal) >= 3, internal
    bad = []
    for url in internal:
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                if r.status != 200:
                    bad.append((url, r.status))
        except urllib.error.HTTPError as e:
            bad.append((url, e.code))
    assert not bad, f"{page}: internal links that do not resolve: {bad}"
    tab.wait_for_timeout(200)  # late console messages
    ctx.close()
    assert not problems, f"{page}: " + "\n".join(problems)
