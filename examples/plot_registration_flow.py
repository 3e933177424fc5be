"""
Point-cloud registration by a Sinkhorn gradient flow
====================================================

A 3-D *source* cloud (a torus, rotated, shrunk and shifted) is registered onto a
*target* torus sampled independently: its points move down the gradient of the
debiased Sinkhorn divergence

.. math::

    S_\\varepsilon(\\alpha, \\beta) = \\mathrm{OT}_\\varepsilon(\\alpha, \\beta)
        - \\tfrac12 \\mathrm{OT}_\\varepsilon(\\alpha, \\alpha)
        - \\tfrac12 \\mathrm{OT}_\\varepsilon(\\beta, \\beta),

computed by :class:`flashot.SamplesLoss` (GeomLoss' arguments: ``p=2`` is the cost
``|x - y|^2 / 2``, ``blur`` the length scale, ``eps = blur^2``).  Each step is an
explicit Euler step of the Wasserstein gradient flow,
``x_i <- x_i - lr * grad_{x_i} S / a_i`` (``a_i = 1 / n`` the weight of point ``i``),
with the gradient from ``loss.backward()``: flashot differentiates the last
Sinkhorn update analytically, never through the iterations, and never stores
an ``n x n`` matrix.  The loss drops by orders of magnitude: the script prints
the factor.

``FLASHOT_EXAMPLE_SMALL=1`` runs a smaller problem (the tests and the
documentation build do); ``FLASHOT_EXAMPLE_OUT=DIR`` saves the figure and the
printed numbers there.
"""

# %%
# Two tori
# --------
import json
import math
import os
import time

import matplotlib.pyplot as plt
import torch

import flashot

SMALL = os.environ.get("FLASHOT_EXAMPLE_SMALL") == "1"
OUT = os.environ.get("FLASHOT_EXAMPLE_OUT")
N = 400 if SMALL else 3000
STEPS = 20 if SMALL else 40
LR = 0.5
gen = torch.Generator().manual_seed(0)


def torus(n, R=1.0, r=0.35):
    u, v = 2 * math.pi * torch.rand(n, generator=gen), 2 * math.pi * torch.rand(n, generator=gen)
    return torch.stack(
        [(R + r * torch.cos(v)) * torch.cos(u), (R + r * torch.cos(v)) * torch.sin(u), r * torch.sin(v)], -1
    )


def rotation(ax, ay):
    cx, sx, cy, sy = math.cos(ax), math.sin(ax), math.cos(ay), math.sin(ay)
    Rx = torch.tensor([[1, 0, 0], [0, cx, -sx], [0, sx, cx]])
    Ry = torch.tensor([[cy, 0, sy], [0, 1, 0], [-sy, 0, cy]])
    return Rx @ Ry


target = torus(N)
source = 0.7 * torus(N) @ rotation(0.9, 0.5).T + torch.tensor([1.5, -0.8, 0.6])

# %%
# The flow
# --------
# ``lr = 0.5``: each step moves every point half-way to where the current
# transport plan sends it.
loss_fn = flashot.SamplesLoss("sinkhorn", p=2, blur=0.02, scaling=0.7)
x = source.clone().requires_grad_()
losses, snapshots = [], {0: source.clone()}
t0 = time.perf_counter()
for step in range(STEPS + 1):
    loss = loss_fn(x, target)
    losses.append(loss.item())
    if step == STEPS:
        break
    (grad,) = torch.autograd.grad(loss, [x])
    with torch.no_grad():
        x -= LR * N * grad  # a_i = 1 / N: the Wasserstein gradient is N * grad
    if step + 1 in (2, 5):
        snapshots[step + 1] = x.detach().clone()
elapsed = time.perf_counter() - t0
snapshots[STEPS] = x.detach().clone()
factor = losses[0] / losses[-1]
print(
    f"{STEPS} steps of {N} points in {elapsed:.1f} s: loss {losses[0]:.3g} -> {losses[-1]:.3g} "
    f"(divided by {factor:.0f})"
)

# %%
# Snapshots and the loss
# ----------------------
fig = plt.figure(figsize=(15, 4.8))
tgt = target.numpy()
for k, (step, pts) in enumerate(snapshots.items()):
    ax = fig.add_subplot(1, len(snapshots) + 1, k + 1, projection="3d")
    p = pts.numpy()
    ax.scatter(tgt[:, 0], tgt[:, 1], tgt[:, 2], s=1.5, c="tab:blue", alpha=0.35, label="target")
    ax.scatter(p[:, 0], p[:, 1], p[:, 2], s=1.5, c="tab:red", alpha=0.5, label="source (moving)")
    ax.set_title(f"step {step}: S = {losses[step]:.2g}")
    ax.set_xlim(-1.5, 2.5)
    ax.set_ylim(-2, 1.5)
    ax.set_zlim(-1, 1.5)
    ax.set_xticklabels([])
    ax.set_yticklabels([])
    ax.set_zticklabels([])
    ax.set_box_aspect(None, zoom=1.35)
    if k == 0:
        ax.legend(loc="upper left", markerscale=4)
ax = fig.add_subplot(1, len(snapshots) + 1, len(snapshots) + 1)
ax.semilogy(losses, "o-", ms=3)
ax.set_xlabel("gradient step")
ax.set_ylabel("Sinkhorn divergence S (log scale)")
ax.set_title(f"loss divided by {factor:.0f}")
ax.grid(True, which="both", alpha=0.3)
fig.suptitle(f"Registration of a torus by a Sinkhorn gradient flow (n = m = {N}, blur = 0.02, lr = {LR})")
fig.tight_layout()

if OUT:
    fig.savefig(os.path.join(OUT, "plot_registration_flow.png"), dpi=80)
    with open(os.path.join(OUT, "plot_registration_flow.json"), "w") as f:
        json.dump({"losses": losses, "factor": factor, "seconds": elapsed}, f)
