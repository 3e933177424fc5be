"""The wheel build's side of the prebuilt kernels (called by ``setup.py``; the loading side is
:mod:`.prebuilt`): which variants a wheel for a platform carries, and compiling them.

The libraries are compiled by :func:`.build.build_many_in_cache`, the recipe and the cache of first use,
so a variant already compiled there (the same sources, flags and compiler: the test suite's
``FLASHOT_CPU_MARCH=x86-64-v3`` runs, a previous wheel build) is copied, not rebuilt.  This module
imports nothing but the standard library and its siblings: ``setup.py`` loads it without torch.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess

from . import build, prebuilt

__all__ = ["CROSS_CXX", "build_variants", "compiler_for", "variants_for_platform", "wheel_variants"]

# the compiler for each architecture when the build machine is another one (Debian's cross compilers)
CROSS_CXX = {"x86_64": "x86_64-linux-gnu-g++", "aarch64": "aarch64-linux-gnu-g++"}


def variants_for_platform(plat: str) -> tuple[str, ...]:
    """The variants a wheel for platform tag ``plat`` (``linux_x86_64``, ``manylinux_2_28_aarch64``, ...)
    carries."""
    for arch, variants in prebuilt.VARIANTS.items():
        if plat.endswith(arch) or (arch == "x86_64" and plat.endswith("amd64")):
            return variants
    return ()


def _arch_of(variant: str) -> str:
    return next(a for a, vs in prebuilt.VARIANTS.items() if variant in vs)


def compiler_for(variant: str) -> str | None:
    """The host compiler for the host's architecture (``CXX``, ``g++``, ...), a cross compiler
    (:data:`CROSS_CXX`) for the other one; None when there is none."""
    arch = _arch_of(variant)
    if prebuilt.arch(platform.machine()) == arch:
        return build.find_compiler()
    return shutil.which(CROSS_CXX[arch])


def wheel_variants(plat: str, setting: str | None) -> tuple[list[str], list[str]]:
    """The variants to compile for a wheel -> (variants, notes for the build log).

    ``setting``: ``FLASHOT_WHEEL_KERNELS``: unset or ``auto`` (every variant of the platform that a
    compiler is found for), ``none`` (a source-only wheel: kernels compiled on first use), or a
    comma-separated list of variants (each must compile)."""
    setting = (setting or "auto").strip()
    if setting == "none":
        return [], ["FLASHOT_WHEEL_KERNELS=none: no prebuilt kernels"]
    allowed = variants_for_platform(plat)
    if setting == "auto":
        have = [v for v in allowed if compiler_for(v)]
        notes = [
            f"no compiler for the prebuilt {v} kernels of a {plat} wheel: left out" for v in allowed if v not in have
        ]
        return have, notes
    asked = [v.strip() for v in setting.split(",") if v.strip()]
    bad = [v for v in asked if v not in allowed]
    if bad:
        raise build.BuildError(
            f"FLASHOT_WHEEL_KERNELS: {', '.join(bad)} not a variant of {plat} ({', '.join(allowed) or 'none'})"
        )
    return asked, []


def build_variants(out: str, variants: list[str], log=print) -> dict[str, dict]:
    """Compile (or take from the kernel cache) both libraries of each variant into ``out``
    (``out/<variant>/<library>.so``) and write ``out/manifest.json`` -> the manifest's variants."""
    compilers = {v: compiler_for(v) for v in variants}
    for v, cxx in compilers.items():
        if cxx is None:
            arch = _arch_of(v)
            need = "g++ or CXX" if prebuilt.arch(platform.machine()) == arch else CROSS_CXX[arch]
            raise build.BuildError(f"no compiler for the prebuilt {v} kernels (on {platform.machine()}: {need})")
    sources = build.read_sources()
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(out)
    entries = {}
    for v, cxx in compilers.items():
        os.makedirs(os.path.join(out, v))
        built = build.build_many_in_cache(tuple(build.LIBRARIES), v, cxx, sources, quiet=True)  # compiled together
        for library, (path, secs, cached) in built.items():
            dest = os.path.join(out, v, f"{library}.so")
            shutil.copyfile(path, dest)
            os.chmod(dest, 0o755)
            log(
                f"flashot: prebuilt {v} {library}: "
                + ("from the kernel cache" if cached else f"compiled in {secs:.0f} s")
            )
        ver = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
        entries[v] = {"key": build.source_key(sources, v), "compiler": (ver.splitlines() or [cxx])[0].strip()}
    prebuilt.write_manifest(out, entries, build.ABI_VERSION)
    return entries
