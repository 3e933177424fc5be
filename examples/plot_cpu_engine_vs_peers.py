"""
The ``cpu`` engine against the peers (measured figures)
=======================================================

Seconds per Sinkhorn iteration of flashot's compiled ``cpu`` engine (what
``backend="auto"`` picks for CPU tensors) and of every peer in the same run, at
``n = m = 20,000`` points, ``d = 3`` and ``d = 64``, float32, ``eps = 0.1``.

Nothing is timed here: the numbers are **read from** ``BENCHMARKS.md`` (its
sections "n = m = 20,000, d = 3, float32, eps = 0.1" and "n = m = 20,000, d = 64,
float32, eps = 0.1"), which ``python benchmarks/run_benchmarks.py`` generated on
the machine it names: an AMD EPYC virtual machine with 2 vCPUs.  Figures from
other CPUs may differ; ``flashot bench --sizes 20000 --dims 3,64 --peers all``
measures yours.  The script prints, for each dimension, how many times slower
than flashot each peer was.
"""

# %%
# Read the two tables from BENCHMARKS.md
# --------------------------------------
import json
import os
import pathlib
import re

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

OUT = os.environ.get("FLASHOT_EXAMPLE_OUT")
try:
    ROOT = pathlib.Path(__file__).resolve().parents[1]
except NameError:  # run interactively from examples/
    ROOT = pathlib.Path.cwd().parent
text = (ROOT / "BENCHMARKS.md").read_text()


def read_section(d):
    """Rows of the section for n = m = 20,000 and dimension ``d``: (solver, s/iter, ratio, notes)."""
    head = re.search(rf"^## n = m = 20,000, d = {d}, float32, eps = 0\.1.*$", text, re.M)
    body = text[head.end() :].split("\n## ", 1)[0]
    rows = []
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 12 or not cells[0].startswith("n="):
            continue
        ratio = 1.0 if cells[4].startswith("1 (ref)") else float(cells[4])
        rows.append((cells[1], float(cells[3]), ratio, cells[11]))
    return rows


machine = re.search(r"^- machine: .*?cpu: ([^;]+); cores: (\d+)", text, re.M)
cpu_name = f"{machine.group(1)} virtual machine, {machine.group(2)} vCPUs"
date = re.search(r"^- date: (\S+ \S+) UTC", text, re.M).group(1)
tables = {d: read_section(d) for d in (3, 64)}
for d, rows in tables.items():
    print(f"d = {d}: " + ", ".join(f"{name} {ratio:g}x" for name, _, ratio, _ in rows[1:]))

# %%
# Seconds per iteration, log scale
# --------------------------------
# The flashot rows are blue (``auto`` = the ``cpu`` engine; ``tiled`` is our
# blocked PyTorch engine), the peers grey; the label is each one's time as a
# multiple of flashot's.  Hatched bars ran fewer iterations than the preset to
# fit the benchmark's time budget (BENCHMARKS.md's "notes" column).
fig, axes = plt.subplots(1, 2, figsize=(14, 5.2))
for ax, (d, rows) in zip(axes, tables.items()):
    rows = sorted(rows, key=lambda r: r[1], reverse=True)
    names = [r[0] for r in rows]
    secs = [r[1] for r in rows]
    colors = ["tab:blue" if n.startswith("flashot") else "0.6" for n in names]
    bars = ax.barh(names, secs, color=colors)
    for bar, (_, s, ratio, notes) in zip(bars, rows):
        if "reduced" in notes:
            bar.set_hatch("//")
        ax.text(
            s * 1.08,
            bar.get_y() + bar.get_height() / 2,
            f"{s:.3g} s ({'reference' if ratio == 1 else f'{ratio:g}x'})",
            va="center",
            fontsize=9,
        )
    ax.set_xscale("log")
    ax.set_xlim(min(secs) / 2, max(secs) * 12)
    ax.set_xlabel("seconds per iteration (log scale; shorter is faster)")
    ax.set_title(f"n = m = 20,000, d = {d}")
    ax.legend(
        handles=[
            Patch(color="tab:blue", label="flashot"),
            Patch(color="0.6", label="peer"),
            Patch(facecolor="0.6", hatch="//", label="fewer iterations (time budget)"),
        ],
        loc="upper right",
        fontsize=8,
    )
fig.suptitle(
    f"Alternating Sinkhorn iterations, float32, eps = 0.1: flashot vs peers\n"
    f"measured on {cpu_name} (BENCHMARKS.md, {date} UTC); other CPUs may differ"
)
fig.tight_layout()

if OUT:
    fig.savefig(os.path.join(OUT, "plot_cpu_engine_vs_peers.png"), dpi=80)
    with open(os.path.join(OUT, "plot_cpu_engine_vs_peers.json"), "w") as f:
        json.dump({"cpu": cpu_name, "tables": {str(d): rows for d, rows in tables.items()}}, f)
