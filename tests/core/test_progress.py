"""verbose=True progress display (tqdm or stderr lines), silence when off."""

from __future__ import annotations

import io
import sys

import pytest
import torch

from flashot import SamplesLoss, solve_sample
from flashot.progress import make_progress

pytestmark = pytest.mark.usefixtures("one_thread")


def _data(n=20):
    g = torch.Generator().manual_seed(0)
    return torch.rand(n, 2, generator=g, dtype=torch.float64), torch.rand(n, 2, generator=g, dtype=torch.float64)


def test_verbose_shows_progress_with_tqdm(capsys):
    x, y = _data()
    solve_sample(x, y, reg=0.05, tol=1e-8, max_iter=500, verbose=True)
    err = capsys.readouterr().err
    assert "sinkhorn" in err and "eps=0.05" in err and "err=" in err and "converged" in err


def test_verbose_off_is_silent(capsys):
    x, y = _data()
    solve_sample(x, y, reg=0.05, tol=1e-8, max_iter=500)
    SamplesLoss(blur=0.1)(x, y)
    out = capsys.readouterr()
    assert out.err == "" and out.out == ""


def test_line_printer_without_tqdm(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm -> ImportError
    x, y = _data()
    solve_sample(x, y, reg=0.05, tol=1e-8, max_iter=500, verbose=True)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("sinkhorn: iter")]
    assert lines, err
    assert "eps=0.05" in lines[-1] and "err=" in lines[-1] and "(converged)" in lines[-1]


def test_line_printer_reports_max_iter(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    buf = io.StringIO()
    p = make_progress(True, 100, file=buf)
    p.update(10, 0.1, 0.5)
    p.close(100, 0.1, 0.01, "")
    text = buf.getvalue()
    assert "iter 10/100" in text and "iter 100/100" in text and "err=1.000e-02" in text


def test_samples_loss_verbose(capsys):
    x, y = _data()
    SamplesLoss(blur=0.1, verbose=True)(x, y)
    err = capsys.readouterr().err
    assert "sinkhorn" in err and "eps=" in err


def test_callback_can_log_to_user_tools():
    x, y = _data()
    log = []
    solve_sample(
        x,
        y,
        reg=0.05,
        tol=None,
        max_iter=20,
        inner_iterations=1,
        callback=lambda r: log.append((r.iteration, r.eps, r.error)),
    )
    assert len(log) == 20 and all(e is not None and e >= 0 for _, _, e in log)
