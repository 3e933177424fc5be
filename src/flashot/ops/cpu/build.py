"""Compile the fused CPU kernels once per machine and load them with ctypes.

The kernels are plain C++ with a C ABI (the ``*.h`` and ``*.cpp`` files beside this module, shipped as
package data; no torch headers), so ``g++`` builds them without ninja or a torch extension toolchain.
Headers by job (``vecmath.h`` vector maths, ``panel.h`` the streaming panels, ``colsum.h`` ordered column
sums, ``dense.h`` / ``cached.h`` / ``blocksparse.h`` the kernels, ``abi.h`` the C ABI: one argument struct
per entry point, mirrored by :mod:`.abi`); translation units by job and dtype instantiate them.  They make
four libraries, each built when it is first needed (:data:`LIBRARIES`): two families, ``core`` (the dense and
streamed kernels of the ``cpu`` engine, ``core_*.cpp``) and ``blocksparse`` (multiscale's, ``bs_*.cpp``),
each in a float32 and a float64 library.  Why split: a first solve waits for the kernels it runs, not for the
block-sparse ones or the other dtype's (each family is about half float32, half float64).  :class:`Kernels`
reads a family like one ctypes library and loads each dtype's library at its first use.  A library's units
are compiled in parallel, then linked; they are balanced by compile time, so two cores finish together.

Instruction set: ``-march=native`` unless ``FLASHOT_CPU_MARCH`` names another target
(``x86-64-v2`` (SSE4.2), ``x86-64-v3`` (AVX2 + FMA), ``x86-64-v4`` (AVX-512), ``armv8-a``,
or any value your compiler accepts for ``-march``); the x86-64 levels are checked against
the CPU before compiling, so a library the CPU cannot run is never built.

Prebuilt: a wheel built by ``setup.py`` ships the libraries for each x86-64 level (or AArch64);
when ``FLASHOT_CPU_MARCH`` is unset, :func:`load` takes the best one the CPU runs from the
installed package (:mod:`.prebuilt`) and compiles nothing; ``native`` always compiles.

Threads: the kernels bring their own thread team (``parallel.h``: C++11 threads, dynamic
tasks, passive waiting), so no OpenMP is needed: the same multi-threaded library builds with
g++, clang++ and Apple clang.

Cache (see :mod:`.cachedir`): a private directory; the library's name is a hash of the
sources, flags, target, the host CPU's feature flags and the compiler's
identity.  The compiler runs with an environment stripped of the variables that would
change its output (``CPATH``, ``CPLUS_INCLUDE_PATH``, ``LIBRARY_PATH``, ...).  Concurrent
first builds wait on a lock and then reuse the library; each build writes into a private
temporary directory and renames the result into place, and leftovers of a build that was
killed are removed by the next one.  Without a compiler on PATH a library cached for the
same sources, flags and CPU is still used.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from importlib import resources

from . import abi, prebuilt
from .cachedir import CacheDirError, cache_dir, check_private_file, private_cache_dir
from .compile_units import compile_parts, cores, object_name, units_of

__all__ = [
    "BuildError",
    "build",
    "build_all",
    "load",
    "load_blocksparse",
    "load_library",
    "Kernels",
    "kernels",
    "family",
    "dtype_suffix",
    "FAMILIES",
    "DTYPES",
    "UNITS",
    "BUILD_INFO",
    "cxxflags",
    "march",
    "SOURCES",
    "ISA_BITS",
    "LIBRARIES",
    "UNIT_FLAGS",
    "cache_dir",
    "build_in_cache",
    "build_many_in_cache",
    "cpu_flags",
    "find_compiler",
    "prebuilt_status",
    "read_sources",
    "source_key",
]

# The libraries and their translation units, linked in this order: per family (core, blocksparse) one library
# per dtype, each listed largest unit first.  A library's units are compiled largest first, one per core
# (compile_units.compile_parts), so the wall time is about max(total compiler CPU / cores, largest unit): the
# kernel units (by job) keep the largest near half the total, and splitting them further would only add the
# ~1 s of header parsing that every unit pays (and changes GCC's inlining and register allocation:
# BENCHMARKS.md).  The dtype-free units (the ABI facts, the exp2 helpers, the block pruning) are small and
# linked into both dtypes' libraries; compiled together (build_many_in_cache), the libraries share them.
LIBRARIES = {
    "core_f32": ("core_lse_f32.cpp", "core_pairplan_f32.cpp", "core_vexp.cpp", "core_abi.cpp"),
    "core_f64": ("core_lse_f64.cpp", "core_pairplan_f64.cpp", "core_vexp.cpp", "core_abi.cpp"),
    "blocksparse_f32": ("bs_pair_f32.cpp", "bs_lseplan_f32.cpp", "bs_prune.cpp", "bs_abi.cpp"),
    "blocksparse_f64": ("bs_pair_f64.cpp", "bs_lseplan_f64.cpp", "bs_prune.cpp", "bs_abi.cpp"),
}
FAMILIES = ("core", "blocksparse")
DTYPES = ("f32", "f64")
# Flags added after cxxflags() for some units (a later -O wins).  The *_abi.cpp units hold no kernel (the
# ABI's version and layout text, the build's facts, the floating-point probes; the exp2 helpers and the
# block pruning have units of their own): -O1 about halves their compile time, most of it the layout
# text's string code.  They come last in LIBRARIES, so last on the link line: of the inline helpers that
# several units emit (the thread team's, ...), the linker keeps the first copy, a kernel unit's (-O3).
UNIT_FLAGS = {"core_abi.cpp": ("-O1",), "bs_abi.cpp": ("-O1",)}
HEADERS = (
    "abi.h",
    "vecmath.h",
    "panel.h",
    "colsum.h",
    "dense.h",
    "cached.h",
    "blocksparse.h",
    "fpenv.h",
    "parallel.h",
    "prune.h",
)
UNITS = tuple(dict.fromkeys(u for units in LIBRARIES.values() for u in units))  # each unit once
SOURCES = (*HEADERS, *UNITS)
BASE_FLAGS = ["-O3", "-fPIC", "-std=c++17", "-fno-math-errno", "-pthread"]
ABI_VERSION = abi.abi_version()  # a hash of abi.h (the libraries report it; abi.py checks it at load)
_FILE_PREFIX = {f"{f}_{t}": f"flashot_cpu_{'bs_' if f == 'blocksparse' else ''}{t}_" for f in FAMILIES for t in DTYPES}
LOCK_TIMEOUT_S = 900
# flashot_isa() bits
ISA_BITS = {"sse4.2": 1, "avx": 2, "avx2": 4, "fma": 8, "avx512f": 16, "aarch64": 32, "threads": 64}
# x86-64 micro-architecture levels: the /proc/cpuinfo flags each one needs (cumulative)
_X86_LEVELS = prebuilt.X86_LEVELS
# environment variables that change what g++ / clang++ compile or link
_BUILD_ENV = (
    "CPATH",
    "C_INCLUDE_PATH",
    "CPLUS_INCLUDE_PATH",
    "OBJC_INCLUDE_PATH",
    "LIBRARY_PATH",
    "GCC_EXEC_PREFIX",
    "COMPILER_PATH",
    "DEPENDENCIES_OUTPUT",
    "SUNPRO_DEPENDENCIES",
    "CCC_OVERRIDE_OPTIONS",
    "GCC_COMPARE_DEBUG",
    "CXXFLAGS",
    "CPPFLAGS",
    "LDFLAGS",
    "SOURCE_DATE_EPOCH",
    "LD_PRELOAD",
)
_MARCH_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$")

# Filled as libraries load: the facts of the first ``core`` library loaded in this process, {"path", "seconds"
# (compile wall time, 0 when cached), "cpu_seconds" (compiler CPU time, when compiled here), "cached",
# "compiler", "march", "prebuilt", "isa"}, and under "libraries" the same facts of every library loaded, by name.
BUILD_INFO: dict = {}
_LIBS: dict[str, ctypes.CDLL] = {}
_LOAD_LOCK = threading.RLock()  # one load (and compile) of a library at a time in this process
_CPU_SECONDS: dict[str, float] = {}  # compiler CPU time of the libraries compiled by this process


class BuildError(RuntimeError):
    """The kernels could not be compiled or loaded."""


def _read_sources() -> dict[str, str]:
    pkg = resources.files(__package__)
    return {name: pkg.joinpath(name).read_text(encoding="utf-8") for name in SOURCES}


def march() -> str:
    """The ``-march`` target: ``FLASHOT_CPU_MARCH`` or ``native``."""
    m = (os.environ.get("FLASHOT_CPU_MARCH") or "native").strip()
    if not _MARCH_RE.match(m):
        raise BuildError(
            f"FLASHOT_CPU_MARCH: expected a -march value such as 'native', 'x86-64-v3' or 'armv8-a', got {m!r}"
        )
    return m


def cxxflags(target: str | None = None) -> list[str]:
    """Compiler flags for one translation unit (without ``-c``/``-o``)."""
    return [*BASE_FLAGS, f"-march={target or march()}", f"-DFLASHOT_ABI_VERSION={ABI_VERSION}"]


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _check_cpu_runs(target: str) -> None:
    """Refuse an x86-64 level the CPU lacks (its library would die of SIGILL)."""
    if target not in _X86_LEVELS:
        return
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise BuildError(f"FLASHOT_CPU_MARCH={target} is an x86-64 target, but this machine is {platform.machine()}")
    have = _cpu_flags()
    if not have:
        return
    need = [
        f
        for lvl, fs in _X86_LEVELS.items()
        for f in fs
        if list(_X86_LEVELS).index(lvl) <= list(_X86_LEVELS).index(target)
    ]
    missing = [f for f in need if f not in have]
    if missing:
        raise BuildError(
            f"FLASHOT_CPU_MARCH={target}: this CPU lacks {', '.join(missing)}; use a lower level or 'native'"
        )


def _find_compiler() -> str | None:
    for cand in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if cand and shutil.which(cand):
            return shutil.which(cand)
    return None


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _BUILD_ENV}


def _hash(*parts: str, n: int = 16) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:n]


def _base_key(sources: dict[str, str], target: str) -> str:
    """Everything but the compiler: sources, flags, target, CPU, ABI."""
    return _hash(
        *(sources[k] for k in SOURCES),
        " ".join(cxxflags(target)),
        repr(LIBRARIES),
        repr(UNIT_FLAGS),
        platform.machine(),
        " ".join(sorted(_cpu_flags())) or platform.processor(),
        str(ABI_VERSION),
    )


def _compiler_key(cxx: str) -> str:
    try:
        ver = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60, env=_clean_env()).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"cannot run {cxx} --version: {e}") from e
    return _hash(os.path.realpath(cxx), ver, n=8)


class _DirLock:
    """An exclusive lock on the cache directory (POSIX flock; a no-op elsewhere)."""

    def __init__(self, d: str):
        self.path = os.path.join(d, ".build.lock")
        self.fd = None

    def __enter__(self):
        try:
            import fcntl
        except ImportError:
            return self
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        t0 = time.monotonic()
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() - t0 > LOCK_TIMEOUT_S:
                    os.close(self.fd)
                    raise BuildError(
                        f"timed out after {LOCK_TIMEOUT_S} s waiting for another process's build ({self.path})"
                    ) from None
                time.sleep(0.2)

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)  # releases the flock


def _remove_stale(d: str) -> None:
    """Leftovers of builds that were killed halfway (called with the lock held: no build is live)."""
    for p in glob.glob(os.path.join(d, ".tmp-build-*")):
        shutil.rmtree(p, ignore_errors=True)


def _compile(cxx: str, sources: dict[str, str], target: str, paths: dict[str, str], d: str) -> dict[str, float]:
    """Build each library of ``paths`` (library -> where it goes) from one compile of their units -> each
    library's compiler CPU seconds (those of its units; the dtype-free ones are compiled once, counted in each)."""
    env = _clean_env()
    work = tempfile.mkdtemp(prefix=".tmp-build-", dir=d)
    try:
        for name, text in sources.items():  # compile exactly the text that was hashed
            with open(os.path.join(work, name), "w", encoding="utf-8") as f:
                f.write(text)
        errs, cpu = compile_parts(
            cxx, cxxflags(target), work, units_of([LIBRARIES[lib] for lib in paths]), env, UNIT_FLAGS
        )
        if errs:
            here = os.path.dirname(os.path.abspath(__file__))
            raise BuildError(f"{os.path.basename(cxx)} failed: " + errs[0].replace(work, here)[-3000:])
        for library, path in paths.items():
            objs = [object_name(unit) for unit in LIBRARIES[library]]
            link = [cxx, "-shared", "-fPIC", "-pthread", "-o", "lib.so", *objs]
            r = subprocess.run(link, cwd=work, capture_output=True, text=True, timeout=300, env=env)
            if r.returncode != 0:
                raise BuildError(f"{os.path.basename(cxx)} (link) failed: {r.stderr.strip()[-2000:]}")
            os.chmod(os.path.join(work, "lib.so"), 0o700)
            os.replace(os.path.join(work, "lib.so"), path)
        return {lib: sum(cpu.get(u, 0.0) for u in LIBRARIES[lib]) for lib in paths}
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"compiling the CPU kernels failed: {e}") from e
    finally:
        shutil.rmtree(work, ignore_errors=True)


# compiler CPU seconds of each library and of its largest unit, for the message's estimate: g++ 12.2
# -march=native on an AVX-512 AMD EPYC with 2 vCPUs shared with other jobs, each unit compiled alone (the
# larger side: a quiet AVX2 Zen 3 took about 0.7x as much, BENCHMARKS.md "First-use compile of the CPU kernels")
_COMPILE_CPU_S = {"core": (22.0, 11.0), "blocksparse": (36.0, 24.0)}


def _estimate_seconds(libraries: list[str]) -> int:
    n = cores()
    total = sum(_COMPILE_CPU_S[family(lib)][0] for lib in libraries)
    largest = max(_COMPILE_CPU_S[family(lib)][1] for lib in libraries)
    return int(round(max(total / max(1, n), largest))) + 1


def build(*, quiet: bool = False, library: str = "core_f32") -> tuple[str, float, bool, str]:
    """Compile (or find cached) one of :data:`LIBRARIES` -> (path, compile wall seconds, was cached,
    compiler).

    The compiler's CPU time is reported by :func:`load_library` in ``BUILD_INFO``.
    """
    return build_all(quiet=quiet, libraries=(library,))[library]


def build_all(
    *, quiet: bool = False, libraries: tuple[str, ...] = tuple(LIBRARIES)
) -> dict[str, tuple[str, float, bool, str]]:
    """:func:`build` for several :data:`LIBRARIES` (default: all), the missing ones compiled together
    (:func:`build_many_in_cache`) -> library -> (path, compile wall seconds, was cached, compiler)."""
    _check_libraries(libraries)
    sources = _read_sources()
    d, target = _cache_and_target()
    cxx = _find_compiler()
    if cxx is None:  # no compiler: any library built here for the same sources, flags and CPU
        out = {}
        for library in libraries:
            found = _cached(d, sources, target, _FILE_PREFIX[library])
            if found is None:
                raise BuildError(_NO_COMPILER)
            out[library] = (found, 0.0, True, "(none: cached library)")
        return out
    built = build_many_in_cache(libraries, target, cxx, sources, d, quiet=quiet)
    return {library: (*r, cxx) for library, r in built.items()}


_NO_COMPILER = "no C++ compiler found (set CXX or install g++) and no cached library for this machine"


def _cache_and_target() -> tuple[str, str]:
    """(the private cache directory, the -march target this CPU runs); raises :class:`BuildError`."""
    target = march()
    _check_cpu_runs(target)
    try:
        return private_cache_dir(), target
    except OSError as e:
        raise BuildError(str(e)) from e


def _cached(d: str, sources: dict[str, str], target: str, prefix: str) -> str | None:
    """The newest library in ``d`` named ``prefix<key>_<compiler>.so`` for these sources, flags and CPU (any
    compiler), or None."""
    found = glob.glob(os.path.join(d, f"{prefix}{_base_key(sources, target)}_*.so"))
    return max(found, key=os.path.getmtime) if found else None


def build_in_cache(
    library: str,
    target: str,
    cxx: str,
    sources: dict[str, str] | None = None,
    d: str | None = None,
    *,
    quiet: bool = True,
) -> tuple[str, float, bool]:
    """Compile ``library`` for ``-march=target`` with ``cxx`` into the cache directory ``d`` (default: the
    private cache), or find it there -> (path, compile wall seconds, was cached).

    No check that this CPU runs ``target``: the wheel build (:mod:`.wheel`) compiles every level (and
    AArch64 with a cross compiler) on one machine; the cache key is the one :func:`build` uses, so a level
    the test suite or a user compiled already is reused, and the other way round.
    """
    return build_many_in_cache((library,), target, cxx, sources, d, quiet=quiet)[library]


def build_many_in_cache(
    libraries: tuple[str, ...],
    target: str,
    cxx: str,
    sources: dict[str, str] | None = None,
    d: str | None = None,
    *,
    quiet: bool = True,
) -> dict[str, tuple[str, float, bool]]:
    """:func:`build_in_cache` for several libraries at once -> library -> (path, compile wall seconds of the
    batch, was cached).  The missing ones are compiled together, one pool of compilers for all their units
    (each unit once): one after the other, a core would idle while each library's largest unit finishes."""
    _check_libraries(libraries)
    sources = _read_sources() if sources is None else sources
    if d is None:
        try:
            d = private_cache_dir()
        except OSError as e:
            raise BuildError(str(e)) from e
    paths = {
        lib: os.path.join(d, f"{_FILE_PREFIX[lib]}{_base_key(sources, target)}_{_compiler_key(cxx)}.so")
        for lib in libraries
    }
    out = {lib: (path, 0.0, True) for lib, path in paths.items()}
    if all(os.path.exists(p) for p in paths.values()):
        return out
    with _DirLock(d):
        todo = {lib: p for lib, p in paths.items() if not os.path.exists(p)}  # another process built the rest
        if not todo:
            return out
        _remove_stale(d)
        if not quiet:
            print(
                f"flashot: compiling the CPU kernels once for this machine ({_describe(list(todo))}; -march={target}, "
                f"about {_estimate_seconds(list(todo))} s) into {d}",
                file=sys.stderr,
                flush=True,
            )
        t0 = time.perf_counter()
        _CPU_SECONDS.update(_compile(cxx, sources, target, todo, d))
        secs = time.perf_counter() - t0
        if not quiet:
            print(f"flashot: compiled in {secs:.1f} s (cached for later runs)", file=sys.stderr, flush=True)
    out.update({lib: (p, secs, False) for lib, p in todo.items()})
    return out


def _check_libraries(libraries: tuple[str, ...]) -> None:
    for library in libraries:
        if library not in LIBRARIES:
            raise ValueError(f"library: expected one of {sorted(LIBRARIES)}, got {library!r}")


def _describe(libraries: list[str]) -> str:
    """What a float32 or float64 user is waiting for, in words."""
    if len(libraries) > 1:
        return ", ".join(libraries)
    (library,) = libraries
    what = "the block-sparse ones, for multiscale, " if family(library) == "blocksparse" else ""
    return what + ("float32" if library.endswith("f32") else "float64")


def _bind(lib: ctypes.CDLL, library: str = "core") -> None:
    """Set the entry points' ctypes signatures (:func:`.abi.bind`)."""
    abi.bind(lib, library)


def cpu_flags() -> set[str]:
    """This CPU's feature flags (``/proc/cpuinfo``; empty where unknown)."""
    return _cpu_flags()


def find_compiler() -> str | None:
    """The C++ compiler :func:`build` uses (``CXX``, ``g++``, ``c++``, ``clang++``), or None."""
    return _find_compiler()


def read_sources() -> dict[str, str]:
    """The kernel sources of this package (:data:`SOURCES`: name -> text)."""
    return _read_sources()


def source_key(sources: dict[str, str], target: str) -> str:
    """What a library for ``-march=target`` is compiled from: the sources, the flags, the libraries' units.

    The key of a prebuilt library (:mod:`.prebuilt`): unlike the cache key, no CPU and no compiler,
    since the target names the instruction set and the wheel was compiled elsewhere."""
    return _hash(*(sources[k] for k in SOURCES), " ".join(cxxflags(target)), repr(LIBRARIES), repr(UNIT_FLAGS))


def _explicit_target() -> str | None:
    """``FLASHOT_CPU_MARCH`` when set (checked), else None: the best prebuilt level, or native."""
    return march() if (os.environ.get("FLASHOT_CPU_MARCH") or "").strip() else None


def prebuilt_status() -> dict:
    """What the installed package's prebuilt kernels offer this CPU (:func:`.prebuilt.status`)."""
    try:  # the sources are read only where a manifest names a variant for this CPU
        return prebuilt.status(
            lambda v: source_key(_read_sources(), v), _cpu_flags(), platform.machine(), _explicit_target()
        )
    except prebuilt.PrebuiltError as e:
        raise BuildError(str(e)) from e


def _prebuilt(library: str) -> tuple[str, dict] | None:
    """The wheel's prebuilt ``library`` for this CPU (:mod:`.prebuilt`), or None: compile it."""
    target = _explicit_target()
    if target == "native":
        return None
    if target is not None:
        _check_cpu_runs(target)
    try:
        return prebuilt.find(
            library, lambda v: source_key(_read_sources(), v), _cpu_flags(), platform.machine(), target
        )
    except prebuilt.PrebuiltError as e:
        raise BuildError(str(e)) from e


def _open(library: str, quiet: bool) -> tuple[ctypes.CDLL, dict]:
    """Load the prebuilt library, or build if needed and load; check it -> (library, its facts for
    BUILD_INFO)."""
    pre = _prebuilt(library)
    if pre is not None:
        (path, facts), secs, cached = pre, 0.0, True
    else:
        path, secs, cached, cxx = build(quiet=quiet, library=library)
        facts = dict(prebuilt=None, march=march(), compiler=cxx)
        try:
            check_private_file(path)
        except CacheDirError as e:
            raise BuildError(str(e)) from e
    try:
        lib = ctypes.CDLL(path)
        _bind(lib, library)
    except (OSError, AttributeError) as e:
        how = "reinstall flashot" if pre is not None else f"clear the cache directory, {cache_dir()}"
        raise BuildError(f"loading {path} failed: {e}; rebuild it ({how})") from e
    try:
        abi.check_version(lib, library, path)
        abi.check_layout(lib, library, path)
    except abi.AbiError as e:
        raise BuildError(str(e)) from e
    info = dict(path=path, seconds=secs, cached=cached, **facts)
    if not cached and library in _CPU_SECONDS:
        info["cpu_seconds"] = _CPU_SECONDS[library]
    return lib, info


def family(library: str) -> str:
    """The family (``core`` or ``blocksparse``) of one of :data:`LIBRARIES`."""
    return library.rsplit("_", 1)[0]


def dtype_suffix(dtype: object) -> str:
    """``f32`` or ``f64`` for a float32 / float64 dtype (a torch dtype, ``"float32"``, ``"f64"``, ...)."""
    name = str(dtype).removeprefix("torch.")
    short = {"float32": "f32", "float": "f32", "float64": "f64", "double": "f64"}.get(name, name)
    if short not in DTYPES:
        raise ValueError(f"dtype: the CPU kernels run float32 and float64, got {dtype}")
    return short


def load_library(library: str, *, quiet: bool = False) -> ctypes.CDLL:
    """Build if needed and load one of :data:`LIBRARIES` (once per process). Raises :class:`BuildError`."""
    _check_libraries((library,))
    with _LOAD_LOCK:
        if library not in _LIBS:
            lib, info = _open(library, quiet)
            if family(library) == "core":
                isa = lib.flashot_isa()
                info["isa"] = sorted(k for k, b in ISA_BITS.items() if isa & b and k != "threads")
                if "path" not in BUILD_INFO:
                    BUILD_INFO.update(info)
            BUILD_INFO.setdefault("libraries", {})[library] = info
            _LIBS[library] = lib
    return _LIBS[library]


class Kernels:
    """One family's compiled kernels (``core`` or ``blocksparse``), read like one ctypes library.

    Each dtype's library is loaded (compiled first if needed) at the first use of one of its entry points:
    ``kernels.flashot_softmin_f64`` loads the float64 library.  The dtype-free entry points (the ABI facts,
    the floating-point probes, the vector width: the same in both) come from a library already loaded, the
    float32 one if none is.  Why lazily: a first solve then compiles only its own dtype's kernels.
    ``parts`` ({"f32": library, "f64": library}, bound with :func:`.abi.bind`): given libraries instead of
    this package's (benchmarks comparing two builds); a dtype it lacks cannot be used.
    """

    def __init__(self, family: str, *, quiet: bool = False, parts: dict[str, ctypes.CDLL] | None = None):
        if family not in FAMILIES:
            raise ValueError(f"family: expected one of {FAMILIES}, got {family!r}")
        self.family, self.quiet, self._parts = family, quiet, parts

    def part(self, dtype: object) -> ctypes.CDLL:
        """The library of ``dtype`` (float32 or float64), loaded (and compiled) if needed."""
        dt = dtype_suffix(dtype)
        if self._parts is None:
            return load_library(f"{self.family}_{dt}", quiet=self.quiet)
        if dt not in self._parts:
            raise BuildError(f"no {dt} library was given to these kernels (they have {sorted(self._parts)})")
        return self._parts[dt]

    def loaded(self) -> tuple[str, ...]:
        """The dtypes (``f32``, ``f64``) whose library is loaded."""
        have = self._parts if self._parts is not None else {t for t in DTYPES if f"{self.family}_{t}" in _LIBS}
        return tuple(t for t in DTYPES if t in have)

    def __getattr__(self, name: str):
        if not name.startswith("flashot_"):
            raise AttributeError(name)
        tail = name.rsplit("_", 1)[-1]
        fn = getattr(self.part(tail if tail in DTYPES else (self.loaded() or DTYPES)[0]), name)
        self.__dict__[name] = fn  # later reads are plain attribute reads
        return fn


def kernels(family: str = "core", *, quiet: bool = False) -> Kernels:
    """``family``'s kernels, checked loadable without compiling anything yet: a prebuilt library for this
    CPU, or a private cache directory and a compiler (or a library cached there). Raises :class:`BuildError`."""
    if family not in FAMILIES:
        raise ValueError(f"family: expected one of {FAMILIES}, got {family!r}")
    library = f"{family}_{DTYPES[0]}"
    if library not in _LIBS and _prebuilt(library) is None:
        d, target = _cache_and_target()
        if _find_compiler() is None and _cached(d, _read_sources(), target, "flashot_cpu_*") is None:
            raise BuildError(_NO_COMPILER)
    return Kernels(family, quiet=quiet)


def load(dtype: object = "float32", *, quiet: bool = False) -> Kernels:
    """The ``core`` kernels with ``dtype``'s library loaded (built if needed); the other dtype's loads at its
    first use. Raises :class:`BuildError`."""
    k = Kernels("core", quiet=quiet)
    k.part(dtype)
    return k


def load_blocksparse(dtype: object = "float32", *, quiet: bool = False) -> Kernels:
    """The ``blocksparse`` kernels (multiscale's) with ``dtype``'s library loaded (built if needed)."""
    k = Kernels("blocksparse", quiet=quiet)
    k.part(dtype)
    return k
