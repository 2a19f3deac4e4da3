"""diag(G), the path count and the ℓq path norms (SPEC §3, §8), each from passes of the "squared network".

The squared network of power q replaces every parameter θ by ψ = |θ|^q, every fixed edge
constant c by |c|^q, every ReLU by the identity and every max-pool by a sum over its window,
and feeds ones. Its summed output is ‖Φ(θ)‖_q^q; for q = 2 that is L, and ∂L/∂ψ = diag(G);
with ψ = 1 and q = 0 it counts paths.

Overflow: deep networks with extreme weights overflow a naive float64 pass, so diag(G) is
computed on a balanced copy Dθ (each layer's incoming squared norm set to 1, an admissible
rescaling) and mapped back in the log domain: log g(θ) = log g(Dθ) + 2(B u_D). The path
count renormalises activations as it goes and keeps the scale in a log offset.

How log g is kept (dense, :class:`OuterLog`, :class:`GradientLog`) is :mod:`.log_g`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from .graph import Graph, Input, Node, Scale
from .groups import DagParam, RescalingGroups, blocks
from .log_g import (
    DiagG,
    GradientLog,
    LayerGradient,
    LogG,
    OuterLog,
    dense,
    mapped_back,
    zero_counts,
)
from .rules import LinearRule, per_channel, rule_for, vjp

EXACT_LIMIT = 2**53
# diag(G) keeps log g as a float64 tensor for every parameter while that takes at most this many
# bytes, a share of the memory bound's constant; beyond, each weight whose LayerGradient is
# smaller than its log g is kept as that, and its log g recomputed when a report reads it.
DENSE_LOG_G_BYTES = 2**28


@dataclass
class PathCount:
    log10: float
    exact: int | None


@dataclass(frozen=True)
class PathNorm:
    """‖Φ(θ)‖_q as log10 (always finite for a network with a non-zero path; −inf when Φ = 0)
    and as a float when it fits in float64 (None otherwise)."""

    q: float
    log10: float

    @property
    def value(self) -> float | None:
        try:
            value = 10.0**self.log10
        except OverflowError:
            return None
        return value if math.isfinite(value) and (value > 0 or self.log10 == -math.inf) else None

    @property
    def key(self) -> str:
        """The report's key: ``l`` and q's shortest decimal that reads back as the same float64
        (``l1``, ``l2``, ``l4``, ``l1.5``, ``l1.0000001``, ``l1e+308``), so distinct q never share one."""
        return "l" + norm_order_text(self.q)


def norm_order_text(q: float) -> str:
    """q as its shortest round-tripping decimal, without a trailing ``.0``: ``1``, ``1.5``, ``1e+308``."""
    text = repr(float(q))
    return text[:-2] if text.endswith(".0") else text


@dataclass
class ScaledTensor:
    """A non-negative tensor stored as ``value · exp(log_scale)`` so that any magnitude fits
    (``log_scale`` a 0-dim tensor on ``value``'s device where it was computed from it: reading
    it on the host would wait for the device once per tensor)."""

    value: torch.Tensor
    log_scale: float | torch.Tensor = 0.0


# A layer's (weight, bias) in the squared network; either may be absent (a bias alone has no weight).
LayerPsi = tuple[ScaledTensor | None, ScaledTensor | None]


@dataclass
class SquaredPass:
    """The squared network's activations: true value of node n is ``exp(offsets[n]) · values[n]``
    (each offset a 0-dim tensor on the pass's device, read on the host only by :meth:`total`)."""

    values: dict[str, torch.Tensor]
    offsets: dict[str, torch.Tensor]

    def total(self, graph: Graph) -> tuple[float, float]:
        """L = Σ outputs, as (mantissa, log offset): one read of the device."""
        mantissa, final = self.total_on_device(graph).tolist()
        return mantissa, final

    def total_on_device(self, graph: Graph) -> torch.Tensor:
        """:meth:`total` unread, ``[mantissa, log offset]`` on the pass's device."""
        final = largest([self.offsets[o] for o in graph.outputs])
        mantissa = sum(self.values[o].sum() * torch.exp(self.offsets[o] - final) for o in graph.outputs)
        return torch.stack([mantissa, final])


def largest(offsets: Sequence[torch.Tensor]) -> torch.Tensor:
    """The largest of some 0-dim tensors, on their device."""
    result = offsets[0]
    for offset in offsets[1:]:
        result = torch.maximum(result, offset)
    return result


def zero_offset(device) -> torch.Tensor:
    return torch.zeros((), dtype=torch.float64, device=device)


def renormalise(y: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Divide by the peak when it leaves [1e-100, 1e100], moving the factor into the log offset.

    Squared-network activations and cotangents are never negative, so the peak is the max. The
    choice is made on the device: otherwise the range is divided by 1 and the offset gains
    ln 1, both exact, so that no node's pass waits for the host. On the CPU, where reading the
    peak waits for nothing, a contiguous ``y`` whose peak is in range is returned with ``offset``
    as they are instead of that exact copy (a pass over every activation: 15 % of ResNet-50's
    diag(G) and path count). A view is still copied: kept as a node's value, it would keep the
    whole tensor it views after the sweep lets that go.
    """
    if not y.numel():
        return y, offset
    peak = y.amax().to(torch.float64)
    if y.device.type == "cpu" and y.is_contiguous():
        top = float(peak)
        if top == 0 or 1e-100 < top < 1e100:
            return y, offset
    factor = torch.where((peak > 0) & ((peak <= 1e-100) | (peak >= 1e100)), peak, torch.ones_like(peak))
    return y / factor.to(y.dtype), offset + torch.log(factor)


def rescaled_by(tensor: torch.Tensor, log_factor: torch.Tensor) -> torch.Tensor:
    return tensor * torch.exp(log_factor).to(tensor.dtype)


def squared_network(
    graph: Graph,
    layers: Mapping[str, LayerPsi],
    *,
    power: float,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str = "cpu",
    totals_only: bool = False,
    inputs: Mapping[str, torch.Tensor] | None = None,
) -> SquaredPass:
    """Forward pass of the squared network on all-ones inputs, with a log offset per node.

    ``layers`` maps each Linear/Conv (and standalone BatchNorm) node to its ψ weight and bias
    in torch's layout, each with its own log scale; so neither a huge global scale nor a huge
    path count overflows. A layer without weight (a bias alone) passes its input on through
    fixed edges of weight 1. ``totals_only``, ``inputs``: as :func:`squared_networks`.
    """
    return squared_networks(
        graph, _OnePower(layers), powers=(power,), dtype=dtype, device=device, totals_only=totals_only, inputs=inputs
    )[0]


def squared_networks(
    graph: Graph,
    layers: Mapping[str, Iterable[LayerPsi]],
    *,
    powers: Sequence[float],
    dtype: torch.dtype = torch.float64,
    device: torch.device | str = "cpu",
    totals_only: bool = False,
    inputs: Mapping[str, torch.Tensor] | None = None,
) -> list[SquaredPass]:
    """:func:`squared_network` for each of ``powers`` in one sweep: ``layers`` gives each layer's
    ψ weight and bias for each power in turn (:class:`PowerLayerValues` builds them from one read
    of the layer's values). With ``totals_only`` each activation another node reads is let go
    after its last read: a pass keeps the outputs (all :meth:`SquaredPass.total` reads), and
    the values of inputs nothing reads. ``inputs``: a batch of non-negative values per input
    instead of one all-ones example (with power 1, the |θ| network on |x|)."""
    passes = [SquaredPass({}, {}) for _ in powers]
    with torch.no_grad():
        for node in graph.sweep(*(sweep.values for sweep in passes if totals_only)):
            rule = rule_for(node)
            per_power = iter(layers[node.name]) if node.name in layers else None
            for power, sweep in zip(powers, passes):
                values, offsets = sweep.values, sweep.offsets
                if isinstance(node, Input):
                    y = (
                        torch.ones((1, *node.shape), dtype=dtype, device=device)
                        if inputs is None
                        else inputs[node.name].to(device, dtype)
                    )
                    offset = zero_offset(device)
                elif per_power is not None:
                    weight, bias = next(per_power)
                    x = values[node.inputs[0]]
                    weighted_scale = offsets[node.inputs[0]] + (0.0 if weight is None else weight.log_scale)
                    y = x if weight is None else rule.weighted(node, x, weight.value)
                    offset = weighted_scale
                    if bias is not None:
                        offset = torch.maximum(
                            weighted_scale,
                            torch.as_tensor(bias.log_scale, dtype=torch.float64, device=weighted_scale.device),
                        )
                        y = rescaled_by(y, weighted_scale - offset) + rescaled_by(
                            per_channel(bias.value, y), bias.log_scale - offset
                        )
                    # ψ is layer-sized: released before the next is built, not when it is assigned.
                    del weight, bias
                else:
                    y, offset = parameter_free_step(node, values, offsets, power)
                values[node.name], offsets[node.name] = renormalise(y, offset)
            del per_power
    return passes


class _OnePower(Mapping[str, tuple[LayerPsi]]):
    """Layers of one squared network as :func:`squared_networks` takes them."""

    def __init__(self, layers: Mapping[str, LayerPsi]):
        self._layers = layers

    def __getitem__(self, layer: str) -> tuple[LayerPsi]:
        return (self._layers[layer],)

    def __contains__(self, layer: object) -> bool:
        return layer in self._layers

    def __iter__(self):
        return iter(self._layers)

    def __len__(self) -> int:
        return len(self._layers)


def parameter_free_step(
    node: Node, values: Mapping[str, torch.Tensor], offsets: Mapping[str, torch.Tensor], power: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A node without DAG parameters in the squared network of ``power``, on its inputs'
    ``values`` with their log ``offsets``: its output and the output's offset."""
    unit, log_gain = unit_gain(node)
    offset = largest([offsets[i] for i in node.inputs])
    inputs = (
        [values[node.inputs[0]]]
        if len(node.inputs) == 1
        else [rescaled_by(values[i], offsets[i] - offset) for i in node.inputs]
    )
    y = rule_for(node).squared(unit, inputs, power)
    return y, offset + power * log_gain


def unit_gain(node: Node) -> tuple[Node, float]:
    """``node`` with a constant factor c ≠ 0 replaced by 1, and ln|c|: the factor enters as |c|^q
    (a path's weight in every norm is the absolute product), and its power is carried in the log
    offset, where c = 1e200 does not overflow as c² does."""
    if isinstance(node, Scale) and node.factor != 0:
        return dataclasses.replace(node, factor=1.0), math.log(abs(node.factor))
    return node, 0.0


def log_gradients(
    graph: Graph,
    layers: Mapping[str, LayerPsi],
    forward: SquaredPass,
    *,
    power: float = 2,
    times_value: bool = False,
    keep_small_gradients: bool = False,
) -> dict[str, tuple[LogG | LayerGradient, torch.Tensor | None]]:
    """log ∂L/∂ψ for every layer's weight and bias, by a backward sweep with its own log offsets;
    with ``times_value``, log ψ·∂L/∂ψ instead (each parameter's share of L: for power 1, its
    path-magnitude score), from the ψ the sweep builds anyway, as a tensor. With
    ``keep_small_gradients``, a weight whose :class:`LayerGradient` is smaller than its log is
    given as that, its gradient not computed.

    Each node's vector–Jacobian product is taken locally on normalised values, and the scale
    of the cotangent is carried as a log offset, so gradients far below (or above) the rest
    of the network stay representable: no chain of tiny factors ever multiplies out.

    The sweep consumes ``forward``: each activation is let go once it has been read for the
    last time, so that afterwards ``forward`` holds the outputs (all its total reads) and the
    values of inputs nothing reads.
    """
    cotangents: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {
        o: [(torch.ones_like(forward.values[o]), zero_offset(forward.values[o].device))] for o in graph.outputs
    }
    result: dict[str, tuple[LogG | LayerGradient | None, torch.Tensor | None]] = {}
    for node in graph.sweep(forward.values, backward=True):
        if isinstance(node, Input) or node.name not in cotangents:
            continue
        incoming = cotangents.pop(node.name)
        sigma = largest([offset for _, offset in incoming])
        if len(incoming) == 1:
            cotangent = incoming[0][0]
        else:
            cotangent = rescaled_by(incoming[0][0], incoming[0][1] - sigma)
            for tensor, offset in incoming[1:]:
                cotangent = cotangent + rescaled_by(tensor, offset - sigma)
        cotangent, sigma = renormalise(cotangent, sigma)

        def send(name: str, tensor: torch.Tensor, offset: torch.Tensor) -> None:
            cotangents.setdefault(name, []).append(renormalise(tensor, offset))

        rule = rule_for(node)
        if node.name in layers:
            weight, bias = layers[node.name]
            source = node.inputs[0]
            x = forward.values[source]
            log_weight: LogG | LayerGradient | None = None
            if weight is None:
                grad_x = cotangent
            elif isinstance(rule, LinearRule) and x.numel() == weight.value.shape[1]:
                # One input vector: ∂L/∂ψ = δ xᵀ, kept as its two factors, never built.
                grad_x, _ = rule.weighted_vjp(node, x, weight.value, cotangent, weight_grad=False)
                log_weight = OuterLog(
                    torch.log(cotangent.reshape(-1)) + sigma, torch.log(x.reshape(-1)) + forward.offsets[source]
                )
            elif (
                keep_small_gradients
                and (
                    gradient := LayerGradient(
                        node, x, cotangent, sigma + forward.offsets[source], tuple(weight.value.shape)
                    )
                ).is_smaller_than_its_log()
            ):
                grad_x, _ = rule.weighted_vjp(node, x, weight.value, cotangent, weight_grad=False)
                log_weight = gradient
            else:
                grad_x, grad_w = rule.weighted_vjp(node, x, weight.value, cotangent)
                log_weight = torch.log_(grad_w).add_(sigma + forward.offsets[source])
            send(source, grad_x, sigma + (0.0 if weight is None else weight.log_scale))
            log_bias = None
            if bias is not None:
                log_bias = torch.log(cotangent.sum(dim=[0, *range(2, cotangent.dim())]).clamp_min(0)) + sigma
            if times_value:
                log_weight = None if weight is None else _times(dense(log_weight).reshape(weight.value.shape), weight)
                log_bias = None if bias is None else _times(log_bias, bias)
            result[node.name] = (log_weight, log_bias)
            del weight, bias
        else:
            # Parameter-free nodes are linear in each input, so the point of the VJP is immaterial.
            unit, log_gain = unit_gain(node)
            grads = vjp(
                lambda *xs: rule.squared(unit, list(xs), power), [forward.values[i] for i in node.inputs], cotangent
            )
            for source, grad in zip(node.inputs, grads):
                send(source, grad, sigma + power * log_gain)
    return result


def _times(log_gradient: torch.Tensor, value: ScaledTensor) -> torch.Tensor:
    """log(ψ · ∂L/∂ψ) from log ∂L/∂ψ and ψ (non-negative, as ``mantissa · e^scale``)."""
    return log_gradient.add_(torch.log(value.value.reshape(log_gradient.shape))).add_(value.log_scale)


def _layer_tensors(groups: RescalingGroups, tensors: list) -> dict[str, list]:
    by_layer: dict[str, list] = {}
    for dp, t in zip(groups.dag_params, tensors):
        by_layer.setdefault(dp.layer, []).append(t)
    return by_layer


class LayerValues(Mapping[str, LayerPsi]):
    """Each layer's (weight, bias) for the squared network, built from its DAG parameters on
    every access and never kept: the passes hold one layer's ψ at a time, not a float64 copy
    of the whole network (the forward and backward sweeps build the same numbers twice).
    With ``keep``, each is built once and kept, for a caller that holds a float64 value per
    parameter anyway (the pruning scores)."""

    def __init__(self, groups: RescalingGroups, make: Callable[[DagParam], ScaledTensor], *, keep: bool = False):
        self._tensors = _layer_tensors(groups, groups.dag_params)
        self._make = make
        self._kept: dict[str, LayerPsi] | None = {} if keep else None

    def __getitem__(self, layer: str) -> LayerPsi:
        if self._kept is not None and layer in self._kept:
            return self._kept[layer]
        weights = [self._make(dp) for dp in self._tensors[layer] if not dp.is_bias] or [None]
        biases = [self._make(dp) for dp in self._tensors[layer] if dp.is_bias] or [None]
        values = weights[0], biases[0]
        if self._kept is not None:
            self._kept[layer] = values
        return values

    def __contains__(self, layer: object) -> bool:
        # Mapping's default would build the layer's values to answer.
        return layer in self._tensors

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


class PowerLayerValues(Mapping[str, Iterator[LayerPsi]]):
    """Each layer's (weight, bias) for the squared networks of several ``powers``, in turn
    (:func:`squared_networks`): ψ = |Dθ|^q for each q from one balanced copy Dθ (one read of
    the layer's values, ``u_ext`` the balancing), each ψ built when its pass reaches it. ψ for
    q = 1 and the last ψ are built in the copy's own memory (|Dθ| raised to q has the bits of Dθ
    raised to q), so ℓ1 and ℓ2 together hold one float64 copy of a layer, as one power does,
    and more powers at most two."""

    def __init__(self, groups: RescalingGroups, u_ext: torch.Tensor, device, powers: Sequence[float]):
        self._signed = LayerValues(groups, lambda dp: balanced_value(dp, u_ext, device))
        self._powers = powers

    def __getitem__(self, layer: str) -> Iterator[LayerPsi]:
        weight, bias = self._signed[layer]
        for number, power in enumerate(self._powers):
            in_place = power == 1 or number == len(self._powers) - 1
            yield tuple(
                None if signed is None else psi_of(signed, power, in_place=in_place) for signed in (weight, bias)
            )

    def __contains__(self, layer: object) -> bool:
        return layer in self._signed

    def __iter__(self):
        return iter(self._signed)

    def __len__(self) -> int:
        return len(self._signed)


def unit_values(dp: DagParam, device) -> ScaledTensor:
    return ScaledTensor(torch.ones(dp.shape, dtype=torch.float64, device=device))


def balancing_exponents(groups: RescalingGroups, order: float = 2.0) -> torch.Tensor:
    """An admissible rescaling u_D that gives each free group's incoming parameters unit ℓ_order
    norm (squared norm by default; a path norm of order q ≫ 2 runs on its own, so that the largest
    entry of each row is near 1 and its q-th power does not underflow).

    Computed layer by layer in topological order; each output row is divided by its largest
    entry before the power and the scales are kept as logarithms, so it is finite for any
    finite weights. A group fed by several layers (a residual stream) takes the first whose
    row is not zero.

    Only parameters on a path count: a weight that leaves a dead group (no non-zero weight
    from a live group and no bias reaches it, e.g. after a BatchNorm with γ = 0 and β = 0) and
    an all-zero row are left out, and a dead group keeps u = 0. So u_D(D_v θ) = u_D(θ) − v on
    every live group for any rescaling v, dead groups included: the balanced copy is the same
    for a network and any rescaling of it wherever a path runs, and dead groups carry no path.
    """
    H = groups.num_free
    u = torch.zeros(H + 1, dtype=torch.float64, device=groups.device)
    assigned = torch.zeros(H + 1, dtype=torch.bool, device=groups.device)
    assigned[H] = True
    live = assigned.clone()
    for dps in _layer_tensors(groups, groups.dag_params).values():
        weight_dp, *bias_dps = dps
        if weight_dp.is_bias:
            continue  # a bias alone: its channels are its input's, balanced where they were made
        source = (-order * u[weight_dp.src]).masked_fill_(~live[weight_dp.src], -math.inf)
        stored = weight_dp.value.reshape(weight_dp.view)
        conv_groups, rows_per_group, in_per_group, kernel = weight_dp.view
        per_out = torch.cat(
            [
                _log_row_norms(stored[:, rows], source, order)
                for rows in blocks(rows_per_group, conv_groups * in_per_group * kernel)
            ],
            dim=1,
        )
        per_out = per_out.reshape(-1)
        for bias_dp in bias_dps:
            per_out = torch.logaddexp(per_out, order * torch.log(bias_dp.value.to(torch.float64).abs()))
        dst = weight_dp.dst.reshape(-1)
        row_live = torch.isfinite(per_out)
        # Masks, not boolean indexing: selecting the rows would read their number on the host.
        live |= torch.zeros_like(u).index_add_(0, dst, row_live.to(u.dtype)) > 0
        fresh = ~assigned[dst] & row_live
        # Each unassigned group a fresh row reaches takes the least of their targets (rows that
        # are not fresh offer +inf, which no target is: a live row's is finite).
        least = torch.full_like(u, math.inf).scatter_reduce_(
            0, dst, torch.where(fresh, -per_out / order, math.inf), reduce="amin"
        )
        newly = least < math.inf
        u = torch.where(newly, least, u)
        assigned |= newly
    return u[:H]


def _log_row_norms(w4: torch.Tensor, source: torch.Tensor, order: float) -> torch.Tensor:
    """ln Σ_{i,k} |w_oik|^order e^{s_i} per row o of a ``[G, rows, I/G, K]`` block (``source``:
    s, ``[G, I/G]``, −inf for a source left out). Order 2: each row divided by its largest entry
    before squaring, one matrix product; other orders: a log-sum-exp per row, where |w|^q for a
    large q, even divided by the row's largest, would underflow."""
    w4 = w4.to(torch.float64).abs()
    if order != 2:
        return torch.logsumexp(w4.log_().mul_(order).add_(source[:, None, :, None]).flatten(2), dim=2)
    source_max = source.amax(dim=1, keepdim=True).nan_to_num_(neginf=0.0)
    source_scale = torch.exp(source - source_max)[:, :, None]
    row_max = w4.amax(dim=(2, 3), keepdim=True)
    squares = w4.div_(row_max.clamp_min(torch.finfo(torch.float64).tiny)).square_().sum(3)
    return torch.log(torch.bmm(squares, source_scale).squeeze(2)) + 2 * torch.log(row_max[:, :, 0, 0]) + source_max


def balanced_value(dp: DagParam, u_ext: torch.Tensor, device) -> ScaledTensor:
    """Dθ for one tensor (D the rescaling ``u_ext``), signed, with its scale as a logarithm.

    (Dθ)_{oi} = θ_{oi} · e^{a_o} · e^{b_i} with a = u_dst, b = −u_src: each factor is divided
    by its maximum, so the mantissa is at most 1 in magnitude and no intermediate overflows.
    An all-zero value stays zero, with scale 0; the scale stays on the device.
    """
    # A copy even of a float64 value (it may be a view of the mapped checkpoint), scaled in place.
    value = dp.value.to(device, torch.float64, copy=True).reshape(dp.view)
    if not value.numel():
        return ScaledTensor(value.reshape(dp.shape))
    a, b = u_ext[dp.dst], -u_ext[dp.src]
    a_max, b_max = a.amax(), b.amax()
    low, high = value.aminmax()
    peak = torch.maximum(-low, high)
    nonzero = peak != 0.0
    value.mul_((torch.exp(a - a_max) / torch.where(nonzero, peak, 1.0))[:, :, None, None])
    # All zeros: +0 whatever their signs, as a fresh zero tensor is (x + 0 turns −0 into +0;
    # x + (−0) is x, every sign kept, for any other tensor).
    value.mul_(torch.exp(b - b_max)[:, None, :, None]).add_(torch.where(nonzero, -0.0, 0.0))
    return ScaledTensor(value.reshape(dp.shape), torch.where(nonzero, torch.log(peak) + a_max + b_max, 0.0))


def balanced_power(dp: DagParam, u_ext: torch.Tensor, device, power: float) -> ScaledTensor:
    """ψ = |Dθ|^power for one tensor, its scale as a logarithm (mantissa at most 1)."""
    return psi_of(balanced_value(dp, u_ext, device), power, in_place=True)


def psi_of(signed: ScaledTensor, power: float, *, in_place: bool = False) -> ScaledTensor:
    """ψ = |v|^power of a signed value, its scale as a logarithm; in ``signed``'s memory with ``in_place``.

    For a power other than 1, |v| is divided by its largest entry first, so that the largest ψ
    is 1 whatever the power: a largest entry below 1 raised to q = 1000 would underflow the whole
    tensor to 0. (ψ for power 1 is |v| itself, and may share ``signed``'s memory while other
    powers are still to be built from it.)
    """
    value = signed.value if in_place else signed.value.clone()
    magnitude = value.abs_()
    log_scale = signed.log_scale
    if power != 1 and magnitude.numel():
        # Divided by 1 when the peak is 0: exact, and decided on the device.
        peak = magnitude.amax()
        peak = torch.where(peak > 0, peak, 1.0)
        magnitude.div_(peak)
        log_scale = log_scale + torch.log(peak)
    psi = magnitude.square_() if power == 2 else magnitude.pow_(power)
    return ScaledTensor(psi, power * log_scale)


def diag_g(groups: RescalingGroups, *, device: torch.device | str = "cpu", u_ext: torch.Tensor | None = None) -> DiagG:
    """log diag(G) for every DAG parameter: one forward and one backward pass (SPEC §3).

    ψ = (Dθ)² is built per tensor with a log scale (D an admissible balancing: ``u_ext``,
    computed here when not given), and log g(θ) = log ∂L/∂Ψ(Dθ) + 2(B u_D) since g(Dθ) = g(θ) / d².
    """
    return diag_g_and_l2_norm(groups, device=device, u_ext=u_ext)[0]


def diag_g_and_l2_norm(
    groups: RescalingGroups, *, device: torch.device | str = "cpu", u_ext: torch.Tensor | None = None
) -> tuple[DiagG, PathNorm]:
    """:func:`diag_g` and ‖Φ(θ)‖₂: diag(G)'s forward pass is the squared network of power 2 on
    ψ = (Dθ)², whose total is ‖Φ‖₂² (SPEC §8), so one pass serves both."""
    groups = groups.to(device)
    if u_ext is None:
        u_ext = groups.extend(balancing_exponents(groups))
    log_g: list[LogG] = []
    gradients, total = _balanced_log_gradients(
        groups, u_ext, 2, device, keep_small_gradients=8 * groups.p > DENSE_LOG_G_BYTES
    )
    peaks, kept_as_gradients = [], {}
    for index, (dp, lg) in enumerate(gradients):
        log_dst, log_src = 2 * u_ext[dp.dst], 2 * u_ext[dp.src]
        if isinstance(lg, OuterLog):
            lg = OuterLog(*lg.shifted(log_dst.reshape(-1), -log_src.reshape(-1)))
            peaks += [t.amax() for t in (lg.rows, lg.cols) if t.numel()]
        elif isinstance(lg, LayerGradient):
            kept_as_gradients[index] = (lg, dp.view, log_dst, log_src)
        else:
            lg = mapped_back(lg.reshape(dp.view), log_dst, log_src).reshape(dp.shape)
            peaks += [lg.amax()] if lg.numel() else []
        log_g.append(lg)
    for index, lg in zip(kept_as_gradients, GradientLog.all_of(list(kept_as_gradients.values()))):
        log_g[index] = lg
        peaks.append(torch.tensor(lg.stats.high, dtype=torch.float64, device=device))
    # NaN and +inf both fail this comparison: one reduction checks every tensor, read with L.
    representable = (torch.stack(peaks) < math.inf).all() if peaks else torch.ones((), dtype=torch.bool)
    mantissa, offset, representable = torch.cat([total, representable.to(total).reshape(1)]).tolist()
    if not representable:
        raise ArithmeticError("diag(G) could not be represented even in the log domain")
    return DiagG(log_g), _norm_of_total(2.0, 2.0, mantissa, offset)


def _balanced_log_gradients(
    groups: RescalingGroups,
    u_ext: torch.Tensor,
    power: float,
    device,
    *,
    times_value: bool = False,
    keep_small_gradients: bool = False,
) -> tuple[list[tuple[DagParam, LogG | LayerGradient]], torch.Tensor]:
    """(dp, log ∂S/∂ψ) per DAG parameter, S = Σ_P Π ψ the squared network of ``power`` on the
    balanced ψ = |Dθ|^power, and S as [mantissa, ln offset] unread: one forward and one backward pass
    (log ψ·∂S/∂ψ with ``times_value``; ``keep_small_gradients`` as :func:`log_gradients`)."""
    # The scores (times_value) are a float64 value per parameter: keeping ψ for the backward
    # sweep at most doubles that, and saves building every layer's ψ twice.
    layers = LayerValues(groups, lambda dp: balanced_power(dp, u_ext, device, power), keep=times_value)
    forward = squared_network(groups.graph, layers, power=power, device=device)
    gradients = log_gradients(
        groups.graph, layers, forward, power=power, times_value=times_value, keep_small_gradients=keep_small_gradients
    )
    per_parameter = []
    for dp in groups.dag_params:
        weight_log, bias_log = gradients[dp.layer]
        per_parameter.append((dp, bias_log if dp.is_bias else weight_log))
    return per_parameter, forward.total_on_device(groups.graph)


def path_magnitude_scores(
    groups: RescalingGroups, *, device: torch.device | str = "cpu", u_ext: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """ln Δ_i per DAG parameter (shaped like it; −inf where Δ_i = 0): seed 004's path-magnitude
    score Δ_i = ‖Φ(θ)‖₁ − ‖Φ(θ with θ_i = 0)‖₁ (SPEC §8).

    ‖Φ‖₁ is linear in each |θ_i| (a parameter appears at most once on a path), so
    Δ_i = |θ_i| · ∂‖Φ‖₁/∂|θ_i|: every score from one backward pass of the ℓ1 network. Δ is
    rescaling-invariant, so the pass runs on the balanced copy Dθ (``u_ext``: the balancing,
    computed here when not given) and needs no mapping back.
    """
    groups = groups.to(device)
    if u_ext is None:
        u_ext = groups.extend(balancing_exponents(groups))
    return [lg.reshape(dp.shape) for dp, lg in _balanced_log_gradients(groups, u_ext, 1, device, times_value=True)[0]]


def path_sum(
    groups: RescalingGroups,
    power: float,
    make: Callable[[DagParam], ScaledTensor],
    *,
    device: torch.device | str = "cpu",
) -> tuple[float, float]:
    """Σ_P Π_{e∈P} ψ_e·|c_e|^power of the squared network of ``power`` whose layers are
    ``make(dp)``, as (mantissa, ln offset): ‖Φ‖_q^q with ψ = |θ|^q and power q; the path count
    with ψ = 1 and power 0 (then an exact integer mantissa while the offset is 0)."""
    return squared_network(groups.graph, LayerValues(groups, make), power=power, device=device, totals_only=True).total(
        groups.graph
    )


def path_count(groups: RescalingGroups, *, device: torch.device | str = "cpu") -> PathCount:
    """Number of paths (input or bias to output) as log10, and exactly when below 2**53."""
    groups = groups.to(device)
    mantissa, offset = path_sum(groups, 0, lambda dp: unit_values(dp, device), device=device)
    log10 = (math.log(mantissa) + offset) / math.log(10)
    exact = int(round(mantissa)) if offset == 0.0 and mantissa < EXACT_LIMIT else None
    return PathCount(log10, exact)


def path_norm(
    groups: RescalingGroups, q: float, *, device: torch.device | str = "cpu", u_ext: torch.Tensor | None = None
) -> PathNorm:
    """‖Φ(θ)‖_q (SPEC §8): one forward pass of the squared network of power q on ψ = |Dθ|^q."""
    return path_norms(groups, [q], device=device, u_ext=u_ext)[0]


def path_norms(
    groups: RescalingGroups,
    orders: Sequence[float],
    *,
    device: torch.device | str = "cpu",
    u_ext: torch.Tensor | None = None,
) -> list[PathNorm]:
    """‖Φ(θ)‖_q for each q of ``orders`` (SPEC §8): the forward passes of the squared networks of
    power q on ψ = |Dθ|^q, in one sweep that reads each tensor once for all of them.

    Φ is rescaling-invariant, so the passes run on the balanced copy Dθ (``u_ext``: the
    balancing, computed here when not given), whose values stay in range on deep networks.
    """
    for q in orders:
        if not q >= 1 or not math.isfinite(q):
            raise ValueError(f"a path norm needs a finite q ≥ 1, not {q}")
    groups = groups.to(device)
    if u_ext is None:
        u_ext = groups.extend(balancing_exponents(groups))
    powers = {q: min(q, LARGEST_COMPUTED_ORDER) for q in orders}
    shared = [q for q in orders if q <= 2]
    norms = {}
    if shared:
        passes = squared_networks(
            groups.graph,
            PowerLayerValues(groups, u_ext, device, shared),
            powers=shared,
            device=device,
            totals_only=True,
        )
        norms |= {q: _norm_of_total(q, q, *sweep.total(groups.graph)) for q, sweep in zip(shared, passes)}
    for q in orders:
        if q not in norms:
            # The ℓ2 balancing leaves rows whose largest entry is n^(−1/2) of their norm: to a power q ≫ 2
            # that underflows. The balancing of order q keeps each row's largest entry within n^(−1/q) of 1.
            power = powers[q]
            balanced = groups.extend(balancing_exponents(groups, power))
            (sweep,) = squared_networks(
                groups.graph,
                PowerLayerValues(groups, balanced, device, [power]),
                powers=[power],
                device=device,
                totals_only=True,
            )
            norms[q] = _norm_of_total(q, power, *sweep.total(groups.graph))
    return [norms[q] for q in orders]


# The largest order a pass runs at. ψ = |v|^q turns a relative rounding δ of a balanced value
# (δ ≈ (|u| + 4)·2^−53) into a factor e^{qδ}: harmless up to q = 10^12, while beyond some 10^16
# the entries that should be near 1 underflow. For q beyond it, ‖Φ‖_∞ ≤ ‖Φ‖_q ≤ ‖Φ‖_p ≤
# N^{1/p} ‖Φ‖_∞ (p = 10^12, N the path count): ‖Φ‖_p is within a relative ln(N)/10^12 of
# ‖Φ‖_q, below 1e-9 for any network of fewer than 10^400 paths.
LARGEST_COMPUTED_ORDER = 1e12


def _norm_of_total(q: float, power: float, mantissa: float, offset: float) -> PathNorm:
    """‖Φ‖_q from ‖Φ‖_p^p as (mantissa, ln offset), p = ``power`` (q, or the order that has q's norm)."""
    ln_total = math.log(mantissa) + offset if mantissa > 0 else -math.inf
    return PathNorm(float(q), ln_total / power / math.log(10))


def zeros_per_layer(
    groups: RescalingGroups, psi: Callable[[DagParam], torch.Tensor], *, device: torch.device | str = "cpu"
) -> dict[str, int]:
    """DAG parameters on no path whose other entries of ``psi`` are all non-zero, per layer
    (layers without any left out): one pass of the power-0 squared network on ``psi`` (one
    tensor per DAG parameter, ≥ 0, shaped like it), whose ∂N/∂ψ counts those paths.

    g_i is a sum of non-negative terms, one per path through i, so it is zero exactly when
    no path through i has every other weight non-zero: with ``psi`` = 1[θ ≠ 0] this counts
    diag(G)'s zeros, and with some entries set to 1, those that remain without them.
    """
    layers = LayerValues(groups, lambda dp: ScaledTensor(psi(dp)))
    counts = log_gradients(groups.graph, layers, squared_network(groups.graph, layers, power=0, device=device), power=0)
    parts = [(layer, log_g) for layer, logs in counts.items() for log_g in logs if log_g is not None]
    zeros: dict[str, int] = {}
    for (layer, _), missing in zip(parts, zero_counts([log_g for _, log_g in parts])):
        if missing:
            zeros[layer] = zeros.get(layer, 0) + missing
    return zeros


def unused_parameters(groups: RescalingGroups, *, device: torch.device | str = "cpu") -> dict[str, int]:
    """DAG parameters on no input-or-bias-to-output path at the graph's input shape, per layer.

    The number of paths through each parameter is ∂N/∂ψ of the path-count network; it is 0
    for conv taps that only ever see padding (or whose windows fall outside a small input).
    Such parameters have g = 0 whatever the weights, so diag(G) and the rescaling know nothing
    of them: the input shape should be the one the network is trained at.
    """
    return zeros_per_layer(groups, lambda dp: unit_values(dp, device).value, device=device)
