"""Rescale a loaded network: solve for the PathCond (or ENorm) rescaling, apply it to the
tensors in memory, keep them storable in their dtypes, and verify the function is preserved.

    import pathcond_cli as pathcond
    result = pathcond.rescale(pathcond.load("model.onnx"))             # u, the changed tensors, D before and after
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

import torch

from .analysis import Analysis, analyse, check_path_norms
from .engine.calibration import calibration_warnings, ignores_input
from .engine.diag import PathNorm
from .engine.groups import RescalingGroups
from .engine.log_g import DiagG, LogG, OuterLog, dense
from .engine.model import LoadedModel
from .errors import VerificationError
from .runtime import Stopwatch, resolve_device
from .solve.bounds import BoundChoice, within_dtype
from .solve.dtype_limits import check_storage, ensure_storable
from .solve.enorm import enorm
from .solve.options import AUTO, BOUNDED_SOLVERS, DEFAULT_CRITERION, DEFAULT_SOLVER, NONE, USER, SolveOptions
from .solve.solvers import ProgressCallback, SolveResult, solve
from .statistics import Conditioning, DiagSummary, histograms, joint_bounds, summarise
from .verify import Verification, compare


def rescaled_diag(groups: RescalingGroups, diag: DiagG, u: torch.Tensor) -> DiagG:
    """diag(G) of the parameters rescaled by ``u``: log g_i − 2(Bu)_i, since g(θ_u)_i = g_i e^{−2(Bu)_i}."""
    return DiagG(RescaledLogG(groups, diag.parts, groups.extend(u.to(groups.device, torch.float64))))


class RescaledLogG(Sequence[LogG]):
    """log g − 2(Bu) per tensor, computed when read and not kept: the reports read it once or
    twice, and keeping it would hold a second float64 copy of the network's size."""

    def __init__(self, groups: RescalingGroups, log_g: Sequence[LogG], u_ext: torch.Tensor):
        self.groups, self.log_g, self.u_ext = groups, log_g, u_ext

    def __getitem__(self, t: int | slice) -> LogG | list[LogG]:
        if isinstance(t, slice):
            return [self[i] for i in range(len(self))[t]]
        dp, lg = self.groups.dag_params[t], self.log_g[t]
        if isinstance(lg, OuterLog):
            # (Bu)_oi = u_dst(o) − u_src(i) splits between the two factors.
            return OuterLog(*lg.shifted(-2 * self.u_ext[dp.dst].reshape(-1), 2 * self.u_ext[dp.src].reshape(-1)))
        # (Bu) broadcasts over the kernel axis of the view: one pass per tensor, no expanded copy.
        return torch.add(dense(lg).reshape(dp.view), dp.exponent(self.u_ext), alpha=-2.0).reshape(lg.shape)

    def __len__(self) -> int:
        return len(self.log_g)


@dataclass
class RescaleResult:
    """A finished rescaling: the solve, the changed tensors and the measured preservation."""

    analysis: Analysis
    solve: SolveResult
    changed: MutableMapping[str, torch.Tensor]
    verification: Verification | None
    seconds: dict[str, float] = field(default_factory=dict)
    criterion: str = DEFAULT_CRITERION
    warnings: list[str] = field(default_factory=list)
    bound: BoundChoice = field(default_factory=lambda: BoundChoice(NONE))
    # ‖Φ‖_q of the rescaled network as written and read back (None until written, see :func:`save`).
    path_norms_after: dict[str, PathNorm] | None = None
    # The storage check :func:`save` still has to make (``rescale(check_storage_when_written=True)``).
    pending_storage_check: PendingStorageCheck | None = None
    # Whether :func:`save` adds the warning for an output that ignores its input, from its
    # verification's run of the original.
    calibration_pending: bool = False

    @property
    def rescaled_params(self) -> dict[str, torch.Tensor]:
        """All checkpoint tensors after rescaling (unchanged ones are the original objects)."""
        return {**self.analysis.model.params, **self.changed}

    @cached_property
    def diag_after(self) -> DiagG:
        """log diag(G) of the rescaled parameters, log g_i − 2(Bu)_i (SPEC §4): no second pass."""
        return rescaled_diag(self.analysis.groups, self.analysis.diag, self.solve.u)

    @cached_property
    def summary_after(self) -> DiagSummary:
        """Per-layer spreads, D and range of diag(G) after rescaling."""
        return summarise(self.analysis.groups, self.diag_after.parts)

    @property
    def conditioning_after(self) -> Conditioning:
        """D(θ_u) of the rescaled model."""
        return self.summary_after.conditioning

    @cached_property
    def bins(self) -> tuple[list[tuple[float, float, int]], list[tuple[float, float, int]]]:
        """The report's histograms of log10 g before and after rescaling, over one set of bins
        spanning both, so that the two read side by side."""
        bounds = joint_bounds(self.analysis.summary, self.summary_after)
        before, after = histograms([self.analysis.diag.parts, self.diag_after.parts], *bounds)
        return before, after

    def gather_report_facts(self) -> None:
        """Compute, once, every fact the ``rescale`` report states."""
        for holder, fact in ((self.analysis, "zero_causes"), (self, "bins")):
            getattr(holder, fact)


def rescale(
    model: LoadedModel,
    options: SolveOptions | None = None,
    *,
    device: str | torch.device = "auto",
    progress: ProgressCallback | None = None,
    analysis: Analysis | None = None,
    verify: bool = True,
    check_storage_when_written: bool = False,
    **choices,
) -> RescaleResult:
    """Find the PathCond rescaling of ``model`` and apply it to its tensors (in memory).

    What to minimise and how is a :class:`SolveOptions` (``options``, or its fields as keywords:
    ``criterion``, ``solver``, ``tol``, ``max_iter``, ``max_log_scale``; both: the keywords replace
    those fields), validated once when it is made (:class:`InvalidOption`, a ``ValueError``).
    ``criterion="enorm"`` minimises ENorm's Σθ² (SPEC §7) on the same groups instead, with
    its closed-form block updates; ``solver`` chooses among PathCond's minimisers only.
    With ``verify`` (the default) the rescaled tensors are run against the original ones and
    :class:`VerificationError` is raised when they differ beyond the dtype's tolerance; the
    CLI instead verifies the file it wrote. ``result.verification`` is None when skipped.
    ``max_iter`` is a safety cap (``result.solve.converged`` says whether the tolerance was
    met). ``max_log_scale`` bounds every |u_h| (:mod:`.bounds`): ``"auto"`` (the default) keeps
    the unbounded optimum when the checkpoint's dtypes can store it and otherwise solves within
    the largest bound that keeps every rescaled tensor storable (``result.bound`` says which,
    ``result.warnings`` what it cost); a number U bounds |u_h| ≤ U; ``"none"`` or None solves
    unbounded. With a number or ``"none"``, a rescaled tensor that would overflow or lose its
    values in its dtype raises :class:`StorageError`. A few values flushed below the smallest
    normal are listed in ``result.warnings``. ENorm takes no bound (``"auto"`` means none).
    With ``check_storage_when_written`` that check, the bound it may lead to and their warnings
    wait for :func:`save`, which makes them on the tensors it computes to write them: each
    rescaled tensor is then computed once (the CLI's way; ``save`` is then required).
    """
    options = replace(options or SolveOptions(), **choices)
    rule, criterion = options.bound_rule, options.criterion
    device = resolve_device(device)
    analysis = analysis or analyse(model, device=device)
    seconds = dict(analysis.seconds)
    timed = Stopwatch(seconds)

    def run(bound: float | None) -> SolveResult:
        # Under the auto rule an unconstrained solver (lbfgs) leaves the bounded solve to the default one.
        solver = options.solver if bound is None or options.solver in BOUNDED_SOLVERS else DEFAULT_SOLVER
        return solve(
            analysis.groups,
            analysis.diag,
            options,
            solver=solver,
            max_log_scale=bound,
            device=device,
            progress=progress,
        )

    if criterion == "enorm":
        result = timed(
            "solve",
            lambda: enorm(
                analysis.groups, tol=options.tol, max_iter=options.max_iter, device=device, progress=progress
            ),
        )
    elif not analysis.diag.any_nonzero():
        result = timed("solve", lambda: _nothing_to_rescale(model, analysis, options))
    else:
        result = timed("solve", lambda: run(options.bound))
    changed = timed("apply", lambda: analysis.groups.apply(model.params, result.u))
    choice = BoundChoice(rule, None if rule == USER else result)
    pending = PendingStorageCheck(run) if check_storage_when_written else None
    storage_warnings = []
    if pending is None:
        # One computation of each rescaled tensor serves the auto rule and the refusal or warnings.
        problems = timed("storage_check", lambda: check_storage(model.params, changed))
        if choice.rule == AUTO:
            result, changed, choice = timed(
                "solve", lambda: within_dtype(analysis.groups, model.params, result, changed, run, problems)
            )
            if choice.applied:
                problems = timed("storage_check", lambda: check_storage(model.params, changed))
        storage_warnings = ensure_storable(
            model.source, analysis.groups, model.params, changed, result.u_inf, problems=problems
        ) + choice.warnings(model.source, result)
    verification = (
        timed("verify", lambda: compare(model.graph, model.params, ChainMap(changed, model.params))) if verify else None
    )
    # Whether the output ignores its input is answered by the verification's forward pass of the
    # original: made here, or by :func:`save` when it is required (which adds that warning); a
    # pass of its own only when neither verifies.
    calibration_pending = verification is None and pending is not None
    if verification is not None:
        constant = verification.original_ignores_input
    else:
        constant = None if calibration_pending else ignores_input(model, analysis.groups)
    storage_warnings += calibration_warnings(model, constant)
    if verification is not None and not verification.passed:
        raise VerificationError(
            f"{model.source}: the rescaled network differs from the original by a relative "
            f"{verification.max_rel_error:.3g} (tolerance {verification.tolerance:.1g}); nothing was written."
        )
    norms_after = (
        timed(
            "path_norms_rescaled",
            lambda: check_path_norms(
                analysis, model.graph, ChainMap(changed, model.params), model.source, rescaled_by=result.u
            ),
        )
        if verify
        else None
    )
    return RescaleResult(
        analysis,
        result,
        changed,
        verification,
        seconds,
        criterion,
        storage_warnings,
        choice,
        norms_after,
        pending,
        calibration_pending,
    )


@dataclass
class PendingStorageCheck:
    """A rescaling's storage check left to the write that computes its tensors (see
    :func:`rescale`); ``resolve`` solves within a bound, for the auto rule."""

    resolve: Callable[[float | None], SolveResult]


ZERO_FUNCTION_NOTE = (
    "diag(G) is zero everywhere: no path of the network carries a nonzero product of weights (it computes "
    "the zero function, or a constant). Nothing to rescale: u = 0 and the file is written unchanged; "
    "the objective is undefined and reported as 0."
)
NO_PARAMETERS_NOTE = (
    "the network has no parameters (weights or biases) to rescale: u = 0 and the file is written unchanged; "
    "the objective is undefined and reported as 0."
)


def _nothing_to_rescale(model: LoadedModel, analysis: Analysis, options: SolveOptions) -> SolveResult:
    """The trivial solve of a network whose path kernel is zero (or has no entry: no parameter):
    every group stays at u = 0."""
    note = NO_PARAMETERS_NOTE if analysis.groups.p == 0 else ZERO_FUNCTION_NOTE
    if note not in model.warnings:
        model.warnings.append(note)
    u = torch.zeros(analysis.groups.num_free, dtype=torch.float64)
    return SolveResult(options.solver, u, [0.0], 0.0, True, 0, 0, tol=options.tol, max_iter=options.max_iter)
