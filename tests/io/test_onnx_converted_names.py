"""Old-opset ONNX files read through their conversion to opset 13: what is checked, reported and
refused is the file's own.

The converter to opset 13 adds nodes and values of its own (the Flatten and Reshape around an
opset-11 LogSoftmax) and makes Upsample (opsets 7 to 9) and Resize-10 a Resize whose defaults
compute something else. The independent check fetches values the file has (or, when it cannot,
compares the file's outputs end to end and says so); the report lists the file's operations; an
Upsample is read as the nearest upsampling it is, checked against onnxruntime on the original
file; a refusal names the file's node, operation and opset.
"""

from __future__ import annotations

import dataclasses
import io
import warnings

import fake_cuda
import numpy as np
import onnx
import pytest
import torch
from cli_support import assert_clean_exit, invoke, parse_single_json
from onnx import TensorProto, helper, numpy_helper
from test_onnx_opsets import assert_runtimes_agree, random_inputs, rescale_and_check, run_onnxruntime
from torch import nn

from pathcond_cli import verify
from pathcond_cli.engine.evaluate import forward
from pathcond_cli.io.formats.onnx_format import load_onnx, reference_outputs

pytestmark = pytest.mark.filterwarnings("ignore")


class MnistNet(nn.Module):
    """The classic PyTorch MNIST idiom: ``x.view(x.size(0), -1)`` and a LogSoftmax head."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3)
        self.fc = nn.Linear(3 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv(x))
        return torch.log_softmax(self.fc(x.view(x.size(0), -1)), dim=1)


class UpsamplingNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Conv2d(1, 4, 3, padding=1)
        self.second = nn.Conv2d(4, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(nn.functional.interpolate(torch.relu(self.first(x)), scale_factor=2, mode="nearest"))


def _conditioned(module: nn.Module) -> nn.Module:
    """``module`` with rows of very different sizes: a rescaling changes its tensors."""
    torch.manual_seed(0)
    for layer in module.modules():
        if isinstance(layer, nn.Linear | nn.Conv2d):
            layer.weight.data *= torch.logspace(-1, 1, layer.weight.shape[0]).view(-1, *[1] * (layer.weight.dim() - 1))
    return module.eval()


def _torch_export(module: nn.Module, shape: tuple[int, ...], opset: int) -> bytes:
    """The TorchScript exporter's file at ``opset``, its batch symbolic."""
    torch.manual_seed(0)
    buffer = io.BytesIO()
    with warnings.catch_warnings(), fake_cuda.suspended():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            _conditioned(module),
            (torch.zeros(2, *shape),),
            buffer,
            dynamo=False,
            opset_version=opset,
            input_names=["x"],
            output_names=["y"],
            dynamic_axes={"x": {0: "N"}, "y": {0: "N"}},
        )
    return buffer.getvalue()


def _file_values(path) -> set[str]:
    graph = onnx.load(str(path)).graph
    return {out for node in graph.node for out in node.output} | {v.name for v in graph.input}


# --------------------------------------------------------------------------- values the file has


@pytest.mark.parametrize("opset", [9, 11])
def test_a_softmax_head_of_an_old_opset_is_checked_on_the_files_own_values(opset, tmp_path):
    path = tmp_path / f"mnist{opset}.onnx"
    path.write_bytes(_torch_export(MnistNet(), (1, 6, 6), opset))
    model = load_onnx(path)
    # The converter wraps the LogSoftmax in Flatten/Reshape: the DAG still ends at the file's Gemm.
    gemm = next(node.output[0] for node in onnx.load(str(path)).graph.node if node.op_type == "Gemm")
    assert model.carried.dag_outputs == (gemm,)
    report = rescale_and_check(path, tmp_path)
    assert report["processing"]["post"] == ["LogSoftmax"]
    detail = report["verification"]["independent"]["detail"]
    assert "between the values the DAG outputs" in detail and "the file's outputs agree too" in detail

    pruned = tmp_path / "pruned.onnx"
    result = invoke("prune", path, "-o", pruned, "--sparsity", "0.3", "--json")
    assert_clean_exit(result, 0)
    verification = parse_single_json(result.stdout)["verification"]
    assert verification["independent"] == "passed", verification
    assert set(load_onnx(pruned).carried.dag_outputs) <= _file_values(pruned)


def test_a_dag_value_the_file_lacks_is_checked_end_to_end_and_said(tmp_path):
    path = tmp_path / "mnist11.onnx"
    path.write_bytes(_torch_export(MnistNet(), (1, 6, 6), 11))
    written = tmp_path / "rescaled.onnx"
    assert_clean_exit(invoke("rescale", path, "-o", written), 0)
    # A DAG output that only a converted model has: no runtime can fetch it from either file.
    model = load_onnx(path)
    model.carried = dataclasses.replace(model.carried, dag_outputs=("converter_only",))
    checked = verify.independent_check(model, written, 1e-5)
    assert checked["status"] == "passed", checked
    assert "compared end to end" in checked["detail"] and "'converter_only'" in checked["detail"]

    # The file's outputs end to end are what decides: a written file that computes something else fails.
    broken = onnx.load(str(written))
    bias = next(t for t in broken.graph.initializer if t.name == "fc.bias")
    # LogSoftmax ignores a shift of every logit: shift one only.
    values = numpy_helper.to_array(bias).copy()
    values[0] += 3.0
    bias.CopyFrom(numpy_helper.from_array(values, "fc.bias"))
    onnx.save(broken, str(written))
    assert verify.independent_check(model, written, 1e-5)["status"] == "failed"

    reread = load_onnx(written)
    reread.carried = dataclasses.replace(reread.carried, dag_outputs=("converter_only",))
    agreement = verify.independent_agreement(reread, written)
    assert agreement["status"] == "unavailable"
    assert "runs the written model" in agreement["detail"] and "'converter_only'" in agreement["detail"]


# --------------------------------------------------------------------------- Upsample and Resize-10


def _upsampling_file(path, op: str, opset: int, scales: list[float], mode: str = "nearest") -> None:
    """Conv → ReLU → an unnamed ``op`` (Upsample or Resize) → Conv, as old exporters write it."""
    rng = np.random.default_rng(1)
    stored = [
        numpy_helper.from_array(
            (rng.standard_normal((3, 1, 3, 3)) * np.logspace(-1, 1, 3)[:, None, None, None]).astype(np.float32), "K"
        ),
        numpy_helper.from_array(rng.standard_normal(3).astype(np.float32), "c"),
        numpy_helper.from_array(rng.standard_normal((2, 3, 3, 3)).astype(np.float32), "K2"),
        numpy_helper.from_array(rng.standard_normal(2).astype(np.float32), "c2"),
    ]
    if op == "Upsample" and opset < 9:
        resize = helper.make_node(op, ["r"], ["u"], mode=mode, scales=scales)
    else:
        stored.append(numpy_helper.from_array(np.array(scales, np.float32), "sc"))
        resize = helper.make_node(op, ["r", "sc"], ["u"], mode=mode)
    nodes = [
        helper.make_node("Conv", ["x", "K", "c"], ["a"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["a"], ["r"]),
        resize,
        helper.make_node("Conv", ["u", "K2", "c2"], ["y"], pads=[1, 1, 1, 1]),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, 5, 6])]
    output = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2, int(5 * scales[2]), int(6 * scales[3])])
    graph = helper.make_graph(nodes, "g", inputs, [output], stored)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=4), str(path))


@pytest.mark.parametrize(("op", "opset"), [("Upsample", 7), ("Upsample", 8), ("Upsample", 9), ("Resize", 10)])
# Scales of denominator 4: the converter's Resize (half_pixel, round_prefer_floor) reads other pixels.
@pytest.mark.parametrize("scales", [[1.0, 1.0, 2.0, 2.0], [1.0, 1.0, 1.25, 1.75]])
def test_an_old_nearest_upsampling_is_read_as_onnxruntime_computes_it(op, opset, scales, tmp_path):
    path = tmp_path / f"{op}{opset}.onnx"
    _upsampling_file(path, op, opset, scales)
    model = load_onnx(path)
    inputs = random_inputs(path)
    theirs = run_onnxruntime(path, inputs)[0]
    with torch.no_grad():
        ours = forward(model.graph, model.params, {"x": torch.from_numpy(inputs["x"]).double()})[model.graph.outputs[0]]
    assert ours.shape == theirs.shape
    assert np.abs(ours.numpy() - theirs).max() <= 1e-5 * np.abs(theirs).max()
    rescale_and_check(path, tmp_path)


@pytest.mark.parametrize(("op", "opset"), [("Upsample", 7), ("Upsample", 9), ("Resize", 10)])
def test_onnx_reference_evaluates_an_old_upsampling_as_onnxruntime_does(op, opset, tmp_path):
    path = tmp_path / f"{op}{opset}.onnx"
    _upsampling_file(path, op, opset, [1.0, 1.0, 1.25, 1.75])
    inputs = random_inputs(path)
    (expected,) = run_onnxruntime(path, inputs)
    (actual,) = reference_outputs(path, inputs)
    assert actual.shape == expected.shape
    assert np.abs(actual - expected).max() <= 1e-5 * np.abs(expected).max()


def test_torch_exports_of_opsets_9_and_10_with_an_upsampling_are_rescaled(tmp_path):
    for opset in (9, 10):
        path = tmp_path / f"upsampling{opset}.onnx"
        path.write_bytes(_torch_export(UpsamplingNet(), (1, 5, 6), opset))
        rescale_and_check(path, tmp_path)
        assert_runtimes_agree(path, tmp_path / f"{path.stem}.rescaled.onnx")


def test_an_old_linear_upsampling_is_refused_naming_the_files_node_op_and_opset(tmp_path):
    path = tmp_path / "linear.onnx"
    _upsampling_file(path, "Upsample", 9, [1.0, 1.0, 2.0, 2.0], mode="linear")
    assert_clean_exit(
        invoke("rescale", path),
        4,
        "node 'u' (Upsample of ONNX opset 9, read as Resize)",
        "coordinate_transformation_mode 'asymmetric'",
    )


def test_a_nearest_resize_10_that_shrinks_is_refused_naming_it(tmp_path):
    path = tmp_path / "shrinking.onnx"
    _upsampling_file(path, "Resize", 10, [1.0, 1.0, 0.5, 0.6])
    assert_clean_exit(invoke("rescale", path), 4, "node 'u' (Resize of ONNX opset 10)", "scales [1.0, 1.0, 0.5")


# --------------------------------------------------------------------------- opsets the converter refuses


def _mlp_file(path, opset: int, ir_version: int) -> None:
    rng = np.random.default_rng(2)
    stored = [
        numpy_helper.from_array(rng.standard_normal((3, 4)).astype(np.float32), "W1"),
        numpy_helper.from_array(rng.standard_normal(3).astype(np.float32), "b1"),
        numpy_helper.from_array(rng.standard_normal((2, 3)).astype(np.float32), "W2"),
        numpy_helper.from_array(rng.standard_normal(2).astype(np.float32), "b2"),
    ]
    nodes = [
        helper.make_node("Gemm", ["x", "W1", "b1"], ["g"], transB=1),
        helper.make_node("Relu", ["g"], ["h"]),
        helper.make_node("Gemm", ["h", "W2", "b2"], ["y"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])],
        stored,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir_version)
    onnx.save(model, str(path))


def test_an_opset_onnx_does_not_define_is_refused_naming_it(tmp_path):
    path = tmp_path / "opset99.onnx"
    _mlp_file(path, 99, ir_version=10)
    assert_clean_exit(invoke("rescale", path, "-o", tmp_path / "out.onnx"), 4, "opset 99", "does not exist")
    assert not (tmp_path / "out.onnx").exists()


def test_the_converters_refusal_names_the_node_it_fails_on_alone(tmp_path):
    # Opset 8 → 9 redefines BatchNormalization, Flatten and Gemm; only per-activation BatchNorm
    # (spatial=0) has no opset-9 form, and the converter's message names no operator.
    rng = np.random.default_rng(3)
    stored = [
        numpy_helper.from_array(rng.standard_normal((3, 2, 3, 3)).astype(np.float32), "K"),
        numpy_helper.from_array(rng.standard_normal(3).astype(np.float32), "c"),
        *(
            numpy_helper.from_array((np.abs(rng.standard_normal((3, 4, 4))) + 0.5).astype(np.float32), name)
            for name in ("g", "b", "m", "v")
        ),
        numpy_helper.from_array(rng.standard_normal((2, 48)).astype(np.float32), "W"),
        numpy_helper.from_array(rng.standard_normal(2).astype(np.float32), "wb"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "K", "c"], ["a"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["a", "g", "b", "m", "v"], ["bn"], spatial=0),
        helper.make_node("Relu", ["bn"], ["r"]),
        helper.make_node("Flatten", ["r"], ["f"], axis=1),
        helper.make_node("Gemm", ["f", "W", "wb"], ["y"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])],
        stored,
    )
    path = tmp_path / "spatial0.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 8)], ir_version=4), str(path))
    stderr = assert_clean_exit(
        invoke("rescale", path), 4, "operator 'BatchNormalization' of opset 8 (node 'bn')", "from opset 8 to 9"
    )
    assert "Flatten" not in stderr and "Gemm" not in stderr
