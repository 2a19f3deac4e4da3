"""Trust, paths written: every path a run writes is named by
the user as that output or is a companion pathcond creates; it is never a file the run reads
(exit 6) nor another output of the same run (exit 2), and that is decided before any work.
Every message about a failed write tells the truth about what is on disk.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import yaml
from cli_support import (
    CLEAN_ENV,
    assert_clean_exit,
    assert_unchanged,
    invoke,
    leftovers,
    mlp_spec,
    mlp_tensors,
    module_command,
    onnx_mlp_model,
    snapshot,
    write_mlp,
    write_onnx_mlp,
    write_sharded_mlp,
)

import pathcond_cli
import pathcond_cli.analysis
import pathcond_cli.io.formats
import pathcond_cli.model_files
import pathcond_cli.rescaling
from pathcond_cli.io.fileio import describe, printable
from pathcond_cli.verify import compare

FACTORY_SOURCE = """import torch


def build():
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
"""


def _no_work_allowed(monkeypatch) -> None:
    def never(*args, **kwargs):
        raise AssertionError("the work started before the paths were checked")

    monkeypatch.setattr(pathcond_cli.rescaling, "solve", never)
    monkeypatch.setattr(pathcond_cli.io.formats, "load_model", never)


def _refused(directory: Path, code: int, args, *needles: str) -> str:
    before = snapshot(directory)
    stderr = assert_clean_exit(invoke(*args), code, *needles)
    assert_unchanged(directory, before)
    return stderr


def _external_data_onnx(directory: Path) -> Path:
    """An MLP with external data whose first weight (8 KiB) is large enough to stay external when written."""
    path = directory / "net.onnx"
    onnx.save_model(
        onnx_mlp_model((64, 32, 5, 3)),
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="net.weights",
        size_threshold=0,
    )
    return path


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
    index, index_spec = write_sharded_mlp(d)
    arch = ["--arch", spec]
    return {
        "report-over-sidecar": [
            "rescale",
            sidecar_checkpoint,
            "-o",
            d / "o.safetensors",
            "--report",
            d / "side.pathcond.yaml",
        ],
        "output-over-sidecar-in-place": ["rescale", sidecar_checkpoint, "--in-place", "-o", d / "side.pathcond.yaml"],
        "report-over-arch-spec": ["rescale", checkpoint, *arch, "-o", d / "o.safetensors", "--report", spec],
        "report-over-checkpoint-in-place": ["rescale", checkpoint, *arch, "--in-place", "--report", checkpoint],
        "output-over-spec-in-place": ["rescale", checkpoint, *arch, "--in-place", "-o", spec],
        "plot-over-input": ["rescale", png_input, *arch, "-o", d / "o.safetensors", "--plot", png_input],
        "inspect-plot-over-input": ["inspect", png_input, *arch, "--plot", png_input],
        "output-over-factory-source": [
            "rescale",
            factory_checkpoint,
            "--arch",
            "mynet:build",
            "--input-shape",
            "6",
            "-o",
            d / "mynet.py",
        ],
        "report-over-factory-source": [
            "rescale",
            factory_checkpoint,
            "--arch",
            "mynet:build",
            "--input-shape",
            "6",
            "-o",
            d / "o.safetensors",
            "--report",
            d / "mynet.py",
        ],
        "report-over-factory-package": [
            "rescale",
            factory_checkpoint,
            "--arch",
            "pkg.nets:build",
            "--input-shape",
            "6",
            "-o",
            d / "o.safetensors",
            "--report",
            d / "pkg" / "__init__.py",
        ],
        "report-over-factory-module": [
            "rescale",
            factory_checkpoint,
            "--arch",
            "pkg.nets:build",
            "--input-shape",
            "6",
            "-o",
            d / "o.safetensors",
            "--report",
            d / "pkg" / "nets.py",
        ],
        "report-over-external-data": ["rescale", onnx_model, "-o", d / "o.onnx", "--report", d / "net.weights"],
        "plot-over-shard": [
            "rescale",
            index,
            "--arch",
            index_spec,
            "-o",
            d / "o.safetensors.index.json",
            "--plot",
            d / "model-00002-of-00002.safetensors.png",
        ],
        "report-over-shard": [
            "rescale",
            index,
            "--arch",
            index_spec,
            "-o",
            d / "o.safetensors.index.json",
            "--report",
            d / "model-00001-of-00002.safetensors",
        ],
    }


READ_CASES = [
    "report-over-sidecar",
    "output-over-sidecar-in-place",
    "report-over-arch-spec",
    "report-over-checkpoint-in-place",
    "output-over-spec-in-place",
    "plot-over-input",
    "inspect-plot-over-input",
    "output-over-factory-source",
    "report-over-factory-source",
    "report-over-factory-package",
    "report-over-factory-module",
    "report-over-external-data",
    "report-over-shard",
]


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
    index, index_spec = write_sharded_mlp(d)
    arch = ["--arch", spec]
    return {
        "report-is-the-output": [
            "rescale",
            checkpoint,
            *arch,
            "-o",
            d / "o.safetensors",
            "--report",
            d / "o.safetensors",
        ],
        "plot-is-the-output": ["rescale", checkpoint, *arch, "-o", d / "out.png", "--plot", d / "out.png"],
        "plot-is-the-report": [
            "rescale",
            checkpoint,
            *arch,
            "-o",
            d / "o.safetensors",
            "--report",
            d / "r.png",
            "--plot",
            d / "r.png",
        ],
        "report-is-the-external-data": ["rescale", onnx_model, "-o", d / "o.onnx", "--report", d / "o.onnx.data"],
        "report-is-a-tagged-external-data": [
            "rescale",
            onnx_model,
            "-o",
            d / "o.onnx",
            "--report",
            d / "o-0123abcd.onnx.data",
        ],
        "report-is-a-shard": [
            "rescale",
            index,
            "--arch",
            index_spec,
            "-o",
            d / "o.safetensors.index.json",
            "--report",
            d / "o-00001-of-00003.safetensors",
        ],
        "default-output-is-the-report": ["rescale", checkpoint, *arch, "--report", d / "tiny.pathcond.safetensors"],
    }


@pytest.mark.parametrize(
    "case",
    [
        "report-is-the-output",
        "plot-is-the-output",
        "plot-is-the-report",
        "report-is-the-external-data",
        "report-is-a-tagged-external-data",
        "report-is-a-shard",
        "default-output-is-the-report",
    ],
)
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
    _refused(
        tmp_path,
        6,
        ["rescale", checkpoint, "--arch", spec, *extra, option, f"{tmp_path}/newdir/"],
        "names a directory",
        option,
    )
    assert not (tmp_path / "newdir").exists()


def test_report_to_stdout_is_refused_for_json_is_the_way(tmp_path, monkeypatch):
    checkpoint, spec = write_mlp(tmp_path)
    _no_work_allowed(monkeypatch)
    _refused(
        tmp_path,
        2,
        ["rescale", checkpoint, "--arch", spec, "-o", tmp_path / "o.safetensors", "--report", "-"],
        "--json",
    )
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
    done = subprocess.run(
        module_command("rescale", checkpoint, "--arch", spec, "-o", tmp_path / "o.safetensors"),
        capture_output=True,
        env=env,
    )
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
    command = " ".join(
        module_command("rescale", checkpoint, "--arch", spec, "-o", tmp_path / "o.safetensors", "--json")
    )
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
    save = pathcond_cli.model_files.save

    def save_then_remove_the_report_directory(*args, **kwargs):
        verification = save(*args, **kwargs)
        shutil.rmtree(reports)
        return verification

    monkeypatch.setattr(pathcond_cli.model_files, "save", save_then_remove_the_report_directory)
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


# -- 7. input never exits 1 (internal error): each case gets its documented code ------------------


def _external_entry(d: Path, key: str, value: str) -> list:
    path = _external_data_onnx(d)
    model = onnx.load(str(path), load_external_data=False)
    tensor = model.graph.initializer[0]
    entries = {entry.key: entry for entry in tensor.external_data}
    if key not in entries:
        entries[key] = tensor.external_data.add(key=key)
    entries[key].value = value
    onnx.save_model(model, str(path))
    return ["rescale", path, "-o", d / "o.onnx"]


def _onnx_bias_of_one(d: Path) -> list:
    path = write_onnx_mlp(d / "b.onnx", transform=lambda name, a: a[:1] if name == "fc1.bias" else a)
    return ["rescale", path, "-o", d / "o.onnx"]


def _spec_bias_of_one(d: Path) -> list:
    tensors = mlp_tensors()
    tensors["fc1.bias"] = tensors["fc1.bias"][:1]
    checkpoint, spec = write_mlp(d, tensors=tensors)
    return ["rescale", checkpoint, "--arch", spec, "-o", d / "o.safetensors"]


def _spec_scale(d: Path, factor: float) -> list:
    spec = mlp_spec()
    spec["layers"].insert(2, {"name": "gain", "type": "scale", "factor": factor})
    checkpoint, spec_path = write_mlp(d, spec=spec)
    return ["rescale", checkpoint, "--arch", spec_path, "-o", d / "o.safetensors"]


def _spec_with_digits(d: Path, suffix: str) -> list:
    checkpoint, _ = write_mlp(d)
    spec = d / f"digits{suffix}"
    layers = mlp_spec()["layers"]
    text = json.dumps({"layers": [{**layers[0], "shape": ["DIGITS"]}, *layers[1:]]}).replace('"DIGITS"', "9" * 5000)
    if suffix != ".json":
        text = yaml.safe_dump({"layers": [{**layers[0], "shape": ["DIGITS"]}, *layers[1:]]}).replace(
            "DIGITS", "9" * 5000
        )
    spec.write_text(text)
    return ["rescale", checkpoint, "--arch", spec, "-o", d / "o.safetensors"]


def _factory(d: Path, name: str, body: str) -> list:
    (d / f"{name}.py").write_text(body)
    checkpoint = d / "f.safetensors"
    import safetensors.torch

    safetensors.torch.save_file(
        {"0.weight": mlp_tensors()["fc1.weight"], "0.bias": mlp_tensors()["fc1.bias"]}, str(checkpoint)
    )
    return ["rescale", checkpoint, "--arch", f"{name}:build", "--input-shape", "6", "-o", d / "o.safetensors"]


INPUT_CASES = {
    "external-offset-not-a-number": (lambda d: _external_entry(d, "offset", "abc"), 3, "offset and length"),
    "external-length-negative": (lambda d: _external_entry(d, "length", "-5"), 3, "offset and length"),
    "external-length-in-exponent-notation": (lambda d: _external_entry(d, "length", "1e3"), 3, "offset and length"),
    "onnx-gemm-bias-of-one": (_onnx_bias_of_one, 3, "one bias value for each"),
    "spec-bias-of-one": (_spec_bias_of_one, 3, "one bias value for each"),
    # The network overflows float64 by itself: nothing can be verified (exit 5, saying why).
    "spec-scale-overflowing-float64": (lambda d: _spec_scale(d, 1e308), 5, "not finite"),
    "spec-integer-of-5000-digits-yaml": (lambda d: _spec_with_digits(d, ".yaml"), 3, "4300 digits"),
    "spec-integer-of-5000-digits-json": (lambda d: _spec_with_digits(d, ".json"), 3, "4300 digits"),
    "input-shape-beyond-int64": (
        lambda d: ["rescale", write_onnx_mlp(d / "n.onnx"), "--input-shape", str(2**63), "-o", d / "o.onnx"],
        2,
        "int64",
    ),
    "factory-calling-sys-exit": (
        lambda d: _factory(d, "exits_in_build", "import sys\ndef build():\n    sys.exit()\n"),
        3,
        "sys.exit()",
    ),
    "factory-calling-sys-exit-0-on-import": (
        lambda d: _factory(d, "exits_on_import", "import sys\nsys.exit(0)\n"),
        3,
        "sys.exit(0)",
    ),
}


@pytest.mark.parametrize("case", sorted(INPUT_CASES))
def test_input_problems_get_their_documented_exit_code(tmp_path, monkeypatch, case):
    monkeypatch.chdir(tmp_path)
    build, code, needle = INPUT_CASES[case]
    args = build(tmp_path)
    stderr = _refused(tmp_path, code, args, needle)
    assert "internal error" not in stderr


@pytest.mark.parametrize(
    "failure",
    [
        MemoryError(),
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
            "you tried to allocate "
            "320000000000 bytes. Error code 12 (Cannot allocate memory)"
        ),
    ],
    ids=["python", "torch"],
)
def test_an_allocation_that_fails_is_exit_3_not_an_internal_error(tmp_path, monkeypatch, failure):
    checkpoint, spec = write_mlp(tmp_path)

    def allocating(*args, **kwargs):
        raise failure

    monkeypatch.setattr(pathcond_cli.analysis, "diag_g_and_l2_norm", allocating)
    stderr = _refused(
        tmp_path,
        3,
        ["rescale", checkpoint, "--arch", spec, "-o", tmp_path / "o.safetensors"],
        "out of memory",
        "Nothing was written",
    )
    assert "internal error" not in stderr


def _float64_mlp_with_gains(path: Path, gains: list[float]) -> Path:
    """The float64 test MLP with Mul nodes by ``gains`` after its first ReLU."""
    model = onnx_mlp_model(transform=lambda name, a: a.astype("float64"))
    for value in (*model.graph.input, *model.graph.output):
        value.type.tensor_type.elem_type = onnx.TensorProto.DOUBLE
    relu = next(node for node in model.graph.node if node.name == "relu1")
    source = relu.output[0] = "gained0"
    for i, gain in enumerate(gains):
        model.graph.initializer.append(onnx.numpy_helper.from_array(np.array(gain), f"gain{i}"))
        target = "r1" if i == len(gains) - 1 else f"gained{i + 1}"
        model.graph.node.insert(2 + i, onnx.helper.make_node("Mul", [source, f"gain{i}"], [target], name=f"gain{i}"))
        source = target
    onnx.save_model(model, str(path))
    return path


def test_a_float64_constant_factor_whose_square_overflows_is_rescaled_exactly(tmp_path):
    """A Mul by 1e200 in float64: c² overflows float64; the squared network keeps it as a logarithm.
    Oracle: diag(G) of the same network with the factor split in two (1e100 · 1e100, squares that fit)."""
    path, out = _float64_mlp_with_gains(tmp_path / "big.onnx", [1e200]), tmp_path / "o.onnx"
    assert_clean_exit(invoke("rescale", path, "-o", out, "-q"), 0)
    before, after = pathcond_cli.load(path), pathcond_cli.load(out)
    assert compare(before.graph, before.params, after.params).passed
    whole = pathcond_cli.analyse(before).diag.log_g
    split = pathcond_cli.analyse(
        pathcond_cli.load(_float64_mlp_with_gains(tmp_path / "split.onnx", [1e100, 1e100]))
    ).diag.log_g
    for a, b in zip(whole, split):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-9)
    assert max(float(t.max()) for t in whole) > 2 * math.log(1e200)  # the g that the square would have overflowed


# -- 9. names from files never drive the terminal; messages stay short -----------------------------

HOSTILE = "\x1b]0;pwned\x07\x1b[2J[/][bold]"


def _hostile_onnx(path: Path) -> Path:
    """The ONNX MLP with hostile node and weight names (a layer is named after its weight)."""
    model = onnx_mlp_model()
    stored = {tensor.name for tensor in model.graph.initializer}
    for tensor in model.graph.initializer:
        tensor.name = HOSTILE + tensor.name
    for node in model.graph.node:
        node.name = HOSTILE + node.name
        node.input[:] = [HOSTILE + value if value in stored else value for value in node.input]
    onnx.save_model(model, str(path))
    return path


@pytest.mark.parametrize("command", ["inspect", "rescale"])
def test_names_from_files_reach_the_tables_escaped(tmp_path, command):
    model = _hostile_onnx(tmp_path / "n.onnx")
    extra = ["-o", tmp_path / "o.onnx"] if command == "rescale" else []
    result = invoke(command, model, *extra)
    stderr = assert_clean_exit(result, 0)
    assert "\x1b" not in stderr and "\x07" not in stderr
    assert "\\x1b]0;pwned" in stderr  # shown escaped; "[/]" taken as markup would have failed the run
    with_json = invoke(command, model, *extra, "--json")
    layers = [row["layer"] for row in json.loads(with_json.stdout)["diag_g"]["per_layer"]]
    assert layers == [HOSTILE + "fc1", HOSTILE + "fc2", HOSTILE + "fc3"]  # JSON carries the names as they are


@pytest.mark.parametrize("keep", ["", "\n", "\t\n"])
def test_printable_escapes_exactly_what_a_terminal_would_act_on(keep):
    """Printable text is returned as it is without a pass per character; every other text gets
    each character that is neither printable nor kept escaped, and nothing else changed."""
    samples = ["plain name", "ünïcödé 名前", HOSTILE, "a\nb\tc", "\u202eevil", "x" * 10_000 + "\x07", "\udcff"]
    for text in samples:
        want = "".join(
            c if c.isprintable() or c in keep else c.encode("unicode_escape").decode("ascii") for c in describe(text)
        )
        assert printable(text, keep=keep) == want, text[:40]
    assert printable("a\nb", keep="\n") == "a\nb" and printable("a\nb") == "a\\nb"


def test_warnings_with_names_from_files_are_escaped(tmp_path):
    tensors = {**mlp_tensors(), HOSTILE + "extra": torch.zeros(2)}
    checkpoint, spec = write_mlp(tmp_path, tensors=tensors)
    result = invoke("rescale", checkpoint, "--arch", spec, "-o", tmp_path / "o.safetensors", "--allow-unused")
    stderr = assert_clean_exit(result, 0, "warning")
    assert "\x1b" not in stderr and "\\x1b]0;pwned" in stderr


def test_sidecar_spec_linking_out_of_the_model_folder_is_refused(tmp_path):
    model_dir, outside = tmp_path / "model", tmp_path / "outside"
    model_dir.mkdir()
    outside.mkdir()
    checkpoint, _ = write_mlp(model_dir, "net")
    (outside / "secret.yaml").write_text(yaml.safe_dump(mlp_spec()))
    (model_dir / "net.pathcond.yaml").symlink_to(outside / "secret.yaml")
    stderr = _refused(tmp_path, 3, ["inspect", checkpoint], "symbolic link", "net.pathcond.yaml")
    assert "secret" not in stderr
    # A link that stays inside the folder is followed as before.
    (model_dir / "net.pathcond.yaml").unlink()
    (model_dir / "real.yaml").write_text(yaml.safe_dump(mlp_spec()))
    (model_dir / "net.pathcond.yaml").symlink_to("real.yaml")
    assert_clean_exit(invoke("inspect", checkpoint, "-q"), 0)


MEGABYTE = 2**20


def _long_name_cases(d: Path) -> dict[str, tuple[list, int]]:
    long = "n" * MEGABYTE
    checkpoint, spec = write_mlp(d)
    out = ["-o", d / "o.safetensors"]
    layers = mlp_spec()["layers"]
    bad_layer = d / "layer.yaml"
    # libyaml where pyyaml has it: the pure-Python emitter takes a second over a megabyte-long name
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    bad_layer.write_text(yaml.dump({"layers": [*layers, {"name": long, "type": "nonsense"}]}, Dumper=dumper))
    unused, _ = write_mlp(d, "unused", tensors={**mlp_tensors(), long: torch.zeros(1)})
    softmax = onnx_mlp_model()  # a Softmax between two layers (after the last one it would be post-processing)
    (relu,) = [node for node in softmax.graph.node if node.name == "relu1"]
    relu.op_type, relu.name = "Softmax", long
    onnx.save_model(softmax, str(d / "softmax.onnx"))
    bias = onnx_mlp_model()
    bias.graph.initializer[1].CopyFrom(onnx.numpy_helper.from_array(np.zeros(1, np.float32), long))  # a [1] bias
    for node in bias.graph.node:
        node.input[:] = [long if name == "fc1.bias" else name for name in node.input]
    onnx.save_model(bias, str(d / "bias.onnx"))
    return {
        "model-path": (["rescale", d / f"{long}.safetensors"], 3),
        "output-directory": (["rescale", checkpoint, "--arch", spec, "-o", d / long / "o.safetensors"], 6),
        "output-name": (["rescale", checkpoint, "--arch", spec, "-o", d / f"{long}.safetensors"], 6),
        "report-directory": (["rescale", checkpoint, "--arch", spec, *out, "--report", d / long / "r.json"], 6),
        "plot-directory": (["rescale", checkpoint, "--arch", spec, *out, "--plot", d / long / "p.png"], 6),
        "spec-path": (["rescale", checkpoint, "--arch", d / f"{long}.yaml", *out], 3),
        "factory": (["rescale", checkpoint, "--arch", f"{long}:build", "--input-shape", "6", *out], 3),
        "spec-layer-name": (["rescale", checkpoint, "--arch", bad_layer, *out], 3),
        "unused-tensor-key": (["rescale", unused, "--arch", spec, *out], 3),
        "onnx-node-name": (["rescale", d / "softmax.onnx", "-o", d / "o.onnx"], 4),
        "onnx-tensor-name": (["rescale", d / "bias.onnx", "-o", d / "o.onnx"], 3),
        "input-shape": (
            ["rescale", checkpoint, "--arch", spec, "--input-shape", "9," * (MEGABYTE // 2) + "a", *out],
            2,
        ),
    }


@pytest.fixture(scope="module")
def long_name_cases(tmp_path_factory) -> dict[str, tuple[list, int]]:
    """The cases' files, written once (a megabyte name in YAML, safetensors and ONNX takes a while):
    every case is refused without writing, so they share one folder."""
    return _long_name_cases(tmp_path_factory.mktemp("long-names"))


@pytest.mark.parametrize(
    "case",
    [
        "model-path",
        "output-directory",
        "output-name",
        "report-directory",
        "plot-directory",
        "spec-path",
        "factory",
        "spec-layer-name",
        "unused-tensor-key",
        "onnx-node-name",
        "onnx-tensor-name",
        "input-shape",
    ],
)
def test_a_megabyte_name_is_quoted_in_a_few_hundred_characters(long_name_cases, case):
    args, code = long_name_cases[case]
    folder = args[1].parent
    before = snapshot(folder)
    result = invoke(*args)
    assert_clean_exit(result, code)
    assert_unchanged(folder, before)  # what the next case finds is what the first one found
    assert len(result.stderr) < 5000, f"{len(result.stderr)} characters on stderr"
