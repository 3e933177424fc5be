"""Compile the ``cpu`` engine's libraries for this machine into the kernel cache, with any Python 3 and no torch.

tests/ci.sh runs it while pip installs the environment (pip keeps one core busy, the compilers take the
other), so the default run's first-use compile (tests/conftest.py) finds the libraries cached.  It compiles
what a process with the same environment compiles at first use: the same sources, ``FLASHOT_CPU_MARCH``
(native when unset), compiler and cache directory (``FLASHOT_CACHE_DIR`` or ``~/.cache/flashot``), through
the same function (``flashot.ops.cpu.build.build_all``).  ``flashot.ops.cpu`` imports nothing but the
standard library; it is loaded from the source tree under a private name, as setup.py loads it.

With arguments (``build_kernels.py x86-64-v2 x86-64-v3``) it compiles those ``-march`` levels instead, the
ones the slow tests rebuild the engine for (tests/ops/test_isa_matrix.py, test_cpu_build.py, the wheel of
tests/docs/test_packaging.py), under the key those tests' builds use (``build.build_many_in_cache``); a
level this CPU cannot run (any x86-64 level on another architecture) is skipped with a message, as those
tests skip it.

Exit status 0 when the libraries are cached or built, or when there is no C++ compiler (nothing to do: the
test run then reports the cpu engine's fallback); 1 when a build fails (the message is printed).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import platform
import sys
import time

CPU = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src", "flashot", "ops", "cpu")


def _build_module():
    name = "_flashot_cpu_prebuild"
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(CPU, "__init__.py"), submodule_search_locations=[CPU]
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return importlib.import_module(name + ".build")


def main(levels: list[str]) -> int:
    build = _build_module()
    cxx = build.find_compiler()
    if cxx is None:
        print("flashot kernels: no C++ compiler on PATH: nothing built")
        return 0
    prebuilt = importlib.import_module(build.__package__ + ".prebuilt")
    status = 0
    for level in levels or [None]:
        if level is not None and not prebuilt.runs_on(level, build.cpu_flags(), platform.machine()):
            print(f"flashot kernels ({level}): skipped, this CPU does not run it")
            continue
        name, t0 = level or build.march(), time.perf_counter()
        try:
            if level is None:  # what a first use compiles
                built = {lib: r[:3] for lib, r in build.build_all(quiet=True).items()}
            else:
                built = build.build_many_in_cache(tuple(build.LIBRARIES), level, cxx)
        except build.BuildError as e:
            print(f"flashot kernels ({name}): the build failed: {str(e)[:2000]}")
            status = 1
            continue
        fresh = [lib for lib, (_, _, cached) in built.items() if not cached]
        what = f"compiled {', '.join(fresh)}" if fresh else "all cached"
        print(f"flashot kernels ({name}): {what} in {time.perf_counter() - t0:.1f} s", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
