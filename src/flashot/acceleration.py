r"""Optional accelerations of the Sinkhorn loop (log-domain, safeguarded).

Two small frozen configs, passed as ``acceleration=`` to :func:`flashot.solve_sample`
(or to :func:`flashot.sinkhorn.sinkhorn_loop`):

* :class:`Momentum` ``(omega)``: over-relaxation of the potentials.  For the
  alternating (POT) updates it relaxes each half-step,
  ``f <- f + omega (S_x(g) - f)``, then ``g <- g + omega (S_y(f) - g)``
  (the log-domain form of over-relaxed Sinkhorn, ``u <- u^(1-omega) (a / K v)^omega``);
  for the symmetric (GeomLoss) updates it relaxes the averaged step.
  ``omega = 1`` is plain Sinkhorn; ``1 < omega < 2`` accelerates.
* :class:`Anderson` ``(m)``: Anderson (type II) extrapolation over the last ``m``
  iterates of the fixed-point map (``g -> S_y(S_x(g))`` for alternating updates,
  ``(f, g) -> averaged step`` for symmetric ones), solved per problem of the batch
  with a small regularised least-squares system.

Both act on potentials (logs of the scalings): they never leave the log domain.
Safeguard: an accelerated candidate with non-finite entries is replaced by the plain
step; when the error (marginal violation, or potential change for unbalanced problems)
measured after an accelerated step is larger than before it, the next step is the
plain one (Anderson also clears its history; Momentum halves ``omega - 1`` for that
problem), so a bad extrapolation costs one iteration and never derails the solve.
The history is cleared whenever epsilon changes (epsilon-scaling).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Momentum", "Anderson", "check_acceleration"]


@dataclass(frozen=True)
class Momentum:
    """Over-relaxation with factor ``omega`` in (0, 2) (1 = plain Sinkhorn)."""

    omega: float = 1.5

    def __post_init__(self):
        w = self.omega
        if isinstance(w, bool) or not isinstance(w, (int, float)):
            raise TypeError(f"Momentum.omega: expected a number in (0, 2), got {type(w).__name__}")
        if not 0.0 < float(w) < 2.0:
            raise ValueError(f"Momentum.omega: expected a number in (0, 2), got {w!r}")


@dataclass(frozen=True)
class Anderson:
    """Anderson acceleration with memory ``m`` >= 1 and Tikhonov regularisation ``reg`` >= 0
    (relative to the scale of the residual Gram matrix)."""

    m: int = 5
    reg: float = 1e-10

    def __post_init__(self):
        if isinstance(self.m, bool) or not isinstance(self.m, int):
            raise TypeError(f"Anderson.m: expected an integer >= 1, got {type(self.m).__name__}")
        if self.m < 1:
            raise ValueError(f"Anderson.m: expected an integer >= 1, got {self.m}")
        r = self.reg
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not (float(r) >= 0.0) or r == float("inf"):
            raise ValueError(f"Anderson.reg: expected a finite number >= 0, got {r!r}")


def check_acceleration(acc):
    """Validate the ``acceleration`` argument (None, Momentum or Anderson)."""
    if acc is None or isinstance(acc, (Momentum, Anderson)):
        return acc
    if isinstance(acc, str):
        raise TypeError(
            f"acceleration: expected None, flashot.Momentum(omega=...) or flashot.Anderson(m=...), "
            f"got the string {acc!r}"
        )
    raise TypeError(
        "acceleration: expected None, flashot.Momentum(omega=...) or flashot.Anderson(m=...), "
        f"got {type(acc).__name__}"
    )


def _finite_rows(t: Tensor) -> Tensor:
    """(B,) mask: rows of a (B, n) tensor without NaN / Inf."""
    return torch.isfinite(t).all(-1)


class Accelerator:
    """Per-solve state of an acceleration (internal).

    ``omega(err)`` returns the (B, 1) relaxation factors for this step (Momentum);
    ``extrapolate(z, tz, err, eps)`` returns the next iterate given the current one ``z``
    and its plain image ``tz`` (Anderson; Momentum returns ``tz``).  ``err`` is the (B,)
    error of the current iterate, used by the safeguard (no host sync).
    """

    def __init__(self, cfg, batch: int, device, dtype):
        self.cfg = cfg
        self.prev_err: Tensor | None = None
        self.prev_acc = torch.zeros(batch, dtype=torch.bool, device=device)  # was the last step accelerated?
        self.eps: float | None = None
        self.n_rejected = torch.zeros((), dtype=torch.long, device=device)
        if isinstance(cfg, Momentum):
            self.w = torch.full((batch, 1), float(cfg.omega), dtype=dtype, device=device)
        self.X: list[Tensor] = []  # Anderson history: iterates
        self.T: list[Tensor] = []  # and their images

    # -- safeguard ----------------------------------------------------------------
    def _accept(self, err: Tensor, eps: float) -> Tensor:
        """(B,) mask: may this step be accelerated?  Updates the safeguard state."""
        if self.eps is not None and eps != self.eps:
            self.X.clear()
            self.T.clear()
        self.eps = eps
        ok = torch.isfinite(err)
        if self.prev_err is not None:
            worse = self.prev_acc & ~(err <= self.prev_err)
            self.n_rejected += worse.sum()
            ok = ok & ~worse
        else:
            worse = None
        self.prev_err = err
        return ok, worse

    def omega(self, err: Tensor, eps: float) -> Tensor:
        ok, worse = self._accept(err, eps)
        if worse is not None:
            # shrink the over-relaxation of the problems that got worse
            self.w = torch.where(worse.unsqueeze(-1), 1.0 + 0.5 * (self.w - 1.0), self.w)
        w = torch.where(ok.unsqueeze(-1), self.w, torch.ones_like(self.w))
        self.prev_acc = ok & (self.w[:, 0] != 1.0)
        return w

    def momentum_guard(self, cand: Tensor, plain: Tensor) -> Tensor:
        """Replace non-finite rows of an over-relaxed candidate by the plain step."""
        return torch.where(_finite_rows(cand).unsqueeze(-1), cand, plain)

    def extrapolate(self, z: Tensor, tz: Tensor, err: Tensor, eps: float) -> Tensor:
        ok, worse = self._accept(err, eps)
        if worse is not None and bool(worse.any()):  # one sync, only after an accelerated step
            self.X.clear()
            self.T.clear()
        self.X.append(z)
        self.T.append(tz)
        m = self.cfg.m
        if len(self.X) > m + 1:
            self.X.pop(0)
            self.T.pop(0)
        if len(self.X) < 2:
            self.prev_acc = torch.zeros_like(ok)
            return tz
        X = torch.stack(self.X, -1)  # (B, n, k)
        T = torch.stack(self.T, -1)
        R = T - X  # residuals
        dR = R[..., 1:] - R[..., :-1]  # (B, n, k-1)
        dT = T[..., 1:] - T[..., :-1]
        r = R[..., -1:]
        G = dR.transpose(-1, -2) @ dR  # (B, k-1, k-1)
        scale = G.diagonal(dim1=-2, dim2=-1).sum(-1).clamp_min(torch.finfo(G.dtype).tiny)
        lam = (self.cfg.reg + 1e-14) * scale
        eye = torch.eye(G.shape[-1], dtype=G.dtype, device=G.device)
        rhs = dR.transpose(-1, -2) @ r
        gamma, _ = torch.linalg.solve_ex(G + lam[:, None, None] * eye, rhs)  # (B, k-1, 1); no raise
        cand = tz - (dT @ gamma)[..., 0]
        good = ok & _finite_rows(cand) & torch.isfinite(gamma).all(-1).all(-1)
        self.prev_acc = good
        return torch.where(good.unsqueeze(-1), cand, tz)
