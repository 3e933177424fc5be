"""
Unbalanced transport ignores outliers
=====================================

Balanced optimal transport must move *all* the mass of the source onto *all* the
mass of the target, so a few outliers in the target pull a share of the source
across the plane.  Unbalanced OT replaces the marginal constraints by KL
penalties of strength ``rho``,

.. math::

    \\min_{P \\geq 0} \\; \\langle C, P \\rangle + \\varepsilon\\, \\mathrm{KL}(P \\,|\\, a \\otimes b)
        + \\rho\\, \\mathrm{KL}(P \\mathbf{1} \\,|\\, a) + \\rho\\, \\mathrm{KL}(P^\\top \\mathbf{1} \\,|\\, b),

so mass that would travel much farther than ``sqrt(rho)`` is cheaper to destroy
or create than to transport.  With :func:`flashot.solve_sample` this is
``unbalanced=rho`` (POT's ``reg_m``); with :class:`flashot.SamplesLoss` it is
``reach`` (``rho = reach^p``).  The script prints the share of the mass that
each plan sends to the outliers (streamed column sums of the plan, no ``n x m``
matrix).

``FLASHOT_EXAMPLE_SMALL=1`` runs a smaller problem (the tests and the
documentation build do); ``FLASHOT_EXAMPLE_OUT=DIR`` saves the figure and the
printed numbers there.
"""

# %%
# A source blob, a target blob and 10% outliers
# ---------------------------------------------
import json
import os

import matplotlib.pyplot as plt
import torch

import flashot

SMALL = os.environ.get("FLASHOT_EXAMPLE_SMALL") == "1"
OUT = os.environ.get("FLASHOT_EXAMPLE_OUT")
N = 150 if SMALL else 400
gen = torch.Generator().manual_seed(0)
x = 0.3 * torch.randn(N, 2, generator=gen)  # source
inliers = 0.3 * torch.randn(N, 2, generator=gen) + torch.tensor([1.5, 0.0])
n_out = N // 10
outliers = torch.tensor([5.0, 4.0]) + 0.25 * torch.randn(n_out, 2, generator=gen)
y = torch.cat([inliers, outliers])  # target
is_outlier = torch.arange(len(y)) >= N
print(f"source: {N} points; target: {N} points + {n_out} outliers ({is_outlier.float().mean():.1%} of its mass)")

# %%
# Balanced and unbalanced plans
# -----------------------------
# Same ``reg``; ``unbalanced=4.0``: the source-to-inlier squared distances
# (about 2 to 4) are worth paying, the ~40 to the outliers are not.  The
# unbalanced plan also moves less than all the mass (it prints how much): the
# KL penalties trade some mass for shorter moves.
reg, rho = 0.05, 4.0
balanced = flashot.solve_sample(x, y, reg=reg)
unbalanced = flashot.solve_sample(x, y, reg=reg, unbalanced=rho)
shares = {}
for name, res in (("balanced", balanced), ("unbalanced", unbalanced)):
    received = res.marginals[1]  # column sums P^T 1, streamed
    shares[name] = float(received[is_outlier].sum() / received.sum())
    print(
        f"{name:>10}: {shares[name]:.2%} of the transported mass goes to the outliers "
        f"(total mass moved {float(received.sum()):.3f})"
    )

# %%
# Where the mass goes
# -------------------
# Left and middle: each source point is joined to the target point it sends the
# most mass to (``plan.topk(1)``; line opacity: the plan entry).  Right: the mass each target
# point receives, relative to its own weight ``b_j``.
fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
b = torch.full((len(y),), 1.0 / len(y))
for ax, (name, res) in zip(axes[:2], (("balanced", balanced), ("unbalanced", unbalanced))):
    vals, idx = res.plan.topk(1)  # largest entry per row, streamed
    top = float(vals.max())
    for i in range(N):
        for v, j in zip(vals[i].tolist(), idx[i].tolist()):
            ax.plot([x[i, 0], y[j, 0]], [x[i, 1], y[j, 1]], "-", color="0.3", alpha=min(1.0, 0.8 * v / top), lw=0.6)
    ax.scatter(*x.T, s=10, c="tab:blue", label="source", zorder=3)
    ax.scatter(*y[~is_outlier].T, s=10, c="tab:orange", label="target", zorder=3)
    ax.scatter(*y[is_outlier].T, s=30, c="tab:red", marker="^", label="target outliers", zorder=3)
    ax.set_title(f"{name} plan: {shares[name]:.1%} of the mass to the outliers")
    ax.set_aspect("equal")
    ax.set_xlabel("x1")
    ax.set_ylabel("x2")
    ax.legend(loc="upper left")
ax = axes[2]
for name, res, color in (("balanced", balanced, "tab:gray"), ("unbalanced", unbalanced, "tab:green")):
    ratio = (res.marginals[1] / b).numpy()
    ax.hist(
        ratio[~is_outlier.numpy()],
        bins=32,
        range=(0, 1.6),
        histtype="step",
        lw=2,
        color=color,
        label=f"{name}: inliers",
    )
    ax.hist(
        ratio[is_outlier.numpy()],
        bins=32,
        range=(0, 1.6),
        histtype="stepfilled",
        alpha=0.4,
        color=color,
        label=f"{name}: outliers",
    )
ax.set_xlabel("mass received / weight b_j")
ax.set_ylabel("number of target points")
ax.set_title("mass received by each target point")
ax.legend()
fig.suptitle(f"Balanced vs unbalanced entropic OT (reg = {reg}, unbalanced = rho = {rho})")
fig.tight_layout()

if OUT:
    fig.savefig(os.path.join(OUT, "plot_unbalanced_outliers.png"), dpi=80)
    with open(os.path.join(OUT, "plot_unbalanced_outliers.json"), "w") as f:
        json.dump(
            {
                "outlier_mass_fraction": float(is_outlier.float().mean()),
                "share_balanced": shares["balanced"],
                "share_unbalanced": shares["unbalanced"],
            },
            f,
        )
