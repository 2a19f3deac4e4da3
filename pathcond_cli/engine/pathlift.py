"""Two parameter vectors of one ReLU DAG through the path-lifting (SPEC §8, seeds 002 and 004):
their signs, their ℓ1 path-metric (a lower and an upper bound, exact in the dominated case),
and the choice of weights to prune by path magnitude.

Everything runs on :class:`~.groups.RescalingGroups` (the DAG parameters, BatchNorm folded);
reading files and writing them is the API's job (:mod:`.toolkit`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .diag import (
    LayerValues,
    PathNorm,
    ScaledTensor,
    SquaredPass,
    balanced_power,
    balanced_value,
    balancing_exponents,
    largest,
    parameter_free_step,
    renormalise,
    squared_network,
)
from .graph import Graph, Input, LeakyReLU, PReLU, WeightedNode
from .groups import DagParam, RescalingGroups
from .rules import FOLD_ROUNDINGS, per_channel, rule_for, swap_group_axes


@dataclass(frozen=True)
class LayerSigns:
    """One DAG layer's parameters (weight and bias, BatchNorm folded) whose signs differ."""

    layer: str
    parameters: int
    flips: int


@dataclass(frozen=True)
class SignComparison:
    """Signs of two parameter vectors θ (``a``) and θ' (``b``), entry by entry.

    ``a_dominates``: |θ'_i| ≤ |θ_i| with θ_i θ'_i ≥ 0 for every i (θ' is θ pruned or rounded
    toward zero); ``b_dominates`` the reverse. Either makes the ℓ1 path-metric equal to
    |‖Φ(θ)‖₁ − ‖Φ(θ')‖₁| (004 Lemma 4.2).
    """

    layers: list[LayerSigns]
    a_dominates: bool
    b_dominates: bool

    @property
    def flips(self) -> int:
        return sum(layer.flips for layer in self.layers)


def compare_signs(groups_a: RescalingGroups, groups_b: RescalingGroups) -> SignComparison:
    """Sign flips (θ_i θ'_i < 0) per layer, and whether one vector dominates the other."""
    sizes: dict[str, int] = {}
    flips, dominance = [], []
    for dp_a, dp_b in zip(groups_a.dag_params, groups_b.dag_params):
        a = dp_a.value.to(torch.float64).reshape(-1)
        b = dp_b.value.to(torch.float64).reshape(-1).to(a.device)
        sizes[dp_a.layer] = sizes.get(dp_a.layer, 0) + a.numel()
        flips.append((a * b < 0).sum())
        same_side = a * b >= 0
        dominance.append(
            torch.stack([(same_side & (b.abs() <= a.abs())).all(), (same_side & (a.abs() <= b.abs())).all()])
        )
    # Every tensor's answers in one read of the device.
    read = torch.cat([torch.stack(flips), torch.stack(dominance).all(0).to(torch.long)]).tolist() if flips else [1, 1]
    per_layer_flips: dict[str, int] = dict.fromkeys(sizes, 0)
    for dp_a, count in zip(groups_a.dag_params, read[:-2]):
        per_layer_flips[dp_a.layer] += count
    layers = [LayerSigns(layer, parameters, per_layer_flips[layer]) for layer, parameters in sizes.items()]
    return SignComparison(layers, bool(read[-2]), bool(read[-1]))


@dataclass(frozen=True)
class PathMetric:
    """Bounds on the ℓ1 path-metric d = ‖Φ(θ) − Φ(θ')‖₁, as natural logarithms (−inf for 0).

    ``exact``: one vector dominates the other, and ``lower`` = ``upper`` = d. ``rounding``: ρ,
    a bound on the relative rounding error of the float64 pass that computed ``upper``
    (:func:`rounding_bound`); ``ln_bound`` = ln(upper · (1 + ρ)) is never below the true d or
    the true upper bound, whatever the rounding.
    """

    ln_lower: float
    ln_upper: float
    exact: bool
    rounding: float = 0.0

    @property
    def lower(self) -> float | None:
        return exp_or_none(self.ln_lower)

    @property
    def upper(self) -> float | None:
        return exp_or_none(self.ln_upper)

    @property
    def ln_bound(self) -> float:
        return self.ln_upper + math.log1p(self.rounding)


UNIT_ROUNDOFF = 2.0**-53


def rounding_bound(groups: RescalingGroups, ln_magnitude: float) -> float:
    """ρ = γ_K = K·u / (1 − K·u) (u = 2^−53): a bound on the relative rounding error of one
    float64 pass over non-negative values on ``groups``' graph (a squared network forward or
    backward, the telescoped sum; a forward of the |W| network with ``ln_magnitude`` 0).

    Every value such a pass forms is a sum of products of non-negative numbers, so nothing
    cancels and each rounding moves a term by a relative u at most: the result is within
    (1 ± u)^K of the truth, K the roundings that can reach one term (Higham, Lemma 3.1). K
    counts, at every node, one rounding per term summed into an entry (at most the entries its
    inputs hold, plus a bias, forward; at most the entries it holds, backward), eight for the
    product by a weight, the renormalisation and the exponentials of scale differences, and
    those of a folded BatchNorm's scale and of a difference taken before it (FOLD_ROUNDINGS);
    and the balancing's factors e^a, whose arguments carry an
    absolute error of about |a|·u, a relative one in the value: ``ln_magnitude`` bounds those
    logarithms (the balancing's |u|, the log scales and offsets), four of them per node.
    """
    shapes = groups.shapes
    nodes = groups.graph.nodes
    summed = sum(sum(math.prod(shapes[i]) for i in node.inputs) + math.prod(shapes[node.name]) + 1 for node in nodes)
    count = (summed + len(nodes) * (8 + FOLD_ROUNDINGS + 4 * ln_magnitude)) * UNIT_ROUNDOFF
    return count / (1 - count) if count < 0.5 else math.inf


def exp_or_none(ln: float) -> float | None:
    """exp(ln), or None beyond float64."""
    try:
        return math.exp(ln)
    except OverflowError:
        return None


def ln_difference(ln_x: float, ln_y: float) -> float:
    """ln |x − y| from ln x and ln y (x, y ≥ 0), without leaving the log domain."""
    high, low = max(ln_x, ln_y), min(ln_x, ln_y)
    if high == -math.inf or low == high:
        return -math.inf
    return high + math.log(-math.expm1(low - high))


def ln_add(ln_x: float, ln_y: float) -> float:
    """ln (x + y) from ln x and ln y (x, y ≥ 0)."""
    high, low = max(ln_x, ln_y), min(ln_x, ln_y)
    return high if low == -math.inf else high + math.log1p(math.exp(low - high))


def path_metric(
    groups_a: RescalingGroups,
    groups_b: RescalingGroups,
    l1_a: PathNorm,
    l1_b: PathNorm,
    signs: SignComparison,
    *,
    device: torch.device | str = "cpu",
    u_a: torch.Tensor | None = None,
    u_b: torch.Tensor | None = None,
) -> PathMetric:
    """The ℓ1 path-metric's bounds (SPEC §8).

    When one vector dominates the other, d is the telescoped sum (:func:`telescoped_sum`) on
    one balancing, the dominating vector's, for both: one D keeps |b_e| ≤ |a_e| with equal signs,
    so along each path |Π a_e| − |Π b_e| = Σ_k |b_1 … b_{k−1}| (|a_k| − |b_k|) |a_{k+1} … a_L| is
    a sum of non-negative terms and the pass returns d itself, each term from |θ − θ'| taken
    before any scaling (and before a BatchNorm's fold, when both fold the same statistics):
    nothing cancels (‖Φ(θ)‖₁ − ‖Φ(θ')‖₁ loses every digit once d is below 1e-13 of the norms),
    and ``lower`` = ``upper`` = d. Where two folds differ, their folded values' difference
    carries both folds' rounding (:meth:`~.rules.Fold.difference`): the sum is an upper bound
    only, and the lower one is the norms', as below.

    Otherwise ``lower`` = |‖Φ(θ)‖₁ − ‖Φ(θ')‖₁| less what rounding the two norms can have added,
    the folds' included (:func:`_ln_fold_error_mass`), and ``upper`` sums the telescoped bound
    |Π a_e − Π b_e| ≤ Σ_k |b_1 … b_{k−1}| |a_k − b_k| |a_{k+1} … a_L| over every path on the
    balanced representatives of each vector: the balancing depends only on the rescaling orbit,
    so the bound is rescaling-invariant, and 0 up to rounding for equivalent vectors. It is
    never reported below ``lower``. ``u_a``, ``u_b``: the balancings (extended), when the
    caller has them.
    """
    if signs.a_dominates or signs.b_dominates:
        larger, smaller, u_larger = (groups_a, groups_b, u_a) if signs.a_dominates else (groups_b, groups_a, u_b)
        if u_larger is None:
            u_larger = larger.extend(balancing_exponents(larger.to(device)))
        ln_d, rounding, exact = _telescoped(larger, smaller, device=device, u_a=u_larger, u_b=u_larger)
        if exact:
            return PathMetric(ln_d, ln_d, True, rounding)
        # Each allowance taken off instead: where no difference goes below 0, every term still
        # is one, dominance holds in exact arithmetic as well, and the sum is at most d.
        ln_least, _, _ = _telescoped(larger, smaller, device=device, u_a=u_larger, u_b=u_larger, allowance_sign=-1)
        if ln_least is not None:
            ln_least += math.log1p(-rounding) if rounding < 1 else -math.inf
            return PathMetric(ln_least, ln_d, ln_d - ln_least <= 2 * math.log1p(rounding), rounding)
        ln_upper = ln_d
    else:
        ln_upper, rounding, _ = _telescoped(groups_a, groups_b, device=device, u_a=u_a, u_b=u_b)
    # The B stream is the ℓ1 pass of θ', so its rounding bound serves the two norms as well.
    (ln_high, high_groups, u_high), (ln_low, low_groups, u_low) = sorted(
        ((norm.log10 * math.log(10), groups, u) for norm, groups, u in ((l1_a, groups_a, u_a), (l1_b, groups_b, u_b))),
        key=lambda entry: entry[0],
        reverse=True,
    )
    high = ln_high + (math.log1p(-rounding) if rounding < 1 else -math.inf)
    high_error = _ln_fold_error_mass(high_groups, u_high, device) + 2 * math.log1p(rounding)
    high = ln_difference(high, high_error) if high > high_error else -math.inf
    low = ln_add(
        ln_low + math.log1p(rounding), _ln_fold_error_mass(low_groups, u_low, device) + 2 * math.log1p(rounding)
    )
    lower = ln_difference(high, low) if high > low else -math.inf
    return PathMetric(lower, max(lower, ln_upper), False, rounding)


def _ln_fold_error_mass(groups: RescalingGroups, u_ext: torch.Tensor | None, device) -> float:
    """ln of what the folded BatchNorm shifts' rounding can move ‖Φ‖₁ by: Σ_v err_v · (the ℓ1
    norm of the paths leaving v), the ℓ1 network with every input 0 and each bias its fold's
    error bound (:attr:`~.rules.Fold.error`; 0 unfolded). A folded weight is within a relative
    rounding of its fold, which :func:`rounding_bound` counts."""
    if not any(dp.fold is not None and dp.is_bias for dp in groups.dag_params):
        return -math.inf
    groups = groups.to(device)
    u_ext = groups.extend(balancing_exponents(groups)) if u_ext is None else u_ext

    def layer_value(dp: DagParam) -> ScaledTensor:
        if not dp.is_bias:
            return balanced_power(dp, u_ext, device, 1)
        error = dp.fold().error if dp.fold is not None else torch.zeros(dp.shape, dtype=torch.float64)
        return balanced_value(dataclasses.replace(dp, source=error.to(device)), u_ext, device)

    zeros = {
        node.name: torch.zeros((1, *node.shape), dtype=torch.float64, device=device) for node in groups.graph.inputs
    }
    sweep = squared_network(groups.graph, LayerValues(groups, layer_value), power=1, device=device, inputs=zeros)
    total, ln_offset = sweep.total(groups.graph)
    return math.log(total) + ln_offset if total > 0 else -math.inf


def telescoped_sum(
    groups_a: RescalingGroups,
    groups_b: RescalingGroups,
    *,
    device: torch.device | str = "cpu",
    u_a: torch.Tensor | None = None,
    u_b: torch.Tensor | None = None,
) -> tuple[float, float]:
    """ln Σ_P Σ_k |b_1 … b_{k−1}| |a_k − b_k| |a_{k+1} … a_L| over every path P, on balanced
    representatives a = D_a θ, b = D_b θ' (an upper bound on ‖Φ(θ) − Φ(θ')‖₁, and d itself when
    θ dominates θ', ``u_b`` is ``u_a`` and no BatchNorm folds differ), and ρ, the pass's
    :func:`rounding_bound`.

    Stream B(v) = Σ_u |b_uv| B(u) + |b_v| is the ℓ1 network of b; stream
    T(v) = Σ_u (|a_uv| T(u) + |a_uv − b_uv| B(u)) + |a_v − b_v| carries the telescoped sums.
    Fixed edges (pooling, skips, constants) are the same in both vectors, so they enter T as
    they enter B. Both streams keep a log offset per node, as the squared network does.
    With one balancing for both, |a − b| is D|θ − θ'|, the difference taken on the stored
    values, where it is exact for a pruned or a kept weight; with two, the difference of the
    two balanced copies, plus what their rounding can have hidden. ``u_a``, ``u_b``: the two
    balancings (extended), computed here when not given.
    """
    ln_sum, rounding, _ = _telescoped(groups_a, groups_b, device=device, u_a=u_a, u_b=u_b)
    return ln_sum, rounding


def _telescoped(
    groups_a: RescalingGroups,
    groups_b: RescalingGroups,
    *,
    device: torch.device | str,
    u_a: torch.Tensor | None,
    u_b: torch.Tensor | None,
    allowance_sign: int = 1,
) -> tuple[float | None, float, bool]:
    """:func:`telescoped_sum`, and whether every |a − b| is the exact difference within a
    relative rounding (one balancing, no folds whose difference needs an allowance:
    :meth:`~.rules.Fold.difference`). With one balancing and ``allowance_sign`` −1 the folds'
    allowances are taken off the differences instead of added: the sum is None where that
    leaves a difference below 0."""
    groups_a, groups_b = groups_a.to(device), groups_b.to(device)
    u_a = groups_a.extend(balancing_exponents(groups_a)) if u_a is None else u_a
    u_b = groups_b.extend(balancing_exponents(groups_b)) if u_b is None else u_b
    one_balancing = u_b is u_a
    graph = groups_a.graph
    layers_b = LayerValues(groups_b, lambda dp: balanced_power(dp, u_b, device, 1))
    stream_b = squared_network(graph, layers_b, power=1, device=device)
    pairs = {dp.layer: [] for dp in groups_a.dag_params}
    for dp_a, dp_b in zip(groups_a.dag_params, groups_b.dag_params):
        pairs[dp_a.layer].append((dp_a, dp_b))
    values: dict[str, torch.Tensor] = {}
    offsets: dict[str, torch.Tensor] = {}
    # Kept on the device, and read once at the end, as everything the sweep decides.
    ln_magnitude = 1 + torch.maximum(u_a.abs().amax(), u_b.abs().amax())
    below_zero = torch.zeros((), dtype=torch.bool, device=u_a.device)
    exact = one_balancing
    with torch.no_grad():
        for node in graph.sweep(values):
            rule = rule_for(node)
            if isinstance(node, Input):
                y = torch.zeros((1, *node.shape), dtype=torch.float64, device=device)
                offset = y.new_zeros(())
            elif node.name in pairs:
                source = node.inputs[0]
                # A layer without weight passes T on through fixed edges, as the parameter-free nodes do.
                terms = [] if not pairs[node.name][0][0].is_bias else [(values[source], offsets[source])]
                for dp_a, dp_b in pairs[node.name]:
                    a = balanced_value(dp_a, u_a, device)
                    if one_balancing:
                        difference, exact_here, negative = _balanced_difference(dp_a, dp_b, u_a, device, allowance_sign)
                        below_zero |= negative
                        exact = exact and exact_here
                    else:
                        difference = _bounded_difference(
                            dp_a, dp_b, a, balanced_value(dp_b, u_b, device), (u_a, u_b), ln_magnitude, device
                        )
                    ln_magnitude = largest(
                        [
                            ln_magnitude,
                            _as_offset(a.log_scale, ln_magnitude).abs(),
                            _as_offset(difference.log_scale, ln_magnitude).abs(),
                        ]
                    )
                    if not dp_a.is_bias:
                        magnitude = ScaledTensor(a.value.abs_(), a.log_scale)
                        terms.append(
                            (
                                rule.weighted(node, values[source], magnitude.value),
                                offsets[source] + magnitude.log_scale,
                            )
                        )
                        terms.append(
                            (
                                rule.weighted(node, stream_b.values[source], difference.value),
                                stream_b.offsets[source] + difference.log_scale,
                            )
                        )
                    else:
                        terms.append((None, difference))
                y, offset = _combine(terms)
            else:
                y, offset = parameter_free_step(node, values, offsets, 1)
            values[node.name], offsets[node.name] = renormalise(y, offset)
            ln_magnitude = largest([ln_magnitude, offsets[node.name].abs(), stream_b.offsets[node.name].abs()])
    ln_magnitude, negative = torch.stack([ln_magnitude, below_zero.to(ln_magnitude.dtype)]).tolist()
    if negative:
        return None, rounding_bound(groups_a, ln_magnitude), False
    total, ln_offset = SquaredPass(values, offsets).total(graph)
    ln_sum = math.log(total) + ln_offset if total > 0 else -math.inf
    return ln_sum, rounding_bound(groups_a, ln_magnitude), exact


def _balanced_difference(
    dp_a: DagParam, dp_b: DagParam, u_ext: torch.Tensor, device, allowance_sign: int
) -> tuple[ScaledTensor, bool, torch.Tensor]:
    """D|θ − θ'| for one tensor: the difference of the stored values, then the balancing; with
    a BatchNorm folded in, the folds' :meth:`~.rules.Fold.difference` with its allowance added
    (``allowance_sign`` 1) or taken off (−1); whether there was none to make; and whether that
    left an entry below 0 (a 0-dim boolean on the device: the sum is then None)."""
    negative = torch.zeros((), dtype=torch.bool, device=u_ext.device)
    if dp_a.fold is None:
        gap, allowance = (dp_a.value.to(device, torch.float64) - dp_b.value.to(device, torch.float64)).abs_(), None
    else:
        gap, allowance = dp_a.fold().difference(dp_b.fold())
        if allowance is not None:
            gap = gap + allowance_sign * allowance
            negative = (gap < 0).any().to(u_ext.device)
    difference = balanced_value(dataclasses.replace(dp_a, source=gap.to(device)), u_ext, device)
    return difference, allowance is None, negative


def balancing_rounding(ln_magnitude: float | torch.Tensor) -> float | torch.Tensor:
    """A bound on the relative rounding of one entry of :func:`~.diag.balanced_value` brought to
    another scale (:func:`_at_common_scale`): the factors e^a, e^b, e^{log scale − scale} have
    arguments of magnitude at most 2·``ln_magnitude`` each (the balancing's |u| and the log
    scales), carrying an absolute error of u per unit and so a relative one in the value, and
    six roundings of their own (three exponentials, two products, the division by the peak)."""
    count = (16 + 8 * ln_magnitude) * UNIT_ROUNDOFF
    if isinstance(count, torch.Tensor):
        return torch.where(count < 0.5, count / (1 - count), math.inf)
    return count / (1 - count) if count < 0.5 else math.inf


def _bounded_difference(
    dp_a: DagParam,
    dp_b: DagParam,
    a: ScaledTensor,
    b: ScaledTensor,
    balancings: tuple[torch.Tensor, torch.Tensor],
    ln_magnitude: torch.Tensor,
    device,
) -> ScaledTensor:
    """A bound on |D_a θ − D_b θ'| for one tensor, from the balanced copies ``a``, ``b`` (signed):
    their difference may cancel to far below the rounding each copy carries, so each entry is
    |a − b| + δ (|a| + |b|) (δ: :func:`balancing_rounding`), plus each fold's error (a
    BatchNorm's, :attr:`~.rules.Fold.error`) under its balancing: a sum of non-negative terms."""
    terms = [a, b]
    for dp, u_ext in zip((dp_a, dp_b), balancings):
        if dp.fold is not None:
            terms.append(balanced_value(dataclasses.replace(dp, source=dp.fold().error.to(device)), u_ext, device))
    magnitude = largest([ln_magnitude, *(_as_offset(t.log_scale, ln_magnitude).abs() for t in terms)])
    (value_a, value_b, *errors), scale = _at_common_scale(terms)
    bound = (value_a - value_b).abs_() + balancing_rounding(magnitude) * (value_a.abs() + value_b.abs())
    return ScaledTensor(sum(errors, bound), scale)


def _as_offset(value: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(value, dtype=torch.float64, device=like.device)


def _common_scale(
    values: list[torch.Tensor],
    scales: list[float | torch.Tensor],
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Factors that bring ``values`` (each ``value · e^scale``) to the largest scale among those
    not all zero, 0 for a zero one, and that scale (0 when all are zero): a zero tensor's log
    scale means nothing, and letting it set the scale could flush the others to 0. Decided on
    the device: nothing is read on the host."""
    like = values[0]
    present = [value.any() for value in values]
    scales = [_as_offset(scale, like) for scale in scales]
    largest_present = largest([torch.where(any_, scale, -math.inf) for any_, scale in zip(present, scales)])
    scale = torch.where(largest_present > -math.inf, largest_present, 0.0)
    return [torch.where(any_, torch.exp(s - scale), 0.0) for any_, s in zip(present, scales)], scale


def _at_common_scale(tensors: list[ScaledTensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The tensors' values at the largest scale among those not all zero (:func:`_common_scale`)."""
    factors, scale = _common_scale([t.value for t in tensors], [t.log_scale for t in tensors])
    return [t.value * factor for t, factor in zip(tensors, factors)], scale


def _combine(terms: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ of (tensor, ln scale) terms (a bias term is ``(None, ScaledTensor)``, added per channel),
    at the largest scale among the terms that are not all zero (:func:`_common_scale`)."""
    dense = [(t, s) for t, s in terms if t is not None]
    biases = [b for t, b in terms if t is None]
    factors, offset = _common_scale(
        [t for t, _ in dense] + [b.value for b in biases], [s for _, s in dense] + [b.log_scale for b in biases]
    )
    y = sum(t * factor for (t, _), factor in zip(dense, factors))
    for bias, factor in zip(biases, factors[len(dense) :]):
        y = y + per_channel(bias.value, y) * factor
    return y, offset


# --------------------------------------------------------------------------- pruning


def prunable(graph: Graph, groups: RescalingGroups) -> list[tuple[int, DagParam]]:
    """(index, DAG weight) of every Linear, Conv and ConvTranspose layer: the weights pruning may
    zero. Biases, BatchNorm and per-channel affine layers are kept (normalisation, not weights)."""
    return [
        (index, dp)
        for index, dp in enumerate(groups.dag_params)
        if not dp.is_bias and isinstance(graph[dp.layer], WeightedNode)
    ]


def stored_weight_mask(graph: Graph, layer: str, canonical_mask: torch.Tensor) -> tuple[str, torch.Tensor]:
    """The checkpoint key of ``layer``'s weight and the mask laid out as that tensor is stored."""
    node = graph[layer]
    rule = rule_for(node)
    layout = rule.weight_layout(node)
    if layout == "weight_t":
        return node.weight, canonical_mask.t()
    if layout == "conv_transpose":
        return node.weight, swap_group_axes(canonical_mask, node.groups)
    return node.weight, canonical_mask


def magnitude_keys(graph: Graph, params: Mapping[str, torch.Tensor], layer: str) -> torch.Tensor:
    """|W| of ``layer``'s weight as stored in the checkpoint, in canonical layout (magnitude
    pruning ranks what the user holds, BatchNorm not folded in: it is not rescaling-invariant)."""
    node = graph[layer]
    return rule_for(node).canonical_weight(node, params[node.weight]).to(torch.float64).abs()


def select_pruned(
    keys: Sequence[torch.Tensor], zeros: Sequence[torch.Tensor], sparsity: float, *, per_layer: bool
) -> list[torch.Tensor]:
    """A boolean mask per tensor, True where the weight is zero after pruning: the ``sparsity``
    share of the entries (over all tensors, or in each with ``per_layer``), the entries already
    zero (``zeros``, True where the stored weight is 0) first, whatever their key, then the
    other entries with the smallest keys. So ``sparsity`` is the share of zeros afterwards, or
    the share already zero when that is larger. Ties go to the entry that comes first, tensor
    by tensor, so the choice is deterministic."""
    if not 0 <= sparsity <= 1:
        raise ValueError(f"sparsity {sparsity} is not a share between 0 and 1")
    if per_layer:
        return [select_pruned([key], [zero], sparsity, per_layer=False)[0] for key, zero in zip(keys, zeros)]
    flat = torch.cat([key.reshape(-1).to(torch.float64) for key in keys]) if keys else torch.zeros(0)
    kept = (
        torch.cat([~zero.reshape(-1).to(flat.device) for zero in zeros]) if zeros else torch.zeros(0, dtype=torch.bool)
    )
    chosen = ~kept
    count = round(sparsity * flat.numel()) - int(chosen.sum())
    if count > 0:
        candidates = kept.nonzero().reshape(-1)
        chosen[candidates[torch.sort(flat[candidates], stable=True).indices[:count]]] = True
    masks, start = [], 0
    for key in keys:
        masks.append(chosen[start : start + key.numel()].reshape(key.shape))
        start += key.numel()
    return masks


def non_relu_activations(graph: Graph) -> list[str]:
    """Nodes whose activation is not a ReLU, identity or max-pool (LeakyReLU, PReLU): seed
    004's Theorem 4.1 is proved for ReLU DAGs with max-pooling, and says nothing of them."""
    return [node.name for node in graph.nodes if isinstance(node, (LeakyReLU, PReLU))]
