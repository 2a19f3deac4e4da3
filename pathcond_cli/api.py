"""The Python API: analyse and rescale a network given as a checkpoint or an ``nn.Module``.

    import pathcond_cli as pathcond

    result = pathcond.rescale_module(model, input_shape=(3, 32, 32))   # in place, verified
    analysis = pathcond.analyse(pathcond.load("model.onnx"))           # diag(G), paths, groups
"""

from __future__ import annotations

import math
import time
from collections import ChainMap
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import TypeVar

import torch

from . import __version__
from .engine.calibration import calibration_warnings, constant_output_warnings, ignores_input
from .engine.diag import (
    DiagG, LogG, OuterLog, PathCount, PathNorm, TensorStats, balancing_exponents, dense, diag_g_and_l2_norm,
    norm_order_text, path_count, path_norms, tensor_stats, zeros_per_layer,
)
from .engine.graph import BatchNorm, Graph, all_finite
from .engine.groups import DagParam, RescalingGroups, build_groups
from .engine.layouts import layout_of, release_held
from .engine.model import LoadedModel
from .errors import InputError, PathcondError, UnsupportedModelError, UsageError, VerificationError
# The module, not its functions: a loader replaced in it (a test's fault) is the one called here.
from .io import formats
from .io.fileio import check_destination, check_unchanged, describe, resolve_destination, staged_output
from .io.formats import replaced_companions, write_model
from .io.formats.fx_import import module_import
from .solve.bounds import BoundChoice, within_dtype
from .solve.dtype_limits import StorageCheck, check_storage, ensure_storable, storage_problem
from .solve.enorm import enorm
from .solve.options import AUTO, BOUNDED_SOLVERS, DEFAULT_CRITERION, DEFAULT_SOLVER, NONE, USER, SolveOptions
from .solve.solvers import ProgressCallback, SolveResult, solve
from .verify import Verification, compare, compare_modules, independent_check

LOG10_E = 1 / math.log(10)
# The ℓq path norms every analysis reports (SPEC §8); ``path_norms=`` adds others.
DEFAULT_PATH_NORMS = (1.0, 2.0)
VerifiedT = TypeVar("VerifiedT")


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``auto`` picks CUDA when present, else the CPU."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"device '{device}' was requested but torch sees no CUDA device on this machine.")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise UsageError(f"device '{device}' was requested but this machine has {torch.cuda.device_count()} CUDA "
                         "device(s), numbered from 0.")
    return device


@dataclass
class LayerSpread:
    """diag(G) summary for one Linear/Conv layer (BatchNorm folded)."""

    layer: str
    parameters: int
    zeros: int
    log10_min: float | None
    log10_max: float | None


@dataclass
class Conditioning:
    """The invariant conditioning measure of SPEC §4 for one diag(G).

    ``value`` is D = p · ln(mean g / geomean g), p the ``counted`` parameters with g > 0 (the
    support, as in F) and the means taken over them. Parameters with g = 0 lie on no path of
    non-zero weight; no rescaling changes that (g e^{−2(Bu)} stays 0), so they are left out
    and counted in ``zeros``: D compares like with like before and after, and
    F(u) − F(0) = D(θ_u) − D(θ) exactly. ``per_parameter`` = ln(mean g / geomean g) = D / p
    compares networks of different sizes. D ≥ 0, and D = 0 iff diag(G) is constant on g > 0.
    """

    value: float
    per_parameter: float
    counted: int
    zeros: int


def _conditioning(stats: list[TensorStats], sizes: list[int]) -> Conditioning:
    zeros = sum(s.zeros for s in stats)
    counted = sum(sizes) - zeros
    if not counted:
        return Conditioning(0.0, 0.0, 0, zeros)
    log_mean = float(torch.logsumexp(torch.tensor([s.log_sum_exp for s in stats], dtype=torch.float64), 0))
    log_mean -= math.log(counted)
    # AM ≥ GM: a negative difference is round-off.
    per_parameter = max(log_mean - sum(s.log_total for s in stats) / counted, 0.0)
    return Conditioning(counted * per_parameter, per_parameter, counted, zeros)


def conditioning(log_g: Sequence[LogG]) -> Conditioning:
    """D from log diag(G) (−inf where g = 0), tensor by tensor in the log domain."""
    return _conditioning([tensor_stats(lg) for lg in log_g], [lg.numel() for lg in log_g])


@dataclass
class DiagSummary:
    """What the reports read from one diag(G), from a single pass of reductions per tensor:
    per-layer spreads (network order), D, and the natural-log range of g > 0 (None if all 0)."""

    layers: list[LayerSpread]
    conditioning: Conditioning
    ln_low: float | None
    ln_high: float | None


def summarise(groups: RescalingGroups, log_g: Sequence[LogG]) -> DiagSummary:
    # Each log g read once: a rescaled one (RescaledLogG) is computed on every read.
    stats = [tensor_stats(lg) for lg in log_g]
    spreads: dict[str, LayerSpread] = {}
    lows: dict[str, float] = {}
    highs: dict[str, float] = {}
    for dp, st in zip(groups.dag_params, stats):
        entry = spreads.setdefault(dp.layer, LayerSpread(dp.layer, 0, 0, None, None))
        entry.parameters += dp.numel
        entry.zeros += st.zeros
        lows[dp.layer] = min(lows.get(dp.layer, math.inf), st.low)
        highs[dp.layer] = max(highs.get(dp.layer, -math.inf), st.high)
    for layer, entry in spreads.items():
        if highs[layer] > -math.inf:
            entry.log10_min, entry.log10_max = lows[layer] * LOG10_E, highs[layer] * LOG10_E
    low, high = min(lows.values(), default=math.inf), max(highs.values(), default=-math.inf)
    return DiagSummary(
        list(spreads.values()),
        _conditioning(stats, [dp.numel for dp in groups.dag_params]),
        low if high > -math.inf else None,
        high if high > -math.inf else None,
    )


def histogram(log_g: Sequence[LogG], ln_low: float | None, ln_high: float | None,
              bins: int = 12) -> list[tuple[float, float, int]]:
    """Counts of g > 0 over ``bins`` equal-width bins of ln g spanning [ln_low, ln_high] (the
    exact extremes, so every g > 0 is counted), with the edges given as log10."""
    if ln_low is None or ln_high is None:
        return []
    ln_high = ln_high if ln_high > ln_low else ln_low + 1.0
    counts = torch.zeros(bins, dtype=torch.long)
    for lg in log_g:
        # histc leaves out values below its range: g = 0 (ln g = −inf) is not counted.
        if isinstance(lg, OuterLog):
            counts += lg.histc(bins, ln_low, ln_high).to("cpu")
        else:
            counts += torch.histc(dense(lg), bins=bins, min=ln_low, max=ln_high).to("cpu", torch.long)
    width = (ln_high - ln_low) / bins
    return [((ln_low + i * width) * LOG10_E, (ln_low + (i + 1) * width) * LOG10_E, int(counts[i])) for i in range(bins)]


@dataclass
class Analysis:
    """Everything ``inspect`` reports: counts, groups, path count and the diag(G) spread."""

    model: LoadedModel
    groups: RescalingGroups
    diag: DiagG
    paths: PathCount
    seconds: dict[str, float] = field(default_factory=dict)
    device: str = "cpu"
    # ‖Φ(θ)‖_q by report key (``l1``, ``l2``, ``l4``, ...), in the order asked for.
    path_norms: dict[str, PathNorm] = field(default_factory=dict)
    # u_D, the balancing diag(G) and the path norms ran on (None: not computed).
    balancing: torch.Tensor | None = None

    @cached_property
    def summary(self) -> DiagSummary:
        return summarise(self.groups, self.diag.parts)

    @property
    def log10_min(self) -> float | None:
        return None if self.summary.ln_low is None else self.summary.ln_low * LOG10_E

    @property
    def log10_max(self) -> float | None:
        return None if self.summary.ln_high is None else self.summary.ln_high * LOG10_E

    def per_layer(self) -> list[LayerSpread]:
        return self.summary.layers

    def histogram(self, bins: int = 12) -> list[tuple[float, float, int]]:
        """Counts of log10 g over equal-width bins (g = 0 excluded)."""
        return histogram(self.diag.parts, self.summary.ln_low, self.summary.ln_high, bins)

    @property
    def conditioning(self) -> Conditioning:
        """D(θ) of the model as loaded."""
        return self.summary.conditioning


@dataclass
class ZeroGamma:
    """A BatchNorm with γ = 0 on ``zeroed`` of its ``channels`` (``mask``), and the DAG layer whose
    weight rows it zeroes: the Linear/Conv it is folded into, or itself when standalone."""

    name: str
    layer: str
    zeroed: int
    channels: int
    mask: torch.Tensor

    def describe(self) -> str:
        share = f"all {self.channels:,}" if self.zeroed == self.channels else f"{self.zeroed:,} of {self.channels:,}"
        return f"γ = 0 on {share} channels of BatchNorm {self.name}"


@dataclass
class ZeroCause:
    """A layer's g = 0 and their most likely cause (issue 27.1). g_i = 0 when no path through
    parameter i has every other weight non-zero; of the layer's ``zeros``:

    - ``unused``: on no path at all at this input shape (conv taps that see only padding);
    - ``gamma``: those that a BatchNorm γ = 0 makes zero (they lie on a path again when every
      γ = 0 is taken as non-zero); ``batchnorm`` is the nearest such BatchNorm downstream of
      the layer (else upstream), None when no γ is 0;
    - ``weights`` (the rest): zero weights elsewhere, or dead units (no input and no bias).
    """

    layer: str
    parameters: int
    zeros: int
    unused: int
    gamma: int
    batchnorm: ZeroGamma | None

    @property
    def weights(self) -> int:
        return self.zeros - self.unused - self.gamma

    @property
    def cause(self) -> str:
        """The largest share's cause, in words."""
        shares = [(self.gamma, self.batchnorm.describe() if self.batchnorm else ""),
                  (self.unused, "conv taps on no path at this input shape (they see only padding)"),
                  (self.weights, "zero weights or dead units: every path through them has a zero weight")]
        return max(shares, key=lambda share: share[0])[1]


def zero_gammas(graph: Graph, params) -> list[ZeroGamma]:
    """The BatchNorms with γ = 0 on some channel, in network order."""
    found = []
    for node in graph.nodes:
        if isinstance(node, BatchNorm):
            mask = params[node.weight].reshape(-1) == 0
            if bool(mask.any()):
                folded = graph.folded_into(node)
                found.append(ZeroGamma(node.name, (folded or node).name, int(mask.sum()), mask.numel(), mask))
    return found


def _nearest(graph: Graph, layer: str, gammas: list[ZeroGamma]) -> ZeroGamma | None:
    """The BatchNorm of ``gammas`` fewest nodes downstream of ``layer`` (its own, which cannot
    zero its g, excluded), else fewest upstream: breadth-first over the graph."""
    by_name = {gamma.name: gamma for gamma in gammas if gamma.layer != layer}
    for neighbours in (graph.consumers, lambda name: list(graph[name].inputs)):
        seen, frontier = {layer}, [layer]
        while frontier:
            for name in frontier:
                if name in by_name:
                    return by_name[name]
            frontier = [n for name in frontier for n in neighbours(name) if n not in seen]
            seen.update(frontier)
    return None


def zero_causes(analysis: Analysis, unused: dict[str, int]) -> list[ZeroCause]:
    """Per layer with g = 0, in network order, how many and why (``unused``: the parameters on
    no path at this input shape, :func:`~pathcond_cli.engine.diag.unused_parameters`). Costs one
    path-count pass when some BatchNorm has γ = 0, none otherwise."""
    if not any(spread.zeros for spread in analysis.summary.layers):
        return []
    groups, params = analysis.groups, analysis.model.params
    gammas = zero_gammas(groups.graph, params)
    remaining: dict[str, int] = {}
    if gammas:
        rows = {gamma.layer: gamma.mask for gamma in gammas}

        def restored(dp: DagParam) -> torch.Tensor:
            # 1[θ ≠ 0], with the rows a γ = 0 zeroes taken as non-zero (a bias is not zeroed by γ)
            psi = (dp.value != 0).to(torch.float64)
            if dp.layer in rows and psi.dim() > 1:
                psi[rows[dp.layer].to(psi.device)] = 1.0
            return psi

        remaining = zeros_per_layer(groups, restored, device=groups.device)
    causes = []
    for spread in analysis.summary.layers:
        if spread.zeros:
            gamma = max(spread.zeros - remaining.get(spread.layer, 0), 0) if gammas else 0
            used = min(unused.get(spread.layer, 0), spread.zeros - gamma)
            causes.append(ZeroCause(spread.layer, spread.parameters, spread.zeros, used, gamma,
                                    _nearest(groups.graph, spread.layer, gammas)))
    return causes


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


class Stopwatch:
    def __init__(self, seconds: dict[str, float]):
        self.seconds = seconds

    def __call__(self, stage: str, work: Callable):
        start = time.perf_counter()
        value = work()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start
        return value


def analyse(model: LoadedModel, *, device: str | torch.device = "auto",
            path_norms: Iterable[float] = DEFAULT_PATH_NORMS) -> Analysis:
    """Groups, diag(G), path count and the ℓq path norms of a loaded model (q = 1, 2 and any
    other q ≥ 1 in ``path_norms``). The values the loader held for it (:class:`~pathcond_cli.
    engine.layouts.HeldValues`) are let go at its end: later passes read the file."""
    device = resolve_device(device)
    seconds: dict[str, float] = {}
    timed = Stopwatch(seconds)
    qs = path_norm_orders(path_norms)
    try:
        groups = timed("groups", lambda: build_groups(model.graph, model.params).to(device))
        # One balancing serves diag(G) and every path norm.
        balancing = timed("diag_g", lambda: balancing_exponents(groups))
        u_ext = groups.extend(balancing)
        diag, l2 = timed("diag_g", lambda: diag_g_and_l2_norm(groups, device=device, u_ext=u_ext))
        paths = timed("path_count", lambda: path_count(groups, device=device))
        norms = timed("path_norms", lambda: path_norms_of(groups, qs, device=device, u_ext=u_ext, known=[l2]))
    finally:
        release_held(model.params)
    return Analysis(model, groups, diag, paths, seconds, str(device), norms, balancing)


def path_norm_orders(extra: Iterable[float]) -> list[float]:
    """q = 1 and 2, then every other q asked for, each once; q must be a finite number ≥ 1."""
    orders: list[float] = []
    for q in (*DEFAULT_PATH_NORMS, *extra):
        q = float(q)
        if not (math.isfinite(q) and q >= 1):
            raise UsageError(f"a path norm needs a finite q ≥ 1, not {q:g} (‖Φ‖_q is not a norm below 1)")
        if q not in orders:
            orders.append(q)
    return orders


def path_norms_of(groups: RescalingGroups, orders: Iterable[float], *, device: str | torch.device = "cpu",
                  u_ext: torch.Tensor | None = None, known: Iterable[PathNorm] = ()) -> dict[str, PathNorm]:
    """‖Φ(θ)‖_q for each q, from one sweep over one balanced copy of θ (``u_ext``: the
    balancing, computed here when not given), except for the norms ``known`` already."""
    groups = groups.to(device)
    known = {norm.q: norm for norm in known}
    missing = [q for q in orders if q not in known]
    if missing:
        known |= {norm.q: norm for norm in path_norms(groups, missing, device=device, u_ext=u_ext)}
    return {known[q].key: known[q] for q in orders}


def rounding_tolerance(groups: RescalingGroups, dtypes: Iterable[torch.dtype]) -> float:
    """Relative change of any ‖Φ‖_q that rounding the stored tensors to ``dtypes`` can cause.

    Each DAG parameter is a product of at most two stored values (a weight and a folded
    BatchNorm γ), each rounded once (relative error ≤ u, the unit roundoff), and a path holds at
    most L of them, so every |Φ_P| moves by a factor within (1 ± u)^{2L}; a sum of such terms,
    and its q-th root, by no more. float64's own passes add 1e-9.
    """
    unit = max((torch.finfo(dtype).eps / 2 for dtype in dtypes if dtype.is_floating_point), default=0.0)
    layers = {dp.layer for dp in groups.dag_params}
    depth: dict[str, int] = {}
    for node in groups.graph.nodes:
        depth[node.name] = max((depth[i] for i in node.inputs), default=0) + (node.name in layers)
    longest = max(depth.values(), default=0)
    return math.expm1(2 * longest * math.log1p(unit)) + 1e-9


def check_path_norms(analysis: Analysis, graph, params: Mapping[str, torch.Tensor], name: str, *,
                     outcome: str = "Nothing was written.", rescaled_by: torch.Tensor | None = None) -> dict[str, PathNorm]:
    """The path norms of the rescaled network ``graph``/``params``, which must equal the
    original's up to rounding (Φ is rescaling-invariant): :class:`VerificationError` otherwise,
    ending with ``outcome`` (what was left as it was). A check of the rescaling that needs no
    input data.

    ``rescaled_by`` is the u that rescaled the original into ``params``: their passes then run
    on the analysis's balancing less u (θ rescaled by u, then by u_D − u, is the balanced copy
    the analysis ran on) instead of a balancing pass of their own. Any admissible rescaling
    leaves the norms as they are; this one keeps their passes in range as the analysis's were.
    """
    device = analysis.groups.device
    groups = build_groups(graph, params).to(device)
    u_ext = None
    if rescaled_by is not None and analysis.balancing is not None and groups.num_free == analysis.groups.num_free:
        u_ext = groups.extend(analysis.balancing - rescaled_by.to(device, torch.float64))
    after = path_norms_of(groups, [norm.q for norm in analysis.path_norms.values()], device=device, u_ext=u_ext)
    tolerance = rounding_tolerance(groups, [layout_of(params, key)[1] for key in graph.parameter_keys()])
    for key, before in analysis.path_norms.items():
        # Φ = 0 (log10 −inf) on both sides is no change; −inf against a number is.
        same = after[key].log10 == before.log10
        change = 0.0 if same else abs(math.expm1((after[key].log10 - before.log10) * math.log(10)))
        if not change <= tolerance:  # NaN fails too
            raise VerificationError(
                f"'{name}': the path norm ‖Φ‖_{norm_order_text(before.q)} changed by a relative {change:.3g} (from 10^{before.log10:.9g} "
                f"to 10^{after[key].log10:.9g}), beyond the {tolerance:.2g} that rounding the stored tensors allows; "
                "a rescaling leaves every path norm unchanged, so the rescaled model is not a rescaling of the "
                f"original. {outcome}"
            )
    return after


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
        return solve(analysis.groups, analysis.diag, options, solver=solver, max_log_scale=bound, device=device,
                     progress=progress)

    if criterion == "enorm":
        result = timed("solve", lambda: enorm(analysis.groups, tol=options.tol, max_iter=options.max_iter,
                                              device=device, progress=progress))
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
            result, changed, choice = timed("solve", lambda: within_dtype(analysis.groups, model.params, result,
                                                                          changed, run, problems))
            if choice.applied:
                problems = timed("storage_check", lambda: check_storage(model.params, changed))
        storage_warnings = ensure_storable(model.source, analysis.groups, model.params, changed, result.u_inf,
                                           problems=problems) + choice.warnings(model.source, result)
    verification = timed("verify", lambda: compare(model.graph, model.params, ChainMap(changed, model.params))) if verify else None
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
    norms_after = timed("path_norms_rescaled", lambda: check_path_norms(
        analysis, model.graph, ChainMap(changed, model.params), model.source, rescaled_by=result.u)) if verify else None
    return RescaleResult(analysis, result, changed, verification, seconds, criterion, storage_warnings, choice,
                         norms_after, pending, calibration_pending)


@dataclass
class PendingStorageCheck:
    """A rescaling's storage check left to the write that computes its tensors (see
    :func:`rescale`); ``resolve`` solves within a bound, for the auto rule."""

    resolve: Callable[[float | None], SolveResult]


class _BoundedByTheWrite(Exception):
    """The tensors just written lose values and the auto rule bounded the solve: write again."""


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


def module_model(module: torch.nn.Module, input_shape: tuple[int, ...], *, name: str | None = None) -> LoadedModel:
    """Wrap an ``nn.Module`` (traced with torch.fx) as a :class:`LoadedModel`."""
    source = name or type(module).__name__
    _check_on_a_device(module)
    graph, params, notes = module_import(module, tuple(input_shape), source=source)
    return LoadedModel(graph, params, "module", source, payload=module, warnings=notes, arch_source="module")


def rescale_module(module: torch.nn.Module, input_shape: tuple[int, ...], **options) -> RescaleResult:
    """Rescale ``module``'s parameters in place (function preserved, verified) and return the result.

    ``options`` are those of :func:`rescale` (``criterion``, ``solver``, ``tol``, ``max_iter``, ``device``,
    ``max_log_scale``).
    The rescaling is verified on the module itself: a copy holding the rescaled tensors is run
    against a copy of the original, in eval mode and, with BatchNorm, in train mode (the
    module's own running statistics are never touched). Only then are its tensors changed;
    on :class:`VerificationError` the module is left as it was. A module whose parameters are
    shared between layers (tied weights) is refused with :class:`UnsupportedModelError`.
    """
    _check_module(module)
    options.pop("verify", None)
    model = module_model(module, input_shape)
    result = rescale(model, verify=False, **options)
    verification = _compare_module(module, result.changed, tuple(input_shape), model.source)
    if not verification.passed:
        raise VerificationError(
            f"{model.source}: the rescaled module differs from the original by a relative "
            f"{verification.max_rel_error:.3g} (tolerance {verification.tolerance:.1g}); the module was not changed."
        )
    result.path_norms_after = check_path_norms(result.analysis, model.graph, ChainMap(result.changed, model.params),
                                               model.source, outcome="The module was not changed.",
                                               rescaled_by=result.solve.u)
    # Computed once, before the module's tensors (which they are computed from) change.
    result.changed = result.changed.copy()
    state = module.state_dict()
    with torch.no_grad():
        for key, tensor in result.changed.items():
            state[key].copy_(tensor)
    result.verification = verification
    return result


def _compare_module(module: torch.nn.Module, changed: Mapping[str, torch.Tensor], input_shape: tuple[int, ...],
                    source: str) -> Verification:
    """:func:`compare_modules`, with a forward that cannot run as it runs the module (in float64) refused."""
    try:
        return compare_modules(module, changed, input_shape)
    except PathcondError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's forward, run on float64 copies, may raise anything
        reason = (str(exc).strip().splitlines() or [""])[0]
        raise VerificationError(
            f"{source}: the rescaling cannot be verified: the verification runs copies of the module in float64 on "
            f"standard normal inputs, and its forward raises there ({type(exc).__name__}: {reason[:300]}). A "
            "forward that casts a stored tensor to a fixed dtype (self.filt.float(), .to(torch.float32)) runs in "
            "that dtype only: store the tensor in the dtype it is used in, and use it without the cast. The module "
            "was not changed."
        ) from None


def _check_on_a_device(module: torch.nn.Module) -> None:
    """Refuse a module with tensors on the meta device: it holds no values to read or run."""
    tensors = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    on_meta = [key for key, tensor in tensors if tensor.is_meta]
    if on_meta:
        raise InputError(
            f"{type(module).__name__}: tensor(s) {', '.join(on_meta[:10])} are on the meta device and hold no "
            "values; load the weights (e.g. module.to_empty(device='cpu') then load_state_dict) first."
        )


def _check_module(module: torch.nn.Module) -> None:
    """Refuse what ``rescale_module`` cannot rescale exactly: meta tensors and tied parameters."""
    name = type(module).__name__
    _check_on_a_device(module)
    tensors = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    owners: dict[tuple[int, int], list[str]] = {}
    for key, tensor in tensors:
        if tensor.numel():
            owners.setdefault((tensor.untyped_storage().data_ptr(), tensor.storage_offset()), []).append(key)
    tied = [keys for keys in owners.values() if len(keys) > 1]
    if tied:
        raise UnsupportedModelError(
            f"{name}: parameters are shared between layers (tied weights); one rescaling per layer would change "
            "the function, so pathcond does not rescale such a module:",
            [" = ".join(keys) for keys in tied],
        )


def load(
    source: str | Path | bytes,
    *,
    arch: str | None = None,
    input_shape: tuple[int, ...] | dict[str, tuple[int, ...]] | None = None,
    allow_unused: bool = False,
) -> LoadedModel:
    """Load an ONNX model or a safetensors checkpoint (``arch``: spec file or ``module:factory``).

    Checkpoint tensors the architecture does not read raise :class:`InputError` unless
    ``allow_unused`` (then they are carried through and named in ``warnings``).
    """
    return formats.load_model(Path(source) if isinstance(source, str) else source, arch=arch,
                              input_shape=input_shape, allow_unused=allow_unused)


def run_metadata(result: RescaleResult) -> dict[str, str]:
    """Key figures of the run, recorded in the written file's metadata."""
    solve = result.solve
    return {
        "pathcond.version": __version__,
        "pathcond.criterion": result.criterion,
        "pathcond.solver": solve.method,
        "pathcond.iterations": str(solve.iterations),
        "pathcond.converged": str(solve.converged).lower(),
        "pathcond.kkt_residual": f"{solve.kkt_residual:.6g}",
        "pathcond.objective_initial": repr(solve.objective[0]),
        "pathcond.objective_final": repr(solve.objective[-1]),
        "pathcond.u_inf": f"{solve.u_inf:.6g}",
        "pathcond.log10_paths": f"{result.analysis.paths.log10:.6f}",
    }


def save(
    result: RescaleResult,
    destination: str | Path,
    *,
    input_shape: tuple[int, ...] | dict[str, tuple[int, ...]] | None = None,
    in_place: bool = False,
    seconds: dict[str, float] | None = None,
    self_contained: bool = False,
) -> Verification:
    """Write the rescaled model in its input format, reload it and verify it.

    The model is written into a hidden staging directory beside ``destination``, reloaded
    from there and verified, running the graph read back from it (for ONNX also by an
    independent runtime, onnxruntime or onnx.reference, when one can evaluate the original: the
    written file must then load and agree); only a file that computes the original function is
    renamed onto ``destination``. Otherwise :class:`VerificationError` is raised and
    nothing is left behind, so ``destination`` — the input itself with ``in_place`` — is
    untouched by a failed or interrupted run. No file of the input (shards, external data,
    spec) is written without ``in_place``; companion files are written under fresh names and,
    after the swap, those provably the replaced checkpoint's own are deleted (the others it
    named are left, each named in ``result.warnings``). The verification is stored
    on ``result`` too. With ``self_contained`` an ONNX model read with external data is written
    as one file, its data inline (:class:`OutputError` beyond protobuf's 2 GiB). Each rescaled
    tensor is computed once here, as it is written, and checked then: its values finite and, for
    a ``result`` whose storage check was left to the write (``rescale(check_storage_when_written=
    True)``), storable in its dtype, with :func:`rescale`'s refusal, bound and warnings (a bound
    found here writes the bounded tensors again).
    """
    model = result.analysis.model
    if input_shape is None and model.format == "onnx":
        # The written file is read back with the shapes the analysis used, which the model may leave open.
        input_shape = model.carried.inputs or {node.name: tuple(node.shape) for node in model.graph.inputs}
    timings = seconds if seconds is not None else result.seconds
    timed = Stopwatch(timings)

    while True:
        changed = CheckedWhenRead(result.changed, model.params, f"{model.source}: the rescaling (solver "
                                  f"'{result.solve.method}', max |u| = {result.solve.u_inf:.3g})",
                                  storage=result.pending_storage_check is not None)

        def verify(target: Path, name: str, checked: CheckedWhenRead = changed) -> Verification:
            if result.pending_storage_check is not None:
                _settle_storage(result, checked.storage_problems(), timed)
            verification, written = _verify_written(model, target, input_shape, name=name,
                                                    compared=lambda verification: _add_calibration(result, verification))
            result.path_norms_after = check_path_norms(result.analysis, written.graph, written.params, name,
                                                       rescaled_by=result.solve.u)
            return verification

        try:
            result.verification = write_staged(model, changed, destination, run_metadata(result), verify,
                                               in_place=in_place, self_contained=self_contained,
                                               warnings=result.warnings, timed=timed)
        except _BoundedByTheWrite:
            continue
        return result.verification


def _add_calibration(result: RescaleResult, verification: Verification) -> None:
    """The calibration warning :func:`rescale` left to :func:`save`, from the verification's run
    of the original (added even when the verification then fails: it may say why)."""
    if result.calibration_pending:
        result.warnings += constant_output_warnings(result.analysis.model, verification.original_ignores_input)
        result.calibration_pending = False


def _settle_storage(result: RescaleResult, problems: list[StorageCheck], timed: Stopwatch) -> None:
    """What :func:`rescale` does with the storage ``problems`` of ``result.changed``, found by the
    write: under the auto rule a first loss bounds the solve (:class:`_BoundedByTheWrite`, the
    tensors are written again and checked then); otherwise a loss is :class:`StorageError`, and
    a few flushed values are warnings."""
    model, groups = result.analysis.model, result.analysis.groups
    if result.bound.rule == AUTO and not result.bound.applied:
        solved, changed, choice = timed("solve", lambda: within_dtype(
            groups, model.params, result.solve, result.changed, result.pending_storage_check.resolve, problems))
        if choice.applied:
            result.solve, result.changed, result.bound = solved, changed, choice
            raise _BoundedByTheWrite
    result.warnings[:0] = ensure_storable(model.source, groups, model.params, result.changed, result.solve.u_inf,
                                         problems=problems) + result.bound.warnings(model.source, result.solve)
    result.pending_storage_check = None


class CheckedWhenRead(Mapping[str, torch.Tensor]):
    """``tensors`` checked as the writer reads each one, so that the checks share the writer's
    computation of a rescaled tensor instead of making their own: with ``storage``, what storing
    it in its dtype loses (:meth:`storage_problems`, against ``original``); and its values
    finite, else :class:`VerificationError` before the staged file can be kept (``what`` names
    what produced the tensors). A tensor that overflows is a storage problem, left to the
    storage check's refusal or bound."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], original: Mapping[str, torch.Tensor], what: str, *,
                 storage: bool):
        self._tensors, self._original, self._what = tensors, original, what
        self._problems: dict[str, StorageCheck] | None = {} if storage else None

    def __getitem__(self, key: str) -> torch.Tensor:
        tensor = self._tensors[key]
        if self._problems is not None and (problem := storage_problem(key, self._original, tensor)) is not None:
            self._problems[key] = problem
        elif tensor.is_floating_point() and not all_finite(tensor):
            raise VerificationError(f"{self._what} produced NaN or Inf in tensor {key!r}; nothing was written.")
        return tensor

    def storage_problems(self) -> list[StorageCheck]:
        """The problems found so far, in the order of ``tensors`` (as :func:`check_storage` lists them)."""
        return [self._problems[key] for key in self._tensors if key in self._problems]

    def __contains__(self, key: object) -> bool:
        return key in self._tensors

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def write_staged(model: LoadedModel, changed: Mapping[str, torch.Tensor], destination: str | Path,
                 metadata: dict[str, str], verify: Callable[[Path, str], VerifiedT], *, in_place: bool = False,
                 self_contained: bool = False, warnings: list[str] | None = None,
                 timed: Callable | None = None) -> VerifiedT:
    """Write ``model`` with ``changed`` tensors in its own format into a staging directory beside
    ``destination``, run ``verify(staged_path, shown_name)`` on what was written, and only if it
    returns rename the file onto ``destination`` (the rules of :func:`save`): a failed check
    raises and leaves nothing behind. Returns what ``verify`` returned."""
    timed = timed or Stopwatch({})
    destination = resolve_destination(Path(destination))
    check_destination(destination, inputs=model.files, in_place=in_place)
    replaced, left = replaced_companions(destination) if destination.is_file() else ([], [])
    with staged_output(destination) as stage:
        timed("write", lambda: write_model(model, changed, stage.path, metadata,
                                           companion_name=stage.companion_name, self_contained=self_contained))
        verified = timed("verify_written", lambda: verify(stage.path, str(destination)))
        stage.obsolete = replaced
        if in_place:
            check_unchanged(model.file_states)
        else:
            stage.keep = list(model.files)
    if warnings is not None:
        warnings += [f"'{describe(file)}', named as data by the replaced '{describe(destination)}', was left in "
                     "place: pathcond deletes only data files provably that model's own" for file in left]
    return verified


def _verify_written(model: LoadedModel, target: Path, input_shape, *, name: str | None = None,
                    compared: Callable[[Verification], None] | None = None) -> tuple[Verification, LoadedModel]:
    """Reload what was written (its architecture is embedded) and compare it with the original;
    returns the verification and the model read back. ``name`` is how the file is called in
    messages (default: ``target``); ``compared`` sees the comparison before it is judged."""
    name = name or str(target)
    try:
        written = formats.load_model(target, input_shape=input_shape, name=name, allow_unused=True)
    except PathcondError as exc:
        raise VerificationError(f"'{name}': the written model does not read back ({exc}); nothing was written.") from None
    # Held any longer, the written values would add to the run's peak: the loader's check read them.
    release_held(written.params)
    # Nor is its format state (an ONNX model's whole ModelProto, as large as its tensors) used
    # again: the comparison reads its graph and tensors, the independent runtime its file.
    written.payload = None
    verification = compare(model.graph, model.params, written.params, rescaled_graph=written.graph)
    if compared is not None:
        compared(verification)
    if not verification.passed:
        raise VerificationError(
            f"'{name}': the written model differs from the original by a relative "
            f"{verification.max_rel_error:.3g} (tolerance {verification.tolerance:.1g}); nothing was written."
        )
    verification.independent = independent_check(model, target, verification.tolerance)
    if verification.independent["status"] == "failed":
        raise VerificationError(
            f"'{name}': the check by {verification.independent['runtime']} failed: "
            f"{verification.independent['detail']}; nothing was written."
        )
    return verification, written
