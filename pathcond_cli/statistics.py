"""What the reports say of a diag(G): per-layer spreads, the conditioning measure D, the
histogram of log g, and the causes of its zeros. Each is reduced on the device diag(G) is on
and read to the host once."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .engine.diag import zeros_per_layer
from .engine.graph import BatchNorm, Graph
from .engine.groups import DagParam, RescalingGroups
from .engine.log_g import LogG, OuterLog, TensorStats, all_tensor_stats, dense

LOG10_E = 1 / math.log(10)
HISTOGRAM_BINS = 12


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
    return _conditioning(all_tensor_stats(log_g), [lg.numel() for lg in log_g])


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
    stats = all_tensor_stats(log_g)
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


def histogram(
    log_g: Sequence[LogG], ln_low: float | None, ln_high: float | None, bins: int = HISTOGRAM_BINS
) -> list[tuple[float, float, int]]:
    """Counts of g > 0 over ``bins`` equal-width bins of ln g spanning [ln_low, ln_high] (the
    exact extremes, so every g > 0 is counted), with the edges given as log10. The counts add
    up on the device of ``log_g`` and are read once."""
    return histograms([log_g], ln_low, ln_high, bins)[0]


def histograms(
    diags: Sequence[Sequence[LogG]], ln_low: float | None, ln_high: float | None, bins: int = HISTOGRAM_BINS
) -> list[list[tuple[float, float, int]]]:
    """:func:`histogram` of each diag(G) in ``diags`` over the same bins, read at once."""
    if ln_low is None or ln_high is None:
        return [[] for _ in diags]
    ln_high = ln_high if ln_high > ln_low else ln_low + 1.0
    rows: list[torch.Tensor | None] = []
    for log_g in diags:  # each log g read once: a rescaled one is computed on every read
        counts = None
        for lg in log_g:
            # histc leaves out values below its range: g = 0 (ln g = −inf) is not counted.
            if isinstance(lg, OuterLog):
                part = lg.histc(bins, ln_low, ln_high)
            else:
                part = torch.histc(dense(lg), bins=bins, min=ln_low, max=ln_high).long()
            counts = part if counts is None else counts + part
        rows.append(counts)
    counted = [counts for counts in rows if counts is not None]
    none = counted[0].new_zeros(bins) if counted else torch.zeros(bins, dtype=torch.long)
    width = (ln_high - ln_low) / bins
    edges = [((ln_low + i * width) * LOG10_E, (ln_low + (i + 1) * width) * LOG10_E) for i in range(bins)]
    read = torch.stack([none if counts is None else counts for counts in rows]).tolist() if rows else []
    return [[(low, high, count) for (low, high), count in zip(edges, row)] for row in read]


def joint_bounds(*summaries: DiagSummary) -> tuple[float | None, float | None]:
    """The natural-log range of g > 0 over several diag(G): one set of histogram bins for all."""
    ends = [v for summary in summaries for v in (summary.ln_low, summary.ln_high) if v is not None]
    return (min(ends), max(ends)) if ends else (None, None)


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
        shares = [
            (self.gamma, self.batchnorm.describe() if self.batchnorm else ""),
            (self.unused, "conv taps on no path at this input shape (they see only padding)"),
            (self.weights, "zero weights or dead units: every path through them has a zero weight"),
        ]
        return max(shares, key=lambda share: share[0])[1]


def zero_gammas(graph: Graph, params: Mapping[str, torch.Tensor], device: torch.device | str) -> list[ZeroGamma]:
    """The BatchNorms with γ = 0 on some channel, in network order (their masks on ``device``,
    their counts read once)."""
    batchnorms = [node for node in graph.nodes if isinstance(node, BatchNorm)]
    if not batchnorms:
        return []
    masks = [params[node.weight].reshape(-1).to(device) == 0 for node in batchnorms]
    zeroed = torch.stack([mask.sum() for mask in masks]).tolist()
    return [
        ZeroGamma(node.name, (graph.folded_into(node) or node).name, count, mask.numel(), mask)
        for node, mask, count in zip(batchnorms, masks, zeroed)
        if count
    ]


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


def zero_causes(
    groups: RescalingGroups, params: Mapping[str, torch.Tensor], summary: DiagSummary, unused: Mapping[str, int]
) -> list[ZeroCause]:
    """Per layer with g = 0 in ``summary``, in network order, how many and why (``unused``: the
    parameters on no path at this input shape, :func:`~pathcond_cli.engine.diag.unused_parameters`).
    Costs one path-count pass when some BatchNorm has γ = 0, none otherwise."""
    if not any(spread.zeros for spread in summary.layers):
        return []
    gammas = zero_gammas(groups.graph, params, groups.device)
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
    for spread in summary.layers:
        if spread.zeros:
            gamma = max(spread.zeros - remaining.get(spread.layer, 0), 0) if gammas else 0
            used = min(unused.get(spread.layer, 0), spread.zeros - gamma)
            causes.append(
                ZeroCause(
                    spread.layer,
                    spread.parameters,
                    spread.zeros,
                    used,
                    gamma,
                    _nearest(groups.graph, spread.layer, gammas),
                )
            )
    return causes
