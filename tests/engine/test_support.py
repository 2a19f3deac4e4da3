"""The objective on the support of diag(G) (SPEC §4 corrected).

Every sum of F (p, S, k_h, and A_h, C_h of SPEC §5) runs over the parameters with g > 0, so

    F(u) − F(0) = D(θ_u) − D(θ)

holds on every network, zeros in diag(G) included, and minimising F never raises D. Checked
with θ_u the tensors pathcond actually writes and diag(G) recomputed from them by a fresh pass
(not by g e^{−2Bu}); against brute-force path enumeration on tiny networks; and as D after ≤ D
before on every model family, with and without the last BatchNorm γ of each block zeroed (as
timm initialises it).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from families import FAMILIES, small_regnet_x
from oracle import build_neuron_dag, oracle_objective
from torch import nn

from pathcond_cli.analysis import analyse
from pathcond_cli.engine.diag import diag_g
from pathcond_cli.engine.groups import build_groups
from pathcond_cli.engine.model import LoadedModel
from pathcond_cli.module_route import module_model
from pathcond_cli.rescaling import rescale
from pathcond_cli.solve.objective import Objective, support
from pathcond_cli.solve.solvers import solve

IDENTITY = 1e-9  # relative, on F(u) − F(0) against D(θ_u) − D(θ)
SOLVERS = ["newton", "lbfgs", "block", "sequential"]
BOUNDED = ["newton", "block", "sequential"]


# -- networks with zeros in diag(G) ---------------------------------------------------------------


def _zero_weights(nets):
    """fc2 reads nothing from hidden unit 1 (a zero column), and one more weight is 0."""
    graph, params = nets.mlp(0, widths=(3, 5, 4, 2))
    params["fc3.weight"][:, 1] = 0.0
    params["fc1.weight"][2, 0] = 0.0
    return graph, params


def _dead_unit(nets):
    """Hidden unit 2 has no input and no bias: every path through it has weight 0."""
    graph, params = nets.mlp(1, widths=(3, 5, 4, 2))
    params["fc1.weight"][2] = 0.0
    params["fc1.bias"][2] = 0.0
    return graph, params


def _zero_gamma(nets):
    """The BatchNorm before the residual sum has γ = 0 on every channel (timm's init)."""
    graph, params = nets.cnn_bn_residual(2)
    params["bn8.weight"].zero_()
    return graph, params


def _gamma_before_head(nets):
    """γ = 0 on both channels of the second BatchNorm: the first conv's outputs reach the head
    only through zero weights (its bias, β, still carries paths)."""
    graph, params = nets.conv_bn(3)
    params["bn5.weight"].zero_()
    return graph, params


ZEROED = {
    "zero_weights": _zero_weights,
    "dead_unit": _dead_unit,
    "zero_gamma": _zero_gamma,
    "gamma_before_head": _gamma_before_head,
}
# small enough for path enumeration
TINY = ["zero_weights", "dead_unit", "gamma_before_head"]


def _model(graph, params) -> LoadedModel:
    return LoadedModel(graph, params, "module", "test-network", arch_source="module")


def _rescaled(groups, params, u: torch.Tensor) -> dict[str, torch.Tensor]:
    """The checkpoint tensors pathcond writes for ``u``, the others as they were."""
    return {**params, **groups.apply(params, u).copy()}


def _assert_identity(f_change: float, d_change: float, scale: float) -> None:
    assert d_change == pytest.approx(f_change, rel=IDENTITY, abs=IDENTITY * scale)


# -- the identity F(u) − F(0) = D(θ_u) − D(θ), by a fresh pass -----------------------------------


@pytest.mark.parametrize("name", list(ZEROED))
def test_objective_change_is_the_change_of_d_measured_by_a_fresh_pass(nets, name):
    graph, params = ZEROED[name](nets)
    model = _model(graph, params)
    result = rescale(model, device="cpu")
    analysis = result.analysis
    assert analysis.conditioning.zeros > 0, "the network must have g = 0 somewhere"
    objective = Objective(analysis.groups, analysis.diag)
    generator = torch.Generator().manual_seed(4)
    points = [result.solve.u, torch.randn(analysis.groups.num_free, generator=generator, dtype=torch.float64)]
    before = analysis.conditioning
    f_zero = objective.evaluate(torch.zeros(analysis.groups.num_free, dtype=torch.float64)).value
    for u in points:
        fresh = analyse(_model(graph, _rescaled(analysis.groups, params, u)), device="cpu").conditioning
        assert (fresh.counted, fresh.zeros) == (before.counted, before.zeros), "rescaling keeps the support"
        _assert_identity(objective.evaluate(u).value - f_zero, fresh.value - before.value, before.value)
    assert result.conditioning_after.value <= before.value


def test_identity_on_a_regnet_with_timm_zeroed_gamma():
    """The issue's case in small: RegNetX blocks whose last BatchNorm has γ = 0, about half
    of diag(G) zero. D falls, by exactly F(0) − F* (in float64: float32 tensors would round θ_u,
    and g with it, at 1e-7)."""
    torch.manual_seed(0)
    module = _zero_last_gamma(small_regnet_x()).double()
    model = module_model(module, (3, 32, 32))
    result = rescale(model, device="cpu", verify=False)
    before = result.analysis.conditioning
    assert before.zeros > 0.4 * (before.zeros + before.counted)
    assert result.solve.converged and result.solve.degenerate
    fresh = analyse(LoadedModel(model.graph, result.rescaled_params, "module", "regnet"), device="cpu").conditioning
    _assert_identity(result.solve.objective[-1] - result.solve.objective[0], fresh.value - before.value, before.value)
    assert fresh.value < before.value


# -- brute force on tiny networks ----------------------------------------------------------------


def _brute_d(g: torch.Tensor) -> float:
    """D over g > 0, p the number of them, from brute-force g."""
    positive = g[g > 0].numpy()
    return positive.size * (np.log(positive.mean()) - np.log(positive).mean())


@pytest.mark.parametrize("name", TINY)
def test_support_objective_and_d_match_path_enumeration(nets, name):
    graph, params = ZEROED[name](nets)
    dag = build_neuron_dag(graph, params)
    groups = build_groups(graph, params)
    diag = diag_g(groups)
    g = dag.diag_G()
    assert (g == 0).any()
    ob = oracle_objective(dag, groups)  # F over the support: the rows of B with g = 0 dropped
    counts = support(groups, diag.parts)
    assert counts.size == ob.p == int((g > 0).sum())
    assert np.array_equal(counts.n_in.numpy(), (ob.B > 0).sum(0))
    assert np.array_equal(counts.n_out.numpy(), (ob.B < 0).sum(0))
    objective = Objective(groups, diag)
    generator = torch.Generator().manual_seed(5)
    for _ in range(3):
        u = torch.randn(groups.num_free, generator=generator, dtype=torch.float64)
        assert objective.evaluate(u).value == pytest.approx(ob.value(u.numpy()), rel=1e-12)
        # D of the rescaled tensors, path by path
        moved = build_neuron_dag(graph, _rescaled(groups, params, u)).diag_G()
        assert torch.equal(moved > 0, g > 0)
        _assert_identity(
            ob.value(u.numpy()) - ob.value(np.zeros(groups.num_free)), _brute_d(moved) - _brute_d(g), _brute_d(g)
        )


@pytest.mark.parametrize("method", SOLVERS)
@pytest.mark.parametrize("name", TINY)
def test_every_solver_reaches_the_brute_force_optimum_on_the_support(nets, name, method):
    graph, params = ZEROED[name](nets)
    dag = build_neuron_dag(graph, params)
    groups = build_groups(graph, params)
    diag = diag_g(groups)
    result = solve(groups, diag, solver=method, tol=1e-10, max_iter=20000)
    assert result.converged
    frozen = Objective(groups, diag).degenerate().numpy()
    assert frozen.any(), "a group without support in or out is degenerate"
    assert (result.u.numpy()[frozen] == 0).all()
    _, f_star = oracle_objective(dag, groups).minimise(free=~frozen)
    assert result.objective[-1] == pytest.approx(f_star, rel=1e-10, abs=1e-10)
    assert result.objective[-1] <= result.objective[0]


@pytest.mark.parametrize("method", BOUNDED)
@pytest.mark.parametrize("name", ["zero_gamma", "dead_unit"])
def test_bounded_solvers_lower_d_by_the_decrease_of_f(nets, name, method):
    graph, params = ZEROED[name](nets)
    groups = build_groups(graph, params)
    diag = diag_g(groups)
    result = solve(groups, diag, solver=method, tol=1e-9, max_iter=20000, max_log_scale=0.05)
    assert result.converged and result.u_inf <= 0.05
    before = analyse(_model(graph, params), device="cpu").conditioning
    after = analyse(_model(graph, _rescaled(groups, params, result.u)), device="cpu").conditioning
    _assert_identity(result.objective[-1] - result.objective[0], after.value - before.value, before.value)
    assert after.value <= before.value


def test_a_group_with_no_support_is_frozen_and_reported(nets):
    graph, params = _dead_unit(nets)
    result = rescale(_model(graph, params), device="cpu")
    labels = [result.analysis.groups.labels[h] for h in result.solve.degenerate]
    assert labels == ["fc1:2"]
    assert float(result.solve.u[result.solve.degenerate].abs().max()) == 0.0


# -- D after ≤ D before on every family -----------------------------------------------------------


def _zero_last_gamma(module: nn.Module) -> nn.Module:
    """γ = 0 on the last BatchNorm of each block (a module holding several BatchNorms
    directly), as timm and torchvision's zero_init_residual do. A network without such blocks
    gets γ = 0 on every channel of its second BatchNorm instead, and one without BatchNorm a
    dead unit (the first half of its second convolution's outputs: weights and bias 0), so
    that every family is checked with zeros in diag(G)."""
    norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    blocks = [
        [child for child in block.children() if isinstance(child, nn.modules.batchnorm._BatchNorm)]
        for block in module.modules()
    ]
    last = [block[-1] for block in blocks if len(block) >= 2] or norms[1:2]
    for norm in last:
        nn.init.zeros_(norm.weight)
    if not last:
        conv = [m for m in module.modules() if isinstance(m, nn.modules.conv._ConvNd)][1]
        with torch.no_grad():
            conv.weight[: conv.out_channels // 2] = 0.0
            if conv.bias is not None:
                conv.bias[: conv.out_channels // 2] = 0.0
    return module


# googlenet_64 is googlenet_32's network at a larger input, and four times its time (90 s)
_FAMILY_PARAMS = [pytest.param(name, marks=pytest.mark.slow) if name == "googlenet_64" else name for name in FAMILIES]


@pytest.mark.parametrize("zeroed", [False, True], ids=["as_built", "zeroed_gamma"])
@pytest.mark.parametrize("family", _FAMILY_PARAMS)
def test_d_never_rises_on_a_family(family, zeroed):
    torch.manual_seed(0)
    module = FAMILIES[family].small()
    if zeroed:
        module = _zero_last_gamma(copy.deepcopy(module))
    result = rescale(module_model(module, FAMILIES[family].small_shape), device="cpu", verify=False)
    before, after = result.analysis.conditioning, result.conditioning_after
    if zeroed:
        assert before.zeros > 0
    assert result.solve.converged
    assert after.value <= before.value * (1 + 1e-12)
    _assert_identity(result.solve.objective[-1] - result.solve.objective[0], after.value - before.value, before.value)


# -- the report: the share of zeros and their cause by layer ------------------------------------


def _zeros_report(graph, params) -> dict:
    from pathcond_cli.report.render import analysis_report

    return analysis_report(analyse(_model(graph, params), device="cpu"))["diag_g_zeros"]


def test_report_names_the_batchnorm_whose_gamma_is_zero(nets):
    graph, params = _zero_gamma(nets)
    zeros = _zeros_report(graph, params)
    analysis = analyse(_model(graph, params), device="cpu")
    assert zeros["share"] == pytest.approx(analysis.conditioning.zeros / analysis.groups.p, rel=1e-15)
    # conv4's weights and bias, and conv1's bias... feed the sum only through bn8's zero rows
    by_layer = {row["layer"]: row for row in zeros["per_layer"]}
    assert set(by_layer) == {"conv4"}
    row = by_layer["conv4"]
    assert row["zeros"] == row["parameters"] == row["batchnorm_gamma"] and row["share"] == 1.0
    assert (row["unused_taps"], row["zero_weights"], row["batchnorm"]) == (0, 0, "bn8")
    assert row["cause"] == "γ = 0 on all 3 channels of BatchNorm bn8"


def test_report_counts_zero_weights_and_unused_taps_apart(nets):
    graph, params = _dead_unit(nets)
    rows = _zeros_report(graph, params)["per_layer"]
    assert [(row["layer"], row["zeros"], row["zero_weights"], row["batchnorm"]) for row in rows] == [
        ("fc3", 4, 4, None)
    ]
    assert rows[0]["cause"].startswith("zero weights or dead units")
    # a 3×3 conv on a 1×1 input: 8 taps of each output channel see only padding
    b = nets.builder((1, 1, 1), 0)
    b.conv(2, 3, padding=1)
    b.relu()
    b.flatten()
    b.linear(2)
    rows = _zeros_report(*b.build())["per_layer"]
    assert [(row["layer"], row["zeros"], row["unused_taps"]) for row in rows] == [("conv1", 16, 16)]
    assert rows[0]["cause"].startswith("conv taps on no path")


def test_report_splits_a_layer_between_gamma_and_zero_weights(nets):
    """γ = 0 on one channel of a BatchNorm downstream, and a zero column upstream of another."""
    graph, params = nets.conv_bn(3)
    params["bn5.weight"][0] = 0.0  # conv4's channel 0 carries nothing but its bias
    params["conv4.weight"][1, 2] = 0.0  # conv4's channel 1 reads nothing from channel 2
    dag = build_neuron_dag(graph, params)
    g = dag.diag_G()
    rows = _zeros_report(graph, params)["per_layer"]
    assert sum(row["zeros"] for row in rows) == int((g == 0).sum()) > 0
    for row in rows:
        assert row["unused_taps"] + row["batchnorm_gamma"] + row["zero_weights"] == row["zeros"]
