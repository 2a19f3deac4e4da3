"""Analyse a loaded network: its rescaling groups, diag(G), path count and ℓq path norms, and,
when a report asks, the facts it states (the spread and zeros of diag(G), the histogram, the
unused parameters, the degenerate groups); and the check that a rescaled copy kept every
path norm.

    import pathcond_cli as pathcond
    analysis = pathcond.analyse(pathcond.load("model.onnx"))           # diag(G), paths, groups
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property

import torch

from .engine.diag import (
    PathCount,
    PathNorm,
    balancing_exponents,
    diag_g_and_l2_norm,
    norm_order_text,
    path_count,
    path_norms,
    unused_parameters,
)
from .engine.groups import RescalingGroups, build_groups, groups_with_values
from .engine.layouts import layout_of, release_held
from .engine.log_g import DiagG
from .engine.model import LoadedModel
from .errors import UsageError, VerificationError
from .runtime import Stopwatch, resolve_device
from .solve.objective import degenerate_mask
from .statistics import (
    HISTOGRAM_BINS,
    LOG10_E,
    Conditioning,
    DiagSummary,
    LayerSpread,
    ZeroCause,
    histogram,
    summarise,
    zero_causes,
)

# The ℓq path norms every analysis reports (SPEC §8); ``path_norms=`` adds others.
DEFAULT_PATH_NORMS = (1.0, 2.0)


@dataclass
class Analysis:
    """Everything ``inspect`` reports: counts, groups, path count and the diag(G) spread.

    The facts the report states (``summary``, ``unused_parameters``, ``zero_causes``,
    ``degenerate_groups``, ``bins``) are computed when first read, on the analysis's device,
    or all at once by :meth:`gather_report_facts` (the CLI times that as a stage)."""

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

    def histogram(self, bins: int = HISTOGRAM_BINS) -> list[tuple[float, float, int]]:
        """Counts of log10 g over equal-width bins (g = 0 excluded)."""
        return histogram(self.diag.parts, self.summary.ln_low, self.summary.ln_high, bins)

    @cached_property
    def bins(self) -> list[tuple[float, float, int]]:
        """The report's histogram: :meth:`histogram` over :data:`HISTOGRAM_BINS` bins."""
        return self.histogram()

    @property
    def conditioning(self) -> Conditioning:
        """D(θ) of the model as loaded."""
        return self.summary.conditioning

    @cached_property
    def unused_parameters(self) -> dict[str, int]:
        """DAG parameters on no path at the input shape, per layer: a forward and a backward
        pass, made only when diag(G) has zeros (a parameter on no path has g = 0)."""
        if not any(layer.zeros for layer in self.summary.layers):
            return {}
        return unused_parameters(self.groups, device=self.groups.device)

    @cached_property
    def zero_causes(self) -> list[ZeroCause]:
        """Per layer with g = 0, how many and their most likely cause."""
        return zero_causes(self.groups, self.model.params, self.summary, self.unused_parameters)

    @cached_property
    def degenerate_groups(self) -> int:
        """How many free groups have no path weight in or out (the solver freezes them)."""
        return int(degenerate_mask(self.groups, self.diag).sum())

    def gather_report_facts(self) -> None:
        """Compute, once, every fact the ``inspect`` report states."""
        for fact in ("zero_causes", "degenerate_groups", "bins"):
            getattr(self, fact)


def analyse(
    model: LoadedModel, *, device: str | torch.device = "auto", path_norms: Iterable[float] = DEFAULT_PATH_NORMS
) -> Analysis:
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


def path_norms_of(
    groups: RescalingGroups,
    orders: Iterable[float],
    *,
    device: str | torch.device = "cpu",
    u_ext: torch.Tensor | None = None,
    known: Iterable[PathNorm] = (),
) -> dict[str, PathNorm]:
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


def check_path_norms(
    analysis: Analysis,
    graph,
    params: Mapping[str, torch.Tensor],
    name: str,
    *,
    outcome: str = "Nothing was written.",
    rescaled_by: torch.Tensor | None = None,
) -> dict[str, PathNorm]:
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
    groups = groups_with_values(analysis.groups, graph, params)
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
                f"'{name}': the path norm ‖Φ‖_{norm_order_text(before.q)} changed by a relative {change:.3g} "
                f"(from 10^{before.log10:.9g} "
                f"to 10^{after[key].log10:.9g}), beyond the {tolerance:.2g} that rounding the stored tensors allows; "
                "a rescaling leaves every path norm unchanged, so the rescaled model is not a rescaling of the "
                f"original. {outcome}"
            )
    return after
