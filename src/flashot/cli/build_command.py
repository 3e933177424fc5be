"""``flashot build``: load (or compile) the CPU kernels now and say which, or with ``--info`` which would be
used; also the CPU's name, which the benchmarks print beside every figure."""

from __future__ import annotations

import argparse
import os
import sys
from types import ModuleType


def cpu_model() -> str:
    """The CPU's vendor and model as the OS reports it (benchmarks name it beside every figure)."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model", "CPU part")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def torch_threads() -> int:
    """torch's intra-op thread count (the CPU engine's threads)."""
    import torch

    return torch.get_num_threads()


def build_cmd(argv: list[str] | None = None) -> int:
    """``flashot build``: exit 0 when the kernels load, 1 (one line on stderr) when they cannot be built."""
    p = argparse.ArgumentParser(
        prog="flashot build",
        description="Load the CPU kernels now (for images and CI) instead of at first use -- the wheel's prebuilt "
        "ones, or compiled here -- and say which. The instruction set follows FLASHOT_CPU_MARCH "
        "(default: the best prebuilt level this CPU runs, else native).",
    )
    p.add_argument(
        "--march",
        default=None,
        help="build for this -march instead (e.g. x86-64-v3, or native to "
        "compile for this CPU); sets FLASHOT_CPU_MARCH for this command",
    )
    p.add_argument(
        "--info",
        action="store_true",
        help="say which kernels would be used (prebuilt variant, compiler, cache) without compiling anything",
    )
    args = p.parse_args(argv)
    if args.march is not None:
        os.environ["FLASHOT_CPU_MARCH"] = args.march
    from flashot.ops.cpu import build

    if args.info:
        return _build_info(build)
    try:
        lib = build.load_library("core_f32")
        for name in build.LIBRARIES:  # both families, both dtypes
            build.load_library(name)
    except build.BuildError as e:
        print(f"flashot build: {e}", file=sys.stderr)
        return 1
    info = build.BUILD_INFO
    how = f"prebuilt {info['prebuilt']}" if info.get("prebuilt") else f"-march={info['march']}"
    print(
        f"CPU kernels for {cpu_model()}: {how}, {', '.join(info['isa'])}, "
        f"{lib.flashot_vector_bytes() * 8}-bit vectors, up to {torch_threads()} threads (torch.get_num_threads())"
    )
    for name, facts in info["libraries"].items():
        if facts.get("prebuilt"):
            how = f"prebuilt {facts['prebuilt']} (compiled by {facts['compiler']}), from the installed package"
        else:
            how = (
                "found in the cache"
                if facts["cached"]
                else (f"compiled in {facts['seconds']:.1f} s wall, {facts.get('cpu_seconds', 0.0):.1f} s CPU")
            )
        print(f"  {name}: {how}: {facts['path']}")
    return 0


def _build_info(build: ModuleType) -> int:
    """``flashot build --info``: the prebuilt variants and the one selected, or what first use compiles."""
    import platform

    try:
        st = build.prebuilt_status()
    except build.BuildError as e:
        print(f"flashot build: {e}", file=sys.stderr)
        return 1
    print(
        f"CPU: {cpu_model()} ({platform.machine()}); prebuilt variants in this install: "
        f"{', '.join(st['shipped']) or 'none'}; this CPU runs: {', '.join(st['runs']) or 'none'}"
    )
    if st["selected"]:
        print(
            f"kernels: prebuilt {st['selected']} (compiled by {st['compiler']}) from {st['dir']}; no compiler needed "
            f"(FLASHOT_CPU_MARCH=native compiles for this exact CPU instead)"
        )
        return 0
    cxx = build.find_compiler()
    print(
        f"kernels: compiled on first use with -march={build.march()}: {st['reason']}; compiler: "
        f"{cxx or 'none found (set CXX or install g++)'}; cache: {build.cache_dir()}"
    )
    return 0
