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

@dataclass
class Evaluation:
    """F(u) and, per free group, a_h = p·A_h/S and c_h = p·C_h/S (incoming/outgoing shares)."""

    value: float
    a: torch.Tensor
    c: torch.Tensor
    gradient: torch.Tensor
    kkt_residual: float


class Objective:
    """F for one network, on one device. Counts its passes over the parameters.

    Because w_i = g_i · e^{−2u_dst} · e^{2u_src} factorises, g is summed over kernel positions
    once (ḡ, shape ``[G, O/G, I/G]``) and every pass is two batched matrix–vector products per
    tensor: row sums give A, column sums give C, and their total gives S. Each tensor keeps
    its own log-scale so nothing overflows.
    """

    def __init__(self, groups: RescalingGroups, diag: DiagG, *, device: torch.device | str = "cpu"):
        self.groups = groups.to(device)
        self.device = torch.device(device)
        self.p = groups.p
        self.k = groups.k.to(self.device, torch.float64)
        self.degree = (groups.n_in + groups.n_out).to(self.device, torch.float64).clamp_min(1)
        self.gbar: list[torch.Tensor] = []
        self.gbar_shift: list[float] = []
        self_loop_log = torch.full((groups.num_free + 1,), -torch.inf, dtype=torch.float64, device=self.device)
        for lg, dp in zip(diag.log_g, self.groups.dag_params):
            log_g4 = lg.to(self.device).reshape(dp.view)
            log_gbar = torch.logsumexp(log_g4, dim=3)
            finite = log_gbar[torch.isfinite(log_gbar)]
            shift = float(finite.max()) if finite.numel() else 0.0
            self.gbar.append(torch.exp(log_gbar - shift))
            self.gbar_shift.append(shift)
            if dp.self_loops is not None:
                masked = torch.where(dp.self_loops[..., 0], log_gbar, torch.full_like(log_gbar, -torch.inf))
                self_loop_log = torch.logaddexp(self_loop_log, _group_logsumexp(dp.dst, torch.logsumexp(masked, dim=2), self_loop_log))
        self.self_loop_log = self_loop_log[:-1]
        if not any(bool((gbar > 0).any()) for gbar in self.gbar):
            raise ValueError("diag(G) is zero everywhere: the network computes the zero function")
        self.passes = 0

    def log_weights(self, u: torch.Tensor) -> list[torch.Tensor]:
        """log w = log ḡ − 2(Bu) per tensor, shaped ``[G, O/G, I/G, 1]`` (kernel summed)."""
        u_ext = self.groups.extend(u)
        return [
            (torch.log(gbar) + shift)[..., None] - 2 * dp.exponent(u_ext)
            for gbar, shift, dp in zip(self.gbar, self.gbar_shift, self.groups.dag_params)
        ]

    def evaluate(self, u: torch.Tensor, frozen: torch.Tensor | None = None) -> Evaluation:
        """F(u), the shares a and c, ∂F/∂u and the relative KKT residual (frozen groups excluded)."""
        self.passes += 1
        H = self.groups.num_free
        u_ext = self.groups.extend(u)
        parts = []
        for gbar, shift, dp in zip(self.gbar, self.gbar_shift, self.groups.dag_params):
            log_dst, log_src = -2 * u_ext[dp.dst], 2 * u_ext[dp.src]
            top_dst, top_src = log_dst.max(), log_src.max()
            e_dst, e_src = torch.exp(log_dst - top_dst), torch.exp(log_src - top_src)
            rows = e_dst * torch.bmm(gbar, e_src[:, :, None])[:, :, 0]
            cols = e_src * torch.bmm(e_dst[:, None, :], gbar)[:, 0, :]
            parts.append((dp, rows, cols, shift + top_dst + top_src))
        peak = max(float(scale + torch.log(rows.max())) for _, rows, _, scale in parts if bool((rows > 0).any()))
        incoming = torch.zeros(H + 1, dtype=torch.float64, device=self.device)
        outgoing = torch.zeros(H + 1, dtype=torch.float64, device=self.device)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for dp, rows, cols, scale in parts:
            factor = torch.exp(scale - peak)
            total += rows.sum() * factor
            incoming.index_add_(0, dp.dst.reshape(-1), (rows * factor).reshape(-1))
            outgoing.index_add_(0, dp.src.reshape(-1), (cols * factor).reshape(-1))
        self_loops = torch.exp(self.self_loop_log - peak)
        scale = self.p / total
        a = (incoming[:H] - self_loops).clamp_min(0) * scale
        c = (outgoing[:H] - self_loops).clamp_min(0) * scale
        value = self.p * (peak + float(torch.log(total))) + 2 * float(self.k @ u)
        gradient = 2 * (self.k - a + c)
        if frozen is not None:
            gradient = torch.where(frozen, torch.zeros_like(gradient), gradient)
        residual = float((gradient.abs() / (2 * self.degree)).max()) if H else 0.0
        return Evaluation(value, a, c, gradient, residual)


def _group_logsumexp(groups: torch.Tensor, log_values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """log Σ exp(values) per group index, −inf for groups with no entry."""
    flat_groups, flat = groups.reshape(-1), log_values.reshape(-1)
    peak = torch.full_like(like, -torch.inf).scatter_reduce(0, flat_groups, flat, "amax")
    safe_peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    summed = torch.zeros_like(like).index_add(0, flat_groups, torch.exp(flat - safe_peak[flat_groups]))
    return torch.log(summed) + safe_peak


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
