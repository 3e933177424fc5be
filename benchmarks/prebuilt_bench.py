"""The wheel's prebuilt kernels (``x86-64-v4`` by default) against ``-march=native`` on this CPU.

Both ``core`` libraries are loaded in one process (ctypes loads each with its own symbols) and timed
interleaved -- prebuilt, native, prebuilt, native, ... -- so a load that comes and goes on a shared
machine hits both alike; the figures are medians.  Each timing is one streamed softmin
(``CpuEngine(mode="stream").softmin``, the Sinkhorn loop's hot kernel) on n = m points, eps = 0.1,
squared Euclidean cost, reported in G pairs / s.

The prebuilt library: the installed wheel's (``build.prebuilt_status()``) when there is one, else the
same file from the kernel cache (the wheel build copies it from there: same sources, flags and
compiler, ``build.build_in_cache``); the native one: ``build.build_in_cache("core_f32", "native", ...)`` (and ``core_f64``).

    python benchmarks/prebuilt_bench.py --n 10000 --dims 3,16,64 --threads 1 --repeats 15
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time

import torch

from flashot.costs import get_cost
from flashot.ops.cpu import abi, build
from flashot.ops.cpu.engine import CpuEngine


def _library(variant: str) -> tuple[build.Kernels, str]:
    """-> (the loaded, checked core libraries of both dtypes, where they came from)."""
    st = build.prebuilt_status() if variant != "native" else {"shipped": []}
    parts, where = {}, []
    for dt in build.DTYPES:
        name = f"core_{dt}"
        if variant in st["shipped"]:
            path, how = os.path.join(st["dir"], variant, f"{name}.so"), "installed wheel"
        else:
            cxx = build.find_compiler()
            if cxx is None:
                raise SystemExit(f"no prebuilt {variant} library installed and no compiler to build it")
            path, how = build.build_in_cache(name, variant, cxx, quiet=False)[0], "kernel cache"
        lib = ctypes.CDLL(path)
        abi.bind(lib, name)
        abi.check_version(lib, name, path)
        abi.check_layout(lib, name, path)
        parts[dt] = lib
        where.append(f"{how}: {path}")
    return build.Kernels("core", parts=parts), "; ".join(where)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=10000)
    ap.add_argument("--dims", type=lambda s: [int(v) for v in s.split(",")], default=[3, 16, 64])
    ap.add_argument("--dtypes", default="float32,float64")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--variant", default="x86-64-v4")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    libs = {}
    for name in (args.variant, "native"):
        lib, where = _library(name)
        libs[name] = lib
        print(f"{name}: {where} ({lib.flashot_vector_bytes() * 8}-bit vectors)")
    c = get_cost("sqeuclidean")
    n = args.n
    print(f"\nn = m = {n:,}, eps = 0.1, {args.threads} thread(s), median of {args.repeats} interleaved runs\n")
    print(f"| dtype | d | {args.variant} (G pairs/s) | native (G pairs/s) | {args.variant} / native |")
    print("|---|---:|---:|---:|---:|")
    for dt in args.dtypes.split(","):
        for d in args.dims:
            g = torch.Generator().manual_seed(d)
            x = (torch.randn(1, n, d, generator=g) / d**0.5).to(getattr(torch, dt))
            y = (torch.randn(1, n, d, generator=g) / d**0.5 + 0.1).to(getattr(torch, dt))
            h = torch.randn(1, n, generator=g).to(getattr(torch, dt))
            engines = {k: CpuEngine(lib, mode="stream", threads=args.threads) for k, lib in libs.items()}
            times: dict[str, list[float]] = {k: [] for k in engines}
            for e in engines.values():
                e.softmin(x, y, h, 0.1, c)  # warm-up
            for _ in range(args.repeats):
                for k, e in engines.items():
                    t0 = time.perf_counter()
                    e.softmin(x, y, h, 0.1, c)
                    times[k].append(time.perf_counter() - t0)
            rate = {k: n * n / statistics.median(ts) / 1e9 for k, ts in times.items()}
            print(
                f"| {dt} | {d} | {rate[args.variant]:.2f} | {rate['native']:.2f} | "
                f"{rate[args.variant] / rate['native']:.2f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
