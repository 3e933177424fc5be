r"""A precomputed cost matrix, streamed by the same engines as the point-cloud costs.

:math:`C(x_i, y_j) = M_{ij}` for a given (N, M) or (B, N, M) matrix, dense (a torch tensor or
numpy array) or *lazy*: any object with ``.shape`` (N, M) and ``__getitem__`` on a pair of
slices returning that block as an array (``numpy.memmap``, an h5py or zarr dataset, POT's
``ot.utils.LazyTensor``), so a matrix larger than memory is read one tile at a time.

The engines see a cost between *index points*: row ``i`` is the 1-D point ``i`` and column
``j`` the point ``N + j`` (exact in float32 up to ``N + M = 2^24``), and :meth:`MatrixCost.tile`
returns the block of ``M`` (or of ``M^T``, for the transposed softmin) that a tile of index
points addresses.  The ``tiled`` engine streams contiguous row and column ranges, so a lazy
matrix is read block by block; ``dense`` reads it whole.  There is no cost between two rows
or two columns (no debiasing) and no gradient with respect to the index points; gradients
with respect to a dense ``M`` come from :func:`flashot.solve` (envelope theorem).
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ._checks import FLOATS, check_storage, check_weights, compute_dtype
from .measures import Measures, log_weights
from .ops import get_engine

# rows + columns addressable by float32 index points without rounding
MAX_FLOAT32_INDEX = 2**24
# rows read per block when scanning a lazy matrix for its range (NaN / Inf check, cmax)
SCAN_ROWS = 1024

_ids = itertools.count()


def is_lazy_matrix(M: object) -> bool:
    """An object with a 2-D ``shape`` that can be sliced (not a tensor or numpy array)."""
    shape = getattr(M, "shape", None)
    if isinstance(M, np.memmap):  # on disk: read one tile at a time, never loaded whole
        return M.ndim == 2
    return (
        not isinstance(M, (Tensor, np.ndarray))
        and hasattr(M, "__getitem__")
        and shape is not None
        and len(tuple(shape)) == 2
    )


SIDES = ("xy", "yx", "xx", "yy")


@dataclass(frozen=True, eq=False)
class MatrixCost:
    """``C(i, N + j) = M[b, i, j]`` between index points (see the module docstring).

    ``M`` is the (B, N, M) ``xy`` block in the compute dtype, or a lazy 2-D matrix (``B = 1``) whose
    blocks are converted on the fly.  ``extra`` may hold the ``"yx"`` (B, M, N) block (else ``M^T``)
    and the ``"xx"`` (B, N, N) / ``"yy"`` (B, M, M) blocks of the debiasing problems.  ``graph``
    holds the same blocks with their autograd history (a user's cost function): the final,
    differentiable step (:meth:`softmin_graph`) goes through them.
    """

    M: object
    n_rows: int
    n_cols: int
    dtype: torch.dtype
    device: torch.device
    name: str = ""
    extra: dict = field(default_factory=dict)
    graph: dict | None = None
    scale = None  # not a dot-product cost
    power = 0
    min_sqdist = 0.0

    is_dot = False
    direct = True  # the engines call tile() / matrix(), never the GEMM expansion

    @property
    def lazy(self) -> bool:
        return not isinstance(self.M, Tensor)

    def _block(self, r0: int, r1: int, c0: int, c1: int) -> Tensor:
        if isinstance(self.M, Tensor):  # not lazy
            return self.M[:, r0:r1, c0:c1]
        blk = read_block(self.M, r0, r1, c0, c1, np.float32 if self.dtype == torch.float32 else np.float64)
        return torch.from_numpy(blk).to(self.device).unsqueeze(0)

    def _side(self, lo: int) -> tuple[str, int]:
        return ("x", 0) if lo < self.n_rows else ("y", self.n_rows)

    def tile(self, u: Tensor, v: Tensor) -> Tensor:
        """Cost block between index points ``u`` (B, n, 1) and ``v`` (B, m, 1): a fresh (B, n, m)
        tensor of ``u``'s dtype (the engines overwrite it)."""
        (u0, u1), (v0, v1) = _span(u), _span(v)
        (su, ou), (sv, ov) = self._side(u0), self._side(v0)
        r0, r1, c0, c1 = u0 - ou, u1 - ou, v0 - ov, v1 - ov
        key = su + sv
        if key in self.extra:
            return self.extra[key][:, r0:r1, c0:c1].to(u.dtype, copy=True)
        if key == "xy":
            blk = self._block(r0, r1, c0, c1)
        elif key == "yx":
            blk = self._block(c0, c1, r0, r1).transpose(-1, -2)
        else:
            raise NotImplementedError(
                "a precomputed cost matrix has no cost between two rows or two columns "
                "(debiasing / self-transport): use point clouds (solve_sample, SamplesLoss)"
            )
        return blk.to(u.dtype, copy=not self.lazy)  # a lazy block is already a fresh tensor

    matrix = tile

    def softmin_graph(self, side: str, h: Tensor, eps: float) -> Tensor:
        """``-eps log sum_k exp(h_k - C_side / eps)`` through the blocks' autograd history (dense)."""
        assert self.graph is not None  # Measures.softmin_grad calls this only with a graph
        C = self.graph.get(side)
        if C is None and side == "yx":
            C = self.graph["xy"].transpose(-1, -2)
        if C is None:
            raise NotImplementedError(f"no {side!r} cost block (debiasing needs the cost within each cloud)")
        return -eps * torch.logsumexp(h.unsqueeze(-2) - C.to(h.dtype) / eps, -1)

    def dcost_weight(self, c: Tensor) -> Tensor:
        raise NotImplementedError("a precomputed cost matrix has no points to differentiate with respect to")

    def from_sqdist(self, d2: Tensor) -> Tensor:
        raise NotImplementedError("a precomputed cost matrix is not a function of distances")


def _span(u: Tensor) -> tuple[int, int]:
    """The contiguous index range ``[first, last + 1)`` that the index points ``u`` hold."""
    n = u.shape[1]
    first, last = (int(t) for t in u[0, [0, n - 1], 0].tolist())
    if last - first + 1 != n:
        raise NotImplementedError(
            "a precomputed cost matrix is read by contiguous tiles of rows and columns; "
            "this engine asked for a scattered set (use backend='tiled' or 'dense')"
        )
    return first, last + 1


def read_block(M: Any, r0: int, r1: int, c0: int, c1: int, dtype: Any = np.float64) -> np.ndarray:
    """``M[r0:r1, c0:c1]`` of a lazy matrix as a fresh, writable array of ``dtype`` (None: its own),
    checked: an array of real numbers (not ``None``, a string, objects) of shape ``(r1 - r0, c1 - c0)``,
    finite.

    Every block is checked when it is read, not only during the range scan: a lazy matrix computed on
    the fly (or a file changed meanwhile) can return NaN later, which the solver would otherwise
    report as an overflow of ``C / eps``."""
    where = f"rows {r0}:{r1}, columns {c0}:{c1}"
    raw = M[r0:r1, c0:c1]
    if isinstance(raw, Tensor):
        raw = raw.detach().cpu()
        raw = (raw.double() if raw.dtype in (torch.float16, torch.bfloat16) else raw).numpy()
    if raw is None or isinstance(raw, (str, bytes, dict, set)):
        raise TypeError(
            f"M: the lazy matrix returned a {type(raw).__name__} for {where}; expected an array of "
            f"real numbers of shape {(r1 - r0, c1 - c0)}"
        )
    try:
        blk = np.asarray(raw)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"M: the lazy matrix returned a {type(raw).__name__} for {where} that is not an array of real numbers ({e})"
        ) from None
    if blk.dtype.kind not in "fiu":
        raise TypeError(
            f"M: the lazy matrix returned a {type(raw).__name__} of dtype {blk.dtype} for {where}; "
            "expected an array of real numbers"
        )
    if blk.shape != (r1 - r0, c1 - c0):
        raise ValueError(
            f"M: the lazy matrix returned a block of shape {blk.shape} for {where} (expected {(r1 - r0, c1 - c0)})"
        )
    blk = np.array(blk, dtype=dtype)  # a writable copy
    if not np.isfinite(blk).all():
        raise ValueError(f"M: the lazy matrix returned NaN or Inf values for {where}")
    return blk


def _scan(M) -> tuple[float, float]:
    """``(min, max)`` of a lazy matrix, read in blocks of rows; raises on NaN / Inf."""
    lo, hi = math.inf, -math.inf
    for r0 in range(0, M.shape[0], SCAN_ROWS):
        blk = read_block(M, r0, min(M.shape[0], r0 + SCAN_ROWS), 0, M.shape[1])
        lo, hi = min(lo, float(blk.min())), max(hi, float(blk.max()))
    return lo, hi


def _lazy_shape(M) -> tuple[int, int]:
    """The ``(N, M)`` of a lazy matrix: two non-negative integers, at least one row and one column."""
    shape = tuple(M.shape)
    try:
        dims = tuple(operator.index(s) for s in shape)
    except TypeError:
        dims = None
    if dims is None or any(s < 0 for s in dims):
        raise ValueError(f"M: the lazy matrix's shape must be two non-negative integers (rows, columns), got {shape}")
    _check_not_empty(dims)
    rows, cols = dims  # two of them: is_lazy_matrix checked the length
    return rows, cols


def _check_not_empty(shape: tuple[int, ...]) -> None:
    if len(shape) == 3 and shape[0] == 0:
        raise ValueError(f"M: the batch of cost matrices is empty (shape {shape})")
    if shape[-2] == 0 or shape[-1] == 0:
        raise ValueError(f"M: the cost matrix must have at least one row and one column, got shape {shape}")


def _lazy_dtype(M) -> torch.dtype:
    """The compute dtype's source of a lazy matrix: its ``dtype`` attribute, else that of its first entry
    (read and checked)."""
    dt = getattr(M, "dtype", None)
    if isinstance(dt, torch.dtype):
        return dt
    try:
        kind = np.dtype(dt) if dt is not None else None
    except TypeError:
        kind = None
    if kind is None:
        kind = read_block(M, 0, 1, 0, 1, dtype=None).dtype
    if kind.kind not in "fiu":
        raise TypeError(f"M: expected real numbers, got dtype {kind}")
    return torch.float32 if kind == np.float32 or kind.itemsize <= 2 and kind.kind == "f" else torch.float64


def matrix_measures(M: Any, a: Any, b: Any, *, backend: str = "auto") -> Measures:
    """:class:`~flashot.measures.Measures` over the cost matrix ``M`` ((N, M) or (B, N, M); torch,
    numpy or lazy) with weights ``a`` (rows) and ``b`` (columns), uniform when None."""
    if backend not in ("auto", "tiled", "dense"):
        raise ValueError(
            f"backend: a precomputed cost matrix runs on 'tiled' (the default, streamed) or 'dense', "
            f"got {backend!r}; the 'cpu' and 'triton' engines compute costs from points "
            "(use solve_sample)"
        )
    lazy = is_lazy_matrix(M)
    shape: tuple[int, ...]
    if lazy:
        shape = _lazy_shape(M)
        cdt = compute_dtype(_lazy_dtype(M))
        device = torch.device("cpu") if not isinstance(a, Tensor) else a.device
        lo, hi = _scan(M)
        B, batched, out_dtype, Mt = 1, False, cdt, M
    else:
        Mt = _check_dense(M)
        _check_not_empty(tuple(Mt.shape))
        batched = Mt.dim() == 3
        Mt = Mt if batched else Mt.unsqueeze(0)
        shape, out_dtype, device = tuple(Mt.shape[1:]), Mt.dtype, Mt.device
        cdt = compute_dtype(Mt.dtype)
        Mt = Mt.to(cdt)
        B = Mt.shape[0]
        with torch.no_grad():
            lo, hi = float(Mt.min()), float(Mt.max())
    N, K = shape
    if cdt == torch.float32 and N + K > MAX_FLOAT32_INDEX:
        raise ValueError(
            f"M: {N} rows + {K} columns exceed what float32 index points address exactly "
            f"({MAX_FLOAT32_INDEX:,}); give M in float64"
        )
    ar = torch.arange(N + K, device=device, dtype=cdt).view(1, -1, 1).expand(B, -1, -1)
    x, y = ar[:, :N].contiguous(), ar[:, N:].contiguous()
    names = ("a", "M's rows", "b", "M's columns")
    a = check_weights("a", _weights(a, device), x if batched else x[0], names[1])
    b = check_weights("b", _weights(b, device), y if batched else y[0], names[3])
    if not batched:
        a, b = a.unsqueeze(0), b.unsqueeze(0)
    a, b = a.to(cdt), b.to(cdt)
    cost = MatrixCost(Mt if lazy else Mt.detach(), N, K, cdt, device, name=f"matrix#{next(_ids)}")
    engine = get_engine(
        "tiled" if backend == "auto" else backend, device=device, dtype=cdt, cost=cost, size=(B, N, K, 1)
    )
    # the spread of the costs bounds every C / eps that matters (a softmin is shift-equivariant)
    cmax = max(hi - lo, abs(hi), abs(lo))
    return Measures(
        x,
        y,
        a,
        b,
        log_weights(a),
        log_weights(b),
        cost,
        engine,
        batched,
        out_dtype,
        torch.zeros(B, 1, 1, dtype=cdt, device=device),
        cmax,
    )


def _weights(w, device: torch.device):
    if w is None or isinstance(w, Tensor):
        return w
    if isinstance(w, np.ndarray):
        if w.dtype.kind not in "fiu":
            raise TypeError(f"weights: expected a real-valued array, got dtype {w.dtype}")
        return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float64)).to(device)
    return w  # check_weights names the wrong type


def _check_dense(M) -> Tensor:
    if isinstance(M, np.ndarray):
        if M.dtype.kind not in "fiu":
            raise TypeError(f"M: expected a real-valued array, got dtype {M.dtype}")
        M = M if M.dtype.kind == "f" else M.astype(np.float64)
        M = torch.from_numpy(np.ascontiguousarray(M) if M.flags.writeable else np.array(M))
    if not isinstance(M, Tensor):
        raise TypeError(
            f"M: expected a torch.Tensor, a numpy.ndarray or a lazy matrix (an object with a 2-D "
            f".shape and slicing, e.g. numpy.memmap), got {type(M).__name__}"
        )
    if M.dtype not in FLOATS:
        raise TypeError(f"M: expected a floating-point matrix, got dtype {M.dtype}")
    check_storage("M", M)
    if M.dim() not in (2, 3):
        raise ValueError(f"M: expected shape (N, M) or (B, N, M), got {tuple(M.shape)}")
    if not bool(torch.isfinite(M.detach()).all()):
        raise ValueError("M: contains NaN or Inf values")
    return M


def _cost_block(fn, u: Tensor, v: Tensor, what: str) -> Tensor:
    """``fn(u, v)``, checked: a finite floating (B, n, m) tensor (memory budget checked first)."""
    from .ops.dense import check_dense_budget

    B, n, m = u.shape[0], u.shape[1], v.shape[1]
    check_dense_budget(B, n, m, compute_dtype(u.dtype), u.device)
    C = fn(u, v)
    if not isinstance(C, Tensor):
        raise TypeError(
            f"cost: the cost function returned a {type(C).__name__} for {what}, expected a (B, N, M) torch.Tensor"
        )
    if tuple(C.shape) != (B, n, m):
        raise ValueError(f"cost: the cost function returned shape {tuple(C.shape)} for {what}, expected {(B, n, m)}")
    if not C.is_floating_point():
        raise TypeError(f"cost: the cost function returned dtype {C.dtype} for {what}, expected floating point")
    if not bool(torch.isfinite(C.detach()).all()):
        raise ValueError(f"cost: the cost function returned NaN or Inf values for {what}")
    return C


def function_measures(
    fn: Callable[[Tensor, Tensor], Tensor],
    x: Tensor,
    y: Tensor,
    a: Tensor | None,
    b: Tensor | None,
    *,
    sides: tuple[str, ...],
    detach_second: bool,
    backend: str = "auto",
    names: tuple[str, str, str, str] = ("a", "x", "b", "y"),
) -> Measures:
    """:class:`~flashot.measures.Measures` over the blocks of a user's cost function (GeomLoss' tensorized
    ``cost``): ``fn(x, y)`` maps (B, N, D), (B, M, D) points to a (B, N, M) matrix.

    ``sides`` lists the blocks to compute (``"xy"`` always; ``"yx"``, ``"xx"``, ``"yy"``), with the second
    argument detached when ``detach_second`` (GeomLoss' Sinkhorn convention: gradients through the first
    slot only, the envelope theorem doing the rest).  The iterations stream the detached blocks; the
    final step goes through their autograd history (:meth:`MatrixCost.softmin_graph`)."""
    from ._checks import check_pair, check_points

    an, xn, bn, yn = names
    check_points(xn, x)
    check_points(yn, y)
    check_pair(x, y, xn, yn)
    batched = x.dim() == 3
    xb, yb = (x, y) if batched else (x.unsqueeze(0), y.unsqueeze(0))
    a = check_weights(an, a, x, xn)
    b = check_weights(bn, b, y, yn)
    if not batched:
        a, b = a.unsqueeze(0), b.unsqueeze(0)
    cdt = compute_dtype(x.dtype)
    pts = {"x": xb, "y": yb}
    graph = {}
    for side in sides:
        u, v = pts[side[0]], pts[side[1]]
        graph[side] = _cost_block(fn, u, v.detach() if detach_second else v, f"C({side[0]}, {side[1]})").to(cdt)
    blocks = {k: t.detach().contiguous() for k, t in graph.items()}
    B, N, K = blocks["xy"].shape
    with torch.no_grad():
        lo = min(float(t.min()) for t in blocks.values())
        hi = max(float(t.max()) for t in blocks.values())
    M = blocks.pop("xy")
    ar = torch.arange(N + K, device=x.device, dtype=cdt).view(1, -1, 1).expand(B, -1, -1)
    ix, iy = ar[:, :N].contiguous(), ar[:, N:].contiguous()
    cost = MatrixCost(M, N, K, cdt, x.device, name=f"matrix#{next(_ids)}", extra=blocks, graph=graph)
    engine = get_engine(
        "tiled" if backend == "auto" else backend, device=x.device, dtype=cdt, cost=cost, size=(B, N, K, 1)
    )
    a, b = a.to(cdt), b.to(cdt)
    return Measures(
        ix,
        iy,
        a,
        b,
        log_weights(a),
        log_weights(b),
        cost,
        engine,
        batched,
        x.dtype,
        torch.zeros(B, 1, 1, dtype=cdt, device=x.device),
        max(hi - lo, abs(hi), abs(lo)),
    )
