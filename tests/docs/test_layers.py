"""The package's import layers: ops -> core -> strategies -> front ends -> CLI, no cycles, no private reads.

Every module of ``src/flashot`` is parsed with :mod:`ast`; *all* its imports count, those inside
functions included (a lazy import hides a cycle, it does not remove it).  Relative and absolute
imports are resolved; ``from flashot.x import y`` is an import of the submodule ``flashot.x.y`` when it
exists, else of ``flashot.x`` (for ``flashot`` itself that is the package ``__init__``).  A module's
implicit import of its parent packages is not an edge: Python runs them first, but that is what lets a
package ``__init__`` re-export its submodules.

Checks: (a) no import points to a higher layer; (b) no cycle among modules, within a layer too;
(c) no module reads another module's private names: neither ``from flashot.x import _name`` /
``mod._name`` on a flashot module / ``Cls._name`` on a name imported from one, nor ``obj._name`` on an
object when ``_name`` is not defined by the reading module itself (another module's class owns it: it
should expose a public property).
"""

from __future__ import annotations

import ast
import pathlib
from collections import defaultdict

import pytest

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "flashot"

# Layer of each module, by longest matching dotted prefix.
LAYERS: dict[str, int] = {
    # 0 ops: the streamed primitives and engines, with the leaf utilities they need (cost
    # definitions, argument checks); nothing here knows about a Sinkhorn solve.
    "flashot.ops": 0,
    "flashot.costs": 0,
    "flashot._checks": 0,
    # 1 core: the problem (Measures), the Sinkhorn loop and its stopping, schedules, acceleration,
    # warm starts, unbalanced updates, implicit differentiation, plans, results and values.
    "flashot.measures": 1,
    "flashot.solver": 1,
    "flashot.progress": 1,
    "flashot.schedules": 1,
    "flashot.acceleration": 1,
    "flashot.unbalanced": 1,
    "flashot.implicit": 1,
    "flashot.values": 1,
    "flashot.plan": 1,
    "flashot.warmstart": 1,
    "flashot.results": 1,
    "flashot.driver": 1,
    "flashot.matrix_measures": 1,  # a Measures built on a cost matrix or a cost function: the problem, not a front end
    "flashot.matrix_cost": 1,  # deprecated alias of flashot.matrix_measures
    # 2 strategies: ways of running the core loop (coarse-to-fine multiscale, sharded over ranks).
    "flashot.clusters": 2,
    "flashot.multiscale": 2,
    "flashot.distributed": 2,
    "flashot.ragged": 2,  # ragged batches: one block-diagonal problem on the concatenated clouds
    # 3 front ends: the user-facing APIs (GeomLoss" SamplesLoss, POT"s solve*/sinkhorn*, GW,
    # barycenters, kernel losses) and the package namespace that re-exports them.
    "flashot": 3,
    "flashot.samples_loss": 3,
    "flashot.loss_options": 3,
    "flashot.kernel_losses": 3,
    "flashot.pot_samples": 3,
    "flashot.pot_matrix": 3,
    "flashot.ot_samples": 3,  # deprecated aliases of flashot.pot_samples and flashot.pot_matrix
    "flashot.ot_matrix": 3,
    "flashot.dataset_distance": 3,
    "flashot.gromov": 3,
    "flashot.barycenter": 3,
    # 4 CLI: the command line, its file formats, demo data and the benchmark harness.
    "flashot.cli": 4,
    "flashot.demo_picture": 4,
    "flashot.io": 4,
    "flashot.data": 4,
    "flashot.bench": 4,
}

# Known violations still to fix: these sets only shrink (a stale entry fails the test).
KNOWN_UP: set[tuple[str, str]] = set()  # (module, imported module of a higher layer)
KNOWN_CYCLES: set[frozenset[str]] = set()  # the modules of one cycle
KNOWN_PRIVATE: set[tuple[str, str, str]] = set()  # (module, owner module or "<object>", private name)

# Private attributes of objects that are not flashot's: torch's tensor version counter.
EXTERNAL_PRIVATE = {"_version"}


def _modname(path: pathlib.Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {_modname(p): p for p in sorted(SRC.rglob("*.py"))}


def layer(mod: str) -> int:
    keys = [k for k in LAYERS if mod == k or mod.startswith(k + ".")]
    if not keys:
        raise KeyError(f"module {mod} has no layer: add it to LAYERS in tests/docs/test_layers.py")
    return LAYERS[max(keys, key=len)]


def _resolve(mod: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".") if MODULES[mod].name == "__init__.py" else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


class _Module:
    """One module's flashot imports (target, line), names bound to flashot modules, and private reads."""

    def __init__(self, mod: str):
        self.mod = mod
        self.tree = ast.parse(MODULES[mod].read_text(), filename=str(MODULES[mod]))
        self.imports: list[tuple[str, int]] = []
        self.aliases: dict[str, str] = {}  # local name -> flashot module
        self.names: dict[str, str] = {}  # local name -> the flashot module it was imported from (a class, ...)
        self.foreign: set[str] = set()  # local names bound to non-flashot imports
        self.private_imports: list[tuple[str, str, int]] = []
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                self._plain(node)
            elif isinstance(node, ast.ImportFrom):
                self._from(node)

    def _plain(self, node: ast.Import) -> None:
        for a in node.names:
            if a.name == "flashot" or a.name.startswith("flashot."):
                self.imports.append((a.name, node.lineno))
                self.aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else "flashot"
            else:
                self.foreign.add(a.asname or a.name.split(".")[0])

    def _from(self, node: ast.ImportFrom) -> None:
        src = _resolve(self.mod, node)
        if not (src == "flashot" or src.startswith("flashot.")):
            self.foreign.update(a.asname or a.name for a in node.names)
            return
        for a in node.names:
            sub = f"{src}.{a.name}"
            if sub in MODULES:
                self.imports.append((sub, node.lineno))
                self.aliases[a.asname or a.name] = sub
                continue
            self.imports.append((src, node.lineno))
            self.names[a.asname or a.name] = src
            if a.name.startswith("_") and not a.name.startswith("__") and src != self.mod:
                self.private_imports.append((src, a.name, node.lineno))

    def owned(self) -> set[str]:
        """Private names this module defines: top-level or class members, or attributes it assigns."""
        names = set()
        for node in ast.walk(self.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
                names.add(node.attr)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.keyword) and node.arg:
                names.add(node.arg)  # dataclass field set by keyword, e.g. OTResult(..., _numpy=...)
        return {n for n in names if n.startswith("_")}

    def _root(self, node: ast.expr) -> str | None:
        while isinstance(node, ast.Attribute):
            node = node.value
        return node.id if isinstance(node, ast.Name) else None

    def _module_of(self, node: ast.expr) -> str | None:
        """The flashot module an expression such as ``flashot.ops.dense`` names, if it names one."""
        chain = []
        while isinstance(node, ast.Attribute):
            chain.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name) or node.id not in self.aliases:
            return None
        mod = self.aliases[node.id]
        for part in reversed(chain):
            if f"{mod}.{part}" not in MODULES:
                return None
            mod = f"{mod}.{part}"
        return mod

    def private_reads(self) -> list[tuple[str, str, int]]:
        """``(owner, name, line)`` for each read of another module's private name."""
        out = [(src, name, line) for src, name, line in self.private_imports]
        owned = self.owned()
        for node in ast.walk(self.tree):
            if not isinstance(node, ast.Attribute) or not isinstance(node.ctx, ast.Load):
                continue
            name = node.attr
            if not name.startswith("_") or name.startswith("__"):
                continue
            target = self._module_of(node.value)
            if target is None and isinstance(node.value, ast.Name) and node.value.id in self.names:
                target = self.names[node.value.id]  # ``Cls._name`` on a class imported from another module
            if target is not None:
                if target != self.mod:
                    out.append((target, name, node.lineno))
                continue
            root = self._root(node.value)
            if root in ("self", "cls") and isinstance(node.value, ast.Name):
                continue
            if root in self.foreign or name in EXTERNAL_PRIVATE or name in owned:
                continue
            out.append(("<object>", name, node.lineno))
        return out


@pytest.fixture(scope="module")
def parsed() -> dict[str, _Module]:
    return {m: _Module(m) for m in MODULES}


def test_every_module_has_a_layer():
    for mod in MODULES:
        layer(mod)


def _up(parsed) -> set[tuple[str, str]]:
    return {(m, t) for m, info in parsed.items() for t, _ in info.imports if layer(t) > layer(m)}


def test_imports_point_down(parsed):
    bad = [
        f"{m}:{line} imports {t} (layer {layer(m)} -> {layer(t)})"
        for m, info in parsed.items()
        for t, line in info.imports
        if layer(t) > layer(m) and (m, t) not in KNOWN_UP
    ]
    assert not bad, "imports pointing up:\n" + "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _all_cycles(parsed) -> list[list[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for m, info in parsed.items():
        graph[m].update(t for t, _ in info.imports if t != m)
        for t in list(graph[m]):
            graph[t]
    return _cycles(graph)


def test_no_import_cycles(parsed):
    cycles = [c for c in _all_cycles(parsed) if frozenset(c) not in KNOWN_CYCLES]
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def _private(parsed) -> list[tuple[str, str, str, int]]:
    return [(m, owner, name, line) for m, info in parsed.items() for owner, name, line in info.private_reads()]


def test_no_private_reads(parsed):
    bad = [
        f"{m}:{line} reads {owner}.{name}"
        for m, owner, name, line in _private(parsed)
        if (m, owner, name) not in KNOWN_PRIVATE
    ]
    assert not bad, "private names read from another module:\n" + "\n".join(bad)


def test_known_violations_are_current(parsed):
    """The known-violation sets only shrink: an entry no longer needed must be removed."""
    stale = sorted(map(str, KNOWN_UP - _up(parsed)))
    stale += sorted(map(str, KNOWN_CYCLES - {frozenset(c) for c in _all_cycles(parsed)}))
    stale += sorted(map(str, KNOWN_PRIVATE - {(m, o, n) for m, o, n, _ in _private(parsed)}))
    assert not stale, f"stale known violations: {stale}"
