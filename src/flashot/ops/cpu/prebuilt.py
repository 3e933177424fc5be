"""Prebuilt kernels: the libraries a platform wheel ships, one build per instruction-set level.

A wheel built by ``setup.py`` (``python -m build --wheel``) carries, beside the kernel sources,
``prebuilt/<variant>/core.so`` and ``prebuilt/<variant>/blocksparse.so`` for each variant of its
platform, and ``prebuilt/manifest.json``: per variant the source key (a hash of the sources, the
compile flags and the library layout, so a package whose sources were edited after the build
compiles instead of loading a stale binary) and the compiler.  The variants:

* x86-64: ``x86-64-v4`` (AVX-512 F/BW/CD/DQ/VL), ``x86-64-v3`` (AVX2, FMA, BMI1/2, F16C, MOVBE,
  LZCNT), ``x86-64-v2`` (SSE4.2, SSSE3, POPCNT): the levels of the x86-64 psABI, so one wheel
  runs on every x86-64 CPU of the last fifteen years with the widest vectors it has;
* AArch64: ``armv8-a`` (NEON is part of the base architecture).

At load the best variant this CPU runs is picked from the CPU's own feature flags
(``/proc/cpuinfo``, read by :func:`.build._cpu_flags`), never from the build machine's, and the
library's ABI is checked as for a compiled one (:mod:`.abi`).  A prebuilt library is loaded only
from this package's own directory, as a regular file that nobody can write who could not already
write the Python code that loads it (:func:`check_package_file`): never from a cache or temporary
directory.  ``FLASHOT_CPU_MARCH=native`` skips the prebuilt libraries and compiles for the exact
CPU (:mod:`.build`); ``FLASHOT_CPU_MARCH=<variant>`` picks that variant when it is shipped.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import stat
import subprocess

from . import build

__all__ = ["DIRNAME", "VARIANTS", "PrebuiltError", "build_variants", "check_package_file", "find", "package_dir",
           "select_variant", "source_key", "status", "variants_for_platform", "wheel_variants"]

DIRNAME = "prebuilt"
MANIFEST = "manifest.json"
FORMAT = 1
# per architecture, best first (the x86-64 levels' feature flags: build._X86_LEVELS, cumulative)
VARIANTS = {"x86_64": ("x86-64-v4", "x86-64-v3", "x86-64-v2"), "aarch64": ("armv8-a",)}
_ARCH = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}
# the compiler for each architecture when the build machine is another one (Debian's cross compilers)
CROSS_CXX = {"x86_64": "x86_64-linux-gnu-g++", "aarch64": "aarch64-linux-gnu-g++"}


class PrebuiltError(build.BuildError):
    """A prebuilt library is unsafe to load (outside the package, or writable by someone else)."""


def package_dir() -> str:
    """The directory of the prebuilt libraries: inside this installed package, nowhere else."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), DIRNAME)


def _arch(machine: str) -> str | None:
    return _ARCH.get(machine.lower())


def _level_flags(variant: str) -> list[str]:
    """The CPU flags an x86-64 level needs (its own and the lower levels')."""
    levels = list(build._X86_LEVELS)
    return [f for lvl in levels[:levels.index(variant) + 1] for f in build._X86_LEVELS[lvl]]


def runs_on(variant: str, flags: set[str], machine: str) -> bool:
    """Whether a CPU with these ``/proc/cpuinfo`` flags and this ``platform.machine()`` runs ``variant``."""
    arch = _arch(machine)
    if arch is None or variant not in VARIANTS[arch]:
        return False
    if arch == "aarch64":
        return True  # armv8-a is the base architecture
    return all(f in flags for f in _level_flags(variant))


def select_variant(flags: set[str], machine: str, available) -> str | None:
    """The best of ``available`` variants a CPU with ``flags`` (``/proc/cpuinfo``) runs, or None.

    Unknown flags (an empty set: no ``/proc/cpuinfo``) select nothing on x86-64, so the kernels are
    compiled for the CPU instead of guessing a level that might die of SIGILL."""
    arch = _arch(machine)
    return next((v for v in VARIANTS.get(arch or "", ()) if v in available and runs_on(v, flags, machine)), None)


def source_key(sources: dict[str, str], variant: str) -> str:
    """What a prebuilt library was compiled from: the sources, the flags for ``variant``, the libraries'
    units (the CPU and compiler are left out: the variant names the target)."""
    return build._hash(*(sources[k] for k in build.SOURCES), " ".join(build.cxxflags(variant)),
                       repr(build.LIBRARIES))


def check_package_file(path: str, root: str | None = None) -> None:
    """Raise :class:`PrebuiltError` unless ``path`` is a regular file inside ``root`` (default
    :func:`package_dir`) that nobody can write who could not already write this module.

    The rule: not a symlink, its real path under ``root``'s, and the file and its directories up to
    ``root`` not world-writable, owned by root, by the current user or by this module's owner, and
    group-writable only where this module itself is writable by the same group.  A library no more
    writable than the code that loads it adds no way to plant code; a stricter rule would refuse
    every install made under a group-writable umask."""
    root = os.path.realpath(root or package_dir())
    real = os.path.realpath(path)
    if os.path.commonpath([real, root]) != root:
        raise PrebuiltError(f"prebuilt library {path} is not inside the installed package ({root}): refusing "
                            f"to load it")
    if not stat.S_ISREG(os.lstat(path).st_mode):
        raise PrebuiltError(f"prebuilt library {path} is not a regular file (a symlink?): refusing to load it")
    ref = os.stat(os.path.abspath(__file__))
    uid = os.getuid() if hasattr(os, "getuid") else None
    p = real
    while True:
        st = os.stat(p)
        mode = stat.S_IMODE(st.st_mode)
        if (st.st_mode & stat.S_IWOTH or (uid is not None and st.st_uid not in (0, uid, ref.st_uid))
                or (st.st_mode & stat.S_IWGRP and not (ref.st_mode & stat.S_IWGRP and ref.st_gid == st.st_gid))):
            raise PrebuiltError(f"prebuilt library {path}: {p} (owner uid {st.st_uid}, mode {mode:o}) can be "
                                f"written by others than the owner of flashot's own code: refusing to load it; "
                                f"reinstall flashot, or set FLASHOT_CPU_MARCH=native to compile the kernels")
        if p == root:
            return
        p = os.path.dirname(p)


def _manifest(root: str) -> dict | None:
    path = os.path.join(root, MANIFEST)
    if not os.path.exists(path):
        return None
    check_package_file(path, root)
    try:
        with open(path, encoding="utf-8") as f:
            man = json.load(f)
    except (OSError, ValueError) as e:
        raise PrebuiltError(f"cannot read {path}: {e}") from e
    if not isinstance(man, dict) or man.get("format") != FORMAT or not isinstance(man.get("variants"), dict):
        raise PrebuiltError(f"{path}: not a flashot {FORMAT} prebuilt manifest")
    return man


def status(target: str | None = None, root: str | None = None) -> dict:
    """What the prebuilt libraries offer here: ``shipped`` (variants in the package), ``runs`` (those this
    CPU runs), ``selected`` (the variant to load, or None) and ``reason`` (why none, when none).

    ``target``: a ``FLASHOT_CPU_MARCH`` value (None: pick the best for this CPU; ``native``: none)."""
    root = root or package_dir()
    man = _manifest(root)
    shipped = [v for v in (man or {}).get("variants", {}) if any(v in vs for vs in VARIANTS.values())]
    flags, machine = build._cpu_flags(), platform.machine()
    out = {"dir": root, "shipped": shipped, "runs": [v for v in shipped if runs_on(v, flags, machine)],
           "selected": None, "reason": None, "compiler": None}
    if man is None:
        out["reason"] = "no prebuilt kernels in this install (a source or editable install)"
    elif target == "native":
        out["reason"] = "FLASHOT_CPU_MARCH=native asks for a build for this exact CPU"
    elif target is not None and target not in shipped:
        out["reason"] = f"FLASHOT_CPU_MARCH={target} is not a prebuilt variant ({', '.join(shipped) or 'none'})"
    else:
        v = target or select_variant(flags, machine, shipped)
        if v is None:
            out["reason"] = f"this CPU ({machine}) runs none of the prebuilt variants ({', '.join(shipped)})"
        elif man["variants"][v].get("key") != source_key(build._read_sources(), v):
            out["reason"] = f"the prebuilt {v} kernels were built from other sources than this package's"
        else:
            out["selected"], out["compiler"] = v, man["variants"][v].get("compiler")
    return out


def find(library: str, target: str | None = None, root: str | None = None) -> tuple[str, dict] | None:
    """The prebuilt ``library`` to load -> (path, its facts for ``BUILD_INFO``), or None (compile instead).

    ``target``: as in :func:`status`.  Raises :class:`PrebuiltError` for a file that is unsafe to load."""
    st = status(target, root)
    v = st["selected"]
    if v is None:
        return None
    path = os.path.join(st["dir"], v, f"{library}.so")
    if not os.path.exists(path):
        return None
    check_package_file(path, st["dir"])
    return path, {"prebuilt": v, "march": v, "compiler": st["compiler"] or "?"}


# ---- the wheel build (setup.py) ---------------------------------------------------------------------

def variants_for_platform(plat: str) -> tuple[str, ...]:
    """The variants a wheel for platform tag ``plat`` (``linux_x86_64``, ``manylinux_2_28_aarch64``, ...)
    carries."""
    for arch in VARIANTS:
        if plat.endswith(arch) or (arch == "x86_64" and plat.endswith("amd64")):
            return VARIANTS[arch]
    return ()


def _compiler_for(variant: str) -> str | None:
    """The host compiler for the host's architecture, a cross compiler for the other one."""
    arch = next(a for a, vs in VARIANTS.items() if variant in vs)
    if _arch(platform.machine()) == arch:
        return build._find_compiler()
    return shutil.which(CROSS_CXX[arch])


def wheel_variants(plat: str, setting: str | None) -> tuple[list[str], list[str]]:
    """The variants to compile for a wheel -> (variants, notes).

    ``setting``: ``FLASHOT_WHEEL_KERNELS``: unset or ``auto`` (every variant of the platform that a
    compiler is found for), ``none`` (a source-only wheel: kernels compiled on first use), or a
    comma-separated list of variants (each must compile)."""
    setting = (setting or "auto").strip()
    if setting == "none":
        return [], ["FLASHOT_WHEEL_KERNELS=none: no prebuilt kernels"]
    allowed = variants_for_platform(plat)
    if setting == "auto":
        have = [v for v in allowed if _compiler_for(v)]
        notes = [f"no compiler for {v} (for {plat})" for v in allowed if v not in have]
        return have, notes
    asked = [v.strip() for v in setting.split(",") if v.strip()]
    bad = [v for v in asked if v not in allowed]
    if bad:
        raise build.BuildError(f"FLASHOT_WHEEL_KERNELS: {', '.join(bad)} not a variant of {plat} "
                               f"({', '.join(allowed) or 'none'})")
    return asked, []


def build_variants(out: str, variants: list[str], log=print) -> dict:
    """Compile (or take from the kernel cache) both libraries of each variant into ``out``
    (``out/<variant>/<library>.so``) and write ``out/manifest.json`` -> the manifest.

    The libraries come from :func:`.build.build_in_cache`: the compile recipe and cache of first use, so
    a variant compiled there already (the same sources, flags and compiler) is copied, not rebuilt."""
    sources = build._read_sources()
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(out)
    man = {"format": FORMAT, "abi_version": build.ABI_VERSION, "variants": {}}
    for v in variants:
        cxx = _compiler_for(v)
        if cxx is None:
            arch = next(a for a, vs in VARIANTS.items() if v in vs)
            raise build.BuildError(f"no compiler for the {v} kernels (on {platform.machine()}: "
                                   f"{'g++ or CXX' if _arch(platform.machine()) == arch else CROSS_CXX[arch]})")
        os.makedirs(os.path.join(out, v))
        for library in build.LIBRARIES:
            path, secs, cached = build.build_in_cache(library, v, cxx, sources, quiet=True)
            shutil.copyfile(path, os.path.join(out, v, f"{library}.so"))
            os.chmod(os.path.join(out, v, f"{library}.so"), 0o755)
            log(f"flashot: prebuilt {v} {library}: " + ("from the kernel cache" if cached else f"compiled in {secs:.0f} s"))
        ver = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
        man["variants"][v] = {"key": source_key(sources, v), "compiler": (ver.splitlines() or [cxx])[0].strip()}
    with open(os.path.join(out, MANIFEST), "w", encoding="utf-8") as f:
        json.dump(man, f, indent=1, sort_keys=True)
    return man
