"""The size limits ARCHITECTURE.md sets for the code, checked: functions a reader holds at once, modules of
one job.

* Python (``src/flashot``): no function or method body longer than ``PY_FUNCTION`` lines (its statements:
  the signature and the docstring, which states the maths, are not counted) and no module longer than
  ``PY_MODULE`` lines.
* C++ (``src/flashot/ops/cpu``): no function longer than ``CPP_FUNCTION`` lines (from its first signature
  line to its closing brace) and no file longer than ``CPP_FILE`` lines.  A C++ function is a top-level
  brace block that is not a namespace, ``extern "C"`` block, struct, class, enum or union; a macro
  definition counts as a function too, from ``#define`` to its last continued line (the register-blocked
  panel's steps are macros: panel.h says why).

Each limit names "about" a size in ARCHITECTURE.md: a few lines over it would be a judgement call, so the
limits here are those numbers, and a function that must exceed one is listed in ``EXCEPTIONS`` with the
reason, which keeps the list short and current (an entry that no longer exceeds its limit fails).
"""

from __future__ import annotations

import ast
import pathlib
import re

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "flashot"
CPP = SRC / "ops" / "cpu"
PY_FUNCTION, PY_MODULE = 80, 700
CPP_FUNCTION, CPP_FILE = 80, 900
EXCEPTIONS: dict[str, str] = {}  # "path:name": why it is longer
SKIP = {"__attribute__", "alignas", "decltype", "sizeof"}  # not a function's name


def _python_functions(path: pathlib.Path):
    """(name, lines of its body) of each function and method: from the first statement after the docstring
    to the last line (the signature and the docstring are not counted)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]  # the docstring
            yield node.name, node.end_lineno - body[0].lineno + 1


def _cpp_blocks(text: str):
    """(name, lines) of each function and macro of a C++ source at namespace level (outside any function or
    type), in order."""
    lines = text.split("\n")
    stack: list[str] = []  # the open blocks: "ns" (namespace, extern "C"), "fn" (function), "other"
    start = fstart = None  # first line of the declaration under way, and of the open function
    i = 0
    while i < len(lines):
        line = re.sub(r"//.*", "", lines[i])
        at_ns = all(k == "ns" for k in stack)
        if at_ns and line.lstrip().startswith("#"):
            j = i
            while lines[j].endswith("\\"):
                j += 1
            if line.lstrip().startswith("#define"):
                yield line.split()[1].split("(")[0], j - i + 1
            i = j + 1
            continue
        if at_ns and start is None and line.strip() and not line.strip().startswith("}"):
            start = i
        for ch in line:
            if ch == "{":
                if all(k == "ns" for k in stack):
                    head = " ".join(lines[start if start is not None else i : i + 1]).split("{")[0]
                    if re.search(r"\b(namespace|extern \"C\")", head):
                        stack.append("ns")
                        start = None
                    elif "(" in head and not re.search(r"\b(struct|class|enum|union)\b", head):
                        stack.append("fn")
                        fstart, fhead = (start if start is not None else i), head
                    else:
                        stack.append("other")
                else:
                    stack.append("other")
            elif ch == "}":
                kind = stack.pop()
                if kind == "fn" and all(k == "ns" for k in stack):
                    names = [n for n in re.findall(r"([A-Za-z_]\w*)\s*\(", fhead) if n not in SKIP]
                    yield (names[0] if names else fhead.strip()[:40]), i - fstart + 1
                if all(k == "ns" for k in stack):
                    start = None
            elif ch == ";" and all(k == "ns" for k in stack):
                start = None
        i += 1


def _too_long(items, limit, where):
    out = []
    for name, n in items:
        key = f"{where}:{name}"
        if n > limit and key not in EXCEPTIONS:
            out.append(f"{key} has {n} lines (limit {limit})")
    return out


def test_python_functions_and_modules_are_short():
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        bad += _too_long(_python_functions(path), PY_FUNCTION, rel)
        n = len(path.read_text().splitlines())
        if n > PY_MODULE:
            bad.append(f"{rel} has {n} lines (limit {PY_MODULE})")
    assert not bad, "\n".join(bad)


def test_cpp_functions_and_files_are_short():
    bad = []
    sources = sorted([*CPP.glob("*.h"), *CPP.glob("*.cpp")])
    assert len(sources) >= 10
    found = 0
    for path in sources:
        text = path.read_text()
        blocks = list(_cpp_blocks(text))
        found += len(blocks)
        bad += _too_long(blocks, CPP_FUNCTION, path.name)
        n = len(text.splitlines())
        if n > CPP_FILE:
            bad.append(f"{path.name} has {n} lines (limit {CPP_FILE})")
    assert found > 100, found  # the parser sees the kernels' functions and macros
    assert not bad, "\n".join(bad)


def test_the_checks_can_fail(tmp_path):
    """The parsers see long functions: a 92-line C++ function inside a namespace, a 91-line macro, and a
    Python function whose 81-line body follows its docstring."""
    body = "\n".join(f"  x += {k};" for k in range(88))
    cpp = f"namespace {{\ntemplate <int N>\nstatic int f(int x) {{\n{body}\n  return x;\n}}\n}}\n"
    assert dict(_cpp_blocks(cpp)) == {"f": 92}
    macro = "#define FL_M() \\\n" + "\n".join("  x += 1; \\" for _ in range(89)) + "\n  x += 1;\n"
    assert dict(_cpp_blocks(macro)) == {"FL_M": 91}
    assert _too_long([("f", 92)], CPP_FUNCTION, "t.h") == ["t.h:f has 92 lines (limit 80)"]
    py = tmp_path / "m.py"
    py.write_text('def g(x):\n    """Doc."""\n' + "    x += 1\n" * 80 + "    return x\n")
    assert dict(_python_functions(py)) == {"g": 81}


def test_exceptions_are_current():
    for key in EXCEPTIONS:
        where, name = key.split(":")
        path = next(p for p in SRC.rglob(where))
        items = _cpp_blocks(path.read_text()) if path.suffix in (".h", ".cpp") else _python_functions(path)
        limit = CPP_FUNCTION if path.suffix in (".h", ".cpp") else PY_FUNCTION
        assert any(n == name and k > limit for n, k in items), f"{key} is within its limit: remove the exception"
