"""Trust round 5 (issue 38), the inputs and the errors: BatchNorm statistics no BatchNorm can
use are refused on every command and route (G); an address-space limit (``ulimit -v``) is
honoured by stdin, threads and allocations (I); an error never loses its remedy to a long list
or a long line, and a checkpoint that shares no tensor name with its architecture says so
first (M); and the smaller items: a tied ONNX weight warned about and counted once, a reflect
pad wider than its crop leaves refused as onnxruntime refuses it, a spec ``add``/``sub`` of the
wrong arity exit 3, a NaN among a filter's coefficients named, the NaN refusal worded for
every command, and a spec's YAML read by libyaml.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import onnxruntime
import pytest
import safetensors.torch
import torch
import yaml
from cli_support import (
    CLEAN_ENV,
    assert_clean_exit,
    assert_unchanged,
    invoke,
    mlp_spec,
    mlp_tensors,
    module_command,
    snapshot,
    write_mlp,
)
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from pathcond_cli import threads
from pathcond_cli.cli.guard import MESSAGE_LINE_CHARS, shown_message
from pathcond_cli.engine.graph import BatchNorm, batchnorm_variance_problems
from pathcond_cli.errors import PROBLEMS_SHOWN, InputError
from pathcond_cli.io.fileio import read_within
from pathcond_cli.io.formats import spec as spec_module
from pathcond_cli.io.formats.spec import graph_from_spec, parse_spec_text, spec_warnings
from pathcond_cli.module_route import rescale_module


def _commands(tmp_path, checkpoint, *rest):
    """Every command on ``checkpoint`` (``rest``: its --arch), each writing under ``tmp_path``."""
    suffix = checkpoint.suffix
    return {
        "inspect": ["inspect", checkpoint, *rest],
        "rescale": ["rescale", checkpoint, *rest, "-o", tmp_path / f"out{suffix}"],
        "compare": ["compare", checkpoint, checkpoint, *rest],
        "prune": ["prune", checkpoint, *rest, "--sparsity", "0.5", "-o", tmp_path / f"pruned{suffix}"],
        "spec": ["spec", checkpoint, *rest, "-o", tmp_path / "out.yaml"],
    }


# -- G. BatchNorm statistics whose running_var + eps is not > 0 --------------------------------------


def _bn_mlp_tensors(variance: float) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "fc1.weight": torch.randn(4, 3, generator=generator),
        "fc1.bias": torch.randn(4, generator=generator),
        "bn1.weight": torch.ones(4),
        "bn1.bias": torch.zeros(4),
        "bn1.running_mean": torch.zeros(4),
        "bn1.running_var": torch.tensor([1.0, variance, 1.0, 1.0]),
        "fc2.weight": torch.randn(2, 4, generator=generator),
        "fc2.bias": torch.randn(2, generator=generator),
    }


BN_MLP_SPEC = {
    "layers": [
        {"name": "x", "type": "input", "shape": [3]},
        {"name": "fc1", "type": "linear"},
        {"name": "bn1", "type": "batchnorm", "eps": 1e-5},
        {"name": "relu1", "type": "relu"},
        {"name": "fc2", "type": "linear"},
    ]
}


def _torch_bn_mlp(tensors: dict[str, torch.Tensor]) -> nn.Module:
    module = nn.Sequential()
    module.add_module("fc1", nn.Linear(3, 4))
    module.add_module("bn1", nn.BatchNorm1d(4, eps=1e-5))
    module.add_module("relu1", nn.ReLU())
    module.add_module("fc2", nn.Linear(4, 2))
    module.load_state_dict(tensors, strict=False)
    return module.eval()


# -1: negative in any precision; -1e-5 + 1e-5 is 0 in float32 (2.5e-13 in float64), which torch computes in.
@pytest.mark.parametrize("variance", [-1.0, -1e-5])
@pytest.mark.parametrize("command", ["inspect", "rescale", "compare", "prune", "spec"])
def test_batchnorm_variance_without_a_positive_sum_is_refused_on_every_command(tmp_path, variance, command):
    tensors = _bn_mlp_tensors(variance)
    with torch.no_grad():  # the oracle: torch's own BatchNorm gives no finite output
        assert not torch.isfinite(_torch_bn_mlp(tensors)(torch.randn(5, 3))).all()
    checkpoint, spec = write_mlp(tmp_path, tensors=tensors, spec=BN_MLP_SPEC)
    before = snapshot(tmp_path)
    stderr = assert_clean_exit(
        invoke(*_commands(tmp_path, checkpoint, "--arch", spec)[command]),
        3,
        "'bn1.running_var'",
        "channel 1",
        "running_var + eps",
        "float32",
    )
    assert "bug in pathcond" not in stderr
    assert_unchanged(tmp_path, before)


def test_a_batchnorm_variance_just_above_minus_eps_is_accepted(tmp_path):
    tensors = _bn_mlp_tensors(-0.99e-5)  # + 1e-5 = 1e-7 > 0 in float32: a finite network
    with torch.no_grad():
        assert torch.isfinite(_torch_bn_mlp(tensors)(torch.randn(5, 3))).all()
    checkpoint, spec = write_mlp(tmp_path, tensors=tensors, spec=BN_MLP_SPEC)
    assert_clean_exit(invoke("inspect", checkpoint, "--arch", spec), 0)


def _onnx_conv_bn(path, variance: float) -> None:
    rng = np.random.default_rng(0)
    stored = {
        "w": rng.standard_normal((3, 2, 1, 1)),
        "scale": np.ones(3),
        "shift": np.zeros(3),
        "mean": np.zeros(3),
        "var": np.array([1.0, variance, 1.0]),
        "w2": rng.standard_normal((2, 3, 1, 1)),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
        helper.make_node("BatchNormalization", ["c", "scale", "shift", "mean", "var"], ["b"], name="bn", epsilon=1e-5),
        helper.make_node("Relu", ["b"], ["r"], name="relu"),
        helper.make_node("Conv", ["r", "w2"], ["y"], name="conv2"),
    ]
    graph = helper.make_graph(
        nodes,
        "bn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, 3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2, 3, 3])],
        [numpy_helper.from_array(value.astype(np.float32), key) for key, value in stored.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save_model(model, str(path))


@pytest.mark.parametrize("command", ["inspect", "rescale", "compare", "prune", "spec"])
def test_onnx_batchnormalization_without_a_positive_variance_is_refused_on_every_command(tmp_path, command):
    path = tmp_path / "bn.onnx"
    _onnx_conv_bn(path, -1e-5)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    outputs = session.run(None, {"x": np.random.default_rng(1).standard_normal((2, 2, 3, 3)).astype(np.float32)})[0]
    assert not np.isfinite(outputs).all()  # the oracle: onnxruntime's reading of the file
    before = snapshot(tmp_path)
    assert_clean_exit(invoke(*_commands(tmp_path, path)[command]), 3, "'var'", "channel 1", "BatchNorm 'bn'")
    assert_unchanged(tmp_path, before)


class _ConvBn(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 1)
        self.bn = nn.BatchNorm2d(3)
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def _conv_bn_module(variance: float) -> nn.Module:
    torch.manual_seed(0)
    module = _ConvBn().eval()
    with torch.no_grad():
        module.bn.running_var[2] = variance
    return module


def test_a_module_with_a_negative_running_variance_is_refused_by_rescale_module():
    module = _conv_bn_module(-0.5)
    before = {key: value.clone() for key, value in module.state_dict().items()}
    with pytest.raises(InputError, match=r"'bn.running_var'.*channel 2"):
        rescale_module(module, (2, 4, 4))
    assert all(torch.equal(before[key], value) for key, value in module.state_dict().items())


def test_a_factory_checkpoint_with_a_negative_running_variance_is_refused(tmp_path, monkeypatch):
    (tmp_path / "round5_factories.py").write_text(
        textwrap.dedent("""
        import torch
        from torch import nn


        class ConvBn(nn.Module):
            def __init__(self):
                super().__init__()
                self.conv = nn.Conv2d(2, 3, 1)
                self.bn = nn.BatchNorm2d(3)
                self.fc = nn.Linear(3, 2)

            def forward(self, x):
                return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))
    """)
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    state = _conv_bn_module(-0.5).state_dict()
    checkpoint = tmp_path / "convbn.safetensors"
    safetensors.torch.save_file({key: value.contiguous() for key, value in state.items()}, str(checkpoint))
    for args in _commands(tmp_path, checkpoint, "--arch", "round5_factories:ConvBn", "--input-shape", "2,4,4").values():
        assert_clean_exit(invoke(*args), 3, "'bn.running_var'", "channel 2")


# -- I. an address-space limit ---------------------------------------------------------------------


def _small_onnx(path) -> None:
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h"], name="mm1"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "W2"], ["y"], name="mm2"),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])],
        [
            numpy_helper.from_array(rng.standard_normal((3, 4)).astype(np.float32), "W1"),
            numpy_helper.from_array(rng.standard_normal((4, 2)).astype(np.float32), "W2"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save_model(model, str(path))


@pytest.fixture(scope="module")
def mapped_after_import() -> int:
    """Bytes of address space a process has mapped once pathcond's libraries are imported and its
    threads started: what a limit must leave room for before the model."""
    probe = (
        "import pathcond_cli.pipeline, pathcond_cli.io.formats, pathcond_cli.report.render, onnx\n"
        "from pathcond_cli.threads import set_threads\nset_threads()\n"
        "print(next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmSize:')))"
    )
    return int(
        subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, env=CLEAN_ENV).stdout
    )


def _limited(args, limit: int, *, input: bytes | None = None) -> subprocess.CompletedProcess:
    def set_limit():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return subprocess.run(
        module_command(*args), input=input, capture_output=True, env=CLEAN_ENV, preexec_fn=set_limit, timeout=300
    )


def test_stdin_is_read_in_chunks_under_an_address_space_limit(tmp_path, mapped_after_import):
    """Reading '-' asked for a quarter of MemAvailable at once, which a limit refuses: a 484-byte model
    exited 3 'out of memory' under `ulimit -v`."""
    path = tmp_path / "small.onnx"
    _small_onnx(path)
    limit = min(mapped_after_import + (3 << 29), 4 << 30)
    result = _limited(["inspect", "-", "--json"], limit, input=path.read_bytes())
    assert result.returncode == 0, result.stderr.decode()
    assert json.loads(result.stdout)["parameters"] == 20


def test_read_within_gives_what_arrived_and_none_beyond_the_limit(monkeypatch):
    import io

    monkeypatch.setattr("pathcond_cli.io.fileio.STREAM_CHUNK_BYTES", 3)
    assert read_within(io.BytesIO(b"abcdefg"), 7) == b"abcdefg"
    assert read_within(io.BytesIO(b"abcdefg"), 6) is None
    assert read_within(io.BytesIO(b""), 0) == b""


def test_threads_that_do_not_fit_the_address_space_are_refused_not_left_to_openmp(tmp_path, mapped_after_import):
    """libgomp ended the process with exit 1 ('Thread creation failed') when --threads asked for
    more threads than the limit had room for."""
    checkpoint, spec = write_mlp(tmp_path)
    limit = mapped_after_import + (1 << 29)
    refused = _limited(["inspect", checkpoint, "--arch", spec, "--threads", "64"], limit)
    stderr = refused.stderr.decode()
    assert refused.returncode == 3, stderr
    assert "address-space limit" in stderr and "--threads" in stderr and "libgomp" not in stderr
    by_default = _limited(["inspect", checkpoint, "--arch", spec], limit)
    assert by_default.returncode == 0, by_default.stderr.decode()


def test_set_threads_stays_within_the_address_space_left(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    per_thread = threads.thread_address_space(True)
    monkeypatch.setattr(threads, "address_space_left", lambda: int(3 * per_thread / threads.THREADS_ADDRESS_SHARE))
    before = torch.get_num_threads()
    try:
        assert threads.set_threads() == 4 and torch.get_num_threads() == 4
        with pytest.raises(InputError, match="--threads 13 or fewer"):
            threads.set_threads(14)
    finally:
        torch.set_num_threads(before)


def test_openmp_stack_size_counts_in_a_threads_address_space(monkeypatch):
    monkeypatch.delenv("OMP_STACKSIZE", raising=False)
    default = threads.thread_address_space(True)
    monkeypatch.setenv("OMP_STACKSIZE", "300M")
    stack = resource.getrlimit(resource.RLIMIT_STACK)[0]
    stack = threads.UNLIMITED_STACK_DEFAULT_BYTES if stack == resource.RLIM_INFINITY else stack
    assert threads.thread_address_space(True) == default - stack + (300 << 20)


def test_passes_beyond_the_address_space_left_are_refused_before_allocating(tmp_path, mapped_after_import):
    tensors = {
        "c1.weight": torch.randn(16, 3, 3, 3),
        "c1.bias": torch.randn(16),
        "fc.weight": torch.randn(4, 16),
        "fc.bias": torch.randn(4),
    }
    spec = {
        "layers": [
            {"name": "x", "type": "input", "shape": [3, 8, 8]},
            {"name": "c1", "type": "conv", "padding": 1},
            {"name": "r1", "type": "relu"},
            {"name": "p", "type": "global_avgpool"},
            {"name": "f", "type": "flatten"},
            {"name": "fc", "type": "linear"},
        ]
    }
    checkpoint, spec_path = write_mlp(tmp_path, tensors=tensors, spec=spec)
    result = _limited(
        ["inspect", checkpoint, "--arch", spec_path, "--input-shape", "3,2048,2048"], mapped_after_import + (1 << 30)
    )
    stderr = result.stderr.decode()
    assert result.returncode == 3, stderr
    assert "Nothing was allocated" in stderr and "Traceback" not in stderr


# -- M. the remedy is never cut ------------------------------------------------------------------------


def test_a_long_line_keeps_its_end_where_the_remedy_is():
    line = "the problem: " + "x" * 5000 + " Fix it by passing --allow-unused."
    shown = shown_message(f"first line\n{line}")
    assert shown.startswith("first line\nthe problem: ")
    assert shown.endswith(" Fix it by passing --allow-unused.")
    assert max(map(len, shown.split("\n"))) <= MESSAGE_LINE_CHARS + 50


def test_a_checkpoint_sharing_no_tensor_name_with_its_architecture_says_so_first(tmp_path):
    tensors = {f"stages.{i}.conv.weight": torch.randn(4, 4) for i in range(60)}
    tensors.update({f"stages.{i}.bn.running_mean": torch.zeros(4) for i in range(60)})
    checkpoint, spec = write_mlp(tmp_path, tensors=tensors, dims=[4] * 61)
    stderr = assert_clean_exit(invoke("inspect", checkpoint, "--arch", spec), 3)
    first = stderr.strip().splitlines()[0]
    assert "not one tensor name of the architecture is in the checkpoint" in first
    assert "120 tensor(s)" in first and "'fc1.weight'" in first and "'stages.0.bn.running_mean'" in first
    assert "lacks" not in stderr and "BatchNorm" not in stderr
    assert stderr.rstrip().endswith("give the architecture this checkpoint was saved from.")


def test_a_long_list_of_missing_tensors_is_summarised_and_its_hint_kept_whole(tmp_path):
    dims = [4] * 31
    tensors = {key: value for key, value in mlp_tensors(dims).items() if not key.endswith("bias")}
    tensors.update({f"fc{i}.running_mean": torch.zeros(4) for i in range(1, 31)})
    checkpoint, spec = write_mlp(tmp_path, tensors=tensors, dims=dims)
    args = ["inspect", checkpoint, "--arch", spec]
    stderr = assert_clean_exit(invoke(*args), 3)
    lacks = [line for line in stderr.splitlines() if "which the checkpoint lacks" in line]
    assert len(lacks) == PROBLEMS_SHOWN
    assert f"and {30 - PROBLEMS_SHOWN} more problem(s)" in stderr and "--json" in stderr
    assert "(30 layer(s) have no bias tensor" in stderr
    assert stderr.rstrip().endswith("--input-shape ...))")
    complete = assert_clean_exit(invoke(*args, "--json"), 3)
    assert len([line for line in complete.splitlines() if "which the checkpoint lacks" in line]) == 30


def test_a_bn_folded_export_spec_error_keeps_its_remedy_whole():
    layers = [{"name": "x", "type": "input", "shape": [3, 4, 4]}]
    for i in range(80):
        layers += [{"name": f"features.block{i}.conv", "type": "conv"}, {"name": f"relu{i}", "type": "relu"}]
    graph = graph_from_spec({"layers": layers[:-1]}, source="export.onnx")
    folded = [key for node in graph.nodes for key in node.parameter_keys().values()]
    with pytest.raises(InputError) as caught:
        spec_warnings(graph, "onnx", "export.onnx", folded)
    shown = shown_message(str(caught.value))
    assert "160 folded tensor(s)" in shown
    assert shown.rstrip().endswith("torch.onnx.export(..., dynamo=False, do_constant_folding=False)).")
    assert "more characters" not in shown and "characters left out" not in shown


# -- smaller items ---------------------------------------------------------------------------------------


def test_an_onnx_weight_read_by_two_layers_is_warned_about_and_counted_once(tmp_path):
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"], name="mm1"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "W"], ["y"], name="mm2"),
    ]
    graph = helper.make_graph(
        nodes,
        "tied",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        [numpy_helper.from_array(rng.standard_normal((4, 4)).astype(np.float32), "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "tied.onnx"
    onnx.save_model(model, str(path))
    stored = sum(numpy_helper.to_array(tensor).size for tensor in onnx.load(str(path)).graph.initializer)
    result = invoke("inspect", path, "--json")
    assert_clean_exit(result, 0)
    report = json.loads(result.stdout)
    assert report["parameters"] == stored == 16
    assert any("'W' is the weight of 2 layers (mm1, mm2)" in warning for warning in report["warnings"])


def _reflect_after_crop(path, crop: int, pad: int) -> None:
    rng = np.random.default_rng(0)
    stored = [
        numpy_helper.from_array(rng.standard_normal((2, 1, 1, 1)).astype(np.float32), "w"),
        numpy_helper.from_array(rng.standard_normal((3, 2, 1, 1)).astype(np.float32), "w2"),
        numpy_helper.from_array(np.array([0, 0, 0, crop, 0, 0, 0, pad], np.int64), "pads"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("Pad", ["r", "pads"], ["p"], name="pad", mode="reflect"),
        helper.make_node("Conv", ["p", "w2"], ["y"], name="conv2"),
    ]
    graph = helper.make_graph(
        nodes,
        "crop",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, 1, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3, 1, 5 + crop + pad])],
        stored,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save_model(model, str(path))


def _onnxruntime_runs(path) -> bool:
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    try:
        session.run(None, {"x": np.ones((1, 1, 1, 5), np.float32)})
    except onnxruntime.capi.onnxruntime_pybind11_state.InvalidArgument:
        return False
    return True


def test_a_reflect_pad_wider_than_its_crop_leaves_is_refused_as_onnxruntime_refuses_it(tmp_path):
    wide, narrow = tmp_path / "wide.onnx", tmp_path / "narrow.onnx"
    _reflect_after_crop(wide, -3, 3)  # 2 elements kept, reflected by 3
    _reflect_after_crop(narrow, -3, 1)  # 2 elements kept, reflected by 1
    assert not _onnxruntime_runs(wide) and _onnxruntime_runs(narrow)
    before = snapshot(tmp_path)
    assert_clean_exit(
        invoke("rescale", wide, "-o", tmp_path / "out.onnx"),
        4,
        "node 'pad' (Pad)",
        "reflect padding of 3",
        "keeps 2 of its 5 elements",
    )
    assert_unchanged(tmp_path, before)
    assert_clean_exit(invoke("rescale", narrow, "-o", tmp_path / "out.onnx"), 0, "verified")


@pytest.mark.parametrize(
    ("layer", "expected"),
    [
        ({"name": "s", "type": "add", "inputs": ["relu1"]}, "layer 's' (add) reads at least 2 inputs, and is given 1"),
        (
            {"name": "s", "type": "sub", "inputs": ["relu1", "relu1", "relu1"]},
            "layer 's' (sub) reads exactly 2 inputs, and is given 3",
        ),
    ],
)
def test_a_spec_sum_of_the_wrong_arity_is_a_bad_spec_exit_3(tmp_path, layer, expected):
    spec = mlp_spec()
    spec["layers"].insert(3, layer)
    checkpoint, spec_path = write_mlp(tmp_path, spec=spec)
    assert_clean_exit(invoke("inspect", checkpoint, "--arch", spec_path), 3, expected)


def test_a_nan_among_a_filters_coefficients_is_named_not_quoted_away(tmp_path):
    coefficients = [0.0625] * 17 + [float("nan")]
    spec = {
        "layers": [
            {"name": "x", "type": "input", "shape": [2, 5, 5]},
            {"name": "c", "type": "conv"},
            {"name": "blur", "type": "fixed_filter", "kernel": [3, 3], "coefficients": coefficients},
            {"name": "r", "type": "relu"},
        ]
    }
    with pytest.raises(InputError) as caught:
        graph_from_spec(parse_spec_text(yaml.safe_dump(spec), source="blur.yaml"), source="blur.yaml")
    message = str(caught.value)
    assert "'coefficients'" in message and "item 17 of 18 is nan" in message and "0.0625" not in message
    assert "the architecture has 1 problem(s)" in message


class _NanBlur(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        blur = torch.tensor([1.0, 2.0, 1.0])
        blur = (blur[:, None] * blur[None, :] / 16).expand(2, 1, 3, 3).clone()
        blur[1, 0, 2, 2] = float("nan")
        self.register_buffer("blur", blur, persistent=False)
        self.fc = nn.Linear(2, 3)

    def forward(self, x):
        return self.fc(nn.functional.conv2d(torch.relu(self.conv(x)), self.blur, groups=2, padding=1).mean((2, 3)))


def test_a_nan_in_a_module_filter_buffer_is_named():
    with pytest.raises(Exception) as caught:
        rescale_module(_NanBlur(), (2, 6, 6))
    message = str(caught.value)
    assert "nan" in message.lower() and "0.0625" not in message and "spec" not in message


@pytest.mark.parametrize("command", ["compare", "prune"])
def test_a_nan_weight_is_refused_in_words_that_fit_compare_and_prune(tmp_path, command):
    tensors = mlp_tensors()
    tensors["fc2.weight"][1, 2] = float("nan")
    checkpoint, spec = write_mlp(tmp_path, tensors=tensors)
    stderr = assert_clean_exit(
        invoke(*_commands(tmp_path, checkpoint, "--arch", spec)[command]),
        7,
        "'fc2.weight' (weight of node 'fc2')",
        "NaN or Inf",
    )
    assert "refuses to rescale" not in stderr


def test_spec_yaml_is_read_by_libyaml_where_pyyaml_has_it(monkeypatch):
    """A spec of 200,000 layers took 100 s, 0.6 ms a layer of it in PyYAML's pure-Python scanner."""
    if not yaml.__with_libyaml__:
        pytest.skip("PyYAML was built without libyaml")
    layers = [{"name": "x", "type": "input", "shape": [2]}]
    for i in range(200):
        layers += [{"name": f"fc{i}", "type": "linear"}, {"name": f"r{i}", "type": "relu"}]

    def pure_python_scanner(self):
        raise AssertionError("the spec was read by the pure-Python YAML scanner")

    monkeypatch.setattr(yaml.scanner.Scanner, "fetch_more_tokens", pure_python_scanner)
    assert parse_spec_text(yaml.safe_dump({"layers": layers}), source="deep.yaml") == {"layers": layers}
    with pytest.raises(InputError, match="aliases"):
        parse_spec_text("a: &a [1]\nlayers: *a\n", source="alias.yaml")
    depth = spec_module.MAX_SPEC_DEPTH
    # The mapping, then the sequences, then the number: one level each.
    parse_spec_text("layers: " + "[" * (depth - 2) + "1" + "]" * (depth - 2) + "\n", source="deep.yaml")
    with pytest.raises(InputError, match="nests more than"):
        parse_spec_text("layers: " + "[" * (depth - 1) + "1" + "]" * (depth - 1) + "\n", source="deep.yaml")


def test_batchnorm_problem_names_tensor_channels_and_precision():
    node = BatchNorm(
        name="bn",
        inputs=("x",),
        weight="bn.weight",
        bias="bn.bias",
        running_mean="bn.running_mean",
        running_var="bn.running_var",
        eps=1e-5,
    )
    assert batchnorm_variance_problems(node, torch.tensor([1.0, 0.5])) == []
    # float32's -1e-5 is -9.99999975e-06: with eps 1e-5 it sums to 2.5e-13 in float64, which a float64 BatchNorm
    # computes in, and to 0 in float32.
    variance = torch.tensor([1.0, -1e-5], dtype=torch.float32)
    assert batchnorm_variance_problems(node, variance.double()) == []
    assert len(batchnorm_variance_problems(node, variance)) == 1
    (problem,) = batchnorm_variance_problems(node, torch.tensor([-1e-5, 1.0, -2.0] * 3, dtype=torch.float16))
    assert "'bn.running_var'" in problem and "in float32 in 6 of 9 channel(s)" in problem
    assert "channel 0 (" in problem and "and 1 more" in problem
