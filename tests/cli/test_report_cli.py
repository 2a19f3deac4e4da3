"""What people and pipelines see: header and summary line, the
not-converged warning, where the architecture came from, --plot, --version/-h, completion,
lazy imports, and the README's own examples."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml
from cli_support import (
    CLEAN_ENV,
    ROOT,
    SAMPLES,
    assert_clean_exit,
    check_report,
    invoke,
    mlp_spec,
    mlp_tensors,
    parse_single_json,
    write_mlp,
    write_onnx_mlp,
)
from docs_support import all_blocks
from typer.testing import CliRunner

from pathcond_cli import __version__
from pathcond_cli.cli.app import app
from pathcond_cli.runtime import resolve_device

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _last_line(text: str) -> str:
    return text.rstrip("\n").splitlines()[-1]


# -- header, summary line, warnings -------------------------------------------------------------


def test_rescale_report_opens_with_the_command_and_closes_with_the_summary_line(tmp_path):
    checkpoint, spec = write_mlp(tmp_path)
    output = tmp_path / "out.safetensors"
    stderr = assert_clean_exit(invoke("rescale", checkpoint, "--arch", spec, "-o", output), 0)
    assert stderr.lstrip().startswith(f"pathcond rescale · {checkpoint}")
    last = _last_line(stderr)
    assert last.startswith(f"pathcond rescale: {checkpoint} → {output} · verified (max rel error ")
    assert re.search(r" · D [\d.e+]+ → [\d.e+]+ · ‖u‖∞ [\d.e+-]+ · converged · \d+\.\d\d s$", last), last
    for needle in (
        "conditioning before",
        "conditioning after",
        "diag(G) before",
        "diag(G) after",
        "min after",
        "same bins for both",
        "architecture from",
        "--arch",
        "device",
    ):
        assert needle in stderr, needle


def test_json_run_keeps_stdout_clean_and_still_ends_stderr_with_the_summary(tmp_path):
    checkpoint, spec = write_mlp(tmp_path)
    result = invoke("rescale", checkpoint, "--arch", spec, "-o", tmp_path / "out.safetensors", "--json")
    stderr = assert_clean_exit(result, 0)
    report = parse_single_json(result.stdout)
    check_report(report, rescale=True)
    assert report["arch_source"] == f"--arch {spec}" and report["device"] == str(resolve_device("auto"))
    assert stderr.count("\n") == 1 and stderr.startswith("pathcond rescale: ")
    D = report["conditioning"]
    assert f"D {D['before']['D']:.5g} → {D['after']['D']:.5g}" in stderr


def test_inspect_summary_line(tmp_path):
    model = write_onnx_mlp(tmp_path / "net.onnx")
    result = invoke("inspect", model)
    stderr = assert_clean_exit(result, 0, "pathcond inspect ·", "onnx graph", "conditioning")
    assert re.fullmatch(rf"pathcond inspect: {re.escape(str(model))} · D [\d.e+]+ · \d+\.\d\d s", _last_line(stderr))


def test_max_iter_reached_is_a_visible_warning_and_converged_false(tmp_path):
    checkpoint, spec = write_mlp(tmp_path)
    for as_json in (False, True):
        result = invoke(
            "rescale",
            checkpoint,
            "--arch",
            spec,
            "-o",
            tmp_path / f"out{as_json}.safetensors",
            "--max-iter",
            "1",
            *(["--json"] if as_json else []),
        )
        stderr = assert_clean_exit(result, 0, "warning: not converged", "--max-iter 1")
        assert "NOT converged (KKT" in _last_line(stderr)
        if as_json:
            report = parse_single_json(result.stdout)
            check_report(report, rescale=True)
            assert report["solver"]["converged"] is False and report["solver"]["max_iter"] == 1
            assert any(w.startswith("not converged") for w in report["warnings"])


def test_arch_source_names_the_sidecar_and_the_embedded_spec(tmp_path):
    first = invoke("rescale", SAMPLES / "mlp.safetensors", "-o", tmp_path / "out.safetensors", "--json", "-q")
    assert_clean_exit(first, 0)
    assert parse_single_json(first.stdout)["arch_source"] == f"sidecar {SAMPLES / 'mlp.yaml'}"
    second = invoke("inspect", tmp_path / "out.safetensors", "--json")
    assert_clean_exit(second, 0)
    assert parse_single_json(second.stdout)["arch_source"] == "metadata"


# -- --plot -------------------------------------------------------------------------------------


def test_plot_writes_png_and_svg(tmp_path):
    checkpoint, spec = write_mlp(tmp_path)
    png, svg = tmp_path / "run.png", tmp_path / "inspect.svg"
    assert_clean_exit(
        invoke("rescale", checkpoint, "--arch", spec, "-o", tmp_path / "o.safetensors", "--plot", png, "-q"), 0
    )
    assert png.read_bytes().startswith(PNG_MAGIC) and png.stat().st_size > 10_000
    assert_clean_exit(invoke("inspect", checkpoint, "--arch", spec, "--plot", svg, "-q"), 0)
    text = svg.read_text()
    assert "<svg" in text and "fc1" in text  # per-layer tick labels


def test_plot_usage_errors_come_before_any_work(tmp_path, monkeypatch):
    checkpoint, spec = write_mlp(tmp_path)
    result = invoke("rescale", checkpoint, "--arch", spec, "--plot", tmp_path / "plot.jpeg")
    assert_clean_exit(result, 2, "--plot", ".png")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what importlib sees when it is not installed
    result = invoke("rescale", checkpoint, "--arch", spec, "--plot", tmp_path / "plot.png")
    assert_clean_exit(result, 2, "matplotlib", "pip install 'pathcond[plot]'")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([checkpoint.name, spec.name])
    monkeypatch.undo()
    result = invoke("rescale", checkpoint, "--arch", spec, "--plot", tmp_path / "no" / "plot.png")
    assert_clean_exit(result, 6, "directory", "does not exist")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([checkpoint.name, spec.name])


# -- conventions --------------------------------------------------------------------------------


def test_version_and_short_help():
    for args in (["--version"], ["-V"]):
        result = invoke(*args)
        assert_clean_exit(result, 0)
        assert result.stdout == f"pathcond {__version__}\n"
    for args in (["-h"], ["rescale", "-h"], ["inspect", "-h"]):
        result = invoke(*args)
        assert_clean_exit(result, 0)
        assert "Usage:" in result.stdout and "--help" in result.stdout
    assert "--plot" in invoke("rescale", "-h").stdout
    assert "--install-completion" in invoke("-h").stdout


def test_shell_completion_completes_commands_and_options():
    runner = CliRunner()
    commands = runner.invoke(
        app,
        [],
        prog_name="pathcond",
        env={"_PATHCOND_COMPLETE": "complete_bash", "COMP_WORDS": "pathcond res", "COMP_CWORD": "1"},
    )
    assert commands.exit_code == 0 and commands.stdout.split() == ["rescale"]
    options = runner.invoke(
        app,
        [],
        prog_name="pathcond",
        env={"_PATHCOND_COMPLETE": "complete_bash", "COMP_WORDS": "pathcond rescale --pl", "COMP_CWORD": "2"},
    )
    assert options.exit_code == 0 and options.stdout.split() == ["--plot"]


def test_the_cli_module_imports_neither_torch_nor_onnx():
    """--help, --version and completion stay instant because nothing heavy loads until a command runs;
    the package's public names still resolve (lazily)."""
    code = (
        "import sys, pathcond_cli.cli.app, pathcond_cli\n"
        "heavy = sorted(m for m in ('torch', 'onnx', 'numpy', 'safetensors', 'matplotlib') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
        "assert callable(pathcond_cli.rescale_module) and 'torch' in sys.modules\n"
        "assert issubclass(pathcond_cli.PathcondError, Exception)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**CLEAN_ENV, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    version = subprocess.run(
        [sys.executable, "-m", "pathcond_cli", "--version"],
        cwd=ROOT,
        env={**CLEAN_ENV, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert version.returncode == 0 and version.stdout == f"pathcond {__version__}\n"


def test_the_documented_minimal_spec_runs(tmp_path):
    minimal = [yaml.safe_load(block.text) for block in all_blocks() if block.language == "yaml"]
    spec = next(spec for spec in minimal if len(spec["layers"][0]["shape"]) == 1)
    dims = (spec["layers"][0]["shape"][0], 7, 4)
    tensors = mlp_tensors(dims)
    checkpoint, spec_path = write_mlp(tmp_path, tensors=tensors, spec=spec)
    assert mlp_spec(dims)["layers"][1]["name"] == "fc1"  # the documented tensor names are the tests' names
    assert_clean_exit(invoke("rescale", checkpoint, "--arch", spec_path, "-o", tmp_path / "o.safetensors", "-q"), 0)


@pytest.mark.parametrize("extra, package", [("plot", "matplotlib"), ("export", "onnxscript")])
def test_optional_extras_are_declared(extra, package):
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(requirement.startswith(package) for requirement in extras[extra])
    assert f"pathcond[{extra}]" in (ROOT / "README.md").read_text()
