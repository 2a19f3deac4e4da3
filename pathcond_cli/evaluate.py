"""Run the real network a :class:`Graph` describes, in torch (used to verify rescaled models)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from .errors import InputError
from .graph import (
    AdaptiveAvgPool, Add, AvgPool, BatchNorm, Concat, Conv, Flatten, Graph, Identity, Input,
    LeakyReLU, Linear, MaxPool, Node, ReLU,
)


def spatial_rank(x: torch.Tensor) -> int:
    """Number of spatial axes of a batched ``(N, C, *spatial)`` tensor."""
    return x.dim() - 2


def conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, node: Conv) -> torch.Tensor:
    fn = F.conv1d if weight.dim() == 3 else F.conv2d
    return fn(x, weight, bias, node.stride, node.padding, node.dilation, node.groups)


def linear_weight(node: Linear, weight: torch.Tensor) -> torch.Tensor:
    """The weight in torch's ``[out, in]`` layout whatever the checkpoint stores."""
    return weight.t() if node.weight_transposed else weight


def max_pool(x: torch.Tensor, node: MaxPool) -> torch.Tensor:
    fn = F.max_pool1d if spatial_rank(x) == 1 else F.max_pool2d
    return fn(x, node.kernel, node.stride, node.padding, node.dilation, ceil_mode=node.ceil_mode)


def avg_pool(x: torch.Tensor, node: AvgPool) -> torch.Tensor:
    fn = F.avg_pool1d if spatial_rank(x) == 1 else F.avg_pool2d
    return fn(x, node.kernel, node.stride, node.padding, node.ceil_mode, node.count_include_pad)


def adaptive_avg_pool(x: torch.Tensor, node: AdaptiveAvgPool) -> torch.Tensor:
    fn = F.adaptive_avg_pool1d if spatial_rank(x) == 1 else F.adaptive_avg_pool2d
    return fn(x, node.output_size)


def forward(
    graph: Graph,
    params: Mapping[str, torch.Tensor],
    inputs: torch.Tensor | Mapping[str, torch.Tensor],
    *,
    train: bool = False,
) -> dict[str, torch.Tensor]:
    """Outputs of the network on batched ``inputs``, keyed by output node name.

    ``params`` are the checkpoint's tensors (any float dtype; they are cast to the input's
    dtype). BatchNorm uses running statistics, or batch statistics when ``train`` is true
    (running statistics are never modified).
    """
    if isinstance(inputs, torch.Tensor):
        if len(graph.inputs) != 1:
            raise InputError(f"{graph.source}: the network has {len(graph.inputs)} inputs; pass a mapping")
        inputs = {graph.inputs[0].name: inputs}
    dtype = next(iter(inputs.values())).dtype
    values: dict[str, torch.Tensor] = {}

    def param(key: str | None) -> torch.Tensor | None:
        return None if key is None else params[key].to(dtype)

    for node in graph.nodes:
        if isinstance(node, Input):
            values[node.name] = inputs[node.name]
            continue
        x = values[node.inputs[0]]
        values[node.name] = _apply(node, x, [values[i] for i in node.inputs], param, train)
    return {name: values[name] for name in graph.outputs}


def _apply(node: Node, x: torch.Tensor, xs: list[torch.Tensor], param, train: bool) -> torch.Tensor:
    if isinstance(node, Linear):
        return F.linear(x, linear_weight(node, param(node.weight)), param(node.bias))
    if isinstance(node, Conv):
        return conv(x, param(node.weight), param(node.bias), node)
    if isinstance(node, BatchNorm):
        return F.batch_norm(
            x, param(node.running_mean).clone(), param(node.running_var).clone(), param(node.weight),
            param(node.bias), training=train, momentum=node.momentum, eps=node.eps,
        )
    if isinstance(node, ReLU):
        return F.relu(x)
    if isinstance(node, LeakyReLU):
        return F.leaky_relu(x, node.negative_slope)
    if isinstance(node, Identity):
        return x
    if isinstance(node, MaxPool):
        return max_pool(x, node)
    if isinstance(node, AvgPool):
        return avg_pool(x, node)
    if isinstance(node, AdaptiveAvgPool):
        return adaptive_avg_pool(x, node)
    if isinstance(node, Flatten):
        return x.flatten(1)
    if isinstance(node, Add):
        total = xs[0]
        for other in xs[1:]:
            total = total + other
        return total
    if isinstance(node, Concat):
        return torch.cat(xs, dim=1)
    raise TypeError(f"no evaluator for node type {type(node).__name__}")


def infer_shapes(graph: Graph, params: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """Batch-free output shape of every node, by a forward pass of one all-zero example.

    (Meta tensors would skip the arithmetic, but their one-off set-up costs seconds.)
    """
    probe_params = {key: params[key].to(torch.float32) for key in graph.parameter_keys()}
    inputs = {n.name: torch.zeros((1, *n.shape)) for n in graph.inputs}
    shapes: dict[str, tuple[int, ...]] = {}
    values: dict[str, torch.Tensor] = {}
    for node in graph.nodes:
        if isinstance(node, Input):
            values[node.name] = inputs[node.name]
        else:
            xs = [values[i] for i in node.inputs]
            try:
                with torch.no_grad():
                    values[node.name] = _apply(node, xs[0], xs, lambda k: None if k is None else probe_params[k], False)
            except (RuntimeError, ValueError, IndexError) as exc:
                in_shapes = ", ".join(str(tuple(v.shape[1:])) for v in xs)
                raise InputError(
                    f"{graph.source}: node '{node.name}' ({node.op}) cannot take input of shape {in_shapes} "
                    f"with its tensors: {str(exc).splitlines()[0]}"
                ) from None
        shapes[node.name] = tuple(values[node.name].shape[1:])
    return shapes
