"""Minimisers of the PathCond objective (SPEC §5). All return a :class:`SolveResult`.

- ``newton`` (default): Newton's method with the exact Hessian of F, solved inexactly by
  conjugate gradients (each Hessian product is two batched mat-vecs per tensor, like a
  gradient pass) preconditioned by the Hessian's diagonal plus a per-layer coarse correction,
  globalised by an Armijo line search on F. With a bound it
  is projected Newton: groups pinned at the bound leave the Newton system.
- ``block``: parallel colour-block coordinate descent. Groups of one colour share no
  parameter, so at fixed λ = p/S each is minimised exactly and all at once by tensor
  reductions; one step is one pass over the parameters.
- ``lbfgs``: quasi-Newton on F with the analytic gradient (one pass per evaluation).
- ``sequential``: the paper's coordinate descent (Algorithm 2), one group at a time with S
  maintained incrementally: the baseline the others are measured against.

``passes`` counts gradient-equivalent passes over the parameters: evaluations of F and ∇F,
Hessian products, and accurate evaluations of a change of F, one each.

With ``max_log_scale`` U every solver but ``lbfgs`` minimises F over the box |u_h| ≤ U (SPEC §5,
bounded variant) and stops on the box KKT residual.

Degenerate groups (A_h = 0 or C_h = 0: dead neurons, zero weights) make F non-coercive in
u_h; they are frozen at u_h = 0 and reported.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from ..engine.groups import RescalingGroups
from ..engine.log_g import DiagG
from ..engine.transfer import to_host
from .curvature import CoarseCorrection, LayerAggregates, ScaledHessian, newton_direction
from .layer_shift import layer_shift_start
from .objective import Evaluation, Objective, block_step, paper_step
from .options import DEFAULT_MAX_ITER, DEFAULT_TOL, SolveOptions

MIN_STEP = 1e-10
MAX_FIRST_STEP = 20.0
FLAT_ITERATIONS = 3
NEWTON_REACH = 10.0
MAX_CG_STEPS = 40
ARMIJO = 1e-4
UNRESOLVED_CHANGE = 1e-9

ProgressCallback = Callable[[int, float, float], None]


@dataclass
class SolveResult:
    """Outcome of a solve. ``objective[0]`` is F(0); one entry per iteration after it."""

    method: str
    u: torch.Tensor
    objective: list[float]
    kkt_residual: float
    converged: bool
    iterations: int
    passes: int
    degenerate: list[int] = field(default_factory=list)
    seconds: float = 0.0
    tol: float = DEFAULT_TOL
    max_iter: int = DEFAULT_MAX_ITER
    max_log_scale: float | None = None

    @classmethod
    def of_run(
        cls,
        method: str,
        u: torch.Tensor,
        history: list[float],
        kkt_residual: float,
        iterations: int,
        passes: int,
        frozen: torch.Tensor,
        started: float,
        tol: float,
        max_iter: int,
        max_log_scale: float | None = None,
    ) -> SolveResult:
        """The result of a run begun at ``started`` (``time.perf_counter``) with ``frozen`` groups."""
        u, frozen = to_host([u, frozen])
        return cls(
            method=method,
            u=u,
            objective=history,
            kkt_residual=kkt_residual,
            converged=kkt_residual <= tol,
            iterations=iterations,
            passes=passes,
            degenerate=torch.nonzero(frozen).flatten().tolist(),
            seconds=time.perf_counter() - started,
            tol=tol,
            max_iter=max_iter,
            max_log_scale=max_log_scale,
        )

    @property
    def groups_at_bound(self) -> int:
        """Groups whose |u_h| sits on ``max_log_scale`` (0 without a bound)."""
        if self.max_log_scale is None or not self.u.numel():
            return 0
        return int((self.u.abs() >= self.max_log_scale).sum())

    @property
    def stopped_by_max_iter(self) -> bool:
        """Stopped because the iteration cap was reached, not because the tolerance was met."""
        return not self.converged and self.iterations >= self.max_iter

    @property
    def u_inf(self) -> float:
        return float(self.u.abs().max()) if self.u.numel() else 0.0

    @property
    def decrease(self) -> float:
        """F(0) − F(u*)."""
        return self.objective[0] - self.objective[-1]


def solve(
    groups: RescalingGroups,
    diag: DiagG,
    options: SolveOptions | None = None,
    *,
    device: torch.device | str = "cpu",
    progress: ProgressCallback | None = None,
    **choices,
) -> SolveResult:
    """Minimise F from u = 0 until the relative KKT residual is below ``options.tol``.

    ``choices`` replace fields of ``options`` (default :class:`SolveOptions`), validated again.
    ``max_iter`` is a safety cap: a run that reaches it returns ``converged = False``. A number
    ``max_log_scale`` bounds every |u_h| (natural log of a neuron's scale factor); ``auto`` is the
    caller's rule (:func:`pathcond_cli.api.rescale`), so here it solves unbounded like ``none``.
    """
    options = replace(options or SolveOptions(), **choices)
    bound = options.bound
    start = time.perf_counter()
    objective = Objective(groups, diag, device=device, bound=bound)
    u = torch.zeros(groups.num_free, dtype=torch.float64, device=objective.device)
    frozen = objective.degenerate()
    first = objective.evaluate(u, frozen)
    run = {"newton": _newton, "block": _block, "lbfgs": _lbfgs, "sequential": _sequential}[options.solver]
    u, history, final, iterations = run(objective, u, frozen, first, options.tol, options.max_iter, progress)
    return SolveResult.of_run(
        options.solver,
        u,
        history,
        final.kkt_residual,
        iterations,
        objective.passes,
        frozen,
        start,
        options.tol,
        options.max_iter,
        bound,
    )


def _report(progress: ProgressCallback | None, iteration: int, ev: Evaluation) -> None:
    if progress is not None:
        progress(iteration, ev.value, ev.kkt_residual)


def _block(objective: Objective, u, frozen, current: Evaluation, tol, max_iter, progress, history=None, iterations=0):
    colours = objective.groups.colours
    num_colours = objective.groups.num_colours
    history = history if history is not None else [current.value]
    max_iter += iterations
    while current.kkt_residual > tol and iterations < max_iter:
        for colour in range(num_colours):
            if colour:
                current = objective.evaluate(u, frozen)
            update = (colours == colour) & ~frozen
            step = block_step(current.log_a, current.log_c, objective.k)
            u = torch.where(update, _project(objective, u + step), u)
        iterations += 1
        current = objective.evaluate(u, frozen)
        history.append(current.value)
        _report(progress, iterations, current)
    return u, history, current, iterations


def _project(objective: Objective, u: torch.Tensor) -> torch.Tensor:
    return u if objective.bound is None else u.clamp(-objective.bound, objective.bound)


def _newton(objective: Objective, u, frozen, current: Evaluation, tol, max_iter, progress):
    """Inexact (projected) Newton with an Armijo line search on F; F never increases.

    It starts from the minimiser of F over layer shifts (:mod:`.layer_shift`) when that lowers
    F: on MnasNet- and Inception-style networks most of the way to u* (‖u*‖∞ ≈ 90), which
    damped Newton steps would travel in 20–30 iterations. CG is stopped at a relative residual
    of min(0.5, √KKT) (quadratic convergence; no tighter than the tolerance needs) or after 40
    products; each group's move is damped towards about 10 (:class:`ScaledHessian`) and the
    first trial step moves no u_h by more than 20. Differences of F too small for F's own
    rounding are computed accurately (:meth:`Objective.change`), so the line search keeps
    working down to the tolerance; if it still fails, the block solver, whose updates compare
    no F values, takes over from the same point.
    """
    history = [current.value]
    iterations = 0
    aggregates = LayerAggregates(objective)
    if current.kkt_residual > tol and max_iter > 0:
        start = _project(objective, layer_shift_start(objective, aggregates.of_group, aggregates.count, frozen))
        candidate = objective.evaluate(start, frozen)
        if candidate.value < current.value:
            u, current = start, candidate
            iterations += 1
            history.append(current.value)
            _report(progress, iterations, current)
    # Off the CPU, the next step is set up at each trial point before its F is read, so that the
    # coarse correction's flags travel with F (a host round trip less per step); on the CPU,
    # where a read costs nothing, only at the accepted point. The steps are the same.
    speculate = objective.device.type != "cpu"
    setup, flags = None, None
    while current.kkt_residual > tol and iterations < max_iter:
        hessian, coarse = setup or _newton_setup(objective, u, current, frozen, aggregates)
        coarse.settle(flags)
        gradient = current.gradient * hessian.active
        forcing = min(0.5, max(current.kkt_residual**0.5, 0.1 * tol / current.kkt_residual))
        direction = newton_direction(hessian, gradient, forcing, MAX_CG_STEPS, coarse)
        # The first trial's length is decided on the device. Each trial's length and slope, and
        # the flags of the next step's coarse correction set up at the trial point, are read
        # with the trial's F in one host transfer.
        t = (MAX_FIRST_STEP / direction.abs().max().clamp_min(1e-300)).clamp_max(1.0)
        slope = current.gradient @ direction
        while True:
            target = _project(objective, u + t * direction)
            step = target - u
            # without a bound the step is t·direction; a projected one needs its own slope
            step_slope = t * slope if objective.bound is None else current.gradient @ step
            trial = torch.stack([torch.as_tensor(t, dtype=slope.dtype, device=slope.device), step_slope])

            def read_with_f(evaluation: Evaluation, target=target, trial=trial) -> torch.Tensor:
                nonlocal setup
                if not speculate:
                    return trial
                setup = _newton_setup(objective, target, evaluation, frozen, aggregates)
                return torch.cat([trial, setup[1].flags])

            candidate = objective.evaluate(target, frozen, also=read_with_f)
            t, step_slope, *next_flags = candidate.also
            change = candidate.value - current.value
            if abs(change) <= UNRESOLVED_CHANGE * max(1.0, abs(current.value)):
                change = objective.change(u, current, step)
                candidate.value = current.value + change
            if change <= ARMIJO * step_slope and change <= 0:
                break
            t *= 0.5
            if t < MIN_STEP:
                return _block(objective, u, frozen, current, tol, max_iter - iterations, progress, history, iterations)
        u, current = target, candidate
        setup, flags = (setup, next_flags) if speculate else (None, None)
        iterations += 1
        history.append(current.value)
        _report(progress, iterations, current)
    return u, history, current, iterations


def _newton_setup(
    objective: Objective, u: torch.Tensor, current: Evaluation, frozen: torch.Tensor, aggregates: LayerAggregates
) -> tuple[ScaledHessian, CoarseCorrection]:
    """The Newton step's Hessian at ``u`` over the groups neither frozen nor pinned at a bound,
    and its coarse correction, not yet settled."""
    pinned = objective.feasible_gradient(u, current.gradient) != current.gradient
    hessian = ScaledHessian(objective, u, current, ~frozen & ~pinned, NEWTON_REACH)
    return hessian, CoarseCorrection(hessian, aggregates, current)


def _lbfgs(objective: Objective, u, frozen, current: Evaluation, tol, max_iter, progress, memory: int = 20):
    """L-BFGS (two-loop recursion) with a backtracking Armijo line search on F.

    A step never raises F and never moves any u_h by more than 20 (e^20 per neuron) at once.
    When the line search cannot decrease F any more, or F stops decreasing for a few
    iterations (a tolerance below what F's float64 value resolves), the block solver, whose
    updates need no comparison of F values, takes over from the same point.
    """
    steps: list[tuple[torch.Tensor, torch.Tensor, float]] = []
    history = [current.value]
    iterations = 0
    flat = 0
    while current.kkt_residual > tol and iterations < max_iter:
        if flat >= FLAT_ITERATIONS:
            return _block(objective, u, frozen, current, tol, max_iter - iterations, progress, history, iterations)
        curvature_diagonal = 4 * (current.a + current.c)
        direction = -_inverse_hessian_times(steps, current.gradient, curvature_diagonal)
        slope = float(current.gradient @ direction)
        if slope >= 0:
            steps.clear()
            direction, slope = -current.gradient, -float(current.gradient @ current.gradient)
        t = min(1.0, MAX_FIRST_STEP / max(float(direction.abs().max()), 1e-300))
        while True:
            candidate = objective.evaluate(u + t * direction, frozen)
            if candidate.value <= current.value + 1e-4 * t * slope:
                break
            t *= 0.5
            if t < MIN_STEP:
                return _block(objective, u, frozen, current, tol, max_iter - iterations, progress, history, iterations)
        step = t * direction
        change = candidate.gradient - current.gradient
        curvature = float(change @ step)
        if curvature > 1e-12 * float(step @ step) ** 0.5 * float(change @ change) ** 0.5:
            steps.append((step, change, 1.0 / curvature))
            del steps[:-memory]
        flat = flat + 1 if candidate.value > current.value - 1e-13 * abs(current.value) else 0
        u, current = u + step, candidate
        iterations += 1
        history.append(current.value)
        _report(progress, iterations, current)
    return u, history, current, iterations


def _inverse_hessian_times(steps, gradient: torch.Tensor, curvature_diagonal: torch.Tensor) -> torch.Tensor:
    """The L-BFGS estimate of H⁻¹·gradient from the stored (s, y, 1/yᵀs) pairs.

    The initial matrix is the inverse Hessian diagonal of F, ∂²F/∂u_h² ≈ 4(a_h + c_h), scaled
    by the usual sᵀy / yᵀDy: group curvatures differ by orders of magnitude across layers,
    which a scalar initial matrix cannot follow.
    """
    inverse_diagonal = 1 / curvature_diagonal.clamp_min(float(curvature_diagonal.max()) * 1e-12 + 1e-300)
    q = gradient.clone()
    alphas = []
    for s, y, rho in reversed(steps):
        alpha = rho * float(s @ q)
        q -= alpha * y
        alphas.append(alpha)
    q *= inverse_diagonal
    if steps:
        s, y, _ = steps[-1]
        q *= float(s @ y) / float(y @ (inverse_diagonal * y))
    for (s, y, rho), alpha in zip(steps, reversed(alphas)):
        q += (alpha - rho * float(y @ q)) * s
    return q


def _sequential(objective: Objective, u, frozen, current: Evaluation, tol, max_iter, progress):
    """The paper's Algorithm 2: exact update of one group at a time, S kept incrementally.

    Weights are kept as logs and each group's sums are log-sum-exp, so the update holds
    however far apart the groups' scales are.
    """
    groups = objective.groups
    p = objective.p
    k = objective.k.tolist()
    incidence = _incidence(groups)
    active = [h for h in range(groups.num_free) if not bool(frozen[h])]
    history = [current.value]
    iterations = 0
    while current.kkt_residual > tol and iterations < max_iter:
        log_weights = objective.log_weights(u)
        log_total = torch.logsumexp(torch.cat([lw.reshape(-1) for lw in log_weights]), dim=0)
        u_list = u.tolist()
        for h in active:
            rows, cols = incidence[h]
            log_in = torch.logsumexp(torch.cat([_rows(log_weights[t], groups.dag_params[t], r) for t, r in rows]), 0)
            log_out = torch.logsumexp(torch.cat([_cols(log_weights[t], groups.dag_params[t], c) for t, c in cols]), 0)
            log_rest = _log_remainder(log_total, log_in, log_out)
            delta = paper_step(log_in, log_out, log_rest, k[h], p)
            if objective.bound is not None:
                delta = min(max(u_list[h] + delta, -objective.bound), objective.bound) - u_list[h]
            for t, r in rows:
                _shift_rows(log_weights[t], r, -2 * delta)
            for t, c in cols:
                _shift_cols(log_weights[t], c, 2 * delta)
            log_total = torch.logsumexp(torch.stack([log_rest, log_in - 2 * delta, log_out + 2 * delta]), 0)
            u_list[h] += delta
        u = torch.tensor(u_list, dtype=torch.float64, device=u.device)
        objective.passes += 1
        iterations += 1
        current = objective.evaluate(u, frozen)
        history.append(current.value)
        _report(progress, iterations, current)
    return u, history, current, iterations


def _log_remainder(log_total: torch.Tensor, log_in: torch.Tensor, log_out: torch.Tensor) -> torch.Tensor:
    """log E = log(S − A − C), the weight of parameters not touching the group (≥ 0)."""
    share = torch.exp(log_in - log_total) + torch.exp(log_out - log_total)
    return log_total + torch.log1p(-share.clamp(max=1.0))


def _incidence(groups: RescalingGroups):
    """Per free group: (tensor index, flat row indices) where it is the destination, and
    (tensor index, (conv group, input channel) indices) where it is the source."""
    H = groups.num_free
    rows: list[list] = [[] for _ in range(H)]
    cols: list[list] = [[] for _ in range(H)]
    for t, dp in enumerate(groups.dag_params):
        flat_dst = dp.dst.reshape(-1)
        order = torch.argsort(flat_dst, stable=True)
        for h, members in zip(*_split_by_value(flat_dst, order)):
            if h < H:
                rows[h].append((t, members))
        flat_src = dp.src.reshape(-1)
        order = torch.argsort(flat_src, stable=True)
        per_group = dp.src.shape[1]
        for h, members in zip(*_split_by_value(flat_src, order)):
            if h < H:
                cols[h].append((t, (members // per_group, members % per_group)))
    return list(zip(rows, cols))


def _split_by_value(values: torch.Tensor, order: torch.Tensor):
    unique, counts = torch.unique_consecutive(values[order], return_counts=True)
    return unique.tolist(), torch.split(order, counts.tolist())


def _without_self_loops(log_w: torch.Tensor, dp) -> torch.Tensor:
    return log_w if dp.self_loops is None else log_w.masked_fill(dp.self_loops, -torch.inf)


def _rows(log_w: torch.Tensor, dp, rows: torch.Tensor) -> torch.Tensor:
    return _without_self_loops(log_w, dp).reshape(dp.view[0] * dp.view[1], -1)[rows].reshape(-1)


def _cols(log_w: torch.Tensor, dp, cols) -> torch.Tensor:
    return _without_self_loops(log_w, dp)[cols[0], :, cols[1], :].reshape(-1)


def _shift_rows(log_w: torch.Tensor, rows: torch.Tensor, amount: float) -> None:
    log_w.view(log_w.shape[0] * log_w.shape[1], -1)[rows] += amount


def _shift_cols(log_w: torch.Tensor, cols, amount: float) -> None:
    log_w[cols[0], :, cols[1], :] += amount
