"""Deprecated alias of :mod:`flashot.pot_samples` (POT's solve_sample on point clouds), kept for a release.

Importing ``flashot.ot_samples`` gives that module itself (the same object: its names, private ones included, and
monkeypatching are shared) and a ``DeprecationWarning``.  Import ``flashot.pot_samples`` instead.
"""

import sys
import warnings

from . import pot_samples

warnings.warn(
    "flashot.ot_samples is deprecated: its contents moved to flashot.pot_samples; import that module instead",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = pot_samples
