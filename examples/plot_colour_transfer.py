"""
Colour transfer between two images
==================================

Each pixel of an image is a point in the RGB cube.  Optimal transport between
the colours of a *source* image and those of a *target* image moves the source's
palette onto the target's while keeping its picture: the entropic plan ``P`` is
computed with :func:`flashot.solve_sample` (cost ``|x - y|^2``, ``reg`` = epsilon)
and every source pixel takes the colour its mass is sent to on average, the
**barycentric map**

.. math::

    T(x_i) = \\frac{\\sum_j P_{ij}\\, y_j}{\\sum_j P_{ij}},

one streamed plan product (``res.plan.barycentric_map()``): the ``n x m`` plan is
never stored.  The two images are drawn by this script (no download).  Because
the plan's marginals are uniform, the mean colour of the result equals the
target's mean colour (up to the solver's tolerance): the script prints both.

``FLASHOT_EXAMPLE_SMALL=1`` runs it on smaller images (the tests and the
documentation build do); ``FLASHOT_EXAMPLE_OUT=DIR`` saves the figure and the
printed numbers there.
"""

# %%
# Two synthetic images
# --------------------
# A warm sunset (orange sky, a yellow sun, dark hills) and a cool seascape
# (pale sky, teal sea, a green island).  Both are ``H x W x 3`` arrays in [0, 1].
import json
import os
import time

import matplotlib.pyplot as plt
import numpy as np
import torch

import flashot

SMALL = os.environ.get("FLASHOT_EXAMPLE_SMALL") == "1"
OUT = os.environ.get("FLASHOT_EXAMPLE_OUT")
H = W = 40 if SMALL else 128


def sunset(h, w):
    v, u = np.mgrid[0 : 1 : h * 1j, 0 : 1 : w * 1j]
    sky = np.stack([0.95 - 0.35 * v, 0.45 - 0.25 * v + 0.2 * (1 - v) ** 3, 0.25 + 0.35 * v], -1)
    sun = ((u - 0.65) ** 2 + (v - 0.45) ** 2) < 0.012
    sky[sun] = [1.0, 0.9, 0.35]
    hills = v > 0.68 + 0.08 * np.sin(7 * u) + 0.04 * np.cos(17 * u)
    sky[hills] = np.stack([0.25 + 0.1 * u, 0.12 + 0.05 * v, 0.15 + 0.05 * u], -1)[hills]
    return np.clip(sky, 0, 1)


def seascape(h, w):
    v, u = np.mgrid[0 : 1 : h * 1j, 0 : 1 : w * 1j]
    img = np.stack([0.65 + 0.2 * v, 0.8 + 0.1 * v, 0.95 + 0 * v], -1)  # pale sky
    sea = v > 0.5
    img[sea] = np.stack([0.05 + 0.1 * u, 0.35 + 0.2 * (1 - v), 0.45 + 0.2 * (1 - v)], -1)[sea]
    island = ((u - 0.3) ** 2 / 0.04 + (v - 0.52) ** 2 / 0.006) < 1
    img[island] = np.stack([0.15 + 0.1 * v, 0.5 + 0.2 * u, 0.2 + 0 * u], -1)[island]
    return np.clip(img, 0, 1)


source, target = sunset(H, W), seascape(H, W)
x = torch.tensor(source.reshape(-1, 3), dtype=torch.float32)  # n = H W source colours
y = torch.tensor(target.reshape(-1, 3), dtype=torch.float32)  # m = H W target colours
print(f"{x.shape[0]} source and {y.shape[0]} target pixels")

# %%
# Transport the colours
# ---------------------
# ``reg = 0.01`` is small against the squared colour distances (up to 3), so each
# pixel goes to a narrow set of target colours.  The barycentric map gives the
# new colour of every source pixel.
t0 = time.perf_counter()
res = flashot.solve_sample(x, y, reg=0.01, tol=1e-4)
mapped = res.plan.barycentric_map()
elapsed = time.perf_counter() - t0
print(f"solve + barycentric map: {elapsed:.2f} s, {res.n_iter} iterations, converged={res.converged}")
result = mapped.clamp(0, 1).reshape(H, W, 3).numpy()

mean_src, mean_tgt, mean_res = (c.reshape(-1, 3).mean(0) for c in (source, target, result))
gap_before = float(np.linalg.norm(mean_src - mean_tgt))
gap_after = float(np.linalg.norm(mean_res - mean_tgt))
print("mean colour (RGB): source", mean_src.round(3), "target", mean_tgt.round(3), "transferred", mean_res.round(3))
print(f"distance of the mean colour to the target's: {gap_before:.3f} before, {gap_after:.4f} after")

# %%
# The images and their colour distributions
# -----------------------------------------
# Top: the images.  Bottom: every pixel drawn at its (red, blue) coordinates in
# its own colour, on grey: the transferred image uses the target's palette, and
# its mean colour (the white cross) is the target's.
fig, axes = plt.subplots(2, 3, figsize=(11, 7.5))
titles = ["source (sunset)", "target (seascape)", "source with the target's colours"]
names = ["source", "target", "transferred"]
for ax, img, title in zip(axes[0], (source, target, result), titles):
    ax.imshow(img, interpolation="nearest")
    ax.set_title(title)
    ax.axis("off")
for ax, img, name in zip(axes[1], (source, target, result), names):
    c = img.reshape(-1, 3)
    ax.set_facecolor("0.45")  # pale and dark colours both show on grey
    ax.scatter(c[:, 0], c[:, 2], c=c, s=6, edgecolors="none")
    ax.scatter(*c.mean(0)[[0, 2]], marker="X", s=140, c="w", edgecolors="k", label="mean colour")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("red")
    ax.set_ylabel("blue")
    ax.set_title(f"pixel colours: {name}")
    ax.legend(loc="upper left")
fig.suptitle(
    f"Colour transfer by entropic OT ({x.shape[0]} x {y.shape[0]} pixels, reg = 0.01): "
    f"mean-colour gap to the target {gap_before:.3f} -> {gap_after:.4f}"
)
fig.tight_layout()

if OUT:
    fig.savefig(os.path.join(OUT, "plot_colour_transfer.png"), dpi=80)
    with open(os.path.join(OUT, "plot_colour_transfer.json"), "w") as f:
        json.dump(
            {"gap_before": gap_before, "gap_after": gap_after, "seconds": elapsed, "converged": bool(res.converged)}, f
        )
