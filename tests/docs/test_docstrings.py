"""The API reference's docstrings: every public name has an ``Example:`` section, and it runs.

The public names are ``flashot.__all__`` and ``flashot.ops.__all__`` (``docs/api.rst`` renders
exactly those), plus the methods of the public classes that users call (``METHODS``).  A name
added to ``__all__`` without an example fails ``test_every_public_name_has_an_example``.
"""

from __future__ import annotations

import doctest
import functools
import inspect
import re
import warnings

import pytest
import torch

import flashot
import flashot.ops

# methods and properties of public classes that users call (each needs its own example)
METHODS = {
    "flashot.SamplesLoss": ("forward", "plan"),
    "flashot.OTResult": ("value_linear", "marginals"),
    "flashot.LazyPlan": ("apply", "T", "sum", "cost_sum", "barycentric_map", "topk", "to_dense"),
}

_EXAMPLE = re.compile(r"^\s*Examples?:\s*$", re.M)


def _public():
    """``(qualified name, object)`` for every public name and listed method."""
    out = []
    for mod in (flashot, flashot.ops):
        for name in mod.__all__:
            obj = getattr(mod, name)
            if name == "__version__":  # a string: no docstring of its own
                continue
            out.append((f"{mod.__name__}.{name}", obj))
    for cls_name, methods in METHODS.items():
        cls = getattr(flashot, cls_name.split(".")[1])
        for m in methods:
            attr = inspect.getattr_static(cls, m)
            if isinstance(attr, (property, functools.cached_property)):
                attr = attr.fget if isinstance(attr, property) else attr.func
            out.append((f"{cls_name}.{m}", attr))
    return out


PUBLIC = _public()


@pytest.mark.parametrize("qualname,obj", PUBLIC, ids=[q for q, _ in PUBLIC])
def test_every_public_name_has_an_example(qualname, obj):
    doc = inspect.getdoc(obj) or ""
    assert doc.strip(), f"{qualname}: no docstring"
    m = _EXAMPLE.search(doc)
    assert m is not None, f"{qualname}: no 'Example:' section in its docstring"
    assert ">>> " in doc[m.end() :], f"{qualname}: its 'Example:' section has no '>>>' line"


def _run(qualname, obj):
    finder = doctest.DocTestFinder(recurse=False)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    globs = {"torch": torch, "flashot": flashot}
    n = 0
    for test in finder.find(obj, qualname, globs=globs):
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # an example must run cleanly (no convergence warnings)
            runner.run(test)
        n += len(test.examples)
    return runner.summarize(verbose=False), n


def test_examples_run():
    """Every example of every public name (and listed method) prints what its docstring says."""
    failed = []
    total = 0
    state = torch.get_num_threads()
    try:
        for qualname, obj in PUBLIC:
            res, n = _run(qualname, obj)
            total += n
            if n == 0:
                failed.append(f"{qualname}: no doctest example found")
            elif res.failed:
                failed.append(f"{qualname}: {res.failed} of {res.attempted} examples failed")
    finally:
        torch.set_num_threads(state)
    assert not failed, "doctest failures (run `python -m doctest -v` on the module to see them):\n" + "\n".join(failed)
    assert total >= len(PUBLIC)
