"""Deprecated alias of :mod:`flashot.matrix_measures` (the problem on a cost matrix or a cost function), kept for a release.

Importing ``flashot.matrix_cost`` gives that module itself (the same object: its names, private ones included, and
monkeypatching are shared) and a ``DeprecationWarning``.  Import ``flashot.matrix_measures`` instead.
"""

import sys
import warnings

from . import matrix_measures

warnings.warn(
    "flashot.matrix_cost is deprecated: its contents moved to flashot.matrix_measures; import that module instead",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = matrix_measures
