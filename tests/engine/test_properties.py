"""Property-based tests (hypothesis) on random small ReLU DAGs and random admissible rescalings.

Strategies draw *recipes* (plain data); the network is built from a recipe with the session
fixture ``nets.builder`` so that shrinking stays meaningful.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from oracle import build_neuron_dag, rel_err, to_theta_order, torch_forward

from pathcond_cli.engine.diag import diag_g, path_count
from pathcond_cli.engine.graph import BatchNorm
from pathcond_cli.engine.groups import build_groups
from pathcond_cli.solve.solvers import solve

SETTINGS = dict(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


@st.composite
def mlp_recipes(draw):
    depth = draw(st.integers(1, 4))
    return {
        "kind": "mlp",
        "seed": draw(st.integers(0, 2**16)),
        "d_in": draw(st.integers(1, 3)),
        "widths": [draw(st.integers(1, 3)) for _ in range(depth)],
        "skips": [draw(st.booleans()) for _ in range(depth)],
        "biases": [draw(st.booleans()) for _ in range(depth + 1)],
        "leaky": draw(st.booleans()),
        "d_out": draw(st.integers(1, 2)),
        "transposed": draw(st.booleans()),
    }


@st.composite
def conv_recipes(draw):
    one_d = draw(st.booleans())
    size = draw(st.integers(3, 5))
    shape = (draw(st.integers(1, 2)), size) if one_d else (draw(st.integers(1, 2)), size, draw(st.integers(3, 4)))
    layers = []
    spatial = min(shape[1:])
    for _ in range(draw(st.integers(1, 2))):
        k = draw(st.integers(1, min(3, spatial)))
        pad = draw(st.integers(0, k // 2))
        stride = draw(st.integers(1, 2))
        layers.append(
            {
                "out": draw(st.integers(1, 3)),
                "k": k,
                "pad": pad,
                "stride": stride,
                "bias": draw(st.booleans()),
                "bn": draw(st.booleans()),
            }
        )
        spatial = (spatial + 2 * pad - k) // stride + 1
    pool = draw(st.sampled_from(["none", "max", "avg", "avg_nopad", "adaptive"])) if spatial >= 2 else "none"
    return {
        "kind": "conv",
        "seed": draw(st.integers(0, 2**16)),
        "shape": shape,
        "layers": layers,
        "pool": pool,
        "skip": draw(st.booleans()),
        "d_out": draw(st.integers(1, 2)),
    }


def build(nets, recipe):
    b = nets.builder(recipe["shape"] if recipe["kind"] == "conv" else (recipe["d_in"],), recipe["seed"])
    if recipe["kind"] == "mlp":
        prev = None
        for i, w in enumerate(recipe["widths"]):
            h = b.linear(w, bias=recipe["biases"][i], transposed=recipe["transposed"] and i == 0)
            if recipe["skips"][i] and prev is not None and prev[1] == w:
                h = b.add(prev[0], h)
            act = b.leaky(0.1) if recipe["leaky"] and i % 2 else b.relu()
            prev = (act, w)
        b.linear(recipe["d_out"], bias=recipe["biases"][-1])
        return b.build()
    for i, layer in enumerate(recipe["layers"]):
        before = b.cur
        b.conv(layer["out"], layer["k"], stride=layer["stride"], padding=layer["pad"], bias=layer["bias"])
        if layer["bn"]:
            b.bn()
        if recipe["skip"] and i > 0 and b.shape() == b.shape(before):
            b.add(before, b.cur)
        b.relu()
    pool = recipe["pool"]
    if pool == "max":
        b.maxpool(2, stride=1)
    elif pool == "avg":
        b.avgpool(2, stride=1, padding=1)
    elif pool == "avg_nopad":
        b.avgpool(2, stride=2, padding=1, ceil_mode=True, count_include_pad=False)
    elif pool == "adaptive":
        b.adaptive(1)
    b.flatten()
    b.linear(recipe["d_out"])
    return b.build()


recipes = st.one_of(mlp_recipes(), conv_recipes())


def _random_u(groups, seed, scale):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(groups.num_free, generator=g, dtype=torch.float64) * scale


def _out_err(graph, a, b, train=False):
    x = torch.randn((8, *graph.inputs[0].shape), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ya, yb = torch_forward(graph, a, x, train=train), torch_forward(graph, b, x, train=train)
    return max(rel_err(ya[o], yb[o]) for o in graph.outputs)


@settings(**SETTINGS)
@given(recipe=recipes, u_seed=st.integers(0, 1000), scale=st.floats(0.0, 4.0))
def test_apply_preserves_function(nets, recipe, u_seed, scale):
    graph, params = build(nets, recipe)
    groups = build_groups(graph, params)
    u = _random_u(groups, u_seed, scale)
    moved = {**params, **groups.apply(params, u)}
    has_bn = any(isinstance(n, BatchNorm) for n in graph.nodes)
    for train in (False, True) if has_bn else (False,):
        assert _out_err(graph, params, moved, train) <= 1e-10


def _pathcond(graph, params):
    groups = build_groups(graph, params)
    res = solve(groups, diag_g(groups), solver="block", tol=1e-11, max_iter=20000)
    assert res.converged, res.kkt_residual
    assert res.degenerate == []
    return {**params, **groups.apply(params, res.u)}, groups, res


@settings(**SETTINGS)
@given(recipe=recipes, u_seed=st.integers(0, 1000), scale=st.floats(0.1, 3.0))
def test_canonical_representative(nets, recipe, u_seed, scale):
    graph, params = build(nets, recipe)
    reference, groups, res = _pathcond(graph, params)
    assert all(torch.isfinite(t).all() for t in reference.values())
    assert _out_err(graph, params, reference) <= 1e-10
    moved = {**params, **groups.apply(params, _random_u(groups, u_seed, scale))}
    again, _, _ = _pathcond(graph, moved)
    for key in reference:
        x, y = reference[key], again[key]
        assert ((x - y).abs() <= 1e-6 * x.abs() + 1e-12 * x.abs().max()).all(), key


@settings(**SETTINGS)
@given(recipe=recipes)
def test_diag_g_and_path_count_match_oracle(nets, recipe):
    graph, params = build(nets, recipe)
    dag = build_neuron_dag(graph, params)
    n = dag.path_count_dp()
    groups = build_groups(graph, params)
    count = path_count(groups)
    assert count.exact == n
    assert math.isclose(count.log10, math.log10(n), abs_tol=1e-12)
    assume(n <= 1500)  # explicit enumeration only on the tiniest networks
    assert dag.path_count() == n
    assert dag.forward_check(params) < 1e-12
    g_engine = to_theta_order(dag, groups, [lg.exp() for lg in diag_g(groups).log_g])
    g_oracle = dag.diag_G()
    assert (g_oracle > 0).all()
    assert float(((g_engine - g_oracle).abs() / g_oracle).max()) <= 1e-10


@settings(**SETTINGS)
@given(recipe=mlp_recipes(), u_seed=st.integers(0, 1000), scale=st.floats(0.5, 3.0))
def test_g_transforms_covariantly(nets, recipe, u_seed, scale):
    """g(Dθ) = g(θ)·exp(−2 B u_D) for the engine's diag, with B from the oracle."""
    graph, params = build(nets, recipe)
    dag = build_neuron_dag(graph, params)
    groups = build_groups(graph, params)
    B = dag.dense_B(groups)
    u = _random_u(groups, u_seed, scale)
    moved = {**params, **groups.apply(params, u)}
    groups_d = build_groups(graph, moved)
    log_g = to_theta_order(dag, groups, diag_g(groups).log_g).numpy()
    log_g_d = to_theta_order(build_neuron_dag(graph, moved), groups_d, diag_g(groups_d).log_g).numpy()
    assert np.allclose(log_g_d, log_g - 2 * B @ u.numpy(), rtol=0, atol=1e-9)
