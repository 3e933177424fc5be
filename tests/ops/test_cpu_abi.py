"""The kernels' C ABI (``abi.h``) and its ctypes side (``flashot.ops.cpu.abi``): the layout check at load, the
derived ABI version and cache key, typed entry points, and the engines end to end through the structs."""

from __future__ import annotations

import ctypes
import math

import pytest
import torch

from flashot.costs import get_cost
from flashot.ops.cpu import abi, build

pytestmark = pytest.mark.skipif(build._find_compiler() is None, reason="no C++ compiler on PATH")


@pytest.fixture(scope="module")
def bs_lib():
    try:
        return build.load_blocksparse(quiet=True)
    except build.BuildError as e:  # pragma: no cover - no toolchain
        pytest.skip(f"no compiled block-sparse kernels: {str(e)[:200]}")


def _swapped(cls: type[ctypes.Structure]) -> type[ctypes.Structure]:
    """``cls`` with its last two fields in the other order (a stale mirror, or a library built from another
    abi.h)."""
    fields = list(cls._fields_)
    fields[-2], fields[-1] = fields[-1], fields[-2]
    return type(cls.__name__, (ctypes.Structure,), {"_fields_": fields})


def test_libraries_report_the_layout_and_version_of_this_abi_h(lib, bs_lib):
    for library in build.LIBRARIES:  # both families, both dtypes
        handle = build.load_library(library, quiet=True)
        abi.check_layout(handle, library)
        abi.check_version(handle, library)
    assert build.ABI_VERSION == abi.abi_version() == lib.flashot_abi_version() == bs_lib.flashot_bs_abi_version()
    names = [part.split()[0] for part in abi.layout_text().split(";")]
    assert names == list(abi.STRUCTS)  # one mirror per struct of abi.h's layout table, in its order


@pytest.mark.parametrize("name", ["flashot_plan_args", "flashot_stream", "flashot_prune_args"])
def test_layout_check_catches_a_mismatched_mirror(lib, bs_lib, monkeypatch, name):
    monkeypatch.setitem(abi.STRUCTS, name, _swapped(abi.STRUCTS[name]))
    for library, handle in (("core_f32", lib.part("f32")), ("blocksparse_f64", bs_lib.part("f64"))):
        with pytest.raises(abi.AbiError, match=rf"{name}.*rebuild it"):
            abi.check_layout(handle, library, "the.so")


def test_layout_mismatch_at_load_is_a_build_error_telling_to_rebuild(monkeypatch):
    """What a user sees: loading a library whose structs differ from the mirrors raises BuildError."""
    monkeypatch.setitem(abi.STRUCTS, "flashot_lse_args", _swapped(abi.LseArgs))
    with pytest.raises(build.BuildError, match="flashot_lse_args.*rebuild it"):
        build._open("core_f64", quiet=True)


def test_version_mismatch_at_load_is_a_build_error(monkeypatch):
    monkeypatch.setattr(abi, "abi_version", lambda text=None: 12345)
    with pytest.raises(build.BuildError, match="ABI version .* 12345.*rebuild"):
        build._open("blocksparse_f32", quiet=True)


def test_abi_version_and_cache_key_follow_abi_h():
    """The version is a hash of abi.h (never bumped by hand): any edit changes it, and the cache key, which
    hashes every source, changes with any source."""
    sources = build._read_sources()
    text = sources["abi.h"].encode()
    assert abi.abi_version(text) == build.ABI_VERSION
    edited = text.replace(b"int32_t wk;", b"int32_t wk; ")
    assert edited != text and abi.abi_version(edited) != abi.abi_version(text)
    assert 0 < abi.abi_version(edited) < 2**31
    assert f"-DFLASHOT_ABI_VERSION={build.ABI_VERSION}" in build.cxxflags("x86-64")
    key = build._base_key(sources, "native")
    for name in ("abi.h", "panel.h", "core_lse_f32.cpp", "bs_pair_f64.cpp"):
        assert build._base_key({**sources, name: sources[name] + "\n"}, "native") != key, name
    for library, units in build.LIBRARIES.items():  # a library's units: its family's, its dtype's or no dtype's
        assert len(units) == len(set(units)) and set(units) <= set(build.SOURCES), library
        fam, dt = build.family(library), library[-3:]
        assert all(u.startswith("core_" if fam == "core" else "bs_") for u in units), library
        assert all(dt in u or not any(t in u for t in build.DTYPES) for u in units), library
    kernel_units = [u for us in build.LIBRARIES.values() for u in us if any(t in u for t in build.DTYPES)]
    assert len(kernel_units) == len(set(kernel_units))  # each kernel unit in one library only


def test_entry_points_take_their_struct_only(lib):
    x = torch.zeros(1, 1, 1)
    with pytest.raises(ctypes.ArgumentError):  # a struct of another entry point
        lib.flashot_softmin_f32(ctypes.byref(abi.PlanArgs()))
    with pytest.raises(ctypes.ArgumentError):  # positional arguments (the ABI before structs)
        lib.flashot_softmin_f32(x.data_ptr(), x.data_ptr())


def test_kernels_refuse_bad_arguments_through_the_struct(lib):
    B, N, M, D = 1, 5, 64, 3
    x, yT = torch.randn(B, N, D), torch.randn(B, D, M)
    yy, hs, out = (yT * yT).sum(1), torch.zeros(B, M), torch.empty(B, N)
    s = abi.Stream(x.data_ptr(), yT.data_ptr(), yy.data_ptr(), hs.data_ptr(), N, M, 1 << 19, 1.0, 0.0, B, D, 7, 0, 1)
    assert abi.call(lib.flashot_softmin_f32, abi.LseArgs(s, out.data_ptr(), 1.0)) == -2  # unknown kind
    s.kind, s.cfg = 0, 5
    assert abi.call(lib.flashot_softmin_f32, abi.LseArgs(s, out.data_ptr(), 1.0)) == -1  # unknown cfg
    s.cfg = 0
    assert abi.call(lib.flashot_softmin_f32, abi.LseArgs(s, out.data_ptr(), 1.0)) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mode", ["stream", "cache"])
def test_engine_end_to_end(dtype, mode):
    """Every call of the cpu engine through the structs, against dense PyTorch."""
    from flashot.ops.cpu.engine import CpuEngine

    g = torch.Generator().manual_seed(0)
    B, N, M, D, eps = 2, 70, 90, 24, 0.3
    x, y = torch.randn(B, N, D, generator=g, dtype=dtype), torch.randn(B, M, D, generator=g, dtype=dtype)
    hx, hy = torch.randn(B, N, generator=g, dtype=dtype), torch.randn(B, M, generator=g, dtype=dtype)
    V = torch.randn(B, M, 6, generator=g, dtype=dtype)
    tol = dict(rtol=2e-4, atol=2e-4) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)
    eng = CpuEngine(mode=mode)
    for cost in (get_cost("sqeuclidean"), get_cost("euclidean")):
        C = cost.matrix(x, y)
        ref_f = -eps * torch.logsumexp(hy[:, None] - C / eps, -1)
        ref_g = -eps * torch.logsumexp(hx[:, :, None] - C / eps, 1)
        for _ in range(2):  # auto / cache modes build the matrix on a call, the later ones read it
            torch.testing.assert_close(eng.softmin(x, y, hy, eps, cost), ref_f, **tol)
            torch.testing.assert_close(eng.softmin(y, x, hx, eps, cost), ref_g, **tol)
        fx, fy = eng.softmin_pair(x, y, hx, hy, eps, cost)
        torch.testing.assert_close(fx, ref_f, **tol)
        torch.testing.assert_close(fy, ref_g, **tol)
        fa, fb = eng.softmin_alt(x, y, hx, hy, eps, cost, 1.0)
        torch.testing.assert_close(fa, ref_f, **tol)
        torch.testing.assert_close(fb, -eps * torch.logsumexp((hx + ref_f / eps)[:, :, None] - C / eps, 1), **tol)
        P = torch.exp(hx[:, :, None] + hy[:, None] - C / eps)
        for K in (2, 6):
            torch.testing.assert_close(eng.plan_product(x, y, hx, hy, eps, V[..., :K], cost), P @ V[..., :K], **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_blocksparse_kernels_end_to_end(bs_lib, dtype):
    """The block-sparse entry points (softmin, pair step, plan product) through the structs, on a pattern that
    keeps every block: the dense results."""
    from flashot.clusters import cluster
    from flashot.ops import blocksparse_cpu as BS
    from flashot.ops.block_pattern import BlockPattern

    g = torch.Generator().manual_seed(1)
    x, y = torch.rand(120, 3, generator=g, dtype=torch.float64), torch.rand(90, 3, generator=g, dtype=torch.float64)
    cx, cy = cluster(x, torch.ones(120, dtype=torch.float64), 0.3), cluster(y, torch.ones(90, dtype=torch.float64), 0.3)
    pat = BlockPattern(cx.offsets, cy.offsets, torch.ones(cx.n_clusters, cy.n_clusters, dtype=torch.bool))
    xs, ys = x[cx.perm][None].to(dtype), y[cy.perm][None].to(dtype)
    hx, hy = torch.full((1, 120), -math.log(120), dtype=dtype), torch.full((1, 90), -math.log(90), dtype=dtype)
    cost, eps = get_cost("sqeuclidean"), 0.1
    C = cost.matrix(xs, ys)[0]
    tol = dict(rtol=2e-4, atol=2e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        BS.softmin_cpu(bs_lib, pat, xs, ys, hy, eps, cost)[0], -eps * torch.logsumexp(hy[0][None] - C / eps, -1), **tol
    )
    rows, cols, rb, _ = BS.pair_cpu(bs_lib, pat, xs, ys, hx, hy, eps, cost, sym=False, bary=1)
    E = torch.exp(hx[0][:, None] + hy[0][None] - C / eps)
    torch.testing.assert_close(rows, E.sum(1), **tol)
    torch.testing.assert_close(cols, E.sum(0), **tol)
    torch.testing.assert_close(rb, E @ ys[0], **tol)
    V = torch.randn(1, 90, 3, generator=g, dtype=torch.float64).to(dtype)
    torch.testing.assert_close(BS.plan_cpu(bs_lib, pat, xs, ys, hx, hy, eps, V, cost, "plan")[0], E @ V[0], **tol)
