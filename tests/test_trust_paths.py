"""Trust, paths written (issue 18, points 4, 5, 8 and 11): every path a run writes is named by
the user as that output or is a companion pathcond creates; it is never a file the run reads
(exit 6) nor another output of the same run (exit 2), and that is decided before any work.
Every message about a failed write tells the truth about what is on disk.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
import yaml

import pathcond_cli
import pathcond_cli.api
import pathcond_cli.formats
from cli_support import (
    CLEAN_ENV, assert_clean_exit, assert_unchanged, invoke, leftovers, mlp_spec, mlp_tensors, module_command,
    onnx_mlp_model, snapshot, write_mlp, write_onnx_mlp,
)
from pathcond_cli.verify import compare

FACTORY_SOURCE = """import torch


def build():
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
"""


def _no_work_allowed(monkeypatch) -> None:
    def never(*args, **kwargs):
        raise AssertionError("the work started before the paths were checked")

    monkeypatch.setattr(pathcond_cli.api, "solve", never)
    monkeypatch.setattr(pathcond_cli.formats, "load_model", never)


def _refused(directory: Path, code: int, args, *needles: str) -> str:
    before = snapshot(directory)
    stderr = assert_clean_exit(invoke(*args), code, *needles)
    assert_unchanged(directory, before)
    return stderr


def _external_data_onnx(directory: Path) -> Path:
    path = directory / "net.onnx"
    onnx.save_model(onnx_mlp_model(), str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="net.weights", size_threshold=0)
    return path


def _sharded(directory: Path) -> tuple[Path, Path]:
    import safetensors.torch

    tensors = mlp_tensors()
    layout = {"model-00001-of-00002.safetensors": ["fc1.weight", "fc1.bias", "fc2.weight"],
              "model-00002-of-00002.safetensors": ["fc2.bias", "fc3.weight", "fc3.bias"]}
    for file, keys in layout.items():
        safetensors.torch.save_file({k: tensors[k] for k in keys}, str(directory / file))
    index = directory / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {k: f for f, keys in layout.items() for k in keys}}))
    spec = directory / "model.arch.yaml"
    spec.write_text(yaml.safe_dump(mlp_spec()))
    return index, spec


def _read_file_cases(d: Path) -> dict[str, list]:
    """Command lines whose -o, --report or --plot names a file the run reads."""
    checkpoint, spec = write_mlp(d)
    sidecar_checkpoint, _ = write_mlp(d, "side")
    (d / "side.pathcond.yaml").write_text(yaml.safe_dump(mlp_spec()))
    png_input, _ = write_mlp(d, "weightsx")
    png_input = png_input.rename(d / "weights.png")
    (d / "mynet.py").write_text(FACTORY_SOURCE)
    (d / "pkg").mkdir()
    (d / "pkg" / "__init__.py").write_text("")
    (d / "pkg" / "nets.py").write_text(FACTORY_SOURCE)
    factory_checkpoint = d / "f.safetensors"
    import safetensors.torch
    import torch

    module = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    safetensors.torch.save_file(module.state_dict(), str(factory_checkpoint))
    onnx_model = _external_data_onnx(d)
    index, index_spec = _sharded(d)
    arch = ["--arch", spec]
    return {
        "report-over-sidecar": ["rescale", sidecar_checkpoint, "-o", d / "o.safetensors", "--report", d / "side.pathcond.yaml"],
        "output-over-sidecar-in-place": ["rescale", sidecar_checkpoint, "--in-place", "-o", d / "side.pathcond.yaml"],
        "report-over-arch-spec": ["rescale", checkpoint, *arch, "-o", d / "o.safetensors", "--report", spec],
        "report-over-checkpoint-in-place": ["rescale", checkpoint, *arch, "--in-place", "--report", checkpoint],
        "output-over-spec-in-place": ["rescale", checkpoint, *arch, "--in-place", "-o", spec],
        "plot-over-input": ["rescale", png_input, *arch, "-o", d / "o.safetensors", "--plot", png_input],
        "inspect-plot-over-input": ["inspect", png_input, *arch, "--plot", png_input],
        "output-over-factory-source": ["rescale", factory_checkpoint, "--arch", "mynet:build", "--input-shape", "6",
                                       "-o", d / "mynet.py"],
        "report-over-factory-source": ["rescale", factory_checkpoint, "--arch", "mynet:build", "--input-shape", "6",
                                       "-o", d / "o.safetensors", "--report", d / "mynet.py"],
        "report-over-factory-package": ["rescale", factory_checkpoint, "--arch", "pkg.nets:build", "--input-shape",
                                        "6", "-o", d / "o.safetensors", "--report", d / "pkg" / "__init__.py"],
        "report-over-factory-module": ["rescale", factory_checkpoint, "--arch", "pkg.nets:build", "--input-shape",
                                       "6", "-o", d / "o.safetensors", "--report", d / "pkg" / "nets.py"],
        "report-over-external-data": ["rescale", onnx_model, "-o", d / "o.onnx", "--report", d / "net.weights"],
        "plot-over-shard": ["rescale", index, "--arch", index_spec, "-o", d / "o.safetensors.index.json",
                            "--plot", d / "model-00002-of-00002.safetensors.png"],
        "report-over-shard": ["rescale", index, "--arch", index_spec, "-o", d / "o.safetensors.index.json",
                              "--report", d / "model-00001-of-00002.safetensors"],
    }


READ_CASES = ["report-over-sidecar", "output-over-sidecar-in-place", "report-over-arch-spec",
              "report-over-checkpoint-in-place", "output-over-spec-in-place", "plot-over-input", "inspect-plot-over-input",
              "output-over-factory-source", "report-over-factory-source", "report-over-factory-package",
              "report-over-factory-module", "report-over-external-data", "report-over-shard"]


@pytest.mark.parametrize("case", READ_CASES)
def test_no_path_a_run_writes_is_a_file_it_reads(tmp_path, monkeypatch, case):
    monkeypatch.chdir(tmp_path)  # where a factory module is looked up
    args = _read_file_cases(tmp_path)[case]
    _no_work_allowed(monkeypatch)
    _refused(tmp_path, 6, args, "a file this run reads" if "in-place" not in case or "output" in case else "reads")


def _with_each_output(d: Path) -> dict[str, list]:
    """Command lines whose outputs name the same file, or one names a companion of the checkpoint."""
    checkpoint, spec = write_mlp(d)
    onnx_model = _external_data_onnx(d)
    index, index_spec = _sharded(d)
    arch = ["--arch", spec]
    return {
        "report-is-the-output": ["rescale", checkpoint, *arch, "-o", d / "o.safetensors", "--report", d / "o.safetensors"],
        "plot-is-the-output": ["rescale", checkpoint, *arch, "-o", d / "out.png", "--plot", d / "out.png"],
        "plot-is-the-report": ["rescale", checkpoint, *arch, "-o", d / "o.safetensors", "--report", d / "r.png",
                               "--plot", d / "r.png"],
        "report-is-the-external-data": ["rescale", onnx_model, "-o", d / "o.onnx", "--report", d / "o.onnx.data"],
        "report-is-a-tagged-external-data": ["rescale", onnx_model, "-o", d / "o.onnx",
                                             "--report", d / "o-0123abcd.onnx.data"],
        "report-is-a-shard": ["rescale", index, "--arch", index_spec, "-o", d / "o.safetensors.index.json",
                              "--report", d / "o-00001-of-00003.safetensors"],
        "default-output-is-the-report": ["rescale", checkpoint, *arch, "--report", d / "tiny.pathcond.safetensors"],
    }


@pytest.mark.parametrize("case", ["report-is-the-output", "plot-is-the-output", "plot-is-the-report",
                                  "report-is-the-external-data", "report-is-a-tagged-external-data",
                                  "report-is-a-shard", "default-output-is-the-report"])
def test_outputs_of_one_run_never_overwrite_each_other(tmp_path, monkeypatch, case):
    args = _with_each_output(tmp_path)[case]
    _no_work_allowed(monkeypatch)
    _refused(tmp_path, 2, args, "would overwrite", "choose another")


def test_every_output_next_to_every_input_is_written(tmp_path):
    """The rule refuses clashes only: distinct names beside the inputs are all written."""
    onnx_model = _external_data_onnx(tmp_path)
    inputs = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    out, report, plot = tmp_path / "o.onnx", tmp_path / "o.json", tmp_path / "o.png"
    assert_clean_exit(invoke("rescale", onnx_model, "-o", out, "--report", report, "--plot", plot, "-q"), 0)
    assert {name: (tmp_path / name).read_bytes() for name in inputs} == inputs
    assert json.loads(report.read_text())["output"] == str(out)
    assert plot.read_bytes().startswith(b"\x89PNG")
    before, after = pathcond_cli.load(onnx_model), pathcond_cli.load(out)
    assert compare(before.graph, before.params, after.params).passed
    assert (tmp_path / "o.onnx.data").is_file() and leftovers(tmp_path) == []


# -- 11. names -----------------------------------------------------------------------------------


@pytest.mark.parametrize("option", ["-o", "--report"])
def test_a_name_ending_in_a_slash_is_refused_before_any_work(tmp_path, monkeypatch, option):
    checkpoint, spec = write_mlp(tmp_path)
    _no_work_allowed(monkeypatch)
    extra = ["-o", tmp_path / "o.safetensors"] if option != "-o" else []
    _refused(tmp_path, 6, ["rescale", checkpoint, "--arch", spec, *extra, option, f"{tmp_path}/newdir/"],
             "names a directory", option)
    assert not (tmp_path / "newdir").exists()


def test_report_to_stdout_is_refused_for_json_is_the_way(tmp_path, monkeypatch):
    checkpoint, spec = write_mlp(tmp_path)
    _no_work_allowed(monkeypatch)
    _refused(tmp_path, 2, ["rescale", checkpoint, "--arch", spec, "-o", tmp_path / "o.safetensors", "--report", "-"],
             "--json")
    assert not (tmp_path / "-").exists()


def test_long_utf8_names_are_written_or_refused_before_any_work(tmp_path, monkeypatch):
    checkpoint, spec = write_mlp(tmp_path)
    # 242 bytes in 127 characters: every staging name stays within 255 bytes.
    out = tmp_path / ("é" * 115 + ".safetensors")
    assert len(os.fsencode(out.name)) == 242
    assert_clean_exit(invoke("rescale", checkpoint, "--arch", spec, "-o", out, "-q"), 0)
    assert out.is_file() and leftovers(tmp_path) == []
    # An ONNX output's external data is named <name>.data (or with an 8-digit tag): at most 241 bytes fit.
    model = _external_data_onnx(tmp_path)
    fits = tmp_path / ("é" * 118 + ".onnx")
    assert len(os.fsencode(fits.name)) == 241
    assert_clean_exit(invoke("rescale", model, "-o", fits, "-q"), 0)
    assert fits.is_file() and Path(f"{fits}.data").is_file() and leftovers(tmp_path) == []
    _no_work_allowed(monkeypatch)
    _refused(tmp_path, 6, ["rescale", model, "-o", tmp_path / ("é" * 118 + "a.onnx")], "longer than 255 bytes")


def test_columns_zero_still_prints_errors_and_the_summary(tmp_path):
    checkpoint, spec = write_mlp(tmp_path)
    env = {**CLEAN_ENV, "COLUMNS": "0", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    failed = subprocess.run(module_command("rescale", tmp_path / "absent.safetensors"), capture_output=True, env=env)
    assert failed.returncode == 3 and b"no such file" in failed.stderr
    done = subprocess.run(module_command("rescale", checkpoint, "--arch", spec, "-o", tmp_path / "o.safetensors"),
                          capture_output=True, env=env)
    assert done.returncode == 0 and b"pathcond rescale: " in done.stderr.splitlines()[-1]


# -- 8. the messages match what is on disk --------------------------------------------------------


def _shell(command: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**CLEAN_ENV, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    return subprocess.run(["sh", "-c", command], capture_output=True, env=env, cwd=tmp_path)


@pytest.mark.parametrize("redirection", ["2>&-", "2</dev/null"], ids=["closed", "read-only"])
def test_closed_stderr_does_not_fail_a_run(tmp_path, redirection):
    checkpoint, spec = write_mlp(tmp_path)
    command = " ".join(module_command("rescale", checkpoint, "--arch", spec, "-o", tmp_path / "o.safetensors"))
    assert _shell(f"{command} {redirection}", tmp_path).returncode == 0
    before, after = pathcond_cli.load(checkpoint, arch=str(spec)), pathcond_cli.load(tmp_path / "o.safetensors")
    assert compare(before.graph, before.params, after.params).passed


def test_closed_stdout_with_json_is_refused_before_any_work(tmp_path):
    checkpoint, spec = write_mlp(tmp_path)
    before = snapshot(tmp_path)
    command = " ".join(module_command("rescale", checkpoint, "--arch", spec, "-o", tmp_path / "o.safetensors", "--json"))
    result = _shell(f"{command} >&-", tmp_path)
    assert result.returncode == 2 and b"stdout is closed" in result.stderr
    assert_unchanged(tmp_path, before)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_json_that_cannot_reach_stdout_says_the_checkpoint_was_written(tmp_path):
    checkpoint, spec = write_mlp(tmp_path)
    out = tmp_path / "o.safetensors"
    command = " ".join(module_command("rescale", checkpoint, "--arch", spec, "-o", out, "--json", "-q"))
    result = _shell(f"{command} > /dev/full", tmp_path)
    assert result.returncode == 6 and b"Traceback" not in result.stderr
    message = result.stderr.decode()
    assert "JSON report" in message and "Nothing was written" not in message and f"'{out}'" in message
    assert pathcond_cli.load(out).params.keys() == mlp_tensors().keys()


@pytest.mark.parametrize("in_place", [False, True])
def test_report_directory_vanishing_after_the_checkpoint_says_what_was_written(tmp_path, monkeypatch, in_place):
    checkpoint, spec = write_mlp(tmp_path)
    reports = tmp_path / "reports"
    reports.mkdir()
    save = pathcond_cli.api.save

    def save_then_remove_the_report_directory(*args, **kwargs):
        verification = save(*args, **kwargs)
        shutil.rmtree(reports)
        return verification

    monkeypatch.setattr(pathcond_cli.api, "save", save_then_remove_the_report_directory)
    written = checkpoint if in_place else tmp_path / "o.safetensors"
    where = ["--in-place"] if in_place else ["-o", written]
    result = invoke("rescale", checkpoint, "--arch", spec, *where, "--report", reports / "r.json")
    stderr = assert_clean_exit(result, 6, "r.json", "Written in full before this error", written.name)
    assert "Nothing was written" not in stderr
    assert pathcond_cli.load(written).arch_source == "metadata"


def test_stdout_checkpoint_that_fails_never_names_a_scratch_file_as_written(tmp_path):
    checkpoint, spec = write_mlp(tmp_path)
    command = " ".join(module_command("rescale", checkpoint, "--arch", spec, "-o", "-", "-q"))
    result = _shell(f"{command} > /dev/full", tmp_path)
    assert result.returncode == 6 and b"Traceback" not in result.stderr
    assert b"incomplete" in result.stderr and b"Nothing was written" in result.stderr
