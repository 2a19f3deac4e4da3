"""ENorm, equi-normalisation (SPEC §7): the comparison criterion offered beside PathCond.

    E(u) = Σ_i θ_i² e^{2(Bu)_i}

over the DAG parameters θ (BatchNorm folded), on the same rescaling groups as PathCond, so
``groups.apply`` writes the result back exactly as it writes a PathCond solution. E is
convex. With A'_h and C'_h the sums of θ_i² e^{2(Bu)_i} over the parameters entering and
leaving group h (a bias enters its group and leaves nothing), the exact minimiser over u_h
alone is δ_h = ¼ ln(C'_h / A'_h). Groups of one colour share no parameter, so E separates
over them: all are updated at once, each step is an exact block minimisation and E never
increases.

The sums come from PathCond's own objective evaluator fed with θ² in place of diag(G), so
everything stays in the log domain: weights of 1e±200 neither overflow nor underflow. The
reported objective is ln E (E itself can leave float64's range).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..engine.groups import RescalingGroups
from ..engine.log_g import DiagG
from .objective import Objective
from .options import DEFAULT_MAX_ITER, DEFAULT_TOL
from .solvers import ProgressCallback, SolveResult

METHOD = "enorm"


@dataclass
class EnormEvaluation:
    """ln E(u), ln A'_h − ln C'_h per free group, and the relative KKT residual."""

    log_total: float
    log_ratio: torch.Tensor
    kkt_residual: float


class EnormObjective:
    """E through PathCond's objective machinery: with g := θ² and u ↦ −u, PathCond's weights
    g_i e^{−2(Bu)_i} are ENorm's θ_i² e^{2(Bu)_i}, so :class:`Objective`'s per-group incoming
    and outgoing sums are A' and C' and its S is E, all kept as logs (with its factorised
    mat-vec passes, its log-domain fallback and its handling of zero rows of B)."""

    def __init__(self, groups: RescalingGroups, *, device: torch.device | str = "cpu"):
        squares = DiagG([2 * torch.log(dp.value.to(torch.float64).abs()) for dp in groups.dag_params])
        self.objective = Objective(groups, squares, device=device)
        self.groups = self.objective.groups
        self.device = self.objective.device
        # A' = 0 or C' = 0 depends only on which θ are zero, not on u.
        self.frozen = self.objective.degenerate()

    @property
    def passes(self) -> int:
        return self.objective.passes

    def evaluate(self, u: torch.Tensor) -> EnormEvaluation:
        """ln E, ln A' − ln C' and max_h |A'_h − C'_h| / (A'_h + C'_h) over the non-degenerate groups."""
        pathcond = self.objective.evaluate(-u, self.frozen)
        # PathCond's value at −u is p·ln E − 2k·u; its log shares are ln A' and ln C' shifted alike.
        log_total = (pathcond.value + 2 * float(self.objective.k @ u)) / self.objective.p
        log_ratio = pathcond.log_a - pathcond.log_c
        # |A' − C'| / (A' + C') = |tanh((ln A' − ln C') / 2)|, finite whatever the scales.
        relative = torch.where(self.frozen, torch.zeros_like(log_ratio), torch.tanh(0.5 * log_ratio).abs())
        residual = float(relative.max()) if relative.numel() else 0.0
        return EnormEvaluation(log_total, log_ratio, residual)


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
    frozen = objective.frozen
    history = [current.log_total]
    colours = objective.groups.colours
    iterations = 0
    while current.kkt_residual > tol and iterations < max_iter:
        for colour in range(objective.groups.num_colours):
            if colour:
                current = objective.evaluate(u)
            update = (colours == colour) & ~frozen
            step = -0.25 * current.log_ratio
            u = torch.where(update, u + step, u)
        iterations += 1
        current = objective.evaluate(u)
        history.append(current.log_total)
        if progress is not None:
            progress(iterations, current.log_total, current.kkt_residual)
    return SolveResult.of_run(
        METHOD, u, history, current.kkt_residual, iterations, objective.passes, frozen, start, tol, max_iter
    )
