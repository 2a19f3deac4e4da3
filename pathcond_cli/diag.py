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
    AdaptiveAvgPool, Add, AvgPool, BatchNorm, Concat, Conv, Flatten, Graph, Input, Linear, MaxPool,
)
from .groups import RescalingGroups

EXACT_LIMIT = 2**53


@dataclass
class DiagG:
    """log diag(G) per DAG parameter (−inf where g = 0), in float64, in the original θ's scale."""

    log_g: list[torch.Tensor]

    def values(self) -> list[torch.Tensor]:
        """g itself; entries beyond float64's range become 0 or inf, so prefer :attr:`log_g`."""
        return [lg.exp() for lg in self.log_g]


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


def squared_network(
    graph: Graph,
    layer_params: dict[str, tuple[torch.Tensor, torch.Tensor | None]],
    *,
    power: int,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str = "cpu",
    renormalise: bool = False,
) -> tuple[torch.Tensor, float]:
    """Summed output of the squared network, and (when ``renormalise``) its natural-log scale.

    ``layer_params`` maps each Linear/Conv node to its (BatchNorm-folded) ψ weight and bias in
    torch's layout. With ``renormalise`` every activation is divided by its maximum and the
    factor kept as a log offset, so counts beyond float64's range stay representable; the
    returned total is then ``exp(offset) · value``.
    """
    values: dict[str, torch.Tensor] = {}
    offsets: dict[str, float] = {}
    for node in graph.nodes:
        offset = 0.0
        if isinstance(node, Input):
            y = torch.ones((1, *node.shape), dtype=dtype, device=device)
        elif isinstance(node, (Linear, Conv)):
            x, offset = values[node.inputs[0]], offsets[node.inputs[0]]
            weight, bias = layer_params[node.name]
            if bias is not None and renormalise:
                bias = bias * math.exp(-offset)
            y = F.linear(x, weight, bias) if isinstance(node, Linear) else conv(x, weight, bias, node)
        elif isinstance(node, BatchNorm) and node.name in layer_params:
            x, offset = values[node.inputs[0]], offsets[node.inputs[0]]
            scale, shift = layer_params[node.name]
            broadcast = (1, -1, *([1] * (x.dim() - 2)))
            if renormalise:
                shift = shift * math.exp(-offset)
            y = x * scale.reshape(broadcast) + shift.reshape(broadcast)
        elif isinstance(node, (Add, Concat)):
            offset = max(offsets[i] for i in node.inputs)
            parts = [values[i] * math.exp(offsets[i] - offset) if renormalise else values[i] for i in node.inputs]
            y = torch.cat(parts, dim=1) if isinstance(node, Concat) else sum(parts[1:], parts[0])
        else:
            x, offset = values[node.inputs[0]], offsets[node.inputs[0]]
            y = _fixed_op(node, x, power)
        if renormalise:
            peak = float(y.max()) if y.numel() else 0.0
            if peak > 0 and not 1e-100 < peak < 1e100:
                y = y / peak
                offset += math.log(peak)
        values[node.name], offsets[node.name] = y, offset
    total = sum(values[name].sum() * (math.exp(offsets[name] - max(offsets[o] for o in graph.outputs)))
                for name in graph.outputs)
    return total, max(offsets[o] for o in graph.outputs)


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


def _layer_tensors(groups: RescalingGroups, tensors: list[torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    by_layer: dict[str, list[torch.Tensor]] = {}
    for dp, t in zip(groups.dag_params, tensors):
        by_layer.setdefault(dp.layer, []).append(t)
    return by_layer


def _layer_params(groups: RescalingGroups, tensors: list[torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
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
    for layer, params in _layer_tensors(groups, [dp.value for dp in groups.dag_params]).items():
        dps = [dp for dp in groups.dag_params if dp.layer == layer]
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
    """log diag(G) for every DAG parameter: one forward and one backward pass (SPEC §3)."""
    u_balance = balancing_exponents(groups).to(device)
    u_ext = groups.extend(u_balance)
    dev_groups = groups.to(device)
    psi: list[torch.Tensor] = []
    log_shift: list[torch.Tensor] = []
    for dp in dev_groups.dag_params:
        exponent = dp.exponent(u_ext).expand(dp.view).reshape(dp.value.shape)
        value = dp.value.to(device)
        balanced_log_abs = torch.log(value.abs()) + exponent
        psi.append(torch.exp(2 * balanced_log_abs).requires_grad_(True))
        log_shift.append(2 * exponent)
    total, _ = squared_network(groups.graph, _layer_params(groups, psi), power=2, device=device)
    grads = torch.autograd.grad(total, psi, allow_unused=True)
    log_g = []
    for p, grad, shift in zip(psi, grads, log_shift):
        g = torch.zeros_like(p) if grad is None else grad.detach()
        log_g.append(torch.log(g.clamp_min(0)) + shift)
    return DiagG(log_g)


def path_count(groups: RescalingGroups, *, device: torch.device | str = "cpu") -> PathCount:
    """Number of paths (input or bias to output) as log10, and exactly when below 2**53."""
    ones = [torch.ones(dp.value.shape, dtype=torch.float64, device=device) for dp in groups.dag_params]
    total, offset = squared_network(groups.graph, _layer_params(groups, ones), power=0, device=device, renormalise=True)
    log10 = (math.log(float(total)) + offset) / math.log(10)
    exact = int(round(float(total))) if offset == 0.0 and float(total) < EXACT_LIMIT else None
    return PathCount(log10, exact)
