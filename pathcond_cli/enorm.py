"""ENorm, equi-normalisation (SPEC §7): the comparison criterion offered beside PathCond.

    E(u) = Σ_i θ_i² e^{2(Bu)_i}

over the DAG parameters θ (BatchNorm folded), on the same rescaling groups as PathCond, so
``groups.apply`` writes the result back exactly as it writes a PathCond solution. E is
convex. With A'_h and C'_h the sums of θ_i² e^{2(Bu)_i} over the parameters entering and
leaving group h (a bias enters its group and leaves nothing), the exact minimiser over u_h
alone is δ_h = ¼ ln(C'_h / A'_h). Groups of one colour share no parameter, so E separates
over them: all are updated at once, each step is an exact block minimisation and E never
increases.

Everything stays in the log domain (log θ² summed over kernel positions, logsumexp
reductions), so weights of 1e±200 neither overflow nor underflow. The reported objective is
ln E (E itself can leave float64's range).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .groups import RescalingGroups
from .objective import SAFE_RANGE, group_logsumexp
from .solvers import DEFAULT_MAX_ITER, DEFAULT_TOL, ProgressCallback, SolveResult

METHOD = "enorm"


@dataclass
class EnormEvaluation:
    """ln E(u) and, per free group, ln A'_h and ln C'_h (−inf for an empty sum)."""

    log_total: float
    log_in: torch.Tensor
    log_out: torch.Tensor
    kkt_residual: float


class EnormObjective:
    """E for one network on one device; counts its passes over the parameters.

    θ² is summed over kernel positions once (the factor e^{2(Bu)} does not depend on them),
    giving per tensor a ``[G, O/G, I/G]`` matrix N. Because e^{2(Bu)} = e^{2u_dst} e^{−2u_src}
    factorises, A' and C' of a tensor are N's row and column sums weighted by those vectors:
    two batched mat-vecs. They run in linear scale when the tensor's dynamic range (of N and
    of the two vectors) guarantees that no positive term underflows, and as exact logsumexp
    reductions otherwise. Parameters whose two ends share a group (a zero row of B) keep
    their θ² whatever u is: they are taken out of N once and added to E as a constant.
    """

    def __init__(self, groups: RescalingGroups, *, device: torch.device | str = "cpu"):
        self.groups = groups.to(device)
        self.device = torch.device(device)
        self.log_norms: list[torch.Tensor] = []
        self.norms: list[torch.Tensor | None] = []
        self.shifts: list[float] = []
        self.spreads: list[float] = []
        constants = [torch.tensor(-torch.inf, dtype=torch.float64, device=self.device)]
        for dp in self.groups.dag_params:
            log_norm = torch.logsumexp(2 * torch.log(dp.value.to(self.device, torch.float64).abs()).reshape(dp.view), dim=3)
            if dp.self_loops is not None:
                loops = dp.self_loops[..., 0]
                constants.append(torch.logsumexp(log_norm[loops], dim=0))
                log_norm = log_norm.masked_fill(loops, -torch.inf)
            finite = log_norm[torch.isfinite(log_norm)]
            shift = float(finite.max()) if finite.numel() else 0.0
            spread = shift - float(finite.min()) if finite.numel() else 0.0
            self.log_norms.append(log_norm)
            self.norms.append(torch.exp(log_norm - shift) if spread < SAFE_RANGE else None)
            self.shifts.append(shift)
            self.spreads.append(spread)
        self.log_constant = torch.logsumexp(torch.stack(constants), dim=0)
        self.passes = 0

    def _tensor_sums(self, t: int, u_ext: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """log of the row sums ``[G, O/G]`` (into ``dst``) and column sums ``[G, I/G]`` (out of ``src``)."""
        dp = self.groups.dag_params[t]
        log_dst, log_src = 2 * u_ext[dp.dst], -2 * u_ext[dp.src]
        top_dst, top_src = log_dst.max(), log_src.max()
        norm = self.norms[t]
        if norm is not None:
            dst_range, src_range = float(top_dst - log_dst.min()), float(top_src - log_src.min())
            if self.spreads[t] + max(dst_range, src_range) < SAFE_RANGE:
                e_dst, e_src = torch.exp(log_dst - top_dst), torch.exp(log_src - top_src)
                rows = e_dst * torch.bmm(norm, e_src[:, :, None])[:, :, 0]
                cols = e_src * torch.bmm(e_dst[:, None, :], norm)[:, 0, :]
                scale = self.shifts[t] + top_dst + top_src
                return torch.log(rows) + scale, torch.log(cols) + scale
        log_w = self.log_norms[t] + log_dst[:, :, None] + log_src[:, None, :]
        return torch.logsumexp(log_w, dim=2), torch.logsumexp(log_w, dim=1)

    def evaluate(self, u: torch.Tensor) -> EnormEvaluation:
        """ln E, ln A', ln C' and the relative KKT residual max_h |A'_h − C'_h| / (A'_h + C'_h)
        over the groups where both sums are positive (the others are degenerate)."""
        self.passes += 1
        H = self.groups.num_free
        u_ext = self.groups.extend(u)
        rows, cols, dst_index, src_index = [], [], [], []
        for t, dp in enumerate(self.groups.dag_params):
            row_sums, col_sums = self._tensor_sums(t, u_ext)
            rows.append(row_sums.reshape(-1))
            cols.append(col_sums.reshape(-1))
            dst_index.append(dp.dst.reshape(-1))
            src_index.append(dp.src.reshape(-1))
        rows_flat = torch.cat(rows)
        log_total = float(torch.logaddexp(torch.logsumexp(rows_flat, dim=0), self.log_constant))
        log_in = group_logsumexp(torch.cat(dst_index), rows_flat, H + 1)[:H]
        log_out = group_logsumexp(torch.cat(src_index), torch.cat(cols), H + 1)[:H]
        active = torch.isfinite(log_in) & torch.isfinite(log_out)
        # |A' − C'| / (A' + C') = |tanh((ln A' − ln C') / 2)|, finite whatever the scales.
        relative = torch.tanh(0.5 * (log_in - log_out)).abs()
        relative = torch.where(active, relative, torch.zeros_like(relative))
        residual = float(relative.max()) if H else 0.0
        return EnormEvaluation(log_total, log_in, log_out, residual)


def enorm(
    groups: RescalingGroups,
    *,
    tol: float = DEFAULT_TOL,
    max_iter: int = DEFAULT_MAX_ITER,
    device: torch.device | str = "cpu",
    progress: ProgressCallback | None = None,
) -> SolveResult:
    """Minimise E by colour-parallel block coordinate descent from u = 0.

    One iteration updates every colour once; ``objective`` holds ln E, its first entry at
    u = 0. Stops when the relative KKT residual is at most ``tol`` or after ``max_iter``
    iterations. Degenerate groups (A' = 0 or C' = 0: E is not coercive in them) stay at 0
    and are listed in ``degenerate``.
    """
    start = time.perf_counter()
    objective = EnormObjective(groups, device=device)
    u = torch.zeros(groups.num_free, dtype=torch.float64, device=objective.device)
    current = objective.evaluate(u)
    # Which sums are empty depends only on which θ are zero, not on u.
    frozen = ~(torch.isfinite(current.log_in) & torch.isfinite(current.log_out))
    history = [current.log_total]
    colours = objective.groups.colours
    iterations = 0
    while current.kkt_residual > tol and iterations < max_iter:
        for colour in range(objective.groups.num_colours):
            if colour:
                current = objective.evaluate(u)
            update = (colours == colour) & ~frozen
            step = 0.25 * (current.log_out - current.log_in)
            u = torch.where(update, u + step, u)
        iterations += 1
        current = objective.evaluate(u)
        history.append(current.log_total)
        if progress is not None:
            progress(iterations, current.log_total, current.kkt_residual)
    return SolveResult(
        method=METHOD,
        u=u.to("cpu"),
        objective=history,
        kkt_residual=current.kkt_residual,
        converged=current.kkt_residual <= tol,
        iterations=iterations,
        passes=objective.passes,
        degenerate=torch.nonzero(frozen.cpu()).flatten().tolist(),
        seconds=time.perf_counter() - start,
    )

