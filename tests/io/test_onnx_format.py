"""ONNX import/export: translation of exporter output, function-preserving round trips, errors."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import ops_models
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx_models import EXPORTERS, MODELS, build, example_input, export, exported

from pathcond_cli.engine.evaluate import forward
from pathcond_cli.engine.graph import BatchNorm, Identity, Linear
from pathcond_cli.engine.groups import build_groups
from pathcond_cli.errors import InputError, UnsupportedModelError, UsageError
from pathcond_cli.io.formats import onnx_write
from pathcond_cli.io.formats.onnx_format import load_onnx, reference_outputs, write_onnx

pytestmark = pytest.mark.filterwarnings("ignore")

TOLERANCE = 1e-5


def relative_error(actual, expected) -> float:
    actual = torch.as_tensor(np.asarray(actual), dtype=torch.float64)
    expected = torch.as_tensor(np.asarray(expected), dtype=torch.float64)
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


def torch_output(name: str, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return build(name, dtype=torch.float64)(x.double())


def only_output(model, x: torch.Tensor) -> torch.Tensor:
    (output,) = forward(model.graph, model.params, x.double()).values()
    return output


def random_rescaling(model, seed: int = 0) -> dict[str, torch.Tensor]:
    groups = build_groups(model.graph, model.params)
    assert groups.num_free > 0
    u = torch.randn(groups.num_free, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 0.5
    return groups.apply(model.params, u)


def initializers(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    return {t.name: t for t in model.graph.initializer}


# --------------------------------------------------------------------------- exporter output


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_exported_model_computes_the_torch_function(name, exporter):
    model = load_onnx(exported(name, exporter))
    x = example_input(name, batch=4)
    assert model.format == "onnx" and model.source == "<stdin>"
    assert relative_error(only_output(model, x), torch_output(name, x)) <= TOLERANCE
    assert build_groups(model.graph, model.params).num_free > 0


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_rescaled_file_computes_the_same_function(name, exporter, tmp_path):
    data = exported(name, exporter)
    model = load_onnx(data)
    changed = random_rescaling(model)
    assert changed
    destination = tmp_path / "rescaled.onnx"
    write_onnx(model, changed, destination, {"pathcond.objective": "1.5"})

    x = example_input(name, batch=4)
    rescaled = load_onnx(destination)
    assert relative_error(only_output(rescaled, x), torch_output(name, x)) <= TOLERANCE
    for key, tensor in changed.items():
        assert torch.equal(rescaled.params[key], tensor)
    (before,) = reference_outputs(data, x.numpy())
    (after,) = reference_outputs(destination, x.numpy())
    assert relative_error(after, before) <= TOLERANCE


UPSAMPLE_MODELS = [name for name in sorted(ops_models.OPS_MODELS) if name.startswith("upsample")]


@pytest.mark.parametrize("name, exporter", [(n, e) for n in UPSAMPLE_MODELS for e in EXPORTERS])
def test_resize_computes_the_torch_function_and_survives_rescaling(name, exporter, tmp_path):
    """Resize as both exporters write torch's nearest and (bi/tri)linear resizes: the graph
    computes the module, and the rescaled file computes the same by ONNX's own evaluator."""
    module, shape = ops_models.build(name)
    x = torch.randn((3, *shape), generator=torch.Generator().manual_seed(4))
    data = export(module, x, exporter)
    if exporter == "dynamo" and "GatherND" in {n.op_type for n in onnx.load_from_string(data).graph.node}:
        with pytest.raises(UnsupportedModelError, match="GatherND"):
            load_onnx(data)
        return  # torch.export writes 1-d linear interpolation as index arithmetic, not a Resize
    model = load_onnx(data)
    with torch.no_grad():
        expected = module.double()(x.double())
    assert relative_error(only_output(model, x), expected) <= TOLERANCE
    destination = tmp_path / "rescaled.onnx"
    write_onnx(model, random_rescaling(model), destination, {})
    # onnxruntime, not onnx's reference evaluator: the latter floors x/scale of nearest
    # resizes by non-integer scales differently from both torch and onnxruntime.
    import onnxruntime

    outputs = [
        session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
        for session in (onnxruntime.InferenceSession(data), onnxruntime.InferenceSession(str(destination)))
    ]
    assert relative_error(outputs[0], expected) <= TOLERANCE
    assert relative_error(outputs[1], outputs[0]) <= TOLERANCE


def test_batchnorm_kept_by_the_exporter_becomes_a_graph_node():
    model = load_onnx(exported("cnn", "torchscript-unfolded"))
    assert sum(isinstance(n, BatchNorm) for n in model.graph.nodes) == 2
    assert {"1.running_mean", "1.running_var"} <= set(model.params)


def test_graph_nodes_are_named_after_their_weights_or_onnx_nodes():
    proto = onnx.load_from_string(exported("mlp", "torchscript"))
    model = load_onnx(exported("mlp", "torchscript"))
    onnx_names = {n.name for n in proto.graph.node}
    for node in model.graph.nodes:
        weight = getattr(node, "weight", None)
        if weight is not None and "::" not in weight:
            assert weight == f"{node.name}.weight"
        elif node.op != "input":
            assert node.name in onnx_names
    assert model.graph.inputs[0].name == "x" and model.graph.inputs[0].shape == (6,)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_matmul_weights_keep_their_stored_layout(exporter):
    model = load_onnx(exported("matmul", exporter))
    layers = [n for n in model.graph.nodes if isinstance(n, Linear)]
    out_features = [model.params[n.weight].shape[1 if n.weight_transposed else 0] for n in layers]
    assert out_features == [7, 3]
    assert layers[1].bias is not None


# --------------------------------------------------------------------------- what the writer keeps


def test_writer_changes_only_the_rescaled_tensors(tmp_path):
    proto = onnx.load_from_string(exported("cnn", "torchscript-unfolded"))
    proto.doc_string = "a test network"
    proto.graph.doc_string = "its graph"
    proto.metadata_props.add(key="author", value="someone")
    proto.metadata_props.add(key="pathcond.objective", value="old")
    data = proto.SerializeToString()
    model = load_onnx(data)
    changed = random_rescaling(model)
    destination = tmp_path / "out.onnx"
    write_onnx(model, changed, destination, {"pathcond.objective": "0.25", "pathcond.version": "1"})

    written = onnx.load(destination)
    assert written.opset_import == proto.opset_import
    assert (written.producer_name, written.producer_version) == (proto.producer_name, proto.producer_version)
    assert (written.doc_string, written.graph.doc_string) == ("a test network", "its graph")
    assert {p.key: p.value for p in written.metadata_props} == {
        "author": "someone",
        "pathcond.objective": "0.25",
        "pathcond.version": "1",
    }
    assert [n.SerializeToString() for n in written.graph.node] == [n.SerializeToString() for n in proto.graph.node]
    original, rewritten = initializers(proto), initializers(written)
    assert list(rewritten) == list(original)
    for key, tensor in original.items():
        if key in changed:
            assert rewritten[key].data_type == tensor.data_type and rewritten[key].dims == tensor.dims
            assert not np.array_equal(numpy_helper.to_array(rewritten[key]), numpy_helper.to_array(tensor))
        else:
            assert rewritten[key].SerializeToString() == tensor.SerializeToString()
    # Running statistics never change; BatchNorm's γ and β carry the conv's output factor.
    assert not {"1.running_mean", "1.running_var", "0.weight"} & set(changed)
    assert {"1.weight", "1.bias"} <= set(changed)


def _decorated_cnn() -> tuple[onnx.ModelProto, int]:
    """The test CNN with a field of each kind the writer copies: doc strings, metadata, value infos,
    and on a rescaled initializer (BatchNorm's γ, whose index it returns too) a doc string, and
    float_data instead of raw_data."""
    proto = onnx.load_from_string(exported("cnn", "torchscript-unfolded"))
    replaced = [t.name for t in proto.graph.initializer].index("1.weight")
    proto.doc_string, proto.graph.doc_string = "a test network", "its graph"
    proto.metadata_props.add(key="author", value="someone")
    proto.graph.value_info.extend(proto.graph.output)
    gamma = proto.graph.initializer[replaced]
    gamma.doc_string = "BatchNorm's gamma"
    values = numpy_helper.to_array(gamma)
    gamma.ClearField("raw_data")
    gamma.float_data.extend(values.reshape(-1).tolist())
    return proto, replaced


def test_writer_output_is_what_a_whole_copy_gives(tmp_path, monkeypatch):
    """The replaced initializers are copied without their data; the bytes written are those of
    the copy of the whole model with the data replaced."""
    proto, replaced = _decorated_cnn()
    model = load_onnx(proto.SerializeToString())
    changed = random_rescaling(model)
    assert model.payload.graph.initializer[replaced].name in changed
    copy = onnx_write.copy_without_data(model.payload, lambda tensor: tensor.name in changed)
    for original, copied in zip(model.payload.graph.initializer, copy.graph.initializer):
        if original.name in changed:
            assert not (copied.raw_data or copied.float_data or copied.external_data) and copied.dims == original.dims
        else:
            assert copied.SerializeToString() == original.SerializeToString()
    write_onnx(model, changed, tmp_path / "new.onnx", {"pathcond.version": "1"})

    def whole_copy(payload, replaced):
        proto = onnx.ModelProto()
        proto.CopyFrom(payload)
        return proto

    monkeypatch.setattr(onnx_write, "copy_without_data", whole_copy)
    write_onnx(model, changed, tmp_path / "whole.onnx", {"pathcond.version": "1"})
    assert (tmp_path / "new.onnx").read_bytes() == (tmp_path / "whole.onnx").read_bytes()


# a field number no ONNX message uses, varint 7
_UNKNOWN_FIELD = bytes([0xC0, 0x3E, 0x07])


@pytest.mark.parametrize("protobuf", ["unknown_fields", "before 4.22"])
@pytest.mark.parametrize("level", ["model", "graph", "replaced initializer", "kept initializer"])
def test_writer_keeps_fields_the_installed_onnx_does_not_know(tmp_path, monkeypatch, level, protobuf):
    """With protobuf's unknown_fields, or as before 4.22 without it: the message's own method then
    tells, or (upb) raises, and the model is copied whole."""
    unknown_fields = pytest.importorskip("google.protobuf.unknown_fields")
    if protobuf == "before 4.22":
        import google.protobuf

        monkeypatch.delattr(google.protobuf, "unknown_fields")
        monkeypatch.setitem(sys.modules, "google.protobuf.unknown_fields", None)  # the import fails
    proto, replaced = _decorated_cnn()
    model = load_onnx(proto.SerializeToString())
    changed = random_rescaling(model)
    kept = next(i for i, t in enumerate(proto.graph.initializer) if t.name not in changed)
    index = {"replaced initializer": replaced, "kept initializer": kept}.get(level)
    if level == "model":
        proto = onnx.load_from_string(proto.SerializeToString() + _UNKNOWN_FIELD)
    elif level == "graph":
        proto.graph.ParseFromString(proto.graph.SerializeToString() + _UNKNOWN_FIELD)
    else:
        tensor = proto.graph.initializer[index]
        tensor.ParseFromString(tensor.SerializeToString() + _UNKNOWN_FIELD)
    model = load_onnx(proto.SerializeToString())
    write_onnx(model, changed, tmp_path / "out.onnx", {})

    written = onnx.load(tmp_path / "out.onnx")
    holder = {"model": written, "graph": written.graph}.get(level) or written.graph.initializer[index]
    assert [(field.field_number, field.data) for field in unknown_fields.UnknownFieldSet(holder)] == [(1000, 7)]


def test_half_precision_round_trip_keeps_half_precision(tmp_path):
    data = exported("cnn", "torchscript", torch.float16)
    model = load_onnx(data)
    assert {t.dtype for t in model.params.values()} == {torch.float16}
    changed = random_rescaling(model)
    destination = tmp_path / "half.onnx"
    write_onnx(model, changed, destination, {})

    written = onnx.load(destination)
    assert {t.data_type for t in written.graph.initializer} == {TensorProto.FLOAT16}
    x = example_input("cnn", batch=4, dtype=torch.float16)
    (before,) = reference_outputs(data, x.numpy())
    (after,) = reference_outputs(destination, x.numpy())
    assert after.dtype == np.float16
    assert relative_error(after, before) <= 1e-2
    reloaded = load_onnx(destination)
    assert relative_error(only_output(reloaded, x), only_output(model, x)) <= 1e-2


# --------------------------------------------------------------------------- hand-built graphs


# The IR version of the models built here: onnx 1.23 writes 14 by default, which onnxruntime 1.30
# (an H200 machine's) refuses, and the tests compare against onnxruntime directly.
ORT_READABLE_IR = 10


def _model(nodes, initializer, *, inputs=None, output_rank=2, opset=17, elem_type=TensorProto.FLOAT) -> bytes:
    """A one-input, one-output model; the output's dimensions are left to inference."""
    output = helper.make_tensor_value_info("y", elem_type, [f"d{i}" for i in range(output_rank)])
    graph = helper.make_graph(
        nodes,
        "g",
        inputs or [helper.make_tensor_value_info("x", elem_type, ["batch", 4])],
        [output],
        initializer,
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ORT_READABLE_IR
    ).SerializeToString()


def _tensor(name: str, array: np.ndarray, data_type: int = TensorProto.FLOAT) -> onnx.TensorProto:
    if data_type == TensorProto.BFLOAT16:
        return helper.make_tensor(name, data_type, array.shape, array.astype(np.float32).ravel().tolist())
    return numpy_helper.from_array(array.astype(helper.tensor_dtype_to_np_dtype(data_type)), name)


def _rng() -> np.random.Generator:
    return np.random.default_rng(3)


def _round_trip(data: bytes, tmp_path: Path, x: np.ndarray) -> tuple[dict, onnx.ModelProto]:
    model = load_onnx(data)
    changed = random_rescaling(model)
    destination = tmp_path / "out.onnx"
    write_onnx(model, changed, destination, {})
    (before,) = reference_outputs(data, x)
    (after,) = reference_outputs(destination, x)
    assert relative_error(after, before) <= TOLERANCE
    assert relative_error(only_output(load_onnx(destination), torch.from_numpy(x)), before) <= TOLERANCE
    return changed, onnx.load(destination)


def test_transposed_constant_and_shared_weights(tmp_path):
    """Weights behind a Transpose, in a Constant node, and one tensor aliased by an Identity."""
    rng = _rng()
    w1 = rng.normal(size=(5, 4))  # [out, in], read through a Transpose
    w2 = rng.normal(size=(5, 5))  # [in, out], held by a Constant node
    bias = rng.normal(size=5)  # shared by both layers, the second time through an Identity
    nodes = [
        helper.make_node("Transpose", ["w1"], ["w1_t"], perm=[1, 0], name="transpose"),
        helper.make_node("MatMul", ["x", "w1_t"], ["h0"], name="fc1"),
        helper.make_node("Add", ["h0", "b"], ["h1"], name="fc1_bias"),
        helper.make_node("Relu", ["h1"], ["h2"], name="relu"),
        helper.make_node("Constant", [], ["w2"], value=_tensor("w2", w2), name="w2_const"),
        helper.make_node("Identity", ["b"], ["b_alias"], name="alias"),
        helper.make_node("Gemm", ["h2", "w2", "b_alias"], ["y"], name="fc2"),
    ]
    data = _model(nodes, [_tensor("w1", w1), _tensor("b", bias)])
    model = load_onnx(data)
    layers = {n.name: n for n in model.graph.nodes if isinstance(n, Linear)}
    assert (layers["fc1"].weight, layers["fc1"].weight_transposed, layers["fc1"].bias) == ("w1", False, "b")
    assert (layers["fc2"].weight, layers["fc2"].weight_transposed, layers["fc2"].bias) == ("w2", True, "b_alias")

    # fc2 produces the output, so its bias keeps its value while the tensor it shared changes.
    changed, written = _round_trip(data, tmp_path, rng.normal(size=(3, 4)).astype(np.float32))
    assert {"w1", "w2", "b"} <= set(changed) and "b_alias" not in changed
    constants = {n.output[0]: n for n in written.graph.node if n.op_type == "Constant"}
    assert set(constants) == {"w2", "b_alias"}
    assert np.array_equal(numpy_helper.to_array(constants["b_alias"].attribute[0].t), bias.astype(np.float32))
    assert "transpose" in {n.name for n in written.graph.node}


def test_identity_alias_from_the_torchscript_exporter(tmp_path):
    """TorchScript shares equal tensors (here the zero biases of folded fresh BatchNorms)."""
    torch.manual_seed(0)
    module = build("residual")
    for bn in module.modules():
        if isinstance(bn, torch.nn.BatchNorm2d):
            bn.reset_parameters()
            bn.reset_running_stats()
    x = example_input("residual")
    data = export(module, x, "torchscript")
    assert any(n.op_type == "Identity" for n in onnx.load_from_string(data).graph.node)
    _round_trip(data, tmp_path, x.numpy())


def _two_layer_model(data_type: int = TensorProto.FLOAT) -> tuple[bytes, dict[str, np.ndarray]]:
    rng = _rng()
    tensors = {"w1": rng.normal(size=(3, 4)), "b1": rng.normal(size=3), "w2": rng.normal(size=(2, 3))}
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], transB=1, name="fc1"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("Gemm", ["r", "w2"], ["y"], transB=1, name="fc2"),
    ]
    return _model(nodes, [_tensor(k, v, data_type) for k, v in tensors.items()], elem_type=data_type), tensors


@pytest.mark.parametrize(
    "data_type, dtype",
    [(TensorProto.FLOAT16, torch.float16), (TensorProto.BFLOAT16, torch.bfloat16), (TensorProto.DOUBLE, torch.float64)],
    ids=["float16", "bfloat16", "float64"],
)
def test_parameter_dtypes_are_kept_bit_exact(data_type, dtype, tmp_path):
    data, tensors = _two_layer_model(data_type)
    model = load_onnx(data)
    assert {t.dtype for t in model.params.values()} == {dtype}
    changed = random_rescaling(model)
    destination = tmp_path / "out.onnx"
    write_onnx(model, changed, destination, {})
    reloaded = load_onnx(destination)
    for key in tensors:
        assert reloaded.params[key].dtype == dtype
        assert torch.equal(reloaded.params[key], changed.get(key, model.params[key]))


def test_external_data_is_read_from_the_path(tmp_path):
    data, _ = _two_layer_model()
    source = tmp_path / "external.onnx"
    onnx.save_model(
        onnx.load_from_string(data), source, save_as_external_data=True, location="external.data", size_threshold=0
    )
    with pytest.raises(InputError, match="external data"):
        load_onnx(source.read_bytes(), name="<stdin>")
    model = load_onnx(source)
    destination = tmp_path / "out.onnx"
    write_onnx(model, random_rescaling(model), destination, {})
    x = _rng().normal(size=(3, 4)).astype(np.float32)
    assert relative_error(reference_outputs(destination, x)[0], reference_outputs(data, x)[0]) <= TOLERANCE


def test_companions_are_found_without_parsing_a_model_that_names_none(tmp_path, monkeypatch):
    """A file without the bytes of onnx's ``location`` key names no external data: told without
    parsing it. A file that has them (external data, or only a doc string that says
    "location") is parsed, and lists exactly the files it names."""
    from pathcond_cli.io.formats import onnx_read

    data, _ = _two_layer_model()
    inline, external, described = tmp_path / "inline.onnx", tmp_path / "external.onnx", tmp_path / "described.onnx"
    inline.write_bytes(data)
    onnx.save_model(
        onnx.load_from_string(data),
        external,
        save_as_external_data=True,
        location="external.onnx.data",
        size_threshold=0,
    )
    with_doc = onnx.load_from_string(data)
    with_doc.doc_string = "trained at an undisclosed location"
    onnx.save_model(with_doc, described)
    parsed = []
    load = onnx.load
    monkeypatch.setattr(onnx, "load", lambda path, **kwargs: parsed.append(path) or load(path, **kwargs))
    assert onnx_read.external_data_files(inline) == [] and onnx_read.own_external_data(inline) == []
    assert parsed == []
    assert onnx_read.external_data_files(described) == [] and onnx_read.own_external_data(described) == []
    assert onnx_read.external_data_files(external) == [tmp_path / "external.onnx.data"]
    assert onnx_read.own_external_data(external) == [tmp_path / "external.onnx.data"]
    assert len(parsed) == 4


def test_unsupported_nodes_are_all_listed():
    rng = _rng()
    nodes = [
        helper.make_node("Gemm", ["x", "w1"], ["h"], transB=1, name="fc1"),
        helper.make_node("Sigmoid", ["h"], ["s"], name="squash"),
        helper.make_node("Gemm", ["s", "w2"], ["g"], transB=1, name="fc2"),
        helper.make_node("Gelu", ["g"], ["a"], name="smooth"),
        helper.make_node("Gemm", ["a", "w3"], ["b"], transB=1, name="fc3"),
        helper.make_node("Softmax", ["b"], ["p"], name="probabilities"),
        # Between layers, all three are refused; after the last layer they would be post-processing.
        helper.make_node("Gemm", ["p", "w4"], ["y"], transB=1, name="fc4"),
    ]
    data = _model(nodes, [_tensor(f"w{i}", rng.normal(size=(4, 4))) for i in range(1, 5)], opset=20)
    with pytest.raises(UnsupportedModelError) as error:
        load_onnx(data, name="act.onnx")
    message = str(error.value)
    assert "act.onnx" in message
    assert len(error.value.problems) == 3
    for node, op in [("squash", "Sigmoid"), ("smooth", "Gelu"), ("probabilities", "Softmax")]:
        assert f"{op} ×1: node '{node}'" in message
    assert "homogeneous" in message


def test_unsupported_nodes_of_an_exported_model_are_all_listed():
    module = torch.nn.Sequential(
        torch.nn.Linear(4, 4),
        torch.nn.Sigmoid(),
        torch.nn.Linear(4, 4),
        torch.nn.GELU(),
        torch.nn.Linear(4, 4),
        torch.nn.Tanh(),
        torch.nn.Linear(4, 4),  # a Tanh after the last layer is post-processing
    ).eval()
    with pytest.raises(UnsupportedModelError) as error:
        load_onnx(export(module, torch.randn(3, 4), "torchscript"))
    message = str(error.value)
    for op in ("Sigmoid", "Gelu", "Tanh"):
        assert f"{op} ×1: node " in message


@pytest.mark.parametrize(
    "node, reason",
    [
        (
            helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[2, 2], pads=[0, 1, 0, 0], name="c"),
            "asymmetric padding",
        ),
        (helper.make_node("Conv", ["x", "k"], ["y"], auto_pad="SAME_UPPER", name="c"), "auto_pad"),
        (helper.make_node("Add", ["x", "b"], ["y"], name="c"), "bias of a MatMul"),
        (helper.make_node("Resize", ["x", "", "sc"], ["y"], mode="cubic", name="c"), "mode 'cubic'"),
        (helper.make_node("Resize", ["x", "", "sc"], ["y"], mode="nearest", name="c"), "half_pixel/round_prefer_floor"),
        (
            helper.make_node(
                "Resize", ["x", "", "sc"], ["y"], mode="linear", coordinate_transformation_mode="asymmetric", name="c"
            ),
            "'asymmetric' is not supported",
        ),
        (helper.make_node("Resize", ["x", "", "sc2"], ["y"], mode="linear", name="c"), "batch or channel axis"),
    ],
    # Reshapes, transposes and spatial concatenations are element-wise copies, read as such
    # (tests/io/test_onnx_other_exporters.py).
    ids=[
        "asymmetric-pads",
        "auto-pad",
        "constant-add",
        "resize-cubic",
        "resize-nearest-rounding",
        "resize-linear-asymmetric",
        "resize-channels",
    ],
)
def test_unsupported_attributes_are_explained(node, reason):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2, 4, 4])
    initializer = [
        _tensor("k", np.ones((2, 2, 1, 2))),
        _tensor("b", np.ones(4)),
        numpy_helper.from_array(np.array([0, 4, 2, 4]), "shape"),
        _tensor("sc", np.array([1.0, 1.0, 2.0, 2.0])),
        _tensor("sc2", np.array([1.0, 2.0, 2.0, 2.0])),
    ]
    with pytest.raises(UnsupportedModelError, match=reason):
        load_onnx(_model([node], initializer, inputs=[x], output_rank=4))


# --------------------------------------------------------------------------- input shapes


def test_symbolic_batch_dimension_is_fine():
    model = load_onnx(exported("cnn", "torchscript"))
    dims = onnx.load_from_string(exported("cnn", "torchscript")).graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param == "batch"
    assert model.graph.inputs[0].shape == (3, 8, 8)


def _with_symbolic_spatial_dims(data: bytes) -> bytes:
    proto = onnx.load_from_string(data)
    dims = proto.graph.input[0].type.tensor_type.shape.dim
    dims[2].dim_param, dims[3].dim_param = "height", "width"
    return proto.SerializeToString()


def test_symbolic_spatial_dimensions_need_an_input_shape():
    data = _with_symbolic_spatial_dims(exported("concat", "torchscript"))
    with pytest.raises(UsageError, match="--input-shape"):
        load_onnx(data, name="fcn.onnx")
    model = load_onnx(data, input_shape=(3, 7, 9))
    assert model.graph.inputs[0].shape == (3, 7, 9)
    x = torch.randn(2, 3, 7, 9)
    assert relative_error(only_output(model, x), torch_output("concat", x)) <= TOLERANCE


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_input_shape_overrides_the_exported_size(exporter):
    """torch.export records every intermediate shape for the example input: they must not stick."""
    model = load_onnx(exported("concat", exporter), input_shape=(3, 7, 9))
    assert model.graph.inputs[0].shape == (3, 7, 9)
    x = torch.randn(2, 3, 7, 9)
    assert relative_error(only_output(model, x), torch_output("concat", x)) <= TOLERANCE


def test_input_shape_of_the_wrong_rank_is_refused():
    with pytest.raises(UsageError, match="input-shape"):
        load_onnx(exported("cnn", "torchscript"), input_shape=(3, 8))


# --------------------------------------------------------------------------- unreadable input


@pytest.mark.parametrize(
    "content",
    [b"\x00\x01garbage\xff\xfe" * 10, b"", b"not an onnx file at all"],
    ids=["binary", "empty", "text"],
)
def test_garbage_is_an_input_error(content, tmp_path):
    path = tmp_path / "bad.onnx"
    path.write_bytes(content)
    with pytest.raises(InputError) as error:
        load_onnx(path)
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_truncated_file_is_an_input_error(tmp_path):
    data = exported("cnn", "torchscript")
    path = tmp_path / "truncated.onnx"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match="truncated.onnx"):
        load_onnx(path)


def test_missing_file_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="missing.onnx"):
        load_onnx(tmp_path / "missing.onnx")


def test_invalid_model_is_an_input_error():
    node = helper.make_node("Relu", ["undefined"], ["y"], name="r")
    with pytest.raises(InputError, match="not a valid ONNX model"):
        load_onnx(_model([node], []), name="broken.onnx")


def test_dropout_and_identity_become_identity_nodes():
    rng = _rng()
    nodes = [
        helper.make_node("Gemm", ["x", "w1"], ["h"], transB=1, name="fc1"),
        helper.make_node("Dropout", ["h"], ["d"], name="drop"),
        helper.make_node("Relu", ["d"], ["r"], name="relu"),
        helper.make_node("Identity", ["r"], ["i"], name="same"),
        helper.make_node("Gemm", ["i", "w2"], ["y"], transB=1, name="fc2"),
    ]
    model = load_onnx(_model(nodes, [_tensor("w1", rng.normal(size=(3, 4))), _tensor("w2", rng.normal(size=(2, 3)))]))
    assert [n.name for n in model.graph.nodes if isinstance(n, Identity)] == ["drop", "same"]
