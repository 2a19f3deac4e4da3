"""Fault behaviour of the command line.

Every failure must: name the problem (file, tensor, node or key), exit with its README code,
show no traceback, leave no output and no temporary file behind, and leave the input
byte-for-byte as it was. Every tolerated oddity (unused tensors, dead neurons, extreme
scales) must succeed with a finite report and a verified output.
"""

from __future__ import annotations

import copy
import errno
import json
import math
import os
import struct
from pathlib import Path

import numpy as np
import onnx
import pytest
import safetensors
import safetensors.torch
import torch
import yaml
from cli_support import (
    assert_clean_exit,
    assert_unchanged,
    check_report,
    invoke,
    leftovers,
    mlp_spec,
    mlp_tensors,
    onnx_mlp_model,
    parse_single_json,
    snapshot,
    write_mlp,
    write_onnx_mlp,
    write_sharded_mlp,
)

import pathcond_cli
import pathcond_cli.io.fileio
import pathcond_cli.io.formats.safetensors_format as safetensors_format
import pathcond_cli.model_files
import pathcond_cli.rescaling
from pathcond_cli.verify import Verification, compare


def _fails_cleanly(tmp_path: Path, code: int, args, *needles: str, input: bytes | None = None) -> str:
    """Run the CLI and check the failure contract; returns stderr."""
    before = snapshot(tmp_path)
    result = invoke(*args, input=input)
    stderr = assert_clean_exit(result, code, *needles)
    assert_unchanged(tmp_path, before)  # no output, no temp file, inputs untouched
    return stderr


def _succeeds(tmp_path: Path, checkpoint: Path, *args) -> tuple[dict, Path]:
    """Rescale with --json; the report is complete and finite, the output verified."""
    out = tmp_path / f"out{checkpoint.suffix}"
    source = checkpoint.read_bytes()
    result = invoke("rescale", checkpoint, *args, "-o", out, "--json")
    assert_clean_exit(result, 0)
    report = parse_single_json(result.stdout)
    check_report(report, rescale=True)
    assert checkpoint.read_bytes() == source
    assert leftovers(tmp_path) == []
    return report, out


def _same_function(original: Path, written: Path, **load_options) -> None:
    before = pathcond_cli.load(original, allow_unused=True, **load_options)
    after = pathcond_cli.load(written, allow_unused=True)
    verification = compare(before.graph, before.params, after.params)
    assert verification.passed, verification
    for key in after.graph.parameter_keys():
        assert bool(torch.isfinite(after.params[key]).all()), key


def _header(data: bytes) -> tuple[dict, bytes]:
    length = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def _with_header(header: dict, body: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + body


# -- unreadable files: exit 3 ------------------------------------------------------------------


def _safetensors_bytes() -> bytes:
    return safetensors.torch.save(mlp_tensors())


def _corruptions() -> dict[str, tuple[str, bytes]]:
    good = _safetensors_bytes()
    header, body = _header(good)
    beyond = copy.deepcopy(header)
    beyond["fc1.weight"]["data_offsets"][1] += 4096
    onnx_bytes = onnx_mlp_model().SerializeToString()
    random = np.random.default_rng(7).integers(0, 256, 600, dtype=np.uint8).tobytes()
    return {
        "truncated": (".safetensors", good[: len(good) // 2]),
        "truncated-in-header": (".safetensors", good[:40]),
        "empty": (".safetensors", b""),
        "seven-bytes": (".safetensors", good[:7]),
        "random-bytes": (".safetensors", random),
        "random-bytes-onnx": (".onnx", random),
        "random-bytes-no-suffix": (".bin", random),
        "header-claims-more-bytes": (".safetensors", struct.pack("<Q", len(good)) + good[8:]),
        "huge-header-2-40": (".safetensors", struct.pack("<Q", 2**40) + good[8:]),
        "huge-header-2-64": (".safetensors", b"\xff" * 8 + good[8:]),
        "header-not-json": (".safetensors", struct.pack("<Q", 12) + b"not json at all" + body),
        "tensor-beyond-file": (".safetensors", _with_header(beyond, body)),
        "truncated-onnx": (".onnx", onnx_bytes[: len(onnx_bytes) * 2 // 3]),
        "empty-onnx": (".onnx", b""),
        "text-onnx": (".onnx", b"ir_version: 8\nthis is not a model\n"),
    }


@pytest.mark.parametrize("name", list(_corruptions()))
@pytest.mark.parametrize("command", ["rescale", "inspect"])
def test_unreadable_file_exit_3(tmp_path, name, command):
    suffix, data = _corruptions()[name]
    path = tmp_path / f"model{suffix}"
    path.write_bytes(data)
    spec = tmp_path / "model.arch.yaml"
    spec.write_text(yaml.safe_dump(mlp_spec()))
    arch = ["--arch", spec] if suffix == ".safetensors" else []
    _fails_cleanly(tmp_path, 3, [command, path, *arch], str(path))
    assert path.read_bytes() == data


def test_unreadable_stdin_exit_3(tmp_path):
    _fails_cleanly(tmp_path, 3, ["rescale", "-", "-o", tmp_path / "out.onnx"], "<stdin>", input=b"\x00garbage" * 50)
    _fails_cleanly(tmp_path, 3, ["rescale", "-", "-o", tmp_path / "out.onnx"], "<stdin>", input=b"")


def test_directory_exit_3(tmp_path):
    directory = tmp_path / "model.safetensors"
    directory.mkdir()
    _fails_cleanly(tmp_path, 3, ["rescale", directory], str(directory), "directory")
    _fails_cleanly(tmp_path, 3, ["inspect", directory], str(directory), "directory")


def test_missing_file_exit_3(tmp_path):
    for name in ("absent.safetensors", "absent.onnx", "absent"):
        _fails_cleanly(tmp_path, 3, ["rescale", tmp_path / name], name, "no such file")


def test_unreadable_file_permissions_exit_3(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root reads files whatever their permissions")
    checkpoint, spec = write_mlp(tmp_path)
    checkpoint.chmod(0)
    try:
        _fails_cleanly(tmp_path, 3, ["rescale", checkpoint, "--arch", spec], str(checkpoint))
    finally:
        checkpoint.chmod(0o644)


# -- checkpoint and spec disagree: exit 3 ------------------------------------------------------


def _spec_with(change) -> dict:
    spec = mlp_spec()
    change(spec["layers"])
    return spec


SPEC_FAULTS = {
    "missing-tensor": (lambda layers: layers[1].update(weight="nope.weight"), ["nope.weight", "fc1"]),
    "missing-bias": (lambda layers: layers[3].update(bias="fc2.b"), ["fc2.b", "fc2"]),
    "unknown-layer-type": (lambda layers: layers[2].update(type="swirl"), ["swirl", "relu1"]),
    "unknown-field": (lambda layers: layers[1].update(strides=2), ["strides", "fc1"]),
    "cycle": (lambda layers: layers[1].update(inputs="relu2"), ["cycle", "fc1"]),
    "dangling-input": (lambda layers: layers[3].update(inputs="ghost"), ["ghost", "fc2"]),
    "duplicate-name": (lambda layers: layers[3].update(name="fc1"), ["fc1"]),
    "no-input-shape": (lambda layers: layers[0].pop("shape"), ["shape"]),
}


@pytest.mark.parametrize("name", list(SPEC_FAULTS))
def test_spec_faults_exit_3(tmp_path, name):
    change, needles = SPEC_FAULTS[name]
    checkpoint, spec = write_mlp(tmp_path, spec=_spec_with(change))
    _fails_cleanly(tmp_path, 3, ["rescale", checkpoint, "--arch", spec], str(spec.name), *needles)


def test_spec_not_yaml_exit_3(tmp_path):
    checkpoint, spec = write_mlp(tmp_path)
    spec.write_text("layers: [ {name: x, type: input\n")
    _fails_cleanly(tmp_path, 3, ["rescale", checkpoint, "--arch", spec], spec.name)
    _fails_cleanly(tmp_path, 3, ["rescale", checkpoint, "--arch", tmp_path / "absent.yaml"], "absent.yaml")


def test_tensor_of_wrong_rank_exit_3(tmp_path):
    tensors = mlp_tensors()
    tensors["fc2.weight"] = tensors["fc2.weight"].flatten()
    checkpoint, spec = write_mlp(tmp_path, tensors=tensors)
    _fails_cleanly(tmp_path, 3, ["rescale", checkpoint, "--arch", spec], "fc2.weight", "fc2", "rank")


def test_tensor_of_wrong_shape_exit_3(tmp_path):
    tensors = mlp_tensors()
    tensors["fc2.weight"] = torch.randn(5, 7)  # fc1 produces 8 features
    checkpoint, spec = write_mlp(tmp_path, tensors=tensors)
    _fails_cleanly(tmp_path, 3, ["rescale", checkpoint, "--arch", spec], "fc2")
    tensors = mlp_tensors()
    tensors["fc1.bias"] = torch.randn(3)  # 8 expected
    checkpoint, spec = write_mlp(tmp_path, tensors=tensors)
    _fails_cleanly(tmp_path, 3, ["rescale", checkpoint, "--arch", spec], "fc1")


def test_integer_weights_exit_3(tmp_path):
    tensors = mlp_tensors()
    tensors["fc1.weight"] = torch.ones(8, 6, dtype=torch.int64)
    checkpoint, spec = write_mlp(tmp_path, tensors=tensors)
    _fails_cleanly(tmp_path, 3, ["rescale", checkpoint, "--arch", spec], "fc1.weight")


def test_input_shape_that_does_not_fit_exit_3_or_of_the_wrong_rank_exit_2(tmp_path):
    checkpoint, spec = write_mlp(tmp_path)
    _fails_cleanly(tmp_path, 3, ["rescale", checkpoint, "--arch", spec, "--input-shape", "7"], "fc1")
    model = write_onnx_mlp(tmp_path / "net.onnx")
    _fails_cleanly(tmp_path, 2, ["rescale", model, "--input-shape", "3,4"], "--input-shape", "batch-free")


# -- unsupported architecture: exit 4 ----------------------------------------------------------


def test_non_homogeneous_onnx_lists_every_offending_node_exit_4(tmp_path):
    model = onnx_mlp_model()
    for node in model.graph.node:
        if node.name == "relu1":
            node.op_type = "Sigmoid"
        elif node.name == "relu2":
            node.op_type = "Tanh"
    path = tmp_path / "smooth.onnx"
    onnx.save_model(model, str(path))
    _fails_cleanly(tmp_path, 4, ["rescale", path], "relu1", "Sigmoid", "relu2", "Tanh")
    _fails_cleanly(tmp_path, 4, ["inspect", path], "relu1", "relu2")


# -- non-finite weights: exit 7 ----------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_weights_exit_7(tmp_path, bad):
    tensors = mlp_tensors()
    tensors["fc2.weight"][1, 2] = bad
    checkpoint, spec = write_mlp(tmp_path, tensors=tensors)
    _fails_cleanly(tmp_path, 7, ["rescale", checkpoint, "--arch", spec], "fc2.weight", "NaN or Inf")
    _fails_cleanly(tmp_path, 7, ["inspect", checkpoint, "--arch", spec], "fc2.weight")


def test_non_finite_onnx_initializer_exit_7(tmp_path):
    def poison(name, array):
        if name == "fc3.bias":
            array = array.copy()
            array[0] = np.nan
        return array

    path = write_onnx_mlp(tmp_path / "nan.onnx", transform=poison)
    _fails_cleanly(tmp_path, 7, ["rescale", path], "fc3.bias")


# -- tolerated oddities: success ---------------------------------------------------------------


def test_unused_tensors_warned_and_kept_bit_identical(tmp_path):
    tensors = mlp_tensors()
    extras = {
        "extra.float": torch.tensor([1.5, float("nan"), -0.0]),  # not part of the function: NaN is fine
        "extra.half": torch.randn(4, 3).to(torch.float16),
        "extra.steps": torch.tensor([12345678901], dtype=torch.int64),
        "extra.flags": torch.tensor([True, False]),
    }
    checkpoint, spec = write_mlp(tmp_path, tensors={**tensors, **extras})
    _fails_cleanly(tmp_path, 3, ["rescale", checkpoint, "--arch", spec], "--allow-unused", "extra.half")
    report, out = _succeeds(tmp_path, checkpoint, "--arch", spec, "--allow-unused")
    (warning,) = report["warnings"]
    for key in extras:
        assert key in warning
    with (
        safetensors.safe_open(str(checkpoint), framework="pt") as before,
        safetensors.safe_open(str(out), framework="pt") as after,
    ):
        assert set(after.keys()) == set(before.keys())
        for key in extras:
            a, b = before.get_tensor(key), after.get_tensor(key)
            assert a.dtype == b.dtype and a.shape == b.shape
            assert a.view(torch.uint8).numpy().tobytes() == b.view(torch.uint8).numpy().tobytes(), key
    _same_function(checkpoint, out, arch=str(spec))
    # Shown to people too.
    result = invoke("rescale", checkpoint, "--arch", spec, "-o", tmp_path / "again.safetensors", "--allow-unused")
    assert_clean_exit(result, 0, "warning", "extra.half")


def test_all_zero_layer_is_degenerate_frozen_and_succeeds(tmp_path):
    tensors = mlp_tensors()
    tensors["fc2.weight"].zero_()
    tensors["fc2.bias"].zero_()
    checkpoint, spec = write_mlp(tmp_path, tensors=tensors)
    report, out = _succeeds(tmp_path, checkpoint, "--arch", spec)
    assert report["groups"]["degenerate"] > 0
    assert report["groups"]["degenerate"] == len(report["degenerate_groups"])
    assert {g.split(":")[0] for g in report["degenerate_groups"]} >= {"fc2"}
    _same_function(checkpoint, out, arch=str(spec))
    written = safetensors.torch.load_file(str(out))
    assert torch.equal(written["fc2.weight"], tensors["fc2.weight"])
    # Every hidden neuron is degenerate (no path reaches the output): all frozen at u = 0, so
    # the layer before the zero one is left exactly as it was.
    assert report["groups"]["degenerate"] == report["groups"]["free"] and report["u_inf"] == 0.0
    assert torch.equal(written["fc1.weight"], tensors["fc1.weight"]) and torch.equal(
        written["fc1.bias"], tensors["fc1.bias"]
    )


def test_dead_neuron_is_degenerate_frozen_and_succeeds(tmp_path):
    tensors = mlp_tensors()
    tensors["fc1.weight"][3].zero_()
    tensors["fc1.bias"][3] = 0.0
    tensors["fc2.weight"][:, 3].zero_()
    checkpoint, spec = write_mlp(tmp_path, tensors=tensors)
    report, out = _succeeds(tmp_path, checkpoint, "--arch", spec)
    assert "fc1:3" in report["degenerate_groups"]
    assert report["groups"]["degenerate"] == len(report["degenerate_groups"]) >= 1
    assert report["diag_g"]["zeros"] > 0
    assert report["solver"]["converged"] is True
    _same_function(checkpoint, out, arch=str(spec))
    written = safetensors.torch.load_file(str(out))
    assert not written["fc1.weight"][3].any() and not written["fc2.weight"][:, 3].any()


def test_everything_zero_succeeds(tmp_path):
    tensors = {k: torch.zeros_like(v) for k, v in mlp_tensors().items()}
    checkpoint, spec = write_mlp(tmp_path, tensors=tensors)
    report, out = _succeeds(tmp_path, checkpoint, "--arch", spec)
    assert report["u_inf"] == 0.0
    written = safetensors.torch.load_file(str(out))
    assert all(not t.any() for t in written.values())


def _assert_finite_numbers(value, path="report") -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _assert_finite_numbers(item, f"{path}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _assert_finite_numbers(item, f"{path}[{i}]")
    elif isinstance(value, float):
        assert math.isfinite(value), path


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compensating_extreme_scales_succeed(tmp_path, dtype):
    """fc1 ×1e30 and fc2 ×1e-30: the same function, a wildly unbalanced network."""
    tensors = mlp_tensors(dtype=dtype)
    tensors["fc1.weight"] *= 1e30
    tensors["fc1.bias"] *= 1e30
    tensors["fc2.weight"] *= 1e-30
    checkpoint, spec = write_mlp(tmp_path, tensors=tensors)
    report, out = _succeeds(tmp_path, checkpoint, "--arch", spec)
    _assert_finite_numbers(report)
    for key in ("min", "max", "log10_min", "log10_max", "log10_spread"):
        assert report["diag_g"][key] is not None, key
    assert report["u_inf"] > 10  # the rescaling undoes the 1e30 imbalance (ln 1e30 ≈ 69)
    _same_function(checkpoint, out, arch=str(spec))


def test_deep_mlp_with_huge_weights_succeeds(tmp_path):
    """Every tensor ×1e20 across 8 layers: outputs ~1e160, diag(G) entries up to ~1e286."""
    dims = (5, 6, 6, 6, 6, 6, 6, 6, 3)
    tensors = {k: v * 1e20 for k, v in mlp_tensors(dims, dtype=torch.float64).items()}
    checkpoint, spec = write_mlp(tmp_path, dims=dims, tensors=tensors)
    report, out = _succeeds(tmp_path, checkpoint, "--arch", spec)
    _assert_finite_numbers(report)
    assert report["diag_g"]["log10_max"] > 250  # a naive float64 pass overflows; the log-domain one does not
    _same_function(checkpoint, out, arch=str(spec))


def test_diag_g_beyond_float64_succeeds(tmp_path):
    """×1e100 on 3 layers: outputs ~1e300 still fit float64, g ~1e400 does not (reported as null)."""
    dims = (5, 6, 6, 3)
    tensors = {k: v * 1e100 for k, v in mlp_tensors(dims, dtype=torch.float64).items()}
    checkpoint, spec = write_mlp(tmp_path, dims=dims, tensors=tensors)
    report, out = _succeeds(tmp_path, checkpoint, "--arch", spec)
    assert report["diag_g"]["log10_max"] > 308 and report["diag_g"]["max"] is None
    _same_function(checkpoint, out, arch=str(spec))


@pytest.mark.parametrize(
    "solver",
    [
        "newton",
        "block",
        "sequential",
        "lbfgs",
    ],
)
def test_tiny_weights_succeed(tmp_path, solver):
    """×1e-30 on every tensor of 4 layers: the output bias dominates every path by ~1e60."""
    dims = (5, 6, 6, 6, 3)
    tensors = {k: v * 1e-30 for k, v in mlp_tensors(dims, dtype=torch.float64).items()}
    checkpoint, spec = write_mlp(tmp_path, dims=dims, tensors=tensors)
    report, out = _succeeds(tmp_path, checkpoint, "--arch", spec, "--solver", solver)
    _assert_finite_numbers(report)
    assert report["solver"]["converged"] is True
    _same_function(checkpoint, out, arch=str(spec))


@pytest.mark.parametrize(
    "solver",
    [
        "block",
        "sequential",
        "lbfgs",
    ],
)
@pytest.mark.parametrize("where", ["fc2.weight", "fc2.bias"])
def test_one_huge_weight_succeeds(tmp_path, solver, where):
    """One float32 entry near float32's limit (what a flipped exponent bit does): found by test_fuzz."""
    tensors = mlp_tensors()
    tensors[where].view(-1)[1] = 2.0e37
    checkpoint, spec = write_mlp(tmp_path, tensors=tensors)
    report, out = _succeeds(tmp_path, checkpoint, "--arch", spec, "--solver", solver)
    _assert_finite_numbers(report)
    assert report["solver"]["converged"] is True
    _same_function(checkpoint, out, arch=str(spec))


def _corrupting_apply(monkeypatch):
    """Make the rescaling wrong on purpose: fc2's weights come out doubled."""
    import pathcond_cli.engine.groups

    real_apply = pathcond_cli.engine.groups.RescalingGroups.apply

    def apply(self, params, u):
        changed = real_apply(self, params, u)
        changed["fc2.weight"] = changed.get("fc2.weight", params["fc2.weight"]) * 2
        return changed

    monkeypatch.setattr(pathcond_cli.engine.groups.RescalingGroups, "apply", apply)


def test_a_wrong_rescaling_is_caught_exit_5(tmp_path, monkeypatch):
    checkpoint, spec = write_mlp(tmp_path)
    _corrupting_apply(monkeypatch)
    _fails_cleanly(tmp_path, 5, ["rescale", checkpoint, "--arch", spec, "-o", tmp_path / "out.safetensors"], "differs")


def test_a_wrong_rescaling_is_caught_even_when_outputs_overflow_exit_5(tmp_path, monkeypatch):
    dims = (5, 6, 6, 6, 3)  # ×1e150 on 4 layers: outputs ~1e600, inf in float64
    tensors = {k: v * 1e150 for k, v in mlp_tensors(dims, dtype=torch.float64).items()}
    checkpoint, spec = write_mlp(tmp_path, dims=dims, tensors=tensors)
    _corrupting_apply(monkeypatch)
    _fails_cleanly(tmp_path, 5, ["rescale", checkpoint, "--arch", spec, "-o", tmp_path / "out.safetensors"])


# -- the output cannot be written: exit 6 ------------------------------------------------------


def test_output_in_missing_directory_exit_6(tmp_path):
    checkpoint, spec = write_mlp(tmp_path)
    missing = tmp_path / "no" / "such"
    _fails_cleanly(
        tmp_path, 6, ["rescale", checkpoint, "--arch", spec, "-o", missing / "out.safetensors"], str(missing)
    )
    _fails_cleanly(
        tmp_path,
        6,
        ["rescale", checkpoint, "--arch", spec, "-o", tmp_path / "out.safetensors", "--report", missing / "r.json"],
        str(missing),
    )


def test_output_is_a_directory_exit_6(tmp_path):
    checkpoint, spec = write_mlp(tmp_path)
    (tmp_path / "out.safetensors").mkdir()
    _fails_cleanly(
        tmp_path, 6, ["rescale", checkpoint, "--arch", spec, "-o", tmp_path / "out.safetensors"], "directory"
    )


def test_output_directory_without_write_permission_exit_6(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes whatever the permissions; see the monkeypatched variants")
    checkpoint, spec = write_mlp(tmp_path)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        _fails_cleanly(
            tmp_path, 6, ["rescale", checkpoint, "--arch", spec, "-o", locked / "out.safetensors"], "permission"
        )
    finally:
        locked.chmod(0o755)


def test_no_write_permission_reported_before_any_work_exit_6(tmp_path, monkeypatch):
    checkpoint, spec = write_mlp(tmp_path)
    real_access = os.access
    monkeypatch.setattr(
        pathcond_cli.io.fileio.os,
        "access",
        lambda path, mode, **kw: False if mode & os.W_OK else real_access(path, mode, **kw),
    )
    _fails_cleanly(
        tmp_path,
        6,
        ["rescale", checkpoint, "--arch", spec, "-o", tmp_path / "out.safetensors"],
        "permission",
        str(tmp_path),
    )


@pytest.mark.parametrize("where", ["mkdtemp", "mkstemp"])
def test_permission_denied_creating_temporary_files_exit_6(tmp_path, monkeypatch, where):
    """What a read-only file system or an ACL does although os.access said yes."""
    checkpoint, spec = write_mlp(tmp_path)

    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(pathcond_cli.io.fileio.tempfile, where, denied)
    _fails_cleanly(
        tmp_path,
        6,
        ["rescale", checkpoint, "--arch", spec, "-o", tmp_path / "out.safetensors"],
        "out.safetensors",
        "permission denied",
    )


def _partial_then(exception):
    """A writer that leaves half a file behind and then fails."""

    def write(*args, **kwargs):
        Path(args[1]).write_bytes(b"\x00partial checkpoint")
        raise exception

    return write


def test_disk_full_while_writing_safetensors_exit_6(tmp_path, monkeypatch):
    checkpoint, spec = write_mlp(tmp_path)
    monkeypatch.setattr(
        safetensors_format, "write_tensors", _partial_then(OSError(errno.ENOSPC, "No space left on device"))
    )
    _fails_cleanly(
        tmp_path,
        6,
        ["rescale", checkpoint, "--arch", spec, "-o", tmp_path / "out.safetensors"],
        "out.safetensors",
        "disk is full",
    )
    # With --in-place the input survives too.
    _fails_cleanly(tmp_path, 6, ["rescale", checkpoint, "--arch", spec, "--in-place"], "disk is full")


def test_disk_full_while_writing_onnx_exit_6(tmp_path, monkeypatch):
    model = write_onnx_mlp(tmp_path / "net.onnx")
    monkeypatch.setattr(onnx, "save_model", _partial_then(OSError(errno.ENOSPC, "No space left on device")))
    _fails_cleanly(tmp_path, 6, ["rescale", model, "-o", tmp_path / "out.onnx"], "out.onnx", "disk is full")


def test_rename_failure_exit_6(tmp_path, monkeypatch):
    checkpoint, spec = write_mlp(tmp_path)

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pathcond_cli.io.fileio.os, "replace", full)
    _fails_cleanly(
        tmp_path, 6, ["rescale", checkpoint, "--arch", spec, "-o", tmp_path / "out.safetensors"], "disk is full"
    )


def test_disk_full_writing_the_report_exit_6(tmp_path, monkeypatch):
    checkpoint, spec = write_mlp(tmp_path)
    real_write_text = Path.write_text

    def write_text(self, *args, **kwargs):
        if self.name.startswith(".report.json."):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    result = invoke(
        "rescale", checkpoint, "--arch", spec, "-o", tmp_path / "out.safetensors", "--report", tmp_path / "report.json"
    )
    assert_clean_exit(result, 6, "report.json", "disk is full")
    assert not (tmp_path / "report.json").exists()
    assert leftovers(tmp_path) == []


def test_keyboard_interrupt_while_writing_exit_130(tmp_path, monkeypatch):
    checkpoint, spec = write_mlp(tmp_path)
    monkeypatch.setattr(safetensors_format, "write_tensors", _partial_then(KeyboardInterrupt()))
    _fails_cleanly(
        tmp_path, 130, ["rescale", checkpoint, "--arch", spec, "-o", tmp_path / "out.safetensors"], "interrupted"
    )
    _fails_cleanly(tmp_path, 130, ["rescale", checkpoint, "--arch", spec, "--in-place"], "interrupted")


def test_keyboard_interrupt_while_solving_exit_130(tmp_path, monkeypatch):
    model = write_onnx_mlp(tmp_path / "net.onnx")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pathcond_cli.rescaling, "solve", interrupted)
    _fails_cleanly(tmp_path, 130, ["rescale", model, "-o", tmp_path / "out.onnx"], "interrupted")


def test_keyboard_interrupt_while_verifying_in_place_keeps_the_input(tmp_path, monkeypatch):
    """The written file is verified before it replaces anything: Ctrl-C then loses nothing."""
    checkpoint, spec = write_mlp(tmp_path)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pathcond_cli.model_files, "compare", interrupted)
    _fails_cleanly(tmp_path, 130, ["rescale", checkpoint, "--arch", spec, "--in-place"], "interrupted")
    _fails_cleanly(
        tmp_path, 130, ["rescale", checkpoint, "--arch", spec, "-o", tmp_path / "out.safetensors"], "interrupted"
    )


def test_failed_verification_exit_5_writes_nothing(tmp_path, monkeypatch):
    checkpoint, spec = write_mlp(tmp_path)
    model = write_onnx_mlp(tmp_path / "net.onnx")

    def differs(*args, **kwargs):
        return Verification(1.0, 0.5, 1e-5, ("eval",))

    monkeypatch.setattr(pathcond_cli.model_files, "compare", differs)
    out = tmp_path / "out.safetensors"
    _fails_cleanly(tmp_path, 5, ["rescale", checkpoint, "--arch", spec, "-o", out], str(out), "differs")
    _fails_cleanly(tmp_path, 5, ["rescale", checkpoint, "--arch", spec, "--in-place"], str(checkpoint), "differs")
    _fails_cleanly(tmp_path, 5, ["rescale", model, "-o", tmp_path / "out.onnx"], "out.onnx", "differs")


def test_output_equal_to_input_without_in_place_exit_6(tmp_path, monkeypatch):
    checkpoint, spec = write_mlp(tmp_path)
    model = write_onnx_mlp(tmp_path / "net.onnx")
    _fails_cleanly(
        tmp_path, 6, ["rescale", checkpoint, "--arch", spec, "-o", checkpoint], "--in-place", str(checkpoint)
    )
    _fails_cleanly(tmp_path, 6, ["rescale", model, "-o", model], "--in-place")
    monkeypatch.chdir(tmp_path)  # the same file under another spelling
    _fails_cleanly(tmp_path, 6, ["rescale", model, "-o", "./net.onnx"], "--in-place")
    link = tmp_path / "link.onnx"
    link.symlink_to(model)
    _fails_cleanly(tmp_path, 6, ["rescale", model, "-o", link], "--in-place")
    _fails_cleanly(
        tmp_path,
        6,
        ["rescale", checkpoint, "--arch", spec, "-o", tmp_path / "o.safetensors", "--report", checkpoint],
        "a file this run reads",
    )


@pytest.mark.parametrize("explicit_output", [False, True])
def test_in_place_replaces_the_input_with_a_verified_rescaling(tmp_path, explicit_output):
    checkpoint, spec = write_mlp(tmp_path)
    original = tmp_path / "original.safetensors"
    original.write_bytes(checkpoint.read_bytes())
    checkpoint.chmod(0o640)
    args = ["-o", checkpoint] if explicit_output else []
    result = invoke("rescale", checkpoint, "--arch", spec, *args, "--in-place", "--json")
    assert_clean_exit(result, 0)
    report = parse_single_json(result.stdout)
    assert report["output"] == str(checkpoint)
    assert checkpoint.read_bytes() != original.read_bytes()
    assert checkpoint.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["original.safetensors", "tiny.arch.yaml", "tiny.safetensors"]
    _same_function(original, checkpoint, arch=str(spec))


def test_onnx_in_place(tmp_path):
    model = write_onnx_mlp(tmp_path / "net.onnx")
    original = model.read_bytes()
    assert_clean_exit(invoke("rescale", model, "--in-place", "-q"), 0)
    assert model.read_bytes() != original
    (tmp_path / "original.onnx").write_bytes(original)
    _same_function(tmp_path / "original.onnx", model)
    assert leftovers(tmp_path) == []


# -- the command line's own safety nets --------------------------------------------------------


def test_non_finite_rescaling_is_refused_exit_8(tmp_path, monkeypatch):
    """Whatever the solver returns, a rescaling that overflows is never written (here even the
    auto rule's bounded solve returns u beyond its bound: the final storage check refuses it)."""
    checkpoint, spec = write_mlp(tmp_path)
    real_solve = pathcond_cli.rescaling.solve

    def overflowing(*args, **kwargs):
        result = real_solve(*args, **kwargs)
        result.u = result.u + 1e6
        return result

    monkeypatch.setattr(pathcond_cli.rescaling, "solve", overflowing)
    # refused by the dtype check before anything is written (dtype_limits), naming the tensor
    _fails_cleanly(
        tmp_path,
        8,
        ["rescale", checkpoint, "--arch", spec, "-o", tmp_path / "out.safetensors"],
        "would exceed float32",
        "fc1.weight",
        "--max-log-scale",
    )
    _fails_cleanly(tmp_path, 8, ["rescale", checkpoint, "--arch", spec, "--in-place"], "would exceed float32")


def test_written_file_that_does_not_read_back_exit_5(tmp_path, monkeypatch):
    checkpoint, spec = write_mlp(tmp_path)
    monkeypatch.setattr(safetensors_format, "write_tensors", lambda tensors, path, **_: Path(path).write_bytes(b"junk"))
    _fails_cleanly(
        tmp_path,
        5,
        ["rescale", checkpoint, "--arch", spec, "-o", tmp_path / "out.safetensors"],
        "does not read back",
        str(tmp_path / "out.safetensors"),
    )


def test_unexpected_exception_is_an_internal_error_without_traceback(tmp_path, monkeypatch):
    checkpoint, spec = write_mlp(tmp_path)

    def broken(*args, **kwargs):
        raise ZeroDivisionError("float division by zero")

    monkeypatch.setattr(pathcond_cli.rescaling, "solve", broken)
    monkeypatch.delenv("PATHCOND_DEBUG", raising=False)
    _fails_cleanly(
        tmp_path,
        1,
        ["rescale", checkpoint, "--arch", spec, "-o", tmp_path / "out.safetensors"],
        "internal error",
        "ZeroDivisionError",
        "PATHCOND_DEBUG",
    )
    monkeypatch.setenv("PATHCOND_DEBUG", "1")
    result = invoke("rescale", checkpoint, "--arch", spec, "-o", tmp_path / "out.safetensors")
    assert isinstance(result.exception, ZeroDivisionError)  # the traceback, on request
    assert leftovers(tmp_path) == []


def test_inconsistent_onnx_tensor_names_the_tensor_exit_3(tmp_path):
    model = onnx_mlp_model()
    bias = next(t for t in model.graph.initializer if t.name == "fc2.bias")
    del bias.dims[:]
    bias.dims.append(4)  # holds 5 floats
    path = tmp_path / "bad.onnx"
    onnx.save_model(model, str(path))
    _fails_cleanly(tmp_path, 3, ["rescale", path], "fc2.bias", str(path))
    _fails_cleanly(
        tmp_path, 3, ["rescale", "-", "-o", tmp_path / "out.onnx"], "fc2.bias", "<stdin>", input=path.read_bytes()
    )


# -- sharded checkpoints: several files, the index last ---------------------------------------


def test_sharded_checkpoint_is_written_whole_and_verified(tmp_path):
    index, spec = write_sharded_mlp(tmp_path)
    out = tmp_path / "out" / "rescaled.safetensors.index.json"
    out.parent.mkdir()
    result = invoke("rescale", index, "--arch", spec, "-o", out, "--json")
    assert_clean_exit(result, 0)
    assert sorted(p.name for p in out.parent.iterdir()) == [
        "rescaled-00001-of-00002.safetensors",
        "rescaled-00002-of-00002.safetensors",
        "rescaled.safetensors.index.json",
    ]
    _same_function(index, out, arch=str(spec))


def test_sharded_in_place_interrupted_while_verifying_keeps_every_file(tmp_path, monkeypatch):
    index, spec = write_sharded_mlp(tmp_path)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pathcond_cli.model_files, "compare", interrupted)
    _fails_cleanly(tmp_path, 130, ["rescale", index, "--arch", spec, "--in-place"], "interrupted")
    monkeypatch.undo()
    original = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    keep = tmp_path / "original"
    keep.mkdir()
    for name, data in original.items():
        (keep / name).write_bytes(data)
    assert_clean_exit(invoke("rescale", index, "--arch", spec, "--in-place", "-q"), 0)
    # The new shards have fresh names (the index was swapped last); the old ones are gone.
    weight_map = json.loads(index.read_text())["weight_map"]
    shards = sorted(set(weight_map.values()))
    assert len(shards) == 2 and not set(shards) & set(original)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == sorted([index.name, spec.name, *shards])
    _same_function(keep / index.name, index, arch=str(spec))


@pytest.mark.parametrize("name", ["model.json", "model.textproto", "model.pbtxt"])
def test_text_files_are_unreadable_not_internal_errors_exit_3(tmp_path, name):
    path = tmp_path / name
    path.write_text('{"graph": 1}\n' if name.endswith(".json") else "garbage: 1\n")
    _fails_cleanly(tmp_path, 3, ["rescale", path], str(path))
    _fails_cleanly(tmp_path, 3, ["inspect", path], str(path))


def test_sharded_output_named_json_reads_back(tmp_path):
    """A sharded output may be named anything.json; it must read back for verification."""
    index, spec = write_sharded_mlp(tmp_path)
    out = tmp_path / "out.json"
    result = invoke("rescale", index, "--arch", spec, "-o", out, "--json")
    assert_clean_exit(result, 0)
    check_report(parse_single_json(result.stdout), rescale=True)
    _same_function(index, out, arch=str(spec))
    assert leftovers(tmp_path) == []
