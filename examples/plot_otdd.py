"""
A dataset distance with labels (OTDD)
=====================================

Two labelled datasets can have the same points and still be different datasets: what
matters for transfer learning is also *which* points carry *which* label.  The optimal
transport dataset distance (OTDD, Alvarez-Melis and Fusi) compares labelled points with the
label-augmented cost

.. math::

    C((x, l), (y, l')) = w_f\\, |x - y|^2 + w_l\\, W[l, l'],

where ``W[c, c']`` is itself the entropic OT value between the points of class ``c`` in the
first dataset and those of class ``c'`` in the second.  :func:`flashot.otdd` computes ``W``
(all the class pairs as one ragged batch) and then the OT value under that cost, streamed: the ``N x M``
cost matrix is never built (:class:`flashot.LabelCost` adds the label term as a column bias
inside the engines' kernels).

Here a dataset ``A`` with three classes is compared with ``B``, the same classes moved a little
and relabelled (its label 0 is ``A``'s class 2, and so on), and with ``B'``, which has exactly
``B``'s points but labels that do not follow the clusters.  Plain OT between the points cannot
tell ``B`` from ``B'``; OTDD can, and ``W`` recovers which class of ``B`` is which class of ``A``.

``FLASHOT_EXAMPLE_SMALL=1`` runs a smaller problem (the tests and the documentation build
do); ``FLASHOT_EXAMPLE_OUT=DIR`` saves the figure and the printed numbers there.
"""

# %%
# Three labelled datasets
# -----------------------
import json
import os

import matplotlib.pyplot as plt
import torch

import flashot

SMALL = os.environ.get("FLASHOT_EXAMPLE_SMALL") == "1"
OUT = os.environ.get("FLASHOT_EXAMPLE_OUT")
n = 60 if SMALL else 200  # points per class
gen = torch.Generator().manual_seed(0)
centres = torch.tensor([[0.0, 0.0], [3.0, 0.0], [1.5, 2.5]])
XA = torch.cat([c + 0.5 * torch.randn(n, 2, generator=gen) for c in centres])
lA = torch.arange(3).repeat_interleave(n)
XB = torch.cat([c + torch.tensor([0.4, 0.3]) + 0.5 * torch.randn(n, 2, generator=gen) for c in centres])
relabel = torch.tensor([2, 0, 1])  # A's class k is B's class relabel[k]
lB = relabel[lA]
lB2 = torch.randint(0, 3, (3 * n,), generator=gen)  # B': B's points, labels at random

# %%
# Plain OT and OTDD
# -----------------
reg = 0.1
plain = flashot.solve_sample(XA, XB, reg=reg).value  # the points only: B and B' alike
res = flashot.otdd(XA, lA, XB, lB, reg=reg)
res2 = flashot.otdd(XA, lA, XB, lB2, reg=reg)
W = res.label_cost
match = W.argmin(1)  # the closest class of B for each class of A
print(f"plain OT(A, B) = OT(A, B') = {float(plain):.3f}")
print(f"OTDD(A, B)  = {float(res.value):.3f}")
print(f"OTDD(A, B') = {float(res2.value):.3f}")
print("closest class of B for A's classes 0, 1, 2:", match.tolist(), "(true:", relabel.tolist(), ")")

# %%
# The datasets and the class-to-class costs
# -----------------------------------------
# Left: the datasets (colour: label).  Right: ``W`` between the classes of ``A`` and ``B``
# and between those of ``A`` and ``B'``: one small entry per row for ``B``, none for ``B'``.
fig, axes = plt.subplots(1, 4, figsize=(18, 4.4))
colors = ["tab:blue", "tab:orange", "tab:green"]
for ax, (X, lab, title) in zip(axes[:2], ((XA, lA, "A"), (XB, lB2, "B and B' (labels of B')"))):
    for k in range(3):
        ax.scatter(*X[lab == k].T, s=8, c=colors[k], label=f"class {k}")
    ax.set_title(title)
    ax.set_aspect("equal")
    ax.legend(loc="upper right", fontsize=8)
for k in range(3):
    axes[1].scatter(*XB[lB == k].T, s=30, facecolors="none", edgecolors=colors[k], lw=0.4)
for ax, (Wk, title) in zip(
    axes[2:],
    ((W, f"W(A, B): OTDD {float(res.value):.2f}"), (res2.label_cost, f"W(A, B'): OTDD {float(res2.value):.2f}")),
):
    Wk = Wk.detach()
    im = ax.imshow(Wk, cmap="viridis", vmin=0, vmax=float(W.max()))
    for i in range(3):
        for j in range(3):
            ax.text(
                j,
                i,
                f"{float(Wk[i, j]):.2f}",
                ha="center",
                va="center",
                color="w" if float(Wk[i, j]) < 0.6 * float(W.max()) else "k",
            )
    ax.set_xticks(range(3))
    ax.set_yticks(range(3))
    ax.set_xlabel("class of the second dataset")
    ax.set_ylabel("class of A")
    ax.set_title(title)
    fig.colorbar(im, ax=ax, fraction=0.046)
fig.suptitle(f"OT dataset distance (reg = {reg}); plain OT between the points: {float(plain):.2f} for both")
fig.tight_layout()

if OUT:
    fig.savefig(os.path.join(OUT, "plot_otdd.png"), dpi=80)
    with open(os.path.join(OUT, "plot_otdd.json"), "w") as f:
        json.dump(
            {
                "plain": float(plain),
                "otdd": float(res.value),
                "otdd_shuffled": float(res2.value),
                "match": match.tolist(),
                "relabel": relabel.tolist(),
                "converged": bool(res.converged and res2.converged),
            },
            f,
        )
