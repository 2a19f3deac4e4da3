"""Formats are recognised by their structure, never by two bytes.

A safetensors file starts with its header's length, 8 bytes little-endian: a length of
0x80 + 256·k (k = 2..5, modulo 2^16) makes those bytes 0x80 0x02..0x05, the start of a
pickle. Such a file is still a safetensors file (its length is followed by '{' and a JSON
header within the file), and real torch pickles (a whole zip archive or pickle) are still refused.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import safetensors.torch
import torch
import yaml
from cli_support import assert_clean_exit, assert_unchanged, invoke, mlp_spec, mlp_tensors, parse_single_json, snapshot

import pathcond_cli.io.formats.safetensors_format as safetensors_format
from pathcond_cli.errors import InputError
from pathcond_cli.io.formats import detect_format


def _safetensors_bytes(tensors: dict[str, torch.Tensor], header_length: int) -> bytes:
    """A valid safetensors file whose JSON header is padded with spaces to ``header_length`` bytes."""
    header, data, offset = {}, b"", 0
    for key, tensor in tensors.items():
        raw = tensor.contiguous().numpy().tobytes()
        header[key] = {"dtype": "F32", "shape": list(tensor.shape), "data_offsets": [offset, offset + len(raw)]}
        data += raw
        offset += len(raw)
    text = json.dumps(header).encode()
    assert len(text) <= header_length
    return header_length.to_bytes(8, "little") + text + b" " * (header_length - len(text)) + data


@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_safetensors_whose_header_length_looks_like_a_pickle_is_read(tmp_path, k):
    tensors = mlp_tensors()
    length = 0x80 + 256 * k
    blob = _safetensors_bytes(tensors, length)
    assert blob[:2] == bytes([0x80, k])
    checkpoint = tmp_path / "net.safetensors"
    checkpoint.write_bytes(blob)
    spec = tmp_path / "net.arch.yaml"
    spec.write_text(yaml.safe_dump(mlp_spec()))
    # the file loads as itself: the safetensors library agrees on every tensor
    loaded = safetensors.torch.load_file(str(checkpoint))
    assert all(torch.equal(loaded[key], tensors[key]) for key in tensors)
    assert detect_format(checkpoint) == "safetensors"
    assert detect_format(blob) == "safetensors"
    unnamed = tmp_path / "net"
    unnamed.write_bytes(blob)
    assert detect_format(unnamed) == "safetensors"

    result = invoke("rescale", checkpoint, "--arch", spec, "-o", tmp_path / "out.safetensors", "--json")
    assert_clean_exit(result, 0)
    assert parse_single_json(result.stdout)["verification"]["passed"]
    result = invoke("inspect", "-", "--arch", spec, input=blob)
    assert_clean_exit(result, 0)


@pytest.mark.parametrize("k", [2, 5])
def test_written_file_whose_header_length_looks_like_a_pickle_reads_back(tmp_path, monkeypatch, k):
    """The verifier reads pathcond's own output with the same detection: an output whose header
    length happens to be 0x80 + 256·k is verified, not refused as a pickle (exit 5)."""
    checkpoint, spec = tmp_path / "net.safetensors", tmp_path / "net.arch.yaml"
    safetensors.torch.save_file(mlp_tensors(), str(checkpoint))
    spec.write_text(yaml.safe_dump(mlp_spec()))
    real_write = safetensors_format._write_file

    def write_padded(destination, *args, **kwargs):
        real_write(destination, *args, **kwargs)
        filename = Path(destination)
        data = filename.read_bytes()
        length = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + length])
        text = json.dumps(header).encode()
        target = 0x80 + 256 * k
        while target < len(text):
            target += 65536
        Path(filename).write_bytes(
            target.to_bytes(8, "little") + text + b" " * (target - len(text)) + data[8 + length :]
        )

    monkeypatch.setattr(safetensors_format, "_write_file", write_padded)
    out = tmp_path / "out.safetensors"
    result = invoke("rescale", checkpoint, "--arch", spec, "-o", out, "--json")
    if out.exists():
        assert out.read_bytes()[:2] == bytes([0x80, k]), "the patched writer was not used"
    assert_clean_exit(result, 0)


def test_damaged_pickle_lookalike_is_not_called_a_torch_pickle(tmp_path):
    """Two bytes of pickle magic followed by no pickle and no safetensors header: the
    safetensors reader says what is wrong with it (exit 3), not 'torch pickle'."""
    path = tmp_path / "net.safetensors"
    path.write_bytes(bytes([0x80, 0x03]) + b"\xff" * 30)
    spec = tmp_path / "net.arch.yaml"
    spec.write_text(yaml.safe_dump(mlp_spec()))
    before = snapshot(tmp_path)
    stderr = assert_clean_exit(
        invoke("rescale", path, "--arch", spec, "-o", tmp_path / "out.safetensors"), 3, "net.safetensors"
    )
    assert "torch pickle" not in stderr
    assert_unchanged(tmp_path, before)


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_whole_pickles_and_zip_archives_are_still_refused(tmp_path, protocol):
    path = tmp_path / "model.safetensors"
    path.write_bytes(pickle.dumps({"weight": [1.0, 2.0]}, protocol=protocol))
    with pytest.raises(InputError, match="torch pickle"):
        detect_format(path)
    with pytest.raises(InputError, match="torch pickle"):
        detect_format(path.read_bytes())
    zipped = tmp_path / "model.onnx"
    torch.save({"weight": torch.ones(2)}, str(zipped))
    with pytest.raises(InputError, match="torch pickle"):
        detect_format(zipped)
