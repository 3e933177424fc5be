r"""One OT problem spread over the ranks of a ``torch.distributed`` process group.

Replicated mode (``shard="replicated"``, the default): every rank holds all the points and weights,
and :class:`ShardedEngine` wraps the ordinary single-device engine (``cpu``, ``tiled``,
``triton``, ``dense``, and the block-sparse engine of ``backend="multiscale"``) so that each
primitive computes only this rank's contiguous slice of the output rows and all-gathers the rest:

* ``softmin(x, y, h)`` and ``plan_product(x, y, ...)``: rank ``r`` computes rows
  ``[r N / W, (r + 1) N / W)`` with the inner engine; one ``all_gather`` of ``O(N K)`` numbers
  gives every rank the whole ``(B, N, K)`` result (exact: no reassociation).
* the fused steps ``softmin_pair`` and ``softmin_alt`` (one pass over the pairs for both
  potentials) keep their fusion: rank ``r`` runs them on ``(x_r, y)``, which gives complete
  rows of ``f`` on ``x_r`` and a *partial* column softmin over ``x_r``; the partials of all
  ranks are combined by a LogSumExp in rank order (``g = -eps log sum_r exp(-g_r / eps)``),
  which differs from one process by float reassociation only.  Both travel in ONE
  ``all_gather`` per step (``W M + N`` numbers received per rank per step; see ``stats``).
* ``softmin_sym`` (debiasing) is a row-sharded ``softmin(x, x, h)``.
* multiscale (:mod:`flashot.multiscale`): the coarse stage and the extrapolation of its potentials
  to the points shard their engine as above; the fine stage's block-sparse engine chooses the slices
  itself (``row_bounds``: ranges of whole row clusters, balanced by kept pairs) and computes only those
  rows (``rows=(lo, hi)``).  Clustering and pruning run on every rank on the same points and
  all-gathered potentials, so the ranks keep the same blocks; a hash of the kept blocks enters every
  header.
  ``shard="points"`` refuses it (the clustering needs the whole clouds).

Because every rank receives the same gathered bits and reduces them in the same order, every
rank holds bit-identical potentials, so the solver (:func:`flashot.solver.sinkhorn_loop`) runs
unchanged on each rank and takes the same stopping decisions.  Every collective also carries a
small header (operation, call number, an exact checksum of the call's inputs): ranks whose call
sequences or inputs diverge raise ``RuntimeError`` naming the ranks at the next call instead of
exchanging mismatched data.  The local reductions of the error check (``torch.sum``) round the
same way on ranks with the same torch build, CPU type and thread count (torchrun's default
``OMP_NUM_THREADS=1`` for every rank); a divergence there is caught by that header.

Front ends: ``solve_sample(..., group=pg)`` and ``SamplesLoss(..., group=pg)`` call
:func:`distribute_measures` after building the measures: it checks that shapes, dtypes, the
points themselves (replicated mode needs the same points on every rank), the cost, the engine
and the options agree across ranks (one ``all_gather_object``; ``ValueError`` naming the
argument and the ranks), then swaps in the sharded engine.  Everything that later applies the
plan (``OTResult.plan @ V``, ``marginals``, ``value_linear``, gradients) is then a collective
too: call it on every rank.

Bad arguments: every rank checks its own arguments first (:func:`shared_checks`: the options, finite points
and weights, shapes and dtypes that fit together), then the first collective of the call, one
``all_gather_object``, carries each rank's verdict with the fields compared across ranks
(:func:`check_same`, :func:`points_measures`): if a rank rejected its arguments, EVERY rank raises the same
exception (the rejecting rank's type and message, prefixed ``rank r rejected its input:``) within that one
collective, in both modes, so that no rank waits for the process group's timeout and ranks that catch the
error take the same branch.  ``SamplesLoss(..., group=pg)`` checks its options that way at construction
(one all-gather: construct it on every rank).

Failure: a rank that dies makes the others' next collective fail (gloo reports the closed
connection, usually at once); a rank that hangs, or raises outside those checks without exiting,
leaves the others blocked until the process group's ``timeout`` (``init_process_group(timeout=...)``,
30 minutes by default in torch), after which they raise.  Use a short timeout in jobs where a hang
costs.

Gradients: the backward passes (:mod:`flashot.ops.autograd`, :mod:`flashot.implicit`) are plan
products of the engine, so they shard too; each rank receives the full gradient w.r.t. the
(replicated) points and weights, identical on every rank.

Points-sharded ("ring") mode, ``shard="points"`` (for clouds that do not fit one device): every
rank passes only ITS slice of ``x`` (and ``a``) and of ``y`` (and ``b``); slices may be uneven, none
empty.  :func:`points_measures` checks the options across ranks, centres every slice on the centre of
ALL the points and bounds the cost over all pairs (one all-reduce of the bounding boxes), and wraps the
engine in a :class:`RingEngine`: each softmin / plan product sends the other side's blocks (points
plus potentials, or plus ``V``) around the ring of ranks and accumulates this rank's rows block by
block with the ordinary engine (LogSumExp / sum), like ring attention; the transposed direction sends
x blocks.  Each block carries the header (operation, call number) that checks the ranks' calls: a pass
costs no collective besides its hops.  A rank holds its slices plus two blocks in flight (``O((n_r + 2 max m_r) D)`` memory) and
receives ``(W - 1) / W`` of the other cloud per primitive: ``(N + M)(D + 1)(W - 1) / W`` numbers per
alternating iteration (versus ``N + W M`` in replicated mode).  A symmetric step (``softmin_pair``,
GeomLoss' updates) is ONE ring pass: each y block travels with its partial column softmin, which every
rank updates with its rows, and comes home complete after W hops (``M (D + 2)`` numbers received).  The potentials stay sliced: the solver's error,
rounding floor, finiteness check and masses are all-reduced (:meth:`PointsMeasures.reduce`; an iteration's
errors, with Anderson's sums or Momentum's finiteness check where they fall at the same point, in one
all-reduce: :meth:`PointsMeasures.reduce_all`), so every rank takes the same stopping decision.  Balanced values are the ranks' partial sums ``<a_r, f_r> + <b_r,
g_r>`` all-reduced (:func:`flashot.values.sinkhorn_value`), unbalanced ones are computed from
all-gathered ``O(N + M)`` vectors (:meth:`PointsMeasures.full`, differentiable: each rank's backward gets
its own slice); the same on every rank.  Potentials, marginals, ``plan @ V`` and the gradients w.r.t.
points and weights are this rank's slices (the single-process results' slices up to float
reassociation).  Also there: second derivatives of balanced values (``create_graph=True``: implicit
differentiation, whose plan products are ring passes that carry the other ranks' cotangents and whose
conjugate gradients all-reduce their inner products, :mod:`flashot.implicit`), ``value_linear``'s
gradient (the same machinery), ``SamplesLoss(warm_start=...)`` (each rank caches its slices; the
displacement and the cold / warm decision are all-reduced, :mod:`flashot.warmstart`),
``acceleration`` (Anderson's Gram matrix and right-hand side and the finiteness tests all-reduced,
:mod:`flashot.acceleration`), and ``plan.to_dense()`` / ``plan.topk(k)``: THIS rank's rows over all
columns (one ring pass of the column blocks; top-k merged block by block).  Not supported there (a
clear error): second derivatives of unbalanced values and ``np.asarray(plan)`` (the whole plan; naming
``to_dense`` and ``shard='replicated'``).  The user chooses the mode (:func:`pick_shard` states a simple
rule).

Modules: :mod:`~flashot.distributed.group` (the group's checks, checksums, the ranks' agreement on their
arguments, the wrapper engines' base), :mod:`~flashot.distributed.replicated` (:class:`ShardedEngine`,
:func:`distribute_measures`), :mod:`~flashot.distributed.ring` (:class:`RingEngine`),
:mod:`~flashot.distributed.points` (:class:`PointsMeasures`, :func:`points_measures`),
:mod:`~flashot.distributed.points_result` (the plan and result of a points-sharded solve) and
:mod:`~flashot.distributed.solve` (the entry points of ``solve_sample``).
"""

from __future__ import annotations

from .group import check_group, check_same, check_same_values, reject, shared_checks  # noqa: F401
from .points import PointsMeasures, points_measures
from .points_result import PointsOTResult, PointsPlan  # noqa: F401 (the types of a points-sharded result)
from .replicated import ShardedEngine, distribute_measures
from .ring import RingEngine
from .solve import SHARDS, check_shard, distribute_solve, pick_shard, points_solve  # noqa: F401 (the front ends')

__all__ = [
    "SHARDS",
    "PointsMeasures",
    "RingEngine",
    "ShardedEngine",
    "check_group",
    "check_same",
    "distribute_measures",
    "distribute_solve",
    "pick_shard",
    "points_measures",
    "points_solve",
    "reject",
    "shared_checks",
]
