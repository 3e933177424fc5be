"""What the commands print besides their results: errors and warnings as one line each, and the peak memory."""

from __future__ import annotations

import resource
import sys
import warnings
from collections.abc import Iterable


def one_line(e: object) -> str:
    """The first line of ``str(e)`` (at most 500 characters), or the exception's type name when empty."""
    lines = str(e).strip().splitlines()
    return (lines[0] if lines else type(e).__name__)[:500]


def print_warnings(prog: str, caught: Iterable[warnings.WarningMessage]) -> None:
    """Each caught warning as ``<prog>: warning: <first line>`` on stderr."""
    for w in caught:
        print(f"{prog}: warning: {one_line(w.message)}", file=sys.stderr)


def peak_rss_mib() -> float:
    """This process's peak resident memory in MiB (Linux reports ``ru_maxrss`` in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
