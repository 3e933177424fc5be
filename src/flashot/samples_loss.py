"""``SamplesLoss``: a drop-in for ``geomloss.SamplesLoss(loss="sinkhorn", ...)``.

Cost ``C(x, y) = |x - y|^p / p`` for ``p = 2`` (i.e. ``|x - y|^2 / 2``) and
``|x - y|`` for ``p = 1``; temperature ``eps = blur^p``; epsilon-scaling from
``diameter^p`` by ratio ``scaling^p``; symmetric updates; the debiased Sinkhorn
divergence ``S(a, b) = OT(a, b) - OT(a, a)/2 - OT(b, b)/2`` by default.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import replace
from functools import partial

import numpy as np
import torch
from torch import Tensor

from . import multiscale as ms
from ._checks import check_bool, check_eps_scale, check_int, check_positive, check_power
from .driver import LoopConfig, Solved, Strategy, solve_problem
from .implicit import check_implicit
from .kernel_losses import KERNELS, hausdorff_loss, kernel_loss, kernel_matrix_loss
from .loss_options import (
    check_custom,
    check_group,
    check_label_cost,
    check_labels,
    check_loss_and_p,
    check_multiscale,
    check_scaling,
)
from .matrix_measures import function_measures
from .measures import MASS_RTOL, Measures  # noqa: F401  (MASS_RTOL: the warning's threshold)
from .pot_samples import rank_checks
from .ragged import is_ragged_call, ragged_samples_loss
from .schedules import epsilon_scaling, max_diameter
from .solver import SinkhornState, final_step, final_values
from .unbalanced import (
    debiased_dual_value,
    debiased_dual_value_two_sided,
    dual_value,
    parse_reach,
    self_terms_final,
    warn_on_second_order,
)
from .values import sinkhorn_value
from .warmstart import WarmStart, check_warm_start

AUTO_MULTISCALE_PAIRS = 10_000**2  # GeomLoss' threshold; multiscale is faster from here (BENCHMARKS.md)


def _collective_construction(init):
    """``SamplesLoss.__init__`` as a collective when given ``group=`` (keyword-only): one all-gather after the
    option checks (:func:`flashot.distributed.shared_checks`), so that a rank whose options are rejected makes
    every rank raise the same error at construction instead of leaving them waiting in their first call."""

    @functools.wraps(init)
    def wrapped(self, *args, **kwargs):
        group = kwargs.get("group")
        if group is None:
            return init(self, *args, **kwargs)
        from .distributed import shared_checks

        with shared_checks(group, collective=True):
            init(self, *args, **kwargs)

    return wrapped


def auto_multiscale(m: Measures, p: int, blur: float, diameter: float) -> bool:
    r"""Whether ``backend="auto"`` picks the multiscale solver for the problem ``m`` (balanced or with
    ``reach``; not two-sided debiasing, see :meth:`SamplesLoss._auto_multiscale`): one pair of
    clouds on the CPU, :math:`D \le 3`, :math:`p = 2`, :math:`NM \ge` ``AUTO_MULTISCALE_PAIRS`` and
    ``blur <= diameter / 20`` (below GeomLoss' default cluster scale, so the fine stage prunes).

    Example:
        >>> import torch, flashot
        >>> from flashot.measures import Measures
        >>> m = Measures.build(torch.randn(20000, 3), torch.randn(20000, 3), None, None, cost="half_sqeuclidean",
        ...                    backend="auto")
        >>> flashot.samples_loss.auto_multiscale(m, 2, 0.01, 8.0), flashot.samples_loss.auto_multiscale(m, 2, 1.0, 8.0)
        (True, False)
    """
    B, N, M, D = m.shape
    return (
        not m.batched
        and m.x.device.type == "cpu"
        and D <= 3
        and p == 2
        and N * M >= AUTO_MULTISCALE_PAIRS
        and blur <= diameter / 20
        and not m.points_sharded
        and not getattr(m.cost, "labelled", False)
    )


# The options every rank of a group checks (:mod:`flashot.distributed`): replicated, and points-sharded.
_REPLICATED_OPTIONS = (
    "p",
    "blur",
    "reach",
    "reach_x",
    "reach_y",
    "diameter",
    "scaling",
    "debias",
    "potentials",
    "backend",
    "warm_start",
    "cluster_scale",
    "truncate",
    "tol",
    "max_iter",
)
_POINTS_OPTIONS = (*_REPLICATED_OPTIONS[:11], "tol", "max_iter", "implicit")

_GEOMLOSS_BACKENDS = {"tensorized": "dense", "online": "auto", "auto": "auto", "multiscale": "auto"}
_P_COSTS = {1: "euclidean", 2: "half_sqeuclidean"}


def _warn_unequal_masses(m: Measures) -> None:
    """Balanced OT between measures of different total masses has no coupling: GeomLoss returns a
    number anyway (its symmetric iterations stop after a fixed schedule), and so do we, with a
    ``RuntimeWarning`` (threshold: :meth:`Measures.unequal_masses`).  Uniform weights never trigger it."""
    masses = m.unequal_masses()
    if masses is not None:
        warnings.warn(
            f"α and β: total masses differ ({masses[0]:.6g} vs {masses[1]:.6g}): balanced OT assumes "
            "equal masses, and the value returned (GeomLoss' schedule) is not a transport cost; normalise "
            "the weights, or use reach= (unbalanced OT)",
            RuntimeWarning,
            stacklevel=3,
        )


class SamplesLoss(torch.nn.Module):
    """Sinkhorn divergence between sampled measures (GeomLoss' arguments and defaults).

    ``S(a, b) = OT_eps(a, b) - (OT_eps(a, a) + OT_eps(b, b)) / 2`` with
    ``OT_eps(a, b) = min_P <C, P> + eps KL(P | a x b)``, ``C(x, y) = |x - y|^2 / 2`` (``p=2``) or
    ``|x - y|`` (``p=1``) and ``eps = blur^p`` (GeomLoss' conventions).

    Args:
        loss: ``"sinkhorn"`` (debiased Sinkhorn divergence, the default), the kernel norms
            ``"gaussian"``, ``"laplacian"``, ``"energy"`` (MMDs, ``1/2 |a - b|_k^2`` with
            ``k = exp(-|x-y|^2 / 2 blur^2)``, ``exp(-|x-y| / blur)``, ``-|x-y|``) or
            ``"hausdorff"`` (``1/2 <a - b, s_b - s_a>`` with the softmins ``s`` at ``eps =
            blur^p``); see :mod:`flashot.kernel_losses`.  Kernel norms use only ``blur``,
            ``potentials`` and ``backend``; hausdorff also ``p`` (no ``reach``).
        p: 1 (``C = |x - y|``) or 2 (``C = |x - y|^2 / 2``).
        blur: final temperature ``eps = blur^p`` (> 0).
        reach: unbalanced OT: KL marginal penalties of strength ``rho = reach^p`` on both
            sides (None: balanced).  Values and potentials are GeomLoss' (for probability
            measures); gradients are the exact ones, where GeomLoss' are ``(rho + eps/2) / (rho + eps)``
            of them on the points (:mod:`flashot.unbalanced`, ``docs/coming_from.md``).
        reach_x: (keyword-only) semi-unbalanced OT: a KL penalty ``rho_x = reach_x^p`` on the
            ``x`` marginal only (None: a strict constraint on that side; not with ``reach``).
            Same formulas as ``reach``, extended with ``<a, f>`` for a strict side.  With
            ``debias``, ``OT(a, a)`` and ``OT(b, b)`` are solved with the same ``(rho_x, rho_y)``
            (two potentials each, two more softmins per iteration), so ``S(a, a) = 0``;
            ``potentials=True`` then returns ``f_ab - (f_aa + g_aa)/2`` and ``g_ab - (f_bb + g_bb)/2``.
        reach_y: (keyword-only) the same on the ``y`` marginal: a KL penalty ``rho_y = reach_y^p``
            (None: strict); ``reach_x=None, reach_y=r`` keeps ``P 1 = a`` and penalises ``P^T 1``.
        diameter: start of the epsilon-scaling; computed from the data if None.
        scaling: ratio of the epsilon-scaling, in (0, 1).
        debias: return ``S(a, b)`` (True) or ``OT_eps(a, b)`` (False).  Unbalanced: each ``OT`` is
            the exact dual value (GeomLoss' ``sinkhorn_cost`` for probability measures).
        potentials: return the dual potentials ``(F, G)`` instead of the value.
        cost: GeomLoss' tensorized cost function (``"sinkhorn"``, ``"hausdorff"``): ``cost(x, y)`` maps
            (B, N, D) and (B, M, D) points to a (B, N, M) matrix (``p`` then only sets ``eps = blur^p``
            and the scaling).  Its matrices are materialised (memory guard of the ``dense`` engine)
            and the iterations stream them; gradients go through the function by autograd, with
            GeomLoss' convention (``cost(x, y.detach())``, envelope theorem).  KeOps formula strings
            raise ``NotImplementedError``.  Or a :class:`~flashot.LabelCost` (``loss="sinkhorn"``): the
            label-augmented cost, streamed, with the labels in the call, ``L(x, y, labels=(lx, ly))``.
        kernel: GeomLoss' kernel function for the kernel norms: ``kernel(x, y, blur=, use_keops=,
            ranges=)`` -> (B, N, M), materialised.
        cluster_scale: ``backend="multiscale"``: the side of its coarse clusters (default: GeomLoss' from
            the diameter and the dimension, halved while both clouds occupy at most 10,000 cells and the
            cells stay wider than a quarter of the last pruning radius; the fine blocks are halved from
            GeomLoss' while they keep >= 64 points on average).
        truncate: ``backend="multiscale"``: keep only the blocks of clusters whose bound on
            ``C - f - g`` is within ``truncate * eps`` (re-pruned at every temperature;
            ``truncate=None`` keeps all).
        backend: ``"auto"``, GeomLoss' ``"tensorized"`` (= our ``dense``) or
            ``"online"`` (our best streaming engine), or one of our engine names.
            ``"multiscale"``: GeomLoss' coarse-to-fine solver (:mod:`flashot.multiscale`):
            clusters of side ``cluster_scale``, the coarse schedule on their centroids, then the
            points with only the blocks kept by ``truncate``.  One pair of clouds (no
            batch), balanced or with ``reach`` (semi-unbalanced ``reach_x`` / ``reach_y`` with
            ``debias=False``), ``loss="sinkhorn"``; the six-argument call ``L(labels_x, a, x,
            labels_y, b, y)`` gives the clusters.  ``L.last_multiscale.kept`` lists the kept fractions
            of the pairs.  Its fine iterations run in the ``cpu`` engine's C++ kernels on the CPU, in
            the ``triton`` engine's block-sparse kernels on CUDA tensors (PyTorch without Triton).
            ``"auto"`` picks it where GeomLoss does and where it pays here
            (:func:`auto_multiscale`: one pair of CPU clouds, D <= 3, p = 2, ``N M`` at least
            ``AUTO_MULTISCALE_PAIRS``, blur at most ``diameter / 20``, built-in cost, no
            ``implicit`` / ``warm_start`` / ``shard="points"``; with ``group`` in replicated mode the
            same choice as one process); its value then follows GeomLoss' coarse-to-fine trajectory,
            which lands within ~1% of the single-scale one.
        verbose: show a progress bar (tqdm if installed) over the epsilon-scaling steps.
        implicit: :class:`~flashot.ImplicitDiff` settings of the second derivatives
            (``create_graph=True``: Hessian-vector products by implicit differentiation).
        warm_start: reuse the previous call's potentials and run only the tail of the
            epsilon-scaling (from ``(4 blur)^p``, or ``(warm_start * blur)^p`` for a
            number); see :mod:`flashot.warmstart`.  ``L.last_n_iter`` counts the iterations.
        group: a ``torch.distributed`` process group: each call solves ONE problem over its ranks
            (:mod:`flashot.distributed`; every rank passes the same points, checked at the start);
            ``loss="sinkhorn"`` with the built-in costs.  ``backend="multiscale"`` in replicated mode
            only (each rank computes a range of whole row clusters of the fine blocks).  Construction
            is then a collective (one all-gather): a rank whose options or arguments are rejected makes
            every rank raise the same error (naming that rank) instead of waiting for the group's timeout.
        shard: with ``group``: ``"replicated"`` (default; every rank passes all the points) or ``"points"``
            (every rank passes only its slice of the points and weights; the slices travel around a ring of
            the ranks).  With ``"points"`` the value is the whole problem's (same on every rank), the
            potentials and gradients this rank's slices; ``warm_start`` caches this rank's slices.
        tol: None (default): GeomLoss' schedule, which visits ``eps = blur^p`` once and stops, as GeomLoss
            does (its value can be percents away from the converged one at small blur:
            ``docs/exactness.md``).  A number: after the schedule, symmetric iterations continue at
            ``blur^p`` until the error of every potential (debiasing ones included) is below ``tol`` (L1
            marginal error; potential change / eps with ``reach``), on every engine and with
            ``backend="multiscale"`` (on its pruned blocks, with ``truncate`` raised to ``log(1 / tol)``
            so that the pruning stays within ``tol``); a ``RuntimeWarning`` if ``max_iter`` ends first.
        max_iter: with ``tol``: the most iterations at ``blur^p`` after the schedule (default 1000).

    Call as ``L(x, y)`` (uniform weights) or ``L(a, x, b, y)``, with (N, D) /
    (B, N, D) points and (N,) / (B, N) weights.  Balanced (no ``reach``) weights whose total
    masses differ by more than ``MASS_RTOL`` (relative) give a ``RuntimeWarning`` and GeomLoss'
    value.  Bad input raises before any work: ``TypeError`` (wrong kind of argument),
    ``ValueError`` (bad value), ``NotImplementedError`` (a GeomLoss option not implemented);
    see :mod:`flashot._checks`.

    Example:
        >>> import torch, flashot
        >>> _ = torch.manual_seed(0)
        >>> x, y = torch.randn(20, 2), torch.randn(30, 2)
        >>> L = flashot.SamplesLoss("sinkhorn", p=2, blur=0.5)  # half squared Euclidean cost, eps = blur^2
        >>> float(L(x, x)) == 0.0, bool(L(x, y) > 0)  # S(a, a) = 0
        (True, True)
    """

    @_collective_construction
    def __init__(
        self,
        loss: str = "sinkhorn",
        p: int = 2,
        blur: float = 0.05,
        reach: float | None = None,
        diameter: float | None = None,
        scaling: float = 0.5,
        truncate: float | None = 5,
        cost=None,
        kernel=None,
        cluster_scale: float | None = None,
        debias: bool = True,
        potentials: bool = False,
        verbose: bool = False,
        backend: str = "auto",
        *,
        reach_x: float | None = None,
        reach_y: float | None = None,
        implicit=None,
        warm_start: bool | float = False,
        group=None,
        shard: str = "replicated",
        tol: float | None = None,
        max_iter: int = 1000,
    ):
        super().__init__()
        self.label_cost, cost = (cost, None) if getattr(cost, "labelled", False) else (None, cost)
        if self.label_cost is not None:
            check_label_cost(loss, debias, backend, group, self.label_cost)
        p = check_loss_and_p(loss, p)
        for name, v in (("reach", reach), ("reach_x", reach_x), ("reach_y", reach_y)):
            if (
                isinstance(v, (int, float, np.integer, np.floating))
                and not isinstance(v, bool)
                and 0 < v < float("inf")
            ):
                check_power(name, v, p)  # rho = reach^p: neither 0 nor inf in float64
        self.rho_x, self.rho_y = parse_reach(reach, reach_x, reach_y, p)
        check_custom(loss, cost, kernel, backend, implicit, warm_start)
        if loss == "hausdorff" and (reach is not None or reach_x is not None or reach_y is not None):
            raise NotImplementedError("reach: loss='hausdorff' is implemented for reach=None only")
        multiscale = backend == "multiscale"
        if multiscale or cluster_scale is not None:
            check_multiscale(backend, loss, cost, implicit, warm_start, debias, cluster_scale, self.rho_x, self.rho_y)
        self.cluster_scale = check_positive("cluster_scale", cluster_scale, allow_none=True)
        self.blur = check_positive("blur", blur)
        check_power("blur", self.blur, p)  # eps = blur^p: neither 0 nor inf in float64
        if diameter is not None:
            diameter = check_positive("diameter", diameter)
            check_power("diameter", diameter, p)
        check_scaling(scaling)
        truncate = check_positive("truncate", truncate, allow_none=True)  # multiscale pruning margin (x eps)
        if not isinstance(backend, str):
            raise TypeError(f"backend: expected a string, got {type(backend).__name__}")
        self.loss, self.p, self.reach, self.diameter = loss, p, reach, diameter
        self.reach_x, self.reach_y = reach_x, reach_y
        self.scaling, self.truncate, self.debias = float(scaling), truncate, check_bool("debias", debias)
        self.potentials, self.verbose = check_bool("potentials", potentials), check_bool("verbose", verbose)
        self.backend = backend
        self.cost, self.kernel = cost, kernel
        self.implicit = check_implicit(implicit)
        self._implicit_given = implicit is not None
        self.warm_start = check_warm_start(warm_start)
        if (self.rho_x is not None or self.rho_y is not None) and (implicit is not None or self.warm_start is not None):
            raise NotImplementedError(
                "implicit= and warm_start= support balanced OT only; use reach=None (reach_x/reach_y=None) "
                "or drop implicit/warm_start"
            )
        if group is not None or shard != "replicated":
            check_group(group, shard, loss, cost, multiscale)
        self.group, self.shard = group, shard
        self.tol = check_positive("tol", tol, allow_none=True)
        self.max_iter = check_int("max_iter", max_iter, minimum=1)
        if self.tol is not None and loss != "sinkhorn":
            raise ValueError(f"tol: only loss='sinkhorn' iterates (loss={loss!r} is computed in one pass); drop tol")
        self._warm_cache = None
        self.last_n_iter = None
        self.last_multiscale = None

    def reset_warm_start(self) -> None:
        """Forget the cached potentials (the next call runs the full schedule)."""
        self._warm_cache = None

    def _with_labels(self, args, labels):
        """``args`` with the points augmented by their labels (``[x, label]``) for a :class:`~flashot.LabelCost`."""
        if labels is None and self.label_cost is None:
            return args
        if self.label_cost is None:
            raise ValueError("labels: used with cost=flashot.LabelCost(W, ...) only (a class-to-class cost table)")
        if labels is None:
            raise ValueError("cost=LabelCost(...): give the points' class labels, L(x, y, labels=(labels_x, labels_y))")
        if len(args) not in (2, 4):
            raise ValueError(f"SamplesLoss with a LabelCost takes (x, y) or (a, x, b, y), got {len(args)} arguments")
        x, y = args[-3] if len(args) == 4 else args[0], args[-1]
        x, y = self.label_cost.augment(x, y, labels)
        return (x, y) if len(args) == 2 else (args[0], x, args[2], y)

    def _split_args(self, args):
        """``(x, y)``, ``(a, x, b, y)`` or GeomLoss' multiscale ``(labels_x, a, x, labels_y, b, y)``: returns
        ``(a, x, b, y)`` and stores the labels (None without them)."""
        self._labels = (None, None)
        if len(args) == 2:
            return None, args[0], None, args[1]
        if len(args) == 4:
            return args
        if len(args) == 6:
            if self.backend != "multiscale":
                raise ValueError(
                    "cluster labels (six-argument call) belong to backend='multiscale'; call L(a, x, b, y)"
                )
            lx, a, x, ly, b, y = args
            self._labels = (check_labels("labels_x", lx, x), check_labels("labels_y", ly, y))
            return a, x, b, y
        raise ValueError(f"SamplesLoss takes (x, y) or (a, x, b, y), got {len(args)} arguments")

    def forward(
        self, *args: Tensor, x_batch: Tensor | None = None, y_batch: Tensor | None = None, labels: tuple | None = None
    ):
        """The loss between ``(a, x)`` and ``(b, y)``: ``L(x, y)`` (uniform weights) or ``L(a, x, b, y)``.

        Ragged batches (:mod:`flashot.ragged`): lists of clouds ``L(xs, ys)`` / ``L(a_list, xs, b_list, ys)``,
        or concatenated (N, D), (M, D) points with PyTorch Geometric batch vectors ``x_batch``, ``y_batch``
        (sorted problem indices): a (B,) value, one solve for all the problems.

        ``loss="sinkhorn"``: ``S(a, b) = OT_eps(a, b) - (OT_eps(a, a) + OT_eps(b, b)) / 2``
        (``debias=True``) or ``OT_eps(a, b)``, with ``eps = blur^p`` and ``C = |x - y|^2 / 2``
        (``p=2``) or ``|x - y|`` (``p=1``); the other losses as in the class docstring.

        Args:
            *args: ``(x, y)`` or ``(a, x, b, y)``: (N, D) / (M, D) points, or (B, N, D) /
                (B, M, D); (N,) / (M,) (or (B, N) / (B, M)) weights.
            labels: with ``cost=flashot.LabelCost(W, ...)``: ``(labels_x, labels_y)``, the points' integer
                class labels (shape ``x.shape[:-1]``, ``y.shape[:-1]``); the cost is ``feature_weight |x - y|^2
                + label_weight W[l, l']`` with ``eps = blur^p``.
        Returns:
            The value, () or (B,), differentiable w.r.t. the points and weights (envelope
            theorem); with ``potentials=True`` the dual potentials ``(F, G)``, (N,) / (M,)
            (or batched) instead.

        Example:
            >>> import torch, flashot
            >>> _ = torch.manual_seed(0)
            >>> x = torch.randn(20, 2, requires_grad=True)
            >>> a, y, b = torch.full((20,), 1 / 20), torch.randn(30, 2), torch.full((30,), 1 / 30)
            >>> L = flashot.SamplesLoss("sinkhorn", p=2, blur=0.5)
            >>> value = L(a, x, b, y)  # the same as L(x, y) here (uniform weights)
            >>> value.shape, bool(torch.allclose(value, L(x, y)))
            (torch.Size([]), True)
            >>> g, = torch.autograd.grad(value, x)
            >>> g.shape
            torch.Size([20, 2])
        """
        if is_ragged_call(args, x_batch, y_batch):  # lists of clouds or batch vectors: flashot.ragged
            if labels is not None or self.label_cost is not None:
                raise NotImplementedError("labels / LabelCost: not on a ragged batch; call the loss once per problem")
            return ragged_samples_loss(self, args, x_batch, y_batch, implicit_given=self._implicit_given)
        args = self._with_labels(args, labels)
        replicated = self.group is not None and self.shard == "replicated"  # one problem over a group's ranks
        with rank_checks(self.group):  # local checks: with a group, one rank's rejection raises on every rank
            a_in, x, b_in, y = self._split_args(args)
            m = self._measures(x, y, a_in, b_in, _P_COSTS[self.p]) if replicated else None
        self.last_multiscale = None
        if self.loss != "sinkhorn":
            return self._other_loss(a_in, x, b_in, y)
        m = self._problem(m, x, y, a_in, b_in)
        cfg, strategy = self._config(m, x, y, a_in, b_in)
        solved = solve_problem(m, cfg, strategy)  # the core's one solve (flashot.driver)
        self.last_n_iter, self.last_multiscale = solved.n_iter, solved.run
        return self._read_out(solved, a_in, b_in)

    def _problem(self, m: Measures | None, x, y, a_in, b_in) -> Measures:
        """The problem of a ``loss="sinkhorn"`` call: on a user's cost function (GeomLoss' tensorized ``cost``),
        on this process's points (or this rank's slices with ``shard="points"``), or ``m`` (replicated over the
        group's ranks) checked and sharded across them."""
        if self.cost is not None:
            sides = ("xy", "yx", "xx", "yy") if self.debias else ("xy", "yx")
            return function_measures(
                self.cost, x, y, a_in, b_in, sides=sides, detach_second=True, names=("α", "x", "β", "y")
            )
        if m is None:  # one process, or this rank's slices (shard="points": checked across the ranks)
            return self._measures(x, y, a_in, b_in, _P_COSTS[self.p])
        from .distributed import distribute_measures

        distribute_measures(m, self.group, self._option_reprs(_REPLICATED_OPTIONS))
        return m

    def _option_reprs(self, names: tuple[str, ...]) -> dict[str, str]:
        """The options every rank of a group must pass the same (name -> repr)."""
        return {k: repr(getattr(self, k)) for k in names}

    def _config(self, m: Measures, x, y, a_in, b_in) -> tuple[LoopConfig, Strategy | None]:
        """GeomLoss' loop on ``m`` and the strategy that runs it: the epsilon-scaling from the diameter (given, or
        of the clouds' joint bounding box over all batches, un-centred, as GeomLoss) to ``blur^p``, symmetric
        updates, continued at ``blur^p`` until ``tol`` when given; coarse-to-fine (``backend="multiscale"``, or
        ``"auto"`` where :func:`auto_multiscale` picks it), warm-started (``warm_start``) or single scale."""
        check_eps_scale("blur", self.blur**self.p, m.cmax, m.x.dtype)
        diameter = (
            self.diameter
            if self.diameter is not None
            else (max_diameter(x, y) if self.cost is not None else m.bbox_diameter())
        )
        diameter = max(diameter, self.blur)
        cfg = LoopConfig(
            epsilon_scaling(self.p, diameter, self.blur, self.scaling),
            symmetric=True,
            debias=self.debias,
            rho_x=self.rho_x,
            rho_y=self.rho_y,
            tol=self.tol,
            refine=None if self.tol is None else self.max_iter,
            verbose=self.verbose,
        )
        if self.rho_x is None and self.rho_y is None and (a_in is not None or b_in is not None):
            _warn_unequal_masses(m)  # (uniform weights: mass 1, no sync)
        if self.backend == "multiscale" or (self.backend == "auto" and self._auto_multiscale(m, diameter)):
            config = ms.MultiscaleConfig(self.cluster_scale, self.truncate)
            return cfg, ms.Multiscale(config, self.p, diameter, labels=self._labels, group=self.group)
        if self.warm_start is not None:  # (balanced only)
            return cfg, WarmStart(self, self.warm_start, self.p, self.blur)
        return cfg, None

    def _read_out(self, solved: Solved, a_in, b_in):
        """The value (debiased or not) or the potentials of the ``solved`` state, on its measures (multiscale:
        the sorted points, potentials given back in the inputs' order)."""
        m, st, run = solved.m, solved.state, solved.run
        if self.rho_x is not None or self.rho_y is not None:
            return self._unbalanced(m, st, self.rho_x, self.rho_y, a_in, b_in, run)
        if not self.potentials and self.cost is None:  # barycentres: envelope gradients without plan products
            f, g, f_aa, g_bb, bary = final_values(m, st)
            return m.restore(sinkhorn_value(m, st, f, g, f_aa, g_bb, implicit=self.implicit, bary=bary))
        f, g, f_aa, g_bb = final_step(m, st)
        if not self.potentials:  # autograd through the cost function's matrices
            value = (m.a * f).sum(-1) + (m.b * g).sum(-1)
            return m.restore(value - (m.a * f_aa).sum(-1) - (m.b * g_bb).sum(-1) if self.debias else value)
        if self.debias:
            f, g = f - f_aa, g - g_bb
        return self._potentials(m, f, g, a_in, b_in, run)

    def _auto_multiscale(self, m: Measures, diameter: float) -> bool:
        """Whether ``backend="auto"`` runs this call coarse-to-fine (see :func:`auto_multiscale`)."""
        if self.cost is not None or self._implicit_given or self.warm_start is not None:
            return False  # (shard="points": auto_multiscale refuses points-sharded measures)
        if self.debias and self.rho_x != self.rho_y:
            return False  # two-sided self problems: single-scale only
        return auto_multiscale(m, self.p, self.blur, diameter)

    def _measures(self, x, y, a_in, b_in, cost: str) -> Measures:
        """The validated, centred pair on the engine this loss's ``backend`` names (GeomLoss' names mapped);
        this rank's slices of one problem with ``shard="points"`` (:func:`flashot.distributed.points_measures`)."""
        backend = _GEOMLOSS_BACKENDS.get(self.backend, self.backend)
        cost = cost if self.label_cost is None else self.label_cost  # a LabelCost: on the points [x, label]

        def build(x, y, a, b):
            return Measures.build(
                x, y, a, b, cost=cost, backend=backend, allow_dense=self.backend != "online", names=("α", "x", "β", "y")
            )

        if getattr(self, "shard", "replicated") != "points":
            return build(x, y, a_in, b_in)
        from .distributed import points_measures

        return points_measures(
            x,
            y,
            a_in,
            b_in,
            group=self.group,
            build=build,
            options=self._option_reprs(_POINTS_OPTIONS),
            names=("x", "y", "α", "β"),
        )

    def _other_loss(self, a_in, x, b_in, y):
        """Kernel norms and the Hausdorff divergence (:mod:`flashot.kernel_losses`): no Sinkhorn loop."""
        kernel = self.loss in KERNELS
        if kernel and self.kernel is not None:
            m = function_measures(
                partial(self.kernel, blur=self.blur, use_keops=False, ranges=None),
                x,
                y,
                a_in,
                b_in,
                sides=("xy", "yx", "xx", "yy"),
                detach_second=False,
                names=("α", "x", "β", "y"),
            )
            out = kernel_matrix_loss(m, self.potentials)
            return self._potentials(m, *out, a_in, b_in) if self.potentials else m.restore(out)
        if self.cost is not None:  # hausdorff with a user's cost function
            m = function_measures(
                self.cost,
                x,
                y,
                a_in,
                b_in,
                sides=("xy", "yx", "xx", "yy"),
                detach_second=False,
                names=("α", "x", "β", "y"),
            )
            check_eps_scale("blur", self.blur**self.p, m.cmax, m.x.dtype)
            out = hausdorff_loss(m, self.blur**self.p, self.potentials)
            return self._potentials(m, *out, a_in, b_in) if self.potentials else m.restore(out)
        cost = ("half_sqeuclidean" if self.loss == "gaussian" else "euclidean") if kernel else _P_COSTS[self.p]
        m = self._measures(x, y, a_in, b_in, cost)
        if kernel:
            out = kernel_loss(self.loss, m, self.blur, self.backend, self.potentials)
        else:
            check_eps_scale("blur", self.blur**self.p, m.cmax, m.x.dtype)
            out = hausdorff_loss(m, self.blur**self.p, self.potentials)
        return self._potentials(m, *out, a_in, b_in) if self.potentials else m.restore(out)

    @staticmethod
    def _potentials(m: Measures, f: Tensor, g: Tensor, a_in, b_in, run: ms.MultiscaleRun | None = None):
        """(F, G) with the shapes of the given weights ((N,) / (N, 1) / batched); potentials of a multiscale
        ``run``'s sorted points back in the inputs' order."""
        if run is not None:
            f, g = ms.unsort(f, run.cx.perm), ms.unsort(g, run.cy.perm)
        F, G = m.restore(f), m.restore(g)
        if a_in is not None and a_in.dim() > F.dim():
            F, G = F.view_as(a_in), G.view_as(b_in)
        return F, G

    def plan(self, *args, tol: float | None = 1e-4, max_iter: int = 1000):
        """The lazy entropic plan of ``OT_eps(a, b)``: a :class:`~flashot.plan.LazyPlan`.

        Call like the loss (``L.plan(x, y)`` or ``L.plan(a, x, b, y)``).  The plan is
        built from the *cross* potentials of the same schedule with ``debias=False``
        (the debiased potentials returned by ``potentials=True, debias=True`` are
        gradients of the divergence and do not define a plan).

        GeomLoss' schedule visits the final temperature only once, so its potentials
        give a plan whose marginals can be off by tens of percent (L1) at small
        blur.  With ``tol`` (default 1e-4) they are refined by alternating Sinkhorn
        iterations at ``eps = blur^p`` (warm-started, :func:`~flashot.solve_sample`)
        until the L1 marginal error is below ``tol`` (at most ``max_iter``);
        ``tol=None`` keeps the raw GeomLoss potentials.  Not differentiable.

        The plan is ``P_ij = a_i b_j exp((f_i + g_j - C(x_i, y_j)) / eps)`` with ``eps = blur^p``
        and ``C = |x - y|^2 / 2`` (``p=2``) or ``|x - y|`` (``p=1``).

        Example:
            >>> import torch, flashot
            >>> _ = torch.manual_seed(0)
            >>> x, y = torch.randn(20, 2), torch.randn(30, 2)
            >>> P = flashot.SamplesLoss("sinkhorn", p=2, blur=0.5).plan(x, y)
            >>> P.shape, float((P.sum(axis=1) - 1 / 20).abs().sum()) < 1e-3  # row sums = a
            ((20, 30), True)
        """
        from ._checks import check_int
        from .plan import plan_from_potentials
        from .pot_samples import solve_sample

        if is_ragged_call(args):
            raise NotImplementedError(
                "plan: not on a ragged batch; flashot.solve_sample(xs, ys, reg=blur**p, "
                "cost=...) gives each problem's plan (result.plan(k))"
            )
        if self.loss != "sinkhorn":
            raise ValueError(f"plan: loss={self.loss!r} defines no transport plan; use loss='sinkhorn'")
        if self.label_cost is not None:
            raise NotImplementedError(
                "plan: not implemented with a LabelCost; use flashot.solve_sample(x, y, "
                "reg=blur**p, cost=LabelCost(...), labels=(lx, ly)).plan"
            )
        if self.cost is not None:
            raise NotImplementedError(
                "plan: not implemented with a cost function; build the matrix and call "
                "flashot.solve(M, a, b, reg=blur**p) (its result has the plan)"
            )
        tol = check_positive("tol", tol, allow_none=True)  # before the loss runs
        max_iter = check_int("max_iter", max_iter)
        a_in, x, b_in, y = self._split_args(args)
        L = SamplesLoss(
            p=self.p,
            blur=self.blur,
            diameter=self.diameter,
            scaling=self.scaling,
            debias=False,
            potentials=True,
            backend=self.backend,
        )
        with torch.no_grad():
            F, G = L(*args)
        F, G = F.reshape(x.shape[:-1]), G.reshape(y.shape[:-1])
        if a_in is not None:
            a_in, b_in = a_in.detach().reshape(x.shape[:-1]), b_in.detach().reshape(y.shape[:-1])
        backend = _GEOMLOSS_BACKENDS.get(self.backend, self.backend)
        x, y = x.detach(), y.detach()
        if tol is None:
            return plan_from_potentials(x, y, F, G, a_in, b_in, blur=self.blur, p=self.p, backend=backend)
        res = solve_sample(
            x,
            y,
            a_in,
            b_in,
            cost=_P_COSTS[self.p],
            reg=self.blur**self.p,
            tol=tol,
            max_iter=max_iter,
            potentials_init=(F, G),
            backend=backend,
        )
        return res.plan

    def _unbalanced(self, m: Measures, st: SinkhornState, rx, ry, a_in, b_in, run: ms.MultiscaleRun | None = None):
        """The value or potentials of the state ``st`` with KL-penalised marginals (GeomLoss' reach, or our
        semi-unbalanced reach_x / reach_y); ``run``: the multiscale run that left ``st`` (sorted points)."""
        if st.g_aa is not None:  # debiasing with rho_x != rho_y: two-sided self problems
            f, g, _, _ = final_step(m, replace(st, f_aa=None, g_bb=None), rho_x=rx, rho_y=ry)
            f_aa, g_aa, f_bb, g_bb = self_terms_final(m, st, rx, ry)
            if self.potentials:
                return self._potentials(m, f - 0.5 * (f_aa + g_aa), g - 0.5 * (f_bb + g_bb), a_in, b_in)
            val = debiased_dual_value_two_sided(
                *m.full("xyxyxxyy", m.a, m.b, f, g, f_aa, g_aa, f_bb, g_bb), st.eps, rx, ry
            )
            return m.restore(warn_on_second_order(val))
        f, g, f_aa, g_bb = final_step(m, st, rho_x=rx, rho_y=ry)
        if self.potentials:
            if self.debias:
                f, g = f - f_aa, g - g_bb
            return self._potentials(m, f, g, a_in, b_in, run)
        if self.debias:
            val = debiased_dual_value(*m.full("xyxyxy", m.a, m.b, f, g, f_aa, g_bb), st.eps, rx, ry)
        else:
            val = dual_value(*m.full("xyxy", m.a, m.b, f, g), st.eps, rx, ry)
        return m.restore(warn_on_second_order(val))
