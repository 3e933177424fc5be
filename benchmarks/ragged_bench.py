"""Ragged batch vs a Python loop over its problems (issue 38): ``SamplesLoss(...)(xs, ys)`` on lists of clouds
against ``[L(x, y) for x, y in zip(xs, ys)]``, value and gradient, on the ``cpu`` engine.

Default case: 256 problems of 50 to 2,000 points per cloud (uniform sizes), D = 3, float32, p = 2, blur = 0.05,
debiased, a fixed diameter (both runs follow the same schedule).  Reports the median time of each over
``--repeats`` runs (interleaved, so that a noisy machine slows both alike), their ratio and the largest relative
difference of the values.

    PYTHONPATH=src python benchmarks/ragged_bench.py [--problems 256] [--min 50] [--max 2000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

import flashot


def _clouds(args, gen):
    n = torch.randint(args.min, args.max + 1, (args.problems,), generator=gen).tolist()
    m = torch.randint(args.min, args.max + 1, (args.problems,), generator=gen).tolist()
    xs = [torch.randn(k, args.dim, generator=gen).requires_grad_() for k in n]
    ys = [torch.randn(k, args.dim, generator=gen) + 0.5 for k in m]
    return xs, ys


def _time(fn) -> tuple[float, torch.Tensor]:
    t = time.perf_counter()
    v = fn()
    return time.perf_counter() - t, v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", type=int, default=256)
    ap.add_argument("--min", type=int, default=50)
    ap.add_argument("--max", type=int, default=2000)
    ap.add_argument("--dim", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--blur", type=float, default=0.05)
    ap.add_argument("--threads", type=int, default=None, help="torch (and C++ kernel) threads; default torch's")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    xs, ys = _clouds(args, torch.Generator().manual_seed(0))
    L = flashot.SamplesLoss(p=2, blur=args.blur, diameter=8.0, backend=args.backend)

    def loop():
        v = torch.stack([L(x, y) for x, y in zip(xs, ys)])
        torch.autograd.grad(v.sum(), xs)
        return v.detach()

    def ragged():
        v = L(xs, ys)
        torch.autograd.grad(v.sum(), xs)
        return v.detach()

    ragged()  # builds the kernels once
    times = {"loop": [], "ragged": []}
    for _ in range(args.repeats):
        for name, fn in (("loop", loop), ("ragged", ragged)):
            t, v = _time(fn)
            times[name].append(t)
            if name == "loop":
                ref = v
            else:
                rel = float(((v - ref).abs() / ref.abs().clamp_min(1e-12)).max())
    med = {k: statistics.median(v) for k, v in times.items()}
    pts = sum(x.shape[0] for x in xs) + sum(y.shape[0] for y in ys)
    print(
        f"{args.problems} problems of {args.min}-{args.max} points (total {pts}), D={args.dim}, float32, "
        f"backend={args.backend}, torch threads {torch.get_num_threads()}, {platform.processor() or platform.machine()}"
    )
    print(f"loop   median {med['loop']:.3f} s  ({', '.join(f'{t:.2f}' for t in times['loop'])})")
    print(f"ragged median {med['ragged']:.3f} s  ({', '.join(f'{t:.2f}' for t in times['ragged'])})")
    print(f"ratio loop / ragged = {med['loop'] / med['ragged']:.2f}; largest relative value difference {rel:.2e}")


if __name__ == "__main__":
    main()
