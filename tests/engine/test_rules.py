"""The rule registry: every node type has exactly one rule, and a type without one is refused."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from pathcond_cli.engine import rules
from pathcond_cli.engine.diag import diag_g, path_count
from pathcond_cli.engine.evaluate import forward
from pathcond_cli.engine.graph import NODE_TYPES, Graph, Input, Linear, Node, ReLU, node_type
from pathcond_cli.engine.groups import build_groups
from pathcond_cli.errors import UnsupportedModelError


@dataclass(frozen=True)
class Mystery(Node):
    """A node type pathcond has never heard of (element-wise, so the rest of the graph is valid)."""

    op: ClassVar[str] = "mystery"


def _graph(middle: Node) -> tuple[Graph, dict[str, torch.Tensor]]:
    nodes = [
        Input("x", shape=(3,)),
        Linear("fc1", ("x",), weight="w1"),
        middle,
        Linear("fc2", (middle.name,), weight="w2"),
    ]
    params = {"w1": torch.randn(4, 3, dtype=torch.float64), "w2": torch.randn(2, 4, dtype=torch.float64)}
    return Graph(nodes, ("fc2",)), params


def test_every_node_type_has_a_rule():
    assert set(NODE_TYPES.values()) == set(rules.RULES)


def test_a_second_rule_for_a_node_type_is_refused_where_it_is_written():
    with pytest.raises(ValueError, match="ReLU has two rules, ReLURule and OtherReLURule"):

        @rules.rule_of(ReLU)
        class OtherReLURule(rules.HomogeneousActivation):
            pass

    assert type(rules.RULES[ReLU]) is rules.ReLURule


def test_a_second_node_type_of_one_op_is_refused_where_it_is_written():
    with pytest.raises(ValueError, match="node types ReLU and OtherReLU have one op, 'relu'"):

        @node_type
        @dataclass(frozen=True)
        class OtherReLU(Node):
            op: ClassVar[str] = "relu"

    assert NODE_TYPES["relu"] is ReLU


def test_graph_construction_refuses_a_node_type_it_does_not_know():
    with pytest.raises(
        UnsupportedModelError, match="node 'm' has type Mystery, which is not among pathcond's node types"
    ):
        _graph(Mystery("m", ("fc1",)))


def test_forward_groups_diag_and_path_count_refuse_a_node_type_without_a_rule(monkeypatch):
    """Even a graph that got past validation (here: a rule that disappears) never passes the
    unknown node through: every interpreter asks the registry."""
    monkeypatch.setitem(NODE_TYPES, Mystery.op, Mystery)
    monkeypatch.setitem(rules.RULES, Mystery, rules.RULES[ReLU])
    graph, params = _graph(Mystery("m", ("fc1",)))
    groups = build_groups(graph, params)
    monkeypatch.delitem(rules.RULES, Mystery)
    for run in (
        lambda: forward(graph, params, torch.ones(1, 3, dtype=torch.float64)),
        lambda: build_groups(graph, params),
        lambda: diag_g(groups),
        lambda: path_count(groups),
    ):
        with pytest.raises(UnsupportedModelError, match="Mystery"):
            run()


def test_a_subclass_does_not_inherit_its_parents_rule():
    @dataclass(frozen=True)
    class MyReLU(ReLU):
        op: ClassVar[str] = "my_relu"

    with pytest.raises(UnsupportedModelError, match="MyReLU"):
        _graph(MyReLU("m", ("fc1",)))


def test_a_member_a_rule_lacks_is_named_not_silent():
    node = Input("x", shape=(3,))
    with pytest.raises(NotImplementedError, match="InputRule has no 'forward' \\(node 'x', input\\)"):
        rules.rule_for(node).forward(node, [], lambda key: None, False)


@pytest.mark.parametrize("transposed", [False, True], ids=["weight", "weight_t"])
@pytest.mark.parametrize("block", [1, 12, 10**9], ids=["one_row", "two_rows", "whole"])
def test_a_large_linear_weight_converted_by_blocks_computes_the_whole_product(nets, monkeypatch, transposed, block):
    """A float32 Linear weight evaluated in float64 a block of output rows at a time: the same
    outputs as F.linear with the whole float64 weight (biases and a transposed layout included),
    and no whole float64 copy of the weight is made."""
    graph, params = nets.mlp(0, torch.float32, widths=(5, 12, 4), transposed=transposed)
    monkeypatch.setattr(rules, "LINEAR_BLOCK_ELEMENTS", block)
    x = torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    converted = []
    original_to = torch.Tensor.to

    def recording_to(tensor, *args, **kwargs):
        result = original_to(tensor, *args, **kwargs)
        if result.dtype == torch.float64 and result.data_ptr() != tensor.data_ptr():
            converted.append(tensor.numel())
        return result

    monkeypatch.setattr(torch.Tensor, "to", recording_to)
    (output,) = forward(graph, params, x).values()
    monkeypatch.undo()
    expected = x
    for node in graph.nodes[1:]:
        if isinstance(node, Linear):
            weight = params[node.weight].double()
            expected = torch.nn.functional.linear(
                expected,
                weight.t() if node.weight_transposed else weight,
                params[node.bias].double() if node.bias else None,
            )
        else:
            expected = torch.relu(expected)
    assert torch.allclose(output, expected, rtol=1e-12, atol=1e-12)
    largest = max(params[n.weight].numel() for n in graph.nodes if isinstance(n, Linear))
    assert (max(converted) < largest) == (block < largest)
