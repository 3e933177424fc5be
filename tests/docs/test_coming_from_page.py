"""Every python block of docs/coming_from.md runs as written (issue 14, item 6): each block
checks flashot against the peer it maps from (GeomLoss, POT, OTT-JAX) when that peer is installed.
GeomLoss and POT are test extras, so CI checks those mappings; OTT-JAX's is checked where jax and
ott-jax are installed (the `bench` extra), and otherwise only flashot's side runs."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest
import torch
from test_docs_code_blocks import python_blocks

DOC = Path(__file__).resolve().parents[2] / "docs" / "coming_from.md"
BLOCKS = python_blocks(DOC.read_text())


def test_the_page_has_its_blocks_and_the_test_peers_are_installed():
    assert len(BLOCKS) >= 4
    for peer in ("geomloss", "ot"):  # test extras: their mappings are really checked in CI
        assert importlib.util.find_spec(peer) is not None, peer


@pytest.mark.parametrize("src", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_block_runs_and_matches_its_peer(src):
    threads = torch.get_num_threads()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"(?!flashot)")
        warnings.filterwarnings("ignore", message=".*KeOps.*")
        warnings.filterwarnings("ignore", category=UserWarning, module=r"(ot|jax|ott)\b")
        try:
            exec(compile(src, str(DOC), "exec"), {"__name__": "__coming_from__"})
        finally:
            torch.set_num_threads(threads)
