"""The ``triton`` engine package: fused streamed kernels for softmin and plan products.

``kernels`` holds the ``@triton.jit`` code, ``configs`` the block-size choices,
``engine`` the :class:`TritonEngine` wrapper.  Importing this package imports
``triton`` (the registry's loader turns an ImportError into EngineUnavailable);
the kernels module itself is imported on first launch, so ``TRITON_INTERPRET``
may be set any time before the first kernel call.
"""

from __future__ import annotations

import triton  # noqa: F401  (ImportError here = engine unavailable)

from .configs import KernelConfig, interpret_enabled, parse_config  # noqa: F401  (interpret_enabled: kept importable)
from .engine import TritonEngine
from .loader import kernels_for_device

__all__ = ["TritonEngine", "KernelConfig", "parse_config", "kernels_for_device"]
