"""safetensors checkpoints: architecture resolution, validation, rescaled round trips, shards."""

from __future__ import annotations

import json
import struct
import textwrap

import pytest
import safetensors.torch
import torch
import yaml

from pathcond_cli.engine.evaluate import forward
from pathcond_cli.engine.groups import build_groups
from pathcond_cli.errors import InputError, InvalidWeightsError, OutputError, UsageError
from pathcond_cli.io.formats.safetensors_format import (
    SAFETENSORS_DTYPES,
    SPEC_METADATA_KEY,
    SafetensorsPayload,
    load_safetensors,
    write_safetensors,
)

SPEC = {
    "layers": [
        {"name": "x", "type": "input", "shape": [3, 8, 8]},
        {"name": "conv1", "type": "conv", "padding": 1, "bias": None},
        {"name": "bn1", "type": "batchnorm"},
        {"name": "relu1", "type": "relu"},
        {"name": "conv2", "type": "conv", "padding": 1},
        {"name": "relu2", "type": "relu"},
        {"name": "skip", "type": "add", "inputs": ["relu2", "relu1"]},
        {"name": "pool", "type": "maxpool", "kernel": 2},
        {"name": "gap", "type": "global_avgpool"},
        {"name": "flat", "type": "flatten"},
        {"name": "fc1", "type": "linear"},
        {"name": "relu3", "type": "relu"},
        {"name": "fc2", "type": "linear"},
    ]
}

TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 4e-2}


def checkpoint_tensors(dtype=torch.float32) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)

    def rand(*shape, low=-1.0, high=1.0):
        return (torch.rand(*shape, generator=generator, dtype=torch.float64) * (high - low) + low).to(dtype)

    return {
        "conv1.weight": rand(4, 3, 3, 3),
        "bn1.weight": rand(4, low=0.5, high=1.5),
        "bn1.bias": rand(4),
        "bn1.running_mean": rand(4),
        "bn1.running_var": rand(4, low=0.5, high=2.0),
        "bn1.num_batches_tracked": torch.tensor(7),
        "conv2.weight": rand(4, 4, 3, 3),
        "conv2.bias": rand(4),
        "fc1.weight": rand(6, 4),
        "fc1.bias": rand(6),
        "fc2.weight": rand(2, 6),
        "fc2.bias": rand(2),
    }


def write_spec(path, spec=SPEC):
    path.write_text(yaml.safe_dump(spec))
    return path


def save(path, tensors, metadata=None):
    safetensors.torch.save_file(tensors, str(path), metadata=metadata)
    return path


def raw_bytes(tensor: torch.Tensor) -> bytes:
    return bytes(tensor.reshape(-1).contiguous().view(torch.uint8).tolist())


def same_network(a, b) -> bool:
    return (a.nodes, a.outputs) == (b.nodes, b.outputs)


def relative_error(graph, before, after, x) -> float:
    expected = forward(graph, before, x)[graph.outputs[0]]
    got = forward(graph, after, x)[graph.outputs[0]]
    return float((got - expected).abs().max() / expected.abs().max())


def random_rescaling(model) -> dict[str, torch.Tensor]:
    groups = build_groups(model.graph, model.params)
    assert groups.num_free > 0
    u = torch.randn(groups.num_free, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 0.5
    return groups.apply(model.params, u)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rescaled_round_trip_preserves_function_bytes_and_metadata(tmp_path, dtype):
    source = save(tmp_path / "model.safetensors", checkpoint_tensors(dtype), {"origin": "unit test"})
    model = load_safetensors(source, arch=str(write_spec(tmp_path / "arch.yaml")))
    assert model.format == "safetensors" and model.warnings == []
    changed = random_rescaling(model)
    # conv1 reads the (fixed) input and hands its output scale to bn1: it stays untouched.
    assert set(changed) == {
        "bn1.weight",
        "bn1.bias",
        "conv2.weight",
        "conv2.bias",
        "fc1.weight",
        "fc1.bias",
        "fc2.weight",
    }

    out = tmp_path / "rescaled.safetensors"
    write_safetensors(model, changed, out, {"pathcond.version": "test"})
    reread = load_safetensors(out)  # no arch: the embedded spec describes it
    assert same_network(reread.graph, model.graph)
    assert reread.payload.metadata["origin"] == "unit test"
    assert reread.payload.metadata["pathcond.version"] == "test"
    assert SPEC_METADATA_KEY in reread.payload.metadata

    assert set(reread.params) == set(model.params)
    for key, tensor in reread.params.items():
        assert tensor.dtype == model.params[key].dtype and tensor.shape == model.params[key].shape
        expected = changed.get(key, model.params[key])
        assert raw_bytes(tensor) == raw_bytes(expected), key

    x = torch.randn(5, 3, 8, 8, dtype=torch.float64)
    assert relative_error(model.graph, model.params, reread.params, x) <= TOLERANCE[dtype]


def test_fp64_and_bytes_source(tmp_path):
    data = safetensors.torch.save(checkpoint_tensors(torch.float64))
    model = load_safetensors(data, arch=str(write_spec(tmp_path / "arch.json", SPEC)))
    assert model.source == "<bytes>" and model.params["fc2.weight"].dtype == torch.float64
    assert load_safetensors(data, arch=str(tmp_path / "arch.json"), name="upload").source == "upload"


def test_sidecar_discovery_in_order(tmp_path):
    checkpoint = save(tmp_path / "net.safetensors", checkpoint_tensors())
    (tmp_path / "net.yaml").write_text("not: [a spec")  # lower priority: never read
    write_spec(tmp_path / "net.pathcond.yml")
    assert load_safetensors(checkpoint).graph.source == str(tmp_path / "net.pathcond.yml")
    (tmp_path / "net.pathcond.yml").unlink()
    (tmp_path / "net.yaml").unlink()
    (tmp_path / "net.json").write_text(json.dumps(SPEC))
    assert load_safetensors(checkpoint).graph.source == str(tmp_path / "net.json")


def test_arch_argument_takes_precedence_over_embedded_spec(tmp_path):
    embedded = json.dumps({"layers": [{"name": "x", "type": "input", "shape": [1]}]})
    checkpoint = save(tmp_path / "m.safetensors", checkpoint_tensors(), {SPEC_METADATA_KEY: embedded})
    model = load_safetensors(checkpoint, arch=str(write_spec(tmp_path / "arch.yaml")))
    assert model.graph.source == str(tmp_path / "arch.yaml")


def test_no_architecture_says_where_it_looked(tmp_path):
    checkpoint = save(tmp_path / "model.safetensors", checkpoint_tensors())
    with pytest.raises(InputError) as info:
        load_safetensors(checkpoint)
    message = str(info.value)
    assert str(checkpoint) in message and "--arch" in message and SPEC_METADATA_KEY in message
    for name in (
        "model.pathcond.yaml",
        "model.pathcond.yml",
        "model.pathcond.json",
        "model.yaml",
        "model.yml",
        "model.json",
    ):
        assert name in message
    with pytest.raises(InputError, match="--arch"):
        load_safetensors(safetensors.torch.save(checkpoint_tensors()))
    with pytest.raises(InputError, match="expected a spec file"):
        load_safetensors(checkpoint, arch="not-a-spec")


def test_unused_tensors_are_named_in_a_warning_and_carried_through(tmp_path):
    tensors = checkpoint_tensors()
    tensors["head.extra"] = torch.arange(3.0)
    checkpoint = save(tmp_path / "model.safetensors", tensors)
    with pytest.raises(InputError, match="(?s)head.extra.*layer 'head'.*--allow-unused"):
        load_safetensors(checkpoint, arch=str(write_spec(tmp_path / "arch.yaml")))
    model = load_safetensors(checkpoint, arch=str(write_spec(tmp_path / "arch.yaml")), allow_unused=True)
    assert len(model.warnings) == 1
    assert "head.extra" in model.warnings[0] and "num_batches_tracked" not in model.warnings[0]
    out = tmp_path / "out.safetensors"
    write_safetensors(model, random_rescaling(model), out, {})
    assert torch.equal(load_safetensors(out, allow_unused=True).params["head.extra"], torch.arange(3.0))


def test_missing_bias_points_at_bias_null(tmp_path):
    spec = json.loads(json.dumps(SPEC))
    del spec["layers"][1]["bias"]
    checkpoint = save(tmp_path / "model.safetensors", checkpoint_tensors())
    with pytest.raises(InputError) as info:
        load_safetensors(checkpoint, arch=str(write_spec(tmp_path / "arch.yaml", spec)))
    message = str(info.value)
    assert str(checkpoint) in message and "'conv1.bias'" in message and "bias: null" in message


def test_missing_bias_beside_unread_batchnorm_statistics_points_at_the_module_spec(tmp_path):
    """A spec written from an ONNX export that folded BatchNorm expects conv biases the module's
    checkpoint lacks, and leaves its BatchNorm tensors unread: 'bias: null' would be wrong advice."""
    spec = json.loads(json.dumps(SPEC))
    del spec["layers"][1]["bias"]
    tensors = checkpoint_tensors()
    tensors.update({f"layer1.bn9.{role}": torch.ones(4) for role in ("weight", "bias", "running_mean", "running_var")})
    checkpoint = save(tmp_path / "model.safetensors", tensors)
    with pytest.raises(InputError) as info:
        load_safetensors(checkpoint, arch=str(write_spec(tmp_path / "arch.yaml", spec)))
    message = str(info.value)
    assert "'conv1.bias'" in message and "bias: null" not in message
    assert "BatchNorm statistics" in message and "--arch module:factory" in message


def test_an_unused_top_level_tensor_is_not_called_a_missing_layer(tmp_path):
    tensors = checkpoint_tensors()
    tensors["extra"] = torch.arange(3.0)
    checkpoint = save(tmp_path / "model.safetensors", tensors)
    with pytest.raises(InputError) as info:
        load_safetensors(checkpoint, arch=str(write_spec(tmp_path / "arch.yaml")))
    message = str(info.value)
    assert "- extra: top-level names that no layer of the architecture reads" in message
    assert "layer ''" not in message


def test_nan_weights_are_invalid_weights_naming_the_tensor(tmp_path):
    tensors = checkpoint_tensors()
    tensors["conv2.weight"][0, 0, 0, 0] = float("nan")
    checkpoint = save(tmp_path / "model.safetensors", tensors)
    with pytest.raises(InvalidWeightsError, match="'conv2.weight'"):
        load_safetensors(checkpoint, arch=str(write_spec(tmp_path / "arch.yaml")))


def write_shards(directory, tensors, metadata=None):
    keys = sorted(tensors)
    layout = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for file, shard_keys in layout.items():
        save(directory / file, {k: tensors[k] for k in shard_keys}, {"format": "pt"})
    index = directory / "model.safetensors.index.json"
    weight_map = {key: file for file, shard_keys in layout.items() for key in shard_keys}
    index.write_text(json.dumps({"metadata": metadata or {"total_size": 1234}, "weight_map": weight_map}))
    return index, layout


def test_sharded_read_and_write_round_trip(tmp_path):
    source_dir, out_dir = tmp_path / "in", tmp_path / "out"
    source_dir.mkdir()
    out_dir.mkdir()
    index, layout = write_shards(source_dir, checkpoint_tensors())
    write_spec(source_dir / "model.pathcond.yaml")
    model = load_safetensors(index)
    assert isinstance(model.payload, SafetensorsPayload) and len(model.payload.shards) == 2
    changed = random_rescaling(model)

    destination = out_dir / "rescaled.safetensors.index.json"
    write_safetensors(model, changed, destination, {"pathcond.version": "test"})
    written = json.loads(destination.read_text())
    assert written["metadata"]["total_size"] == 1234 and SPEC_METADATA_KEY in written["metadata"]
    shard_names = ["rescaled-00001-of-00002.safetensors", "rescaled-00002-of-00002.safetensors"]
    assert sorted(set(written["weight_map"].values())) == shard_names
    for old_keys, new_name in zip(layout.values(), shard_names):
        assert sorted(k for k, f in written["weight_map"].items() if f == new_name) == sorted(old_keys)

    reread = load_safetensors(destination)  # the spec travels in the index metadata
    assert same_network(reread.graph, model.graph)
    assert reread.payload.shards[0].metadata == {"format": "pt"}
    for key, tensor in reread.params.items():
        assert raw_bytes(tensor) == raw_bytes(changed.get(key, model.params[key])), key
    x = torch.randn(3, 3, 8, 8, dtype=torch.float64)
    assert relative_error(model.graph, model.params, reread.params, x) <= 1e-5

    with pytest.raises(OutputError, match="index"):
        write_safetensors(model, changed, out_dir / "single.safetensors", {})


def test_inconsistent_index_is_an_input_error(tmp_path):
    index, _ = write_shards(tmp_path, checkpoint_tensors())
    data = json.loads(index.read_text())
    data["weight_map"]["ghost.weight"] = "model-00001-of-00002.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(InputError, match="ghost.weight"):
        load_safetensors(index, arch=str(write_spec(tmp_path / "arch.yaml")))
    index.write_text('{"weights": {}}')
    with pytest.raises(InputError, match="not a safetensors index"):
        load_safetensors(index, arch=str(tmp_path / "arch.yaml"))


def bad_files(tmp_path) -> dict[str, object]:
    good = safetensors.torch.save(checkpoint_tensors())
    header_length = struct.unpack("<Q", good[:8])[0]
    files = {
        "empty": b"",
        "garbage": b"this is certainly not a safetensors checkpoint",
        "truncated": good[: len(good) - 10],
        "header beyond file": struct.pack("<Q", 5000) + good[8:100],
        "huge header": struct.pack("<Q", 2**40) + good[8:],
        "header not json": struct.pack("<Q", header_length) + b"\xff" * header_length + good[8 + header_length :],
    }
    paths: dict[str, object] = {}
    for label, data in files.items():
        path = tmp_path / f"{label.replace(' ', '_')}.safetensors"
        path.write_bytes(data)
        paths[label] = path
    paths["directory"] = tmp_path / "dir.safetensors"
    paths["directory"].mkdir()
    paths["missing"] = tmp_path / "missing.safetensors"
    return paths


def test_bad_files_are_input_errors_naming_the_file(tmp_path):
    arch = str(write_spec(tmp_path / "arch.yaml"))
    for label, path in bad_files(tmp_path).items():
        with pytest.raises(InputError) as info:
            load_safetensors(path, arch=arch)
        assert str(path) in str(info.value), label
        with pytest.raises(InputError):
            load_safetensors(path.read_bytes() if path.is_file() else b"", arch=arch)


def test_bad_file_messages_say_what_is_wrong(tmp_path):
    arch = str(write_spec(tmp_path / "arch.yaml"))
    paths = bad_files(tmp_path)
    expectations = {
        "empty": "too short",
        "header beyond file": "the header claims 5000 bytes",
        "huge header": "header length field",
        "truncated": "corrupt or truncated",
        "header not json": "header is not JSON",
        "directory": "cannot read",
        "missing": "No such file",
    }
    for label, fragment in expectations.items():
        with pytest.raises(InputError, match=fragment):
            load_safetensors(paths[label], arch=arch)


def test_python_factory_as_arch(tmp_path, monkeypatch):
    (tmp_path / "factory_net.py").write_text(
        textwrap.dedent("""
        import torch.nn as nn

        def build():
            return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    """)
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    tensors = {
        "0.weight": torch.randn(6, 4),
        "0.bias": torch.randn(6),
        "2.weight": torch.randn(2, 6),
        "2.bias": torch.randn(2),
    }
    checkpoint = save(tmp_path / "seq.safetensors", tensors)
    model = load_safetensors(checkpoint, arch="factory_net:build", input_shape=(4,))
    assert [n.op for n in model.graph.nodes] == ["input", "linear", "relu", "linear"]
    assert model.params["0.weight"].equal(tensors["0.weight"])
    with pytest.raises(UsageError, match="--input-shape"):
        load_safetensors(checkpoint, arch="factory_net:build")


@pytest.mark.parametrize("name", sorted(SAFETENSORS_DTYPES))
def test_each_element_type_name_is_the_one_save_file_writes(tmp_path, name):
    dtype = SAFETENSORS_DTYPES[name]
    path = tmp_path / "one.safetensors"
    safetensors.torch.save_file({"t": torch.zeros(2, dtype=dtype)}, str(path))
    with open(path, "rb") as stream:
        header = json.loads(stream.read(int.from_bytes(stream.read(8), "little")))
    assert header["t"]["dtype"] == name
    with safetensors.safe_open(str(path), framework="pt") as opened:
        assert opened.get_tensor("t").dtype == dtype
