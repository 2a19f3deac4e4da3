"""The timm families issue 27 left refused, rescaled end to end on both routes.

NASNet crops with negative pad widths (``nn.ZeroPad2d((-1, 1, -1, 1))``, ONNX Pad pads
``[0, 0, -1, -1, 0, 0, 1, 1]``) and by slicing. resnetblur's BlurPool2d convolves with a
``persistent=False`` filter buffer, a constant (a fixed filter on the fx route, a stored weight
in ONNX: test_parity.py states the relation). Each family is rescaled through
``rescale_module`` (torch.fx) and through its ONNX export by both exporters; the module keeps
its outputs, and the written file is verified by pathcond and by onnxruntime.
"""

from __future__ import annotations

import copy

import numpy as np
import onnxruntime
import pytest
import torch

import onnx_models
import timm_like
from pathcond_cli.api import module_model, rescale, rescale_module, save
from pathcond_cli.formats.onnx_format import load_onnx
from pathcond_cli.graph import Pad

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


def assert_export_rescaled_and_verified(module: torch.nn.Module, shape: tuple[int, ...], exporter: str,
                                        tmp_path) -> None:
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


# --------------------------------------------------------------------------- (c) fixed filters


def test_blur_module_is_rescaled_in_place_and_its_filter_buffer_kept():
    module = timm_like.randomized(timm_like.BlurNet(persistent=False))
    filt = module.aa.filt.clone()
    assert_module_rescaled_in_place(module, (3, 8, 8))
    rescale_module(module, (3, 8, 8))
    assert torch.equal(module.aa.filt, filt)


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_blur_export_is_rescaled_and_verified(exporter, tmp_path):
    assert_export_rescaled_and_verified(timm_like.randomized(timm_like.BlurNet(persistent=False)), (3, 8, 8),
                                        exporter, tmp_path)
