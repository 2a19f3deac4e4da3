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

LOG2 = math.log(2.0)
LOG4 = math.log(4.0)
SAFE_RANGE = 650.0


@dataclass
class Evaluation:
    """F(u) and, per free group, the shares a_h = p·A_h/S and c_h = p·C_h/S, kept as logs
    (``log_a``, ``log_c``) because they can lie far outside float64's range."""

    value: float
    log_a: torch.Tensor
    log_c: torch.Tensor
    gradient: torch.Tensor
    kkt_residual: float

    @property
    def a(self) -> torch.Tensor:
        return torch.exp(self.log_a)

    @property
    def c(self) -> torch.Tensor:
        return torch.exp(self.log_c)


class Objective:
    """F for one network, on one device. Counts its passes over the parameters.

    Because w_i = g_i · e^{−2u_dst} · e^{2u_src} factorises, g is summed over kernel positions
    once (ḡ, shape ``[G, O/G, I/G]``) and a pass is two batched matrix–vector products per
    tensor: row sums give A, column sums give C, their total gives S. The products run in
    linear scale only when the tensor's dynamic range (of ḡ and of e^{2u}) guarantees that no
    positive term underflows; otherwise that tensor is reduced exactly with logsumexp. Sums
    across tensors and groups are log-sum-exp, so nothing overflows or underflows.
    """

    def __init__(self, groups: RescalingGroups, diag: DiagG, *, device: torch.device | str = "cpu"):
        self.groups = groups.to(device)
        self.device = torch.device(device)
        self.p = groups.p
        self.log_p = math.log(self.p)
        self.k = groups.k.to(self.device, torch.float64)
        self.degree = (groups.n_in + groups.n_out).to(self.device, torch.float64).clamp_min(1)
        self.log_gbar: list[torch.Tensor] = []
        self.gbar: list[torch.Tensor | None] = []
        self.gbar_shift: list[float] = []
        self.gbar_range: list[float] = []
        self_loop_log = torch.full((groups.num_free + 1,), -torch.inf, dtype=torch.float64, device=self.device)
        for lg, dp in zip(diag.log_g, self.groups.dag_params):
            log_gbar = torch.logsumexp(lg.to(self.device).reshape(dp.view), dim=3)
            finite = log_gbar[torch.isfinite(log_gbar)]
            shift = float(finite.max()) if finite.numel() else 0.0
            spread = shift - float(finite.min()) if finite.numel() else 0.0
            self.log_gbar.append(log_gbar)
            self.gbar.append(torch.exp(log_gbar - shift) if spread < SAFE_RANGE else None)
            self.gbar_shift.append(shift)
            self.gbar_range.append(spread)
            if dp.self_loops is not None:
                masked = torch.where(dp.self_loops[..., 0], log_gbar, torch.full_like(log_gbar, -torch.inf))
                self_loop_log = torch.logaddexp(
                    self_loop_log, group_logsumexp(dp.dst.reshape(-1), torch.logsumexp(masked, dim=2).reshape(-1),
                                                   groups.num_free + 1))
        self.self_loop_log = self_loop_log[:-1]
        if not any(bool(torch.isfinite(lg).any()) for lg in self.log_gbar):
            raise ValueError("diag(G) is zero everywhere: the network computes the zero function")
        self.passes = 0

    def log_weights(self, u: torch.Tensor) -> list[torch.Tensor]:
        """log w = log ḡ − 2(Bu) per tensor, shaped ``[G, O/G, I/G, 1]`` (kernel summed)."""
        u_ext = self.groups.extend(u)
        return [lg[..., None] - 2 * dp.exponent(u_ext) for lg, dp in zip(self.log_gbar, self.groups.dag_params)]

    def _tensor_sums(self, t: int, u_ext: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """log of the row sums ``[G, O/G]`` and column sums ``[G, I/G]`` of w for tensor ``t``."""
        dp = self.groups.dag_params[t]
        log_dst, log_src = -2 * u_ext[dp.dst], 2 * u_ext[dp.src]
        top_dst, top_src = log_dst.max(), log_src.max()
        gbar = self.gbar[t]
        if gbar is not None:
            dst_range, src_range = float(top_dst - log_dst.min()), float(top_src - log_src.min())
            if self.gbar_range[t] + max(dst_range, src_range) < SAFE_RANGE:
                e_dst, e_src = torch.exp(log_dst - top_dst), torch.exp(log_src - top_src)
                rows = e_dst * torch.bmm(gbar, e_src[:, :, None])[:, :, 0]
                cols = e_src * torch.bmm(e_dst[:, None, :], gbar)[:, 0, :]
                scale = self.gbar_shift[t] + top_dst + top_src
                return torch.log(rows) + scale, torch.log(cols) + scale
        log_w = self.log_gbar[t] + log_dst[:, :, None] + log_src[:, None, :]
        return torch.logsumexp(log_w, dim=2), torch.logsumexp(log_w, dim=1)

    def evaluate(self, u: torch.Tensor, frozen: torch.Tensor | None = None) -> Evaluation:
        """F(u), log shares, ∂F/∂u and the relative KKT residual (frozen groups excluded)."""
        self.passes += 1
        H = self.groups.num_free
        u_ext = self.groups.extend(u)
        row_logs, col_logs, dst_index, src_index = [], [], [], []
        for t, dp in enumerate(self.groups.dag_params):
            rows, cols = self._tensor_sums(t, u_ext)
            row_logs.append(rows.reshape(-1))
            col_logs.append(cols.reshape(-1))
            dst_index.append(dp.dst.reshape(-1))
            src_index.append(dp.src.reshape(-1))
        rows, cols = torch.cat(row_logs), torch.cat(col_logs)
        log_total = torch.logsumexp(rows, dim=0)
        log_in = _minus(group_logsumexp(torch.cat(dst_index), rows, H + 1)[:H], self.self_loop_log)
        log_out = _minus(group_logsumexp(torch.cat(src_index), cols, H + 1)[:H], self.self_loop_log)
        log_a, log_c = log_in + self.log_p - log_total, log_out + self.log_p - log_total
        value = self.p * float(log_total) + 2 * float(self.k @ u)
        gradient = 2 * (self.k - torch.exp(log_a) + torch.exp(log_c))
        if frozen is not None:
            gradient = torch.where(frozen, torch.zeros_like(gradient), gradient)
        residual = float((gradient.abs() / (2 * self.degree)).max()) if H else 0.0
        return Evaluation(value, log_a, log_c, gradient, residual)


def _minus(log_x: torch.Tensor, log_y: torch.Tensor) -> torch.Tensor:
    """log(x − y) for y ≤ x (−inf where the difference vanishes)."""
    ratio = torch.exp(torch.clamp(log_y - log_x, max=0.0))
    return torch.where(torch.isfinite(log_y), log_x + torch.log1p(-ratio), log_x)


def group_logsumexp(index: torch.Tensor, log_values: torch.Tensor, size: int) -> torch.Tensor:
    """log Σ exp(values) per group index (``size`` groups), −inf for groups with no entry."""
    peak = torch.full((size,), -torch.inf, dtype=log_values.dtype, device=log_values.device)
    peak = peak.scatter_reduce(0, index, log_values, "amax")
    safe_peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    summed = torch.zeros_like(peak).index_add(0, index, torch.exp(log_values - safe_peak[index]))
    return torch.log(summed) + safe_peak


def degenerate_mask(groups: RescalingGroups, diag: DiagG) -> torch.Tensor:
    """Free groups with A_h = 0 or C_h = 0 (no path weight in or out): F is not coercive in them.

    Depends only on which g_i are zero, so it holds for every u.
    """
    present = [torch.isfinite(lg).to(torch.float64) for lg in diag.log_g]
    incoming, outgoing = groups.incidence_sums(present)
    return (incoming == 0) | (outgoing == 0)


def log_positive_root(log_quadratic: torch.Tensor, linear: torch.Tensor, log_linear_abs: torch.Tensor,
                      log_constant: torch.Tensor) -> torch.Tensor:
    """ln z for the positive root of q z² + b z − c = 0 (q, c > 0, given as logs; b signed with
    ``log_linear_abs`` = ln|b|), without cancellation and without leaving the log domain."""
    log_root = 0.5 * torch.logaddexp(2 * log_linear_abs, LOG4 + log_quadratic + log_constant)
    return torch.where(
        linear >= 0,
        LOG2 + log_constant - torch.logaddexp(log_linear_abs, log_root),
        torch.logaddexp(log_linear_abs, log_root) - LOG2 - log_quadratic,
    )


def block_step(log_a: torch.Tensor, log_c: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """δ_h minimising F over u_h at fixed λ = p/S (SPEC §5): z = e^{2δ} solves c z² + k z − a = 0."""
    return 0.5 * log_positive_root(log_c, k, torch.log(k.abs()), log_a)


def paper_step(log_A, log_C, log_E, k: float, p: int) -> float:
    """The paper's exact coordinate update (Lemma 4.1): z = e^{2δ} solves
    (p + k) C z² + k E z + (k − p) A = 0, with A, C, E given as logs (floats or 0-d tensors)."""
    log_A, log_C, log_E = (torch.as_tensor(v, dtype=torch.float64) for v in (log_A, log_C, log_E))
    k_tensor = torch.tensor(float(k), dtype=torch.float64)
    log_quadratic = math.log(p + k) + log_C
    log_linear_abs = torch.log(k_tensor.abs()) + log_E
    return 0.5 * float(log_positive_root(log_quadratic, k_tensor, log_linear_abs, math.log(p - k) + log_A))
