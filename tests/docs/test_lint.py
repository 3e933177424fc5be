"""Static checks: ruff's lint and format check over the source, tests, benchmarks and examples (rules: ``[tool.ruff.lint]`` in
pyproject.toml), and mypy over the core, the strategies, the front ends but POT's and GeomLoss', and the CLI (modules
and options: ``[tool.mypy]``)."""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _ruff() -> list[str]:
    exe = shutil.which("ruff", path=str(pathlib.Path(sys.executable).parent)) or shutil.which("ruff")
    assert exe, "ruff is missing: it is part of the test extra (pip install -e '.[test]')"
    return [exe]


def test_ruff_check_is_clean():
    r = subprocess.run(
        _ruff() + ["check", "--no-cache", "src", "tests", "benchmarks", "examples", "setup.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_ruff_format_is_clean():
    """The code is as ``ruff format`` writes it (``[tool.ruff.format]``): run ``ruff format`` to fix."""
    r = subprocess.run(
        _ruff() + ["format", "--check", "--no-cache", "src", "tests", "benchmarks", "examples", "setup.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_mypy_is_clean():
    """mypy on the files listed in ``[tool.mypy]``.  Its incremental cache (``.mypy_cache`` at the repository
    root, git-ignored) makes a repeated run take seconds; a cold one analyses torch's stubs (tens of seconds)."""
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed: it is part of the test extra (pip install -e '.[test]')")
    r = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", "pyproject.toml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def _mypy_files() -> list[pathlib.Path]:
    """The files of ``[tool.mypy] files``, a directory standing for every ``.py`` file under it."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    with open(ROOT / "pyproject.toml", "rb") as f:
        entries = tomllib.load(f)["tool"]["mypy"]["files"]
    paths = [ROOT / e for e in entries]
    return [q for p in paths for q in (sorted(p.rglob("*.py")) if p.is_dir() else [p])]


def _unannotated(path: pathlib.Path) -> list[str]:
    """The public functions and methods of ``path`` with a parameter or return type missing.  Left out: private
    names (``_x``), methods of private classes, and the ``forward`` / ``backward`` of ``torch.autograd.Function``
    subclasses (torch calls them with a context object and untyped tensors; the public function around each one
    is annotated)."""
    tree = ast.parse(path.read_text())
    out: list[str] = []

    def visit(body: list[ast.stmt], prefix: str, autograd: bool) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                fn = any(ast.unparse(b).endswith("autograd.Function") for b in node.bases)
                visit(node.body, f"{prefix}{node.name}.", fn)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                dunder = node.name.startswith("__") and node.name.endswith("__")
                if (node.name.startswith("_") and not dunder) or (autograd and node.name in ("forward", "backward")):
                    continue
                args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                if prefix and args and args[0].arg in ("self", "cls"):
                    args = args[1:]
                args += [a for a in (node.args.vararg, node.args.kwarg) if a is not None]
                missing = [a.arg for a in args if a.annotation is None]
                if node.returns is None and node.name != "__init__":
                    missing.append("return")
                if missing:
                    out.append(f"{path.relative_to(ROOT)}:{node.lineno} {prefix}{node.name}: {', '.join(missing)}")

    visit(tree.body, "", False)
    return out


def test_public_functions_of_the_checked_modules_are_annotated():
    """The house rule (type hints on public functions) on the files mypy checks: mypy alone skips the body of
    a function without annotations, so a public one without them would go unchecked."""
    files = _mypy_files()
    assert any(f.parts[-2:] == ("cli", "__init__.py") for f in files), files  # the directories were expanded
    missing = [m for f in files for m in _unannotated(f)]
    assert not missing, "add type hints:\n" + "\n".join(missing)
