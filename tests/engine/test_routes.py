"""What each route supports, node type by node type.

Adding an op means one node class (its schema, in graph.py), one rule (its behaviour, in
rules.py) and one handler per importer (docs/adding-a-node-type.md). This table states, for every node class, the ONNX
op types and the torch operations that produce it, or why a route has none; the tests check
that the table covers exactly the node classes and that every entry is really registered.
"""

from __future__ import annotations

import json
import operator
from dataclasses import replace

import onnx_models
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from pathcond_cli.engine import graph as g
from pathcond_cli.engine.rules import RULES
from pathcond_cli.io.formats import fx_import, spec
from pathcond_cli.io.formats.fx_ops import (
    CALLS,
    FUNCTIONS,
    METHODS,
    MODULES,
    MOVEMENT_FUNCTIONS,
    MOVEMENT_METHODS,
    STORED_READERS,
)
from pathcond_cli.io.formats.onnx_format import load_onnx
from pathcond_cli.io.formats.onnx_ops import HANDLERS as ONNX_HANDLERS
from pathcond_cli.io.formats.spec import LAYER_TYPES

# node class -> (ONNX op types, torch modules / functions / Tensor methods); a string states a route's absence.
ROUTES = {
    g.Input: ("the graph's single input", "the traced forward's single argument"),
    g.Linear: (("Gemm", "MatMul"), (nn.Linear,)),
    g.Conv: (("Conv",), (nn.Conv1d, nn.Conv2d, nn.Conv3d)),
    g.ConvTranspose: (("ConvTranspose",), (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)),
    g.BatchNorm: (("BatchNormalization",), (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)),
    g.ReLU: (("Relu",), (nn.ReLU, F.relu, torch.relu, "relu")),
    g.LeakyReLU: (("LeakyRelu", "Abs"), (nn.LeakyReLU, F.leaky_relu)),
    g.PReLU: (("PRelu",), (nn.PReLU,)),
    g.Identity: (("Identity", "Dropout"), (nn.Identity, nn.Dropout, F.dropout)),
    g.Scale: (
        ("Mul", "Div", "Neg"),
        (operator.mul, operator.truediv, torch.mul, "mul", "div", operator.neg, torch.neg, "neg"),
    ),
    g.MaxPool: (("MaxPool", "ReduceMax"), (nn.MaxPool2d, F.max_pool2d)),
    g.AvgPool: (("AveragePool",), (nn.AvgPool2d, F.avg_pool2d)),
    g.AdaptiveAvgPool: (("GlobalAveragePool", "ReduceMean", "ReduceSum"), (nn.AdaptiveAvgPool2d, torch.mean, "mean")),
    g.Pad: (
        ("Pad", "Concat", "Slice"),
        (
            nn.ZeroPad2d,
            nn.ConstantPad2d,
            nn.ReflectionPad2d,
            nn.ReplicationPad2d,
            nn.CircularPad2d,
            nn.Conv2d,
            F.pad,
            "__getitem__",
            operator.getitem,
        ),
    ),
    g.Flatten: (("Flatten", "Reshape"), (nn.Flatten, torch.flatten, "view")),
    g.Add: (("Add", "Sum"), (operator.add, torch.add, "add")),
    g.Sub: (("Sub",), (operator.sub, torch.sub, "sub")),
    g.Concat: (("Concat",), (torch.cat,)),
    g.ChannelShuffle: (("Reshape", "Transpose"), (nn.ChannelShuffle, torch.channel_shuffle, "transpose")),
    g.ChannelSlice: (("Split", "Slice"), (torch.chunk, torch.split, "__getitem__", operator.getitem)),
    g.Upsample: (("Resize",), (nn.Upsample, F.interpolate)),
    g.ChannelGather: (("Reshape", "Transpose", "Slice"), (torch.reshape, torch.transpose, "view")),
    g.ChannelAffine: (("Mul", "Add"), (operator.mul, operator.add, "mul", "add")),
    g.ChannelBias: (("Add",), (operator.add, torch.add, "add")),
    g.Rearrange: (
        ("Transpose", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Gather", "Slice", "Concat"),
        (torch.reshape, torch.permute, torch.transpose, "view", "permute"),
    ),
    g.FixedFilter: (
        "none: an ONNX Conv's filter is an initializer, a parameter, so the Conv is a conv layer",
        (torch.conv1d, torch.conv2d, torch.conv3d),
    ),
}

_FX_REGISTRIES = (MODULES, FUNCTIONS, CALLS, METHODS, STORED_READERS)
_FX_MOVEMENTS = (*MOVEMENT_FUNCTIONS, *MOVEMENT_METHODS)


def test_the_table_lists_every_node_class():
    assert set(ROUTES) == set(g.NODE_TYPES.values())


@pytest.mark.parametrize("node_type", list(ROUTES), ids=lambda t: t.op)
def test_every_node_class_has_a_rule_a_spec_type_and_its_importers(node_type):
    assert node_type in RULES
    assert LAYER_TYPES[node_type.op].node is node_type
    onnx_ops, fx_ops = ROUTES[node_type]
    if isinstance(onnx_ops, str):
        assert onnx_ops
    else:
        assert all(op in ONNX_HANDLERS for op in onnx_ops), onnx_ops
    if isinstance(fx_ops, str):
        assert fx_ops
    else:
        assert all(any(op in registry for registry in _FX_REGISTRIES) or op in _FX_MOVEMENTS for op in fx_ops), fx_ops


@pytest.mark.parametrize("node_type", list(ROUTES), ids=lambda t: t.op)
def test_every_spec_field_has_a_validator(node_type):
    """Every hyper-parameter of a node class is declared with its validator (the spec's layer
    table is derived from them); tensor roles are the other fields."""
    from dataclasses import fields

    for f in fields(node_type):
        if f.name in ("name", "inputs"):
            continue
        assert "convert" in f.metadata or f.name in node_type.roles, (node_type.op, f.name)
    assert set(node_type.optional_roles) <= set(node_type.roles)
    assert set(node_type.per_axis_fields) <= {f.name for f in fields(node_type)}


@pytest.mark.parametrize("node_type", list(g.NODE_TYPES.values()), ids=lambda t: t.op)
def test_every_node_class_round_trips_through_a_spec_layer(node_type):
    """A node of every type (its fields' defaults) written as a JSON spec layer reads back equal:
    each field is written as its validator reads it."""
    inputs = () if node_type is g.Input else tuple(f"in{i}" for i in range(max(node_type.arity[0], 1)))
    node = node_type(name="n", inputs=inputs, **{role: f"n.{role}" for role in node_type.roles})
    if node_type is g.Input:
        node = replace(node, shape=(3, 4, 4))
    layer = json.loads(json.dumps(spec.spec_layer(node)))
    assert spec.node_from_layer(layer, source="test") == node


def test_graph_is_the_ground_floor():
    """graph.py (node classes and their schema) imports nothing from the rules."""
    import subprocess
    import sys

    code = "import sys, pathcond_cli.engine.graph; print('pathcond_cli.engine.rules' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        == "False"
    )


@pytest.mark.parametrize("name", ["cnn", "avgpool"])
def test_every_importer_builds_its_nodes_with_the_one_node_constructor(name, monkeypatch):
    built: set[str] = set()
    constructor = spec._parse_layer

    def recording(*args, **kwargs):
        node = constructor(*args, **kwargs)
        if node is not None:
            built.add(node.name)
        return node

    monkeypatch.setattr(spec, "_parse_layer", recording)
    module, shape = onnx_models.build(name), tuple(onnx_models.example_input(name).shape[1:])
    traced, _ = fx_import.graph_from_module(module, shape, source=name)
    assert {node.name for node in traced.nodes} <= built
    built.clear()
    onnx_graph = load_onnx(onnx_models.exported(name, "torchscript")).graph
    assert {node.name for node in onnx_graph.nodes} <= built
