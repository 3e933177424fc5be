"""All four CPU kernel libraries compiled together (one pool of compilers, ``build.build_many_in_cache``)
against one library after another (``build.build_in_cache`` each), alternated, each in a fresh cache:

    python benchmarks/build_pool_ab.py [--march native] [--rounds 2]

Prints the wall time of each. Name the CPU beside the figures.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from flashot.ops.cpu import build


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--march", default="native")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    cxx = build.find_compiler()
    if cxx is None:
        raise SystemExit("no C++ compiler")
    for _ in range(args.rounds):
        for how in ("one after another", "together"):
            d = tempfile.mkdtemp()
            os.chmod(d, 0o700)
            t = time.perf_counter()
            if how == "together":
                build.build_many_in_cache(tuple(build.LIBRARIES), args.march, cxx, d=d)
            else:
                for lib in build.LIBRARIES:
                    build.build_in_cache(lib, args.march, cxx, d=d)
            print(f"{how}: {time.perf_counter() - t:.1f} s", flush=True)
            shutil.rmtree(d)


if __name__ == "__main__":
    main()
