"""Text outputs may go to a character device: ``spec -o /dev/null`` and
``--report /dev/null`` work (written directly, nothing staged beside them); a checkpoint, which
is read back to be verified, still needs a regular file, and the refusal names its option."""

from __future__ import annotations

import os

import pytest
from cli_support import assert_clean_exit, assert_unchanged, invoke, snapshot, write_mlp, write_onnx_mlp

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/null"), reason="needs /dev/null")


def test_spec_to_dev_null(tmp_path):
    model = write_onnx_mlp(tmp_path / "net.onnx")
    before = snapshot(tmp_path)
    stderr = assert_clean_exit(invoke("spec", model, "-o", "/dev/null"), 0)
    assert "'/dev/null'" in stderr
    assert_unchanged(tmp_path, before)


def test_report_to_dev_null(tmp_path):
    checkpoint, spec = write_mlp(tmp_path)
    out = tmp_path / "out.safetensors"
    assert_clean_exit(invoke("rescale", checkpoint, "--arch", spec, "-o", out, "--report", "/dev/null", "-q"), 0)
    assert out.is_file()


def test_a_checkpoint_to_a_device_is_refused_naming_its_option(tmp_path):
    checkpoint, spec = write_mlp(tmp_path)
    before = snapshot(tmp_path)
    assert_clean_exit(
        invoke("rescale", checkpoint, "--arch", spec, "-o", "/dev/null"),
        6,
        "character device",
        "read back",
        "choose another -o path",
    )
    assert_unchanged(tmp_path, before)
