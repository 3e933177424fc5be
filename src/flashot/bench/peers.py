"""One small runner per solver.  Runners execute inside a worker process.

Every runner solves the same problem (``problems.Problem``): uniform weights,
``C(x, y) = |x - y|^2`` at temperature ``eps``, a fixed number ``K`` of
*alternating* log-domain Sinkhorn iterations (one iteration = one softmin
onto ``x`` followed by one softmin onto ``y``), no early stopping, starting from
zero potentials (POT/OTT start from zero log-scalings, which differ from zero
potentials by a constant; the dual value ``<a, f> + <b, g>`` is unaffected).

What each runner times (``solve``), from points already in the library's own
array type to potentials ready in memory:

* ``flashot:<engine>``: ``Measures.build`` + ``sinkhorn_loop(m, [eps], symmetric=False,
  tol=None, init=...)`` called K times (identical to one call with ``[eps] * K``;
  stepping lets us record the dual value after every iteration, untimed).
* ``geomloss-tensorized``: GeomLoss' own ``squared_distances`` for C_xy and C_yx
  (as ``sinkhorn_tensorized`` does), then K alternating updates calling
  GeomLoss' ``softmin_tensorized``.
* ``geomloss-online``: K alternating updates calling GeomLoss' ``softmin_online``
  with its KeOps ``lse_genred`` reduction for the cost formula ``SqDist(X,Y)``
  (= |x - y|^2, no 1/2: GeomLoss accepts custom KeOps cost formulas, so eps is
  passed unchanged).  GeomLoss' ``sinkhorn_loop`` itself has no fixed-iteration,
  alternating mode (it averages symmetric updates and adds an initial and a
  final extrapolation step), so its softmin kernels are driven by our loop.
* ``pot-dense``: ``ot.dist`` (torch) + ``ot.sinkhorn(..., method="sinkhorn_log",
  numItermax=K, stopThr=0)``.  POT updates the second potential first, so it
  is called with the clouds swapped (the value is symmetric).  POT also computes
  a marginal error at iterations 0, 10, 20, ... and returns the dense plan;
  both are part of its call and are timed.
* ``pot-lazy``: ``ot.bregman.empirical_sinkhorn(..., isLazy=True, numIterMax=K,
  stopThr=0, batchSize=B)`` on torch tensors (POT computes blocks of the cost
  with numpy/scipy; its marginal check every 10th iteration is timed too).
* ``ott-dense`` / ``ott-online``: ``PointCloud(batch_size=None / B)`` +
  ``Sinkhorn(threshold=-1, min_iterations=K, max_iterations=K,
  inner_iterations=K)``, jitted and compiled ahead of time for the full shape
  and K (compile not timed), result blocked until ready.  OTT updates ``g`` first, so it is also
  called with the clouds swapped.  One marginal-error evaluation at the end of
  the K iterations is part of OTT's loop.
* ``flash-sinkhorn``: needs CUDA + Triton; reported as missing here.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .problems import Problem

# Rows per block for the batched peers (POT lazy, OTT online): about 2**23 cost entries.
BLOCK_ENTRIES = 2**23


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _missing_modules(*mods: str) -> str | None:
    miss = [m for m in mods if importlib.util.find_spec(m) is None]
    return f"not installed ({', '.join(miss)})" if miss else None


@dataclass
class Result:
    f: np.ndarray  # potential on x, (n,)
    g: np.ndarray  # potential on y, (m,)
    trajectory: list[tuple[np.ndarray, np.ndarray]] | None = None  # (f, g) after each iteration
    engine: str | None = None


class Runner:
    """Base class.  ``setup``, ``warmup`` (given a small problem's state) and ``prepare`` are untimed,
    ``solve`` is timed."""

    name: str = ""
    library: str = ""  # distribution name for the version column
    modules: tuple[str, ...] = ()
    # Rough bytes of memory per (i, j) pair the solver materialises (dense solvers), for the memory guard.
    bytes_per_pair: float = 0.0
    note: str = ""

    def missing(self) -> str | None:
        """None if the runner can run on this machine, else why not (cheap: no heavy imports)."""
        return _missing_modules(*self.modules)

    def version(self) -> str:
        return _version(self.library) or "?"

    def setup(self, prob: Problem, x: np.ndarray, y: np.ndarray) -> Any:
        raise NotImplementedError

    def warmup(self, st: Any) -> None:
        self.solve(st, 1)

    def prepare(self, st: Any, iters: int) -> None:
        """Untimed work that depends on the iteration count (JAX: compile)."""

    def solve(self, st: Any, iters: int, record: bool = False) -> Result:
        raise NotImplementedError


# ----------------------------------------------------------------------------- flashot
class FlashotRunner(Runner):
    library = "flashot"
    modules = ("torch",)

    def __init__(self, engine: str = "auto"):
        self.engine = engine
        self.name = f"flashot:{engine}"
        self.note = "Measures.build + K x sinkhorn_loop(symmetric=False, tol=None)"

    def missing(self):
        from ..ops import engine_names

        if self.engine != "auto" and self.engine not in engine_names():
            return f"engine not registered (registered: {', '.join(engine_names())})"
        return None

    def version(self):
        import flashot

        return flashot.__version__

    def setup(self, prob, x, y):
        import torch

        a, b = prob.weights()
        return dict(x=torch.from_numpy(x), y=torch.from_numpy(y), a=torch.from_numpy(a),
                    b=torch.from_numpy(b), eps=prob.eps)

    def solve(self, st, iters, record=False):
        from ..measures import Measures
        from ..sinkhorn import sinkhorn_loop

        m = Measures.build(st["x"], st["y"], st["a"], st["b"], cost="sqeuclidean", backend=self.engine)
        s = None
        traj = []
        for _ in range(iters):
            s = sinkhorn_loop(m, [st["eps"]], symmetric=False, tol=None,
                              init=None if s is None else (s.f, s.g), warn=False)
            if record:
                traj.append((s.f, s.g))
        conv = lambda t: t[0].double().numpy()  # noqa: E731
        traj = [(conv(f), conv(g)) for f, g in traj] if record else None
        return Result(conv(s.f), conv(s.g), traj, engine=m.engine.name)


# ----------------------------------------------------------------------------- GeomLoss
class GeomLossTensorized(Runner):
    name = "geomloss-tensorized"
    library = "geomloss"
    modules = ("geomloss", "torch")
    bytes_per_pair = 4 * 4.0  # C_xy, C_yx, and two (N, M) temporaries of the logsumexp
    note = "squared_distances (C_xy, C_yx) + K x (softmin_tensorized, softmin_tensorized), our loop"

    def setup(self, prob, x, y):
        import torch

        a, b = prob.weights()
        return dict(x=torch.from_numpy(x)[None], y=torch.from_numpy(y)[None],
                    a_log=torch.from_numpy(a).log()[None], b_log=torch.from_numpy(b).log()[None], eps=prob.eps)

    def solve(self, st, iters, record=False):
        import torch
        from geomloss._legacy.sinkhorn_samples import softmin_tensorized
        from geomloss._legacy.utils import squared_distances

        eps = st["eps"]
        with torch.no_grad():
            C_xy = squared_distances(st["x"], st["y"])  # |x - y|^2 (GeomLoss p=2 would halve it)
            C_yx = squared_distances(st["y"], st["x"])
            f = torch.zeros_like(st["a_log"])
            g = torch.zeros_like(st["b_log"])
            traj = []
            for _ in range(iters):
                f = softmin_tensorized(eps, C_xy, st["b_log"] + g / eps)
                g = softmin_tensorized(eps, C_yx, st["a_log"] + f / eps)
                if record:
                    traj.append((f, g))
        conv = lambda t: t[0].double().numpy()  # noqa: E731
        return Result(conv(f), conv(g), [(conv(p), conv(q)) for p, q in traj] if record else None)


class GeomLossOnline(Runner):
    name = "geomloss-online"
    library = "geomloss"
    modules = ("geomloss", "pykeops", "torch")
    note = "K x (softmin_online, softmin_online) with KeOps lse_genred('SqDist(X,Y)'), our loop"

    def setup(self, prob, x, y):
        import torch
        from geomloss._legacy.sinkhorn_samples import lse_genred

        a, b = prob.weights()
        return dict(x=torch.from_numpy(x), y=torch.from_numpy(y), a_log=torch.from_numpy(a).log(),
                    b_log=torch.from_numpy(b).log(), eps=prob.eps, lse=lse_genred("SqDist(X,Y)", prob.d))

    def solve(self, st, iters, record=False):
        import torch
        from geomloss._legacy.sinkhorn_samples import softmin_online

        eps, lse = st["eps"], st["lse"]
        with torch.no_grad():
            f = torch.zeros_like(st["a_log"])
            g = torch.zeros_like(st["b_log"])
            traj = []
            for _ in range(iters):
                f = softmin_online(eps, (st["x"], st["y"]), st["b_log"] + g / eps, log_conv=lse).view(-1)
                g = softmin_online(eps, (st["y"], st["x"]), st["a_log"] + f / eps, log_conv=lse).view(-1)
                if record:
                    traj.append((f, g))
        conv = lambda t: t.double().numpy()  # noqa: E731
        return Result(conv(f), conv(g), [(conv(p), conv(q)) for p, q in traj] if record else None)


# ----------------------------------------------------------------------------- POT
class PotDense(Runner):
    name = "pot-dense"
    library = "pot"
    modules = ("ot", "torch")
    bytes_per_pair = 5 * 4.0  # M, -M/reg, the logsumexp argument and its exp, the returned plan
    note = "ot.dist + ot.sinkhorn(method='sinkhorn_log', stopThr=0), torch backend, clouds swapped"

    def setup(self, prob, x, y):
        import torch

        a, b = prob.weights()
        return dict(x=torch.from_numpy(x), y=torch.from_numpy(y), a=torch.from_numpy(a), b=torch.from_numpy(b),
                    eps=prob.eps)

    def solve(self, st, iters, record=False):
        import ot
        import torch

        eps = st["eps"]
        with torch.no_grad():
            # Swapped: POT updates the potential of its second argument first; we want x first.
            M = ot.dist(st["y"], st["x"], metric="sqeuclidean")
            _, log = ot.sinkhorn(st["b"], st["a"], M, eps, method="sinkhorn_log", numItermax=iters,
                                 stopThr=0.0, log=True, warn=False)
            f = eps * (log["log_v"] - st["a"].log())
            g = eps * (log["log_u"] - st["b"].log())
        return Result(f.double().numpy(), g.double().numpy())


class PotLazy(Runner):
    name = "pot-lazy"
    library = "pot"
    modules = ("ot", "torch")
    note = "ot.bregman.empirical_sinkhorn(isLazy=True, stopThr=0, batchSize=2**23//m), torch backend"

    def setup(self, prob, x, y):
        import torch

        a, b = prob.weights()
        return dict(x=torch.from_numpy(x), y=torch.from_numpy(y), a=torch.from_numpy(a), b=torch.from_numpy(b),
                    eps=prob.eps, bs=max(1, BLOCK_ENTRIES // max(prob.n, prob.m)))

    def solve(self, st, iters, record=False):
        import ot

        eps = st["eps"]
        f, g = ot.bregman.empirical_sinkhorn(st["x"], st["y"], eps, st["a"], st["b"], metric="sqeuclidean",
                                             numIterMax=iters, stopThr=0.0, isLazy=True, batchSize=st["bs"],
                                             warn=False)
        f = eps * (f - st["a"].log())
        g = eps * (g - st["b"].log())
        return Result(f.double().numpy(), g.double().numpy())


# ----------------------------------------------------------------------------- OTT-JAX
class _Ott(Runner):
    library = "ott-jax"
    modules = ("ott", "jax")
    online = False

    def setup(self, prob, x, y):
        import jax

        if prob.dtype == "float64":
            jax.config.update("jax_enable_x64", True)
        import jax.numpy as jnp

        a, b = prob.weights()
        bs = max(1, BLOCK_ENTRIES // max(prob.n, prob.m)) if self.online else None
        st = dict(x=jnp.asarray(x), y=jnp.asarray(y), a=jnp.asarray(a), b=jnp.asarray(b), eps=prob.eps, bs=bs,
                  compiled={})
        return st

    def _compiled(self, st, iters):
        if iters in st["compiled"]:
            return st["compiled"][iters]
        import jax
        import jax.numpy as jnp
        from ott.geometry import pointcloud
        from ott.problems.linear import linear_problem
        from ott.solvers.linear import sinkhorn

        eps, bs = st["eps"], st["bs"]

        def run(x, y, a, b):
            # Swapped: OTT updates g (second cloud) first; we want x first.
            geom = pointcloud.PointCloud(y, x, epsilon=eps, batch_size=bs)
            prob = linear_problem.LinearProblem(geom, b, a)
            solver = sinkhorn.Sinkhorn(threshold=-1.0, min_iterations=iters, max_iterations=iters,
                                       inner_iterations=iters)
            out = solver(prob)
            # OTT's plan is exp((f + g - C) / eps) (no a x b factor): shift to the a x b convention.
            return out.g - eps * jnp.log(a), out.f - eps * jnp.log(b)  # potential on x, on y

        fn = jax.jit(run).lower(st["x"], st["y"], st["a"], st["b"]).compile()
        st["compiled"][iters] = fn
        return fn

    def warmup(self, st):
        import jax

        # The small problem: compiles and runs the 1-iteration program once (JAX/XLA start-up costs).
        jax.block_until_ready(self._compiled(st, 1)(st["x"], st["y"], st["a"], st["b"]))

    def prepare(self, st, iters):
        self._compiled(st, iters)

    def solve(self, st, iters, record=False):
        import jax

        fn = self._compiled(st, iters)
        f, g = jax.block_until_ready(fn(st["x"], st["y"], st["a"], st["b"]))
        return Result(np.asarray(f, np.float64), np.asarray(g, np.float64))


class OttDense(_Ott):
    name = "ott-dense"
    bytes_per_pair = 4 * 4.0
    note = "PointCloud + Sinkhorn(min=max=inner=K, threshold=-1), jit AOT, clouds swapped"


class OttOnline(_Ott):
    name = "ott-online"
    online = True
    note = "PointCloud(batch_size=2**23//m) + Sinkhorn(min=max=inner=K, threshold=-1), jit AOT, clouds swapped"


# ----------------------------------------------------------------------------- flash-sinkhorn
class FlashSinkhorn(Runner):
    name = "flash-sinkhorn"
    library = "flash-sinkhorn"
    modules = ("flash_sinkhorn", "triton")
    note = "needs CUDA + Triton"

    def missing(self):
        why = _missing_modules("flash_sinkhorn")
        if why:
            return why + "; needs CUDA + Triton"
        import torch

        if not torch.cuda.is_available():
            return "installed, but needs CUDA (torch.cuda.is_available() is False)"
        return ("installed with CUDA, but flashot bench has no runner for it yet "
                "(its fixed-iteration API is not verified)")


PEERS: dict[str, Callable[[], Runner]] = {
    "geomloss-tensorized": GeomLossTensorized,
    "geomloss-online": GeomLossOnline,
    "pot-dense": PotDense,
    "pot-lazy": PotLazy,
    "ott-dense": OttDense,
    "ott-online": OttOnline,
    "flash-sinkhorn": FlashSinkhorn,
}


def get_runner(name: str) -> Runner:
    """``flashot:<engine>`` or a peer name."""
    if name.startswith("flashot:"):
        return FlashotRunner(name.split(":", 1)[1])
    if name not in PEERS:
        raise ValueError(f"unknown solver {name!r}")
    return PEERS[name]()
