"""ONNX files as other tools write them (issue 37, part B): pre- and post-processing inside the
graph, TensorFlow/Keras layouts, unflattens between layers, Abs and global max/sum pooling.

Each file is built here with onnx.helper in its exporter's style (no network), rescaled through
the CLI, and checked with onnxruntime against the original on random inputs: the written file
computes the same (integer outputs of a property check exactly), keeps the input's opset, and
D does not rise. The non-homogeneous operations between layers are refused, named. Brute-force
path enumeration (tests/oracle.py) checks the groups and diag(G) of the general data movement
and of the DAG between pre- and post-processing.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from cli_support import assert_clean_exit, invoke
from onnx import TensorProto, helper, numpy_helper
from oracle import build_neuron_dag, engine_blocks, to_theta_order

from pathcond_cli.engine.diag import diag_g, path_count
from pathcond_cli.engine.evaluate import forward
from pathcond_cli.engine.graph import Conv, Graph, Input, LeakyReLU, Linear, MaxPool, Rearrange, ReLU
from pathcond_cli.engine.groups import build_groups
from pathcond_cli.errors import UnsupportedModelError
from pathcond_cli.io.formats.onnx_format import load_onnx

RNG = np.random.default_rng(37)


def _t(name: str, array: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(array, dtype=np.float32), name)


def _i64(name: str, values) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(values, dtype=np.int64), name)


def _value(name: str, shape, elem_type=TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, shape)


def _save(path: Path, nodes, initializer, inputs, outputs, *, opset: int = 13, ir_version: int = 8) -> Path:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", opset)],
        ir_version=ir_version,
        producer_name="exporter-style test",
    )
    onnx.save_model(model, str(path))
    return path


def _run(path: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]).run(None, feeds)


def _rescaled_and_checked(path: Path, tmp_path: Path, feeds: dict[str, np.ndarray]) -> dict:
    """Rescale ``path`` through the CLI; the written file keeps the opset, computes what the
    original does in onnxruntime (integer outputs exactly), and D does not rise."""
    out = tmp_path / f"{path.stem}.rescaled.onnx"
    result = invoke("rescale", path, "-o", out, "--json")
    assert_clean_exit(result, 0)
    report = json.loads(result.stdout)
    assert report["verification"]["passed"]
    assert report["verification"]["independent"]["status"] == "passed", report["verification"]["independent"]
    assert report["conditioning"]["after"]["D"] <= report["conditioning"]["before"]["D"] * (1 + 1e-9)
    assert report["groups"]["free"] > 0
    original, written = onnx.load(str(path)), onnx.load(str(out))
    assert [(o.domain, o.version) for o in written.opset_import] == [
        (o.domain, o.version) for o in original.opset_import
    ]
    assert written.ir_version == original.ir_version
    assert [n.op_type for n in written.graph.node] == [n.op_type for n in original.graph.node]
    changed = {t.name for t in written.graph.initializer} & {t.name for t in original.graph.initializer}
    assert any(
        not np.array_equal(numpy_helper.to_array(a), numpy_helper.to_array(b))
        for a in original.graph.initializer
        for b in written.graph.initializer
        if a.name == b.name and a.name in changed
    ), "nothing was rescaled"
    for before, after in zip(_run(path, feeds), _run(out, feeds)):
        if np.issubdtype(before.dtype, np.floating):
            scale = max(float(np.abs(before).max()), 1e-30)
            assert float(np.abs(after - before).max()) / scale <= 1e-4
        else:
            np.testing.assert_array_equal(after, before)
    return report


def _carried_tensors_unchanged(path: Path, written: Path, report: dict) -> None:
    """The tensors pre- and post-processing read are the original's, bit for bit."""
    original, rescaled = onnx.load(str(path)), onnx.load(str(written))
    stored = {t.name: numpy_helper.to_array(t) for t in rescaled.graph.initializer}
    layers = {"Conv", "ConvTranspose", "Gemm", "MatMul", "BatchNormalization", "Add"}
    for node in original.graph.node:
        if node.op_type in layers:
            continue
        for value in node.input:
            for tensor in original.graph.initializer:
                if tensor.name == value:
                    np.testing.assert_array_equal(stored[value], numpy_helper.to_array(tensor))


# --------------------------------------------------------------------------- exporter styles


def _tf2onnx(tmp_path: Path) -> Path:
    """tf2onnx: NHWC input, a Transpose to NCHW before the first Conv, a Transpose back to NHWC
    before the flatten (in H, W, C order) into a MatMul."""
    nodes = [
        helper.make_node("Transpose", ["input_1"], ["nchw"], perm=[0, 3, 1, 2], name="conv2d/Conv2D__6"),
        helper.make_node("Conv", ["nchw", "k1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv2d/Conv2D"),
        helper.make_node("Relu", ["c1"], ["r1"], name="conv2d/Relu"),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2], name="max_pooling2d/MaxPool"),
        helper.make_node("Conv", ["p1", "k2", "b2"], ["c2"], pads=[1, 1, 1, 1], name="conv2d_1/Conv2D"),
        helper.make_node("Relu", ["c2"], ["r2"], name="conv2d_1/Relu"),
        helper.make_node("Transpose", ["r2"], ["nhwc"], perm=[0, 2, 3, 1], name="conv2d_1/Relu__10"),
        helper.make_node("Reshape", ["nhwc", "flat_shape"], ["flat"], name="flatten/Reshape"),
        helper.make_node("MatMul", ["flat", "w"], ["mm"], name="dense/MatMul"),
        helper.make_node("Add", ["mm", "bias"], ["dense"], name="dense/BiasAdd"),
    ]
    initializer = [
        _t("k1", RNG.normal(size=(4, 3, 3, 3))),
        _t("b1", RNG.normal(size=4)),
        _t("k2", RNG.normal(size=(5, 4, 3, 3))),
        _t("b2", RNG.normal(size=5)),
        _i64("flat_shape", [-1, 45]),
        _t("w", RNG.normal(size=(45, 6))),
        _t("bias", RNG.normal(size=6)),
    ]
    return _save(
        tmp_path / "tf2onnx.onnx",
        nodes,
        initializer,
        [_value("input_1", ["unk__1", 6, 6, 3])],
        [_value("dense", ["unk__2", 6])],
        opset=13,
    )


def test_tf2onnx_nhwc_graph_is_rescaled_exactly(tmp_path):
    path = _tf2onnx(tmp_path)
    model = load_onnx(str(path))
    # The input transpose is pre-processing; the transpose back and flatten is an element-wise copy.
    assert model.carried.pre == ()
    assert any(isinstance(n, Rearrange) for n in model.graph.nodes)
    _rescaled_and_checked(path, tmp_path, {"input_1": RNG.normal(size=(3, 6, 6, 3)).astype(np.float32)})


def _keras2onnx(tmp_path: Path, *, shuffled: bool) -> Path:
    """keras2onnx: NHWC, a Softmax head, nodes written out of dependency order."""
    nodes = [
        helper.make_node("Transpose", ["input"], ["nchw"], perm=[0, 3, 1, 2], name="adjusted_input"),
        helper.make_node("Conv", ["nchw", "k"], ["c"], name="conv2d"),
        helper.make_node("Relu", ["c"], ["r"], name="conv2d_relu"),
        helper.make_node("Transpose", ["r"], ["nhwc"], perm=[0, 2, 3, 1], name="transpose_back"),
        helper.make_node("Flatten", ["nhwc"], ["flat"], axis=1, name="flatten"),
        helper.make_node("MatMul", ["flat", "w"], ["mm"], name="dense"),
        helper.make_node("Add", ["mm", "bias"], ["logits"], name="dense_bias"),
        helper.make_node("Softmax", ["logits"], ["probabilities"], axis=-1, name="dense_softmax"),
    ]
    if shuffled:
        nodes = [nodes[i] for i in (7, 4, 1, 6, 0, 3, 5, 2)]
    initializer = [
        _t("k", RNG.normal(size=(4, 2, 3, 3))),
        _t("w", RNG.normal(size=(36, 5))),
        _t("bias", RNG.normal(size=5)),
    ]
    return _save(
        tmp_path / f"keras2onnx{'_unsorted' if shuffled else ''}.onnx",
        nodes,
        initializer,
        [_value("input", ["N", 5, 5, 2])],
        [_value("probabilities", ["N", 5])],
        opset=13,
    )


@pytest.mark.parametrize("shuffled", [False, True], ids=["sorted", "unsorted"])
def test_keras2onnx_nhwc_with_a_softmax_head_is_rescaled(tmp_path, shuffled):
    path = _keras2onnx(tmp_path, shuffled=shuffled)
    report = _rescaled_and_checked(path, tmp_path, {"input": RNG.normal(size=(4, 5, 5, 2)).astype(np.float32)})
    assert report["processing"]["post"] == ["Softmax"]
    assert "path norms, diag(G), compare and prune are those of the DAG" in report["processing"]["note"]


def _matlab(tmp_path: Path, opset: int) -> Path:
    """MATLAB / ERAN style: (x − μ)/σ on the input, Flatten, then MatMul and Add layers."""
    nodes = [
        helper.make_node("Sub", ["input", "mean"], ["centred"], name="input_Sub"),
        helper.make_node("Div", ["centred", "std"], ["normalised"], name="input_Div"),
        helper.make_node("Flatten", ["normalised"], ["flat"], name="flatten"),
        helper.make_node("MatMul", ["flat", "W0"], ["h0"], name="fc_1"),
        helper.make_node("Add", ["h0", "B0"], ["a0"], name="fc_1_add"),
        helper.make_node("Relu", ["a0"], ["r0"], name="relu_1"),
        helper.make_node("MatMul", ["r0", "W1"], ["h1"], name="fc_2"),
        helper.make_node("Add", ["h1", "B1"], ["scores"], name="fc_2_add"),
    ]
    initializer = [
        _t("mean", RNG.normal(size=(1, 1, 4, 4))),
        _t("std", RNG.uniform(0.5, 2, size=(1, 1, 4, 4))),
        _t("W0", RNG.normal(size=(16, 12))),
        _t("B0", RNG.normal(size=12)),
        _t("W1", RNG.normal(size=(12, 3))),
        _t("B1", RNG.normal(size=3)),
    ]
    return _save(
        tmp_path / f"matlab_opset{opset}.onnx",
        nodes,
        initializer,
        [_value("input", [1, 1, 4, 4])],
        [_value("scores", [1, 3])],
        opset=opset,
        ir_version=4 if opset < 9 else 8,
    )


@pytest.mark.parametrize("opset", [8, 13])
def test_matlab_input_normalisation_is_pre_processing(tmp_path, opset):
    path = _matlab(tmp_path, opset)
    model = load_onnx(str(path))
    assert model.carried.pre == ("Sub", "Div", "Flatten") and model.carried.post == ()
    assert [n.shape for n in model.graph.inputs] == [(16,)]
    report = _rescaled_and_checked(path, tmp_path, {"input": RNG.normal(size=(1, 1, 4, 4)).astype(np.float32)})
    assert report["processing"]["pre"] == ["Sub", "Div", "Flatten"]
    assert report["processing"]["file_inputs"] == {"input": [1, 4, 4]}
    _carried_tensors_unchanged(path, tmp_path / f"{path.stem}.rescaled.onnx", report)


def _pytorch_mnist(tmp_path: Path) -> Path:
    """A PyTorch MNIST net as PyTorch's exporter wrote it at opset 9, LogSoftmax head."""
    module = torch.nn.Sequential(
        torch.nn.Conv2d(1, 3, 3),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(27, 8),
        torch.nn.ReLU(),
        torch.nn.Linear(8, 4),
        torch.nn.LogSoftmax(dim=1),
    ).eval()
    path = tmp_path / "mnist9.onnx"
    torch.onnx.export(
        module,
        (torch.randn(2, 1, 8, 8),),
        str(path),
        opset_version=9,
        dynamo=False,
        input_names=["input"],
        output_names=["output"],
        dynamic_axes={"input": {0: "N"}},
    )
    return path


def test_pytorch_mnist_opset_9_with_log_softmax(tmp_path):
    path = _pytorch_mnist(tmp_path)
    assert onnx.load(str(path)).opset_import[0].version == 9
    model = load_onnx(str(path))
    assert model.carried.post == ("LogSoftmax",)
    _rescaled_and_checked(path, tmp_path, {"input": RNG.normal(size=(3, 1, 8, 8)).astype(np.float32)})


def _generator(tmp_path: Path, *, batchnorm: bool) -> Path:
    """A GAN generator: Gemm → Reshape to (C, H, W) → BatchNorm → Relu → ConvTranspose → Sigmoid."""
    nodes = [
        helper.make_node("Gemm", ["z", "fc_w", "fc_b"], ["features"], transB=1, name="project"),
        helper.make_node("Reshape", ["features", "unflat"], ["maps"], name="unflatten"),
        helper.make_node("BatchNormalization", ["maps", "g", "beta", "mu", "var"], ["normed"], name="bn")
        if batchnorm
        else helper.make_node("Identity", ["maps"], ["normed"], name="no_bn"),
        helper.make_node("Relu", ["normed"], ["r"], name="relu"),
        helper.make_node("ConvTranspose", ["r", "up_w", "up_b"], ["image"], strides=[2, 2], name="up"),
        helper.make_node("Sigmoid", ["image"], ["pixels"], name="squash"),
    ]
    initializer = [
        _t("fc_w", RNG.normal(size=(12, 5))),
        _t("fc_b", RNG.normal(size=12)),
        _i64("unflat", [-1, 3, 2, 2]),
        _t("g", RNG.uniform(0.5, 2, size=3)),
        _t("beta", RNG.normal(size=3)),
        _t("mu", RNG.normal(size=3)),
        _t("var", RNG.uniform(0.5, 2, size=3)),
        _t("up_w", RNG.normal(size=(3, 2, 2, 2))),
        _t("up_b", RNG.normal(size=2)),
    ]
    return _save(
        tmp_path / f"generator{'_bn' if batchnorm else ''}.onnx",
        nodes,
        initializer,
        [_value("z", ["N", 5])],
        [_value("pixels", ["N", 2, 4, 4])],
        opset=13,
    )


@pytest.mark.parametrize("batchnorm", [True, False], ids=["batchnorm", "plain"])
def test_generator_unflatten_ties_each_channel_and_rescales_exactly(tmp_path, batchnorm):
    path = _generator(tmp_path, batchnorm=batchnorm)
    model = load_onnx(str(path))
    assert model.carried.post == ("Sigmoid",)
    groups = build_groups(model.graph, model.params)
    project = groups.node_groups["project"].tolist()
    if batchnorm:
        # A BatchNorm after no layer of its own fixes its input channels (batch statistics).
        assert set(project) == {groups.num_free}
    else:
        # The 12 features land in 3 channels the transposed convolution reads: one scale per channel.
        assert len(set(project)) == 3 and project == sorted(project) and groups.num_free not in project
    _rescaled_and_checked(path, tmp_path, {"z": RNG.normal(size=(4, 5)).astype(np.float32)})


def _unet_with_property_check(tmp_path: Path) -> Path:
    """A small U-Net whose logits feed a property check: Softmax → ArgMax → OneHot → Equal → ReduceSum."""
    target = np.zeros((1, 3, 4, 4), dtype=bool)
    target[0, 1] = True
    nodes = [
        helper.make_node("Conv", ["x", "e_w", "e_b"], ["e"], pads=[1, 1, 1, 1], name="enc"),
        helper.make_node("Relu", ["e"], ["er"], name="enc_relu"),
        helper.make_node("MaxPool", ["er"], ["down"], kernel_shape=[2, 2], strides=[2, 2], name="down"),
        helper.make_node("Conv", ["down", "m_w", "m_b"], ["m"], pads=[1, 1, 1, 1], name="mid"),
        helper.make_node("Relu", ["m"], ["mr"], name="mid_relu"),
        helper.make_node(
            "Resize",
            ["mr", "", "scales"],
            ["up"],
            mode="nearest",
            coordinate_transformation_mode="asymmetric",
            nearest_mode="floor",
            name="up",
        ),
        helper.make_node("Concat", ["up", "er"], ["skip"], axis=1, name="skip"),
        helper.make_node("Conv", ["skip", "d_w", "d_b"], ["logits"], name="head"),
        helper.make_node("Softmax", ["logits"], ["probabilities"], axis=1, name="softmax"),
        helper.make_node("ArgMax", ["probabilities"], ["label"], axis=1, keepdims=0, name="argmax"),
        helper.make_node("OneHot", ["label", "depth", "onehot_values"], ["onehot"], axis=1, name="onehot"),
        helper.make_node("Cast", ["onehot"], ["onehot_bool"], to=TensorProto.BOOL, name="as_bool"),
        helper.make_node("Equal", ["onehot_bool", "target"], ["agrees"], name="equal"),
        helper.make_node("Cast", ["agrees"], ["agrees_int"], to=TensorProto.INT64, name="as_int"),
        helper.make_node("ReduceSum", ["agrees_int"], ["count"], keepdims=0, name="count"),
    ]
    initializer = [
        _t("e_w", RNG.normal(size=(4, 2, 3, 3))),
        _t("e_b", RNG.normal(size=4)),
        _t("m_w", RNG.normal(size=(4, 4, 3, 3))),
        _t("m_b", RNG.normal(size=4)),
        _t("scales", [1, 1, 2, 2]),
        _t("d_w", RNG.normal(size=(3, 8, 1, 1))),
        _t("d_b", RNG.normal(size=3)),
        _i64("depth", [3]),
        _i64("onehot_values", [0, 1]),
        numpy_helper.from_array(target, "target"),
    ]
    return _save(
        tmp_path / "unet_property.onnx",
        nodes,
        initializer,
        [_value("x", [1, 2, 4, 4])],
        [_value("logits", [1, 3, 4, 4]), _value("count", [], TensorProto.INT64)],
        opset=13,
    )


def test_unet_followed_by_a_property_check(tmp_path):
    path = _unet_with_property_check(tmp_path)
    model = load_onnx(str(path))
    assert model.carried.post == ("Softmax", "ArgMax", "OneHot", "Cast", "Equal", "Cast", "ReduceSum")
    assert model.carried.dag_outputs == ("logits",)
    report = _rescaled_and_checked(path, tmp_path, {"x": RNG.normal(size=(1, 2, 4, 4)).astype(np.float32)})
    assert "the values the DAG outputs" in report["verification"]["independent"]["detail"]


# --------------------------------------------------------------------------- refusals


def _between_layers(tmp_path: Path, op_nodes: list, name: str, extra=()) -> Path:
    nodes = [
        helper.make_node("Gemm", ["x", "w1"], ["h"], transB=1, name="fc1"),
        *op_nodes,
        helper.make_node("Gemm", ["a", "w2"], ["y"], transB=1, name="fc2"),
    ]
    initializer = [_t("w1", RNG.normal(size=(4, 4))), _t("w2", RNG.normal(size=(3, 4))), *extra]
    return _save(tmp_path / f"{name}.onnx", nodes, initializer, [_value("x", ["N", 4])], [_value("y", ["N", 3])])


def test_a_sigmoid_between_two_layers_is_refused_naming_it(tmp_path):
    path = _between_layers(tmp_path, [helper.make_node("Sigmoid", ["h"], ["a"], name="squash")], "sigmoid")
    assert_clean_exit(
        invoke("rescale", path, "-o", tmp_path / "out.onnx"),
        4,
        "Sigmoid ×1: node 'squash'",
        "not positively homogeneous",
    )


def test_layers_followed_by_a_sigmoid_are_not_pre_processing(tmp_path):
    """Conv → Sigmoid → Conv: the Sigmoid reads a layer's output, so it is no pre-processing."""
    nodes = [
        helper.make_node("Conv", ["x", "k1"], ["c"], name="conv1"),
        helper.make_node("Sigmoid", ["c"], ["s"], name="gate"),
        helper.make_node("Conv", ["s", "k2"], ["y"], name="conv2"),
    ]
    path = _save(
        tmp_path / "gate.onnx",
        nodes,
        [_t("k1", RNG.normal(size=(2, 1, 1, 1))), _t("k2", RNG.normal(size=(2, 2, 1, 1)))],
        [_value("x", ["N", 1, 3, 3])],
        [_value("y", ["N", 2, 3, 3])],
    )
    with pytest.raises(UnsupportedModelError, match="Sigmoid ×1: node 'gate'"):
        load_onnx(str(path))


def test_a_sum_over_channels_is_refused_with_its_true_reason(tmp_path):
    nodes = [
        helper.make_node("Conv", ["x", "k1"], ["c"], name="conv1"),
        helper.make_node("ReduceSum", ["c", "axes"], ["s"], keepdims=1, name="over_channels"),
        helper.make_node("Conv", ["s", "k2"], ["y"], name="conv2"),
    ]
    path = _save(
        tmp_path / "channels.onnx",
        nodes,
        [_t("k1", RNG.normal(size=(2, 1, 1, 1))), _i64("axes", [1]), _t("k2", RNG.normal(size=(2, 1, 1, 1)))],
        [_value("x", ["N", 1, 3, 3])],
        [_value("y", ["N", 2, 3, 3])],
    )
    with pytest.raises(UnsupportedModelError) as error:
        load_onnx(str(path))
    message = str(error.value)
    assert "node 'over_channels' (ReduceSum): only a sum over all spatial axes" in message
    assert "not positively homogeneous" not in message


# --------------------------------------------------------------------------- homogeneous operations read


def test_abs_and_global_max_and_sum_pooling_are_read_and_rescaled(tmp_path):
    nodes = [
        helper.make_node("Conv", ["x", "k1", "b1"], ["c"], pads=[1, 1, 1, 1], name="conv1"),
        helper.make_node("Abs", ["c"], ["a"], name="magnitude"),
        helper.make_node("Conv", ["a", "k2", "b2"], ["c2"], name="conv2"),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("ReduceMax", ["r2"], ["gmax"], axes=[2, 3], keepdims=0, name="global_max"),
        helper.make_node("ReduceSum", ["r2", "axes"], ["gsum"], keepdims=0, name="global_sum"),
        helper.make_node("Concat", ["gmax", "gsum"], ["pooled"], axis=1, name="pooled"),
        helper.make_node("Gemm", ["pooled", "w", "b"], ["y"], transB=1, name="head"),
    ]
    initializer = [
        _t("k1", RNG.normal(size=(3, 2, 3, 3))),
        _t("b1", RNG.normal(size=3)),
        _t("k2", RNG.normal(size=(4, 3, 3, 3))),
        _t("b2", RNG.normal(size=4)),
        _i64("axes", [2, 3]),
        _t("w", RNG.normal(size=(2, 8))),
        _t("b", RNG.normal(size=2)),
    ]
    path = _save(
        tmp_path / "homogeneous.onnx", nodes, initializer, [_value("x", ["N", 2, 5, 5])], [_value("y", ["N", 2])]
    )
    graph = load_onnx(str(path)).graph
    assert [n.negative_slope for n in graph.nodes if isinstance(n, LeakyReLU)] == [-1.0]
    assert [n.kernel for n in graph.nodes if isinstance(n, MaxPool)] == [(3, 3)]
    _rescaled_and_checked(path, tmp_path, {"x": RNG.normal(size=(3, 2, 5, 5)).astype(np.float32)})


@pytest.mark.parametrize(
    "node",
    [
        helper.make_node("Reshape", ["h", "shape"], ["y"], name="c"),
        helper.make_node("Transpose", ["h"], ["y"], perm=[0, 1, 3, 2], name="c"),
        helper.make_node("Concat", ["h"] * 4, ["y"], axis=2, name="c"),
        helper.make_node("Gather", ["h", "picked"], ["y"], axis=3, name="c"),
    ],
    ids=["reshape", "transpose", "spatial-concat", "gather"],
)
def test_a_movement_between_layers_is_never_refused_for_its_layout(tmp_path, node):
    """A chain of copies between a Conv and a Conv: read as the index map it is, rescaled exactly."""
    nodes = [
        helper.make_node("Conv", ["x", "k1"], ["h"], name="conv1"),
        node,
        helper.make_node("Conv", ["y", "k2"], ["z"], name="conv2"),
    ]
    initializer = [
        _t("k1", RNG.normal(size=(2, 2, 1, 1))),
        _t("k2", RNG.normal(size=(3, 4 if node.op_type == "Reshape" else 2, 1, 1))),
        _i64("shape", [0, 4, 2, 4]),
        _i64("picked", [3, 0, 0]),
    ]
    path = _save(
        tmp_path / "movement.onnx", nodes, initializer, [_value("x", [2, 2, 4, 4])], [_value("z", [2, 3, "h", "w"])]
    )
    _rescaled_and_checked(path, tmp_path, {"x": RNG.normal(size=(2, 2, 4, 4)).astype(np.float32)})


# --------------------------------------------------------------------------- brute force


def _unflatten_and_nhwc_graph() -> tuple[Graph, dict[str, torch.Tensor]]:
    """Linear(5→12) → ReLU → unflatten to (3, 2, 2) → Conv 1×1 → ReLU → NHWC flatten → Linear(8→2)."""
    unflat = tuple(range(12))
    nhwc = tuple(torch.arange(8).reshape(2, 2, 2).permute(1, 2, 0).reshape(-1).tolist())
    nodes = [
        Input("x", shape=(5,)),
        Linear("fc1", ("x",), weight="fc1.w", bias="fc1.b"),
        ReLU("r1", ("fc1",)),
        Rearrange("unflatten", ("r1",), shape=(3, 2, 2), elements=unflat),
        Conv("conv", ("unflatten",), weight="conv.w", bias="conv.b", stride=(1, 1), padding=(0, 0), dilation=(1, 1)),
        ReLU("r2", ("conv",)),
        Rearrange("nhwc", ("r2",), shape=(8,), elements=nhwc),
        Linear("fc2", ("nhwc",), weight="fc2.w", bias="fc2.b"),
    ]
    generator = torch.Generator().manual_seed(5)
    shapes = {"fc1.w": (12, 5), "fc1.b": (12,), "conv.w": (2, 3, 1, 1), "conv.b": (2,), "fc2.w": (2, 8), "fc2.b": (2,)}
    params = {key: torch.randn(shape, generator=generator, dtype=torch.float64) for key, shape in shapes.items()}
    return Graph(nodes, ("fc2",)), params


def _dag_matches_brute_force(graph: Graph, params: dict[str, torch.Tensor]) -> None:
    dag = build_neuron_dag(graph, params)
    assert dag.forward_check(params) < 1e-12
    groups = build_groups(graph, params)
    dag.group_columns(groups)  # the engine's partition into groups is the neurons' own
    engine_blocks(dag, groups)
    g_engine = to_theta_order(dag, groups, [lg.exp() for lg in diag_g(groups).log_g])
    g_oracle = dag.diag_G()
    assert float(((g_engine - g_oracle).abs() / g_oracle).max()) <= 1e-10
    assert path_count(groups).exact == dag.path_count()


def test_general_movement_groups_and_diag_g_match_brute_force():
    graph, params = _unflatten_and_nhwc_graph()
    _dag_matches_brute_force(graph, params)
    groups = build_groups(graph, params)
    # 12 hidden features tied into the conv's 3 input channels; the conv's 2 channels free.
    assert groups.num_free == 3 + 2


def test_the_dag_between_pre_and_post_processing_matches_brute_force(tmp_path):
    """The DAG of a file with pre- and post-processing: its groups, diag(G) and path count by path
    enumeration, and its function against onnxruntime's values of the file around it."""
    nodes = [
        helper.make_node("Sub", ["x", "mean"], ["centred"], name="centre"),
        helper.make_node("Transpose", ["centred"], ["nchw"], perm=[0, 3, 1, 2], name="to_nchw"),
        helper.make_node("Conv", ["nchw", "k", "kb"], ["c"], name="conv"),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("Transpose", ["r"], ["nhwc"], perm=[0, 2, 3, 1], name="to_nhwc"),
        helper.make_node("Flatten", ["nhwc"], ["flat"], name="flatten"),
        helper.make_node("Gemm", ["flat", "w", "b"], ["logits"], transB=1, name="fc"),
        helper.make_node("LogSoftmax", ["logits"], ["y"], axis=1, name="log_probabilities"),
    ]
    initializer = [
        _t("mean", RNG.normal(size=(1, 1, 1, 2))),
        _t("k", RNG.normal(size=(3, 2, 2, 2))),
        _t("kb", RNG.normal(size=3)),
        _t("w", RNG.normal(size=(2, 12))),
        _t("b", RNG.normal(size=2)),
    ]
    path = _save(
        tmp_path / "processed.onnx", nodes, initializer, [_value("x", ["N", 3, 3, 2])], [_value("y", ["N", 2])]
    )
    model = load_onnx(str(path))
    assert model.carried.pre == ("Sub", "Transpose") and model.carried.post == ("LogSoftmax",)
    params = {key: model.params[key].double() for key in model.graph.parameter_keys()}
    _dag_matches_brute_force(model.graph, params)
    fetched = onnx.load(str(path))
    fetched.graph.output.extend([onnx.ValueInfoProto(name="nchw"), onnx.ValueInfoProto(name="logits")])
    x = RNG.normal(size=(4, 3, 3, 2)).astype(np.float32)
    _, nchw, logits = onnxruntime.InferenceSession(fetched.SerializeToString()).run(None, {"x": x})
    (ours,) = forward(model.graph, model.params, torch.from_numpy(nchw).double()).values()
    assert float((ours - torch.from_numpy(logits)).abs().max()) <= 1e-4 * float(np.abs(logits).max())
