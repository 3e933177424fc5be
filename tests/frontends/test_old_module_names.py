"""The renamed modules keep their old import paths for a release: ``flashot.ot_samples`` (now
:mod:`flashot.pot_samples`), ``flashot.ot_matrix`` (:mod:`flashot.pot_matrix`) and ``flashot.matrix_cost``
(:mod:`flashot.matrix_measures`) are the new modules themselves, with a ``DeprecationWarning`` on import."""

from __future__ import annotations

import importlib
import sys
import warnings

import pytest

RENAMED = {
    "flashot.ot_samples": "flashot.pot_samples",
    "flashot.ot_matrix": "flashot.pot_matrix",
    "flashot.matrix_cost": "flashot.matrix_measures",
}


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_the_old_path_is_the_new_module_with_a_warning(old, monkeypatch):
    new = importlib.import_module(RENAMED[old])
    monkeypatch.delitem(sys.modules, old, raising=False)  # import it afresh: the warning comes on import
    with pytest.warns(DeprecationWarning, match=RENAMED[old].replace(".", r"\.")):
        mod = importlib.import_module(old)
    assert mod is new and sys.modules[old] is new


def test_the_old_names_still_import():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from flashot.matrix_cost import SCAN_ROWS, MatrixCost, function_measures, matrix_measures
        from flashot.ot_matrix import linear_cost_grads, sinkhorn, sinkhorn2, solve
        from flashot.ot_samples import EPS_SCALING_AUTO, OTResult, solve_sample

    import flashot
    import flashot.matrix_measures as mm
    import flashot.pot_matrix as pm
    import flashot.pot_samples as ps

    assert solve_sample is flashot.solve_sample is ps.solve_sample and OTResult is flashot.OTResult
    assert EPS_SCALING_AUTO == ps.EPS_SCALING_AUTO
    assert (solve, sinkhorn, sinkhorn2, linear_cost_grads) == (
        pm.solve,
        pm.sinkhorn,
        pm.sinkhorn2,
        pm.linear_cost_grads,
    )
    assert (MatrixCost, function_measures, matrix_measures, SCAN_ROWS) == (
        mm.MatrixCost,
        mm.function_measures,
        mm.matrix_measures,
        mm.SCAN_ROWS,
    )
