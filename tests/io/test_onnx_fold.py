"""Folding run-time shape arithmetic (pathcond_cli.io.formats.onnx_fold) on hand-built graphs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from test_onnx_format import ORT_READABLE_IR

from pathcond_cli.engine.evaluate import forward
from pathcond_cli.errors import UnsupportedModelError
from pathcond_cli.io.formats.onnx_fold import fold_shape_arithmetic
from pathcond_cli.io.formats.onnx_format import load_onnx
from pathcond_cli.io.formats.onnx_read import infer_shapes


def _shuffle_view(extra_nodes=(), output="shuffled") -> onnx.ModelProto:
    """ShuffleNet's channel shuffle of x (N, 4, 3) as TorchScript exports it: Relu, Reshape to
    (N, 2, Shape[1] / 2, 3), swap axes 1 and 2, Reshape back to (N, -1, 3)."""
    ints = lambda name, values: numpy_helper.from_array(np.array(values, dtype=np.int64), name)  # noqa: E731
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Shape", ["r"], ["shape"]),
        helper.make_node("Gather", ["shape", "zero"], ["batch"], axis=0),
        helper.make_node("Gather", ["shape", "one"], ["channels"], axis=0),
        helper.make_node("Div", ["channels", "two"], ["half"]),
        helper.make_node("Concat", ["batch", "two", "half", "three"], ["target"], axis=0),
        helper.make_node("Reshape", ["r", "target"], ["y"]),
        helper.make_node("Transpose", ["y"], ["swapped"], perm=[0, 2, 1, 3]),
        helper.make_node("Concat", ["batch", "minus_one", "three"], ["back"], axis=0),
        helper.make_node("Reshape", ["swapped", "back"], ["shuffled"]),
        *extra_nodes,
    ]
    graph = helper.make_graph(
        nodes,
        "view",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 3])],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, ["N", 4, 3])],
        [ints("zero", [0]), ints("one", [1]), ints("two", [2]), ints("three", [3]), ints("minus_one", [-1])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=ORT_READABLE_IR)


def _constants(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in model.graph.node if n.op_type == "Constant"}


def _other_batch(model: onnx.ModelProto) -> onnx.ModelProto:
    return infer_shapes(model, {"x": (4, 3)}, "view.onnx", batch=3)


def test_shape_chain_becomes_constants_in_place():
    model = _shuffle_view()
    inferred = infer_shapes(model, {"x": (4, 3)}, "view.onnx")
    folded = fold_shape_arithmetic(inferred, _other_batch)

    assert [n.op_type for n in folded.graph.node] == [
        "Relu",
        "Constant",
        "Constant",
        "Constant",
        "Constant",
        "Constant",
        "Reshape",
        "Transpose",
        "Constant",
        "Reshape",
    ]
    constants = _constants(folded)
    np.testing.assert_array_equal(constants["target"], [2, 2, 2, 3])  # the concrete batch 2, then 2, 4/2, 3
    np.testing.assert_array_equal(constants["half"], [2])
    np.testing.assert_array_equal(constants["back"], [2, -1, 3])
    assert [n.name for n in folded.graph.node] == [n.name for n in inferred.graph.node]
    assert not any(n.op_type == "Constant" for n in inferred.graph.node)  # the input is not modified


def test_batch_dependent_value_read_as_data_is_not_folded():
    # The batch size used as a multiplier of the activation: baking in the concrete batch would
    # change the function for every other batch.
    cast = helper.make_node("Cast", ["batch"], ["batch_float"], to=TensorProto.FLOAT)
    scale = helper.make_node("Mul", ["shuffled", "batch_float"], ["z"])
    inferred = infer_shapes(_shuffle_view([cast, scale], output="z"), {"x": (4, 3)}, "view.onnx")
    folded = fold_shape_arithmetic(inferred, _other_batch)
    kept = {n.output[0]: n.op_type for n in folded.graph.node}
    assert kept["batch_float"] == "Cast" and kept["target"] == "Constant" and kept["half"] == "Constant"
    assert kept["batch"] == "Gather"  # its Cast reader stays: a Constant batch would read as a fixed scale
    with pytest.raises(UnsupportedModelError, match="batch_float"):
        load_onnx(_shuffle_view([cast, scale], output="z").SerializeToString(), name="view.onnx")


def test_without_other_batch_only_shape_readers_get_batch_dependent_constants():
    cast = helper.make_node("Cast", ["batch"], ["batch_float"], to=TensorProto.FLOAT)
    scale = helper.make_node("Mul", ["shuffled", "batch_float"], ["z"])
    inferred = infer_shapes(_shuffle_view([cast, scale], output="z"), {"x": (4, 3)}, "view.onnx")
    kept = {n.output[0]: n.op_type for n in fold_shape_arithmetic(inferred).graph.node}
    assert kept["batch_float"] == "Cast" and kept["target"] == "Constant"


def test_nothing_to_fold_returns_the_model():
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=ORT_READABLE_IR)
    assert fold_shape_arithmetic(model) is model


@pytest.mark.parametrize("batch", [1, 5])
def test_loaded_view_computes_the_original_at_any_batch_and_keeps_its_graph(batch):
    import onnxruntime

    model = _shuffle_view()
    x = np.random.default_rng(0).standard_normal((batch, 4, 3)).astype(np.float32)
    (expected,) = onnxruntime.InferenceSession(model.SerializeToString()).run(None, {"x": x})
    loaded = load_onnx(model.SerializeToString(), name="view.onnx")
    (actual,) = forward(loaded.graph, loaded.params, torch.from_numpy(x).double()).values()
    np.testing.assert_allclose(actual.numpy(), expected, rtol=1e-6)
    assert loaded.payload.SerializeToString() == model.SerializeToString()  # written back unfolded
