"""The operations beyond Linear/Conv/pool/add/concat, against the brute-force oracle.

Each tiny network of ``conftest.NEW_OPS`` (PReLU, constant scaling, zero, reflect, replicate,
circular and −inf padding, a per-channel scale and shift, broadcasting sums, channel split and
shuffle, ConvTranspose 1-d/2-d/3-d, Conv3d and 3-d pooling, ceil-mode pooling in every
combination) is checked like the original operations: the oracle's neuron DAG equals
torch, diag(G) equals diag(JᵀJ) of the enumerated path-lifting, the path count is exact, and
rescaling by a random admissible u preserves the function.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import NEW_OPS
from oracle import build_neuron_dag, rel_err, to_theta_order, torch_forward

from pathcond_cli.engine.diag import diag_g, path_count
from pathcond_cli.engine.groups import build_groups

ARCHS = sorted(NEW_OPS)


@pytest.mark.parametrize("arch", ARCHS)
def test_oracle_is_the_network_and_engine_matches_it(nets, arch):
    graph, params = nets.catalogue[arch](0)
    dag = build_neuron_dag(graph, params)
    for seed in range(2):
        assert dag.forward_check(params, seed=seed) < 1e-12
    assert dag.path_count() == dag.path_count_dp()
    groups = build_groups(graph, params)
    dag.dense_B(groups)  # the engine's partition equals the oracle's (asserted inside)
    g_engine = to_theta_order(dag, groups, [lg.exp() for lg in diag_g(groups).log_g])
    g_oracle = dag.diag_G()
    assert groups.p == dag.p
    scale = g_oracle.abs().max()
    assert ((g_engine - g_oracle).abs() <= 1e-10 * torch.maximum(g_oracle, scale * 1e-12)).all()
    count = path_count(groups)
    assert count.exact == dag.path_count()
    assert count.log10 == pytest.approx(math.log10(dag.path_count()), abs=1e-12)


@pytest.mark.parametrize("arch", ARCHS)
def test_rescaling_preserves_the_function(nets, arch):
    graph, params = nets.catalogue[arch](1)
    groups = build_groups(graph, params)
    u = torch.randn(groups.num_free, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    rescaled = {**params, **groups.apply(params, u)}
    assert any(not torch.equal(params[k], rescaled[k]) for k in params) or groups.num_free == 0
    x = torch.randn((3, *graph.inputs[0].shape), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    before, after = torch_forward(graph, params, x), torch_forward(graph, rescaled, x)
    for name in graph.outputs:
        assert rel_err(before[name], after[name]) < 1e-12


def test_parameters_on_no_path_are_counted_per_layer(nets):
    """A 3×3 conv with padding 1 on a 1×1 input: only the centre tap ever sees the input, so
    the other 8 taps of each output channel lie on no path (counted per layer, as brute force says)."""
    from pathcond_cli.engine.diag import unused_parameters

    b = nets.builder((1, 1, 1), 0)
    b.conv(2, 3, padding=1)
    b.relu()
    b.flatten()
    b.linear(2)
    graph, params = b.build()
    dag = build_neuron_dag(graph, params)
    on_a_path = set(i for path, _ in dag.paths() for i in path)
    expected: dict[str, int] = {}
    for block in dag.blocks:
        missing = sum(1 for i in range(block.start, block.start + block.size) if i not in on_a_path)
        if missing:
            expected[block.layer] = expected.get(block.layer, 0) + missing
    assert expected == {"conv1": 2 * 8}
    assert unused_parameters(build_groups(graph, params)) == expected
