"""The ``cpu`` engine's memory budget for cached cost matrices (``FLASHOT_CPU_CACHE_BYTES``).

The default is a fraction of the memory the process may use: the physical memory, or the cgroup's
limit when lower (a container's limit is what an out-of-memory kill enforces).
"""

from __future__ import annotations

import os

__all__ = ["MIN_DEFAULT_CACHE_BYTES", "memory_bytes", "default_cache_bytes", "env_bytes"]

MIN_DEFAULT_CACHE_BYTES = 256 << 20


def memory_bytes() -> int | None:
    """Physical memory, or the cgroup (v2 / v1) memory limit when that is lower."""
    total = None
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                v = f.read().strip()
            if v.isdigit() and (total is None or int(v) < total):
                total = int(v)
        except OSError:
            pass
    return total


def default_cache_bytes() -> int:
    """1/8 of the machine's (or cgroup's) memory, at least 256 MiB (1 GiB if unknown)."""
    mem = memory_bytes()
    return 1 << 30 if mem is None else max(MIN_DEFAULT_CACHE_BYTES, mem // 8)


def env_bytes(name: str, default: int) -> int:
    """The integer number of bytes in the environment variable ``name`` (``default`` when unset or empty)."""
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    try:
        return int(float(v))
    except ValueError:
        raise ValueError(f"{name}: expected an integer number of bytes, got {v!r}") from None
