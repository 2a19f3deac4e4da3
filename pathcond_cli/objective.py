"""The PathCond objective (SPEC §4) and the per-group quantities the solvers share (SPEC §5).

    F(u) = p · ln Σ_i g_i exp(−2 (Bu)_i) + 2 Σ_i (Bu)_i,   Σ_i (Bu)_i = k·u

Everything is evaluated from log g in the log domain with a running shift, so neither g nor
the weights w_i = g_i e^{−2(Bu)_i} ever overflow. One evaluation is one pass over the DAG
parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .diag import DiagG
from .groups import RescalingGroups

SAFE_EXP_RANGE = 600.0


@dataclass
class Evaluation:
    """F(u) and, per free group, a_h = p·A_h/S and c_h = p·C_h/S (incoming/outgoing shares)."""

    value: float
    a: torch.Tensor
    c: torch.Tensor
    gradient: torch.Tensor
    kkt_residual: float


class Objective:
    """F for one network, on one device. Counts its passes over the parameters."""

    def __init__(self, groups: RescalingGroups, diag: DiagG, *, device: torch.device | str = "cpu"):
        self.groups = groups.to(device)
        self.device = torch.device(device)
        self.log_g = [lg.to(self.device).reshape(dp.view) for lg, dp in zip(diag.log_g, self.groups.dag_params)]
        self.p = groups.p
        self.k = groups.k.to(self.device, torch.float64)
        self.degree = (groups.n_in + groups.n_out).to(self.device, torch.float64).clamp_min(1)
        finite_peaks = [float(lg[torch.isfinite(lg)].max()) for lg in self.log_g if bool(torch.isfinite(lg).any())]
        if not finite_peaks:
            raise ValueError("diag(G) is zero everywhere: the network computes the zero function")
        self.shift = max(finite_peaks)
        self.passes = 0

    def log_weights(self, u: torch.Tensor) -> list[torch.Tensor]:
        """log w_i = log g_i − 2(Bu)_i per tensor, shaped like each parameter's view."""
        u_ext = self.groups.extend(u)
        return [lg - 2 * dp.exponent(u_ext) for lg, dp in zip(self.log_g, self.groups.dag_params)]

    def evaluate(self, u: torch.Tensor, frozen: torch.Tensor | None = None) -> Evaluation:
        """F(u), the shares a and c, ∂F/∂u and the relative KKT residual (frozen groups excluded)."""
        self.passes += 1
        H = self.groups.num_free
        u_ext = self.groups.extend(u)
        while True:
            incoming = torch.zeros(H + 1, dtype=torch.float64, device=self.device)
            outgoing = torch.zeros(H + 1, dtype=torch.float64, device=self.device)
            total = torch.zeros((), dtype=torch.float64, device=self.device)
            peak = torch.full((), -torch.inf, dtype=torch.float64, device=self.device)
            for lg, dp in zip(self.log_g, self.groups.dag_params):
                log_w = lg - 2 * dp.exponent(u_ext)
                peak = torch.maximum(peak, log_w.max())
                w = torch.exp(log_w - self.shift)
                total += w.sum()
                dp.accumulate(w, incoming, outgoing)
            peak_value = float(peak)
            if abs(peak_value - self.shift) < SAFE_EXP_RANGE:
                break
            self.shift = peak_value
        scale = self.p / total
        a, c = incoming[:H] * scale, outgoing[:H] * scale
        value = self.p * (self.shift + float(torch.log(total))) + 2 * float(self.k @ u)
        gradient = 2 * (self.k - a + c)
        if frozen is not None:
            gradient = torch.where(frozen, torch.zeros_like(gradient), gradient)
        residual = float((gradient.abs() / (2 * self.degree)).max()) if H else 0.0
        return Evaluation(value, a, c, gradient, residual)


def degenerate_mask(groups: RescalingGroups, diag: DiagG) -> torch.Tensor:
    """Free groups with A_h = 0 or C_h = 0 (no path weight in or out): F is not coercive in them.

    Depends only on which g_i are zero, so it holds for every u.
    """
    present = [torch.isfinite(lg).to(torch.float64) for lg in diag.log_g]
    incoming, outgoing = groups.incidence_sums(present)
    return (incoming == 0) | (outgoing == 0)


def block_step(a: torch.Tensor, c: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """δ_h minimising F over u_h at fixed λ = p/S (SPEC §5), in cancellation-free form.

    z = e^{2δ} is the positive root of c z² + k z − a = 0.
    """
    root = torch.sqrt(k * k + 4 * a * c)
    z = torch.where(k >= 0, 2 * a / (k + root), (root - k) / (2 * c))
    return 0.5 * torch.log(z)


def paper_step(A: float, C: float, E: float, k: float, p: int) -> float:
    """The paper's exact coordinate update (Lemma 4.1): z = e^{2δ} solves
    (p + k) C z² + k E z + (k − p) A = 0, root taken without cancellation."""
    qa, qb, qc = (p + k) * C, k * E, (k - p) * A
    root = (qb * qb - 4 * qa * qc) ** 0.5
    z = -2 * qc / (qb + root) if qb >= 0 else (root - qb) / (2 * qa)
    return 0.5 * math.log(z)
