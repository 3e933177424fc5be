"""Compile the fused CPU kernels once per machine and load them with ctypes.

The kernels are plain C++ with a C ABI (no torch headers), so ``g++`` builds them
without ninja or a torch extension toolchain: four translation units of one source
(``-DFLASHOT_PART=k``) compiled in parallel, then linked.  The
shared library is cached in ``$FLASHOT_CACHE_DIR`` (default
``$XDG_CACHE_HOME/flashot`` or ``~/.cache/flashot``) under a hash of the
source, the compiler, its flags and the host CPU's feature flags (``-march=native``),
so only the first process on a machine pays the compile.  Concurrent first
builds are safe: each compiles to a private temporary file and renames it
into place atomically.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import resource
import platform
import shutil
import subprocess
import tempfile
import time

from ._source import SOURCE

__all__ = ["BuildError", "build", "load", "BUILD_INFO", "CXXFLAGS"]

CXXFLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++17", "-fno-math-errno"]
ABI_VERSION = 9
# translation units compiled in parallel (FLASHOT_PART = 1..PARTS in the source)
PARTS = 4

# Filled by :func:`load`: {"path", "seconds" (compile wall time, 0 when cached),
# "cpu_seconds" (compiler CPU time, when compiled here), "cached", "compiler"}.
BUILD_INFO: dict = {}
_LIB: ctypes.CDLL | None = None


class BuildError(RuntimeError):
    """The kernels could not be compiled or loaded."""


def cache_dir() -> str:
    d = os.environ.get("FLASHOT_CACHE_DIR")
    if not d:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        d = os.path.join(base, "flashot")
    return d


def _compiler() -> str:
    for cand in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if cand and shutil.which(cand):
            return shutil.which(cand)
    raise BuildError("no C++ compiler found (set CXX or install g++)")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor()


def _key(cxx: str) -> str:
    try:
        ver = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"cannot run {cxx} --version: {e}") from e
    h = hashlib.sha256()
    for part in (SOURCE, cxx, ver, " ".join(CXXFLAGS), platform.machine(), _cpu_flags(), str(ABI_VERSION),
                 str(PARTS)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:20]


def build() -> tuple[str, float, bool, str]:
    """Compile (or find cached) -> (path, compile wall seconds, was cached, compiler).

    The compiler's CPU time is recorded in ``BUILD_INFO["cpu_seconds"]``.
    """
    cxx = _compiler()
    d = cache_dir()
    try:
        os.makedirs(d, exist_ok=True)
        if not os.access(d, os.W_OK):
            raise OSError(f"{d} is not writable")
    except OSError:  # read-only home (CI, containers): a per-user temp dir
        d = os.path.join(tempfile.gettempdir(), f"flashot-{os.getuid() if hasattr(os, 'getuid') else 'user'}")
        os.makedirs(d, exist_ok=True)
    path = os.path.join(d, f"flashot_cpu_{_key(cxx)}.so")
    if os.path.exists(path):
        return path, 0.0, True, cxx
    fd, src = tempfile.mkstemp(suffix=".cpp", dir=d)
    with os.fdopen(fd, "w") as f:
        f.write(SOURCE)
    tmp = src[:-4] + ".so"
    objs = [src[:-4] + f".part{k}.o" for k in range(1, PARTS + 1)]
    t0 = time.perf_counter()
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    compile_flags = [f for f in CXXFLAGS if f != "-shared"]
    try:
        # the exported functions come in PARTS groups (see FLASHOT_PART in the source): compile them
        # as separate translation units in parallel, then link
        procs = [subprocess.Popen([cxx, *compile_flags, f"-DFLASHOT_PART={k}", "-c", src, "-o", obj],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for k, obj in enumerate(objs, start=1)]
        errs = []
        for pr in procs:
            try:
                _, err = pr.communicate(timeout=900)
            except subprocess.TimeoutExpired:
                pr.kill()
                _, err = pr.communicate()
                err = "timed out after 900 s. " + (err or "")
            if pr.returncode != 0:
                errs.append((err or "").strip()[-2000:])
        if errs:
            raise BuildError(f"{os.path.basename(cxx)} failed: {errs[0]}")
        r = subprocess.run([cxx, "-shared", "-fPIC", "-fopenmp", "-o", tmp, *objs], capture_output=True, text=True,
                           timeout=300)
        if r.returncode != 0:
            raise BuildError(f"{os.path.basename(cxx)} (link) failed: {r.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
        ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        BUILD_INFO["cpu_seconds"] = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"compiling the CPU kernels failed: {e}") from e
    finally:
        for p in (src, tmp, *objs):
            if os.path.exists(p):
                os.remove(p)
    return path, time.perf_counter() - t0, False, cxx


_F, _D = ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_double)
_P, _I, _L, _DB = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_double
_SIGS = {
    "flashot_abi_version": [],
    "flashot_softmin": [_P, _P, _P, _P, _P, _I, _L, _L, _I, _DB, _DB, _I, _DB, _I, _L, _I],
    "flashot_pair": [_P, _P, _P, _P, _P, _P, _P, _I, _L, _L, _I, _DB, _DB, _I, _I, _I, _L, _I],
    "flashot_plan": [_P, _P, _P, _P, _P, _P, _P, _I, _P, _P, _I, _I, _L, _L, _I, _DB, _DB, _I, _I, _DB, _I, _L, _I],
    "flashot_rows_lse": [_P, _P, _P, _I, _L, _L, _DB, _DB, _I],
    "flashot_cols_lse": [_P, _P, _P, _I, _L, _L, _DB, _DB, _I],
    "flashot_vexp": [_P, _P, _L, _I],
    "flashot_cached_weights": [_P, _L, _L, _P, _P, _DB, _I, _DB, _P, _I],
    "flashot_cached_alt": [_P, _P, _P, _DB, _DB, _P, _P, _I, _L, _L, _I],
    "flashot_alt": [_P, _P, _P, _P, _P, _DB, _P, _P, _I, _L, _L, _I, _DB, _DB, _I, _I, _L, _I],
}


def load() -> ctypes.CDLL:
    """Build if needed and load the library (once per process). Raises :class:`BuildError`."""
    global _LIB
    if _LIB is not None:
        return _LIB
    path, secs, cached, cxx = build()
    try:
        lib = ctypes.CDLL(path)
        for name, args in _SIGS.items():
            fns = [name] if name == "flashot_abi_version" else [name + "_f32", name + "_f64"]
            for fn in fns:
                f = getattr(lib, fn)
                f.argtypes = args
                f.restype = ctypes.c_int
    except (OSError, AttributeError) as e:
        raise BuildError(f"loading {path} failed: {e}") from e
    if lib.flashot_abi_version() != ABI_VERSION:
        raise BuildError(f"{path}: ABI version mismatch")
    BUILD_INFO.update(path=path, seconds=secs, cached=cached, compiler=cxx)
    _LIB = lib
    return lib
