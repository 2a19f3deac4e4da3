"""The conditioning measure D and the after-rescaling state.

D(θ) = p · ln(mean g / geomean g) over g > 0 (SPEC §4). Checked against a direct numpy
formula, against F (F(u) − F(0) = D(θ_u) − D(θ) when every g > 0), and the predicted
after-state log g − 2(Bu) against a brute-force diag(JᵀJ) of the rescaled parameters and
against a fresh diag(G) pass over the tensors pathcond writes.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from cli_support import SAMPLES, assert_clean_exit, check_report, invoke, mlp_tensors, parse_single_json, write_mlp
from oracle import build_neuron_dag, to_theta_order

from pathcond_cli import analyse, load, rescale
from pathcond_cli.engine.groups import build_groups
from pathcond_cli.engine.model import LoadedModel
from pathcond_cli.rescaling import rescaled_diag
from pathcond_cli.solve.objective import Objective
from pathcond_cli.statistics import conditioning

ORACLE_ARCHS = ["mlp", "conv_bn", "residual", "conv_maxpool"]


def _numpy_d(log_g: list[torch.Tensor]) -> float:
    """D with p the support's size, g > 0 (SPEC §4)."""
    g = np.exp(np.concatenate([lg.numpy().ravel() for lg in log_g]))
    positive = g[g > 0]
    return positive.size * (math.log(positive.mean()) - np.log(positive).mean())


def _model(graph, params) -> LoadedModel:
    return LoadedModel(graph, params, "module", "test-network", arch_source="module")


# -- D itself -----------------------------------------------------------------------------------


def test_d_matches_the_formula_and_leaves_zeros_out():
    generator = torch.Generator().manual_seed(0)
    log_g = [torch.randn(40, 7, generator=generator, dtype=torch.float64) * 3, torch.randn(40, dtype=torch.float64)]
    log_g[0][3, :] = -torch.inf
    log_g[1][5] = -torch.inf
    p = sum(lg.numel() for lg in log_g) - 8
    measure = conditioning(log_g)
    assert measure.zeros == 8 and measure.counted == p
    assert measure.value == pytest.approx(_numpy_d(log_g), rel=1e-12)
    assert measure.per_parameter == pytest.approx(measure.value / p, rel=1e-12)
    assert measure.value > 0


def test_d_is_zero_for_constant_g_and_blind_to_a_common_scale():
    constant = [torch.full((5, 3), -4.0, dtype=torch.float64), torch.full((5,), -4.0, dtype=torch.float64)]
    assert conditioning(constant).value == 0.0
    generator = torch.Generator().manual_seed(1)
    log_g = [torch.randn(30, generator=generator, dtype=torch.float64)]
    shifted = [lg + 123.4 for lg in log_g]  # g → e^123.4 g: the λ of the Bregman divergence absorbs it
    assert conditioning(shifted).value == pytest.approx(conditioning(log_g).value, rel=1e-9)


def test_d_of_all_zero_g_is_zero_with_every_parameter_counted_as_zero():
    measure = conditioning([torch.full((4,), -torch.inf, dtype=torch.float64)])
    assert (measure.value, measure.counted, measure.zeros) == (0.0, 0, 4)


# -- the after state ----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ORACLE_ARCHS)
def test_after_state_equals_brute_force_diag_of_the_rescaled_parameters(nets, arch):
    """log g − 2(Bu) (no second pass) is diag(JᵀJ) of the rescaled network, path by path."""
    graph, params = nets.catalogue[arch](0)
    result = rescale(_model(graph, params), device="cpu")
    assert result.solve.u_inf > 1e-3, "the test needs a rescaling that moves g"
    dag = build_neuron_dag(graph, result.rescaled_params)
    # Same layout as the original groups; built on the rescaled values so the oracle's θ check holds.
    layout = build_groups(graph, result.rescaled_params)
    predicted = to_theta_order(dag, layout, [lg.exp() for lg in result.diag_after.log_g])
    brute_force = dag.diag_G()
    assert (brute_force > 0).all()
    assert ((predicted - brute_force).abs() / brute_force).max().item() <= 1e-9


@pytest.mark.parametrize("sample", ["resnet_small.onnx", "cifar_nv_small.safetensors"])
def test_after_state_equals_a_fresh_diag_pass_over_the_rescaled_tensors(sample):
    """BatchNorm networks: the tensors written back (γ, β carry the post-BN scale) give the predicted g."""
    loaded = load(SAMPLES / sample)
    # float64 tensors, so the comparison is not blurred by rounding the result to float32.
    params = {key: t.double() if t.is_floating_point() else t for key, t in loaded.params.items()}
    model = LoadedModel(loaded.graph, params, loaded.format, loaded.source)
    result = rescale(model, device="cpu")
    fresh = analyse(LoadedModel(model.graph, result.rescaled_params, model.format, model.source), device="cpu")
    for predicted, measured in zip(result.diag_after.log_g, fresh.diag.log_g):
        torch.testing.assert_close(predicted, measured, rtol=0, atol=1e-9)
    assert result.conditioning_after.value == pytest.approx(fresh.conditioning.value, rel=1e-9)


@pytest.mark.parametrize("arch", ORACLE_ARCHS)
def test_objective_change_equals_d_change_when_every_g_is_positive(nets, arch):
    """F(u) − F(0) = D(θ_u) − D(θ) (SPEC §4), at the optimum and at an arbitrary u."""
    graph, params = nets.catalogue[arch](1)
    result = rescale(_model(graph, params), device="cpu")
    analysis = result.analysis
    p = analysis.groups.p
    assert analysis.conditioning.zeros == 0
    d_change = result.conditioning_after.value - analysis.conditioning.value
    f_change = result.solve.objective[-1] - result.solve.objective[0]
    assert d_change == pytest.approx(f_change, rel=1e-9, abs=1e-9 * p)
    assert d_change < 0
    objective = Objective(analysis.groups, analysis.diag)
    u = torch.randn(analysis.groups.num_free, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    moved = conditioning(rescaled_diag(analysis.groups, analysis.diag, u).log_g).value
    f_moved = objective.evaluate(u).value - objective.evaluate(torch.zeros_like(u)).value
    assert moved - analysis.conditioning.value == pytest.approx(f_moved, rel=1e-9, abs=1e-9 * p)


def test_zero_g_stay_zero_and_are_reported_before_and_after(tmp_path):
    tensors = mlp_tensors()
    tensors["fc1.weight"][2] = 0.0  # neuron 2 of the first layer: no input ...
    tensors["fc1.bias"][2] = 0.0  # ... and no bias: every path through it has weight 0
    checkpoint, spec = write_mlp(tmp_path, tensors=tensors)
    result = invoke("rescale", checkpoint, "--arch", spec, "-o", tmp_path / "out.safetensors", "--json")
    assert_clean_exit(result, 0)
    report = parse_single_json(result.stdout)
    check_report(report, rescale=True)
    before, after = report["conditioning"]["before"], report["conditioning"]["after"]
    assert before["zeros"] == after["zeros"] == report["diag_g"]["zeros"] == report["diag_g_after"]["zeros"] > 0
    assert after["D"] < before["D"]


# -- a pathcond output, inspected and rescaled again --------------------------------------------


@pytest.fixture(scope="module")
def twice(tmp_path_factory):
    """The CIFAR-NV sample (its log10 spread of diag(G) goes up) rescaled, inspected, rescaled again."""
    directory = tmp_path_factory.mktemp("twice")
    once, again = directory / "once.safetensors", directory / "again.safetensors"
    first = invoke("rescale", SAMPLES / "cifar_nv_small.safetensors", "-o", once, "--json")
    inspected = invoke("inspect", once, "--json")
    second = invoke("rescale", once, "-o", again, "--json")
    for result in (first, inspected, second):
        assert_clean_exit(result, 0)
    return [parse_single_json(r.stdout) for r in (first, inspected, second)]


def test_inspect_of_an_output_shows_the_after_state(twice):
    first, inspected, _ = twice
    check_report(inspected, rescale=False)
    assert inspected["arch_source"] == "metadata"
    assert inspected["conditioning"]["before"]["D"] == pytest.approx(first["conditioning"]["after"]["D"], rel=1e-6)
    after, seen = first["diag_g_after"], inspected["diag_g"]
    for key in ("log10_min", "log10_max", "log10_spread"):
        assert seen[key] == pytest.approx(after[key], abs=1e-5), key
    for row_after, row_seen in zip(after["per_layer"], seen["per_layer"]):
        assert row_seen["layer"] == row_after["layer"]
        assert row_seen["log10_min"] == pytest.approx(row_after["log10_min"], abs=1e-5)
        assert row_seen["log10_max"] == pytest.approx(row_after["log10_max"], abs=1e-5)


def test_spread_can_rise_while_d_falls(twice):
    """The README's explanation rests on this sample: D is what PathCond minimises, not max/min."""
    first, _, _ = twice
    assert first["conditioning"]["after"]["D"] < 0.5 * first["conditioning"]["before"]["D"]
    assert first["diag_g_after"]["log10_spread"] > first["diag_g"]["log10_spread"]


def test_rescaling_an_output_again_is_a_no_op_up_to_the_tolerance(twice):
    first, _, second = twice
    check_report(second, rescale=True)
    assert second["solver"]["converged"]
    assert second["u_inf"] <= 1e-3
    d = first["conditioning"]["after"]["D"]
    assert abs(second["conditioning"]["decrease"]) <= 1e-6 * d
    assert abs(second["solver"]["decrease"]) <= 1e-6 * d
    assert second["conditioning"]["after"]["D"] == pytest.approx(d, rel=1e-6)
