"""What a sweep over the ReLU DAG holds: each activation is let go after its last read.

Holding every activation of a forward pass (float64, batch 2 at 224² for the verification)
made the run fault in fresh pages for each one; a sweep now holds only what a later node reads.
Checked against the definition (a value is needed while a node not yet handled reads it, and
an output always), and on the passes that use the sweep.
"""

from __future__ import annotations

import weakref

import pytest
import torch

import pathcond_cli.engine.evaluate as evaluate_module
from pathcond_cli.engine import diag as diag_module
from pathcond_cli.engine.groups import build_groups

ARCHS = ["mlp", "conv_residual", "concat", "bottleneck", "conv_bn", "self_loop"]


def _needed(graph, remaining, computed) -> set[str]:
    """The computed values a sweep still needs: the outputs, and what a node not yet handled reads."""
    read_later = {name for node in remaining for name in node.inputs}
    return {name for name in computed if name in graph.outputs or name in read_later}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("backward", [False, True])
def test_a_sweep_holds_exactly_what_is_read_later(nets, arch, backward):
    """Stopped after each node in turn, the sweep holds the values the rest of it reads."""
    graph, _ = nets.catalogue[arch]()
    order = graph.nodes[::-1] if backward else graph.nodes
    for stop in range(1, len(order) + 1):
        # A backward sweep starts with every forward value; a forward one adds each as computed.
        held = {node.name: None for node in graph.nodes} if backward else {}
        computed = set(held)
        handled = []
        for node in graph.sweep(held, backward=backward):
            if len(handled) == stop:
                break
            handled.append(node)
            if not backward:
                held[node.name] = None
                computed.add(node.name)
        else:
            assert set(held) == set(graph.outputs)
        assert handled == order[:stop]
        assert set(held) == _needed(graph, order[stop:], computed)


def test_a_forward_pass_holds_a_few_activations_not_all(nets):
    """A chain of 12 Linear+ReLU layers: when each node runs, at most its input is alive of
    the activations computed before it (all 23 were, before)."""
    graph, params = nets.mlp(widths=(5,) * 13)
    alive: list[weakref.ref] = []
    most = 0
    rule_for = evaluate_module.rule_for

    class Recording:
        def __init__(self, rule):
            self.rule = rule

        def forward(self, node, xs, param, train):
            nonlocal most
            most = max(most, sum(ref() is not None for ref in alive))
            y = self.rule.forward(node, xs, param, train)
            alive.append(weakref.ref(y))
            return y

    evaluate_module.rule_for = lambda node: Recording(rule_for(node))
    try:
        outputs = evaluate_module.forward(graph, params, torch.randn(2, 5, dtype=torch.float64))
    finally:
        evaluate_module.rule_for = rule_for
    assert len(alive) == 23
    assert most == 1
    assert [ref() is not None for ref in alive].count(True) == len(outputs) == 1


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_only_passes_keep_the_outputs_and_the_backward_consumes_the_forward(nets, arch):
    graph, params = nets.catalogue[arch]()
    groups = build_groups(graph, params)
    u_ext = groups.extend(diag_module.balancing_exponents(groups))
    layers = diag_module.PowerLayerValues(groups, u_ext, "cpu", [1.0, 2.0])
    kept = diag_module.squared_networks(graph, layers, powers=[1.0, 2.0])
    totals = diag_module.squared_networks(
        graph, diag_module.PowerLayerValues(groups, u_ext, "cpu", [1.0, 2.0]), powers=[1.0, 2.0], totals_only=True
    )
    for whole, only in zip(kept, totals):
        assert set(whole.values) == {node.name for node in graph.nodes}
        assert set(only.values) == set(graph.outputs)
        assert only.total(graph) == whole.total(graph)

    psi = diag_module.LayerValues(groups, lambda dp: diag_module.balanced_power(dp, u_ext, "cpu", 2))
    forward = diag_module.squared_network(graph, psi, power=2)
    total = forward.total(graph)
    gradients = diag_module.log_gradients(graph, psi, forward, power=2)
    assert set(forward.values) == set(graph.outputs)
    assert forward.total(graph) == total
    assert set(gradients) == {dp.layer for dp in groups.dag_params}
