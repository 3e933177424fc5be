"""The ``triton`` engine's kernels module, imported on first launch (not with the package), so
``TRITON_INTERPRET`` may be set any time before the first kernel call."""

from __future__ import annotations

import torch

from .configs import interpret_enabled

_KERNELS = None
_KERNELS_INTERPRETED: bool | None = None


def kernels_for_device(device: torch.device):
    """The kernels module, imported on first use; checks it matches the device.

    Triton decides at decoration time whether a kernel is compiled or
    interpreted, so the mode is fixed by the first launch in the process.
    """
    global _KERNELS, _KERNELS_INTERPRETED
    if _KERNELS is None:
        from . import kernels

        _KERNELS, _KERNELS_INTERPRETED = kernels, interpret_enabled()
    if device.type == "cpu" and not _KERNELS_INTERPRETED:
        raise ValueError(
            "backend='triton': the kernels were compiled for CUDA (TRITON_INTERPRET was not set "
            "when they were first used), so CPU tensors cannot run; use backend='tiled'"
        )
    return _KERNELS
