"""ONNX models with several graph inputs: read, rescaled and verified with
every input fed.

Oracles: the torch module the model was exported from, run on the same random inputs as the
written file in onnxruntime (or onnx.reference); the brute-force path enumeration of
tests/oracle.py for diag(G); and the same network given as safetensors with its spec.
"""

from __future__ import annotations

import io
import sys
import warnings

import numpy as np
import onnx
import pytest
import safetensors.torch
import torch
from cli_support import assert_clean_exit, invoke, leftovers, parse_single_json
from onnx import numpy_helper
from onnx_models import dynamo_exporting
from oracle import build_neuron_dag, to_theta_order
from torch import nn

from pathcond_cli.engine.diag import diag_g
from pathcond_cli.engine.groups import build_groups
from pathcond_cli.io.formats.onnx_format import load_onnx

IMAGE, VECTOR = (3, 8, 8), (5,)
SHAPES = ("--input-shape", "img:3,8,8", "--input-shape", "vec:5")


class ImageAndVector(nn.Module):
    """An image branch (conv, ReLU, linear, ReLU) and a vector branch (linear, ReLU), joined
    by ``join`` (concatenated or added), then a linear head."""

    def __init__(self, join: str = "concat", image=IMAGE, vector=VECTOR[0], channels=4, width=6):
        super().__init__()
        self.join = join
        self.conv = nn.Conv2d(image[0], channels, 3, padding=1)
        self.fc_img = nn.Linear(channels * image[1] * image[2], width)
        self.fc_vec = nn.Linear(vector, width)
        self.head = nn.Linear(2 * width if join == "concat" else width, 2)

    def forward(self, img, vec):
        a = torch.relu(self.fc_img(torch.relu(self.conv(img)).flatten(1)))
        b = torch.relu(self.fc_vec(vec))
        return self.head(torch.cat([a, b], 1) if self.join == "concat" else a + b)


class SharedAdd(nn.Module):
    """Both inputs feed one Add, then two linear layers with a ReLU between."""

    def __init__(self, width=5, hidden=7):
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, 3)

    def forward(self, a, b):
        return self.fc2(torch.relu(self.fc1(torch.relu(a + b))))


def _module(name: str) -> nn.Module:
    torch.manual_seed(3)
    module = SharedAdd() if name == "shared_add" else ImageAndVector(name)
    return module.eval()


def _examples(name: str, batch: int = 2) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(5)
    shapes = [(5,), (5,)] if name == "shared_add" else [IMAGE, VECTOR]
    return tuple(torch.randn((batch, *shape), generator=generator) for shape in shapes)


def _input_names(name: str) -> list[str]:
    return ["a", "b"] if name == "shared_add" else ["img", "vec"]


def _export(
    module: nn.Module,
    examples: tuple[torch.Tensor, ...],
    names: list[str],
    exporter: str,
    *,
    open_spatial: bool = False,
) -> bytes:
    """ONNX bytes, batch symbolic (and, with ``open_spatial``, the image's height and width)."""
    if exporter == "dynamo":
        with dynamo_exporting():
            batch = torch.export.Dim("batch")
            program = torch.onnx.export(
                module,
                examples,
                dynamo=True,
                verbose=False,
                input_names=names,
                dynamic_shapes=tuple({0: batch} for _ in examples),
            )
        return program.model_proto.SerializeToString()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        axes = {name: {0: "batch"} for name in names}
        if open_spatial:
            axes[names[0]] = {0: "batch", 2: "height", 3: "width"}
        buffer = io.BytesIO()
        torch.onnx.export(
            module,
            examples,
            buffer,
            dynamo=False,
            input_names=names,
            output_names=["y"],
            dynamic_axes={**axes, "y": {0: "batch"}},
        )
        return buffer.getvalue()


def _ort_outputs(path, feeds: dict[str, np.ndarray]) -> np.ndarray:
    onnxruntime = pytest.importorskip("onnxruntime")
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert sorted(i.name for i in session.get_inputs()) == sorted(feeds)
    (output,) = session.run(None, feeds)
    return output


def _initializers(path) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


def _rescale(source, destination, *options) -> dict:
    result = invoke("rescale", source, "-o", destination, "--json", *options)
    assert_clean_exit(result, 0)
    return parse_single_json(result.stdout)


def _check_written(module: nn.Module, names: list[str], source, written, report: dict) -> None:
    """The report says verified by both checks; onnxruntime runs the written file on fresh
    random inputs and agrees with the module; the rescaling changed some tensor."""
    verification = report["verification"]
    assert verification["passed"] and verification["independent"]["status"] == "passed", verification
    generator = torch.Generator().manual_seed(11)
    inputs = [torch.randn((4, *shape), generator=generator) for shape in report["input_shape"]]
    with torch.no_grad():
        expected = module(*inputs).numpy()
    got = _ort_outputs(written, {name: x.numpy() for name, x in zip(names, inputs)})
    assert np.abs(got - expected).max() <= 1e-4 * np.abs(expected).max()
    before, after = _initializers(source), _initializers(written)
    changed = [key for key in before if key in after and not np.array_equal(before[key], after[key])]
    assert changed, "the rescaling should move some tensor of this network"
    assert max(np.abs(before[k] - after[k]).max() for k in changed) > 1e-3


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("name", ["concat", "add", "shared_add"])
def test_a_two_input_model_is_rescaled_and_verified_with_static_shapes(tmp_path, name, exporter):
    module, names = _module(name), _input_names(name)
    source = tmp_path / "two.onnx"
    source.write_bytes(_export(module, _examples(name), names, exporter))
    report = _rescale(source, tmp_path / "out.onnx")
    assert report["input_shape"] == [list(x.shape[1:]) for x in _examples(name)]
    assert report["groups"]["free"] > 0
    _check_written(module, names, source, tmp_path / "out.onnx", report)


def test_named_shapes_shape_each_input_of_an_open_model(tmp_path):
    """Height and width left open by the export: each input is shaped by name."""
    module, names = _module("concat"), _input_names("concat")
    source = tmp_path / "open.onnx"
    source.write_bytes(_export(module, _examples("concat"), names, "torchscript", open_spatial=True))
    report = _rescale(source, tmp_path / "out.onnx", *SHAPES)
    assert report["input_shape"] == [list(IMAGE), list(VECTOR)]
    _check_written(module, names, source, tmp_path / "out.onnx", report)


def test_the_api_saves_an_open_model_read_with_named_shapes_without_repeating_them(tmp_path):
    """``save`` reads the written file back with the shapes the analysis used: without
    ``input_shape`` it was a VerificationError (exit 5) telling an API user to pass
    --input-shape, and nothing was written."""
    import pathcond_cli as pathcond

    module, names = _module("concat"), _input_names("concat")
    source = tmp_path / "open.onnx"
    source.write_bytes(_export(module, _examples("concat"), names, "torchscript", open_spatial=True))
    result = pathcond.rescale(pathcond.load(source, input_shape={"img": IMAGE, "vec": VECTOR}), device="cpu")
    verification = pathcond.save(result, tmp_path / "out.onnx")
    report = {
        "verification": {"passed": verification.passed, "independent": verification.independent},
        "input_shape": [list(IMAGE), list(VECTOR)],
    }
    _check_written(module, names, source, tmp_path / "out.onnx", report)


def test_onnx_reference_checks_a_two_input_model_without_onnxruntime(tmp_path, monkeypatch):
    module, names = _module("concat"), _input_names("concat")
    source = tmp_path / "two.onnx"
    source.write_bytes(_export(module, _examples("concat"), names, "torchscript"))
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime raises ImportError
    report = _rescale(source, tmp_path / "out.onnx")
    independent = report["verification"]["independent"]
    assert independent["runtime"] == "onnx.reference" and independent["status"] == "passed", independent
    monkeypatch.delitem(sys.modules, "onnxruntime")
    _check_written(module, names, source, tmp_path / "out.onnx", report)


@pytest.mark.parametrize("name", ["add", "shared_add"])
def test_diag_g_of_a_two_input_model_is_the_brute_force_path_sum(name):
    """Every input neuron is a path source: diag(G) equals diag(JᵀJ) of the enumerated paths."""
    torch.manual_seed(1)
    module = (
        SharedAdd(width=3, hidden=4)
        if name == "shared_add"
        else ImageAndVector("add", image=(2, 3, 3), vector=3, channels=2, width=3)
    )
    examples = (
        (torch.randn(2, 3), torch.randn(2, 3)) if name == "shared_add" else (torch.randn(2, 2, 3, 3), torch.randn(2, 3))
    )
    model = load_onnx(_export(module.eval(), examples, _input_names(name), "torchscript"))
    assert len(model.graph.inputs) == 2
    params = {key: value.to(torch.float64) for key, value in model.params.items()}
    dag = build_neuron_dag(model.graph, params)
    groups = build_groups(model.graph, params)
    g_engine = to_theta_order(dag, groups, [log_g.exp() for log_g in diag_g(groups).log_g])
    g_oracle = dag.diag_G()
    assert (g_oracle > 0).all()
    assert ((g_engine - g_oracle).abs() / g_oracle).max().item() <= 1e-10


def test_the_spec_of_a_two_input_model_lists_both_inputs_and_gives_the_same_analysis(tmp_path):
    """`spec` of the ONNX model, with its tensors as safetensors, is the same network."""
    import yaml

    module, names = _module("concat"), _input_names("concat")
    source = tmp_path / "two.onnx"
    source.write_bytes(_export(module, _examples("concat"), names, "torchscript", open_spatial=True))
    assert_clean_exit(invoke("spec", source, *SHAPES, "-o", tmp_path / "two.yaml"), 0)
    layers = yaml.safe_load((tmp_path / "two.yaml").read_text())["layers"]
    assert [(layer["name"], layer["shape"]) for layer in layers if layer["type"] == "input"] == [
        ("img", list(IMAGE)),
        ("vec", list(VECTOR)),
    ]
    checkpoint = tmp_path / "two.safetensors"
    safetensors.torch.save_file(
        {k: torch.from_numpy(v.copy()) for k, v in _initializers(source).items()}, str(checkpoint)
    )
    from_onnx = invoke("inspect", source, *SHAPES, "--json")
    from_spec = invoke("inspect", checkpoint, "--arch", tmp_path / "two.yaml", "--json")
    assert_clean_exit(from_onnx, 0)
    assert_clean_exit(from_spec, 0)
    onnx_report, spec_report = parse_single_json(from_onnx.stdout), parse_single_json(from_spec.stdout)
    for key in ("input_shape", "parameters", "groups", "paths"):
        assert onnx_report[key] == spec_report[key], key
    assert onnx_report["conditioning"]["before"]["D"] == pytest.approx(
        spec_report["conditioning"]["before"]["D"], rel=1e-9
    )


@pytest.fixture
def open_model(tmp_path):
    path = tmp_path / "open.onnx"
    path.write_bytes(
        _export(_module("concat"), _examples("concat"), _input_names("concat"), "torchscript", open_spatial=True)
    )
    return path


@pytest.mark.parametrize("command", ["inspect", "rescale", "spec"])
def test_a_shape_for_a_name_that_is_no_input_is_a_usage_error(open_model, command):
    assert_clean_exit(
        invoke(command, open_model, *SHAPES, "--input-shape", "image:3,8,8"), 2, "'image'", "'img'", "'vec'"
    )
    assert leftovers(open_model.parent) == []


@pytest.mark.parametrize("command", ["inspect", "rescale", "spec"])
def test_an_open_input_without_a_shape_is_a_usage_error_naming_it(open_model, command):
    assert_clean_exit(
        invoke(command, open_model, "--input-shape", "vec:5"), 2, "'img'", "--input-shape NAME:SHAPE", "img:"
    )
    assert leftovers(open_model.parent) == []


def test_one_unnamed_shape_for_two_inputs_is_a_usage_error(open_model):
    assert_clean_exit(invoke("inspect", open_model, "--input-shape", "3,8,8"), 2, "'img'", "'vec'", "NAME:SHAPE")


def test_a_module_with_two_inputs_is_refused_as_such_not_blamed_on_the_shape():
    """fx import traces one input: a two-input forward is exit 4 naming its inputs, not a
    usage error about the one shape it was given (the run on one zero input fails)."""
    import pathcond_cli
    from pathcond_cli.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="takes 2 inputs \\('img', 'vec'\\).*ONNX export"):
        pathcond_cli.rescale_module(_module("concat"), input_shape=IMAGE)


def test_a_factory_with_two_inputs_given_two_named_shapes_is_refused_naming_them(tmp_path, monkeypatch):
    factory = tmp_path / "two_input_factory.py"
    factory.write_text(
        "import torch\n\n\nclass Two(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.fc = torch.nn.Linear(5, 3)\n\n    def forward(self, img, vec):\n"
        "        return self.fc(torch.relu(img + vec))\n\n\ndef build():\n    return Two()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    checkpoint = tmp_path / "two.safetensors"
    safetensors.torch.save_file({"fc.weight": torch.ones(3, 5), "fc.bias": torch.zeros(3)}, str(checkpoint))
    try:
        assert_clean_exit(
            invoke(
                "inspect",
                checkpoint,
                "--arch",
                "two_input_factory:build",
                "--input-shape",
                "img:5",
                "--input-shape",
                "vec:5",
            ),
            4,
            "2 inputs",
            "'img'",
            "'vec'",
            "ONNX",
        )
    finally:
        sys.modules.pop("two_input_factory", None)
