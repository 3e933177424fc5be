"""Building and loading the ``cpu`` engine's library: instruction-set override, no OpenMP needed,
the private cache (planted libraries refused), concurrent and interrupted builds, and a build
environment that cannot change what is compiled.

Each build runs in a fresh subprocess (the library is loaded once per process); results are
checked against the dense engine (the float32 kernels against float64 dense, 1e-4).  One test compiles
afresh (the compile itself under test: killed, concurrent, no OpenMP, planted headers); the others use the test
run's shared cache (``shared_build_cache`` in conftest.py: one compile per instruction set per
machine, shared with tests/cli/test_cli.py, test_native_driver.py and test_isa_matrix.py)."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest

from flashot.ops.cpu import build

pytestmark = pytest.mark.skipif(build._find_compiler() is None, reason="no C++ compiler on PATH")

# Runs in the child: load the float32 library (the only one it compiles), check one softmin against dense
# float64 (the float32 kernels' error is ~1e-6 here), print what was built.
CHILD = textwrap.dedent("""
    import json, torch, warnings
    from flashot.ops.cpu import build
    from flashot.ops.cpu.engine import CpuEngine
    from flashot.ops.dense import DenseEngine
    from flashot.costs import get_cost
    lib = build.load()
    c = get_cost("sqeuclidean")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 57, 5, generator=g)
    y = torch.randn(2, 43, 5, generator=g)
    h = torch.randn(2, 43, generator=g)
    ref = DenseEngine().softmin(x.double(), y.double(), h.double(), 0.3, c)
    err = (CpuEngine(lib, threads=2).softmin(x, y, h, 0.3, c).double() - ref).abs().max()
    import ctypes
    lib.flashot_fp_probe(1)
    CpuEngine(lib, threads=2, mode="stream").softmin(x, y, h, 0.3, c)
    lib.flashot_fp_probe(0)
    threads = lib.flashot_fp_probe_read((ctypes.c_int * 256)(), 256)
    print("RESULT", json.dumps({"isa": build.BUILD_INFO["isa"], "threads": threads,
                                "cached": build.BUILD_INFO["cached"], "path": build.BUILD_INFO["path"],
                                "err": float(err), "vbytes": lib.flashot_vector_bytes()}))
""")


def _run(cache, timeout=600, **env):
    e = {k: v for k, v in os.environ.items() if not k.startswith("FLASHOT_")}
    e.update(FLASHOT_CACHE_DIR=str(cache), **env)
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=timeout, env=e)
    return r


def _result(r):
    import json

    assert r.returncode == 0, r.stderr[-3000:]
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[7:])


def _cpu_has(*flags):
    have = build._cpu_flags()
    return all(f in have for f in flags)


@pytest.mark.slow  # compiles the x86-64-v2 and -v3 libraries (shared with tests/ops/test_isa_matrix.py)
@pytest.mark.parametrize(
    "march,has,lacks,vbytes",
    [
        ("x86-64-v2", ["sse4.2"], ["avx", "avx2", "avx512f"], 16),
        ("x86-64-v3", ["avx2", "fma"], ["avx512f"], 32),
    ],
)
def test_march_override_selects_the_isa(shared_build_cache, march, has, lacks, vbytes):
    if not _cpu_has(*build._X86_LEVELS[march]):
        pytest.skip(f"this CPU cannot run {march}")
    res = _result(_run(shared_build_cache, FLASHOT_CPU_MARCH=march))
    assert all(f in res["isa"] for f in has) and not any(f in res["isa"] for f in lacks), res
    assert res["vbytes"] == vbytes and res["err"] < 1e-4


@pytest.mark.slow  # needs two targets' libraries
def test_march_is_part_of_the_cache_key(shared_build_cache):
    if not _cpu_has(*build._X86_LEVELS["x86-64-v2"]):
        pytest.skip("this CPU cannot run x86-64-v2")
    a = _result(_run(shared_build_cache, FLASHOT_CPU_MARCH="x86-64-v2"))
    # the other target: x86-64-v3 where the CPU runs it (built by the test above, so no second
    # ~35 s compile), otherwise native
    other = {"FLASHOT_CPU_MARCH": "x86-64-v3"} if _cpu_has(*build._X86_LEVELS["x86-64-v3"]) else {}
    b = _result(_run(shared_build_cache, **other))
    assert a["path"] != b["path"] and b["cached"] in (True, False)
    again = _result(_run(shared_build_cache, FLASHOT_CPU_MARCH="x86-64-v2"))
    assert again["cached"] and again["path"] == a["path"]


# Runs in the child: one solve of each kind asked for, then the libraries this process loaded.
FIRST_USE = textwrap.dedent("""
    import sys, torch, flashot
    from flashot.ops.cpu import build
    g = torch.Generator().manual_seed(0)
    for what in sys.argv[1:]:
        kind, dtype = what.split(":")
        x = torch.randn(400, 3, generator=g, dtype=getattr(torch, dtype))
        y = torch.randn(300, 3, generator=g, dtype=getattr(torch, dtype))
        flashot.SamplesLoss(blur=0.1, backend=kind, scaling=0.5)(x, y)
    print("LOADED", " ".join(sorted(build.BUILD_INFO["libraries"])))
""")


@pytest.mark.parametrize(
    "calls,loaded",
    [
        (["cpu:float64"], "core_f64"),
        (["multiscale:float32"], "blocksparse_f32 core_f32"),
    ],
)
def test_first_use_loads_the_kernels_of_its_dtype_only(shared_build_cache, calls, loaded):
    """A first solve compiles (here: loads from the run's cache) only the libraries of its dtype and family:
    build.Kernels loads each at its first use."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("FLASHOT_")}
    e.update(FLASHOT_CACHE_DIR=str(shared_build_cache))
    r = subprocess.run([sys.executable, "-c", FIRST_USE, *calls], capture_output=True, text=True, timeout=300, env=e)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [ln for ln in r.stdout.splitlines() if ln.startswith("LOADED")] == [f"LOADED {loaded}"]


def test_bad_march_values_are_refused(monkeypatch):
    for bad in ("native -fplugin=/tmp/x.so", "-O0", "a;b", ""):
        monkeypatch.setenv("FLASHOT_CPU_MARCH", bad)
        if bad == "":
            assert build.march() == "native"
            continue
        with pytest.raises(build.BuildError, match="FLASHOT_CPU_MARCH"):
            build.march()


def test_a_level_the_cpu_lacks_is_refused_before_compiling(monkeypatch):
    monkeypatch.setattr(build, "_cpu_flags", lambda: {"sse4_1", "sse4_2", "ssse3", "popcnt", "cx16", "lahf_lm"})
    monkeypatch.setattr(build.platform, "machine", lambda: "x86_64")
    with pytest.raises(build.BuildError, match="lacks avx, avx2"):
        build._check_cpu_runs("x86-64-v3")
    build._check_cpu_runs("x86-64-v2")  # fine


def _fake_compiler(tmp_path, body):
    """A compiler wrapper script around the real one."""
    real = build._find_compiler()
    p = tmp_path / "fakecxx"
    p.write_text(f"#!/bin/sh\n{body}\nexec {real} \"$@\"\n")
    p.chmod(0o755)
    return str(p)


# ---- the private cache -------------------------------------------------------------------


def _plant(d):
    """A library with our exact name in d, whose constructor would leave a mark."""
    src = d / "evil.c"
    mark = d / "PWNED"
    src.write_text(
        f'#include <stdio.h>\n__attribute__((constructor)) static void f(void) {{ '
        f'FILE* o = fopen("{mark}", "w"); if (o) fclose(o); }}\n'
    )
    return src, mark


def test_world_writable_cache_dir_is_refused_and_engine_falls_back(tmp_path, monkeypatch):
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o777)  # a directory any local user could have prepared
    monkeypatch.setenv("FLASHOT_CACHE_DIR", str(d))
    monkeypatch.setattr(build, "_LIBS", {})
    # plant a library under the exact name the build would use
    sources = build._read_sources()
    key = f"{build._base_key(sources, build.march())}_{build._compiler_key(build._find_compiler())}"
    name = f"{build._FILE_PREFIX['core_f32']}{key}.so"
    src, mark = _plant(d)
    subprocess.run([build._find_compiler(), "-x", "c", "-shared", "-fPIC", "-o", str(d / name), str(src)], check=True)
    with pytest.raises(build.BuildError, match="writable by group or others"):
        build.load()
    assert not mark.exists()
    from flashot.ops import cpu as cpu_pkg

    with pytest.warns(RuntimeWarning, match="tiled"):
        eng = cpu_pkg.load_engine()
    assert eng.name == "tiled" and not mark.exists()


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="chown to another user needs root")
def test_cache_dir_owned_by_another_user_is_refused(tmp_path, monkeypatch):
    d = tmp_path / "theirs"
    d.mkdir(mode=0o755)
    os.chown(d, 65534, 65534)
    monkeypatch.setenv("FLASHOT_CACHE_DIR", str(d))
    monkeypatch.setattr(build, "_LIBS", {})
    with pytest.raises(build.BuildError, match="owned by uid 65534"):
        build.load()


def test_tmp_fallback_dir_prepared_by_someone_else_is_refused(tmp_path, monkeypatch):
    """The per-user temp fallback is used only when it passes the same checks."""
    from flashot.ops.cpu import cachedir

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("FLASHOT_CACHE_DIR", str(blocker / "sub"))  # cannot be created, even by root
    monkeypatch.setattr(cachedir.tempfile, "gettempdir", lambda: str(tmp_path))
    fb = tmp_path / f"flashot-{os.getuid()}"
    fb.mkdir()
    os.chmod(fb, 0o777)
    with pytest.raises(cachedir.CacheDirError, match="writable by group or others"):
        cachedir.private_cache_dir()
    os.chmod(fb, 0o700)
    assert cachedir.private_cache_dir() == str(fb)  # a private one is used


def test_library_file_checks(tmp_path):
    from flashot.ops.cpu.cachedir import CacheDirError, check_private_file

    f = tmp_path / "lib.so"
    f.write_bytes(b"\0")
    os.chmod(f, 0o700)
    check_private_file(str(f))
    os.chmod(f, 0o720)
    with pytest.raises(CacheDirError, match="writable by group"):
        check_private_file(str(f))
    os.chmod(f, 0o700)
    link = tmp_path / "link.so"
    link.symlink_to(f)
    with pytest.raises(CacheDirError, match="not a regular file"):
        check_private_file(str(link))


def test_new_cache_dir_is_private(tmp_path, monkeypatch):
    from flashot.ops.cpu import cachedir

    monkeypatch.setenv("FLASHOT_CACHE_DIR", str(tmp_path / "new" / "flashot"))
    d = cachedir.private_cache_dir()
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700


# ---- concurrency, interruption, no compiler -------------------------------------------------


@pytest.mark.slow  # a full compile (the compile itself is under test)
def test_fresh_build_killed_then_concurrent_without_openmp_compiles_once(tmp_path):
    """The one test that compiles the kernels afresh (the other build tests share the run's
    cache): every check of a first-use build rides on this single compile.
    - a build killed halfway leaves only its temporary directory (no library);
    - three processes then starting at once in the same cache compile once, all load the same
      library, compute the right answer on 2 threads, and the temporary directories are gone;
    - the compiler has no OpenMP (like Apple clang): the kernels need none (their own thread team);
    - CPLUS_INCLUDE_PATH / CPATH pointing at crafted headers are ignored by the build;
    - the first use says it is compiling, and where, without a warning; a later use (the compiler
      is part of the cache key) loads the cached library."""
    cxx = _fake_compiler(
        tmp_path,
        'for a in "$@"; do [ "$a" = "-fopenmp" ] && { echo "unsupported option \'-fopenmp\'" >&2; exit 1; }; done',
    )
    evil = tmp_path / "evil"
    evil.mkdir()
    for name in ("vector", "cmath", "algorithm", "omp.h"):
        (evil / name).write_text('#error "planted header was used"\n')
    cache = tmp_path / "c"
    march = "x86-64-v2" if _cpu_has("sse4_2") else "native"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHOT_")}
    env.update(
        FLASHOT_CACHE_DIR=str(cache), FLASHOT_CPU_MARCH=march, CXX=cxx, CPLUS_INCLUDE_PATH=str(evil), CPATH=str(evil)
    )
    p = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True
    )
    t0 = time.time()
    while not list(cache.glob(".tmp-build-*")) and time.time() - t0 < 60:
        time.sleep(0.05)
    assert list(cache.glob(".tmp-build-*")), "the build never started"
    os.killpg(p.pid, signal.SIGKILL)  # the interpreter and its compilers, halfway
    p.wait()
    assert list(cache.glob(".tmp-build-*")) and not list(cache.glob("*.so"))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=900) for p in procs]
    results = [_result(subprocess.CompletedProcess([], p.returncode, o, e)) for p, (o, e) in zip(procs, outs)]
    assert len({r["path"] for r in results}) == 1
    assert all(r["err"] < 1e-4 and r["threads"] == 2 for r in results), results
    announced = [e for _, e in outs if "compiling the CPU kernels once for this machine" in e]
    assert len(announced) == 1 and str(cache) in announced[0], [e[-500:] for _, e in outs]
    assert not any("warn" in e.lower() for _, e in outs)
    assert not list(cache.glob(".tmp-build-*"))
    r2 = _run(cache, CXX=cxx, FLASHOT_CPU_MARCH=march)  # no planted headers: the same key, the same library
    assert _result(r2)["cached"] and _result(r2)["path"] == results[0]["path"] and "compiling" not in r2.stderr


def test_cached_library_is_used_without_a_compiler(shared_build_cache, tmp_path):
    """Native: the run's library (compiled at session start, tests/conftest.py)."""
    first = _result(_run(shared_build_cache))
    res = _result(_run(shared_build_cache, PATH="/nonexistent", CXX=""))
    assert res["cached"] and res["path"] == first["path"]
    r = _run(tmp_path / "empty", PATH="/nonexistent", CXX="")
    assert r.returncode != 0 and "no C++ compiler" in r.stderr


def test_units_compile_largest_first_one_per_core(tmp_path, monkeypatch):
    """compile_parts runs the units in the order given, at most one per core at once (a unit waits for a
    free core), and returns the error output of each unit that failed."""
    log = tmp_path / "log"
    cxx = tmp_path / "fake-cxx"
    cxx.write_text(
        textwrap.dedent(f"""\
            #!/bin/sh
            for a in "$@"; do case "$a" in *.cpp) u="$a";; esac; done
            echo "start $u" >> {log}
            case "$u" in big.cpp) sleep 1.2;; *) sleep 0.3;; esac
            echo "end $u" >> {log}
            [ "$u" = "bad.cpp" ] && {{ echo "bad.cpp:1: error: ‘no’" >&2; exit 1; }}
            exit 0
            """),
        encoding="utf-8",
    )
    cxx.chmod(0o755)
    from flashot.ops.cpu import compile_units

    monkeypatch.setattr(compile_units, "cores", lambda: 2)
    errs, cpu = compile_units.compile_parts(
        str(cxx), [], str(tmp_path), ("big.cpp", "mid.cpp", "bad.cpp", "small.cpp"), {}
    )
    assert errs == ["bad.cpp:1: error: ‘no’"]  # GCC's UTF-8 quotes, whatever the locale
    assert sorted(cpu) == ["bad.cpp", "big.cpp", "mid.cpp", "small.cpp"] and all(t >= 0 for t in cpu.values())
    events = log.read_text().split("\n")[:-1]
    starts = [e.split()[1] for e in events if e.startswith("start")]
    assert set(starts[:2]) == {"big.cpp", "mid.cpp"} and starts[2:] == ["bad.cpp", "small.cpp"]  # the first two race
    live = peak = 0
    for e in events:
        live += 1 if e.startswith("start") else -1
        peak = max(peak, live)
    # big (1.2 s) keeps its core; mid's core then takes bad, then small
    assert peak == 2 and events.index("end mid.cpp") < events.index("start bad.cpp") < events.index("end bad.cpp")
    assert events.index("end bad.cpp") < events.index("start small.cpp") < events.index("end big.cpp")


def test_libraries_compiled_together_share_their_dtype_free_units():
    """build_many_in_cache's order: the libraries' largest units first, each unit once."""
    from flashot.ops.cpu.compile_units import units_of

    units = units_of([build.LIBRARIES[lib] for lib in build.LIBRARIES])
    assert sorted(units) == sorted(build.UNITS)
    assert units[:4] == ("core_lse_f32.cpp", "core_lse_f64.cpp", "bs_pair_f32.cpp", "bs_pair_f64.cpp")
