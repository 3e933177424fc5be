"""Ragged batches: many OT problems of different sizes solved in one pass (a strategy layer).

``SamplesLoss(...)(xs, ys)`` / ``SamplesLoss(...)(a_list, xs, b_list, ys)`` with lists of clouds, or with
concatenated points and PyTorch Geometric batch vectors (``x_batch=``, ``y_batch=``), and
``solve_sample(xs, ys, reg=...)`` with lists, run here: the batch is one problem on the concatenated clouds
whose kernel is block-diagonal (:mod:`flashot.ragged.measures`), solved by the ordinary loop; values are per
problem (:mod:`flashot.ragged.api`).  Inputs are checked first (:mod:`flashot.ragged.inputs`).
"""

from .api import RaggedResult, problem_diameters, ragged_samples_loss, ragged_solve_sample
from .inputs import RaggedInput, RaggedLayout, is_ragged_call, ragged_input
from .measures import RaggedMeasures, ragged_engine, ragged_measures

__all__ = [
    "RaggedResult",
    "RaggedInput",
    "RaggedLayout",
    "RaggedMeasures",
    "is_ragged_call",
    "problem_diameters",
    "ragged_engine",
    "ragged_input",
    "ragged_measures",
    "ragged_samples_loss",
    "ragged_solve_sample",
]
