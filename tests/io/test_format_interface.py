"""Each checkpoint format implements the Format protocol, and the dispatcher reaches it by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from pathcond_cli.io import formats
from pathcond_cli.io.companions import companion_format
from pathcond_cli.io.formats.detection import FORMAT_OF_KIND
from pathcond_cli.io.formats.interface import Format


@pytest.mark.parametrize("name", sorted(set(FORMAT_OF_KIND.values())))
def test_every_format_implements_the_protocol_under_its_name(name):
    implementation = formats.format_named(name)
    assert isinstance(implementation, Format)
    assert implementation.name == name


def test_companions_are_asked_of_the_format_their_name_says(tmp_path):
    assert companion_format(tmp_path / "model.safetensors.index.json") == "safetensors"
    assert companion_format(tmp_path / "model.onnx") == "onnx"
    assert companion_format(tmp_path / "model.safetensors") is None
    assert set(filter(None, map(companion_format, [tmp_path / "a.json", tmp_path / "a.onnx"]))) <= set(
        FORMAT_OF_KIND.values()
    )


def test_an_unreadable_checkpoint_consists_of_itself(tmp_path):
    for name in ("model.onnx", "model.safetensors.index.json"):
        path = tmp_path / name
        path.write_bytes(b"not a checkpoint")
        assert formats.checkpoint_files(path) == [path]
        assert formats.replaced_companions(path) == ([], [])


def test_each_format_detects_its_own_files_asked_in_order(tmp_path):
    safetensors, onnx = formats.format_named("safetensors"), formats.format_named("onnx")
    assert safetensors.detect(tmp_path / "m.safetensors.index.json", None) == "safetensors-index"
    assert safetensors.detect(tmp_path / "m.json", None) == "safetensors-index"
    assert safetensors.detect(tmp_path / "m.safetensors", None) == "safetensors"
    assert safetensors.detect(tmp_path / "m.onnx", "safetensors") is None
    assert safetensors.detect(None, "safetensors") == "safetensors"
    assert safetensors.detect(None, None) is None
    assert onnx.detect(None, None) == "onnx"


def test_the_architecture_files_are_the_formats_own(tmp_path):
    (tmp_path / "m.yaml").write_text("layers: []\n")
    (tmp_path / "m.pathcond.json").write_text("{}")
    sidecars = [tmp_path / "m.pathcond.json", tmp_path / "m.yaml"]
    assert formats.files_read(tmp_path / "m.safetensors", None) == [tmp_path / "m.safetensors", *sidecars]
    assert formats.files_read(tmp_path / "m.onnx", None) == [tmp_path / "m.onnx"]
    assert formats.files_read(tmp_path / "m.onnx", "spec.yml") == [tmp_path / "m.onnx", Path("spec.yml")]
    assert formats.files_read(None, None) == []
    assert formats.format_named("onnx").architecture_files(tmp_path / "m.onnx", None) == []
