"""How often one `pathcond rescale` computes each rescaled tensor, serialises the ONNX model,
bins log g and runs the squared network: work a run repeated is counted, not timed.

A rescaled tensor is computed from the original when read (``RescaledTensors``), so counting
those reads counts its computations. Without holding every rescaled tensor at once, which the
memory bound (tests/system/test_memory_bound.py) forbids, the write is where each is computed: the
storage check, the auto bound and the non-finite check run on the tensor the writer computes,
and the verification reads the written file.
"""

from __future__ import annotations

from collections import Counter

import onnx
import onnx_models
import pytest
import torch
from cli_support import assert_clean_exit, invoke, parse_single_json, write_mlp

import pathcond_cli.analysis
import pathcond_cli.engine.groups
import pathcond_cli.engine.model
import pathcond_cli.model_files
import pathcond_cli.rescaling
from pathcond_cli.errors import VerificationError

COMPUTATIONS_PER_TENSOR = 1


@pytest.fixture
def counted(monkeypatch):
    """Counts of rescaled-tensor computations by key, full ONNX serialisations, histc calls."""
    counts = {"computed": Counter(), "serialised": [], "histc": 0}
    compute = pathcond_cli.engine.groups.RescaledTensors.__getitem__

    def counting_compute(self, key):
        if key in self and key not in self._assigned:  # a key it does not change is a KeyError, not work
            counts["computed"][key] += 1
        return compute(self, key)

    serialise = onnx.ModelProto.SerializeToString

    def counting_serialise(self, *args, **kwargs):
        data = serialise(self, *args, **kwargs)
        counts["serialised"].append(len(data))
        return data

    histc = torch.histc

    def counting_histc(*args, **kwargs):
        counts["histc"] += 1
        return histc(*args, **kwargs)

    monkeypatch.setattr(pathcond_cli.engine.groups.RescaledTensors, "__getitem__", counting_compute)
    monkeypatch.setattr(onnx.ModelProto, "SerializeToString", counting_serialise)
    monkeypatch.setattr(torch, "histc", counting_histc)
    return counts


def _rescale(*args) -> dict:
    result = invoke("rescale", *args, "--json", "--device", "cpu")
    assert_clean_exit(result, 0)
    return parse_single_json(result.stdout)


def _cnn() -> torch.nn.Module:
    """Weights of more than 1,024 elements, which shape inference leaves out of the copy it serialises."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1),
        torch.nn.BatchNorm2d(16),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1),
        torch.nn.BatchNorm2d(32),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(32 * 2 * 2, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 10),
    )
    for layer in module:
        if isinstance(layer, torch.nn.BatchNorm2d):
            torch.nn.init.uniform_(layer.running_var, 0.5, 2.0)
    return module.eval()


def test_onnx_rescale_computes_each_tensor_twice_and_serialises_once(tmp_path, counted):
    path = tmp_path / "cnn.onnx"
    path.write_bytes(onnx_models.export(_cnn(), torch.randn(2, 3, 8, 8), "torchscript-unfolded"))
    out = tmp_path / "out.onnx"
    report = _rescale(path, "-o", out)
    computed = counted["computed"]
    assert len(computed) >= 6 and set(computed.values()) == {COMPUTATIONS_PER_TENSOR}, computed
    # Shape inference serialises a copy without the large weights: the model itself is serialised once.
    assert sum(size > out.stat().st_size // 2 for size in counted["serialised"]) == 1, counted["serialised"]
    # One histc per DAG tensor for each of the two histograms (before and after), and no more:
    # the per-layer statistics come from the summary pass, and no report is built twice.
    tensors = len(report["diag_g"]["per_layer"]) * 2  # each layer here has a weight and a bias
    assert counted["histc"] <= 2 * tensors


def test_onnx_rescale_builds_the_groups_once(tmp_path, monkeypatch):
    """The written file's path norms are read on the analysis's groups (its graph is the
    original's node for node): the groups are built once a run, not again for the file."""
    path = tmp_path / "cnn.onnx"
    path.write_bytes(onnx_models.export(_cnn(), torch.randn(2, 3, 8, 8), "torchscript-unfolded"))
    built = []
    build = pathcond_cli.engine.groups.build_groups
    counting = lambda *args, **kwargs: built.append(1) or build(*args, **kwargs)  # noqa: E731
    monkeypatch.setattr(pathcond_cli.engine.groups, "build_groups", counting)
    monkeypatch.setattr(pathcond_cli.analysis, "build_groups", counting)
    report = _rescale(path, "-o", tmp_path / "out.onnx")
    assert report["path_norms_after"].keys() == report["path_norms"].keys()
    assert len(built) == 1


def test_a_quiet_rescale_computes_no_report(tmp_path, counted, monkeypatch):
    """Under -q with no --json, --report or --plot nobody reads the report: neither it nor its
    facts (the histograms, the zeros' causes) are computed; the file is written and verified."""
    checkpoint, spec = write_mlp(tmp_path)
    monkeypatch.setattr(
        pathcond_cli.rescaling.RescaleResult, "gather_report_facts", lambda self: pytest.fail("facts computed")
    )
    out = tmp_path / "out.safetensors"
    result = invoke("rescale", checkpoint, "--arch", spec, "-o", out, "-q", "--device", "cpu")
    assert_clean_exit(result, 0)
    assert out.exists() and result.stdout == "" and counted["histc"] == 0


def test_safetensors_rescale_computes_each_tensor_twice(tmp_path, counted):
    checkpoint, spec = write_mlp(tmp_path)
    _rescale(checkpoint, "--arch", spec, "-o", tmp_path / "out.safetensors")
    computed = counted["computed"]
    assert computed and set(computed.values()) == {COMPUTATIONS_PER_TENSOR}, computed


def test_a_non_finite_rescaled_tensor_is_refused_by_the_write_that_computes_it(tmp_path):
    """Without a storage check left to it, the write still checks each tensor's values as it
    computes them: a NaN stops it, and nothing is left behind."""
    checkpoint, spec = write_mlp(tmp_path)
    result = pathcond_cli.rescaling.rescale(
        pathcond_cli.model_files.load(checkpoint, arch=str(spec)), device="cpu", verify=False
    )
    key = next(iter(result.changed))
    result.changed[key] = torch.full_like(result.changed[key], float("nan"))
    out = tmp_path / "out.safetensors"
    with pytest.raises(VerificationError, match="NaN or Inf"):
        pathcond_cli.model_files.save(result, out)
    assert not out.exists()


@pytest.mark.parametrize("arch", ["mlp", "conv_residual", "concat"])
def test_diag_g_pass_gives_the_l2_path_norm(nets, monkeypatch, arch):
    """diag(G)'s forward pass is the squared network of power 2 on the balanced ψ = (Dθ)², whose
    total is ‖Φ‖₂²: the analysis takes ℓ2 from it, bit for bit what a pass of its own gives, and
    runs three squared-network passes (diag(G), path count, ℓ1), not four."""
    from pathcond_cli.engine import diag as diag_module

    graph, params = nets.catalogue[arch]()
    model = pathcond_cli.engine.model.LoadedModel(graph, params, "safetensors", arch)
    passes = []
    # Every squared-network pass, of one power or several in one sweep, goes through squared_networks.
    squared_networks = diag_module.squared_networks
    monkeypatch.setattr(
        diag_module, "squared_networks", lambda *a, **k: passes.extend(k["powers"]) or squared_networks(*a, **k)
    )
    analysis = pathcond_cli.analysis.analyse(model, device="cpu")
    assert sorted(passes) == [0, 1, 2]
    groups = analysis.groups
    u_ext = groups.extend(diag_module.balancing_exponents(groups))
    assert analysis.path_norms["l2"] == diag_module.path_norm(groups, 2.0, u_ext=u_ext)
