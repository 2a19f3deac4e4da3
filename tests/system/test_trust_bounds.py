"""Issue 38 (trust round 5), the bounds and the toolkit: every bound ``compare`` and ``prune``
print holds in exact arithmetic whatever float64 does, only where Theorem 4.1 applies, on
networks that stay in float64; path norms of every order, keyed apart; float64 box inputs;
``compare`` refusing other inputs and outputs; the balancing canonical on dead channels; and
``--sparsity`` counting the zeros already there.

Oracles: exact rational path sums (``fractions.Fraction``) and brute-force path enumeration on
tiny MLPs, torch forwards in float64 on inputs of the box."""

from __future__ import annotations

import copy
import itertools
import json
import math
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import safetensors.torch
import torch
import yaml
from cli_support import assert_clean_exit, invoke, leftovers, mlp_spec, mlp_tensors, snapshot, write_mlp
from torch import nn

import pathcond_cli
import pathcond_cli.toolkit as toolkit
from pathcond_cli.analysis import analyse
from pathcond_cli.engine.groups import build_groups
from pathcond_cli.engine.pathlift import PathMetric
from pathcond_cli.errors import MismatchError, UsageError, VerificationError
from pathcond_cli.module_route import module_model, rescale_module
from pathcond_cli.toolkit import compare_models, prune


def _mlp(*weights: list[list[float]], slope: float | None = None) -> nn.Module:
    """A bias-free float64 MLP with these weights, ReLU (or LeakyReLU of ``slope``) between layers."""
    layers: list[nn.Module] = []
    for index, rows in enumerate(weights):
        linear = nn.Linear(len(rows[0]), len(rows), bias=False).double()
        with torch.no_grad():
            linear.weight.copy_(torch.tensor(rows, dtype=torch.float64))
        layers.append(linear)
        if index < len(weights) - 1:
            layers.append(nn.ReLU() if slope is None else nn.LeakyReLU(slope))
    return nn.Sequential(*layers).eval()


def _exact_l1(*weights: list[list[float]]) -> Fraction:
    """‖Φ‖₁ of a bias-free MLP by enumerating its paths, in exact rational arithmetic."""
    total = Fraction(0)
    sizes = [len(weights[0][0])] + [len(w) for w in weights]
    for path in itertools.product(*(range(n) for n in sizes)):
        product = Fraction(1)
        for layer, w in enumerate(weights):
            product *= abs(Fraction(w[path[layer + 1]][path[layer]]))
        total += product
    return total


def _output(module: nn.Module, x: list[float]) -> torch.Tensor:
    with torch.no_grad():
        return module(torch.tensor([x], dtype=torch.float64))[0]


# A path of weight 1e15 beside a path of weight 1: pruning the small one changes the output at
# x = (0, 1) by exactly 1, while ‖Φ‖₁ = 1e15 + 1 leaves no digit of it in ‖Φ(θ)‖₁ − ‖Φ(θ')‖₁.
LARGE = [[1e15, 0.0], [0.0, 1.0]]
READOUT = [[1.0, 1.0]]


def test_a_dominated_metric_keeps_a_change_below_the_norms_rounding():
    """0.8.3 computed d = ‖Φ(θ)‖₁ − ‖Φ(θ')‖₁ from the two norms' logarithms: 0, and printed
    "output change ≤ 0" for a change of 1."""
    original = _mlp(LARGE, READOUT)
    result = prune(module_model(original, (2,)), 0.5, device="cpu")
    pruned = _mlp(
        *(
            [[float(v) for v in row] for row in t.tolist()]
            for t in (result.changed["0.weight"], result.changed["2.weight"])
        )
    )
    truth = _exact_l1(LARGE, READOUT) - _exact_l1(*(m.weight.tolist() for m in pruned if isinstance(m, nn.Linear)))
    assert truth == 1, "the small path is the one pruned"
    assert result.metric.exact and result.metric.upper == pytest.approx(1.0, rel=1e-12)
    change = float((_output(original, [0, 1]) - _output(pruned, [0, 1])).abs().sum())
    assert change == 1.0
    assert result.output_change_bound >= change and result.score_bound >= result.output_change_bound

    comparison = compare_models(module_model(original, (2,)), module_model(pruned, (2,)), device="cpu")
    assert comparison.metric.exact and Fraction(comparison.metric.lower) == pytest.approx(truth, rel=1e-12)
    assert comparison.output_change_bound >= change >= comparison.measured_output_change > 0


def test_the_measured_change_is_checked_against_the_bound_not_against_the_norms(monkeypatch):
    """A bound 1e-4 short of the change the corners reach (1) must fail the run: float64 evaluates
    these outputs (‖Φ‖₁ = 1e6 + 1) within some 1e-9. 0.8.3 allowed an absolute 1e-9 · max(R, 1) ·
    ‖Φ‖₁ over the bound whatever the inputs, 1e-3 here, and passed it."""
    original, pruned = _mlp([[1e6, 0.0], [0.0, 1.0]], READOUT), _mlp([[1e6, 0.0], [0.0, 0.0]], READOUT)
    short = math.log(1 - 1e-4)
    monkeypatch.setattr(toolkit, "path_metric", lambda *args, **kwargs: PathMetric(short, short, True))
    with pytest.raises(VerificationError, match="exceeds its bound"):
        compare_models(module_model(original, (2,)), module_model(pruned, (2,)), device="cpu")
    monkeypatch.undo()
    comparison = compare_models(module_model(original, (2,)), module_model(pruned, (2,)), device="cpu")
    assert comparison.measured_output_change == 1.0 <= comparison.output_change_bound


@pytest.mark.parametrize("slope", [3.0, 10.0])
def test_prune_gives_no_bound_for_leaky_relu(slope):
    """Theorem 4.1 is proved for ReLU only: with slope 3, 0.8.3's prune printed a bound the
    output exceeds inside the box; with slope 10 it called its own run a bug (exit 5)."""
    hidden = [[1.0, -0.01], [0.5, 0.3]]
    module = _mlp(hidden, [[1.0, 1.0]], slope=slope)
    result = prune(module_model(module, (2,)), 0.5, device="cpu")
    assert not result.bound_applies and "ReLU" in result.bound_note
    assert result.output_change_bound is None and result.score_bound is None
    pruned = copy.deepcopy(module)
    with torch.no_grad():
        for key, value in result.changed.items():
            pruned.get_parameter(key).copy_(value)
    corners = torch.tensor(list(itertools.product([-1.0, 1.0], repeat=2)), dtype=torch.float64)
    with torch.no_grad():
        change = float((module(corners) - pruned(corners)).abs().sum(dim=1).max())
    assert change > math.exp(result.metric.ln_upper), "Theorem 4.1's bound would have been false here"


def _brute_log10_norm(q: float, *weights: list[list[float]]) -> float:
    """log10 ‖Φ‖_q of a bias-free MLP by path enumeration, the largest path factored out."""
    sizes = [len(weights[0][0])] + [len(w) for w in weights]
    terms = []
    for path in itertools.product(*(range(n) for n in sizes)):
        terms.append(math.prod(abs(w[path[layer + 1]][path[layer]]) for layer, w in enumerate(weights)))
    largest = max(terms)
    return math.log10(largest) + math.log10(math.fsum((t / largest) ** q for t in terms)) / q


NORM_WEIGHTS = ([[0.3, -0.7, 0.2], [0.9, 0.1, -0.4], [-0.5, 0.6, 0.8]], [[0.4, -0.9, 0.3], [0.7, 0.2, -0.6]])


def test_path_norm_keys_never_collide_and_each_is_its_own_norm():
    """0.8.3 keyed by ``l{q:g}``: Q = 1.0000001 replaced the ℓ1 entry (and compare then took its
    metric from it), 2.0000001 replaced ℓ2, and 3 and 3.0000001 kept one entry."""
    extra = (1.0000001, 2.0000001, 3.0, 3.0000001)
    norms = analyse(module_model(_mlp(*NORM_WEIGHTS), (3,)), device="cpu", path_norms=extra).path_norms
    assert list(norms) == ["l1", "l2", "l1.0000001", "l2.0000001", "l3", "l3.0000001"]
    for key, norm in norms.items():
        assert float(key[1:]) == norm.q
        assert norm.log10 == pytest.approx(_brute_log10_norm(norm.q, *NORM_WEIGHTS), rel=1e-12, abs=1e-13), key


@pytest.mark.parametrize("q", [1000.0, 1e5, 1e12, 1e100, 1e308])
def test_path_norms_of_huge_order_are_exact(q):
    """0.8.3 raised balanced entries below 1 to the power Q: 0 (log10 null) from Q ≈ 1000 on."""
    norms = analyse(module_model(_mlp(*NORM_WEIGHTS), (3,)), device="cpu", path_norms=(q,)).path_norms
    norm = next(norm for norm in norms.values() if norm.q == q)
    assert norm.log10 == pytest.approx(_brute_log10_norm(q, *NORM_WEIGHTS), rel=1e-9)


@pytest.mark.parametrize("radius", [1.1, 3.7, 1e39])
def test_box_inputs_are_float64_and_inside_the_box(radius, monkeypatch):
    """0.8.3 drew the corners in float32: R = 1.1 rounded up to 1.1000000238, outside the box,
    and R ≥ 3.4e38 became inf (exit 1)."""
    fed = []
    real_forward = toolkit.forward

    def recording(graph, params, feeds):
        fed.extend(feeds.values())
        return real_forward(graph, params, feeds)

    monkeypatch.setattr(toolkit, "forward", recording)
    model = module_model(_mlp([[0.5, -0.25]]), (2,))
    compare_models(model, model, input_bound=radius, device="cpu")
    inputs = torch.cat(fed)
    assert inputs.dtype == torch.float64 and float(inputs.abs().max()) == radius
    assert bool((inputs.abs() <= radius).all())


def test_a_bound_reached_exactly_at_a_corner_passes():
    """Pruning one of two unit weights: at the corner x = (R, R) the output moves by R · d, the
    bound itself. With 0.8.3's float32 corners the measured change exceeded it (exit 5)."""
    result = prune(module_model(_mlp([[1.0, 1.0]]), (2,)), 0.5, input_bound=1.1, device="cpu")
    assert result.metric.upper == 1.0
    assert result.measured_output_change == pytest.approx(1.1, rel=1e-15)
    assert result.measured_output_change <= result.output_change_bound


def test_an_input_bound_that_overflows_the_bound_is_a_usage_error():
    model = module_model(_mlp([[2.0, 2.0]]), (2,))
    with pytest.raises(UsageError, match="input-bound"):
        compare_models(model, model, input_bound=1e308, device="cpu")


def _two_output_spec(outputs: list[str]) -> dict:
    spec = mlp_spec()
    spec["outputs"] = outputs
    return spec


@pytest.mark.parametrize("outputs", [["relu1", "fc3"], ["fc3"]])
def test_compare_refuses_other_outputs_with_exit_10(tmp_path, outputs):
    """The same tensors with outputs in another order (0.8.3: exit 5, "a bug in pathcond") or
    other outputs (0.8.3: exit 1) are two architectures."""
    first, spec = write_mlp(tmp_path, "first", spec=_two_output_spec(["fc3", "relu1"]))
    other_spec = tmp_path / "other.arch.yaml"
    other_spec.write_text(yaml.safe_dump(_two_output_spec(outputs)))
    from pathcond_cli.model_files import load

    with pytest.raises(MismatchError, match="outputs"):
        compare_models(load(first, arch=str(spec)), load(first, arch=str(other_spec)), device="cpu")


def test_compare_refuses_other_input_names_with_exit_10(tmp_path):
    first, spec = write_mlp(tmp_path, "first")
    renamed = mlp_spec()
    renamed["layers"][0]["name"] = "pixels"
    other_spec = tmp_path / "renamed.arch.yaml"
    other_spec.write_text(yaml.safe_dump(renamed))
    from pathcond_cli.model_files import load

    with pytest.raises(MismatchError, match="inputs .*'x'.*'pixels'"):
        compare_models(load(first, arch=str(spec)), load(first, arch=str(other_spec)), device="cpu")


def test_compare_and_prune_refuse_networks_that_overflow_float64(tmp_path):
    """Weights × 1e300: 0.8.3 printed metric "–", measured null and wrote the pruned file; a
    self-compare claimed bound 0. rescale refuses such a network (exit 5), and so do these."""
    tensors = {
        key: (value.double() * 1e300 if key.endswith("weight") else value.double())
        for key, value in mlp_tensors().items()
    }
    checkpoint, spec = write_mlp(tmp_path, tensors=tensors)
    before = snapshot(tmp_path)
    result = invoke("compare", checkpoint, checkpoint, "--arch", spec)
    assert_clean_exit(result, 5, "beyond float64")
    result = invoke("prune", checkpoint, "--arch", spec, "--sparsity", "0.5", "-o", tmp_path / "p.safetensors")
    assert_clean_exit(result, 5, "beyond float64")
    assert snapshot(tmp_path) == before and not leftovers(tmp_path)


class _Block(nn.Module):
    """A residual block as timm initialises it (``zero_init_last``): the last BatchNorm has
    γ = 0 and β = 0, and the shortcut, a 1×1 conv, runs after the residual branch."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)
        self.conv2, self.bn2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)
        self.down, self.bn_down = nn.Conv2d(channels, channels, 1, bias=False), nn.BatchNorm2d(channels)
        nn.init.zeros_(self.bn2.weight)

    def forward(self, x):
        residual = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        return torch.relu(residual + self.bn_down(self.down(x)))


class _ZeroInitResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(2, 4, 3, padding=1)
        self.block1, self.block2 = _Block(4), _Block(4)
        self.head = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        return self.head(self.block2(self.block1(torch.relu(self.stem(x)))).flatten(1))


def _zero_init_resnet(dead_channel: bool) -> nn.Module:
    torch.manual_seed(0)
    module = _ZeroInitResNet().double().eval()
    with torch.no_grad():
        for bn in (m for m in module.modules() if isinstance(m, nn.BatchNorm2d)):
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
        if dead_channel:  # a channel that nothing reaches inside block 1, whose output is used
            module.block1.bn1.weight[1] = 0
            module.block1.bn1.bias[1] = 0
            module.block1.bn2.weight.uniform_(0.5, 1.5)
    return module


@pytest.mark.parametrize("dead_channel", [False, True])
def test_compare_against_a_rescaling_is_zero_with_zero_gamma_and_dead_channels(dead_channel):
    """0.8.3 balanced a residual stream by its first layer, the γ = 0 branch (all zero), and
    counted weights leaving dead channels: 1.3 (and 4) times ‖Φ‖₁ against its own rescaling."""
    shape = (2, 4, 4)
    module = _zero_init_resnet(dead_channel)
    original = module_model(module, shape)
    rescaled = copy.deepcopy(module)
    rescale_module(rescaled, shape, device="cpu")
    groups = build_groups(original.graph, original.params)
    moved = module_model(module, shape)
    u = torch.randn(groups.num_free, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 3
    moved.params = {**original.params, **groups.apply(original.params, u)}
    for other in (module_model(rescaled, shape), moved):
        comparison = compare_models(original, other, device="cpu")
        scale = comparison.path_norms_a["l1"].value
        assert comparison.signs.flips == 0 and comparison.metric.upper <= 1e-9 * scale


def test_sparsity_counts_the_weights_already_zero():
    """A dead hidden unit (its outgoing weights 0) has incoming weights of score 0 that come
    before the zeros in the ranking: 0.8.3 chose them and left the zeros on top, 25% for 15%."""
    hidden = [[0.5, -0.4, 0.3], [0.9, 0.1, -0.7], [0.2, 0.8, 0.6], [-0.3, 0.5, 0.4]]
    readout = [[0.0, 1.0, -0.5, 0.25], [0.0, 0.75, 0.5, -1.0]]
    model = module_model(_mlp(hidden, readout), (3,))
    for criterion in ("path-magnitude", "magnitude"):
        result = prune(model, 0.15, criterion=criterion, device="cpu")
        assert sum(layer.zeros_after for layer in result.layers) == round(0.15 * 20), criterion
        assert result.achieved_sparsity == pytest.approx(0.15)
        assert result.score_bound >= result.output_change_bound
    assert prune(model, 0.05, device="cpu").achieved_sparsity == pytest.approx(0.1), "never fewer zeros than before"


def test_a_sparsity_out_of_range_is_refused_before_torch_loads(tmp_path):
    """0.8.3 imported the pruning engine (and torch) to check --criterion, so --sparsity 50 took 1.7 s."""
    probe = (
        "import atexit, sys; atexit.register(lambda: print('torch loaded:', 'torch' in sys.modules, file=sys.stderr)); "
        "sys.argv = ['pathcond', 'prune', 'model.onnx', '--sparsity', '50']; "
        "from pathcond_cli.cli.app import main; main()"
    )
    package_root = str(Path(pathcond_cli.__file__).resolve().parents[1])
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
        env={**os.environ, "PYTHONPATH": package_root},
    )
    assert done.returncode == 2 and "--sparsity" in done.stderr
    assert "torch loaded: False" in done.stderr


def test_compare_applies_arch_to_the_file_that_needs_it(tmp_path):
    """0.8.3 passed --arch to an ONNX model too, which refused it (exit 3)."""
    import onnx
    from onnx import helper, numpy_helper

    checkpoint, spec = write_mlp(tmp_path)
    tensors = safetensors.torch.load_file(checkpoint)
    nodes, initializers, value = [], [], "x"
    for i in (1, 2, 3):
        initializers += [
            numpy_helper.from_array(tensors[f"fc{i}.weight"].numpy(), f"fc{i}.weight"),
            numpy_helper.from_array(tensors[f"fc{i}.bias"].numpy(), f"fc{i}.bias"),
        ]
        nodes.append(
            helper.make_node("Gemm", [value, f"fc{i}.weight", f"fc{i}.bias"], [f"fc{i}"], name=f"fc{i}", transB=1)
        )
        value = f"fc{i}"
        if i < 3:
            nodes.append(helper.make_node("Relu", [value], [f"relu{i}"], name=f"relu{i}"))
            value = f"relu{i}"
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 6])],
        [helper.make_tensor_value_info("fc3", onnx.TensorProto.FLOAT, ["N", 3])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save_model(model, str(tmp_path / "tiny.onnx"))
    result = invoke("compare", tmp_path / "tiny.onnx", checkpoint, "--arch", spec, "--json")
    assert result.exit_code != 3, result.stderr
    if result.exit_code == 0:
        report = json.loads(result.stdout)
        assert report["path_metric"]["upper"] <= 1e-6 * report["path_norms"]["l1"]["value"]
