"""The engine contract (:mod:`flashot.ops.base`): declared capabilities, forwarding, foreign engines.

* every built-in engine declares exactly the optional steps it implements (a declared capability has its
  methods; a method of an undeclared one is not defined), and wrappers declare what they keep;
* the core calls a fused method only where the engine declares it, and does call it where it does;
* :class:`ForwardingEngine` forwards the primitives (``rows=`` too) and the declared capabilities;
* a user's engine that does not subclass :class:`Engine` works through ``register_engine`` and matches
  ``dense``;
* no ``getattr`` / ``hasattr`` probe of a capability's method names comes back in ``src/flashot``.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

import flashot
from flashot import ops
from flashot.ops import Capability, Engine, ForwardingEngine
from flashot.ops.base import ForeignEngine
from flashot.ops.bilinear import BilinearAdapter
from flashot.ops.block_pattern import BlockPattern
from flashot.ops.blocksparse import BlockSparseEngine
from flashot.ops.dense import DenseEngine
from flashot.ops.tiled import TiledEngine

F64 = torch.float64
CPU = torch.device("cpu")
SQ = flashot.get_cost("sqeuclidean")
C = Capability
SRC = Path(__file__).resolve().parents[2] / "src" / "flashot"


def _defines(cls: type, name: str) -> bool:
    """``cls`` has its own ``name`` (not :class:`Engine`'s default, which raises)."""
    for k in cls.__mro__:
        if k is Engine:
            return False
        if name in vars(k):
            return True
    return False


def _cpu_engine():
    eng = ops.get_engine("cpu", device=CPU, dtype=F64, cost=SQ)
    if eng.name != "cpu":
        pytest.skip("the cpu engine's kernels are not built here")
    return eng


def _engine_classes():
    out = {"dense": DenseEngine, "tiled": TiledEngine, "multiscale": BlockSparseEngine}
    from flashot.ops.cpu.engine import CpuEngine

    out["cpu"] = CpuEngine
    try:
        from flashot.ops.triton import TritonEngine
    except ImportError:
        pass
    else:
        out["triton"] = TritonEngine
    return out


EXPECTED = {
    "dense": set(),
    "tiled": set(),
    "cpu": {C.SOFTMIN_PAIR, C.SOFTMIN_ALT, C.SOFTMIN_SYM, C.EXPECT_REUSE},
    "triton": {C.SOFTMIN_PAIR},
    "multiscale": {
        C.SOFTMIN_PAIR,
        C.SOFTMIN_SYM,
        C.SOFTMIN_PAIR_BARY,
        C.SOFTMIN_SYM_BARY,
        C.FUSED_FINAL_STEP,
        C.ROW_RANGES,
    },
}


# -- declarations ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_builtin_engine_declares_exactly_what_it_implements(name):
    classes = _engine_classes()
    if name not in classes:
        pytest.skip(f"{name} engine unavailable here")
    cls = classes[name]
    assert issubclass(cls, Engine)
    assert set(cls.capabilities) == EXPECTED[name]
    for cap in Capability:
        for m in cap.methods:
            assert _defines(cls, m) == (cap in cls.capabilities), (name, cap, m)
    rows = C.ROW_RANGES in cls.capabilities  # rows=(lo, hi) in both primitives
    for prim in ("softmin", "plan_product"):
        assert ("rows" in inspect.signature(vars(cls)[prim]).parameters) == rows, (name, prim)


def test_undeclared_method_raises_and_names_the_capability():
    eng = TiledEngine()
    x = torch.randn(1, 4, 2, dtype=F64)
    h = torch.zeros(1, 4, dtype=F64)
    assert not any(eng.supports(c) for c in Capability)
    with pytest.raises(NotImplementedError, match="SOFTMIN_PAIR"):
        eng.softmin_pair(x, x, h, h, 0.5, SQ)
    with pytest.raises(NotImplementedError, match="ROW_RANGES"):
        eng.row_bounds(x, x, 2)


def test_declaring_without_the_method_is_refused():
    with pytest.raises(TypeError, match="SOFTMIN_SYM"):

        class Bad(TiledEngine):
            capabilities = frozenset({C.SOFTMIN_SYM})

    with pytest.raises(TypeError, match="frozenset of Capability"):

        class Bad2(TiledEngine):
            capabilities = {"softmin_pair"}


def test_wrapper_capabilities():
    tiled = TiledEngine()
    assert BilinearAdapter(tiled).capabilities == frozenset()
    cpu = _cpu_engine()
    assert BilinearAdapter(cpu).capabilities == {C.SOFTMIN_PAIR, C.SOFTMIN_ALT, C.EXPECT_REUSE}
    x, y, xs, ys, px, py, bs = _blocksparse()
    from flashot.multiscale import InputOrderEngine

    assert InputOrderEngine(bs, x, y, xs, ys, px, py).capabilities == frozenset()


def _dist_group():
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed unavailable")
    if dist.is_initialized():
        pytest.skip("a default process group is already initialised")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist


def test_distributed_wrappers_declare_what_they_keep():
    from flashot.distributed import RingEngine, ShardedEngine

    cpu = _cpu_engine()
    *_, bs = _blocksparse()
    dist = _dist_group()
    try:
        pg = dist.group.WORLD
        assert ShardedEngine(cpu, pg).capabilities == {C.SOFTMIN_PAIR, C.SOFTMIN_ALT, C.EXPECT_REUSE, C.SOFTMIN_SYM}
        assert ShardedEngine(TiledEngine(), pg).capabilities == {C.SOFTMIN_SYM}
        assert ShardedEngine(bs, pg).capabilities == {C.SOFTMIN_SYM}  # it picks the row slices: no fused forms
        assert RingEngine(cpu, pg).capabilities == {C.SOFTMIN_PAIR, C.RING_VISIT}
        assert RingEngine(TiledEngine(), pg).capabilities == {C.RING_VISIT}
        sh = ShardedEngine(cpu, pg)
        x, y = torch.randn(1, 20, 3, dtype=F64), torch.randn(1, 30, 3, dtype=F64)
        hx, hy = torch.randn(1, 20, dtype=F64), torch.randn(1, 30, dtype=F64)
        for a, b in zip(sh.softmin_pair(x, y, hx, hy, 0.5, SQ), cpu.softmin_pair(x, y, hx, hy, 0.5, SQ)):
            assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    finally:
        dist.destroy_process_group()


# -- forwarding ------------------------------------------------------------------------------------------
def _blocksparse():
    """A block-sparse engine on two clouds sorted into 3 and 2 clusters (one block dropped)."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(1, 30, 2, generator=g, dtype=F64), torch.randn(1, 20, 2, generator=g, dtype=F64)
    px, py = torch.randperm(30, generator=g), torch.randperm(20, generator=g)
    xs, ys = x[:, px].contiguous(), y[:, py].contiguous()
    keep = torch.tensor([[True, True], [True, False], [False, True]])
    pat = BlockPattern(torch.tensor([0, 10, 18, 30]), torch.tensor([0, 12, 20]), keep)
    return x[0], y[0], xs, ys, px, py, BlockSparseEngine([(xs, ys, pat), (ys, xs, pat.T)], native=False)


class _Plain(ForwardingEngine):
    """A wrapper that adds nothing."""


def test_forwarding_engine_forwards_primitives_and_capabilities():
    cpu = _cpu_engine()
    w = _Plain(cpu)
    assert w.name == "cpu" and w.inner is cpu and w.capabilities == cpu.capabilities
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(1, 40, 3, generator=g, dtype=F64), torch.randn(1, 50, 3, generator=g, dtype=F64)
    hx, hy = torch.randn(1, 40, generator=g, dtype=F64), torch.randn(1, 50, generator=g, dtype=F64)
    V = torch.randn(1, 50, 2, generator=g, dtype=F64)
    assert torch.equal(w.softmin(x, y, hy, 0.3, SQ), cpu.softmin(x, y, hy, 0.3, SQ))
    assert torch.equal(
        w.plan_product(x, y, hx, hy, 0.3, V, SQ, "cost"), cpu.plan_product(x, y, hx, hy, 0.3, V, SQ, "cost")
    )
    for a, b in zip(w.softmin_pair(x, y, hx, hy, 0.3, SQ), cpu.softmin_pair(x, y, hx, hy, 0.3, SQ)):
        assert torch.equal(a, b)
    for a, b in zip(w.softmin_alt(x, y, hx, hy, 0.3, SQ, 0.7), cpu.softmin_alt(x, y, hx, hy, 0.3, SQ, 0.7)):
        assert torch.equal(a, b)
    assert torch.equal(w.softmin_sym(x, hx, 0.3, SQ), cpu.softmin_sym(x, hx, 0.3, SQ))
    w.expect_reuse(x, y, SQ)
    assert w.unsupported(CPU, torch.float16, SQ) == cpu.unsupported(CPU, torch.float16, SQ) is not None


def test_forwarding_engine_subset_and_own_methods():
    cpu = _cpu_engine()
    sub = _Plain(cpu, {C.SOFTMIN_PAIR})
    assert sub.supports(C.SOFTMIN_PAIR) and not sub.supports(C.SOFTMIN_ALT)
    x = torch.randn(1, 5, 2, dtype=F64)
    h = torch.zeros(1, 5, dtype=F64)
    with pytest.raises(NotImplementedError, match="SOFTMIN_ALT"):
        sub.softmin_alt(x, x, h, h, 0.5, SQ)
    with pytest.raises(ValueError, match="ROW_RANGES"):  # forwarded, but the inner engine lacks it
        _Plain(cpu, {C.ROW_RANGES})

    class Sym(ForwardingEngine):  # implements softmin_sym itself: may declare it over any engine
        def softmin_sym(self, x, h, eps, cost):
            return self.softmin(x, x, h, eps, cost)

    s = Sym(TiledEngine(), {C.SOFTMIN_SYM})
    assert torch.equal(s.softmin_sym(x, h, 0.5, SQ), TiledEngine().softmin(x, x, h, 0.5, SQ))


def test_forwarding_engine_forwards_row_ranges():
    _, _, xs, ys, _, _, bs = _blocksparse()
    w = _Plain(bs)
    assert w.capabilities == bs.capabilities
    h = torch.randn(1, 20, dtype=F64)
    alpha, V = torch.randn(1, 30, dtype=F64), torch.randn(1, 20, 2, dtype=F64)
    spans = w.row_bounds(xs, ys, 2)
    assert spans == bs.row_bounds(xs, ys, 2) and torch.equal(w.digest(xs, ys), bs.digest(xs, ys))
    for lo, hi in spans:
        assert torch.equal(w.softmin(xs, ys, h, 0.4, SQ, rows=(lo, hi)), bs.softmin(xs, ys, h, 0.4, SQ, rows=(lo, hi)))
        assert torch.equal(
            w.plan_product(xs, ys, alpha, h, 0.4, V, SQ, rows=(lo, hi)),
            bs.plan_product(xs, ys, alpha, h, 0.4, V, SQ, rows=(lo, hi)),
        )


# -- the core asks supports() --------------------------------------------------------------------------
class _Trap(DenseEngine):
    """The dense engine with every optional method defined, none declared: none may be called."""

    def _boom(self, *a, **k):
        raise AssertionError("an undeclared fused method was called")

    softmin_pair = softmin_alt = softmin_sym = softmin_pair_bary = softmin_sym_bary = _boom
    expect_reuse = row_bounds = digest = ring_visit = _boom


class _Spy(TiledEngine):
    """The tiled engine declaring softmin_pair / softmin_sym / expect_reuse, implemented by plain softmins."""

    capabilities = frozenset({C.SOFTMIN_PAIR, C.SOFTMIN_SYM, C.EXPECT_REUSE})

    def __init__(self):
        super().__init__()
        self.calls = {"pair": 0, "sym": 0, "reuse": 0}

    def softmin_pair(self, x, y, hx, hy, eps, cost):
        self.calls["pair"] += 1
        return self.softmin(x, y, hy, eps, cost), self.softmin(y, x, hx, eps, cost)

    def softmin_sym(self, x, h, eps, cost):
        self.calls["sym"] += 1
        return self.softmin(x, x, h, eps, cost)

    def expect_reuse(self, x, y, cost):
        self.calls["reuse"] += 1


def _problems():
    g = torch.Generator().manual_seed(1)
    return torch.randn(40, 3, generator=g, dtype=F64), torch.randn(35, 3, generator=g, dtype=F64) + 0.5


@pytest.fixture
def registered():
    names = []

    def reg(name, loader):
        ops.register_engine(name, loader)
        names.append(name)

    yield reg
    for n in names:
        ops.unregister_engine(n)


def test_undeclared_fused_methods_are_not_used(registered):
    registered("trap", _Trap)
    assert ops.get_engine("trap", device=CPU, dtype=F64, cost=SQ).capabilities == frozenset()
    x, y = _problems()
    for method in ("sinkhorn_log", "alternating"):
        r = flashot.solve_sample(x, y, reg=0.3, backend="trap", method=method, max_iter=30, tol=None)
        ref = flashot.solve_sample(x, y, reg=0.3, backend="dense", method=method, max_iter=30, tol=None)
        assert torch.equal(r.value, ref.value)
    r = flashot.solve_sample(x, y, reg=0.3, backend="trap", unbalanced=1.0, max_iter=20, tol=None)
    assert torch.isfinite(r.value)
    xx = x.clone().requires_grad_(True)
    L = flashot.SamplesLoss("sinkhorn", p=2, blur=0.3, backend="trap")(xx, y)
    L.backward()
    assert torch.isfinite(xx.grad).all()


def test_declared_fused_methods_are_used(registered):
    spy = _Spy()
    registered("spy", lambda: spy)
    x, y = _problems()
    xx = x.clone().requires_grad_(True)
    L = flashot.SamplesLoss("sinkhorn", p=2, blur=0.3, backend="spy")(xx, y)
    (gx,) = torch.autograd.grad(L, xx)
    assert spy.calls["pair"] > 0 and spy.calls["sym"] > 0 and spy.calls["reuse"] > 0
    xr = x.clone().requires_grad_(True)
    ref = flashot.SamplesLoss("sinkhorn", p=2, blur=0.3, backend="tiled")(xr, y)
    (gr,) = torch.autograd.grad(ref, xr)
    assert torch.equal(L.detach(), ref.detach()) and torch.equal(gx, gr)  # same softmins, same order


# -- foreign engines -----------------------------------------------------------------------------------
class _UserEngine:
    """A user's engine written against the documented maths only: no base class, no ``unsupported``, and a
    ``softmin_pair`` that must never be called (it is not declared)."""

    name = "mine"

    def softmin(self, x, y, h, eps, cost):
        C = cost.matrix(x, y)
        return -eps * torch.logsumexp(h.unsqueeze(-2) - C / eps, -1)

    def plan_product(self, x, y, alpha, beta, eps, V, cost, weight="plan"):
        C = cost.matrix(x, y)
        K = torch.exp(alpha.unsqueeze(-1) + beta.unsqueeze(-2) - C / eps)
        if weight == "cost":
            K = K * C
        elif weight == "dcost":
            K = K * cost.dcost_weight(C)
        return K @ V

    def softmin_pair(self, *a, **k):
        raise AssertionError("a foreign engine's fused method was called")


def test_foreign_engine_is_wrapped_and_declares_nothing(registered):
    registered("mine", _UserEngine)
    eng = ops.get_engine("mine", device=CPU, dtype=F64, cost=SQ)
    assert isinstance(eng, ForeignEngine) and isinstance(eng.inner, _UserEngine)
    assert eng.name == "mine" and eng.capabilities == frozenset() and eng.unsupported(CPU, F64, SQ) is None
    assert ops.get_engine("mine", device=CPU, dtype=F64, cost=SQ) is eng  # loaded once


def test_foreign_engine_unsupported_is_respected(registered):
    class Picky(_UserEngine):
        def unsupported(self, device, dtype, cost):
            return "float64 only" if dtype != F64 else None

    registered("picky", Picky)
    assert isinstance(ops.get_engine("picky", device=CPU, dtype=F64, cost=SQ), ForeignEngine)
    with pytest.raises(ValueError, match="float64 only"):
        ops.get_engine("picky", device=CPU, dtype=torch.float32, cost=SQ)


def test_foreign_engine_solve_sample_matches_dense(registered):
    registered("mine", _UserEngine)
    x, y = _problems()
    for kw in ({"method": "sinkhorn_log"}, {"method": "alternating"}, {"unbalanced": 1.0}):
        r = flashot.solve_sample(x, y, reg=0.3, backend="mine", max_iter=40, **kw)
        ref = flashot.solve_sample(x, y, reg=0.3, backend="dense", max_iter=40, **kw)
        assert torch.allclose(r.value, ref.value, rtol=1e-12, atol=1e-12)
        for a, b in zip(r.potentials, ref.potentials):
            assert torch.allclose(a, b, rtol=1e-10, atol=1e-10)
        V = torch.randn(35, 2, dtype=F64)
        assert torch.allclose(r.plan @ V, ref.plan @ V, rtol=1e-10, atol=1e-12)


def test_foreign_engine_samples_loss_matches_dense(registered):
    registered("mine", _UserEngine)
    x, y = _problems()
    for debias in (True, False):
        out = []
        for backend in ("mine", "dense"):
            xx = x.clone().requires_grad_(True)
            L = flashot.SamplesLoss("sinkhorn", p=2, blur=0.3, debias=debias, backend=backend)(xx, y)
            (gx,) = torch.autograd.grad(L, xx)
            out.append((L.detach(), gx))
        assert torch.allclose(out[0][0], out[1][0], rtol=1e-12, atol=1e-12)
        assert torch.allclose(out[0][1], out[1][1], rtol=1e-9, atol=1e-12)


# -- no probe by method name comes back ----------------------------------------------------------------
_NAMES = sorted({m for c in Capability for m in c.methods} | {c.value for c in Capability})
_PROBE = re.compile(r"\b(?:getattr|hasattr)\(\s*[^,()]+(?:\([^()]*\))?\s*,\s*[\"'](" + "|".join(_NAMES) + r")[\"']")


def test_probe_pattern_catches_the_old_forms():
    for old in (
        'getattr(eng, "softmin_pair", None)',
        "hasattr(inner, 'row_bounds')",
        'getattr(engine, "fused_final_step", False)',
        'getattr(self.inner, "expect_reuse", None)',
        'getattr(m.engine, "softmin_sym_bary", None)',
    ):
        assert _PROBE.search(old), old


def test_no_getattr_probe_of_capability_methods_in_src():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        for m in _PROBE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            found.append(f"{path.relative_to(SRC)}:{line}: {m.group(0)}")
    assert not found, "probe engines with engine.supports(Capability.X), not getattr/hasattr:\n" + "\n".join(found)


def test_exports():
    for name in ("Capability", "Engine", "ForwardingEngine"):
        assert name in ops.__all__ and getattr(ops, name) is getattr(flashot.ops.base, name)
