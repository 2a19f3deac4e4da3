"""diag(G) and the path count (SPEC §3), each from one pass of the "squared network".

The squared network replaces every parameter θ by ψ = θ², every fixed edge constant c by
c^power, every ReLU by the identity and every max-pool by a sum over its window, and feeds
ones. Its summed output is L = ‖Φ(θ)‖² (power 2) and ∂L/∂ψ = diag(G); with ψ = 1 and
power 0 it counts paths.

Overflow: deep networks with extreme weights overflow a naive float64 pass, so diag(G) is
computed on a balanced copy Dθ (each layer's incoming squared norm set to 1, an admissible
rescaling) and mapped back in the log domain: log g(θ) = log g(Dθ) + 2(B u_D). The path
count renormalises activations as it goes and keeps the scale in a log offset.

Memory: a Linear layer that sees one input vector has g_oi = δ_o x_i (δ its cotangent, x its
input in the squared network), an outer product; its log g is kept as the two factors
(:class:`OuterLog`), O + I numbers instead of O·I, so that an MLP's diag(G) and everything the
solvers keep from it are the size of its neurons, not of its weights.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from .graph import Graph, Input, Node, Scale
from .groups import DagParam, RescalingGroups, blocks
from .rules import LinearRule, per_channel, rule_for

EXACT_LIMIT = 2**53


@dataclass(frozen=True)
class OuterLog:
    """log g of a weight whose g is an outer product: ln g_oi = rows_o + cols_i (float64,
    −inf for g = 0), standing for the ``[O, I]`` tensor ``rows[:, None] + cols[None, :]``."""

    rows: torch.Tensor
    cols: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows.numel(), self.cols.numel())

    @property
    def device(self) -> torch.device:
        return self.rows.device

    def numel(self) -> int:
        return self.rows.numel() * self.cols.numel()

    def dense(self) -> torch.Tensor:
        """The ``[O, I]`` tensor itself (O·I float64 values: for small tensors and tests)."""
        return self.rows[:, None] + self.cols[None, :]

    def row_blocks(self):
        """The dense tensor, flattened, in consecutive blocks of whole rows of bounded size."""
        for rows in blocks(self.rows.numel(), self.cols.numel()):
            yield (self.rows[rows, None] + self.cols[None, :]).reshape(-1)

    def flat_entries(self, index: torch.Tensor) -> torch.Tensor:
        """Entries of the flattened dense tensor at ``index``."""
        width = self.cols.numel()
        return self.rows[torch.div(index, width, rounding_mode="floor")] + self.cols[index % width]

    def shifted(self, log_dst: torch.Tensor, log_src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The two factors of ln g_oi + log_dst_o + log_src_i, shaped like ``log_dst`` and ``log_src``."""
        return self.rows.reshape(log_dst.shape) + log_dst, self.cols.reshape(log_src.shape) + log_src

    def finite_counts(self) -> tuple[int, int]:
        """How many rows and how many columns have a finite log (g > 0 exactly on their product)."""
        return int(torch.isfinite(self.rows).sum()), int(torch.isfinite(self.cols).sum())

    def zeros(self) -> int:
        finite_rows, finite_cols = self.finite_counts()
        return self.numel() - finite_rows * finite_cols

    def to(self, device: torch.device | str) -> OuterLog:
        return OuterLog(self.rows.to(device), self.cols.to(device))


LogG = torch.Tensor | OuterLog


def dense(log_g: LogG) -> torch.Tensor:
    """A tensor's log g as a tensor, whichever way it is kept."""
    return log_g.dense() if isinstance(log_g, OuterLog) else log_g


def zero_count(log_g: LogG) -> int:
    """How many g = 0 in this tensor."""
    return log_g.zeros() if isinstance(log_g, OuterLog) else int(torch.isneginf(log_g).sum())


def has_nonzero(log_g: LogG) -> bool:
    """Whether some g > 0 in this tensor."""
    if isinstance(log_g, OuterLog):
        return min(log_g.finite_counts()) > 0
    return bool(torch.isfinite(log_g).any())


@dataclass
class DiagG:
    """log diag(G) per DAG parameter (−inf where g = 0), in float64, in the original θ's scale.

    ``parts`` keeps each as a tensor shaped like the parameter, or as an :class:`OuterLog` for
    a Linear layer's weight whose g is an outer product; pathcond's own passes read them so.
    ``log_g`` gives every one as a tensor, an outer product expanded when read.
    """

    parts: Sequence[LogG]

    @property
    def log_g(self) -> Sequence[torch.Tensor]:
        return _Expanded(self.parts)

    def any_nonzero(self) -> bool:
        return any(has_nonzero(lg) for lg in self.parts)


@dataclass
class PathCount:
    log10: float
    exact: int | None


@dataclass
class ScaledTensor:
    """A non-negative tensor stored as ``value · exp(log_scale)`` so that any magnitude fits."""

    value: torch.Tensor
    log_scale: float = 0.0


@dataclass
class SquaredPass:
    """The squared network's activations: true value of node n is ``exp(offsets[n]) · values[n]``."""

    values: dict[str, torch.Tensor]
    offsets: dict[str, float]

    def total(self, graph: Graph) -> tuple[float, float]:
        """L = Σ outputs, as (mantissa, log offset)."""
        final = max(self.offsets[o] for o in graph.outputs)
        mantissa = sum(float(self.values[o].sum()) * math.exp(self.offsets[o] - final) for o in graph.outputs)
        return mantissa, final


def _renormalise(y: torch.Tensor, offset: float) -> tuple[torch.Tensor, float]:
    """Divide by the peak when it leaves [1e-100, 1e100], moving the factor into the log offset.

    Squared-network activations and cotangents are never negative, so the peak is the max.
    """
    peak = float(y.max()) if y.numel() else 0.0
    if peak > 0 and not 1e-100 < peak < 1e100:
        return y / peak, offset + math.log(peak)
    return y, offset


def _rescaled(tensor: torch.Tensor, log_factor: float) -> torch.Tensor:
    return tensor if log_factor == 0.0 else tensor * math.exp(log_factor)


def squared_network(
    graph: Graph,
    layers: Mapping[str, tuple[ScaledTensor, ScaledTensor | None]],
    *,
    power: int,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str = "cpu",
) -> SquaredPass:
    """Forward pass of the squared network on all-ones inputs, with a log offset per node.

    ``layers`` maps each Linear/Conv (and standalone BatchNorm) node to its ψ weight and bias
    in torch's layout, each with its own log scale; so neither a huge global scale nor a huge
    path count overflows.
    """
    values: dict[str, torch.Tensor] = {}
    offsets: dict[str, float] = {}
    with torch.no_grad():
        for node in graph.nodes:
            rule = rule_for(node)
            if isinstance(node, Input):
                y, offset = torch.ones((1, *node.shape), dtype=dtype, device=device), 0.0
            elif node.name in layers:
                weight, bias = layers[node.name]
                weighted_scale = offsets[node.inputs[0]] + weight.log_scale
                offset = weighted_scale if bias is None else max(weighted_scale, bias.log_scale)
                y = rule.weighted(node, values[node.inputs[0]], weight.value) * math.exp(weighted_scale - offset)
                if bias is not None:
                    y = y + per_channel(bias.value, y) * math.exp(bias.log_scale - offset)
                # ψ is layer-sized: released before the next layer's is built, not when it is assigned.
                del weight, bias
            else:
                unit, log_gain = _unit_gain(node)
                offset = max(offsets[i] for i in node.inputs)
                y = rule.squared(unit, [_rescaled(values[i], offsets[i] - offset) for i in node.inputs], power)
                offset += power * log_gain
            values[node.name], offsets[node.name] = _renormalise(y, offset)
    return SquaredPass(values, offsets)


def _unit_gain(node: Node) -> tuple[Node, float]:
    """``node`` with a constant factor c ≠ 0 replaced by its sign, and ln|c|: the factor's power
    is carried in the log offset, where c = 1e200 does not overflow as c² does."""
    if isinstance(node, Scale) and node.factor != 0:
        return dataclasses.replace(node, factor=math.copysign(1.0, node.factor)), math.log(abs(node.factor))
    return node, 0.0


def _vjp(function, inputs: list[torch.Tensor], cotangent: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Vector–Jacobian product of a (multi)linear op at ``inputs``: local autograd, one node.

    The product is taken as the gradient of the scalar ⟨output, cotangent⟩ (the same numbers):
    an explicit ``grad_outputs`` tensor makes torch import sympy on first use, 0.3–0.8 s.
    """
    leaves = [t.detach().requires_grad_(True) for t in inputs]
    with torch.enable_grad():
        output = function(*leaves)
        return torch.autograd.grad((output * cotangent).sum(), leaves, allow_unused=True)


def log_gradients(
    graph: Graph, layers: Mapping[str, tuple[ScaledTensor, ScaledTensor | None]], forward: SquaredPass, *, power: int = 2
) -> dict[str, tuple[LogG, torch.Tensor | None]]:
    """log ∂L/∂ψ for every layer's weight and bias, by a backward sweep with its own log offsets.

    Each node's vector–Jacobian product is taken locally on normalised values, and the scale
    of the cotangent is carried as a log offset, so gradients far below (or above) the rest
    of the network stay representable: no chain of tiny factors ever multiplies out.
    """
    cotangents: dict[str, list[tuple[torch.Tensor, float]]] = {
        o: [(torch.ones_like(forward.values[o]), 0.0)] for o in graph.outputs
    }
    result: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
    for node in reversed(graph.nodes):
        if isinstance(node, Input) or node.name not in cotangents:
            continue
        incoming = cotangents.pop(node.name)
        sigma = max(offset for _, offset in incoming)
        cotangent = _rescaled(incoming[0][0], incoming[0][1] - sigma)
        for tensor, offset in incoming[1:]:
            cotangent = cotangent + _rescaled(tensor, offset - sigma)
        cotangent, sigma = _renormalise(cotangent, sigma)

        def send(name: str, tensor: torch.Tensor, offset: float) -> None:
            cotangents.setdefault(name, []).append(_renormalise(tensor, offset))

        rule = rule_for(node)
        if node.name in layers:
            weight, bias = layers[node.name]
            source = node.inputs[0]
            x = forward.values[source]
            log_weight: LogG
            if isinstance(rule, LinearRule) and x.numel() == weight.value.shape[1]:
                # One input vector: ∂L/∂ψ = δ xᵀ, kept as its two factors, never built.
                (grad_x,) = _vjp(lambda a: rule.weighted(node, a, weight.value), [x], cotangent)
                log_weight = OuterLog(torch.log(cotangent.reshape(-1)) + sigma,
                                      torch.log(x.reshape(-1)) + forward.offsets[source])
            else:
                grad_x, grad_w = _vjp(lambda a, w: rule.weighted(node, a, w), [x, weight.value], cotangent)
                log_weight = torch.log_(grad_w).add_(sigma + forward.offsets[source])
            send(source, grad_x, sigma + weight.log_scale)
            log_bias = None
            if bias is not None:
                log_bias = torch.log(cotangent.sum(dim=[0, *range(2, cotangent.dim())]).clamp_min(0)) + sigma
            result[node.name] = (log_weight, log_bias)
            del weight, bias
        else:
            # Parameter-free nodes are linear in each input, so the point of the VJP is immaterial.
            unit, log_gain = _unit_gain(node)
            grads = _vjp(lambda *xs: rule.squared(unit, list(xs), power), [forward.values[i] for i in node.inputs], cotangent)
            for source, grad in zip(node.inputs, grads):
                send(source, grad, sigma + power * log_gain)
    return result


class _Expanded(Sequence[torch.Tensor]):
    def __init__(self, parts: Sequence[LogG]):
        self._parts = parts

    def __getitem__(self, t):
        if isinstance(t, slice):
            return [dense(lg) for lg in self._parts[t]]
        return dense(self._parts[t])

    def __len__(self) -> int:
        return len(self._parts)


def _layer_tensors(groups: RescalingGroups, tensors: list) -> dict[str, list]:
    by_layer: dict[str, list] = {}
    for dp, t in zip(groups.dag_params, tensors):
        by_layer.setdefault(dp.layer, []).append(t)
    return by_layer


class _Layers(Mapping[str, tuple[ScaledTensor, ScaledTensor | None]]):
    """Each layer's (weight, bias) for the squared network, built from its DAG parameters on
    every access and never kept: the passes hold one layer's ψ at a time, not a float64 copy
    of the whole network (the forward and backward sweeps build the same numbers twice)."""

    def __init__(self, groups: RescalingGroups, make: Callable[[DagParam], ScaledTensor]):
        self._tensors = _layer_tensors(groups, groups.dag_params)
        self._make = make

    def __getitem__(self, layer: str) -> tuple[ScaledTensor, ScaledTensor | None]:
        dps = self._tensors[layer]
        return self._make(dps[0]), self._make(dps[1]) if len(dps) > 1 else None

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def _ones(dp: DagParam, device) -> ScaledTensor:
    return ScaledTensor(torch.ones(dp.shape, dtype=torch.float64, device=device))


def balancing_exponents(groups: RescalingGroups) -> torch.Tensor:
    """An admissible rescaling u_D that gives each free group's incoming parameters unit squared norm.

    Computed layer by layer in topological order; each output row is divided by its largest
    entry before squaring and the scales are kept as logarithms, so it is finite for any
    finite weights. A group fed by several layers (a residual stream) takes the first.
    """
    H = groups.num_free
    u = torch.zeros(H + 1, dtype=torch.float64, device=groups.device)
    assigned = torch.zeros(H + 1, dtype=torch.bool, device=groups.device)
    assigned[H] = True
    for dps in _layer_tensors(groups, groups.dag_params).values():
        weight_dp = dps[0]
        source = -2 * u[weight_dp.src]
        source_max = source.amax(dim=1, keepdim=True)
        source_scale = torch.exp(source - source_max)[:, :, None]
        stored = weight_dp.value.reshape(weight_dp.view)
        conv_groups, rows_per_group, in_per_group, kernel = weight_dp.view
        per_out = torch.cat([_log_row_norms(stored[:, rows], source_scale)
                             for rows in blocks(rows_per_group, conv_groups * in_per_group * kernel)], dim=1)
        per_out = (per_out + source_max).reshape(-1)
        if len(dps) > 1:
            per_out = torch.logaddexp(per_out, 2 * torch.log(dps[1].value.to(torch.float64).abs()))
        dst = weight_dp.dst.reshape(-1)
        target = torch.where(torch.isfinite(per_out), -0.5 * per_out, torch.zeros_like(per_out))
        fresh = ~assigned[dst]
        if bool(fresh.any()):
            u.scatter_reduce_(0, dst[fresh], target[fresh], reduce="amin", include_self=False)
            assigned[dst[fresh]] = True
    return u[:H]


def _log_row_norms(w4: torch.Tensor, source_scale: torch.Tensor) -> torch.Tensor:
    """ln Σ_{i,k} w_oik² e^{s_i} per row o of a ``[G, rows, I/G, K]`` block, with ``source_scale``
    = e^{s − max s} and without that max; each row divided by its largest entry before squaring."""
    w4 = w4.to(torch.float64).abs()
    row_max = w4.amax(dim=(2, 3), keepdim=True)
    squares = w4.div_(row_max.clamp_min(torch.finfo(torch.float64).tiny)).square_().sum(3)
    return torch.log(torch.bmm(squares, source_scale).squeeze(2)) + 2 * torch.log(row_max[:, :, 0, 0])


def _balanced_psi(dp: DagParam, u_ext: torch.Tensor, device) -> ScaledTensor:
    """ψ = (Dθ)² for one tensor with its scale as a logarithm.

    (Dθ)_{oi} = θ_{oi} · e^{a_o} · e^{b_i} with a = u_dst, b = −u_src: each factor is divided
    by its maximum, so ψ's mantissa is at most 1 and no intermediate overflows.
    """
    # A copy even of a float64 value (it may be a view of the mapped checkpoint), made ψ in place.
    value = dp.value.to(device, torch.float64, copy=True).reshape(dp.view)
    a, b = u_ext[dp.dst], -u_ext[dp.src]
    a_max, b_max = float(a.max()), float(b.max())
    low, high = value.aminmax() if value.numel() else (value.new_zeros(()), value.new_zeros(()))
    peak = max(-float(low), float(high))
    if peak == 0.0:
        return ScaledTensor(torch.zeros(dp.shape, dtype=torch.float64, device=device))
    psi = value.mul_((torch.exp(a - a_max) / peak)[:, :, None, None])
    psi.mul_(torch.exp(b - b_max)[:, None, :, None]).square_()
    return ScaledTensor(psi.reshape(dp.shape), 2 * (math.log(peak) + a_max + b_max))


def diag_g(groups: RescalingGroups, *, device: torch.device | str = "cpu") -> DiagG:
    """log diag(G) for every DAG parameter: one forward and one backward pass (SPEC §3).

    ψ = (Dθ)² is built per tensor with a log scale (D an admissible balancing), and
    log g(θ) = log ∂L/∂Ψ(Dθ) + 2(B u_D) since g(Dθ) = g(θ) / d².
    """
    groups = groups.to(device)
    u_ext = groups.extend(balancing_exponents(groups))
    layers = _Layers(groups, lambda dp: _balanced_psi(dp, u_ext, device))
    gradients = log_gradients(groups.graph, layers, squared_network(groups.graph, layers, power=2, device=device))
    log_g: list[LogG] = []
    for dp, position in zip(groups.dag_params, _position_in_layer(groups)):
        weight_log, bias_log = gradients[dp.layer]
        lg = bias_log if position else weight_log
        if isinstance(lg, OuterLog):
            lg = OuterLog(*lg.shifted(2 * u_ext[dp.dst].reshape(-1), -2 * u_ext[dp.src].reshape(-1)))
            checked = [lg.rows, lg.cols]
        else:
            lg = lg.reshape(dp.view)
            lg.add_(2 * u_ext[dp.dst][:, :, None, None]).sub_(2 * u_ext[dp.src][:, None, :, None])
            lg = lg.reshape(dp.shape)
            checked = [lg]
        # NaN and +inf both fail this comparison: one reduction checks both.
        if any(t.numel() and not float(t.max()) < math.inf for t in checked):
            raise ArithmeticError("diag(G) could not be represented even in the log domain")
        log_g.append(lg)
    return DiagG(log_g)


def _position_in_layer(groups: RescalingGroups) -> list[int]:
    """0 for a layer's weight, 1 for its bias, per DAG parameter."""
    seen: dict[str, int] = {}
    positions = []
    for dp in groups.dag_params:
        positions.append(seen.get(dp.layer, 0))
        seen[dp.layer] = positions[-1] + 1
    return positions


def path_count(groups: RescalingGroups, *, device: torch.device | str = "cpu") -> PathCount:
    """Number of paths (input or bias to output) as log10, and exactly when below 2**53."""
    ones = _Layers(groups, lambda dp: _ones(dp, device))
    mantissa, offset = squared_network(groups.graph, ones, power=0, device=device).total(groups.graph)
    log10 = (math.log(mantissa) + offset) / math.log(10)
    exact = int(round(mantissa)) if offset == 0.0 and mantissa < EXACT_LIMIT else None
    return PathCount(log10, exact)


def zeros_per_layer(groups: RescalingGroups, psi: Callable[[DagParam], torch.Tensor], *,
                    device: torch.device | str = "cpu") -> dict[str, int]:
    """DAG parameters on no path whose other entries of ``psi`` are all non-zero, per layer
    (layers without any left out): one pass of the power-0 squared network on ``psi`` (one
    tensor per DAG parameter, ≥ 0, shaped like it), whose ∂N/∂ψ counts those paths.

    g_i is a sum of non-negative terms, one per path through i, so it is zero exactly when
    no path through i has every other weight non-zero: with ``psi`` = 1[θ ≠ 0] this counts
    diag(G)'s zeros, and with some entries set to 1, those that remain without them.
    """
    layers = _Layers(groups, lambda dp: ScaledTensor(psi(dp)))
    counts = log_gradients(groups.graph, layers, squared_network(groups.graph, layers, power=0, device=device), power=0)
    zeros: dict[str, int] = {}
    for layer, (weight_log, bias_log) in counts.items():
        missing = zero_count(weight_log) + (0 if bias_log is None else zero_count(bias_log))
        if missing:
            zeros[layer] = missing
    return zeros


def unused_parameters(groups: RescalingGroups, *, device: torch.device | str = "cpu") -> dict[str, int]:
    """DAG parameters on no input-or-bias-to-output path at the graph's input shape, per layer.

    The number of paths through each parameter is ∂N/∂ψ of the path-count network; it is 0
    for conv taps that only ever see padding (or whose windows fall outside a small input).
    Such parameters have g = 0 whatever the weights, so diag(G) and the rescaling know nothing
    of them: the input shape should be the one the network is trained at.
    """
    return zeros_per_layer(groups, lambda dp: _ones(dp, device).value, device=device)
