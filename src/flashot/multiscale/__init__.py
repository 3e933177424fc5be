r"""Coarse-to-fine Sinkhorn with block-sparse fine iterations (GeomLoss' ``backend="multiscale"``).

1. Both clouds are clustered on a voxel grid of side ``cluster_scale`` (:mod:`flashot.clusters`)
   and sorted by cluster.  The fine blocks: GeomLoss' default ``diameter / (sqrt(D) 2000^(1/D))``
   halved while the cells stay wider than a quarter of the last temperature's pruning radius and
   hold >= 64 points on average (:func:`~flashot.clusters.block_scale`): large clouds get finer
   blocks.  The coarse stage, by default: those blocks halved further while both clouds occupy at
   most 10,000 cells (:func:`~flashot.clusters.coarse_scale`), so it jumps to the points later.  A
   given ``cluster_scale`` is GeomLoss' (the coarse stage's); the fine blocks may still be halved
   from it.
2. The epsilon-scaling runs on the cluster centroids with the cluster weights while
   ``eps >= cluster_scale^p`` (GeomLoss' jump rule), with the ordinary engines.
3. The coarse potentials are extrapolated to the points (one softmin against the centroids, on the CPU
   over the groups of centroids that a bound keeps for each fine cluster: :func:`~flashot.multiscale.extrapolation.extrapolated_state`),
   and the blocks ``(I, J)`` of clusters are pruned: a block is kept when a lower bound of
   :math:`C(x_i, y_j) - f_i - g_j` over the block is at most ``truncate * eps`` (GeomLoss'
   ``truncate``, default 5) at the temperature about to run (:class:`~flashot.multiscale.bounds.BlockBounds`: the cost of
   the gap between the clusters' balls minus the potentials' maxima, or, tighter, a bound from a
   linear fit of the potentials over each cluster).  A dropped entry thus has
   :math:`P_{ij} < a_i b_j e^{-\mathrm{truncate}}`.  Each row and column cluster keeps at least
   its best block.  The debiasing problems are pruned alike (``f_aa``, ``g_bb``).
4. The rest of the schedule runs on the points with the block-sparse engine
   (:mod:`flashot.ops.blocksparse`).  On the CPU kernels its fused steps also skip, inside the kept
   blocks, the tiles (a panel of rows x 64 columns; points sorted in a finer Morton order inside their
   cluster, ``SUB_LEVELS``) where the same rule holds for the potentials of the call, its inputs or (bounded
   from sampled points) its outputs (the same linear-model bound, per panel and chunk)
   (:mod:`flashot.ops.tile_rule`), and the final step returns the barycentres its
   gradient needs (:func:`flashot.solver.final_values`): no plan product.  After each temperature the bounds are recomputed from the
   new potentials: where they would keep a block that was dropped, that temperature runs again
   on the union, so the rule holds for the potentials that come out, not only for those that
   went in.  The next temperature prunes from the same bounds with its own (smaller) margin.
5. Above ~2,000 clusters a side, the bounds are computed coarse-to-fine: the fine clusters are
   runs of coarser Morton cells (:func:`~flashot.clusters.coarsen`), the coarse blocks are
   pruned first and only the fine blocks inside kept coarse ones are bounded, in the C++
   kernels (``prune.h``) where they load.

The returned fine :class:`~flashot.measures.Measures` hold the sorted clouds (gathered from the
inputs, so gradients flow back to them) and the engine of the last pruning: the final step,
values and gradients are those of the ordinary solver on the pruned plan.

Distributed (``group``, replicated mode: every rank holds all the points): the coarse stage runs on
:class:`~flashot.distributed.ShardedEngine` (after :func:`~flashot.distributed.distribute_measures`
checks the centroids across ranks), and every fine engine is a ``ShardedEngine`` over the block-sparse
one, each rank computing a range of whole row clusters (balanced by kept pairs).  The extrapolation
to the points is row-sharded too.  Clustering and pruning run on every rank, on the same points and the
same all-gathered potentials, so every rank takes the same pruning decisions; the kept blocks enter the
checksum of every collective.

The package, by responsibility (each module imports only those before it here, but for :mod:`.config`'s
type hints): :mod:`.config` (the options and the run
left behind), :mod:`.scales` (schedule, cluster scales, jump), :mod:`.linear` and :mod:`.hierarchies` (the
ingredients of the bounds), :mod:`.bounds` (block pruning), :mod:`.extrapolation` (the coarse stage's
problem and its potentials on the points), :mod:`.fine` (the fine stage's sorted measures and block-sparse
engines), :mod:`.coarse_to_fine` (the loop), :mod:`.ordering` (the inputs' point order) and
:mod:`.strategy` (:class:`Multiscale`, the strategy the front ends hand to the core's one solve).  The tuning constants re-exported here
are copies: set them in their modules (e.g. ``flashot.multiscale.fine.TILE_PRUNING``).
"""

from .bounds import FLAT_ROWS, PRUNE_CHUNK, PRUNE_ROWS, BlockBounds, prune
from .coarse_to_fine import continue_fine, multiscale_loop
from .config import MultiscaleConfig, MultiscaleRun, truncate_for
from .extrapolation import (
    EXTRAPOLATION_GROUP,
    EXTRAPOLATION_MIN_CENTROIDS,
    EXTRAPOLATION_PROBES,
    EXTRAPOLATION_TRUNCATE,
)
from .fine import SUB_LEVELS, TILE_PRUNING
from .hierarchies import COARSE_BLOCKS, Hierarchy, hierarchy
from .linear import FIT_CHUNK, LinearModel, linear_model
from .ordering import InputOrderEngine, in_input_order, unsort
from .scales import COARSE_MIN_GAIN, coarse_pays, jump_index, schedule
from .strategy import Multiscale, Refinement, check_pair, pot_problem, pot_result, solve, solve_measures

__all__ = [
    "BlockBounds",
    "COARSE_BLOCKS",
    "COARSE_MIN_GAIN",
    "EXTRAPOLATION_GROUP",
    "EXTRAPOLATION_MIN_CENTROIDS",
    "EXTRAPOLATION_PROBES",
    "EXTRAPOLATION_TRUNCATE",
    "FIT_CHUNK",
    "FLAT_ROWS",
    "Hierarchy",
    "InputOrderEngine",
    "LinearModel",
    "Multiscale",
    "MultiscaleConfig",
    "MultiscaleRun",
    "PRUNE_CHUNK",
    "PRUNE_ROWS",
    "Refinement",
    "SUB_LEVELS",
    "TILE_PRUNING",
    "check_pair",
    "coarse_pays",
    "continue_fine",
    "hierarchy",
    "in_input_order",
    "jump_index",
    "linear_model",
    "multiscale_loop",
    "pot_problem",
    "pot_result",
    "prune",
    "schedule",
    "solve",
    "solve_measures",
    "truncate_for",
    "unsort",
]
