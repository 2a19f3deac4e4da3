"""io.companions: the search for a name's bytes in a file, which tells whether a companion is another
file's and whether an ONNX file may name external data."""

from __future__ import annotations

import os

import pytest

from pathcond_cli.io import companions


@pytest.mark.parametrize("chunk", [3, 16], ids=["reads-shorter-than-the-needle", "reads-of-16"])
def test_the_needle_is_found_across_reads_and_absent_is_absent(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(companions, "SEARCH_CHUNK_BYTES", chunk)
    path = tmp_path / "bytes.onnx"
    for size in range(0, 40):
        for position in range(-1, size - 7):
            data = bytearray(b"x" * size)
            if position >= 0:
                data[position : position + 8] = b"location"
            path.write_bytes(bytes(data))
            assert companions.file_holds(path, b"location") == (position >= 0), (size, position)
    path.write_bytes(b"locatio")
    assert not companions.file_holds(path, b"location")


def test_anything_but_a_regular_file_holds_nothing_and_is_not_read(tmp_path):
    """A FIFO is opened without waiting for a writer and not read: the loader is its one reader."""
    fifo = tmp_path / "fifo.onnx"
    os.mkfifo(fifo)
    assert companions.file_holds(fifo, b"location") is False
    (tmp_path / "folder.onnx").mkdir()
    assert companions.file_holds(tmp_path / "folder.onnx", b"location") is False
    with pytest.raises(OSError):
        companions.file_holds(tmp_path / "missing.onnx", b"location")


def test_a_companion_named_by_another_model_is_found(tmp_path):
    model, other = tmp_path / "a.onnx", tmp_path / "b.onnx"
    model.write_bytes(b"... a.onnx.data ...")
    other.write_bytes(b"nothing of the kind")
    assert not companions.named_by_another_file(model, "a.onnx.data", ".onnx")
    other.write_bytes(b"\x00" * 40 + b"a.onnx.data")
    assert companions.named_by_another_file(model, "a.onnx.data", ".onnx")
