"""flashot: IO-aware entropic optimal transport that never materialises the cost matrix.

Public API:
    SamplesLoss   drop-in for ``geomloss.SamplesLoss`` (sinkhorn, hausdorff, gaussian, laplacian, energy)
    solve_sample  POT/GeomLoss-style solver returning an :class:`OTResult` with a lazy plan
    solve, sinkhorn, sinkhorn2  POT's ot.solve / ot.sinkhorn / ot.sinkhorn2 on a precomputed cost matrix
    free_support_barycenter  POT's entropic free-support barycenter, streamed
    gromov_wasserstein, fused_gromov_wasserstein  entropic (fused) Gromov-Wasserstein, POT's conventions, streamed
    semirelaxed_gromov_wasserstein, semirelaxed_fused_gromov_wasserstein  the same with a free second marginal
    otdd, LabelCost  the OT dataset distance between labelled datasets; the label-augmented cost it streams
    ops           the two streamed primitives (softmin, plan product) and the engine registry
"""

from .acceleration import Anderson, Momentum
from .barycenter import BarycenterResult, free_support_barycenter
from .costs import Cost, LabelCost, get_cost
from .dataset_distance import OTDDResult, otdd
from .gromov import (
    GWResult,
    fused_gromov_wasserstein,
    gromov_wasserstein,
    semirelaxed_fused_gromov_wasserstein,
    semirelaxed_gromov_wasserstein,
)
from .implicit import ImplicitDiff
from .plan import LazyPlan, plan_from_potentials
from .pot_matrix import sinkhorn, sinkhorn2, solve
from .pot_samples import solve_sample
from .results import OTResult
from .samples_loss import SamplesLoss

__version__ = "0.1.0"

__all__ = [
    "SamplesLoss",
    "solve_sample",
    "solve",
    "sinkhorn",
    "sinkhorn2",
    "OTResult",
    "Cost",
    "get_cost",
    "LabelCost",
    "otdd",
    "OTDDResult",
    "Momentum",
    "Anderson",
    "ImplicitDiff",
    "LazyPlan",
    "plan_from_potentials",
    "free_support_barycenter",
    "BarycenterResult",
    "gromov_wasserstein",
    "fused_gromov_wasserstein",
    "semirelaxed_gromov_wasserstein",
    "semirelaxed_fused_gromov_wasserstein",
    "GWResult",
    "__version__",
]
