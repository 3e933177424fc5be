"""One-command GPU check of the ``triton`` engine: correctness, then speed.

    python benchmarks/gpu_check.py [--quick] [--out benchmarks/gpu_check.md]
    TRITON_INTERPRET=1 python benchmarks/gpu_check.py --quick --device cpu   # structure smoke test

(a) Correctness: the triton engine against the dense engine in float64 on the
    device (softmin, plan products with every weight, gradients, batched, ragged,
    d up to 1024, -inf weights), float32 / float16 / bfloat16 / TF32 / folded
    accuracy against float64, and ``flashot.SamplesLoss(..., backend="triton")``
    against ``backend="dense"`` (values and gradients, p = 1 and 2).
(b) Speed: 100 fixed-eps Sinkhorn iterations (both potentials per iteration)
    at n = m in {10k, 50k, 200k}, d in {3, 64}, float32 (strict IEEE unless
    ``--tf32``), sqeuclidean cost, eps = 0.1, points uniform in the unit cube:

    * ``flashot``:       alternating updates, ``f = softmin(x, y, log b + g/eps)``
      then ``g = softmin(y, x, log a + f/eps)``, two engine launches per iteration;
    * ``flashot-pair``:  symmetric updates, one ``softmin_pair`` launch per iteration;
    * ``flash-sinkhorn``: ``flash_sinkhorn.SamplesLoss(backend="alternating",
      use_epsilon_scaling=False, eps=eps, n_iters=100, potentials=True,
      debias=False, allow_tf32=<same as ours>)`` (their fixed-eps alternating
      solver, called once; includes their small per-call overhead);
    * ``keops``: GeomLoss' online backend kernel, written directly with
      ``pykeops`` LazyTensors: per iteration two ``(h_j - |x_i - y_j|^2 / eps)
      .logsumexp`` reductions (x->y then y->x), the same loop as ``flashot``.

    Each is warmed up (compile / autotune, excluded), then timed ``--runs``
    times (default 3) with ``torch.cuda.synchronize()`` around the loop; the
    median is reported with the ratio ``peer / flashot`` (> 1: we are faster).
    "Share of hardware limit" = the time a perfect kernel would need, bounded
    by exp throughput (2 n m exp per iteration) or by dot-product FLOPs
    (2 n m * 2 d per iteration, at the card's measured fp32-FMA or TF32 GEMM
    rate), divided by the measured time.  exp throughput is measured with a
    small Triton kernel of dependent exp2 chains in registers (not memory
    bound); GEMM rates with ``torch.matmul`` on 8192^2 matrices.

A time budget (``--budget`` seconds, default 300) skips the remaining runs of a
measurement when they would not fit; skipped cells say so.  Peers that cannot
be imported are reported as missing; nothing is installed.  KeOps is first
probed in a subprocess (one small reduction): a KeOps build that crashes
(pykeops 2.3 segfaulted on CUDA 13) is then reported instead of ending the run.
(c) ``--sweep SECONDS``: one softmin at n = m = 50k for a grid of pinned configs
(tiles, warps, stages; explicit and folded scores), d = 3 and 64.
The last thing printed is the timing table, also written as markdown to ``--out``.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import flashot
from flashot.costs import get_cost
from flashot.ops.dense import DenseEngine
from flashot.ops.registry import get_engine

LINES: list[str] = []


def log(msg: str = "") -> None:
    print(msg, flush=True)
    LINES.append(msg)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if torch.isnan(a).any():
        return float("nan")
    fin = torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), fin):
        return float("inf")
    return ((a[fin] - b[fin]).abs().max() / b[fin].abs().max().clamp_min(1e-300)).item()


# --------------------------------------------------------------------------- (a)
def check_correctness(device: torch.device, quick: bool) -> bool:
    from flashot.ops.triton import TritonEngine

    log("## (a) correctness: triton vs dense\n")
    dense = DenseEngine()
    eng = get_engine("triton", device=device, dtype=torch.float64, cost=get_cost("sqeuclidean"))
    ok = True
    g = torch.Generator(device="cpu").manual_seed(0)
    # Each (d-class, dtype, weight, flag) is a separate compile (~1-3 s): keep the list short.
    dims = (1, 3, 17, 64) if quick else (1, 3, 9, 17, 64, 130, 1024)
    log("| check | d | cost | max rel. err | tol | ok |")
    log("|---|---|---|---|---|---|")

    def row(name, d, cost, err, tol):
        nonlocal ok
        good = err <= tol
        ok &= good
        log(f"| {name} | {d} | {cost} | {err:.2e} | {tol:.0e} | {'yes' if good else 'NO'} |")

    B, N, M = 2, (37 if quick else 333), (45 if quick else 517)
    for d in dims:
        x = (torch.rand(B, N, d, generator=g, dtype=torch.float64) - 0.5).to(device)
        y = (torch.rand(B, M, d, generator=g, dtype=torch.float64) - 0.4).to(device)
        h = torch.randn(B, M, generator=g, dtype=torch.float64).to(device)
        h[:, 3] = -math.inf
        eps = 0.02 * d + 0.02
        # every cost at a few d; sqeuclidean everywhere (keeps compiles few)
        costs = ("sqeuclidean", "half_sqeuclidean", "euclidean") if d in (3, 17) else ("sqeuclidean",)
        for cname in costs:
            c = get_cost(cname)
            ref = dense.softmin(x, y, h, eps, c)
            row("softmin f64", d, cname, rel(eng.softmin(x, y, h, eps, c), ref), 1e-10)
            alpha = ref / eps
            V = torch.randn(B, M, d + 1, generator=g, dtype=torch.float64).to(device)
            for w in ("plan", "cost", "dcost"):
                row(
                    f"plan[{w}] f64",
                    d,
                    cname,
                    rel(
                        eng.plan_product(x, y, alpha, h, eps, V, c, w), dense.plan_product(x, y, alpha, h, eps, V, c, w)
                    ),
                    1e-10,
                )
            if cname == "sqeuclidean" and d in (3, 64):  # precision variants: few compiles
                hx = torch.randn(B, N, generator=g, dtype=torch.float64).to(device)
                f, gg = eng.softmin_pair(x, y, hx, h, eps, c)
                row("softmin_pair f64", d, cname, max(rel(f, ref), rel(gg, dense.softmin(y, x, hx, eps, c))), 1e-10)
                r32 = rel(eng.softmin(x.float(), y.float(), h.float(), eps, c), ref)
                row("softmin f32", d, cname, r32, 2e-5)
                row(
                    "softmin f32 fold",
                    d,
                    cname,
                    rel(TritonEngine(fold=True).softmin(x.float(), y.float(), h.float(), eps, c), ref),
                    2e-5,
                )
                row(
                    "softmin f32 tf32",
                    d,
                    cname,
                    rel(TritonEngine(allow_tf32=True).softmin(x.float(), y.float(), h.float(), eps, c), ref),
                    2e-2,
                )
                for hd in (torch.float16, torch.bfloat16):
                    xh, yh = x.to(hd), y.to(hd)
                    row(
                        f"softmin {str(hd)[6:]}",
                        d,
                        cname,
                        rel(eng.softmin(xh, yh, h.float(), eps, c), dense.softmin(xh.double(), yh.double(), h, eps, c)),
                        2e-5,
                    )
        # gradients through flashot.ops.softmin (autograd -> plan products)
        for cname in costs[::2]:
            grads = {}
            for be in ("dense", "triton"):
                xx, yy, hh = (t.detach().clone().requires_grad_() for t in (x, y, h))
                out = flashot.ops.softmin(xx, yy, hh, eps, cost=cname, backend=be)
                (out * torch.linspace(-1, 1, N, device=device, dtype=out.dtype)).sum().backward()
                grads[be] = (xx.grad, yy.grad, hh.grad)
            err = max(rel(a, b) for a, b in zip(grads["triton"], grads["dense"]))
            row("grad x,y,h f64", d, cname, err, 1e-9)

    # float32 gradient accuracy, explicit (default) vs FlashSinkhorn-folded scores, small eps
    from flashot.ops.autograd import softmin_fn

    for d in (3, 64):
        x = (torch.rand(1, 256, d, generator=g, dtype=torch.float64) - 0.5).to(device)
        y = (torch.rand(1, 300, d, generator=g, dtype=torch.float64) - 0.4).to(device)
        h = torch.randn(1, 300, generator=g, dtype=torch.float64).to(device)
        c, eps = get_cost("sqeuclidean"), 0.0025
        wts = torch.linspace(-1, 1, 256, device=device, dtype=torch.float64)

        def grads(e, dt):
            xx, yy, hh = (t.to(dt).detach().requires_grad_() for t in (x, y, h))
            out = softmin_fn(xx, yy, hh, eps, c, e)
            (out * wts.to(dt)).sum().backward()
            return out, xx.grad, yy.grad, hh.grad

        ref = grads(dense, torch.float64)
        for name, e in (
            ("explicit", TritonEngine(direct_max_d=0)),
            ("fold", TritonEngine(fold=True)),
            ("direct", TritonEngine()),
        ):
            if name == "direct" and d > 8:
                continue
            got = grads(e, torch.float32)
            row(
                f"grad f32 {name} eps={eps} (value, gx, gy, gh max)",
                d,
                "sqeuclidean",
                max(rel(a, b) for a, b in zip(got, ref)),
                1e-2,
            )

    # SamplesLoss end to end
    for p in (1, 2):
        for dt, tol in ((torch.float64, 1e-9), (torch.float32, 1e-4)):
            n = 64 if quick else 500
            x = torch.rand(n, 3, generator=g, dtype=torch.float64).to(device, dt)
            y = (torch.rand(n + 7, 3, generator=g, dtype=torch.float64) + 0.2).to(device, dt)
            res = {}
            for be in ("dense", "triton"):
                xx = x.clone().requires_grad_()
                val = flashot.SamplesLoss(p=p, blur=0.05, backend=be)(xx, y)
                (gx,) = torch.autograd.grad(val, xx)
                res[be] = (val.detach(), gx)
            err = max(
                rel(res["triton"][0].reshape(1), res["dense"][0].reshape(1)),
                rel(res["triton"][1], res["dense"][1]) if p == 2 else 0.0,
            )
            row(
                f"SamplesLoss p={p} {str(dt)[6:]}{' (value only)' if p == 1 else ''}",
                3,
                "half_sqeuclidean" if p == 2 else "euclidean",
                err,
                tol,
            )
    log(f"\ncorrectness: {'PASS' if ok else 'FAIL'}\n")
    return ok


# --------------------------------------------------------------------------- hardware
def hardware_limits(device: torch.device, quick: bool) -> dict[str, float]:
    """Measured exp2 rate (exp/s) and GEMM rates (FLOP/s) of this device."""
    import triton
    import triton.language as tl

    @triton.jit
    def exp_chain(ptr, ITERS: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(ptr + offs)
        for _ in range(ITERS):
            v = tl.exp2(v * -0.75)  # stays in (0, 1]; one FMA-pipe mul + one MUFU ex2
        tl.store(ptr + offs, v)

    out: dict[str, float] = {}
    block, iters = (128, 4) if quick else (1024, 8192)
    progs = 4 if quick else 132 * 64
    buf = torch.rand(progs * block, device=device)
    exp_chain[(progs,)](buf, ITERS=iters, BLOCK=block)
    sync(device)
    t = _time(lambda: exp_chain[(progs,)](buf, ITERS=iters, BLOCK=block), device, reps=3)
    out["exp/s"] = progs * block * iters / t
    n = 256 if quick else 8192
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        for name, tf32 in (("fp32 FLOP/s", False), ("tf32 FLOP/s", True)):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            a @ b
            t = _time(lambda: a @ b, device, reps=3)
            out[name] = 2 * n**3 / t
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    return out


def _time(fn, device, reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` runs, synchronised."""
    ts = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


# --------------------------------------------------------------------------- (b)
def loop_flashot(eng, cost, x, y, a_log, b_log, eps, iters, pair: bool):
    f = torch.zeros_like(a_log)
    g = torch.zeros_like(b_log)
    if pair:
        for _ in range(iters):
            f, g = eng.softmin_pair(x, y, a_log + f / eps, b_log + g / eps, eps, cost)
    else:
        for _ in range(iters):
            f = eng.softmin(x, y, b_log + g / eps, eps, cost)
            g = eng.softmin(y, x, a_log + f / eps, eps, cost)
    return f, g


_KEOPS_PROBE = """
import sys, torch
from pykeops.torch import LazyTensor
x = torch.rand(200, 3, device=sys.argv[1])
X, Y = LazyTensor(x[:, None, :]), LazyTensor(x[None, :, :])
print(float((-((X - Y) ** 2).sum(-1)).logsumexp(dim=1).sum()))
"""


def keops_unusable(device: torch.device) -> str | None:
    """Why KeOps cannot be timed here, or None.  KeOps builds its JIT engine on first use; on a
    CUDA version it does not support that build can crash the process (seen: a segmentation
    fault with pykeops 2.3 on CUDA 13), so a one-reduction probe runs in a subprocess first."""
    try:
        import pykeops  # noqa: F401
    except Exception as e:
        return f"missing ({type(e).__name__})"
    import subprocess

    try:
        r = subprocess.run(
            [sys.executable, "-c", _KEOPS_PROBE, device.type], capture_output=True, text=True, timeout=600
        )
    except subprocess.TimeoutExpired:
        return "probe timed out"
    if r.returncode != 0:
        how = f"signal {-r.returncode}" if r.returncode < 0 else f"exit {r.returncode}"
        last = (r.stderr.strip().splitlines() or [""])[-1][:60]
        return f"probe crashed ({how}{': ' + last if last else ''})"
    return None


def make_keops(x, y, eps):
    from pykeops.torch import LazyTensor

    X_i, Y_j = LazyTensor(x[:, None, :]), LazyTensor(y[None, :, :])
    Y_i, X_j = LazyTensor(y[:, None, :]), LazyTensor(x[None, :, :])
    C_xy = ((X_i - Y_j) ** 2).sum(-1)
    C_yx = ((Y_i - X_j) ** 2).sum(-1)
    a_log = torch.full((x.shape[0],), -math.log(x.shape[0]), device=x.device)
    b_log = torch.full((y.shape[0],), -math.log(y.shape[0]), device=x.device)

    def run(iters: int):
        f = torch.zeros_like(a_log)
        g = torch.zeros_like(b_log)
        for _ in range(iters):
            h_j = LazyTensor((b_log + g / eps)[None, :, None])
            f = -eps * (h_j - C_xy / eps).logsumexp(dim=1).view(-1)
            h_i = LazyTensor((a_log + f / eps)[None, :, None])
            g = -eps * (h_i - C_yx / eps).logsumexp(dim=1).view(-1)
        return f, g

    return run


def make_flash_sinkhorn(x, y, eps, tf32):
    import flash_sinkhorn as fs

    losses: dict[int, object] = {}

    def run(iters: int):
        if iters not in losses:
            losses[iters] = fs.SamplesLoss(
                loss="sinkhorn",
                p=2,
                blur=math.sqrt(eps),
                debias=False,
                potentials=True,
                backend="alternating",
                use_epsilon_scaling=False,
                eps=eps,
                n_iters=iters,
                allow_tf32=tf32,
            )
        return losses[iters](x, y)

    return run


def bench(device: torch.device, quick: bool, runs: int, budget: float, tf32: bool) -> list[dict]:
    from flashot.ops.triton import TritonEngine

    cost = get_cost("sqeuclidean")
    eng = TritonEngine(allow_tf32=tf32)
    sizes = (64, 100) if quick else (10_000, 50_000, 200_000)
    dims = (3, 64)
    iters = 3 if quick else 100
    eps = 0.1
    t_start = time.perf_counter()
    rows = []
    peers = ["flashot", "flashot-pair", "flash-sinkhorn", "keops"]
    missing: dict[str, str] = {}
    try:
        import flash_sinkhorn  # noqa: F401
    except Exception as e:
        missing["flash-sinkhorn"] = f"missing ({type(e).__name__})"
    reason = keops_unusable(device)
    if reason:
        missing["keops"] = reason
    for n in sizes:
        for d in dims:
            g = torch.Generator(device="cpu").manual_seed(n + d)
            x = torch.rand(1, n, d, generator=g).to(device)
            y = torch.rand(1, n, d, generator=g).to(device)
            c = (x.mean(1, keepdim=True) + y.mean(1, keepdim=True)) / 2
            x, y = (x - c).contiguous(), (y - c).contiguous()
            a_log = torch.full((1, n), -math.log(n), device=device)
            b_log = a_log.clone()
            row: dict = {"n": n, "d": d}
            for peer in peers:
                if peer in missing:
                    row[peer] = missing[peer]
                    continue
                try:
                    if peer in ("flashot", "flashot-pair"):
                        pair = peer == "flashot-pair"

                        def fn(k, pair=pair):
                            return loop_flashot(eng, cost, x, y, a_log, b_log, eps, k, pair)
                    elif peer == "keops":
                        fn = make_keops(x[0], y[0], eps)
                    else:
                        if device.type != "cuda":
                            row[peer] = "needs CUDA"
                            continue
                        fn = make_flash_sinkhorn(x[0], y[0], eps, tf32)
                    fn(2)  # warm-up: compile / autotune (excluded)
                    sync(device)
                    ts = []
                    for _ in range(runs):
                        sync(device)
                        t0 = time.perf_counter()
                        fn(iters)
                        sync(device)
                        ts.append(time.perf_counter() - t0)
                        left = budget - (time.perf_counter() - t_start)
                        if len(ts) < runs and left < 2 * ts[-1]:
                            break
                    row[peer] = statistics.median(ts)
                    row[peer + "_runs"] = len(ts)
                except Exception as e:  # a peer failing must not stop the check
                    row[peer] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
                    traceback.print_exc()
                if time.perf_counter() - t_start > budget:
                    missing.update({p: "skipped (time budget)" for p in peers})
            rows.append(row)
            log(f"  n={n} d={d}: " + ", ".join(f"{p}={_fmt(row.get(p))}" for p in peers))
    log("\nautotuned configs (kernel, n bucket, m bucket, d, dtype, ...) -> config:")
    for key, cfg in eng.tuned_configs().items():
        log(f"  {key[0][0]} n<={key[1]} m<={key[2]} d={key[3]} -> {cfg}")
    return rows


def sweep(device: torch.device, quick: bool, budget: float, hw: dict[str, float]) -> None:
    """Time one float32 softmin for a grid of pinned configs, explicit and folded scores, d = 3 and 64.

    Autotuning picks among a few candidates; this shows what the candidates leave on the table
    (tile shapes, warps, pipeline stages) so the lists can be chosen from measurements."""
    from flashot.ops.triton import TritonEngine
    from flashot.ops.triton.configs import KernelConfig

    n = 64 if quick else 50_000
    cost, eps = get_cost("sqeuclidean"), 0.1
    t_start = time.perf_counter()
    grid = [
        KernelConfig(bn, bm, w, st) for bn in (32, 64, 128) for bm in (32, 64, 128) for w in (4, 8) for st in (2, 3)
    ]
    if quick:
        grid = grid[:2]
    log(f"## (c) config sweep: one float32 softmin, n = m = {n}, median of 5 launches\n")
    log("| d | scores | config | ms | exp-bound share | FMA-bound share |")
    log("|---|---|---|---|---|---|")
    for d in (3, 64):
        g = torch.Generator(device="cpu").manual_seed(d)
        x = (torch.rand(1, n, d, generator=g) - 0.5).to(device)
        y = (torch.rand(1, n, d, generator=g) - 0.5).to(device)
        h = torch.zeros(1, n, device=device)
        for fold in (False, True):
            for cfg in grid:
                if time.perf_counter() - t_start > budget:
                    log(f"| {d} | ... | skipped (time budget) | | | |")
                    return
                eng = TritonEngine(config=cfg, fold=fold)
                try:
                    eng.softmin(x, y, h, eps, cost)
                    t = _time(lambda: eng.softmin(x, y, h, eps, cost), device, reps=5)
                except Exception as e:
                    log(f"| {d} | {'fold' if fold else 'explicit'} | {cfg} | error: {type(e).__name__} | | |")
                    continue
                t_exp = n * n / hw["exp/s"]
                t_fma = n * n * 2 * d / hw["fp32 FLOP/s"]
                log(
                    f"| {d} | {'fold' if fold else 'explicit'} | {cfg} | {t * 1e3:.2f} | {t_exp / t:.0%} | "
                    f"{t_fma / t:.0%} |"
                )
    log("")


def _fmt(v) -> str:
    return f"{v * 1e3:.1f} ms" if isinstance(v, float) else str(v)


def table(rows: list[dict], hw: dict[str, float], tf32: bool, iters: int) -> str:
    gemm = hw["tf32 FLOP/s" if tf32 else "fp32 FLOP/s"]
    head = (
        "| n = m | d | flashot (ms) | flashot-pair (ms) | flash-sinkhorn (ms) | ratio fs/ours | "
        "keops (ms) | ratio keops/ours | exp-bound share | dot-FLOP-bound share |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        n, d = r["n"], r["d"]
        ours = r.get("flashot")
        best = min([v for v in (ours, r.get("flashot-pair")) if isinstance(v, float)], default=None)

        def ratio(k):
            v = r.get(k)
            return f"{v / best:.2f}" if isinstance(v, float) and best else "-"

        if best:
            t_exp = 2 * n * n * iters / hw["exp/s"]
            t_dot = 2 * n * n * 2 * d * iters / gemm
            share_exp, share_dot = f"{t_exp / best:.0%}", f"{t_dot / best:.0%}"
        else:
            share_exp = share_dot = "-"
        lines.append(
            f"| {n} | {d} | {_ms(ours)} | {_ms(r.get('flashot-pair'))} | {_ms(r.get('flash-sinkhorn'))} | "
            f"{ratio('flash-sinkhorn')} | {_ms(r.get('keops'))} | {ratio('keops')} | {share_exp} | {share_dot} |"
        )
    return "\n".join(lines)


def _ms(v) -> str:
    return f"{v * 1e3:.1f}" if isinstance(v, float) else (str(v) if v is not None else "-")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, 3 iterations (smoke run)")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (needs TRITON_INTERPRET=1)")
    ap.add_argument("--out", default=str(Path(__file__).with_name("gpu_check.md")))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--budget", type=float, default=300.0, help="seconds allowed for part (b)")
    ap.add_argument("--tf32", action="store_true", help="time with TF32 dot products (ours and flash-sinkhorn)")
    ap.add_argument("--skip-correctness", action="store_true")
    ap.add_argument(
        "--sweep",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="after (b), time a grid of pinned configs for at most SECONDS (0: no sweep)",
    )
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu and TRITON_INTERPRET=1 for a smoke test", file=sys.stderr)
        return 2
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("--device cpu needs TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (triton interpreter)"
    import triton

    log(f"# flashot triton engine check on {name}\n")
    log(f"torch {torch.__version__}, triton {triton.__version__}, flashot {flashot.__version__}\n")
    ok: bool | None = None
    if not args.skip_correctness:
        # One pinned config: correctness does not need autotuning (4x fewer compiles).
        old = os.environ.get("FLASHOT_TRITON_CONFIG")
        os.environ["FLASHOT_TRITON_CONFIG"] = "BLOCK_N=64,BLOCK_M=64,num_warps=8,num_stages=2"
        try:
            ok = check_correctness(device, args.quick)
        except Exception:
            traceback.print_exc()
            log("correctness: ERROR (traceback above)")
            ok = False
        finally:
            if old is None:
                os.environ.pop("FLASHOT_TRITON_CONFIG", None)
            else:
                os.environ["FLASHOT_TRITON_CONFIG"] = old
    log(f"(a) took {time.perf_counter() - t0:.0f} s\n")
    hw = hardware_limits(device, args.quick)
    log("## hardware (measured)\n")
    log(
        f"exp2: {hw['exp/s'] / 1e12:.3g} Texp/s; GEMM fp32 (no TF32): {hw['fp32 FLOP/s'] / 1e12:.3g} TFLOP/s; "
        f"TF32: {hw['tf32 FLOP/s'] / 1e12:.3g} TFLOP/s\n"
    )
    log("## (b) timing\n")
    rows = bench(device, args.quick, args.runs, args.budget, args.tf32)
    if args.sweep:
        sweep(device, args.quick, args.sweep, hw)
    iters = 3 if args.quick else 100
    md = table(rows, hw, args.tf32, iters)
    prec = "TF32" if args.tf32 else "strict fp32"
    caption = (
        f"{iters} fixed-eps Sinkhorn iterations (eps = 0.1, sqeuclidean, float32, {prec}), median of "
        f"{args.runs} runs after warm-up; ratio = peer / best of ours (> 1: flashot faster); share = "
        f"ideal time at the measured exp2 or GEMM rate / our time. Total {time.perf_counter() - t0:.0f} s; "
        f"correctness {'skipped' if ok is None else 'PASS' if ok else 'FAIL'}."
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(LINES) + "\n\n" + caption + "\n\n" + md + "\n")
    print()
    print(caption)
    print(md)
    return 0 if ok is not False else 1


if __name__ == "__main__":
    sys.exit(main())
