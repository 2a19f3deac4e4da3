"""``pipeline.rescale_file``: one checkpoint through read → analyse → rescale → staged write →
verify, the function the CLI's ``rescale`` and library users share.

The written file is checked against the user's own reading of it: its tensors loaded with
safetensors and run through the MLP written out by hand, against the input's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch
from cli_support import leftovers, mlp_tensors, snapshot, write_mlp, write_onnx_mlp

import pathcond_cli
import pathcond_cli.rescaling
from pathcond_cli.errors import OutputError, UsageError, VerificationError
from pathcond_cli.io.destinations import written
from pathcond_cli.pipeline import FileRescale, Watcher, rescale_file

DIMS = (6, 8, 5, 3)


def mlp_outputs(path: Path, x: torch.Tensor) -> torch.Tensor:
    """The MLP of ``cli_support.mlp_spec`` computed from the file's tensors, in float64."""
    tensors = {key: value.double() for key, value in safetensors.torch.load_file(str(path)).items()}
    layers = len(DIMS) - 1
    for i in range(1, layers + 1):
        x = x @ tensors[f"fc{i}.weight"].T + tensors[f"fc{i}.bias"]
        if i < layers:
            x = torch.relu(x)
    return x


def assert_same_function(original: Path, rescaled: Path) -> None:
    x = torch.randn(64, DIMS[0], dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(mlp_outputs(rescaled, x), mlp_outputs(original, x), rtol=1e-5, atol=1e-6)


def test_writes_beside_the_input_a_verified_rescaling_of_the_same_function(tmp_path):
    checkpoint, spec = write_mlp(tmp_path, dims=DIMS)
    run = rescale_file(checkpoint, arch=str(spec))
    assert run.destination == tmp_path / "tiny.pathcond.safetensors" and run.destination.is_file()
    assert run.result.verification is not None and run.result.verification.passed
    assert run.result.solve.objective[-1] < run.result.solve.objective[0]
    assert_same_function(checkpoint, run.destination)
    changed = safetensors.torch.load_file(str(run.destination))
    assert any(not torch.equal(changed[key], value) for key, value in mlp_tensors(DIMS).items())
    assert {"load", "diag_g", "solve", "total"} <= set(run.seconds)
    assert leftovers(tmp_path) == []


def test_the_package_exposes_it():
    assert pathcond_cli.rescale_file is rescale_file


def test_a_run_never_replaces_its_input_unless_asked(tmp_path):
    checkpoint, spec = write_mlp(tmp_path, dims=DIMS)
    before = snapshot(tmp_path)
    with pytest.raises(OutputError, match="in-place"):
        rescale_file(checkpoint, checkpoint, arch=str(spec))
    assert snapshot(tmp_path) == before
    original = tmp_path / "original.safetensors"
    original.write_bytes(checkpoint.read_bytes())
    run = rescale_file(checkpoint, arch=str(spec), in_place=True)
    assert run.destination == checkpoint
    assert checkpoint.read_bytes() != original.read_bytes()
    assert_same_function(original, checkpoint)


def test_usage_errors_come_before_any_work(tmp_path, monkeypatch):
    checkpoint, spec = write_mlp(tmp_path, dims=DIMS)
    monkeypatch.setattr(pathcond_cli.io.formats, "load_model", lambda *a, **k: pytest.fail("the work started"))
    with pytest.raises(UsageError, match="ONNX"):
        rescale_file(checkpoint, tmp_path / "out.onnx", arch=str(spec))
    with pytest.raises(UsageError, match="destination"):
        rescale_file(checkpoint.read_bytes(), arch=str(spec))
    with pytest.raises(UsageError, match="not both"):
        rescale_file(checkpoint, tmp_path / "kept.safetensors", arch=str(spec), send=lambda path: None)
    with pytest.raises(UsageError, match="not both"):
        rescale_file(checkpoint, arch=str(spec), in_place=True, send=lambda path: None)
    report = tmp_path / "out.safetensors"
    with pytest.raises(UsageError, match="--report"):
        rescale_file(checkpoint, report, arch=str(spec), also_writes=[written("--report", report)])
    assert sorted(path.name for path in tmp_path.iterdir()) == ["tiny.arch.yaml", "tiny.safetensors"]


def test_also_written_paths_come_back_in_order(tmp_path):
    checkpoint, spec = write_mlp(tmp_path, dims=DIMS)
    run = rescale_file(
        checkpoint,
        tmp_path / "out.safetensors",
        arch=str(spec),
        also_writes=[written("--report", tmp_path / "r.json"), None, written("--plot", tmp_path / "p.png")],
    )
    assert run.also_written == [tmp_path / "r.json", None, tmp_path / "p.png"]
    assert not (tmp_path / "r.json").exists()  # checked, not written: the caller writes them


def test_a_failed_verification_leaves_nothing(tmp_path, monkeypatch):
    checkpoint, spec = write_mlp(tmp_path, dims=DIMS)
    before = snapshot(tmp_path)
    real_rescale = pathcond_cli.rescaling.rescale

    def corrupting(*args, **kwargs):
        result = real_rescale(*args, **kwargs)
        changed = dict(result.changed)
        changed["fc1.weight"] = changed["fc1.weight"] * 2
        result.changed = changed
        return result

    monkeypatch.setattr(pathcond_cli.rescaling, "rescale", corrupting)
    with pytest.raises(VerificationError):
        rescale_file(checkpoint, tmp_path / "out.safetensors", arch=str(spec))
    assert snapshot(tmp_path) == before


def test_send_gets_the_verified_file_and_nothing_is_kept(tmp_path):
    checkpoint, spec = write_mlp(tmp_path, dims=DIMS)
    before = snapshot(tmp_path)
    received = tmp_path.parent / f"{tmp_path.name}-sent.safetensors"

    def send(path: Path) -> None:
        received.write_bytes(path.read_bytes())

    run = rescale_file(checkpoint.read_bytes(), arch=str(spec), send=send, name="<bytes>")
    assert run.destination is None and run.result.verification.passed
    assert snapshot(tmp_path) == before
    assert_same_function(checkpoint, received)
    received.unlink()


def test_an_onnx_model_is_written_as_onnx(tmp_path):
    import onnx

    model = write_onnx_mlp(tmp_path / "net.onnx")
    run = rescale_file(model)
    assert run.destination == tmp_path / "net.pathcond.onnx"
    onnx.checker.check_model(str(run.destination))
    assert run.result.verification.passed


def test_the_watcher_sees_each_stage_and_the_run_grow(tmp_path):
    checkpoint, spec = write_mlp(tmp_path, dims=DIMS)
    stages, steps, iterations = [], [], []

    class Recording(Watcher):
        def stage(self, description: str) -> None:
            stages.append(description.split(":")[0])

        def solver(self, iteration: int, objective: float, residual: float) -> None:
            iterations.append(iteration)

        def reached(self, run: FileRescale) -> None:
            steps.append((run.loaded is not None, run.analysis is not None, run.result is not None))

    rescale_file(checkpoint, tmp_path / "out.safetensors", arch=str(spec), watcher=Recording())
    assert stages == ["loading", "analysing", "writing and verifying the written file"]
    assert steps == [(True, False, False), (True, True, False), (True, True, True)]
    assert iterations and iterations == sorted(iterations)
