"""Non-homogeneous operations, listed by operation type in one line each.

A transformer has dozens of GELUs, softmaxes and LayerNorms; one line per node would bury the
message. Importers collect ``(operation, node)`` pairs and report each operation once with
its count and every node.
"""

from __future__ import annotations

# Lower-case names of layer types, modules and functions that are not positively homogeneous:
# fx reports them by name, and a spec that names one describes a network pathcond cannot rescale.
NOT_HOMOGENEOUS_TYPES = {
    "gelu", "silu", "sigmoid", "tanh", "softmax", "log_softmax", "layernorm", "layer_norm", "hardswish",
    "hardsigmoid", "relu6", "hardtanh", "elu", "selu", "celu", "mish", "softplus", "groupnorm", "group_norm",
    "instancenorm", "multiheadattention", "scaled_dot_product_attention", "matmul", "bmm", "exp", "clamp", "clip",
    "sqrt", "pow", "instance_norm", "instancenorm1d", "instancenorm2d", "instancenorm3d", "logsigmoid",
    "softsign", "tanhshrink", "rrelu", "glu", "swish",
}

NOT_HOMOGENEOUS = "not positively homogeneous, so no rescaling preserves the function (pathcond needs a ReLU network)"


def grouped(offenders: list[tuple[str, str]]) -> list[str]:
    """One problem line per operation type: ``Sigmoid ×12: node 'a', node 'b', … (why)``."""
    by_op: dict[str, list[str]] = {}
    for op, node in offenders:
        by_op.setdefault(op, []).append(node)
    return [
        f"{op} ×{len(nodes)}: {', '.join(f'node {node!r}' for node in nodes)}: {NOT_HOMOGENEOUS}"
        for op, nodes in by_op.items()
    ]
