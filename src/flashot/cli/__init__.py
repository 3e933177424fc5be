"""``flashot`` command line: ``flashot solve``, ``flashot demo``, ``flashot build`` and ``flashot bench``.

One module per command (``solve_options`` / ``solve_command``, ``demo_command``, ``build_command``; ``bench``
is :mod:`flashot.bench`), the option types they share in ``options`` and their one-line messages in
``output``; :func:`main` (the console entry point ``flashot``) dispatches on the first argument."""

from __future__ import annotations

import sys
from collections.abc import Callable

from ..demo_picture import DEMO_PNG, demo_png
from .build_command import build_cmd, cpu_model, torch_threads
from .demo_command import demo
from .solve_command import solve_cmd
from .solve_options import PROGRESS_MIN_PAIRS

__all__ = [
    "DEMO_PNG",
    "PROGRESS_MIN_PAIRS",
    "build_cmd",
    "cpu_model",
    "demo",
    "demo_png",
    "main",
    "solve_cmd",
    "torch_threads",
]


def _usage(cmds: dict[str, Callable[[list[str]], int]]) -> str:
    return (
        "usage: flashot [--version] {" + ",".join(cmds) + "} [options]\n"
        "  solve  entropic OT between two point-cloud files (.npy .npz .csv .txt .ply); see flashot solve --help\n"
        "  demo   solve a built-in problem (20,000 points per cloud) and print value, iterations, time, memory;\n"
        "         writes a PNG of a 2-D transport (barycentric-map arrows) when matplotlib is installed\n"
        "  build  load the CPU kernels now (the wheel's prebuilt ones, or compiled here: first use would) and print\n"
        "         the instruction set and path; --info says which would be used, compiling nothing\n"
        + ("  bench  time flashot against installed peers (see flashot bench --help)\n" if "bench" in cmds else "")
    )


def main(argv: list[str] | None = None) -> int:
    """The ``flashot`` command: ``flashot <command> [options]``; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("--version", "-V"):
        from .. import __version__

        print(f"flashot {__version__}")
        return 0
    cmds: dict[str, Callable[[list[str]], int]] = {"solve": solve_cmd, "demo": demo, "build": build_cmd}
    try:
        from ..bench import main as bench_main

        cmds["bench"] = bench_main
    except ImportError as e:  # only when the optional benchmark module is absent
        if "flashot.bench" not in str(e):
            raise
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in cmds:
        out = sys.stdout if argv and argv[0] in ("-h", "--help") else sys.stderr
        if argv and argv[0] not in ("-h", "--help"):
            print(f"flashot: unknown command {argv[0]!r} (choose from {', '.join(cmds)})", file=out)
        print(_usage(cmds), file=out)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return int(cmds[argv[0]](argv[1:]) or 0)
