"""The fuzz tests' hypothesis profiles, shared by every ``*_fuzz.py`` module.

``ci`` (the default): few derandomized examples per target, no example database, so CI is
deterministic; ``long`` (``FLASHOT_FUZZ=long``): many fresh random examples per target.
``FLASHOT_FUZZ_EXAMPLES=N`` overrides the number of examples per target.  The profiles are
registered here and applied per test (:func:`fuzz_settings`), not loaded globally, so other test
files keep their own hypothesis settings.  tests/ops/test_engines_fuzz.py describes the targets
and the measured margins.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

PROFILE = os.environ.get("FLASHOT_FUZZ", "ci").strip().lower() or "ci"
if PROFILE not in ("ci", "long"):
    raise RuntimeError(f"FLASHOT_FUZZ: expected 'ci' or 'long', got {PROFILE!r}")

_HC = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
settings.register_profile(
    "flashot-fuzz-ci",
    max_examples=40,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=_HC,
    print_blob=True,
)
settings.register_profile(
    "flashot-fuzz-long",
    max_examples=2500,
    derandomize=False,
    database=None,
    deadline=None,
    suppress_health_check=_HC,
    print_blob=True,
)
BASE = settings.get_profile(f"flashot-fuzz-{PROFILE}")
_OVERRIDE = os.environ.get("FLASHOT_FUZZ_EXAMPLES")


def fuzz_settings(ci_examples: int, long_examples: int) -> settings:
    """The profile's settings with ``ci_examples`` (``ci``) or ``long_examples`` (``long``) examples."""
    n = long_examples if PROFILE == "long" else ci_examples
    if _OVERRIDE:
        n = int(_OVERRIDE)
    return settings(BASE, max_examples=n)
