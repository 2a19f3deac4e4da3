"""Run the real network a :class:`Graph` describes, in torch (used to verify rescaled models)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..errors import InputError, UnsupportedModelError
from .graph import Graph, Input, broadcast_problem
from .layouts import stand_ins
from .rules import Parameters, rule_for


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
    param = Parameters(params, next(iter(inputs.values())).dtype)
    values: dict[str, torch.Tensor] = {}
    # The sweep lets activations go once read for the last time: the run holds a few, not all,
    # and the allocator reuses their memory instead of faulting in fresh pages.
    for node in graph.sweep(values):
        rule = rule_for(node)
        if isinstance(node, Input):
            values[node.name] = inputs[node.name]
        else:
            values[node.name] = rule.forward(node, [values[i] for i in node.inputs], param, train)
    return {name: values[name] for name in graph.outputs}


def infer_shapes(graph: Graph, params: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """Batch-free output shape of every node, by a forward pass of one all-zero example.

    This is where the shapes a node combines are checked (the one place every importer's
    graph passes through before analysis): an :class:`UnsupportedModelError` names the node.

    (Meta tensors would skip the arithmetic, but their one-off set-up costs seconds.)
    """
    # Shapes do not depend on values: a checkpoint's tensors are not read from its file.
    param = Parameters(stand_ins(params), torch.float32)

    shapes: dict[str, tuple[int, ...]] = {}
    values: dict[str, torch.Tensor] = {}
    for node in graph.sweep(values):
        rule = rule_for(node)
        if isinstance(node, Input):
            values[node.name] = torch.zeros((1, *node.shape))
        else:
            xs = [values[i] for i in node.inputs]
            problem = broadcast_problem(node, [shapes[i] for i in node.inputs]) if node.broadcasts_inputs else None
            if problem:
                raise UnsupportedModelError(f"{graph.source}: the network is not a supported ReLU DAG:", [problem])
            if node.op == "pad" and node.mode == "circular":
                spatial = tuple(xs[0].shape[2:])
                for size, before, after in zip(spatial[::-1], node.begin[::-1], node.end[::-1]):
                    if max(before, after) > size:
                        raise UnsupportedModelError(
                            f"{graph.source}: node '{node.name}' (pad, circular) pads by {max(before, after)} an "
                            f"axis of size {size}: that wraps around more than once, which circular padding (torch's) "
                            "does not do; pad by at most the size of the axis"
                        )
            try:
                with torch.no_grad():
                    values[node.name] = rule.forward(node, xs, param, False)
            except (RuntimeError, ValueError, IndexError) as exc:
                in_shapes = ", ".join(str(tuple(v.shape[1:])) for v in xs)
                raise InputError(
                    f"{graph.source}: node '{node.name}' ({node.op}) cannot take input of shape {in_shapes} "
                    f"with its tensors: {str(exc).splitlines()[0]}"
                ) from None
            if any(graph[i].op == "pad" and graph[i].mode == "-inf" for i in node.inputs) and not bool(
                torch.isfinite(values[node.name]).all()
            ):
                raise UnsupportedModelError(
                    f"{graph.source}: node '{node.name}' ({node.op}) has a window made only of −inf padding: "
                    "its output would be −inf"
                )
        shapes[node.name] = tuple(values[node.name].shape[1:])
    return shapes
