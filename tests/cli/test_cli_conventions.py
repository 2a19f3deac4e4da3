"""Conventions users bring from other tools.

Spec export that round-trips for every family, choices that complete, refusals that lead
with their root causes, one verdict per model, names users recognise, named input shapes and
sharded outputs in the layout loaders expect.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import onnx_models
import pytest
import safetensors.torch
import torch
import yaml
from cli_support import (
    SAMPLES,
    assert_clean_exit,
    invoke,
    leftovers,
    mlp_spec,
    mlp_tensors,
    parse_single_json,
    write_onnx_mlp,
    write_sharded_mlp,
)
from docs_support import section
from families import FAMILIES
from test_families import build as build_family
from torch import nn
from typer.testing import CliRunner

import pathcond_cli as pathcond
from pathcond_cli.analysis import analyse
from pathcond_cli.cli.app import app
from pathcond_cli.engine.groups import build_groups
from pathcond_cli.errors import UnsupportedModelError, UsageError
from pathcond_cli.io.formats import load_model
from pathcond_cli.io.formats.onnx_format import load_onnx
from pathcond_cli.io.formats.spec import parse_spec_text, spec_from_graph, spec_text
from pathcond_cli.module_route import module_model
from pathcond_cli.runtime import resolve_device
from pathcond_cli.solve.dtype_limits import ensure_storable


def _signature(model) -> tuple:
    """What a route must agree on: group counts, every parameter's log diag(G), the path count."""
    analysis = analyse(model, device="cpu")
    groups = analysis.groups
    log_g = torch.cat([lg.flatten() for lg in analysis.diag.log_g]).sort().values
    return (groups.num_free, groups.num_fixed, groups.p), log_g, analysis.paths.log10


def _assert_same(signature, other, rtol=1e-9):
    assert other[0] == signature[0]
    torch.testing.assert_close(other[1], signature[1], rtol=rtol, atol=rtol)
    assert other[2] == pytest.approx(signature[2], rel=1e-12)


def _save_tensors(model, path: Path) -> Path:
    """A safetensors checkpoint of the tensors ``model``'s network reads, under the names pathcond reads them by."""
    keys = model.graph.parameter_keys()
    safetensors.torch.save_file({key: model.params[key].contiguous() for key in keys}, str(path))
    return path


# -- 1. pathcond spec ---------------------------------------------------------------------------


# Families whose analysis takes more than ten seconds on a loaded 2-core box: their graphs and
# tensors are compared by default, their analyses under ``-m slow``.
_SLOW_ANALYSES = {
    "vgg11_bn",
    "vgg16_bn",
    "alexnet",
    "mnasnet",
    "inception_v3",
    "googlenet_32",
    "googlenet_64",
    "unet",
    "unet_bilinear",
    "squeezenet1_0",
    "squeezenet1_1",
    "densenet",
    "regnet_x",
    "shufflenet_v2",
    "c3d",
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_spec_of_every_family_reads_the_state_dict_as_the_module(tmp_path, family):
    """The module route (torch.fx) against its spec, written as text and read with the module's own state_dict."""
    original, reloaded = _family_routes(tmp_path, family)
    assert reloaded.graph.nodes == original.graph.nodes and reloaded.graph.outputs == original.graph.outputs
    assert all(torch.equal(reloaded.params[key], original.params[key]) for key in original.graph.parameter_keys())
    if family not in _SLOW_ANALYSES:
        _assert_same(_signature(original), _signature(reloaded))


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(_SLOW_ANALYSES))
def test_spec_of_every_family_gives_the_same_analysis(tmp_path, family):
    _assert_same(*map(_signature, _family_routes(tmp_path, family)))


def _family_routes(tmp_path: Path, family: str):
    torch.manual_seed(0)
    record = FAMILIES[family]
    module = record.small().float().eval()
    original = module_model(module, record.small_shape)
    checkpoint = tmp_path / "model.safetensors"
    safetensors.torch.save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(checkpoint))
    spec = tmp_path / "model.yaml"
    spec.write_text(spec_text(spec_from_graph(original.graph)))
    return original, load_model(checkpoint, arch=str(spec))


def test_spec_command_from_a_factory_gives_a_spec_for_the_checkpoint(tmp_path):
    torch.manual_seed(0)
    module = FAMILIES["resnet"].small().float().eval()
    checkpoint = tmp_path / "resnet.safetensors"
    safetensors.torch.save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(checkpoint))
    result = invoke("spec", checkpoint, "--arch", "families:small_resnet", "--input-shape", "3,32,32")
    assert_clean_exit(result, 0)
    spec = yaml.safe_load(result.stdout)
    assert spec["layers"][0]["shape"] == [3, 32, 32]
    assert {"conv1.weight", "fc.weight"} <= {layer.get("weight") for layer in spec["layers"]}
    spec_file = tmp_path / "resnet.yaml"
    spec_file.write_text(result.stdout)
    from_spec = load_model(checkpoint, arch=str(spec_file))
    from_factory = load_model(checkpoint, arch="families:small_resnet", input_shape=(3, 32, 32))
    _assert_same(_signature(from_factory), _signature(from_spec))


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_spec_of_an_onnx_export_reads_a_safetensors_export_of_its_weights(tmp_path, exporter):
    """The ONNX route against a safetensors file of the same weights and the spec `pathcond spec` wrote.

    torch.export's optimiser folds the BatchNorms into convs that keep their state_dict names:
    no spec is written for its export (a state_dict would match it by name, not by meaning)."""
    module, _ = build_family("resnet")  # the families test's network: its dynamo export is made once a run
    onnx_path = tmp_path / "resnet.onnx"
    onnx_path.write_bytes(onnx_models.export(module, torch.randn(2, 3, 32, 32), exporter))
    spec_path = tmp_path / "resnet.json"
    original = load_onnx(onnx_path)
    if exporter == "dynamo":
        assert_clean_exit(invoke("spec", onnx_path, "-o", spec_path), 3, "'conv1.weight'", "by name but not by meaning")
        assert leftovers(tmp_path) == [] and not spec_path.exists()
        names = {node.name for node in original.graph.nodes}
        assert {"conv1", "layer1.0.conv1", "fc"} <= names, names
        return
    assert_clean_exit(invoke("spec", onnx_path, "-o", spec_path), 0)
    assert leftovers(tmp_path) == []
    checkpoint = _save_tensors(original, tmp_path / "resnet.safetensors")
    reloaded = load_model(checkpoint, arch=str(spec_path))
    _assert_same(_signature(original), _signature(reloaded))


def test_spec_of_a_dynamo_export_reads_the_modules_own_state_dict(tmp_path):
    """torch.export keeps the state_dict's names (here, without BatchNorm to fold): the spec
    written from the ONNX file reads the checkpoint the user saved from the module."""
    torch.manual_seed(0)
    module = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5), nn.ReLU(), nn.Linear(5, 2)
    ).eval()
    onnx_path = tmp_path / "net.onnx"
    onnx_path.write_bytes(onnx_models.export(module, torch.randn(2, 3, 8, 8), "dynamo"))
    spec_path = tmp_path / "net.yaml"
    assert_clean_exit(invoke("spec", onnx_path, "-o", spec_path), 0)
    state = tmp_path / "state.safetensors"
    safetensors.torch.save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(state))
    from_state = load_model(state, arch=str(spec_path))
    assert [node.name for node in from_state.graph.nodes if node.op in ("conv", "linear")] == ["0", "3", "5"]
    _assert_same(_signature(module_model(module, (3, 8, 8))), _signature(from_state), rtol=1e-6)


class _NewLayerTypes(nn.Module):
    """Padding modes, a per-channel scale and shift by stored
    tensors (channel_affine), a broadcasting add and −inf padding before max pooling."""

    def __init__(self):
        super().__init__()
        self.reflect = nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect")
        self.replicate = nn.Conv2d(4, 4, 3, padding=1, padding_mode="replicate")
        self.circular = nn.Conv2d(4, 4, 3, padding=1, padding_mode="circular")
        self.scale = nn.Parameter(torch.rand(4, 1, 1) + 0.5)
        self.shift = nn.Parameter(torch.randn(4, 1, 1))
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(4 * 3 * 3, 2)

    def forward(self, x):
        y = torch.relu(self.replicate(torch.relu(self.reflect(x))))
        y = y * self.scale + self.shift
        y = y + y.mean((2, 3), keepdim=True)
        y = torch.relu(self.circular(y))
        y = self.pool(nn.functional.pad(y, (1, 1, 1, 1), value=float("-inf")))
        return self.fc(y.flatten(1))


def test_spec_of_the_new_layer_types_reads_the_state_dict_as_the_module(tmp_path):
    torch.manual_seed(0)
    module = _NewLayerTypes().eval()
    original = module_model(module, (3, 4, 4))
    spec = spec_from_graph(original.graph)
    modes = {layer.get("mode") for layer in spec["layers"] if layer["type"] == "pad"}
    assert modes == {"reflect", "replicate", "circular", "-inf"}
    assert {"channel_affine", "add"} <= {layer["type"] for layer in spec["layers"]}
    checkpoint, spec_path = tmp_path / "m.safetensors", tmp_path / "m.yaml"
    safetensors.torch.save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(checkpoint))
    spec_path.write_text(spec_text(spec))
    reloaded = load_model(checkpoint, arch=str(spec_path))
    assert reloaded.graph.nodes == original.graph.nodes
    _assert_same(_signature(original), _signature(reloaded))


def test_spec_of_an_onnx_export_of_the_new_layer_types_reads_its_weights(tmp_path):
    torch.manual_seed(0)
    onnx_path = tmp_path / "m.onnx"
    onnx_path.write_bytes(onnx_models.export(_NewLayerTypes().eval(), torch.randn(2, 3, 4, 4), "torchscript"))
    spec_path = tmp_path / "m.json"
    assert_clean_exit(invoke("spec", onnx_path, "-o", spec_path), 0)
    original = load_onnx(onnx_path)
    assert {"pad", "channel_affine", "add"} <= {node.op for node in original.graph.nodes}
    reloaded = load_model(_save_tensors(original, tmp_path / "m.safetensors"), arch=str(spec_path))
    assert reloaded.graph.nodes == original.graph.nodes
    _assert_same(_signature(original), _signature(reloaded))


def test_spec_text_round_trips_names_yaml_would_misread():
    spec = {
        "format_version": 1,
        "layers": [
            {"name": "yes", "type": "input", "shape": [4]},
            {"name": "1.5", "type": "linear", "weight": "null", "bias": None, "weight_transposed": False},
            {"name": "a: b", "type": "relu", "inputs": ["1.5"]},
        ],
        "outputs": ["a: b"],
    }
    assert parse_spec_text(spec_text(spec), source="s") == spec
    assert parse_spec_text(spec_text(spec, as_json=True), source="s") == spec


def test_spec_output_is_checked_before_any_work_and_never_replaces_the_input(tmp_path):
    checkpoint, spec = tmp_path / "m.safetensors", tmp_path / "m.yaml"
    safetensors.torch.save_file(mlp_tensors(), str(checkpoint))
    spec.write_text(yaml.safe_dump(mlp_spec()))
    before = spec.read_bytes()
    assert_clean_exit(invoke("spec", checkpoint, "--arch", spec, "-o", tmp_path / "m.txt"), 2, "-o")
    assert_clean_exit(invoke("spec", checkpoint, "--arch", spec, "-o", spec), 6)
    assert spec.read_bytes() == before
    out = tmp_path / "out.yaml"
    assert_clean_exit(invoke("spec", checkpoint, "--arch", spec, "-o", out), 0)
    assert parse_spec_text(out.read_text(), source="out") == spec_from_graph(
        load_model(checkpoint, arch=str(spec)).graph
    )


# -- 2. choices that complete -------------------------------------------------------------------


@pytest.mark.parametrize("command", ["rescale", "inspect", "spec", "compare", "prune"])
def test_help_shows_choices_and_every_exit_code_without_typer_placeholders(command):
    result = invoke(command, "--help")
    assert result.exit_code == 0
    text = " ".join(result.stdout.split())
    assert "{MODEL}" not in text and "<str>" not in text and "<int range>" not in text and "<path>" not in text
    assert "[auto|cpu|cuda|cuda:N]" in text or command == "spec"
    assert "<float" not in text and "<text>" not in text
    table = section("Exit codes")
    documented = {int(code) for code in re.findall(r"^\| (\d+) \|", table, re.MULTILINE)}
    assert {1, 8, 9} <= documented
    assert {int(code) for code in re.findall(r"(?:Exit codes: |· |else )(\d+)\b", text)} == documented
    if command == "rescale":
        assert "--solver [newton|block|lbfgs|sequential]" in text and "--criterion [pathcond|enorm]" in text
        assert "--max-log-scale [auto|none|U]" in text and "--output-dir DIR" in text
        low, high = re.search(r"(\d+)–(\d+) gradient-equivalent passes", section("Solver options")).groups()
        assert f"{low}-{high} gradient-equivalent passes" in text and "25-140" not in text


def _completions(words: str) -> list[str]:
    """What bash completion offers for the last word of ``words`` (Typer's completion protocol)."""
    env = {"_PATHCOND_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": str(len(words.split(" ")) - 1)}
    result = CliRunner().invoke(app, [], env=env, prog_name="pathcond")
    assert result.exit_code == 0, result.output
    return result.stdout.split()


def test_shell_completion_offers_the_choices():
    cuda = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    assert _completions("pathcond inspect m.onnx --device ") == ["auto", "cpu", "cuda"]
    assert _completions("pathcond rescale m.onnx --device c") == ["cpu", "cuda", *cuda]
    assert _completions("pathcond rescale m.onnx --solver ") == ["newton", "block", "lbfgs", "sequential"]
    assert _completions("pathcond rescale m.onnx --criterion e") == ["enorm"]


def test_choices_refuse_unknown_values_and_device_keeps_cuda_n(tmp_path):
    checkpoint, spec = tmp_path / "m.safetensors", tmp_path / "m.yaml"
    safetensors.torch.save_file(mlp_tensors(), str(checkpoint))
    spec.write_text(yaml.safe_dump(mlp_spec()))
    assert_clean_exit(invoke("rescale", checkpoint, "--arch", spec, "--criterion", "l2"), 2, "--criterion")
    assert_clean_exit(invoke("rescale", checkpoint, "--arch", spec, "--solver", "adam"), 2, "--solver")
    index = torch.cuda.device_count()
    assert_clean_exit(invoke("inspect", checkpoint, "--arch", spec, "--device", f"cuda:{index}"), 2, "--device")


# -- 3. readable refusals -----------------------------------------------------------------------


class _ConvNeXtBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.dwconv = nn.Conv2d(channels, channels, 7, padding=3, groups=channels)
        self.norm = nn.LayerNorm(channels)
        self.pwconv1 = nn.Linear(channels, 4 * channels)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * channels, channels)

    def forward(self, x):
        y = self.dwconv(x).permute(0, 2, 3, 1)
        return x + self.pwconv2(self.act(self.pwconv1(self.norm(y)))).permute(0, 3, 1, 2)


def _convnext_like() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 4, stride=4),
        *[_ConvNeXtBlock(8) for _ in range(3)],
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    ).eval()


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_convnext_refusal_leads_with_its_root_causes(tmp_path, exporter):
    path = tmp_path / "convnext.onnx"
    path.write_bytes(onnx_models.export(_convnext_like(), torch.randn(2, 3, 32, 32), exporter))
    with pytest.raises(UnsupportedModelError) as caught:
        load_onnx(path)
    error = caught.value
    root = [p for p in error.problems if p not in error.follow_on]
    assert (
        len(root) == 2
        and any(p.startswith("LayerNormalization ×3") for p in root)
        and any(p.startswith("Gelu ×3") for p in root)
    )
    # The MatMul, bias Add and residual Add nodes after each refusal: counted, not listed.
    assert len(error.follow_on) >= 9 and not any("Gelu" in p.split(":")[0] for p in error.follow_on)
    shown = assert_clean_exit(invoke("inspect", path), 4, "LayerNormalization", "Gelu")
    assert f"and {len(error.follow_on)} more problem(s)" in shown
    assert len(shown.splitlines()) <= 5
    complete = assert_clean_exit(invoke("inspect", path, "--json"), 4)
    assert all(p.split(":")[0] in complete for p in error.follow_on)


def test_json_puts_the_complete_problem_list_wherever_the_error_paragraph_goes(tmp_path):
    """One contract for --json: a refused network's paragraph lists every problem, on stderr
    (one MODEL: nothing on stdout, it failed while being read) and as the JSON line's
    ``error.message`` of that file in a run over several MODELs."""
    refused = tmp_path / "convnext.onnx"
    refused.write_bytes(onnx_models.export(_convnext_like(), torch.randn(2, 3, 32, 32), "torchscript"))
    with pytest.raises(UnsupportedModelError) as caught:
        load_onnx(refused)
    follow_on = caught.value.follow_on
    assert follow_on
    single = invoke("inspect", refused, "--json")
    assert single.stdout == ""
    assert all(problem.split(":")[0] in assert_clean_exit(single, 4) for problem in follow_on)
    result = invoke("inspect", refused, write_onnx_mlp(tmp_path / "mlp.onnx"), "--json")
    assert result.exit_code == 4 and "Traceback" not in result.stderr, result.stderr
    first, second = (json.loads(line) for line in result.stdout.splitlines())
    assert first["error"]["exit_code"] == 4 and "error" not in second
    assert all(problem.split(":")[0] in first["error"]["message"] for problem in follow_on)
    assert "more problem(s)" not in first["error"]["message"]
    without_json = assert_clean_exit(invoke("inspect", refused, tmp_path / "mlp.onnx"), 4)
    assert f"and {len(follow_on)} more problem(s)" in without_json


def test_convnext_module_refusal_leads_with_its_root_causes():
    with pytest.raises(UnsupportedModelError) as caught:
        pathcond.rescale_module(_convnext_like(), (3, 32, 32))
    error = caught.value
    root = [p for p in error.problems if p not in error.follow_on]
    assert [p.split(" ×")[0] for p in root] == ["LayerNorm", "GELU"]
    # ConvNeXt's channel-last permutes are read (as rearranges) since 0.9, so nothing follows on.
    assert all(p.startswith("fx node") for p in error.follow_on)
    assert str(error).count("\n  - ") == 2


def test_flushed_values_of_many_tensors_are_one_warning():
    graph_spec = {
        "layers": [
            {"name": "x", "type": "input", "shape": [4]},
            {"name": "fc1", "type": "linear"},
            {"name": "relu", "type": "relu"},
            {"name": "fc2", "type": "linear"},
        ]
    }
    from pathcond_cli.io.formats.spec import graph_from_spec

    graph = graph_from_spec(graph_spec, source="s")
    tiny = torch.finfo(torch.float16).tiny
    params = {key: torch.full((1000,), 2 * tiny, dtype=torch.float16) for key in ("a", "b", "c")}
    params.update(
        {
            "fc1.weight": torch.ones(3, 4, dtype=torch.float16),
            "fc1.bias": torch.ones(3, dtype=torch.float16),
            "fc2.weight": torch.ones(2, 3, dtype=torch.float16),
            "fc2.bias": torch.ones(2, dtype=torch.float16),
        }
    )
    changed = {key: params[key].clone() for key in ("a", "b", "c")}
    for tensor in changed.values():
        tensor[:2] = 0.0
    warnings = ensure_storable("net.safetensors", build_groups(graph, params), params, changed, 1.0)
    assert len(warnings) == 1
    assert "6 normal values of 3 float16 tensors" in warnings[0]
    assert all(f"'{key}' 2/1,000" in warnings[0] for key in ("a", "b", "c"))


# -- 4. one verdict per model -------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind", ["gelu", "silu", "sigmoid", "tanh", "softmax", "layernorm", "groupnorm", "hardswish", "relu6"]
)
def test_non_homogeneous_spec_types_are_unsupported_models_exit_4(tmp_path, kind):
    checkpoint, spec = tmp_path / "m.safetensors", tmp_path / "m.yaml"
    safetensors.torch.save_file(mlp_tensors(), str(checkpoint))
    layers = mlp_spec()["layers"]
    layers[2] = {"name": layers[2]["name"], "type": kind}
    spec.write_text(yaml.safe_dump({"layers": layers}))
    assert_clean_exit(invoke("inspect", checkpoint, "--arch", spec), 4, kind, "not positively homogeneous")


def test_shape_mistakes_are_usage_errors_exit_2(tmp_path):
    checkpoint = tmp_path / "m.safetensors"
    torch.manual_seed(0)
    module = FAMILIES["resnet"].small().float().eval()
    safetensors.torch.save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(checkpoint))
    assert_clean_exit(invoke("inspect", checkpoint, "--arch", "families:small_resnet"), 2, "--input-shape")
    assert_clean_exit(invoke("inspect", SAMPLES / "resnet_small.onnx", "--input-shape", "32,32"), 2, "batch")
    spec = tmp_path / "m.yaml"
    spec.write_text(yaml.safe_dump(mlp_spec()))
    safetensors.torch.save_file(mlp_tensors(), str(checkpoint))
    assert_clean_exit(invoke("inspect", checkpoint, "--arch", spec, "--input-shape", "1,6"), 2, "batch")


def test_rescale_module_with_a_batch_in_the_shape_says_the_shape_is_batch_free():
    module = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(UsageError) as caught:
        pathcond.rescale_module(module, input_shape=(1, 8))
    assert caught.value.exit_code == 2
    assert "batch-free" in str(caught.value) and "not 1,8" in str(caught.value)
    assert "architecture spec" not in str(caught.value)


def test_api_missing_cuda_device_is_a_usage_error():
    with pytest.raises(UsageError) as caught:
        resolve_device(f"cuda:{torch.cuda.device_count()}")
    assert caught.value.exit_code == 2


# -- 5. names users recognise -------------------------------------------------------------------


def test_tables_off_a_terminal_keep_whole_names(tmp_path):
    module = nn.Sequential()
    module.add_module("a_rather_long_first_layer_name", nn.Linear(4, 6))
    module.add_module("relu", nn.ReLU())
    module.add_module("another_long_layer_name_at_the_end", nn.Linear(6, 2))
    path = tmp_path / "long.onnx"
    path.write_bytes(onnx_models.export(module.eval(), torch.randn(2, 4), "torchscript"))
    result = invoke("rescale", path, "-o", tmp_path / "out.onnx")
    shown = assert_clean_exit(result, 0)
    assert "a_rather_long_first_layer_name " in shown and "another_long_layer_name_at_the_end " in shown
    assert "…" not in shown


# -- 6. named input shapes ----------------------------------------------------------------------


def _two_input_spec(tmp_path: Path) -> tuple[Path, Path]:
    spec = {
        "layers": [
            {"name": "a", "type": "input"},
            {"name": "b", "type": "input"},
            {"name": "fa", "type": "linear", "inputs": "a"},
            {"name": "fb", "type": "linear", "inputs": "b"},
            {"name": "cat", "type": "concat", "inputs": ["fa", "fb"]},
            {"name": "relu", "type": "relu"},
            {"name": "out", "type": "linear"},
        ]
    }
    torch.manual_seed(0)
    tensors = {
        "fa.weight": torch.randn(3, 4),
        "fa.bias": torch.randn(3),
        "fb.weight": torch.randn(5, 6),
        "fb.bias": torch.randn(5),
        "out.weight": torch.randn(2, 8),
        "out.bias": torch.randn(2),
    }
    checkpoint, spec_path = tmp_path / "two.safetensors", tmp_path / "two.yaml"
    safetensors.torch.save_file(tensors, str(checkpoint))
    spec_path.write_text(yaml.safe_dump(spec))
    return checkpoint, spec_path


def test_named_input_shapes_shape_a_multi_input_spec(tmp_path):
    checkpoint, spec = _two_input_spec(tmp_path)
    result = invoke("inspect", checkpoint, "--arch", spec, "--input-shape", "a:4", "--input-shape", "b:6", "--json")
    assert_clean_exit(result, 0)
    assert parse_single_json(result.stdout)["input_shape"] == [[4], [6]]
    assert_clean_exit(invoke("inspect", checkpoint, "--arch", spec, "--input-shape", "4"), 2, "NAME:SHAPE")
    assert_clean_exit(
        invoke("inspect", checkpoint, "--arch", spec, "--input-shape", "a:4", "--input-shape", "c:6"),
        2,
        "'c'",
        "'a', 'b'",
    )
    assert_clean_exit(
        invoke("inspect", checkpoint, "--arch", spec, "--input-shape", "a:4", "--input-shape", "6"), 2, "--input-shape"
    )
    assert_clean_exit(
        invoke("inspect", checkpoint, "--arch", spec, "--input-shape", "a:4", "--input-shape", "a:5"), 2, "two shapes"
    )


def test_named_input_shape_of_a_factory(tmp_path):
    module = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    checkpoint = tmp_path / "mlp.safetensors"
    safetensors.torch.save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(checkpoint))
    factory = tmp_path / "habits_factory.py"
    factory.write_text(
        "import torch\n\ndef mlp():\n    return torch.nn.Sequential(torch.nn.Linear(6, 8), "
        "torch.nn.ReLU(), torch.nn.Linear(8, 3))\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        names = {node.name for node in load_model(checkpoint, arch="habits_factory:mlp", input_shape=(6,)).graph.inputs}
        (name,) = names
        result = invoke("inspect", checkpoint, "--arch", "habits_factory:mlp", "--input-shape", f"{name}:6", "--json")
        assert_clean_exit(result, 0)
        assert parse_single_json(result.stdout)["input_shape"] == [[6]]
        assert_clean_exit(
            invoke("inspect", checkpoint, "--arch", "habits_factory:mlp", "--input-shape", "image:6"),
            2,
            "'image'",
            f"'{name}'",
        )
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("habits_factory", None)


def test_named_input_shape_of_an_onnx_model(tmp_path):
    onnx_path = tmp_path / "cnn.onnx"
    onnx_path.write_bytes(onnx_models.exported("cnn", "torchscript"))
    shape = ",".join(map(str, onnx_models.example_input("cnn").shape[1:]))
    result = invoke("inspect", onnx_path, "--input-shape", f"x:{shape}", "--json")
    assert_clean_exit(result, 0)
    assert_clean_exit(invoke("inspect", onnx_path, "--input-shape", f"image:{shape}"), 2, "'image'", "'x'")


def test_named_input_shape_applies_to_every_model_of_a_multi_file_run(tmp_path):
    models = [write_onnx_mlp(tmp_path / f"m{i}.onnx", seed=i) for i in range(2)]
    out = tmp_path / "out"
    out.mkdir()
    result = invoke("rescale", *models, "--output-dir", out, "--input-shape", "x:6", "--json", "-q")
    assert result.exit_code == 0, result.stderr
    reports = [json.loads(line) for line in result.stdout.splitlines()]
    assert [report["input_shape"] for report in reports] == [[[6]], [[6]]]
    assert sorted(p.name for p in out.iterdir()) == ["m0.pathcond.onnx", "m1.pathcond.onnx"]
    wrong = invoke("inspect", *models, "--input-shape", "image:6", "--json")
    assert wrong.exit_code == 2, wrong.stderr  # each file's usage error: the code they share
    assert [json.loads(line)["error"]["exit_code"] for line in wrong.stdout.splitlines()] == [2, 2]
    assert "'image'" in wrong.stderr and "'x'" in wrong.stderr


# -- 7. sharded output in the layout loaders expect ---------------------------------------------


def _read_like_a_loader(directory: Path) -> dict[str, torch.Tensor]:
    """What ``from_pretrained(directory)`` reads: ``model.safetensors.index.json`` and the shards it names."""
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    tensors = {}
    for file in sorted(set(index["weight_map"].values())):
        tensors.update(safetensors.torch.load_file(str(directory / file)))
    assert set(tensors) == set(index["weight_map"])
    return tensors


def test_sharded_output_into_a_directory_has_the_loader_layout(tmp_path):
    (tmp_path / "in").mkdir()
    index, spec = write_sharded_mlp(tmp_path / "in")
    out = tmp_path / "out"
    out.mkdir()
    assert_clean_exit(invoke("rescale", index, "--arch", spec, "-o", out / "model.safetensors.index.json", "-q"), 0)
    assert sorted(p.name for p in out.iterdir()) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    written = _read_like_a_loader(out)
    reread = load_model(out / "model.safetensors.index.json")
    assert written.keys() == reread.params.keys()
    assert all(torch.equal(written[k], reread.params[k]) for k in written)
    assert any(not torch.equal(written[k], mlp_tensors()[k]) for k in written)
    # Again into the same directory: the index names a complete checkpoint and nothing else is left.
    assert_clean_exit(invoke("rescale", index, "--arch", spec, "-o", out / "model.safetensors.index.json", "-q"), 0)
    named = set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert sorted(p.name for p in out.iterdir()) == sorted([*named, "model.safetensors.index.json"])
    _read_like_a_loader(out)
    assert leftovers(tmp_path) == []


# -- what a new user met ------------------------------------------------------


class _ConvBatchNorm(nn.Module):
    """A bias-free conv followed by BatchNorm, as in every ResNet: both exporters fold the
    BatchNorm into the conv in eval mode, so the exported tensors are not the state_dict's."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 6 * 6, 2)
        with torch.no_grad():  # statistics of a trained network (the exporter drops an identity BatchNorm)
            self.bn1.running_mean.uniform_(-1, 1)
            self.bn1.running_var.uniform_(0.5, 2)
            self.bn1.bias.uniform_(-1, 1)

    def forward(self, x):
        return self.fc(torch.relu(self.bn1(self.conv1(x))).flatten(1))


@pytest.mark.parametrize(("exporter", "made_key"), [("torchscript", "onnx::Conv_")])
def test_spec_of_an_export_with_folded_batchnorm_warns_that_it_is_not_the_state_dicts(tmp_path, exporter, made_key):
    """The spec of such an export reads tensors the module's checkpoint lacks: `spec` says so,
    names them and the two ways to a spec of the checkpoint, before `rescale` refuses it."""
    torch.manual_seed(0)
    module = _ConvBatchNorm().eval()
    onnx_path = tmp_path / "net.onnx"
    onnx_path.write_bytes(onnx_models.export(module, torch.randn(2, 3, 8, 8), exporter))
    spec_path = tmp_path / "net.yaml"
    stderr = assert_clean_exit(
        invoke("spec", onnx_path, "-o", spec_path),
        0,
        "warning:",
        made_key,
        "--arch module:factory",
        "do_constant_folding=False",
    )
    assert "state_dict" in stderr
    state = tmp_path / "state.safetensors"
    safetensors.torch.save_file(
        {k: v.contiguous() for k, v in module.state_dict().items() if not k.endswith("num_batches_tracked")}, str(state)
    )
    assert_clean_exit(invoke("rescale", state, "--arch", spec_path, "-q"), 3, made_key)


class _BiasedConvBatchNorm(_ConvBatchNorm):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, bias=True)


@pytest.mark.parametrize(
    ("factory", "folded"),
    [
        (_ConvBatchNorm, ("conv1.weight", "conv1.weight_bias")),
        (_BiasedConvBatchNorm, ("conv1.weight", "conv1.bias")),  # both keep their names: no warning before
    ],
)
def test_spec_of_an_export_that_kept_state_dict_names_for_folded_tensors_is_refused(tmp_path, factory, folded):
    """torch.export's optimiser folds BatchNorm into the conv and keeps ``conv1.weight`` (and a
    conv's own ``conv1.bias``) for the folded values: a state_dict would match such a spec by
    name but not by meaning, so `spec` writes none, names every folded tensor and the module route."""
    torch.manual_seed(0)
    module = factory().eval()
    onnx_path = tmp_path / "net.onnx"
    onnx_path.write_bytes(onnx_models.export(module, torch.randn(2, 3, 8, 8), "dynamo"))
    spec_path = tmp_path / "net.yaml"
    assert_clean_exit(
        invoke("spec", onnx_path, "-o", spec_path), 3, *folded, "by name but not by meaning", "--arch module:factory"
    )
    assert not spec_path.exists()


def test_spec_of_an_export_of_the_state_dicts_tensors_does_not_warn(tmp_path):
    torch.manual_seed(0)
    onnx_path = tmp_path / "net.onnx"
    onnx_path.write_bytes(onnx_models.export(_ConvBatchNorm().eval(), torch.randn(2, 3, 8, 8), "torchscript-unfolded"))
    assert "warning" not in assert_clean_exit(invoke("spec", onnx_path), 0)


def test_spec_shows_the_warnings_of_reading_the_checkpoint(tmp_path):
    """`--allow-unused` carries tensors the spec does not read with a warning: `spec` shows it too."""
    checkpoint = tmp_path / "m.safetensors"
    safetensors.torch.save_file({**mlp_tensors(), "extra": torch.zeros(3)}, str(checkpoint))
    spec = tmp_path / "m.yaml"
    spec.write_text(yaml.safe_dump(mlp_spec()))
    assert_clean_exit(invoke("spec", checkpoint, "--arch", spec, "--allow-unused"), 0, "warning:", "extra")


def test_an_onnx_model_with_two_inputs_has_an_input_layer_for_each(tmp_path):
    """Each graph input is an input of the network, shaped by name or by its declared shape;
    one unnamed shape cannot say which input it is for."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["s"]), helper.make_node("Relu", ["s"], ["y"])],
        "two_inputs",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", 4]) for n in ("a", "b")],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
    )
    path = tmp_path / "two.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    for shapes in ((), ("--input-shape", "a:4", "--input-shape", "b:4")):
        result = invoke("spec", path, *shapes)
        assert_clean_exit(result, 0)
        layers = yaml.safe_load(result.stdout)["layers"]
        assert [(layer["name"], layer["shape"]) for layer in layers if layer["type"] == "input"] == [
            ("a", [4]),
            ("b", [4]),
        ]
        assert_clean_exit(invoke("inspect", path, *shapes), 0)
    for command in ("inspect", "spec"):
        assert_clean_exit(invoke(command, path, "--input-shape", "4"), 2, "two.onnx", "'a'", "'b'", "NAME:SHAPE")


def test_a_spec_given_as_model_is_named_for_what_it_is(tmp_path):
    """Arguments swapped (`pathcond spec model.yaml`): the spec is not called a corrupt ONNX file."""
    spec = tmp_path / "m.yaml"
    spec.write_text(yaml.safe_dump(mlp_spec()))
    checkpoint = tmp_path / "m.safetensors"
    safetensors.torch.save_file(mlp_tensors(), str(checkpoint))
    for args in (("spec", spec), ("inspect", spec, "--arch", checkpoint), ("rescale", spec, "--arch", checkpoint)):
        stderr = assert_clean_exit(invoke(*args), 3, "m.yaml", "architecture spec", "--arch")
        assert "onnx" not in stderr.lower()
    assert leftovers(tmp_path) == []


def test_spec_refusing_to_replace_its_arch_file_offers_no_in_place(tmp_path):
    """`spec` has no --in-place: its refusal to write over the spec it reads does not offer one."""
    spec = tmp_path / "m.yaml"
    spec.write_text(yaml.safe_dump(mlp_spec()))
    checkpoint = tmp_path / "m.safetensors"
    safetensors.torch.save_file(mlp_tensors(), str(checkpoint))
    stderr = assert_clean_exit(invoke("spec", checkpoint, "--arch", spec, "-o", spec), 6, "m.yaml", "choose another -o")
    assert "--in-place" not in stderr


def test_inspect_help_promises_the_plot_inspect_draws(tmp_path):
    """inspect solves nothing: its --plot has no 'after' and no F per iteration (plot.draw with result None)."""
    text = " ".join(invoke("inspect", "--help").stdout.split())
    assert "(before and after) and F per iteration" not in text
    assert "--plot FILE" in text


class _FlattensInForward(nn.Module):
    """torch.flatten in forward (as ResNet does): resolved only by running the module."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4 * 6 * 6, 2)

    def forward(self, x):
        return self.fc(torch.flatten(torch.relu(self.conv(x)), 1))


@pytest.mark.parametrize("shape", [(1, 3, 8, 8), (8, 8)])
def test_a_module_that_cannot_run_on_the_given_shape_is_a_usage_error(shape):
    """A wrong --input-shape for a factory or rescale_module (the batch left in, a dimension
    missing) makes the module raise: exit 2 quoting torch's reason, not exit 4 blaming flatten."""
    module = _FlattensInForward()
    with pytest.raises(UsageError) as raised:
        module_model(module, shape)
    message = str(raised.value)
    with pytest.raises(RuntimeError) as torch_says:
        module(torch.zeros(1, *shape))
    assert str(shape) in message and "batch-free" in message and str(torch_says.value).splitlines()[0] in message
    assert module_model(module, (3, 8, 8)).graph.inputs[0].shape == (3, 8, 8)
