"""Issue 19's ops: reflect/replicate/circular padding, −inf padding before max pooling, a
per-channel scale and shift with no Linear/Conv before it, and sums with broadcasting.

The brute-force oracle checks (groups, diag(G), path count, function-preserving rescaling) are
in test_ops_oracle.py (conftest.NEW_OPS), the fx/spec/ONNX parity in test_parity.py. Here: the
ONNX files of both exporters compute the module and, rescaled, compute the same under
onnxruntime; the issue's broadcast example; and what is refused, with the reason.
"""

from __future__ import annotations

import math

import onnx
import ops_models
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from onnx_models import EXPORTERS, export
from test_onnx_format import TOLERANCE, only_output, random_rescaling, relative_error

from pathcond_cli.engine.graph import ChannelAffine, ChannelBias, Pad, Rearrange
from pathcond_cli.engine.groups import build_groups
from pathcond_cli.errors import InputError, UnsupportedModelError
from pathcond_cli.io.formats.onnx_format import load_onnx, write_onnx
from pathcond_cli.io.formats.spec import graph_from_spec
from pathcond_cli.module_route import module_model
from pathcond_cli.rescaling import rescale

pytestmark = pytest.mark.filterwarnings("ignore")

NEW_MODELS = ("padding_modes", "padded_maxpool", "repvgg_block", "broadcast_add")


@pytest.mark.parametrize("name, exporter", [(n, e) for n in NEW_MODELS for e in EXPORTERS])
def test_onnx_graph_computes_the_module_and_its_rescaled_file_the_same(name, exporter, tmp_path):
    import onnxruntime

    module, shape = ops_models.build(name)
    x = torch.randn((3, *shape), generator=torch.Generator().manual_seed(4))
    data = export(module, x, exporter)
    model = load_onnx(data)
    with torch.no_grad():
        expected = module.double()(x.double())
    assert relative_error(only_output(model, x), expected) <= TOLERANCE
    changed = random_rescaling(model)
    if name == "repvgg_block":
        affine = [n for n in model.graph.nodes if isinstance(n, ChannelAffine)]
        assert len(affine) == 3 and sum(n.bias is not None for n in affine) == 2
        assert all(n.weight in changed for n in affine)
    destination = tmp_path / "rescaled.onnx"
    write_onnx(model, changed, destination, {})
    outputs = [
        session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
        for session in (onnxruntime.InferenceSession(data), onnxruntime.InferenceSession(str(destination)))
    ]
    assert relative_error(outputs[0], expected) <= TOLERANCE
    assert relative_error(outputs[1], outputs[0]) <= TOLERANCE


def test_circular_padding_written_as_slices_and_concat_is_a_pad():
    """The TorchScript exporter writes circular padding as Slices and Concats along the
    spatial axes: that data movement is recognised as the pad it is."""
    module, shape = ops_models.build("padding_modes")
    data = export(module, torch.randn((2, *shape)), "torchscript")
    assert not any(
        n.op_type == "Pad" and any(a.name == "mode" and a.s == b"wrap" for a in n.attribute)
        for n in onnx.load_from_string(data).graph.node
    )
    modes = sorted(n.mode for n in load_onnx(data).graph.nodes if isinstance(n, Pad))
    assert modes == ["circular", "circular", "reflect", "reflect", "replicate"]


class _FourPlusOne(nn.Module):
    """Issue 19: a 4-channel conv added to a 1-channel conv."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(1, 2, 1)
        self.wide, self.narrow = nn.Conv2d(2, 4, 1), nn.Conv2d(2, 1, 1)
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        x = F.relu(self.stem(x))
        return self.head(F.relu(self.wide(x) + self.narrow(x))).flatten(1)


def test_a_broadcast_channel_ties_every_channel_it_feeds_and_rescaling_verifies():
    torch.manual_seed(0)
    model = module_model(_FourPlusOne().eval(), (1, 3, 3))
    groups = build_groups(model.graph, model.params)
    # stem's 2 channels, and one group for the sum: wide's 4 channels all tied to narrow's one.
    assert groups.num_free == 3
    result = rescale(model, device="cpu")
    assert result.verification is not None and result.changed


def _spec(*layers, shape=(1, 4, 4)):
    return {"layers": [{"name": "x", "type": "input", "shape": list(shape)}, *layers]}


def test_sums_of_different_ranks_or_unbroadcastable_shapes_are_refused_by_node():
    conv = lambda name: {"name": name, "type": "conv", "inputs": "x", "bias": None}  # noqa: E731
    params = {"a.weight": torch.randn(4, 1, 1, 1), "b.weight": torch.randn(2, 1, 1, 1)}
    spec = _spec(conv("a"), conv("b"), {"name": "s", "type": "add", "inputs": ["a", "b"]})
    with pytest.raises(
        UnsupportedModelError, match=r"node 's' \(add\) combines tensors of shapes \(4, 4, 4\), \(2, 4, 4\)"
    ):
        build_groups(graph_from_spec(spec, source="spec"), params)
    params = {"a.weight": torch.randn(4, 1, 1, 1)}
    spec = _spec(conv("a"), {"name": "f", "type": "flatten"}, {"name": "s", "type": "add", "inputs": ["a", "f"]})
    with pytest.raises(UnsupportedModelError, match="must have one rank"):
        build_groups(graph_from_spec(spec, source="spec"), params)


def test_neg_inf_padding_read_by_anything_but_max_pooling_is_refused():
    spec = _spec(
        {"name": "p", "type": "pad", "begin": 1, "end": 1, "mode": "-inf"}, {"name": "c", "type": "conv", "bias": None}
    )
    with pytest.raises(UnsupportedModelError, match=r"node 'p' \(pad, mode -inf\) must be read by max-pooling only"):
        graph_from_spec(spec, source="spec")


def test_a_max_pool_window_made_only_of_neg_inf_padding_is_refused():
    spec = _spec(
        {"name": "p", "type": "pad", "begin": 2, "end": 0, "mode": "-inf"},
        {"name": "m", "type": "maxpool", "kernel": 2},
    )
    with pytest.raises(UnsupportedModelError, match="node 'm' \\(maxpool\\) has a window made only of −inf padding"):
        build_groups(graph_from_spec(spec, source="spec"), {})


def test_a_spec_pad_mode_is_checked():
    with pytest.raises(InputError, match="'mode' must be one of 'zeros', 'reflect', 'replicate', 'circular', '-inf'"):
        graph_from_spec(_spec({"name": "p", "type": "pad", "mode": "constant"}), source="spec")


def test_a_channel_affine_tensor_must_hold_one_value_per_channel():
    spec = _spec({"name": "c", "type": "conv", "bias": None}, {"name": "a", "type": "channel_affine", "bias": None})
    params = {"c.weight": torch.randn(4, 1, 1, 1), "a.weight": torch.randn(1, 1, 2, 2)}  # 4 values, not per channel
    with pytest.raises(InputError, match=r"a tensor of shape \(1, 1, 2, 2\) does not hold one value per channel of 4"):
        build_groups(graph_from_spec(spec, source="spec"), params)


class _ConstantPad(nn.Module):
    def __init__(self, value: float):
        super().__init__()
        # The pad lies between two layers: after the last one it would be post-processing.
        self.conv, self.fc, self.value = nn.Conv2d(1, 2, 1), nn.Linear(8, 3), value

    def forward(self, x):
        return self.fc(F.max_pool2d(F.pad(self.conv(x), (1, 1, 1, 1), value=self.value), 2).flatten(1))


@pytest.mark.parametrize("route", ["fx", *EXPORTERS])
def test_a_non_zero_constant_pad_is_refused_as_not_homogeneous(route):
    module = _ConstantPad(1.5).eval()
    with pytest.raises(UnsupportedModelError, match="padding with the constant .*1.5.* is not positively homogeneous"):
        if route == "fx":
            module_model(module, (1, 3, 3))
        else:
            load_onnx(export(module, torch.randn(2, 1, 3, 3), route))


@pytest.mark.parametrize("route", ["fx", *EXPORTERS])
def test_neg_inf_padding_before_max_pooling_is_accepted(route):
    module = _ConstantPad(-math.inf).eval()
    model = (
        module_model(module, (1, 3, 3)) if route == "fx" else load_onnx(export(module, torch.randn(2, 1, 3, 3), route))
    )
    assert [n.mode for n in model.graph.nodes if isinstance(n, Pad)] == ["-inf"]


class _ShiftAlone(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 1)
        self.shift = nn.Parameter(torch.ones(2, 1, 1))
        self.fc = nn.Linear(18, 2)

    def forward(self, x):
        return self.fc(F.relu(self.conv(x) + self.shift).flatten(1))


def test_a_stored_shift_without_a_scale_is_a_channel_bias_on_fx_and_onnx():
    """A per-channel tensor added after a conv that has its own bias: a bias of its own on fixed
    edges, the same layer on every route."""
    module = _ShiftAlone().eval()
    models = [module_model(module, (1, 3, 3))] + [
        load_onnx(export(module, torch.randn(2, 1, 3, 3), exporter)) for exporter in EXPORTERS
    ]
    for model in models:
        assert [n.bias for n in model.graph.nodes if isinstance(n, ChannelBias)] == ["shift"]
        assert build_groups(model.graph, model.params).num_free == 2


@pytest.mark.parametrize("mode", ["circular", "reflect", "replicate"])
def test_an_index_map_that_copies_pixels_is_the_pad_torch_computes(mode):
    from pathcond_cli.io.formats.movement import movement_layer

    index = torch.arange(2 * 4 * 5, dtype=torch.float64).reshape(1, 2, 4, 5)
    padded = F.pad(index, (2, 1, 0, 3), mode=mode).long()
    assert movement_layer((2, 4, 5), padded) == {"type": "pad", "begin": (0, 2), "end": (3, 1), "mode": mode}


def test_an_index_map_no_torch_pad_computes_is_the_copy_it_is():
    from pathcond_cli.io.formats.movement import movement_layer

    index = torch.arange(2 * 4 * 4).reshape(1, 2, 4, 4)
    wrapped = torch.cat([index] * 4, dim=2)  # a wrap longer than the axis: no pad torch computes
    layer = movement_layer((2, 4, 4), wrapped)
    # A wrap is a strided view (stride 0 across the copies): a few numbers, not one per element.
    assert layer == {"type": "rearrange", "shape": (2, 16, 4), "sizes": (2, 4, 16), "strides": (16, 0, 1), "offset": 0}
    assert torch.equal(Rearrange("r", ("x",), **{k: v for k, v in layer.items() if k != "type"}).index, wrapped[0])


# -- one tensor in two roles of a node is named once; circular padding beyond an axis is unsupported


def test_one_tensor_as_weight_and_bias_of_one_node_names_that_node_once():
    spec = _spec(
        {"name": "c", "type": "conv", "bias": None}, {"name": "a", "type": "channel_affine", "weight": "s", "bias": "s"}
    )
    with pytest.raises(UnsupportedModelError) as caught:
        graph_from_spec(spec, source="spec")
    message = str(caught.value)
    assert "tensor 's' is both the weight and the bias of node 'a' (channel_affine)" in message
    assert "node 'a' and node 'a'" not in message


def test_circular_padding_wider_than_its_axis_is_unsupported_not_unreadable():
    spec = _spec(
        {"name": "p", "type": "pad", "begin": 5, "end": 5, "mode": "circular"},
        {"name": "c", "type": "conv", "bias": None},
    )
    with pytest.raises(
        UnsupportedModelError,
        match=r"node 'p' \(pad, circular\) pads by 5 an axis of size 4: that wraps "
        "around more than once",
    ):
        build_groups(graph_from_spec(spec, source="spec"), {"c.weight": torch.randn(2, 1, 1, 1)})
