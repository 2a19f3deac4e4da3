"""Differences and negations of activations: ``a - b`` is a ``sub`` node (fixed edges +1 and −1,
channels tied as a sum's), ``-x`` a ``scale`` node of factor −1.

The brute-force oracle checks (groups, diag(G), path count, path norms, path-metric, function
preserved) run on ``conftest.sub_net`` (test_ops_oracle.py, test_pathlift_oracle.py); fx, spec
and both ONNX exporters on ``ops_models.Differences`` (test_ops_import.py, test_parity.py). Here:
the ONNX files compute the module and, rescaled, compute the same under onnxruntime; ONNX Sub
and Neg (refused before: Sub unsupported, Neg listed as not homogeneous) and fx ``a - b``
load; the squared network of a difference is the sum's; what is refused, with the reason.
"""

from __future__ import annotations

import numpy as np
import ops_models
import pytest
import torch
import torch.nn as nn
from conftest import NetBuilder
from onnx import helper
from onnx_models import EXPORTERS, export
from test_onnx_format import TOLERANCE, _model, _tensor, only_output, random_rescaling, relative_error

from pathcond_cli.engine.diag import diag_g, path_count, path_norm
from pathcond_cli.engine.graph import Add, Graph, Scale, Sub
from pathcond_cli.engine.groups import build_groups
from pathcond_cli.errors import InputError, UnsupportedModelError
from pathcond_cli.io.formats.onnx_format import load_onnx, write_onnx
from pathcond_cli.io.formats.spec import graph_from_spec
from pathcond_cli.module_route import module_model

pytestmark = pytest.mark.filterwarnings("ignore")


def _run(source, x: np.ndarray) -> np.ndarray:
    import onnxruntime

    session = onnxruntime.InferenceSession(source if isinstance(source, bytes) else str(source))
    return session.run(None, {session.get_inputs()[0].name: x})[0]


def _rescaled_file_computes_the_same(data: bytes, x: np.ndarray, tmp_path) -> None:
    model = load_onnx(data)
    assert relative_error(only_output(model, torch.from_numpy(x)), _run(data, x)) <= TOLERANCE
    changed = random_rescaling(model)
    assert changed
    destination = tmp_path / "rescaled.onnx"
    write_onnx(model, changed, destination, {})
    assert relative_error(_run(destination, x), _run(data, x)) <= TOLERANCE


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_exported_differences_compute_the_module_and_rescaled_file_the_same(exporter, tmp_path):
    module, shape = ops_models.build("differences")
    x = torch.randn((3, *shape), generator=torch.Generator().manual_seed(4))
    data = export(module, x, exporter)
    model = load_onnx(data)
    assert sum(isinstance(n, Sub) for n in model.graph.nodes) == 2
    assert [n.factor for n in model.graph.nodes if isinstance(n, Scale)] == [-1.0]
    with torch.no_grad():
        expected = module.double()(x.double())
    assert relative_error(only_output(model, x), expected) <= TOLERANCE
    _rescaled_file_computes_the_same(data, x.numpy(), tmp_path)


def _sub_neg_model(*, subtrahend: str = "b") -> bytes:
    """fc_a(x) − fc_b(x) → Relu → Neg → Gemm: Sub of two activations and Neg (refused before)."""
    rng = np.random.default_rng(5)
    nodes = [
        helper.make_node("Gemm", ["x", "wa"], ["a"], transB=1, name="fc_a"),
        helper.make_node("Gemm", ["x", "wb"], ["b"], transB=1, name="fc_b"),
        helper.make_node("Sub", ["a", subtrahend], ["d"], name="diff"),
        helper.make_node("Relu", ["d"], ["r"], name="relu"),
        helper.make_node("Neg", ["r"], ["n"], name="negate"),
        helper.make_node("Gemm", ["n", "wc"], ["y"], transB=1, name="fc_c"),
    ]
    initializer = [_tensor(name, rng.normal(size=(4, 4))) for name in ("wa", "wb", "wc")]
    initializer.append(_tensor("c", rng.normal(size=(4,))))
    return _model(nodes, initializer, opset=17)


def test_onnx_sub_of_two_activations_and_neg_load_and_rescale(tmp_path):
    data = _sub_neg_model()
    graph = load_onnx(data).graph
    assert isinstance(graph["diff"], Sub) and graph["diff"].inputs == ("fc_a", "fc_b")
    assert isinstance(graph["negate"], Scale) and graph["negate"].factor == -1.0
    x = np.random.default_rng(6).normal(size=(5, 4)).astype(np.float32)
    _rescaled_file_computes_the_same(data, x, tmp_path)


def test_onnx_sub_of_a_stored_constant_is_refused_with_the_reason():
    with pytest.raises(UnsupportedModelError, match="only a difference of two activations is supported"):
        load_onnx(_sub_neg_model(subtrahend="c"))


class _Difference(nn.Module):
    def __init__(self, subtract_number: bool = False):
        super().__init__()
        self.a, self.b, self.fc = nn.Linear(3, 4), nn.Linear(3, 4), nn.Linear(4, 2)
        self.subtract_number = subtract_number

    def forward(self, x):
        y = torch.relu(self.a(x) - (1.0 if self.subtract_number else self.b(x)))
        return self.fc(-y)


def test_fx_difference_and_negation_are_nodes_and_compute_the_module():
    module = _Difference().double().eval()
    model = module_model(module, (3,))
    ops = [n.op for n in model.graph.nodes]
    assert "sub" in ops and any(isinstance(n, Scale) and n.factor == -1.0 for n in model.graph.nodes)
    x = torch.randn((4, 3), dtype=torch.float64)
    assert relative_error(only_output(model, x), module(x).detach()) <= 1e-12


class _ShapeBranchDifference(_Difference):
    """A forward that branches on its input's shape, which torch.fx cannot trace: read through
    torch.export, whose ATen ``sub``/``neg`` are mapped back to ``torch.sub``/``torch.neg``."""

    def forward(self, x):
        if x.shape[-1] > 2:
            return super().forward(x)
        return self.fc(torch.relu(self.a(x)))


def test_a_difference_read_through_torch_export_is_a_node():
    module = _ShapeBranchDifference().double().eval()
    model = module_model(module, (3,))
    assert "sub" in [n.op for n in model.graph.nodes]
    assert any(isinstance(n, Scale) and n.factor == -1.0 for n in model.graph.nodes)
    x = torch.randn((4, 3), dtype=torch.float64)
    assert relative_error(only_output(model, x), module(x).detach()) <= 1e-12


def test_fx_subtracting_a_number_is_refused_with_the_reason():
    with pytest.raises(UnsupportedModelError, match="subtracting the number 1.0"):
        module_model(_Difference(subtract_number=True).eval(), (3,))


def test_a_spec_difference_takes_exactly_two_inputs():
    spec = {
        "layers": [
            {"name": "x", "type": "input", "shape": [3]},
            {"name": "a", "type": "linear"},
            {"name": "b", "type": "linear", "inputs": "x"},
            {"name": "d", "type": "sub", "inputs": ["a", "b", "x"]},
        ]
    }
    with pytest.raises(InputError, match="layer 'd' \\(sub\\) reads exactly 2 inputs, and is given 3"):
        graph_from_spec(spec, source="spec")


def test_the_squared_network_of_a_difference_is_the_sums():
    """|−1|^q = 1: diag(G), the path count and every path norm of ``a − b`` are those of ``a + b``."""
    builder = NetBuilder((3,), seed=1)
    stem = builder.relu(builder.linear(4))
    left, right = builder.linear(3, src=stem), builder.linear(3, src=stem)
    builder.sub(left, right)
    builder.relu()
    builder.linear(2)
    graph, params = builder.build()
    as_sum = Graph([Add(n.name, n.inputs) if isinstance(n, Sub) else n for n in graph.nodes], graph.outputs)
    difference, total = build_groups(graph, params), build_groups(as_sum, params)
    for a, b in zip(diag_g(difference).log_g, diag_g(total).log_g):
        assert torch.equal(a, b)
    assert path_count(difference).exact == path_count(total).exact
    for q in (1, 2):
        assert path_norm(difference, q).log10 == pytest.approx(path_norm(total, q).log10, rel=1e-12)
