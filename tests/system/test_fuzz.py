"""Deterministic fuzzing of the readers through the command line.

Valid checkpoints — a tiny safetensors MLP (with its spec, given by --arch or embedded), a
tiny ONNX MLP, and the sample models — are mutated with seeded generators at three depths:

- bytes: flips, truncations, insertions and deletions anywhere (the envelope parsers);
- payload: flips inside the tensor bytes only (NaN/Inf, extreme and denormal weights);
- structure: well-formed files whose content is wrong (safetensors header fields, the
  embedded spec, ONNX nodes/attributes/initializers/inputs/opsets).

``pathcond rescale`` (in-process) must then either succeed with a verified output, or fail
with a documented exit code (3, 4, 5, 6, 7, 8) and a one-paragraph message — never with a
traceback — and leave no output or temporary file behind and the input untouched.
"""

from __future__ import annotations

import copy
import json
import random
import struct

import numpy as np
import onnx
import pytest
import safetensors.torch
import yaml
from cli_support import (
    DOCUMENTED_ERRORS,
    SAMPLES,
    assert_unchanged,
    check_error_output,
    check_report,
    invoke,
    leftovers,
    mlp_spec,
    mlp_tensors,
    onnx_mlp_model,
    snapshot,
)

import pathcond_cli
from pathcond_cli.io.formats.spec import dump_spec
from pathcond_cli.verify import compare

BYTE_CASES = 24
PAYLOAD_CASES = 16
STRUCTURE_CASES = 20
SPEC_CASES = 16
SAMPLE_CASES = 8
BYTE_KINDS = ("flip", "truncate", "insert", "delete")

SAFETENSORS = safetensors.torch.save(mlp_tensors(), metadata={"origin": "fuzz"})
ONNX_MODEL = onnx_mlp_model()
ONNX = ONNX_MODEL.SerializeToString()


# -- byte-level --------------------------------------------------------------------------------


def _mutate_bytes(data: bytes, rng: random.Random, kind: str, region: tuple[int, int]) -> bytes:
    low, high = region
    position = rng.randrange(low, high)
    if kind == "flip":
        mutated = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            mutated[rng.randrange(low, high)] ^= rng.randrange(1, 256)
        return bytes(mutated)
    if kind == "truncate":
        return data[:position]
    if kind == "insert":
        return data[:position] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 16))) + data[position:]
    return data[:position] + data[position + rng.randint(1, 16) :]


def _byte_cases(name: str, data: bytes, count: int, seed: int, region: tuple[int, int] | None = None) -> list:
    rng = random.Random(seed)
    region = region or (0, len(data))
    return [
        pytest.param(
            name, _mutate_bytes(data, rng, BYTE_KINDS[i % 4], region), id=f"{name}-bytes-{i:02d}-{BYTE_KINDS[i % 4]}"
        )
        for i in range(count)
    ]


def _flip_within(data: bytes, ranges: list[tuple[int, int]], rng: random.Random) -> bytes:
    """Flip bits inside the (float32) tensor bytes; half the time in a value's sign/exponent byte,
    which gives NaN, Inf, huge (~1e38) or tiny (~1e-38) weights."""
    mutated = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        low, high = rng.choice(ranges)
        position = rng.randrange(low, high)
        if rng.random() < 0.5:
            mutated[low + (position - low) // 4 * 4 + 3] ^= rng.choice([0x80, 0x40, 0x7F, 0x3F, 0x20, 0x10])
        else:
            mutated[position] ^= 1 << rng.randrange(8)
    return bytes(mutated)


def _safetensors_header(data: bytes) -> tuple[dict, int]:
    length = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8 : 8 + length]), 8 + length


def _payload_cases() -> list:
    rng = random.Random(3)
    header, start = _safetensors_header(SAFETENSORS)
    st_ranges = [
        (start + a, start + b)
        for key, entry in header.items()
        if key != "__metadata__"
        for a, b in [entry["data_offsets"]]
    ]
    onnx_ranges = []
    for tensor in ONNX_MODEL.graph.initializer:
        at = ONNX.find(tensor.raw_data)
        onnx_ranges.append((at, at + len(tensor.raw_data)))
    return [
        pytest.param(
            "safetensors",
            _changed(lambda r: _flip_within(SAFETENSORS, st_ranges, r), rng, SAFETENSORS),
            id=f"safetensors-payload-{i:02d}",
        )
        for i in range(PAYLOAD_CASES)
    ] + [
        pytest.param(
            "onnx", _changed(lambda r: _flip_within(ONNX, onnx_ranges, r), rng, ONNX), id=f"onnx-payload-{i:02d}"
        )
        for i in range(PAYLOAD_CASES)
    ]


# -- structure-level: safetensors ----------------------------------------------------------------


def _with_header(header, body: bytes, pad: bool = True) -> bytes:
    text = json.dumps(header).encode()
    if pad:
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + body


def _safetensors_structure(rng: random.Random) -> bytes:
    header, start = _safetensors_header(SAFETENSORS)
    body = SAFETENSORS[start:]
    keys = [k for k in header if k != "__metadata__"]
    key = rng.choice(keys)
    entry = header[key]
    choice = rng.randrange(11)
    if choice == 0:
        entry["dtype"] = rng.choice(["F16", "BF16", "F64", "I32", "I64", "U8", "BOOL", "F8_E4M3", "X", 7])
    elif choice == 1:
        shape = entry["shape"]
        if shape and rng.random() < 0.5:
            shape[rng.randrange(len(shape))] += rng.choice([-1, 1, 1000])
        else:
            shape.append(rng.choice([0, 1, 2]))
    elif choice == 2:
        a, b = entry["data_offsets"]
        shift = rng.choice([-4, 4, 10**9, -a - 1])
        entry["data_offsets"] = [a + shift, b + shift]
    elif choice == 3:
        other = header[rng.choice(keys)]
        entry["data_offsets"], other["data_offsets"] = other["data_offsets"], entry["data_offsets"]
    elif choice == 4:
        del header[key]
    elif choice == 5:
        header[key + ".renamed"] = header.pop(key)
    elif choice == 6:
        entry[rng.choice(["shape", "dtype", "data_offsets"])] = rng.choice([None, "3", [], {}, -1])
    elif choice == 7:
        header["__metadata__"] = rng.choice([{"a": 1}, ["x"], None, {"pathcond.spec": "{not json"}])
    elif choice == 8:
        return _with_header(rng.choice([[1, 2], "text", 3, None]), body)
    elif choice == 9:
        header["extra"] = {"dtype": "F32", "shape": [2], "data_offsets": [len(body), len(body) + 8]}
    else:
        return _with_header(header, body, pad=False)[: -rng.randint(1, 8)]
    return _with_header(header, body)


def _spec_structure(rng: random.Random) -> bytes:
    """A checkpoint whose embedded ``pathcond.spec`` (read without --arch) is subtly wrong."""
    spec = copy.deepcopy(mlp_spec())
    layers = spec["layers"]
    index = rng.randrange(len(layers))
    layer = layers[index]
    choice = rng.randrange(12)
    if choice == 0:
        layer["type"] = rng.choice(["gelu", "conv", "batchnorm", "maxpool", "add", "concat", "flatten", "input", 3])
    elif choice == 1:
        layer.pop(rng.choice([k for k in layer]))
    elif choice == 2:
        layer[rng.choice(["stride", "kernel", "weight", "bias", "inputs", "shape", "p", "eps"])] = rng.choice(
            [0, -1, 2, "x", None, [], [1, 2, 3], {"a": 1}, 1e300, True]
        )
    elif choice == 3:
        layer["inputs"] = rng.choice(["ghost", layers[-1]["name"], [layers[0]["name"]] * 2, []])
    elif choice == 4:
        layer["name"] = rng.choice([layers[0]["name"], "", 5, None])
    elif choice == 5:
        layers.insert(rng.randrange(len(layers) + 1), copy.deepcopy(rng.choice(layers)))
    elif choice == 6:
        del layers[index]
    elif choice == 7:
        spec["outputs"] = rng.choice([["ghost"], [], "x", [layers[0]["name"]], 7])
    elif choice == 8:
        layers[0]["shape"] = rng.choice([[], [0], [-3], [6, 1], [10**12], "6", [6.5]])
    elif choice == 9:
        spec["format_version"] = rng.choice([2, "1", None, 0])
    elif choice == 10:
        spec = rng.choice([[], "layers", {"layers": {}}, {"layers": [1, 2]}, {}])
    else:
        layers.reverse()
    text = json.dumps(spec) if rng.random() < 0.7 else yaml.safe_dump(spec)
    if rng.random() < 0.2:
        text = text[: rng.randrange(len(text))]
    return safetensors.torch.save(mlp_tensors(), metadata={"pathcond.spec": text})


# -- structure-level: ONNX -----------------------------------------------------------------------


def _onnx_structure(rng: random.Random) -> bytes:
    model = onnx.ModelProto()
    model.CopyFrom(ONNX_MODEL)
    graph = model.graph
    nodes = list(graph.node)
    node = rng.choice(nodes)
    choice = rng.randrange(13)
    if choice == 0:
        node.op_type = rng.choice(
            [
                "Sigmoid",
                "Gemm",
                "Conv",
                "Add",
                "MatMul",
                "Foo",
                "Identity",
                "Flatten",
                "MaxPool",
                "Softmax",
                "Mul",
                "LeakyRelu",
                "BatchNormalization",
                "Reshape",
            ]
        )
    elif choice == 1:
        graph.node.remove(node)
    elif choice == 2:
        values = ["x", "ghost", "", *(t.name for t in graph.initializer), *(o for n in nodes for o in n.output)]
        node.input[rng.randrange(len(node.input))] = rng.choice(values)
    elif choice == 3:
        del node.attribute[:]
        if rng.random() < 0.5:
            node.attribute.append(
                onnx.helper.make_attribute(
                    rng.choice(["transB", "transA", "alpha", "beta", "axis"]), rng.choice([0, 2, -1, 0.5, 3.0])
                )
            )
    elif choice == 4:
        tensor = rng.choice(list(graph.initializer))
        dims = list(tensor.dims)
        if len(dims) == 2 and rng.random() < 0.5:
            dims.reverse()
        else:
            dims[rng.randrange(len(dims))] += rng.choice([-1, 1])
        del tensor.dims[:]
        tensor.dims.extend(dims)
    elif choice == 5:
        tensor = rng.choice(list(graph.initializer))
        tensor.data_type = rng.choice(
            [
                onnx.TensorProto.DOUBLE,
                onnx.TensorProto.FLOAT16,
                onnx.TensorProto.INT64,
                onnx.TensorProto.STRING,
                onnx.TensorProto.BOOL,
                99,
            ]
        )
    elif choice == 6:
        dim = graph.input[0].type.tensor_type.shape.dim[rng.randrange(2)]
        if rng.random() < 0.3:
            dim.dim_param = "D"
        else:
            dim.dim_value = rng.choice([0, 1, 7, 10**6])
    elif choice == 7:
        model.opset_import[0].version = rng.choice([1, 7, 9, 12, 13, 21, 99])
    elif choice == 8:
        graph.input.append(onnx.helper.make_tensor_value_info("second", onnx.TensorProto.FLOAT, [1, 6]))
    elif choice == 9:
        del graph.output[:]
        if rng.random() < 0.5:
            graph.output.append(
                onnx.helper.make_tensor_value_info(
                    rng.choice(["h1", "x", "ghost", "fc1.weight"]), onnx.TensorProto.FLOAT, None
                )
            )
    elif choice == 10:
        graph.node.insert(rng.randrange(len(nodes) + 1), copy.deepcopy(node))
    elif choice == 11:
        tensor = rng.choice(list(graph.initializer))
        tensor.raw_data = tensor.raw_data[: rng.randrange(len(tensor.raw_data))]
    else:
        graph.input[0].type.tensor_type.elem_type = rng.choice(
            [onnx.TensorProto.DOUBLE, onnx.TensorProto.INT32, onnx.TensorProto.FLOAT16]
        )
    return model.SerializeToString()


def _changed(generate, rng: random.Random, original: bytes) -> bytes:
    """The first generated file that differs from ``original`` (some mutations can be no-ops)."""
    while (data := generate(rng)) == original:
        pass
    return data


def _structure_cases() -> list:
    rng = random.Random(4)
    return (
        [
            pytest.param(
                "safetensors", _changed(_safetensors_structure, rng, SAFETENSORS), id=f"safetensors-structure-{i:02d}"
            )
            for i in range(STRUCTURE_CASES)
        ]
        + [pytest.param("embedded-spec", _spec_structure(rng), id=f"embedded-spec-{i:02d}") for i in range(SPEC_CASES)]
        + [
            pytest.param("onnx", _changed(_onnx_structure, rng, ONNX), id=f"onnx-structure-{i:02d}")
            for i in range(STRUCTURE_CASES)
        ]
    )


# -- the sample models -----------------------------------------------------------------------------


def _sample_cases() -> list:
    mlp = (SAMPLES / "mlp.safetensors").read_bytes()
    resnet = (SAMPLES / "resnet_small.onnx").read_bytes()
    _, header_end = _safetensors_header(mlp)
    # The sample safetensors is mutated in its header (mutated weights are what the tiny model
    # is for, at a fraction of the cost); the ONNX sample is truncated or cut anywhere.
    return (
        _byte_cases("sample-safetensors", mlp, SAMPLE_CASES, seed=11, region=(0, header_end))
        + [
            pytest.param("sample-onnx", resnet[:cut], id=f"sample-onnx-truncate-{cut}")
            for cut in random.Random(12).sample(range(1, len(resnet)), SAMPLE_CASES // 2)
        ]
        + [
            pytest.param("sample-onnx", resnet[:cut] + resnet[cut + 64 :], id=f"sample-onnx-delete-{cut}")
            for cut in random.Random(13).sample(range(0, len(resnet) - 64), SAMPLE_CASES // 2)
        ]
    )


CASES = (
    _byte_cases("safetensors", SAFETENSORS, BYTE_CASES, seed=1)
    + _byte_cases("onnx", ONNX, BYTE_CASES, seed=2)
    + _payload_cases()
    + _structure_cases()
    + _sample_cases()
)


@pytest.fixture(scope="module")
def specs(tmp_path_factory):
    tiny = tmp_path_factory.mktemp("specs") / "tiny.yaml"
    tiny.write_text(yaml.safe_dump(mlp_spec()))
    return {"safetensors": tiny, "sample-safetensors": SAMPLES / "mlp.yaml"}


def test_fuzz_inputs_are_deterministic_mutations_of_valid_files():
    """The originals are valid, the cases are rebuilt identically, and every case differs from
    its original (a no-op mutation would test nothing)."""
    assert SAFETENSORS == safetensors.torch.save(mlp_tensors(), metadata={"origin": "fuzz"})
    assert pathcond_cli.load(ONNX).format == "onnx"
    ids = [case.id for case in CASES]
    assert len(ids) == len(set(ids))
    rebuilt = (
        _byte_cases("safetensors", SAFETENSORS, BYTE_CASES, seed=1)
        + _byte_cases("onnx", ONNX, BYTE_CASES, seed=2)
        + _payload_cases()
        + _structure_cases()
        + _sample_cases()
    )
    assert [c.values for c in rebuilt] == [c.values for c in CASES]
    originals = {
        "safetensors": SAFETENSORS,
        "onnx": ONNX,
        "sample-safetensors": (SAMPLES / "mlp.safetensors").read_bytes(),
        "sample-onnx": (SAMPLES / "resnet_small.onnx").read_bytes(),
    }
    for case in CASES:
        name, data = case.values
        assert data != originals.get(name, SAFETENSORS), case.id
    assert dump_spec(mlp_spec())


@pytest.mark.parametrize(("name", "data"), CASES)
def test_mutated_checkpoint(tmp_path, specs, name, data):
    suffix = ".onnx" if name.endswith("onnx") else ".safetensors"
    model = tmp_path / f"model{suffix}"
    model.write_bytes(data)
    out = tmp_path / f"out{suffix}"
    arch = ["--arch", str(specs[name])] if name in specs else []
    before = snapshot(tmp_path)

    result = invoke("rescale", model, *arch, "-o", out, "--json", "--max-iter", "50")

    escaped = result.exception if not isinstance(result.exception, SystemExit) else None
    assert escaped is None, f"exception escaped the CLI: {escaped!r}"
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout
    assert leftovers(tmp_path) == []
    assert model.read_bytes() == data, "the input was modified"
    if result.exit_code == 0:
        report = json.loads(result.stdout)
        check_report(report, rescale=True)
        original = pathcond_cli.load(model, **({"arch": arch[1]} if arch else {}))
        written = pathcond_cli.load(out)
        assert compare(original.graph, original.params, written.params).passed
        for key in original.params:
            if key not in original.graph.parameter_keys():
                assert np.array_equal(original.params[key].numpy(), written.params[key].numpy(), equal_nan=True)
    else:
        # A mutation that opens an input's dimensions asks for the one option that shapes it.
        asks_for_a_shape = result.exit_code == 2 and "pass --input-shape" in result.stderr
        assert result.exit_code in DOCUMENTED_ERRORS or asks_for_a_shape, f"exit {result.exit_code}: {result.stderr}"
        assert result.stderr.startswith("error:"), result.stderr
        check_error_output(result)
        assert_unchanged(tmp_path, before)
