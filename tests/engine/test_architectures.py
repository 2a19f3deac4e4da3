"""Modern ReLU architectures, exactly.

Table 1 counts through both entry points (ONNX with BatchNormalization nodes kept, and
safetensors + spec through the real CLI), function preservation in eval and train mode, and
the canonical-representative property on every small architecture. The ImageNet-sized
models run only with ``-m slow``.
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from reference_models import REFERENCE_MODELS, SMALL_MODELS, TABLE1
from safetensors.torch import save_file
from typer.testing import CliRunner

import pathcond_cli as pathcond
from pathcond_cli.cli.app import app
from pathcond_cli.engine.groups import build_groups
from pathcond_cli.io.formats.spec import spec_from_graph
from pathcond_cli.module_route import module_model
from pathcond_cli.verify import compare

FAST_TABLE1 = ["cifar_nv", "resnet18"]
SLOW_TABLE1 = [name for name in TABLE1 if name not in FAST_TABLE1]


def build(name: str) -> tuple[torch.nn.Module, tuple[int, ...]]:
    torch.manual_seed(0)
    factory, shape, _, _ = REFERENCE_MODELS[name]
    return factory().eval(), shape


def export_safetensors(module: torch.nn.Module, shape: tuple[int, ...], directory: Path, name: str) -> Path:
    """A checkpoint as a user has it: the full state_dict, and a sidecar spec."""
    graph = module_model(module, shape).graph
    (directory / f"{name}.yaml").write_text(yaml.safe_dump(spec_from_graph(graph), sort_keys=False))
    path = directory / f"{name}.safetensors"
    save_file({k: v.detach().contiguous() for k, v in module.state_dict().items()}, str(path))
    return path


def export_onnx(module: torch.nn.Module, shape: tuple[int, ...], directory: Path, name: str) -> Path:
    """TorchScript export with constant folding off, so BatchNormalization nodes are kept."""
    path = directory / f"{name}.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module,
            (torch.zeros(1, *shape),),
            str(path),
            dynamo=False,
            opset_version=17,
            do_constant_folding=False,
            input_names=["x"],
            dynamic_axes={"x": {0: "batch"}},
        )
    return path


def inspect_json(path: Path) -> dict:
    result = CliRunner().invoke(app, ["inspect", str(path), "--json", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def check_table1(name: str, tmp_path: Path) -> None:
    module, shape = build(name)
    expected_parameters, expected_hidden = TABLE1[name]
    for path in (export_safetensors(module, shape, tmp_path, name), export_onnx(module, shape, tmp_path, name)):
        report = inspect_json(path)
        assert (report["parameters"], report["hidden_units"]) == (expected_parameters, expected_hidden), path.name
        assert report["paths"]["log10"] > 0 and report["diag_g"]["log10_spread"] >= 0


@pytest.mark.parametrize("name", FAST_TABLE1)
def test_table1_counts_through_onnx_and_safetensors(name, tmp_path):
    check_table1(name, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW_TABLE1)
def test_table1_counts_big_models(name, tmp_path):
    check_table1(name, tmp_path)


def test_onnx_export_kept_batchnorm_nodes(tmp_path):
    import onnx

    module, shape = build("small_resnet")
    ops = {n.op_type for n in onnx.load(str(export_onnx(module, shape, tmp_path, "r"))).graph.node}
    assert "BatchNormalization" in ops


def _float64_outputs(module: torch.nn.Module, shape, *, train: bool) -> torch.Tensor:
    x = torch.randn((8, *shape), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    clone = copy.deepcopy(module).double().train(train)
    with torch.no_grad():
        return clone(x)


@pytest.mark.parametrize("name", SMALL_MODELS)
def test_small_architectures_rescale_exactly_in_eval_and_train_mode(name):
    module, shape = build(name)
    before = {mode: _float64_outputs(module, shape, train=mode) for mode in (False, True)}
    result = pathcond.rescale_module(module, shape, device="cpu")
    assert result.solve.converged and result.solve.u_inf > 0
    assert result.verification.max_rel_error <= 1e-5
    for mode in (False, True):
        after = _float64_outputs(module, shape, train=mode)
        relative = float((after - before[mode]).abs().max() / before[mode].abs().max())
        assert relative <= 1e-5, (name, "train" if mode else "eval", relative)


@pytest.mark.parametrize("name", SMALL_MODELS)
def test_canonical_representative(name):
    """PathCond(Dθ) = PathCond(θ): the result depends only on the rescaling orbit."""
    module, shape = build(name)
    model = module_model(module, shape)
    params64 = {k: v.double() for k, v in model.params.items()}
    model.params = params64
    groups = build_groups(model.graph, params64)
    shift = torch.randn(groups.num_free, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    moved = {**params64, **groups.apply(params64, shift)}
    assert compare(model.graph, params64, moved).max_rel_error < 1e-10
    first = pathcond.rescale(model, tol=1e-10, max_iter=5000, device="cpu").rescaled_params
    model.params = moved
    second = pathcond.rescale(model, tol=1e-10, max_iter=5000, device="cpu").rescaled_params
    for key in groups.graph.parameter_keys():
        scale = float(first[key].abs().max()) or 1.0
        assert float((first[key] - second[key]).abs().max()) / scale < 1e-6, key


def test_non_homogeneous_parts_are_rejected_with_every_node_listed():
    class Mixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(4, 8)
            self.act = torch.nn.GELU()
            self.norm = torch.nn.LayerNorm(8)
            self.fc2 = torch.nn.Linear(8, 2)

        def forward(self, x):
            return torch.softmax(self.fc2(self.norm(self.act(self.fc1(x)))), dim=-1)

    with pytest.raises(pathcond.PathcondError) as raised:
        module_model(Mixed(), (4,))
    message = str(raised.value)
    assert raised.value.exit_code == 4
    for offender in ("GELU", "LayerNorm", "softmax"):
        assert offender in message, message


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet50", "vgg16"])
def test_big_models_rescale_exactly(name):
    module, shape = build(name)
    result = pathcond.rescale_module(module, shape, device="cpu")
    assert result.solve.converged
    assert result.verification.max_rel_error <= 1e-5
