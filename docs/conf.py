"""Sphinx configuration of flashot's documentation site (`make docs`).

Offline by design: no intersphinx, MathJax served from the site itself
(``sphinx-mathjax-offline``'s copy), no web fonts or scripts from elsewhere.
The gallery runs ``examples/plot_*.py``; ``FLASHOT_EXAMPLE_SMALL=1`` in the environment
runs them at reduced size (CI does).
"""

from __future__ import annotations

import os
import logging
import pathlib
import re
import shutil
import sys

import matplotlib

matplotlib.use("Agg")

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "src"))  # the working tree's flashot, installed or not

import flashot  # noqa: E402

project = "flashot"
author = "flashot developers"
copyright = "flashot developers"
release = version = flashot.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "myst_parser",
    "sphinx_gallery.gen_gallery",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build", "README.md", "requirements.txt", "**sg_execution_times.rst",
                    "auto_examples/*.ipynb", "auto_examples/*.py", "auto_examples/*.zip",
                    "auto_examples/*.codeobj.json", "auto_examples/*.md5"]
myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 3

# API reference from the docstrings (Google style "Args:" sections)
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_inherit_docstrings = False  # not torch.nn.Module's "Should be overridden by all subclasses"
autodoc_default_options = {"members": True, "undoc-members": True}  # a name without a docstring still gets its entry
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # "Attributes:" as fields: undoc-members documents the attributes once

# The docstrings are written to be read as plain text (help(), an editor): norms are |x - y|,
# which reStructuredText would read as a substitution reference.  Escape those bars (outside
# ``literals``, `roles` and literal blocks) so they render as written.
_LITERAL = re.compile(r"(``.*?``|`[^`]*`)")


def _escape_bars(app, what, name, obj, options, lines):
    if what == "module":  # api.rst says what the modules are; their docstrings are terminal tables
        lines[:] = []
        return
    literal_indent = None
    for i, line in enumerate(lines):
        stripped = line.lstrip()
        indent = len(line) - len(stripped)
        if literal_indent is not None:
            if not stripped or indent > literal_indent:
                continue
            literal_indent = None
        if stripped.startswith(("|", "+-", "+=")):
            continue  # a table or a line block: bars are markup there
        if stripped.startswith((">>>", "...")):
            continue  # doctest lines are shown verbatim
        parts = _LITERAL.split(line)
        lines[i] = "".join(p if k % 2 else p.replace("|", r"\|") for k, p in enumerate(parts))
        if stripped.endswith("::"):
            literal_indent = indent


# Warnings from docstrings in src/ that docs/ cannot fix (docs/README.md, "Suppressed
# warnings"): (location suffix, start of the message).  Each is dropped before -W sees it; every
# other warning fails the build.
SUPPRESSED_WARNINGS: list[tuple[str, str]] = []  # (location, message); none today


class _DropListed(logging.Filter):
    def filter(self, record):
        loc = str(getattr(record, "location", "") or "")
        msg = record.getMessage()
        return not any(loc.endswith(l) and msg.startswith(m) for l, m in SUPPRESSED_WARNINGS)

sphinx_gallery_conf = {
    "examples_dirs": str(ROOT / "examples"),
    "gallery_dirs": "auto_examples",
    "filename_pattern": r"/plot_",            # run every plot_*.py
    "ignore_pattern": r"(gradient_flow|geomloss_flow|distributed_solve)\.py$",  # command-line scripts (examples/README.md)
    "download_all_examples": False,
    "remove_config_comments": True,
    "matplotlib_animations": False,
    "image_scrapers": ("matplotlib",),
    "reset_modules": ("matplotlib",),
    "show_memory": False,
    "within_subsection_order": "FileNameSortKey",
    "default_thumb_file": None,
    "write_computation_times": False,  # its page loads jQuery and DataTables from CDNs
}

html_theme = "furo"
html_title = f"flashot {release}"
html_static_path = ["_static"]
html_favicon = "_static/favicon.svg"
html_show_sourcelink = False
html_copy_source = False

# MathJax 3 from the site itself: sphinx-mathjax-offline ships it; only the CHTML bundle, its fonts
# and the components it may load on demand are copied (about 6 MB of the package's 24 MB).
mathjax_path = "mathjax/tex-chtml.js"


def _copy_mathjax(app, exc):
    if exc is not None or app.builder.format != "html":
        return
    import importlib.util

    spec = importlib.util.find_spec("sphinx-mathjax-offline")
    if spec is None or spec.origin is None:
        raise RuntimeError("docs: MathJax not found; pip install -r docs/requirements.txt")
    src = pathlib.Path(spec.origin).parent / "static" / "mathjax"
    dst = pathlib.Path(app.outdir) / "_static" / "mathjax"
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src / "tex-chtml.js", dst / "tex-chtml.js")
    for sub in ("output", "input", "a11y", "ui"):
        if (src / sub).is_dir():
            shutil.copytree(src / sub, dst / sub, dirs_exist_ok=True)


def setup(app):
    app.connect("build-finished", _copy_mathjax)
    app.connect("autodoc-process-docstring", _escape_bars, priority=100)
    for handler in logging.getLogger("sphinx").handlers:
        handler.filters.insert(0, _DropListed())
