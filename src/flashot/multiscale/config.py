"""A multiscale solve's options and what it leaves behind."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..clusters import Clusters
from ..measures import Measures
from ..solver import SinkhornState

if TYPE_CHECKING:
    from .bounds import BlockBounds
    from .fine import FineBlocks


def truncate_for(truncate: float | None, tol: float | None) -> float | None:
    """The pruning margin (units of eps) of a solve asked for ``tol``: at least ``log(1 / tol)``, so that the
    dropped entries of the plan (below ``e^-truncate a_i b_j``) stay within the tolerance that
    ``converged=True`` promises about the returned result (errors fall ~``e^-truncate``: docs/exactness.md)."""
    if truncate is None or tol is None:
        return truncate
    return max(truncate, math.log(1.0 / tol))


@dataclass(frozen=True)
class MultiscaleConfig:
    """GeomLoss' multiscale options: ``cluster_scale`` (None: from the diameter and the dimension) and
    ``truncate`` (pruning margin in units of eps; None keeps every block)."""

    cluster_scale: float | None = None
    truncate: float | None = 5.0


@dataclass
class MultiscaleRun:
    """What a multiscale solve leaves behind: the fine measures (sorted clouds, last engine), the
    loop state, the clusterings, and the kept fraction of pairs (x-y problem) at each pruning."""

    m: Measures
    state: SinkhornState
    cx: Clusters
    cy: Clusters
    kept: list[float]
    jump: int  # index in eps_list of the last coarse temperature
    hier: FineBlocks | None = None  # the fine clusterings and pruning hierarchies (continue_fine)
    bounds: list[BlockBounds] | None = None  # the bounds of the last state
    truncate: float | None = None
    group: Any = None  # the torch.distributed process group of a distributed solve (replicated mode), or None
