"""Property-based trust tests, with hypothesis (derandomized, small example counts).

- Any valid ReLU DAG written as a spec (MLPs with BatchNorm and residual adds, small conv
  nets with pooling, concat and flatten) is rescaled by the CLI with exit 0, and the written
  file, reloaded from disk, computes the original function.
- Random hostile mutations of the checkpoint bytes and of the command-line arguments never
  produce exit 1 (a bug), never a traceback, and never change an input file.
"""

from __future__ import annotations

import json
import math
import os
import random

import safetensors.torch
import torch
import yaml
from cli_support import invoke, mlp_spec, mlp_tensors, snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pathcond_cli
from pathcond_cli.verify import compare

SETTINGS = dict(
    max_examples=12,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
DOCUMENTED = {0, 2, 3, 4, 5, 6, 7}


# -- random valid specs -------------------------------------------------------------------------


@st.composite
def mlp_networks(draw):
    """An MLP spec with optional BatchNorm after each hidden Linear and optional residual adds."""
    rng = random.Random(draw(st.integers(0, 2**31)))
    width_in = draw(st.integers(2, 6))
    layers = [{"name": "x", "type": "input", "shape": [width_in]}]
    tensors: dict[str, torch.Tensor] = {}
    width, previous, count = width_in, "x", 0
    for _ in range(draw(st.integers(1, 4))):
        count += 1
        out = draw(st.integers(1, 7))
        name = f"fc{count}"
        bias = draw(st.booleans())
        layers.append({"name": name, "type": "linear", "inputs": [previous], **({} if bias else {"bias": None})})
        tensors[f"{name}.weight"] = torch.randn(
            out, width, generator=torch.Generator().manual_seed(rng.randrange(2**31))
        )
        if bias:
            tensors[f"{name}.bias"] = 0.1 * torch.randn(out)
        previous = name
        if draw(st.booleans()):
            bn = f"bn{count}"
            layers.append({"name": bn, "type": "batchnorm", "inputs": [previous]})
            tensors.update(
                {
                    f"{bn}.weight": torch.rand(out) + 0.5,
                    f"{bn}.bias": torch.randn(out),
                    f"{bn}.running_mean": torch.randn(out),
                    f"{bn}.running_var": torch.rand(out) + 0.5,
                }
            )
            previous = bn
        relu = f"relu{count}"
        layers.append(
            {"name": relu, "type": draw(st.sampled_from(["relu", "leaky_relu", "identity"])), "inputs": [previous]}
        )
        if draw(st.booleans()) and out == width and layers[-2]["type"] != "input":
            skip_source = next(
                layer["name"]
                for layer in reversed(layers[:-2])
                if layer["type"] in ("relu", "leaky_relu", "identity", "input")
            )
            layers.append({"name": f"add{count}", "type": "add", "inputs": [relu, skip_source]})
            relu = f"add{count}"
        previous, width = relu, out
    count += 1
    layers.append({"name": "head", "type": "linear", "inputs": [previous]})
    tensors["head.weight"] = torch.randn(draw(st.integers(1, 4)), width)
    tensors["head.bias"] = torch.randn(tensors["head.weight"].shape[0])
    return {"layers": layers}, tensors


@st.composite
def conv_networks(draw):
    """conv → relu → (max|avg) pool → [branch concat] → global pool → flatten → linear."""
    channels, side = draw(st.integers(1, 3)), draw(st.integers(5, 9))
    c1 = draw(st.integers(1, 4))
    kernel = draw(st.sampled_from([1, 3]))
    layers = [
        {"name": "x", "type": "input", "shape": [channels, side, side]},
        {"name": "conv1", "type": "conv", "padding": kernel // 2},
        {"name": "relu1", "type": "relu"},
        {
            "name": "pool1",
            "type": draw(st.sampled_from(["maxpool", "avgpool"])),
            "kernel": 2,
            "ceil_mode": draw(st.booleans()),
        },
    ]
    tensors = {"conv1.weight": torch.randn(c1, channels, kernel, kernel), "conv1.bias": torch.randn(c1)}
    width = c1
    if draw(st.booleans()):
        c2 = draw(st.integers(1, 3))
        layers += [
            {"name": "conv2", "type": "conv", "inputs": ["pool1"], "bias": None},
            {"name": "relu2", "type": "relu"},
            {"name": "cat", "type": "concat", "inputs": ["relu2", "pool1"]},
        ]
        tensors["conv2.weight"] = torch.randn(c2, c1, 1, 1)
        width = c1 + c2
    layers += [
        {"name": "gap", "type": "global_avgpool"},
        {"name": "flat", "type": "flatten"},
        {"name": "head", "type": "linear"},
    ]
    out = draw(st.integers(1, 3))
    tensors.update({"head.weight": torch.randn(out, width), "head.bias": torch.randn(out)})
    return {"layers": layers}, tensors


@settings(**SETTINGS)
@given(network=st.one_of(mlp_networks(), conv_networks()), solver=st.sampled_from(["lbfgs", "block", "sequential"]))
def test_random_valid_relu_dags_rescale_and_preserve_the_function(tmp_path_factory, network, solver):
    spec, tensors = network
    directory = tmp_path_factory.mktemp("dag")
    checkpoint, spec_path, out = directory / "m.safetensors", directory / "m.arch.yaml", directory / "out.safetensors"
    safetensors.torch.save_file(tensors, str(checkpoint))
    spec_path.write_text(yaml.safe_dump(spec))
    result = invoke("rescale", checkpoint, "--arch", spec_path, "-o", out, "--solver", solver, "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["verification"]["passed"]
    original, written = pathcond_cli.load(checkpoint, arch=str(spec_path)), pathcond_cli.load(out)
    verification = compare(original.graph, original.params, written.params)
    assert verification.passed, verification
    assert all(math.isfinite(v) for v in report["solver"]["objective"])


# -- random hostile mutations ------------------------------------------------------------------


HOSTILE_VALUES = [
    "",
    "-",
    "--",
    "x",
    "0",
    "-1",
    "1e309",
    "nan",
    "inf",
    "3,0",
    "3,-2",
    "1,2,3,4,5",
    "a,b",
    "9" * 40,
    "..",
    "/",
    "/dev/null",
    "/etc/passwd",
    "../outside.safetensors",
    "m.onnx",
    "m.pt",
    "out.json",
    "out.safetensors",
    "out.safetensors.index.json",
    "module:factory",
    "os:getcwd",
    "\u00e9\u00e8",
    "\x7f",
    "a" * 300,
    "cuda:99",
    "cpu",
]
OPTIONS = ["-o", "--arch", "--input-shape", "--device", "--solver", "--max-iter", "--tol", "--report"]
FLAGS = ["--json", "--in-place", "--quiet", "--allow-unused"]


def _byte_mutation(data: bytes, rng: random.Random) -> bytes:
    kind = rng.randrange(4)
    position = rng.randrange(len(data))
    if kind == 0:
        mutated = bytearray(data)
        mutated[position] ^= rng.randrange(1, 256)
        return bytes(mutated)
    if kind == 1:
        return data[:position]
    if kind == 2:
        return data[:position] + os.urandom(rng.randint(1, 8)) + data[position:]
    return data[:position] + data[position + rng.randint(1, 8) :]


@settings(**{**SETTINGS, "max_examples": 40})
@given(
    seed=st.integers(0, 2**31),
    mutate_file=st.booleans(),
    options=st.lists(st.tuples(st.sampled_from(OPTIONS), st.sampled_from(HOSTILE_VALUES)), max_size=3),
    flags=st.lists(st.sampled_from(FLAGS), max_size=2, unique=True),
    command=st.sampled_from(["rescale", "inspect"]),
)
def test_hostile_files_and_arguments_never_cause_a_bug(
    tmp_path_factory, monkeypatch, seed, mutate_file, options, flags, command
):
    directory = tmp_path_factory.mktemp("hostile")
    monkeypatch.chdir(directory)
    checkpoint, spec = directory / "m.safetensors", directory / "m.arch.yaml"
    data = safetensors.torch.save(mlp_tensors())
    if mutate_file:
        data = _byte_mutation(data, random.Random(seed))
    checkpoint.write_bytes(data)
    spec.write_text(yaml.safe_dump(mlp_spec()))
    args = [command, checkpoint]
    if not any(option == "--arch" for option, _ in options):
        args += ["--arch", spec]
    for option, value in options:
        if command == "inspect" and option in ("-o", "--solver", "--max-iter", "--tol", "--report"):
            continue
        if option == "--device" and value.startswith("cuda"):
            continue  # CUDA presence is the machine's, not the input's
        args += [option, value]
    if command == "rescale":
        args += flags
        if "-o" not in args and "--in-place" not in flags:
            args += ["-o", directory / "out.safetensors"]
    else:
        args += [f for f in flags if f not in ("--in-place",)]
    before = snapshot(directory)
    result = invoke(*args, "--max-iter", "30") if command == "rescale" and "--max-iter" not in args else invoke(*args)
    escaped = result.exception if not isinstance(result.exception, SystemExit) else None
    assert escaped is None, f"{args}: {escaped!r}"
    assert result.exit_code in DOCUMENTED, f"{args}: exit {result.exit_code}: {result.stderr}"
    assert "Traceback" not in result.stderr
    if "--in-place" not in args:
        after = snapshot(directory)
        assert {k: v for k, v in after.items() if k in before} == before, args
