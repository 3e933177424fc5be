"""Wasserstein gradient flow of entropic OT, with warm starts and the barycentric map.

Particles ``x`` (a Gaussian blob) flow towards a target cloud ``y`` (a noisy
crescent) by explicit Euler steps on ``W(x) = OT_eps(x, y)`` with the cost
``|x - y|^2 / 2`` and ``eps = blur^2`` (GeomLoss' ``p=2`` convention)::

    x_i  <-  x_i - lr * grad_{x_i} W / a_i        (a_i = 1 / n: the Wasserstein gradient)

* the gradient is the streamed first-order gradient of :func:`flashot.solve_sample`'s value;
* ``potentials_init`` warm-starts each solve from the previous step's potentials: every
  solve still runs to the same tolerance, in far fewer iterations than a cold start;
* at the end, the lazy plan's barycentric map ``T(x_i) = sum_j P_ij y_j / sum_j P_ij``
  (one streamed plan product) shows where each particle would still go (arrows).

Run ``python examples/gradient_flow.py --n 2000 --steps 40 --out flow.png``.  The figure
needs matplotlib: ``pip install "flashot[examples]"``.
"""

from __future__ import annotations

import argparse
import math
import time

try:
    import matplotlib
except ImportError as e:  # pragma: no cover - depends on the environment
    raise SystemExit(f'this example needs matplotlib: pip install "flashot[examples]" ({e})') from e

matplotlib.use("Agg")  # no display needed
import matplotlib.pyplot as plt
import torch

import flashot


def make_clouds(n: int, m: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = 0.15 * torch.randn(n, 2, generator=gen) + torch.tensor([-0.6, -0.3])
    t = math.pi * torch.rand(m, generator=gen)
    y = torch.stack([0.7 * torch.cos(t), 0.7 * torch.sin(t) - 0.2], -1)
    y = y + 0.04 * torch.randn(m, 2, generator=gen) + torch.tensor([0.4, 0.0])
    return x, y


def run(
    n: int = 1000,
    steps: int = 40,
    lr: float = 0.5,
    blur: float = 0.1,
    tol: float = 1e-4,
    out: str = "gradient_flow.png",
    seed: int = 0,
    backend: str = "auto",
) -> dict:
    """Run the flow, write the figure to ``out``; returns the history (losses, iterations, ...)."""
    x, y = make_clouds(n, int(1.2 * n), seed)
    x0 = x.clone()
    reg = blur**2  # GeomLoss' eps = blur^p with the cost |x - y|^2 / 2
    losses, iters, snaps = [], [], [x0.clone()]
    pots = None  # warm start: the previous step's potentials
    t0 = time.perf_counter()
    T0 = None
    for step in range(steps + 1):
        xr = x.clone().requires_grad_()
        res = flashot.solve_sample(
            xr, y, cost="half_sqeuclidean", reg=reg, tol=tol, max_iter=5000, potentials_init=pots, backend=backend
        )
        losses.append(float(res.value.detach()))
        iters.append(res.n_iter)
        pots = tuple(p.detach() for p in res.potentials)
        if step == 0:
            T0 = res.plan.barycentric_map()
        if step == steps:
            break
        (grad,) = torch.autograd.grad(res.value, xr)
        x = x - lr * n * grad  # a_i = 1/n: x_i - lr * (x_i - T(x_i)) for this cost
        if step in (steps // 4, steps // 2):
            snaps.append(x.clone())
    elapsed = time.perf_counter() - t0
    # Where would each particle still go?  Barycentric map of the last plan (one plan product).
    T = res.plan.barycentric_map()
    residual = float((T - x).norm(dim=-1).mean())
    initial = float((T0 - x0).norm(dim=-1).mean())
    cold_last = flashot.solve_sample(
        x, y, cost="half_sqeuclidean", reg=reg, tol=tol, max_iter=5000, backend=backend
    ).n_iter

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    ax = axes[0]
    ax.scatter(y[:, 0], y[:, 1], s=3, c="tab:red", alpha=0.4, label="target y")
    ax.scatter(x0[:, 0], x0[:, 1], s=3, c="tab:blue", alpha=0.6, label="x at t=0")
    sub = torch.arange(0, n, max(1, n // 60))
    ax.quiver(
        x0[sub, 0],
        x0[sub, 1],
        (T0 - x0)[sub, 0],
        (T0 - x0)[sub, 1],
        angles="xy",
        scale_units="xy",
        scale=1,
        width=0.003,
        alpha=0.7,
        label="barycentric map T(x) - x",
    )
    ax.set_title("t = 0: the barycentric map of the plan")
    ax.legend(loc="lower left", fontsize=8)
    ax = axes[1]
    ax.scatter(y[:, 0], y[:, 1], s=3, c="tab:red", alpha=0.3)
    for k, s in enumerate(snaps[1:], 1):
        ax.scatter(s[:, 0], s[:, 1], s=2, alpha=0.35, label=f"snapshot {k}")
    ax.scatter(x[:, 0], x[:, 1], s=3, c="k", label=f"x after {steps} steps")
    ax.set_title(f"flow (mean |T(x) - x|: {initial:.3f} -> {residual:.3f})")
    ax.legend(loc="lower left", fontsize=8)
    for ax in axes[:2]:
        ax.set_aspect("equal")
    ax = axes[2]
    ax.semilogy(losses, "o-", ms=3, label="OT_eps(x_t, y)")
    ax.set_xlabel("step")
    ax.set_ylabel("entropic OT value")
    ax2 = ax.twinx()
    ax2.step(range(len(iters)), iters, where="mid", c="tab:green", alpha=0.7, label="Sinkhorn iterations")
    ax2.set_ylabel("iterations per step (warm start after step 0)")
    ax.set_title(f"n = {n}, blur = {blur}, {elapsed:.1f} s")
    fig.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return {
        "losses": losses,
        "iterations": iters,
        "mean_displacement_initial": initial,
        "mean_displacement_final": residual,
        "x": x,
        "y": y,
        "out": out,
        "seconds": elapsed,
        "cold_iterations_last": cold_last,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--blur", type=float, default=0.1)
    p.add_argument("--backend", default="auto")
    p.add_argument("--out", default="gradient_flow.png")
    args = p.parse_args(argv)
    h = run(args.n, args.steps, args.lr, args.blur, out=args.out, backend=args.backend)
    print(
        f"S: {h['losses'][0]:.4g} -> {h['losses'][-1]:.4g}; iterations per step: "
        f"{h['iterations'][0]} cold, then {h['iterations'][1:]} warm "
        f"(a cold start at the last step: {h['cold_iterations_last']}); "
        f"mean |T(x) - x|: {h['mean_displacement_initial']:.3f} -> {h['mean_displacement_final']:.3f}; "
        f"{h['seconds']:.1f} s; wrote {h['out']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
