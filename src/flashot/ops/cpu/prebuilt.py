"""Prebuilt kernels: the libraries a platform wheel ships, one build per instruction-set level.

A wheel built by ``setup.py`` (``python -m build --wheel``; the compiling side is :mod:`.wheel`) carries, beside
the kernel sources, ``prebuilt/<variant>/<library>.so`` for each library of :data:`.build.LIBRARIES`
(``core_f32.so``, ...) and each variant of its platform, and ``prebuilt/manifest.json``: per variant the source key (a hash of the sources, the
compile flags and the library layout, so a package whose sources were edited after the build
compiles instead of loading a stale binary) and the compiler.  The variants:

* x86-64: ``x86-64-v4`` (AVX-512 F/BW/CD/DQ/VL), ``x86-64-v3`` (AVX2, FMA, BMI1/2, F16C, MOVBE,
  LZCNT), ``x86-64-v2`` (SSE4.2, SSSE3, POPCNT): the levels of the x86-64 psABI, so one wheel
  runs on every x86-64 CPU of the last fifteen years with the widest vectors it has;
* AArch64: ``armv8-a`` (NEON is part of the base architecture).

At load the best variant this CPU runs is picked from the CPU's own feature flags
(``/proc/cpuinfo``, read by :func:`.build.cpu_flags`), never from the build machine's, and the
library's ABI is checked as for a compiled one (:mod:`.abi`).  A prebuilt library is loaded only
from this package's own directory, as a regular file that nobody can write who could not already
write the Python code that loads it (:func:`check_package_file`): never from a cache or temporary
directory.  ``FLASHOT_CPU_MARCH=native`` skips the prebuilt libraries and compiles for the exact
CPU (:mod:`.build`); ``FLASHOT_CPU_MARCH=<variant>`` picks that variant when it is shipped.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable

__all__ = [
    "DIRNAME",
    "VARIANTS",
    "X86_LEVELS",
    "PrebuiltError",
    "check_package_file",
    "find",
    "package_dir",
    "runs_on",
    "select_variant",
    "status",
]

DIRNAME = "prebuilt"
MANIFEST = "manifest.json"
FORMAT = 1
# per architecture, best first
VARIANTS = {"x86_64": ("x86-64-v4", "x86-64-v3", "x86-64-v2"), "aarch64": ("armv8-a",)}
# x86-64 micro-architecture levels (psABI): the /proc/cpuinfo flags each one adds to the one before
# ("abm" is LZCNT); a level needs its own and all lower levels' flags
X86_LEVELS = {
    "x86-64": [],
    "x86-64-v2": ["cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"],
    "x86-64-v3": ["avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"],
    "x86-64-v4": ["avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"],
}
_ARCH = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}


class PrebuiltError(RuntimeError):
    """A prebuilt library is unsafe to load (outside the package, or writable by someone else), or its
    manifest is unreadable."""


def package_dir() -> str:
    """The directory of the prebuilt libraries: inside this installed package, nowhere else."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), DIRNAME)


def arch(machine: str) -> str | None:
    """The architecture (a key of :data:`VARIANTS`) of a ``platform.machine()`` value, or None."""
    return _ARCH.get(machine.lower())


def level_flags(variant: str) -> list[str]:
    """The CPU flags an x86-64 level needs (its own and the lower levels')."""
    levels = list(X86_LEVELS)
    return [f for lvl in levels[: levels.index(variant) + 1] for f in X86_LEVELS[lvl]]


def runs_on(variant: str, flags: set[str], machine: str) -> bool:
    """Whether a CPU with these ``/proc/cpuinfo`` flags and this ``platform.machine()`` runs ``variant``."""
    a = arch(machine)
    if a is None or variant not in VARIANTS[a]:
        return False
    if a == "aarch64":
        return True  # armv8-a is the base architecture
    return all(f in flags for f in level_flags(variant))


def select_variant(flags: set[str], machine: str, available) -> str | None:
    """The best of ``available`` variants a CPU with ``flags`` (``/proc/cpuinfo``) runs, or None.

    Unknown flags (an empty set: no ``/proc/cpuinfo``) select nothing on x86-64, so the kernels are
    compiled for the CPU instead of guessing a level that might die of SIGILL."""
    a = arch(machine)
    return next((v for v in VARIANTS.get(a or "", ()) if v in available and runs_on(v, flags, machine)), None)


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
        raise PrebuiltError(
            f"prebuilt library {path} is not inside the installed package ({root}): refusing to load it"
        )
    if not stat.S_ISREG(os.lstat(path).st_mode):
        raise PrebuiltError(f"prebuilt library {path} is not a regular file (a symlink?): refusing to load it")
    ref = os.stat(os.path.abspath(__file__))
    uid = os.getuid() if hasattr(os, "getuid") else None
    p = real
    while True:
        st = os.stat(p)
        mode = stat.S_IMODE(st.st_mode)
        if (
            st.st_mode & stat.S_IWOTH
            or (uid is not None and st.st_uid not in (0, uid, ref.st_uid))
            or (st.st_mode & stat.S_IWGRP and not (ref.st_mode & stat.S_IWGRP and ref.st_gid == st.st_gid))
        ):
            raise PrebuiltError(
                f"prebuilt library {path}: {p} (owner uid {st.st_uid}, mode {mode:o}) can be "
                f"written by others than the owner of flashot's own code: refusing to load it; "
                f"reinstall flashot, or set FLASHOT_CPU_MARCH=native to compile the kernels"
            )
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


def status(
    key_of: Callable[[str], str], flags: set[str], machine: str, target: str | None = None, root: str | None = None
) -> dict:
    """What the prebuilt libraries offer here: ``shipped`` (variants in the package), ``runs`` (those this
    CPU runs), ``selected`` (the variant to load, or None), ``reason`` (why none, when none) and
    ``compiler`` (the selected one's).

    ``key_of(variant)``: this package's source key for ``variant`` (:func:`.build.source_key`), compared
    with the manifest's; ``flags`` / ``machine``: the CPU's ``/proc/cpuinfo`` flags and
    ``platform.machine()``; ``target``: a ``FLASHOT_CPU_MARCH`` value (None: the best level for this
    CPU; ``native``: none)."""
    root = root or package_dir()
    man = _manifest(root)
    shipped = [v for v in (man or {}).get("variants", {}) if any(v in vs for vs in VARIANTS.values())]
    out = {
        "dir": root,
        "shipped": shipped,
        "runs": [v for v in shipped if runs_on(v, flags, machine)],
        "selected": None,
        "reason": None,
        "compiler": None,
    }
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
        elif man["variants"][v].get("key") != key_of(v):
            out["reason"] = f"the prebuilt {v} kernels were built from other sources than this package's"
        else:
            out["selected"], out["compiler"] = v, man["variants"][v].get("compiler")
    return out


def find(
    library: str,
    key_of: Callable[[str], str],
    flags: set[str],
    machine: str,
    target: str | None = None,
    root: str | None = None,
) -> tuple[str, dict] | None:
    """The prebuilt ``library`` to load -> (path, its facts for ``BUILD_INFO``), or None (compile instead).

    Arguments as in :func:`status`.  Raises :class:`PrebuiltError` for a file that is unsafe to load."""
    st = status(key_of, flags, machine, target, root)
    v = st["selected"]
    if v is None:
        return None
    path = os.path.join(st["dir"], v, f"{library}.so")
    if not os.path.exists(path):
        return None
    check_package_file(path, st["dir"])
    return path, {"prebuilt": v, "march": v, "compiler": st["compiler"] or "?"}


def write_manifest(root: str, variants: dict[str, dict], abi_version: int) -> None:
    """``root/manifest.json``: ``variants`` = {variant: {"key": source key, "compiler": its --version line}}."""
    with open(os.path.join(root, MANIFEST), "w", encoding="utf-8") as f:
        json.dump({"format": FORMAT, "abi_version": abi_version, "variants": variants}, f, indent=1, sort_keys=True)
