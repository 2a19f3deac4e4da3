"""The command-line contract of the README, driven through the real CLI.

In-process runs use typer's ``CliRunner`` (stdout and stderr kept apart); a few runs go
through a real process (``python -m pathcond_cli.cli.app`` or the ``pathcond`` console script)
to check what only a process shows: piping through stdin/stdout, exit statuses, and that a
non-terminal stderr carries no progress or colour codes.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import shutil
import subprocess

import onnx
import pytest
import safetensors
import torch
from cli_support import (
    CLEAN_ENV,
    SAMPLES,
    assert_clean_exit,
    assert_unchanged,
    check_report,
    invoke,
    leftovers,
    module_command,
    onnx_mlp_model,
    parse_single_json,
    snapshot,
    write_mlp,
    write_onnx_mlp,
)

import pathcond_cli
from pathcond_cli.verify import compare

MLP = SAMPLES / "mlp.safetensors"
MLP_SPEC = SAMPLES / "mlp.yaml"
RESNET = SAMPLES / "resnet_small.onnx"
SOLVER_NAMES = ("lbfgs", "newton", "block", "sequential")
ANSI_OR_CR = re.compile(r"\x1b|\r")


def _tensor_layout(path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    with safetensors.safe_open(str(path), framework="pt") as handle:
        return {
            key: (handle.get_slice(key).get_dtype(), tuple(handle.get_slice(key).get_shape())) for key in handle.keys()
        }


def _metadata(path) -> dict[str, str]:
    with safetensors.safe_open(str(path), framework="pt") as handle:
        return handle.metadata() or {}


def _assert_same_function(original_path, written_path, **load_options) -> None:
    original = pathcond_cli.load(original_path, **load_options)
    written = pathcond_cli.load(written_path)  # no --arch: the spec is embedded, or the graph is ONNX
    verification = compare(original.graph, original.params, written.params)
    assert verification.passed, verification
    changed = [k for k in original.params if not torch.equal(original.params[k], written.params[k])]
    assert changed, "the rescaling changed nothing: the test would not notice a no-op"


# -- the MLP sample, once per solver ---------------------------------------------------------


@pytest.fixture(scope="module")
def sample_run(tmp_path_factory):
    """``rescale mlp.safetensors --solver lbfgs --json --report``."""
    directory = tmp_path_factory.mktemp("sample")
    output = directory / "mlp.pathcond.safetensors"
    result = invoke(
        "rescale",
        MLP,
        "--arch",
        MLP_SPEC,
        "-o",
        output,
        "--solver",
        "lbfgs",
        "--json",
        "--report",
        directory / "report.json",
    )
    return directory, result, output


@pytest.fixture(scope="module")
def solver_runs(tmp_path_factory):
    """``rescale --json`` of one small MLP with each solver. The solvers' numerics are covered by
    test_solvers.py; this checks the command line carries each of them through, so a model on
    which the sequential solver takes a fraction of a second is enough."""
    directory = tmp_path_factory.mktemp("solvers")
    checkpoint, spec = write_mlp(directory, dims=(12, 16, 10, 4))
    runs = {}
    for name in SOLVER_NAMES:
        output = directory / f"mlp.{name}.safetensors"
        # lbfgs with the defaults; the slower solvers stop at a 1e-5 KKT residual, which already
        # pins F* to ~1e-10 relative (F - F* is quadratic in the residual).
        extra = [] if name == "lbfgs" else ["--tol", "1e-5"]
        runs[name] = (
            invoke("rescale", checkpoint, "--arch", spec, "-o", output, "--solver", name, "--json", *extra),
            output,
        )
    return runs


def test_rescale_json_is_one_document_with_every_documented_key(sample_run):
    _, result, output = sample_run
    assert_clean_exit(result, 0)
    report = parse_single_json(result.stdout)
    check_report(report, rescale=True)
    # The numbers of the MLP 784 → 256 → 128 → 10: Table 1 style parameter count and hidden units.
    assert report["parameters"] == 784 * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10
    assert report["dag_parameters"] == report["parameters"]
    assert report["hidden_units"] == 256 + 128
    assert report["groups"]["free"] == 256 + 128
    assert report["paths"]["exact"] == 784 * 256 * 128 * 10 + 256 * 128 * 10 + 128 * 10 + 10
    assert report["format"] == "safetensors"
    assert report["model"] == str(MLP)
    assert report["output"] == str(output)
    assert report["solver"]["name"] == "lbfgs"
    assert report["solver"]["objective_final"] < report["solver"]["objective"][0]
    assert report["warnings"] == []
    assert report["degenerate_groups"] == []


def test_report_file_holds_the_same_json(sample_run):
    directory, result, _ = sample_run
    assert json.loads((directory / "report.json").read_text()) == json.loads(result.stdout)


@pytest.mark.parametrize("name", SOLVER_NAMES)
def test_each_solver_converges_to_the_same_objective(solver_runs, name):
    result, output = solver_runs[name]
    assert_clean_exit(result, 0)
    report = parse_single_json(result.stdout)
    check_report(report, rescale=True)
    assert report["solver"]["name"] == name
    assert report["solver"]["converged"] is True
    assert report["solver"]["objective_final"] < report["solver"]["objective"][0]
    reference = json.loads(solver_runs["lbfgs"][0].stdout)["solver"]["objective_final"]
    assert math.isclose(report["solver"]["objective_final"], reference, rel_tol=1e-9, abs_tol=0.0)
    assert _metadata(output)["pathcond.solver"] == name


def test_inspect_json_is_one_document_and_writes_nothing(tmp_path):
    checkpoint, spec = write_mlp(tmp_path)
    before = snapshot(tmp_path)
    result = invoke("inspect", checkpoint, "--arch", spec, "--json")
    assert_clean_exit(result, 0)
    report = parse_single_json(result.stdout)
    check_report(report, rescale=False)
    assert "solver" not in report and "output" not in report and "verification" not in report
    assert report["parameters"] == 6 * 8 + 8 + 8 * 5 + 5 + 5 * 3 + 3
    assert report["hidden_units"] == 8 + 5
    assert_unchanged(tmp_path, before)


def test_inspect_onnx_sample_json():
    result = invoke("inspect", RESNET, "--json")
    assert_clean_exit(result, 0)
    report = parse_single_json(result.stdout)
    check_report(report, rescale=False)
    assert report["format"] == "onnx"


def test_human_report_goes_to_stderr_only(tmp_path):
    checkpoint, spec = write_mlp(tmp_path)
    result = invoke("rescale", checkpoint, "--arch", spec, "-o", tmp_path / "out.safetensors")
    stderr = assert_clean_exit(result, 0, "verification", "passed", "objective")
    assert result.stdout == ""
    assert not ANSI_OR_CR.search(stderr)
    result = invoke("inspect", checkpoint, "--arch", spec)
    assert_clean_exit(result, 0, "diag(G)", "histogram")
    assert result.stdout == ""


# -- real processes: pipes, exit statuses, non-terminal stderr -------------------------------


def test_pipe_safetensors_through_stdin_and_stdout(tmp_path):
    """``cat mlp.safetensors | pathcond rescale - --arch mlp.yaml -o - > out.safetensors``."""
    pathcond = shutil.which("pathcond")
    if pathcond is None:
        pytest.skip("the pathcond console script is not on PATH")
    out = tmp_path / "out.safetensors"
    command = (
        f"cat {shlex.quote(str(MLP))} | {shlex.quote(pathcond)} rescale - --arch {shlex.quote(str(MLP_SPEC))} "
        f"-o - --max-iter 5 --quiet > {shlex.quote(str(out))}"
    )
    done = subprocess.run(command, shell=True, cwd=tmp_path, env=CLEAN_ENV, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stderr == b"", "--quiet prints nothing on stderr on success"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.safetensors"]
    assert _tensor_layout(out) == _tensor_layout(MLP)
    metadata = _metadata(out)
    assert "pathcond.spec" in metadata and metadata["pathcond.solver"] == "newton"
    _assert_same_function(MLP, out, arch=str(MLP_SPEC))


def test_onnx_from_stdin_and_no_terminal_noise(tmp_path):
    """A real process with pipes reads the sample ONNX model from stdin; its stderr carries
    the tables but no spinner, colour codes or carriage returns."""
    out, report_file = tmp_path / "out.onnx", tmp_path / "report.json"
    done = subprocess.run(
        module_command("rescale", "-", "-o", out, "--report", report_file, "--max-iter", "3"),
        input=RESNET.read_bytes(),
        cwd=tmp_path,
        env=CLEAN_ENV,
        capture_output=True,
        timeout=300,
    )
    stderr = done.stderr.decode()
    assert done.returncode == 0, stderr
    assert done.stdout == b"", "without --json (and -o -) nothing goes to stdout"
    report = json.loads(report_file.read_text())
    check_report(report, rescale=True)
    assert report["model"] == "<stdin>" and report["format"] == "onnx" and report["output"] == str(out)
    assert "Traceback" not in stderr
    assert not ANSI_OR_CR.search(stderr), repr(stderr[:500])
    assert "verification" in stderr  # the tables for people are still there
    written, original = onnx.load(str(out)), onnx.load(str(RESNET))
    assert written.producer_name == original.producer_name
    assert {p.key for p in written.metadata_props} >= {
        "pathcond.version",
        "pathcond.solver",
        "pathcond.objective_final",
    }
    _assert_same_function(RESNET, out)


def test_usage_error_exit_status_of_a_real_process(tmp_path):
    checkpoint, spec = write_mlp(tmp_path)
    before = snapshot(tmp_path)
    done = subprocess.run(
        module_command("rescale", checkpoint, "--arch", spec, "--no-such-option"),
        env=CLEAN_ENV,
        capture_output=True,
        timeout=300,
    )
    assert done.returncode == 2
    assert b"no-such-option" in done.stderr and b"Traceback" not in done.stderr
    assert done.stdout == b""
    assert_unchanged(tmp_path, before)


# -- usage errors, help -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--no-such-option"], "no-such-option"),
        (["--input-shape", "3,a,32"], "--input-shape"),
        (["--input-shape", "0,4"], "--input-shape"),
        (["--input-shape", ","], "--input-shape"),
        (["--input-shape", "3,,32"], "--input-shape"),
        (["-o", "-", "--json"], "--report"),
        (["--solver", "adam"], "--solver"),
        (["--max-iter", "-1"], "--max-iter"),
        (["--tol", "nan"], "--tol"),
        (["--device", "tpu"], "--device"),
        (["-o", "{out}", "--report", "{out}"], "--report"),
    ],
    ids=[
        "unknown-option",
        "shape-not-ints",
        "shape-zero",
        "shape-empty",
        "shape-empty-size",
        "stdout-with-json",
        "bad-solver",
        "negative-max-iter",
        "nan-tol",
        "bad-device",
        "report-overwrites-output",
    ],
)
def test_usage_errors_exit_2(tmp_path, args, needle):
    checkpoint, spec = write_mlp(tmp_path)
    out = str(tmp_path / "out.safetensors")
    before = snapshot(tmp_path)
    result = invoke("rescale", checkpoint, "--arch", spec, *[a.replace("{out}", out) for a in args])
    assert_clean_exit(result, 2, needle)
    assert_unchanged(tmp_path, before)


def test_stdin_without_output_is_a_usage_error(tmp_path):
    checkpoint, spec = write_mlp(tmp_path)
    before = snapshot(tmp_path)
    result = invoke("rescale", "-", "--arch", spec, input=checkpoint.read_bytes())
    assert_clean_exit(result, 2, "stdin", "-o")
    assert_unchanged(tmp_path, before)


def test_inspect_usage_errors_exit_2(tmp_path):
    checkpoint, spec = write_mlp(tmp_path)
    assert_clean_exit(invoke("inspect", checkpoint, "--arch", spec, "--input-shape", "a"), 2, "--input-shape")
    assert_clean_exit(invoke("inspect", checkpoint, "--arch", spec, "-o", "x"), 2)
    assert_clean_exit(invoke("inspect"), 2, "MODEL")


@pytest.mark.parametrize("args", [["--help"], ["rescale", "--help"], ["inspect", "--help"]])
def test_help_lists_the_exit_codes(args):
    result = invoke(*args)
    assert_clean_exit(result, 0)
    text = " ".join(result.stdout.split())
    assert "Exit codes" in text
    for code in (
        "0 success",
        "2 usage",
        "3 unreadable",
        "4 unsupported",
        "5 verification",
        "6 output",
        "7 NaN",
        "130 interrupted",
    ):
        assert code in text, code


def test_version():
    result = invoke("version")
    assert_clean_exit(result, 0)
    assert result.stdout.strip() == pathcond_cli.__version__


# -- outputs ------------------------------------------------------------------------------------


def test_default_output_name_beside_the_input(tmp_path):
    checkpoint, spec = write_mlp(tmp_path)
    model = write_onnx_mlp(tmp_path / "net.onnx")
    result = invoke("rescale", checkpoint, "--arch", spec, "--json")
    assert_clean_exit(result, 0)
    assert parse_single_json(result.stdout)["output"] == str(tmp_path / "tiny.pathcond.safetensors")
    result = invoke("rescale", model, "--json")
    assert_clean_exit(result, 0)
    assert parse_single_json(result.stdout)["output"] == str(tmp_path / "net.pathcond.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "net.onnx",
        "net.pathcond.onnx",
        "tiny.arch.yaml",
        "tiny.pathcond.safetensors",
        "tiny.safetensors",
    ]
    _assert_same_function(checkpoint, tmp_path / "tiny.pathcond.safetensors", arch=str(spec))
    _assert_same_function(model, tmp_path / "net.pathcond.onnx")


def test_quiet_prints_nothing_on_stderr(tmp_path):
    checkpoint, spec = write_mlp(tmp_path)
    model = write_onnx_mlp(tmp_path / "net.onnx")
    for args in (
        ["rescale", checkpoint, "--arch", spec, "-o", tmp_path / "a.safetensors", "--quiet"],
        ["rescale", model, "-o", tmp_path / "a.onnx", "-q"],
        ["inspect", model, "--quiet"],
    ):
        result = invoke(*args)
        assert_clean_exit(result, 0)
        assert result.stderr == "" and result.stdout == ""


def test_stdout_output_is_the_checkpoint_and_nothing_else(tmp_path):
    checkpoint, spec = write_mlp(tmp_path)
    result = invoke(
        "rescale", "-", "--arch", spec, "-o", "-", "--report", tmp_path / "r.json", input=checkpoint.read_bytes()
    )
    assert_clean_exit(result, 0)
    out = tmp_path / "out.safetensors"
    out.write_bytes(result.stdout_bytes)
    assert _tensor_layout(out) == _tensor_layout(checkpoint)
    _assert_same_function(checkpoint, out, arch=str(spec))
    report = json.loads((tmp_path / "r.json").read_text())
    check_report(report, rescale=True)
    assert report["output"] == "-" and report["model"] == "<stdin>"
    assert leftovers(tmp_path) == []


def test_onnx_output_keeps_metadata_and_adds_pathcond_keys(tmp_path):
    model = write_onnx_mlp(tmp_path / "net.onnx", metadata={"author": "someone", "pathcond.solver": "stale"})
    out = tmp_path / "out.onnx"
    result = invoke("rescale", model, "-o", out, "--solver", "block", "--json")
    assert_clean_exit(result, 0)
    report = parse_single_json(result.stdout)
    original, written = onnx.load(str(model)), onnx.load(str(out))
    metadata = {p.key: p.value for p in written.metadata_props}
    assert metadata["author"] == "someone"
    assert metadata["pathcond.solver"] == "block"  # an earlier run's value is replaced, not duplicated
    assert [p.key for p in written.metadata_props].count("pathcond.solver") == 1
    assert metadata["pathcond.version"] == pathcond_cli.__version__
    assert float(metadata["pathcond.objective_final"]) == report["solver"]["objective_final"]
    assert float(metadata["pathcond.objective_initial"]) == report["solver"]["objective"][0]
    for field in ("producer_name", "producer_version", "doc_string", "ir_version"):
        assert getattr(written, field) == getattr(original, field), field
    assert list(written.opset_import) == list(original.opset_import)
    assert [n.op_type for n in written.graph.node] == [n.op_type for n in original.graph.node]
    onnx.checker.check_model(written)
    _assert_same_function(model, out)


def test_safetensors_output_embeds_its_spec_and_keeps_metadata(tmp_path):
    checkpoint, spec = write_mlp(tmp_path, metadata={"origin": "unit test", "format": "pt"})
    # tiny.arch.yaml is not a sidecar name: without --arch the input has no architecture.
    assert_clean_exit(invoke("inspect", checkpoint), 3, "no architecture", "--arch")
    out = tmp_path / "out.safetensors"
    assert_clean_exit(invoke("rescale", checkpoint, "--arch", spec, "-o", out, "-q"), 0)
    metadata = _metadata(out)
    assert metadata["origin"] == "unit test" and metadata["format"] == "pt"
    assert json.loads(metadata["pathcond.spec"])  # compact JSON
    assert _tensor_layout(out) == _tensor_layout(checkpoint)
    spec.unlink()  # nothing but the embedded spec can describe the output now
    result = invoke("inspect", out, "--json")
    assert_clean_exit(result, 0)
    assert parse_single_json(result.stdout)["parameters"] == 6 * 8 + 8 + 8 * 5 + 5 + 5 * 3 + 3
    again = tmp_path / "again.safetensors"
    assert_clean_exit(invoke("rescale", out, "-o", again, "-q"), 0)
    assert "pathcond.spec" in _metadata(again)
    assert leftovers(tmp_path) == []


# -- devices ------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
@pytest.mark.parametrize("command", ["rescale", "inspect"])
def test_device_cuda_without_cuda_is_a_clear_usage_error(tmp_path, command):
    checkpoint, spec = write_mlp(tmp_path)
    before = snapshot(tmp_path)
    result = invoke(command, checkpoint, "--arch", spec, "--device", "cuda")
    assert_clean_exit(result, 2, "--device", "no CUDA device")
    assert_unchanged(tmp_path, before)


def test_device_cpu(tmp_path):
    checkpoint, spec = write_mlp(tmp_path)
    result = invoke(
        "rescale", checkpoint, "--arch", spec, "-o", tmp_path / "out.safetensors", "--device", "cpu", "--json"
    )
    assert_clean_exit(result, 0)
    check_report(parse_single_json(result.stdout), rescale=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_cuda(tmp_path):
    checkpoint, spec = write_mlp(tmp_path)
    cpu, cuda = tmp_path / "cpu.safetensors", tmp_path / "cuda.safetensors"
    results = {}
    for device, out in (("cpu", cpu), ("cuda", cuda)):
        result = invoke("rescale", checkpoint, "--arch", spec, "-o", out, "--device", device, "--json")
        assert_clean_exit(result, 0)
        results[device] = parse_single_json(result.stdout)
        check_report(results[device], rescale=True)
    assert math.isclose(
        results["cuda"]["solver"]["objective_final"], results["cpu"]["solver"]["objective_final"], rel_tol=1e-9
    )
    _assert_same_function(checkpoint, cuda, arch=str(spec))
    result = invoke("inspect", RESNET, "--device", "cuda:0", "--json")
    assert_clean_exit(result, 0)
    assert_clean_exit(invoke("inspect", RESNET, "--device", f"cuda:{torch.cuda.device_count()}"), 2, "--device")


def test_onnx_model_builder_is_valid():
    """The tiny ONNX model the CLI tests use is a valid model pathcond reads."""
    model = onnx_mlp_model()
    loaded = pathcond_cli.load(model.SerializeToString())
    assert loaded.format == "onnx" and loaded.hidden_units == 8 + 5
