"""The examples run (small sizes) and do what they claim."""

import importlib.util
import json
import pathlib
import re

import pytest
from site_build import docs_build_fixture  # noqa: F401 - the fixture docs_build, one build per run

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gradient_flow_example(tmp_path):
    mod = _load("gradient_flow")
    out = tmp_path / "flow.png"
    h = mod.run(n=60, steps=8, lr=0.5, blur=0.2, tol=1e-3, out=str(out), backend="tiled")
    L = h["losses"]
    # the flow decreases the OT value (monotonically up to 1%) and ends far below its start
    assert all(b <= a * 1.01 for a, b in zip(L, L[1:])), L
    assert L[-1] < 0.1 * L[0], L
    # the barycentric map: particles end close to where the plan sends them
    assert h["mean_displacement_final"] < 0.2 * h["mean_displacement_initial"]
    # warm starts: the last solve needs fewer iterations than a cold start of the same problem
    assert h["iterations"][-1] < h["cold_iterations_last"], (h["iterations"], h["cold_iterations_last"])
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


# --- the gallery examples (examples/plot_*.py, sphinx-gallery style) --------------------------
# The documentation build runs each at reduced size (FLASHOT_EXAMPLE_SMALL=1, MPLBACKEND=Agg) and
# has it write its figure and the numbers it prints to FLASHOT_EXAMPLE_OUT (tests/docs/site_build.py);
# the checks below hold the example to the claim its text makes.


def _check_colour_transfer(c):
    # "the mean colour of the result equals the target's mean colour"
    assert c["gap_before"] > 0.3, c
    assert c["gap_after"] < 0.01 * c["gap_before"], c
    assert c["converged"], c


def _check_registration_flow(c):
    # "the loss drops by orders of magnitude": at least 100x over the flow, 10x within 5 steps
    L = c["losses"]
    assert L[-1] < L[0] / 100 and c["factor"] > 100, L
    assert L[5] < L[0] / 10, L
    assert min(L) > -1e-6, L  # a divergence: non-negative up to rounding


def _check_domain_adaptation(c):
    # training on the transported source beats training on the raw source, by a clear margin
    assert c["acc_ot"] >= 0.95, c
    assert c["acc_ot"] >= c["acc_raw"] + 0.08, c


def _check_unbalanced_outliers(c):
    # balanced OT sends the outliers exactly their share of the mass; unbalanced OT almost none
    assert abs(c["share_balanced"] - c["outlier_mass_fraction"]) < 0.005, c
    assert c["share_unbalanced"] < 0.01, c


def _check_cpu_engine_vs_peers(c):
    # the figures are BENCHMARKS.md's: both tables parsed, flashot's cpu engine is the reference
    # and the fastest, and every "vs flashot" ratio is the row's s/iter over flashot's
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert c["cpu"].split(" virtual machine")[0] in text
    for d, rows in c["tables"].items():
        assert len(rows) >= 8, (d, rows)
        name, ref, ratio, _ = rows[0]
        assert name == "flashot:auto (cpu)" and ratio == 1, rows[0]
        for name, s, ratio, _ in rows[1:]:
            assert s > ref and ratio > 1, (d, name)
            assert abs(s / ref / ratio - 1) < 0.03, (d, name, s, ref, ratio)


def _check_gw_shape(c):
    # "most copy points are matched within 5% of the diameter of their original; plain OT is not"
    assert c["converged"], c
    assert c["near"] >= 0.8 and c["exact"] >= 0.15, c
    assert c["linear_near"] < 0.2, c


def _check_otdd(c):
    # "plain OT cannot tell B from B'; OTDD can, and W recovers which class of B is which class of A"
    assert c["converged"], c
    assert c["match"] == c["relabel"], c
    assert c["otdd_shuffled"] > 2 * c["otdd"] and c["otdd"] > c["plain"], c


CHECKS = {
    "plot_colour_transfer": _check_colour_transfer,
    "plot_registration_flow": _check_registration_flow,
    "plot_domain_adaptation": _check_domain_adaptation,
    "plot_unbalanced_outliers": _check_unbalanced_outliers,
    "plot_cpu_engine_vs_peers": _check_cpu_engine_vs_peers,
    "plot_gw_shape": _check_gw_shape,
    "plot_otdd": _check_otdd,
}
GALLERY = sorted(p.stem for p in (ROOT / "examples").glob("plot_*.py"))


def test_every_gallery_example_has_a_check():
    assert GALLERY == sorted(CHECKS), "add a check of the new example's claim to CHECKS"


@pytest.mark.parametrize("name", GALLERY)
def test_gallery_example_form(name):
    """sphinx-gallery's form: a docstring that starts with an underlined title, then # %% cells."""
    src = (ROOT / "examples" / f"{name}.py").read_text()
    m = re.match(r'"""\n(.+)\n(=+)\n', src)
    assert m and len(m.group(2)) >= len(m.group(1)), f"{name}: docstring title"
    assert src.count("\n# %%\n") >= 2, f"{name}: # %% cells"
    assert "FLASHOT_EXAMPLE_OUT" in src


@pytest.mark.parametrize("name", GALLERY)
def test_gallery_example_runs_and_keeps_its_claim(name, docs_build):
    """The example, as the documentation build ran it (tests/docs/site_build.py), made its figure and
    keeps the claim its text makes."""
    png = (docs_build.examples / f"{name}.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000, len(png)
    CHECKS[name](json.loads((docs_build.examples / f"{name}.json").read_text()))
