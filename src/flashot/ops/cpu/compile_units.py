"""Compiling the kernels' translation units: one compiler per core, largest unit first.

:mod:`.build` decides what to compile (the sources, the flags, the cache); this module runs the compilers.
Standard library only (``setup.py`` loads :mod:`.build`'s wheel side without torch).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time

UNIT_TIMEOUT_S = 900


def object_name(unit: str) -> str:
    """``x.cpp`` -> ``x.o``."""
    return unit[: -len(".cpp")] + ".o"


def cores() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def units_of(libraries: list[tuple[str, ...]]) -> tuple[str, ...]:
    """The units of several libraries (each a tuple of units, largest first), each unit once, largest first
    across them: the libraries' first units, then their second ones, ..."""
    n = max(map(len, libraries))
    return tuple(dict.fromkeys(u for i in range(n) for units in libraries for u in units[i : i + 1]))


def _reap(pr: subprocess.Popen, cpu: dict, unit: str) -> int | None:
    """``pr``'s exit code if it has ended (its compiler CPU seconds into ``cpu[unit]``), else None."""
    if not hasattr(os, "wait4"):
        return pr.poll()
    pid, status, ru = os.wait4(pr.pid, os.WNOHANG)
    if pid == 0:
        return None
    pr.returncode = os.waitstatus_to_exitcode(status)
    cpu[unit] = ru.ru_utime + ru.ru_stime
    return pr.returncode


def compile_parts(
    cxx: str, flags: list[str], work: str, parts: tuple[str, ...], env: dict, unit_flags: dict | None = None
) -> tuple[list[str], dict[str, float]]:
    """Compile the units ``parts`` in ``work`` (``cxx *flags *unit_flags[unit] -c unit -o unit.o``), at most
    one per core at a time, in the order given (largest first) -> (the compiler's error output of each unit
    that failed, each unit's compiler CPU seconds).

    Longest first on one job per core: the largest unit has a core to itself from the start and the others
    queue on the rest, so the wall time is about max(largest unit, total CPU / cores).  Started all at once,
    the small units would share the largest one's core while they run and delay it by about half their CPU
    time (a library's first use waits for its largest unit).  An exception here (an interrupt) kills the
    running compilers and starts no more."""
    pending, running, errs, cpu = list(parts), {}, [], {}
    jobs = max(1, min(cores(), len(parts)))
    try:
        while pending or running:
            while pending and len(running) < jobs:
                unit = pending.pop(0)
                log = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace", dir=work)  # no pipe to drain
                cmd = [cxx, *flags, *(unit_flags or {}).get(unit, ()), "-c", unit, "-o", object_name(unit)]
                pr = subprocess.Popen(cmd, cwd=work, stdout=subprocess.DEVNULL, stderr=log, text=True, env=env)
                running[unit] = (pr, log, time.monotonic())
            time.sleep(0.02)
            for unit, (pr, log, t0) in list(running.items()):
                rc = _reap(pr, cpu, unit)
                late = rc is None and time.monotonic() - t0 > UNIT_TIMEOUT_S
                if late:
                    pr.kill()
                    rc = pr.wait()
                if rc is None:
                    continue
                del running[unit]
                log.seek(0)
                if rc != 0:
                    errs.append((f"timed out after {UNIT_TIMEOUT_S} s. " if late else "") + log.read().strip())
                log.close()
    finally:
        for pr, log, _ in running.values():  # only after an exception
            pr.kill()
            pr.wait()
            log.close()
    return errs, cpu
