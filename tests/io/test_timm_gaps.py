"""The timm families issue 27 left refused, rescaled end to end on both routes.

NASNet crops with negative pad widths (``nn.ZeroPad2d((-1, 1, -1, 1))``, ONNX Pad pads
``[0, 0, -1, -1, 0, 0, 1, 1]``) and by slicing. MobileOne's train-time stem adds the number 0
(an ONNX ``Add`` of a Constant), and a stored per-channel constant added to a sum of branches
is a bias of its own (a ChannelBias), written back rescaled. resnetblur's BlurPool2d convolves with a
``persistent=False`` filter buffer, a constant (a fixed filter on the fx route, a stored weight
in ONNX: test_parity.py states the relation). Each family is rescaled through
``rescale_module`` (torch.fx) and through its ONNX export by both exporters; the module keeps
its outputs, and the written file is verified by pathcond and by onnxruntime.
"""

from __future__ import annotations

import copy

import numpy as np
import onnx
import onnx_models
import onnxruntime
import pytest
import timm_like
import torch

from pathcond_cli.engine.graph import ChannelBias, Identity, Pad
from pathcond_cli.errors import UnsupportedModelError
from pathcond_cli.io.formats.onnx_format import load_onnx
from pathcond_cli.model_files import save
from pathcond_cli.module_route import module_model, rescale_module
from pathcond_cli.rescaling import rescale

pytestmark = pytest.mark.filterwarnings("ignore")

EXPORTERS = ("torchscript", "dynamo")


def _example(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    return torch.randn((3, *shape), generator=torch.Generator().manual_seed(seed))


def _relative_error(actual, expected) -> float:
    actual, expected = (torch.as_tensor(np.asarray(t), dtype=torch.float64) for t in (actual, expected))
    return float((actual - expected).abs().max() / expected.abs().max())


def assert_module_rescaled_in_place(module: torch.nn.Module, shape: tuple[int, ...]) -> None:
    """``rescale_module`` changes the module's tensors and not its outputs."""
    module = copy.deepcopy(module)
    x = _example(shape, seed=1)
    with torch.no_grad():
        expected = module(x)
    before = {key: tensor.clone() for key, tensor in module.state_dict().items()}
    result = rescale_module(module, shape)
    assert result.verification.passed
    assert any(not torch.equal(before[key], tensor) for key, tensor in module.state_dict().items())
    with torch.no_grad():
        assert _relative_error(module(x), expected) < 1e-5


def assert_export_rescaled_and_verified(
    module: torch.nn.Module, shape: tuple[int, ...], exporter: str, tmp_path
) -> None:
    """The export is read, rescaled and written; pathcond and onnxruntime verify the file, and
    onnxruntime runs the original export and the written file to the module's outputs."""
    data = onnx_models.export(module, _example(shape), exporter)
    result = rescale(load_onnx(data, name="model.onnx"), device="cpu")
    assert result.changed
    destination = tmp_path / "model.pathcond.onnx"
    verification = save(result, destination)
    assert verification.passed
    assert verification.independent["runtime"] == "onnxruntime" and verification.independent["status"] == "passed"
    x = _example(shape, seed=2)
    with torch.no_grad():
        expected = module(x)
    for source in (data, str(destination)):
        session = onnxruntime.InferenceSession(source, providers=["CPUExecutionProvider"])
        (output,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
        assert _relative_error(output, expected) < 1e-5


# --------------------------------------------------------------------------- (a) crops


def test_crops_are_pads_of_negative_width_on_both_routes():
    module, shape = timm_like.TIMM_LIKE["timm_nasnet_crop"]()
    fx = sorted((n.begin, n.end, n.mode) for n in module_model(module, shape).graph.nodes if isinstance(n, Pad))
    assert fx == [((-1, -1), (1, 1), "zeros"), ((-1, 0), (0, -1), "zeros"), ((1, -1), (-2, 2), "reflect")]
    for exporter in EXPORTERS:
        graph = load_onnx(onnx_models.export(module, _example(shape), exporter)).graph
        assert sorted((n.begin, n.end, n.mode) for n in graph.nodes if isinstance(n, Pad)) == fx


def test_nasnet_crop_module_is_rescaled_in_place():
    assert_module_rescaled_in_place(*timm_like.TIMM_LIKE["timm_nasnet_crop"]())


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_nasnet_crop_export_is_rescaled_and_verified(exporter, tmp_path):
    assert_export_rescaled_and_verified(*timm_like.TIMM_LIKE["timm_nasnet_crop"](), exporter, tmp_path)


# --------------------------------------------------------------------------- (b) constants added


def test_mobileone_constants_are_an_identity_and_a_channel_bias_on_both_routes():
    module, shape = timm_like.TIMM_LIKE["timm_mobileone"]()
    fx = module_model(module, shape).graph
    assert [node.bias for node in fx.nodes if isinstance(node, ChannelBias)] == ["shift"]
    assert sum(isinstance(node, Identity) for node in fx.nodes) == 1  # the stem's ``out += 0``
    data = onnx_models.export(module, _example(shape), "torchscript")
    added = [
        n
        for n in onnx.load_from_string(data).graph.node
        if n.op_type == "Add" and any(v.startswith("/stem/Constant") for v in n.input)
    ]
    assert len(added) == 1  # the graph constant in the stem
    graph = load_onnx(data).graph
    assert [node.bias for node in graph.nodes if isinstance(node, ChannelBias)] == ["shift"]
    assert any(isinstance(node, Identity) and node.name == added[0].name for node in graph.nodes)


def test_mobileone_module_is_rescaled_in_place():
    assert_module_rescaled_in_place(*timm_like.TIMM_LIKE["timm_mobileone"]())


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_mobileone_export_is_rescaled_and_verified_with_its_shift_stored_rescaled(exporter, tmp_path):
    module, shape = timm_like.TIMM_LIKE["timm_mobileone"]()
    assert_export_rescaled_and_verified(module, shape, exporter, tmp_path)
    (written,) = [t for t in onnx.load(str(tmp_path / "model.pathcond.onnx")).graph.initializer if t.name == "shift"]
    shift = torch.from_numpy(onnx.numpy_helper.to_array(written).copy())
    assert shift.shape == module.shift.shape and not torch.equal(shift, module.shift.detach())


class _NumberAdded(torch.nn.Module):
    """The number is added between two layers: after the last one it would be ONNX post-processing."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 1)
        self.head = torch.nn.Conv2d(4, 2, 1)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x) + 1.5))


def test_a_constant_that_cannot_rescale_with_its_channel_is_refused_on_both_routes():
    """A number added in forward is no stored tensor; its ONNX export stores one value for all
    four channels, which would have to rescale by four factors at once."""
    module = _NumberAdded().eval()
    with pytest.raises(UnsupportedModelError, match="adding the number 1.5 is not supported"):
        module_model(module, (3, 4, 4))
    for exporter in EXPORTERS:
        with pytest.raises(UnsupportedModelError, match="one value per channel"):
            load_onnx(onnx_models.export(module, _example((3, 4, 4)), exporter))


# --------------------------------------------------------------------------- (c) fixed filters


def test_blur_module_is_rescaled_in_place_and_its_filter_buffer_kept():
    module = timm_like.randomized(timm_like.BlurNet(persistent=False))
    filt = module.aa.filt.clone()
    assert_module_rescaled_in_place(module, (3, 8, 8))
    rescale_module(module, (3, 8, 8))
    assert torch.equal(module.aa.filt, filt)


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_blur_export_is_rescaled_and_verified(exporter, tmp_path):
    assert_export_rescaled_and_verified(
        timm_like.randomized(timm_like.BlurNet(persistent=False)), (3, 8, 8), exporter, tmp_path
    )
