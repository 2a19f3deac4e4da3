"""Canonical representative and function preservation (SPEC §4 facts, §2 write-back)."""

from __future__ import annotations

import pytest
import torch
from oracle import build_neuron_dag, rel_err, torch_forward

from pathcond_cli.analysis import analyse, check_path_norms
from pathcond_cli.engine.diag import diag_g, path_norms
from pathcond_cli.engine.evaluate import forward
from pathcond_cli.engine.graph import BatchNorm
from pathcond_cli.engine.groups import build_groups, groups_with_values
from pathcond_cli.engine.model import LoadedModel
from pathcond_cli.errors import VerificationError
from pathcond_cli.solve.solvers import solve

ARCHS = [
    "mlp",
    "mlp_nobias_transposed",
    "cnn_bn_residual",
    "conv_bn",
    "residual",
    "concat",
    "bottleneck",
    "grouped_conv",
    "conv1d",
    "self_loop",
]


def _net(nets, arch, seed=0, dtype=torch.float64):
    if arch == "cnn_bn_residual":
        return nets.cnn_bn_residual(seed, dtype)
    return nets.catalogue[arch](seed, dtype)


# L-BFGS's Armijo test compares F values (~1e3) and cannot resolve a KKT residual much below
# 1e-10 (it then stalls until max_iter, see the report), so it gets a slightly looser tolerance.
TOLERANCE = {"block": 1e-11, "lbfgs": 1e-9, "sequential": 1e-11}


def pathcond(graph, params, method="block"):
    groups = build_groups(graph, params)
    res = solve(groups, diag_g(groups), solver=method, tol=TOLERANCE[method], max_iter=20000)
    assert res.converged, res.kkt_residual
    changed = groups.apply(params, res.u)
    return {**params, **changed}, res, groups


def random_u(groups, seed, scale=1.5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(groups.num_free, generator=g, dtype=torch.float64) * scale


def _inputs(graph, seed=0, batch=16):
    shape = graph.inputs[0].shape
    return torch.randn((batch, *shape), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def max_output_error(graph, a, b, *, train=False, seed=0) -> float:
    x = _inputs(graph, seed)
    with torch.no_grad():
        ya, yb = torch_forward(graph, a, x, train=train), torch_forward(graph, b, x, train=train)
    return max(rel_err(ya[o], yb[o]) for o in graph.outputs)


def _has_bn(graph):
    return any(isinstance(n, BatchNorm) for n in graph.nodes)


def assert_same_tensors(a, b, rtol):
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key].to(torch.float64), b[key].to(torch.float64)
        bound = rtol * x.abs() + 1e-12 * x.abs().max()
        assert ((x - y).abs() <= bound).all(), (
            f"{key}: max rel diff {float(((x - y).abs() / x.abs().clamp_min(1e-300)).max()):.3e}"
        )


@pytest.mark.parametrize("arch", ARCHS)
def test_apply_is_theta_times_exp_Bu(nets, arch):
    """groups.apply on the checkpoint, re-folded by the oracle, equals θ·exp(B u) with the oracle's B;
    untouched tensors are bit-identical, dtypes kept; g transforms as g(Dθ) = g(θ)·exp(−2Bu)."""
    graph, params = _net(nets, arch)
    dag = build_neuron_dag(graph, params)
    groups = build_groups(graph, params)
    B = dag.dense_B(groups)
    u = random_u(groups, 1)
    changed = groups.apply(params, u)
    for key, t in changed.items():
        assert t.dtype == params[key].dtype and t.shape == params[key].shape
    moved = {**params, **changed}
    dag_d = build_neuron_dag(graph, moved)
    expected = dag.theta * torch.exp(torch.from_numpy(B @ u.numpy()))
    assert torch.allclose(dag_d.theta, expected, rtol=1e-12, atol=0)
    if dag.path_count_dp() > 5000:  # too many paths to enumerate (cnn_bn_residual)
        return
    g, g_d = dag.diag_G(), dag_d.diag_G()
    assert torch.allclose(g_d, g * torch.exp(-2 * torch.from_numpy(B @ u.numpy())), rtol=1e-10, atol=0)
    # rescaling a checkpoint never touches BatchNorm running statistics
    for n in graph.nodes:
        if isinstance(n, BatchNorm):
            assert n.running_mean not in changed and n.running_var not in changed


@pytest.mark.parametrize("method", ["block", "lbfgs"])
@pytest.mark.parametrize("arch", ARCHS)
def test_canonical_representative(nets, arch, method):
    """PathCond(Dθ) == PathCond(θ) as checkpoint tensors, for random admissible D."""
    graph, params = _net(nets, arch)
    reference, res, groups = pathcond(graph, params, method)
    for seed in (11, 12):
        u_d = random_u(groups, seed)
        moved = {**params, **groups.apply(params, u_d)}
        assert max_output_error(graph, params, moved) <= 1e-10
        again, res_d, _ = pathcond(graph, moved, method)
        assert_same_tensors(reference, again, rtol=1e-6)
        # the optimal u from Dθ is u* − u_D
        assert torch.allclose(res_d.u, res.u - u_d, atol=1e-6)


@pytest.mark.parametrize("arch", ARCHS)
def test_rescaled_network_computes_the_same_function_float64(nets, arch):
    graph, params = _net(nets, arch)
    rescaled, res, _ = pathcond(graph, params)
    assert res.u.abs().max() > 1e-3, "the test is vacuous if nothing moves"
    modes = (False, True) if _has_bn(graph) else (False,)
    for train in modes:
        for seed in range(2):
            assert max_output_error(graph, params, rescaled, train=train, seed=seed) <= 1e-10
    # and through the engine's own evaluator too (it is what `verify` uses)
    x = _inputs(graph, 5)
    for train in modes:
        before, after = forward(graph, params, x, train=train), forward(graph, rescaled, x, train=train)
        for o in graph.outputs:
            assert rel_err(before[o], after[o]) <= 1e-10


@pytest.mark.parametrize("arch", ARCHS)
def test_rescaled_network_computes_the_same_function_float32(nets, arch):
    graph, params = _net(nets, arch, dtype=torch.float32)
    rescaled, res, _ = pathcond(graph, params)
    for key, t in rescaled.items():
        assert t.dtype == torch.float32, key
        assert torch.isfinite(t).all()
    modes = (False, True) if _has_bn(graph) else (False,)
    for train in modes:
        # float64 evaluation of the float32 tensors: only the float32 rounding of the write remains
        assert max_output_error(graph, params, rescaled, train=train) <= 1e-5


@pytest.mark.parametrize("arch", ["cnn_bn_residual", "conv_bn"])
def test_batchnorm_train_mode_with_large_rescaling(nets, arch):
    """γ, β carry the channel scale; the conv before BN only its input side: exact in train mode
    even for scales of e^{±6}."""
    graph, params = _net(nets, arch, seed=3)
    groups = build_groups(graph, params)
    u = random_u(groups, 4, scale=6.0)
    moved = {**params, **groups.apply(params, u)}
    for train in (False, True):
        assert max_output_error(graph, params, moved, train=train) <= 1e-10


@pytest.mark.parametrize("arch", ARCHS)
def test_groups_with_values_are_the_groups_built_anew(nets, arch):
    """A rescaled copy's groups taken from the original's structure (as the written file's path
    norms are checked) are, map for map and value for value, the groups built from the copy,
    and give the same path norms bit for bit."""
    graph, params = _net(nets, arch)
    groups = build_groups(graph, params)
    rescaled = {**params, **groups.apply(params, random_u(groups, seed=3))}
    reused, fresh = groups_with_values(groups, graph, rescaled), build_groups(graph, rescaled)
    assert (reused.num_free, reused.num_fixed, reused.labels) == (fresh.num_free, fresh.num_fixed, fresh.labels)
    assert torch.equal(reused.colours, fresh.colours) and reused.shapes == fresh.shapes
    assert reused.node_groups.keys() == fresh.node_groups.keys()
    assert all(torch.equal(reused.node_groups[name], fresh.node_groups[name]) for name in fresh.node_groups)
    for ours, theirs in zip(reused.dag_params, fresh.dag_params, strict=True):
        assert _fields(ours, "name", "layer", "view", "is_bias") == _fields(theirs, "name", "layer", "view", "is_bias")
        assert torch.equal(ours.dst, theirs.dst) and torch.equal(ours.src, theirs.src)
        assert (ours.self_loops is None) == (theirs.self_loops is None)
        assert ours.self_loops is None or torch.equal(ours.self_loops, theirs.self_loops)
        assert torch.equal(ours.value, theirs.value)
    for ours, theirs in zip(reused.writebacks, fresh.writebacks, strict=True):
        layout = ("key", "layout", "out_channels", "groups")
        assert _fields(ours, *layout) == _fields(theirs, *layout)
    assert path_norms(reused, [1.0, 2.0]) == path_norms(fresh, [1.0, 2.0])


def _fields(thing, *names: str) -> tuple:
    return tuple(getattr(thing, name) for name in names)


def test_groups_with_values_of_another_graph_are_built_anew(nets):
    graph, params = _net(nets, "mlp")
    other_graph, other_params = _net(nets, "concat")
    regrouped = groups_with_values(build_groups(graph, params), other_graph, other_params)
    fresh = build_groups(other_graph, other_params)
    assert regrouped.graph is other_graph
    assert [dp.name for dp in regrouped.dag_params] == [dp.name for dp in fresh.dag_params]
    assert regrouped.num_free == fresh.num_free


@pytest.mark.parametrize("arch", ["conv_bn", "residual"])
def test_a_copy_that_is_not_a_rescaling_fails_the_path_norm_check(nets, arch):
    """The check reads the copy's values on the original's groups: one weight scaled by 1.5 is
    not a rescaling, and every path through it says so."""
    graph, params = _net(nets, arch)
    analysis = analyse(LoadedModel(graph, params, "safetensors", arch), device="cpu")
    weight = next(node.weight for node in graph.nodes if getattr(node, "weight", None))
    assert check_path_norms(analysis, graph, dict(params), "copy").keys() == analysis.path_norms.keys()
    with pytest.raises(VerificationError, match="path norm"):
        check_path_norms(analysis, graph, {**params, weight: params[weight] * 1.5}, "copy")
