"""Trust, ONNX files: "verified" means that a runtime other than
pathcond's, run on the written file, computes the original function; the file loads wherever the
original loads; what goes to stdout stands alone; replacing an output deletes only its own data
(the same rule holds for the shards of a replaced safetensors index).

The oracle is the file on disk run by onnx.reference (and onnxruntime where installed), never
pathcond's reading of it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import safetensors.torch
import torch
from cli_support import (
    assert_clean_exit,
    assert_unchanged,
    invoke,
    onnx_mlp_model,
    parse_single_json,
    snapshot,
    write_sharded_mlp,
)
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from onnx_models import dynamo_exporting, exported

import pathcond_cli
import pathcond_cli.rescaling
import pathcond_cli.verify
from pathcond_cli.engine.graph import Graph
from pathcond_cli.io.formats import onnx_format, onnx_read, onnx_write
from pathcond_cli.verify import compare

FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16)


def _outputs(path: Path | bytes, x: np.ndarray) -> list[np.ndarray]:
    model = onnx.load_from_string(path) if isinstance(path, bytes) else onnx.load(str(path))
    evaluator = ReferenceEvaluator(model)
    return evaluator.run(None, {evaluator.input_names[0]: x})


def _relative_difference(original: Path | bytes, written: Path | bytes, x: np.ndarray) -> float:
    before, after = _outputs(original, x), _outputs(written, x)
    return max(float(np.abs(b - a).max() / np.abs(b).max()) for b, a in zip(before, after))


def _assert_same_function(original: Path | bytes, written: Path | bytes, x: np.ndarray, tolerance: float) -> None:
    difference = _relative_difference(original, written, x)
    assert difference <= tolerance, f"the written file computes another function (relative difference {difference:.3g})"


def _rescaled_json(*args) -> dict:
    result = invoke("rescale", *args, "--json")
    assert_clean_exit(result, 0)
    return parse_single_json(result.stdout)


# -- 1. a parameter that another node reads too -------------------------------------------------


def _shared_parameter_model(path: Path, reader: str, *, batch: int | str = "N", dtype=np.float32) -> Path:
    """x → Gemm(W1, b1) → Relu → Gemm(W2, b2) → Mul by b1: the hidden bias, which the rescaling
    changes, is also the factor of the last Mul (directly, or through an Identity or a Cast)."""
    rng = np.random.default_rng(0)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    initializers = [
        numpy_helper.from_array(rng.standard_normal((1, 4)).astype(dtype), "W1"),
        numpy_helper.from_array(np.array([0.7], dtype), "b1"),
        numpy_helper.from_array(rng.standard_normal((3, 1)).astype(dtype), "W2"),
        numpy_helper.from_array((0.1 * rng.standard_normal(3)).astype(dtype), "b2"),
    ]
    nodes = [
        helper.make_node("Gemm", ["x", "W1", "b1"], ["h"], transB=1, name="fc1"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("Gemm", ["r", "W2", "b2"], ["z"], transB=1, name="fc2"),
    ]
    factor = "b1"
    if reader == "identity":
        nodes.append(helper.make_node("Identity", ["b1"], ["factor"], name="alias"))
        factor = "factor"
    elif reader == "cast":
        nodes.append(helper.make_node("Cast", ["b1"], ["factor"], to=elem, name="cast"))
        factor = "factor"
    nodes.append(helper.make_node("Div" if reader == "div" else "Mul", ["z", factor], ["y"], name="scale"))
    graph = helper.make_graph(
        nodes,
        "shared",
        [helper.make_tensor_value_info("x", elem, [batch, 4])],
        [helper.make_tensor_value_info("y", elem, [batch, 3])],
        initializers,
    )
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


@pytest.mark.parametrize("reader", ["mul", "div", "identity", "cast"])
@pytest.mark.parametrize("batch", ["N", 4])
def test_a_parameter_read_by_another_node_keeps_its_value_for_that_node(tmp_path, reader, batch):
    model = _shared_parameter_model(tmp_path / "shared.onnx", reader, batch=batch)
    out = tmp_path / "out.onnx"
    report = _rescaled_json(model, "-o", out)
    independent = report["verification"]["independent"]
    assert independent["status"] == "passed", independent
    assert any("'b1'" in w and "original value" in w for w in report["warnings"]), report["warnings"]
    x = np.random.default_rng(3).standard_normal((4, 4)).astype(np.float32)
    _assert_same_function(model, out, x, 1e-5)


def test_a_value_computed_from_a_parameter_and_read_elsewhere_is_refused_exit_4(tmp_path):
    """W1 reaches its Gemm through an Identity whose output a Mul reads too: no copy of the
    parameter can keep that Mul as it was, so the model is refused, naming both."""
    rng = np.random.default_rng(0)
    initializers = [
        numpy_helper.from_array(rng.standard_normal((1, 1)).astype(np.float32), "W1"),
        numpy_helper.from_array(rng.standard_normal((2, 1)).astype(np.float32), "W2"),
    ]
    nodes = [
        helper.make_node("Identity", ["W1"], ["W1_read"], name="read"),
        helper.make_node("Gemm", ["x", "W1_read"], ["h"], transB=1, name="fc1"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("Gemm", ["r", "W2"], ["z"], transB=1, name="fc2"),
        helper.make_node("Mul", ["z", "W1_read"], ["y"], name="scale"),
    ]
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])],
        initializers,
    )
    path = tmp_path / "chain.onnx"
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    before = snapshot(tmp_path)
    assert_clean_exit(invoke("rescale", path, "-o", tmp_path / "out.onnx"), 4, "'W1_read'", "node 'scale'")
    assert_unchanged(tmp_path, before)


def test_float64_convolutions_are_checked_by_onnx_reference(tmp_path):
    """onnxruntime has no float64 Conv: the independent check falls back to onnx.reference."""
    path = tmp_path / "cnn64.onnx"
    path.write_bytes(exported("cnn", "torchscript", torch.float64))
    independent = _rescaled_json(path, "-o", tmp_path / "out.onnx")["verification"]["independent"]
    assert independent["status"] == "passed", independent


def test_pathcond_s_own_check_runs_the_graph_read_back_from_the_written_file(tmp_path):
    """A written file whose Mul reads the rescaled bias: pathcond's own comparison, with no
    independent runtime at all, sees the function change."""
    original = _shared_parameter_model(tmp_path / "shared.onnx", "mul")
    wrong = onnx.load(str(original))
    for tensor in wrong.graph.initializer:
        factor = {"W1": 2.0, "b1": 2.0, "W2": 0.5}.get(tensor.name, 1.0)  # a valid rescaling of fc1 alone
        tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor) * np.float32(factor), tensor.name))
    onnx.save_model(wrong, str(tmp_path / "wrong.onnx"))
    before, after = pathcond_cli.load(original), pathcond_cli.load(tmp_path / "wrong.onnx")
    assert not compare(before.graph, before.params, after.params, rescaled_graph=after.graph).passed
    assert compare(before.graph, before.params, pathcond_cli.load(original).params, rescaled_graph=before.graph).passed


def test_a_written_graph_with_other_outputs_never_passes_on_what_they_share(tmp_path):
    model = tmp_path / "net.onnx"
    onnx.save_model(onnx_mlp_model(), str(model))
    loaded = pathcond_cli.load(model)
    hidden = next(node.name for node in loaded.graph.nodes if node.name.startswith("relu"))
    two_outputs = Graph(list(loaded.graph.nodes), (*loaded.graph.outputs, hidden), source="two outputs")
    assert not compare(two_outputs, loaded.params, loaded.params, rescaled_graph=loaded.graph).passed
    assert compare(two_outputs, loaded.params, loaded.params, rescaled_graph=two_outputs).passed


def test_without_an_independent_runtime_a_file_that_changes_the_function_is_not_written_exit_5(tmp_path, monkeypatch):
    """The writer is sabotaged to point the Mul back at the rescaled bias; no runtime is left
    to check the file: pathcond's own check must refuse it."""
    real_write = onnx_format.write_onnx

    def write_sharing_the_bias(model, changed, destination, metadata, **options):
        real_write(model, changed, destination, metadata, **options)
        written = onnx.load(str(destination))
        for node in written.graph.node:
            node.input[:] = ["b1" if name.startswith("b1.original_for") else name for name in node.input]
        onnx.save_model(written, str(destination))

    monkeypatch.setattr(onnx_format, "write_onnx", write_sharing_the_bias)
    monkeypatch.setattr(pathcond_cli.verify, "_onnx_runners", lambda model: ([], "no runtime installed"))
    model = _shared_parameter_model(tmp_path / "shared.onnx", "mul")
    before = snapshot(tmp_path)
    assert_clean_exit(invoke("rescale", model, "-o", tmp_path / "out.onnx"), 5, "differs from the original")
    assert_unchanged(tmp_path, before)


def test_a_written_file_the_runtime_cannot_load_is_a_failure_exit_5(tmp_path, monkeypatch):
    """onnx.reference (and onnxruntime) evaluate the original; the written file gains a node of
    an unknown domain that pathcond's reader skips (it is dead) but no runtime can load."""
    real_write = onnx_format.write_onnx

    def write_with_an_unknown_op(model, changed, destination, metadata, **options):
        real_write(model, changed, destination, metadata, **options)
        written = onnx.load(str(destination))
        written.graph.node.append(helper.make_node("Mystery", ["x"], ["dead"], domain="example.mystery"))
        written.opset_import.append(helper.make_opsetid("example.mystery", 1))
        onnx.save_model(written, str(destination))

    monkeypatch.setattr(onnx_format, "write_onnx", write_with_an_unknown_op)
    model = tmp_path / "net.onnx"
    onnx.save_model(onnx_mlp_model(), str(model))
    before = snapshot(tmp_path)
    assert_clean_exit(
        invoke("rescale", model, "-o", tmp_path / "out.onnx"),
        5,
        "cannot load or evaluate the written one",
        "nothing was written",
    )
    assert_unchanged(tmp_path, before)


# -- 2. a torch.onnx.export(dynamo=True) model with external data -------------------------------


class _PooledNet(torch.nn.Module):
    """A Conv (1.7 KiB of weights) pooled by ReduceMean over int64 axes, a Linear (2.5 KiB)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 16, 3)
        self.bn = torch.nn.BatchNorm2d(16)
        self.fc = torch.nn.Linear(16, 40)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv(x)))
        return self.fc(x.mean(dim=(2, 3)))


@pytest.fixture(scope="module")
def dynamo_export(tmp_path_factory) -> Path:
    """A real dynamo export written by torch with its external data (exported once: it is slow)."""
    folder = tmp_path_factory.mktemp("dynamo")
    path = folder / "pooled.onnx"
    with dynamo_exporting():
        torch.onnx.export(
            _PooledNet().eval(),
            (torch.randn(2, 3, 10, 10),),
            str(path),
            dynamo=True,
            external_data=True,
            dynamic_shapes=({0: torch.export.Dim("batch")},),
        )
    assert onnx_read.external_tensors(onnx.load(str(path), load_external_data=False))
    return path


def _copy_model(source: Path, folder: Path) -> Path:
    for file in source.parent.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    return folder / source.name


def test_a_dynamo_export_with_external_data_is_written_loadable_and_checked(tmp_path, dynamo_export):
    model = _copy_model(dynamo_export, tmp_path)
    out = tmp_path / "out.onnx"
    independent = _rescaled_json(model, "-o", out)["verification"]["independent"]
    assert independent["status"] == "passed", independent
    written = onnx.load(str(out), load_external_data=False)
    for tensor in written.graph.initializer:
        stored = tensor.data_location == TensorProto.EXTERNAL
        large_float = (
            tensor.data_type in FLOAT_TYPES
            and numpy_helper.to_array(tensor, base_dir=str(tmp_path)).nbytes >= onnx_write.EXTERNAL_MIN_BYTES
        )
        assert stored == large_float, (tensor.name, tensor.data_type, tuple(tensor.dims), stored)
    x = np.random.default_rng(1).standard_normal((2, 3, 10, 10)).astype(np.float32)
    _assert_same_function(model, out, x, 1e-4)
    onnxruntime = pytest.importorskip("onnxruntime")
    onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])


# -- 3. -o - on a model with external data ------------------------------------------------------


def test_stdout_receives_a_self_contained_model(tmp_path, dynamo_export):
    model = _copy_model(dynamo_export, tmp_path)
    before = snapshot(tmp_path)
    result = invoke("rescale", model, "-o", "-")
    assert_clean_exit(result, 0)
    streamed = result.stdout_bytes
    assert not onnx_read.external_tensors(onnx.load_from_string(streamed))
    x = np.random.default_rng(2).standard_normal((1, 3, 10, 10)).astype(np.float32)
    _assert_same_function(model, streamed, x, 1e-4)
    assert_unchanged(tmp_path, before)


def test_stdout_refuses_a_model_beyond_protobuf_s_limit_before_any_work_exit_6(tmp_path, monkeypatch):
    path = tmp_path / "net.onnx"
    onnx.save_model(onnx_mlp_model((64, 32, 5, 3)), str(path), save_as_external_data=True, size_threshold=0)
    monkeypatch.setattr(onnx_format, "PROTOBUF_MAX_BYTES", 4096)  # the model holds about 9 KiB
    solved = []
    monkeypatch.setattr(pathcond_cli.rescaling, "rescale", lambda *a, **k: solved.append(1))
    before = snapshot(tmp_path)
    assert_clean_exit(invoke("rescale", path, "-o", "-"), 6, "stdout", "2 GiB", "-o FILE.onnx", "Nothing was written")
    assert solved == []
    assert_unchanged(tmp_path, before)


# -- 6. replacing an output deletes only what is provably its own -------------------------------


def _write_external(model: onnx.ModelProto, path: Path, location: str) -> None:
    onnx.save_model(
        model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=location, size_threshold=0
    )


def _old_output(folder: Path, case: str) -> list[str]:
    """An existing out.onnx of the given kind; returns the files it names that must survive."""
    old = onnx_mlp_model((64, 32, 5, 3), seed=5)
    out = folder / "out.onnx"
    if case == "foreign name":
        # A downloaded out.onnx naming the user's thesis, whose size fits its one tensor exactly.
        (folder / "thesis.txt").write_bytes((b"my thesis " * 900)[:8192])
        tensor = onnx.TensorProto(name="fc1.weight", data_type=TensorProto.FLOAT, dims=[32, 64])
        for key, value in (("location", "thesis.txt"), ("offset", "0"), ("length", "8192")):
            tensor.external_data.add(key=key, value=value)
        tensor.data_location = TensorProto.EXTERNAL
        model = onnx_mlp_model((64, 32, 5, 3))
        model.graph.initializer[0].CopyFrom(tensor)
        onnx.save_model(model, str(out))
        return ["thesis.txt"]
    if case == "shared with another model":
        _write_external(old, out, "out.onnx.data")
        keep = onnx.load(str(out), load_external_data=False)
        onnx.save_model(keep, str(folder / "keep.onnx"))
        return ["out.onnx.data"]
    if case == "more than its tensors":
        _write_external(old, out, "out.onnx.data")
        with open(folder / "out.onnx.data", "ab") as handle:
            handle.write(b"notes appended later")
        return ["out.onnx.data"]
    assert case == "link"
    (folder / "elsewhere").mkdir()
    _write_external(old, folder / "elsewhere" / "out.onnx", "out.onnx.data")
    (folder / "out.onnx.data").symlink_to(folder / "elsewhere" / "out.onnx.data")
    onnx.save_model(onnx.load(str(folder / "elsewhere" / "out.onnx"), load_external_data=False), str(out))
    return ["out.onnx.data", "elsewhere/out.onnx.data"]


@pytest.mark.parametrize("case", ["foreign name", "shared with another model", "more than its tensors", "link"])
def test_replacing_an_output_never_deletes_data_not_provably_its_own(tmp_path, case):
    survivors = _old_output(tmp_path, case)
    contents = {name: (tmp_path / name).read_bytes() for name in survivors}
    source = tmp_path / "net.onnx"
    onnx.save_model(onnx_mlp_model((64, 32, 5, 3)), str(source))
    report = _rescaled_json(source, "-o", tmp_path / "out.onnx")
    assert {name: (tmp_path / name).read_bytes() for name in survivors} == contents
    assert any("left in place" in w and "thesis.txt" in w for w in report["warnings"]) or case != "foreign name"


def test_replacing_its_own_earlier_output_leaves_no_stale_data(tmp_path):
    source = tmp_path / "net.onnx"
    _write_external(onnx_mlp_model((64, 32, 5, 3)), source, "net.onnx.data")
    out = tmp_path / "out.onnx"
    for _ in range(3):
        assert_clean_exit(invoke("rescale", source, "-o", out, "-q"), 0)
        written = onnx.load(str(out), load_external_data=False)
        named = {e.value for t in written.graph.initializer for e in t.external_data if e.key == "location"}
        assert len(named) == 1
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["net.onnx", "net.onnx.data", "out.onnx", *named])
    x = np.random.default_rng(4).standard_normal((3, 64)).astype(np.float32)
    _assert_same_function(source, out, x, 1e-5)


def test_in_place_leaves_data_under_another_name_and_says_so(tmp_path):
    source = tmp_path / "net.onnx"
    _write_external(onnx_mlp_model((64, 32, 5, 3)), source, "weights.bin")
    original = (tmp_path / "weights.bin").read_bytes()
    report = _rescaled_json(source, "--in-place")
    assert (tmp_path / "weights.bin").read_bytes() == original
    assert any("weights.bin" in w and "left in place" in w for w in report["warnings"]), report["warnings"]
    assert "weights.bin" not in {
        e.value for t in onnx.load(str(source), load_external_data=False).graph.initializer for e in t.external_data
    }


@pytest.mark.parametrize("case", ["foreign name", "more than its tensors"])
def test_replacing_an_index_never_deletes_shards_not_provably_its_own(tmp_path, case):
    index, spec = write_sharded_mlp(tmp_path)
    out = tmp_path / "out.safetensors.index.json"
    if case == "foreign name":
        shard = "thesis.txt"
        (tmp_path / shard).write_bytes(b"my thesis")
    else:
        shard = "out-00001-of-00001.safetensors"
        safetensors.torch.save_file({"fc1.weight": torch.ones(2, 2), "notes": torch.zeros(3)}, str(tmp_path / shard))
    out.write_text(json.dumps({"metadata": {}, "weight_map": {"fc1.weight": shard}}))
    content = (tmp_path / shard).read_bytes()
    report = _rescaled_json(index, "--arch", spec, "-o", out)
    assert (tmp_path / shard).read_bytes() == content
    assert any(shard in w and "left in place" in w for w in report["warnings"]), report["warnings"]


def test_replacing_its_own_earlier_index_leaves_no_stale_shards(tmp_path):
    index, spec = write_sharded_mlp(tmp_path)
    out = tmp_path / "out.safetensors.index.json"
    for _ in range(3):
        assert_clean_exit(invoke("rescale", index, "--arch", spec, "-o", out, "-q"), 0)
        named = set(json.loads(out.read_text())["weight_map"].values())
        assert len(named) == 2
        expected = {
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            index.name,
            spec.name,
            out.name,
            *named,
        }
        assert {p.name for p in tmp_path.iterdir()} == expected


# -- the copy of a shared parameter never takes a name the graph already has --------


@pytest.mark.parametrize("where", ["input", "value_info", "output"])
def test_the_copy_of_a_shared_parameter_avoids_every_name_in_the_graph(tmp_path, where):
    path = _shared_parameter_model(tmp_path / "shared.onnx", "mul")
    model = onnx.load(str(path))
    taken = "b1.original_for_scale"
    if where == "input":
        # an input the network adds to its output (its own batch dimension)
        model.graph.input.append(helper.make_tensor_value_info(taken, TensorProto.FLOAT, ["N", 3]))
        model.graph.node[-1].output[0] = "y_scaled"
        model.graph.node.append(helper.make_node("Add", ["y_scaled", taken], ["y"], name="shift"))
    elif where == "value_info":
        model.graph.value_info.append(helper.make_tensor_value_info(taken, TensorProto.FLOAT, [1]))
    else:
        model.graph.node.append(helper.make_node("Relu", ["y"], [taken], name="extra"))
        model.graph.output.append(helper.make_tensor_value_info(taken, TensorProto.FLOAT, ["N", 3]))
    onnx.checker.check_model(model)
    onnx.save_model(model, str(path))
    out = tmp_path / "out.onnx"
    report = _rescaled_json(path, "-o", out)
    assert report["verification"]["passed"]
    written = onnx.load(str(out))
    copies = [t.name for t in written.graph.initializer if t.name.startswith("b1.original_for")]
    assert copies and taken not in copies
    names = (
        [i.name for i in written.graph.input]
        + [o.name for o in written.graph.output]
        + [v.name for v in written.graph.value_info]
        + [o for n in written.graph.node for o in n.output]
    )
    assert not set(copies) & set(names)
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    feeds = {"x": x, **({taken: np.ones((2, 3), np.float32)} if where == "input" else {})}
    before = ReferenceEvaluator(model).run(None, feeds)
    after = ReferenceEvaluator(written).run(None, feeds)
    for b, a in zip(before, after):
        assert np.allclose(a, b, rtol=1e-5, atol=1e-6)


# -- a tensor as both scale and shift is named once; a wrap pad beyond its axis is unsupported


def _conv_model(path: Path, middle: list, tensors: list, x_shape, y_shape, opset: int = 17) -> Path:
    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "W"),
        numpy_helper.from_array(rng.standard_normal((2, 4, 3, 3)).astype(np.float32), "W2"),
    ]
    graph = helper.make_graph(
        middle,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", *x_shape])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", *y_shape])],
        weights + tensors,
    )
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), str(path))
    return path


def test_one_initializer_as_scale_and_shift_is_refused_naming_each_node_once(tmp_path):
    scale = numpy_helper.from_array(np.full((1, 4, 1, 1), 1.5, np.float32), "s")
    path = _conv_model(
        tmp_path / "net.onnx",
        [
            helper.make_node("Conv", ["x", "W"], ["c"], name="conv", pads=[1, 1, 1, 1]),
            helper.make_node("Mul", ["c", "s"], ["m"], name="scale"),
            helper.make_node("Add", ["m", "s"], ["a"], name="shift"),
            helper.make_node("Relu", ["a"], ["r"], name="relu"),
            helper.make_node("Conv", ["r", "W2"], ["y"], name="conv2"),
        ],
        [scale],
        (3, 8, 8),
        (2, 6, 6),
    )
    before = snapshot(tmp_path)
    stderr = assert_clean_exit(
        invoke("rescale", path, "-o", tmp_path / "out.onnx"),
        4,
        "node 'shift' (Add)",
        "'s'",
        "node 'scale' multiplies by",
        "scale and the shift",
    )
    assert "node 'scale' and node 'scale'" not in stderr
    assert_unchanged(tmp_path, before)


def test_a_wrap_pad_larger_than_its_axis_is_unsupported_exit_4(tmp_path):
    pads = numpy_helper.from_array(np.array([0, 0, 10, 10, 0, 0, 10, 10], np.int64), "pads")
    # Between two layers: on the input, before any layer, it would be pre-processing.
    path = _conv_model(
        tmp_path / "net.onnx",
        [
            helper.make_node("Conv", ["x", "W"], ["c"], name="conv", pads=[1, 1, 1, 1]),
            helper.make_node("Pad", ["c", "pads"], ["p"], name="wrap_pad", mode="wrap"),
            helper.make_node("Relu", ["p"], ["r"], name="relu"),
            helper.make_node("Conv", ["r", "W2"], ["y"], name="conv2"),
        ],
        [pads],
        (3, 4, 4),
        (2, 22, 22),
        opset=19,
    )
    before = snapshot(tmp_path)
    assert_clean_exit(
        invoke("rescale", path, "-o", tmp_path / "out.onnx"),
        4,
        "node 'wrap_pad' (Pad)",
        "wrap padding of 10",
        "size 4",
        "wraps around more than once",
    )
    assert_unchanged(tmp_path, before)
