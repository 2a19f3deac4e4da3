"""Architecture specs: parsing, defaults, round trip, evaluation against torch, and errors."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml

from pathcond_cli.engine.evaluate import forward
from pathcond_cli.engine.graph import (
    NODE_TYPES,
    AdaptiveAvgPool,
    Conv,
    Identity,
    Input,
    Linear,
    MaxPool,
    node_attributes,
)
from pathcond_cli.errors import InputError, UnsupportedModelError
from pathcond_cli.io.formats.spec import (
    LAYER_TYPES,
    dump_spec,
    graph_from_spec,
    load_spec_file,
    spec_from_graph,
)

SOURCE = "arch.yaml"


def build(spec, **kwargs):
    return graph_from_spec(spec, source=SOURCE, **kwargs)


def spec_error(spec, error=InputError, **kwargs) -> str:
    with pytest.raises(error) as info:
        build(spec, **kwargs)
    return str(info.value)


# A residual block, a channel concat, every pooling type, dropout and leaky ReLU.
BRANCHY_SPEC = {
    "format_version": 1,
    "layers": [
        {"name": "x", "type": "input", "shape": [3, 8, 8]},
        {"name": "stem", "type": "conv", "padding": 1},
        {"name": "stem_bn", "type": "batchnorm"},
        {"name": "stem_relu", "type": "relu"},
        {"name": "b1", "type": "conv", "padding": 1},
        {"name": "b1_bn", "type": "batchnorm"},
        {"name": "b1_relu", "type": "relu"},
        {"name": "b2", "type": "conv", "padding": [1, 1], "bias": None},
        {"name": "residual", "type": "add", "inputs": ["b2", "stem_relu"]},
        {"name": "res_relu", "type": "relu"},
        {"name": "left", "type": "conv", "inputs": "res_relu"},
        {"name": "right", "type": "conv", "inputs": ["res_relu"], "padding": 1, "dilation": 1, "stride": 1},
        {"name": "cat", "type": "concat", "inputs": ["left", "right"]},
        {"name": "leaky", "type": "leaky_relu", "negative_slope": 0.2},
        {"name": "pool", "type": "maxpool", "kernel": 2},
        {"name": "avg", "type": "avgpool", "kernel": 3, "stride": 1, "padding": 1, "count_include_pad": False},
        {"name": "gap", "type": "global_avgpool"},
        {"name": "flat", "type": "flatten"},
        {"name": "drop", "type": "dropout", "p": 0.5},
        {"name": "fc", "type": "linear"},
    ],
    "outputs": ["fc"],
}


class BranchyNet(nn.Module):
    """The torch module BRANCHY_SPEC describes (attribute names give the default tensor keys)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.stem_bn = nn.BatchNorm2d(4)
        self.b1 = nn.Conv2d(4, 4, 3, padding=1)
        self.b1_bn = nn.BatchNorm2d(4)
        self.b2 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.left = nn.Conv2d(4, 2, 1)
        self.right = nn.Conv2d(4, 3, 3, padding=1)
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        stem = F.relu(self.stem_bn(self.stem(x)))
        branch = self.b2(F.relu(self.b1_bn(self.b1(stem))))
        out = F.relu(branch + stem)
        out = F.leaky_relu(torch.cat([self.left(out), self.right(out)], 1), 0.2)
        out = F.avg_pool2d(F.max_pool2d(out, 2), 3, 1, 1, count_include_pad=False)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))


def randomised(module: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    return module.eval()


def test_branchy_spec_computes_the_torch_module():
    module = randomised(BranchyNet())
    graph = build(BRANCHY_SPEC)
    params = {k: v.detach().double() for k, v in module.state_dict().items()}
    graph.check_parameters(params)
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    expected = module.double()(x)
    got = forward(graph, params, x)["fc"]
    assert (got - expected).abs().max() / expected.abs().max() <= 1e-6


def test_round_trip_gives_an_equal_graph_and_a_fixed_point():
    graph = build(BRANCHY_SPEC)
    spec = spec_from_graph(graph)
    again = build(json.loads(dump_spec(spec)))
    assert again == graph
    assert spec_from_graph(again) == spec


def test_every_node_type_and_field_is_expressible():
    for op, node_type in NODE_TYPES.items():
        assert op in LAYER_TYPES
        layer_type = LAYER_TYPES[op]
        assert layer_type.node is node_type
        accepted = {*layer_type.hyper, *layer_type.keys}
        assert set(node_attributes(node_type(name="n", inputs=()))) == accepted, op


def test_defaults_inputs_keys_outputs_and_aliases():
    graph = build(
        {
            "layers": [
                {"name": "x", "type": "input", "shape": [2, 16]},
                {"name": "conv", "type": "conv", "stride": 2},
                {"name": "pool", "type": "maxpool", "kernel": 2},
                {"name": "gap", "type": "global_avgpool"},
                {"name": "flat", "type": "flatten"},
                {"name": "drop", "type": "dropout"},
                {"name": "fc", "type": "linear", "bias": None, "weight": "head.w"},
            ]
        }
    )
    assert graph.outputs == ("fc",)
    conv = graph["conv"]
    assert isinstance(conv, Conv) and conv.inputs == ("x",)
    assert (conv.weight, conv.bias, conv.stride, conv.padding, conv.dilation) == (
        "conv.weight",
        "conv.bias",
        (2,),
        (0,),
        (1,),
    )
    pool = graph["pool"]
    assert isinstance(pool, MaxPool) and pool.kernel == pool.stride == (2,) and pool.padding == (0,)
    assert isinstance(graph["gap"], AdaptiveAvgPool) and graph["gap"].output_size == (1,)
    assert isinstance(graph["drop"], Identity)
    fc = graph["fc"]
    assert isinstance(fc, Linear) and (fc.weight, fc.bias) == ("head.w", None)


def test_scalars_expand_to_the_spatial_rank_of_the_input():
    graph = build(
        {
            "layers": [
                {"name": "x", "type": "input", "shape": [3, 9, 9]},
                {"name": "conv", "type": "conv", "stride": 2, "padding": [1, 0]},
                {"name": "pool", "type": "avgpool", "kernel": 3, "stride": [1, 2]},
            ]
        }
    )
    assert graph["conv"].stride == (2, 2) and graph["conv"].padding == (1, 0)
    assert graph["pool"].kernel == (3, 3) and graph["pool"].stride == (1, 2)


def test_input_shape_argument_overrides_the_spec():
    spec = {"layers": [{"name": "x", "type": "input"}, {"name": "fc", "type": "linear"}]}
    assert build(spec, input_shape=(7,)).inputs[0].shape == (7,)
    with_shape = {"layers": [{"name": "x", "type": "input", "shape": [3]}, {"name": "fc", "type": "linear"}]}
    assert build(with_shape, input_shape=[5]).inputs[0] == Input(name="x", shape=(5,))


def test_yaml_and_json_files_load_alike(tmp_path):
    yaml_path = tmp_path / "net.yaml"
    yaml_path.write_text(
        "# comments are allowed\n"
        "layers:\n"
        "  - {name: x, type: input, shape: [4]}\n"
        "  - {name: fc1, type: linear}\n"
        "  - {name: bn, type: batchnorm, eps: 1e-3}\n"  # YAML 1.1 reads 1e-3 as a string
        "  - {name: act, type: relu}\n"
        "  - {name: fc2, type: linear}\n"
    )
    json_path = tmp_path / "net.json"
    json_path.write_text(json.dumps(yaml.safe_load(yaml_path.read_text())))
    from_yaml = build(load_spec_file(yaml_path))
    assert from_yaml == build(load_spec_file(json_path))
    assert from_yaml["bn"].eps == 1e-3


def test_unreadable_spec_files_are_input_errors(tmp_path):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("layers: [unclosed\n")
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{"layers": [}')
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("just a string\n")
    for path in (bad_yaml, bad_json, scalar, tmp_path / "missing.yaml", tmp_path):
        with pytest.raises(InputError, match=str(path.name)):
            load_spec_file(path)


def test_all_layer_problems_are_reported_at_once():
    message = spec_error(
        {
            "layers": [
                {"name": "x", "type": "input", "shape": [3, 8, 8]},
                {"name": "act", "type": "gelu"},
                {"name": "pool", "type": "maxpool"},
                {"name": "conv", "type": "conv", "stride": 0, "strides": 2},
                {"name": "lrelu", "type": "leaky_relu", "negative_slope": "steep"},
                {"name": "fc", "type": "linear", "bias": 3},
            ]
        }
    )
    assert SOURCE in message
    assert "layer 'act' has type 'gelu': not positively homogeneous" in message
    assert "layer 'pool' (maxpool): missing required field 'kernel'" in message
    assert "layer 'conv' (conv): 'stride' must be an integer >= 1" in message
    assert "layer 'conv' (conv): unknown field 'strides'" in message
    assert "layer 'lrelu' (leaky_relu): 'negative_slope' must be a finite number" in message
    assert "layer 'fc' (linear): 'bias' must be a tensor key or null" in message


def test_top_level_problems():
    assert "'layers' must be a non-empty list" in spec_error({"layers": []})
    assert "format_version 2" in spec_error(
        {"format_version": 2, "layers": [{"name": "x", "type": "input", "shape": [1]}]}
    )
    assert "unknown top-level key 'layer'" in spec_error({"layer": []})
    message = spec_error({"layers": [{"name": "x", "type": "input", "shape": [1]}, {"type": "relu"}, 5]})
    assert "layer #2 needs a non-empty string 'name'" in message and "layer #3 must be a mapping" in message


def test_missing_input_shape_and_misplaced_inputs():
    message = spec_error({"layers": [{"name": "x", "type": "input"}, {"name": "fc", "type": "linear"}]})
    assert "layer 'x' (input) needs a 'shape'" in message and "--input-shape" in message
    message = spec_error({"layers": [{"name": "x", "type": "input", "inputs": "y"}, {"name": "fc", "type": "linear"}]})
    assert message.count("\n  - ") == 1 and "layer 'x' (input): an input layer takes no 'inputs'" in message
    assert "first layer has no previous layer" in spec_error({"layers": [{"name": "r", "type": "relu"}]})
    message = spec_error(
        {"layers": [{"name": "x", "type": "input", "shape": [2]}, {"name": "bn", "type": "batchnorm", "inputs": []}]}
    )
    assert "layer 'bn' (batchnorm): 'inputs' must be a layer name or a non-empty list" in message


def test_rank_problems_name_the_layer():
    message = spec_error(
        {
            "layers": [
                {"name": "x", "type": "input", "shape": [3, 8, 8]},
                {"name": "conv", "type": "conv", "stride": [1, 1, 1]},
                {"name": "fc", "type": "linear"},
            ]
        }
    )
    assert "layer 'conv' (conv): 'stride' has 3 values, but its input has 2 spatial axes" in message
    assert "layer 'fc' (linear) reads 'conv', which has 2 spatial axes; put a flatten layer before it" in message
    message = spec_error(
        {"layers": [{"name": "x", "type": "input", "shape": [8]}, {"name": "pool", "type": "maxpool", "kernel": 2}]}
    )
    assert "layer 'pool' (maxpool) needs an input with 1, 2 or 3 spatial axes" in message


def test_duplicate_dangling_and_cyclic_layers():
    x = {"name": "x", "type": "input", "shape": [4]}
    message = spec_error({"layers": [x, {"name": "fc", "type": "linear"}, {"name": "fc", "type": "linear"}]})
    assert SOURCE in message and "two nodes are named 'fc'" in message
    message = spec_error({"layers": [x, {"name": "fc", "type": "linear", "inputs": "nowhere"}]})
    assert SOURCE in message and "node 'fc' (linear) reads 'nowhere'" in message
    message = spec_error(
        {
            "layers": [x, {"name": "a", "type": "relu", "inputs": "b"}, {"name": "b", "type": "relu", "inputs": "a"}],
            "outputs": ["b"],
        }
    )
    assert SOURCE in message and "cycle" in message
    assert "output 'nope' names no node" in spec_error({"layers": [x], "outputs": "nope"})


def test_structural_problems_from_the_graph_name_the_spec():
    message = spec_error(
        {
            "layers": [
                {"name": "x", "type": "input", "shape": [4]},
                {"name": "dead", "type": "relu"},
                {"name": "out", "type": "relu", "inputs": ["x"]},
            ]
        },
        error=UnsupportedModelError,
    )
    assert SOURCE in message and "node 'dead' (relu) does not reach any output" in message


def test_missing_and_misshapen_tensors_are_named():
    graph = build({"layers": [{"name": "x", "type": "input", "shape": [4]}, {"name": "fc", "type": "linear"}]})
    with pytest.raises(InputError, match="needs tensor 'fc.bias'"):
        graph.check_parameters({"fc.weight": torch.ones(2, 4)})
    with pytest.raises(InputError, match=r"tensor 'fc.weight' \(weight\) has shape \(8,\), expected rank 2"):
        graph.check_parameters({"fc.weight": torch.ones(8), "fc.bias": torch.ones(2)})


UPSAMPLE_SPEC = {
    "format_version": 1,
    "layers": [
        {"name": "x", "type": "input", "shape": [2, 3, 4]},
        {"name": "near", "type": "upsample", "scale_factor": 2},
        {"name": "lin", "type": "upsample", "inputs": ["x"], "mode": "linear", "size": [6, 8], "align_corners": True},
        {"name": "frac", "type": "upsample", "inputs": ["x"], "mode": "linear", "scale_factor": [1.5, 2]},
        {"name": "down", "type": "upsample", "inputs": ["frac"], "size": [6, 8], "scale_factor": None},
        {"name": "cat", "type": "concat", "inputs": ["near", "lin", "down"]},
    ],
    "outputs": ["cat"],
}


def test_upsample_layers_compute_torch_interpolate_and_round_trip():
    graph = build(UPSAMPLE_SPEC)
    assert graph_from_spec(spec_from_graph(graph), source=SOURCE) == graph
    x = torch.randn(3, 2, 3, 4, dtype=torch.float64)
    frac = F.interpolate(x, scale_factor=(1.5, 2.0), mode="bilinear", align_corners=False)
    expected = torch.cat(
        [
            F.interpolate(x, scale_factor=2.0),
            F.interpolate(x, size=(6, 8), mode="bilinear", align_corners=True),
            F.interpolate(frac, size=(6, 8)),
        ],
        dim=1,
    )
    assert torch.equal(forward(graph, {}, x)["cat"], expected)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"mode": "bicubic", "scale_factor": 2}, "'mode' must be one of 'nearest', 'linear'"),
        ({"scale_factor": 0}, "'scale_factor' must be a number > 0"),
        ({"size": [4, 4], "scale_factor": 2}, "exactly one of 'size' and 'scale_factor'"),
        ({}, "exactly one of 'size' and 'scale_factor'"),
        ({"size": [4, 4, 4]}, "3 resize values for 2 spatial axes"),
    ],
)
def test_upsample_problems_name_the_layer(fields, message):
    from pathcond_cli.engine.evaluate import infer_shapes

    spec = {
        "format_version": 1,
        "layers": [{"name": "x", "type": "input", "shape": [1, 3, 4]}, {"name": "up", "type": "upsample", **fields}],
    }
    with pytest.raises(InputError) as info:
        infer_shapes(build(spec), {})
    assert message in str(info.value) and "'up'" in str(info.value)
