"""
Domain adaptation on two moons with the barycentric map
=======================================================

A classifier is trained on labelled *source* data, then used on *target* data
whose distribution has moved (here: the two moons rotated by 20 degrees and shifted), without
target labels.  Optimal-transport domain adaptation (Courty et al., 2017) moves
the source samples onto the target distribution with the entropic plan's
**barycentric map** ``T(x_i) = sum_j P_ij y_j / sum_j P_ij``
(``res.plan.barycentric_map()`` of :func:`flashot.solve_sample`, one streamed
plan product) and trains on the moved samples, which keep their labels.

The classifier is a 5-nearest-neighbour vote written in a few lines of torch
(no scikit-learn).  The script prints its accuracy on the target, trained on the
raw source and on the transported source.

``FLASHOT_EXAMPLE_SMALL=1`` runs a smaller problem (the tests and the
documentation build do); ``FLASHOT_EXAMPLE_OUT=DIR`` saves the figure and the
printed numbers there.
"""

# %%
# Two moons, and the same moons rotated
# -------------------------------------
import json
import math
import os

import matplotlib.pyplot as plt
import torch

import flashot

SMALL = os.environ.get("FLASHOT_EXAMPLE_SMALL") == "1"
OUT = os.environ.get("FLASHOT_EXAMPLE_OUT")
N = 300 if SMALL else 2000
gen = torch.Generator().manual_seed(0)


def two_moons(n, noise=0.08):
    """n points on two interleaved half circles, and their labels (0 or 1)."""
    labels = torch.arange(n) % 2
    t = math.pi * torch.rand(n, generator=gen)
    upper = torch.stack([torch.cos(t), torch.sin(t)], -1)
    lower = torch.stack([1 - torch.cos(t), 0.5 - torch.sin(t)], -1)
    pts = torch.where(labels[:, None] == 0, upper, lower)
    return pts + noise * torch.randn(n, 2, generator=gen), labels


angle = math.radians(20)
rot = torch.tensor([[math.cos(angle), -math.sin(angle)], [math.sin(angle), math.cos(angle)]])
xs, ys = two_moons(N)  # source: labelled
xt, yt = two_moons(N)  # target: labels used only to score
xt = (xt - 0.5) @ rot.T + torch.tensor([0.8, 0.5])


def knn_predict(train_x, train_y, test_x, k=5):
    """Majority vote of the k nearest training points."""
    idx = torch.cdist(test_x, train_x).topk(k, largest=False).indices
    return (train_y[idx].float().mean(1) > 0.5).long()


# %%
# Transport the source onto the target
# ------------------------------------
# ``reg = 0.05`` is small against the squared distance between the two moons,
# so each source point lands on the part of the target it is coupled with.
res = flashot.solve_sample(xs, xt, reg=0.05, tol=1e-4)
xs_moved = res.plan.barycentric_map()
print(f"solve: {res.n_iter} iterations, converged={res.converged}")

acc_raw = (knn_predict(xs, ys, xt) == yt).float().mean().item()
acc_ot = (knn_predict(xs_moved, ys, xt) == yt).float().mean().item()
print(f"target accuracy: {acc_raw:.1%} trained on the source, {acc_ot:.1%} trained on the transported source")

# %%
# Source, transported source, and the predictions on the target
# -------------------------------------------------------------
colors = torch.tensor([[0.12, 0.47, 0.71], [1.0, 0.5, 0.05]])  # class 0 blue, class 1 orange
fig, axes = plt.subplots(1, 3, figsize=(15, 4.8), sharex=True, sharey=True)
ax = axes[0]
ax.scatter(*xt.T, s=8, c="0.7", label="target (unlabelled)")
ax.scatter(*xs[ys == 0].T, s=8, c=[colors[0].tolist()], label="source, class 0")
ax.scatter(*xs[ys == 1].T, s=8, c=[colors[1].tolist()], label="source, class 1")
ax.set_title("labelled source and unlabelled target")
ax = axes[1]
ax.scatter(*xt.T, s=8, c="0.7", label="target (unlabelled)")
ax.scatter(*xs_moved[ys == 0].T, s=8, c=[colors[0].tolist()], label="transported, class 0")
ax.scatter(*xs_moved[ys == 1].T, s=8, c=[colors[1].tolist()], label="transported, class 1")
sel = torch.arange(0, N, max(1, N // 60))
for i in sel.tolist():
    ax.annotate(
        "",
        xy=xs_moved[i].tolist(),
        xytext=xs[i].tolist(),
        arrowprops=dict(arrowstyle="->", color="0.3", lw=0.6, alpha=0.6),
    )
ax.set_title("the barycentric map T moves the source\n(arrows: some samples)")
pred_ot = knn_predict(xs_moved, ys, xt)
wrong = pred_ot != yt
ax = axes[2]
ax.scatter(*xt.T, s=8, c=colors[pred_ot].numpy(), label="target, colour = predicted class")
ax.scatter(*xt[wrong].T, s=40, facecolors="none", edgecolors="r", label="misclassified")
ax.set_title(f"target accuracy of a 5-NN vote: {acc_ot:.0%}\n(trained on the raw source: {acc_raw:.0%})")
for ax in axes:
    ax.set_aspect("equal")
    ax.set_xlabel("x1")
    ax.legend(loc="lower left", fontsize=8)
axes[0].set_ylabel("x2")
fig.suptitle(f"OT domain adaptation, two moons rotated by 20 degrees (n = m = {N}, reg = 0.05)")
fig.tight_layout()

if OUT:
    fig.savefig(os.path.join(OUT, "plot_domain_adaptation.png"), dpi=80)
    with open(os.path.join(OUT, "plot_domain_adaptation.json"), "w") as f:
        json.dump({"acc_raw": acc_raw, "acc_ot": acc_ot}, f)
