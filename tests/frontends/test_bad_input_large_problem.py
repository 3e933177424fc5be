"""Bad input raises a clear error naming the argument, before any heavy work.

The table of bad inputs (every entry point, with the exception type and the argument named)
is ``tests/frontends/test_bad_input.py``; this file keeps the check on a large problem.
"""

import pytest
import torch

import flashot


def test_validation_happens_before_heavy_work(monkeypatch):
    """A NaN in a huge problem is reported without running any softmin."""
    from flashot.ops.tiled import TiledEngine

    def boom(*a, **k):  # pragma: no cover - must not be called
        raise AssertionError("heavy work started")

    monkeypatch.setattr(TiledEngine, "softmin", boom)
    big = torch.rand(200_000, 3)
    big[-1, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        flashot.SamplesLoss(backend="tiled")(big, big)
