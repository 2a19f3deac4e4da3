"""Helpers shared by the command-line tests (test_cli, test_faults, test_fuzz).

Tiny models are built on the fly (a few dozen parameters, so a full rescale takes well under
a second in-process); the sample models live in ``sample_models/``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import fake_cuda
import numpy as np
import onnx
import safetensors.torch
import torch
import yaml
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

from pathcond_cli.cli.app import app

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "sample_models"
TMP_MARK = ".pathcond-tmp"
DOCUMENTED_ERRORS = {3, 4, 5, 6, 7, 8}

# Environment for subprocesses: no forced colours or terminal, whatever the caller's shell says.
CLEAN_ENV = {
    k: v
    for k, v in os.environ.items()
    if k not in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "CLICOLOR_FORCE", "PATHCOND_DEBUG")
}


def invoke(*args: object, input: bytes | None = None):
    """Run the CLI in-process; ``result.stdout``/``result.stderr`` are kept apart."""
    return CliRunner().invoke(app, [str(a) for a in args], input=input)


def module_command(*args: object) -> list[str]:
    """``python -m pathcond_cli ARGS``, on the fake CUDA device when the suite runs on it."""
    if fake_cuda.requested():
        return [sys.executable, str(Path(__file__).with_name("fake_cuda_main.py")), *map(str, args)]
    return [sys.executable, "-m", "pathcond_cli", *map(str, args)]


def assert_clean_exit(result, code: int, *needles: str) -> str:
    """Exit ``code`` through the CLI's own handling (no escaped exception, no traceback);
    returns stderr. Each of ``needles`` must appear in it (case-insensitive, whitespace runs as one
    space: where rich wraps a table cell depends on the terminal's width)."""
    escaped = result.exception if not isinstance(result.exception, SystemExit) else None
    assert escaped is None, f"exception escaped the CLI: {escaped!r}\nstderr: {result.stderr}"
    assert result.exit_code == code, (
        f"exit {result.exit_code}, expected {code}\nstderr: {result.stderr}\nstdout: {result.stdout[:2000]}"
    )
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout
    if code != 0:
        assert result.stderr.strip(), "a failure must say why on stderr"
        check_error_output(result)
    lowered = " ".join(result.stderr.lower().split())
    for needle in needles:
        assert " ".join(needle.lower().split()) in lowered, f"{needle!r} not in stderr:\n{result.stderr}"
    return result.stderr


def snapshot(directory: Path) -> dict[str, str]:
    """Relative path → sha256 of every file (hidden ones included) and every directory."""
    found = {}
    for root, dirs, files in os.walk(directory):
        for name in dirs:
            found[os.path.relpath(os.path.join(root, name), directory) + "/"] = "dir"
        for name in files:
            path = os.path.join(root, name)
            found[os.path.relpath(path, directory)] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return found


def leftovers(directory: Path) -> list[str]:
    """Temporary files or directories pathcond might have left anywhere under ``directory``."""
    return sorted(name for name in snapshot(directory) if TMP_MARK in name)


def assert_unchanged(directory: Path, before: Mapping[str, str]) -> None:
    """No file added, removed or modified under ``directory`` since ``before``."""
    after = snapshot(directory)
    assert after == dict(before), (
        f"added: {sorted(set(after) - set(before))}, removed: {sorted(set(before) - set(after))}, "
        f"changed: {sorted(k for k in set(after) & set(before) if after[k] != before[k])}"
    )


# -- tiny models -------------------------------------------------------------------------------


class CountingReads(dict):
    """The checkpoint's tensors, counting how often each is read."""

    def __init__(self, tensors):
        super().__init__(tensors)
        self.reads: dict[str, int] = {}

    def __getitem__(self, key):
        self.reads[key] = self.reads.get(key, 0) + 1
        return super().__getitem__(key)


def mlp_tensors(dims: Sequence[int] = (6, 8, 5, 3), *, seed: int = 0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for i, (fan_in, fan_out) in enumerate(zip(dims[:-1], dims[1:]), start=1):
        tensors[f"fc{i}.weight"] = torch.randn(fan_out, fan_in, generator=generator, dtype=torch.float64).to(dtype)
        tensors[f"fc{i}.bias"] = (0.1 * torch.randn(fan_out, generator=generator, dtype=torch.float64)).to(dtype)
    return tensors


def mlp_spec(dims: Sequence[int] = (6, 8, 5, 3)) -> dict:
    layers: list[dict] = [{"name": "x", "type": "input", "shape": [dims[0]]}]
    for i in range(1, len(dims)):
        if i > 1:
            layers.append({"name": f"relu{i - 1}", "type": "relu"})
        layers.append({"name": f"fc{i}", "type": "linear"})
    return {"layers": layers}


def write_mlp(
    directory: Path,
    name: str = "tiny",
    *,
    dims: Sequence[int] = (6, 8, 5, 3),
    tensors: Mapping[str, torch.Tensor] | None = None,
    spec: dict | None = None,
    metadata: Mapping[str, str] | None = None,
) -> tuple[Path, Path]:
    """``<name>.safetensors`` and its spec ``<name>.arch.yaml`` (not a sidecar name: pass --arch)."""
    checkpoint = directory / f"{name}.safetensors"
    spec_path = directory / f"{name}.arch.yaml"
    safetensors.torch.save_file(
        dict(tensors if tensors is not None else mlp_tensors(dims)),
        str(checkpoint),
        metadata=dict(metadata) if metadata else None,
    )
    spec_path.write_text(yaml.safe_dump(spec if spec is not None else mlp_spec(dims)))
    return checkpoint, spec_path


def write_sharded_mlp(directory: Path) -> tuple[Path, Path]:
    """The MLP as a two-shard checkpoint (``model.safetensors.index.json``) and its spec ``model.arch.yaml``."""
    tensors = mlp_tensors()
    layout = {
        "model-00001-of-00002.safetensors": ["fc1.weight", "fc1.bias", "fc2.weight"],
        "model-00002-of-00002.safetensors": ["fc2.bias", "fc3.weight", "fc3.bias"],
    }
    for file, keys in layout.items():
        safetensors.torch.save_file({k: tensors[k] for k in keys}, str(directory / file), metadata={"format": "pt"})
    index = directory / "model.safetensors.index.json"
    index.write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": {k: f for f, keys in layout.items() for k in keys}})
    )
    spec = directory / "model.arch.yaml"
    spec.write_text(yaml.safe_dump(mlp_spec()))
    return index, spec


def onnx_mlp_model(
    dims: Sequence[int] = (6, 8, 5, 3),
    *,
    seed: int = 0,
    metadata: Mapping[str, str] | None = None,
    transform: Callable[[str, np.ndarray], np.ndarray] | None = None,
) -> onnx.ModelProto:
    """A Gemm/Relu MLP with a symbolic batch, producer, doc string and metadata."""
    rng = np.random.default_rng(seed)
    initializers, nodes = [], []
    value = "x"
    for i, (fan_in, fan_out) in enumerate(zip(dims[:-1], dims[1:]), start=1):
        weight = rng.standard_normal((fan_out, fan_in)).astype(np.float32)
        bias = (0.1 * rng.standard_normal(fan_out)).astype(np.float32)
        if transform is not None:
            weight, bias = transform(f"fc{i}.weight", weight), transform(f"fc{i}.bias", bias)
        initializers += [numpy_helper.from_array(weight, f"fc{i}.weight"), numpy_helper.from_array(bias, f"fc{i}.bias")]
        out = "y" if i == len(dims) - 1 else f"h{i}"
        nodes.append(helper.make_node("Gemm", [value, f"fc{i}.weight", f"fc{i}.bias"], [out], name=f"fc{i}", transB=1))
        value = out
        if i < len(dims) - 1:
            nodes.append(helper.make_node("Relu", [value], [f"r{i}"], name=f"relu{i}"))
            value = f"r{i}"
    graph = helper.make_graph(
        nodes,
        "tiny_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", dims[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", dims[-1]])],
        initializers,
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17)],
        producer_name="pathcond-cli-tests",
        producer_version="1.0",
        doc_string="a tiny ReLU MLP for the CLI tests",
    )
    model.ir_version = 8
    for key, text in (metadata if metadata is not None else {"author": "cli tests", "license": "MIT"}).items():
        model.metadata_props.add(key=key, value=text)
    onnx.checker.check_model(model)
    return model


def write_onnx_mlp(path: Path, **options) -> Path:
    onnx.save_model(onnx_mlp_model(**options), str(path))
    return path


# -- reports -----------------------------------------------------------------------------------


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_report(report: dict, *, rescale: bool) -> None:
    """Every key the README documents, with its type (and a few invariants)."""
    assert report["schema"] == 2
    assert isinstance(report["pathcond_version"], str)
    assert report["command"] == ("rescale" if rescale else "inspect")
    assert isinstance(report["model"], str)
    assert report["format"] in ("onnx", "safetensors")
    assert re.fullmatch(r"onnx graph|metadata|module|(--arch|sidecar) .+", report["arch_source"]), report["arch_source"]
    assert isinstance(report["device"], str) and report["device"]
    _check_conditioning(report["conditioning"]["before"], report["dag_parameters"])
    for key in ("parameters", "dag_parameters", "hidden_units"):
        assert _is_int(report[key]) and report[key] >= 0, key
    groups = report["groups"]
    for key in ("free", "fixed", "degenerate", "colours"):
        assert _is_int(groups[key]) and groups[key] >= 0, key
    paths = report["paths"]
    assert isinstance(paths["log10"], float)
    assert paths["exact"] is None or _is_int(paths["exact"])
    if paths["exact"] is not None:
        assert paths["exact"] < 2**53
        assert abs(np.log10(paths["exact"]) - paths["log10"]) < 1e-6
    _check_diag(report["diag_g"], report["dag_parameters"])
    check_path_norms(report["path_norms"])
    histogram_total = sum(b["count"] for b in report["diag_g"]["histogram"])
    assert histogram_total == report["conditioning"]["before"]["parameters_counted"], "every g > 0 is in one bin"
    assert isinstance(report["warnings"], list) and all(isinstance(w, str) for w in report["warnings"])
    seconds = report["seconds"]
    assert all(_is_number(v) and v >= 0 for v in seconds.values())
    assert "total" in seconds and "load" in seconds
    if not rescale:
        assert "diag_g_after" not in report and set(report["conditioning"]) == {"before"}
        return
    check_path_norms(report["path_norms_after"])
    assert list(report["path_norms_after"]) == list(report["path_norms"])
    for key, before in report["path_norms"].items():
        after = report["path_norms_after"][key]["log10"]
        assert after == before["log10"] or math.isclose(after, before["log10"], rel_tol=1e-6, abs_tol=1e-6), (
            "rescaling leaves every path norm unchanged"
        )
    conditioning = report["conditioning"]
    _check_conditioning(conditioning["after"], report["dag_parameters"])
    assert conditioning["after"]["zeros"] == conditioning["before"]["zeros"], "rescaling never changes which g are 0"
    assert _is_number(conditioning["decrease"])
    assert math.isclose(
        conditioning["decrease"], conditioning["before"]["D"] - conditioning["after"]["D"], rel_tol=1e-12, abs_tol=1e-9
    )
    closed = conditioning["fraction_of_gap_closed"]
    assert closed is None or (_is_number(closed) and closed <= 1 + 1e-12)
    after = report["diag_g_after"]
    _check_diag(after, report["dag_parameters"])
    assert [row["layer"] for row in after["per_layer"]] == [row["layer"] for row in report["diag_g"]["per_layer"]]
    assert [(b["log10_low"], b["log10_high"]) for b in after["histogram"]] == [
        (b["log10_low"], b["log10_high"]) for b in report["diag_g"]["histogram"]
    ], "before and after share the bins"
    assert sum(b["count"] for b in after["histogram"]) == sum(b["count"] for b in report["diag_g"]["histogram"])
    _check_rescale(report, seconds)


def check_path_norms(norms: dict) -> None:
    """``path_norms``: l1 and l2 first, each {q, log10, value} with value = 10^log10 where it fits."""
    assert list(norms)[:2] == ["l1", "l2"]
    for key, norm in norms.items():
        assert key == f"l{norm['q']:g}" and norm["q"] >= 1
        # Φ = 0 (a network computing 0): log10 is −inf, null in JSON, and the value 0.
        assert isinstance(norm["log10"], float) or (norm["log10"] is None and norm["value"] == 0.0)
        if norm["value"] is not None and norm["log10"] is not None:
            assert math.isclose(norm["value"], 10 ** norm["log10"], rel_tol=1e-9)


def _check_conditioning(measure: dict, p: int) -> None:
    assert isinstance(measure["D"], float) and measure["D"] >= 0
    assert isinstance(measure["D_per_parameter"], float) and measure["D_per_parameter"] >= 0
    # D's p is the support g > 0 (SPEC §4), the parameters it counts
    assert math.isclose(
        measure["D"], measure["parameters_counted"] * measure["D_per_parameter"], rel_tol=1e-12, abs_tol=1e-12
    )
    assert _is_int(measure["parameters_counted"]) and _is_int(measure["zeros"])
    assert measure["parameters_counted"] + measure["zeros"] == p


def _check_diag(diag: dict, p: int) -> None:
    for key in ("min", "max", "log10_min", "log10_max", "log10_spread"):
        assert diag[key] is None or isinstance(diag[key], float), key
    assert _is_int(diag["zeros"])
    assert isinstance(diag["per_layer"], list) and diag["per_layer"]
    for layer in diag["per_layer"]:
        assert isinstance(layer["layer"], str)
        assert _is_int(layer["parameters"]) and _is_int(layer["zeros"])
        for key in ("log10_min", "log10_max"):
            assert layer[key] is None or isinstance(layer[key], float)
    assert sum(layer["parameters"] for layer in diag["per_layer"]) == p
    assert isinstance(diag["histogram"], list)
    for bin_ in diag["histogram"]:
        assert _is_number(bin_["log10_low"]) and _is_number(bin_["log10_high"]) and _is_int(bin_["count"])


def _check_rescale(report: dict, seconds: dict) -> None:
    solver = report["solver"]
    assert isinstance(solver["name"], str)
    assert _is_int(solver["iterations"]) and _is_number(solver["passes"])
    objective = solver["objective"]
    assert isinstance(objective, list) and objective and all(isinstance(v, float) for v in objective)
    assert objective[0] == solver["objective_initial"]
    assert objective[-1] == solver["objective_final"]
    assert objective[0] >= solver["objective_final"]
    assert isinstance(solver["objective_final"], float)
    assert _is_number(solver["decrease"]) and solver["decrease"] >= 0
    assert isinstance(solver["kkt_residual"], float)
    assert isinstance(solver["converged"], bool)
    assert _is_int(solver["max_iter"]) and isinstance(solver["tolerance"], float)
    assert solver["converged"] == (solver["kkt_residual"] <= solver["tolerance"])
    assert isinstance(report["u_inf"], float) and report["u_inf"] >= 0
    rule, bound = solver["max_log_scale_rule"], solver["max_log_scale"]
    assert rule in ("auto", "user", "none")
    assert bound is None or (_is_number(bound) and report["u_inf"] <= bound), "u within the bound used"
    assert _is_int(solver["groups_at_bound"]) and (bound is not None or solver["groups_at_bound"] == 0)
    unbounded, share = solver["unbounded_u_inf"], solver["share_of_decrease_kept"]
    assert (unbounded is None) == (rule == "user") and (unbounded is None or unbounded >= 0)
    assert (share is not None) == (rule == "auto")
    if rule == "auto" and bound is None:
        assert share == 1.0 and unbounded == report["u_inf"]
    if share is not None:
        assert 0 <= share <= 1 + 1e-9
    assert isinstance(report["degenerate_groups"], list) and all(
        isinstance(g, str) for g in report["degenerate_groups"]
    )
    verification = report["verification"]
    for key in ("max_abs_error", "max_rel_error", "tolerance"):
        assert isinstance(verification[key], float), key
    assert verification["passed"] is True
    assert verification["max_rel_error"] <= verification["tolerance"]
    assert "eval" in verification["modes"]
    assert set(verification["by_mode"]) == set(verification["modes"])
    for mode in verification["by_mode"].values():
        assert mode["max_rel_error"] <= mode["tolerance"] <= verification["tolerance"]
    assert isinstance(report["output"], str)
    for stage in (
        "load",
        "groups",
        "diag_g",
        "path_count",
        "path_norms",
        "solve",
        "apply",
        "write",
        "verify_written",
        "total",
    ):
        assert stage in seconds, stage


def check_error_output(result) -> None:
    """stdout of a failed run: empty, or (``--json``, input read) one document whose ``error``
    is {exit_code: the exit status, type, message: the paragraph on stderr}."""
    if not result.stdout:
        return
    error = parse_single_json(result.stdout)["error"]
    assert set(error) == {"exit_code", "type", "message"}
    assert error["exit_code"] == result.exit_code and isinstance(error["type"], str) and error["type"]
    assert error["message"] and " ".join(error["message"].split()) in " ".join(result.stderr.split())


def parse_single_json(text: str) -> dict:
    """``text`` is exactly one JSON document (json.loads rejects anything around it)."""
    assert text.strip(), "stdout is empty"
    document = json.loads(text)
    assert isinstance(document, dict)
    return document
