"""Deprecated alias of :mod:`flashot.pot_matrix` (POT's solve, sinkhorn and sinkhorn2 on a cost matrix),
kept for a release.

Importing ``flashot.ot_matrix`` gives that module itself (the same object: its names, private ones included, and
monkeypatching are shared) and a ``DeprecationWarning``.  Import ``flashot.pot_matrix`` instead.
"""

import sys
import warnings

from . import pot_matrix

warnings.warn(
    "flashot.ot_matrix is deprecated: its contents moved to flashot.pot_matrix; import that module instead",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = pot_matrix
