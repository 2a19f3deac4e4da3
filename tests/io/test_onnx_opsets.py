"""ONNX files of every opset onnx.version_converter reads (7 and up), with nodes in any order.

Each file is rescaled through the CLI and checked by onnxruntime: the written file runs and
agrees with the original on random inputs; it is the original model with only tensor data
replaced (opset, IR version, producer, graph and nodes as they were); D does not rise. What
cannot be read (a cycle, a value no node gives, an operator the converter cannot carry) is
refused with its exit code, naming it.
"""

from __future__ import annotations

import functools
import io
import json
import random
import sys
import warnings

import fake_cuda
import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from cli_support import assert_clean_exit, invoke, parse_single_json
from onnx import TensorProto, helper, numpy_helper, version_converter
from torch import nn

from pathcond_cli.errors import InputError, UnsupportedModelError
from pathcond_cli.io.formats import onnx_read
from pathcond_cli.io.formats.onnx_format import load_onnx, reference_outputs

pytestmark = pytest.mark.filterwarnings("ignore")

# The opset the torch exports are made at, converted from there down to 7 and up to 12.
SOURCE_OPSET = 9
OPSETS = (7, 8, 9, 10, 11, 12)
# float32 kernels of one runtime on two rescalings of one function differ by a few ULPs.
RUNTIME_TOLERANCE = 1e-4


class ResidualCNN(nn.Module):
    """Conv, BatchNorm, ReLU, a residual Add, max pooling, Flatten and Gemm."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.body = nn.Conv2d(4, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn(self.stem(x)))
        y = torch.relu(y + self.body(y))
        return self.fc(torch.flatten(nn.functional.max_pool2d(y, 2), 1))


def _mlp() -> nn.Module:
    # 40 x 32: a weight large enough for the reader to convert the model without its data.
    return nn.Sequential(nn.Linear(40, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 3))


MODELS = {"cnn": (ResidualCNN, (3, 8, 8)), "mlp": (_mlp, (40,))}


def _module(name: str) -> nn.Module:
    torch.manual_seed(0)
    module = MODELS[name][0]()
    for layer in module.modules():
        if isinstance(layer, nn.BatchNorm2d):
            layer.running_mean.uniform_(-0.5, 0.5)
            layer.running_var.uniform_(0.5, 2.0)
            layer.weight.data.uniform_(0.5, 1.5)
            layer.bias.data.uniform_(-0.5, 0.5)
    for layer in module.modules():
        if isinstance(layer, nn.Linear | nn.Conv2d):
            # Rows of very different sizes: a rescaling that conditions them changes the tensors.
            layer.weight.data *= torch.logspace(-1, 1, layer.weight.shape[0]).view(-1, *[1] * (layer.weight.dim() - 1))
    return module.eval()


@functools.cache
def torch_export(name: str, opset: int) -> bytes:
    """The TorchScript exporter's file at ``opset``, BatchNorm kept as a node, batch symbolic."""
    buffer = io.BytesIO()
    with warnings.catch_warnings(), fake_cuda.suspended():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            _module(name),
            (torch.zeros(1, *MODELS[name][1]),),
            buffer,
            dynamo=False,
            opset_version=opset,
            do_constant_folding=False,
            input_names=["x"],
            output_names=["y"],
            dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}},
        )
    return buffer.getvalue()


def converted(name: str, opset: int) -> bytes:
    """The opset-9 export taken to ``opset`` by onnx.version_converter."""
    model = onnx.load_from_string(torch_export(name, SOURCE_OPSET))
    if opset != SOURCE_OPSET:
        model = version_converter.convert_version(model, opset)
    assert _opset(model) == opset
    return model.SerializeToString()


def _opset(model: onnx.ModelProto) -> int:
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def run_onnxruntime(path, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, inputs)


def random_inputs(path, batch: int = 3, seed: int = 0) -> dict[str, np.ndarray]:
    """Random arrays for the inputs a caller feeds (not the initializers an old IR lists too)."""
    model = onnx.load(str(path))
    stored = {t.name for t in model.graph.initializer}
    rng = np.random.default_rng(seed)
    inputs = {}
    for graph_input in model.graph.input:
        if graph_input.name in stored:
            continue
        dims = [d.dim_value if d.HasField("dim_value") else batch for d in graph_input.type.tensor_type.shape.dim]
        inputs[graph_input.name] = rng.standard_normal(dims).astype(np.float32)
    return inputs


def assert_runtimes_agree(original, written) -> None:
    for seed in range(3):
        inputs = random_inputs(original, seed=seed)
        before, after = run_onnxruntime(original, inputs), run_onnxruntime(written, inputs)
        assert len(before) == len(after)
        for b, a in zip(before, after):
            assert b.shape == a.shape
            assert np.abs(a - b).max() <= RUNTIME_TOLERANCE * np.abs(b).max()


def assert_written_as_read(original, written) -> None:
    """``written`` is ``original`` with only the data of some initializers changed."""
    before, after = onnx.load(str(original)), onnx.load(str(written))
    assert list(after.opset_import) == list(before.opset_import)
    assert after.ir_version == before.ir_version
    assert (after.producer_name, after.producer_version) == (before.producer_name, before.producer_version)
    assert after.graph.name == before.graph.name
    assert [n.SerializeToString() for n in after.graph.node] == [n.SerializeToString() for n in before.graph.node]
    assert [i.SerializeToString() for i in after.graph.input] == [i.SerializeToString() for i in before.graph.input]
    kept = {t.name: (t.data_type, list(t.dims)) for t in before.graph.initializer}
    assert {t.name: (t.data_type, list(t.dims)) for t in after.graph.initializer} == kept
    values = {t.name: numpy_helper.to_array(t) for t in before.graph.initializer}
    assert any(not np.array_equal(numpy_helper.to_array(t), values[t.name]) for t in after.graph.initializer), (
        "the rescaling changed nothing: the test would not see a writer that drops the new values"
    )


def rescale_and_check(path, tmp_path) -> dict:
    """Rescale ``path`` through the CLI and check the written file; returns the report."""
    written = tmp_path / f"{path.stem}.rescaled.onnx"
    result = invoke("rescale", path, "-o", written, "--json")
    assert_clean_exit(result, 0)
    report = parse_single_json(result.stdout)
    assert report["verification"]["independent"]["status"] == "passed"
    conditioning = report["conditioning"]
    assert conditioning["after"]["D"] <= conditioning["before"]["D"] * (1 + 1e-12)
    assert_written_as_read(path, written)
    assert_runtimes_agree(path, written)
    return report


# --------------------------------------------------------------------------- every opset


@pytest.mark.parametrize("opset", OPSETS)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_converted_exports_of_every_opset_are_rescaled_and_written_in_their_own(name, opset, tmp_path):
    path = tmp_path / f"{name}-opset{opset}.onnx"
    path.write_bytes(converted(name, opset))
    rescale_and_check(path, tmp_path)


@pytest.mark.parametrize("opset", [7, 8])
def test_old_torch_exports_list_their_initializers_as_inputs_and_feed_only_x(opset, tmp_path):
    path = tmp_path / f"cnn-opset{opset}.onnx"
    path.write_bytes(torch_export("cnn", opset))
    proto = onnx.load(str(path))
    assert proto.ir_version == 3 and _opset(proto) == opset
    assert {t.name for t in proto.graph.initializer} < {i.name for i in proto.graph.input}
    model = load_onnx(path)
    assert [node.name for node in model.graph.inputs] == ["x"] and model.graph.inputs[0].shape == (3, 8, 8)
    report = rescale_and_check(path, tmp_path)
    assert report["input_shape"] == [[3, 8, 8]]


def test_every_command_reads_a_converted_file(tmp_path):
    model = tmp_path / "cnn.onnx"
    model.write_bytes(converted("cnn", 8))
    result = invoke("inspect", model, "--json")
    assert_clean_exit(result, 0)
    assert parse_single_json(result.stdout)["input_shape"] == [[3, 8, 8]]

    rescaled = tmp_path / "rescaled.onnx"
    assert_clean_exit(invoke("rescale", model, "-o", rescaled, "-q"), 0)
    result = invoke("compare", model, rescaled, "--json")
    assert_clean_exit(result, 0)
    comparison = parse_single_json(result.stdout)
    # The path-lifting is invariant under rescaling: a rescaled pair is at distance 0 (rounding aside).
    assert comparison["path_metric"]["upper"] <= 1e-6 * comparison["path_norms"]["l1"]["value"]

    pruned = tmp_path / "pruned.onnx"
    result = invoke("prune", model, "--sparsity", "0.5", "-o", pruned, "--json")
    assert_clean_exit(result, 0)
    assert parse_single_json(result.stdout)["verification"]["independent"] == "passed"
    assert list(onnx.load(str(pruned)).opset_import) == list(onnx.load(str(model)).opset_import)

    spec = tmp_path / "cnn.yaml"
    assert_clean_exit(invoke("spec", model, "-o", spec), 0)
    assert spec.read_text().strip()

    unsorted = tmp_path / "unsorted.onnx"
    unsorted.write_bytes(_shuffled(torch_export("cnn", 11)))
    out = tmp_path / "out"
    out.mkdir()
    result = invoke("rescale", model, unsorted, "--output-dir", out, "--json")
    assert_clean_exit(result, 0)
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(lines) == 2 and all("error" not in line for line in lines)
    for source in (model, unsorted):
        assert_runtimes_agree(source, out / f"{source.stem}.pathcond.onnx")


@pytest.mark.parametrize("opset", [7, 9])
def test_onnx_reference_evaluates_old_batchnorm_as_onnxruntime_does(opset, tmp_path):
    path = tmp_path / "cnn.onnx"
    path.write_bytes(torch_export("cnn", opset))
    inputs = random_inputs(path)
    (expected,) = run_onnxruntime(path, inputs)
    (actual,) = reference_outputs(path, inputs)
    assert np.abs(actual - expected).max() <= RUNTIME_TOLERANCE * np.abs(expected).max()


def test_without_onnxruntime_onnx_reference_checks_an_old_file(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime raises ImportError
    path = tmp_path / "cnn.onnx"
    path.write_bytes(torch_export("cnn", 7))
    result = invoke("rescale", path, "-o", tmp_path / "out.onnx", "--json")
    assert_clean_exit(result, 0)
    independent = parse_single_json(result.stdout)["verification"]["independent"]
    assert (independent["runtime"], independent["status"]) == ("onnx.reference", "passed")


# --------------------------------------------------------------------------- node order


def _shuffled(data: bytes, seed: int = 3) -> bytes:
    """The model with its nodes in an order that is not a dependency order (keras2onnx's way)."""
    model = onnx.load_from_string(data)
    nodes = list(model.graph.node)
    random.Random(seed).shuffle(nodes)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    assert onnx_read.dependency_order(model.graph, "shuffled") is not None
    return model.SerializeToString()


@pytest.mark.parametrize("opset", [9, 17])
def test_nodes_in_any_order_are_read_in_dependency_order_and_written_in_the_files(opset, tmp_path):
    path = tmp_path / f"unsorted-{opset}.onnx"
    path.write_bytes(_shuffled(torch_export("cnn", opset)))
    with pytest.raises(onnx.checker.ValidationError, match="topologically sorted"):
        onnx.checker.check_model(onnx.load(str(path)))
    rescale_and_check(path, tmp_path)


def test_a_sorted_graph_keeps_its_order():
    graph = onnx.load_from_string(torch_export("cnn", 17)).graph
    assert onnx_read.dependency_order(graph, "sorted") is None


def _relu_model(nodes: list[onnx.NodeProto], opset: int = 17) -> bytes:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])
    return helper.make_model(
        helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", opset)]
    ).SerializeToString()


def test_a_cycle_is_an_input_error_naming_its_nodes(tmp_path):
    path = tmp_path / "cycle.onnx"
    path.write_bytes(
        _relu_model(
            [
                helper.make_node("Relu", ["x"], ["h"], name="first"),
                helper.make_node("Add", ["h", "back"], ["s"], name="join"),
                helper.make_node("Relu", ["s"], ["back"], name="loop"),
                helper.make_node("Relu", ["s"], ["y"], name="out"),
            ]
        )
    )
    stderr = assert_clean_exit(invoke("inspect", path), 3, "cycle")
    assert "node 'join' (Add) reads 'back' of node 'loop' (Relu), which reads 's' of node 'join' (Add)" in stderr


@pytest.mark.parametrize(
    "nodes, named",
    [
        ([helper.make_node("Add", ["x", "ghost"], ["y"], name="join")], ["node 'join' (Add)", "'ghost'"]),
        ([helper.make_node("Relu", ["x"], ["h"], name="r")], ["graph output 'y'"]),
    ],
    ids=["node-input", "graph-output"],
)
def test_a_value_no_node_gives_is_an_input_error_naming_it(nodes, named, tmp_path):
    path = tmp_path / "dangling.onnx"
    path.write_bytes(_relu_model(nodes))
    assert_clean_exit(
        invoke("rescale", path, "-o", tmp_path / "out.onnx"), 3, "no node, initializer or graph input", *named
    )
    assert not (tmp_path / "out.onnx").exists()


# --------------------------------------------------------------------------- what the converter cannot carry


def test_an_operator_the_converter_cannot_carry_is_named_with_its_opset(tmp_path):
    # Per-activation BatchNorm (spatial=0) has no opset-9 form: the converter refuses it.
    stored = [numpy_helper.from_array(np.ones((2, 2, 1, 1), np.float32), "w")] + [
        numpy_helper.from_array(np.ones((2, 4, 4), np.float32), k) for k in ("g", "b", "m", "v")
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 4, 4])
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
        helper.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], ["n"], name="norm", spatial=0),
        helper.make_node("Relu", ["n"], ["y"], name="relu"),
    ]
    inputs = [x] + [helper.make_tensor_value_info(t.name, TensorProto.FLOAT, t.dims) for t in stored]
    path = tmp_path / "per-activation.onnx"
    onnx.save(
        helper.make_model(
            helper.make_graph(nodes, "g", inputs, [y], stored), opset_imports=[helper.make_opsetid("", 7)], ir_version=3
        ),
        str(path),
    )
    assert_clean_exit(
        invoke("rescale", path),
        4,
        "operator 'BatchNormalization' of opset 7",
        "node 'norm'",
        "from opset 8 to 9",
        "spatial",
    )


def test_a_tensor_the_conversion_changes_is_refused(monkeypatch):
    convert = version_converter.convert_version

    def reshaping(model, target):
        result = convert(model, target)
        weight = next(t for t in result.graph.initializer if t.name == "0.weight")
        weight.dims[:] = [weight.dims[1], weight.dims[0]]
        return result

    monkeypatch.setattr(onnx_read.version_converter, "convert_version", reshaping)
    with pytest.raises(UnsupportedModelError, match="changes its tensor '0.weight'"):
        load_onnx(converted("mlp", 8))


# --------------------------------------------------------------------------- MATLAB-style files


def _matlab_style(*, spatial_batchnorm: bool = False) -> onnx.ModelProto:
    """An opset-8, IR-3 network as MATLAB writes one: batch 1, every initializer also a graph
    input, the image flattened then MatMul (weights stored input-major) and Add layers."""
    rng = np.random.default_rng(4)
    sizes = (25, 8, 6, 3)
    stored, nodes, value = [], [helper.make_node("Flatten", ["input"], ["flat"], name="flatten", axis=1)], "flat"
    for index, (fan_in, fan_out) in enumerate(zip(sizes, sizes[1:]), 1):
        scale = np.logspace(-1, 1, fan_out, dtype=np.float32)
        stored += [
            numpy_helper.from_array(
                (rng.standard_normal((fan_in, fan_out)) * scale).astype(np.float32), f"fc_{index}_W"
            ),
            numpy_helper.from_array(rng.standard_normal(fan_out).astype(np.float32), f"fc_{index}_B"),
        ]
        nodes += [
            helper.make_node("MatMul", [value, f"fc_{index}_W"], [f"fc_{index}_mm"], name=f"fc_{index}"),
            helper.make_node("Add", [f"fc_{index}_mm", f"fc_{index}_B"], [f"fc_{index}"], name=f"fc_{index}_add"),
        ]
        value = f"fc_{index}"
        if index < len(sizes) - 1:
            nodes.append(helper.make_node("Relu", [value], [f"relu_{index}"], name=f"relu_{index}"))
            value = f"relu_{index}"
    inputs = [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 1, 5, 5])]
    inputs += [helper.make_tensor_value_info(t.name, TensorProto.FLOAT, t.dims) for t in stored]
    output = helper.make_tensor_value_info(value, TensorProto.FLOAT, [1, 3])
    return helper.make_model(
        helper.make_graph(nodes, "matlab", inputs, [output], stored),
        opset_imports=[helper.make_opsetid("", 8)],
        ir_version=3,
        producer_name="MATLAB Deep Learning Toolbox Converter for ONNX Model Format",
        producer_version="23.2.0",
    )


def test_a_matlab_style_opset_8_file_is_rescaled(tmp_path):
    path = tmp_path / "matlab.onnx"
    onnx.save(_matlab_style(), str(path))
    model = load_onnx(path)
    assert [node.name for node in model.graph.inputs] == ["input"]
    rescale_and_check(path, tmp_path)


# --------------------------------------------------------------------------- external data


def test_a_missing_external_data_file_names_the_folder_searched(tmp_path):
    model = onnx.load_from_string(torch_export("mlp", 17))
    folder = tmp_path / "weights"
    folder.mkdir()
    path = folder / "mlp.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="mlp.onnx.data", size_threshold=0)
    (folder / "mlp.onnx.data").unlink()
    with pytest.raises(InputError, match="mlp.onnx.data") as error:
        load_onnx(path)
    assert f"looked for in '{folder}'" in str(error.value)
