"""The standalone kernel driver (tests/native/kernel_check.cpp) in the ordinary test suite.

The driver checks every exported CPU kernel against naive double-precision references.  It is
built here three ways:

* ``library``: linked against the two libraries :func:`flashot.ops.cpu.build.build` makes (the
  real build: ``core`` and ``blocksparse``, four translation units each at -O3, for
  ``FLASHOT_CPU_MARCH`` or native; compiled at the start of the test run);
* ``x86-64-v2`` (SSE4.2: the 16-byte vector code paths, as on NEON): linked against the library
  build.py makes for that target in the test run's shared cache (``shared_build_cache`` in
  conftest.py; the same library tests/ops/test_cpu_build.py and test_isa_matrix.py load), so the
  SSE4.2 kernels are compiled once per machine, as they ship;
* ``aarch64``: the same with ``aarch64-linux-gnu-g++`` when it is on PATH, linked statically and
  run under ``qemu-aarch64`` when that is on PATH too (the full ARM64 check, which installs
  both, is tests/native/run_arm64.sh).

Each build starts when a test first needs it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flashot.ops.cpu import build

DRIVER = Path(__file__).resolve().parents[1] / "native" / "kernel_check.cpp"
KERNELS_DIR = Path(build.__file__).resolve().parent  # the sources that build.py compiles
CROSS_CXX = "aarch64-linux-gnu-g++"
SUMMARY = re.compile(r"^(\d+) passed, (\d+) failed$")
COMPILE_TIMEOUT_S = 600
RUN_TIMEOUT_S = 300


class DriverBuild:
    """Compile the driver (and the kernels' translation units, unless linking ``lib``) for one target in the
    background, then link."""

    def __init__(
        self,
        cxx: str,
        march: str,
        work: Path,
        *,
        opt: str = "-O2",
        static: bool = False,
        lib: list[str] | subprocess.Popen | None = None,
    ):
        """``lib``: the libraries to link (their paths, or a running process that prints them last)."""
        self.cxx, self.work, self.static, self.lib = cxx, work, static, lib
        self.env = build._clean_env()
        self.flags = [opt if f == "-O3" else f for f in build.cxxflags(march)]  # as build.py
        self.exe = work / "kernel_check"
        self.procs = [self._compile(DRIVER, "kernel_check.o", "-Wall", "-Wextra", f"-I{KERNELS_DIR}")]
        self.units = list(build.UNITS)  # each unit once (the dtype-free ones are in both dtypes' libraries)
        if lib is None:
            self.procs += [self._compile(KERNELS_DIR / u, u[: -len(".cpp")] + ".o") for u in self.units]
        elif isinstance(lib, subprocess.Popen):
            self.procs.append(lib)
        self._result: tuple[bool, str] | None = None

    def _compile(self, src: Path, obj: str, *extra: str) -> subprocess.Popen:
        return subprocess.Popen(
            [self.cxx, *self.flags, *extra, "-c", str(src), "-o", str(self.work / obj)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=self.env,
        )

    def _link(self) -> subprocess.CompletedProcess:
        objs = [str(self.work / "kernel_check.o")]
        if self.lib is None:
            objs += [str(self.work / (u[: -len(".cpp")] + ".o")) for u in self.units]
        else:
            objs += [*self.lib, *(f"-Wl,-rpath,{d}" for d in sorted({os.path.dirname(p) for p in self.lib}))]
        cmd = [self.cxx, "-pthread", *(["-static"] if self.static else []), "-o", str(self.exe), *objs]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S, env=self.env)

    def finish(self) -> tuple[bool, str]:
        """(ok, compiler output); links the executable once the objects are built."""
        if self._result is None:
            out, ok = [], True
            for p in self.procs:
                try:
                    text, _ = p.communicate(timeout=COMPILE_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    p.kill()
                    text = p.communicate()[0] + f"\n(timed out after {COMPILE_TIMEOUT_S} s)"
                out.append(text)
                ok &= p.returncode == 0
                if ok and p is self.lib:
                    self.lib = text.strip().splitlines()[-len(build.LIBRARIES) :]
            if ok:
                r = self._link()
                if r.returncode != 0 and self.static:  # no static libraries: a dynamic executable
                    self.static = False
                    r = self._link()
                out.append(r.stdout + r.stderr)
                ok = r.returncode == 0
            self._result = (ok, "\n".join(o for o in out if o.strip()))
        return self._result


def _x86_level_reason(level: str) -> str | None:
    """Why this machine cannot run code built for an x86-64 level (None: it can)."""
    try:
        build._check_cpu_runs(level)
    except build.BuildError as e:
        return str(e)
    return None


def _library_build(cxx: str, work: Path) -> DriverBuild | str:
    """The driver against the libraries build.py builds (and the engines load)."""
    try:
        lib = [build.build(quiet=True, library=name)[0] for name in build.LIBRARIES]
    except build.BuildError as e:
        return f"build.py could not build the kernels: {e}"
    return DriverBuild(cxx, build.march(), work, opt="-O3", lib=lib)


def _level_library(level: str, cache: Path) -> subprocess.Popen:
    """build.py's library for an x86-64 level in the shared cache (compiled there once per machine),
    built by a process that prints its path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHOT_")}
    env.update(FLASHOT_CPU_MARCH=level, FLASHOT_CACHE_DIR=str(cache))
    code = (
        "from flashot.ops.cpu import build; "
        "print(*(build.build(quiet=True, library=name)[0] for name in build.LIBRARIES), sep='\\n')"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )


class Builds:
    """Each target's build, started on first request (a deselected slow target costs nothing);
    ``get(target)`` -> DriverBuild, or the reason it cannot be built here."""

    def __init__(self, tmp_path_factory, cache: Path):
        self.tmp, self.cache, self.made = tmp_path_factory, cache, {}
        self.cxx = build._find_compiler()

    def get(self, target: str) -> DriverBuild | str:
        if target not in self.made:
            self.made[target] = self._start(target)
        return self.made[target]

    def _start(self, target: str) -> DriverBuild | str:
        if target == "aarch64":
            cross = shutil.which(CROSS_CXX)
            if cross is None:
                return (
                    f"{CROSS_CXX} not on PATH (Debian: apt-get install g++-aarch64-linux-gnu; "
                    f"tests/native/run_arm64.sh installs it and runs the full ARM64 check)"
                )
            return DriverBuild(cross, "armv8-a", self.tmp.mktemp("aarch64"), static=True)
        if self.cxx is None:
            return "no C++ compiler (g++ / clang++) on PATH"
        if target == "library":
            return _library_build(self.cxx, self.tmp.mktemp("library"))
        why = _x86_level_reason(target)
        if why:
            return f"cannot run {target} code here: {why}"
        return DriverBuild(self.cxx, target, self.tmp.mktemp(target), opt="-O3", lib=_level_library(target, self.cache))

    def close(self) -> None:
        for b in self.made.values():
            if isinstance(b, DriverBuild):
                for p in b.procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()


@pytest.fixture(scope="module")
def builds(tmp_path_factory, shared_build_cache):
    b = Builds(tmp_path_factory, shared_build_cache)
    yield b
    b.close()


def _built(builds: Builds, target: str) -> DriverBuild:
    b = builds.get(target)
    if isinstance(b, str):
        pytest.skip(b)
    ok, log = b.finish()
    assert ok, f"building the kernel driver for {target} failed:\n{log[-4000:]}"
    return b


def _run_driver(cmd: list[str]) -> tuple[int, int, str]:
    """Run the driver; (passed, failed, full output).  Fails the test unless its summary is sane."""
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env)
    lines = r.stdout.strip().splitlines()
    m = SUMMARY.match(lines[-1]) if lines else None
    assert m, f"no 'N passed, M failed' line (exit status {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-2000:]}"
    passed, failed = int(m.group(1)), int(m.group(2))
    fails = "\n".join(ln for ln in lines if ln.startswith("FAIL"))
    assert failed == 0 and r.returncode == 0, f"{failed} kernel checks failed (exit {r.returncode}):\n{fails}"
    assert passed >= 40 and passed == sum(ln.startswith("PASS") for ln in lines), r.stdout[-3000:]
    return passed, failed, r.stdout


def test_driver_declares_no_abi_of_its_own():
    """The driver takes the entry points and their argument structs from abi.h (it checks the libraries' ABI
    version against the -DFLASHOT_ABI_VERSION of build.cxxflags), so it cannot drift from the kernels."""
    text = DRIVER.read_text()
    assert '#include "abi.h"' in text
    assert 'extern "C"' not in text and "EXPECTED_ABI" not in text
    assert f"-DFLASHOT_ABI_VERSION={build.ABI_VERSION}" in build.cxxflags()


@pytest.mark.parametrize("target", ["library", pytest.param("x86-64-v2", marks=pytest.mark.slow)])
def test_kernel_driver_native(builds, target):
    b = _built(builds, target)
    _run_driver([str(b.exe)])


@pytest.mark.slow  # a cross compile; CI runs the full ARM64 check (tests/native/run_arm64.sh) instead
def test_kernel_driver_aarch64_cross(builds):
    """aarch64 cross build (static when the toolchain allows); run under qemu-aarch64 when installed."""
    b = _built(builds, "aarch64")
    qemu = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")
    if qemu is None:
        pytest.skip("built for aarch64; qemu-aarch64 not on PATH, so not run (Debian: apt-get install qemu-user)")
    sysroot = [] if b.static else ["-L", "/usr/aarch64-linux-gnu"]  # Debian's cross libraries
    out = _run_driver([qemu, *sysroot, str(b.exe)])[2]
    isa = re.search(r"^PASS isa: (\d+)", out, re.M)
    assert isa and int(isa.group(1)) & build.ISA_BITS["aarch64"], out[:2000]
