"""The path-lifting toolkit end to end (SPEC §8): path norms of real architectures against an
independent computation on the torch module itself, ``compare`` exact on pruned pairs and 0 on
rescaled pairs, ``prune``'s mask invariant under rescaling (magnitude pruning's is not), and the
command line's reports, errors and files."""

from __future__ import annotations

import copy
import json
import math

import families
import pytest
import reference_models
import safetensors.torch
import torch
import torch.nn.functional as F
from cli_support import assert_clean_exit, invoke, leftovers, mlp_tensors, snapshot, write_mlp, write_onnx_mlp
from torch import nn

from pathcond_cli.analysis import analyse
from pathcond_cli.errors import MismatchError
from pathcond_cli.model_files import load, save
from pathcond_cli.module_route import module_model, rescale_module
from pathcond_cli.rescaling import rescale
from pathcond_cli.toolkit import compare_models, prune, save_pruned


class _WindowSum(nn.Module):
    """A max-pool neuron in |·|^q network: the sum of its window (zero padding, ceil mode kept)."""

    def __init__(self, pool: nn.MaxPool2d):
        super().__init__()
        assert pool.dilation in (1, (1, 1)), "the independent computation handles undilated pools"
        self.pool = pool

    def forward(self, x):
        pool = self.pool
        return F.avg_pool2d(
            x, pool.kernel_size, pool.stride, pool.padding, pool.ceil_mode, count_include_pad=True, divisor_override=1
        )


class _PoweredMean(nn.Module):
    """Average pooling over uniform windows of n elements: edges of weight 1/n, so (1/n)^q."""

    def __init__(self, pool: nn.Module, q: float):
        super().__init__()
        self.pool, self.q = pool, q

    def forward(self, x):
        y = self.pool(x)
        window = x[0, 0].numel() / y[0, 0].numel()
        assert window == int(window), "uniform windows only"
        return y * window ** (1 - self.q)


class _PoweredBatchNorm(nn.Module):
    """Eval-mode BatchNorm y = a·x + (β − aμ) after a bias-free conv, in the |·|^q network."""

    def __init__(self, bn: nn.BatchNorm2d, q: float):
        super().__init__()
        a = bn.weight.double() / torch.sqrt(bn.running_var.double() + bn.eps)
        self.register_buffer("scale", a.abs() ** q)
        self.register_buffer("shift", (bn.bias.double() - a * bn.running_mean.double()).abs() ** q)

    def forward(self, x):
        return x * self.scale[:, None, None] + self.shift[:, None, None]


def module_path_norm(module: nn.Module, input_shape: tuple[int, ...], q: float) -> float:
    """‖Φ‖_q computed on the user's module with torch alone (the recipe of the seeds' research
    code): every weight and bias |·|^q, max-pools as window sums, average pools weighted (1/n)^q,
    BatchNorm as its folded per-channel affine, all-ones input; ‖Φ‖_q^q is the summed output.
    ReLU needs no change: every value of that network is ≥ 0."""
    powered = copy.deepcopy(module).double().eval()
    for name, child in list(powered.named_modules()):
        replacement = None
        if isinstance(child, (nn.Conv2d, nn.Linear)):
            with torch.no_grad():
                child.weight.copy_(child.weight.abs() ** q)
                if child.bias is not None:
                    child.bias.copy_(child.bias.abs() ** q)
        elif isinstance(child, nn.MaxPool2d):
            replacement = _WindowSum(child)
        elif isinstance(child, (nn.AdaptiveAvgPool2d, nn.AvgPool2d)):
            replacement = _PoweredMean(child, q)
        elif isinstance(child, nn.BatchNorm2d):
            replacement = _PoweredBatchNorm(child, q)
        if replacement is not None:
            parent, _, attribute = name.rpartition(".")
            setattr(powered.get_submodule(parent) if parent else powered, attribute, replacement)
    with torch.no_grad():
        total = powered(torch.ones((1, *input_shape), dtype=torch.float64)).sum()
    return float(total) ** (1 / q)


ARCHITECTURES = {
    # residual blocks, BatchNorm folded into bias-free convs, a 1x1 projection
    "resnet": (reference_models.small_resnet, (3, 16, 16)),
    # concatenation, standalone (pre-activation) BatchNorm, average-pool transitions
    "densenet": (reference_models.small_densenet, (3, 16, 16)),
    # ceil-mode max-pools with partial windows, concatenated fire branches, biases
    "squeezenet": (families.small_squeezenet1_0, (3, 32, 32)),
}


def _module(name: str, seed: int = 0) -> tuple[nn.Module, tuple[int, ...]]:
    factory, shape = ARCHITECTURES[name]
    torch.manual_seed(seed)
    return factory().double().eval(), shape


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_path_norms_of_real_architectures_match_the_module_computed_independently(name):
    module, shape = _module(name)
    analysis = analyse(module_model(module, shape), device="cpu", path_norms=(4,))
    assert list(analysis.path_norms) == ["l1", "l2", "l4"]
    for norm in analysis.path_norms.values():
        expected = module_path_norm(module, shape, norm.q)
        assert norm.value == pytest.approx(expected, rel=1e-9), norm.key


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_rescale_module_leaves_every_path_norm_unchanged(name):
    module, shape = _module(name, seed=1)
    before = {q: module_path_norm(module, shape, q) for q in (1, 2)}
    result = rescale_module(module, shape, device="cpu")
    assert result.solve.u_inf > 0.01, "a rescaling that moves nothing checks nothing"
    for key, q in (("l1", 1), ("l2", 2)):
        assert result.path_norms_after[key].value == pytest.approx(before[q], rel=1e-9)
        assert module_path_norm(module, shape, q) == pytest.approx(before[q], rel=1e-9), "the module itself"


def test_compare_is_exact_on_a_pruned_pair_and_zero_on_a_rescaled_pair(tmp_path):
    module, shape = _module("resnet", seed=2)
    original = module_model(module, shape)
    pruned = prune(original, 0.4, device="cpu")
    pruned_model = module_model(module, shape)
    pruned_model.params = {**original.params, **pruned.changed}
    exact = compare_models(original, pruned_model, device="cpu")
    assert exact.metric.exact and exact.signs.flips == 0
    assert exact.metric.lower == exact.metric.upper == pytest.approx(pruned.metric.lower, rel=1e-12)
    l1 = exact.path_norms_a["l1"].value - exact.path_norms_b["l1"].value
    assert exact.metric.lower == pytest.approx(l1, rel=1e-9)
    assert 0 < exact.measured_output_change <= exact.output_change_bound

    rescaled_module = copy.deepcopy(module)
    rescale_module(rescaled_module, shape, device="cpu")
    equivalent = compare_models(original, module_model(rescaled_module, shape), device="cpu")
    scale = equivalent.path_norms_a["l1"].value
    assert not equivalent.metric.exact
    assert equivalent.metric.upper <= 1e-9 * scale and equivalent.metric.lower <= 1e-9 * scale
    assert equivalent.measured_output_change <= equivalent.output_change_bound + 1e-9 * scale


def test_compare_bounds_a_perturbed_pair_and_refuses_a_bound_with_sign_flips():
    module, shape = _module("squeezenet", seed=3)
    original = module_model(module, shape)
    generator = torch.Generator().manual_seed(0)
    perturbed = {
        key: tensor * (1 + 0.05 * (2 * torch.rand(tensor.shape, generator=generator, dtype=tensor.dtype) - 1))
        if key.endswith("weight")
        else tensor
        for key, tensor in original.params.items()
    }
    other = module_model(module, shape)
    other.params = perturbed
    comparison = compare_models(original, other, input_bound=2.0, device="cpu")
    assert comparison.bound_applies and not comparison.metric.exact
    assert comparison.metric.lower < comparison.metric.upper
    assert comparison.measured_output_change <= comparison.output_change_bound
    rounded_up = 1 + comparison.metric.rounding
    assert comparison.output_change_bound == pytest.approx(2.0 * comparison.metric.upper * rounded_up, rel=1e-12)

    key = next(k for k in perturbed if k.endswith("weight"))
    flipped = dict(perturbed)
    flipped[key] = -perturbed[key]
    other.params = flipped
    comparison = compare_models(original, other, device="cpu")
    assert comparison.signs.flips > 0 and not comparison.bound_applies
    assert comparison.output_change_bound is None and "sign" in comparison.bound_note
    assert sum(layer.flips for layer in comparison.signs.layers) == comparison.signs.flips


@pytest.mark.parametrize("name", ["resnet", "squeezenet"])
def test_path_magnitude_pruning_gives_the_same_mask_after_rescaling_and_magnitude_pruning_does_not(name):
    module, shape = _module(name, seed=4)
    original = module_model(module, shape)
    rescaled_module = copy.deepcopy(module)
    result = rescale_module(rescaled_module, shape, device="cpu")
    assert result.solve.u_inf > 0.1
    rescaled = module_model(rescaled_module, shape)
    for criterion, invariant in (("path-magnitude", True), ("magnitude", False)):
        masks = [
            {key: tensor == 0 for key, tensor in prune(model, 0.5, criterion=criterion, device="cpu").changed.items()}
            for model in (original, rescaled)
        ]
        same = all(torch.equal(masks[0][key], masks[1][key]) for key in masks[0])
        assert same == invariant, criterion


def test_per_layer_pruning_prunes_each_layer_by_the_share():
    module, shape = _module("resnet", seed=5)
    result = prune(module_model(module, shape), 0.25, per_layer=True, device="cpu")
    for layer in result.layers:
        assert layer.zeros_after == round(0.25 * layer.parameters), layer.layer
    assert result.achieved_sparsity == pytest.approx(0.25, abs=0.01)


# --------------------------------------------------------------------------- command line


def _json(result) -> dict:
    return json.loads(result.stdout)


def test_inspect_reports_the_path_norms_asked_for(tmp_path):
    checkpoint, spec = write_mlp(tmp_path)
    result = invoke("inspect", checkpoint, "--arch", spec, "--json", "--path-norm", "4", "--path-norm", "1.5")
    assert_clean_exit(result, 0)
    norms = _json(result)["path_norms"]
    assert list(norms) == ["l1", "l2", "l4", "l1.5"]
    tensors = {k: v.double() for k, v in mlp_tensors().items()}
    model = load(checkpoint, arch=str(spec))
    model.params = tensors
    assert norms["l4"]["log10"] == pytest.approx(
        analyse(model, device="cpu", path_norms=(4,)).path_norms["l4"].log10, rel=1e-6
    )
    bad = invoke("inspect", checkpoint, "--arch", spec, "--path-norm", "0.5")
    assert bad.exit_code == 2 and "--path-norm" in bad.stderr


def test_rescale_fails_with_exit_5_when_the_written_path_norms_differ(tmp_path, monkeypatch):
    import pathcond_cli.analysis as analysis

    checkpoint, spec = write_mlp(tmp_path)
    real = analysis.path_norms_of
    calls = []

    def drifted(groups, orders, **options):
        calls.append(1)
        norms = real(groups, orders, **options)
        if len(calls) == 1:
            return norms
        return {key: type(norm)(norm.q, norm.log10 + 1e-3) for key, norm in norms.items()}

    monkeypatch.setattr(analysis, "path_norms_of", drifted)
    before = snapshot(tmp_path)
    result = invoke("rescale", checkpoint, "--arch", spec, "-o", tmp_path / "out.safetensors")
    assert_clean_exit(result, 5, "path norm", "nothing was written")
    assert snapshot(tmp_path) == before and not leftovers(tmp_path)


def test_compare_command_on_a_pruned_onnx_pair(tmp_path):
    original = write_onnx_mlp(tmp_path / "model.onnx")
    pruned = tmp_path / "pruned.onnx"
    result = invoke("prune", original, "--sparsity", "0.5", "-o", pruned, "--json")
    assert_clean_exit(result, 0)
    report = _json(result)
    assert report["command"] == "prune" and report["path_metric"]["exact"]
    assert report["verification"]["independent"] == "passed"
    assert report["measured_output_change"] <= report["output_change_bound"] <= report["score_bound"] * (1 + 1e-9)
    assert abs(report["sparsity_achieved"] - 0.5) < 0.02

    result = invoke("compare", original, pruned, "--json", "--input-bound", "3")
    assert_clean_exit(result, 0)
    comparison = _json(result)
    assert comparison["path_metric"]["exact"] and comparison["sign_flips"]["total"] == 0
    assert comparison["path_metric"]["lower"] == pytest.approx(report["path_metric"]["lower"], rel=1e-9)
    assert comparison["output_change_bound"] == pytest.approx(3 * comparison["path_metric"]["upper"], rel=1e-9)
    assert comparison["measured_output_change"] <= comparison["output_change_bound"]


def test_pruned_file_holds_exactly_the_masked_weights(tmp_path):
    checkpoint, spec = write_mlp(tmp_path)
    out = tmp_path / "pruned.safetensors"
    result = invoke("prune", checkpoint, "--arch", spec, "--sparsity", "0.3", "-o", out, "--criterion", "magnitude")
    assert_clean_exit(result, 0)
    before, after = safetensors.torch.load_file(checkpoint), safetensors.torch.load_file(out)
    assert set(before) == set(after)
    for key, tensor in before.items():
        kept = after[key] != 0
        assert torch.equal(after[key][kept], tensor[kept]), key
        if key.endswith("bias"):
            assert torch.equal(after[key], tensor), "biases are kept"
    pruned = sum(int((after[k] == 0).sum()) for k in after if k.endswith("weight"))
    total = sum(after[k].numel() for k in after if k.endswith("weight"))
    assert pruned == round(0.3 * total)


def test_compare_refuses_two_architectures_with_exit_10_naming_the_first_difference(tmp_path):
    small, spec = write_mlp(tmp_path, "small")
    wide, wide_spec = write_mlp(tmp_path, "wide", dims=(6, 9, 5, 3))
    deeper, deeper_spec = write_mlp(tmp_path, "deeper", dims=(6, 8, 5, 4, 3))
    before = snapshot(tmp_path)
    result = invoke("compare", small, wide, "--arch", spec, "--json")
    assert_clean_exit(result, 10, "fc1.weight", "[8, 6]", "[9, 6]", "nothing was compared")
    document = _json(result)
    assert document["command"] == "compare" and document["other"].endswith("wide.safetensors")
    assert document["error"]["exit_code"] == 10 and document["error"]["type"] == "MismatchError"
    with pytest.raises(MismatchError, match="nodes"):
        compare_models(load(small, arch=str(spec)), load(deeper, arch=str(deeper_spec)))
    result = invoke(
        "compare", write_onnx_mlp(tmp_path / "small.onnx"), write_onnx_mlp(tmp_path / "deep.onnx", dims=(6, 8, 5, 4, 3))
    )
    assert_clean_exit(result, 10, "nodes", "nothing was compared")
    assert all(snapshot(tmp_path)[name] == digest for name, digest in before.items())
    assert not leftovers(tmp_path)


def test_prune_never_writes_over_its_input_and_refuses_bad_options(tmp_path):
    checkpoint, spec = write_mlp(tmp_path)
    before = snapshot(tmp_path)
    result = invoke("prune", checkpoint, "--arch", spec, "--sparsity", "1.5")
    assert result.exit_code == 2 and "--sparsity" in result.stderr
    result = invoke("prune", checkpoint, "--arch", spec, "--sparsity", "0.5", "--criterion", "random")
    assert result.exit_code == 2 and "--criterion" in result.stderr
    result = invoke("prune", checkpoint, "--arch", spec, "--sparsity", "0.5", "-o", checkpoint)
    assert_clean_exit(result, 6)
    assert snapshot(tmp_path) == before
    result = invoke("prune", checkpoint, "--arch", spec, "--sparsity", "0.5")
    assert_clean_exit(result, 0)
    assert (tmp_path / "tiny.pruned.safetensors").is_file()


def test_saved_rescaled_file_reports_unchanged_path_norms(tmp_path):
    checkpoint, spec = write_mlp(tmp_path)
    model = load(checkpoint, arch=str(spec))
    result = rescale(model, device="cpu")
    save(result, tmp_path / "out.safetensors")
    for key, norm in result.analysis.path_norms.items():
        assert math.isclose(result.path_norms_after[key].log10, norm.log10, rel_tol=1e-6)
    pruned = prune(model, 0.5, device="cpu")
    checks = save_pruned(pruned, tmp_path / "p.safetensors")
    assert checks["reloaded"] == "exact" and checks["independent"] == "unavailable"


def test_path_norms_agree_across_routes(tmp_path, monkeypatch):
    """The module, its ONNX export (BatchNorm kept) and its safetensors checkpoint read through
    ``--arch module:factory`` give the path norms the module gives computed independently."""
    import onnx_models

    shape = (3, 16, 16)
    torch.manual_seed(6)
    module = reference_models.small_resnet().eval()
    expected = {key: module_path_norm(module, shape, q) for key, q in (("l1", 1), ("l2", 2), ("l3", 3))}

    def check(norms):
        assert list(norms) == list(expected)
        for key, value in expected.items():
            found = norms[key].value if hasattr(norms[key], "value") else norms[key]["value"]
            assert found == pytest.approx(value, rel=1e-9), key

    check(analyse(module_model(module, shape), device="cpu", path_norms=(3,)).path_norms)
    exported = tmp_path / "model.onnx"
    exported.write_bytes(onnx_models.export(module, torch.randn(2, *shape), "torchscript-unfolded"))
    check(analyse(load(exported), device="cpu", path_norms=(3,)).path_norms)

    (tmp_path / "resnet_factory.py").write_text(
        "import torch\nimport reference_models\n\n\ndef build():\n    torch.manual_seed(6)\n"
        "    return reference_models.small_resnet().eval()\n"
    )
    safetensors.torch.save_file(module.state_dict(), str(tmp_path / "model.safetensors"))
    monkeypatch.chdir(tmp_path)
    result = invoke(
        "inspect",
        "model.safetensors",
        "--arch",
        "resnet_factory:build",
        "--input-shape",
        "3,16,16",
        "--json",
        "--path-norm",
        "3",
    )
    assert_clean_exit(result, 0)
    check(_json(result)["path_norms"])
