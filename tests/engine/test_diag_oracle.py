"""diag(G) and the path count (SPEC §3) against brute-force path enumeration.

The oracle (tests/oracle.py) builds the explicit neuron-level DAG by index arithmetic, checks
it against a plain torch forward, enumerates every path with networkx, differentiates the
path-lifting Φ(θ) with autograd and takes diag(JᵀJ). Nothing of pathcond's diag code is used.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from oracle import build_neuron_dag, engine_blocks, to_theta_order

from pathcond_cli.engine.diag import diag_g, path_count
from pathcond_cli.engine.groups import build_groups

ARCHS = [
    "mlp",
    "mlp_nobias_transposed",
    "mlp_leaky",
    "conv_maxpool",
    "conv_maxpool_strided",
    "residual",
    "conv_residual",
    "avgpool",
    "avgpool_nopad",
    "avgpool_ceil",
    "avgpool_ceil_nopad",
    "concat",
    "conv_bn",
    "grouped_conv",
    "adaptive",
    "conv1d",
    "bottleneck",
    "mlp_bottleneck",
    "self_loop",
    "maxpool_dilated",
]


def _setup(nets, arch, seed):
    graph, params = nets.catalogue[arch](seed)
    dag = build_neuron_dag(graph, params)
    groups = build_groups(graph, params)
    return graph, params, dag, groups


@pytest.mark.parametrize("arch", ARCHS)
def test_oracle_neuron_dag_is_the_network(nets, arch):
    """Self-check of the oracle: the neuron DAG (index arithmetic, folded BN, avg divisors)
    computes what torch computes, and enumeration agrees with a DP path count."""
    graph, params, dag, _ = _setup(nets, arch, 0)
    for seed in range(3):
        assert dag.forward_check(params, seed=seed) < 1e-12
    assert dag.path_count() == dag.path_count_dp()
    assert 0 < dag.path_count() <= 5000


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("arch", ARCHS)
def test_diag_g_equals_diag_JtJ(nets, arch, seed):
    graph, params, dag, groups = _setup(nets, arch, seed)
    diag = diag_g(groups)
    assert len(diag.log_g) == len(groups.dag_params)
    for dp, lg in zip(groups.dag_params, diag.log_g):
        assert lg.shape == dp.value.shape, dp.name
        assert not torch.isnan(lg).any() and not torch.isposinf(lg).any(), dp.name
    engine_blocks(dag, groups)  # canonical layout + BN folding of DagParam.value == oracle θ
    g_engine = to_theta_order(dag, groups, [lg.exp() for lg in diag.log_g])
    g_oracle = dag.diag_G()
    assert groups.p == dag.p
    positive = g_oracle > 0
    assert positive.all(), "random weights: every g_i should be > 0"
    rel = ((g_engine - g_oracle).abs() / g_oracle).max().item()
    assert rel <= 1e-10, f"max relative error of g: {rel:.3e}"


@pytest.mark.parametrize("arch", ARCHS)
def test_path_count(nets, arch):
    graph, params, dag, groups = _setup(nets, arch, 0)
    count = path_count(groups)
    n = dag.path_count()
    assert count.exact == n
    assert count.log10 == pytest.approx(math.log10(n), abs=1e-12)


@pytest.mark.parametrize("arch", ["mlp", "conv_bn", "mlp_leaky", "grouped_conv"])
def test_zero_g_entries_are_minus_inf(nets, arch):
    """Zero weights make some g_i exactly 0: log g must be −inf there, finite elsewhere, never NaN."""
    graph, params = nets.catalogue[arch](3)
    # kill every outgoing weight of channel 0 of the first layer (rows of the next layer's input)
    layers = [n for n in graph.nodes if n.op in ("linear", "conv")]
    second = layers[1]
    w = params[second.weight].clone()
    if second.op == "linear" and second.weight_transposed:
        w[0, :] = 0
    else:
        w[:, 0] = 0
    params = {**params, second.weight: w}
    dag = build_neuron_dag(graph, params)
    groups = build_groups(graph, params)
    diag = diag_g(groups)
    log_engine = to_theta_order(dag, groups, diag.log_g)
    g_oracle = dag.diag_G()
    zero = g_oracle == 0
    assert zero.any()
    assert torch.isneginf(log_engine[zero]).all()
    assert torch.isfinite(log_engine[~zero]).all()
    rel = ((log_engine[~zero].exp() - g_oracle[~zero]).abs() / g_oracle[~zero]).max().item()
    assert rel <= 1e-10


def test_path_count_beyond_exact_limit(nets):
    """A wide deep MLP: N = Π widths ≫ 2**53. log10 must still be right; exact only if it fits."""
    widths = (64,) * 12
    graph, params = nets.mlp(0, widths=widths, bias=False)
    groups = build_groups(graph, params)
    count = path_count(groups)
    expected = sum(math.log10(w) for w in widths)
    assert count.log10 == pytest.approx(expected, rel=1e-12)
    assert count.exact is None or count.exact == 64**12


# ----------------------------------------------------------------------------------------------
# Extreme weights: finite log g equal to an analytic / log-domain brute-force value
# ----------------------------------------------------------------------------------------------


def _scale_layers(graph, params, factors):
    layers = [n.name for n in graph.nodes if n.op in ("linear", "conv")]
    out = dict(params)
    for layer, f in zip(layers, factors):
        for key in list(out):
            if key.startswith(layer + "."):
                out[key] = out[key] * f
    return out


def _check_log_g(dag, groups, diag, expected: np.ndarray):
    log_engine = to_theta_order(dag, groups, diag.log_g).numpy()
    assert not np.isnan(log_engine).any(), "NaN in log diag(G)"
    assert np.isfinite(log_engine).all(), f"non-finite log g: {log_engine[~np.isfinite(log_engine)][:5]}"
    err = np.abs(log_engine - expected).max()
    assert err <= 1e-9 * max(1.0, np.abs(expected).max()), f"max |Δ log g| = {err:.3e}"


def test_deep_mlp_huge_uniform_weights_closed_form(nets):
    """10 layers, every weight 1e40, no bias. For the weight of layer l (1-based):
    g = (1e40)^{2(L−1)} · Π_{j ∉ {l−1, l}} n_j   (paths through one edge), i.e. ≈ 1e720 ≫ float64."""
    widths = (2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2)
    L = len(widths) - 1
    graph, params = nets.mlp(0, widths=widths, bias=False)
    params = {k: torch.full_like(v, 1e40) for k, v in params.items()}
    groups = build_groups(graph, params)
    diag = diag_g(groups)
    for layer, (dp, lg) in enumerate(zip(groups.dag_params, diag.log_g), start=1):
        expected = 2 * (L - 1) * math.log(1e40) + sum(
            math.log(n) for j, n in enumerate(widths) if j not in (layer - 1, layer)
        )
        assert torch.isfinite(lg).all(), (
            f"layer {layer} ({dp.name}): log g = {lg.flatten()[:3].tolist()} (expected {expected:.6f})"
        )
        assert torch.allclose(lg, torch.full_like(lg, expected), rtol=1e-12, atol=1e-9), (
            layer,
            lg.flatten()[:3],
            expected,
        )


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    "factors",
    [
        (1e150, 1e-150, 1.0),
        (1e-150, 1e150, 1e-100),
        (1e150, 1e150, 1e-300),
        (1e-200, 1e-200, 1e-200),
        (1e200, 1e200, 1e200),
    ],
    ids=["1e150_1e-150", "1e-150_1e150_1e-100", "1e150_1e150_1e-300", "all_1e-200", "all_1e200"],
)
def test_extreme_layer_scales_match_log_domain_brute_force(nets, factors, bias):
    graph, params = nets.mlp(1, widths=(2, 3, 3, 2), bias=bias)
    params = _scale_layers(graph, params, factors)
    dag = build_neuron_dag(graph, params)
    groups = build_groups(graph, params)
    diag = diag_g(groups)
    _check_log_g(dag, groups, diag, dag.log_diag_G())


def test_deep_mlp_random_huge_weights_log_domain(nets):
    """10-layer width-2 MLP with random-sign weights of magnitude ~1e40 and biases."""
    graph, params = nets.mlp(2, widths=(2,) * 11, bias=True)
    params = {k: v * 1e40 for k, v in params.items()}
    dag = build_neuron_dag(graph, params)
    groups = build_groups(graph, params)
    diag = diag_g(groups)
    _check_log_g(dag, groups, diag, dag.log_diag_G())


def test_conv_extreme_scales(nets):
    graph, params = nets.conv_bn(0)
    layers = [n for n in graph.nodes if n.op in ("conv", "linear")]
    params = dict(params)
    params[layers[0].weight] = params[layers[0].weight] * 1e120
    params[layers[2].weight] = params[layers[2].weight] * 1e-120
    dag = build_neuron_dag(graph, params)
    groups = build_groups(graph, params)
    _check_log_g(dag, groups, diag_g(groups), dag.log_diag_G())
