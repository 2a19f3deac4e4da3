"""A module's graph from ``torch.export``, for a forward that torch.fx cannot trace.

torch.fx refuses a forward that branches on its input's shape; ``torch.export`` runs such
branches at the given input shape and records the ATen operations taken. The result is
rewritten into the torch functions the fx import translates (``aten.conv2d`` becomes
``torch.conv2d``, ...), so that both routes share one translation: the translated function of
the operation's name, or the one of :data:`_EQUIVALENTS` where the names or the arguments differ.
An ATen operation with neither is left as it is and refused by name where it is translated.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
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


def slice_along(
    x: torch.Tensor, dim: int = 0, start: int | None = None, end: int | None = None, step: int = 1
) -> torch.Tensor:
    """``x[..., start:end:step, ...]`` on axis ``dim``: what ``aten.slice`` records for indexing with a slice."""
    index = [slice(None)] * x.dim()
    index[dim] = slice(start, end, step)
    return x[tuple(index)]


def _resize(mode: str) -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
    """``aten.upsample_<mode>.vec(input, output_size, scale_factors)`` (nearest) or
    ``(input, output_size, align_corners, scale_factors)`` (the others) as ``F.interpolate(input,
    size, scale_factor, mode, align_corners, recompute_scale_factor, antialias)``: the scale
    factors are those F.interpolate passed on, so that its output size is the recorded one."""
    antialias = mode.endswith("-antialias")
    mode = mode.removesuffix("-antialias")

    def arguments(args: tuple[Any, ...]) -> tuple[Any, ...]:
        if mode.startswith("nearest"):
            x, size, scale_factors = args
            return (x, size, scale_factors, mode)
        x, size, align_corners, scale_factors = args
        return (x, size, scale_factors, mode, align_corners, None, antialias)

    return arguments


# The ATen operations torch.export records for a supported layer whose torch function has another
# name or takes other positional arguments (any overload of a packet, or one overload): the torch
# function the fx import translates, and how its positional arguments map onto that function's.
# Any other ATen operation is its namesake's (:func:`_namesake`).
_Equivalent = tuple[Callable[..., Any], Callable[[tuple[Any, ...]], tuple[Any, ...]]]
_EQUIVALENTS: dict[Any, _Equivalent] = {
    **{
        packet: (function, _unchanged)
        for packet, function in (
            (aten.add_, torch.add),
            (aten.view, torch.reshape),
            (aten.split_with_sizes, torch.split),
        )
    },
    aten.slice.Tensor: (slice_along, _unchanged),
    aten.alias.default: (slice_along, _unchanged),  # a slice that keeps every element: x[:]
    aten.batch_norm: (F.batch_norm, _batch_norm_arguments),
    # Every mode F.interpolate has: the unsupported ones are refused with its reason.
    **{
        overload: (F.interpolate, _resize(mode))
        for overload, mode in (
            (aten.upsample_nearest1d.vec, "nearest"),
            (aten.upsample_nearest2d.vec, "nearest"),
            (aten.upsample_nearest3d.vec, "nearest"),
            (aten._upsample_nearest_exact1d.vec, "nearest-exact"),
            (aten._upsample_nearest_exact2d.vec, "nearest-exact"),
            (aten._upsample_nearest_exact3d.vec, "nearest-exact"),
            (aten.upsample_linear1d.vec, "linear"),
            (aten.upsample_bilinear2d.vec, "bilinear"),
            (aten.upsample_trilinear3d.vec, "trilinear"),
            (aten.upsample_bicubic2d.vec, "bicubic"),
            (aten._upsample_bilinear2d_aa.vec, "bilinear-antialias"),
            (aten._upsample_bicubic2d_aa.vec, "bicubic-antialias"),
        )
    },
}

# Checks torch.export inserts (its guards on the input, asserts on symbolic sizes): no value.
_CHECKS = (aten._assert_scalar, aten._assert_tensor_metadata, aten.sym_constrain_range_for_size)


def exported_graph(
    module: nn.Module, example: torch.Tensor, translated: Collection[Callable[..., Any]]
) -> torch.fx.GraphModule:
    """The module's forward at ``example``'s shape, in eval mode, as fx-importable nodes:
    ``translated`` are the torch functions the fx import reads.

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
        equivalent = _equivalent(node, translated)
        if equivalent is not None:
            function, arguments = equivalent
            node.target, node.args = function, arguments(tuple(node.args))
    graph.lint()
    graph_module.recompile()
    return graph_module


def _equivalent(node: torch.fx.Node, translated: Collection[Callable[..., Any]]) -> _Equivalent | None:
    if node.op != "call_function":
        return None
    packet = getattr(node.target, "overloadpacket", None)
    return _EQUIVALENTS.get(node.target) or _EQUIVALENTS.get(packet) or _namesake(packet, translated)


def _namesake(packet: Any, translated: Collection[Callable[..., Any]]) -> _Equivalent | None:
    """The translated function named as ATen operation ``packet`` (``torch.sub`` for ``aten.sub``,
    ``F.max_pool2d`` for ``aten.max_pool2d``, torch's first), which takes its positional arguments
    in the same order; None for an operation that is no ATen one or has no translated namesake."""
    if packet is None:
        return None
    for namespace in (torch, F):
        function = getattr(namespace, packet.__name__, None)
        if function is not None and function in translated:
            return function, _unchanged
    return None


def _is_check(node: torch.fx.Node) -> bool:
    if node.users:
        return False
    if node.op == "call_module":
        return str(node.target).startswith("_guards")  # the input guards of the unlifted module
    return node.op == "call_function" and getattr(node.target, "overloadpacket", None) in _CHECKS
