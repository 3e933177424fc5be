"""``flashot bench``: a tiny problem end to end, agreement with POT, option errors."""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest

pytest.importorskip("ot")
pytest.importorskip("geomloss")

from flashot.bench import main
from flashot.bench import peers as peers_mod
from flashot.bench.core import Config, run_bench

TINY = ["--sizes", "300", "--dims", "3", "--iters", "2", "--repeats", "1", "--no-progress"]


def _md_rows(path):
    """Markdown table rows as dicts keyed by column name."""
    lines = [l for l in path.read_text().splitlines() if l.startswith("| ")]
    head = [c.strip() for c in lines[0].strip("|").split(" | ")]
    return [dict(zip(head, [c.strip() for c in l.strip("|").split(" | ")])) for l in lines[1:]]


def test_tiny_problem_agrees_with_pot_and_writes_markdown(tmp_path, capsys):
    md = tmp_path / "out.md"
    rc = main(
        TINY
        + [
            "--in-process",
            "--peers",
            "torch-blocked,pot-dense,pot-lazy,geomloss-tensorized,ott-dense",
            "--markdown",
            str(md),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    rows = {r["solver"]: r for r in _md_rows(md)}
    AUTO = next(k for k in rows if k.startswith("flashot:auto"))  # "flashot:auto (<engine it picked>)"
    assert rows[AUTO]["vs flashot"] == "1 (ref)"
    for peer in ("torch-blocked", "pot-dense", "pot-lazy", "geomloss-tensorized"):
        r = rows[peer]
        assert r["iters x runs"] == "2 x 1"
        assert float(r["rel. diff"]) < 1e-4, r
        assert float(r["s / iter"]) > 0 and float(r["vs flashot"]) > 0
        assert float(r["% HW limit"]) > 0
        assert peer in out  # also in the printed table
    # the value itself is the entropic dual value after 2 iterations, same for all
    assert abs(float(rows["pot-dense"]["value <a,f>+<b,g>"]) - float(rows[AUTO]["value <a,f>+<b,g>"])) < 1e-5
    if importlib.util.find_spec("ott") is None or importlib.util.find_spec("jax") is None:
        assert "missing: ott-dense" in out
        assert "ott-dense" not in rows
    else:
        assert float(rows["ott-dense"]["rel. diff"]) < 1e-4
    # the measured limits: both exp rates (torch.exp and flashot's compiled vector exp), the faster one used
    assert re.search(
        r"measured limits \(float32, \d+ threads\): exp: torch\.exp [\d.]+ G/s, flashot compiled "
        r"vector exp ([\d.]+ G/s|not measured \(.+\)); exp rate = the faster",
        out,
    ), out
    text = md.read_text()
    assert "Command: `flashot bench" in text and "Machine:" in text and "Versions:" in text


def test_agreement_column_detects_a_wrong_solver(monkeypatch):
    """A peer whose potentials are off must show a large relative difference (the check can fail)."""
    good = peers_mod.PotDense.solve

    def bad(self, st, iters, record=False):
        res = good(self, st, iters, record)
        res.f = res.f + 0.01  # shifts <a, f> by 0.01
        return res

    monkeypatch.setattr(peers_mod.PotDense, "solve", bad)
    res = run_bench(
        Config(sizes=[300], dims=[3], iters=2, repeats=1, peers=["pot-dense"], in_process=True, measure_limits=False),
        progress=False,
    )
    row = [r for r in res.rows if r.solver == "pot-dense"][0]
    assert row.status == "ok" and row.rel_diff > 1e-3


def test_missing_peers_are_listed_not_fatal(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        peers_mod.importlib.util, "find_spec", lambda name, *a: None if name in ("ott", "jax") else real(name, *a)
    )
    rc = main(TINY + ["--in-process", "--no-limits", "--peers", "ott-online,pot-dense"])
    out = capsys.readouterr().out
    assert rc == 0
    assert re.search(r"missing: ott-online: not installed", out)
    assert re.search(r"pot-dense\s", out)


def test_worker_subprocess_reports_peak_memory():
    res = run_bench(Config(sizes=[300], dims=[3], iters=2, repeats=1, peers=[], measure_limits=False), progress=False)
    (row,) = res.rows
    assert row.status == "ok", row.reason
    assert row.rss_peak_mib is not None and row.rss_peak_mib > 10
    assert row.trajectory is not None and len(row.trajectory) == 2


def test_total_budget_skips_with_reason():
    res = run_bench(
        Config(
            sizes=[300],
            dims=[3],
            iters=2,
            repeats=1,
            peers=["pot-dense"],
            in_process=True,
            measure_limits=False,
            budget=1e-6,
        ),
        progress=False,
    )
    assert [r.status for r in res.rows] == ["skipped", "skipped"]
    assert all("budget" in r.reason for r in res.rows)


def test_solver_budget_trims_runs_and_iterations_and_says_so():
    res = run_bench(
        Config(
            sizes=[300],
            dims=[3],
            iters=4,
            repeats=3,
            peers=["pot-dense"],
            in_process=True,
            measure_limits=False,
            solver_budget=1e-6,
        ),
        progress=False,
    )
    for r in res.rows:
        assert r.status == "ok" and (r.iters, r.repeats) == (1, 1)
        assert "reduced from" in r.reduced
    assert res.rows[1].rel_diff < 1e-4  # agreement still uses flashot's value after 1 iteration


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["--peers", "geomloss-online,nope"], "unknown peer 'nope'"),
        (["--engines", "auto,warp"], "unknown engine 'warp'"),
        (["--sizes", "0"], "--sizes"),
        (["--sizes", "10,abc"], "--sizes"),
        (["--dtypes", "float16"], "--dtypes"),
        (["--iters", "0"], "--iters"),
        (["--eps", "-1"], "--eps"),
    ],
)
def test_bad_options_give_clear_errors(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit):
        main(TINY + ["--plot", str(tmp_path / "p.png")])
    assert "--plot needs matplotlib" in capsys.readouterr().err


def test_cli_dispatches_bench(capsys):
    from flashot.cli import main as cli_main

    with pytest.raises(SystemExit) as e:
        cli_main(["bench", "--help"])
    assert e.value.code == 0
    assert "--solver-budget" in capsys.readouterr().out
