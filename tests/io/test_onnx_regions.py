"""Where an ONNX file's pre- and post-processing end (issue 37, review findings 5 to 9).

A per-channel Mul/Add the DAG reads as a layer with parameters ends the pre-processing (a
Sigmoid after it sits between two layers: refused); a non-homogeneous op computed only from the
network's input, after the DAG, is post-processing. compare and prune say their bound is of the
DAG between the processing, which onnxruntime checks on the file's own DAG values; spec warns
that the carried operations are not in the spec. A per-channel constant in NHWC layout is
refused for its layout, never as "not positively homogeneous".
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
from cli_support import assert_clean_exit, invoke
from onnx import TensorProto, helper, numpy_helper

from pathcond_cli.engine.graph import ChannelAffine, ChannelBias
from pathcond_cli.errors import UnsupportedModelError
from pathcond_cli.io.formats.onnx_format import load_onnx

RNG = np.random.default_rng(3705)


def _t(name: str, array) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(array, dtype=np.float32), name)


def _i64(name: str, values) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(values, dtype=np.int64), name)


def _value(name: str, shape, elem_type=TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, shape)


def _save(path: Path, nodes, initializer, inputs, outputs) -> Path:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8, producer_name="regions test"
    )
    onnx.save_model(model, str(path))
    return path


def _session(model: onnx.ModelProto | Path) -> onnxruntime.InferenceSession:
    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    source = str(model) if isinstance(model, Path) else model.SerializeToString()
    return onnxruntime.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def _affine_conv_nodes(between: list[onnx.NodeProto], first: str) -> list[onnx.NodeProto]:
    """x → Mul(s) → Add(b) → Relu → ``between`` → Conv → Relu → Flatten → Gemm (an input
    BatchNorm exported as a per-channel Mul/Add); ``first`` is the value the Conv reads."""
    return [
        helper.make_node("Mul", ["x", "s"], ["scaled"], name="bn_scale"),
        helper.make_node("Add", ["scaled", "b"], ["shifted"], name="bn_shift"),
        helper.make_node("Relu", ["shifted"], ["r0"], name="relu0"),
        *between,
        helper.make_node("Conv", [first, "k", "kb"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("Flatten", ["r"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "w", "wb"], ["y"], transB=1, name="fc"),
    ]


def _affine_conv(tmp_path: Path, between: list[onnx.NodeProto], first: str) -> Path:
    initializer = [
        _t("s", RNG.normal(size=(3, 1, 1)) * 3),
        _t("b", RNG.normal(size=(3, 1, 1))),
        _t("k", RNG.normal(size=(4, 3, 3, 3))),
        _t("kb", RNG.normal(size=4)),
        _t("w", RNG.normal(size=(2, 64))),
        _t("wb", RNG.normal(size=2)),
    ]
    return _save(
        tmp_path / f"affine_{len(between)}.onnx",
        _affine_conv_nodes(between, first),
        initializer,
        [_value("x", ["N", 3, 4, 4])],
        [_value("y", ["N", 2])],
    )


# --------------------------------------------------------------------------- finding 6


def test_a_sigmoid_after_a_per_channel_affine_sits_between_two_layers_and_is_refused(tmp_path):
    path = _affine_conv(tmp_path, [helper.make_node("Sigmoid", ["r0"], ["squashed"], name="squash")], "squashed")
    assert_clean_exit(invoke("inspect", path), 4, "Sigmoid ×1: node 'squash'", "not positively homogeneous")


def test_without_the_sigmoid_the_per_channel_affine_is_a_layer_of_the_dag(tmp_path):
    model = load_onnx(str(_affine_conv(tmp_path, [], "r0")))
    assert not model.carried
    affine = [node for node in model.graph.nodes if isinstance(node, ChannelAffine)]
    assert [(node.weight, node.bias) for node in affine] == [("s", "b")]


def test_pre_processing_ends_at_a_per_channel_scale_which_the_dag_rescales(tmp_path):
    """x → Sub(μ) → Mul(s) → Conv: the Sub is pre-processing, the per-channel Mul a layer of the
    DAG; the rescaled file computes what the original does (onnxruntime)."""
    nodes = [
        helper.make_node("Sub", ["x", "mean"], ["centred"], name="centre"),
        helper.make_node("Mul", ["centred", "s"], ["scaled"], name="scale"),
        helper.make_node("Conv", ["scaled", "k"], ["c"], name="conv"),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("Flatten", ["r"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "w"], ["y"], transB=1, name="fc"),
    ]
    initializer = [
        _t("mean", RNG.normal(size=(1, 3, 1, 1))),
        _t("s", RNG.normal(size=(3, 1, 1))),
        _t("k", RNG.normal(size=(4, 3, 2, 2))),
        _t("w", RNG.normal(size=(2, 36))),
    ]
    path = _save(tmp_path / "sub_mul.onnx", nodes, initializer, [_value("x", ["N", 3, 4, 4])], [_value("y", ["N", 2])])
    model = load_onnx(str(path))
    assert model.carried.pre == ("Sub",) and not model.carried.post
    assert [node.weight for node in model.graph.nodes if isinstance(node, ChannelAffine)] == ["s"]
    out = tmp_path / "sub_mul.rescaled.onnx"
    assert_clean_exit(invoke("rescale", path, "-o", out), 0)
    assert not np.array_equal(
        numpy_helper.to_array(next(t for t in onnx.load(str(out)).graph.initializer if t.name == "s")),
        numpy_helper.to_array(initializer[1]),
    )
    feeds = {"x": RNG.normal(size=(5, 3, 4, 4)).astype(np.float32)}
    (before,), (after,) = _session(path).run(None, feeds), _session(out).run(None, feeds)
    np.testing.assert_allclose(after, before, rtol=1e-4, atol=1e-5 * float(np.abs(before).max()))


def test_a_per_channel_bias_on_the_input_is_a_layer_of_the_dag(tmp_path):
    """x → Add(b) → Sigmoid → Gemm: the per-channel Add is a ChannelBias with a DAG parameter, so
    the Sigmoid after it is between two layers."""
    nodes = [
        helper.make_node("Add", ["x", "b"], ["shifted"], name="shift"),
        helper.make_node("Sigmoid", ["shifted"], ["squashed"], name="squash"),
        helper.make_node("Gemm", ["squashed", "w"], ["y"], transB=1, name="fc"),
    ]
    path = _save(
        tmp_path / "bias_sigmoid.onnx",
        nodes,
        [_t("b", RNG.normal(size=4)), _t("w", RNG.normal(size=(2, 4)))],
        [_value("x", ["N", 4])],
        [_value("y", ["N", 2])],
    )
    with pytest.raises(UnsupportedModelError, match="Sigmoid ×1: node 'squash'"):
        load_onnx(str(path))
    nodes[1] = helper.make_node("Relu", ["shifted"], ["squashed"], name="relu")
    model = load_onnx(
        str(
            _save(
                tmp_path / "bias_relu.onnx",
                nodes,
                [_t("b", RNG.normal(size=4)), _t("w", RNG.normal(size=(2, 4)))],
                [_value("x", ["N", 4])],
                [_value("y", ["N", 2])],
            )
        )
    )
    assert not model.carried and any(isinstance(node, ChannelBias) for node in model.graph.nodes)


# --------------------------------------------------------------------------- finding 9


def _mlp_nodes() -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["g1"], transB=1, name="fc1"),
        helper.make_node("Relu", ["g1"], ["h"], name="relu"),
        helper.make_node("Gemm", ["h", "w2", "b2"], ["y"], transB=1, name="fc2"),
    ]
    initializer = [
        _t("w1", RNG.normal(size=(3, 4))),
        _t("b1", RNG.normal(size=3)),
        _t("w2", RNG.normal(size=(2, 3))),
        _t("b2", RNG.normal(size=2)),
    ]
    return nodes, initializer


def test_a_softmax_of_the_input_alone_is_post_processing_carried_unchanged(tmp_path):
    nodes, initializer = _mlp_nodes()
    nodes.append(helper.make_node("Softmax", ["x"], ["z"], axis=1, name="input_softmax"))
    path = _save(
        tmp_path / "softmax_of_input.onnx",
        nodes,
        initializer,
        [_value("x", ["N", 4])],
        [_value("y", ["N", 2]), _value("z", ["N", 4])],
    )
    model = load_onnx(str(path))
    assert model.carried.post == ("Softmax",) and not model.carried.pre
    out = tmp_path / "softmax_of_input.rescaled.onnx"
    result = invoke("rescale", path, "-o", out, "--json")
    assert_clean_exit(result, 0)
    report = json.loads(result.stdout)
    assert report["processing"]["post"] == ["Softmax"]
    assert report["verification"]["independent"]["status"] == "passed"
    written = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(out)).graph.initializer}
    assert not np.array_equal(written["w1"], numpy_helper.to_array(initializer[0]))
    feeds = {"x": RNG.normal(size=(6, 4)).astype(np.float32)}
    for before, after in zip(_session(path).run(None, feeds), _session(out).run(None, feeds)):
        np.testing.assert_allclose(after, before, rtol=1e-4, atol=1e-6)


def test_a_file_with_no_layer_is_still_refused(tmp_path):
    path = _save(
        tmp_path / "only_sigmoid.onnx",
        [helper.make_node("Sigmoid", ["x"], ["z"], name="squash")],
        [],
        [_value("x", ["N", 4])],
        [_value("z", ["N", 4])],
    )
    assert_clean_exit(invoke("inspect", path), 4, "Sigmoid ×1: node 'squash'")


# --------------------------------------------------------------------------- finding 8


def test_a_per_channel_affine_in_nhwc_layout_is_refused_for_its_layout(tmp_path):
    channels = 4
    nodes = [
        helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 3, 1, 2], name="to_nchw"),
        helper.make_node("Conv", ["xt", "k1", "c1"], ["a1"], pads=[1, 1, 1, 1], name="conv1"),
        helper.make_node("Relu", ["a1"], ["r1"], name="relu1"),
        helper.make_node("Transpose", ["r1"], ["r1t"], perm=[0, 2, 3, 1], name="to_nhwc"),
        helper.make_node("Mul", ["r1t", "s"], ["m"], name="bn_scale"),
        helper.make_node("Add", ["m", "bb"], ["ad"], name="bn_shift"),
        helper.make_node("Transpose", ["ad"], ["back"], perm=[0, 3, 1, 2], name="back_to_nchw"),
        helper.make_node("Conv", ["back", "k2", "c2"], ["y"], pads=[1, 1, 1, 1], name="conv2"),
    ]
    initializer = [
        _t("k1", RNG.normal(size=(channels, 3, 3, 3))),
        _t("c1", RNG.normal(size=channels)),
        _t("s", np.abs(RNG.normal(size=channels)) + 0.5),
        _t("bb", RNG.normal(size=channels)),
        _t("k2", RNG.normal(size=(5, channels, 3, 3))),
        _t("c2", RNG.normal(size=5)),
    ]
    path = _save(
        tmp_path / "nhwc_affine.onnx", nodes, initializer, [_value("x", ["N", 6, 6, 3])], [_value("y", ["N", 5, 6, 6])]
    )
    with pytest.raises(UnsupportedModelError) as error:
        load_onnx(str(path))
    problems = error.value.problems
    assert not any("not positively homogeneous" in problem for problem in problems)
    (scale,) = [problem for problem in problems if "node 'bn_scale'" in problem]
    assert "'s' holds one value per index of axis 3 of 'r1t', its last axis" in scale and "layout" in scale


# --------------------------------------------------------------------------- findings 5 and 7


def _normalised_mlp(tmp_path: Path, *, head: bool) -> Path:
    """MATLAB style: (x − μ)/σ with σ = 0.01, Flatten, MatMul/Add, Relu, MatMul/Add (then a
    LogSoftmax with ``head``): the pre-processing multiplies the file's inputs by 100."""
    nodes = [
        helper.make_node("Sub", ["input", "mean"], ["centred"], name="centre"),
        helper.make_node("Div", ["centred", "std"], ["normalised"], name="normalise"),
        helper.make_node("Flatten", ["normalised"], ["flat"], name="flatten"),
        helper.make_node("MatMul", ["flat", "w0"], ["h0"], name="fc0"),
        helper.make_node("Add", ["h0", "b0"], ["a0"], name="fc0_bias"),
        helper.make_node("Relu", ["a0"], ["r0"], name="relu"),
        helper.make_node("MatMul", ["r0", "w1"], ["h1"], name="fc1"),
        helper.make_node("Add", ["h1", "b1"], ["scores"], name="fc1_bias"),
    ]
    if head:
        nodes.append(helper.make_node("LogSoftmax", ["scores"], ["log_probabilities"], axis=1, name="head"))
    initializer = [
        _t("mean", np.full((1, 1, 4, 4), 0.5)),
        _t("std", np.full((1, 1, 4, 4), 0.01)),
        _t("w0", RNG.normal(size=(16, 12))),
        _t("b0", RNG.normal(size=12)),
        _t("w1", RNG.normal(size=(12, 3))),
        _t("b1", RNG.normal(size=3)),
    ]
    output = "log_probabilities" if head else "scores"
    return _save(
        tmp_path / f"normalised_{head}.onnx",
        nodes,
        initializer,
        [_value("input", ["N", 1, 4, 4])],
        [_value(output, ["N", 3])],
    )


def _largest_l1_change(a: onnx.ModelProto | Path, b: onnx.ModelProto | Path, name: str, inputs: np.ndarray) -> float:
    (before,), (after,) = _session(a).run(None, {name: inputs}), _session(b).run(None, {name: inputs})
    return float(np.abs(after.astype(np.float64) - before.astype(np.float64)).sum(axis=1).max())


def _box(shape: tuple[int, ...], radius: float) -> np.ndarray:
    """Points of the box ‖·‖∞ ≤ ``radius``: half uniform, half corners."""
    uniform = RNG.uniform(-radius, radius, size=(128, *shape))
    corners = RNG.choice([-radius, radius], size=(128, *shape))
    return np.concatenate([uniform, corners]).astype(np.float32)


def test_prune_and_compare_state_their_bound_for_the_dag_between_the_processing(tmp_path):
    """The bound holds for DAG inputs in the box (onnxruntime on the DAG cut out of both files),
    not for the file's inputs (the pre-processing stretches them 100-fold), and the reports say so."""
    path, pruned = _normalised_mlp(tmp_path, head=False), tmp_path / "pruned.onnx"
    result = invoke("prune", path, "--sparsity", "0.5", "-o", pruned, "--json")
    assert_clean_exit(result, 0)
    report = json.loads(result.stdout)
    assert report["processing"]["pre"] == ["Sub", "Div", "Flatten"] and report["processing"]["post"] == []
    assert report["bound_applies"]
    assert "for DAG inputs z with ‖z‖∞ ≤ R, the values after the file's pre-processing" in report["bound_note"]
    bound = report["output_change_bound"]
    assert report["measured_output_change"] <= bound
    dags = []
    for name in (path, pruned):
        dags.append(tmp_path / f"{name.stem}.dag.onnx")
        onnx.utils.extract_model(str(name), str(dags[-1]), ["flat"], ["scores"])
    assert _largest_l1_change(*dags, "flat", _box((16,), 1.0)) <= bound * (1 + 1e-5)
    assert _largest_l1_change(path, pruned, "input", _box((1, 4, 4), 1.0)) > bound

    table = invoke("prune", path, "--sparsity", "0.5", "-o", tmp_path / "pruned_again.onnx")
    stderr = assert_clean_exit(
        table,
        0,
        "pre/post-processing",
        "pre Sub, Div, Flatten",
        "for DAG inputs ‖z‖∞ ≤ 1 (after the file's pre-processing)",
        "DAG output change ≤",
    )
    assert "output change, ‖x‖∞" not in stderr

    result = invoke("compare", path, pruned, "--json")
    assert_clean_exit(result, 0)
    comparison = json.loads(result.stdout)
    assert comparison["processing"] == comparison["other_processing"] == report["processing"]
    assert comparison["bound_note"] == report["bound_note"]
    assert comparison["output_change_bound"] == pytest.approx(bound, rel=1e-9)
    stderr = assert_clean_exit(
        invoke("compare", path, pruned),
        0,
        "pre Sub, Div, Flatten",
        "for DAG inputs ‖z‖∞ ≤ 1 (after the file's pre-processing)",
    )
    assert "output change, ‖x‖∞" not in stderr and "pre/post-processing (second)" not in stderr


def test_a_post_processing_only_file_states_the_dag_outputs_and_a_plain_file_nothing(tmp_path):
    nodes, initializer = _mlp_nodes()
    plain = _save(tmp_path / "plain.onnx", nodes, initializer, [_value("x", ["N", 4])], [_value("y", ["N", 2])])
    nodes.append(helper.make_node("Softmax", ["y"], ["p"], axis=1, name="head"))
    headed = _save(tmp_path / "headed.onnx", nodes, initializer, [_value("x", ["N", 4])], [_value("p", ["N", 2])])
    result = invoke("prune", headed, "--sparsity", "0.3", "-o", tmp_path / "headed.pruned.onnx", "--json")
    assert_clean_exit(result, 0)
    report = json.loads(result.stdout)
    assert report["processing"]["post"] == ["Softmax"] and report["bound_applies"]
    assert "on the DAG's outputs, before the file's post-processing" in report["bound_note"]
    assert "the file's own, which the DAG reads" in report["bound_note"]
    result = invoke("prune", plain, "--sparsity", "0.3", "-o", tmp_path / "plain.pruned.onnx", "--json")
    assert_clean_exit(result, 0)
    report = json.loads(result.stdout)
    assert report["processing"] is None and report["bound_note"] is None


def test_spec_warns_that_the_carried_processing_is_not_in_it(tmp_path):
    stderr = assert_clean_exit(
        invoke("spec", _normalised_mlp(tmp_path, head=True)),
        0,
        "the spec is the ReLU DAG alone",
        "pre-processing (Sub, Div, Flatten), whose outputs ('flat') are the spec's inputs",
        "post-processing (LogSoftmax), which reads the spec's outputs ('scores')",
    )
    assert "spec has none of it" in stderr
    nodes, initializer = _mlp_nodes()
    plain = _save(tmp_path / "plain.onnx", nodes, initializer, [_value("x", ["N", 4])], [_value("y", ["N", 2])])
    assert "ReLU DAG alone" not in assert_clean_exit(invoke("spec", plain), 0)
