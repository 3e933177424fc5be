"""``flashot demo``'s picture: a 2-D transport at two values of ``reg`` (points and barycentric-map arrows)."""

from __future__ import annotations

import math
import os
import sys

DEMO_PNG = "flashot_demo.png"


def demo_png(path: str, backend: str, seed: int) -> int:
    """A 2-D picture that shows what the plan's barycentric map is and what ``reg`` does to it."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):  # before the solves
        print(f"flashot demo: error: cannot write {path}: the directory {folder} does not exist", file=sys.stderr)
        return 1
    try:
        import matplotlib
    except ImportError:
        print(
            "picture: skipped (matplotlib is not installed: pip install matplotlib, or pip install 'flashot[examples]')"
        )
        return 0
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    import flashot

    gen = torch.Generator().manual_seed(seed)
    n = 300
    x = torch.randn(n, 2, generator=gen, dtype=torch.float64) * 0.35 + torch.tensor([-1.5, 0.0], dtype=torch.float64)
    t = torch.rand(n, generator=gen, dtype=torch.float64) * math.pi  # a half-ring (crescent) on the right
    y = torch.stack([1.0 + torch.sin(t), torch.cos(t)], -1) + 0.06 * torch.randn(
        n, 2, generator=gen, dtype=torch.float64
    )
    regs = (0.01, 1.0)
    cmax = float(((x[:, None] - y[None]) ** 2).sum(-1).max())
    shown = torch.randperm(n, generator=gen)[:70]  # arrows for some points (all would hide the picture)
    color = x[:, 1]  # colour = the source point's height: the map keeps the order (top goes to top)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.9), sharex=True, sharey=True)
    for k, (ax, reg) in enumerate(zip(axes, regs)):
        res = flashot.solve_sample(x, y, reg=reg, tol=1e-6, max_iter=5000, backend=backend)
        _panel(ax, x, y, res, color, shown, reg, cmax, small=k == 0)
    axes[0].legend(loc="lower left", fontsize=8, framealpha=0.9)
    fig.suptitle(
        f"res = flashot.solve_sample(x, y, reg) on 2-D clouds ({n} + {n} points, cost |x - y|^2); "
        f"arrows: res.plan.barycentric_map() for {len(shown)} of the points",
        fontsize=11,
    )
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110, bbox_inches="tight")
    except OSError as e:
        print(f"flashot demo: error: cannot write {path}: {e.strerror or e}", file=sys.stderr)
        return 1
    finally:
        plt.close(fig)
    print(f"picture: {os.path.abspath(path)} (2-D transport: points and barycentric-map arrows at two reg values)")
    return 0


def _panel(ax, x, y, res, color, shown, reg: float, cmax: float, small: bool) -> None:
    """One panel: the clouds, the barycentric map of ``res``'s plan as arrows and crosses, what ``reg`` does."""
    T = res.plan.barycentric_map()
    ax.scatter(y[:, 0], y[:, 1], s=14, c="0.72", label="target points y_j", zorder=1)
    ax.scatter(x[:, 0], x[:, 1], s=14, c=color, cmap="viridis", label="source points x_i", zorder=3)
    d = T - x
    ax.quiver(
        x[shown, 0],
        x[shown, 1],
        d[shown, 0],
        d[shown, 1],
        color[shown],
        cmap="viridis",
        angles="xy",
        scale_units="xy",
        scale=1,
        width=0.003,
        headwidth=4,
        alpha=0.75,
        zorder=2,
    )
    ax.scatter(
        T[:, 0],
        T[:, 1],
        s=16,
        c=color,
        cmap="viridis",
        marker="x",
        linewidths=1.0,
        label="images T(x_i) = sum_j P_ij y_j / sum_j P_ij",
        zorder=4,
    )
    what = (
        "small reg: the plan is close to a matching; each x_i\nlands on the crescent, and the order (colour) is kept"
        if small
        else "large reg: each row of the plan spreads over many y_j,\nso every T(x_i) is pulled "
        "towards the target's mean"
    )
    ax.set_title(
        f"reg = {reg:g} (largest cost {cmax:.0f}): value {float(res.value):.3f}, {res.n_iter} iterations\n{what}",
        fontsize=10,
    )
    ax.set_aspect("equal")
    ax.grid(alpha=0.25)
