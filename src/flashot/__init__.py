"""flashot: IO-aware entropic optimal transport that never materialises the cost matrix.

Public API:
    SamplesLoss   drop-in for ``geomloss.SamplesLoss(loss="sinkhorn")``
    solve_sample  POT/GeomLoss-style solver returning an :class:`OTResult` with a lazy plan
    ops           the two streamed primitives (softmin, plan product) and the engine registry
"""

from .acceleration import Anderson, Momentum
from .costs import Cost, get_cost
from .implicit import ImplicitDiff
from .plan import LazyPlan, plan_from_potentials
from .samples_loss import SamplesLoss
from .solve import OTResult, solve_sample

__version__ = "0.1.0"

__all__ = [
    "SamplesLoss",
    "solve_sample",
    "OTResult",
    "Cost",
    "get_cost",
    "Momentum",
    "Anderson",
    "ImplicitDiff",
    "LazyPlan",
    "plan_from_potentials",
    "__version__",
]
