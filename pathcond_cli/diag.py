"""diag(G) and the path count (SPEC §3), each from one pass of the "squared network".

The squared network replaces every parameter θ by ψ = θ², every fixed edge constant c by
c^power, every ReLU by the identity and every max-pool by a sum over its window, and feeds
ones. Its summed output is L = ‖Φ(θ)‖² (power 2) and ∂L/∂ψ = diag(G); with ψ = 1 and
power 0 it counts paths.

Overflow: deep networks with extreme weights overflow a naive float64 pass, so diag(G) is
computed on a balanced copy Dθ (each layer's incoming squared norm set to 1, an admissible
rescaling) and mapped back in the log domain: log g(θ) = log g(Dθ) + 2(B u_D). The path
count renormalises activations as it goes and keeps the scale in a log offset.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .evaluate import adaptive_avg_pool, conv, spatial_rank
from .graph import (
    AdaptiveAvgPool, Add, AvgPool, Concat, Conv, Flatten, Graph, Input, Linear, MaxPool,
)
from .groups import RescalingGroups

EXACT_LIMIT = 2**53


@dataclass
class DiagG:
    """log diag(G) per DAG parameter (−inf where g = 0), in float64, in the original θ's scale."""

    log_g: list[torch.Tensor]


@dataclass
class PathCount:
    log10: float
    exact: int | None


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    return x.unsqueeze(2) if spatial_rank(x) == 1 else x


def _from_2d(y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return y.squeeze(2) if spatial_rank(like) == 1 else y


def _pair(values: tuple[int, ...], fill: int) -> tuple[int, int]:
    return (fill, values[0]) if len(values) == 1 else (values[0], values[1])


def _window_sum(x: torch.Tensor, kernel, stride, padding, dilation, ceil_mode: bool) -> torch.Tensor:
    """Sum over each pooling window, zero padding: the max-pool neuron's incoming fixed edges."""
    x2 = _as_2d(x)
    k, s, p, d = _pair(kernel, 1), _pair(stride, 1), _pair(padding, 0), _pair(dilation, 1)
    if d == (1, 1):
        y = F.avg_pool2d(x2, k, s, p, ceil_mode, count_include_pad=True, divisor_override=1)
    else:
        if ceil_mode:
            raise ValueError("dilated max-pooling with ceil_mode is not supported")
        channels = x2.shape[1]
        ones = x2.new_ones(channels, 1, *k)
        y = F.conv2d(x2, ones, None, s, p, d, groups=channels)
    return _from_2d(y, x)


def _avg_divisor(x: torch.Tensor, node: AvgPool) -> torch.Tensor:
    """Each output's divisor, exactly as torch's avg_pool computes it (padding, ceil_mode)."""
    ones = _as_2d(torch.ones_like(x[:1, :1]))
    k, s, p = _pair(node.kernel, 1), _pair(node.stride, 1), _pair(node.padding, 0)
    counted = F.avg_pool2d(ones, k, s, p, node.ceil_mode, count_include_pad=True, divisor_override=1)
    mean = F.avg_pool2d(ones, k, s, p, node.ceil_mode, node.count_include_pad)
    return _from_2d(counted / mean, x)


def _adaptive_window_sizes(in_size: tuple[int, ...], out_size: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    sizes = []
    for n, m in zip(in_size, out_size):
        i = torch.arange(m)
        sizes.append(((i + 1) * n + m - 1) // m - (i * n) // m)
    grid = sizes[0] if len(sizes) == 1 else sizes[0][:, None] * sizes[1][None, :]
    return grid.to(like.dtype)


@dataclass
class ScaledTensor:
    """A non-negative tensor stored as ``value · exp(log_scale)`` so that any magnitude fits."""

    value: torch.Tensor
    log_scale: float = 0.0

    @classmethod
    def from_log(cls, log_value: torch.Tensor) -> ScaledTensor:
        finite = log_value[torch.isfinite(log_value)]
        log_scale = float(finite.max()) if finite.numel() else 0.0
        return cls(torch.exp(log_value - log_scale), log_scale)


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
    """Divide by the peak when it leaves [1e-100, 1e100], moving the factor into the log offset."""
    peak = float(y.abs().max()) if y.numel() else 0.0
    if peak > 0 and not 1e-100 < peak < 1e100:
        return y / peak, offset + math.log(peak)
    return y, offset


def squared_network(
    graph: Graph,
    layers: dict[str, tuple[ScaledTensor, ScaledTensor | None]],
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
            if isinstance(node, Input):
                y, offset = torch.ones((1, *node.shape), dtype=dtype, device=device), 0.0
            elif node.name in layers:
                weight, bias = layers[node.name]
                weighted_scale = offsets[node.inputs[0]] + weight.log_scale
                offset = weighted_scale if bias is None else max(weighted_scale, bias.log_scale)
                y = _weighted(node, values[node.inputs[0]], weight.value) * math.exp(weighted_scale - offset)
                if bias is not None:
                    y = y + _per_channel(bias.value, y) * math.exp(bias.log_scale - offset)
            elif isinstance(node, (Add, Concat)):
                offset = max(offsets[i] for i in node.inputs)
                parts = [values[i] * math.exp(offsets[i] - offset) for i in node.inputs]
                y = torch.cat(parts, dim=1) if isinstance(node, Concat) else sum(parts[1:], parts[0])
            else:
                y, offset = _fixed_op(node, values[node.inputs[0]], power), offsets[node.inputs[0]]
            values[node.name], offsets[node.name] = _renormalise(y, offset)
    return SquaredPass(values, offsets)


def _per_channel(vector: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return vector.reshape(1, -1, *([1] * (like.dim() - 2)))


def _vjp(function, inputs: list[torch.Tensor], cotangent: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Vector–Jacobian product of a (multi)linear op at ``inputs``: local autograd, one node."""
    leaves = [t.detach().requires_grad_(True) for t in inputs]
    with torch.enable_grad():
        output = function(*leaves)
        return torch.autograd.grad(output, leaves, cotangent, allow_unused=True)


def log_gradients(
    graph: Graph, layers: dict[str, tuple[ScaledTensor, ScaledTensor | None]], forward: SquaredPass
) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
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
        cotangent = sum(t * math.exp(offset - sigma) for t, offset in incoming)
        cotangent, sigma = _renormalise(cotangent, sigma)

        def send(name: str, tensor: torch.Tensor, offset: float) -> None:
            cotangents.setdefault(name, []).append(_renormalise(tensor, offset))

        if node.name in layers:
            weight, bias = layers[node.name]
            source = node.inputs[0]
            x = forward.values[source]
            grad_x, grad_w = _vjp(lambda a, w: _weighted(node, a, w), [x, weight.value], cotangent)
            send(source, grad_x, sigma + weight.log_scale)
            log_bias = None
            if bias is not None:
                log_bias = torch.log(cotangent.sum(dim=[0, *range(2, cotangent.dim())]).clamp_min(0)) + sigma
            result[node.name] = (torch.log(grad_w.clamp_min(0)) + sigma + forward.offsets[source], log_bias)
        elif isinstance(node, Add):
            for source in node.inputs:
                send(source, cotangent, sigma)
        elif isinstance(node, Concat):
            widths = [forward.values[i].shape[1] for i in node.inputs]
            for source, part in zip(node.inputs, torch.split(cotangent, widths, dim=1)):
                send(source, part, sigma)
        else:
            (grad_x,) = _vjp(lambda a: _fixed_op(node, a, 2), [forward.values[node.inputs[0]]], cotangent)
            send(node.inputs[0], grad_x, sigma)
    return result


def _weighted(node, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The parameterised part of a layer (no bias): Linear, Conv, or BatchNorm's scale."""
    if isinstance(node, Linear):
        return F.linear(x, weight)
    if isinstance(node, Conv):
        return conv(x, weight, None, node)
    return x * weight.reshape(1, -1, *([1] * (x.dim() - 2)))


def _fixed_op(node, x: torch.Tensor, power: int) -> torch.Tensor:
    """Parameter-free nodes in the squared network: constants c become c**power."""
    if isinstance(node, MaxPool):
        return _window_sum(x, node.kernel, node.stride, node.padding, node.dilation, node.ceil_mode)
    if isinstance(node, AvgPool):
        divisor = _avg_divisor(x, node)
        summed = _window_sum(x, node.kernel, node.stride, node.padding, (1,) * len(node.kernel), node.ceil_mode)
        return summed / divisor**power
    if isinstance(node, AdaptiveAvgPool):
        sizes = _adaptive_window_sizes(tuple(x.shape[2:]), node.output_size, x)
        return adaptive_avg_pool(x, node) * sizes ** (1 - power)
    if isinstance(node, Flatten):
        return x.flatten(1)
    return x


def _layer_tensors(groups: RescalingGroups, tensors: list) -> dict[str, list]:
    by_layer: dict[str, list] = {}
    for dp, t in zip(groups.dag_params, tensors):
        by_layer.setdefault(dp.layer, []).append(t)
    return by_layer


def _layers(groups: RescalingGroups, tensors: list[ScaledTensor]) -> dict[str, tuple[ScaledTensor, ScaledTensor | None]]:
    return {layer: (ts[0], ts[1] if len(ts) > 1 else None) for layer, ts in _layer_tensors(groups, tensors).items()}


def balancing_exponents(groups: RescalingGroups) -> torch.Tensor:
    """An admissible rescaling u_D that gives each free group's incoming parameters unit squared norm.

    Computed layer by layer in topological order and in the log domain, so it is finite for
    any finite weights; a group fed by several layers (a residual stream) takes the first.
    """
    H = groups.num_free
    u = torch.zeros(H + 1, dtype=torch.float64)
    assigned = torch.zeros(H + 1, dtype=torch.bool)
    assigned[H] = True
    for dps in _layer_tensors(groups, groups.dag_params).values():
        weight_dp = dps[0]
        w4 = weight_dp.value.reshape(weight_dp.view)
        log_sq = 2 * torch.log(w4.abs()) - 2 * u[weight_dp.src][:, None, :, None]
        per_out = torch.logsumexp(log_sq.flatten(2), dim=2).reshape(-1)
        if len(dps) > 1:
            per_out = torch.logaddexp(per_out, 2 * torch.log(dps[1].value.abs()))
        dst = weight_dp.dst.reshape(-1)
        target = torch.where(torch.isfinite(per_out), -0.5 * per_out, torch.zeros_like(per_out))
        fresh = ~assigned[dst]
        if bool(fresh.any()):
            u.scatter_reduce_(0, dst[fresh], target[fresh], reduce="amin", include_self=False)
            assigned[dst[fresh]] = True
    return u[:H]


def diag_g(groups: RescalingGroups, *, device: torch.device | str = "cpu") -> DiagG:
    """log diag(G) for every DAG parameter: one forward and one backward pass (SPEC §3).

    ψ = (Dθ)² is built from log|θ| + (B u_D) in the log domain with a scale per tensor, and
    log g(θ) = log ∂L/∂Ψ(Dθ) + 2(B u_D) since g(Dθ) = g(θ) / d².
    """
    u_ext = groups.extend(balancing_exponents(groups).to(device))
    dev_groups = groups.to(device)
    psi: list[ScaledTensor] = []
    exponents: list[torch.Tensor] = []
    for dp in dev_groups.dag_params:
        exponent = dp.exponent(u_ext).expand(dp.view).reshape(dp.value.shape)
        psi.append(ScaledTensor.from_log(2 * (torch.log(dp.value.to(device).abs()) + exponent)))
        exponents.append(exponent)
    layers = _layers(groups, psi)
    gradients = log_gradients(groups.graph, layers, squared_network(groups.graph, layers, power=2, device=device))
    log_g = []
    for dp, scaled, exponent in zip(groups.dag_params, psi, exponents):
        weight_log, bias_log = gradients[dp.layer]
        is_bias = layers[dp.layer][1] is scaled
        log_g.append((bias_log if is_bias else weight_log).reshape(dp.value.shape) + 2 * exponent)
    if any(bool(torch.isnan(lg).any() | (lg == torch.inf).any()) for lg in log_g):
        raise ArithmeticError("diag(G) could not be represented even in the log domain")
    return DiagG(log_g)


def path_count(groups: RescalingGroups, *, device: torch.device | str = "cpu") -> PathCount:
    """Number of paths (input or bias to output) as log10, and exactly when below 2**53."""
    ones = [ScaledTensor(torch.ones(dp.value.shape, dtype=torch.float64, device=device)) for dp in groups.dag_params]
    mantissa, offset = squared_network(groups.graph, _layers(groups, ones), power=0, device=device).total(groups.graph)
    log10 = (math.log(mantissa) + offset) / math.log(10)
    exact = int(round(mantissa)) if offset == 0.0 and mantissa < EXACT_LIMIT else None
    return PathCount(log10, exact)
