import os

import pytest
import torch


def rel_err(a, b) -> float:
    """max |a - b| / max |b| (scale-aware elementwise relative error)."""
    a = torch.as_tensor(a).detach().double()
    b = torch.as_tensor(b).detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
