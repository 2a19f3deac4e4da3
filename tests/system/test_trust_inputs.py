"""Trust, inputs and verification: hostile inputs fail fast with their documented
code, a spec that does not describe the checkpoint is refused, verification runs against the
real thing (the user's module, the reloaded file, an independent runtime), and a bug stays a
bug (exit 1) instead of being blamed on the input.
"""

from __future__ import annotations

import json
import struct
import sys
import time

import numpy as np
import onnx
import pytest
import safetensors.torch
import torch
import yaml
from cli_support import (
    assert_clean_exit,
    assert_unchanged,
    check_report,
    invoke,
    mlp_spec,
    mlp_tensors,
    parse_single_json,
    snapshot,
    write_mlp,
    write_onnx_mlp,
)
from onnx import TensorProto, helper, numpy_helper

import pathcond_cli
import pathcond_cli.module_route
import pathcond_cli.verify
from pathcond_cli.errors import InputError, UnsupportedModelError, VerificationError
from pathcond_cli.io.formats import onnx_ops


def _fails_cleanly(directory, code: int, args, *needles: str, input: bytes | None = None) -> str:
    before = snapshot(directory)
    result = invoke(*args, input=input)
    stderr = assert_clean_exit(result, code, *needles)
    assert_unchanged(directory, before)
    return stderr


# -- 2. resource bombs fail within seconds --------------------------------------------------------


def _conv_bomb(path, side: int) -> None:
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv1"),
        helper.make_node("Relu", ["c"], ["r"], name="relu1"),
        helper.make_node("GlobalAveragePool", ["r"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["y"], name="flat"),
    ]
    graph = helper.make_graph(
        nodes,
        "bomb",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, side, side])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        [numpy_helper.from_array(np.ones((4, 1, 3, 3), np.float32), "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save_model(model, str(path))


def test_onnx_declaring_a_huge_activation_is_refused_before_allocating(tmp_path):
    path = tmp_path / "bomb.onnx"
    _conv_bomb(path, 100_000)
    started = time.monotonic()
    _fails_cleanly(tmp_path, 3, ["rescale", path, "-o", tmp_path / "out.onnx"], "memory", "conv1", "(4, 99998, 99998)")
    assert time.monotonic() - started < 60  # seconds, not an out-of-memory kill after minutes
    _fails_cleanly(tmp_path, 3, ["inspect", path, "--input-shape", "1,100000,100000"], "conv1")


def test_spec_declaring_a_huge_input_is_refused(tmp_path):
    spec = mlp_spec()
    spec["layers"][0]["shape"] = [10**11]
    checkpoint, spec_path = write_mlp(tmp_path, spec=spec)
    _fails_cleanly(tmp_path, 3, ["inspect", checkpoint, "--arch", spec_path], "memory", "(100000000000,)")


YAML_BOMB = """a: &a ["x","x","x","x","x","x","x","x","x"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
layers: [{name: x, type: input, shape: [6]}, {name: fc1, type: linear, weight: *g}]
"""


def test_yaml_alias_bomb_is_refused_quickly_with_a_short_message(tmp_path):
    checkpoint, spec = write_mlp(tmp_path)
    spec.write_text(YAML_BOMB)
    assert len(YAML_BOMB) < 600
    stderr = _fails_cleanly(tmp_path, 3, ["rescale", checkpoint, "--arch", spec], "aliases")
    assert len(stderr) < 1000
    # The same spec without aliases reads.
    spec.write_text(yaml.safe_dump(mlp_spec()))
    assert_clean_exit(invoke("inspect", checkpoint, "--arch", spec, "-q"), 0)


@pytest.mark.parametrize("where", ["yaml-spec", "json-spec", "embedded-spec", "safetensors-header", "index"])
def test_deeply_nested_documents_exit_3(tmp_path, where):
    deep = "[" * 50_000 + "]" * 50_000
    checkpoint, spec = write_mlp(tmp_path)
    args = ["inspect", checkpoint, "--arch", spec]
    if where == "yaml-spec":
        spec.write_text("layers: " + deep + "\n")
    elif where == "json-spec":
        spec.write_text('{"layers": ' + deep + "}")
    elif where == "embedded-spec":
        safetensors.torch.save_file(
            mlp_tensors(), str(checkpoint), metadata={"pathcond.spec": '{"layers": ' + deep + "}"}
        )
        args = ["inspect", checkpoint]
    elif where == "safetensors-header":
        header = ('{"__metadata__": {"x": "y"}, "deep": ' + deep + "}").encode()
        checkpoint.write_bytes(struct.pack("<Q", len(header)) + header)
    else:
        index = tmp_path / "model.safetensors.index.json"
        index.write_text('{"metadata": {}, "weight_map": {"a": "b"}, "x": ' + deep + "}")
        args = ["inspect", index, "--arch", spec]
    _fails_cleanly(tmp_path, 3, args, "nest")


def test_endless_stdin_is_cut_off_exit_3(tmp_path, monkeypatch):
    import pathcond_cli.io.formats

    monkeypatch.setattr(pathcond_cli.io.formats, "available_memory", lambda: 40_000)
    _fails_cleanly(tmp_path, 3, ["inspect", "-"], "<stdin>", "more than 10000 bytes", input=b"\x00" * 50_000)


def test_huge_embedded_values_are_not_echoed(tmp_path):
    spec = mlp_spec()
    spec["layers"][1]["stride"] = "x" * 1_000_000
    spec["layers"][2]["type"] = "y" * 1_000_000
    checkpoint, spec_path = write_mlp(tmp_path, spec=spec)
    stderr = _fails_cleanly(tmp_path, 3, ["inspect", checkpoint, "--arch", spec_path], "stride")
    assert len(stderr) < 3000


# -- 5. unused tensors ------------------------------------------------------------------------


def _bn_checkpoint(tmp_path):
    tensors = mlp_tensors()
    tensors.update(
        {
            "bn1.weight": torch.rand(8) + 0.5,
            "bn1.bias": torch.randn(8),
            "bn1.running_mean": torch.randn(8),
            "bn1.running_var": torch.rand(8) + 0.5,
            "bn1.num_batches_tracked": torch.tensor(3),
        }
    )
    return write_mlp(tmp_path, tensors=tensors)  # the spec forgot the batchnorm layer


def test_spec_that_forgets_a_layer_is_refused_naming_it(tmp_path):
    checkpoint, spec = _bn_checkpoint(tmp_path)
    stderr = _fails_cleanly(
        tmp_path, 3, ["rescale", checkpoint, "--arch", spec], "bn1.running_mean", "batchnorm", "'bn1'", "--allow-unused"
    )
    assert "num_batches_tracked" not in stderr
    _fails_cleanly(tmp_path, 3, ["inspect", checkpoint, "--arch", spec], "bn1.weight")


def test_allow_unused_carries_them_through_with_a_warning(tmp_path):
    checkpoint, spec = _bn_checkpoint(tmp_path)
    out = tmp_path / "out.safetensors"
    result = invoke("rescale", checkpoint, "--arch", spec, "-o", out, "--allow-unused", "--json")
    assert_clean_exit(result, 0)
    report = parse_single_json(result.stdout)
    check_report(report, rescale=True)
    (warning,) = report["warnings"]
    assert "bn1.running_var" in warning
    written = safetensors.torch.load_file(str(out))
    assert torch.equal(written["bn1.running_var"], safetensors.torch.load_file(str(checkpoint))["bn1.running_var"])


# -- 6. rescale_module verifies the module itself ---------------------------------------------


class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 6)
        self.fc2 = torch.nn.Linear(6, 6)
        self.fc2.weight = self.fc1.weight
        self.out = torch.nn.Linear(6, 2)

    def forward(self, x):
        return self.out(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def test_tied_weights_are_refused_and_the_module_is_left_as_it_was():
    torch.manual_seed(0)
    module = _Tied()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(UnsupportedModelError, match="fc1.weight = fc2.weight") as caught:
        pathcond_cli.rescale_module(module, (6,))
    assert caught.value.exit_code == 4
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())


def _bn_net() -> torch.nn.Module:
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    net[1].running_mean.normal_()
    net[1].running_var.uniform_(0.5, 2.0)
    net[0].weight.data *= 30.0
    return net.double()


def test_rescale_module_is_verified_on_the_module_without_touching_its_statistics():
    net = _bn_net()
    stats = {k: v.clone() for k, v in net.state_dict().items() if "running" in k or "num_batches" in k}
    x = torch.randn(16, 5, dtype=torch.float64)
    net.eval()
    expected = net(x)
    result = pathcond_cli.rescale_module(net, (5,))
    assert result.verification.passed and result.verification.modes == ("eval", "train")
    assert all(torch.equal(net.state_dict()[k], v) for k, v in stats.items())
    assert not net.training
    assert torch.allclose(net(x), expected, rtol=1e-9, atol=1e-9)
    assert result.solve.u_inf > 0


def test_rescale_module_verification_keeps_dropout_in_eval_mode_while_batchnorm_trains():
    torch.manual_seed(0)
    net = (
        torch.nn.Sequential(
            torch.nn.Linear(5, 8),
            torch.nn.BatchNorm1d(8),
            torch.nn.ReLU(),
            torch.nn.Dropout(0.5),
            torch.nn.Linear(8, 3),
        )
        .double()
        .eval()
    )
    result = pathcond_cli.rescale_module(net, (5,))
    assert result.verification.passed and result.verification.modes == ("eval", "train")
    assert result.verification.max_rel_error < 1e-9


def test_verification_allows_train_mode_batchnorm_its_own_rounding_amplification():
    """Small Inception-v3 in fp32: train-mode BatchNorm over a batch of 2 amplifies the rounding of
    any fp32 checkpoint beyond 1e-5; the check then holds the rescaled module to 10x what one
    rounding of its tensors does, while eval mode keeps the dtype's tolerance."""
    import reference_models

    torch.manual_seed(0)
    net = reference_models.small_inception_v3()
    result = pathcond_cli.rescale_module(net, (3, 75, 75))
    verification = result.verification
    assert verification.passed
    assert verification.errors["eval"] <= verification.tolerances["eval"] == 1e-5
    assert verification.errors["train"] > 1e-5
    assert verification.errors["train"] <= verification.tolerances["train"] <= 1e-3


def test_rescale_module_raises_when_the_module_disagrees(monkeypatch):
    net = _bn_net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    real_rescale = pathcond_cli.module_route.rescale

    def corrupting(*args, **kwargs):
        result = real_rescale(*args, **kwargs)
        key = next(iter(result.changed))
        result.changed[key] = result.changed[key] * 1.25
        return result

    monkeypatch.setattr(pathcond_cli.module_route, "rescale", corrupting)
    with pytest.raises(VerificationError, match="module was not changed"):
        pathcond_cli.rescale_module(net, (5,))
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


def test_module_on_the_meta_device_is_an_input_error():
    with torch.device("meta"):
        net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    with pytest.raises(InputError, match="meta device") as caught:
        pathcond_cli.rescale_module(net, (4,))
    assert caught.value.exit_code == 3


# -- 9. weights pathcond cannot compute with; a network with nothing to rescale ---------------


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_weights_exit_3(tmp_path, dtype):
    tensors = mlp_tensors()
    tensors["fc2.weight"] = tensors["fc2.weight"].to(dtype)
    checkpoint, spec = write_mlp(tmp_path, tensors=tensors)
    _fails_cleanly(tmp_path, 3, ["rescale", checkpoint, "--arch", spec], "fc2.weight", "float8")


def test_fp8_onnx_initializer_exit_3(tmp_path):
    model = onnx.load_from_string(write_onnx_mlp(tmp_path / "net.onnx").read_bytes())
    weight = next(t for t in model.graph.initializer if t.name == "fc2.weight")
    values = numpy_helper.to_array(weight)
    replacement = helper.make_tensor("fc2.weight", TensorProto.FLOAT8E4M3FN, values.shape, values.flatten().tolist())
    weight.CopyFrom(replacement)
    path = tmp_path / "fp8.onnx"
    onnx.save_model(model, str(path))
    _fails_cleanly(tmp_path, 3, ["rescale", path, "-o", tmp_path / "out.onnx"], "fp8")


def test_zero_size_layer_exit_3(tmp_path):
    dims = (6, 0, 3)
    tensors = {
        "fc1.weight": torch.zeros(0, 6),
        "fc1.bias": torch.zeros(0),
        "fc2.weight": torch.zeros(3, 0),
        "fc2.bias": torch.zeros(3),
    }
    checkpoint, spec = write_mlp(tmp_path, dims=dims, tensors=tensors)
    _fails_cleanly(tmp_path, 3, ["rescale", checkpoint, "--arch", spec], "empty", "fc1.weight")


def test_bias_free_all_zero_network_is_a_success_with_a_note(tmp_path):
    spec = mlp_spec()
    for layer in spec["layers"]:
        if layer["type"] == "linear":
            layer["bias"] = None
    tensors = {k: torch.zeros_like(v) for k, v in mlp_tensors().items() if k.endswith("weight")}
    checkpoint, spec_path = write_mlp(tmp_path, tensors=tensors, spec=spec)
    out = tmp_path / "out.safetensors"
    result = invoke("rescale", checkpoint, "--arch", spec_path, "-o", out, "--json")
    assert_clean_exit(result, 0)
    report = parse_single_json(result.stdout)
    check_report(report, rescale=True)
    assert report["u_inf"] == 0.0
    assert any("nothing to rescale" in w.lower() for w in report["warnings"])
    written = safetensors.torch.load_file(str(out))
    assert all(torch.equal(written[k], tensors[k]) for k in tensors)
    assert_clean_exit(invoke("inspect", checkpoint, "--arch", spec_path, "-q"), 0)


def test_a_network_without_parameters_is_written_unchanged_with_a_note_saying_so(tmp_path):
    """relu(x + x) has paths but no weight: it was an internal error (exit 1) in verification."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "x"], ["s"]), helper.make_node("Relu", ["s"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    model = tmp_path / "net.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(model))
    out = tmp_path / "out.onnx"
    result = invoke("rescale", model, "-o", out, "--json")
    assert_clean_exit(result, 0)
    report = parse_single_json(result.stdout)
    assert report["verification"]["passed"] and report["u_inf"] == 0.0
    assert any("has no parameters" in w for w in report["warnings"])
    assert not any("zero function" in w for w in report["warnings"])
    assert onnx.load(str(out)).graph.node[0].op_type == "Add"


# -- 10. a bug in the importer is a bug, not an inconsistent model -----------------------------


def test_type_error_inside_the_onnx_importer_stays_an_internal_error(tmp_path, monkeypatch):
    model = write_onnx_mlp(tmp_path / "net.onnx")

    def broken(translator, node):
        raise TypeError("unsupported operand type(s) for +: 'int' and 'NoneType'")

    monkeypatch.setitem(onnx_ops.HANDLERS, "Relu", broken)
    monkeypatch.delenv("PATHCOND_DEBUG", raising=False)
    stderr = _fails_cleanly(
        tmp_path, 1, ["rescale", model, "-o", tmp_path / "out.onnx"], "internal error", "TypeError", "NoneType"
    )
    assert "inconsistent" not in stderr


# -- 11. the independent runtime never turns a correct result into a failure -------------------


def _googlenet_block(path) -> None:
    """Conv → ReLU → ceil-mode max pooling feeding an Inception-style Concat, at 64×64."""
    rng = np.random.default_rng(0)

    def weight(name, *shape):
        return numpy_helper.from_array(
            (rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32), name
        )

    nodes = [
        helper.make_node("Conv", ["x", "w0", "b0"], ["c0"], name="stem", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c0"], ["r0"], name="stem_relu"),
        helper.make_node("MaxPool", ["r0"], ["p0"], name="pool", kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1),
        helper.make_node("Conv", ["p0", "w1", "b1"], ["c1"], name="branch1"),
        helper.make_node("Relu", ["c1"], ["r1"], name="branch1_relu"),
        helper.make_node("Conv", ["p0", "w2", "b2"], ["c2"], name="branch3", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"], name="branch3_relu"),
        helper.make_node(
            "MaxPool",
            ["p0"],
            ["p3"],
            name="branch_pool",
            kernel_shape=[3, 3],
            strides=[1, 1],
            pads=[1, 1, 1, 1],
            ceil_mode=1,
        ),
        helper.make_node("Concat", ["r1", "r2", "p3"], ["cat"], name="concat", axis=1),
        helper.make_node("GlobalAveragePool", ["cat"], ["gap"], name="gap"),
        helper.make_node("Flatten", ["gap"], ["flat"], name="flatten"),
        helper.make_node("Gemm", ["flat", "wf", "bf"], ["y"], name="fc", transB=1),
    ]
    initializers = [
        weight("w0", 8, 3, 3, 3),
        weight("b0", 8),
        weight("w1", 4, 8, 1, 1),
        weight("b1", 4),
        weight("w2", 6, 8, 3, 3),
        weight("b2", 6),
        weight("wf", 5, 18),
        weight("bf", 5),
    ]
    graph = helper.make_graph(
        nodes,
        "inception",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 64, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save_model(model, str(path))


def test_googlenet_style_ceil_mode_concat_is_checked_by_onnxruntime(tmp_path):
    path = tmp_path / "inception.onnx"
    _googlenet_block(path)
    result = invoke("rescale", path, "-o", tmp_path / "out.onnx", "--json")
    assert_clean_exit(result, 0)
    independent = parse_single_json(result.stdout)["verification"]["independent"]
    assert independent["runtime"] == "onnxruntime" and independent["status"] == "passed", independent


def test_without_onnxruntime_onnx_reference_is_used(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import fails
    model = write_onnx_mlp(tmp_path / "net.onnx")
    result = invoke("rescale", model, "-o", tmp_path / "out.onnx", "--json")
    assert_clean_exit(result, 0)
    independent = parse_single_json(result.stdout)["verification"]["independent"]
    assert independent["runtime"] == "onnx.reference" and independent["status"] == "passed"


def test_a_runtime_that_cannot_evaluate_the_graph_is_reported_unavailable(tmp_path, monkeypatch):
    def cannot(model_bytes, model_path, x):
        raise RuntimeError("[ONNXRuntimeError] : 9 : NOT_IMPLEMENTED : Could not find an implementation")

    monkeypatch.setattr(pathcond_cli.verify, "_onnx_runners", lambda model: ([("onnxruntime", cannot)], ""))
    model = write_onnx_mlp(tmp_path / "net.onnx")
    result = invoke("rescale", model, "-o", tmp_path / "out.onnx", "--json")
    assert_clean_exit(result, 0)
    independent = parse_single_json(result.stdout)["verification"]["independent"]
    assert independent["status"] == "unavailable" and "NOT_IMPLEMENTED" in independent["detail"]
    assert (tmp_path / "out.onnx").is_file()


def test_a_runtime_that_disagrees_fails_the_run_exit_5(tmp_path, monkeypatch):
    calls = []

    def drifting(model_bytes, model_path, x):
        calls.append(1)
        return [np.full((1, 3), float(len(calls)), dtype=np.float32)]

    monkeypatch.setattr(pathcond_cli.verify, "_onnx_runners", lambda model: ([("onnxruntime", drifting)], ""))
    model = write_onnx_mlp(tmp_path / "net.onnx")
    _fails_cleanly(
        tmp_path, 5, ["rescale", model, "-o", tmp_path / "out.onnx"], "onnxruntime", "max relative difference"
    )


def test_safetensors_reports_its_independent_check_as_unavailable(tmp_path):
    checkpoint, spec = write_mlp(tmp_path)
    result = invoke("rescale", checkpoint, "--arch", spec, "-o", tmp_path / "out.safetensors", "--json")
    assert_clean_exit(result, 0)
    independent = json.loads(result.stdout)["verification"]["independent"]
    assert independent["runtime"] is None and independent["status"] == "unavailable"
