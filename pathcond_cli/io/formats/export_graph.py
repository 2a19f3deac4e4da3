"""A module's graph from ``torch.export``, for a forward that torch.fx cannot trace.

torch.fx refuses a forward that branches on its input's shape; ``torch.export`` runs such
branches at the given input shape and records the ATen operations taken. The result is
rewritten into the torch functions the fx import translates (``aten.conv2d`` becomes
``torch.conv2d``, ...), so that both routes share one translation. An ATen operation with no
counterpart here is left as it is and refused by name where it is translated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

aten = torch.ops.aten


def _unchanged(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The ATen operation takes the torch function's positional arguments in the same order."""
    return args


def _batch_norm_arguments(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``aten.batch_norm(input, weight, bias, mean, var, training, momentum, eps, cudnn)`` as
    ``F.batch_norm(input, mean, var, weight, bias, training, momentum, eps)``."""
    x, weight, bias, mean, var, *rest = args
    return (x, mean, var, weight, bias, *rest[:3])


# Each ATen operation (any overload) torch.export records for a supported layer: the torch
# function the fx import translates, and how its positional arguments map onto that function's.
_EQUIVALENTS: dict[Any, tuple[Callable[..., Any], Callable[[tuple[Any, ...]], tuple[Any, ...]]]] = {
    **{packet: (function, _unchanged) for packet, function in (
        (aten.conv1d, torch.conv1d), (aten.conv2d, torch.conv2d), (aten.conv3d, torch.conv3d),
        (aten.linear, F.linear), (aten.relu, torch.relu), (aten.relu_, torch.relu_),
        (aten.leaky_relu, F.leaky_relu), (aten.dropout, F.dropout),
        (aten.max_pool1d, F.max_pool1d), (aten.max_pool2d, F.max_pool2d), (aten.max_pool3d, F.max_pool3d),
        (aten.avg_pool1d, F.avg_pool1d), (aten.avg_pool2d, F.avg_pool2d), (aten.avg_pool3d, F.avg_pool3d),
        (aten.adaptive_avg_pool1d, F.adaptive_avg_pool1d), (aten.adaptive_avg_pool2d, F.adaptive_avg_pool2d),
        (aten.adaptive_avg_pool3d, F.adaptive_avg_pool3d), (aten.pad, F.pad),
        (aten.add, torch.add), (aten.add_, torch.add), (aten.mul, torch.mul), (aten.div, torch.div),
        (aten.sub, torch.sub), (aten.neg, torch.neg),
        (aten.mean, torch.mean), (aten.cat, torch.cat),
        (aten.flatten, torch.flatten), (aten.view, torch.reshape), (aten.reshape, torch.reshape),
        (aten.transpose, torch.transpose), (aten.permute, torch.permute), (aten.squeeze, torch.squeeze),
        (aten.unsqueeze, torch.unsqueeze), (aten.split, torch.split), (aten.chunk, torch.chunk),
        (aten.narrow, torch.narrow), (aten.channel_shuffle, torch.channel_shuffle),
    )},
    aten.batch_norm: (F.batch_norm, _batch_norm_arguments),
}

# Checks torch.export inserts (its guards on the input, asserts on symbolic sizes): no value.
_CHECKS = (aten._assert_scalar, aten._assert_tensor_metadata, aten.sym_constrain_range_for_size)


def exported_graph(module: nn.Module, example: torch.Tensor) -> torch.fx.GraphModule:
    """The module's forward at ``example``'s shape, in eval mode, as fx-importable nodes.

    Raises whatever ``torch.export`` raises; the caller reports it.
    """
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            graph_module = torch.export.export(module, (example,), strict=False).module()
    finally:
        module.train(was_training)
    graph = graph_module.graph
    for node in list(graph.nodes):
        if _is_check(node):
            graph.erase_node(node)
            continue
        packet = getattr(node.target, "overloadpacket", None) if node.op == "call_function" else None
        if packet in _EQUIVALENTS:
            function, arguments = _EQUIVALENTS[packet]
            node.target, node.args = function, arguments(tuple(node.args))
    graph.lint()
    graph_module.recompile()
    return graph_module


def _is_check(node: torch.fx.Node) -> bool:
    if node.users:
        return False
    if node.op == "call_module":
        return str(node.target).startswith("_guards")  # the input guards of the unlifted module
    return node.op == "call_function" and getattr(node.target, "overloadpacket", None) in _CHECKS
