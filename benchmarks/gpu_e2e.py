"""End-to-end GPU check: whole losses, multiscale and Gromov-Wasserstein on a card.

    python benchmarks/gpu_e2e.py [--budget 120] [--parts losses,multiscale,gw] [--out benchmarks/gpu_e2e.md]
    TRITON_INTERPRET=1 python benchmarks/gpu_e2e.py --quick --device cpu   # structure smoke test

(1) ``SamplesLoss("sinkhorn", p=2, blur=0.05)`` value + gradient in x (debiased, epsilon-scaling
    0.5, cost |x - y|^2 / 2) on 3-D float32 clouds, n = m in {1e4, 1e5, 1e6}, against GeomLoss'
    ``online`` and ``multiscale`` backends (KeOps) and flash-sinkhorn's ``SamplesLoss`` with the same
    convention (``half_cost=True``, ``debias=True``, strict fp32).  Agreement is measured against
    flashot in float64 where that fits (n = 1e4), else against flashot float32: max |value
    difference| / |value| and max |grad difference| / max |grad|.
(2) ``SamplesLoss(backend="multiscale")`` on the card at 1e6 and 1e7 points (3-D, blur 0.01 x
    diameter): time, peak GPU memory, and the kept fraction of pairs at the last pruning; flash-sinkhorn's
    multiscale forward (``backend="multiscale"``, which takes no ``diameter`` and rounds coordinates to
    TF32) beside it where it runs.
(3) ``gromov_wasserstein`` at n = m = 1e5 (float32): time, outer / inner iterations, peak memory,
    with POT's default tolerances (``tol=1e-9``; the loop stops at its rounding bound in float32).

Every timing is one call after a warm-up call on a smaller problem of the same kind (compiles and
autotuning excluded where the warm-up covers them: Triton autotunes per size bucket, so the first
call at a new bucket may include tuning; such cells are marked ``*``).  Each part has its own time
budget (``--budget`` seconds) and skips what would not fit; a skipped cell says so.  Peers that cannot
be imported are reported as missing; KeOps is first probed in a subprocess (see ``gpu_check.py``).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import flashot

LINES: list[str] = []


def log(msg: str = "") -> None:
    print(msg, flush=True)
    LINES.append(msg)


def table_head(title: str, *columns: str) -> None:
    log(f"## {title}\n")
    log("| " + " | ".join(columns) + " |")
    log("|" + "---|" * len(columns))


def gib(peak: int | None) -> str:
    return f"{peak / 2**30:.2f}" if peak is not None else "-"


def release(device: torch.device) -> None:
    """Give cached GPU memory back between measurements (peak memory is per measurement)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def log_error(cells: str, e: Exception, blanks: int) -> None:
    """Print the traceback and log a table row: ``cells``, the error, then ``blanks`` empty cells."""
    traceback.print_exc()
    msg = str(e).splitlines()[0][:80] if str(e) else ""
    log(f"| {cells} | error: {type(e).__name__}: {msg} |" + " |" * blanks)


class Clock:
    """A part's time budget: ``left()`` seconds remain of ``budget``."""

    def __init__(self, budget: float):
        self.t0, self.budget = time.perf_counter(), budget

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.t0)

    def skip(self, est: float) -> str | None:
        """Why a step estimated at ``est`` seconds does not fit, or None."""
        if self.left() <= 0:
            return "skipped (part's time budget spent)"
        if est > self.left():
            return f"skipped (time: ~{est:.0f} s estimated, {self.left():.0f} s left)"
        return None


def timed(fn, device: torch.device):
    """(result, seconds, peak GPU bytes or None) of one synchronised call."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    return out, time.perf_counter() - t0, peak


def clouds(n: int, device, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 3, generator=g, dtype=torch.float64)
    y = torch.rand(n, 3, generator=g, dtype=torch.float64) * 0.8 + 0.1
    y[:, 0] += 0.3
    return x.to(device, dtype), y.to(device, dtype)


# --------------------------------------------------------------------------- (1) losses
def loss_runners(args) -> dict:
    """name -> (make(n) -> callable(x, y) -> loss) or a reason string."""
    kw = dict(p=2, blur=0.05, scaling=0.5, debias=True)
    out: dict = {"flashot": lambda: flashot.SamplesLoss("sinkhorn", backend=args.backend, **kw)}
    try:
        import geomloss
        from gpu_check import keops_unusable

        reason = keops_unusable(torch.device(args.device))
        if reason:
            raise RuntimeError(f"KeOps {reason}")
        out["geomloss-online"] = lambda: geomloss.SamplesLoss("sinkhorn", backend="online", **kw)
        out["geomloss-multiscale"] = lambda: geomloss.SamplesLoss("sinkhorn", backend="multiscale", **kw)
    except Exception as e:
        why = str(e) if isinstance(e, RuntimeError) else f"missing ({type(e).__name__})"
        out["geomloss-online"] = out["geomloss-multiscale"] = why
    try:
        import flash_sinkhorn as fs

        out["flash-sinkhorn"] = (
            (lambda: fs.SamplesLoss("sinkhorn", half_cost=True, allow_tf32=False, **kw))
            if args.device == "cuda"
            else "needs CUDA"
        )
    except Exception as e:
        out["flash-sinkhorn"] = f"missing ({type(e).__name__})"
    return out


def value_grad(L, x, y):
    xx = x.detach().clone().requires_grad_()
    v = L(xx, y)
    (gx,) = torch.autograd.grad(v, xx)
    return v.detach().double().reshape(()), gx.detach().double()


def part_losses(args, device, clock: Clock) -> None:
    sizes = (300, 600) if args.quick else (10_000, 100_000, 1_000_000)
    runners = loss_runners(args)
    table_head(
        "(1) SamplesLoss('sinkhorn', p=2, blur=0.05) value + gradient, 3-D float32",
        "n = m",
        "peer",
        "time (s)",
        "peak GPU mem (GiB)",
        "value",
        "rel. value diff",
        "rel. grad diff",
        "against",
    )
    last: dict[str, float] = {}
    for i, n in enumerate(sizes):
        x, y = clouds(n, device)
        ref, ref_name = None, ""
        if i == 0:  # float64 reference where it is cheap (dense-free: flashot's streamed engines)
            L64 = flashot.SamplesLoss("sinkhorn", p=2, blur=0.05, backend=args.backend)
            ref = value_grad(L64, x.double(), y.double())
            ref_name = "flashot f64"
        for name, make in runners.items():
            if isinstance(make, str):
                log(f"| {n} | {name} | {make} | | | | | |")
                continue
            est = last.get(name, 0.0) * (n / sizes[i - 1]) ** 2 if i else 0.0
            if name.endswith("multiscale"):
                est = last.get(name, 0.0) * (n / sizes[i - 1]) * 2 if i else 0.0
            if clock.skip(est):
                log(f"| {n} | {name} | {clock.skip(est)} | | | | | |")
                continue
            try:
                L = make()
                if i == 0:
                    value_grad(L, x, y)  # warm-up: compiles, KeOps builds, autotuning
                (v, gx), t, peak = timed(lambda: value_grad(L, x, y), device)
                last[name] = t
                star = "*" if i > 0 and name in ("flashot", "flash-sinkhorn") else ""
                if ref is None:
                    ref, ref_name = (v, gx), name
                dv = abs(v - ref[0]).item() / max(abs(ref[0].item()), 1e-30)
                dg = ((gx - ref[1]).abs().max() / ref[1].abs().max()).item()
                log(
                    f"| {n} | {name} | {t:.3f}{star} | {gib(peak)} | {v.item():.6g} | {dv:.1e} | {dg:.1e} | {ref_name} |"
                )
            except Exception as e:
                log_error(f"{n} | {name}", e, blanks=5)
            release(device)
    log("")


# --------------------------------------------------------------------------- (2) multiscale
def part_multiscale(args, device, clock: Clock) -> None:
    sizes = (2_000, 5_000) if args.quick else (1_000_000, 10_000_000)
    table_head(
        "(2) multiscale, 3-D float32, blur = 0.01 x diameter",
        "n = m",
        "solver",
        "time (s)",
        "peak GPU mem (GiB)",
        "value",
        "kept pairs (last pruning)",
    )
    try:
        import flash_sinkhorn as fs
    except Exception:
        fs = None
    prev: dict[str, float] = {}
    for i, n in enumerate(sizes):
        x, y = clouds(n, device, seed=1)
        diam = math.sqrt(3) * 1.3
        blur = 0.01 * diam
        for name in ("flashot", "flash-sinkhorn"):
            est = prev.get(name, 0.0) * n / sizes[i - 1] if i else 0.0
            if clock.skip(est):
                log(f"| {n} | {name} | {clock.skip(est)} | | | |")
                continue
            if name == "flash-sinkhorn" and (fs is None or device.type != "cuda"):
                log(f"| {n} | {name} | {'missing' if fs is None else 'needs CUDA'} | | | |")
                continue
            try:
                if name == "flashot":
                    L = flashot.SamplesLoss("sinkhorn", p=2, blur=blur, diameter=diam, backend="multiscale")
                else:  # its multiscale takes no diameter and always rounds coordinates to TF32
                    L = fs.SamplesLoss("sinkhorn", p=2, blur=blur, half_cost=True, debias=True, backend="multiscale")
                if i == 0:
                    xs, ys = clouds(20_000 if not args.quick else 500, device, seed=2)
                    L(xs, ys)  # warm-up: compiles
                v, t, peak = timed(lambda: L(x, y), device)
                prev[name] = t
                kept = "-"
                if name == "flashot" and L.last_multiscale is not None:
                    kept = f"{L.last_multiscale.kept[-1]:.2e}" if L.last_multiscale.kept else "none"
                log(f"| {n} | {name} | {t:.2f} | {gib(peak)} | {float(v):.6g} | {kept} |")
            except Exception as e:
                log_error(f"{n} | {name}", e, blanks=3)
            release(device)
    log("")


# --------------------------------------------------------------------------- (3) GW
def part_gw(args, device, clock: Clock) -> None:
    sizes = (200, 400) if args.quick else (10_000, 100_000)
    table_head(
        "(3) gromov_wasserstein, float32, X uniform in the unit cube (3-D), Y = X rotated (+ noise)",
        "n = m",
        "time (s)",
        "peak GPU mem (GiB)",
        "outer",
        "inner",
        "converged",
        "last change",
        "value",
    )
    prev = 0.0
    for i, n in enumerate(sizes):
        g = torch.Generator().manual_seed(3)
        X = torch.rand(n, 3, generator=g, dtype=torch.float64)
        Q, _ = torch.linalg.qr(torch.randn(3, 3, generator=g, dtype=torch.float64))
        Y = X @ Q.T + 0.01 * torch.randn(n, 3, generator=g, dtype=torch.float64)
        X, Y = X.to(device, torch.float32), Y.to(device, torch.float32)
        est = prev * (n / sizes[i - 1]) ** 2 if i else 0.0
        if clock.skip(est):
            log(f"| {n} | {clock.skip(est)} | | | | | | |")
            continue
        try:
            r, t, peak = timed(lambda: flashot.gromov_wasserstein(X, Y, reg=1.0, backend=args.backend), device)
            prev = t
            log(
                f"| {n} | {t:.2f} | {gib(peak)} | {r.n_outer} | {r.n_inner} | {r.converged} | {float(r.error):.2e} | "
                f"{float(r.value):.6g} |"
            )
        except Exception as e:
            log_error(str(n), e, blanks=6)
    log("")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (smoke run)")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (needs TRITON_INTERPRET=1)")
    ap.add_argument("--backend", default="auto", help="flashot engine for (1) and (3) (default auto)")
    ap.add_argument("--budget", type=float, default=120.0, help="seconds for each part")
    ap.add_argument("--parts", default="losses,multiscale,gw")
    ap.add_argument("--out", default=str(Path(__file__).with_name("gpu_e2e.md")))
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu and TRITON_INTERPRET=1 for a smoke test", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    log(f"# flashot end-to-end check on {name}\n")
    log(f"torch {torch.__version__}, flashot {flashot.__version__}, budget {args.budget:.0f} s\n")
    t0 = time.perf_counter()
    parts = {"losses": part_losses, "multiscale": part_multiscale, "gw": part_gw}
    for p in args.parts.split(","):
        if p not in parts:
            ap.error(f"--parts: unknown part {p!r}; expected some of {sorted(parts)}")
        parts[p](args, device, Clock(args.budget))
    log(f"total {time.perf_counter() - t0:.0f} s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(LINES) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
