"""GeomLoss' "Wasserstein gradient flows" tutorial, with flashot: 500 particles flow to 500 targets.

The tutorial's loop (``plot_gradient_flows_2D.py``), unchanged: explicit Euler steps on the
Sinkhorn divergence ``S_eps(x, y)`` = ``SamplesLoss("sinkhorn", p=2, blur=0.01)``::

    x_i  <-  x_i - lr * N * grad_{x_i} S_eps(x, y)        (lr = 0.05, int(5 / lr) + 1 = 101 steps)

with snapshots at t = 0, 0.25, 0.5, 1, 2, 5.  Each step is a full solve (epsilon-scaling
from the diameter down to blur^2 = 1e-4, debiased) and a gradient.  The tutorial samples two
PNG images; here both densities are our own, in the unit square: the particles start on a
noisy ring, the targets are a crescent and a blob.

``--impl geomloss`` runs the same loop with ``geomloss.SamplesLoss`` (``pip install geomloss``;
``--geomloss-backend tensorized`` by default), ``--impl both`` runs both and prints how far
apart the final particles are.  The figure needs matplotlib: ``pip install "flashot[examples]"``
(or ``--out ''`` for no figure).

Run ``python examples/geomloss_flow.py`` (``--backend cpu`` / ``tiled`` / ``dense`` to force
an engine; ``--n 2000`` for a bigger problem).
"""

from __future__ import annotations

import argparse
import math
import time

import torch

import flashot


def make_clouds(n: int, m: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Source: a noisy ring; target: a crescent plus a blob (float32, in the unit square)."""
    gen = torch.Generator().manual_seed(seed)
    t = 2 * math.pi * torch.rand(n, generator=gen)
    r = 0.18 + 0.03 * torch.randn(n, generator=gen)
    x = torch.stack([0.3 + r * torch.cos(t), 0.65 + r * torch.sin(t)], -1)
    k = m * 2 // 3
    s = math.pi * (0.15 + 0.7 * torch.rand(k, generator=gen))
    crescent = torch.stack([0.62 + 0.25 * torch.cos(s), 0.45 - 0.25 * torch.sin(s)], -1)
    crescent = crescent + 0.02 * torch.randn(k, 2, generator=gen)
    blob = torch.tensor([0.75, 0.75]) + 0.05 * torch.randn(m - k, 2, generator=gen)
    return x, torch.cat([crescent, blob])


def make_loss(impl: str, blur: float, backend: str, geomloss_backend: str):
    if impl == "flashot":
        return flashot.SamplesLoss("sinkhorn", p=2, blur=blur, backend=backend)
    if impl == "geomloss":
        try:
            import geomloss
        except ImportError as e:
            raise SystemExit(f"--impl geomloss needs the geomloss package: pip install geomloss ({e})") from e
        return geomloss.SamplesLoss("sinkhorn", p=2, blur=blur, backend=geomloss_backend)
    raise ValueError(f"impl: expected 'flashot' or 'geomloss', got {impl!r}")


def run(
    n: int = 500,
    lr: float = 0.05,
    blur: float = 0.01,
    impl: str = "flashot",
    backend: str = "auto",
    geomloss_backend: str = "tensorized",
    seed: int = 0,
    t_end: float = 5.0,
) -> dict:
    """The flow; returns the snapshots, the losses, the time and the final particles."""
    x, y = make_clouds(n, n, seed)
    loss = make_loss(impl, blur, backend, geomloss_backend)
    steps = int(t_end / lr) + 1
    shown = [int(t / lr) for t in (0, 0.25, 0.5, 1.0, 2.0, 5.0) if t <= t_end]
    snaps, losses = {}, []
    t0 = time.perf_counter()
    for i in range(steps):
        if i in shown:
            snaps[i * lr] = x.clone()
        xr = x.clone().requires_grad_()
        L = loss(xr, y)
        (g,) = torch.autograd.grad(L, [xr])
        losses.append(float(L.detach()))
        x = x - lr * len(x) * g
    seconds = time.perf_counter() - t0
    return {"x": x, "y": y, "snapshots": snaps, "losses": losses, "seconds": seconds, "steps": steps}


def plot(h: dict, out: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit(
            f"the figure needs matplotlib: pip install \"flashot[examples]\" (or --out '' to skip it) ({e})"
        ) from e
    snaps = h["snapshots"]
    fig, axes = plt.subplots(2, 3, figsize=(12, 8))
    for ax, (t, xs) in zip(axes.flat, snaps.items()):
        ax.scatter(h["y"][:, 0], h["y"][:, 1], s=3, c="tab:red", alpha=0.4)
        ax.scatter(xs[:, 0], xs[:, 1], s=3, c="tab:blue")
        ax.set_title(f"t = {t:.2f}")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_aspect("equal")
        ax.set_xticks([])
        ax.set_yticks([])
    for ax in list(axes.flat)[len(snaps) :]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=500)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--blur", type=float, default=0.01)
    p.add_argument("--impl", choices=["flashot", "geomloss", "both"], default="flashot")
    p.add_argument("--backend", default="auto", help="flashot engine (auto, cpu, tiled, dense, ...)")
    p.add_argument("--geomloss-backend", default="tensorized", help="GeomLoss backend (tensorized, online)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="geomloss_flow.png", help="figure ('' for none)")
    args = p.parse_args(argv)
    if args.n < 2 or args.lr <= 0 or args.blur <= 0:
        p.error("--n must be >= 2, --lr and --blur > 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    impls = ["flashot", "geomloss"] if args.impl == "both" else [args.impl]
    results = {}
    for impl in impls:
        h = run(args.n, args.lr, args.blur, impl, args.backend, args.geomloss_backend)
        results[impl] = h
        name = (
            f"flashot (backend={args.backend!r})"
            if impl == "flashot"
            else f"geomloss (backend={args.geomloss_backend!r})"
        )
        print(
            f"{name}: {h['steps']} steps, {h['seconds']:.1f} s ({1e3 * h['seconds'] / h['steps']:.0f} ms/step); "
            f"S_eps: {h['losses'][0]:.4g} -> {h['losses'][-1]:.4g}",
            flush=True,
        )
        if args.out:
            out = args.out if len(impls) == 1 else args.out.replace(".png", f"_{impl}.png")
            plot(h, out, f"{name}, n = {args.n}, blur = {args.blur}: {h['seconds']:.1f} s")
    if len(impls) == 2:
        d = (results["flashot"]["x"] - results["geomloss"]["x"]).norm(dim=-1).max()
        dl = max(abs(a - b) for a, b in zip(results["flashot"]["losses"], results["geomloss"]["losses"]))
        print(
            f"max |x_flashot - x_geomloss| at the end: {float(d):.2e}; max loss difference over the steps: {dl:.2e}; "
            f"time ratio geomloss / flashot: {results['geomloss']['seconds'] / results['flashot']['seconds']:.1f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
