"""ONNX weights produced by every form of ``Constant``: ``value_floats``,
``value_ints``, ``value_float`` and ``sparse_value`` are read as the stored tensors they are, and
written back (as a ``value`` tensor when rescaled); a weight computed by a node with no inputs
(``RandomNormal``) is refused naming that node, exit 4, nothing written."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from cli_support import assert_clean_exit, assert_unchanged, invoke, onnx_mlp_model, parse_single_json, snapshot
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator


def _with_constant(model: onnx.ModelProto, key: str, **attributes) -> onnx.ModelProto:
    """``model`` with initializer ``key`` replaced by a Constant node producing it."""
    graph = model.graph
    kept = [t for t in graph.initializer if t.name != key]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    node = helper.make_node("Constant", [], [key], name=f"const_{key}", **attributes)
    graph.node.insert(0, node)
    onnx.checker.check_model(model)
    return model


def _array(model: onnx.ModelProto, key: str) -> np.ndarray:
    return next(numpy_helper.to_array(t) for t in model.graph.initializer if t.name == key)


def _run(path: Path, x: np.ndarray) -> np.ndarray:
    return ReferenceEvaluator(onnx.load(str(path))).run(None, {"x": x})[0]


def _rescales_to_the_same_function(
    tmp_path: Path, model: onnx.ModelProto, reference: onnx.ModelProto | None = None
) -> dict:
    """``reference``: the same function, for onnx.reference to run when it cannot run ``model``."""
    source, out = tmp_path / "net.onnx", tmp_path / "out.onnx"
    onnx.save_model(model, str(source))
    oracle = source
    if reference is not None:
        oracle = tmp_path / "reference" / "net.onnx"
        oracle.parent.mkdir()
        onnx.save_model(reference, str(oracle))
    result = invoke("rescale", source, "-o", out, "--json")
    assert_clean_exit(result, 0)
    report = parse_single_json(result.stdout)
    assert report["verification"]["passed"]
    x = np.random.default_rng(1).standard_normal((4, 6)).astype(np.float32)
    before, after = _run(oracle, x), _run(out, x)
    assert np.abs(before - after).max() <= 1e-4 * np.abs(before).max()
    return report


def test_bias_from_value_floats_is_a_stored_tensor(tmp_path):
    model = onnx_mlp_model()
    bias = _array(model, "fc1.bias")
    model = _with_constant(model, "fc1.bias", value_floats=[float(v) for v in bias])
    _rescales_to_the_same_function(tmp_path, model)
    written = onnx.load(str(tmp_path / "out.onnx"))
    constant = next(n for n in written.graph.node if n.output[0] == "fc1.bias")
    assert constant.op_type == "Constant" and [a.name for a in constant.attribute] == ["value"]
    # the rescaling changed it: it was written, not passed through
    assert not np.array_equal(numpy_helper.to_array(constant.attribute[0].t), bias)


def test_weight_from_sparse_value_is_a_stored_tensor(tmp_path):
    model = onnx_mlp_model()
    weight = _array(model, "fc2.weight").copy()
    weight[weight < 0.3] = 0.0  # a sparse weight
    rows, cols = np.nonzero(weight)
    values = numpy_helper.from_array(weight[rows, cols].astype(np.float32), "fc2.weight_values")
    indices = numpy_helper.from_array(
        np.ravel_multi_index((rows, cols), weight.shape).astype(np.int64), "fc2.weight_indices"
    )
    sparse = helper.make_sparse_tensor(values, indices, list(weight.shape))
    dense = onnx.ModelProto()
    dense.CopyFrom(model)
    next(t for t in dense.graph.initializer if t.name == "fc2.weight").CopyFrom(
        numpy_helper.from_array(weight, "fc2.weight")
    )
    model = _with_constant(model, "fc2.weight", sparse_value=sparse)
    _rescales_to_the_same_function(tmp_path, model, reference=dense)


def test_shape_from_value_ints_and_scalar_from_value_float(tmp_path):
    """A Reshape's shape given by value_ints, and an fc3 bias given as value_floats of length one
    broadcast by Gemm, read like any stored tensors."""
    model = onnx_mlp_model()
    graph = model.graph
    graph.node[0].input[0] = "x_flat"
    graph.node.insert(0, helper.make_node("Reshape", ["x", "flat_shape"], ["x_flat"], name="flatten"))
    graph.node.insert(0, helper.make_node("Constant", [], ["flat_shape"], name="const_shape", value_ints=[-1, 6]))
    onnx.checker.check_model(model)
    _rescales_to_the_same_function(tmp_path, model)


@pytest.mark.parametrize("op", ["RandomNormal", "RandomUniform"])
def test_weight_from_a_node_with_no_inputs_is_refused_naming_it(tmp_path, op):
    model = onnx_mlp_model()
    graph = model.graph
    kept = [t for t in graph.initializer if t.name != "fc2.weight"]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    graph.node.insert(
        0, helper.make_node(op, [], ["fc2.weight"], name="random_weight", shape=[5, 8], dtype=TensorProto.FLOAT)
    )
    onnx.checker.check_model(model)
    source = tmp_path / "net.onnx"
    onnx.save_model(model, str(source))
    before = snapshot(tmp_path)
    stderr = assert_clean_exit(
        invoke("rescale", source, "-o", tmp_path / "out.onnx"), 4, "random_weight", op, "fc2.weight", "no inputs"
    )
    assert_unchanged(tmp_path, before)
    assert not (tmp_path / "out.onnx").exists()
    assert stderr.count("\n") < 25
